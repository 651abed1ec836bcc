//! A request's body received in full, within `gateway.body_timeout_ms`, before the request
//! takes an in-flight permit ([`receive_body`]).
//!
//! A client that trickles its body would otherwise hold a permit (`gateway.max_in_flight`)
//! for as long as the response timeout, and a thousand such clients would leave every other
//! request `503 overloaded`. Here the body is read while the request holds nothing but its
//! connection (bounded by `gateway.max_connections`); one that has not arrived in time is
//! answered `408 body-timeout` and its connection closed. A request without a body (every
//! read) passes straight through. The buffered body is at most `gateway.max_body_bytes`, as
//! the handlers' extractors would have buffered it (`413 body-too-large` beyond).

use axum::body::{Body, Bytes, HttpBody as _};
use axum::extract::{FromRequest as _, Request, State};
use axum::http::header::CONNECTION;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};

use crate::problem::ApiError;
use crate::state::AppState;
use crate::write::body_bytes;

/// Receives the body within `gateway.body_timeout_ms`, then runs the rest of the stack
/// with it; `408 body-timeout` (connection closed) when it is late.
pub async fn receive_body(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if req.body().is_end_stream() {
        return next.run(req).await;
    }
    let settings = &state.config.settings;
    let (parts, body) = req.into_parts();
    // The parts go with the body through the extractor, so that `DefaultBodyLimit` applies
    // as it does in the handlers.
    let reading = Bytes::from_request(Request::from_parts(parts.clone(), body), &());
    match tokio::time::timeout(settings.body_timeout(), reading).await {
        Ok(Ok(bytes)) => next.run(Request::from_parts(parts, Body::from(bytes))).await,
        Ok(Err(rejection)) => body_bytes(Err(rejection), settings.max_body_bytes).unwrap_err().into_response(),
        Err(_) => {
            let mut response = ApiError::BodyTimeout { timeout_ms: settings.body_timeout_ms }.into_response();
            // The rest of the body may still come: the connection cannot serve another request.
            response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            response
        }
    }
}
