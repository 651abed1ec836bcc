//! The hostile-input suite: requests and Kafka records a careless or malicious client can
//! send, each against the real stack — the projector running on real Kafka and Postgres, the
//! gateway serving on a real TCP listener, spoken to byte by byte (so header names, paths and
//! bodies can hold anything). Every case asserts the exact answer, and every group then
//! proves that each partition of the model still serves read-your-writes — or, for a
//! deliberate poison record, that its task is refused by name and serves again after an
//! operator's `skip`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parsley::murmur2::partition_for_key;
use parsley::{CausalPast, ChannelId, TopicId};
use parsley_gateway::{Gateway, GatewayConfig};
use parsley_projector::metrics::{Metrics, METRICS};
use parsley_projector::{DocumentProjection, ModelProjector};
use parsley_settings::config::Config;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{json, Value};
use sqlx::{PgPool, Row as _};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::support::*;

const PARTITIONS: u32 = 2;

/// Request headers as raw bytes: name, value.
type RawHeaders<'a> = Vec<(&'a [u8], &'a [u8])>;
const PROBLEM: &str = "https://parsley.dev/problems/";

/// One raw HTTP answer.
#[derive(Debug)]
struct Raw {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    fn problem(&self) -> String {
        self.json()["type"].as_str().unwrap_or("").trim_start_matches(PROBLEM).to_string()
    }

    fn describe(&self) -> String {
        format!("{} {}", self.status, String::from_utf8_lossy(&self.body))
    }
}

/// Builds an HTTP/1.1 request of arbitrary bytes: `Connection: close` and a
/// `Content-Length` for the body are added.
fn request(method: &str, target: &[u8], headers: &[(&[u8], &[u8])], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(target);
    out.extend_from_slice(b" HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n");
    for (name, value) in headers {
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    if !body.is_empty() || method == "POST" {
        out.extend_from_slice(
            format!("content-type: application/json\r\ncontent-length: {}\r\n", body.len()).as_bytes(),
        );
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

/// Sends `bytes` and reads the answer until the server closes the connection. `None`: the
/// server closed without answering.
async fn exchange(addr: SocketAddr, bytes: &[u8]) -> Option<Raw> {
    let mut stream = TcpStream::connect(addr).await.expect("connecting to the gateway");
    stream.write_all(bytes).await.expect("sending a request");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(40), stream.read_to_end(&mut answer)).await;
    match read {
        Ok(Ok(_)) => {}
        // A reset after the answer was written still leaves the answer readable above.
        Ok(Err(_)) if !answer.is_empty() => {}
        Ok(Err(_)) => return None,
        Err(_) => panic!("the gateway neither answered nor closed within 40 s"),
    }
    parse(&answer)
}

fn parse(answer: &[u8]) -> Option<Raw> {
    let end = answer.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&answer[..end]).to_string();
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':').map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string())))
        .collect();
    let mut body = answer[end + 4..].to_vec();
    if headers.iter().any(|(n, v)| n == "transfer-encoding" && v.contains("chunked")) {
        body = dechunk(&body);
    }
    Some(Raw { status, headers, body })
}

fn dechunk(mut bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = bytes.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&bytes[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        out.extend_from_slice(&bytes[eol + 2..eol + 2 + size]);
        bytes = &bytes[eol + 2 + size + 2..];
    }
    out
}

/// The projector (library API, on its own tokio task) and a gateway serving on a real
/// listener, over one model receiving `orders` (replace) and `payments` (merge).
struct BlackBox {
    names: Names,
    config: Config,
    pool: PgPool,
    addr: SocketAddr,
    producer: FutureProducer,
    stop_gateway: watch::Sender<bool>,
    projector: Option<(watch::Sender<bool>, JoinHandle<anyhow::Result<()>>)>,
}

impl BlackBox {
    async fn start(prefix: &str, gateway: &str) -> BlackBox {
        let names = Names::new(prefix);
        create_topics(&[&names.orders, &names.payments], PARTITIONS as i32).await;
        let settings = format!("listen = \"127.0.0.1:0\"\nadmin_listen = \"\"\nread_wait_ms = 3000\n{gateway}");
        let config = config(&names, &settings);
        let pool = pool().await;
        let mut b = BlackBox {
            names,
            config: config.clone(),
            pool,
            addr: "127.0.0.1:1".parse().unwrap(),
            producer: producer(),
            stop_gateway: watch::channel(false).0,
            projector: None,
        };
        b.start_projector().await;
        let gateway = Gateway::new(GatewayConfig::with_keys(config, ring()).unwrap()).unwrap();
        let listener = gateway.bind().await.unwrap();
        b.addr = listener.local_addr().unwrap();
        let (stop, shutdown) = watch::channel(false);
        tokio::spawn(async move {
            if let Err(e) = gateway.serve(listener, shutdown).await {
                panic!("the gateway stopped: {e:#}");
            }
        });
        b.stop_gateway = stop;
        b
    }

    async fn start_projector(&mut self) {
        let model = &self.config.models[0];
        let projector = ModelProjector::start(
            &self.config,
            model,
            self.pool.clone(),
            Arc::new(DocumentProjection::from_model(model)),
            Metrics::new(METRICS),
        )
        .await
        .unwrap_or_else(|e| panic!("starting the projector: {e:#}"));
        assert!(projector.refusal().is_none(), "the model was refused: {:?}", projector.refusal());
        let (stop, shutdown) = watch::channel(false);
        self.projector = Some((stop, tokio::spawn(projector.run(shutdown))));
    }

    fn orders_uri(&self) -> Vec<u8> {
        format!("/v1/topics/{}/records", self.names.orders).into_bytes()
    }

    fn document_uri(&self, key: &[u8]) -> Vec<u8> {
        let mut uri = format!("/v1/models/{}/documents/", self.names.model).into_bytes();
        uri.extend_from_slice(key);
        uri
    }

    fn collection_uri(&self, query: &[u8]) -> Vec<u8> {
        let mut uri = format!("/v1/models/{}/documents", self.names.model).into_bytes();
        uri.extend_from_slice(query);
        uri
    }

    async fn send(&self, bytes: Vec<u8>) -> Raw {
        exchange(self.addr, &bytes).await.expect("the gateway closed the connection without an answer")
    }

    /// A write of raw body bytes to `orders`.
    async fn post(&self, body: &[u8], headers: &[(&[u8], &[u8])]) -> Raw {
        self.send(request("POST", &self.orders_uri(), headers, body)).await
    }

    /// Asserts a problem answer: status and problem type.
    #[track_caller]
    fn refused(&self, what: &str, raw: &Raw, status: u16, kind: &str) {
        assert_eq!((raw.status, raw.problem().as_str()), (status, kind), "{what}: {}", raw.describe());
        assert_eq!(raw.header("content-type"), Some("application/problem+json"), "{what}");
    }

    /// Every partition still serves read-your-writes: a write of a fresh key on each
    /// partition, then a read of it with the session the write returned.
    async fn serves_every_partition(&self, after: &str) {
        let base = unique("ryw");
        for p in 0..PARTITIONS {
            let key = key_on(&base, p);
            let body = serde_json::to_vec(&json!({"key": key, "value": {"after": after}})).unwrap();
            let w = self.post(&body, &[]).await;
            assert_eq!(w.status, 201, "after {after}: write on partition {p}: {}", w.describe());
            let token = w.header("parsley-session").expect("a write returns a token").to_string();
            // A 503 is an allowed answer (never a stale read), so a task that is catching up
            // (just after a skip, say) is given time; what must come is the document.
            let deadline = Instant::now() + Duration::from_secs(45);
            loop {
                let get =
                    request("GET", &self.document_uri(key.as_bytes()), &[(b"parsley-session", token.as_bytes())], b"");
                let r = self.send(get).await;
                if r.status == 503 && Instant::now() < deadline {
                    continue;
                }
                assert_eq!(r.status, 200, "after {after}: read-your-writes on partition {p}: {}", r.describe());
                assert_eq!(r.json()["document"], json!({"after": after}), "after {after}");
                break;
            }
        }
    }

    /// Waits until task `task` is refused with `reason`, and returns the row's diagnosis.
    async fn refused_by_name(&self, task: u32, reason: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let row = sqlx::query(
                "SELECT status, refusal_reason, refusal_diagnosis FROM parsley.tasks WHERE model = $1 AND task = $2",
            )
            .bind(&self.names.model)
            .bind(task as i32)
            .fetch_optional(&self.pool)
            .await
            .unwrap();
            if let Some(row) = row {
                let status: String = row.get(0);
                let got: Option<String> = row.get(1);
                if status == "refused" && got.as_deref() == Some(reason) {
                    return row.get::<Option<String>, _>(2).unwrap_or_default();
                }
                assert!(
                    status != "refused" || got.as_deref() == Some(reason),
                    "task {task} refused {got:?}, expected {reason}"
                );
            }
            assert!(Instant::now() < deadline, "task {task} was not refused {reason} within 60 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A read of a key on `task`'s partition, with a session that wrote after the poison,
    /// answers 503 naming the refusal: never a stale read.
    async fn gated_by_refusal(&self, task: u32, reason: &str) {
        let key = key_on(&unique("gated"), task);
        let body = serde_json::to_vec(&json!({"key": key, "value": 1})).unwrap();
        let w = self.post(&body, &[]).await;
        assert_eq!(w.status, 201, "{}", w.describe());
        let token = w.header("parsley-session").unwrap().to_string();
        let get = request("GET", &self.document_uri(key.as_bytes()), &[(b"parsley-session", token.as_bytes())], b"");
        let r = self.send(get).await;
        assert_eq!(r.status, 503, "{}", r.describe());
        assert!(r.describe().contains(reason), "the 503 names the refusal: {}", r.describe());
    }

    /// The ID the projector recorded for topic `name` of the model.
    async fn topic_id(&self, name: &str) -> TopicId {
        let id: uuid::Uuid =
            sqlx::query_scalar("SELECT topic_id FROM parsley.topics WHERE model = $1 AND topic_name = $2")
                .bind(&self.names.model)
                .bind(name)
                .fetch_one(&self.pool)
                .await
                .expect("the projector recorded the model's topics");
        TopicId::from_bytes(*id.as_bytes())
    }

    /// Skips one record as an operator would, through the projector's skip command.
    async fn skip(&self, topic: &str, partition: u32, position: i64) {
        let mut command = std::process::Command::new(projector_binary());
        command
            .args([
                "skip",
                "--model",
                &self.names.model,
                "--topic",
                topic,
                "--partition",
                &partition.to_string(),
                "--position",
                &position.to_string(),
                "--reason",
                "hostile-input suite: a deliberate poison record",
            ])
            .env("PARSLEY_DATABASE_URL", database_url())
            .env("PARSLEY_KAFKA_BOOTSTRAP", bootstrap())
            .env("PARSLEY_CONFIG", self.config_file());
        let out = tokio::task::spawn_blocking(move || command.output())
            .await
            .unwrap()
            .expect("running parsley-projector skip");
        let _ = std::fs::remove_file(self.config_file_path());
        assert!(
            out.status.success(),
            "skip failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn config_file_path(&self) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("{}.toml", self.names.model))
    }

    /// The configuration as a file, for the projector's command line (removed once the
    /// command ran).
    fn config_file(&self) -> String {
        let path = self.config_file_path();
        let text = format!(
            "[kafka]\nbootstrap = {:?}\n[database]\nurl = {:?}\n[[models]]\nname = {:?}\ntopics = [{{ name = {:?} }}, {{ name = {:?}, apply = \"merge\" }}]\n",
            bootstrap(),
            database_url(),
            self.names.model,
            self.names.orders,
            self.names.payments
        );
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    }
}

impl Drop for BlackBox {
    fn drop(&mut self) {
        let _ = self.stop_gateway.send(true);
        if let Some((stop, _)) = &self.projector {
            let _ = stop.send(true);
        }
    }
}

/// The projector binary beside this test binary (`cargo test --workspace` builds it).
fn projector_binary() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let bin = dir.join("parsley-projector");
    assert!(bin.exists(), "{} is missing: build the workspace (`cargo build -p parsley-projector`)", bin.display());
    bin
}

/// A key starting with `base` that the murmur2 rule places on `partition`.
fn key_on(base: &str, partition: u32) -> String {
    (0..).map(|i| format!("{base}-{i}")).find(|k| partition_for_key(k.as_bytes(), PARTITIONS) == partition).unwrap()
}

fn body(text: &str) -> Vec<u8> {
    text.as_bytes().to_vec()
}

/// Write bodies: what can never be stored is refused at the door with the field named,
/// and nothing refused reaches Kafka.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_write_bodies_are_refused_at_the_door() {
    let b = BlackBox::start("hostile-body", "max_body_bytes = 65536").await;
    let deep = format!("{{\"key\":\"k\",\"value\":{}1{}}}", "[".repeat(5000), "]".repeat(5000));
    let long_key = format!("{{\"key\":\"{}\",\"value\":1}}", "k".repeat(1025));
    let huge = format!("{{\"key\":\"k\",\"value\":\"{}\"}}", "x".repeat(70_000));
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("NUL in the key", body(r#"{"key":"a\u0000b","value":1}"#), 400, "invalid-body"),
        ("NUL in a value string", body(r#"{"key":"k","value":{"v":"x\u0000y"}}"#), 400, "invalid-body"),
        ("NUL in an object key", body(r#"{"key":"k","value":{"a\u0000":1}}"#), 400, "invalid-body"),
        ("NUL deep in an array", body(r#"{"key":"k","value":[1,[2,["\u0000"]]]}"#), 400, "invalid-body"),
        ("a lone high surrogate in the key", body(r#"{"key":"\ud800","value":1}"#), 400, "invalid-body"),
        ("a lone low surrogate in the value", body(r#"{"key":"k","value":"\udc00"}"#), 400, "invalid-body"),
        ("duplicate keys in the value", body(r#"{"key":"k","value":{"a":1,"a":2}}"#), 400, "invalid-body"),
        ("duplicate keys nested", body(r#"{"key":"k","value":{"x":{"b":1,"b":1}}}"#), 400, "invalid-body"),
        ("the key field twice", body(r#"{"key":"k","key":"j","value":1}"#), 400, "invalid-body"),
        ("a key over max_key_bytes", long_key.into_bytes(), 400, "invalid-body"),
        ("an empty body", body(""), 400, "invalid-body"),
        ("not JSON", body("key=k&value=1"), 400, "invalid-body"),
        ("truncated JSON", body(r#"{"key":"k","value":{"a":"#), 400, "invalid-body"),
        ("invalid UTF-8", b"{\"key\":\"\xff\xfe\",\"value\":1}".to_vec(), 400, "invalid-body"),
        ("nesting 5000 deep", deep.into_bytes(), 400, "invalid-body"),
        ("a key that is a number", body(r#"{"key":7,"value":1}"#), 400, "invalid-body"),
        ("an unknown field", body(r#"{"key":"k","value":1,"partition":0}"#), 400, "invalid-body"),
        (
            "a header value that is not a string",
            body(r#"{"key":"k","value":1,"headers":{"h":{}}}"#),
            400,
            "invalid-body",
        ),
        (
            "the reserved causes header",
            body(r#"{"key":"k","value":1,"headers":{"parsley.causes":"AQA"}}"#),
            400,
            "reserved-header",
        ),
        (
            "a reserved header in capitals",
            body(r#"{"key":"k","value":1,"headers":{"PARSLEY.x":"1"}}"#),
            400,
            "reserved-header",
        ),
        ("a body over max_body_bytes", huge.into_bytes(), 413, "body-too-large"),
    ];
    for (what, bytes, status, kind) in &cases {
        let raw = b.post(bytes, &[]).await;
        b.refused(what, &raw, *status, kind);
    }
    b.serves_every_partition("hostile write bodies").await;

    // Accepted, and harmless: a header name whose 8th byte starts a multibyte character (it
    // once panicked the reserved-prefix check), and numbers no float holds.
    let w = b.post(&body(r#"{"key":"mb","value":1,"headers":{"abcdefgé":"v"}}"#), &[]).await;
    assert_eq!(w.status, 201, "{}", w.describe());
    let w = b.post(&body(r#"{"key":"big","value":{"b":1,"a":12345678901234567890123}}"#), &[]).await;
    assert_eq!(w.status, 201, "{}", w.describe());
    let key_at_limit = "k".repeat(1024);
    let w = b.post(format!(r#"{{"key":"{key_at_limit}","value":{{"at":"limit"}}}}"#).as_bytes(), &[]).await;
    assert_eq!(w.status, 201, "a key of exactly max_key_bytes: {}", w.describe());
    let token = w.header("parsley-session").unwrap().to_string();
    let r = b
        .send(request("GET", &b.document_uri(key_at_limit.as_bytes()), &[(b"parsley-session", token.as_bytes())], b""))
        .await;
    assert_eq!((r.status, r.json()["document"].clone()), (200, json!({"at": "limit"})), "{}", r.describe());
    assert_eq!(cases.len() + 3, 24);
    b.serves_every_partition("accepted odd writes").await;
}

/// Paths, queries and request heads: a client error is a 4xx, never an outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_paths_queries_and_heads_are_client_errors() {
    let b = BlackBox::start("hostile-path", "max_header_bytes = 8192").await;
    let long_key = "k".repeat(5000);
    let gets: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("a NUL in a key", b.document_uri(b"a%00b"), 400, "invalid-key"),
        ("a key that is not UTF-8", b.document_uri(b"%FF%FE"), 400, "invalid-key"),
        ("a key over max_key_bytes", b.document_uri(long_key.as_bytes()), 400, "invalid-key"),
        ("a NUL cursor", b.collection_uri(b"?after=%00"), 400, "invalid-query"),
        ("a cursor that is not UTF-8", b.collection_uri(b"?after=%C3%28"), 400, "invalid-query"),
        ("a negative limit", b.collection_uri(b"?limit=-1"), 400, "invalid-query"),
        ("a limit that is no number", b.collection_uri(b"?limit=abc"), 400, "invalid-query"),
        ("a limit past u64", b.collection_uri(b"?limit=99999999999999999999999"), 400, "invalid-query"),
        ("an unknown parameter", b.collection_uri(b"?page=2"), 400, "invalid-query"),
        ("a model name with a NUL", b"/v1/models/sh%00op/documents/x".to_vec(), 404, "unknown-model"),
    ];
    for (what, uri, status, kind) in &gets {
        let raw = b.send(request("GET", uri, &[], b"")).await;
        b.refused(what, &raw, *status, kind);
    }
    let raw = b.send(request("POST", b"/v1/topics/or%00ders/records", &[], br#"{"key":"k","value":1}"#)).await;
    b.refused("a topic name with a NUL", &raw, 404, "unknown-topic");

    // Request heads the HTTP layer refuses before any handler runs; the server goes on.
    let big = "x".repeat(20_000);
    let raw = b.send(request("GET", &b.collection_uri(b""), &[(b"x-big", big.as_bytes())], b"")).await;
    assert_eq!(raw.status, 431, "a header section over max_header_bytes: {}", raw.describe());
    let garbage = exchange(b.addr, b"GARBAGE\r\n\r\n").await;
    assert!(garbage.as_ref().is_none_or(|r| r.status == 400), "a garbage request line: {garbage:?}");
    let raw = b.send(request("GET", &b.collection_uri(b""), &[(b"bad\x01name", b"v")], b"")).await;
    assert_eq!(raw.status, 400, "a header name with a control byte: {}", raw.describe());
    assert_eq!(gets.len() + 4, 14);
    b.serves_every_partition("hostile paths").await;
}

/// A request head that never ends is cut off after the header-read timeout instead of
/// holding a connection forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_request_head_is_cut_off() {
    let b = BlackBox::start("hostile-slow", "header_read_timeout_ms = 500").await;
    let mut stream = TcpStream::connect(b.addr).await.unwrap();
    stream.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-slow: ").await.unwrap();
    let started = Instant::now();
    let mut sink = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut sink)).await;
    assert!(closed.is_ok(), "the connection was still open after 10 s");
    assert!(started.elapsed() < Duration::from_secs(5), "closed only after {:?}", started.elapsed());
    b.serves_every_partition("a slow head").await;
}

/// Tokens: every damaged, forged or oversized session is refused with its type, never read
/// as an empty session.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_tokens_are_refused_with_their_type() {
    let b = BlackBox::start("hostile-token", "token_max_encoded_len = 4096").await;
    let far = parsley_gateway::session::unix_now() + 3600;
    let valid = seal(CausalPast::new(), far);
    let mut tampered = valid.clone().into_bytes();
    let i = tampered.len() / 2;
    tampered[i] = if tampered[i] == b'A' { b'B' } else { b'A' };
    let expired = seal(CausalPast::new(), 10);
    let orders: TopicId = b.topic_id(&b.names.orders).await;
    let ahead = seal(CausalPast::from_pairs([(ChannelId::new(orders, 0), 1_000_000)]), far);
    let oversized = "A".repeat(6000);
    let uri = b.collection_uri(b"");
    let cases: Vec<(&str, RawHeaders<'_>, u16, &str)> = vec![
        ("garbage", vec![(b"parsley-session", b"not a token!")], 400, "token-malformed"),
        ("too short", vec![(b"parsley-session", b"AQ")], 400, "token-malformed"),
        ("tampered", vec![(b"parsley-session", &tampered)], 400, "token-invalid"),
        ("expired", vec![(b"parsley-session", expired.as_bytes())], 400, "token-expired"),
        // (Several session headers of one subject are joined, not refused: tests/it/joined.rs.)
        ("an empty element in a list", vec![(b"parsley-session", b",")], 400, "token-malformed"),
        ("bytes that are not text", vec![(b"parsley-session", b"\xff\xfe\xfd")], 400, "token-malformed"),
        ("longer than the token limit", vec![(b"parsley-session", oversized.as_bytes())], 400, "token-malformed"),
        ("ahead of the log", vec![(b"parsley-session", ahead.as_bytes())], 400, "token-ahead-of-log"),
    ];
    for (what, headers, status, kind) in &cases {
        let raw = b.send(request("GET", &uri, headers, b"")).await;
        b.refused(what, &raw, *status, kind);
        let raw = b.post(br#"{"key":"t","value":1}"#, headers).await;
        b.refused(what, &raw, *status, kind);
    }
    assert_eq!(cases.len(), 8);
    b.serves_every_partition("hostile tokens").await;
}

/// Kafka records no gateway would write: read without trusting them, delivered when they
/// are harmless, refused by name when they are poison — and after an operator's `skip`, the
/// partition serves again without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_kafka_records_never_wedge_a_partition() {
    let b = BlackBox::start("hostile-kafka", "").await;
    let orders = b.names.orders.clone();
    let orders_id = b.topic_id(&orders).await;

    // Harmless: a header whose name is not UTF-8, a value at the broker's size limit region.
    raw_header_record(&orders, 0, b"nu8", b"{\"n\":1}", b"\xff\xfename", b"v").await;
    let big = format!("{{\"blob\":\"{}\"}}", "b".repeat(900_000));
    // (On partition 0: murmur2 places "big" there, as every keyed record must be.)
    produce(&b.producer, &orders, 0, "big", big.as_bytes(), None).await;
    b.serves_every_partition("harmless Kafka records").await;

    // Poison, one at a time on task 1 (where murmur2 places the poisons' keys): refused by
    // name, a read behind it is a 503 naming the refusal, skip, and the partition serves
    // again.
    let damaged: &[u8] = &[0x01, 0x01, 0x00];
    let mut at_max = vec![0x01, 0x01];
    at_max.extend_from_slice(orders_id.as_bytes());
    at_max.extend_from_slice(&[0x01, 0x00]);
    at_max.extend_from_slice(&i64::MAX.to_be_bytes());
    let over_budget = CausalPast::from_pairs((0..30_000u32).map(|p| (ChannelId::new(orders_id, p), 1))).encode();
    let poisons: Vec<(&str, Poison, &str)> = vec![
        ("a value that is not JSON", Poison::value(b"not json"), "PROJECTION_REJECTED"),
        ("a NUL in the key", Poison::keyed("a\0b", b"1"), "PROJECTION_REJECTED"),
        ("a NUL escape in the value", Poison::value(br#"{"a":"\u0000"}"#), "PROJECTION_REJECTED"),
        ("no key", Poison::keyless(b"1"), "PROJECTION_REJECTED"),
        ("damaged causes", Poison::causes(damaged.to_vec()), "UNDECODABLE_METADATA"),
        ("a cause at i64::MAX", Poison::causes(at_max), "UNDECODABLE_METADATA"),
        ("causes over the budget", Poison::causes(over_budget), "METADATA_BUDGET_EXCEEDED"),
        ("two causes headers", Poison::two_causes(), "UNDECODABLE_METADATA"),
        ("a key murmur2 places on another partition", Poison::keyed("misplaced", b"1"), "KEY_PARTITION_MISMATCH"),
    ];
    let task = 1;
    for (_, poison, _) in &poisons {
        let placed = poison.key.as_deref().map(|k| partition_for_key(k, PARTITIONS));
        let misplaced = poison.key.as_deref() == Some(b"misplaced".as_slice());
        assert!(placed.is_none() || (placed == Some(task)) != misplaced, "the poison's key is placed as meant");
    }
    for (what, poison, reason) in &poisons {
        let position = poison.produce(&b.producer, &orders, task as i32).await;
        let diagnosis = b.refused_by_name(task, reason).await;
        assert!(!diagnosis.is_empty(), "{what}: the refusal carries a diagnosis");
        b.gated_by_refusal(task, reason).await;
        b.skip(&orders, task, position).await;
        b.serves_every_partition(what).await;
    }
    let skips: i64 = sqlx::query_scalar("SELECT count(*) FROM parsley.skips WHERE model = $1")
        .bind(&b.names.model)
        .fetch_one(&b.pool)
        .await
        .unwrap();
    assert_eq!(skips, poisons.len() as i64, "every skip is recorded");
    assert_eq!(poisons.len() + 2, 11);
}

/// Partitions added to a received topic while everything runs: the gateway refuses writes
/// no task would read (409), and the projector refuses TASK_WIDTH_CHANGED without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions_added_while_running_are_refused_not_written() {
    let b = BlackBox::start("hostile-width", "metadata_refresh_ms = 1000").await;
    b.serves_every_partition("before the change").await;
    add_partitions(&b.names.orders, PARTITIONS as usize + 1).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let raw = b.post(br#"{"key":"w","value":1}"#, &[]).await;
        if raw.status == 409 {
            b.refused("a write on a widened topic", &raw, 409, "width-changed");
            break;
        }
        assert_eq!(raw.status, 201, "{}", raw.describe());
        assert!(Instant::now() < deadline, "writes were still accepted 30 s after the width changed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for task in 0..PARTITIONS {
        b.refused_by_name(task, "TASK_WIDTH_CHANGED").await;
    }
}

async fn add_partitions(topic: &str, total: usize) {
    use rdkafka::admin::NewPartitions;
    let results = parsley_testkit::admin()
        .create_partitions(&[NewPartitions::new(topic, total)], &parsley_testkit::admin_options())
        .await
        .expect("create_partitions");
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("adding partitions to {t}: {e}"));
    }
}

/// A record written around the gateway.
struct Poison {
    key: Option<Vec<u8>>,
    value: Vec<u8>,
    causes: Vec<Vec<u8>>,
}

impl Poison {
    fn value(v: &[u8]) -> Poison {
        Poison { key: Some(b"poison".to_vec()), value: v.to_vec(), causes: vec![] }
    }
    fn keyed(k: &str, v: &[u8]) -> Poison {
        Poison { key: Some(k.as_bytes().to_vec()), value: v.to_vec(), causes: vec![] }
    }
    fn keyless(v: &[u8]) -> Poison {
        Poison { key: None, value: v.to_vec(), causes: vec![] }
    }
    fn causes(c: Vec<u8>) -> Poison {
        Poison { key: Some(b"poison".to_vec()), value: b"1".to_vec(), causes: vec![c] }
    }
    fn two_causes() -> Poison {
        let one = CausalPast::new().encode();
        Poison { key: Some(b"poison".to_vec()), value: b"1".to_vec(), causes: vec![one.clone(), one] }
    }

    async fn produce(&self, producer: &FutureProducer, topic: &str, partition: i32) -> i64 {
        let mut headers = OwnedHeaders::new();
        for c in &self.causes {
            headers = headers.insert(Header { key: "parsley.causes", value: Some(c.as_slice()) });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(topic).partition(partition).payload(self.value.as_slice()).headers(headers);
        if let Some(k) = &self.key {
            record = record.key(k.as_slice());
        }
        producer.send(record, TIMEOUT).await.map_err(|(e, _)| e).expect("producing a poison record").offset
    }
}

/// Produces a record whose one header has a name of raw bytes (not UTF-8).
async fn raw_header_record(topic: &str, partition: i32, key: &[u8], value: &[u8], name: &[u8], header: &[u8]) {
    let (topic, key, value, name, header) =
        (topic.to_string(), key.to_vec(), value.to_vec(), name.to_vec(), header.to_vec());
    tokio::task::spawn_blocking(move || {
        parsley_infra::headers::produce::produce_with_raw_headers(
            &bootstrap(),
            &topic,
            partition,
            &key,
            Some(&value),
            &[(name.as_slice(), Some(header.as_slice()))],
            TIMEOUT,
        )
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("producing a record with a raw header name: {e:#}"));
}
