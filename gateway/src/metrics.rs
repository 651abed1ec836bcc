//! Prometheus metrics of the gateway, rendered in the text exposition format at `/metrics`.
//! Hand-rolled like the projector's (whose registry has a fixed list of projector metric
//! names, so it cannot be reused as is): a mutex over a map, updated a few times per request.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Histogram,
}

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
];

const SECONDS_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

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

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        Arc::new(Metrics::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn add(&self, name: &'static str, l: &[(&str, &str)], v: f64) {
        *self.lock().values.entry((name, labels(l))).or_insert(0.0) += v;
    }

    pub fn observe(&self, name: &'static str, l: &[(&str, &str)], v: f64) {
        let mut r = self.lock();
        let h = r
            .histograms
            .entry((name, labels(l)))
            .or_insert_with(|| Histogram { counts: vec![0; SECONDS_BUCKETS.len()], ..Histogram::default() });
        for (i, le) in SECONDS_BUCKETS.iter().enumerate() {
            if v <= *le {
                h.counts[i] += 1;
            }
        }
        h.sum += v;
        h.count += 1;
    }

    /// The current value of a counter (tests).
    pub fn value(&self, name: &'static str, l: &[(&str, &str)]) -> Option<f64> {
        self.lock().values.get(&(name, labels(l))).copied()
    }

    /// The text exposition format, version 0.0.4.
    pub fn render(&self) -> String {
        let r = self.lock();
        let mut out = String::new();
        for (name, kind, help) in METRICS {
            let _ = writeln!(out, "# HELP {name} {help}");
            match kind {
                Kind::Counter => {
                    let _ = writeln!(out, "# TYPE {name} counter");
                    for ((n, l), v) in r.values.range((*name, String::new())..) {
                        if n != name {
                            break;
                        }
                        let _ = writeln!(out, "{name}{{{l}}} {v}");
                    }
                }
                Kind::Histogram => {
                    let _ = writeln!(out, "# TYPE {name} histogram");
                    for ((n, l), h) in r.histograms.range((*name, String::new())..) {
                        if n != name {
                            break;
                        }
                        let sep = if l.is_empty() { "" } else { "," };
                        for (le, c) in SECONDS_BUCKETS.iter().zip(&h.counts) {
                            let _ = writeln!(out, "{name}_bucket{{{l}{sep}le=\"{le}\"}} {c}");
                        }
                        let _ = writeln!(out, "{name}_bucket{{{l}{sep}le=\"+Inf\"}} {}", h.count);
                        let _ = writeln!(out, "{name}_sum{{{l}}} {}", h.sum);
                        let _ = writeln!(out, "{name}_count{{{l}}} {}", h.count);
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms() {
        let m = Metrics::default();
        m.add("parsley_gateway_requests_total", &[("route", "/healthz"), ("status", "200")], 1.0);
        m.observe("parsley_gateway_request_seconds", &[("route", "/healthz")], 0.003);
        let text = m.render();
        assert!(text.contains("# TYPE parsley_gateway_requests_total counter"));
        assert!(text.contains("parsley_gateway_requests_total{route=\"/healthz\",status=\"200\"} 1"));
        assert!(text.contains("parsley_gateway_request_seconds_bucket{route=\"/healthz\",le=\"0.0025\"} 0"));
        assert!(text.contains("parsley_gateway_request_seconds_bucket{route=\"/healthz\",le=\"0.005\"} 1"));
        assert!(text.contains("parsley_gateway_request_seconds_count{route=\"/healthz\"} 1"));
    }
}
