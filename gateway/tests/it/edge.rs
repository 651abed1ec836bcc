//! The gateway's edge against the real stack: what could never be stored is refused before
//! it reaches Kafka (and the partition keeps serving), the value reaches Kafka byte for byte
//! as sent, keys and cursors no document can have are client errors (never "Postgres is
//! unavailable"), a topic whose partition count changed is refused `409 width-changed`, and
//! reads beyond `max_waiting_reads` are refused `503 overloaded` at once.

use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use parsley_gateway::metrics::Metric;
use rdkafka::admin::NewPartitions;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Headers as _, Message as _};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};

use crate::support::*;

const PROBLEM: &str = "https://parsley.dev/problems/";

/// Asserts the exact status and problem type of `r`, returning its body.
#[track_caller]
fn problem(r: &Reply, status: u16, kind: &str) -> Value {
    assert_eq!((r.status.as_u16(), r.problem_type()), (status, format!("{PROBLEM}{kind}").as_str()), "{}", r.json);
    assert_eq!(r.content_type.as_deref(), Some("application/problem+json"));
    r.json.clone()
}

/// A record as consumed: key, value and headers, as bytes.
struct Consumed {
    key: Vec<u8>,
    value: Vec<u8>,
    headers: Vec<(String, Vec<u8>)>,
}

/// The record at `offset` of `topic`/`partition`.
fn consume(topic: &str, partition: i32, offset: i64) -> Consumed {
    let consumer: BaseConsumer =
        parsley_infra::kafka::consumer_config(&bootstrap(), &unique("it-edge")).create().expect("a consumer");
    let mut assignment = TopicPartitionList::new();
    assignment.add_partition_offset(topic, partition, Offset::Offset(offset)).unwrap();
    consumer.assign(&assignment).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    loop {
        assert!(Instant::now() < deadline, "the record at {topic}/{partition}@{offset} never arrived");
        let Some(message) = consumer.poll(Duration::from_millis(200)) else { continue };
        let message = message.expect("consuming");
        assert_eq!(message.offset(), offset);
        let headers = message
            .headers()
            .map(|h| h.iter().map(|h| (h.key.to_string(), h.value.unwrap_or_default().to_vec())).collect())
            .unwrap_or_default();
        let (key, value) = (message.key().unwrap_or_default().to_vec(), message.payload().unwrap_or_default().to_vec());
        return Consumed { key, value, headers };
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn what_could_never_be_stored_is_refused_and_the_value_is_produced_as_sent() {
    let mut s = Stack::new("edge-write", 2, "read_wait_ms = 15000").await;
    s.start_projector().await;
    let uri = format!("/v1/topics/{}/records", s.names.orders);
    let long_key = format!(r#"{{"key":"{}","value":1}}"#, "k".repeat(1025));
    for (body, field, reason) in [
        (r#"{"key":"a\u0000b","value":1}"#, "key", "nul"),
        (long_key.as_str(), "key", "too-long"),
        (r#"{"key":"k","value":{"note":"x\u0000y"}}"#, "value.note", "nul"),
        (r#"{"key":"k","value":{"a":1,"a":2}}"#, "value.a", "duplicate-key"),
        (r#"{"key":"k","value":"\udc00"}"#, "value", "unrepresentable"),
    ] {
        let r = send_raw(&s.router, Method::POST, &uri, None, Some(body.as_bytes())).await;
        let p = problem(&r, 400, "invalid-body");
        assert_eq!((p["field"].as_str(), p["reason"].as_str()), (Some(field), Some(reason)), "{body}: {p}");
        assert!(r.token.is_none(), "nothing was written: {p}");
    }

    // The value reaches Kafka byte for byte: key order and the big number as sent.
    let body = br#"{"key":"big", "value": {"b":1,"a":12345678901234567890123} , "headers":{"z":"1","a":"\u0000x"}}"#;
    let w = send_raw(&s.router, Method::POST, &uri, None, Some(body)).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let (partition, offset) = (w.json["partition"].as_i64().unwrap() as i32, w.json["offset"].as_i64().unwrap());
    let orders = s.names.orders.clone();
    let Consumed { key, value, headers } =
        tokio::task::spawn_blocking(move || consume(&orders, partition, offset)).await.unwrap();
    assert_eq!(key, b"big");
    assert_eq!(value, br#"{"b":1,"a":12345678901234567890123}"#.to_vec(), "{}", String::from_utf8_lossy(&value));
    // The application headers in the order sent, then the gateway's trace context (a new
    // trace: the request carried none).
    assert_eq!(headers[..2], [("z".to_string(), b"1".to_vec()), ("a".to_string(), b"\0x".to_vec())]);
    assert_eq!(headers.len(), 3, "{headers:?}");
    let (name, traceparent) = &headers[2];
    assert_eq!(name, "traceparent");
    assert!(parsley_gateway::trace::TraceContext::parse(std::str::from_utf8(traceparent).unwrap()).is_some());

    // The partitions keep serving: the record is applied and read with the session.
    let r = s.read("big", Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["document"]["b"], json!(1));
    s.stop_projector().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_and_cursors_no_document_can_have_are_client_errors_never_an_outage() {
    let mut s = Stack::new("edge-read", 2, "read_wait_ms = 15000").await;
    s.start_projector().await;
    let w = s.write(&s.names.orders.clone(), "k", json!({"n": 1}), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let token = w.token();
    let long = "k".repeat(1025);
    for (path, kind, parameter) in [
        ("/documents/a%00b".to_string(), "invalid-key", "key"),
        ("/documents/%00".to_string(), "invalid-key", "key"),
        ("/documents/%FF%FE".to_string(), "invalid-key", "key"),
        (format!("/documents/{long}"), "invalid-key", "key"),
        ("/documents?after=%00".to_string(), "invalid-query", "after"),
        ("/documents?after=a%00".to_string(), "invalid-query", "after"),
        ("/documents?after=%C3%28".to_string(), "invalid-query", "after"),
        (format!("/documents?after={long}"), "invalid-query", "after"),
    ] {
        for t in [None, Some(token.as_str())] {
            let uri = format!("/v1/models/{}{path}", s.names.model);
            let r = s.send(Method::GET, &uri, t, None).await;
            let p = problem(&r, 400, kind);
            assert_eq!(p["parameter"], json!(parameter), "{path}: {p}");
        }
    }
    // The same reads with keys a document can have are served.
    let r = s.read("k", Some(&token)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let r = s.list("?after=a%20b", Some(&token)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    s.stop_projector().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_to_a_topic_whose_width_changed_are_refused() {
    let mut s = Stack::new("edge-width", 1, "metadata_refresh_ms = 1000").await;
    let (orders, payments) = (s.names.orders.clone(), s.names.payments.clone());
    s.start_projector().await;
    let w = s.write(&orders, "before", json!(1), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    // The model was recorded one task wide; stop it and widen `orders`.
    s.stop_projector().await;
    let admin = parsley_testkit::admin();
    let results = admin
        .create_partitions(&[NewPartitions::new(&orders, 2)], &parsley_testkit::admin_options())
        .await
        .expect("create_partitions request");
    assert!(results[0].is_ok(), "{results:?}");

    let expect_409 = |r: &Reply| {
        let p = problem(r, 409, "width-changed");
        assert_eq!(
            (p["topic"].clone(), p["partitions"].clone(), p["model"].clone(), p["task_count"].clone()),
            (json!(orders), json!(2), json!(s.names.model), json!(1)),
            "{p}"
        );
        assert!(r.token.is_none(), "the session claims nothing: {p}");
        p
    };
    // A gateway that learns the topic now refuses at once, and writes nothing.
    let (fresh, _stop) = s.other_gateway("").await;
    let body = json!({"key": "after", "value": 1});
    let r = send(&fresh, Method::POST, &format!("/v1/topics/{orders}/records"), None, Some(&body)).await;
    assert_eq!(expect_409(&r)["written"], Value::Null);
    let r = send(&fresh, Method::POST, &format!("/v1/topics/{payments}/records"), None, Some(&body)).await;
    assert_eq!(r.status, StatusCode::CREATED, "the other topic's width is unchanged: {}", r.json);

    // The running gateway refuses once its facts refresh (never a write to partition 1).
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let r = s.write(&orders, "after", json!(1), Some(&w.token())).await;
        if r.status == StatusCode::CONFLICT {
            expect_409(&r);
            break;
        }
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
        assert_eq!(r.json["partition"], json!(0), "a 201 only for a partition the model reads: {}", r.json);
        assert!(Instant::now() < deadline, "the width change is never noticed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_beyond_max_waiting_reads_are_refused_at_once() {
    let s = Stack::new("edge-waiting", 1, "read_wait_ms = 3000\nmax_waiting_reads = 1").await;
    // No projector: a read of a session with a write is never covered, so it waits.
    let w = s.write(&s.names.orders.clone(), "o1", json!(1), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let token = w.token();
    let uri = format!("/v1/models/{}/documents/o1", s.names.model);
    let (router, first_uri, first_token) = (s.router.clone(), uri.clone(), token.clone());
    let first = tokio::spawn(async move { send(&router, Method::GET, &first_uri, Some(&first_token), None).await });
    tokio::time::sleep(Duration::from_millis(500)).await;

    let started = Instant::now();
    let r = s.send(Method::GET, &uri, Some(&token), None).await;
    problem(&r, 503, "overloaded");
    assert_eq!(r.retry_after.as_deref(), Some("1"));
    assert!(started.elapsed() < Duration::from_secs(2), "refused at once, not after waiting");
    // A read covered at its first attempt never waits, so it is not limited.
    let r = s.read("o1", None).await;
    problem(&r, 404, "not-found");

    problem(&first.await.unwrap(), 503, "not-yet-covered");
    // The slot is free again: the next uncovered read waits its turn.
    let r = s.send(Method::GET, &uri, Some(&token), None).await;
    problem(&r, 503, "not-yet-covered");
    assert_eq!(s.state.metrics.value(Metric::OverloadedTotal, &[("limit", "max_waiting_reads")]), Some(1.0));
}
