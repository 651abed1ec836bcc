//! Optional export of trace spans over OTLP/HTTP (JSON encoding), off unless an endpoint is
//! configured (`gateway.otlp_endpoint`, `projector.otlp_endpoint`).
//!
//! The services record one span per traced operation — the gateway per write, the projector
//! per applied record that carries a `traceparent` — and an [`Exporter`] sends them in
//! batches (at most every [`FLUSH_EVERY`], or at [`BATCH`] spans) as
//! `POST <endpoint>` with an `ExportTraceServiceRequest` in OTLP's JSON form. Plain `http://`
//! only (a collector on the host or a sidecar); a collector that does not answer loses that
//! batch and the next one is tried — tracing never slows or fails the work it observes
//! (spans beyond [`QUEUE`] waiting are dropped and counted in the log).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// Longest a span waits before its batch is sent.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// Most spans in one request.
pub const BATCH: usize = 256;
/// Most spans waiting to be sent; more are dropped.
pub const QUEUE: usize = 8192;

/// One finished span.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent_span_id: Option<[u8; 8]>,
    pub name: String,
    /// OTLP's span kind: 2 server, 4 producer, 5 consumer.
    pub kind: u8,
    pub start_unix_ns: u64,
    pub end_unix_ns: u64,
    pub attributes: Vec<(String, String)>,
}

/// Nanoseconds since the epoch, now.
pub fn now_unix_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Where spans go: `http://host:port/path` (the path defaults to `/v1/traces`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    pub path: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> anyhow::Result<Endpoint> {
        let Some(rest) = url.strip_prefix("http://") else {
            bail!("{url:?} is not an http:// URL (OTLP/HTTP export takes plain http to a collector)");
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/v1/traces"),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (h, p.parse::<u16>().with_context(|| format!("the port of {url:?}"))?),
            None => (authority, 4318),
        };
        if host.is_empty() {
            bail!("{url:?} names no host");
        }
        Ok(Endpoint { host: host.to_string(), port, path: path.to_string() })
    }
}

/// Sends spans in the background; cheap to clone.
#[derive(Clone, Debug)]
pub struct Exporter {
    spans: mpsc::Sender<Span>,
}

impl Exporter {
    /// Starts the sending task on the current runtime, for `service` (`service.name`).
    pub fn start(endpoint: Endpoint, service: &str) -> anyhow::Result<Exporter> {
        let runtime = tokio::runtime::Handle::try_current().context("the span exporter needs a runtime")?;
        let (spans, rx) = mpsc::channel(QUEUE);
        runtime.spawn(send_loop(endpoint, service.to_string(), rx));
        Ok(Exporter { spans })
    }

    /// Queues a finished span; never waits (a full queue drops it).
    pub fn record(&self, span: Span) {
        if self.spans.try_send(span).is_err() {
            tracing::debug!("the span queue is full; a span was dropped");
        }
    }
}

async fn send_loop(endpoint: Endpoint, service: String, mut rx: mpsc::Receiver<Span>) {
    let mut batch = Vec::new();
    loop {
        let next = if batch.is_empty() {
            rx.recv().await
        } else {
            match tokio::time::timeout(FLUSH_EVERY, rx.recv()).await {
                Ok(s) => s,
                Err(_) => {
                    flush(&endpoint, &service, &mut batch).await;
                    continue;
                }
            }
        };
        match next {
            Some(span) => {
                batch.push(span);
                if batch.len() >= BATCH {
                    flush(&endpoint, &service, &mut batch).await;
                }
            }
            None => {
                flush(&endpoint, &service, &mut batch).await;
                return;
            }
        }
    }
}

async fn flush(endpoint: &Endpoint, service: &str, batch: &mut Vec<Span>) {
    if batch.is_empty() {
        return;
    }
    let body = request_body(service, batch).to_string();
    let n = batch.len();
    batch.clear();
    match tokio::time::timeout(Duration::from_secs(5), post(endpoint, &body)).await {
        Ok(Ok(status)) if (200..300).contains(&status) => {}
        Ok(Ok(status)) => tracing::warn!(status, spans = n, "the trace collector refused a batch of spans"),
        Ok(Err(e)) => {
            tracing::warn!(error = %format!("{e:#}"), spans = n, "could not send spans to the trace collector")
        }
        Err(_) => tracing::warn!(spans = n, "the trace collector did not answer in time"),
    }
}

/// The `ExportTraceServiceRequest` for `spans`, in OTLP's JSON encoding (ids in hex).
pub fn request_body(service: &str, spans: &[Span]) -> Value {
    let attr = |k: &str, v: &str| json!({"key": k, "value": {"stringValue": v}});
    let spans: Vec<Value> = spans
        .iter()
        .map(|s| {
            let mut span = json!({
                "traceId": hex(&s.trace_id),
                "spanId": hex(&s.span_id),
                "name": s.name,
                "kind": s.kind,
                "startTimeUnixNano": s.start_unix_ns.to_string(),
                "endTimeUnixNano": s.end_unix_ns.to_string(),
                "attributes": s.attributes.iter().map(|(k, v)| attr(k, v)).collect::<Vec<_>>(),
            });
            if let Some(p) = s.parent_span_id {
                span["parentSpanId"] = json!(hex(&p));
            }
            span
        })
        .collect();
    json!({"resourceSpans": [{
        "resource": {"attributes": [attr("service.name", service)]},
        "scopeSpans": [{"scope": {"name": "parsley"}, "spans": spans}],
    }]})
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One `POST` over a fresh connection; answers the status code.
async fn post(endpoint: &Endpoint, body: &str) -> anyhow::Result<u16> {
    let mut stream = TcpStream::connect((endpoint.host.as_str(), endpoint.port))
        .await
        .with_context(|| format!("connecting to {}:{}", endpoint.host, endpoint.port))?;
    let request = format!(
        "POST {} HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        endpoint.path,
        endpoint.host,
        endpoint.port,
        body.len(),
        body
    );
    stream.write_all(request.as_bytes()).await.context("sending spans")?;
    let mut head = vec![0u8; 64];
    let n = stream.read(&mut head).await.context("reading the collector's answer")?;
    let line = String::from_utf8_lossy(&head[..n]);
    let status = line.split_whitespace().nth(1).and_then(|s| s.parse().ok());
    status.with_context(|| format!("the collector answered {line:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_plain_http() {
        assert_eq!(
            Endpoint::parse("http://collector:4318").unwrap(),
            Endpoint { host: "collector".into(), port: 4318, path: "/v1/traces".into() }
        );
        assert_eq!(Endpoint::parse("http://127.0.0.1:9999/otlp/v1/traces").unwrap().path, "/otlp/v1/traces");
        assert_eq!(Endpoint::parse("http://c").unwrap().port, 4318);
        for bad in ["https://c:4318", "c:4318", "http://:4318", "http://c:x"] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }

    /// Spans reach a collector as OTLP JSON: one request with the service, ids in hex, the
    /// parent, the attributes.
    #[tokio::test]
    async fn spans_are_posted_to_the_collector() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let exporter =
            Exporter::start(Endpoint::parse(&format!("http://127.0.0.1:{port}")).unwrap(), "test-service").unwrap();
        exporter.record(Span {
            trace_id: [0xab; 16],
            span_id: [0x01; 8],
            parent_span_id: Some([0x02; 8]),
            name: "write".into(),
            kind: 4,
            start_unix_ns: 1,
            end_unix_ns: 2,
            attributes: vec![("messaging.destination.name".into(), "orders".into())],
        });
        let (mut socket, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept()).await.unwrap().unwrap();
        let mut received = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = socket.read(&mut buf).await.unwrap();
            received.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&received);
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("Content-Length: "))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap();
                if body.len() >= len {
                    assert!(head.starts_with("POST /v1/traces HTTP/1.1"), "{head}");
                    let v: Value = serde_json::from_str(body).unwrap();
                    let span = &v["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
                    assert_eq!(span["traceId"], json!("ab".repeat(16)));
                    assert_eq!(span["parentSpanId"], json!("02".repeat(8)));
                    assert_eq!(span["attributes"][0]["value"]["stringValue"], json!("orders"));
                    let service = &v["resourceSpans"][0]["resource"]["attributes"][0]["value"]["stringValue"];
                    assert_eq!(service, &json!("test-service"));
                    break;
                }
            }
            assert!(n > 0, "the connection closed before the body");
        }
        socket.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").await.unwrap();
    }
}
