//! The service: the routers ([`app`] for clients, [`admin_app`] for operators), the
//! per-request middleware (metrics, tracing by route, the response timeout, the in-flight
//! limit, the admin bearer check, answering a panic with a 500), and [`Gateway`], which owns
//! the background tasks (the clock listener, the metadata refresh, the token keys' reloader)
//! and serves both listeners until its shutdown signal. The state the handlers share is
//! [`AppState`] ([`crate::state`]).

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::TraceLayer;

use crate::keys;
use crate::metrics::Metric;
use crate::notify;
use crate::problem::{ApiError, Problem, ProblemType};
use crate::server::{self, ServerLimits};
use crate::settings::GatewayConfig;
use crate::state::AppState;
use crate::{ops, read, write};

/// The clients' router (the main listener). Tests drive it with
/// `tower::ServiceExt::oneshot`; [`Gateway::serve`] serves it.
///
/// The admin routes (`/v1/status`, `/metrics`) are served here only to requests bearing the
/// admin token, when one is configured (`401 unauthorized` otherwise); without one they are
/// not routes here (`404`) and only the admin listener serves them.
pub fn app(state: AppState) -> Router {
    clients(state, true)
}

/// The clients' routes as [`app`] serves them, with their layers and the state applied, but
/// without its fallback (the `404 no-such-route` answer for any other path): a router an
/// embedding program can `.merge()` into its own axum app or `.nest()` under a prefix, beside
/// its own routes (which may use [`crate::gated::Gate`] for the same gated reads). Run the
/// state's background tasks too ([`Gateway::spawn_background`]): without the clock listener,
/// waiting reads are woken only by the re-check timer.
///
/// ```no_run
/// # fn embed(gateway: parsley_gateway::Gateway, own: axum::Router) {
/// // The program's own routes, and the gateway's under /parsley.
/// let app: axum::Router = own.nest("/parsley", parsley_gateway::routes(gateway.state().clone()));
/// # let _ = app;
/// # }
/// ```
///
/// ([`crate::gated`]'s documentation has a custom gated route.)
pub fn routes(state: AppState) -> Router {
    clients(state, false)
}

/// The clients' routes and layers, with the `no-such-route` fallback or without it.
fn clients(state: AppState, fallback: bool) -> Router {
    let max_body = state.config.settings.max_body_bytes;
    let admin = Router::new()
        .route("/metrics", get(ops::metrics))
        .route("/v1/status", get(ops::status))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_admin_token));
    let clients = Router::new()
        .route("/readyz", get(ops::readyz))
        .route("/openapi.json", get(crate::openapi::document))
        .route("/v1/topics/{topic}/records", post(write::post_record))
        .route("/v1/records", post(crate::batch::post_batch))
        .route("/v1/sessions", post(crate::session::post_session))
        .route("/v1/models/{model}/documents", get(read::get_collection))
        .route("/v1/models/{model}/documents/{key}", get(read::get_document))
        .route("/v1/models/{model}/queries/{name}", get(crate::queries::get_query));
    let clients = if state.config.admin_token.is_some() { clients.merge(admin) } else { clients };
    let clients = clients.layer(middleware::from_fn_with_state(state.clone(), limit_in_flight));
    // Outside the permit: a body is received before the request takes one.
    let clients = clients.layer(middleware::from_fn_with_state(state.clone(), crate::receive::receive_body));
    let router = Router::new().route("/healthz", get(ops::livez)).route("/livez", get(ops::livez)).merge(clients);
    let router = if fallback { router.fallback(no_route) } else { router };
    let router = finish(router, &state).layer(DefaultBodyLimit::max(max_body));
    // Without an allowed origin the CORS layer would only pass every request through: it is
    // left out, and costs nothing per request.
    let router = if state.config.settings.cors_allowed_origins.is_empty() {
        router
    } else {
        router.layer(middleware::from_fn_with_state(state.clone(), crate::cors::cors))
    };
    router.with_state(state)
}

/// The operators' router (the admin listener, `gateway.admin_listen`): `/v1/status`,
/// `/metrics`, `/livez` (and `/healthz`), `/readyz`, with no credential — bind it where only
/// operators reach.
pub fn admin_app(state: AppState) -> Router {
    let router = Router::new()
        .route("/healthz", get(ops::livez))
        .route("/livez", get(ops::livez))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/v1/status", get(ops::status))
        .fallback(no_route);
    finish(router, &state).with_state(state)
}

/// The layers every route has, innermost first: a panic answered with a 500 problem, the
/// metrics and the response timeout, the request's span.
fn finish(router: Router<AppState>, state: &AppState) -> Router<AppState> {
    router.layer(catch_panics(state)).layer(middleware::from_fn_with_state(state.clone(), observe)).layer(
        TraceLayer::new_for_http()
            .make_span_with(|req: &Request| {
                // The route template, not the path: paths carry keys, and logs carry
                // coordinates.
                let route = req.extensions().get::<MatchedPath>().map_or("unmatched", |m| m.as_str());
                crate::trace::request_span(req.headers(), req.method(), route)
            })
            // A 503 not-yet-covered is an answer, not a failure; internal errors are
            // logged once where they become a 500.
            .on_failure(()),
    )
}

/// Answers a handler's panic with a `500 internal` problem document (the panic is logged,
/// never shown) and counts it in `parsley_gateway_panics_total`. The connection and every
/// other request carry on.
pub fn catch_panics(
    state: &AppState,
) -> CatchPanicLayer<impl FnMut(Box<dyn Any + Send + 'static>) -> Response + Clone + Send + Sync + 'static> {
    let metrics = Arc::clone(&state.metrics);
    CatchPanicLayer::custom(move |panic: Box<dyn Any + Send + 'static>| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_string());
        metrics.add(Metric::PanicsTotal, &[], 1.0);
        ApiError::Internal(anyhow::anyhow!("a request handler panicked: {message}")).into_response()
    })
}

/// Refuses a request at once (`503 overloaded`) when `gateway.max_in_flight` are already
/// being handled: a refusal, not a queue.
async fn limit_in_flight(State(state): State<AppState>, req: Request, next: Next) -> Response {
    match Arc::clone(&state.in_flight).try_acquire_owned() {
        Ok(_permit) => next.run(req).await,
        Err(_) => {
            state.metrics.add(Metric::OverloadedTotal, &[("limit", "max_in_flight")], 1.0);
            ApiError::Overloaded {
                detail: format!(
                    "{} requests are in flight (gateway.max_in_flight); retry later",
                    state.config.settings.max_in_flight
                ),
                retry_after: state.config.settings.retry_after_s,
            }
            .into_response()
        }
    }
}

/// The credentials of an `Authorization: Bearer <token>` value (the scheme in any case).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| rest.trim_ascii())
}

/// On the main listener, the admin routes need `Authorization: Bearer <admin token>`.
async fn require_admin_token(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(expected) = &state.config.admin_token else {
        return ApiError::NoSuchRoute(req.uri().path().to_string()).into_response();
    };
    let mut offered = req.headers().get_all(header::AUTHORIZATION).iter();
    let bearer = match (offered.next(), offered.next()) {
        (Some(v), None) => bearer_token(v.as_bytes()),
        _ => None,
    };
    match bearer {
        Some(token) if expected.matches(token) => next.run(req).await,
        Some(_) => ApiError::Unauthorized("the admin bearer token is wrong".into()).into_response(),
        None => ApiError::Unauthorized(
            "this route needs the admin token: Authorization: Bearer <token> (or use the admin listener)".into(),
        )
        .into_response(),
    }
}

async fn no_route(uri: Uri) -> ApiError {
    ApiError::NoSuchRoute(uri.path().to_string())
}

/// Metrics per route and status, problem counts, the response timeout (answered with a
/// problem document rather than a bare status), and while draining `Connection: close`, so
/// that kept-alive clients reconnect (through their balancer, to a ready gateway).
async fn observe(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let matched = req.extensions().get::<MatchedPath>().cloned();
    let route = matched.as_ref().map_or("unmatched", MatchedPath::as_str);
    let started = Instant::now();
    let response = match tokio::time::timeout(state.config.settings.response_timeout(), next.run(req)).await {
        Ok(r) => r,
        Err(_) => {
            let mut p =
                Problem::new(ProblemType::RequestTimeout, "the gateway could not answer within its response timeout");
            p.retry_after = Some(state.config.settings.retry_after_s);
            p.into_response()
        }
    };
    let mut response = response;
    if state.readiness.draining() {
        response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    }
    let status = response.status();
    state.metrics.add(Metric::RequestsTotal, &[("route", route), ("status", status.as_str())], 1.0);
    state.metrics.observe(Metric::RequestSeconds, &[("route", route)], started.elapsed().as_secs_f64());
    if let Some(kind) = problem_kind(&response) {
        state.metrics.add(Metric::ProblemsTotal, &[("type", &kind)], 1.0);
    }
    response
}

/// The problem kind of a problem response (an extension set when a [`Problem`] is rendered).
fn problem_kind(response: &Response) -> Option<String> {
    response.extensions().get::<crate::problem::ProblemKind>().map(|k| k.0.kind().to_string())
}

/// The gateway's bound listeners: the main one, and the admin one when
/// `gateway.admin_listen` is set.
pub struct Listeners {
    pub main: TcpListener,
    pub admin: Option<TcpListener>,
}

impl Listeners {
    /// The main listener's address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.main.local_addr()
    }

    /// The admin listener's address, if there is one.
    pub fn admin_addr(&self) -> Option<std::io::Result<SocketAddr>> {
        self.admin.as_ref().map(TcpListener::local_addr)
    }
}

/// The gateway process: state, routers and background tasks.
pub struct Gateway {
    state: AppState,
}

impl Gateway {
    pub fn new(config: GatewayConfig) -> anyhow::Result<Gateway> {
        match config.settings.access_mode() {
            crate::settings::AccessMode::Open => tracing::warn!(
                "gateway.access = \"open\": every caller may write to every received topic and read every model; \
                 configure [gateway.auth] and [[gateway.rules]] to authorize callers (docs/gateway.md, \"Authorization\")"
            ),
            crate::settings::AccessMode::Rules => tracing::info!(
                rules = %config.access.rule_names().join(","),
                "authentication on: every data route needs a bearer JWT and a rule allowing it"
            ),
        }
        let state = AppState::new(config)?;
        state.metrics.set(
            Metric::BuildInfo,
            &[("version", env!("CARGO_PKG_VERSION")), ("commit", env!("PARSLEY_BUILD_COMMIT"))],
            1.0,
        );
        Ok(Gateway { state })
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    pub fn router(&self) -> Router {
        app(self.state.clone())
    }

    /// Binds `gateway.listen` and, unless it is empty, `gateway.admin_listen` (port 0 picks
    /// a free port).
    pub async fn bind(&self) -> anyhow::Result<Listeners> {
        let settings = &self.state.config.settings;
        let main = TcpListener::bind(&settings.listen).await.with_context(|| format!("binding {}", settings.listen))?;
        let admin = match settings.admin_listen.as_str() {
            "" => None,
            address => Some(
                TcpListener::bind(address).await.with_context(|| format!("binding the admin listener {address}"))?,
            ),
        };
        Ok(Listeners { main, admin })
    }

    /// Starts the clock listener, the periodic metadata refresh, the dependency checks of
    /// `/readyz` ([`crate::health::run_checks`]) and, for keys from a file or the environment,
    /// the token keys' reloader (its `SIGHUP` handler is installed before this returns); all
    /// stop when `shutdown` turns true.
    pub fn spawn_background(&self, shutdown: watch::Receiver<bool>) -> Vec<JoinHandle<()>> {
        let s = &self.state;
        let listener = tokio::spawn(notify::listen(
            s.pool.clone(),
            Arc::clone(&s.notifier),
            Arc::clone(&s.metrics),
            shutdown.clone(),
        ));
        let refresher = tokio::spawn(refresh_metadata(s.clone(), shutdown.clone()));
        let checks = tokio::spawn(crate::health::run_checks(s.clone(), shutdown.clone()));
        let poll = s.config.settings.token_keys_reload();
        let identity = s.config.verifier.as_ref().map(|v| v.keys.spawn(Arc::clone(&s.metrics), poll, shutdown.clone()));
        let reloader = keys::spawn_reloader(Arc::clone(&s.config.keys), Arc::clone(&s.metrics), poll, shutdown);
        [listener, refresher, checks].into_iter().chain(reloader).chain(identity).collect()
    }

    /// Chooses the role each model's named queries run under (`gateway.query_roles`) and
    /// checks that every named query can run under it: a query its role may not read is an
    /// error naming it (the gateway must not start). A query naming a table that does not
    /// exist yet (the model's migrations have not run) is logged and left to answer at
    /// request time; an unreachable database skips the check (`/readyz` says so).
    pub async fn check_queries(&self) -> anyhow::Result<()> {
        use crate::settings::QueryRoles;
        use parsley_store::queries::{check_query, ParamValue};
        let s = &self.state;
        let mode = s.config.settings.query_roles;
        let mut roles = BTreeMap::new();
        for model in s.config.shared.models.iter().filter(|m| !m.queries.is_empty()) {
            let role = match mode {
                QueryRoles::Off => None,
                QueryRoles::Auto | QueryRoles::Required => {
                    let role = parsley_store::roles::query_role(&model.name);
                    match parsley_store::roles::usable(&s.pool, &role).await {
                        Ok(true) => Some(role),
                        Ok(false) if mode == QueryRoles::Required => anyhow::bail!(
                            "model {:?}: its named queries must run under the read role {role:?} \
                             (gateway.query_roles = \"required\"), which does not exist or the gateway's role may \
                             not take: run `parsley-projector migrate --create-roles --gateway-user <the gateway's \
                             login role>` (docs/operations.md, \"Database roles\")",
                            model.name
                        ),
                        Ok(false) => {
                            tracing::warn!(
                                model = %model.name,
                                role,
                                "the model's named queries run under the gateway's own role: its read role does not \
                                 exist (parsley-projector migrate --create-roles)"
                            );
                            None
                        }
                        Err(e) => {
                            tracing::warn!(error = %format!("{e:#}"), "the database did not answer: named queries not checked");
                            return Ok(());
                        }
                    }
                }
            };
            for query in &model.queries {
                let rewritten = parsley_settings::sql_params::rewrite(&query.sql)
                    .map_err(|e| anyhow::anyhow!("query {:?} of model {:?}: {e}", query.name, model.name))?;
                // Planned with placeholder values of each parameter's type.
                let params: Vec<ParamValue> = rewritten
                    .names
                    .iter()
                    .map(|n| match query.params.get(n) {
                        Some(parsley_settings::config::ParamType::Int) => ParamValue::Int(0),
                        Some(parsley_settings::config::ParamType::Float) => ParamValue::Float(0.0),
                        Some(parsley_settings::config::ParamType::Bool) => ParamValue::Bool(false),
                        Some(parsley_settings::config::ParamType::Json) => ParamValue::Json(serde_json::Value::Null),
                        _ => ParamValue::Text(String::new()),
                    })
                    .collect();
                let checked = check_query(&s.pool, role.as_deref(), &rewritten.sql, &params).await;
                match checked {
                    Ok(()) => {}
                    Err(e) if e.sqlstate().as_deref() == Some("42501") => anyhow::bail!(
                        "named query {:?} of model {:?} cannot run under {}: {e:#}; grant the role what the query \
                         reads, or change the query (docs/operations.md, \"Database roles\")",
                        query.name,
                        model.name,
                        role.as_deref()
                            .map_or("the gateway's own role".to_string(), |r| format!("the read role {r:?}"))
                    ),
                    Err(e) if e.is_unavailable() => {
                        tracing::warn!(error = %format!("{e:#}"), "the database did not answer: named queries not checked");
                        return Ok(());
                    }
                    Err(e) => tracing::warn!(
                        model = %model.name,
                        query = %query.name,
                        error = %format!("{e:#}"),
                        "a named query does not plan yet (have the model's migrations run?)"
                    ),
                }
            }
            if let Some(role) = role {
                tracing::info!(model = %model.name, role, "the model's named queries run under its read role");
                roles.insert(model.name.clone(), role);
            }
        }
        *s.query_roles.write().unwrap_or_else(|e| e.into_inner()) = roles;
        Ok(())
    }

    /// Serves both listeners until `shutdown` turns true (or its sender is dropped), then
    /// stops in three steps (docs/operations.md, "Probes and shutdown"): `/readyz` answers
    /// `503 draining` while everything is still served for `gateway.shutdown_grace_ms` (a
    /// load balancer's probes see it and stop sending); then the listeners stop accepting and
    /// every request in flight finishes, waiting reads included (each within
    /// `read_wait_ms`); then the background tasks stop — the clock listener last, so waiting
    /// reads are still woken while they drain. The named queries are checked first
    /// ([`Gateway::check_queries`]): an error there is returned before anything is served.
    pub async fn serve(self, listeners: Listeners, shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
        self.check_queries().await?;
        let (stop_background, background_shutdown) = watch::channel(false);
        let background = self.spawn_background(background_shutdown);
        let (stop_serving, serving) = watch::channel(false);
        let settings = &self.state.config.settings;
        let limits = ServerLimits {
            header_read_timeout: settings.header_read_timeout(),
            max_header_bytes: settings.max_header_bytes,
            max_connections: None,
        };
        let admin = listeners.admin.map(|listener| {
            tokio::spawn(server::serve(listener, admin_app(self.state.clone()), limits, serving.clone()))
        });
        let drain = {
            let state = self.state.clone();
            let grace = settings.shutdown_grace();
            let mut shutdown = shutdown;
            tokio::spawn(async move {
                let _ = shutdown.wait_for(|s| *s).await;
                state.readiness.start_draining();
                tracing::info!(grace_ms = grace.as_millis() as u64, "draining: /readyz answers 503, still serving");
                tokio::time::sleep(grace).await;
                tracing::info!("no longer accepting; finishing the requests in flight");
                let _ = stop_serving.send(true);
            })
        };
        let main = ServerLimits { max_connections: Some(settings.http_connections_cap()), ..limits };
        let served = server::serve(listeners.main, self.router(), main, serving).await;
        drain.abort();
        if let Some(admin) = admin {
            admin.await.context("the admin listener's task failed")??;
        }
        let _ = stop_background.send(true);
        for task in background {
            let _ = task.await;
        }
        // The reads' kept connections back to the pool, so an embedding program's
        // `pool.close()` after this does not wait on them.
        self.state.reads.give_back_all();
        served
    }
}

/// Refreshes the configured topics and every topic the cache knows, and the models'
/// recorded widths, gives the reads' idle connections back to the pool and purges expired
/// idempotency keys, at start and then every
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
        if let Err(e) = state.widths.refresh(&state.pool, &state.model_names()).await {
            tracing::warn!(error = %format!("{e:#}"), "refreshing the models' recorded widths failed");
        }
        // Connections the reads kept but have not used for a while go back to the pool,
        // which closes them after its idle timeout.
        state.reads.give_back_idle();
        // Idempotency keys past their window (any gateway of a fleet may purge them).
        match parsley_store::idempotency::purge_expired(&state.pool).await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(purged = n, "purged expired idempotency keys"),
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "purging expired idempotency keys failed"),
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
    use axum::http::{header, Method, StatusCode};
    use parsley::{CausalPast, ChannelId, TopicId};
    use parsley_settings::config::Config;
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
access = "open"
subject_header = "x-subject"
max_body_bytes = 256
max_key_bytes = 16
"#;

    fn ring() -> KeyRing {
        KeyRing::new(vec![("k1".into(), SecretKey::from_bytes([5; 32]))]).unwrap()
    }

    fn state() -> AppState {
        AppState::new(crate::state::offline_config(FILE)).unwrap()
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
        call_on(app(state()), method, uri, headers, body).await
    }

    async fn call_on(
        router: Router,
        method: Method,
        uri: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (StatusCode, Value, Response) {
        let mut req = axum::http::Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let response = router.oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
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
        problem_on(app(state()), method, uri, headers, body, status, kind).await
    }

    async fn problem_on(
        router: Router,
        method: Method,
        uri: &str,
        headers: &[(&str, &str)],
        body: &str,
        status: u16,
        kind: &str,
    ) -> Value {
        let (s, json, response) = call_on(router, method, uri, headers, body).await;
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
        // Several tokens: one bad one refuses the request, never dropped from the join.
        let now = crate::session::unix_now();
        let good =
            token::seal(&ring(), &Session { issued_at: now, expires_at: far, subject: None, past: CausalPast::new() });
        let two = [(crate::SESSION_HEADER, good.as_str()), (crate::SESSION_HEADER, t.as_str())];
        problem(Method::GET, READ, &two, "", 400, "token-expired").await;
        let list = format!("{good},AQ");
        problem(Method::GET, READ, &[(crate::SESSION_HEADER, &list)], "", 400, "token-malformed").await;
        let long = "s".repeat(300);
        problem(Method::GET, READ, &[("x-subject", &long)], "", 400, "invalid-subject").await;
    }

    /// `POST /v1/sessions` with several tokens answers their join (no infrastructure: it
    /// opens and seals, nothing more), bounded by `token_max_per_request`.
    #[tokio::test]
    async fn several_tokens_are_joined_into_one() {
        let far = session_far();
        let c = |p| ChannelId::new(TopicId::from_bytes([7; 16]), p);
        let seal = |issued_at, subject: Option<&str>, pairs: &[(u32, i64)]| {
            let past = CausalPast::from_pairs(pairs.iter().map(|&(p, o)| (c(p), o)));
            token::seal(&ring(), &Session { issued_at, expires_at: far, subject: subject.map(String::from), past })
        };
        let now = crate::session::unix_now();
        let a = seal(now - 50, Some("alice"), &[(0, 3), (1, 9)]);
        let b = seal(now - 90, Some("alice"), &[(0, 7)]);
        let u = seal(now - 10, None, &[(2, 1)]);
        let opened = |t: &str| {
            token::open(&ring(), t, now, Some("alice"), &token::TokenLimits::default()).expect("the answer opens")
        };
        let join = CausalPast::from_pairs([(c(0), 7), (c(1), 9), (c(2), 1)]);
        let list = format!("{a}, {b},{u}");
        let forms: [Vec<(&str, &str)>; 2] = [
            vec![(crate::SESSION_HEADER, &a), (crate::SESSION_HEADER, &b), (crate::SESSION_HEADER, &u)],
            vec![(crate::SESSION_HEADER, &list)],
        ];
        for mut headers in forms {
            headers.push(("x-subject", "alice"));
            let (status, json, response) = call(Method::POST, "/v1/sessions", &headers, "").await;
            assert_eq!(status, StatusCode::OK, "{json}");
            let back = opened(response.headers()[crate::SESSION_HEADER].to_str().unwrap());
            assert_eq!(back.past, join, "the pointwise maximum");
            assert_eq!(back.issued_at, now - 90, "begun when the oldest began");
            assert_eq!(back.subject.as_deref(), Some("alice"));
        }
        // Another subject's token among them, whoever asks.
        let bob = seal(now, Some("bob"), &[(0, 1)]);
        let mixed = format!("{a},{bob}");
        for who in ["alice", "bob"] {
            let h = [(crate::SESSION_HEADER, mixed.as_str()), ("x-subject", who)];
            problem(Method::POST, "/v1/sessions", &h, "", 403, "token-subjects-differ").await;
        }
        // The bound (16 by default), however the tokens are sent; an empty element.
        let many = vec![u.as_str(); 17].join(",");
        let json =
            problem(Method::POST, "/v1/sessions", &[(crate::SESSION_HEADER, &many)], "", 400, "too-many-tokens").await;
        assert_eq!(json["limit"], 16);
        let sixteen = vec![u.as_str(); 16].join(",");
        let h = [(crate::SESSION_HEADER, sixteen.as_str()), (crate::SESSION_HEADER, u.as_str())];
        problem(Method::POST, "/v1/sessions", &h, "", 400, "too-many-tokens").await;
        let (status, _, _) = call(Method::POST, "/v1/sessions", &[(crate::SESSION_HEADER, &sixteen)], "").await;
        assert_eq!(status, StatusCode::OK);
        let empty = format!("{u},,{u}");
        problem(Method::POST, "/v1/sessions", &[(crate::SESSION_HEADER, &empty)], "", 400, "token-malformed").await;
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
            (r#"{"key":"k","key":"j","value":1}"#, "duplicate field `key`"),
        ] {
            let p = problem(Method::POST, WRITE, &[], body, 400, "invalid-body").await;
            assert!(p["detail"].as_str().unwrap().contains(reason), "{body}: {p}");
            assert_eq!((p["field"].clone(), p["reason"].as_str()), (Value::Null, Some("shape")), "{body}: {p}");
        }
        // What the projector could never store is refused at the door, naming the field.
        for (body, field, reason) in [
            (r#"{"key":"a\u0000b","value":1}"#, "key", "nul"),
            (r#"{"key":"","value":1}"#, "key", "empty"),
            (r#"{"key":"12345678901234567","value":1}"#, "key", "too-long"),
            (r#"{"key":1,"value":1}"#, "key", "shape"),
            (r#"{"key":"k","value":{"a":{"b":[1,2,"\u0000"]}}}"#, "value.a.b[2]", "nul"),
            (r#"{"key":"k","value":{"b":1,"a":2,"b":3}}"#, "value.b", "duplicate-key"),
            (r#"{"key":"k","value":["\ud800"]}"#, "value[0]", "unrepresentable"),
            (r#"{"key":"k","value":1e999}"#, "value", "unrepresentable"),
            (r#"{"key":"k","value":1,"headers":{"x":"1","x":"2"}}"#, "headers.x", "duplicate-key"),
            (r#"{"key":"k","value":1,"headers":{"":"1"}}"#, "headers[\"\"]", "empty"),
            (r#"{"key":"k","value":1,"headers":{"x":2}}"#, "headers.x", "shape"),
        ] {
            let p = problem(Method::POST, WRITE, &[], body, 400, "invalid-body").await;
            assert_eq!((p["field"].as_str(), p["reason"].as_str()), (Some(field), Some(reason)), "{body}: {p}");
        }
        let big = format!(r#"{{"key":"k","value":"{}"}}"#, "x".repeat(400));
        problem(Method::POST, WRITE, &[], &big, 413, "body-too-large").await;
    }

    #[tokio::test]
    async fn read_keys_and_cursors_no_document_can_have_are_client_errors() {
        for (uri, kind, parameter) in [
            ("/v1/models/shop/documents/a%00b", "invalid-key", "key"),
            ("/v1/models/shop/documents/%FF", "invalid-key", "key"),
            ("/v1/models/shop/documents/12345678901234567", "invalid-key", "key"),
            ("/v1/models/shop/documents?after=%00", "invalid-query", "after"),
            ("/v1/models/shop/documents?after=%FF%FE", "invalid-query", "after"),
            ("/v1/models/shop/documents?after=12345678901234567", "invalid-query", "after"),
            ("/v1/models/shop/documents?limit=1&limit=2", "invalid-query", "limit"),
        ] {
            let p = problem(Method::GET, uri, &[], "", 400, kind).await;
            assert_eq!(p["parameter"], parameter, "{uri}: {p}");
        }
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

    async fn metrics_text(router: Router, headers: &[(&str, &str)]) -> (StatusCode, String) {
        let mut req = axum::http::Request::builder().uri("/metrics");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let response = router.oneshot(req.body(Body::empty()).unwrap()).await.unwrap();
        let status = response.status();
        let text = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        (status, String::from_utf8(text.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn health_and_metrics_answer_without_infrastructure() {
        let (s, json, _) = call(Method::GET, "/healthz", &[], "").await;
        assert_eq!((s, json["status"].as_str()), (StatusCode::OK, Some("ok")));
        let (status, text) = metrics_text(admin_app(state()), &[]).await;
        assert_eq!(status, StatusCode::OK);
        assert!(text.contains("# TYPE parsley_gateway_requests_total counter"), "{text}");
    }

    const ADMIN_TOKEN: &str = "an-admin-token-of-some-length";

    fn state_with_admin_token() -> AppState {
        let shared = Config::parse(FILE).unwrap();
        let mut config = GatewayConfig::with_keys(shared, ring()).unwrap();
        config.admin_token = Some(crate::settings::AdminToken::new(ADMIN_TOKEN).unwrap());
        AppState::new(config).unwrap()
    }

    #[tokio::test]
    async fn admin_routes_need_the_admin_listener_or_the_bearer_token() {
        // No admin token: not routes of the main listener at all.
        for uri in ["/metrics", "/v1/status"] {
            problem(Method::GET, uri, &[], "", 404, "no-such-route").await;
        }
        // With one: only for requests bearing it.
        let bearer = format!("Bearer {ADMIN_TOKEN}");
        let lower = format!("bearer {ADMIN_TOKEN}");
        let wrong = format!("Bearer {ADMIN_TOKEN}x");
        for headers in [
            &[][..],
            &[("authorization", wrong.as_str())],
            &[("authorization", ADMIN_TOKEN)],
            &[("authorization", "Bearer ")],
            &[("authorization", bearer.as_str()), ("authorization", bearer.as_str())],
        ] {
            for uri in ["/metrics", "/v1/status"] {
                let router = app(state_with_admin_token());
                let (s, json, response) = call_on(router, Method::GET, uri, headers, "").await;
                assert_eq!(s, StatusCode::UNAUTHORIZED, "{uri} {headers:?}: {json}");
                assert_eq!(json["type"], "https://parsley.dev/problems/unauthorized");
                assert_eq!(response.headers()[header::WWW_AUTHENTICATE], "Bearer");
                assert!(!json.to_string().contains(ADMIN_TOKEN), "the token is never echoed: {json}");
            }
        }
        for auth in [&bearer, &lower] {
            let (status, text) = metrics_text(app(state_with_admin_token()), &[("authorization", auth)]).await;
            assert_eq!(status, StatusCode::OK, "{text}");
            assert!(text.contains("parsley_gateway_requests_total"), "{text}");
        }
        // The admin listener needs nothing; health stays public everywhere.
        let (status, _) = metrics_text(admin_app(state_with_admin_token()), &[]).await;
        assert_eq!(status, StatusCode::OK);
        let (s, _, _) = call_on(app(state_with_admin_token()), Method::GET, "/healthz", &[], "").await;
        assert_eq!(s, StatusCode::OK);
        let printed = format!("{:?}", state_with_admin_token().config);
        assert!(!printed.contains(ADMIN_TOKEN), "{printed}");
    }

    #[tokio::test]
    async fn beyond_max_in_flight_requests_are_refused_at_once() {
        let s = state();
        let held: Vec<_> = (0..s.config.settings.max_in_flight)
            .map(|_| Arc::clone(&s.in_flight).try_acquire_owned().unwrap())
            .collect();
        for (method, uri, body) in [(Method::GET, READ, ""), (Method::POST, WRITE, BODY), (Method::GET, "/readyz", "")]
        {
            let started = Instant::now();
            let (status, json, response) = call_on(app(s.clone()), method, uri, &[], body).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{uri}: {json}");
            assert_eq!(json["type"], "https://parsley.dev/problems/overloaded", "{json}");
            assert_eq!(response.headers()[header::RETRY_AFTER], "1");
            assert!(started.elapsed() < std::time::Duration::from_secs(1), "refused, not queued");
        }
        let (status, _, _) = call_on(app(s.clone()), Method::GET, "/healthz", &[], "").await;
        assert_eq!(status, StatusCode::OK, "health is not limited");
        assert_eq!(s.metrics.value(Metric::OverloadedTotal, &[("limit", "max_in_flight")]), Some(3.0));
        drop(held);
        problem_on(app(s), Method::GET, "/v1/models/nope/documents/k", &[], "", 404, "unknown-model").await;
    }

    async fn boom() -> &'static str {
        panic!("a bug with a secret=hunter2")
    }

    #[tokio::test]
    async fn a_panicking_handler_answers_500_and_is_counted() {
        let s = state();
        let router =
            Router::new().route("/boom", get(boom)).route("/fine", get(|| async { "fine" })).layer(catch_panics(&s));
        let p = problem_on(router.clone(), Method::GET, "/boom", &[], "", 500, "internal").await;
        assert!(!p.to_string().contains("hunter2"), "the panic is logged, not shown: {p}");
        let (status, _, _) = call_on(router, Method::GET, "/fine", &[], "").await;
        assert_eq!(status, StatusCode::OK, "the service carries on");
        assert_eq!(s.metrics.value(Metric::PanicsTotal, &[]), Some(1.0));
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
        assert_eq!(s.metrics.value(Metric::ProblemsTotal, &[("type", "unknown-model")]), Some(1.0));
        assert_eq!(
            s.metrics
                .value(Metric::RequestsTotal, &[("route", "/v1/models/{model}/documents/{key}"), ("status", "404")]),
            Some(1.0)
        );
    }
}
