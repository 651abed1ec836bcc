//! Prometheus metrics: a small registry rendered in the text exposition format, and a
//! minimal HTTP endpoint serving it (`GET /metrics`). Hand-rolled to keep the dependency
//! tree lean (see docs/DECISIONS.md); updates happen once per step, not per record, so one
//! mutex is plenty.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Every metric the projector exports: name, kind, help.
pub const METRICS: &[(&str, Kind, &str)] = &[
    ("parsley_projector_records_received_total", Kind::Counter, "Records fed to the engine (replays excluded)."),
    (
        "parsley_projector_records_replayed_total",
        Kind::Counter,
        "Records dropped as already accounted for (replay after restart).",
    ),
    ("parsley_projector_records_delivered_total", Kind::Counter, "Records delivered to the projection and committed."),
    ("parsley_projector_held_records", Kind::Gauge, "Records received and not yet delivered."),
    ("parsley_projector_head_hold_age_seconds", Kind::Gauge, "How long the oldest held queue head has been held."),
    ("parsley_projector_clock_width", Kind::Gauge, "Channels in the task's clock (delivered past)."),
    ("parsley_projector_steps_total", Kind::Counter, "Step transactions committed."),
    ("parsley_projector_step_commit_seconds", Kind::Histogram, "Time from BEGIN to COMMIT of a step transaction."),
    ("parsley_projector_step_records", Kind::Histogram, "Records fed per committed step."),
    ("parsley_projector_refusals_total", Kind::Counter, "Refusals, by reason."),
    ("parsley_projector_task_refused", Kind::Gauge, "1 while the task is refused."),
    ("parsley_projector_failures_total", Kind::Counter, "Failed steps (rolled back, retried with backoff)."),
    ("parsley_projector_task_failing", Kind::Gauge, "1 while the task's last step failed."),
    ("parsley_projector_fenced_total", Kind::Counter, "Steps aborted because another owner took the task."),
    (
        "parsley_projector_kafka_errors_total",
        Kind::Counter,
        "Errors reported by the Kafka consumer (and failed periodic log-start checks).",
    ),
    (
        "parsley_projector_log_start_checks_total",
        Kind::Counter,
        "Periodic log-start checks of the channels holding records.",
    ),
];

const SECONDS_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
const RECORDS_BUCKETS: &[f64] = &[1.0, 10.0, 100.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(&self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

#[derive(Debug, Default)]
struct Registry {
    values: BTreeMap<(&'static str, String), f64>,
    histograms: BTreeMap<(&'static str, String), Histogram>,
}

/// The projector's metrics. Cheap to share (`Arc`).
#[derive(Debug, Default)]
pub struct Metrics {
    registry: Mutex<Registry>,
}

fn labels(pairs: &[(&str, &str)]) -> String {
    let mut out = String::new();
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let escaped = v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
        let _ = write!(out, "{k}=\"{escaped}\"");
    }
    out
}

fn buckets_of(name: &str) -> &'static [f64] {
    if name.ends_with("_seconds") {
        SECONDS_BUCKETS
    } else {
        RECORDS_BUCKETS
    }
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        Arc::new(Metrics::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        // A panic while holding the lock leaves plain numbers behind: still usable.
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn add(&self, name: &'static str, l: &[(&str, &str)], v: f64) {
        *self.lock().values.entry((name, labels(l))).or_insert(0.0) += v;
    }

    pub fn set(&self, name: &'static str, l: &[(&str, &str)], v: f64) {
        self.lock().values.insert((name, labels(l)), v);
    }

    pub fn observe(&self, name: &'static str, l: &[(&str, &str)], v: f64) {
        let buckets = buckets_of(name);
        let mut r = self.lock();
        let h = r
            .histograms
            .entry((name, labels(l)))
            .or_insert_with(|| Histogram { counts: vec![0; buckets.len()], ..Histogram::default() });
        for (i, le) in buckets.iter().enumerate() {
            if v <= *le {
                h.counts[i] += 1;
            }
        }
        h.sum += v;
        h.count += 1;
    }

    /// The current value of a counter or gauge (tests, status).
    pub fn value(&self, name: &'static str, l: &[(&str, &str)]) -> Option<f64> {
        self.lock().values.get(&(name, labels(l))).copied()
    }

    /// The text exposition format, version 0.0.4.
    pub fn render(&self) -> String {
        let r = self.lock();
        let mut out = String::new();
        for (name, kind, help) in METRICS {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {}", kind.as_str());
            if *kind == Kind::Histogram {
                for ((n, l), h) in r.histograms.range((*name, String::new())..) {
                    if n != name {
                        break;
                    }
                    let sep = if l.is_empty() { "" } else { "," };
                    for (le, c) in buckets_of(name).iter().zip(&h.counts) {
                        let _ = writeln!(out, "{name}_bucket{{{l}{sep}le=\"{le}\"}} {c}");
                    }
                    let _ = writeln!(out, "{name}_bucket{{{l}{sep}le=\"+Inf\"}} {}", h.count);
                    let _ = writeln!(out, "{name}_sum{{{l}}} {}", h.sum);
                    let _ = writeln!(out, "{name}_count{{{l}}} {}", h.count);
                }
            } else {
                for ((n, l), v) in r.values.range((*name, String::new())..) {
                    if n != name {
                        break;
                    }
                    let _ = writeln!(out, "{name}{{{l}}} {v}");
                }
            }
        }
        out
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown` turns true.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, mut shutdown: watch::Receiver<bool>) {
    loop {
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => return,
            a = listener.accept() => a,
        };
        let Ok((mut socket, _)) = accepted else { continue };
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let n = match tokio::time::timeout(std::time::Duration::from_secs(5), socket.read(&mut buf)).await {
                Ok(Ok(n)) => n,
                _ => return,
            };
            let request = String::from_utf8_lossy(&buf[..n]);
            let response = if request.starts_with("GET /metrics ") || request.starts_with("GET /metrics?") {
                let body = metrics.render();
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
            } else {
                "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string()
            };
            let _ = socket.write_all(response.as_bytes()).await;
            let _ = socket.shutdown().await;
        });
    }
}

/// Binds `address` for [`serve`].
pub async fn bind(address: &str) -> anyhow::Result<(TcpListener, SocketAddr)> {
    let listener =
        TcpListener::bind(address).await.with_context(|| format!("binding the metrics address {address}"))?;
    let local = listener.local_addr().context("reading the metrics address")?;
    Ok((listener, local))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_exposition_format() {
        let m = Metrics::default();
        m.add("parsley_projector_steps_total", &[("model", "m"), ("task", "0")], 2.0);
        m.set("parsley_projector_held_records", &[("model", "m\"x"), ("task", "1")], 3.0);
        m.observe("parsley_projector_step_commit_seconds", &[("model", "m")], 0.003);
        let text = m.render();
        assert!(text.contains("# TYPE parsley_projector_steps_total counter"));
        assert!(text.contains("parsley_projector_steps_total{model=\"m\",task=\"0\"} 2"));
        assert!(text.contains("parsley_projector_held_records{model=\"m\\\"x\",task=\"1\"} 3"));
        assert!(text.contains("parsley_projector_step_commit_seconds_bucket{model=\"m\",le=\"0.0025\"} 0"));
        assert!(text.contains("parsley_projector_step_commit_seconds_bucket{model=\"m\",le=\"0.005\"} 1"));
        assert!(text.contains("parsley_projector_step_commit_seconds_count{model=\"m\"} 1"));
        assert_eq!(m.value("parsley_projector_steps_total", &[("model", "m"), ("task", "0")]), Some(2.0));
    }

    #[tokio::test]
    async fn serves_metrics_over_http() {
        let m = Metrics::new();
        m.add("parsley_projector_steps_total", &[("model", "m"), ("task", "0")], 1.0);
        let (listener, addr) = bind("127.0.0.1:0").await.unwrap();
        let (tx, rx) = watch::channel(false);
        let server = tokio::spawn(serve(listener, Arc::clone(&m), rx));
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).await.unwrap();
        assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
        assert!(body.contains("parsley_projector_steps_total{model=\"m\",task=\"0\"} 1"));
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /nope HTTP/1.1\r\n\r\n").await.unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).await.unwrap();
        assert!(body.starts_with("HTTP/1.1 404"), "{body}");
        tx.send(true).unwrap();
        server.await.unwrap();
    }
}
