//! Prometheus metrics of the gateway: its metric list over the shared registry
//! ([`parsley_infra::metrics`]), rendered at `/metrics` by the router.

pub use parsley_infra::metrics::Kind;
use parsley_infra::metrics::Registry;

/// Every metric the gateway exports: name, kind, help.
pub const METRICS: &[(&str, Kind, &str)] = &[
    ("parsley_gateway_requests_total", Kind::Counter, "HTTP requests answered, by route and status."),
    ("parsley_gateway_request_seconds", Kind::Histogram, "Time to answer an HTTP request, by route."),
    ("parsley_gateway_problems_total", Kind::Counter, "Problem documents returned, by problem type."),
    ("parsley_gateway_writes_total", Kind::Counter, "Records acknowledged by the broker, by topic."),
    ("parsley_gateway_write_ack_seconds", Kind::Histogram, "Time from produce to acknowledgement."),
    ("parsley_gateway_reads_total", Kind::Counter, "Gated reads served, by model and whether they had to wait."),
    ("parsley_gateway_read_wait_seconds", Kind::Histogram, "Time a read waited for coverage (served or not)."),
    ("parsley_gateway_not_covered_total", Kind::Counter, "Reads answered 503 not-yet-covered, by model."),
    ("parsley_gateway_gate_checks_total", Kind::Counter, "Gate transactions run, by model."),
    ("parsley_gateway_token_pairs_pruned_total", Kind::Counter, "Token pairs pruned, by reason."),
    ("parsley_gateway_clock_notifications_total", Kind::Counter, "Clock notifications received."),
    ("parsley_gateway_listener_reconnects_total", Kind::Counter, "Times the clock listener lost its connection."),
    ("parsley_gateway_panics_total", Kind::Counter, "Request handlers that panicked (answered 500 internal)."),
    (
        "parsley_gateway_overloaded_total",
        Kind::Counter,
        "Requests refused 503 overloaded, by the limit reached (max_in_flight, max_waiting_reads).",
    ),
    (
        "parsley_gateway_width_changed_total",
        Kind::Counter,
        "Writes refused 409 because the topic's partition count differs from a model's recorded width, by topic.",
    ),
];

/// The gateway's metrics: the shared registry, created with [`METRICS`]
/// (`Metrics::new(METRICS)`) and shared through `Arc`.
pub type Metrics = Registry;

#[cfg(test)]
mod tests {
    use super::*;

    /// Every metric the gateway's code names is declared (the registry renders only
    /// declared metrics, so an undeclared name would be counted and never shown).
    #[test]
    fn every_metric_used_is_declared() {
        let sources = [
            include_str!("app.rs"),
            include_str!("notify.rs"),
            include_str!("ops.rs"),
            include_str!("read.rs"),
            include_str!("session.rs"),
            include_str!("write.rs"),
        ];
        let mut used = 0;
        for source in sources {
            for (at, _) in source.match_indices("\"parsley_gateway_") {
                let name = source[at + 1..].split('"').next().unwrap_or_default();
                assert!(METRICS.iter().any(|(n, _, _)| *n == name), "{name} is used but not declared in METRICS");
                used += 1;
            }
        }
        assert!(used >= METRICS.len(), "the scan found the names ({used})");
    }

    /// The registry picks a histogram's buckets by its name; every gateway histogram is a
    /// duration, with the seconds buckets it always had.
    #[test]
    fn histograms_are_durations() {
        for (name, kind, _) in METRICS {
            assert!(*kind != Kind::Histogram || name.ends_with("_seconds"), "{name}");
        }
    }
}
