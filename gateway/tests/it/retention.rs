//! Token pairs against retention: a client's write that its owner still holds when the log
//! start passes it stays in the session, so the read fails closed (503) rather than serve
//! without it; pairs on channels no configured model receives are still pruned below the
//! log start.

use std::time::Instant;

use axum::http::{Method, StatusCode};
use parsley::{CausalPast, ChannelId};
use parsley_gateway::session::unix_now;
use rdkafka::producer::Producer as _;
use serde_json::{json, Value};

use crate::support::*;

/// Waits until `/v1/status` says `done` of the model's first task.
async fn wait_for_task(s: &Stack, what: &str, done: impl Fn(&Value) -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let st = s.status().await;
        if done(&st.json["models"][0]["tasks"][0]) {
            return;
        }
        assert!(Instant::now() < deadline, "waiting for {what}: {}", st.json);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A 503 `not-yet-covered` that names `channel` (topic `topic`) as a gap at `required`; any
/// task it reports refused is refused for the discarded positions.
fn assert_not_served(r: &Reply, topic: &str, channel: ChannelId, required: i64) {
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "served without the session's write: {}", r.json);
    assert_eq!(r.problem_type(), "https://parsley.dev/problems/not-yet-covered", "{}", r.json);
    assert!(r.token.is_none(), "nothing was proven: {}", r.json);
    let gaps = r.json["gaps"].as_array().unwrap();
    assert!(
        gaps.iter().any(|g| g["topic"] == json!(topic)
            && g["partition"] == json!(channel.partition)
            && g["required"] == json!(required)),
        "the held write is a gap: {}",
        r.json
    );
    for t in r.json["tasks"].as_array().unwrap() {
        if t["status"] == json!("refused") {
            assert_eq!(t["reason"], json!("POSITIONS_DISCARDED_UNREAD"), "{}", r.json);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retention_past_a_held_write_never_drops_it_from_the_session() {
    let mut s = Stack::new("held-retention", 1, "read_wait_ms = 800").await;
    let (orders, payments) = (s.names.orders.clone(), s.names.payments.clone());
    s.start_projector().await;
    let order_channel = channel(&s.state, &orders, 0).await;
    let payment_channel = channel(&s.state, &payments, 0).await;

    // Around the gateway: an order in a Kafka transaction left open, and a payment naming
    // it. The owner holds the payment until the order commits.
    let txp = transactional_producer();
    txp.begin_transaction().unwrap();
    let order_at = produce(&txp, &orders, 0, "o1", br#"{"status":"placed"}"#, None).await;
    let held = CausalPast::from_pairs([(order_channel, order_at)]);
    produce(&producer(), &payments, 0, "o1", br#"{"paid":false}"#, Some(&held)).await;

    // The client's write queues behind that payment on the same channel.
    let w = s.write(&payments, "o1", json!({"paid": true}), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let written = w.json["offset"].as_i64().unwrap();
    assert_eq!(open(&w.token()).past, CausalPast::from_pairs([(payment_channel, written)]));
    wait_for_task(&s, "the owner to hold both payments", |t| t["held"] == json!(2)).await;

    // Retention passes the client's write while its owner still holds it. A second gateway
    // (several serve the same models) reads the new log start on its first look at the
    // channel.
    delete_records(&payments, 0, written + 1).await;
    let (other, _stop) = s.other_gateway("read_wait_ms = 800").await;
    let read_uri = format!("/v1/models/{}/documents/o1", s.names.model);
    let r = send(&other, Method::GET, &read_uri, Some(&w.token()), None).await;
    assert_not_served(&r, &payments, payment_channel, written);

    // A later write keeps the pair: it is stamped as a cause and stays in the token.
    let body = json!({"key": "o2", "value": {"status": "placed"}});
    let w2 = send(&other, Method::POST, &format!("/v1/topics/{orders}/records"), Some(&w.token()), Some(&body)).await;
    assert_eq!(w2.status, StatusCode::CREATED, "{}", w2.json);
    let past = open(&w2.token()).past;
    assert_eq!(past.get(&payment_channel), Some(written), "the held write is still in the session: {past:?}");

    // Restarted, the owner sees the log start past its held records and refuses; the read
    // names the refusal and still serves nothing.
    s.stop_projector().await;
    s.start_projector().await;
    wait_for_task(&s, "the owner's refusal", |t| t["status"] == json!("refused")).await;
    let r = send(&other, Method::GET, &read_uri, Some(&w2.token()), None).await;
    assert_not_served(&r, &payments, payment_channel, written);
    let tasks = r.json["tasks"].as_array().unwrap();
    assert!(
        tasks.iter().any(|t| t["task"] == json!(0) && t["status"] == json!("refused")),
        "the refused owner is named: {}",
        r.json
    );

    txp.abort_transaction(TIMEOUT).unwrap();
    s.stop_projector().await;
}

/// A pair below its channel's log start stays in the token — it is stamped on the
/// session's writes, and a receiver that has not read that position must still wait for
/// it — whether or not a configured model receives the channel. A read of the model stops
/// demanding such a pair on an upstream channel (no clock can cover it any more) and is
/// served, and the token it hands back still carries the pair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pairs_below_the_log_start_stay_in_the_token_and_reads_stop_demanding_upstream_ones() {
    let mut s = Stack::new("upstream-retention", 1, "read_wait_ms = 3000").await;
    let (orders, upstream) = (s.names.orders.clone(), format!("{}.upstream", s.names.model));
    create_topics(&[&upstream], 1).await;
    let p = producer();
    for topic in [&orders, &upstream] {
        for i in 0..3 {
            produce(&p, topic, 0, &format!("k{i}"), b"{}", None).await;
        }
        delete_records(topic, 0, 2).await;
    }
    let order_channel = channel(&s.state, &orders, 0).await;
    let upstream_channel = channel(&s.state, &upstream, 0).await;

    // The log start of both is 2: every pair is kept, below it or not.
    for (channel, position) in [(upstream_channel, 1), (upstream_channel, 2), (order_channel, 1), (order_channel, 0)] {
        let t = seal(CausalPast::from_pairs([(channel, position)]), unix_now() + 60);
        let w = s.write(&s.names.payments.clone(), "k", json!({"a": 1}), Some(&t)).await;
        assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
        assert_eq!(open(&w.token()).past.get(&channel), Some(position), "{channel} at {position}");
    }

    // A read: the upstream pair below the log start is not demanded, and stays in the token.
    s.start_projector().await;
    let t = seal(CausalPast::from_pairs([(upstream_channel, 1)]), unix_now() + 60);
    let w = s.write(&s.names.payments.clone(), "k2", json!({"b": 2}), Some(&t)).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let r = s.read("k2", Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    // (At 2 or more: the clock's entry from the earlier writes' causes merges in.)
    let kept = open(&r.token()).past.get(&upstream_channel);
    assert!(kept.is_some_and(|p| p >= 1), "the read hands the pair back: {kept:?}");

    // A pair on an upstream channel no delivered record ever named: no clock covers it, and
    // below the log start nobody can deliver it — the read stops demanding it.
    let unseen = format!("{}.unseen", s.names.model);
    create_topics(&[&unseen], 1).await;
    for i in 0..3 {
        produce(&p, &unseen, 0, &format!("k{i}"), b"{}", None).await;
    }
    delete_records(&unseen, 0, 2).await;
    let unseen_channel = channel(&s.state, &unseen, 0).await;
    let t = seal(open(&r.token()).past.merge(unseen_channel, 1), unix_now() + 60);
    let r = s.read("k2", Some(&t)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(open(&r.token()).past.get(&unseen_channel), Some(1), "not demanded, and kept");
    // At or above the log start it is demanded: never delivered here, so never covered.
    let t = seal(CausalPast::from_pairs([(unseen_channel, 2)]), unix_now() + 60);
    let r = s.read("k2", Some(&t)).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.json);
    s.stop_projector().await;
}
