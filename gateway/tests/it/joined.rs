//! Several `Parsley-Session` tokens of one session on a request (docs/gateway.md, "Several
//! tokens of one session"): the writes of one session answered concurrently, each with its
//! own token, joined by the next request — repeated headers or a comma list, at most
//! `token_max_per_request`, one subject's only — and the answer's token is their join.

use axum::http::{Method, StatusCode};
use axum::Router;
use parsley::CausalPast;
use parsley_gateway::session::unix_now;
use parsley_gateway::token::{self, Session, TokenLimits};
use parsley_gateway::SESSION_HEADER;
use serde_json::{json, Value};

use crate::support::*;

/// Sends one request with `headers` (repeated names kept) through `router`.
async fn send_with(
    router: &Router,
    method: Method,
    uri: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> Reply {
    let body = body.map(|b| serde_json::to_vec(b).unwrap());
    send_headers(router, method, uri, headers, body.as_deref()).await
}

/// The join of the sessions `tokens` name: their pasts' pointwise maximum.
fn joined(tokens: &[String]) -> CausalPast {
    tokens.iter().fold(CausalPast::new(), |past, t| past.merge_past(&open(t).past))
}

/// Reads `key` carrying `headers`, waiting out `503`s for at most 45 s.
async fn read_with(s: &Stack, key: &str, headers: &[(&str, &str)]) -> Reply {
    let uri = format!("/v1/models/{}/documents/{key}", s.names.model);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(45);
    loop {
        let r = send_with(&s.router, Method::GET, &uri, headers, None).await;
        if r.status != StatusCode::SERVICE_UNAVAILABLE || std::time::Instant::now() > deadline {
            return r;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_of_one_session_are_joined_by_the_next_request() {
    let mut s = Stack::new("joined", 3, "read_wait_ms = 2000").await;
    s.start_projector().await;
    let orders = s.names.orders.clone();
    let first = s.write(&orders, &unique("first"), json!(0), None).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.json);
    let base = first.token();

    // Twelve writes at once, each carrying the same token: each answer names its own write.
    let keys: Vec<String> = (0..12).map(|i| unique(&format!("w{i}"))).collect();
    let writes: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let (router, orders, base) = (s.router.clone(), orders.clone(), base.clone());
            let body = json!({"key": key, "value": {"n": i}});
            tokio::spawn(async move {
                send(&router, Method::POST, &format!("/v1/topics/{orders}/records"), Some(&base), Some(&body)).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for w in writes {
        answers.push(w.await.unwrap());
    }
    let tokens: Vec<String> = answers
        .iter()
        .map(|w| {
            assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
            w.token()
        })
        .collect();
    let partitions: std::collections::BTreeSet<_> = answers.iter().map(|w| w.json["partition"].as_u64()).collect();
    assert!(partitions.len() > 1, "the keys spread over partitions: {partitions:?}");
    let join = joined(&tokens);
    for w in &answers {
        let channel = channel(&s.state, &orders, w.json["partition"].as_u64().unwrap() as u32).await;
        assert!(join.get(&channel) >= w.json["offset"].as_i64(), "the join holds every write");
    }

    // Repeated headers: every write is read back, and the answer's token is the join.
    let repeated: Vec<(&str, &str)> = tokens[..8].iter().map(|t| (SESSION_HEADER, t.as_str())).collect();
    let eight = joined(&tokens[..8]);
    for (i, key) in keys[..8].iter().enumerate() {
        let r = read_with(&s, key, &repeated).await;
        assert_eq!(r.status, StatusCode::OK, "{key}: {}", r.json);
        assert_eq!(r.json["document"], json!({"n": i}));
        // The join of the tokens sent, and what the read proved besides (the served task's
        // positions, which later writes of the twelve may have moved on).
        let answer = open(&r.token()).past;
        assert!(answer.covers(&eight), "the answer's token holds the join of the tokens sent: {answer:?} {eight:?}");
    }

    // A comma list (and the two forms together): the same.
    let list = tokens[..6].join(", ");
    let rest = tokens[6..].join(",");
    let both = [(SESSION_HEADER, list.as_str()), (SESSION_HEADER, rest.as_str())];
    for (i, key) in keys.iter().enumerate() {
        let r = read_with(&s, key, &both).await;
        assert_eq!(r.status, StatusCode::OK, "{key}: {}", r.json);
        assert_eq!(r.json["document"], json!({"n": i}));
        let answer = open(&r.token()).past;
        assert!(answer.covers(&join), "the answer's token holds the join: {answer:?} {join:?}");
    }

    // A write carrying several tokens stamps their join and answers it with its own coordinate.
    let w = send_with(
        &s.router,
        Method::POST,
        &format!("/v1/topics/{orders}/records"),
        &both,
        Some(&json!({"key": unique("after"), "value": 1})),
    )
    .await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let channel = channel(&s.state, &orders, w.json["partition"].as_u64().unwrap() as u32).await;
    assert_eq!(open(&w.token()).past, join.clone().merge(channel, w.json["offset"].as_i64().unwrap()));

    // POST /v1/sessions joins without reading or writing.
    let r = send_with(&s.router, Method::POST, "/v1/sessions", &both, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(open(&r.token()).past, join);
    s.stop_projector().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_tokens_than_the_bound_and_other_subjects_tokens_are_refused_by_name() {
    let s = Stack::new("joinbound", 1, "token_max_per_request = 3\nsubject_header = \"x-subject\"").await;
    let orders = s.names.orders.clone();
    let write = |tokens: Vec<(&'static str, String)>| {
        let (router, orders) = (s.router.clone(), orders.clone());
        async move {
            let headers: Vec<(&str, &str)> = tokens.iter().map(|(n, v)| (*n, v.as_str())).collect();
            let body = json!({"key": "k", "value": 1});
            send_with(&router, Method::POST, &format!("/v1/topics/{orders}/records"), &headers, Some(&body)).await
        }
    };
    let alice = || async {
        let w = write(vec![("x-subject", "alice".to_string())]).await;
        assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
        w.token()
    };
    let (a1, a2, a3, a4) = (alice().await, alice().await, alice().await, alice().await);

    // Three: joined. Four, however sent: `too-many-tokens`, naming the bound.
    let three = format!("{a1},{a2},{a3}");
    let w = write(vec![("x-subject", "alice".into()), (SESSION_HEADER, three.clone())]).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let offset = w.json["offset"].as_i64().unwrap();
    for four in [
        vec![("x-subject", "alice".into()), (SESSION_HEADER, format!("{three},{a4}"))],
        vec![("x-subject", "alice".into()), (SESSION_HEADER, three.clone()), (SESSION_HEADER, a4.clone())],
    ] {
        let r = write(four).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.json);
        assert_eq!(r.problem_type(), "https://parsley.dev/problems/too-many-tokens");
        assert_eq!(r.json["limit"], json!(3));
        assert!(r.token.is_none());
    }

    // Another subject's token among them: `token-subjects-differ`, whoever asks.
    let bob = write(vec![("x-subject", "bob".to_string())]).await.token();
    for subject in ["alice", "bob"] {
        let r = write(vec![("x-subject", subject.into()), (SESSION_HEADER, format!("{a1}, {bob}"))]).await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.json);
        assert_eq!(r.problem_type(), "https://parsley.dev/problems/token-subjects-differ", "{}", r.json);
    }
    // One subject's tokens, sent by another: as with one token, `token-wrong-subject`.
    let r = write(vec![("x-subject", "bob".into()), (SESSION_HEADER, format!("{a1},{a2}"))]).await;
    assert_eq!(r.problem_type(), "https://parsley.dev/problems/token-wrong-subject", "{}", r.json);
    // An unbound token joins a bound one: the answer is bound to the caller.
    let unbound = token::seal(
        &ring(),
        &Session { issued_at: unix_now() - 5, expires_at: unix_now() + 60, subject: None, past: CausalPast::new() },
    );
    let r = send_with(
        &s.router,
        Method::POST,
        "/v1/sessions",
        &[("x-subject", "alice"), (SESSION_HEADER, &format!("{unbound},{a1}"))],
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let back = token::open(&ring(), &r.token(), unix_now(), Some("alice"), &TokenLimits::default()).unwrap();
    assert_eq!(back.subject.as_deref(), Some("alice"));
    // An empty element, or one bad token among good ones: refused whole, never dropped.
    for bad in [format!("{a1},,{a2}"), format!("{a1},{}", &a2[..a2.len() - 4])] {
        let r = write(vec![("x-subject", "alice".into()), (SESSION_HEADER, bad)]).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.json);
        assert!(
            ["https://parsley.dev/problems/token-malformed", "https://parsley.dev/problems/token-invalid"]
                .contains(&r.problem_type()),
            "{}",
            r.json
        );
    }
    // Nothing refused was produced: after the joined write, only bob's is in the log.
    let w = write(vec![("x-subject", "alice".into()), (SESSION_HEADER, a1.clone())]).await;
    assert_eq!(w.json["offset"], json!(offset + 2), "{}", w.json);
}
