//! Several gateways behind a load balancer, as an operator runs them: a key rotation rolled
//! out one gateway at a time in three phases while sessions alternate between two gateways
//! on different rings (no session refused at any step); the ring re-read on `SIGHUP` and
//! when its file changes, a bad file keeping the ring in use; sessions bounded by
//! `token_max_age_s` across re-seals; subjects verified from a bearer JWT (a spoofed subject
//! header refused); and public answers without internals (`/readyz` without driver text,
//! the 503's task diagnoses only on the admin listener unless asked for).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine as _;
use parsley::CausalPast;
use parsley_gateway::keys::KeySource;
use parsley_gateway::metrics::Metric;
use parsley_gateway::session::unix_now;
use parsley_gateway::settings::ENV_TOKEN_KEYS_FILE;
use parsley_gateway::token::{self, KeyRing, KeyRole, Session, TokenLimits};
use parsley_gateway::{AppState, Gateway, GatewayConfig, SESSION_HEADER};
use serde_json::{json, Value};
use tokio::sync::watch;
use tower::ServiceExt as _;

use crate::support::*;

const PROBLEM: &str = "https://parsley.dev/problems/";
const OLD_KEY: [u8; 32] = [0x11; 32];
const NEW_KEY: [u8; 32] = [0x22; 32];

/// A key ring's text with `OLD` and `NEW` standing for the two keys' base64.
fn spec(text: &str) -> String {
    text.replace("OLD", &STANDARD.encode(OLD_KEY)).replace("NEW", &STANDARD.encode(NEW_KEY))
}

fn ring(text: &str) -> KeyRing {
    KeyRing::parse(&spec(text)).unwrap()
}

/// The rotation's rings, as the runbook in docs/operations.md writes them.
const BEFORE: &str = "old:OLD";
const PHASE_1: &str = "old:OLD\nnew:NEW:open";
const PHASE_2: &str = "new:NEW:seal\nold:OLD";
const PHASE_3: &str = "new:NEW";

/// The id of the key a token was sealed with (the client form's clear header).
fn sealed_with(token: &str) -> String {
    let raw = URL_SAFE_NO_PAD.decode(token).unwrap();
    let len = usize::from(raw[1]);
    String::from_utf8(raw[2..2 + len].to_vec()).unwrap()
}

/// One gateway of the fleet over the stack's model and services, with its background tasks
/// (and, for keys from a file, its reloader) running while it lives.
struct Member {
    router: Router,
    state: AppState,
    _stop: watch::Sender<bool>,
}

impl Member {
    fn start(config: GatewayConfig) -> Member {
        let gateway = Gateway::new(config).unwrap();
        let (stop, shutdown) = watch::channel(false);
        let _ = gateway.spawn_background(shutdown);
        Member { router: gateway.router(), state: gateway.state().clone(), _stop: stop }
    }

    /// A member whose `[gateway]` table is `table` and whose keys are `keys` (fixed).
    fn with_ring(s: &Stack, table: &str, keys: KeyRing) -> Member {
        let mut shared = s.config.clone();
        shared.gateway =
            Some(toml::from_str(&format!("admin_listen = \"\"\n{}{table}", open_unless_authenticated(table))).unwrap());
        Member::start(GatewayConfig::with_keys(shared, keys).unwrap())
    }

    /// A member reading its keys from `file` (reloadable), as the binary does.
    fn with_key_file(s: &Stack, table: &str, file: &Path) -> Member {
        let mut shared = s.config.clone();
        shared.gateway =
            Some(toml::from_str(&format!("admin_listen = \"\"\n{}{table}", open_unless_authenticated(table))).unwrap());
        let path = file.to_string_lossy().into_owned();
        let config =
            GatewayConfig::from_shared(shared, |name| (name == ENV_TOKEN_KEYS_FILE).then(|| path.clone())).unwrap();
        assert_eq!(config.keys.source(), &KeySource::File(file.to_path_buf()));
        Member::start(config)
    }

    fn roles(&self) -> Vec<(String, KeyRole)> {
        self.state.config.keys.current().roles().into_iter().map(|(id, role)| (id.to_string(), role)).collect()
    }

    fn reloads(&self, result: &str) -> f64 {
        self.state.metrics.value(Metric::TokenKeyReloadsTotal, &[("result", result)]).unwrap_or(0.0)
    }
}

/// Sends one request with extra `headers`.
async fn call(router: &Router, method: Method, uri: &str, headers: &[(&str, &str)], body: Option<&Value>) -> Reply {
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
    let header = |name: &str| response.headers().get(name).map(|v| v.to_str().unwrap().to_string());
    let (status, token, retry_after, content_type) =
        (response.status(), header(SESSION_HEADER), header("retry-after"), header("content-type"));
    let www_authenticate = header("www-authenticate");
    let bytes = axum::body::to_bytes(response.into_body(), 16 << 20).await.unwrap();
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if status == StatusCode::UNAUTHORIZED {
        assert_eq!(www_authenticate.as_deref(), Some("Bearer"), "{json}");
    }
    Reply { status, json, token, retry_after, content_type }
}

fn problem(r: &Reply, status: u16, kind: &str) {
    assert_eq!((r.status.as_u16(), r.problem_type()), (status, format!("{PROBLEM}{kind}").as_str()), "{}", r.json);
}

/// One client's session: alternately writes through one gateway and reads its write back
/// through the other, carrying its token. Counts every answer that is not a success.
struct Client {
    name: String,
    token: Option<String>,
    round: u64,
}

impl Client {
    /// One round: write through `first`, read back through `second`. The refusals, if any.
    async fn round(&mut self, s: &Stack, first: &Router, second: &Router) -> Vec<String> {
        self.round += 1;
        let key = format!("{}-{}", self.name, self.round % 3);
        let mut refused = Vec::new();
        let headers: Vec<(&str, &str)> = self.token.iter().map(|t| (SESSION_HEADER, t.as_str())).collect();
        let body = json!({"key": key, "value": {"round": self.round}});
        let uri = format!("/v1/topics/{}/records", s.names.orders);
        let w = call(first, Method::POST, &uri, &headers, Some(&body)).await;
        if w.status != StatusCode::CREATED {
            refused.push(format!("write {}: {} {}", self.name, w.status, w.json));
            return refused;
        }
        self.token = Some(w.token());
        let headers = [(SESSION_HEADER, self.token.as_deref().unwrap())];
        let uri = format!("/v1/models/{}/documents/{key}", s.names.model);
        let r = call(second, Method::GET, &uri, &headers, None).await;
        if r.status != StatusCode::OK || r.json["document"] != json!({"round": self.round}) {
            refused.push(format!("read {}: {} {}", self.name, r.status, r.json));
            return refused;
        }
        self.token = Some(r.token());
        refused
    }
}

/// Every client runs `rounds` rounds, alternating which of `a` and `b` writes.
async fn workload(s: &Stack, clients: &mut [Client], a: &Router, b: &Router, rounds: usize) -> Vec<String> {
    let mut refused = Vec::new();
    for i in 0..rounds {
        for (n, c) in clients.iter_mut().enumerate() {
            let (first, second) = if (i + n) % 2 == 0 { (a, b) } else { (b, a) };
            refused.extend(c.round(s, first, second).await);
        }
    }
    refused
}

/// The documented rotation, rolled out one gateway at a time: at every step two gateways on
/// different rings serve the same sessions alternately, and no request is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_three_phase_rotation_rolled_out_gateway_by_gateway_never_refuses_a_session() {
    let mut s = Stack::new("rotation", 2, "read_wait_ms = 5000").await;
    s.start_projector().await;
    let mut clients: Vec<Client> = (0..4).map(|c| Client { name: format!("c{c}"), token: None, round: 0 }).collect();
    // An idle session from before the rotation: its token is sealed with the old key.
    let mut idle = Client { name: "idle".into(), token: None, round: 0 };

    // Each step: (gateway A's ring, gateway B's ring, the key the fleet seals with once both
    // run it, if they agree). A is updated first, then B.
    let steps: &[(&str, &str, &str)] = &[
        (BEFORE, BEFORE, "old"),
        (PHASE_1, BEFORE, "old"),
        (PHASE_1, PHASE_1, "old"),
        (PHASE_2, PHASE_1, ""),
        (PHASE_2, PHASE_2, "new"),
        (PHASE_3, PHASE_2, "new"),
        (PHASE_3, PHASE_3, "new"),
    ];
    let mut refusals = Vec::new();
    for (step, (ring_a, ring_b, sealing)) in steps.iter().enumerate() {
        let a = Member::with_ring(&s, "read_wait_ms = 5000", ring(ring_a));
        let b = Member::with_ring(&s, "read_wait_ms = 5000", ring(ring_b));
        if step == 0 {
            assert!(idle.round(&s, &a.router, &b.router).await.is_empty());
            assert_eq!(sealed_with(idle.token.as_deref().unwrap()), "old");
        }
        let refused = workload(&s, &mut clients, &a.router, &b.router, 4).await;
        for r in &refused {
            refusals.push(format!("step {step} ({ring_a:?} / {ring_b:?}): {r}"));
        }
        if !sealing.is_empty() {
            for c in &clients {
                assert_eq!(&sealed_with(c.token.as_deref().unwrap()), sealing, "step {step}: {}", c.name);
            }
        }
    }
    assert!(refusals.is_empty(), "{} refusals mid-rotation:\n{}", refusals.len(), refusals.join("\n"));

    // Phase 3 is started only once tokens sealed with the old key have expired: an idle
    // token from before is refused by a gateway that no longer has the old key (here it has
    // not expired, because the test does not wait token_ttl_s).
    let done = Member::with_ring(&s, "", ring(PHASE_3));
    let uri = format!("/v1/models/{}/documents/x", s.names.model);
    let r = call(&done.router, Method::GET, &uri, &[(SESSION_HEADER, idle.token.as_deref().unwrap())], None).await;
    problem(&r, 400, "token-invalid");
    s.stop_projector().await;
}

/// The rotation the documentation used to prescribe (deploy `new,old` everywhere at once),
/// rolled out gateway by gateway: a gateway not yet updated refuses every token an updated
/// one sealed. This is what the open-only phase prevents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_one_step_rotation_refuses_sessions_mid_rollout() {
    let mut s = Stack::new("rotation-1step", 1, "read_wait_ms = 5000").await;
    s.start_projector().await;
    let updated = Member::with_ring(&s, "read_wait_ms = 5000", ring("new:NEW,old:OLD"));
    let not_yet = Member::with_ring(&s, "read_wait_ms = 5000", ring(BEFORE));
    let mut client = Client { name: "c".into(), token: None, round: 0 };
    let refused = client.round(&s, &updated.router, &not_yet.router).await;
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(refused[0].contains("token-invalid"), "{refused:?}");
    s.stop_projector().await;
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(unique(name));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Replaces `file` whole, as the runbook says (a new file renamed over the old one).
fn replace(file: &Path, text: &str) {
    let next = file.with_extension("next");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, file).unwrap();
}

fn sighup() {
    let status = std::process::Command::new("kill").args(["-HUP", &std::process::id().to_string()]).status().unwrap();
    assert!(status.success());
}

async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The ring is re-read on SIGHUP (a good file goes in whole, a bad one keeps the ring in
/// use) and when its file changes; sessions carry on throughout, and the metrics name the
/// key ids and roles, never the keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ring_reloads_on_sighup_and_when_its_file_changes_and_a_bad_file_keeps_it() {
    let mut s = Stack::new("reload", 1, "read_wait_ms = 5000").await;
    s.start_projector().await;
    let dir = temp_dir("reload-keys");
    let file = dir.join("token-keys");
    replace(&file, &spec(BEFORE));
    // Reloads on SIGHUP only (no polling), so the counts below are the signals'.
    let g = Member::with_key_file(&s, "read_wait_ms = 5000\ntoken_keys_reload_ms = 0", &file);
    let peer = Member::with_ring(&s, "read_wait_ms = 5000", ring(BEFORE));
    let mut client = Client { name: "c".into(), token: None, round: 0 };
    assert!(client.round(&s, &g.router, &peer.router).await.is_empty());
    assert_eq!(g.roles(), vec![("old".to_string(), KeyRole::Seal)]);

    // Phase 1 then phase 2, each by SIGHUP.
    replace(&file, &spec(PHASE_1));
    sighup();
    eventually("the first reload", || g.reloads("ok") >= 1.0).await;
    assert_eq!(g.roles(), vec![("old".to_string(), KeyRole::Seal), ("new".to_string(), KeyRole::Open)]);
    assert!(client.round(&s, &g.router, &peer.router).await.is_empty());
    replace(&file, &spec(PHASE_2));
    sighup();
    eventually("the second reload", || g.reloads("ok") >= 2.0).await;
    assert_eq!(g.roles(), vec![("new".to_string(), KeyRole::Seal), ("old".to_string(), KeyRole::Open)]);
    let peer = Member::with_ring(&s, "read_wait_ms = 5000", ring(PHASE_2));
    assert!(client.round(&s, &peer.router, &g.router).await.is_empty());
    assert_eq!(sealed_with(client.token.as_deref().unwrap()), "new", "g now seals with the new key");

    // A bad file: the ring in use stays, and says so in the metrics.
    for bad in [spec("new:NEW:seal\nold:OLD:seal"), "new:not-a-key".to_string(), String::new()] {
        let errors = g.reloads("error");
        replace(&file, &bad);
        sighup();
        eventually("a failed reload", || g.reloads("error") > errors).await;
        assert_eq!(g.roles(), vec![("new".to_string(), KeyRole::Seal), ("old".to_string(), KeyRole::Open)]);
        assert!(client.round(&s, &g.router, &peer.router).await.is_empty(), "sessions carry on");
    }
    let value = |id, role| g.state.metrics.value(Metric::TokenKeys, &[("key_id", id), ("role", role)]);
    assert_eq!((value("new", "seal"), value("old", "open")), (Some(1.0), Some(1.0)));
    assert_eq!((value("old", "seal"), value("new", "open")), (Some(0.0), Some(0.0)), "roles a reload removed");
    let text = g.state.metrics.render();
    for key in [OLD_KEY, NEW_KEY] {
        assert!(!text.contains(&STANDARD.encode(key)) && !text.contains(&URL_SAFE_NO_PAD.encode(key)));
    }

    // Polling: phase 3 is picked up without a signal once the file changes.
    let polled_file = dir.join("polled-keys");
    replace(&polled_file, &spec(PHASE_2));
    let polled = Member::with_key_file(&s, "read_wait_ms = 5000\ntoken_keys_reload_ms = 50", &polled_file);
    assert!(client.round(&s, &polled.router, &g.router).await.is_empty());
    replace(&polled_file, &spec(PHASE_3));
    eventually("the poll's reload", || polled.roles() == vec![("new".to_string(), KeyRole::Seal)]).await;
    // The ring is swapped before the reload is counted: the count follows a moment later.
    eventually("the poll's reload counted", || polled.reloads("ok") >= 1.0).await;
    assert!(client.round(&s, &polled.router, &g.router).await.is_empty(), "a new-key session still opens");
    std::fs::remove_dir_all(&dir).unwrap();
    s.stop_projector().await;
}

/// A session lasts `token_max_age_s` from its first token however often it is used (the
/// re-sealed token keeps `issuedAt`), with `token_clock_skew_s` of leeway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_end_at_their_maximum_age_however_often_they_are_used() {
    let s = Stack::new("max-age", 1, "read_wait_ms = 300").await;
    let g = Member::with_ring(&s, "token_max_age_s = 60\ntoken_clock_skew_s = 10", support_ring());
    let uri = format!("/v1/models/{}/documents/absent", s.names.model);
    let token_issued = |age: u64| {
        let now = unix_now();
        token::seal(
            &support_ring(),
            &Session { issued_at: now - age, expires_at: now + 600, subject: None, past: CausalPast::new() },
        )
    };
    // Just inside (60 s + 10 s of leeway, with a few seconds' margin for the test's clock).
    let inside = token_issued(65);
    let r = call(&g.router, Method::GET, &uri, &[(SESSION_HEADER, &inside)], None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.json);
    let refreshed = token::open(&support_ring(), &r.token(), unix_now(), None, &TokenLimits::default()).unwrap();
    let original = token::open(&support_ring(), &inside, unix_now(), None, &TokenLimits::default()).unwrap();
    assert_eq!(refreshed.issued_at, original.issued_at, "a re-seal keeps when the session began");
    assert!(refreshed.expires_at > original.expires_at, "and moves its expiry");
    // Just outside.
    let outside = token_issued(71);
    let r = call(&g.router, Method::GET, &uri, &[(SESSION_HEADER, &outside)], None).await;
    problem(&r, 400, "token-too-old");
    assert!(r.json["detail"].as_str().unwrap().contains("start a new session"), "{}", r.json);
    // Expired a few seconds ago, inside the leeway: still served.
    let now = unix_now();
    let late = token::seal(
        &support_ring(),
        &Session { issued_at: now - 5, expires_at: now - 5, subject: None, past: CausalPast::new() },
    );
    let r = call(&g.router, Method::GET, &uri, &[(SESSION_HEADER, &late)], None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.json);
    let expired = token::seal(
        &support_ring(),
        &Session { issued_at: now - 20, expires_at: now - 11, subject: None, past: CausalPast::new() },
    );
    let r = call(&g.router, Method::GET, &uri, &[(SESSION_HEADER, &expired)], None).await;
    problem(&r, 400, "token-expired");
}

/// The ring the stack's own gateway seals with (support.rs).
fn support_ring() -> KeyRing {
    crate::support::ring()
}

/// `/readyz` names the dependency that failed without the driver's text.
#[tokio::test]
async fn readiness_names_the_failed_dependency_without_driver_text() {
    let mut config = config(&Names::new("ready"), "kafka_timeout_ms = 300");
    config.kafka.bootstrap = "127.0.0.1:1".to_string();
    config.database.url = Some("postgres://nobody:secret@127.0.0.1:1/none".to_string().into());
    config.database.acquire_timeout_ms = 300;
    let g = Member::start(GatewayConfig::with_keys(config, support_ring()).unwrap());
    let r = call(&g.router, Method::GET, "/readyz", &[], None).await;
    problem(&r, 503, "not-ready");
    let checks = &r.json["checks"];
    assert_eq!(
        (checks["database"]["ok"].clone(), checks["database"]["error"].clone(), checks["database"]["required"].clone()),
        (json!(false), json!("the database did not answer"), json!(true)),
        "{}",
        r.json
    );
    assert_eq!(
        (checks["kafka"]["ok"].clone(), checks["kafka"]["error"].clone(), checks["kafka"]["required"].clone()),
        (json!(false), json!("the broker did not answer a metadata request"), json!(false))
    );
    let text = r.json.to_string();
    for internal in ["127.0.0.1", "nobody", "secret", "refused", "os error", "timed out"] {
        assert!(!text.contains(internal), "{internal}: {text}");
    }
}

/// A 503 on the main listener names the blocking task, its status and reason, but not the
/// free text of its failure unless `public_diagnostics`; the admin status keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_public_503_hides_task_diagnoses_and_the_admin_status_keeps_them() {
    use rdkafka::producer::{FutureProducer, FutureRecord};

    let mut s = Stack::new("diagnoses", 1, "read_wait_ms = 800").await;
    s.start_projector().await;
    let raw: FutureProducer = parsley_infra::kafka::producer_config(&bootstrap()).create().unwrap();
    raw.send(FutureRecord::<str, [u8]>::to(&s.names.orders).key("x").payload(b"not json"), TIMEOUT)
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        let st = s.status().await;
        if st.json["models"][0]["tasks"][0]["status"] != json!("running") {
            break st.json["models"][0]["tasks"][0].clone();
        }
        assert!(Instant::now() < deadline, "the task never reported the record: {}", st.json);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let admin_text = match status["status"].as_str() {
        Some("failing") => status["last_error"].clone(),
        _ => status["refusal"]["diagnosis"].clone(),
    };
    assert!(admin_text.as_str().unwrap_or_default().contains("not JSON"), "the admin status keeps it: {status}");

    let w = s.write(&s.names.orders.clone(), "x", json!({"ok": true}), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let r = s.read("x", Some(&w.token())).await;
    problem(&r, 503, "not-yet-covered");
    let task = &r.json["tasks"][0];
    assert_eq!(task["task"], json!(0), "{}", r.json);
    assert!(matches!(task["status"].as_str(), Some("failing" | "refused")), "{}", r.json);
    if task["status"] == json!("refused") {
        assert_eq!(task["reason"], json!("PROJECTION_REJECTED"), "the reason name stays: {}", r.json);
    }
    assert!(task.get("diagnosis").is_none() && task.get("last_error").is_none(), "{}", r.json);
    assert!(!r.json.to_string().contains("not JSON"), "{}", r.json);
    assert!(!r.json["gaps"].as_array().unwrap().is_empty(), "the gaps stay: {}", r.json);

    let (public, _stop) = s.other_gateway("read_wait_ms = 800\npublic_diagnostics = true").await;
    let r = call(
        &public,
        Method::GET,
        &format!("/v1/models/{}/documents/x", s.names.model),
        &[(SESSION_HEADER, &w.token())],
        None,
    )
    .await;
    problem(&r, 503, "not-yet-covered");
    assert!(r.json.to_string().contains("not JSON"), "asked for: {}", r.json);
    s.stop_projector().await;
}
