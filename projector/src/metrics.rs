//! Prometheus metrics of the projector: its metric names ([`Metric`], each declared once)
//! over the shared registry ([`parsley_infra::metrics`]), and the bare `GET /metrics`
//! listener ([`serve`], shared with the gateway's exposition through infra).

use parsley_infra::metrics::Registry;
pub use parsley_infra::metrics::{bind, serve, serve_with_probes, Kind};

parsley_infra::metric_names! {
    /// Every metric the projector exports, each declared once: `Metric::StepsTotal.name()` is
    /// `parsley_projector_steps_total`. Declaration order is the exposition order.
    pub enum Metric {
        BuildInfo = (
            "parsley_build_info",
            Gauge,
            "1, labelled with the version and the commit this binary was built from.",
        ),
        RecordsReceivedTotal = (
            "parsley_projector_records_received_total",
            Counter,
            "Records fed to the engine (replays excluded).",
        ),
        RecordsReplayedTotal = (
            "parsley_projector_records_replayed_total",
            Counter,
            "Records dropped as already accounted for (replay after restart).",
        ),
        RecordsDeliveredTotal = (
            "parsley_projector_records_delivered_total",
            Counter,
            "Records delivered to the projection and committed.",
        ),
        HeldRecords = ("parsley_projector_held_records", Gauge, "Records received and not yet delivered."),
        HeadHoldAgeSeconds = (
            "parsley_projector_head_hold_age_seconds",
            Gauge,
            "How long the oldest held queue head has been held.",
        ),
        ClockWidth = ("parsley_projector_clock_width", Gauge, "Channels in the task's clock (delivered past)."),
        StepsTotal = ("parsley_projector_steps_total", Counter, "Step transactions committed."),
        StepCommitSeconds = (
            "parsley_projector_step_commit_seconds",
            Histogram,
            "Time from BEGIN to COMMIT of a step transaction.",
        ),
        StepRecords = ("parsley_projector_step_records", Histogram, "Records fed per committed step."),
        RefusalsTotal = ("parsley_projector_refusals_total", Counter, "Refusals, by reason."),
        TaskRefused = ("parsley_projector_task_refused", Gauge, "1 while the task is refused."),
        FailuresTotal = (
            "parsley_projector_failures_total",
            Counter,
            "Failed steps (rolled back, retried with backoff).",
        ),
        TaskFailing = ("parsley_projector_task_failing", Gauge, "1 while the task's last step failed."),
        FencedTotal = ("parsley_projector_fenced_total", Counter, "Steps aborted because another owner took the task."),
        KafkaErrorsTotal = (
            "parsley_projector_kafka_errors_total",
            Counter,
            "Errors reported by the Kafka consumer (and failed periodic log-start checks, width checks and prunes).",
        ),
        LogStartChecksTotal = (
            "parsley_projector_log_start_checks_total",
            Counter,
            "Periodic log-start checks (every received channel) of tasks holding records.",
        ),
        PruneChecksTotal = (
            "parsley_projector_prune_checks_total",
            Counter,
            "Periodic prunes that learned the facts of the task's upstream channels.",
        ),
        PairsPrunedTotal = ("parsley_projector_pairs_pruned_total", Counter, "Frontier and clock pairs pruned."),
        SkipsTotal = (
            "parsley_projector_skips_total",
            Counter,
            "Records an operator skipped, delivered without effect (never handed to the projection).",
        ),
        DeadLettersTotal = (
            "parsley_projector_dead_letters_total",
            Counter,
            "Records the projection rejected, stored in parsley.dead_letters and delivered without effect.",
        ),
        PanicsTotal = (
            "parsley_projector_panics_total",
            Counter,
            "Task runners that panicked (recorded as failing, started again with backoff).",
        ),
        WidthChecksTotal = (
            "parsley_projector_width_checks_total",
            Counter,
            "Periodic comparisons of the received topics' partition counts with the task count.",
        ),
        HeldBytes = (
            "parsley_projector_held_bytes",
            Gauge,
            "Bytes the task's held records weigh (toward max_held_bytes).",
        ),
        TasksOwned = ("parsley_projector_tasks_owned", Gauge, "Tasks of the model this instance runs."),
        TakeoversTotal = (
            "parsley_projector_takeovers_total",
            Counter,
            "Tasks this instance took from an owner whose lease had expired.",
        ),
        TasksReleasedTotal = (
            "parsley_projector_tasks_released_total",
            Counter,
            "Tasks this instance handed back (rebalancing, or stopping).",
        ),
        TasksLostTotal = (
            "parsley_projector_tasks_lost_total",
            Counter,
            "Tasks another instance took from this one (its lease had expired).",
        ),
        LeaseRenewFailuresTotal = (
            "parsley_projector_lease_renew_failures_total",
            Counter,
            "Heartbeats that could not renew this instance's membership and leases.",
        ),
        SecondsSinceStep = (
            "parsley_projector_seconds_since_step",
            Gauge,
            "Time since the task's runner last stepped (committed or found nothing to do).",
        ),
    }
}

/// Every metric the projector exports, in exposition order: what [`Metrics::new`] is given.
pub const METRICS: &[Metric] = Metric::ALL;

/// The projector's metrics: the shared registry over [`Metric`], created with [`METRICS`]
/// (`Metrics::new(METRICS)`) and shared through `Arc`.
pub type Metrics = Registry<Metric>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_declarations_are_well_formed() {
        parsley_infra::metrics::check_declarations(METRICS, false).unwrap();
        assert_eq!(METRICS, Metric::ALL, "every declared metric is exported");
        for m in METRICS {
            // parsley_build_info is the one name both services share.
            assert!(m.name().starts_with("parsley_projector_") || *m == Metric::BuildInfo, "{m:?}");
        }
    }

    /// The exposition lists every declared metric, with its kind and help.
    #[test]
    fn the_exposition_lists_every_declared_metric() {
        parsley_infra::metrics::check_exposition(Metric::ALL).unwrap();
    }

    /// docs/projector.md's metric table names exactly the declared metrics, in order.
    #[test]
    fn the_documented_metrics_are_the_declared_ones() {
        let doc = include_str!("../../docs/projector.md");
        let table = doc.split("GET /metrics` on `projector.metrics_address`").nth(1).expect("the metrics section");
        let documented: Vec<&str> = table
            .lines()
            .skip_while(|l| !l.starts_with("| `"))
            .take_while(|l| l.starts_with("| `"))
            .filter_map(|l| l.split('`').nth(1))
            .collect();
        let mut declared: Vec<&str> = Metric::ALL.iter().map(|m| m.name()).collect();
        let mut listed = documented.clone();
        declared.sort_unstable();
        listed.sort_unstable();
        assert_eq!(listed, declared, "docs/projector.md's metric table");
    }

    #[tokio::test]
    async fn serves_metrics_over_http() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let m = Metrics::new(METRICS);
        m.add(Metric::StepsTotal, &[("model", "m"), ("task", "0")], 1.0);
        let (listener, addr) = bind("127.0.0.1:0").await.unwrap();
        let (tx, rx) = tokio::sync::watch::channel(false);
        let server = tokio::spawn(serve(listener, std::sync::Arc::clone(&m), rx));
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
