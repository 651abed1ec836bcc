//! W3C Trace Context (`traceparent`) through a write: the gateway continues the caller's
//! trace, or starts one, and puts its own `traceparent` on every record it produces, so the
//! projector's log line for the step that applied the record names the same trace.
//!
//! Each request runs in a `request` span (the caller's `traceparent` its remote parent) and
//! each write in a `write` span inside it ([`write_span`]); with OpenTelemetry export on
//! (`[telemetry]`), both are exported and the record's `traceparent` names the write span,
//! so the projector's span for the record is its child. Without export, the same ids are
//! drawn here. Both spans carry `trace_id` and `span_id`, which every log line inside names.
//!
//! A request's `traceparent` (`00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`) is
//! continued: the record carries the same trace id and flags with a new parent id (the
//! gateway's span). A missing or invalid one (all-zero ids, wrong lengths, upper-case hex,
//! version `ff`) starts a new trace, sampled — the specification's rule for what is invalid
//! is to ignore it. A record whose body already names a `traceparent` header keeps the
//! client's.

use chacha20poly1305::aead::rand_core::RngCore as _;
use chacha20poly1305::aead::OsRng;

/// The header's name, on HTTP requests and on Kafka records.
pub const TRACEPARENT: &str = "traceparent";

/// One position in a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    pub flags: u8,
}

impl TraceContext {
    /// Parses a `traceparent` value; `None` when it is not a valid one.
    pub fn parse(value: &str) -> Option<TraceContext> {
        let parts: Vec<&str> = value.trim().split('-').collect();
        let [version, trace, parent, flags, rest @ ..] = parts.as_slice() else { return None };
        let version = hex::<1>(version)?[0];
        // Version 00 has exactly four fields; a later version may append more.
        if version == 0xff || (version == 0 && !rest.is_empty()) {
            return None;
        }
        let (trace_id, parent_id, flags) = (hex::<16>(trace)?, hex::<8>(parent)?, hex::<1>(flags)?[0]);
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        Some(TraceContext { trace_id, parent_id, flags })
    }

    /// A new trace, sampled.
    pub fn root() -> TraceContext {
        let mut trace_id = [0u8; 16];
        OsRng.fill_bytes(&mut trace_id);
        TraceContext { trace_id, parent_id: span_id(), flags: 0x01 }.nonzero()
    }

    /// The same trace, with a new span of this gateway's as the parent.
    pub fn child(&self) -> TraceContext {
        TraceContext { parent_id: span_id(), ..*self }.nonzero()
    }

    /// The gateway's context for a request and the caller's parent id, when the request
    /// carried a valid `traceparent`.
    pub fn continued(headers: &axum::http::HeaderMap) -> (TraceContext, Option<[u8; 8]>) {
        match headers.get(TRACEPARENT).and_then(|v| v.to_str().ok()).and_then(TraceContext::parse) {
            Some(t) => (t.child(), Some(t.parent_id)),
            None => (TraceContext::root(), None),
        }
    }

    /// The `traceparent` value.
    pub fn header(&self) -> String {
        format!("00-{}-{}-{:02x}", to_hex(&self.trace_id), to_hex(&self.parent_id), self.flags)
    }

    pub fn trace_id_hex(&self) -> String {
        to_hex(&self.trace_id)
    }

    /// All-zero ids are invalid; a random draw of all zeros is replaced (never in practice).
    fn nonzero(mut self) -> TraceContext {
        if self.trace_id == [0; 16] {
            self.trace_id[15] = 1;
        }
        if self.parent_id == [0; 8] {
            self.parent_id[7] = 1;
        }
        self
    }
}

/// The span of a write named `name` (`POST /v1/…`), inside the request's span, and the
/// trace context its records carry: the exported span's own ids when OpenTelemetry export
/// is on, else ids drawn here (continuing the request's `traceparent`).
pub fn write_span(headers: &axum::http::HeaderMap, name: &str) -> (tracing::Span, TraceContext) {
    let span = tracing::info_span!(
        "write",
        otel.name = name,
        otel.kind = "producer",
        trace_id = tracing::field::Empty,
        span_id = tracing::field::Empty,
        messaging.system = "kafka",
        messaging.destination.name = tracing::field::Empty,
        messaging.kafka.destination.partition = tracing::field::Empty,
        messaging.kafka.message.offset = tracing::field::Empty,
        messaging.batch.message_count = tracing::field::Empty,
    );
    let trace = match parsley_infra::telemetry::span_ids(&span) {
        Some((trace_id, parent_id, flags)) => TraceContext { trace_id, parent_id, flags },
        None => TraceContext::continued(headers).0,
    };
    span.record("trace_id", trace.trace_id_hex());
    span.record("span_id", to_hex(&trace.parent_id));
    (span, trace)
}

/// The span of a request: the caller's valid `traceparent` is its remote parent, so the
/// exported trace continues the caller's.
pub fn request_span(headers: &axum::http::HeaderMap, method: &axum::http::Method, route: &str) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        method = %method,
        route,
        otel.name = format!("{method} {route}"),
        otel.kind = "server",
        trace_id = tracing::field::Empty,
        span_id = tracing::field::Empty,
    );
    if let Some(t) = headers.get(TRACEPARENT).and_then(|v| v.to_str().ok()).and_then(TraceContext::parse) {
        parsley_infra::telemetry::set_remote_parent(&span, t.trace_id, t.parent_id, t.flags);
    }
    if let Some((trace_id, span_id, _)) = parsley_infra::telemetry::span_ids(&span) {
        span.record("trace_id", to_hex(&trace_id));
        span.record("span_id", to_hex(&span_id));
    }
    span
}

fn span_id() -> [u8; 8] {
    let mut id = [0u8; 8];
    OsRng.fill_bytes(&mut id);
    id
}

/// Exactly `2 * N` lower-case hex digits.
fn hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_is_continued_with_a_new_parent() {
        let t = TraceContext::parse(VALID).unwrap();
        assert_eq!(t.header(), VALID);
        let c = t.child();
        assert_eq!((c.trace_id, c.flags), (t.trace_id, t.flags));
        assert_ne!(c.parent_id, t.parent_id);
        assert!(c.header().starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
        assert_eq!(TraceContext::parse(&c.header()), Some(c));
        // A later version may carry more fields.
        assert!(TraceContext::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra").is_some());
    }

    #[test]
    fn invalid_traceparents_are_ignored() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
        let root = TraceContext::root();
        assert_eq!(TraceContext::parse(&root.header()), Some(root));
        assert_eq!(root.flags, 1);
    }
}
