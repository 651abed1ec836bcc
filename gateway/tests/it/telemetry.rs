//! Logs and OpenTelemetry from the real binaries: the gateway and the projector run as
//! processes with `[telemetry]` set, export to an OTLP receiver built here from the
//! `opentelemetry-proto` crate (a tonic server for gRPC, an axum route decoding the protobuf
//! body for HTTP), and log JSON lines on stderr that this test parses. No OpenTelemetry
//! Collector is run: its distribution is a Go program that the reachable registries do not
//! serve (docs/operations.md, "Logs and telemetry").

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use parsley_infra::http::Client;
use serde_json::{json, Value};

use crate::support::*;

/// What the receiver got: spans with their resource's `service.name`, metric names with
/// theirs, and the resource attributes seen.
#[derive(Clone, Debug, Default)]
struct Received {
    spans: Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)>,
    metrics: Vec<(String, String)>,
    resource: Vec<(String, String)>,
    headers: Vec<String>,
}

#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Received>>);

fn text(attrs: &[KeyValue]) -> Vec<(String, String)> {
    attrs
        .iter()
        .filter_map(|kv| match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
            Some(AnyValue::StringValue(s)) => Some((kv.key.clone(), s.clone())),
            _ => None,
        })
        .collect()
}

fn service(attrs: &[(String, String)]) -> String {
    attrs.iter().find(|(k, _)| k == "service.name").map(|(_, v)| v.clone()).unwrap_or_default()
}

impl Receiver {
    fn traces(&self, request: ExportTraceServiceRequest) {
        let mut r = self.0.lock().unwrap();
        for rs in request.resource_spans {
            let resource = text(&rs.resource.map(|r| r.attributes).unwrap_or_default());
            let name = service(&resource);
            r.resource.extend(resource);
            for ss in rs.scope_spans {
                r.spans.extend(ss.spans.into_iter().map(|s| (name.clone(), s)));
            }
        }
    }

    fn metrics(&self, request: ExportMetricsServiceRequest) {
        let mut r = self.0.lock().unwrap();
        for rm in request.resource_metrics {
            let name = service(&text(&rm.resource.map(|r| r.attributes).unwrap_or_default()));
            for sm in rm.scope_metrics {
                r.metrics.extend(sm.metrics.into_iter().map(|m| (name.clone(), m.name)));
            }
        }
    }

    fn snapshot(&self) -> Received {
        self.0.lock().unwrap().clone()
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        if let Some(key) = request.metadata().get("x-collector-key").and_then(|v| v.to_str().ok()) {
            self.0.lock().unwrap().headers.push(key.to_string());
        }
        self.traces(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

#[tonic::async_trait]
impl MetricsService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.metrics(request.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse { partial_success: None }))
    }
}

/// Starts the receiver for `protocol` on a free port; answers its address.
async fn start_receiver(protocol: &str, receiver: Receiver) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    if protocol == "grpc" {
        // tonic binds the address itself, freed just now.
        drop(listener);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(receiver.clone()))
                .add_service(MetricsServiceServer::new(receiver))
                .serve(address),
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    } else {
        use axum::routing::post;
        use prost::Message as _;
        let (traces, metrics) = (receiver.clone(), receiver);
        let app = axum::Router::new()
            .route(
                "/v1/traces",
                post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| async move {
                    assert_eq!(headers["content-type"], "application/x-protobuf");
                    if let Some(key) = headers.get("x-collector-key").and_then(|v| v.to_str().ok()) {
                        traces.0.lock().unwrap().headers.push(key.to_string());
                    }
                    traces.traces(ExportTraceServiceRequest::decode(body).expect("a protobuf trace request"));
                    axum::http::StatusCode::OK
                }),
            )
            .route(
                "/v1/metrics",
                post(move |body: axum::body::Bytes| async move {
                    metrics.metrics(ExportMetricsServiceRequest::decode(body).expect("a protobuf metrics request"));
                    axum::http::StatusCode::OK
                }),
            );
        tokio::spawn(async move { axum::serve(listener, app).await });
    }
    format!("http://{address}")
}

/// The binary `name` next to this test executable (`target/<profile>/deps/it-<hash>`).
fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let profile = exe.parent().and_then(Path::parent).expect("the test executable is in target/<profile>/deps");
    let binary = profile.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(binary.is_file(), "{} is missing: build it with `cargo build --bins`", binary.display());
    binary
}

/// A child process killed when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(binary: &Path, args: &[&str], log: &Path) -> Running {
    let mut command = Command::new(binary);
    for (var, _) in std::env::vars_os() {
        let var = var.to_string_lossy().into_owned();
        if var.starts_with("PARSLEY_") || var.starts_with("OTEL_") || var == "RUST_LOG" {
            command.env_remove(var);
        }
    }
    let keys = format!("it:{}", base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [0x42u8; 32]));
    let out = std::fs::File::create(log).unwrap();
    let child = command
        .args(args)
        .env("PARSLEY_TOKEN_KEYS", keys)
        .env("RUST_LOG", "info")
        // The spans' batches leave within 100 ms, not the default 5 s.
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {}: {e}", binary.display()));
    Running(child)
}

/// One write traced from the HTTP request through the Kafka record to the projector's step,
/// exported over `protocol`, with the metrics, and the request's trace id in the gateway's
/// JSON log line.
async fn a_write_is_traced_through_both_binaries(protocol: &str) {
    let receiver = Receiver::default();
    let endpoint = start_receiver(protocol, receiver.clone()).await;
    let s = Stack::new(&format!("otel-{protocol}"), 1, "").await;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = parsley_testkit::ScratchDir::new("telemetry");
    let file = dir.join("parsley.toml");
    std::fs::write(
        &file,
        format!(
            "[kafka]\nbootstrap = {:?}\n[database]\nurl = {:?}\n\
             [projector]\nowner = \"otel-{protocol}\"\nmetrics_address = \"\"\n\
             [telemetry]\nlog_format = \"json\"\notlp_endpoint = {endpoint:?}\notlp_protocol = {protocol:?}\n\
             otlp_metrics_interval_ms = 300\notlp_headers = {{ \"x-collector-key\" = \"k-123\" }}\n\
             resource_attributes = {{ \"deployment.environment\" = \"it\" }}\n\
             [[models]]\nname = {:?}\ntopics = [{{ name = {:?} }}, {{ name = {:?}, apply = \"merge\" }}]\n\
             [gateway]\naccess = \"open\"\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"\"\n",
            bootstrap(),
            database_url(),
            s.names.model,
            s.names.orders,
            s.names.payments
        ),
    )
    .unwrap();
    let config = file.to_str().unwrap();
    let (gateway_log, projector_log) = (dir.join("gateway.log"), dir.join("projector.log"));
    let gateway = spawn(&binary("parsley-gateway"), &["--config", config], &gateway_log);
    let projector = spawn(&binary("parsley-projector"), &["run", "--config", config], &projector_log);

    let client = Client::new(&format!("127.0.0.1:{port}"), Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !client.get("/readyz", &[]).await.is_ok_and(|r| r.status == 200) {
        let log = std::fs::read_to_string(&gateway_log).unwrap_or_default();
        assert!(Instant::now() < deadline, "the gateway never became ready:\n{log}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let caller_span = "b7ad6b7169203331";
    let traceparent = format!("00-{trace_id}-{caller_span}-01");
    let uri = format!("/v1/topics/{}/records", s.names.orders);
    let r = client.post_json(&uri, &[("traceparent", &traceparent)], &json!({"key": "k", "value": 1})).await.unwrap();
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));

    // The spans: request (server) ← write (producer) ← apply (consumer), one trace.
    let hex = |b: &[u8]| b.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let deadline = Instant::now() + Duration::from_secs(30);
    let (request, write, apply) = loop {
        let got = receiver.snapshot();
        let find = |service: &str, name: &str| {
            got.spans.iter().find(|(s, span)| s == service && span.name == name && hex(&span.trace_id) == trace_id)
        };
        let request = find("parsley-gateway", "POST /v1/topics/{topic}/records");
        let write = find("parsley-gateway", &format!("POST /v1/topics/{}/records", s.names.orders));
        let apply = find("parsley-projector", &format!("apply {}", s.names.orders));
        let metrics_in = ["parsley_gateway_requests_total", "parsley_projector_steps_total"]
            .iter()
            .all(|m| got.metrics.iter().any(|(_, name)| name == m));
        if let (Some(request), Some(write), Some(apply), true) = (request, write, apply, metrics_in) {
            break (request.1.clone(), write.1.clone(), apply.1.clone());
        }
        assert!(
            Instant::now() < deadline,
            "not everything reached the receiver over {protocol}: spans {:?}, metrics {:?}\ngateway:\n{}\nprojector:\n{}",
            got.spans.iter().map(|(s, span)| format!("{s}: {} {}", span.name, hex(&span.trace_id))).collect::<Vec<_>>(),
            got.metrics,
            std::fs::read_to_string(&gateway_log).unwrap_or_default(),
            std::fs::read_to_string(&projector_log).unwrap_or_default(),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(hex(&request.parent_span_id), caller_span, "the request continues the caller's span");
    assert_eq!(write.parent_span_id, request.span_id, "the write is the request's child");
    assert_eq!(apply.parent_span_id, write.span_id, "the projector's step is the write's child");
    let got = receiver.snapshot();
    assert!(got.resource.contains(&("deployment.environment".into(), "it".into())), "{:?}", got.resource);
    assert!(got.headers.iter().any(|h| h == "k-123"), "the configured header reached the receiver");

    // The logs: every line is JSON; the gateway's line for the write names the trace and
    // the write span, the projector's the trace.
    drop(gateway);
    drop(projector);
    let lines = |log: &Path| -> Vec<Value> {
        let text = std::fs::read_to_string(log).unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: not a JSON line: {l}"))).collect()
    };
    let gateway_lines = lines(&gateway_log);
    let produced = gateway_lines
        .iter()
        .find(|l| l["trace_id"] == json!(trace_id) && l["fields"]["topic"] == json!(s.names.orders))
        .unwrap_or_else(|| panic!("no gateway line names the trace: {gateway_lines:?}"));
    assert_eq!(produced["span_id"], json!(hex(&write.span_id)), "{produced}");
    for key in ["timestamp", "level", "target", "message"] {
        assert!(produced[key].is_string(), "{key} in {produced}");
    }
    let applied = lines(&projector_log)
        .into_iter()
        .find(|l| l["message"] == json!("applied a traced record"))
        .expect("the projector logged the traced record");
    assert_eq!(applied["trace_id"], json!(trace_id), "{applied}");
    assert_eq!(applied["span_id"], json!(hex(&apply.span_id)), "{applied}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_traced_over_grpc() {
    a_write_is_traced_through_both_binaries("grpc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_traced_over_http() {
    a_write_is_traced_through_both_binaries("http").await;
}

/// Bad endpoints stop the binary at start with the reason named.
#[test]
fn bad_endpoints_are_refused_at_start() {
    let dir = parsley_testkit::ScratchDir::new("telemetry-bad");
    for (telemetry, reason) in [
        ("otlp_endpoint = \"http://c:4318/v1/traces\\r\\nX-Evil: 1\"", "control character"),
        ("otlp_endpoint = \"ftp://c:4318\"", r#"has the scheme "ftp""#),
        ("otlp_endpoint = \"http://c:4317/x\"\notlp_protocol = \"grpc\"", "takes none"),
        ("otlp_endpoint = \"http://c:4318\"\notlp_headers = { \"k\" = \"v\\nX: 1\" }", "control character"),
        ("otlp_protocol = \"thrift\"", "thrift"),
        ("log_format = \"xml\"", "xml"),
    ] {
        let file = dir.join("bad.toml");
        std::fs::write(&file, format!("[telemetry]\n{telemetry}\n[[models]]\nname = \"m\"\ntopics = [{{ name = \"t\" }}]\n[gateway]\naccess = \"open\"\n")).unwrap();
        for (name, args) in [("parsley-gateway", vec!["--config"]), ("parsley-projector", vec!["run", "--config"])] {
            let log = dir.join("bad.log");
            let mut args = args.clone();
            args.push(file.to_str().unwrap());
            let mut running = spawn(&binary(name), &args, &log);
            let status = running.0.wait().unwrap();
            let err = std::fs::read_to_string(&log).unwrap();
            assert_eq!(status.code(), Some(1), "{name} with {telemetry}: {err}");
            assert!(err.contains(reason), "{name} with {telemetry}: {err}");
        }
    }
}
