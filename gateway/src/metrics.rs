//! Prometheus metrics of the gateway: its metric names ([`Metric`], each declared once)
//! over the shared registry ([`parsley_infra::metrics`]), whose exposition the router
//! answers `/metrics` with.

pub use parsley_infra::metrics::Kind;
use parsley_infra::metrics::Registry;

parsley_infra::metric_names! {
    /// Every metric the gateway exports, each declared once: `Metric::RequestsTotal.name()` is
    /// `parsley_gateway_requests_total`. Declaration order is the exposition order.
    pub enum Metric {
        BuildInfo = (
            "parsley_build_info",
            Gauge,
            "1, labelled with the version and the commit this binary was built from.",
        ),
        DependencyUp = (
            "parsley_gateway_dependency_up",
            Gauge,
            "1 while the dependency counts as up for /readyz (database, migrations, kafka), from the background checks.",
        ),
        DependencyChecksTotal = (
            "parsley_gateway_dependency_checks_total",
            Counter,
            "Background readiness checks, by dependency and result (ok, error).",
        ),
        RequestsTotal = ("parsley_gateway_requests_total", Counter, "HTTP requests answered, by route and status."),
        RequestSeconds = ("parsley_gateway_request_seconds", Histogram, "Time to answer an HTTP request, by route."),
        ProblemsTotal = ("parsley_gateway_problems_total", Counter, "Problem documents returned, by problem type."),
        WritesTotal = ("parsley_gateway_writes_total", Counter, "Records acknowledged by the broker, by topic."),
        WriteAckSeconds = ("parsley_gateway_write_ack_seconds", Histogram, "Time from produce to acknowledgement."),
        BatchesTotal = (
            "parsley_gateway_batches_total",
            Counter,
            "Batch writes committed (each one Kafka transaction).",
        ),
        IdempotentReplaysTotal = (
            "parsley_gateway_idempotent_replays_total",
            Counter,
            "Writes answered from an earlier request with the same Idempotency-Key, without writing again.",
        ),
        ReadsTotal = (
            "parsley_gateway_reads_total",
            Counter,
            "Gated reads served, by model and whether they had to wait.",
        ),
        ReadWaitSeconds = (
            "parsley_gateway_read_wait_seconds",
            Histogram,
            "Time a read waited for coverage (served or not).",
        ),
        NotCoveredTotal = (
            "parsley_gateway_not_covered_total",
            Counter,
            "Reads answered 503 not-yet-covered, by model.",
        ),
        GateChecksTotal = ("parsley_gateway_gate_checks_total", Counter, "Gate transactions run, by model."),
        ReadCacheBytes = (
            "parsley_gateway_read_cache_bytes",
            Gauge,
            "Bytes of kept snapshots held now, by model (as of the scrape).",
        ),
        ReadCacheTotal = (
            "parsley_gateway_read_cache_total",
            Counter,
            "Covered document reads (keys and pages) served from a snapshot kept in memory (hit) or read from Postgres and offered to keep (miss), by model.",
        ),
        ClockFetchesTotal = (
            "parsley_gateway_clock_fetches_total",
            Counter,
            "Clock fetches shared by the reads of a model waiting for coverage, by model.",
        ),
        TokenPairsPrunedTotal = ("parsley_gateway_token_pairs_pruned_total", Counter, "Token pairs pruned, by reason."),
        ClockNotificationsTotal = (
            "parsley_gateway_clock_notifications_total",
            Counter,
            "Clock notifications received.",
        ),
        ListenerReconnectsTotal = (
            "parsley_gateway_listener_reconnects_total",
            Counter,
            "Times the clock listener lost its connection.",
        ),
        PanicsTotal = (
            "parsley_gateway_panics_total",
            Counter,
            "Request handlers that panicked (answered 500 internal).",
        ),
        OverloadedTotal = (
            "parsley_gateway_overloaded_total",
            Counter,
            "Requests refused 503 overloaded, by the limit reached (max_in_flight, max_waiting_reads).",
        ),
        WidthChangedTotal = (
            "parsley_gateway_width_changed_total",
            Counter,
            "Writes refused 409 because the topic's partition count differs from a model's recorded width, by topic.",
        ),
        TokenKeys = (
            "parsley_gateway_token_keys",
            Gauge,
            "Keys of the token key ring in use, by key id and role (seal, open): 1 in the ring, 0 removed by a reload.",
        ),
        TokenKeyReloadsTotal = (
            "parsley_gateway_token_key_reloads_total",
            Counter,
            "Re-reads of the token keys file, by result (ok; error: the ring in use was kept).",
        ),
        JwksFetchesTotal = (
            "parsley_gateway_jwks_fetches_total",
            Counter,
            "Fetches of the JWT verification keys (JWKS URL) and re-reads of their file, by result (ok; error: the keys in use were kept).",
        ),
    }
}

/// Every metric the gateway exports, in exposition order: what [`Metrics::new`] is given.
pub const METRICS: &[Metric] = Metric::ALL;

/// The gateway's metrics: the shared registry over [`Metric`], created with [`METRICS`]
/// (`Metrics::new(METRICS)`) and shared through `Arc`.
pub type Metrics = Registry<Metric>;

#[cfg(test)]
mod tests {
    use super::*;

    /// Names are unique and well formed, and every gateway histogram is a duration: the
    /// registry picks a histogram's buckets by its name, and the gateway's always had the
    /// seconds buckets.
    #[test]
    fn the_declarations_are_well_formed() {
        parsley_infra::metrics::check_declarations(METRICS, true).unwrap();
        assert_eq!(METRICS, Metric::ALL, "every declared metric is exported");
        for m in METRICS {
            // parsley_build_info is the one name both services share.
            assert!(m.name().starts_with("parsley_gateway_") || *m == Metric::BuildInfo, "{m:?}");
        }
    }

    /// The exposition lists every declared metric, with its kind and help.
    #[test]
    fn the_exposition_lists_every_declared_metric() {
        parsley_infra::metrics::check_exposition(Metric::ALL).unwrap();
    }

    /// docs/gateway.md's metrics paragraph names exactly the declared metrics.
    #[test]
    fn the_documented_metrics_are_the_declared_ones() {
        let doc = include_str!("../../docs/gateway.md");
        let paragraph = doc.split("- **Metrics**:").nth(1).expect("the metrics paragraph");
        let paragraph = paragraph.split("\n- **").next().unwrap_or_default();
        let mut documented: Vec<&str> = paragraph
            .split('`')
            .skip(1)
            .step_by(2)
            .map(|code| code.split('{').next().unwrap_or_default())
            .filter(|code| code.starts_with("parsley_gateway_") || *code == "parsley_build_info")
            .collect();
        let mut declared: Vec<&str> = Metric::ALL.iter().map(|m| m.name()).collect();
        documented.sort_unstable();
        declared.sort_unstable();
        assert_eq!(documented, declared, "docs/gateway.md's metric list");
    }
}
