//! A small Prometheus registry rendered in the text exposition format (version 0.0.4),
//! shared by the projector and the gateway: each service passes its own list of metric
//! definitions and keeps a thin `Metrics` wrapper over [`Registry`]. Hand-rolled to keep the
//! dependency tree lean (see docs/DECISIONS.md); updates happen a few times per step or
//! request, not per record, so one mutex is plenty.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard};

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

/// One metric a service exports: name, kind, help. A histogram's buckets follow from its
/// name (see [`Registry::observe`]).
pub type Definition = (&'static str, Kind, &'static str);

const SECONDS_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
const RECORDS_BUCKETS: &[f64] = &[1.0, 10.0, 100.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0];

/// Durations (`…_seconds`) get sub-millisecond to ten-second buckets; every other histogram
/// counts records, from one to ten thousand.
fn buckets_of(name: &str) -> &'static [f64] {
    if name.ends_with("_seconds") {
        SECONDS_BUCKETS
    } else {
        RECORDS_BUCKETS
    }
}

#[derive(Clone, Debug, Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

/// Every series, keyed by metric name and rendered label set; sorted so the exposition
/// text is stable.
#[derive(Debug, Default)]
struct Series {
    values: BTreeMap<(&'static str, String), f64>,
    histograms: BTreeMap<(&'static str, String), Histogram>,
}

/// The metrics of one service: the series of the metrics in its definition list.
#[derive(Debug)]
pub struct Registry {
    definitions: &'static [Definition],
    series: Mutex<Series>,
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

impl Registry {
    /// An empty registry exporting `definitions`, in that order, ready to share between
    /// tasks. Updates to a name not in the list are kept but never rendered.
    pub fn new(definitions: &'static [Definition]) -> Arc<Registry> {
        Arc::new(Registry { definitions, series: Mutex::default() })
    }

    fn lock(&self) -> MutexGuard<'_, Series> {
        // A panic while holding the lock leaves plain numbers behind: still usable.
        self.series.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `v` to a counter (or gauge).
    pub fn add(&self, name: &'static str, l: &[(&str, &str)], v: f64) {
        *self.lock().values.entry((name, labels(l))).or_insert(0.0) += v;
    }

    /// Sets a gauge to `v`.
    pub fn set(&self, name: &'static str, l: &[(&str, &str)], v: f64) {
        self.lock().values.insert((name, labels(l)), v);
    }

    /// Records `v` in a histogram: seconds buckets for a name ending in `_seconds`, records
    /// buckets otherwise.
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
        for (name, kind, help) in self.definitions {
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

#[cfg(test)]
mod tests {
    use super::*;

    const DEFINITIONS: &[Definition] = &[
        ("t_requests_total", Kind::Counter, "Requests answered, by route and status."),
        ("t_held_records", Kind::Gauge, "Records held."),
        ("t_wait_seconds", Kind::Histogram, "Time waited."),
        ("t_step_records", Kind::Histogram, "Records per step."),
    ];

    /// The exact text the projector's and the gateway's own registries rendered for these
    /// updates before they were merged here: the services' `/metrics` output must not change.
    #[test]
    fn renders_every_kind_byte_for_byte() {
        let m = Registry::new(DEFINITIONS);
        m.add("t_requests_total", &[("route", "/a"), ("status", "200")], 1.0);
        m.add("t_requests_total", &[("route", "/a"), ("status", "200")], 2.0);
        m.add("t_requests_total", &[("route", "q\"\\\n")], 1.0);
        m.set("t_held_records", &[("task", "0")], 3.0);
        m.set("t_held_records", &[("task", "0")], 5.0);
        m.add("t_held_records", &[("task", "1")], 1.5);
        m.observe("t_wait_seconds", &[("route", "/a")], 0.003);
        m.observe("t_wait_seconds", &[("route", "/a")], 12.0);
        m.observe("t_step_records", &[], 42.0);
        m.observe("t_step_records", &[], 1.0);
        m.add("t_undeclared_total", &[], 1.0);
        let expected = r#"# HELP t_requests_total Requests answered, by route and status.
# TYPE t_requests_total counter
t_requests_total{route="/a",status="200"} 3
t_requests_total{route="q\"\\\n"} 1
# HELP t_held_records Records held.
# TYPE t_held_records gauge
t_held_records{task="0"} 5
t_held_records{task="1"} 1.5
# HELP t_wait_seconds Time waited.
# TYPE t_wait_seconds histogram
t_wait_seconds_bucket{route="/a",le="0.001"} 0
t_wait_seconds_bucket{route="/a",le="0.0025"} 0
t_wait_seconds_bucket{route="/a",le="0.005"} 1
t_wait_seconds_bucket{route="/a",le="0.01"} 1
t_wait_seconds_bucket{route="/a",le="0.025"} 1
t_wait_seconds_bucket{route="/a",le="0.05"} 1
t_wait_seconds_bucket{route="/a",le="0.1"} 1
t_wait_seconds_bucket{route="/a",le="0.25"} 1
t_wait_seconds_bucket{route="/a",le="0.5"} 1
t_wait_seconds_bucket{route="/a",le="1"} 1
t_wait_seconds_bucket{route="/a",le="2.5"} 1
t_wait_seconds_bucket{route="/a",le="5"} 1
t_wait_seconds_bucket{route="/a",le="10"} 1
t_wait_seconds_bucket{route="/a",le="+Inf"} 2
t_wait_seconds_sum{route="/a"} 12.003
t_wait_seconds_count{route="/a"} 2
# HELP t_step_records Records per step.
# TYPE t_step_records histogram
t_step_records_bucket{le="1"} 1
t_step_records_bucket{le="10"} 1
t_step_records_bucket{le="100"} 2
t_step_records_bucket{le="500"} 2
t_step_records_bucket{le="1000"} 2
t_step_records_bucket{le="2000"} 2
t_step_records_bucket{le="5000"} 2
t_step_records_bucket{le="10000"} 2
t_step_records_bucket{le="+Inf"} 2
t_step_records_sum{} 43
t_step_records_count{} 2
"#;
        assert_eq!(m.render(), expected);
        assert_eq!(m.value("t_requests_total", &[("route", "/a"), ("status", "200")]), Some(3.0));
        assert_eq!(m.value("t_held_records", &[("task", "0")]), Some(5.0));
        assert_eq!(m.value("t_held_records", &[("task", "2")]), None);
    }
}
