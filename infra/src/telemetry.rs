//! Logs and OpenTelemetry for the service binaries: log lines on stderr as text or JSON,
//! with the trace and span ids of the span they were logged in, and — when an OTLP endpoint
//! is configured — spans and metrics exported through the `opentelemetry` crates over gRPC
//! or HTTP (protobuf), with TLS, headers and resource attributes.
//!
//! A span carries its ids as the fields `trace_id` and `span_id` (hex); [`TraceIdsLayer`]
//! keeps them, and every line logged inside the span names them (JSON: top-level
//! `trace_id`/`span_id`; text: the span's fields, as `tracing` prints them). Spans become
//! OpenTelemetry spans through `tracing-opentelemetry`; [`set_remote_parent`] continues a
//! W3C `traceparent` and [`span_ids`] answers the ids a span exports under, so the
//! `traceparent` a record carries names the very span the collector receives.
//!
//! Endpoints are checked before anything starts: a control character (CR, LF, …), an
//! unknown scheme, a missing host, a bad port, a query, credentials in the URL or a header
//! that could not be sent are refused with a named reason ([`EndpointError`]).

use std::collections::BTreeMap;
use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState};
use opentelemetry::KeyValue;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _, WithTonicConfig as _};
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use serde::Deserialize;
use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime as _;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::Layer;

use crate::metrics::{Kind, MetricName, Registry};

/// How log lines are written on stderr (`log_format`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// `tracing`'s human format; coloured only on a terminal and without `NO_COLOR`.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `message`, `fields`, and
    /// `trace_id`/`span_id` when the line was logged in a traced span.
    Json,
}

/// The OTLP transport (`otlp_protocol`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// OTLP/HTTP with protobuf bodies: `POST <endpoint>/v1/traces` and `/v1/metrics`.
    #[default]
    Http,
    /// OTLP/gRPC.
    Grpc,
}

/// Why an OTLP endpoint or header was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("contains a control character (CR, LF, …) at byte {0}")]
    ControlCharacter(usize),
    #[error("contains a space at byte {0}")]
    Whitespace(usize),
    #[error("names no scheme: write http://host:port or https://host:port")]
    NoScheme,
    #[error("has the scheme {0:?}: OTLP export takes http:// or https://")]
    UnknownScheme(String),
    #[error("names no host")]
    NoHost,
    #[error("has the port {0:?}, not a number from 1 to 65535")]
    BadPort(String),
    #[error("carries credentials: put them in otlp_headers")]
    Credentials,
    #[error("has a query or a fragment")]
    QueryOrFragment,
    #[error("has the path {0:?}: an OTLP/gRPC endpoint takes none")]
    GrpcPath(String),
    #[error("header name {0:?} is not an HTTP token")]
    HeaderName(String),
    #[error("header {0:?} has a value with a control character (CR, LF, …)")]
    HeaderValue(String),
}

/// Where to export: the endpoint's base URL, without the signal's path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// `scheme://host:port[/path]`, no trailing `/`; for HTTP, the signals' paths
    /// (`/v1/traces`, `/v1/metrics`) are appended.
    pub base: String,
    pub tls: bool,
}

impl Endpoint {
    /// Checks `url` for `protocol`. `http://collector:4318/v1/traces` (the form the span
    /// exporter took before) means the base `http://collector:4318`.
    pub fn parse(url: &str, protocol: Protocol) -> Result<Endpoint, EndpointError> {
        if let Some((i, _)) = url.char_indices().find(|(_, c)| c.is_control()) {
            return Err(EndpointError::ControlCharacter(i));
        }
        if let Some((i, _)) = url.char_indices().find(|(_, c)| c.is_whitespace()) {
            return Err(EndpointError::Whitespace(i));
        }
        let (scheme, rest) = url.split_once("://").ok_or(EndpointError::NoScheme)?;
        let tls = match scheme.to_ascii_lowercase().as_str() {
            "http" => false,
            "https" => true,
            _ => return Err(EndpointError::UnknownScheme(scheme.to_string())),
        };
        if rest.contains(['?', '#']) {
            return Err(EndpointError::QueryOrFragment);
        }
        let (authority, path) = rest.find('/').map_or((rest, ""), |i| (&rest[..i], &rest[i..]));
        if authority.contains('@') {
            return Err(EndpointError::Credentials);
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, after) = v6.split_once(']').ok_or(EndpointError::NoHost)?;
            (host, after.strip_prefix(':'))
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(EndpointError::NoHost);
        }
        if let Some(p) = port {
            if !p.parse::<u16>().is_ok_and(|p| p > 0) {
                return Err(EndpointError::BadPort(p.to_string()));
            }
        }
        let path = path.trim_end_matches('/');
        let path = path.strip_suffix("/v1/traces").unwrap_or(path);
        if protocol == Protocol::Grpc && !path.is_empty() {
            return Err(EndpointError::GrpcPath(path.to_string()));
        }
        Ok(Endpoint { base: format!("{scheme}://{authority}{path}"), tls })
    }
}

/// Checks the headers sent with every export (a hosted collector's key, say).
pub fn check_headers(headers: &BTreeMap<String, String>) -> Result<(), EndpointError> {
    const SEPARATORS: &str = "()<>@,;:\\\"/[]?={} \t";
    for (name, value) in headers {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_graphic() && !SEPARATORS.contains(c)) {
            return Err(EndpointError::HeaderName(name.clone()));
        }
        if value.chars().any(|c| c.is_control() && c != '\t') {
            return Err(EndpointError::HeaderValue(name.clone()));
        }
    }
    Ok(())
}

/// What to export and where: the checked form of the `[telemetry]` table's OTLP keys.
#[derive(Clone, Debug)]
pub struct Export {
    pub endpoint: Endpoint,
    pub protocol: Protocol,
    pub headers: BTreeMap<String, String>,
    /// PEM certificates to trust instead of the system's roots (`https://` only).
    pub ca_file: Option<PathBuf>,
    /// Resource attributes beyond `service.name` and `service.version` (which they may
    /// replace); `OTEL_RESOURCE_ATTRIBUTES` adds to them.
    pub resource: BTreeMap<String, String>,
    /// How often metrics are exported.
    pub metrics_interval: Duration,
}

/// The running telemetry: flush and stop it with [`Telemetry::shutdown`] before exiting.
#[derive(Debug, Default)]
pub struct Telemetry {
    tracer: Option<SdkTracerProvider>,
    meter: Option<SdkMeterProvider>,
}

impl Telemetry {
    /// Exports what is still queued and stops the exporters (blocking: call it outside
    /// the runtime's workers, e.g. in `spawn_blocking`).
    pub fn shutdown(self) {
        if let Some(t) = self.tracer {
            let _ = t.shutdown();
        }
        if let Some(m) = self.meter {
            let _ = m.shutdown();
        }
    }
}

/// Installs the process's subscriber: logs on stderr in `format`, filtered by `RUST_LOG`
/// else `default_filter`, and with `export`, spans and metrics to the collector as
/// `service` (`service.name`) at `version`. Call within the runtime (gRPC's client lives
/// on it).
pub fn init(
    default_filter: &str,
    format: LogFormat,
    service: &str,
    version: &str,
    export: Option<&Export>,
) -> anyhow::Result<Telemetry> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let mut telemetry = Telemetry::default();
    let mut spans = None;
    if let Some(export) = export {
        let resource = resource(service, version, &export.resource);
        let tracer = SdkTracerProvider::builder()
            .with_resource(resource.clone())
            .with_batch_exporter(span_exporter(export)?)
            .build();
        let meter = SdkMeterProvider::builder()
            .with_resource(resource)
            .with_reader(
                PeriodicReader::builder(metric_exporter(export)?).with_interval(export.metrics_interval).build(),
            )
            .build();
        opentelemetry::global::set_meter_provider(meter.clone());
        use opentelemetry::trace::TracerProvider as _;
        spans = Some(
            tracing_opentelemetry::layer()
                .with_tracer(tracer.tracer("parsley"))
                .with_location(false)
                .with_threads(false)
                .with_tracked_inactivity(false),
        );
        telemetry = Telemetry { tracer: Some(tracer), meter: Some(meter) };
    }
    let (text, json) = match format {
        LogFormat::Text => {
            (Some(tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(colour())), None)
        }
        LogFormat::Json => {
            (None, Some(tracing_subscriber::fmt::layer().with_writer(std::io::stderr).event_format(JsonLines)))
        }
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(TraceIdsLayer)
        .with(text)
        .with(json)
        .with(spans)
        .try_init()
        .context("installing the log subscriber")?;
    Ok(telemetry)
}

/// Colour only on a terminal, and never with `NO_COLOR` set to anything (no-color.org).
fn colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

fn resource(service: &str, version: &str, extra: &BTreeMap<String, String>) -> Resource {
    Resource::builder()
        .with_service_name(service.to_string())
        .with_attribute(KeyValue::new("service.version", version.to_string()))
        .with_attributes(extra.iter().map(|(k, v)| KeyValue::new(k.clone(), v.clone())))
        .build()
}

fn read_ca(export: &Export) -> anyhow::Result<Option<Vec<u8>>> {
    export
        .ca_file
        .as_ref()
        .map(|f| std::fs::read(f).with_context(|| format!("reading telemetry.otlp_ca_file {}", f.display())))
        .transpose()
}

fn grpc_tls(export: &Export) -> anyhow::Result<Option<tonic::transport::ClientTlsConfig>> {
    if !export.endpoint.tls {
        return Ok(None);
    }
    let tls = tonic::transport::ClientTlsConfig::new();
    Ok(Some(match read_ca(export)? {
        Some(pem) => tls.ca_certificate(tonic::transport::Certificate::from_pem(pem)),
        None => tls.with_native_roots(),
    }))
}

fn grpc_metadata(export: &Export) -> anyhow::Result<tonic::metadata::MetadataMap> {
    let mut map = tonic::metadata::MetadataMap::new();
    for (name, value) in &export.headers {
        let key = tonic::metadata::MetadataKey::from_bytes(name.to_ascii_lowercase().as_bytes())
            .map_err(|_| EndpointError::HeaderName(name.clone()))?;
        let value = value.parse().map_err(|_| EndpointError::HeaderValue(name.clone()))?;
        map.insert(key, value);
    }
    Ok(map)
}

const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

fn span_exporter(export: &Export) -> anyhow::Result<opentelemetry_otlp::SpanExporter> {
    let built = match export.protocol {
        Protocol::Grpc => {
            let mut b = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(export.endpoint.base.clone())
                .with_timeout(EXPORT_TIMEOUT)
                .with_metadata(grpc_metadata(export)?);
            if let Some(tls) = grpc_tls(export)? {
                b = b.with_tls_config(tls);
            }
            b.build()
        }
        Protocol::Http => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(format!("{}/v1/traces", export.endpoint.base))
            .with_timeout(EXPORT_TIMEOUT)
            .with_headers(export.headers.clone().into_iter().collect())
            .with_http_client(BlockingClient::new(read_ca(export)?)?)
            .build(),
    };
    built.context("building the OTLP span exporter")
}

fn metric_exporter(export: &Export) -> anyhow::Result<opentelemetry_otlp::MetricExporter> {
    let built = match export.protocol {
        Protocol::Grpc => {
            let mut b = opentelemetry_otlp::MetricExporter::builder()
                .with_tonic()
                .with_endpoint(export.endpoint.base.clone())
                .with_timeout(EXPORT_TIMEOUT)
                .with_metadata(grpc_metadata(export)?);
            if let Some(tls) = grpc_tls(export)? {
                b = b.with_tls_config(tls);
            }
            b.build()
        }
        Protocol::Http => opentelemetry_otlp::MetricExporter::builder()
            .with_http()
            .with_endpoint(format!("{}/v1/metrics", export.endpoint.base))
            .with_timeout(EXPORT_TIMEOUT)
            .with_headers(export.headers.clone().into_iter().collect())
            .with_http_client(BlockingClient::new(read_ca(export)?)?)
            .build(),
    };
    built.context("building the OTLP metric exporter")
}

/// OTLP/HTTP's client: reqwest's blocking client, driven by the SDK's export threads
/// (which run no async runtime).
#[derive(Debug)]
struct BlockingClient(reqwest::blocking::Client);

impl BlockingClient {
    fn new(ca: Option<Vec<u8>>) -> anyhow::Result<BlockingClient> {
        // The blocking client starts a runtime of its own, which must not be created (or
        // dropped) on a runtime's thread: build it on a thread of its own.
        let built = std::thread::spawn(move || {
            let mut b = reqwest::blocking::Client::builder().timeout(EXPORT_TIMEOUT);
            if let Some(pem) = ca {
                for cert in reqwest::Certificate::from_pem_bundle(&pem)? {
                    b = b.add_root_certificate(cert);
                }
            }
            b.build()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the thread building the OTLP/HTTP client panicked"))?;
        Ok(BlockingClient(built.context("building the OTLP/HTTP client (telemetry.otlp_ca_file?)")?))
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for BlockingClient {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let (parts, body) = request.into_parts();
        let response =
            self.0.request(parts.method, parts.uri.to_string()).headers(parts.headers).body(body.to_vec()).send()?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.bytes()?;
        let mut answer = http::Response::builder().status(status);
        if let Some(h) = answer.headers_mut() {
            *h = headers;
        }
        Ok(answer.body(body)?)
    }
}

/// Continues a remote parent (a W3C `traceparent`'s ids and flags) in `span`: the span
/// exports as its child. Without an exporter, nothing happens.
pub fn set_remote_parent(span: &tracing::Span, trace_id: [u8; 16], parent_id: [u8; 8], flags: u8) {
    let parent = SpanContext::new(
        TraceId::from_bytes(trace_id),
        SpanId::from_bytes(parent_id),
        TraceFlags::new(flags),
        true,
        TraceState::NONE,
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent));
}

/// The ids and flags `span` exports under; `None` without an exporter.
pub fn span_ids(span: &tracing::Span) -> Option<([u8; 16], [u8; 8], u8)> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| (sc.trace_id().to_bytes(), sc.span_id().to_bytes(), sc.trace_flags().to_u8()))
}

/// Lower-case hex, as ids are written in `traceparent` and in logs.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Exports `registry`'s series through the process's meter provider (a no-op until
/// [`init`] installed one with an endpoint): counters and gauges as they are, each
/// histogram as its `_count` and `_sum` counters (its buckets are on `/metrics`).
pub fn export_registry<M: MetricName>(registry: &Arc<Registry<M>>) {
    let meter = opentelemetry::global::meter("parsley");
    for &metric in registry.exported() {
        let (name, help) = (metric.name(), metric.help());
        let observe = |registry: Arc<Registry<M>>, part: Part| {
            move |o: &dyn opentelemetry::metrics::AsyncInstrument<f64>| {
                for (labels, value) in registry.series_of(metric, part.wanted()) {
                    let attrs: Vec<KeyValue> = labels.into_iter().map(|(k, v)| KeyValue::new(k, v)).collect();
                    o.observe(value, &attrs);
                }
            }
        };
        match metric.kind() {
            Kind::Counter => {
                let r = Arc::clone(registry);
                let _ = meter
                    .f64_observable_counter(name)
                    .with_description(help)
                    .with_callback(observe(r, Part::Value))
                    .build();
            }
            Kind::Gauge => {
                let r = Arc::clone(registry);
                let _ = meter
                    .f64_observable_gauge(name)
                    .with_description(help)
                    .with_callback(observe(r, Part::Value))
                    .build();
            }
            Kind::Histogram => {
                let r = Arc::clone(registry);
                let _ = meter
                    .f64_observable_counter(format!("{name}_count"))
                    .with_description(help)
                    .with_callback(observe(r, Part::Count))
                    .build();
                let r = Arc::clone(registry);
                let _ = meter
                    .f64_observable_counter(format!("{name}_sum"))
                    .with_description(help)
                    .with_callback(observe(r, Part::Sum))
                    .build();
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Part {
    Value,
    Count,
    Sum,
}

impl Part {
    fn wanted(self) -> crate::metrics::SeriesPart {
        match self {
            Part::Value => crate::metrics::SeriesPart::Value,
            Part::Count => crate::metrics::SeriesPart::Count,
            Part::Sum => crate::metrics::SeriesPart::Sum,
        }
    }
}

/// A span's `trace_id` and `span_id` fields, kept for the log lines logged inside it.
#[derive(Clone, Debug, Default)]
struct TraceIds {
    trace_id: Option<String>,
    span_id: Option<String>,
}

impl Visit for TraceIds {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "trace_id" => self.trace_id = Some(value.to_string()),
            "span_id" => self.span_id = Some(value.to_string()),
            _ => {}
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if matches!(field.name(), "trace_id" | "span_id") {
            self.record_str(field, format!("{value:?}").trim_matches('"'));
        }
    }
}

/// Keeps each span's [`TraceIds`] in its extensions.
pub struct TraceIdsLayer;

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for TraceIdsLayer {
    fn on_new_span(&self, attrs: &tracing::span::Attributes<'_>, id: &tracing::span::Id, ctx: Context<'_, S>) {
        let mut ids = TraceIds::default();
        attrs.record(&mut ids);
        if ids.trace_id.is_some() || ids.span_id.is_some() {
            if let Some(span) = ctx.span(id) {
                span.extensions_mut().insert(ids);
            }
        }
    }

    fn on_record(&self, id: &tracing::span::Id, values: &tracing::span::Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            let mut ext = span.extensions_mut();
            if let Some(ids) = ext.get_mut::<TraceIds>() {
                values.record(ids);
            } else {
                let mut ids = TraceIds::default();
                values.record(&mut ids);
                if ids.trace_id.is_some() || ids.span_id.is_some() {
                    ext.insert(ids);
                }
            }
        }
    }
}

/// An event's fields as JSON values; `message` apart.
#[derive(Default)]
struct JsonFields {
    message: Option<String>,
    fields: Map<String, Value>,
}

impl JsonFields {
    fn put(&mut self, field: &Field, value: Value) {
        if field.name() == "message" {
            self.message = Some(match value {
                Value::String(s) => s,
                v => v.to_string(),
            });
        } else {
            self.fields.insert(field.name().to_string(), value);
        }
    }
}

impl Visit for JsonFields {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, serde_json::Number::from_f64(value).map_or(Value::Null, Value::Number));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, Value::from(value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, Value::from(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, Value::from(value));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, Value::from(value));
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, Value::from(value.to_string()));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.put(field, Value::from(format!("{value:?}")));
    }
}

/// The JSON line format: `{"timestamp","level","target","message","fields",
/// "trace_id"?,"span_id"?,"span"?}`, the ids of the innermost traced span around the event
/// (else the event's own `trace_id` field), `span` the innermost span's name.
pub struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> std::fmt::Result {
        let meta = event.metadata();
        let mut fields = JsonFields::default();
        event.record(&mut fields);
        let mut timestamp = String::new();
        tracing_subscriber::fmt::time::SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        let mut line = Map::new();
        line.insert("timestamp".into(), Value::from(timestamp));
        line.insert("level".into(), Value::from(meta.level().as_str()));
        line.insert("target".into(), Value::from(meta.target()));
        line.insert("message".into(), Value::from(fields.message.take().unwrap_or_default()));
        let (mut trace_id, mut span_id, mut span_name) = (None, None, None);
        if let Some(scope) = ctx.event_scope() {
            for span in scope {
                span_name.get_or_insert_with(|| span.name().to_string());
                if let Some(ids) = span.extensions().get::<TraceIds>() {
                    if trace_id.is_none() && ids.trace_id.is_some() {
                        trace_id.clone_from(&ids.trace_id);
                        span_id.clone_from(&ids.span_id);
                    }
                }
            }
        }
        let trace_id = trace_id.or_else(|| fields.fields.get("trace_id").and_then(Value::as_str).map(str::to_string));
        line.insert("fields".into(), Value::Object(fields.fields));
        if let Some(t) = trace_id {
            line.insert("trace_id".into(), Value::from(t));
        }
        if let Some(s) = span_id {
            line.insert("span_id".into(), Value::from(s));
        }
        if let Some(n) = span_name {
            line.insert("span".into(), Value::from(n));
        }
        writeln!(writer, "{}", Value::Object(line))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(url: &str, protocol: Protocol, expected: Result<&str, EndpointError>) {
        let got = Endpoint::parse(url, protocol).map(|e| e.base);
        assert_eq!(got.as_deref().map_err(Clone::clone), expected, "{url:?}");
    }

    #[test]
    fn endpoints_are_checked_with_a_named_reason() {
        use EndpointError::*;
        use Protocol::*;
        check("http://collector:4318", Http, Ok("http://collector:4318"));
        check("http://collector:4318/v1/traces", Http, Ok("http://collector:4318"));
        check("https://otlp.example.com/otlp/", Http, Ok("https://otlp.example.com/otlp"));
        check("http://[::1]:4317", Grpc, Ok("http://[::1]:4317"));
        check("https://collector:4317", Grpc, Ok("https://collector:4317"));
        check("http://c:4318/v1/traces\r\nX-Evil: 1", Http, Err(ControlCharacter(23)));
        check("http://c:4318/\nx", Http, Err(ControlCharacter(14)));
        check("http://c:4318/a b", Http, Err(Whitespace(15)));
        check("ftp://c:4318", Http, Err(UnknownScheme("ftp".into())));
        check("grpc://c:4317", Grpc, Err(UnknownScheme("grpc".into())));
        check("c:4318", Http, Err(NoScheme));
        check("http://:4318", Http, Err(NoHost));
        check("http://c:x", Http, Err(BadPort("x".into())));
        check("http://c:0", Http, Err(BadPort("0".into())));
        check("http://c:70000", Http, Err(BadPort("70000".into())));
        check("http://user:key@c:4318", Http, Err(Credentials));
        check("http://c:4318/?a=1", Http, Err(QueryOrFragment));
        check("http://c:4317/otlp", Grpc, Err(GrpcPath("/otlp".into())));
        assert!(Endpoint::parse("https://c", Http).unwrap().tls);
    }

    #[test]
    fn headers_are_checked_with_a_named_reason() {
        let h = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        assert_eq!(check_headers(&h("x-api-key", "abc def")), Ok(()));
        assert_eq!(check_headers(&h("x api", "v")), Err(EndpointError::HeaderName("x api".into())));
        assert_eq!(check_headers(&h("", "v")), Err(EndpointError::HeaderName(String::new())));
        assert_eq!(check_headers(&h("k", "v\r\nX-Evil: 1")), Err(EndpointError::HeaderValue("k".into())));
    }

    /// A JSON line names the traced span's ids; the fields keep their types.
    #[test]
    fn json_lines_carry_the_span_s_trace_ids() {
        #[derive(Clone, Default)]
        struct Buffer(Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::registry()
            .with(TraceIdsLayer)
            .with(tracing_subscriber::fmt::layer().with_writer(move || writer.clone()).event_format(JsonLines));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("write", trace_id = tracing::field::Empty, span_id = "00f067aa0ba902b7");
            span.record("trace_id", "4bf92f3577b34da6a3ce929d0e0e4736");
            span.in_scope(|| tracing::info!(offset = 7u64, topic = "orders", ok = true, "produced"));
            tracing::warn!(error = %"boom", "outside");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(lines[0]["message"], "produced");
        assert_eq!(lines[0]["level"], "INFO");
        assert_eq!(lines[0]["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(lines[0]["span_id"], "00f067aa0ba902b7");
        assert_eq!(lines[0]["span"], "write");
        assert_eq!(lines[0]["fields"], serde_json::json!({"offset": 7, "topic": "orders", "ok": true}));
        assert!(lines[0]["timestamp"].as_str().unwrap().ends_with('Z'));
        assert_eq!(lines[1]["fields"]["error"], "boom");
        assert!(lines[1].get("trace_id").is_none());
    }
}
