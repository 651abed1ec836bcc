//! The checker against a live stack: projector instances of the binary, spawned and owned by
//! the checker as in `make check`, and a gateway served in process over TCP (the only way to
//! reach the test feature `unsafe-ungated-reads`, which no shipped binary has).
//!
//! - a short run under the nemesis (`pg-terminate`, `kill`, `stop`) judges reads of both
//!   kinds and finds no violation;
//! - with the gate switched off, the same workload is caught serving stale reads: the proof
//!   that the checker is not vacuous;
//! - a read-heavy run through a gateway keeping snapshots (`read_cache_bytes`), with the
//!   projectors killed and frozen, finds no violation while reads are served from memory;
//!   the same run with kept snapshots served without the gate over their rows is caught.
//!
//! The runs share one database of their own (a `pg-terminate` cuts only its sessions) and
//! take turns: the switch is process-wide, and the nemesis must not hit the other run.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use parsley_check::history::Event;
use parsley_check::judge::{Kind, Verdict};
use parsley_check::nemesis::Fault;
use parsley_check::run::{self, Options, Spawn};
use parsley_check::workload::QueryTarget;
use parsley_gateway::gated::ungated::{serve_kept_snapshots_unchecked, serve_ungated_reads};
use parsley_gateway::token::{KeyRing, SecretKey};
use parsley_gateway::{Gateway, GatewayConfig};
use parsley_settings::Config;
use parsley_testkit::{bootstrap, unique};
use tokio::sync::{watch, Mutex};
use tokio::task::JoinHandle;

/// The runs' own database on the server of `$DATABASE_URL`.
const DATABASE: &str = "parsley_check_it";

/// Held by each run: see the module's documentation.
static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

/// The directory of the workspace's binaries: `target/<profile>`, above this test executable
/// (`target/<profile>/deps/it-<hash>`). `make test` builds the projector there first.
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let dir = exe.parent().and_then(Path::parent).expect("the test executable is in target/<profile>/deps");
    assert!(
        dir.join(format!("parsley-projector{}", std::env::consts::EXE_SUFFIX)).is_file(),
        "{}/parsley-projector is missing: these runs spawn the projector binary; build it with \
         `cargo build -p parsley-projector --bin parsley-projector` (`make test` does)",
        dir.display()
    );
    dir.to_path_buf()
}

/// A model of its own (a replace and a merge topic of 4 partitions) and its SQL twin with the
/// named query `document` (`<model>-q`, over the table `check_q.documents` every run shares;
/// the keys are the run's own), as config/check.toml has them but for the names; the
/// gateway's listener is chosen by the system.
fn config_text(model: &str, replace: &str, merge: &str, gateway: &str) -> String {
    format!(
        r#"
[kafka]
bootstrap = "{bootstrap}"

[database]
max_connections = 8

[projector]
metrics_address = ""
initial_backoff_ms = 50
max_backoff_ms = 400
lease_ms = 3000
heartbeat_ms = 500

[[models]]
name = "{model}"
projection = "documents"
initial_position = "earliest"
max_step_records = 500
max_step_ms = 50
step_linger_ms = 5
topics = [
  {{ name = "{replace}", apply = "replace" }},
  {{ name = "{merge}", apply = "merge" }},
]

[[models]]
name = "{model}-q"
projection = "sql"
migrations = "{migrations}"
initial_position = "earliest"
max_step_records = 500
max_step_ms = 50
step_linger_ms = 5

[[models.topics]]
name = "{replace}"
statements = ["""
INSERT INTO check_q.documents (key, doc, version) VALUES (:key, :value, 1)
ON CONFLICT (key) DO UPDATE SET doc = EXCLUDED.doc, version = check_q.documents.version + 1
"""]

[[models.topics]]
name = "{merge}"
statements = ["""
INSERT INTO check_q.documents (key, doc, version) VALUES (:key, :value, 1)
ON CONFLICT (key) DO UPDATE SET doc = check_q.documents.doc || EXCLUDED.doc, version = check_q.documents.version + 1
"""]

[[models.queries]]
name = "document"
sql = "SELECT doc AS document, version FROM check_q.documents WHERE key = :key"
params = {{ key = "text" }}
key = "key"

[gateway]
access = "open"
listen = "127.0.0.1:0"
admin_listen = ""
read_wait_ms = 2000
recheck_ms = 250
retry_after_s = 1
{gateway}
"#,
        bootstrap = bootstrap(),
        migrations = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/check-query").display(),
    )
}

/// A gateway serving over TCP in this process, stopped on drop of `stop`.
struct Served {
    address: SocketAddr,
    state: parsley_gateway::AppState,
    stop: watch::Sender<bool>,
    server: JoinHandle<anyhow::Result<()>>,
}

impl Served {
    async fn stop(self) {
        let _ = self.stop.send(true);
        let stopped = tokio::time::timeout(Duration::from_secs(30), self.server).await;
        stopped.expect("the gateway stops").expect("the gateway's task").expect("the gateway serves to the end");
    }
}

/// The checker's options for a run of `duration` on a fresh model, the topics and the
/// database prepared and migrated, and the gateway it goes through, serving.
async fn stack(name: &str, projectors: usize, nemesis: &[Fault], duration: Duration) -> (Options, Served) {
    stack_with(name, projectors, nemesis, duration, "").await
}

/// [`stack`] with extra `[gateway]` settings.
async fn stack_with(
    name: &str,
    projectors: usize,
    nemesis: &[Fault],
    duration: Duration,
    gateway: &str,
) -> (Options, Served) {
    let model = unique(name);
    let (replace, merge) = (format!("{model}.replace"), format!("{model}.merge"));
    let text = config_text(&model, &replace, &merge, gateway);
    // Read by the projectors the checker starts; removed with the temporary directory.
    let config_path = std::env::temp_dir().join(format!("{model}.toml"));
    std::fs::write(&config_path, &text).unwrap();
    let spawn = Spawn {
        projectors,
        gateways: 0,
        config: config_path,
        bin_dir: bin_dir(),
        database: DATABASE.to_string(),
        partitions: 4,
        base_port: 0,
    };
    let mut options = Options {
        gateways: Vec::new(),
        model: model.clone(),
        replace_topic: replace,
        merge_topic: merge,
        duration,
        max_ops: None,
        sessions: 4,
        keys: 8,
        write_percent: 45,
        nemesis: nemesis.to_vec(),
        interval: Duration::from_millis(1500),
        projector_pids: Vec::new(),
        database_url: None,
        application_name: None,
        spawn: Some(spawn.clone()),
        repo: std::env::current_dir().unwrap(),
        seed: 7,
        query: Some(QueryTarget { model: format!("{model}-q"), name: "document".into() }),
    };
    // The gateway needs the database and its schema before it serves; the checker prepares
    // both again (it finds them there) when it starts the projectors.
    let url = run::prepare(&spawn, &options).await.expect("the topics and the database");
    let pool = sqlx::PgPool::connect(&url).await.expect("the checker's database");
    parsley_store::migrations::run(&pool).await.expect("migrations");
    pool.close().await;

    let mut config = Config::parse(&text).unwrap();
    config.database.url = Some(url.into());
    let ring = KeyRing::new(vec![("check".to_string(), SecretKey::from_bytes([0x17; 32]))]).unwrap();
    let gateway = Gateway::new(GatewayConfig::with_keys(config, ring).unwrap()).unwrap();
    let listeners = gateway.bind().await.unwrap();
    let address = listeners.local_addr().unwrap();
    let state = gateway.state().clone();
    let (stop, shutdown) = watch::channel(false);
    let server = tokio::spawn(gateway.serve(listeners, shutdown));
    options.gateways.push(format!("http://{address}"));
    (options, Served { address, state, stop, server })
}

/// The summary line, for the test's output.
fn told(name: &str, verdict: &Verdict, took: Duration) {
    eprintln!("[{name}] {} in {took:.1?}", verdict.summary());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_short_run_under_the_nemesis_finds_no_violation() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let nemesis = [Fault::PgTerminate, Fault::Kill, Fault::Stop];
    let (options, gateway) = stack("check-short", 2, &nemesis, Duration::from_secs(12)).await;
    let began = Instant::now();
    let (verdict, history) = run::run(options).await.expect("the run");
    told("short run", &verdict, began.elapsed());
    gateway.stop().await;

    for v in verdict.violations.iter().take(5) {
        eprintln!("{} session {} op {} key {}: {}", v.kind.name(), v.session, v.seq, v.key, v.detail);
        for e in &v.excerpt {
            eprintln!("    {}", serde_json::to_string(e).unwrap());
        }
    }
    assert!(verdict.violations.is_empty(), "{}", verdict.summary());
    assert!(verdict.judged_reads > 0 && verdict.judged_collection_reads > 0, "{}", verdict.summary());
    assert!(verdict.judged_query_reads > 0, "reads through the named query were judged: {}", verdict.summary());
    assert!(verdict.passed());
    let faults: Vec<&str> = history
        .iter()
        .filter_map(|e| match e {
            Event::Fault { what, .. } => Some(what.as_str()),
            _ => None,
        })
        .collect();
    for injected in ["pg_terminate_backend", "kill -9 projector", "SIGSTOP projector"] {
        assert!(faults.iter().any(|f| f.starts_with(injected)), "no {injected:?} among {faults:?}");
    }
}

/// Reads served without the gate while the projector applies behind the writes: a session
/// soon reads a document that lacks its own write (or one it saw), and the judge says so —
/// within the run's five seconds, or the test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ungated_reads_are_caught_within_a_five_second_run() {
    let _turn = ONE_AT_A_TIME.lock().await;
    const RUN: Duration = Duration::from_secs(5);
    let (options, gateway) = stack("check-ungated", 1, &[], RUN).await;
    eprintln!("serving reads without the gate at {}", gateway.address);
    serve_ungated_reads(true);
    let began = Instant::now();
    let result = run::run(options).await;
    serve_ungated_reads(false);
    let (verdict, history) = result.expect("the run");
    told("ungated", &verdict, began.elapsed());
    gateway.stop().await;

    let first = verdict
        .violations
        .first()
        .unwrap_or_else(|| panic!("nothing caught in a run of {RUN:?}: {}", verdict.summary()));
    let caught_at = history
        .iter()
        .find_map(|e| match e {
            Event::Read { session, seq, end_ms, .. } | Event::Page { session, seq, end_ms, .. }
                if (*session, *seq) == (first.session, first.seq) =>
            {
                Some(*end_ms)
            }
            _ => None,
        })
        .expect("the violating read is in the history");
    eprintln!(
        "first violation ({}) at {:.1} s: session {} operation {} key {}: {}",
        first.kind.name(),
        caught_at as f64 / 1000.0,
        first.session,
        first.seq,
        first.key,
        first.detail
    );
    // The run's length is the bound: a violation is caught within it or the test fails above.
    // The named query's answers are judged too: ungated, some of them are caught.
    let through_query = |v: &parsley_check::judge::Violation| {
        v.excerpt.iter().any(
            |e| matches!(e, Event::Read { session, seq, query: Some(_), .. } if (*session, *seq) == (v.session, v.seq)),
        )
    };
    assert!(
        verdict.violations.iter().any(through_query),
        "no violation caught through the named query: {}",
        verdict.summary()
    );
    assert!(
        verdict.violations.iter().all(|v| v.kind != Kind::Inconsistent),
        "stale reads are session-guarantee violations, never inconsistent documents: {}",
        verdict.summary()
    );
}

/// Kept snapshots under the checker: mostly reads (one in ten operations writes), the
/// projectors killed and frozen, and the gateway keeping covered single-key snapshots. The
/// judge finds no violation, and reads were served from memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_heavy_run_through_kept_snapshots_finds_no_violation() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let (verdict, hits, misses) = read_heavy_through_kept_snapshots("check-kept", &[Fault::Kill, Fault::Stop]).await;

    for v in verdict.violations.iter().take(5) {
        eprintln!("{} session {} op {} key {}: {}", v.kind.name(), v.session, v.seq, v.key, v.detail);
    }
    assert!(verdict.violations.is_empty(), "{}", verdict.summary());
    assert!(verdict.judged_reads > 0, "{}", verdict.summary());
    assert!(hits > 0.0, "no read was served from a kept snapshot ({misses} kept): the run did not exercise them");
}

/// A read-heavy run of 12 s (one in ten operations writes) under `nemesis` through a gateway
/// keeping snapshots: the verdict and how many reads it served from memory and kept.
async fn read_heavy_through_kept_snapshots(name: &str, nemesis: &[Fault]) -> (Verdict, f64, f64) {
    let kept = "read_cache_bytes = 16777216\nread_cache_max_age_ms = 5000";
    let (mut options, gateway) = stack_with(name, 2, nemesis, Duration::from_secs(12), kept).await;
    options.write_percent = 10;
    let began = Instant::now();
    let (verdict, _) = run::run(options).await.expect("the run");
    told(name, &verdict, began.elapsed());
    let model = gateway.state.config.shared.models[0].name.clone();
    let count = |result| {
        let labels = [("model", model.as_str()), ("result", result)];
        gateway.state.metrics.value(parsley_gateway::metrics::Metric::ReadCacheTotal, &labels).unwrap_or(0.0)
    };
    let (hits, misses) = (count("hit"), count("miss"));
    eprintln!("[{name}] {hits} reads served from memory, {misses} read and offered to keep");
    gateway.stop().await;
    (verdict, hits, misses)
}

/// Kept snapshots served to every session, covered or not: sessions soon read documents that
/// lack their own writes, and the judge says so — the read-heavy run above would catch a
/// kept snapshot served past its gate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kept_snapshots_served_without_their_gate_are_caught() {
    let _turn = ONE_AT_A_TIME.lock().await;
    serve_kept_snapshots_unchecked(true);
    let (verdict, hits, _) = read_heavy_through_kept_snapshots("check-kept-unchecked", &[]).await;
    serve_kept_snapshots_unchecked(false);
    assert!(hits > 0.0, "no read was served from a kept snapshot");
    assert!(!verdict.violations.is_empty(), "nothing caught: {}", verdict.summary());
    assert!(
        verdict.violations.iter().all(|v| v.kind != Kind::Inconsistent),
        "stale reads are session-guarantee violations, never inconsistent documents: {}",
        verdict.summary()
    );
}
