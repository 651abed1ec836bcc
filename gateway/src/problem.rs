//! The gateway's one error type, [`ApiError`], and its rendering as an RFC 9457 problem
//! document (`application/problem+json`). Every client-visible failure has its own `type`
//! URI, declared once in [`ProblemType`] (name, title, status; docs/gateway.md's table lists
//! exactly these, a test says so); internal failures are logged once here and answered with
//! a generic 500 whose body says nothing about the internals.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use crate::body::BodyError;
use crate::token::TokenError;

/// Prefix of every problem `type`.
pub const PROBLEM_BASE: &str = "https://parsley.dev/problems/";
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// Declares [`ProblemType`]: each problem type once, with its name (the last segment of
/// its `type` URI, also the metrics label), title and status.
macro_rules! problem_types {
    ($( $(#[$meta:meta])* $Variant:ident = ($kind:literal, $title:literal, $status:ident) ),* $(,)?) => {
        /// Every problem type the gateway answers with.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum ProblemType {
            $( $(#[$meta])* $Variant ),*
        }

        impl ProblemType {
            /// Every problem type, in declaration order.
            pub const ALL: &'static [ProblemType] = &[ $( ProblemType::$Variant ),* ];

            /// The short name: the `type` URI is [`PROBLEM_BASE`] + this.
            pub const fn kind(self) -> &'static str {
                match self { $( ProblemType::$Variant => $kind ),* }
            }

            pub const fn title(self) -> &'static str {
                match self { $( ProblemType::$Variant => $title ),* }
            }

            pub const fn status(self) -> StatusCode {
                match self { $( ProblemType::$Variant => StatusCode::$status ),* }
            }
        }
    };
}

problem_types! {
    TokenMalformed = ("token-malformed", "Session token malformed", BAD_REQUEST),
    TokenInvalid = ("token-invalid", "Session token failed authentication", BAD_REQUEST),
    TokenExpired = ("token-expired", "Session token expired", BAD_REQUEST),
    /// The session began longer ago than `token_max_age_s`.
    TokenTooOld = ("token-too-old", "Session past its maximum age", BAD_REQUEST),
    TokenWrongSubject = ("token-wrong-subject", "Session token belongs to another subject", FORBIDDEN),
    /// Several tokens on one request bound to different subjects: not one session's.
    TokenSubjectsDiffer = ("token-subjects-differ", "Session tokens belong to different subjects", FORBIDDEN),
    /// More `Parsley-Session` tokens on one request than `token_max_per_request`.
    TooManyTokens = ("too-many-tokens", "Too many session tokens", BAD_REQUEST),
    TokenAheadOfLog = ("token-ahead-of-log", "Session token ahead of the log", BAD_REQUEST),
    InvalidSubject = ("invalid-subject", "Invalid subject", BAD_REQUEST),
    /// Authentication on, and no valid bearer JWT (answered with `WWW-Authenticate`).
    Unauthenticated = ("unauthenticated", "Not authenticated", UNAUTHORIZED),
    /// No authorization rule allows the request; the detail names the rules that failed.
    Forbidden = ("forbidden", "Forbidden", FORBIDDEN),
    SessionTooLarge = ("session-too-large", "Session outgrew the token limits", UNPROCESSABLE_ENTITY),
    MetadataBudgetExceeded = ("metadata-budget-exceeded", "Causes exceed the metadata budget", UNPROCESSABLE_ENTITY),
    ReservedHeader = ("reserved-header", "Reserved header", BAD_REQUEST),
    InvalidBody = ("invalid-body", "Invalid request body", BAD_REQUEST),
    /// A value that breaks its topic's data contract (the topic's JSON Schema).
    ValueInvalid = ("value-invalid", "Value breaks the topic's schema", BAD_REQUEST),
    BodyTooLarge = ("body-too-large", "Request body too large", PAYLOAD_TOO_LARGE),
    /// The body did not arrive in full within `gateway.body_timeout_ms`.
    BodyTimeout = ("body-timeout", "Request body not received in time", REQUEST_TIMEOUT),
    InvalidQuery = ("invalid-query", "Invalid query parameters", BAD_REQUEST),
    InvalidKey = ("invalid-key", "Invalid document key", BAD_REQUEST),
    InvalidPath = ("invalid-path", "Invalid path", BAD_REQUEST),
    WidthChanged = ("width-changed", "Topic width changed", CONFLICT),
    /// An `Idempotency-Key` header that is empty, too long or not visible ASCII.
    InvalidIdempotencyKey = ("invalid-idempotency-key", "Invalid idempotency key", BAD_REQUEST),
    /// The `Idempotency-Key` was used within the window for a different request.
    IdempotencyKeyReused = ("idempotency-key-reused", "Idempotency key used for another request", CONFLICT),
    /// A request with the same `Idempotency-Key` is still being written.
    IdempotencyKeyInFlight = ("idempotency-key-in-flight", "Idempotency key in flight", CONFLICT),
    /// The request with the same `Idempotency-Key` was attempted and whether it was written
    /// is unknown; it is not written again.
    IdempotencyOutcomeUnknown = ("idempotency-outcome-unknown", "Idempotent write's outcome unknown", CONFLICT),
    /// A CORS preflight from an origin not in `gateway.cors_allowed_origins`.
    CorsOriginNotAllowed = ("cors-origin-not-allowed", "Origin not allowed", FORBIDDEN),
    Unauthorized = ("unauthorized", "Unauthorized", UNAUTHORIZED),
    UnknownTopic = ("unknown-topic", "Unknown topic", NOT_FOUND),
    UnknownModel = ("unknown-model", "Unknown model", NOT_FOUND),
    /// No named query of that name in the model's `[[models.queries]]`.
    UnknownQuery = ("unknown-query", "Unknown query", NOT_FOUND),
    /// No such document, coverage proven.
    NotFound = ("not-found", "Document not found", NOT_FOUND),
    NoSuchRoute = ("no-such-route", "No such route", NOT_FOUND),
    NotYetCovered = ("not-yet-covered", "Not yet covered", SERVICE_UNAVAILABLE),
    WriteFailed = ("write-failed", "Write not acknowledged", SERVICE_UNAVAILABLE),
    Unavailable = ("unavailable", "Service unavailable", SERVICE_UNAVAILABLE),
    Overloaded = ("overloaded", "Overloaded", SERVICE_UNAVAILABLE),
    /// The request exceeded the gateway's response timeout.
    RequestTimeout = ("request-timeout", "Request timed out", SERVICE_UNAVAILABLE),
    /// `/readyz` only.
    NotReady = ("not-ready", "Not ready", SERVICE_UNAVAILABLE),
    Internal = ("internal", "Internal error", INTERNAL_SERVER_ERROR),
    /// A named query the database failed to run (its statement, not an outage).
    QueryFailed = ("query-failed", "Query failed", INTERNAL_SERVER_ERROR),
    /// A named query's statement ran longer than its `timeout_ms` and was cancelled.
    QueryTimeout = ("query-timeout", "Query timed out", GATEWAY_TIMEOUT),
    /// A named query's result is larger than its `max_bytes`: refused whole, not truncated.
    QueryResultTooLarge = ("query-result-too-large", "Query result too large", UNPROCESSABLE_ENTITY),
}

impl ProblemType {
    /// The problem type named `kind`, if the gateway has one.
    pub fn from_kind(kind: &str) -> Option<ProblemType> {
        ProblemType::ALL.iter().copied().find(|t| t.kind() == kind)
    }

    /// The problem type of a token refusal (named by [`TokenError::kind`]).
    fn of_token(e: &TokenError) -> ProblemType {
        // Every kind a token error names is declared (a test checks each); a kind added to
        // the token module but not here still fails closed, as a malformed token.
        ProblemType::from_kind(e.kind()).unwrap_or(ProblemType::TokenMalformed)
    }
}

/// One problem document: `type` is [`PROBLEM_BASE`] + its kind; title and status are its
/// type's; `extensions` are merged into the top-level object.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub problem_type: ProblemType,
    pub detail: String,
    pub extensions: Map<String, Value>,
    /// `Retry-After`, in seconds.
    pub retry_after: Option<u64>,
}

impl Problem {
    pub fn new(problem_type: ProblemType, detail: impl Into<String>) -> Problem {
        Problem { problem_type, detail: detail.into(), extensions: Map::new(), retry_after: None }
    }

    /// The short name (the last segment of the `type` URI; the metrics label).
    pub fn kind(&self) -> &'static str {
        self.problem_type.kind()
    }

    pub fn title(&self) -> &'static str {
        self.problem_type.title()
    }

    pub fn status(&self) -> StatusCode {
        self.problem_type.status()
    }

    pub fn with(mut self, name: &str, value: Value) -> Problem {
        self.extensions.insert(name.to_string(), value);
        self
    }

    pub fn type_uri(&self) -> String {
        format!("{PROBLEM_BASE}{}", self.kind())
    }

    pub fn body(&self) -> Value {
        let mut body = Map::new();
        body.insert("type".into(), json!(self.type_uri()));
        body.insert("title".into(), json!(self.title()));
        body.insert("status".into(), json!(self.status().as_u16()));
        body.insert("detail".into(), json!(self.detail));
        for (k, v) in &self.extensions {
            body.insert(k.clone(), v.clone());
        }
        Value::Object(body)
    }
}

/// Response extension naming the problem a response carries (read by the metrics
/// middleware).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProblemKind(pub ProblemType);

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.body()).expect("a JSON value serializes");
        let mut response = (self.status(), body).into_response();
        response.extensions_mut().insert(ProblemKind(self.problem_type));
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_CONTENT_TYPE));
        if let Some(s) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.problem_type == ProblemType::Unauthenticated {
            // RFC 6750 §3: the scheme, and why, in a header a client library can read.
            let description: String = self
                .detail
                .chars()
                .filter(|c| c.is_ascii_graphic() || *c == ' ')
                .filter(|c| *c != '"' && *c != '\\')
                .collect();
            let value =
                format!("Bearer realm=\"parsley\", error=\"invalid_token\", error_description=\"{description}\"");
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_str(&value)
                    .unwrap_or_else(|_| HeaderValue::from_static("Bearer realm=\"parsley\", error=\"invalid_token\"")),
            );
        }
        response
    }
}

/// Every way a request fails.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error("the session token names {channel}@{position}, beyond the log end {log_end}")]
    TokenAheadOfLog { channel: String, position: i64, log_end: i64 },
    #[error("the session has outgrown the token limits")]
    SessionTooLarge { detail: String },
    #[error("subject header is invalid: {0}")]
    InvalidSubject(String),
    /// With authentication on: no bearer JWT, or one that does not verify.
    #[error("not authenticated: {0}")]
    Unauthenticated(String),
    /// No authorization rule allows the request. `rules`: the rules that covered it and
    /// failed (none: no rule covers it).
    #[error("forbidden: {detail}")]
    Forbidden { detail: String, rules: Vec<String> },
    /// A write body refused by [`crate::body::parse`].
    #[error(transparent)]
    Body(#[from] BodyError),
    /// A value (or a batch's values) breaking the topic's data contract. `topic`: the
    /// single write's topic (a batch's errors name theirs).
    #[error("a value breaks its topic's schema")]
    ValueInvalid { topic: Option<String>, errors: Vec<crate::contracts::ValueError> },
    #[error("unknown topic {0:?}")]
    UnknownTopic(String, String),
    #[error("unknown model {0:?}")]
    UnknownModel(String),
    #[error("model {model:?} has no query {query:?}")]
    UnknownQuery { model: String, query: String },
    /// A named query's statement failed in the database (not an outage). `sqlstate`: the
    /// database's error code, when it gave one; the message is logged, never answered (it
    /// can quote data).
    #[error("query {query:?} of model {model:?} failed (SQLSTATE {sqlstate:?})")]
    QueryFailed { model: String, query: String, sqlstate: Option<String> },
    /// A named query's statement was cancelled by its statement timeout: the query's
    /// `timeout_ms`, or the pool's when it has none (`None`).
    #[error("query {query:?} of model {model:?} ran past its timeout")]
    QueryTimeout { model: String, query: String, timeout_ms: Option<u64> },
    /// A named query's answer would be larger than its `max_bytes`.
    #[error("query {query:?} of model {model:?} answers more than {max_bytes} bytes")]
    QueryResultTooLarge { model: String, query: String, max_bytes: u64 },
    #[error("invalid request body: {0}")]
    InvalidBody(String),
    #[error("request body too large")]
    BodyTooLarge { limit: usize },
    /// The body had not arrived in full after `timeout_ms`.
    #[error("the request body did not arrive within {timeout_ms} ms")]
    BodyTimeout { timeout_ms: u64 },
    /// `parameter`: the query parameter at fault, when one is.
    #[error("invalid query: {detail}")]
    InvalidQuery { parameter: Option<String>, detail: String },
    /// A document key in a read's path that no document can have.
    #[error("invalid key: {0}")]
    InvalidKey(String),
    #[error("invalid path: {0}")]
    InvalidPath(String),
    #[error("the causes would exceed the metadata budget")]
    MetadataBudgetExceeded { size: usize, budget: usize },
    #[error("not yet covered")]
    NotYetCovered(Box<Problem>),
    #[error("{what} is unavailable: {detail}")]
    Unavailable { what: &'static str, detail: String, retry_after: u64 },
    /// A write Kafka did not acknowledge. `unknown`: it may have been written all the same
    /// (answered as the `outcome` member, `unknown` or `not-written`).
    #[error("the write was not acknowledged: {detail}")]
    WriteFailed { detail: String, retry_after: u64, unknown: bool },
    /// A write to a topic whose partition count is not the width a receiving model
    /// recorded: no task reads the partitions beyond it, and keys no longer route to their
    /// tasks. `written`: the partition and offset, when the record was produced before the
    /// change was seen.
    #[error("topic {topic:?} has {partitions} partitions, model {model:?} was recorded with {task_count}")]
    WidthChanged { topic: String, partitions: u32, model: String, task_count: u32, written: Option<(u32, i64)> },
    /// Refused at once rather than queued: too many requests in flight, or too many reads
    /// of one model waiting for coverage.
    #[error("overloaded: {detail}")]
    Overloaded { detail: String, retry_after: u64 },
    /// An admin route on the main listener without the admin bearer token.
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    #[error("no such route")]
    NoSuchRoute(String),
    /// An `Idempotency-Key` header no request can carry.
    #[error("invalid idempotency key: {0}")]
    InvalidIdempotencyKey(String),
    /// The key was used within the window for another request.
    #[error("idempotency key {0:?} was used for another request")]
    IdempotencyKeyReused(String),
    /// A request with the same key is being written.
    #[error("a request with idempotency key {key:?} is in flight")]
    IdempotencyKeyInFlight { key: String, retry_after: u64 },
    /// The request with the same key may or may not have been written.
    #[error("the outcome of the request with idempotency key {0:?} is unknown")]
    IdempotencyOutcomeUnknown(String),
    #[error("internal error: {0:#}")]
    Internal(#[from] anyhow::Error),
}

impl ApiError {
    /// The problem's short name (also the metrics label).
    pub fn kind(&self) -> &'static str {
        self.problem_type().kind()
    }

    /// The problem type this error is answered with.
    pub fn problem_type(&self) -> ProblemType {
        use ProblemType as P;
        match self {
            ApiError::Token(e) => ProblemType::of_token(e),
            ApiError::TokenAheadOfLog { .. } => P::TokenAheadOfLog,
            ApiError::SessionTooLarge { .. } => P::SessionTooLarge,
            ApiError::InvalidSubject(_) => P::InvalidSubject,
            ApiError::Unauthenticated(_) => P::Unauthenticated,
            ApiError::Forbidden { .. } => P::Forbidden,
            ApiError::Body(BodyError::ReservedHeader(_)) => P::ReservedHeader,
            ApiError::Body(BodyError::Invalid { .. }) => P::InvalidBody,
            ApiError::ValueInvalid { .. } => P::ValueInvalid,
            ApiError::UnknownTopic(..) => P::UnknownTopic,
            ApiError::UnknownModel(_) => P::UnknownModel,
            ApiError::UnknownQuery { .. } => P::UnknownQuery,
            ApiError::QueryFailed { .. } => P::QueryFailed,
            ApiError::QueryTimeout { .. } => P::QueryTimeout,
            ApiError::QueryResultTooLarge { .. } => P::QueryResultTooLarge,
            ApiError::InvalidBody(_) => P::InvalidBody,
            ApiError::BodyTooLarge { .. } => P::BodyTooLarge,
            ApiError::BodyTimeout { .. } => P::BodyTimeout,
            ApiError::InvalidQuery { .. } => P::InvalidQuery,
            ApiError::InvalidKey(_) => P::InvalidKey,
            ApiError::InvalidPath(_) => P::InvalidPath,
            ApiError::MetadataBudgetExceeded { .. } => P::MetadataBudgetExceeded,
            ApiError::NotYetCovered(p) => p.problem_type,
            ApiError::Unavailable { .. } => P::Unavailable,
            ApiError::WriteFailed { .. } => P::WriteFailed,
            ApiError::WidthChanged { .. } => P::WidthChanged,
            ApiError::Overloaded { .. } => P::Overloaded,
            ApiError::Unauthorized(_) => P::Unauthorized,
            ApiError::NoSuchRoute(_) => P::NoSuchRoute,
            ApiError::InvalidIdempotencyKey(_) => P::InvalidIdempotencyKey,
            ApiError::IdempotencyKeyReused(_) => P::IdempotencyKeyReused,
            ApiError::IdempotencyKeyInFlight { .. } => P::IdempotencyKeyInFlight,
            ApiError::IdempotencyOutcomeUnknown(_) => P::IdempotencyOutcomeUnknown,
            ApiError::Internal(_) => P::Internal,
        }
    }

    /// The problem document for this error. Internal errors are logged here, once.
    pub fn into_problem(self) -> Problem {
        let problem_type = self.problem_type();
        let p = |detail: String| Problem::new(problem_type, detail);
        match self {
            ApiError::Token(e) => {
                let detail = match &e {
                    TokenError::Expired { .. } => {
                        "the session token expired; omit the Parsley-Session header to start a new session".to_string()
                    }
                    TokenError::TooOld { .. } => {
                        "the session is older than the longest a session may last (gateway.token_max_age_s); \
                         omit the Parsley-Session header to start a new session"
                            .to_string()
                    }
                    TokenError::TooManyTokens { limit, .. } => {
                        let limit = *limit;
                        return p(format!("{e}; join them first (POST /v1/sessions with at most {limit} of them)"))
                            .with("limit", json!(limit));
                    }
                    TokenError::SubjectsDiffer => {
                        format!("{e}; send only the tokens of the caller's own session")
                    }
                    other => format!("{other}; omit the Parsley-Session header to start a new session"),
                };
                p(detail)
            }
            ApiError::TokenAheadOfLog { channel, position, log_end } => p(format!(
                "the session token names position {position} on {channel}, but that channel's log ends before {log_end}"
            ))
            .with("channel", json!(channel))
            .with("position", json!(position))
            .with("log_end", json!(log_end)),
            ApiError::SessionTooLarge { detail } => p(detail),
            ApiError::InvalidSubject(d) => p(d),
            ApiError::Unauthenticated(d) => p(d),
            ApiError::Forbidden { detail, rules } => p(detail).with("rules", json!(rules)),
            ApiError::Body(BodyError::ReservedHeader(d)) => p(d),
            ApiError::Body(BodyError::Invalid { field, reason, detail }) => {
                let problem = p(detail).with("reason", json!(reason.as_str()));
                match field {
                    Some(f) => problem.with("field", json!(f)),
                    None => problem,
                }
            }
            ApiError::ValueInvalid { topic, errors } => {
                let first = errors.first().map_or_else(String::new, |e| {
                    let v = &e.violation;
                    let record = e.record.map_or_else(String::new, |i| format!("records[{i}].value, "));
                    format!(": {record}at {:?} (keyword {:?}): {}", v.pointer, v.keyword, v.message)
                });
                let more = match errors.len() {
                    0 | 1 => String::new(),
                    n => format!(" (and {} more)", n - 1),
                };
                let detail = match &topic {
                    Some(t) => format!("the value breaks the schema of topic {t:?}{first}{more}; nothing was written"),
                    None => format!("a record's value breaks its topic's schema{first}{more}; nothing was written"),
                };
                let problem = p(detail).with("errors", json!(errors.iter().map(|e| e.to_json()).collect::<Vec<_>>()));
                match topic {
                    Some(t) => problem.with("topic", json!(t)),
                    None => problem,
                }
            }
            ApiError::UnknownTopic(topic, why) => p(format!("topic {topic:?} {why}")).with("topic", json!(topic)),
            ApiError::UnknownModel(model) => {
                p(format!("no model named {model:?} is configured")).with("model", json!(model))
            }
            ApiError::UnknownQuery { model, query } => {
                p(format!("model {model:?} has no query named {query:?}"))
                    .with("model", json!(model))
                    .with("query", json!(query))
            }
            ApiError::QueryFailed { model, query, sqlstate } => {
                let code = sqlstate.as_deref().map_or(String::new(), |c| format!(" (SQLSTATE {c})"));
                p(format!("the database failed to run query {query:?} of model {model:?}{code}; it has been logged"))
                    .with("model", json!(model))
                    .with("query", json!(query))
                    .with("sqlstate", json!(sqlstate))
            }
            ApiError::QueryTimeout { model, query, timeout_ms } => {
                let limit = match timeout_ms {
                    Some(ms) => format!("its timeout_ms, {ms} ms"),
                    None => "the database's statement timeout (database.statement_timeout_ms)".to_string(),
                };
                p(format!("query {query:?} of model {model:?} ran longer than {limit}, and was cancelled"))
                    .with("model", json!(model))
                    .with("query", json!(query))
                    .with("timeout_ms", json!(timeout_ms))
            }
            ApiError::QueryResultTooLarge { model, query, max_bytes } => p(format!(
                "the result of query {query:?} of model {model:?} is larger than its max_bytes, {max_bytes} bytes; \
                 nothing of it is sent: narrow the query (its parameters, max_rows) or raise max_bytes"
            ))
            .with("model", json!(model))
            .with("query", json!(query))
            .with("max_bytes", json!(max_bytes)),
            ApiError::InvalidBody(d) => p(d),
            ApiError::BodyTooLarge { limit } => p(format!("the request body is larger than {limit} bytes")),
            ApiError::BodyTimeout { timeout_ms } => p(format!(
                "the request body did not arrive in full within {timeout_ms} ms (gateway.body_timeout_ms)"
            )),
            ApiError::InvalidQuery { parameter, detail } => match parameter {
                Some(name) => p(detail).with("parameter", json!(name)),
                None => p(detail),
            },
            ApiError::InvalidKey(d) => p(d).with("parameter", json!("key")),
            ApiError::InvalidPath(d) => p(d),
            ApiError::MetadataBudgetExceeded { size, budget } => p(format!(
                "the session's causes would take {size} bytes, more than the metadata budget of {budget}; start a new session"
            )),
            ApiError::NotYetCovered(problem) => *problem,
            ApiError::InvalidIdempotencyKey(d) => p(d),
            ApiError::IdempotencyKeyReused(key) => p(format!(
                "the Idempotency-Key {key:?} was used for another request (another route or body) within the \
                 idempotency window; use a new key for a new request"
            )),
            ApiError::IdempotencyKeyInFlight { key, retry_after } => {
                let mut problem = p(format!(
                    "a request with the Idempotency-Key {key:?} is still being written; retry it later to get its answer"
                ));
                problem.retry_after = Some(retry_after);
                problem
            }
            ApiError::IdempotencyOutcomeUnknown(key) => p(format!(
                "the request with the Idempotency-Key {key:?} was attempted, and Kafka did not confirm whether it was \
                 written; it is not written a second time. Read what it would have changed to learn whether it was, \
                 then write again with a new key if it was not"
            )),
            ApiError::Unavailable { what, detail, retry_after } => {
                let mut problem = p(format!("{what} is unavailable: {detail}"));
                problem.retry_after = Some(retry_after);
                problem
            }
            ApiError::WriteFailed { detail, retry_after, unknown } => {
                let outcome = if unknown { "unknown" } else { "not-written" };
                let mut problem =
                    p(format!("the broker did not acknowledge the write: {detail}")).with("outcome", json!(outcome));
                problem.retry_after = Some(retry_after);
                problem
            }
            ApiError::WidthChanged { topic, partitions, model, task_count, written } => {
                let detail = match written {
                    None => format!(
                        "topic {topic:?} now has {partitions} partitions but model {model:?} was recorded with {task_count} tasks: \
                         nothing was written; the model must be rebuilt for the new width"
                    ),
                    Some((partition, offset)) => format!(
                        "topic {topic:?} now has {partitions} partitions but model {model:?} was recorded with {task_count} tasks: \
                         the record was written at partition {partition}, offset {offset}, before the change was seen, and \
                         the session does not claim it; the model must be rebuilt for the new width"
                    ),
                };
                let problem = p(detail)
                    .with("topic", json!(topic))
                    .with("partitions", json!(partitions))
                    .with("model", json!(model))
                    .with("task_count", json!(task_count));
                match written {
                    Some((partition, offset)) => {
                        problem.with("written", json!({"partition": partition, "offset": offset}))
                    }
                    None => problem,
                }
            }
            ApiError::Overloaded { detail, retry_after } => {
                let mut problem = p(detail);
                problem.retry_after = Some(retry_after);
                problem
            }
            ApiError::Unauthorized(d) => p(d),
            ApiError::NoSuchRoute(path) => p(format!("no route for {path}")),
            ApiError::Internal(e) => {
                tracing::error!(error = %format!("{e:#}"), "internal error");
                p("the gateway failed to handle the request; it has been logged".to_string())
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // The admin route's 401 (an unauthenticated caller's carries its reason, above).
        let bearer = matches!(self, ApiError::Unauthorized(_));
        let mut response = self.into_problem().into_response();
        if bearer {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_errors_do_not_leak() {
        let e = ApiError::Internal(anyhow::anyhow!("password=hunter2 at db.internal:5432"));
        let p = e.into_problem();
        assert_eq!(p.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let text = p.body().to_string();
        assert!(!text.contains("hunter2") && !text.contains("db.internal"), "{text}");
        assert_eq!(p.body()["type"], json!("https://parsley.dev/problems/internal"));
    }

    #[test]
    fn every_token_error_has_its_own_type() {
        let cases = [
            (TokenError::Malformed("x".into()), "token-malformed", 400),
            (TokenError::Tampered, "token-invalid", 400),
            (TokenError::Expired { expires_at: 1, now: 2 }, "token-expired", 400),
            (TokenError::WrongSubject, "token-wrong-subject", 403),
            (TokenError::TooOld { issued_at: 1, max_age_s: 1, now: 2 }, "token-too-old", 400),
            (TokenError::SubjectsDiffer, "token-subjects-differ", 403),
            (TokenError::TooManyTokens { count: 3, limit: 2 }, "too-many-tokens", 400),
        ];
        for (e, kind, status) in cases {
            let p = ApiError::Token(e).into_problem();
            assert_eq!((p.kind(), p.status().as_u16()), (kind, status));
        }
    }

    #[test]
    fn unavailable_carries_retry_after() {
        let r = ApiError::Unavailable { what: "Kafka", detail: "down".into(), retry_after: 3 }.into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "3");
        assert_eq!(r.headers()[header::CONTENT_TYPE], PROBLEM_CONTENT_TYPE);
    }

    #[test]
    fn problem_types_are_declared_once() {
        let mut kinds: Vec<&str> = ProblemType::ALL.iter().map(|t| t.kind()).collect();
        kinds.sort_unstable();
        kinds.dedup();
        assert_eq!(kinds.len(), ProblemType::ALL.len(), "a kind is declared twice");
        for t in ProblemType::ALL {
            assert_eq!(ProblemType::from_kind(t.kind()), Some(*t));
            assert!(t.kind().bytes().all(|b| b.is_ascii_lowercase() || b == b'-'), "{t:?}");
            assert!(t.status().is_client_error() || t.status().is_server_error(), "{t:?}");
        }
    }

    /// docs/gateway.md's problem table lists exactly the declared problem types, each with
    /// its status.
    #[test]
    fn the_documented_problem_types_are_the_declared_ones() {
        let doc = include_str!("../../docs/gateway.md");
        let section = doc.split("## Problem types").nth(1).expect("the problem types section");
        let mut documented: Vec<(String, u16)> = section
            .lines()
            .skip_while(|l| !l.starts_with("| `"))
            .take_while(|l| l.starts_with("| `"))
            .map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                let status = cells[2].parse().unwrap_or_else(|_| panic!("a status in {l:?}"));
                (cells[1].trim_matches('`').to_string(), status)
            })
            .collect();
        let mut declared: Vec<(String, u16)> =
            ProblemType::ALL.iter().map(|t| (t.kind().to_string(), t.status().as_u16())).collect();
        documented.sort();
        declared.sort();
        assert_eq!(documented, declared, "docs/gateway.md's problem table");
    }

    /// Every token refusal has a declared problem type of its own name (none falls back).
    #[test]
    fn every_token_error_kind_is_declared() {
        let errors = [
            TokenError::Malformed("x".into()),
            TokenError::Tampered,
            TokenError::Expired { expires_at: 1, now: 2 },
            TokenError::WrongSubject,
            TokenError::SubjectsDiffer,
            TokenError::TooManyTokens { count: 3, limit: 2 },
        ];
        for e in errors {
            assert_eq!(ProblemType::from_kind(e.kind()).map(ProblemType::kind), Some(e.kind()), "{e:?}");
        }
    }
}
