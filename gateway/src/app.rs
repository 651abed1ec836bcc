//! The service: shared state, the router ([`app`]), the per-request middleware (metrics,
//! tracing by route, the request timeout), and [`Gateway`], which owns the background tasks
//! (the clock listener, the metadata refresh) and serves until its shutdown signal.

use std::collections::BTreeSet;
use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use rdkafka::producer::FutureProducer;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tower_http::trace::TraceLayer;

use crate::config::GatewayConfig;
use crate::facts::KafkaFacts;
use crate::metrics::{Metrics, METRICS};
use crate::notify::{self, ClockNotifier};
use crate::problem::{ApiError, Problem};
use crate::{ops, read, write};

/// What every handler shares. Cheap to clone.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

pub struct Inner {
    pub config: GatewayConfig,
    pub pool: PgPool,
    pub producer: FutureProducer,
    pub facts: KafkaFacts,
    pub notifier: Arc<ClockNotifier>,
    pub metrics: Arc<Metrics>,
    /// Names of the topics some configured model receives; ask [`Inner::receives`].
    pub received_topics: BTreeSet<String>,
}

impl Inner {
    /// Whether some configured model receives topic `name`: the topics writes may go to, and
    /// whose token pairs are never pruned for their log start (see
    /// [`crate::session::prunable_below_log_start`]).
    pub fn receives(&self, name: &str) -> bool {
        self.received_topics.contains(name)
    }
}

impl Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    /// Builds the state without touching the network: the pool connects lazily and the Kafka
    /// clients connect in the background.
    pub fn new(config: GatewayConfig) -> anyhow::Result<AppState> {
        let url = config.shared.database_url()?.to_string();
        let pool = PgPoolOptions::new()
            .max_connections(config.settings.max_connections)
            .acquire_timeout(Duration::from_millis(config.shared.database.acquire_timeout_ms))
            .connect_lazy(&url)
            .with_context(|| format!("invalid database URL {}", parsley_infra::pg::redact(&url)))?;
        let producer: FutureProducer = parsley_infra::kafka::producer_config(&config.shared.kafka.bootstrap)
            .set("message.timeout.ms", config.settings.produce_timeout_ms.to_string())
            .create()
            .context("creating the Kafka producer")?;
        let facts = KafkaFacts::new(&config.shared.kafka.bootstrap, config.settings.kafka_timeout())?;
        let notifier = Arc::new(ClockNotifier::new(config.shared.models.iter().map(|m| m.name.as_str())));
        let received_topics =
            config.shared.models.iter().flat_map(|m| m.topics.iter().map(|t| t.name.clone())).collect();
        Ok(AppState(Arc::new(Inner {
            config,
            pool,
            producer,
            facts,
            notifier,
            metrics: Metrics::new(METRICS),
            received_topics,
        })))
    }
}

/// The router. Tests drive it with `tower::ServiceExt::oneshot`; [`Gateway::serve`] serves it.
pub fn app(state: AppState) -> Router {
    let max_body = state.config.settings.max_body_bytes;
    Router::new()
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/v1/status", get(ops::status))
        .route("/v1/topics/{topic}/records", post(write::post_record))
        .route("/v1/models/{model}/documents", get(read::get_collection))
        .route("/v1/models/{model}/documents/{key}", get(read::get_document))
        .fallback(no_route)
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|req: &Request| {
                    // The route template, not the path: paths carry keys, and logs carry
                    // coordinates.
                    let route = req.extensions().get::<MatchedPath>().map_or("unmatched", |m| m.as_str());
                    tracing::info_span!("request", method = %req.method(), route)
                })
                // A 503 not-yet-covered is an answer, not a failure; internal errors are
                // logged once where they become a 500.
                .on_failure(()),
        )
        .with_state(state)
}

async fn no_route(uri: Uri) -> ApiError {
    ApiError::NoSuchRoute(uri.path().to_string())
}

/// Metrics per route and status, problem counts, and the request timeout (answered with a
/// problem document rather than a bare status).
async fn observe(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let route =
        req.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_string(), |m| m.as_str().to_string());
    let started = Instant::now();
    let response = match tokio::time::timeout(state.config.settings.request_timeout(), next.run(req)).await {
        Ok(r) => r,
        Err(_) => {
            let mut p = Problem::new(
                "request-timeout",
                "Request timed out",
                StatusCode::SERVICE_UNAVAILABLE,
                "the gateway could not answer within its request timeout",
            );
            p.retry_after = Some(state.config.settings.retry_after_s);
            p.into_response()
        }
    };
    let status = response.status();
    state.metrics.add("parsley_gateway_requests_total", &[("route", &route), ("status", status.as_str())], 1.0);
    state.metrics.observe("parsley_gateway_request_seconds", &[("route", &route)], started.elapsed().as_secs_f64());
    if let Some(kind) = problem_kind(&response) {
        state.metrics.add("parsley_gateway_problems_total", &[("type", &kind)], 1.0);
    }
    response
}

/// The problem kind of a problem response (an extension set when a [`Problem`] is rendered).
fn problem_kind(response: &Response) -> Option<String> {
    response.extensions().get::<crate::problem::ProblemKind>().map(|k| k.0.to_string())
}

/// The gateway process: state, router and background tasks.
pub struct Gateway {
    state: AppState,
}

impl Gateway {
    pub fn new(config: GatewayConfig) -> anyhow::Result<Gateway> {
        Ok(Gateway { state: AppState::new(config)? })
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    pub fn router(&self) -> Router {
        app(self.state.clone())
    }

    /// Binds `gateway.listen` (port 0 picks a free port).
    pub async fn bind(&self) -> anyhow::Result<TcpListener> {
        let address = &self.state.config.settings.listen;
        TcpListener::bind(address).await.with_context(|| format!("binding {address}"))
    }

    /// Starts the clock listener and the periodic metadata refresh; both stop when
    /// `shutdown` turns true.
    pub fn spawn_background(&self, shutdown: watch::Receiver<bool>) -> Vec<JoinHandle<()>> {
        let s = &self.state;
        let listener = tokio::spawn(notify::listen(
            s.pool.clone(),
            Arc::clone(&s.notifier),
            Arc::clone(&s.metrics),
            shutdown.clone(),
        ));
        let refresher = tokio::spawn(refresh_metadata(s.clone(), shutdown));
        vec![listener, refresher]
    }

    /// Serves on `listener` until `shutdown` turns true, then finishes the requests in
    /// flight and stops the background tasks.
    pub async fn serve(self, listener: TcpListener, shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
        let background = self.spawn_background(shutdown.clone());
        let mut stop = shutdown.clone();
        axum::serve(listener, self.router())
            .with_graceful_shutdown(async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await
            .context("serving HTTP")?;
        for task in background {
            let _ = task.await;
        }
        Ok(())
    }
}

/// Refreshes the configured topics and every topic the cache knows, at start and then every
/// `gateway.metadata_refresh_ms`.
async fn refresh_metadata(state: AppState, mut shutdown: watch::Receiver<bool>) {
    let every = state.config.settings.metadata_refresh();
    loop {
        let mut names: BTreeSet<String> = state.received_topics.clone();
        names.extend(state.facts.known_names());
        let names: Vec<String> = names.into_iter().collect();
        if let Err(e) = state.facts.refresh_topics(&names).await {
            tracing::warn!(error = %format!("{e:#}"), "refreshing topic metadata failed");
        }
        tokio::select! {
            _ = shutdown.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    //! Routing and problem documents that need no infrastructure: everything here is
    //! refused before the gateway talks to Kafka or Postgres (the pool connects lazily, the
    //! Kafka clients point at a closed port).

    use axum::body::Body;
    use axum::http::{header, Method};
    use parsley::{CausalPast, ChannelId, TopicId};
    use parsley_projector::config::Config;
    use serde_json::Value;
    use tower::ServiceExt as _;

    use super::*;
    use crate::token::{self, KeyRing, SecretKey, Session};

    const FILE: &str = r#"
[kafka]
bootstrap = "127.0.0.1:1"
[database]
url = "postgres://nobody:secret@127.0.0.1:1/none"
[[models]]
name = "shop"
topics = [{ name = "orders" }, { name = "payments", apply = "merge" }]
[gateway]
subject_header = "x-subject"
max_body_bytes = 256
"#;

    fn ring() -> KeyRing {
        KeyRing::new(vec![("k1".into(), SecretKey::from_bytes([5; 32]))]).unwrap()
    }

    fn state() -> AppState {
        let shared = Config::parse(FILE).unwrap();
        AppState::new(GatewayConfig::with_keys(shared, ring()).unwrap()).unwrap()
    }

    fn sealed(expires_at: u64, subject: Option<&str>) -> String {
        let c = ChannelId::new(TopicId::from_bytes([7; 16]), 0);
        let session = Session {
            issued_at: 1,
            expires_at,
            subject: subject.map(String::from),
            past: CausalPast::from_pairs([(c, 3)]),
        };
        token::seal(&ring(), &session)
    }

    async fn call(method: Method, uri: &str, headers: &[(&str, &str)], body: &str) -> (StatusCode, Value, Response) {
        let mut req = axum::http::Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let response = app(state()).oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
        let status = response.status();
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
        let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (status, json, Response::from_parts(parts, Body::empty()))
    }

    /// Asserts a problem document of `kind` with `status`, returning its body.
    async fn problem(
        method: Method,
        uri: &str,
        headers: &[(&str, &str)],
        body: &str,
        status: u16,
        kind: &str,
    ) -> Value {
        let (s, json, response) = call(method, uri, headers, body).await;
        assert_eq!(s.as_u16(), status, "{uri}: {json}");
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/problem+json", "{uri}");
        assert_eq!(json["type"], format!("https://parsley.dev/problems/{kind}"), "{uri}: {json}");
        assert_eq!(json["status"], status, "{uri}");
        assert!(json["title"].is_string() && json["detail"].is_string(), "{json}");
        json
    }

    const WRITE: &str = "/v1/topics/orders/records";
    const READ: &str = "/v1/models/shop/documents/o1";
    const BODY: &str = r#"{"key":"o1","value":{"total":3}}"#;

    #[tokio::test]
    async fn bad_tokens_are_refused_with_their_type_never_read_as_empty() {
        let far = session_far();
        for uri in [READ, "/v1/models/shop/documents"] {
            problem(Method::GET, uri, &[(crate::SESSION_HEADER, "not a token!")], "", 400, "token-malformed").await;
            problem(Method::GET, uri, &[(crate::SESSION_HEADER, "AQ")], "", 400, "token-malformed").await;
            let mut tampered = sealed(far, None).into_bytes();
            let last = tampered.len() - 3;
            tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
            let tampered = String::from_utf8(tampered).unwrap();
            problem(Method::GET, uri, &[(crate::SESSION_HEADER, &tampered)], "", 400, "token-invalid").await;
            problem(Method::GET, uri, &[(crate::SESSION_HEADER, &sealed(10, None))], "", 400, "token-expired").await;
            let bound = sealed(far, Some("alice"));
            problem(
                Method::GET,
                uri,
                &[(crate::SESSION_HEADER, &bound), ("x-subject", "bob")],
                "",
                403,
                "token-wrong-subject",
            )
            .await;
            problem(Method::GET, uri, &[(crate::SESSION_HEADER, &bound)], "", 403, "token-wrong-subject").await;
        }
        problem(Method::POST, WRITE, &[(crate::SESSION_HEADER, "%%%")], BODY, 400, "token-malformed").await;
        let t = sealed(10, None);
        problem(Method::POST, WRITE, &[(crate::SESSION_HEADER, &t)], BODY, 400, "token-expired").await;
        let two = [(crate::SESSION_HEADER, t.as_str()), (crate::SESSION_HEADER, t.as_str())];
        problem(Method::GET, READ, &two, "", 400, "token-malformed").await;
        let long = "s".repeat(300);
        problem(Method::GET, READ, &[("x-subject", &long)], "", 400, "invalid-subject").await;
    }

    fn session_far() -> u64 {
        crate::session::unix_now() + 3600
    }

    #[tokio::test]
    async fn writes_are_checked_before_anything_is_produced() {
        let body = r#"{"key":"o1","value":1,"headers":{"parsley.causes":"x"}}"#;
        let p = problem(Method::POST, WRITE, &[], body, 400, "reserved-header").await;
        assert!(p["detail"].as_str().unwrap().contains("parsley.causes"), "{p}");
        let body = r#"{"key":"o1","value":1,"headers":{"PARSLEY.trace":"x"}}"#;
        problem(Method::POST, WRITE, &[], body, 400, "reserved-header").await;

        let p = problem(Method::POST, "/v1/topics/elsewhere/records", &[], BODY, 404, "unknown-topic").await;
        assert_eq!(p["topic"], "elsewhere");

        for (body, reason) in [
            ("", "expected"),
            ("{", "EOF"),
            (r#"{"value":1}"#, "missing field `key`"),
            (r#"{"key":"k"}"#, "missing field `value`"),
            (r#"{"key":"k","value":1,"partition":3}"#, "unknown field `partition`"),
        ] {
            let p = problem(Method::POST, WRITE, &[], body, 400, "invalid-body").await;
            assert!(p["detail"].as_str().unwrap().contains(reason), "{body}: {p}");
        }
        let big = format!(r#"{{"key":"k","value":"{}"}}"#, "x".repeat(400));
        problem(Method::POST, WRITE, &[], &big, 413, "body-too-large").await;
    }

    #[tokio::test]
    async fn routes_and_queries_are_checked() {
        let p = problem(Method::GET, "/v1/models/nope/documents/k", &[], "", 404, "unknown-model").await;
        assert_eq!(p["model"], "nope");
        problem(Method::GET, "/v1/models/nope/documents", &[], "", 404, "unknown-model").await;
        problem(Method::GET, "/v1/models/shop/documents?limit=0", &[], "", 400, "invalid-query").await;
        problem(Method::GET, "/v1/models/shop/documents?limit=5000", &[], "", 400, "invalid-query").await;
        problem(Method::GET, "/v1/models/shop/documents?page=2", &[], "", 400, "invalid-query").await;
        problem(Method::GET, "/v2/anything", &[], "", 404, "no-such-route").await;
    }

    #[tokio::test]
    async fn health_and_metrics_answer_without_infrastructure() {
        let (s, json, _) = call(Method::GET, "/healthz", &[], "").await;
        assert_eq!((s, json["status"].as_str()), (StatusCode::OK, Some("ok")));
        let response = app(state())
            .oneshot(axum::http::Request::builder().uri("/metrics").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let text = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let text = String::from_utf8(text.to_vec()).unwrap();
        assert!(text.contains("# TYPE parsley_gateway_requests_total counter"), "{text}");
    }

    #[tokio::test]
    async fn readiness_reports_each_unreachable_dependency() {
        let text = FILE
            .replace("[gateway]", "[gateway]\nkafka_timeout_ms = 200")
            .replace("[database]", "[database]\nacquire_timeout_ms = 200");
        let s = AppState::new(GatewayConfig::with_keys(Config::parse(&text).unwrap(), ring()).unwrap()).unwrap();
        let req = axum::http::Request::builder().uri("/readyz").body(Body::empty()).unwrap();
        let response = app(s).oneshot(req).await.unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let json: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["type"], "https://parsley.dev/problems/not-ready");
        for check in ["database", "migrations", "kafka"] {
            assert_eq!(json["checks"][check]["ok"], false, "{json}");
        }
        assert!(!json.to_string().contains("secret"), "the database password never leaks: {json}");
    }

    #[tokio::test]
    async fn problems_are_counted_by_type() {
        let s = state();
        let req = axum::http::Request::builder().uri("/v1/models/nope/documents/k").body(Body::empty()).unwrap();
        let _ = app(s.clone()).oneshot(req).await.unwrap();
        assert_eq!(s.metrics.value("parsley_gateway_problems_total", &[("type", "unknown-model")]), Some(1.0));
        assert_eq!(
            s.metrics.value(
                "parsley_gateway_requests_total",
                &[("route", "/v1/models/{model}/documents/{key}"), ("status", "404")]
            ),
            Some(1.0)
        );
    }
}
