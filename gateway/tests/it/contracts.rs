//! Data contracts on the real stack: a topic with a JSON Schema (`schema` in its model's
//! topics). Writes breaking it — single, or any record of a batch — are `400 value-invalid`
//! naming each JSON pointer and keyword (at most 10), and nothing reaches Kafka; tombstones
//! and topics without a schema pass; `/openapi.json` carries the schema. A record another
//! producer wrote around the gateway that breaks the schema is rejected by the projector by
//! name (`PROJECTION_REJECTED` naming the pointer) and an operator's `skip` clears it, or,
//! under `on_rejected = "dead-letter"`, it is dead-lettered and the task goes on. After
//! each, every partition of the model still serves read-your-writes.

use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use parsley::murmur2::partition_for_key;
use parsley::partitioner::Partitioner;
use parsley_projector::skip::{skip, SkipRequest};
use parsley_settings::config::{Config, OnRejected};
use parsley_testkit::ScratchDir;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::ClientConfig;
use serde_json::{json, Value};

use crate::support::*;

const PARTITIONS: u32 = 2;
const PROBLEM: &str = "https://parsley.dev/problems/";

/// The orders topic's contract.
const ORDER_SCHEMA: &str = r##"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["order", "amount"],
  "properties": {
    "order": {"type": "string", "minLength": 1},
    "amount": {"type": "number", "minimum": 0},
    "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}}
  },
  "$defs": {"tag": {"type": "string"}}
}"##;

/// A stack whose orders topic has [`ORDER_SCHEMA`] (payments has none), with the model's
/// `on_rejected` and a quick recheck of refused tasks; the projector running.
async fn stack(prefix: &str, on_rejected: OnRejected) -> (Stack, ScratchDir) {
    let dir = ScratchDir::new("contracts");
    let path = dir.join("order.schema.json");
    std::fs::write(&path, ORDER_SCHEMA).unwrap();
    let path = path.display().to_string();
    let mut s = Stack::with_config(prefix, PARTITIONS as i32, "read_wait_ms = 3000", |_, c: &mut Config| {
        let orders = c.models[0].topics[0].clone();
        c.models[0].topics[0] = orders.with_schema(&path).unwrap();
        c.models[0].on_rejected = on_rejected;
        c.projector.refused_recheck_ms = 200;
    })
    .await;
    s.start_projector().await;
    (s, dir)
}

/// A key starting with `base` that the murmur2 rule places on `partition`.
fn key_on(base: &str, partition: u32) -> String {
    (0..).map(|i| format!("{base}-{i}")).find(|k| partition_for_key(k.as_bytes(), PARTITIONS) == partition).unwrap()
}

#[track_caller]
fn value_invalid(r: &Reply) -> Vec<Value> {
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.json);
    assert_eq!(r.problem_type(), format!("{PROBLEM}value-invalid"), "{}", r.json);
    assert_eq!(r.content_type.as_deref(), Some("application/problem+json"));
    assert!(r.token.is_none(), "a refused write hands back no token");
    r.json["errors"].as_array().unwrap_or_else(|| panic!("errors: {}", r.json)).clone()
}

/// `(pointer, keyword)` of each error.
fn named(errors: &[Value]) -> Vec<(String, String)> {
    errors
        .iter()
        .map(|e| (e["pointer"].as_str().unwrap().to_string(), e["keyword"].as_str().unwrap().to_string()))
        .collect()
}

/// The log end of every partition of `topics`.
async fn log_ends(topics: &[&str]) -> Vec<i64> {
    let topics: Vec<String> = topics.iter().map(|t| t.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new().set("bootstrap.servers", bootstrap()).create().unwrap();
        let mut ends = Vec::new();
        for t in &topics {
            for p in 0..PARTITIONS as i32 {
                ends.push(consumer.fetch_watermarks(t, p, TIMEOUT).unwrap().1);
            }
        }
        ends
    })
    .await
    .unwrap()
}

/// Every partition still serves read-your-writes: a valid order on a fresh key of each
/// partition, then a read of it with the session the write returned (a 503 while a task
/// catches up, after a skip say, is waited out; never a stale read).
async fn serves_every_partition(s: &Stack, after: &str) {
    let value = |key: &str| json!({"order": format!("o-{key}"), "amount": 1, "after": after});
    every_partition_reads_its_writes(s, Partitioner::Murmur2, PARTITIONS, value).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_breaking_the_schema_are_refused_naming_pointers_and_nothing_is_produced() {
    let (s, _dir) = stack("contract-writes", OnRejected::Refuse).await;
    let (orders, payments) = (s.names.orders.clone(), s.names.payments.clone());
    let before = log_ends(&[&orders, &payments]).await;

    // The NOT NULL case: a null where a string must be.
    let r = s.write(&orders, "ada", json!({"order": null, "amount": 1}), None).await;
    let errors = value_invalid(&r);
    assert_eq!(named(&errors), [("/order".to_string(), "type".to_string())], "{}", r.json);
    assert_eq!(errors[0]["schema_path"], "/properties/order/type");
    assert!(errors[0]["message"].as_str().unwrap().contains("null"), "{}", r.json);
    assert!(errors[0].get("record").is_none());
    assert_eq!(r.json["topic"], json!(orders));
    assert!(r.json["detail"].as_str().unwrap().contains("\"/order\""), "{}", r.json);

    // Missing members, a value of the wrong type, a bound: each named.
    let r = s.write(&orders, "ada", json!({"amount": -2}), None).await;
    let mut found = named(&value_invalid(&r));
    found.sort();
    assert_eq!(found, [("", "required"), ("/amount", "minimum")].map(|(p, k)| (p.to_string(), k.to_string())));
    let r = s.write(&orders, "ada", json!([1, 2]), None).await;
    assert_eq!(named(&value_invalid(&r)), [(String::new(), "type".to_string())]);

    // Fifteen failing items (through a local $ref): ten are reported.
    let tags: Vec<i32> = (0..15).collect();
    let r = s.write(&orders, "ada", json!({"order": "o-1", "amount": 1, "tags": tags}), None).await;
    let errors = value_invalid(&r);
    assert_eq!(errors.len(), 10, "{}", r.json);
    assert!(named(&errors).iter().all(|(p, k)| p.starts_with("/tags/") && k == "type"), "{}", r.json);

    // A batch with one bad record among good ones: refused naming it, nothing written.
    let batch = json!({"records": [
        {"topic": payments, "key": "ada", "value": {"paid": true}},
        {"topic": orders, "key": "ada", "value": {"order": "o-2", "amount": 3}},
        {"topic": orders, "key": "bob", "value": {"order": "", "amount": "3"}},
    ]});
    let r = s.send(Method::POST, "/v1/records", None, Some(&batch)).await;
    let errors = value_invalid(&r);
    let at: Vec<(Value, Value, Value)> =
        errors.iter().map(|e| (e["record"].clone(), e["topic"].clone(), e["pointer"].clone())).collect();
    assert_eq!(at.len(), 2, "{}", r.json);
    assert!(at.contains(&(json!(2), json!(orders), json!("/order"))), "{}", r.json);
    assert!(at.contains(&(json!(2), json!(orders), json!("/amount"))), "{}", r.json);
    assert!(r.json.get("topic").is_none());
    assert!(r.json["detail"].as_str().unwrap().contains("records[2]"), "{}", r.json);

    assert_eq!(log_ends(&[&orders, &payments]).await, before, "nothing refused reached Kafka");

    // Accepted: a valid value, a tombstone (not checked), any value on a topic without a
    // schema, a batch of valid records.
    let w = s.write(&orders, "ada", json!({"order": "o-1", "amount": 12.5, "tags": ["x"]}), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let w = s.write(&orders, "ada", Value::Null, Some(&w.token())).await;
    assert_eq!(w.status, StatusCode::CREATED, "a tombstone: {}", w.json);
    let w = s.write(&payments, "ada", json!(17), Some(&w.token())).await;
    assert_eq!(w.status, StatusCode::CREATED, "no schema: {}", w.json);
    let batch = json!({"records": [
        {"topic": payments, "key": "bob", "value": {"paid": true}},
        {"topic": orders, "key": "bob", "value": {"order": "o-3", "amount": 0}},
    ]});
    let r = s.send(Method::POST, "/v1/records", Some(&w.token()), Some(&batch)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    let r = read_covered(&s, "bob", &r.token()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["document"]["order"], "o-3", "{}", r.json);

    // The document carries the topic's schema.
    let doc = s.send(Method::GET, "/openapi.json", None, None).await;
    assert_eq!(doc.status, StatusCode::OK);
    let component = &doc.json["components"]["schemas"][format!("TopicValue.{orders}")];
    assert_eq!(component["required"], json!(["order", "amount"]), "{component}");
    assert_eq!(
        component["properties"]["tags"]["items"]["$ref"],
        json!(format!("#/components/schemas/TopicValue.{orders}/$defs/tag"))
    );
    assert!(doc.json["paths"][format!("/v1/topics/{orders}/records")]["post"].is_object());
    assert!(doc.json["paths"].get(format!("/v1/topics/{payments}/records")).is_none());

    serves_every_partition(&s, "refused writes").await;
}

/// Produces `value` to `orders`/`partition` around the gateway; its offset.
async fn produce_around(s: &Stack, partition: u32, key: &str, value: &[u8]) -> i64 {
    produce(&producer(), &s.names.orders, partition as i32, key, value, None).await
}

/// Waits until task `task` is refused, and returns its refusal in `/v1/status`.
async fn refused(s: &Stack, task: u32) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = s.status().await;
        let t = st.json["models"][0]["tasks"].as_array().and_then(|ts| ts.iter().find(|t| t["task"] == json!(task)));
        if let Some(t) = t.filter(|t| t["status"] == json!("refused")) {
            return t["refusal"].clone();
        }
        assert!(Instant::now() < deadline, "task {task} was not refused within 60 s: {}", st.json);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_foreign_record_breaking_the_schema_is_refused_by_name_and_skip_clears_it() {
    let (s, _dir) = stack("contract-refuse", OnRejected::Refuse).await;
    serves_every_partition(&s, "start").await;
    let eve = key_on(&unique("eve"), 1);
    let bad_at = produce_around(&s, 1, &eve, br#"{"order": null, "amount": "secret"}"#).await;

    let refusal = refused(&s, 1).await;
    assert_eq!(refusal["reason"], "PROJECTION_REJECTED", "{refusal}");
    assert_eq!(refusal["position"], json!(bad_at), "{refusal}");
    let diagnosis = refusal["diagnosis"].as_str().unwrap();
    let coordinate = format!("{}/1@{bad_at}", s.names.orders);
    for part in [coordinate.as_str(), "pointer \"/order\"", "pointer \"/amount\"", "order.schema.json"] {
        assert!(diagnosis.contains(part), "{part:?} missing from: {diagnosis}");
    }
    assert!(!diagnosis.contains("secret"), "the payload must not appear: {diagnosis}");

    // The refused partition never serves a stale read: a write there waits behind it.
    let key = key_on(&unique("held"), 1);
    let w = s.write(&s.names.orders, &key, json!({"order": "o", "amount": 1}), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let r = s.read(&key, Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.json);

    let request = SkipRequest {
        model: s.names.model.clone(),
        topic: s.names.orders.clone(),
        partition: 1,
        position: bad_at,
        reason: "a record breaking the orders schema".to_string(),
        by: "it-test".to_string(),
    };
    skip(&s.config.kafka, &s.pool, &request).await.unwrap_or_else(|e| panic!("{e:#}"));
    serves_every_partition(&s, "the skip").await;
    let r = read_covered(&s, &key, &w.token()).await;
    assert_eq!(r.status, StatusCode::OK, "the write held behind the record: {}", r.json);
    let r = s.read(&eve, Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "the skipped record has no effect: {}", r.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_foreign_record_breaking_the_schema_is_dead_lettered_under_that_policy() {
    let (s, _dir) = stack("contract-dead", OnRejected::DeadLetter).await;
    let before = key_on(&unique("before"), 0);
    produce_around(&s, 0, &before, br#"{"order": "o-0", "amount": 1}"#).await;
    let bad_at = produce_around(&s, 0, &key_on(&unique("mallory"), 0), b"not json at all").await;
    let trent = key_on(&unique("trent"), 0);
    let wrong_at = produce_around(&s, 0, &trent, br#"{"order": 90817263, "amount": 1}"#).await;
    let after = key_on(&unique("after"), 0);
    produce_around(&s, 0, &after, br#"{"order": "o-1", "amount": 2}"#).await;

    serves_every_partition(&s, "dead letters").await;
    let mut conn = s.pool.acquire().await.unwrap();
    let letters = parsley_store::ordering::dead_letters(&mut conn, &s.names.model, 10).await.unwrap();
    let (count, latest) = letters.get(&0).unwrap_or_else(|| panic!("no dead letters on task 0: {letters:?}"));
    assert_eq!(*count, 2, "{latest:?}");
    let reason_at = |position: i64| latest.iter().find(|d| d.position == position).map(|d| d.reason.clone());
    let not_json = reason_at(bad_at).expect("the value that is not JSON");
    assert!(not_json.contains("not JSON") && not_json.contains("order.schema.json"), "{not_json}");
    let wrong = reason_at(wrong_at).expect("the value of the wrong type");
    assert!(wrong.contains("pointer \"/order\" (keyword \"type\"") && !wrong.contains("90817263"), "{wrong}");
    // The records around them applied; the dead-lettered ones had no effect.
    let last = key_on(&unique("last"), 0);
    let token = s.write(&s.names.orders, &last, json!({"order": "o-2", "amount": 3}), None).await.token();
    let r = read_covered(&s, &before, &token).await;
    assert_eq!((r.status, r.json["document"]["order"].clone()), (StatusCode::OK, json!("o-0")), "{}", r.json);
    let r = s.read(&trent, Some(&token)).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.json);
    let r = s.read(&after, Some(&token)).await;
    assert_eq!((r.status, r.json["document"]["order"].clone()), (StatusCode::OK, json!("o-1")), "{}", r.json);
    let r = s.read(&last, Some(&token)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert!(s.status().await.json["models"][0]["tasks"].as_array().unwrap().iter().all(|t| t["status"] == "running"));
}
