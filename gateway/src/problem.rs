//! The gateway's one error type, [`ApiError`], and its rendering as an RFC 9457 problem
//! document (`application/problem+json`). Every client-visible failure has its own `type`
//! URI; internal failures are logged once here and answered with a generic 500 whose body
//! says nothing about the internals.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

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
    #[error("{0}")]
    ReservedHeader(String),
    #[error("unknown topic {0:?}")]
    UnknownTopic(String, String),
    #[error("unknown model {0:?}")]
    UnknownModel(String),
    #[error("invalid request body: {0}")]
    InvalidBody(String),
    #[error("request body too large")]
    BodyTooLarge { limit: usize },
    #[error("invalid query: {0}")]
    InvalidQuery(String),
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
            ApiError::ReservedHeader(_) => ("reserved-header", "Reserved header", S::BAD_REQUEST),
            ApiError::UnknownTopic(..) => ("unknown-topic", "Unknown topic", S::NOT_FOUND),
            ApiError::UnknownModel(_) => ("unknown-model", "Unknown model", S::NOT_FOUND),
            ApiError::InvalidBody(_) => ("invalid-body", "Invalid request body", S::BAD_REQUEST),
            ApiError::BodyTooLarge { .. } => ("body-too-large", "Request body too large", S::PAYLOAD_TOO_LARGE),
            ApiError::InvalidQuery(_) => ("invalid-query", "Invalid query parameters", S::BAD_REQUEST),
            ApiError::InvalidPath(_) => ("invalid-path", "Invalid path", S::BAD_REQUEST),
            ApiError::MetadataBudgetExceeded { .. } => {
                ("metadata-budget-exceeded", "Causes exceed the metadata budget", S::UNPROCESSABLE_ENTITY)
            }
            ApiError::NotYetCovered(p) => (p.kind, p.title, p.status),
            ApiError::Unavailable { .. } => ("unavailable", "Service unavailable", S::SERVICE_UNAVAILABLE),
            ApiError::WriteFailed { .. } => ("write-failed", "Write not acknowledged", S::SERVICE_UNAVAILABLE),
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
            ApiError::ReservedHeader(d) => p(d),
            ApiError::UnknownTopic(topic, why) => p(format!("topic {topic:?} {why}")).with("topic", json!(topic)),
            ApiError::UnknownModel(model) => {
                p(format!("no model named {model:?} is configured")).with("model", json!(model))
            }
            ApiError::InvalidBody(d) => p(d),
            ApiError::BodyTooLarge { limit } => p(format!("the request body is larger than {limit} bytes")),
            ApiError::InvalidQuery(d) => p(d),
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
        self.into_problem().into_response()
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
