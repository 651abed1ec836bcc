//! Writes whose outcome the request does not see. The produce and the recording of its
//! outcome run to the end in a task of their own, so a handler dropped mid-write (a client
//! that hangs up, a response timeout) leaves its `Idempotency-Key` answered, not claimed
//! forever. A write Kafka did not confirm in time (the broker throttling the producer) and
//! one whose gateway died mid-produce (pending, then stale) keep their key `unknown`: a
//! retry is `409 idempotency-outcome-unknown`, never a second write. A write that surely did
//! not happen — refused by librdkafka or by the broker — gives its key up. A batch dropped
//! mid-transaction does not leave its producer slot in a transaction. Every partition serves
//! read-your-writes afterwards.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use parsley::partitioner::Partitioner;
use parsley::CausalPast;
use serde_json::{json, Value};
use tower::ServiceExt as _;

use crate::support::*;

/// How long the gateway's producer lingers before sending: every write is mid-produce for
/// at least this long.
const LINGER_MS: u64 = 1500;

/// A write's answer: status, whether it was replayed, the session token, the body.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    token: Option<String>,
    json: Value,
}

/// `POST uri` with `body`, the idempotency key `key` and the session `token`.
async fn post(router: &Router, uri: &str, key: &str, token: &str, body: &Value) -> Answer {
    let req = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .header("parsley-session", token)
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap();
    let response = router.clone().oneshot(req).await.unwrap();
    let (status, replayed, token) = {
        let header = |name: &str| response.headers().get(name).map(|v| v.to_str().unwrap().to_string());
        (response.status(), header("idempotency-replayed").is_some(), header("parsley-session"))
    };
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
    Answer { status, replayed, token, json: serde_json::from_slice(&bytes).unwrap_or(Value::Null) }
}

/// A fresh session's token (keys are scoped by it: no subject here).
fn session() -> String {
    seal(CausalPast::new(), parsley_gateway::session::unix_now() + 3600)
}

/// The state of `key`'s claim, if it has one.
async fn claim_state(s: &Stack, key: &str) -> Option<String> {
    sqlx::query_scalar("SELECT state FROM parsley.idempotency_keys WHERE key = $1")
        .bind(key)
        .fetch_optional(&s.pool)
        .await
        .unwrap()
}

/// Sends `POST uri` in a task and drops it once its key is claimed (the write is then
/// mid-produce: the producer lingers), as a client hanging up does.
async fn post_and_hang_up(s: &Stack, uri: &str, key: &str, token: &str, body: &Value) {
    let request = {
        let (router, uri, key, token, body) =
            (s.router.clone(), uri.to_string(), key.to_string(), token.to_string(), body.clone());
        tokio::spawn(async move { post(&router, &uri, &key, &token, &body).await })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while claim_state(s, key).await.is_none() {
        assert!(Instant::now() < deadline, "the write never claimed its key");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(!request.is_finished(), "the write answered before the hang-up; lingering should hold it");
    request.abort();
    assert!(request.await.unwrap_err().is_cancelled());
    assert_eq!(claim_state(s, key).await.as_deref(), Some("pending"), "dropped mid-write");
}

/// Retries until the answer is no longer `409 idempotency-key-in-flight`, for at most
/// `within` (less than the claim's staleness: a claim left pending would still be in flight).
async fn retry_until_settled(
    router: &Router,
    uri: &str,
    key: &str,
    token: &str,
    body: &Value,
    within: Duration,
) -> Answer {
    let deadline = Instant::now() + within;
    loop {
        let a = post(router, uri, key, token, body).await;
        if a.status != StatusCode::CONFLICT
            || a.json["type"] != json!("https://parsley.dev/problems/idempotency-key-in-flight")
        {
            return a;
        }
        assert!(Instant::now() < deadline, "the dropped write's key is still in flight after {within:?}: {}", a.json);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_dropped_mid_produce_is_recorded_and_its_retry_replays_it() {
    // Staleness is twice produce_timeout_ms: 20 s, far beyond the retries below.
    let mut s = Stack::with_config("hangup", 2, "produce_timeout_ms = 10000\nread_wait_ms = 15000", |_, c| {
        c.kafka.properties.insert("linger.ms".into(), LINGER_MS.to_string());
    })
    .await;
    s.start_projector().await;
    let uri = format!("/v1/topics/{}/records", s.names.orders);
    let (key, token) = (unique("hangup"), session());
    let body = json!({"key": "order-1", "value": {"n": 1}});
    post_and_hang_up(&s, &uri, &key, &token, &body).await;

    // The write ran on and recorded its acknowledgement: the retry replays it.
    let again = retry_until_settled(&s.router, &uri, &key, &token, &body, Duration::from_secs(8)).await;
    assert_eq!((again.status, again.replayed), (StatusCode::CREATED, true), "{}", again.json);
    assert_eq!(claim_state(&s, &key).await.as_deref(), Some("done"));

    // Written once: the document's version is 1.
    let r = s.read("order-1", again.token.as_deref()).await;
    assert_eq!((r.status, r.json["version"].clone()), (StatusCode::OK, json!(1)), "{}", r.json);
    every_partition_reads_its_writes(&s, Partitioner::Murmur2, 2, |k| json!({"probe": k})).await;
    s.stop_projector().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_dropped_mid_transaction_run_to_the_end_and_leave_every_slot_usable() {
    let mut s = Stack::with_config("batchdrop", 2, "produce_timeout_ms = 10000\nread_wait_ms = 15000", |_, c| {
        c.kafka.properties.insert("linger.ms".into(), LINGER_MS.to_string());
    })
    .await;
    s.start_projector().await;
    let token = session();
    let batch = |i: usize| {
        json!({"records": [
            {"topic": s.names.orders, "key": format!("b{i}"), "value": {"order": i}},
            {"topic": s.names.payments, "key": format!("p{i}"), "value": {"paid": i}},
        ]})
    };
    // As many dropped batches as the gateway has transactional producers.
    let keys: Vec<String> =
        (0..parsley_gateway::transactions::TRANSACTIONAL_PRODUCERS).map(|_| unique("batch")).collect();
    for (i, key) in keys.iter().enumerate() {
        post_and_hang_up(&s, "/v1/records", key, &token, &batch(i)).await;
    }
    for (i, key) in keys.iter().enumerate() {
        let again =
            retry_until_settled(&s.router, "/v1/records", key, &token, &batch(i), Duration::from_secs(30)).await;
        assert_eq!((again.status, again.replayed), (StatusCode::CREATED, true), "batch {i}: {}", again.json);
        // Committed once, whole: both documents, each at version 1.
        for (key, document) in [(format!("b{i}"), json!({"order": i})), (format!("p{i}"), json!({"paid": i}))] {
            let r = s.read(&key, again.token.as_deref()).await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.json);
            assert_eq!((r.json["document"].clone(), r.json["version"].clone()), (document, json!(1)), "batch {i}");
        }
    }
    // Every slot takes a new batch.
    for i in 10..10 + keys.len() {
        let a = post(&s.router, "/v1/records", &unique("next"), &token, &batch(i)).await;
        assert_eq!((a.status, a.replayed), (StatusCode::CREATED, false), "batch {i}: {}", a.json);
    }
    every_partition_reads_its_writes(&s, Partitioner::Murmur2, 2, |k| json!({"probe": k})).await;
    s.stop_projector().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_gateway_died_mid_produce_is_never_written_twice() {
    // The gateway binary, killed with -9 while its producer lingers on a keyed write: its
    // claim stays pending, and once stale (twice produce_timeout_ms: 4 s) a retry on another
    // gateway is told the outcome is unknown instead of writing a second copy.
    let s = Stack::new("died", 2, "produce_timeout_ms = 2000").await;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = parsley_testkit::ScratchDir::new("died");
    let config = dir.join("parsley.toml");
    std::fs::write(
        &config,
        format!(
            "[kafka]\nbootstrap = {:?}\n[kafka.properties]\n\"linger.ms\" = \"{LINGER_MS}\"\n[database]\nurl = {:?}\n\
             [[models]]\nname = {:?}\ntopics = [{{ name = {:?} }}, {{ name = {:?}, apply = \"merge\" }}]\n\
             [gateway]\naccess = \"open\"\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:0\"\n\
             produce_timeout_ms = 2000\n",
            bootstrap(),
            database_url(),
            s.names.model,
            s.names.orders,
            s.names.payments
        ),
    )
    .unwrap();
    use base64::Engine as _;
    let keys = format!("it:{}", base64::engine::general_purpose::STANDARD.encode([0x42u8; 32]));
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_parsley-gateway"));
    for (var, _) in std::env::vars_os() {
        if var.to_string_lossy().starts_with("PARSLEY_") {
            command.env_remove(var);
        }
    }
    let mut gateway = command
        .args(["--config", config.to_str().unwrap()])
        .env("PARSLEY_TOKEN_KEYS", keys)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("starting parsley-gateway");
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(address).await.is_err() {
        assert!(Instant::now() < deadline, "the gateway binary did not listen");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let (key, token) = (unique("died"), session());
    let body = json!({"key": "order-1", "value": {"n": 1}});
    let text = serde_json::to_string(&body).unwrap();
    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!(
        "POST /v1/topics/{}/records HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Idempotency-Key: {key}\r\nParsley-Session: {token}\r\nContent-Length: {}\r\n\r\n{text}",
        s.names.orders,
        text.len()
    );
    tokio::io::AsyncWriteExt::write_all(&mut socket, request.as_bytes()).await.unwrap();
    while claim_state(&s, &key).await.is_none() {
        assert!(Instant::now() < deadline, "the write never claimed its key");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    gateway.kill().unwrap();
    gateway.wait().unwrap();
    assert_eq!(claim_state(&s, &key).await.as_deref(), Some("pending"), "killed mid-write");

    let uri = format!("/v1/topics/{}/records", s.names.orders);
    let a = post(&s.router, &uri, &key, &token, &body).await;
    assert_eq!(a.json["type"], json!("https://parsley.dev/problems/idempotency-key-in-flight"), "{}", a.json);
    tokio::time::sleep(Duration::from_millis(4200)).await;
    for _ in 0..2 {
        let a = post(&s.router, &uri, &key, &token, &body).await;
        assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.json);
        assert_eq!(a.json["type"], json!("https://parsley.dev/problems/idempotency-outcome-unknown"), "{}", a.json);
        assert!(a.json["detail"].as_str().unwrap().contains("new key"), "{}", a.json);
    }
    // A new key writes.
    let a = post(&s.router, &uri, &unique("fresh"), &token, &body).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.json);
}

/// Sets (or, with `None`, removes) a produce quota of `bytes_per_second` for the Kafka
/// clients named `client_id`, with the broker's own configuration tool.
fn produce_quota(client_id: &str, bytes_per_second: Option<u32>) {
    let libs = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.local/kafka/libs");
    assert!(libs.is_dir(), "{} is missing: `make services-up` installs the broker", libs.display());
    let change = match bytes_per_second {
        Some(rate) => vec!["--add-config".to_string(), format!("producer_byte_rate={rate}")],
        None => vec!["--delete-config".to_string(), "producer_byte_rate".to_string()],
    };
    let out = std::process::Command::new("java")
        .arg("-cp")
        .arg(format!("{}/*", libs.display()))
        .args(["kafka.admin.ConfigCommand", "--bootstrap-server", &bootstrap(), "--alter"])
        .args(&change)
        .args(["--entity-type", "clients", "--entity-name", client_id])
        .output()
        .expect("running the broker's ConfigCommand (java)");
    assert!(out.status.success(), "ConfigCommand: {}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_kafka_did_not_confirm_in_time_keeps_its_key_unknown() {
    // The broker throttles the gateway's producer (a produce quota of one byte a second on
    // its client.id): a write after the first waits past the produce timeout, and Kafka
    // confirms it neither way.
    let client_id = unique("throttled");
    let s = Stack::with_config("throttled", 1, "produce_timeout_ms = 1500", |_, c| {
        c.kafka.properties.insert("client.id".into(), client_id.clone());
    })
    .await;
    let blocking_id = client_id.clone();
    tokio::task::spawn_blocking(move || produce_quota(&blocking_id, Some(1))).await.unwrap();
    let uri = format!("/v1/topics/{}/records", s.names.orders);
    let token = session();
    let mut unknown = None;
    for i in 0..6 {
        let (key, body) =
            (unique("throttled"), json!({"key": format!("k{i}"), "value": {"n": i, "pad": "x".repeat(500)}}));
        let a = post(&s.router, &uri, &key, &token, &body).await;
        if a.status == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(a.json["type"], json!("https://parsley.dev/problems/write-failed"), "{}", a.json);
            assert_eq!(a.json["outcome"], json!("unknown"), "a write not confirmed in time: {}", a.json);
            unknown = Some((key, body));
            break;
        }
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.json);
    }
    let blocking_id = client_id.clone();
    tokio::task::spawn_blocking(move || produce_quota(&blocking_id, None)).await.unwrap();
    let (key, body) = unknown.expect("no write was held past the produce timeout by the quota");
    assert_eq!(claim_state(&s, &key).await.as_deref(), Some("unknown"));

    // The retry, on this gateway and on an unthrottled one: never written a second time.
    let (other, _stop) = s.other_gateway("").await;
    for router in [&s.router, &other] {
        let a = post(router, &uri, &key, &token, &body).await;
        assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.json);
        assert_eq!(a.json["type"], json!("https://parsley.dev/problems/idempotency-outcome-unknown"), "{}", a.json);
        assert!(a.json["detail"].as_str().unwrap().contains("new key"), "{}", a.json);
    }
    assert_eq!(claim_state(&s, &key).await.as_deref(), Some("unknown"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_the_broker_refused_gives_its_key_up() {
    // The broker refuses the record for what it is (over the topic's max.message.bytes):
    // surely not written, so the key is free and the retry writes once the topic takes it.
    use rdkafka::admin::{AlterConfig, ResourceSpecifier};
    let s = Stack::new("refused", 1, "").await;
    let set_max_bytes = |n: &'static str| {
        let topic = s.names.orders.clone();
        async move {
            let change = AlterConfig::new(ResourceSpecifier::Topic(&topic)).set("max.message.bytes", n);
            let admin = parsley_testkit::admin();
            let altered = admin.alter_configs(&[change], &parsley_testkit::admin_options()).await.unwrap();
            assert!(altered.iter().all(Result::is_ok), "{altered:?}");
            // The broker applies the change from its metadata log: wait until it says so.
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let described = admin
                    .describe_configs(&[ResourceSpecifier::Topic(&topic)], &parsley_testkit::admin_options())
                    .await
                    .unwrap();
                let now = described
                    .into_iter()
                    .flatten()
                    .find_map(|r| r.get("max.message.bytes").and_then(|e| e.value.clone()));
                if now.as_deref() == Some(n) {
                    break;
                }
                assert!(Instant::now() < deadline, "max.message.bytes is still {now:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    set_max_bytes("200").await;
    let uri = format!("/v1/topics/{}/records", s.names.orders);
    let (key, token) = (unique("refused"), session());
    let body = json!({"key": "k", "value": {"blob": "x".repeat(2000)}});
    let a = post(&s.router, &uri, &key, &token, &body).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", a.json);
    assert_eq!(claim_state(&s, &key).await, None, "the key is given up");

    set_max_bytes("1048588").await;
    let a = post(&s.router, &uri, &key, &token, &body).await;
    assert_eq!((a.status, a.replayed), (StatusCode::CREATED, false), "the retry writes: {}", a.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_surely_did_not_happen_gives_its_key_up() {
    // A value over librdkafka's message.max.bytes (1 MB) but within the gateway's body
    // limit: refused before it leaves the gateway, so its key is free for the retry.
    let s = Stack::new("notwritten", 1, "max_body_bytes = 3000000").await;
    let uri = format!("/v1/topics/{}/records", s.names.orders);
    let (key, token) = (unique("big"), session());
    let body = json!({"key": "big", "value": {"blob": "x".repeat(1_500_000)}});
    for attempt in 0..2 {
        let a = post(&s.router, &uri, &key, &token, &body).await;
        assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE, "attempt {attempt}: {}", a.json);
        assert_eq!(claim_state(&s, &key).await, None, "attempt {attempt}: the key is given up");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_started_before_the_first_write_makes_its_retry_safe() {
    let s = Stack::new("started", 1, "").await;
    let started = s.send(Method::POST, "/v1/sessions", None, None).await;
    assert_eq!(started.status, StatusCode::OK, "{}", started.json);
    let token = started.token();
    let session = open(&token);
    assert!(session.past.is_empty());
    assert_eq!(started.json["expires_at"].as_u64(), Some(session.expires_at));

    // The first write and its retry carry the session's token: one record.
    let uri = format!("/v1/topics/{}/records", s.names.orders);
    let (key, body) = (unique("first"), json!({"key": "k", "value": {"n": 1}}));
    let first = post(&s.router, &uri, &key, &token, &body).await;
    assert_eq!((first.status, first.replayed), (StatusCode::CREATED, false), "{}", first.json);
    let retry = post(&s.router, &uri, &key, &token, &body).await;
    assert_eq!((retry.status, retry.replayed), (StatusCode::CREATED, true), "{}", retry.json);
    assert_eq!(retry.json, first.json);

    // A valid token is the same session, re-sealed; a bad one is refused by name.
    let again = s.send(Method::POST, "/v1/sessions", Some(&first.token.clone().unwrap()), None).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.json);
    assert_eq!(open(&again.token()).past, open(first.token.as_deref().unwrap()).past);
    assert_eq!(open(&again.token()).issued_at, session.issued_at);
    let bad = s.send(Method::POST, "/v1/sessions", Some("AQ-not-a-token"), None).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.json);
}
