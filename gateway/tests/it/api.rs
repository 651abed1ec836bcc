//! The API as browser apps and retrying clients use it: CORS (preflights, exposed headers,
//! origins refused) and idempotent writes (a retry with the same `Idempotency-Key` answers
//! the first acknowledgement without writing again, on any gateway of the fleet; the same
//! key with another body is `409`; concurrent duplicates write once).

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use tower::ServiceExt as _;

use crate::support::*;

/// Sends a request with extra headers; answers (status, headers, JSON body).
async fn request(
    router: &Router,
    method: Method,
    uri: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> (StatusCode, axum::http::HeaderMap, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Body::from(serde_json::to_vec(b).unwrap())
        }
        None => Body::empty(),
    };
    let response = router.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let (status, headers) = (response.status(), response.headers().clone());
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
    (status, headers, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

fn header<'a>(headers: &'a axum::http::HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).map(|v| v.to_str().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_lets_allowed_origins_read_the_session_header_and_refuses_other_preflights() {
    let s = Stack::new("cors", 1, "cors_allowed_origins = [\"https://app.example\"]").await;
    let app = "https://app.example";
    let uri = format!("/v1/topics/{}/records", s.names.orders);

    // A preflight from the allowed origin.
    let (status, h, _) = request(
        &s.router,
        Method::OPTIONS,
        &uri,
        &[
            ("origin", app),
            ("access-control-request-method", "POST"),
            ("access-control-request-headers", "content-type, parsley-session, idempotency-key"),
        ],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(header(&h, "access-control-allow-origin"), Some(app));
    assert_eq!(header(&h, "access-control-allow-methods"), Some("GET, POST"));
    let allowed = header(&h, "access-control-allow-headers").unwrap();
    for name in ["content-type", "parsley-session", "idempotency-key", "traceparent"] {
        assert!(allowed.contains(name), "{allowed}");
    }
    assert_eq!(header(&h, "vary"), Some("origin"));

    // The actual request: the app can read the session token and Retry-After.
    let (status, h, body) =
        request(&s.router, Method::POST, &uri, &[("origin", app)], Some(&json!({"key": "k", "value": 1}))).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(header(&h, "access-control-allow-origin"), Some(app));
    let exposed = header(&h, "access-control-expose-headers").unwrap();
    assert!(exposed.contains("Parsley-Session") && exposed.contains("Retry-After"), "{exposed}");
    assert!(h.contains_key("parsley-session"));

    // Another origin: its preflight is refused by name, its requests carry no CORS header.
    let (status, h, body) = request(
        &s.router,
        Method::OPTIONS,
        &uri,
        &[("origin", "https://evil.example"), ("access-control-request-method", "POST")],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(body["type"], json!("https://parsley.dev/problems/cors-origin-not-allowed"));
    assert!(!h.contains_key("access-control-allow-origin"));
    let (status, h, _) = request(&s.router, Method::GET, "/healthz", &[("origin", "https://evil.example")], None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(!h.contains_key("access-control-allow-origin"));

    // Without configured origins, no CORS header at all.
    let (plain, _stop) = s.other_gateway("").await;
    let (_, h, _) = request(&plain, Method::GET, "/healthz", &[("origin", app)], None).await;
    assert!(!h.contains_key("access-control-allow-origin"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_write_with_the_same_idempotency_key_is_answered_without_writing_again() {
    let mut s = Stack::new("idempotent", 2, "read_wait_ms = 15000").await;
    s.start_projector().await;
    let uri = format!("/v1/topics/{}/records", s.names.orders);
    let body = json!({"key": "order-1", "value": {"n": 1}});
    let key = unique("k");
    // Keys are scoped by the session token (no subject here): the client starts its session
    // with a read, so that its first write can be retried with the same token.
    let started = s.read("order-0", None).await.token();
    let with_key = [("idempotency-key", key.as_str()), ("parsley-session", started.as_str())];

    let (status, h, first) = request(&s.router, Method::POST, &uri, &with_key, Some(&body)).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    assert_eq!(header(&h, "idempotency-replayed"), None);
    let token = header(&h, "parsley-session").unwrap().to_string();

    // The retry (the client never saw the answer), on another gateway of the fleet, with
    // the session it had before: the same acknowledgement, merged into its session.
    let (other, _stop) = s.other_gateway("").await;
    let (status, h, again) = request(&other, Method::POST, &uri, &with_key, Some(&body)).await;
    assert_eq!(status, StatusCode::CREATED, "{again}");
    assert_eq!(again, first, "the same coordinate");
    assert_eq!(header(&h, "idempotency-replayed"), Some("true"));
    let replayed = header(&h, "parsley-session").unwrap().to_string();
    let channel = channel(&s.state, &s.names.orders, first["partition"].as_u64().unwrap() as u32).await;
    assert_eq!(open(&replayed).past.get(&channel), first["offset"].as_i64(), "the coordinate is in the session");
    assert_eq!(open(&token).past, open(&replayed).past);
    // Another caller (another session, or none) with the same key writes its own record:
    // no one can claim or replay another's key.
    let (status, h, theirs) = request(&s.router, Method::POST, &uri, &[("idempotency-key", &key)], Some(&body)).await;
    assert_eq!((status, header(&h, "idempotency-replayed")), (StatusCode::CREATED, None), "{theirs}");
    assert_ne!(theirs, first);

    // The retry wrote nothing: the document's versions are the first write's and the other
    // caller's, two.
    let other_session = header(&h, "parsley-session").unwrap().to_string();
    let r = s.read("order-1", Some(&other_session)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!((r.json["document"].clone(), r.json["version"].clone()), (json!({"n": 1}), json!(2)));

    // The same key for another request: refused by name, nothing written.
    let other_body = json!({"key": "order-1", "value": {"n": 2}});
    let (status, _, problem) = request(&s.router, Method::POST, &uri, &with_key, Some(&other_body)).await;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");
    assert_eq!(problem["type"], json!("https://parsley.dev/problems/idempotency-key-reused"));
    let other_uri = format!("/v1/topics/{}/records", s.names.payments);
    let (status, _, problem) = request(&s.router, Method::POST, &other_uri, &with_key, Some(&body)).await;
    assert_eq!(status, StatusCode::CONFLICT, "another route is another request: {problem}");

    // Keys a request cannot carry.
    for bad in ["", "has space", &"x".repeat(256)] {
        let (status, _, problem) =
            request(&s.router, Method::POST, &uri, &[("idempotency-key", bad)], Some(&body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad:?}: {problem}");
        assert_eq!(problem["type"], json!("https://parsley.dev/problems/invalid-idempotency-key"));
    }

    // Concurrent duplicates: one write; the others replay it or are told it is in flight.
    let body = json!({"key": "order-2", "value": {"n": 1}});
    let answers = concurrent_posts(&s.router, &uri, &body, &unique("concurrent"), &started).await;
    let written: Vec<&(StatusCode, bool, Value)> =
        answers.iter().filter(|a| a.0 == StatusCode::CREATED && !a.1).collect();
    assert_eq!(written.len(), 1, "{answers:?}");
    for (status, replayed, body) in &answers {
        match *status {
            StatusCode::CREATED => assert_eq!(body, &written[0].2, "replayed: {replayed}"),
            StatusCode::CONFLICT => {
                assert_eq!(body["type"], json!("https://parsley.dev/problems/idempotency-key-in-flight"))
            }
            other => panic!("{other}: {body}"),
        }
    }
    let w = s.write(&s.names.orders.clone(), "order-2", json!({"n": 2}), None).await;
    let r = s.read("order-2", Some(&w.token())).await;
    assert_eq!(r.json["version"], json!(2), "the duplicates wrote once: {}", r.json);
    s.stop_projector().await;
}

/// Eight concurrent POSTs with one key: (status, replayed, body) each.
async fn concurrent_posts(
    router: &Router,
    uri: &str,
    body: &Value,
    key: &str,
    session: &str,
) -> Vec<(StatusCode, bool, Value)> {
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (router, uri, body, key) = (router.clone(), uri.to_string(), body.clone(), key.to_string());
        let session = session.to_string();
        tasks.push(tokio::spawn(async move {
            let headers = [("idempotency-key", key.as_str()), ("parsley-session", session.as_str())];
            let (status, h, json) = request(&router, Method::POST, &uri, &headers, Some(&body)).await;
            (status, h.contains_key("idempotency-replayed"), json)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// A batch: an order and its payment in one Kafka transaction, stamped with the session and
/// merged into it; the session reads both at once. A batch naming a topic no model receives
/// writes nothing; a batch retried with its Idempotency-Key is answered without writing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_written_in_one_transaction_and_read_back_by_its_session() {
    let mut s = Stack::new("batch", 2, "read_wait_ms = 15000").await;
    s.start_projector().await;
    let (orders, payments) = (s.names.orders.clone(), s.names.payments.clone());
    let w = s.write(&orders, "o-0", json!({"n": 0}), None).await;
    let before = open(&w.token()).past;

    let batch_key = unique("b");
    let batch = json!({"records": [
        {"topic": orders, "key": "o-1", "value": {"status": "placed"}},
        {"topic": payments, "key": "p-1", "value": {"paid": true}, "headers": {"source": "batch"}},
        {"topic": orders, "key": "o-2", "value": {"status": "placed"}},
    ]});
    let (status, h, body) = request(
        &s.router,
        Method::POST,
        "/v1/records",
        &[("parsley-session", &w.token()), ("idempotency-key", &batch_key)],
        Some(&batch),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let acked = body["records"].as_array().unwrap();
    assert_eq!(acked.len(), 3);
    assert_eq!((acked[0]["topic"].clone(), acked[1]["topic"].clone()), (json!(orders), json!(payments)));
    let token = header(&h, "parsley-session").unwrap().to_string();
    let past = open(&token).past;
    for a in acked {
        let c = channel(&s.state, a["topic"].as_str().unwrap(), a["partition"].as_u64().unwrap() as u32).await;
        assert!(past.get(&c).is_some_and(|p| p >= a["offset"].as_i64().unwrap()), "{a} merged");
    }
    assert!(before.iter().all(|(c, p)| past.get(&c).is_some_and(|q| q >= p)), "the earlier session is kept");

    // The records of a batch are concurrent (none is another's cause): one session read
    // sees all of them.
    for (key, doc) in
        [("o-1", json!({"status": "placed"})), ("p-1", json!({"paid": true})), ("o-2", json!({"status": "placed"}))]
    {
        let r = s.read(key, Some(&token)).await;
        assert_eq!(r.status, StatusCode::OK, "{key}: {}", r.json);
        assert_eq!((r.json["document"].clone(), r.json["version"].clone()), (doc, json!(1)), "{key}");
    }

    // Replayed, not written again (the retry carries the session the first attempt carried).
    let retry = [("parsley-session", w.token()), ("idempotency-key", batch_key.clone())];
    let retry: Vec<(&str, &str)> = retry.iter().map(|(a, b)| (*a, b.as_str())).collect();
    let (status, h, again) = request(&s.router, Method::POST, "/v1/records", &retry, Some(&batch)).await;
    assert_eq!((status, again), (StatusCode::CREATED, body.clone()));
    assert_eq!(header(&h, "idempotency-replayed"), Some("true"));

    // A topic no model receives: refused before anything is produced.
    let bad = json!({"records": [
        {"topic": orders, "key": "o-3", "value": {"status": "placed"}},
        {"topic": "no-such-topic", "key": "o-3", "value": {}},
    ]});
    let (status, _, problem) = request(&s.router, Method::POST, "/v1/records", &[], Some(&bad)).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{problem}");
    assert_eq!(problem["topic"], json!("no-such-topic"));
    // A hostile record: refused naming it.
    let bad = json!({"records": [{"topic": orders, "key": "", "value": 1}]});
    let (status, _, problem) = request(&s.router, Method::POST, "/v1/records", &[], Some(&bad)).await;
    assert_eq!((status, problem["field"].clone()), (StatusCode::BAD_REQUEST, json!("records[0].key")));

    let r = s.read("o-3", Some(&token)).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "nothing of the refused batch was written: {}", r.json);
    let l = s.list("", Some(&token)).await;
    let keys: Vec<&str> = l.json["documents"].as_array().unwrap().iter().map(|d| d["key"].as_str().unwrap()).collect();
    assert_eq!(keys, vec!["o-0", "o-1", "o-2", "p-1"]);
    s.stop_projector().await;
}
