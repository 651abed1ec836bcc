//! Prometheus metrics of the projector: its metric list over the shared registry
//! ([`parsley_infra::metrics`]), and a minimal HTTP endpoint serving it (`GET /metrics`).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
pub use parsley_infra::metrics::Kind;
use parsley_infra::metrics::Registry;
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
        "Errors reported by the Kafka consumer (and failed periodic log-start checks, width checks and prunes).",
    ),
    (
        "parsley_projector_log_start_checks_total",
        Kind::Counter,
        "Periodic log-start checks of the channels holding records.",
    ),
    (
        "parsley_projector_prune_checks_total",
        Kind::Counter,
        "Periodic prunes that learned the facts of the task's upstream channels.",
    ),
    ("parsley_projector_pairs_pruned_total", Kind::Counter, "Frontier and clock pairs pruned."),
    (
        "parsley_projector_skips_total",
        Kind::Counter,
        "Records an operator skipped, delivered without effect (never handed to the projection).",
    ),
    (
        "parsley_projector_dead_letters_total",
        Kind::Counter,
        "Records the projection rejected, stored in parsley.dead_letters and delivered without effect.",
    ),
    (
        "parsley_projector_panics_total",
        Kind::Counter,
        "Task runners that panicked (recorded as failing, started again with backoff).",
    ),
    (
        "parsley_projector_width_checks_total",
        Kind::Counter,
        "Periodic comparisons of the received topics' partition counts with the task count.",
    ),
    ("parsley_projector_held_bytes", Kind::Gauge, "Bytes the task's held records weigh (toward max_held_bytes)."),
];

/// The projector's metrics: the shared registry, created with [`METRICS`]
/// (`Metrics::new(METRICS)`) and shared through `Arc`.
pub type Metrics = Registry;

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

    #[tokio::test]
    async fn serves_metrics_over_http() {
        let m = Metrics::new(METRICS);
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
