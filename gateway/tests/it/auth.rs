//! Who may write and read what, on the real stack: bearer JWTs checked with keys from a JWKS
//! that each test serves over HTTP itself (RS256, PS256, ES256, EdDSA), from a JWKS file, a
//! PEM file and an HS256 secret file; key rotation in the middle of a session; every
//! malformed credential; the JWKS endpoint down at start and later. Then the rules: writes,
//! batches, document reads, collection pages and named queries, each allowed and refused,
//! including a caller trying another user's key on every route; idempotency keys scoped per
//! caller; and the access mode shown to operators.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use parsley_gateway::metrics::Metric;
use parsley_gateway::session::unix_now;
use parsley_gateway::SESSION_HEADER;
use parsley_settings::config::{Config, ParamType, QueryConfig};
use serde_json::{json, Value};
use tower::ServiceExt as _;

use crate::support::*;

const ISSUER: &str = "https://idp.parsley.test";
const AUDIENCE: &str = "parsley-it";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jwt").join(name)
}

/// The public JWK of a fixture key (`rsa-1`, `rsa-2`, `ec-1`, `ed-1`).
fn jwk(name: &str) -> Value {
    serde_json::from_slice(&std::fs::read(fixture(&format!("{name}.jwk.json"))).unwrap()).unwrap()
}

/// A JWT signed with fixture key `key` under `alg`, naming `kid`.
fn sign(key: &str, alg: Algorithm, kid: Option<&str>, claims: &Value) -> String {
    let pem = std::fs::read(fixture(&format!("{key}.key.pem"))).unwrap();
    let encoding = match alg {
        Algorithm::RS256 | Algorithm::PS256 => EncodingKey::from_rsa_pem(&pem),
        Algorithm::ES256 => EncodingKey::from_ec_pem(&pem),
        Algorithm::EdDSA => EncodingKey::from_ed_pem(&pem),
        other => panic!("no fixture for {other:?}"),
    }
    .unwrap();
    let mut header = Header::new(alg);
    header.kid = kid.map(String::from);
    encode(&header, claims, &encoding).unwrap()
}

/// Valid claims for `sub` (five minutes), with `extra` merged in.
fn claims(sub: &str, extra: Value) -> Value {
    let now = unix_now();
    let mut c = json!({"iss": ISSUER, "aud": AUDIENCE, "sub": sub, "iat": now, "exp": now + 300});
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        c[k] = v;
    }
    c
}

/// `Bearer <RS256 JWT by rsa-1>` for `sub` with `extra` claims.
fn bearer(sub: &str, extra: Value) -> String {
    format!("Bearer {}", sign("rsa-1", Algorithm::RS256, Some("rsa-1"), &claims(sub, extra)))
}

/// An identity provider's JWKS endpoint, served by the test: its keys can be changed, and it
/// can be taken down (503) and brought back.
struct Idp {
    url: String,
    keys: Arc<Mutex<Vec<Value>>>,
    up: Arc<Mutex<bool>>,
    fetches: Arc<AtomicUsize>,
    max_age: Arc<Mutex<Option<u64>>>,
}

impl Idp {
    async fn start(keys: &[&str], up: bool) -> Idp {
        let idp = Idp {
            url: String::new(),
            keys: Arc::new(Mutex::new(keys.iter().map(|k| jwk(k)).collect())),
            up: Arc::new(Mutex::new(up)),
            fetches: Arc::new(AtomicUsize::new(0)),
            max_age: Arc::new(Mutex::new(None)),
        };
        let (keys, up, fetches, max_age) =
            (Arc::clone(&idp.keys), Arc::clone(&idp.up), Arc::clone(&idp.fetches), Arc::clone(&idp.max_age));
        let app = Router::new().route(
            "/jwks",
            get(move || {
                let (keys, up, fetches, max_age) = (keys.clone(), up.clone(), fetches.clone(), max_age.clone());
                async move {
                    fetches.fetch_add(1, Ordering::SeqCst);
                    if !*up.lock().unwrap() {
                        return (StatusCode::SERVICE_UNAVAILABLE, "down").into_response();
                    }
                    let body = json!({"keys": *keys.lock().unwrap()}).to_string();
                    let mut r = (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body).into_response();
                    if let Some(s) = *max_age.lock().unwrap() {
                        r.headers_mut().insert(header::CACHE_CONTROL, format!("max-age={s}").parse().unwrap());
                    }
                    r
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/jwks", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Idp { url, ..idp }
    }

    fn set_keys(&self, keys: &[&str]) {
        *self.keys.lock().unwrap() = keys.iter().map(|k| jwk(k)).collect();
    }

    fn set_up(&self, up: bool) {
        *self.up.lock().unwrap() = up;
    }

    fn fetches(&self) -> usize {
        self.fetches.load(Ordering::SeqCst)
    }
}

/// The `[gateway]` table of an authenticating gateway: `auth` in `[gateway.auth]` (besides
/// issuer and audience), then `rules`.
fn table(auth: &str, rules: &str) -> String {
    let refresh = if auth.contains("jwks_min_refresh_ms") { "" } else { "jwks_min_refresh_ms = 200\n" };
    format!(
        "read_wait_ms = 5000\ntoken_keys_reload_ms = 100\n[gateway.auth]\nissuer = \"{ISSUER}\"\naudience = \"{AUDIENCE}\"\n\
         {refresh}jwks_max_age_s = 60\n{auth}\n{rules}"
    )
}

/// The rules of the stack's model (`n`): customers own the orders keyed by their `sub` and
/// read them; a tenant's staff write payments and read and list documents under their
/// tenant's prefix; a customer runs `by-customer` for their own `sub` only; admins do all.
fn rules(n: &Names) -> String {
    let (orders, payments, model) = (&n.orders, &n.payments, &n.model);
    format!(
        r#"
[[gateway.rules]]
name = "own-orders"
allow = ["write"]
topics = ["{orders}"]
scopes = ["orders:write"]
key = "{{sub}}"

[[gateway.rules]]
name = "tenant-payments"
allow = ["write"]
topics = ["{payments}"]
key_prefix = "{{claim.tenant}}:"

[[gateway.rules]]
name = "own-documents"
allow = ["read"]
models = ["{model}"]
key = "{{sub}}"

[[gateway.rules]]
name = "tenant-documents"
allow = ["read", "list"]
models = ["{model}"]
key_prefix = "{{claim.tenant}}:"

[[gateway.rules]]
name = "own-customer-query"
allow = ["query"]
models = ["{model}"]
queries = ["by-customer"]
params = {{ customer = "{{sub}}" }}

[[gateway.rules]]
name = "admins"
allow = ["write", "read", "list", "query"]
topics = ["*"]
models = ["*"]
claims = {{ role = "admin" }}
"#
    )
}

/// The query the rules bind: the keys of the documents whose `customer` is `:customer`.
fn with_query(n: &Names, c: &mut Config) {
    c.models[0].queries = vec![QueryConfig {
        name: "by-customer".into(),
        sql: format!(
            "SELECT key FROM projection.documents WHERE model = '{}' AND doc->>'customer' = :customer ORDER BY key",
            n.model
        ),
        params: [("customer".to_string(), ParamType::Text)].into(),
        key: None,
        max_rows: 100,
        ..QueryConfig::new("", "", Default::default())
    }];
}

/// A stack authenticating with `auth` (key source and more), under [`rules`], with the
/// `by-customer` query; the projector running.
async fn stack(prefix: &str, auth: &str) -> Stack {
    let auth = auth.to_string();
    let mut s = Stack::with_config(prefix, 2, "access = \"rules\"", move |n, c| {
        with_query(n, c);
        let text = format!("[gateway]\nadmin_listen = \"127.0.0.1:0\"\n{}", table(&auth, &rules(n)));
        c.gateway = Config::parse(&text).unwrap().gateway;
    })
    .await;
    s.start_projector().await;
    s
}

/// One answer, with its `WWW-Authenticate`.
struct Answer {
    status: StatusCode,
    json: Value,
    token: Option<String>,
    www_authenticate: Option<String>,
}

async fn call(router: &Router, method: Method, uri: &str, headers: &[(&str, &str)], body: Option<&Value>) -> Answer {
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
    let (status, token, www_authenticate) = (response.status(), header(SESSION_HEADER), header("www-authenticate"));
    let bytes = axum::body::to_bytes(response.into_body(), 16 << 20).await.unwrap();
    Answer { status, json: serde_json::from_slice(&bytes).unwrap_or(Value::Null), token, www_authenticate }
}

impl Answer {
    fn kind(&self) -> &str {
        self.json["type"].as_str().unwrap_or("").trim_start_matches("https://parsley.dev/problems/")
    }

    /// Asserts a `401 unauthenticated` with the bearer challenge.
    fn unauthenticated(&self, what: &str) {
        assert_eq!((self.status, self.kind()), (StatusCode::UNAUTHORIZED, "unauthenticated"), "{what}: {}", self.json);
        let challenge = self.www_authenticate.as_deref().unwrap_or("");
        assert!(
            challenge.starts_with("Bearer ") && challenge.contains("error=\"invalid_token\""),
            "{what}: {challenge}"
        );
        assert!(self.token.is_none(), "{what}: a refused request hands out no token");
    }

    /// Asserts a `403 forbidden` naming `rule`, and returns the detail.
    fn forbidden(&self, rule: Option<&str>) -> String {
        assert_eq!((self.status, self.kind()), (StatusCode::FORBIDDEN, "forbidden"), "{}", self.json);
        let rules: Vec<&str> = self.json["rules"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
        if let Some(rule) = rule {
            assert!(rules.contains(&rule), "{rule} not in {rules:?}");
        }
        self.json["detail"].as_str().unwrap().to_string()
    }
}

/// A caller: a bearer JWT, and the session it carries.
struct Caller {
    auth: String,
    token: Option<String>,
}

impl Caller {
    fn new(auth: String) -> Caller {
        Caller { auth, token: None }
    }

    fn headers(&self) -> Vec<(&str, &str)> {
        let mut h = vec![("authorization", self.auth.as_str())];
        if let Some(t) = &self.token {
            h.push((SESSION_HEADER, t.as_str()));
        }
        h
    }

    async fn call(&mut self, s: &Stack, method: Method, uri: &str, body: Option<&Value>) -> Answer {
        let a = call(&s.router, method, uri, &self.headers(), body).await;
        if let Some(t) = &a.token {
            self.token = Some(t.clone());
        }
        a
    }

    async fn write(&mut self, s: &Stack, topic: &str, key: &str, value: Value) -> Answer {
        let body = json!({"key": key, "value": value});
        self.call(s, Method::POST, &format!("/v1/topics/{topic}/records"), Some(&body)).await
    }

    async fn read(&mut self, s: &Stack, key: &str) -> Answer {
        self.call(s, Method::GET, &format!("/v1/models/{}/documents/{key}", s.names.model), None).await
    }

    async fn list(&mut self, s: &Stack, query: &str) -> Answer {
        self.call(s, Method::GET, &format!("/v1/models/{}/documents{query}", s.names.model), None).await
    }

    async fn query(&mut self, s: &Stack, query: &str) -> Answer {
        self.call(s, Method::GET, &format!("/v1/models/{}/queries/by-customer{query}", s.names.model), None).await
    }
}

fn customer(sub: &str) -> Caller {
    Caller::new(bearer(sub, json!({"scope": "orders:write profile"})))
}

fn admin() -> Caller {
    Caller::new(bearer("root", json!({"role": "admin"})))
}

/// A stack on a JWKS URL serving `rsa-1`.
async fn url_stack(prefix: &str) -> (Stack, Idp) {
    let idp = Idp::start(&["rsa-1", "ec-1", "ed-1"], true).await;
    let s = stack(prefix, &format!("jwks_url = \"{}\"", idp.url)).await;
    (s, idp)
}

// ---------------------------------------------------------------------------------------
// Identity

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rs256_token_from_the_jwks_url_writes_and_reads_its_own_key_and_binds_the_session() {
    let (s, idp) = url_stack("auth-rs256").await;
    assert!(idp.fetches() >= 1, "fetched at start");
    let mut alice = customer("alice");
    let w = alice.write(&s, &s.names.orders, "alice", json!({"customer": "alice", "amount": 5})).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let opened = parsley_gateway::token::open(
        &ring(),
        w.token.as_deref().unwrap(),
        unix_now(),
        Some("alice"),
        &parsley_gateway::token::TokenLimits::default(),
    )
    .unwrap();
    assert_eq!(opened.subject.as_deref(), Some("alice"), "the session is bound to the JWT's sub");
    let r = alice.read(&s, "alice").await;
    assert_eq!((r.status, r.json["document"]["amount"].clone()), (StatusCode::OK, json!(5)), "{}", r.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ps256_es256_and_eddsa_tokens_verify_with_their_keys() {
    let (s, _idp) = url_stack("auth-algs").await;
    for (key, alg) in [("rsa-1", Algorithm::PS256), ("ec-1", Algorithm::ES256), ("ed-1", Algorithm::EdDSA)] {
        let sub = format!("user-{key}");
        let jwt = sign(key, alg, Some(key), &claims(&sub, json!({"scope": "orders:write"})));
        let mut c = Caller::new(format!("Bearer {jwt}"));
        let w = c.write(&s, &s.names.orders, &sub, json!({"n": 1})).await;
        assert_eq!(w.status, StatusCode::CREATED, "{alg:?}: {}", w.json);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_credential_is_401_with_the_bearer_challenge_on_every_data_route() {
    let (s, _idp) = url_stack("auth-missing").await;
    let m = &s.names.model;
    let body = json!({"key": "k", "value": 1});
    let batch = json!({"records": [{"topic": s.names.orders, "key": "k", "value": 1}]});
    for (method, uri, body) in [
        (Method::POST, format!("/v1/topics/{}/records", s.names.orders), Some(&body)),
        (Method::POST, "/v1/records".to_string(), Some(&batch)),
        (Method::GET, format!("/v1/models/{m}/documents/k"), None),
        (Method::GET, format!("/v1/models/{m}/documents"), None),
        (Method::GET, format!("/v1/models/{m}/queries/by-customer"), None),
    ] {
        call(&s.router, method.clone(), &uri, &[], body).await.unauthenticated(&uri);
        let basic = [("authorization", "Basic YWxpY2U6cHc=")];
        call(&s.router, method, &uri, &basic, body).await.unauthenticated(&uri);
    }
    // Probes and the API document stay open.
    assert_eq!(call(&s.router, Method::GET, "/healthz", &[], None).await.status, StatusCode::OK);
    assert_eq!(call(&s.router, Method::GET, "/openapi.json", &[], None).await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alg_none_is_refused() {
    let (s, _idp) = url_stack("auth-none").await;
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let c = claims("alice", json!({"scope": "orders:write"}));
    for header in [r#"{"alg":"none"}"#, r#"{"alg":"none","kid":"rsa-1"}"#, r#"{"alg":"None"}"#] {
        let jwt = format!("{}.{}.", b64.encode(header), b64.encode(c.to_string()));
        let mut caller = Caller::new(format!("Bearer {jwt}"));
        caller.write(&s, &s.names.orders, "alice", json!(1)).await.unauthenticated(header);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_public_key_offered_as_an_hmac_secret_is_refused() {
    let (s, _idp) = url_stack("auth-confusion").await;
    // The RSA public key's PEM, which anyone has, used as an HS256 secret under its kid.
    let public = std::fs::read(fixture("rsa-1.pub.pem")).unwrap();
    let mut header = Header::new(Algorithm::HS256);
    header.kid = Some("rsa-1".into());
    let jwt = encode(&header, &claims("alice", json!({"scope": "orders:write"})), &EncodingKey::from_secret(&public))
        .unwrap();
    let mut c = Caller::new(format!("Bearer {jwt}"));
    let a = c.write(&s, &s.names.orders, "alice", json!(1)).await;
    a.unauthenticated("HS256 under an RSA kid");
    // An EC key's kid on an RS256 token: the key's type decides, not the token.
    let jwt = sign("rsa-1", Algorithm::RS256, Some("ec-1"), &claims("alice", json!({"scope": "orders:write"})));
    Caller::new(format!("Bearer {jwt}"))
        .write(&s, &s.names.orders, "alice", json!(1))
        .await
        .unauthenticated("kid of an EC key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_of_another_issuer_or_audience_is_refused() {
    let (s, _idp) = url_stack("auth-iss-aud").await;
    for (what, extra) in [
        ("another issuer", json!({"iss": "https://evil.example"})),
        ("no issuer", json!({"iss": null})),
        ("another audience", json!({"aud": "someone-else"})),
        ("audience list without ours", json!({"aud": ["a", "b"]})),
        ("no subject", json!({"sub": null})),
    ] {
        let jwt = sign("rsa-1", Algorithm::RS256, Some("rsa-1"), &claims("alice", extra));
        let a = Caller::new(format!("Bearer {jwt}")).read(&s, "alice").await;
        a.unauthenticated(what);
    }
    // Our audience among others is fine.
    let jwt = sign("rsa-1", Algorithm::RS256, Some("rsa-1"), &claims("alice", json!({"aud": ["x", AUDIENCE]})));
    let a = Caller::new(format!("Bearer {jwt}")).read(&s, "alice").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_not_yet_valid_or_too_long_token_is_refused() {
    let (s, _idp) = url_stack("auth-times").await;
    let now = unix_now();
    for (what, extra) in [
        ("expired beyond the leeway", json!({"exp": now - 60, "iat": now - 600})),
        ("not yet valid", json!({"nbf": now + 600})),
        ("issued in the future", json!({"iat": now + 600, "exp": now + 900})),
        ("no exp", json!({"exp": null})),
        ("valid for longer than max_jwt_lifetime_s", json!({"iat": now, "exp": now + 2 * 86_400})),
    ] {
        let jwt = sign("rsa-1", Algorithm::RS256, Some("rsa-1"), &claims("alice", extra));
        let a = Caller::new(format!("Bearer {jwt}")).read(&s, "alice").await;
        a.unauthenticated(what);
        assert!(a.json["detail"].as_str().unwrap().contains("bearer token"), "{what}: {}", a.json);
    }
    // Within the leeway (token_clock_skew_s, 30 s): accepted.
    let jwt =
        sign("rsa-1", Algorithm::RS256, Some("rsa-1"), &claims("alice", json!({"exp": now - 5, "iat": now - 60})));
    assert_eq!(Caller::new(format!("Bearer {jwt}")).read(&s, "alice").await.status, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_or_damaged_token_is_refused() {
    let (s, _idp) = url_stack("auth-forged").await;
    // Signed by a key the provider does not publish, under a published kid.
    let jwt = sign("rsa-2", Algorithm::RS256, Some("rsa-1"), &claims("alice", json!({})));
    Caller::new(format!("Bearer {jwt}")).read(&s, "alice").await.unauthenticated("another key");
    let good = sign("rsa-1", Algorithm::RS256, Some("rsa-1"), &claims("alice", json!({})));
    let (head, rest) = good.split_once('.').unwrap();
    let signature = rest.split_once('.').unwrap().1;
    use base64::Engine as _;
    let bob = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(claims("bob", json!({})).to_string());
    let spliced = format!("Bearer {head}.{bob}.{signature}");
    Caller::new(spliced).read(&s, "bob").await.unauthenticated("another subject spliced in");
    for bad in ["Bearer x.y.z", "Bearer ", "Bearer a.b", &format!("Bearer {}", "a".repeat(9000))] {
        Caller::new(bad.to_string()).read(&s, "alice").await.unauthenticated(&bad[..bad.len().min(20)]);
    }
    // Two Authorization headers.
    let auth = format!("Bearer {good}");
    let two = [("authorization", auth.as_str()), ("authorization", auth.as_str())];
    let uri = format!("/v1/models/{}/documents/alice", s.names.model);
    call(&s.router, Method::GET, &uri, &two, None).await.unauthenticated("repeated header");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_kid_is_fetched_again_at_most_once_per_interval_then_refused() {
    let idp = Idp::start(&["rsa-1"], true).await;
    let s = stack("auth-unknown-kid", &format!("jwks_url = \"{}\"\njwks_min_refresh_ms = 2000", idp.url)).await;
    let ready = customer("alice").read(&s, "alice").await;
    assert_eq!(ready.status, StatusCode::NOT_FOUND, "{}", ready.json);
    let before = idp.fetches();
    for _ in 0..5 {
        let jwt = sign("rsa-2", Algorithm::RS256, Some("rsa-2"), &claims("alice", json!({})));
        let a = Caller::new(format!("Bearer {jwt}")).read(&s, "alice").await;
        a.unauthenticated("unknown kid");
        assert!(a.json["detail"].as_str().unwrap().contains("kid"), "{}", a.json);
    }
    assert_eq!(idp.fetches() - before, 1, "one fetch for five unknown kids within jwks_min_refresh_ms");
    // Once the interval has passed, an unknown kid is fetched for again.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let jwt = sign("rsa-2", Algorithm::RS256, Some("rsa-2"), &claims("alice", json!({})));
    Caller::new(format!("Bearer {jwt}")).read(&s, "alice").await.unauthenticated("unknown kid");
    assert_eq!(idp.fetches() - before, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_rotation_in_the_middle_of_a_session_keeps_the_session() {
    let idp = Idp::start(&["rsa-1"], true).await;
    *idp.max_age.lock().unwrap() = Some(1);
    let s = stack("auth-rotation", &format!("jwks_url = \"{}\"", idp.url)).await;
    let old = |sub: &str| {
        format!(
            "Bearer {}",
            sign("rsa-1", Algorithm::RS256, Some("rsa-1"), &claims(sub, json!({"scope": "orders:write"})))
        )
    };
    let new = |sub: &str| {
        format!(
            "Bearer {}",
            sign("rsa-2", Algorithm::RS256, Some("rsa-2"), &claims(sub, json!({"scope": "orders:write"})))
        )
    };
    let mut alice = Caller::new(old("alice"));
    let w = alice.write(&s, &s.names.orders, "alice", json!({"v": 1})).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);

    // The provider adds rsa-2 and starts signing with it: seen first in a token, fetched.
    idp.set_keys(&["rsa-1", "rsa-2"]);
    alice.auth = new("alice");
    let w = alice.write(&s, &s.names.orders, "alice", json!({"v": 2})).await;
    assert_eq!(w.status, StatusCode::CREATED, "the new kid is fetched on first sight: {}", w.json);
    let r = alice.read(&s, "alice").await;
    assert_eq!((r.status, r.json["document"]["v"].clone()), (StatusCode::OK, json!(2)), "same session: {}", r.json);
    // The old kid stays valid while the provider publishes it.
    alice.auth = old("alice");
    assert_eq!(alice.read(&s, "alice").await.status, StatusCode::OK);

    // The provider removes rsa-1: once the set's lifetime (max-age=1) ends, it no longer verifies.
    idp.set_keys(&["rsa-2"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let a = Caller::new(old("alice")).read(&s, "alice").await;
        if a.status == StatusCode::UNAUTHORIZED {
            a.unauthenticated("a removed key");
            break;
        }
        assert!(Instant::now() < deadline, "the removed key still verifies: {}", a.json);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    alice.auth = new("alice");
    assert_eq!(alice.read(&s, "alice").await.status, StatusCode::OK, "the session goes on under the new key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jwks_endpoint_down_at_start_answers_503_until_it_is_back() {
    let idp = Idp::start(&["rsa-1"], false).await;
    let s = stack("auth-down-start", &format!("jwks_url = \"{}\"", idp.url)).await;
    let a = customer("alice").read(&s, "alice").await;
    assert_eq!((a.status, a.kind()), (StatusCode::SERVICE_UNAVAILABLE, "unavailable"), "{}", a.json);
    let ready = call(&s.admin, Method::GET, "/readyz", &[], None).await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE, "{}", ready.json);
    assert_eq!(ready.json["checks"]["identity_keys"]["ok"], json!(false), "{}", ready.json);

    idp.set_up(true);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let a = customer("alice").read(&s, "alice").await;
        if a.status == StatusCode::NOT_FOUND {
            break;
        }
        assert!(Instant::now() < deadline, "still refused once the endpoint is back: {}", a.json);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ready = call(&s.admin, Method::GET, "/readyz", &[], None).await;
    assert_eq!(ready.json["checks"]["identity_keys"]["ok"], json!(true), "{}", ready.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jwks_endpoint_down_later_keeps_the_keys_and_counts_the_failures() {
    let idp = Idp::start(&["rsa-1"], true).await;
    *idp.max_age.lock().unwrap() = Some(1);
    let s = stack("auth-down-later", &format!("jwks_url = \"{}\"", idp.url)).await;
    assert_eq!(customer("alice").read(&s, "alice").await.status, StatusCode::NOT_FOUND);
    idp.set_up(false);
    let errors = || s.state.metrics.value(Metric::JwksFetchesTotal, &[("result", "error")]).unwrap_or(0.0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while errors() < 1.0 {
        assert!(Instant::now() < deadline, "no failed fetch counted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let a = customer("alice").read(&s, "alice").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "the last good keys still verify: {}", a.json);
    let status = call(&s.admin, Method::GET, "/v1/status", &[], None).await;
    assert!(status.json["access"]["keys"]["last_error"].is_string(), "{}", status.json["access"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_from_a_jwks_file_are_reloaded_when_it_changes() {
    let dir = std::env::temp_dir().join(unique("auth-jwks-file"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("jwks.json");
    std::fs::write(&file, json!({"keys": [jwk("rsa-1")]}).to_string()).unwrap();
    let s = stack("auth-jwks-file", &format!("jwks_file = {:?}", file.to_string_lossy())).await;
    assert_eq!(customer("alice").read(&s, "alice").await.status, StatusCode::NOT_FOUND);
    let rotated = || format!("Bearer {}", sign("ec-1", Algorithm::ES256, Some("ec-1"), &claims("alice", json!({}))));
    Caller::new(rotated()).read(&s, "alice").await.unauthenticated("not in the file yet");
    // Written aside and renamed, as configuration tools do.
    let next = dir.join("jwks.next");
    std::fs::write(&next, json!({"keys": [jwk("ec-1")]}).to_string()).unwrap();
    std::fs::rename(&next, &file).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while Caller::new(rotated()).read(&s, "alice").await.status != StatusCode::NOT_FOUND {
        assert!(Instant::now() < deadline, "the new file was not read");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    customer("alice").read(&s, "alice").await.unauthenticated("removed from the file");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pem_public_key_file_checks_its_algorithm() {
    let s =
        stack("auth-pem", &format!("pem_file = {:?}\npem_kid = \"ec-1\"", fixture("ec-1.pub.pem").to_string_lossy()))
            .await;
    let jwt = sign("ec-1", Algorithm::ES256, Some("ec-1"), &claims("alice", json!({"scope": "orders:write"})));
    let mut alice = Caller::new(format!("Bearer {jwt}"));
    assert_eq!(alice.write(&s, &s.names.orders, "alice", json!(1)).await.status, StatusCode::CREATED);
    let other = sign("ed-1", Algorithm::EdDSA, Some("ec-1"), &claims("alice", json!({})));
    Caller::new(format!("Bearer {other}")).read(&s, "alice").await.unauthenticated("an EdDSA token for a P-256 key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hs256_secret_is_taken_byte_for_byte() {
    let dir = std::env::temp_dir().join(unique("auth-hs256"));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = b"a-shared-secret-of-at-least-32-bytes\n";
    std::fs::write(dir.join("secret"), secret).unwrap();
    let s = stack("auth-hs256", &format!("hs256_secret_file = {:?}", dir.join("secret").to_string_lossy())).await;
    let hs = |key: &[u8]| {
        let c = claims("alice", json!({"scope": "orders:write"}));
        format!("Bearer {}", encode(&Header::new(Algorithm::HS256), &c, &EncodingKey::from_secret(key)).unwrap())
    };
    let mut alice = Caller::new(hs(secret));
    assert_eq!(alice.write(&s, &s.names.orders, "alice", json!(1)).await.status, StatusCode::CREATED);
    Caller::new(hs(&secret[..secret.len() - 1]))
        .read(&s, "alice")
        .await
        .unauthenticated("the secret without its newline");
    // A public-key token is no HS256 token.
    Caller::new(bearer("alice", json!({}))).read(&s, "alice").await.unauthenticated("RS256 on an HS256 gateway");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------
// Authorization

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_may_write_its_own_key_and_not_another_users() {
    let (s, _idp) = url_stack("authz-write").await;
    let mut alice = customer("alice");
    assert_eq!(alice.write(&s, &s.names.orders, "alice", json!({"mine": true})).await.status, StatusCode::CREATED);
    let a = alice.write(&s, &s.names.orders, "bob", json!({"overwritten": true})).await;
    let detail = a.forbidden(Some("own-orders"));
    assert!(detail.contains("{sub}") && !detail.contains("bob"), "names the binding, never the key: {detail}");
    let tombstone = alice.write(&s, &s.names.orders, "bob", Value::Null).await;
    tombstone.forbidden(Some("own-orders"));
    // Bob's document was never written.
    let r = admin().read(&s, "bob").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_without_the_rules_scope_is_refused_naming_the_scope() {
    let (s, _idp) = url_stack("authz-scope").await;
    let mut alice = Caller::new(bearer("alice", json!({"scope": "profile"})));
    let detail = alice.write(&s, &s.names.orders, "alice", json!(1)).await.forbidden(Some("own-orders"));
    assert!(detail.contains("orders:write"), "{detail}");
    // `scp` as a list counts too.
    let mut scp = Caller::new(bearer("alice", json!({"scp": ["orders:write"]})));
    assert_eq!(scp.write(&s, &s.names.orders, "alice", json!(1)).await.status, StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_prefix_binds_writes_to_the_callers_tenant() {
    let (s, _idp) = url_stack("authz-prefix-write").await;
    let mut acme = Caller::new(bearer("clerk", json!({"tenant": "acme"})));
    assert_eq!(acme.write(&s, &s.names.payments, "acme:1", json!({"paid": 3})).await.status, StatusCode::CREATED);
    acme.write(&s, &s.names.payments, "globex:1", json!({"paid": 3})).await.forbidden(Some("tenant-payments"));
    // Without the claim, the binding never widens to every key.
    let mut none = Caller::new(bearer("clerk", json!({})));
    let detail = none.write(&s, &s.names.payments, ":1", json!(1)).await.forbidden(Some("tenant-payments"));
    assert!(detail.contains("tenant"), "{detail}");
    let mut empty = Caller::new(bearer("clerk", json!({"tenant": ""})));
    empty.write(&s, &s.names.payments, ":1", json!(1)).await.forbidden(Some("tenant-payments"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_no_rule_covers_for_the_caller_is_refused() {
    let (s, _idp) = url_stack("authz-topic").await;
    // A customer's rule covers orders only; payments need a tenant prefix, which alice lacks.
    let mut alice = customer("alice");
    alice.write(&s, &s.names.payments, "alice", json!(1)).await.forbidden(Some("tenant-payments"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_allowed_only_if_every_record_is() {
    let (s, _idp) = url_stack("authz-batch").await;
    let mut alice = customer("alice");
    let mixed = json!({"records": [
        {"topic": s.names.orders, "key": "alice", "value": {"batch": 1}},
        {"topic": s.names.orders, "key": "bob", "value": {"batch": 1}},
    ]});
    let a = alice.call(&s, Method::POST, "/v1/records", Some(&mixed)).await;
    a.forbidden(Some("own-orders"));
    // Nothing of it was written, not even alice's own record.
    let mut root = admin();
    assert_eq!(root.write(&s, &s.names.orders, "marker", json!(1)).await.status, StatusCode::CREATED);
    assert_eq!(root.read(&s, "marker").await.status, StatusCode::OK);
    assert_eq!(root.read(&s, "alice").await.status, StatusCode::NOT_FOUND);
    let own = json!({"records": [{"topic": s.names.orders, "key": "alice", "value": {"batch": 2}}]});
    let a = alice.call(&s, Method::POST, "/v1/records", Some(&own)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_reads_its_own_document_and_not_another_users() {
    let (s, _idp) = url_stack("authz-read").await;
    let mut root = admin();
    for k in ["alice", "bob"] {
        assert_eq!(root.write(&s, &s.names.orders, k, json!({"owner": k})).await.status, StatusCode::CREATED);
    }
    assert_eq!(root.read(&s, "bob").await.status, StatusCode::OK, "written");
    let mut alice = customer("alice");
    let r = alice.read(&s, "alice").await;
    assert_eq!((r.status, r.json["document"]["owner"].clone()), (StatusCode::OK, json!("alice")), "{}", r.json);
    let detail = alice.read(&s, "bob").await.forbidden(Some("own-documents"));
    assert!(!detail.contains("\"owner\""), "{detail}");
    // A key alice may not see is refused whether or not it exists: no oracle.
    alice.read(&s, "nobody-has-this").await.forbidden(Some("own-documents"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collection_page_holds_only_the_callers_keys_and_stays_full() {
    let (s, _idp) = url_stack("authz-list").await;
    let mut root = admin();
    // Interleaved in key order: acme:1, globex:1, acme:2, ... (the tenants' keys alternate
    // only with their numbers; sorted, acme's come first).
    for i in 1..=5 {
        for tenant in ["acme", "globex", "initech"] {
            let w = root.write(&s, &s.names.orders, &format!("{tenant}:{i}"), json!({"i": i})).await;
            assert_eq!(w.status, StatusCode::CREATED);
        }
    }
    assert_eq!(root.read(&s, "initech:5").await.status, StatusCode::OK, "all written");
    let mut globex = Caller::new(bearer("staff", json!({"tenant": "globex"})));
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    let mut sizes = Vec::new();
    loop {
        let query = match &after {
            None => "?limit=2".to_string(),
            Some(a) => format!("?limit=2&after={a}"),
        };
        let page = globex.list(&s, &query).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.json);
        let docs = page.json["documents"].as_array().unwrap().clone();
        sizes.push(docs.len());
        seen.extend(docs.iter().map(|d| d["key"].as_str().unwrap().to_string()));
        match page.json["next"].as_str() {
            Some(n) => after = Some(n.to_string()),
            None => break,
        }
    }
    assert_eq!(seen, (1..=5).map(|i| format!("globex:{i}")).collect::<Vec<_>>());
    assert_eq!(sizes, vec![2, 2, 1], "pages are filtered in the statement, so each is full");
    // The admin lists everything.
    let all = root.list(&s, "?limit=100").await;
    assert_eq!(all.json["documents"].as_array().unwrap().len(), 15, "{}", all.json);
    // A caller no list rule allows is refused.
    customer("alice").list(&s, "").await.forbidden(Some("tenant-documents"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_query_parameter_is_bound_to_the_caller() {
    let (s, _idp) = url_stack("authz-query").await;
    let mut root = admin();
    for (key, who) in [("o1", "alice"), ("o2", "bob"), ("o3", "alice")] {
        let w = root.write(&s, &s.names.orders, key, json!({"customer": who})).await;
        assert_eq!(w.status, StatusCode::CREATED);
    }
    // Covered for the admin's session: every write applied, so alice's new session sees them.
    assert_eq!(root.read(&s, "o3").await.status, StatusCode::OK);
    let mut alice = customer("alice");
    let rows = |a: &Answer| -> Vec<String> {
        a.json["rows"].as_array().unwrap().iter().map(|r| r["key"].as_str().unwrap().to_string()).collect()
    };
    let mine = alice.query(&s, "").await;
    assert_eq!(mine.status, StatusCode::OK, "{}", mine.json);
    assert_eq!(rows(&mine), ["o1", "o3"], "the bound parameter is filled in");
    let same = alice.query(&s, "?customer=alice").await;
    assert_eq!(rows(&same), ["o1", "o3"]);
    let detail = alice.query(&s, "?customer=bob").await.forbidden(Some("own-customer-query"));
    assert!(detail.contains("customer") && !detail.contains("bob"), "{detail}");
    // The admin's rule binds nothing.
    let bobs = root.query(&s, "?customer=bob").await;
    assert_eq!(rows(&bobs), ["o2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_claim_allows_every_route() {
    let (s, _idp) = url_stack("authz-admin").await;
    let mut root = admin();
    assert_eq!(root.write(&s, &s.names.payments, "anything", json!({"a": 1})).await.status, StatusCode::CREATED);
    assert_eq!(root.read(&s, "anything").await.status, StatusCode::OK);
    assert_eq!(root.list(&s, "").await.status, StatusCode::OK);
    // A claim of the wrong value is no admin.
    let mut fake = Caller::new(bearer("root", json!({"role": "administrator"})));
    let detail = fake.list(&s, "").await.forbidden(Some("admins"));
    assert!(detail.contains("role") && !detail.contains("administrator"), "never the claim's value: {detail}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_token_stays_bound_to_its_subject() {
    let (s, _idp) = url_stack("authz-bound").await;
    let mut alice = customer("alice");
    assert_eq!(alice.write(&s, &s.names.orders, "alice", json!(1)).await.status, StatusCode::CREATED);
    let mut mallory = customer("mallory");
    mallory.token = alice.token.clone();
    let a = mallory.read(&s, "mallory").await;
    assert_eq!((a.status, a.kind()), (StatusCode::FORBIDDEN, "token-wrong-subject"), "{}", a.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_are_scoped_per_subject() {
    let (s, _idp) = url_stack("authz-idem").await;
    // One key for every caller (unique to this run: keys live a day in the shared database).
    let shared_key = unique("guessable");
    let write = |c: &Caller, key: &str, v: i64| {
        let uri = format!("/v1/topics/{}/records", s.names.orders);
        let body = json!({"key": key, "value": {"v": v}});
        let mut headers = c.headers().into_iter().map(|(a, b)| (a.to_string(), b.to_string())).collect::<Vec<_>>();
        headers.push(("idempotency-key".into(), shared_key.clone()));
        let router = s.router.clone();
        async move {
            let h: Vec<(&str, &str)> = headers.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
            call(&router, Method::POST, &uri, &h, Some(&body)).await
        }
    };
    let (alice, bob) = (customer("alice"), customer("bob"));
    // Bob claims the key first: alice's write with the same key still writes, not 409 reused.
    let b = write(&bob, "bob", 1).await;
    assert_eq!(b.status, StatusCode::CREATED, "{}", b.json);
    let a = write(&alice, "alice", 2).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.json);
    assert_ne!(a.json, b.json, "alice's own write, not bob's answer replayed");
    // Alice's retry is her own replay.
    let again = write(&alice, "alice", 2).await;
    assert_eq!((again.status, again.json.clone()), (StatusCode::CREATED, a.json.clone()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_subjects_idempotency_keys_are_scoped_per_session_token() {
    let mut s = Stack::new("authz-idem-open", 1, "read_wait_ms = 5000").await;
    s.start_projector().await;
    let uri = format!("/v1/topics/{}/records", s.names.orders);
    let post = |token: Option<String>, v: i64| {
        let router = s.router.clone();
        let uri = uri.clone();
        async move {
            let mut h = vec![("idempotency-key", "shared-key")];
            if let Some(t) = &token {
                h.push((SESSION_HEADER, t.as_str()));
            }
            call(&router, Method::POST, &uri, &h, Some(&json!({"key": "k", "value": {"v": v}}))).await
        }
    };
    // Two callers, each with a session of its own (a read hands out a token).
    let session = || async {
        call(&s.router, Method::GET, &format!("/v1/models/{}/documents/x", s.names.model), &[], None)
            .await
            .token
            .unwrap()
    };
    let (one, two) = (session().await, session().await);
    let first = post(Some(one.clone()), 1).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.json);
    let other = post(Some(two.clone()), 2).await;
    assert_eq!(other.status, StatusCode::CREATED, "another session's key is its own: {}", other.json);
    assert_ne!(other.json["offset"], first.json["offset"]);
    let retry = post(Some(one.clone()), 1).await;
    assert_eq!((retry.status, retry.json.clone()), (StatusCode::CREATED, first.json.clone()), "the same token replays");
    // Callers without any token each get a scope of their own: no one can claim the key for them.
    let (x, y) = (post(None, 3).await, post(None, 4).await);
    assert_eq!((x.status, y.status), (StatusCode::CREATED, StatusCode::CREATED), "{} {}", x.json, y.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_see_the_access_mode_and_the_rules() {
    let (s, _idp) = url_stack("authz-status").await;
    let status = call(&s.admin, Method::GET, "/v1/status", &[], None).await;
    let access = &status.json["access"];
    assert_eq!(access["mode"], json!("rules"), "{access}");
    assert!(access["rules"].as_array().unwrap().contains(&json!("own-orders")), "{access}");
    assert_eq!(access["keys"]["kids"], json!(["rsa-1", "ec-1", "ed-1"]), "{access}");
    let open = Stack::new("authz-status-open", 1, "").await;
    let status = call(&open.admin, Method::GET, "/v1/status", &[], None).await;
    assert_eq!(status.json["access"]["mode"], json!("open"), "{}", status.json);
}
