//! A small Prometheus registry rendered in the text exposition format (version 0.0.4),
//! shared by the projector and the gateway, and the one `GET /metrics` answer both serve.
//!
//! Metric names are types: each service declares its metrics once with [`metric_names!`]
//! (an enum whose variants carry name, kind and help), and the registry's updates take that
//! enum, so a misspelt metric fails to compile instead of counting a series nobody renders.
//! Hand-rolled to keep the dependency tree lean (see docs/DECISIONS.md); updates happen a few
//! times per step or request, not per record, so one mutex is plenty.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    pub fn as_str(&self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A service's metric names: implemented by the enum [`metric_names!`] declares. `name`,
/// `kind` and `help` are what the exposition says about the metric.
pub trait MetricName: Copy + Eq + std::fmt::Debug + Send + Sync + 'static {
    fn name(self) -> &'static str;
    fn kind(self) -> Kind;
    fn help(self) -> &'static str;
}

/// Declares a service's metrics, each once: an enum whose variants are the metrics, with
/// `ALL` (declaration order, which is the exposition order), `name()`, `kind()` and `help()`,
/// and [`MetricName`] for the registry.
///
/// ```
/// parsley_infra::metric_names! {
///     /// The metrics of an example service.
///     pub enum Metric {
///         /// Requests answered.
///         RequestsTotal = ("example_requests_total", Counter, "Requests answered."),
///     }
/// }
/// assert_eq!(Metric::RequestsTotal.name(), "example_requests_total");
/// assert_eq!(Metric::ALL, &[Metric::RequestsTotal]);
/// ```
#[macro_export]
macro_rules! metric_names {
    (
        $(#[$meta:meta])*
        $vis:vis enum $Enum:ident {
            $( $(#[$vmeta:meta])* $Variant:ident = ($name:literal, $kind:ident, $help:literal $(,)?) ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        $vis enum $Enum {
            $( $(#[$vmeta])* $Variant ),*
        }

        impl $Enum {
            /// Every metric, in declaration order (the exposition's order).
            pub const ALL: &'static [$Enum] = &[ $( $Enum::$Variant ),* ];

            /// The exposition name.
            pub const fn name(self) -> &'static str {
                match self { $( $Enum::$Variant => $name ),* }
            }

            pub const fn kind(self) -> $crate::metrics::Kind {
                match self { $( $Enum::$Variant => $crate::metrics::Kind::$kind ),* }
            }

            /// The exposition's `# HELP` text.
            pub const fn help(self) -> &'static str {
                match self { $( $Enum::$Variant => $help ),* }
            }
        }

        impl $crate::metrics::MetricName for $Enum {
            fn name(self) -> &'static str {
                $Enum::name(self)
            }
            fn kind(self) -> $crate::metrics::Kind {
                $Enum::kind(self)
            }
            fn help(self) -> &'static str {
                $Enum::help(self)
            }
        }
    };
}

/// What is wrong with a service's declarations, if anything: a name declared twice, a name
/// that is not a Prometheus metric name, or a histogram whose buckets its name does not pick
/// as intended (`expect_seconds`: every histogram must be a duration). For each service's
/// tests.
pub fn check_declarations<M: MetricName>(all: &[M], expect_seconds: bool) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    for m in all {
        let name = m.name();
        if !seen.insert(name) {
            return Err(format!("{name} is declared twice"));
        }
        let valid = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(format!("{name:?} is not a metric name"));
        }
        if m.help().is_empty() {
            return Err(format!("{name} has no help text"));
        }
        if expect_seconds && m.kind() == Kind::Histogram && !name.ends_with("_seconds") {
            return Err(format!("{name} is a histogram but not a duration (…_seconds)"));
        }
    }
    Ok(())
}

/// What is missing from the exposition of a fresh registry of `all`, if anything: every
/// declared metric must be listed once, with its help and kind. For each service's tests.
pub fn check_exposition<M: MetricName>(all: &'static [M]) -> Result<(), String> {
    let text = Registry::new(all).render();
    for m in all {
        let (name, kind, help) = (m.name(), m.kind().as_str(), m.help());
        if !text.contains(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n")) {
            return Err(format!("{name} is not listed with its help and kind:\n{text}"));
        }
    }
    let listed = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
    if listed != all.len() {
        return Err(format!("{listed} metrics listed, {} declared", all.len()));
    }
    Ok(())
}

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

/// The metrics of one service: the series of the metrics `M` it exports.
#[derive(Debug)]
pub struct Registry<M: MetricName> {
    exported: &'static [M],
    series: Mutex<Series>,
    _names: PhantomData<M>,
}

/// The rendered label set, `k1="v1",k2="v2"`, values escaped (`\\`, `"`, newline). Built
/// on every update (the gateway makes several per request): one allocation, no formatting
/// machinery.
fn labels(pairs: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(pairs.iter().map(|(k, v)| k.len() + v.len() + 4).sum());
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(k);
        out.push_str("=\"");
        if !v.contains(['\\', '"', '\n']) {
            out.push_str(v);
        } else {
            for c in v.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '"' => out.push_str("\\\""),
                    '\n' => out.push_str("\\n"),
                    c => out.push(c),
                }
            }
        }
        out.push('"');
    }
    out
}

/// Which number of a series [`Registry::series_of`] answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeriesPart {
    /// A counter's or gauge's value.
    Value,
    /// A histogram's observation count.
    Count,
    /// A histogram's sum.
    Sum,
}

/// The pairs of a label set as [`labels`] rendered it (`k="v",...`, values escaped).
fn parse_labels(rendered: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = rendered;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, other)) => value.push(other),
                    None => {}
                },
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.push((key.to_string(), value));
        rest = after[end..].strip_prefix(',').unwrap_or(&after[end..]);
    }
    out
}

/// The `Content-Type` of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// The answer to `GET /metrics`: what both services serve, on their own routes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exposition {
    pub content_type: &'static str,
    pub body: String,
}

impl<M: MetricName> Registry<M> {
    /// An empty registry exporting `exported` (normally every metric, `M::ALL`), in that
    /// order, ready to share between tasks.
    pub fn new(exported: &'static [M]) -> Arc<Registry<M>> {
        Arc::new(Registry { exported, series: Mutex::default(), _names: PhantomData })
    }

    fn lock(&self) -> MutexGuard<'_, Series> {
        // A panic while holding the lock leaves plain numbers behind: still usable.
        self.series.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `v` to a counter (or gauge).
    pub fn add(&self, metric: M, l: &[(&str, &str)], v: f64) {
        *self.lock().values.entry((metric.name(), labels(l))).or_insert(0.0) += v;
    }

    /// Sets a gauge to `v`.
    pub fn set(&self, metric: M, l: &[(&str, &str)], v: f64) {
        self.lock().values.insert((metric.name(), labels(l)), v);
    }

    /// Records `v` in a histogram: seconds buckets for a name ending in `_seconds`, records
    /// buckets otherwise.
    pub fn observe(&self, metric: M, l: &[(&str, &str)], v: f64) {
        let name = metric.name();
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
    pub fn value(&self, metric: M, l: &[(&str, &str)]) -> Option<f64> {
        self.lock().values.get(&(metric.name(), labels(l))).copied()
    }

    /// The metrics this registry exports, in exposition order.
    pub fn exported(&self) -> &'static [M] {
        self.exported
    }

    /// Every series of `metric` now: its labels and, for a counter or gauge, its value; for
    /// a histogram, its count or sum (OTLP export, [`crate::telemetry::export_registry`]).
    pub fn series_of(&self, metric: M, part: SeriesPart) -> Vec<(Vec<(String, String)>, f64)> {
        let name = metric.name();
        let r = self.lock();
        match part {
            SeriesPart::Value => r
                .values
                .range((name, String::new())..)
                .take_while(|((n, _), _)| *n == name)
                .map(|((_, l), v)| (parse_labels(l), *v))
                .collect(),
            SeriesPart::Count | SeriesPart::Sum => r
                .histograms
                .range((name, String::new())..)
                .take_while(|((n, _), _)| *n == name)
                .map(|((_, l), h)| (parse_labels(l), if part == SeriesPart::Sum { h.sum } else { h.count as f64 }))
                .collect(),
        }
    }

    /// The text exposition format, version 0.0.4.
    pub fn render(&self) -> String {
        let r = self.lock();
        let mut out = String::new();
        for metric in self.exported {
            let (name, kind, help) = (metric.name(), metric.kind(), metric.help());
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {}", kind.as_str());
            if kind == Kind::Histogram {
                for ((n, l), h) in r.histograms.range((name, String::new())..) {
                    if *n != name {
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
                for ((n, l), v) in r.values.range((name, String::new())..) {
                    if *n != name {
                        break;
                    }
                    let _ = writeln!(out, "{name}{{{l}}} {v}");
                }
            }
        }
        out
    }

    /// The answer to `GET /metrics`: the text exposition and its content type. The
    /// gateway's router and [`serve`] both answer with it.
    pub fn exposition(&self) -> Exposition {
        Exposition { content_type: CONTENT_TYPE, body: self.render() }
    }
}

/// A probe's answer: whether it passed (`200`, else `503`) and its JSON body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeAnswer {
    pub ok: bool,
    pub body: String,
}

/// What a bare listener answers to `GET /livez` and `GET /readyz` (the projector's probes,
/// beside its `/metrics`).
pub trait Probes: Send + Sync + 'static {
    /// Liveness: the process should be restarted when this fails.
    fn live(&self) -> ProbeAnswer;
    /// Readiness: the process does what it is there for.
    fn ready(&self) -> ProbeAnswer;
}

/// Serves `GET /metrics` (and nothing else: `404`) on a bare HTTP/1.1 listener until
/// `shutdown` turns true: the projector's endpoint, for a process that has no router.
pub async fn serve<M: MetricName>(listener: TcpListener, registry: Arc<Registry<M>>, shutdown: watch::Receiver<bool>) {
    serve_with_probes(listener, registry, None, shutdown).await
}

/// [`serve`], and with `probes` also `GET /livez` and `GET /readyz` (`200` or `503`, a JSON
/// body). Every answer closes its connection.
pub async fn serve_with_probes<M: MetricName>(
    listener: TcpListener,
    registry: Arc<Registry<M>>,
    probes: Option<Arc<dyn Probes>>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => return,
            a = listener.accept() => a,
        };
        let Ok((mut socket, _)) = accepted else { continue };
        let registry = Arc::clone(&registry);
        let probes = probes.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let n = match tokio::time::timeout(Duration::from_secs(5), socket.read(&mut buf)).await {
                Ok(Ok(n)) => n,
                _ => return,
            };
            let request = String::from_utf8_lossy(&buf[..n]);
            let path = request.strip_prefix("GET ").and_then(|rest| rest.split([' ', '?']).next()).unwrap_or_default();
            let answer = |status: &str, content_type: &str, body: &str| {
                format!(
                    "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
            };
            let probe = |p: ProbeAnswer| {
                answer(if p.ok { "200 OK" } else { "503 Service Unavailable" }, "application/json", &p.body)
            };
            let response = match (path, &probes) {
                ("/metrics", _) => {
                    let Exposition { content_type, body } = registry.exposition();
                    answer("200 OK", content_type, &body)
                }
                ("/livez", Some(probes)) => probe(probes.live()),
                ("/readyz", Some(probes)) => probe(probes.ready()),
                _ => "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string(),
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
    fn label_sets_read_back_as_rendered() {
        for pairs in [vec![], vec![("model", "m")], vec![("a", "x\"y\\z\nw"), ("b", ""), ("c", "p,q=\"r")]] {
            let rendered = labels(&pairs);
            let back = parse_labels(&rendered);
            let back: Vec<(&str, &str)> = back.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            assert_eq!(back, pairs, "{rendered}");
        }
    }

    #[test]
    fn label_values_are_escaped_for_the_exposition() {
        assert_eq!(labels(&[]), "");
        assert_eq!(labels(&[("route", "/v1/documents/{model}/{key}")]), r#"route="/v1/documents/{model}/{key}""#);
        assert_eq!(labels(&[("a", "x\"y\\z\nw"), ("b", "é")]), r#"a="x\"y\\z\nw",b="é""#);
    }

    crate::metric_names! {
        enum T {
            Requests = ("t_requests_total", Counter, "Requests answered, by route and status."),
            Held = ("t_held_records", Gauge, "Records held."),
            Wait = ("t_wait_seconds", Histogram, "Time waited."),
            StepRecords = ("t_step_records", Histogram, "Records per step."),
        }
    }

    /// The exposition text of these updates, byte for byte: the services' `/metrics` output
    /// is a contract.
    #[test]
    fn renders_every_kind_byte_for_byte() {
        let m = Registry::new(T::ALL);
        m.add(T::Requests, &[("route", "/a"), ("status", "200")], 1.0);
        m.add(T::Requests, &[("route", "/a"), ("status", "200")], 2.0);
        m.add(T::Requests, &[("route", "q\"\\\n")], 1.0);
        m.set(T::Held, &[("task", "0")], 3.0);
        m.set(T::Held, &[("task", "0")], 5.0);
        m.add(T::Held, &[("task", "1")], 1.5);
        m.observe(T::Wait, &[("route", "/a")], 0.003);
        m.observe(T::Wait, &[("route", "/a")], 12.0);
        m.observe(T::StepRecords, &[], 42.0);
        m.observe(T::StepRecords, &[], 1.0);
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
        assert_eq!(m.value(T::Requests, &[("route", "/a"), ("status", "200")]), Some(3.0));
        assert_eq!(m.value(T::Held, &[("task", "0")]), Some(5.0));
        assert_eq!(m.value(T::Held, &[("task", "2")]), None);
    }

    /// Only the exported metrics are rendered, in the order given.
    #[test]
    fn renders_the_exported_metrics_in_their_order() {
        let m = Registry::new(&[T::Held, T::Requests]);
        m.add(T::Requests, &[], 1.0);
        m.observe(T::Wait, &[], 1.0);
        let text = m.render();
        let types: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE")).collect();
        assert_eq!(types, ["# TYPE t_held_records gauge", "# TYPE t_requests_total counter"]);
        assert!(!text.contains("t_wait_seconds"), "{text}");
        assert_eq!(m.exposition(), Exposition { content_type: CONTENT_TYPE, body: text });
    }

    #[test]
    fn declarations_are_checked() {
        assert_eq!(check_declarations(T::ALL, false), Ok(()));
        let err = check_declarations(T::ALL, true).unwrap_err();
        assert!(err.contains("t_step_records"), "{err}");
        let err = check_declarations(&[T::Held, T::Held], false).unwrap_err();
        assert!(err.contains("declared twice"), "{err}");
    }

    #[tokio::test]
    async fn serves_metrics_over_http() {
        let m = Registry::new(T::ALL);
        m.add(T::Requests, &[("model", "m"), ("task", "0")], 1.0);
        let (listener, addr) = bind("127.0.0.1:0").await.unwrap();
        let (tx, rx) = watch::channel(false);
        let server = tokio::spawn(serve(listener, Arc::clone(&m), rx));
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).await.unwrap();
        assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
        assert!(body.contains("Content-Type: text/plain; version=0.0.4\r\n"), "{body}");
        assert!(body.contains("t_requests_total{model=\"m\",task=\"0\"} 1"));
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /nope HTTP/1.1\r\n\r\n").await.unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).await.unwrap();
        assert!(body.starts_with("HTTP/1.1 404"), "{body}");
        for path in ["/livez", "/readyz"] {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(format!("GET {path} HTTP/1.1\r\n\r\n").as_bytes()).await.unwrap();
            let mut body = String::new();
            s.read_to_string(&mut body).await.unwrap();
            assert!(body.starts_with("HTTP/1.1 404"), "no probes without Probes: {body}");
        }
        tx.send(true).unwrap();
        server.await.unwrap();
    }

    struct Fixed;

    impl Probes for Fixed {
        fn live(&self) -> ProbeAnswer {
            ProbeAnswer { ok: true, body: r#"{"status":"live"}"#.into() }
        }
        fn ready(&self) -> ProbeAnswer {
            ProbeAnswer { ok: false, body: r#"{"status":"starting"}"#.into() }
        }
    }

    #[tokio::test]
    async fn serves_the_probes_beside_the_metrics() {
        let m = Registry::new(T::ALL);
        let (listener, addr) = bind("127.0.0.1:0").await.unwrap();
        let (tx, rx) = watch::channel(false);
        let server = tokio::spawn(serve_with_probes(listener, Arc::clone(&m), Some(Arc::new(Fixed)), rx));
        for (path, expected) in [
            ("/livez", "HTTP/1.1 200 OK"),
            ("/readyz?verbose", "HTTP/1.1 503 Service Unavailable"),
            ("/metrics", "HTTP/1.1 200 OK"),
            ("/livezz", "HTTP/1.1 404"),
        ] {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).await.unwrap();
            let mut body = String::new();
            s.read_to_string(&mut body).await.unwrap();
            assert!(body.starts_with(expected), "{path}: {body}");
            if path.starts_with("/readyz") {
                assert!(body.contains("application/json") && body.ends_with(r#"{"status":"starting"}"#), "{body}");
            }
        }
        tx.send(true).unwrap();
        server.await.unwrap();
    }
}
