//! Projector throughput on realistic workloads, against a naive projector on the same data,
//! with the Postgres CPU each one costs.
//!
//! Run it with `cargo bench -p parsley-projector --bench throughput`. Every run gets a
//! database of its own (`CREATE DATABASE`, dropped right after the run), so each starts on
//! an empty table and nothing is left in the shared one; the topics are deleted at the end.
//!
//! Workloads (`BENCH_WORKLOADS`, comma-separated; default `upsert-100b`):
//! - `upsert-100b`: one replace topic, values of about 100 bytes, keys drawn from a quarter
//!   of the record count (three records in four update an existing document);
//! - `upsert-1kb`: the same with values of about 1 KiB;
//! - `mix-100b`: two co-partitioned topics, one `replace` and one `merge` (half the records
//!   each, same keys), every merge patch caused by the last replace of its partition;
//! - `distinct-100b`: every key distinct (pure inserts), for comparison.
//!
//! Every record carries a `parsley.causes` header of realistic width: six pairs on upstream
//! channels (a gateway session's causal past), plus the causing replace on the sibling
//! topic for `mix-100b`'s patches.
//!
//! Variants (`BENCH_VARIANTS`; default `projector,naive-proc`, plus `baseline` when
//! `BENCH_BASELINE_BIN` is set: the projector against the naive loop timed the same way):
//! - `projector`: this build's `parsley-projector run` (or `BENCH_PROJECTOR_BIN`), launched
//!   as a process with a config file (one process per `BENCH_INSTANCES`, sharing the
//!   model's tasks);
//! - `baseline`: another build's binary (`BENCH_BASELINE_BIN`, e.g. an older commit built
//!   in a worktree with its own `CARGO_TARGET_DIR`: worktrees sharing a target directory
//!   overwrite each other's crates), launched the same way on the same topics — it runs its
//!   own migrations in its own database;
//! - `naive`: one consumer per partition in this process, applying each batch with this
//!   build's document projection (the same SQL) and storing the consumed offsets in the
//!   same transaction: no causal gating, no ordering state. It batches as the projector's
//!   steps do by default: it waits for a first record (up to 100 ms), then takes only what
//!   is already fetched, up to this build's default record and byte bounds.
//! - `naive-proc`: the same loop in a process of its own (this benchmark's executable
//!   launched again), timed from its launch as the projector is: it starts with a fresh
//!   heap, opens its own pool and consumers on the clock. The in-process `naive` loop runs
//!   in a process whose heap the producer already grew, and its pool is open before its
//!   clock starts.
//!
//! Each variant reads every record from the start. A launched binary's database gets its
//! schema first (`migrate`; the naive loop runs its migrations before its clock too), so
//! `run` is timed from its launch. Printed per run: seconds and records/s from launch to
//! the last commit, seconds to the first committed record, records/s in steady state (from 10 % to 90 % of the
//! records), and the Postgres CPU per 10⁵ records — utime + stime from `/proc` of the
//! server's processes working for the run's database (its backends and autovacuum workers;
//! the harness's own progress connection is left out), and of the whole server (which
//! includes the WAL writer, the checkpointer and anything else running on the machine) —
//! plus the client process's CPU and the server's WAL bytes per record; records per
//! committed transaction (`rec/xact`: every transaction of the run's database, reads and
//! lease heartbeats included) and per writing step (`rec/step`: from the rows written to the
//! positions table, one per channel a step read); rows written per record; `sessions`, the
//! connections opened to the run's database.
//!
//! Other knobs: `BENCH_RECORDS` (default 200000; 1000000 for the long run),
//! `BENCH_STEP_RECORDS` (every variant's `max_step_records`; unset, each build keeps its own
//! default, and the naive loop takes this build's; the naive loop also stops a batch at this
//! build's default `max_step_bytes`), `BENCH_TASKS` (partition counts, comma-separated,
//! default `4`), `BENCH_INSTANCES` (default 1), `BENCH_ROUNDS` (default 1; rounds alternate
//! the variants' order), `BENCH_KEEP_LOGS=1` (keep the processes' logs in the temp dir),
//! `BENCH_LOG` (the launched processes' `RUST_LOG`, default `warn`; e.g.
//! `parsley::stage=debug` logs every step's size), `BENCH_TIMELINE=1` (print when each
//! commit the harness saw landed: seconds from launch, records committed in all).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use parsley::channel::{ChannelId, TopicId};
use parsley::CausalPast;
use parsley_projector::projection::{Delivered, Projection, StepContext};
use parsley_projector::record::Consumed;
use parsley_projector::task::received_now;
use parsley_projector::{kafka, DocumentProjection};
use parsley_settings::config::{Apply, Config, DEFAULT_MAX_STEP_BYTES, DEFAULT_MAX_STEP_RECORDS};
use parsley_store::migrations;
use parsley_testkit::{cpu_ticks, create_database, drop_database, postgres_processes, with_database, TICKS_PER_SECOND};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::{Connection as _, PgConnection};
use tokio::sync::watch;

/// The projector binary of this build.
const PROJECTOR_BIN: &str = env!("CARGO_BIN_EXE_parsley-projector");

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

fn main() -> anyhow::Result<()> {
    if std::env::var_os(NAIVE_CHILD).is_some() {
        return naive_child();
    }
    // `cargo bench` passes `--bench`; `cargo test --benches` does not, and should not run
    // a multi-minute measurement against the services.
    if !std::env::args().any(|a| a == "--bench") {
        println!("throughput: a benchmark; run it with `cargo bench -p parsley-projector --bench throughput`");
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(bench())
}

/// A named workload.
#[derive(Clone, Copy, Debug)]
struct Workload {
    name: &'static str,
    /// Distinct keys as a fraction of the records (`1`: every key distinct).
    keys_divisor: usize,
    value_bytes: usize,
    /// Two topics, `replace` and `merge`, half the records each.
    mix: bool,
}

const WORKLOADS: &[Workload] = &[
    Workload { name: "upsert-100b", keys_divisor: 4, value_bytes: 100, mix: false },
    Workload { name: "upsert-1kb", keys_divisor: 4, value_bytes: 1024, mix: false },
    Workload { name: "mix-100b", keys_divisor: 4, value_bytes: 100, mix: true },
    Workload { name: "distinct-100b", keys_divisor: 1, value_bytes: 100, mix: false },
];

/// The topics a workload was produced to, with their apply rule.
struct Produced {
    workload: Workload,
    partitions: u32,
    topics: Vec<(String, Apply)>,
    /// Records per key (checked against each document's version at the end of each run).
    keys: std::collections::HashMap<String, i64>,
}

/// One measured run.
struct Measured {
    seconds: f64,
    /// From launch to the first committed record.
    first_seconds: f64,
    steady_per_s: f64,
    /// Postgres CPU seconds: the run database's processes, whole run and steady part.
    db_cpu: f64,
    db_cpu_steady: f64,
    steady_records: f64,
    server_cpu: f64,
    client_cpu: f64,
    wal_bytes: f64,
    /// Transactions committed in the run's database (the harness's own left out) — every
    /// one, reads and heartbeats included — and rows inserted, updated and deleted: read
    /// after the run stopped.
    commits: f64,
    rows_written: f64,
    /// Rows written to the positions table (`parsley.channels`, the naive loop's offsets):
    /// every writing step writes one per channel it read, so steps are about this over the
    /// topic count.
    position_writes: f64,
    /// Sessions opened to the run's database (`pg_stat_database.sessions`), the harness's
    /// own left out.
    sessions: f64,
}

struct Bench {
    bootstrap: String,
    database_url: String,
    run: String,
    records: usize,
    /// `BENCH_STEP_RECORDS`: every variant's step bound; `None`, each build's own default
    /// (the naive loop takes this build's).
    step: Option<usize>,
    instances: usize,
    scratch: PathBuf,
    /// Databases created and not yet dropped; topics created.
    databases: Mutex<Vec<String>>,
    topics: Mutex<Vec<String>>,
    runs: Mutex<usize>,
}

async fn bench() -> anyhow::Result<()> {
    let records = env_usize("BENCH_RECORDS", 200_000);
    let baseline = std::env::var("BENCH_BASELINE_BIN").ok().filter(|s| !s.is_empty());
    let default_variants = if baseline.is_some() { "baseline,projector,naive-proc" } else { "projector,naive-proc" };
    let variants = env_list("BENCH_VARIANTS", default_variants);
    for v in &variants {
        match v.as_str() {
            "projector" | "naive" | "naive-proc" => {}
            "baseline" if baseline.is_some() => {}
            "baseline" => bail!("the baseline variant needs BENCH_BASELINE_BIN"),
            other => bail!("unknown variant {other:?} (projector, baseline, naive, naive-proc)"),
        }
    }
    let workloads = env_list("BENCH_WORKLOADS", "upsert-100b")
        .iter()
        .map(|name| {
            WORKLOADS.iter().copied().find(|w| w.name == name).with_context(|| {
                let known: Vec<&str> = WORKLOADS.iter().map(|w| w.name).collect();
                format!("unknown workload {name:?} (one of {known:?})")
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let partition_counts = env_list("BENCH_TASKS", "4")
        .iter()
        .map(|t| t.parse::<u32>().ok().filter(|n| *n > 0).with_context(|| format!("BENCH_TASKS: {t:?}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let rounds = env_usize("BENCH_ROUNDS", 1).max(1);
    let run = format!("bench{}x{}", std::process::id(), rand_suffix());
    let bench = Bench {
        bootstrap: parsley_infra::services::kafka_bootstrap()?,
        database_url: parsley_infra::services::database_url()?,
        run: run.clone(),
        records,
        step: std::env::var("BENCH_STEP_RECORDS").ok().map(|_| env_usize("BENCH_STEP_RECORDS", 0).max(1)),
        instances: env_usize("BENCH_INSTANCES", 1).max(1),
        scratch: std::env::temp_dir().join(&run),
        databases: Mutex::new(Vec::new()),
        topics: Mutex::new(Vec::new()),
        runs: Mutex::new(0),
    };
    std::fs::create_dir_all(&bench.scratch)?;
    println!(
        "records: {records}, step bound: {} / 100 ms, instances: {}, rounds: {rounds}, run: {run}",
        bench
            .step
            .map_or(format!("each build's default (this one's {DEFAULT_MAX_STEP_RECORDS} records)"), |s| format!(
                "{s} records"
            )),
        bench.instances
    );
    println!("{:<14} {:>5} {:<10} {}", "workload", "tasks", "variant", COLUMNS.0);
    println!("{:<14} {:>5} {:<10} {}", "", "", "", COLUMNS.1);
    let outcome = measure_all(&bench, &workloads, &partition_counts, &variants, baseline.as_deref(), rounds).await;
    let cleaned = bench.cleanup().await;
    if std::env::var("BENCH_KEEP_LOGS").is_err() {
        let _ = std::fs::remove_dir_all(&bench.scratch);
    }
    outcome.and(cleaned)
}

async fn measure_all(
    bench: &Bench,
    workloads: &[Workload],
    partition_counts: &[u32],
    variants: &[String],
    baseline: Option<&str>,
    rounds: usize,
) -> anyhow::Result<()> {
    let projector = std::env::var("BENCH_PROJECTOR_BIN").unwrap_or_else(|_| PROJECTOR_BIN.to_string());
    for workload in workloads {
        for &partitions in partition_counts {
            let produced = bench.produce(*workload, partitions).await?;
            let mut results: HashMap<&str, Vec<Measured>> = HashMap::new();
            for round in 0..rounds {
                let mut order: Vec<&String> = variants.iter().collect();
                if round % 2 == 1 {
                    order.reverse();
                }
                for variant in order {
                    let m = match variant.as_str() {
                        "naive" => bench.run_naive(&produced).await?,
                        "naive-proc" => bench.run_naive_process(&produced).await?,
                        "baseline" => bench.run_binary(&produced, baseline.expect("checked"), "baseline").await?,
                        _ => bench.run_binary(&produced, &projector, "projector").await?,
                    };
                    print_row(workload.name, partitions, produced.topics.len(), variant, bench.records, &m);
                    results.entry(variant.as_str()).or_default().push(m);
                }
            }
            print_ratios(&results);
            bench.delete_topics(&produced).await?;
        }
    }
    Ok(())
}

/// The measured columns' headings, two lines.
const COLUMNS: (&str, &str) = (
    "launch s  first s  launch/s  steady/s   db cpu   steady   server   client  wal B/r rec/xact rec/step rows/rec sessions",
    "                                      s/1e5    s/1e5    s/1e5    s/1e5                                             ",
);

fn print_row(workload: &str, tasks: u32, topics: usize, variant: &str, records: usize, m: &Measured) {
    let per = |cpu: f64, n: f64| cpu / n * 1e5;
    let n = records as f64;
    println!(
        "{workload:<14} {tasks:>5} {variant:<10} {:>8.1} {:>8.2} {:>9.0} {:>9.0} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.0} {:>8.0} {:>8.0} {:>8.2} {:>8.0}",
        m.seconds,
        m.first_seconds,
        n / m.seconds,
        m.steady_per_s,
        per(m.db_cpu, n),
        per(m.db_cpu_steady, m.steady_records),
        per(m.server_cpu, n),
        per(m.client_cpu, n),
        m.wal_bytes / n,
        n / m.commits.max(1.0),
        n * topics as f64 / m.position_writes.max(1.0),
        m.rows_written / n,
        m.sessions,
    );
}

/// Medians over the rounds, and the ratios the evidence asks for.
fn print_ratios(results: &HashMap<&str, Vec<Measured>>) {
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let stat =
        |variant: &str, f: fn(&Measured) -> f64| results.get(variant).map(|ms| median(&mut ms.iter().map(f).collect()));
    let launch = |m: &Measured| 1.0 / m.seconds;
    let steady = |m: &Measured| m.steady_per_s;
    let cpu = |m: &Measured| m.db_cpu_steady / m.steady_records;
    let pairs = [
        ("projector", "naive"),
        ("projector", "naive-proc"),
        ("naive-proc", "naive"),
        ("projector", "baseline"),
        ("baseline", "naive"),
    ];
    for (a, b) in pairs {
        if let (Some(la), Some(lb), Some(sa), Some(sb), Some(ca), Some(cb)) =
            (stat(a, launch), stat(b, launch), stat(a, steady), stat(b, steady), stat(a, cpu), stat(b, cpu))
        {
            println!(
                "  {a} / {b} (medians): throughput from launch {:.2}, steady {:.2}; Postgres CPU per record (steady) {:.2}",
                la / lb,
                sa / sb,
                ca / cb
            );
        }
    }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() % 1_000_000).unwrap_or(0)
}

/// A deterministic pseudo-random sequence (xorshift), so every run produces the same data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// A JSON value of about `bytes` bytes for record `i` (an order, or a payment patch).
fn value(i: usize, bytes: usize, patch: bool, rng: &mut Rng) -> String {
    let mut v = if patch {
        format!(
            "{{\"payment\":{{\"id\":\"p-{i}\",\"amount\":{}.{:02},\"state\":\"captured\"}},\"paid\":true,\"note\":\"",
            rng.next() % 1000,
            rng.next() % 100
        )
    } else {
        format!(
            "{{\"n\":{i},\"status\":\"placed\",\"customer\":\"c-{}\",\"items\":{},\"total\":{}.{:02},\"note\":\"",
            rng.next() % 100_000,
            rng.next() % 9 + 1,
            rng.next() % 1000,
            rng.next() % 100
        )
    };
    while v.len() + 2 < bytes {
        v.push(char::from(b'a' + (rng.next() % 26) as u8));
    }
    v.push_str("\"}");
    v
}

/// The partition of `key` among `partitions` (the same for both topics: co-partitioned), as
/// the topics' partitioner (murmur2, the default) places it: the projector refuses a keyed
/// record anywhere else (`KEY_PARTITION_MISMATCH`).
fn partition_of(key: &str, partitions: u32) -> u32 {
    parsley::murmur2::partition_for_key(key.as_bytes(), partitions)
}

/// What the sampler saw of each server process, by pid: ticks at the start (0 for a
/// process started since), latest ticks, whether it works for the run's database.
type Seen = HashMap<u32, (u64, u64, bool)>;

/// Postgres CPU since it was created, sampled from `/proc` every 100 ms (a backend that ends
/// between two samples loses at most its last 100 ms).
struct PgCpu {
    seen: Arc<Mutex<Seen>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    sampler: Option<std::thread::JoinHandle<()>>,
}

impl PgCpu {
    /// `database`: the run's database; `excluded`: the harness's own backends.
    fn start(database: &str, excluded: Vec<u32>) -> PgCpu {
        let mut seen = HashMap::new();
        for (pid, title, ticks) in postgres_processes() {
            seen.insert(pid, (ticks, ticks, works_for(&title, database) && !excluded.contains(&pid)));
        }
        let seen = Arc::new(Mutex::new(seen));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, st, db) = (seen.clone(), stop.clone(), database.to_string());
        let sampler = std::thread::spawn(move || {
            while !st.load(std::sync::atomic::Ordering::Relaxed) {
                sample(&s, &db, &excluded);
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        PgCpu { seen, stop, sampler: Some(sampler) }
    }

    /// CPU seconds so far: (the run database's processes, the whole server).
    fn seconds(&self, database: &str, excluded: &[u32]) -> (f64, f64) {
        sample(&self.seen, database, excluded);
        let seen = self.seen.lock().expect("sampler");
        let (mut db, mut all) = (0, 0);
        for (first, last, ours) in seen.values() {
            all += last - first;
            if *ours {
                db += last - first;
            }
        }
        (db as f64 / TICKS_PER_SECOND, all as f64 / TICKS_PER_SECOND)
    }
}

impl Drop for PgCpu {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(s) = self.sampler.take() {
            let _ = s.join();
        }
    }
}

/// A backend's title is `postgres: <user> <database> <client> <activity>`, an autovacuum
/// worker's `postgres: autovacuum worker <database>`.
fn works_for(title: &str, database: &str) -> bool {
    title.split(' ').any(|word| word == database)
}

fn sample(seen: &Mutex<Seen>, database: &str, excluded: &[u32]) {
    let now = postgres_processes();
    let mut seen = seen.lock().expect("sampler");
    for (pid, title, ticks) in now {
        let entry = seen.entry(pid).or_insert((0, 0, false));
        entry.1 = entry.1.max(ticks);
        // A new backend shows the server's own title until it has connected to its database.
        entry.2 |= works_for(&title, database) && !excluded.contains(&pid);
    }
}

impl Bench {
    /// A new empty database for one run.
    async fn create_database(&self, label: &str) -> anyhow::Result<String> {
        let n = {
            let mut runs = self.runs.lock().expect("runs");
            *runs += 1;
            *runs
        };
        let name = format!("{}_{n}_{label}", self.run);
        create_database(&self.database_url, &name).await.context("creating a database")?;
        self.databases.lock().expect("databases").push(name.clone());
        Ok(name)
    }

    /// Drops a run's database.
    async fn drop_database(&self, name: &str) -> anyhow::Result<()> {
        drop_database(&self.database_url, name).await.with_context(|| format!("dropping database {name}"))?;
        self.databases.lock().expect("databases").retain(|d| d != name);
        Ok(())
    }

    async fn cleanup(&self) -> anyhow::Result<()> {
        let databases = self.databases.lock().expect("databases").clone();
        for d in databases {
            self.drop_database(&d).await?;
        }
        let topics = std::mem::take(&mut *self.topics.lock().expect("topics"));
        if !topics.is_empty() {
            let admin: AdminClient<DefaultClientContext> =
                parsley_infra::kafka::admin_config(&self.bootstrap).create()?;
            let names: Vec<&str> = topics.iter().map(String::as_str).collect();
            admin.delete_topics(&names, &AdminOptions::new()).await?;
        }
        Ok(())
    }

    async fn delete_topics(&self, produced: &Produced) -> anyhow::Result<()> {
        let admin: AdminClient<DefaultClientContext> = parsley_infra::kafka::admin_config(&self.bootstrap).create()?;
        let names: Vec<&str> = produced.topics.iter().map(|(t, _)| t.as_str()).collect();
        for r in admin.delete_topics(&names, &AdminOptions::new()).await? {
            r.map_err(|(t, e)| anyhow::anyhow!("deleting {t}: {e}"))?;
        }
        self.topics.lock().expect("topics").retain(|t| !names.contains(&t.as_str()));
        Ok(())
    }

    /// Creates the workload's topics and writes its records.
    async fn produce(&self, workload: Workload, partitions: u32) -> anyhow::Result<Produced> {
        let prefix = format!("{}.{}.p{partitions}", self.run, workload.name);
        let mut topics = vec![(format!("{prefix}.orders"), Apply::Replace)];
        if workload.mix {
            topics.push((format!("{prefix}.payments"), Apply::Merge));
        }
        let admin: AdminClient<DefaultClientContext> = parsley_infra::kafka::admin_config(&self.bootstrap).create()?;
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        let new: Vec<NewTopic<'_>> =
            topics.iter().map(|(t, _)| NewTopic::new(t, partitions as i32, TopicReplication::Fixed(1))).collect();
        for r in admin.create_topics(&new, &opts).await? {
            self.topics.lock().expect("topics").push(r.clone().unwrap_or_else(|(t, _)| t));
            r.map_err(|(t, e)| anyhow::anyhow!("creating {t}: {e}"))?;
        }
        let names: Vec<String> = topics.iter().map(|(t, _)| t.clone()).collect();
        // A topic just created may not be known to the broker answering yet.
        let mut attempts = 0;
        let described = loop {
            match parsley_infra::describe_topics(&self.bootstrap, &names, Duration::from_secs(30)).await {
                Ok(d) => break d,
                Err(e) if attempts == 40 => return Err(e),
                Err(_) => attempts += 1,
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        let orders_id = TopicId::from_bytes(described[0].id);

        let producer: FutureProducer = parsley_infra::kafka::producer_config(&self.bootstrap)
            .set("linger.ms", "20")
            .set("batch.num.messages", "10000")
            .set("queue.buffering.max.messages", "1000000")
            .create()?;
        let started = Instant::now();
        let upstream = TopicId::from_bytes([0x42; 16]);
        let key_space = (self.records / workload.keys_divisor).max(1);
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        // Records written so far per partition of the orders topic: positions start at 0,
        // one per record (a fresh topic, a non-transactional producer).
        let mut orders_written = vec![0i64; partitions as usize];
        let mut keys = std::collections::HashMap::<String, i64>::new();
        let mut pending = Vec::with_capacity(20_000);
        for i in 0..self.records {
            let key = if workload.keys_divisor == 1 {
                format!("order-{i:08}")
            } else {
                format!("order-{:08}", rng.next() as usize % key_space)
            };
            *keys.entry(key.clone()).or_default() += 1;
            let partition = partition_of(&key, partitions);
            let patch = workload.mix && i % 2 == 1;
            let mut pairs: Vec<(ChannelId, i64)> = (0..6u32)
                .map(|j| (ChannelId::new(upstream, (i as u32 + j * 5) % 16), (i / 4 + j as usize) as i64))
                .collect();
            if patch && orders_written[partition as usize] > 0 {
                pairs.push((ChannelId::new(orders_id, partition), orders_written[partition as usize] - 1));
            }
            let causes = CausalPast::from_pairs(pairs).encode();
            let payload = value(i, workload.value_bytes, patch, &mut rng);
            let topic = &topics[usize::from(patch)].0;
            if !patch {
                orders_written[partition as usize] += 1;
            }
            let record = FutureRecord::to(topic)
                .partition(partition as i32)
                .key(&key)
                .payload(&payload)
                .headers(OwnedHeaders::new().insert(Header { key: "parsley.causes", value: Some(&causes) }));
            pending.push(producer.send_result(record).map_err(|(e, _)| anyhow::anyhow!("enqueueing: {e}"))?);
            if pending.len() == 20_000 {
                for d in pending.drain(..) {
                    d.await.context("delivery canceled")?.map_err(|(e, _)| anyhow::anyhow!("producing: {e}"))?;
                }
            }
        }
        for d in pending {
            d.await.context("delivery canceled")?.map_err(|(e, _)| anyhow::anyhow!("producing: {e}"))?;
        }
        println!(
            "{:<14} {partitions:>5} produced {} records over {} keys to {} topic(s) in {:.1}s",
            workload.name,
            self.records,
            keys.len(),
            topics.len(),
            started.elapsed().as_secs_f64()
        );
        Ok(Produced { workload, partitions, topics, keys })
    }

    /// Launches `instances` processes of `binary` on the workload and measures them.
    async fn run_binary(&self, produced: &Produced, binary: &str, label: &str) -> anyhow::Result<Measured> {
        let database = self.create_database(label).await?;
        let url = with_database(&self.database_url, &database).map_err(anyhow::Error::msg)?;
        let model = format!("{label}-{}", produced.workload.name);
        let config = self.scratch.join(format!("{database}.toml"));
        std::fs::write(&config, self.config_file(produced, &model))?;
        // The schema first, as a deployment has it before a projector starts (the naive loop
        // also runs its migrations before its clock starts): `run` is timed, not `migrate`.
        let migrated = Command::new(binary)
            .args(["migrate", "--config"])
            .arg(&config)
            .env("PARSLEY_DATABASE_URL", &url)
            .stdout(Stdio::null())
            .status()
            .with_context(|| format!("running {binary} migrate"))?;
        if !migrated.success() {
            bail!("{binary} migrate failed: {migrated}");
        }
        let mut progress = Progress::connect(&url, &database).await?;
        let mut children = Vec::new();
        let started = Instant::now();
        for i in 0..self.instances {
            let log = std::fs::File::create(self.scratch.join(format!("{database}.{i}.log")))?;
            let child = Command::new(binary)
                .args(["run", "--config"])
                .arg(&config)
                .env("PARSLEY_DATABASE_URL", &url)
                .env("PARSLEY_OWNER", format!("bench-{i}"))
                .env("RUST_LOG", std::env::var("BENCH_LOG").unwrap_or_else(|_| "warn".to_string()))
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .with_context(|| format!("launching {binary}"))?;
            children.push(child);
        }
        let pids: Vec<u32> = children.iter().map(Child::id).collect();
        let outcome = progress
            .follow(self.records, started, &mut || {
                pids.iter().map(|p| cpu_ticks(*p).unwrap_or(0)).sum::<u64>() as f64 / TICKS_PER_SECOND
            })
            .await;
        for child in &mut children {
            stop(child);
        }
        let outcome = match outcome {
            Ok(mut m) => {
                progress.database_counters(&mut m).await;
                check(&url, &model, produced, self.records).await.map(|()| m)
            }
            Err(e) => Err(e),
        };
        if outcome.is_err() {
            eprintln!("  logs of the failed run: {}", self.scratch.join(format!("{database}.*.log")).display());
        }
        drop(progress);
        self.drop_database(&database).await?;
        outcome
    }

    fn config_file(&self, produced: &Produced, model: &str) -> String {
        let topics: Vec<String> = produced
            .topics
            .iter()
            .map(|(t, apply)| format!("{{ name = \"{t}\", apply = \"{}\" }}", apply_name(*apply)))
            .collect();
        format!(
            "[kafka]\nbootstrap = \"{}\"\n\n[projector]\nmetrics_address = \"\"\n\n[[models]]\nname = \"{model}\"\n\
             projection = \"documents\"\ninitial_position = \"earliest\"\n{}max_step_ms = 100\n\
             topics = [{}]\n",
            self.bootstrap,
            self.step.map_or(String::new(), |s| format!("max_step_records = {s}\n")),
            topics.join(", ")
        )
    }

    /// The naive loop's database, with the project's schema and the loop's offsets table:
    /// made before any clock starts (returns the database, its URL and the model).
    async fn naive_database(&self, label: &str, produced: &Produced) -> anyhow::Result<(String, String, String)> {
        let database = self.create_database(label).await?;
        let url = with_database(&self.database_url, &database).map_err(anyhow::Error::msg)?;
        let model = format!("{label}-{}", produced.workload.name);
        let pool = parsley_infra::pg::connect(&url, 1, Duration::from_secs(30)).await?;
        migrations::run(&pool).await?;
        sqlx::query(NAIVE_OFFSETS_TABLE).execute(&pool).await?;
        // The naive loop's writes are not a step's: the documents' edit trigger (which makes
        // a change outside a step notify every model) would cost it a NOTIFY per batch that
        // the projector does not pay. Off in its own database, so it pays nothing for it.
        sqlx::query("ALTER TABLE projection.documents DISABLE TRIGGER documents_edited").execute(&pool).await?;
        pool.close().await;
        Ok((database, url, model))
    }

    /// One consumer per partition, each applying its batches with the document projection
    /// and storing its offsets in the same transaction, in this process.
    async fn run_naive(&self, produced: &Produced) -> anyhow::Result<Measured> {
        let (database, url, model) = self.naive_database("naive", produced).await?;
        let pool = parsley_infra::pg::connect(&url, produced.partitions + 1, Duration::from_secs(30)).await?;
        let mut progress = Progress::connect(&url, &database).await?;
        let started = Instant::now();
        let own_cpu_at_start = cpu_ticks(std::process::id()).unwrap_or(0);
        let (stop, shutdown) = watch::channel(false);
        let spec = NaiveSpec {
            bootstrap: self.bootstrap.clone(),
            model: model.clone(),
            topics: produced.topics.clone(),
            partitions: produced.partitions,
            step: self.step.unwrap_or(DEFAULT_MAX_STEP_RECORDS),
        };
        let handles = spec.spawn(&pool, &shutdown)?;
        let outcome = progress
            .follow(self.records, started, &mut || {
                (cpu_ticks(std::process::id()).unwrap_or(0) - own_cpu_at_start) as f64 / TICKS_PER_SECOND
            })
            .await;
        stop.send(true)?;
        for h in handles {
            h.await??;
        }
        pool.close().await;
        self.naive_finish(outcome, progress, &database, &url, &model, produced).await
    }

    /// The naive loop in a process of its own, launched on the clock as the projector is.
    async fn run_naive_process(&self, produced: &Produced) -> anyhow::Result<Measured> {
        let (database, url, model) = self.naive_database("naive-proc", produced).await?;
        let mut progress = Progress::connect(&url, &database).await?;
        let topics: Vec<String> =
            produced.topics.iter().map(|(t, apply)| format!("{t}:{}", apply_name(*apply))).collect();
        let log = std::fs::File::create(self.scratch.join(format!("{database}.log")))?;
        let started = Instant::now();
        let mut child = Command::new(std::env::current_exe()?)
            .env(NAIVE_CHILD, "1")
            .env("NAIVE_DATABASE_URL", &url)
            .env("NAIVE_BOOTSTRAP", &self.bootstrap)
            .env("NAIVE_MODEL", &model)
            .env("NAIVE_TOPICS", topics.join(","))
            .env("NAIVE_PARTITIONS", produced.partitions.to_string())
            .env("NAIVE_STEP", self.step.unwrap_or(DEFAULT_MAX_STEP_RECORDS).to_string())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("launching the naive loop's process")?;
        let pid = child.id();
        let outcome =
            progress.follow(self.records, started, &mut || cpu_ticks(pid).unwrap_or(0) as f64 / TICKS_PER_SECOND).await;
        stop(&mut child);
        if outcome.is_err() {
            eprintln!("  log of the failed run: {}", self.scratch.join(format!("{database}.log")).display());
        }
        self.naive_finish(outcome, progress, &database, &url, &model, produced).await
    }

    /// A naive run's end: its counters, the check of its documents, its database dropped.
    async fn naive_finish(
        &self,
        outcome: anyhow::Result<Measured>,
        mut progress: Progress,
        database: &str,
        url: &str,
        model: &str,
        produced: &Produced,
    ) -> anyhow::Result<Measured> {
        let outcome = match outcome {
            Ok(mut m) => {
                progress.database_counters(&mut m).await;
                check(url, model, produced, self.records).await.map(|()| m)
            }
            Err(e) => Err(e),
        };
        drop(progress);
        self.drop_database(database).await?;
        outcome
    }
}

/// The naive loop's offsets, stored in each batch's transaction.
const NAIVE_OFFSETS_TABLE: &str = "CREATE TABLE public.bench_naive_offsets (
    model text NOT NULL, topic text NOT NULL, partition int NOT NULL, next_offset bigint NOT NULL,
    PRIMARY KEY (model, topic, partition))";

/// A topic's apply rule as the configuration names it (`topics[].apply`).
fn apply_name(apply: Apply) -> &'static str {
    match apply {
        Apply::Replace => "replace",
        Apply::Merge => "merge",
    }
}

/// Set in the environment of the naive loop's own process (`naive-proc`).
const NAIVE_CHILD: &str = "BENCH_NAIVE_CHILD";

/// What the naive loop runs on: one consumer per partition of the topics.
struct NaiveSpec {
    bootstrap: String,
    model: String,
    topics: Vec<(String, Apply)>,
    partitions: u32,
    step: usize,
}

impl NaiveSpec {
    /// From the environment the benchmark launched the naive loop's process with.
    fn from_env() -> anyhow::Result<NaiveSpec> {
        let var = |name: &str| std::env::var(name).with_context(|| format!("{name} is not set"));
        let topics = var("NAIVE_TOPICS")?
            .split(',')
            .map(|t| {
                let named = t.rsplit_once(':').and_then(|(name, rule)| {
                    [Apply::Replace, Apply::Merge]
                        .into_iter()
                        .find(|a| apply_name(*a) == rule)
                        .map(|a| (name.to_string(), a))
                });
                named.with_context(|| format!("NAIVE_TOPICS: {t:?} is not name:replace or name:merge"))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(NaiveSpec {
            bootstrap: var("NAIVE_BOOTSTRAP")?,
            model: var("NAIVE_MODEL")?,
            topics,
            partitions: var("NAIVE_PARTITIONS")?.parse().context("NAIVE_PARTITIONS")?,
            step: var("NAIVE_STEP")?.parse().context("NAIVE_STEP")?,
        })
    }

    /// A consumer per partition, assigned from the start, each with its loop.
    fn spawn(
        &self,
        pool: &sqlx::PgPool,
        shutdown: &watch::Receiver<bool>,
    ) -> anyhow::Result<Vec<tokio::task::JoinHandle<anyhow::Result<()>>>> {
        let mut config = Config::parse("")?;
        config.kafka.bootstrap = self.bootstrap.clone();
        let mut handles = Vec::new();
        for partition in 0..self.partitions {
            let consumer: StreamConsumer = kafka::consumer_config(&config.kafka, &self.model).create()?;
            let mut tpl = TopicPartitionList::new();
            for (topic, _) in &self.topics {
                tpl.add_partition_offset(topic, partition as i32, Offset::Offset(0))?;
            }
            consumer.assign(&tpl)?;
            let (pool, model, topics, step) = (pool.clone(), self.model.clone(), self.topics.clone(), self.step);
            let shutdown = shutdown.clone();
            handles.push(tokio::spawn(async move {
                naive_loop(consumer, pool, model, topics, partition, step, shutdown).await
            }));
        }
        Ok(handles)
    }
}

/// The naive loop's own process (`naive-proc`): runs until SIGTERM.
fn naive_child() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async {
        let spec = NaiveSpec::from_env()?;
        let shutdown = parsley_infra::process::shutdown_on_signal(|| {});
        let url = std::env::var("NAIVE_DATABASE_URL").context("NAIVE_DATABASE_URL is not set")?;
        let pool = parsley_infra::pg::connect(&url, spec.partitions + 1, Duration::from_secs(30)).await?;
        for h in spec.spawn(&pool, &shutdown)? {
            h.await??;
        }
        pool.close().await;
        Ok(())
    })
}

async fn naive_loop(
    consumer: StreamConsumer,
    pool: sqlx::PgPool,
    model: String,
    topics: Vec<(String, Apply)>,
    partition: u32,
    step: usize,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let projection = DocumentProjection::new(topics.iter().cloned());
    let channels: Vec<ChannelId> =
        (0..topics.len()).map(|t| ChannelId::new(TopicId::from_bytes([0x11 + t as u8; 16]), partition)).collect();
    let no_causes = CausalPast::new();
    while !*shutdown.borrow() {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(100);
        let mut batch: Vec<(usize, Consumed)> = Vec::new();
        let mut bytes = 0;
        while batch.len() < step && bytes < DEFAULT_MAX_STEP_BYTES {
            // As the projector's steps: wait for a first record, then take only what is
            // already fetched (no linger).
            let received = if batch.is_empty() {
                tokio::time::timeout_at(deadline, consumer.recv()).await.ok()
            } else {
                received_now(consumer.recv()).await
            };
            match received {
                None => break,
                Some(Ok(m)) => {
                    let t = topics.iter().position(|(name, _)| name == rdkafka::Message::topic(&m)).unwrap_or(0);
                    let consumed = Consumed::from_message(&m);
                    bytes += consumed.weight();
                    batch.push((t, consumed));
                }
                Some(Err(e)) => bail!("consumer: {e}"),
            }
        }
        if batch.is_empty() {
            continue;
        }
        let mut next: Vec<Option<i64>> = vec![None; topics.len()];
        let views: Vec<Delivered<'_>> = batch
            .iter()
            .map(|(t, c)| {
                next[*t] = Some(c.offset + 1);
                Delivered {
                    topic: &topics[*t].0,
                    channel: channels[*t],
                    position: c.offset,
                    key: c.data.key.as_deref(),
                    value: c.data.value.as_deref(),
                    headers: &c.data.headers,
                    timestamp_ms: c.data.timestamp_ms,
                    causes: &no_causes,
                }
            })
            .collect();
        let mut tx = pool.begin().await?;
        projection.apply_batch(&mut tx, StepContext { model: &model, task: partition }, &views).await?;
        for (t, next) in next.iter().enumerate() {
            let Some(next) = next else { continue };
            sqlx::query(
                "INSERT INTO public.bench_naive_offsets (model, topic, partition, next_offset) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (model, topic, partition) DO UPDATE SET next_offset = EXCLUDED.next_offset",
            )
            .bind(&model)
            .bind(&topics[t].0)
            .bind(partition as i32)
            .bind(next)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
    }
    Ok(())
}

/// Sends SIGTERM and waits a little for a clean stop; kills after that.
fn stop(child: &mut Child) {
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    for _ in 0..100 {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Every record was applied exactly once: one document per key produced, none other, and
/// each document's version (the records applied to it; the workloads have no tombstones) is
/// the number of records produced with its key.
async fn check(url: &str, model: &str, produced: &Produced, records: usize) -> anyhow::Result<()> {
    let mut conn = PgConnection::connect(url).await?;
    let documents: Vec<(String, i64)> =
        sqlx::query_as("SELECT key, version FROM projection.documents WHERE model = $1")
            .bind(model)
            .fetch_all(&mut conn)
            .await?;
    let mut wrong = Vec::new();
    for (key, version) in &documents {
        match produced.keys.get(key) {
            Some(n) if n == version => {}
            Some(n) => wrong.push(format!("{key}: version {version}, {n} record(s) produced")),
            None => wrong.push(format!("{key}: a document for a key never produced")),
        }
    }
    let found: std::collections::HashSet<&str> = documents.iter().map(|(k, _)| k.as_str()).collect();
    let missing = produced.keys.keys().filter(|k| !found.contains(k.as_str())).count();
    let applied: i64 = documents.iter().map(|(_, v)| v).sum();
    anyhow::ensure!(
        wrong.is_empty() && missing == 0,
        "{model}: {} of {} keys applied wrongly, {missing} without a document ({applied} of {records} records applied); \
         first: {}",
        wrong.len(),
        produced.keys.len(),
        wrong.iter().take(3).cloned().collect::<Vec<_>>().join("; ")
    );
    Ok(())
}

/// Follows a run's progress from a connection of its own (left out of the CPU figures).
struct Progress {
    conn: PgConnection,
    database: String,
    excluded: Vec<u32>,
    cpu: PgCpu,
    /// Transactions this connection committed.
    queries: i64,
}

impl Progress {
    async fn connect(url: &str, database: &str) -> anyhow::Result<Progress> {
        let mut conn = PgConnection::connect(url).await?;
        let own: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut conn).await?;
        let excluded = vec![own as u32];
        let cpu = PgCpu::start(database, excluded.clone());
        Ok(Progress { conn, database: database.to_string(), excluded, cpu, queries: 1 })
    }

    /// Records done: delivered and committed by a projector (read and not held), or
    /// committed by the naive loop. 0 until the schema exists.
    async fn done(&mut self) -> i64 {
        let sql = "SELECT coalesce((SELECT sum(fed_up_to + 1) FROM parsley.channels), 0)::int8
                        - (SELECT count(*) FROM parsley.held)
                        + coalesce((SELECT sum(next_offset) FROM public.bench_naive_offsets), 0)::int8";
        let naive_only = "SELECT coalesce(sum(next_offset), 0)::int8 FROM public.bench_naive_offsets";
        let projector_only = "SELECT coalesce((SELECT sum(fed_up_to + 1) FROM parsley.channels), 0)::int8
                                   - (SELECT count(*) FROM parsley.held)";
        for q in [sql, naive_only, projector_only] {
            if let Ok(n) = sqlx::query_scalar::<_, i64>(q).fetch_one(&mut self.conn).await {
                self.queries += 1;
                return n;
            }
        }
        0
    }

    /// Fills in the database's counters of `m`, once the run stopped (a backend reports
    /// its counters when it ends). Every query of this connection committed one transaction.
    async fn database_counters(&mut self, m: &mut Measured) {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let _: Result<_, _> = sqlx::query("SELECT pg_stat_clear_snapshot()").execute(&mut self.conn).await;
        self.queries += 1;
        let row: Result<(i64, i64, i64), _> = sqlx::query_as(
            "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted, sessions FROM pg_stat_database
             WHERE datname = current_database()",
        )
        .fetch_one(&mut self.conn)
        .await;
        self.queries += 1;
        if let Ok((commits, rows, sessions)) = row {
            m.commits = (commits - self.queries) as f64;
            m.rows_written = rows as f64;
            m.sessions = (sessions - 1) as f64;
        }
        let positions: Result<f64, _> = sqlx::query_scalar(
            "SELECT coalesce(sum(n_tup_ins + n_tup_upd), 0)::float8 FROM pg_stat_user_tables
             WHERE (schemaname, relname) IN (('parsley', 'channels'), ('public', 'bench_naive_offsets'))",
        )
        .fetch_one(&mut self.conn)
        .await;
        self.queries += 1;
        if let Ok(writes) = positions {
            m.position_writes = writes;
        }
    }

    async fn wal_lsn(&mut self) -> f64 {
        self.queries += 1;
        sqlx::query_scalar::<_, f64>("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::float8")
            .fetch_one(&mut self.conn)
            .await
            .unwrap_or(0.0)
    }

    /// Waits until `records` are done (at most 15 minutes); `client_cpu` reads the
    /// client's CPU seconds.
    async fn follow(
        &mut self,
        records: usize,
        started: Instant,
        client_cpu: &mut dyn FnMut() -> f64,
    ) -> anyhow::Result<Measured> {
        let this = self;
        let wal_at_start = this.wal_lsn().await;
        let (low, high) = (records as i64 / 10, records as i64 * 9 / 10);
        let mut at_low: Option<(Instant, i64, f64)> = None;
        let mut at_high: Option<(Instant, i64, f64)> = None;
        let mut first: Option<f64> = None;
        let mut timeline: Vec<(f64, i64)> = Vec::new();
        for polls in 0u64.. {
            let done = this.done().await;
            if timeline.last().is_none_or(|&(_, d)| d != done) {
                timeline.push((started.elapsed().as_secs_f64(), done));
            }
            if first.is_none() && done > 0 {
                first = Some(started.elapsed().as_secs_f64());
            }
            if at_low.is_none() && done >= low {
                at_low = Some((Instant::now(), done, this.cpu.seconds(&this.database, &this.excluded).0));
            }
            if at_high.is_none() && done >= high {
                at_high = Some((Instant::now(), done, this.cpu.seconds(&this.database, &this.excluded).0));
            }
            if done >= records as i64 {
                break;
            }
            if started.elapsed() > Duration::from_secs(900) {
                bail!("{done} of {records} records done after 15 minutes");
            }
            // A refused task never finishes: say why at once rather than after the 15 minutes.
            if polls % 40 == 39 {
                this.queries += 1;
                let refused: Option<String> = sqlx::query_scalar(
                    "SELECT refusal_reason || ': ' || coalesce(refusal_diagnosis, '') FROM parsley.tasks
                      WHERE status = 'refused' LIMIT 1",
                )
                .fetch_optional(&mut this.conn)
                .await
                .unwrap_or(None);
                if let Some(why) = refused {
                    bail!("{done} of {records} records done: a task refused, {why}");
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let seconds = started.elapsed().as_secs_f64();
        if std::env::var("BENCH_TIMELINE").is_ok() {
            let points: Vec<String> = timeline.iter().map(|(t, d)| format!("{t:.2}s:{}k", d / 1000)).collect();
            let launched = std::time::SystemTime::now() - started.elapsed();
            let unix = launched.duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64();
            println!(
                "  timeline (launched at unix {unix:.3}; seconds from launch: records committed): {}",
                points.join(" ")
            );
        }
        let (db_cpu, server_cpu) = this.cpu.seconds(&this.database, &this.excluded);
        let client_cpu = client_cpu();
        let wal_bytes = this.wal_lsn().await - wal_at_start;
        let ((t0, n0, c0), (t1, n1, c1)) = (at_low.expect("reached"), at_high.expect("reached"));
        let steady_records = (n1 - n0).max(1) as f64;
        Ok(Measured {
            seconds,
            first_seconds: first.unwrap_or(seconds),
            steady_per_s: steady_records / (t1 - t0).as_secs_f64().max(1e-3),
            db_cpu,
            db_cpu_steady: c1 - c0,
            steady_records,
            server_cpu,
            client_cpu,
            wal_bytes,
            commits: 0.0,
            rows_written: 0.0,
            position_writes: 0.0,
            sessions: 0.0,
        })
    }
}
