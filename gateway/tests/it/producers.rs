//! Producers outside the gateway: a real librdkafka producer with its default partitioner,
//! `consistent_random` (CRC-32 of the key, the default of the Python, Go and .NET clients
//! built on librdkafka), writing beside the gateway.
//!
//! With the topics configured `partitioner = "crc32"` its records are accepted, the
//! gateway places its own writes and routes its reads by CRC-32 too, and reads are
//! read-your-writes. With the default `murmur2` the first record whose key it places
//! elsewhere is refused `KEY_PARTITION_MISMATCH`, by name, at that record; `skip` moves
//! past it (or `on_rejected = "dead-letter"` stores it), and afterwards every partition
//! serves read-your-writes again.

use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use parsley::partitioner::Partitioner;
use parsley::CausalPast;
use parsley_projector::skip::{skip, SkipRequest};
use parsley_settings::config::OnRejected;
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{json, Value};
use sqlx::Row as _;

use crate::support::*;

const PARTITIONS: u32 = 4;
const PROBLEM: &str = "https://parsley.dev/problems/";

/// A producer as a service outside the gateway makes one with librdkafka: its default
/// partitioner, spelt out (`consistent_random`: CRC-32 of a non-empty key).
fn librdkafka_default_producer() -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("partitioner", "consistent_random")
        .set("enable.idempotence", "true")
        .create()
        .expect("a librdkafka producer")
}

/// Produces `value` keyed `key` to `topic`, partition chosen by the producer, with `causes`
/// as its `parsley.causes` header; returns the partition and offset the broker acknowledged.
async fn produce_keyed(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    value: &Value,
    causes: Option<&CausalPast>,
) -> (u32, i64) {
    let payload = value.to_string();
    let encoded = causes.map(CausalPast::encode);
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let mut record: FutureRecord<'_, str, str> = FutureRecord::to(topic).key(key).payload(&payload);
        if let Some(c) = &encoded {
            record = record.headers(OwnedHeaders::new().insert(Header { key: "parsley.causes", value: Some(c) }));
        }
        match producer.send(record, TIMEOUT).await {
            Ok(d) => return (d.partition as u32, d.offset),
            // A new topic's partitions reach the producer's metadata a moment after creation.
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
            Err((e, _)) => panic!("producing to {topic}: {e}"),
        }
    }
}

/// Keys the two partitioners place on different partitions of `PARTITIONS`: `(key,
/// crc32's partition, murmur2's partition)`.
fn disputed_keys(base: &str) -> impl Iterator<Item = (String, u32, u32)> + '_ {
    (0..).map(move |i| format!("{base}-{i}")).filter_map(|k| {
        let crc = Partitioner::Crc32.partition_for_key(k.as_bytes(), PARTITIONS).unwrap();
        let murmur = Partitioner::Murmur2.partition_for_key(k.as_bytes(), PARTITIONS).unwrap();
        (crc != murmur).then_some((k, crc, murmur))
    })
}

/// A key `partitioner` places on `partition`.
fn key_on(partitioner: Partitioner, partition: u32, base: &str) -> String {
    (0..)
        .map(|i| format!("{base}-{i}"))
        .find(|k| partitioner.partition_for_key(k.as_bytes(), PARTITIONS) == Some(partition))
        .unwrap()
}

/// A stack of `PARTITIONS` tasks whose topics have `partitioner` and whose tasks take
/// `on_rejected`; a refused task notices a skip within 100 ms.
async fn stack(prefix: &str, partitioner: Partitioner, on_rejected: OnRejected) -> Stack {
    Stack::with_config(prefix, PARTITIONS as i32, "read_wait_ms = 500", |_, c| {
        for t in &mut c.models[0].topics {
            t.partitioner = partitioner;
        }
        c.models[0].on_rejected = on_rejected;
        c.projector.refused_recheck_ms = 100;
    })
    .await
}

/// A token naming exactly `(topic, partition, offset)`: the session of a client that saw the
/// outside producer's acknowledgement.
async fn token_naming(s: &Stack, topic: &str, partition: u32, offset: i64) -> String {
    let past = CausalPast::from_pairs([(channel(&s.state, topic, partition).await, offset)]);
    seal(past, unix_now_plus(3600))
}

fn unix_now_plus(seconds: u64) -> u64 {
    parsley_gateway::session::unix_now() + seconds
}

/// The admin status of task `task` once `until` holds of it.
async fn task_status(s: &Stack, task: u32, until: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let st = s.status().await;
        let t = st.json["models"][0]["tasks"]
            .as_array()
            .and_then(|ts| ts.iter().find(|t| t["task"] == json!(task)))
            .cloned()
            .unwrap_or(Value::Null);
        if until(&t) {
            return t;
        }
        assert!(Instant::now() < deadline, "task {task} never reached the state: {}", st.json);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// With `partitioner = "crc32"` on the topics, librdkafka's default producer and the
/// gateway put an order and its payment on one partition; the projector accepts them, and a
/// session that saw the outside write reads it, then its own write on top of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_librdkafka_default_producer_is_read_your_writes_on_crc32_topics() {
    let mut s = stack("crc32-producer", Partitioner::Crc32, OnRejected::Refuse).await;
    s.start_projector().await;
    let (orders, payments) = (s.names.orders.clone(), s.names.payments.clone());
    let outside = librdkafka_default_producer();
    let (key, crc, murmur) = disputed_keys("o").next().unwrap();

    // The outside service writes the order; librdkafka places it by CRC-32.
    let (partition, offset) = produce_keyed(&outside, &orders, &key, &json!({"total": 30}), None).await;
    assert_eq!(partition, crc, "librdkafka's default partitioner is CRC-32 of the key (murmur2 says {murmur})");

    // A client that saw the order's acknowledgement reads it through the gateway.
    let saw_order = token_naming(&s, &orders, partition, offset).await;
    let r = read_covered(&s, &key, &saw_order).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["document"], json!({"total": 30}), "{}", r.json);

    // Its payment through the gateway lands on the same partition, and reads its write.
    let w = s.write(&payments, &key, json!({"paid": true}), Some(&r.token())).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    assert_eq!(w.json["partition"], json!(crc), "the gateway places the key by CRC-32 too: {}", w.json);
    let r = s.read(&key, Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["document"], json!({"total": 30, "paid": true}), "{}", r.json);

    // A batch places each record by CRC-32 as well.
    let (other, other_crc, _) = disputed_keys("b").next().unwrap();
    let batch = json!({"records": [
        {"topic": orders, "key": other, "value": {"total": 5}},
        {"topic": payments, "key": other, "value": {"paid": false}},
    ]});
    let b = s.send(Method::POST, "/v1/records", Some(&w.token()), Some(&batch)).await;
    assert_eq!(b.status, StatusCode::CREATED, "{}", b.json);
    for record in b.json["records"].as_array().unwrap() {
        assert_eq!(record["partition"], json!(other_crc), "{}", b.json);
    }
    // The outside service pays for it, caused by the batch: delivered after it.
    let token = open(&b.token());
    let (p2, o2) = produce_keyed(&outside, &payments, &other, &json!({"paid": true}), Some(&token.past)).await;
    assert_eq!(p2, other_crc);
    let saw_payment = token_naming(&s, &payments, p2, o2).await;
    let r = read_covered(&s, &other, &saw_payment).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["document"], json!({"total": 5, "paid": true}), "{}", r.json);

    // No task refused anything, and every partition serves read-your-writes.
    let st = s.status().await;
    for t in st.json["models"][0]["tasks"].as_array().unwrap() {
        assert_eq!(t["status"], json!("running"), "{}", st.json);
    }
    every_partition_reads_its_writes(&s, Partitioner::Crc32, PARTITIONS, |k| json!({"p": k})).await;
    s.stop_projector().await;
}

/// With the default `murmur2`, the outside producer's record lands where reads of its key
/// are not routed: the projector refuses it by name at that record, the diagnosis naming the
/// key, both partitions and the producer setting that fixes it; a read blocked by it names
/// the reason; `skip` moves past it; afterwards every partition reads its writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_librdkafka_default_producer_on_a_murmur2_topic_is_refused_by_name_and_skipped() {
    let mut s = stack("murmur2-mismatch", Partitioner::Murmur2, OnRejected::Refuse).await;
    s.start_projector().await;
    let orders = s.names.orders.clone();
    let outside = librdkafka_default_producer();
    let (key, crc, murmur) = disputed_keys("o").next().unwrap();

    let (partition, offset) = produce_keyed(&outside, &orders, &key, &json!({"total": 30}), None).await;
    assert_eq!(partition, crc);
    let task = task_status(&s, crc, |t| t["status"] == json!("refused")).await;
    let refusal = &task["refusal"];
    assert_eq!(refusal["reason"], json!("KEY_PARTITION_MISMATCH"), "{task}");
    assert_eq!(refusal["position"], json!(offset), "refused at the record: {task}");
    let diagnosis = refusal["diagnosis"].as_str().unwrap();
    for part in [
        format!("{orders}/{crc}@{offset}"),
        format!("key {key:?}"),
        format!("found on partition {crc}"),
        format!("places it on partition {murmur} of {PARTITIONS}"),
        "partitioner=murmur2_random".to_string(),
        "partitioner = \"crc32\"".to_string(),
    ] {
        assert!(diagnosis.contains(&part), "{part:?} missing from the diagnosis: {diagnosis}");
    }
    // The other tasks run on.
    for t in (0..PARTITIONS).filter(|t| *t != crc) {
        task_status(&s, t, |t| t["status"] == json!("running")).await;
    }
    let no_document: i64 = sqlx::query("SELECT count(*) FROM projection.documents WHERE model = $1 AND key = $2")
        .bind(&s.names.model)
        .bind(&key)
        .fetch_one(&s.pool)
        .await
        .unwrap()
        .get(0);
    assert_eq!(no_document, 0, "the misplaced record is not applied");

    // A session that saw the record waits, and is told why.
    let saw_order = token_naming(&s, &orders, partition, offset).await;
    let r = s.read(&key, Some(&saw_order)).await;
    assert_eq!(
        (r.status.as_u16(), r.problem_type()),
        (503, format!("{PROBLEM}not-yet-covered").as_str()),
        "{}",
        r.json
    );
    let blocked = r.json["tasks"].as_array().unwrap();
    assert!(
        blocked.iter().any(|t| t["task"] == json!(crc) && t["reason"] == json!("KEY_PARTITION_MISMATCH")),
        "{}",
        r.json
    );

    // The operator skips the record: the task goes on, and the session is covered (the
    // skipped record had no effect, so the key has no document).
    let request = SkipRequest {
        model: s.names.model.clone(),
        topic: orders.clone(),
        partition,
        position: offset,
        reason: "produced with librdkafka's consistent_random".into(),
        by: "it-test".into(),
    };
    skip(&s.config.kafka, &s.pool, &request).await.unwrap_or_else(|e| panic!("{e}"));
    task_status(&s, crc, |t| t["status"] == json!("running")).await;
    let r = read_covered(&s, &key, &saw_order).await;
    assert_eq!((r.status.as_u16(), r.problem_type()), (404, format!("{PROBLEM}not-found").as_str()), "{}", r.json);

    // The key written as the topic's partitioner places it is read back.
    let w = s.write(&orders, &key, json!({"total": 31}), Some(&r.token())).await;
    assert_eq!(w.json["partition"], json!(murmur), "{}", w.json);
    let r = read_covered(&s, &key, &w.token()).await;
    assert_eq!(r.json["document"], json!({"total": 31}), "{}", r.json);
    every_partition_reads_its_writes(&s, Partitioner::Murmur2, PARTITIONS, |k| json!({"p": k})).await;
    s.stop_projector().await;
}

/// Under `on_rejected = "dead-letter"` the misplaced record is stored in
/// `parsley.dead_letters` with the reason by name and delivered without effect: the task
/// never stops, the session that saw it is covered, and every partition reads its writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misplaced_record_is_dead_lettered_by_name_under_dead_letter() {
    let mut s = stack("murmur2-dead-letter", Partitioner::Murmur2, OnRejected::DeadLetter).await;
    s.start_projector().await;
    let orders = s.names.orders.clone();
    let outside = librdkafka_default_producer();
    let (key, crc, murmur) = disputed_keys("o").next().unwrap();
    let (partition, offset) = produce_keyed(&outside, &orders, &key, &json!({"total": 30}), None).await;
    assert_eq!(partition, crc);

    let saw_order = token_naming(&s, &orders, partition, offset).await;
    let r = read_covered(&s, &key, &saw_order).await;
    assert_eq!((r.status.as_u16(), r.problem_type()), (404, format!("{PROBLEM}not-found").as_str()), "{}", r.json);
    let row = sqlx::query("SELECT task, partition, position, reason FROM parsley.dead_letters WHERE model = $1")
        .bind(&s.names.model)
        .fetch_one(&s.pool)
        .await
        .unwrap();
    assert_eq!(
        (row.get::<i32, _>(0), row.get::<i32, _>(1), row.get::<i64, _>(2)),
        (crc as i32, crc as i32, offset),
        "the record is dead-lettered where it was found"
    );
    let reason: String = row.get(3);
    assert!(reason.starts_with("KEY_PARTITION_MISMATCH"), "{reason}");
    assert!(reason.contains(&format!("places it on partition {murmur}")), "{reason}");
    let task = task_status(&s, crc, |t| t["status"] == json!("running")).await;
    assert!(task["refusal"].is_null(), "{task}");
    every_partition_reads_its_writes(&s, Partitioner::Murmur2, PARTITIONS, |k| json!({"p": k})).await;
    s.stop_projector().await;
}

/// A topic whose key is not the document key (`partitioner = "none"`) is not checked: the
/// outside producer's records are applied wherever they land, and a read of a key is gated
/// on every task (no task owns a key), so it is covered only once every task covers the
/// session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_unrouted_topics_are_not_checked_and_reads_wait_for_every_task() {
    let mut s = stack("unrouted", Partitioner::None, OnRejected::Refuse).await;
    s.start_projector().await;
    let orders = s.names.orders.clone();
    let outside = librdkafka_default_producer();
    let (key, crc, _) = disputed_keys("o").next().unwrap();
    let (partition, offset) = produce_keyed(&outside, &orders, &key, &json!({"total": 30}), None).await;
    assert_eq!(partition, crc);
    // Every task applies a record of its own (the gateway's writes to an unrouted topic are
    // placed by the producer's murmur2).
    every_partition_reads_its_writes(&s, Partitioner::Murmur2, PARTITIONS, |k| json!({"p": k})).await;
    let saw_order = token_naming(&s, &orders, partition, offset).await;
    let r = read_covered(&s, &key, &saw_order).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["document"], json!({"total": 30}), "{}", r.json);
    // The refreshed token holds every task's position of its own channels: the read was
    // served by all of them.
    let refreshed = open(&r.token());
    let orders_id = channel(&s.state, &orders, 0).await.topic;
    let served: std::collections::BTreeSet<u32> =
        refreshed.past.iter().filter(|(c, _)| c.topic == orders_id).map(|(c, _)| c.partition).collect();
    assert_eq!(served, (0..PARTITIONS).collect(), "served by every task: {:?}", refreshed.past);

    // The same read on a model routing keys by murmur2 is served by the key's owner alone.
    let mut routed = stack("routed", Partitioner::Murmur2, OnRejected::Refuse).await;
    routed.start_projector().await;
    every_partition_reads_its_writes(&routed, Partitioner::Murmur2, PARTITIONS, |k| json!({"p": k})).await;
    let owned = key_on(Partitioner::Murmur2, 1, "owned");
    let w = routed.write(&routed.names.orders.clone(), &owned, json!(1), None).await;
    let r = read_covered(&routed, &owned, &w.token()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let routed_id = channel(&routed.state, &routed.names.orders, 0).await.topic;
    let served: std::collections::BTreeSet<u32> =
        open(&r.token()).past.iter().filter(|(c, _)| c.topic == routed_id).map(|(c, _)| c.partition).collect();
    assert_eq!(served, [1].into(), "served by the owner alone");
    routed.stop_projector().await;
    s.stop_projector().await;
}
