//! Cross-origin requests from browser apps (`gateway.cors_allowed_origins`).
//!
//! With no allowed origin configured (the default) the gateway sends no CORS header at all,
//! and browsers keep other origins out. With some, a request whose `Origin` is allowed gets
//! `Access-Control-Allow-Origin` naming it (or `*` when any origin is allowed) and
//! `Access-Control-Expose-Headers: Parsley-Session, Retry-After, Idempotency-Replayed`, so a
//! browser app can keep its session token and honour `Retry-After`; a preflight
//! (`OPTIONS` with `Access-Control-Request-Method`) from an allowed origin is answered
//! `204` with the methods and request headers the API takes. A preflight from another
//! origin is answered `403 cors-origin-not-allowed`; an ordinary request from one is served
//! without CORS headers (the browser then hides the answer from the page). No credentials
//! mode: tokens travel in a header, never in cookies.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::problem::{Problem, ProblemType};
use crate::state::AppState;

/// Response headers a browser app may read.
pub const EXPOSED_HEADERS: &str = "Parsley-Session, Retry-After, Idempotency-Replayed";
/// Methods the API's routes take.
pub const ALLOWED_METHODS: &str = "GET, POST";
/// Request headers the API reads (the configured subject header is added to them).
pub const ALLOWED_HEADERS: &[&str] =
    &["content-type", "parsley-session", "idempotency-key", "authorization", "traceparent", "tracestate"];
/// How long a browser may cache a preflight's answer, in seconds.
pub const PREFLIGHT_MAX_AGE_S: u32 = 600;

/// Whether `origin` (an `Origin` header's value) is allowed by `allowed` (the configured
/// origins; `*` allows any).
pub fn allows(allowed: &[String], origin: &str) -> bool {
    allowed.iter().any(|a| a == "*" || a.eq_ignore_ascii_case(origin))
}

/// The middleware: answers preflights, and adds the CORS headers to the answers of allowed
/// origins' requests.
pub async fn cors(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let allowed = &state.config.settings.cors_allowed_origins;
    if allowed.is_empty() {
        return next.run(req).await;
    }
    let origin = req.headers().get(header::ORIGIN).and_then(|o| o.to_str().ok()).map(str::to_string);
    let Some(origin) = origin else { return next.run(req).await };
    let preflight =
        req.method() == Method::OPTIONS && req.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let permitted = allows(allowed, &origin);
    if preflight {
        if !permitted {
            return Problem::new(
                ProblemType::CorsOriginNotAllowed,
                format!("origin {origin:?} is not in gateway.cors_allowed_origins"),
            )
            .into_response();
        }
        let mut response = StatusCode::NO_CONTENT.into_response();
        let headers = response.headers_mut();
        allow_origin(headers, allowed, &origin);
        headers.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static(ALLOWED_METHODS));
        let mut names: Vec<String> = ALLOWED_HEADERS.iter().map(|h| h.to_string()).collect();
        if let Some(subject) = &state.config.settings.subject_header {
            names.push(subject.to_ascii_lowercase());
        }
        if let Ok(v) = HeaderValue::from_str(&names.join(", ")) {
            headers.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, v);
        }
        headers.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from(PREFLIGHT_MAX_AGE_S));
        return response;
    }
    let mut response = next.run(req).await;
    if permitted {
        let headers = response.headers_mut();
        allow_origin(headers, allowed, &origin);
        headers.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, HeaderValue::from_static(EXPOSED_HEADERS));
    }
    response
}

/// `Access-Control-Allow-Origin`: `*` when any origin is allowed, else the request's own
/// origin (with `Vary: Origin`, so caches keep answers per origin apart).
fn allow_origin(headers: &mut HeaderMap, allowed: &[String], origin: &str) {
    if allowed.iter().any(|a| a == "*") {
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
        return;
    }
    if let Ok(v) = HeaderValue::from_str(origin) {
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
        headers.append(header::VARY, HeaderValue::from_static("origin"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::check_origin;

    #[test]
    fn origins_are_matched_exactly_or_by_the_wildcard() {
        let allowed = vec!["https://app.example.com".to_string()];
        assert!(allows(&allowed, "https://app.example.com"));
        assert!(allows(&allowed, "HTTPS://APP.EXAMPLE.COM"));
        assert!(!allows(&allowed, "https://evil.example.com"));
        assert!(!allows(&allowed, "https://app.example.com:8443"));
        assert!(allows(&["*".to_string()], "https://anything.example"));
        assert!(!allows(&[], "https://app.example.com"));
    }

    #[test]
    fn configured_origins_are_checked() {
        for good in ["*", "https://app.example.com", "http://localhost:5173"] {
            assert!(check_origin(good).is_ok(), "{good}");
        }
        for bad in ["app.example.com", "https://app.example.com/", "ftp://x", "https://", "https://a b"] {
            assert!(check_origin(bad).is_err(), "{bad}");
        }
    }
}
