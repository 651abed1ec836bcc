//! The gateway's one error type, [`ApiError`], and its rendering as an RFC 9457 problem
//! document (`application/problem+json`). Every client-visible failure has its own `type`
//! URI; internal failures are logged once here and answered with a generic 500 whose body
//! says nothing about the internals.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use crate::body::BodyError;
use crate::token::TokenError;

/// Prefix of every problem `type`.
pub const PROBLEM_BASE: &str = "https://parsley.dev/problems/";
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// One problem document: `type` is [`PROBLEM_BASE`] + `kind`; `extensions` are merged into
/// the top-level object.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub kind: &'static str,
    pub title: &'static str,
    pub status: StatusCode,
    pub detail: String,
    pub extensions: Map<String, Value>,
    /// `Retry-After`, in seconds.
    pub retry_after: Option<u64>,
}

impl Problem {
    pub fn new(kind: &'static str, title: &'static str, status: StatusCode, detail: impl Into<String>) -> Problem {
        Problem { kind, title, status, detail: detail.into(), extensions: Map::new(), retry_after: None }
    }

    pub fn with(mut self, name: &str, value: Value) -> Problem {
        self.extensions.insert(name.to_string(), value);
        self
    }

    pub fn type_uri(&self) -> String {
        format!("{PROBLEM_BASE}{}", self.kind)
    }

    pub fn body(&self) -> Value {
        let mut body = Map::new();
        body.insert("type".into(), json!(self.type_uri()));
        body.insert("title".into(), json!(self.title));
        body.insert("status".into(), json!(self.status.as_u16()));
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
pub struct ProblemKind(pub &'static str);

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.body()).expect("a JSON value serializes");
        let mut response = (self.status, body).into_response();
        response.extensions_mut().insert(ProblemKind(self.kind));
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_CONTENT_TYPE));
        if let Some(s) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(s));
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
    /// A write body refused by [`crate::body::parse`].
    #[error(transparent)]
    Body(#[from] BodyError),
    #[error("unknown topic {0:?}")]
    UnknownTopic(String, String),
    #[error("unknown model {0:?}")]
    UnknownModel(String),
    #[error("invalid request body: {0}")]
    InvalidBody(String),
    #[error("request body too large")]
    BodyTooLarge { limit: usize },
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
    #[error("the write was not acknowledged: {detail}")]
    WriteFailed { detail: String, retry_after: u64 },
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
    #[error("internal error: {0:#}")]
    Internal(#[from] anyhow::Error),
}

impl ApiError {
    /// The problem's short name (also the metrics label).
    pub fn kind(&self) -> &'static str {
        self.problem_ref().0
    }

    fn problem_ref(&self) -> (&'static str, &'static str, StatusCode) {
        use StatusCode as S;
        match self {
            ApiError::Token(e) => match e.kind() {
                "token-expired" => ("token-expired", "Session token expired", S::BAD_REQUEST),
                "token-wrong-subject" => {
                    ("token-wrong-subject", "Session token belongs to another subject", S::FORBIDDEN)
                }
                "token-invalid" => ("token-invalid", "Session token failed authentication", S::BAD_REQUEST),
                _ => ("token-malformed", "Session token malformed", S::BAD_REQUEST),
            },
            ApiError::TokenAheadOfLog { .. } => {
                ("token-ahead-of-log", "Session token ahead of the log", S::BAD_REQUEST)
            }
            ApiError::SessionTooLarge { .. } => {
                ("session-too-large", "Session outgrew the token limits", S::UNPROCESSABLE_ENTITY)
            }
            ApiError::InvalidSubject(_) => ("invalid-subject", "Invalid subject", S::BAD_REQUEST),
            ApiError::Body(BodyError::ReservedHeader(_)) => ("reserved-header", "Reserved header", S::BAD_REQUEST),
            ApiError::Body(BodyError::Invalid { .. }) => ("invalid-body", "Invalid request body", S::BAD_REQUEST),
            ApiError::UnknownTopic(..) => ("unknown-topic", "Unknown topic", S::NOT_FOUND),
            ApiError::UnknownModel(_) => ("unknown-model", "Unknown model", S::NOT_FOUND),
            ApiError::InvalidBody(_) => ("invalid-body", "Invalid request body", S::BAD_REQUEST),
            ApiError::BodyTooLarge { .. } => ("body-too-large", "Request body too large", S::PAYLOAD_TOO_LARGE),
            ApiError::InvalidQuery { .. } => ("invalid-query", "Invalid query parameters", S::BAD_REQUEST),
            ApiError::InvalidKey(_) => ("invalid-key", "Invalid document key", S::BAD_REQUEST),
            ApiError::InvalidPath(_) => ("invalid-path", "Invalid path", S::BAD_REQUEST),
            ApiError::MetadataBudgetExceeded { .. } => {
                ("metadata-budget-exceeded", "Causes exceed the metadata budget", S::UNPROCESSABLE_ENTITY)
            }
            ApiError::NotYetCovered(p) => (p.kind, p.title, p.status),
            ApiError::Unavailable { .. } => ("unavailable", "Service unavailable", S::SERVICE_UNAVAILABLE),
            ApiError::WriteFailed { .. } => ("write-failed", "Write not acknowledged", S::SERVICE_UNAVAILABLE),
            ApiError::WidthChanged { .. } => ("width-changed", "Topic width changed", S::CONFLICT),
            ApiError::Overloaded { .. } => ("overloaded", "Overloaded", S::SERVICE_UNAVAILABLE),
            ApiError::Unauthorized(_) => ("unauthorized", "Unauthorized", S::UNAUTHORIZED),
            ApiError::NoSuchRoute(_) => ("no-such-route", "No such route", S::NOT_FOUND),
            ApiError::Internal(_) => ("internal", "Internal error", S::INTERNAL_SERVER_ERROR),
        }
    }

    /// The problem document for this error. Internal errors are logged here, once.
    pub fn into_problem(self) -> Problem {
        let (kind, title, status) = self.problem_ref();
        let p = |detail: String| Problem::new(kind, title, status, detail);
        match self {
            ApiError::Token(e) => {
                let detail = match &e {
                    TokenError::Expired { .. } => {
                        "the session token expired; omit the Parsley-Session header to start a new session".to_string()
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
            ApiError::Body(BodyError::ReservedHeader(d)) => p(d),
            ApiError::Body(BodyError::Invalid { field, reason, detail }) => {
                let problem = p(detail).with("reason", json!(reason.as_str()));
                match field {
                    Some(f) => problem.with("field", json!(f)),
                    None => problem,
                }
            }
            ApiError::UnknownTopic(topic, why) => p(format!("topic {topic:?} {why}")).with("topic", json!(topic)),
            ApiError::UnknownModel(model) => {
                p(format!("no model named {model:?} is configured")).with("model", json!(model))
            }
            ApiError::InvalidBody(d) => p(d),
            ApiError::BodyTooLarge { limit } => p(format!("the request body is larger than {limit} bytes")),
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
            ApiError::Unavailable { what, detail, retry_after } => {
                let mut problem = p(format!("{what} is unavailable: {detail}"));
                problem.retry_after = Some(retry_after);
                problem
            }
            ApiError::WriteFailed { detail, retry_after } => {
                let mut problem = p(format!("the broker did not acknowledge the write: {detail}"));
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
        assert_eq!(p.status, StatusCode::INTERNAL_SERVER_ERROR);
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
        ];
        for (e, kind, status) in cases {
            let p = ApiError::Token(e).into_problem();
            assert_eq!((p.kind, p.status.as_u16()), (kind, status));
        }
    }

    #[test]
    fn unavailable_carries_retry_after() {
        let r = ApiError::Unavailable { what: "Kafka", detail: "down".into(), retry_after: 3 }.into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "3");
        assert_eq!(r.headers()[header::CONTENT_TYPE], PROBLEM_CONTENT_TYPE);
    }
}
