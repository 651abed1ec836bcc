//! Shared test machinery: the services from the environment (a clear failure when they are
//! missing), unique names, topics, a stack of the real projector (its library API, driven
//! until stopped) plus the gateway's router driven with `oneshot`, and request helpers.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use parsley::{CausalPast, ChannelId, TopicId};
use parsley_gateway::session::unix_now;
use parsley_gateway::token::{self, KeyRing, SecretKey, Session, TokenLimits};
use parsley_gateway::{admin_app, app, AppState, Gateway, GatewayConfig, SESSION_HEADER};
use parsley_projector::metrics::{Metrics, METRICS};
use parsley_projector::{DocumentProjection, ModelProjector};
use parsley_settings::config::{Apply, Config, InitialPosition, ModelConfig, TopicConfig};
use parsley_store::migrations;
pub use parsley_testkit::{
    bootstrap, create_topics, database_url, delete_records, producer, transactional_producer, unique, TIMEOUT,
};
use rdkafka::producer::FutureProducer;
use serde_json::Value;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tower::ServiceExt as _;

/// A pool on the test database with the schema migrated.
pub async fn pool() -> PgPool {
    let pool = parsley_infra::pg::connect(&database_url(), 4, TIMEOUT).await.unwrap_or_else(|e| panic!("{e:#}"));
    migrations::run(&pool).await.unwrap_or_else(|e| panic!("{e:#}"));
    pool
}

/// Produces one record to `topic`/`partition` around the gateway, with `causes` as its
/// `parsley.causes` header, and returns its offset.
pub async fn produce(
    producer: &FutureProducer,
    topic: &str,
    partition: i32,
    key: &str,
    value: &[u8],
    causes: Option<&CausalPast>,
) -> i64 {
    let causes = causes.map(CausalPast::encode);
    parsley_testkit::produce(producer, topic, partition, key, Some(value), causes.as_deref()).await
}

/// The key ring every test gateway seals with.
pub fn ring() -> KeyRing {
    KeyRing::new(vec![("it".to_string(), SecretKey::from_bytes([0x42; 32]))]).unwrap()
}

/// A token naming `past`, sealed as the test gateways seal, expiring at `expires_at`.
pub fn seal(past: CausalPast, expires_at: u64) -> String {
    token::seal(&ring(), &Session { issued_at: unix_now() - 10, expires_at, subject: None, past })
}

/// Opens a token a test gateway handed out.
pub fn open(t: &str) -> Session {
    token::open(&ring(), t, unix_now(), None, &TokenLimits::default()).expect("the gateway's token opens")
}

/// Channel `partition` of topic `name`, by its ID as the gateway resolves it.
pub async fn channel(state: &AppState, name: &str, partition: u32) -> ChannelId {
    let id: TopicId = state.facts.topic(name).await.unwrap().unwrap_or_else(|| panic!("topic {name} exists")).id;
    ChannelId::new(id, partition)
}

/// A model receiving `orders` (replace) and `payments` (merge), with `partitions` tasks.
pub struct Names {
    pub model: String,
    pub orders: String,
    pub payments: String,
}

impl Names {
    pub fn new(prefix: &str) -> Names {
        let base = unique(prefix);
        Names { model: base.clone(), orders: format!("{base}.orders"), payments: format!("{base}.payments") }
    }
}

/// `access = "open"` for a `[gateway]` table that neither authenticates nor chooses its
/// access itself (the tests of everything but authorization run open).
pub fn open_unless_authenticated(gateway: &str) -> &'static str {
    if gateway.contains("[gateway.auth]") || gateway.contains("access =") {
        ""
    } else {
        "access = \"open\"\n"
    }
}

/// The shared configuration for the test services, with `gateway` as the `[gateway]` table.
/// Unless `gateway` names one, the admin listener binds a free port (tests run side by side).
pub fn config(n: &Names, gateway: &str) -> Config {
    let admin = if gateway.contains("admin_listen") { "" } else { "admin_listen = \"127.0.0.1:0\"\n" };
    let access = open_unless_authenticated(gateway);
    let mut c = Config::parse(&format!("[gateway]\n{access}{admin}{gateway}\n")).unwrap();
    c.kafka.bootstrap = bootstrap();
    c.database.url = Some(database_url().into());
    c.projector.owner = Some(unique("owner"));
    c.projector.metrics_address = String::new();
    c.projector.initial_backoff_ms = 50;
    c.projector.max_backoff_ms = 400;
    c.models.push(ModelConfig {
        name: n.model.clone(),
        projection: parsley_settings::config::DOCUMENTS_PROJECTION.to_string(),
        migrations: None,
        options: Default::default(),
        queries: Vec::new(),
        topics: vec![
            TopicConfig { apply: Apply::Replace, ..TopicConfig::named(&n.orders) },
            TopicConfig { apply: Apply::Merge, ..TopicConfig::named(&n.payments) },
        ],
        initial_position: InitialPosition::Earliest,
        max_step_records: 500,
        max_step_bytes: parsley_settings::config::DEFAULT_MAX_STEP_BYTES,
        max_step_ms: 50,
        step_linger_ms: 5,
        tasks: None,
        on_rejected: Default::default(),
        max_held_records: 100_000,
        max_held_bytes: 256 * 1024 * 1024,
    });
    c.validate().unwrap();
    c
}

/// One HTTP answer.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub json: Value,
    pub token: Option<String>,
    pub retry_after: Option<String>,
    pub content_type: Option<String>,
}

impl Reply {
    /// The new token; panics with the body when there is none.
    pub fn token(&self) -> String {
        self.token.clone().unwrap_or_else(|| panic!("no session token in {} {}", self.status, self.json))
    }

    pub fn problem_type(&self) -> &str {
        self.json["type"].as_str().unwrap_or("")
    }
}

/// Sends one request through `router`.
pub async fn send(router: &Router, method: Method, uri: &str, token: Option<&str>, body: Option<&Value>) -> Reply {
    let body = body.map(|b| serde_json::to_vec(b).unwrap());
    send_raw(router, method, uri, token, body.as_deref()).await
}

/// Sends one request with a body of exactly `body` through `router`.
pub async fn send_raw(router: &Router, method: Method, uri: &str, token: Option<&str>, body: Option<&[u8]>) -> Reply {
    let headers: Vec<(&str, &str)> = token.map(|t| (SESSION_HEADER, t)).into_iter().collect();
    send_headers(router, method, uri, &headers, body).await
}

/// Sends one request with `headers` (repeated names kept) and a body of exactly `body`.
pub async fn send_headers(
    router: &Router,
    method: Method,
    uri: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Reply {
    let mut req = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Body::from(b.to_vec())
        }
        None => Body::empty(),
    };
    let response = router.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let (status, token, retry_after, content_type) = {
        let header = |name: &str| response.headers().get(name).map(|v| v.to_str().unwrap().to_string());
        (response.status(), header(SESSION_HEADER), header("retry-after"), header("content-type"))
    };
    let bytes = axum::body::to_bytes(response.into_body(), 16 << 20).await.unwrap();
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Reply { status, json, token, retry_after, content_type }
}

/// A running projector.
struct Running {
    stop: watch::Sender<bool>,
    handle: JoinHandle<anyhow::Result<()>>,
}

/// The real projector for one model plus a gateway over the same services.
pub struct Stack {
    pub names: Names,
    pub config: Config,
    pub pool: PgPool,
    pub state: AppState,
    pub router: Router,
    /// The admin listener's router (`/v1/status`, `/metrics`).
    pub admin: Router,
    stop_gateway: watch::Sender<bool>,
    projector: Option<Running>,
}

impl Stack {
    /// Creates the topics (`partitions` each) and a gateway with `[gateway]` settings
    /// `gateway`; the projector is not started.
    pub async fn new(prefix: &str, partitions: i32, gateway: &str) -> Stack {
        Stack::with_config(prefix, partitions, gateway, |_, _| {}).await
    }

    /// [`Stack::new`] with the configuration changed by `edit` (then validated).
    pub async fn with_config(
        prefix: &str,
        partitions: i32,
        gateway: &str,
        edit: impl FnOnce(&Names, &mut Config),
    ) -> Stack {
        let names = Names::new(prefix);
        create_topics(&[&names.orders, &names.payments], partitions).await;
        let pool = pool().await;
        let mut config = config(&names, gateway);
        edit(&names, &mut config);
        config.validate().unwrap_or_else(|e| panic!("{e:#}"));
        let (state, stop_gateway) = start_gateway(&config).await;
        let router = app(state.clone());
        let admin = admin_app(state.clone());
        Stack { names, config, pool, state, router, admin, stop_gateway, projector: None }
    }

    /// Another gateway over the same model with different `[gateway]` settings.
    pub async fn other_gateway(&self, gateway: &str) -> (Router, watch::Sender<bool>) {
        let mut config = self.config.clone();
        let access = open_unless_authenticated(gateway);
        config.gateway = Config::parse(&format!("[gateway]\n{access}{gateway}\n")).unwrap().gateway;
        let (state, stop) = start_gateway(&config).await;
        (app(state), stop)
    }

    pub async fn start_projector(&mut self) {
        assert!(self.projector.is_none(), "the projector is already running");
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
        let handle = tokio::spawn(projector.run(shutdown));
        self.projector = Some(Running { stop, handle });
    }

    pub async fn stop_projector(&mut self) {
        let running = self.projector.take().expect("the projector is running");
        running.stop.send(true).unwrap();
        running.handle.await.unwrap().unwrap_or_else(|e| panic!("the projector failed: {e:#}"));
    }

    pub async fn send(&self, method: Method, uri: &str, token: Option<&str>, body: Option<&Value>) -> Reply {
        send(&self.router, method, uri, token, body).await
    }

    pub async fn write(&self, topic: &str, key: &str, value: Value, token: Option<&str>) -> Reply {
        let body = serde_json::json!({"key": key, "value": value});
        self.send(Method::POST, &format!("/v1/topics/{topic}/records"), token, Some(&body)).await
    }

    pub async fn read(&self, key: &str, token: Option<&str>) -> Reply {
        self.send(Method::GET, &format!("/v1/models/{}/documents/{key}", self.names.model), token, None).await
    }

    /// `GET /v1/status` on the admin router.
    pub async fn status(&self) -> Reply {
        send(&self.admin, Method::GET, "/v1/status", None, None).await
    }

    pub async fn list(&self, query: &str, token: Option<&str>) -> Reply {
        self.send(Method::GET, &format!("/v1/models/{}/documents{query}", self.names.model), token, None).await
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = self.stop_gateway.send(true);
        if let Some(r) = &self.projector {
            let _ = r.stop.send(true);
        }
    }
}

/// A gateway state over `config` with its background tasks (clock listener, metadata
/// refresh) running until the returned sender says stop.
async fn start_gateway(config: &Config) -> (AppState, watch::Sender<bool>) {
    let gateway = Gateway::new(GatewayConfig::with_keys(config.clone(), ring()).unwrap()).unwrap();
    let (stop, shutdown) = watch::channel(false);
    let _ = gateway.spawn_background(shutdown);
    (gateway.state().clone(), stop)
}

/// Reads `key` with `token`, waiting out `503`s (a task catching up, after a skip say) for at
/// most 45 s: never a stale read.
pub async fn read_covered(s: &Stack, key: &str, token: &str) -> Reply {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(45);
    loop {
        let r = s.read(key, Some(token)).await;
        if r.status != StatusCode::SERVICE_UNAVAILABLE || std::time::Instant::now() > deadline {
            return r;
        }
    }
}

/// Every partition serves read-your-writes: `value(key)` written through the gateway on a
/// fresh key of each of the `partitions` (placed by `partitioner`), then read back with the
/// session the write returned.
pub async fn every_partition_reads_its_writes(
    s: &Stack,
    partitioner: parsley::partitioner::Partitioner,
    partitions: u32,
    value: impl Fn(&str) -> Value,
) {
    let base = unique("ryw");
    for p in 0..partitions {
        let key = (0..)
            .map(|i| format!("{base}-{i}"))
            .find(|k| partitioner.partition_for_key(k.as_bytes(), partitions) == Some(p))
            .expect("a key for every partition");
        let value = value(&key);
        let w = s.write(&s.names.orders, &key, value.clone(), None).await;
        assert_eq!(w.status, StatusCode::CREATED, "write on partition {p}: {}", w.json);
        assert_eq!(w.json["partition"], serde_json::json!(p), "{key:?} placed by {partitioner}: {}", w.json);
        let r = read_covered(s, &key, &w.token()).await;
        assert_eq!(r.status, StatusCode::OK, "read-your-writes on partition {p}: {}", r.json);
        assert_eq!(r.json["document"], value, "partition {p}");
    }
}
