//! Token hygiene against the real log: tampered, expired and ahead-of-log tokens are refused
//! with their problem types; pairs on topics that no longer resolve are pruned.

use axum::http::StatusCode;
use parsley::{CausalPast, ChannelId, TopicId};
use parsley_gateway::session::unix_now;
use serde_json::json;

use crate::support::*;

async fn orders_id(s: &Stack) -> TopicId {
    s.state.facts.topic(&s.names.orders).await.unwrap().expect("the topic exists").id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_expired_and_ahead_of_log_tokens_are_refused() {
    let s = Stack::new("tokens", 2, "read_wait_ms = 300\ntoken_clock_skew_s = 0").await;
    let orders = s.names.orders.clone();
    let w = s.write(&orders, "k", json!(1), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let good = w.token();
    let session = open(&good);
    assert_eq!(session.past.len(), 1);
    assert!(session.expires_at > unix_now() + 3000, "a fresh token lives token_ttl_s");

    // Tampered: one character changed.
    let mut bytes = good.clone().into_bytes();
    let i = bytes.len() / 2;
    bytes[i] = if bytes[i] == b'A' { b'B' } else { b'A' };
    let tampered = String::from_utf8(bytes).unwrap();
    for r in [s.write(&orders, "k", json!(2), Some(&tampered)).await, s.read("k", Some(&tampered)).await] {
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.json);
        assert_eq!(r.problem_type(), "https://parsley.dev/problems/token-invalid");
        assert!(r.token.is_none());
    }

    // Expired.
    let expired = seal(session.past.clone(), unix_now() - 1);
    for r in [s.write(&orders, "k", json!(2), Some(&expired)).await, s.read("k", Some(&expired)).await] {
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.json);
        assert_eq!(r.problem_type(), "https://parsley.dev/problems/token-expired");
    }

    // Ahead of the log: a position nothing was ever written at, and a partition that does
    // not exist.
    let id = orders_id(&s).await;
    for (partition, position) in [(0, 1_000_000), (7, 0)] {
        let ahead = seal(CausalPast::from_pairs([(ChannelId::new(id, partition), position)]), unix_now() + 60);
        for r in [s.write(&orders, "k", json!(2), Some(&ahead)).await, s.read("k", Some(&ahead)).await] {
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.json);
            assert_eq!(r.problem_type(), "https://parsley.dev/problems/token-ahead-of-log", "{}", r.json);
        }
    }

    // Nothing refused above was produced: the log holds the first write only.
    let w = s.write(&orders, "k", json!(3), Some(&good)).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pairs_on_vanished_topics_are_pruned_and_acknowledgements_merged() {
    let s = Stack::new("prune", 1, "read_wait_ms = 300").await;
    let orders = s.names.orders.clone();
    let id = orders_id(&s).await;
    let gone = ChannelId::new(TopicId::from_bytes([0x5a; 16]), 0);
    let t = seal(CausalPast::from_pairs([(gone, 12)]), unix_now() + 60);
    let w = s.write(&orders, "k", json!({"a": 1}), Some(&t)).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let offset = w.json["offset"].as_i64().unwrap();
    let past = open(&w.token()).past;
    assert_eq!(
        past,
        CausalPast::from_pairs([(ChannelId::new(id, 0), offset)]),
        "the dead pair is gone, the ack merged"
    );

    // The next write stamps the previous one as its cause; the token keeps the greatest.
    let w2 = s.write(&orders, "k", json!({"a": 2}), Some(&w.token())).await;
    let offset2 = w2.json["offset"].as_i64().unwrap();
    assert!(offset2 > offset);
    assert_eq!(open(&w2.token()).past, CausalPast::from_pairs([(ChannelId::new(id, 0), offset2)]));
}
