//! Gateway throughput and latency under load against baselines run in the same process,
//! interleaved slice by slice.
//!
//! Against the real broker and database (`make services-up`; `PARSLEY_KAFKA_BOOTSTRAP` and
//! `DATABASE_URL`), with the real projector running in-process for one model and the
//! gateway served on a port-0 listener (the stack of [`support::Stack`], shared with the
//! latency benchmark). N clients (each one keep-alive HTTP/1.1 connection to the gateway
//! and one to the plain server; N from `BENCH_LOAD_CONNS`, default 1, 16 and 64) issue
//! requests back to back for a slice of time, then the baseline's clients do the same, the
//! order alternating from round to round (A B, B A, ...) so drift of the shared machine hits
//! both alike. Three workloads, each subject against its baseline:
//!
//! 1. **Covered single-key reads**: a gated `GET` whose token covers an already-applied
//!    write against a plain axum handler doing the same `SELECT` on the gateway's pool.
//! 2. **Collection pages of 100**: the gated first page against the plain handler doing
//!    the same keyset `SELECT` (101 rows, to know whether another page follows).
//! 3. **Writes**: `POST /v1/topics/{topic}/records` (each client its own session, its token
//!    chained from write to write) against a bare produce of the same record (key, value
//!    bytes, the client's session as the `parsley.causes` header) with the gateway's
//!    producer settings, awaiting the acknowledgement. Both go to the model's topic, so the
//!    projector applies both alike.
//! 5. **Covered single-key reads with a JWT** (`auth`): the read of 1. through a second
//!    gateway that authenticates callers (an RS256 JWT on every request, its JWKS from a
//!    file, one rule allowing the read) against the same read through the open gateway: what
//!    authentication and authorization cost a read.
//! 4. **Covered reads while the documents change** (`mixed`): each client reads the
//!    documents in turn (all of them, not one key), gated against the plain handler, while a
//!    writer updates those documents at `BENCH_LOAD_WRITE_RATE` records per second (default
//!    100, bare produce, during both sides' slices) — so the projector steps all along, and a
//!    gateway keeping snapshots (`BENCH_READ_CACHE_BYTES`) sees them dropped by each step of
//!    their key's owner.
//!
//! Prints per workload and connection count the requests per second and the median and p99
//! latency of each side, and the ratios subject / baseline. Absolute numbers on a shared
//! machine are noise, and the clients share the machine with everything they measure; the
//! ratios are the result. Not a timed test: run it with
//! `cargo bench -p parsley-gateway --bench load`. Environment: `BENCH_LOAD_CONNS`
//! (comma-separated connection counts, default `1,16,64`), `BENCH_LOAD_ROUNDS` (slices per
//! side, default 3), `BENCH_LOAD_SLICE_MS` (one slice, default 1000; a warm-up slice of a
//! fifth of it per side comes first), `BENCH_LOAD_WORKLOADS` (comma-separated, of `read`,
//! `page`, `write`, `mixed` and `auth`; default all five), `BENCH_READ_CACHE_BYTES` (the gateway's
//! `read_cache_bytes`, default the gateway's own; 0: off), `BENCH_LOAD_ONLY` (`subject` or `baseline`:
//! measure one side only, to profile it; its ratios are then meaningless). The defaults
//! take about a minute.

// Shared by the benchmarks, each of which uses a part of it.
#[allow(dead_code)]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use parsley_gateway::metrics::Metric;
use parsley_gateway::session::unix_now;
use parsley_gateway::token::{self, KeyRing, TokenLimits};
use rdkafka::producer::FutureProducer;
use serde_json::{json, Value};

use support::{env_usize, ms, Http, Stack, Stats, PARTITIONS};

/// Documents written before measuring, more than a page.
const DOCUMENTS: usize = 120;
/// The page size measured.
const PAGE: u32 = 100;

fn main() -> anyhow::Result<()> {
    if !support::run_as_benchmark("load") {
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(bench())
}

struct Plan {
    conns: Vec<usize>,
    /// Documents updated a second during the `mixed` workload.
    write_rate: usize,
    rounds: usize,
    slice: Duration,
    sides: Sides,
}

/// Which sides a run measures.
#[derive(Clone, Copy)]
enum Sides {
    Both,
    Subject,
    Baseline,
}

impl Sides {
    fn runs(self, subject: bool) -> bool {
        match self {
            Sides::Both => true,
            Sides::Subject => subject,
            Sides::Baseline => !subject,
        }
    }
}

/// One kind of request, of the gateway or of a baseline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    GatewayRead,
    PlainRead,
    GatewayPage,
    PlainPage,
    GatewayWrite,
    BareProduce,
    /// Reads of every document in turn.
    GatewayReadAny,
    PlainReadAny,
    /// A covered single-key read through the authenticating gateway, a JWT on every request.
    AuthenticatedRead,
}

/// The workloads: name, subject, baseline.
const WORKLOADS: [(&str, Op, Op); 5] = [
    ("covered single-key read", Op::GatewayRead, Op::PlainRead),
    ("collection page of 100", Op::GatewayPage, Op::PlainPage),
    ("write", Op::GatewayWrite, Op::BareProduce),
    ("covered reads, documents changing", Op::GatewayReadAny, Op::PlainReadAny),
    ("covered single-key read, JWT vs open", Op::AuthenticatedRead, Op::GatewayRead),
];

async fn bench() -> anyhow::Result<()> {
    let conns = std::env::var("BENCH_LOAD_CONNS").unwrap_or_else(|_| "1,16,64".into());
    let plan = Plan {
        conns: conns.split(',').map(|c| c.trim().parse::<usize>().map(|n| n.max(1))).collect::<Result<_, _>>()?,
        rounds: env_usize("BENCH_LOAD_ROUNDS", 3).max(1),
        write_rate: env_usize("BENCH_LOAD_WRITE_RATE", 100),
        slice: Duration::from_millis(env_usize("BENCH_LOAD_SLICE_MS", 1000).max(10) as u64),
        sides: match std::env::var("BENCH_LOAD_ONLY").as_deref() {
            Err(_) | Ok("") => Sides::Both,
            Ok("subject") => Sides::Subject,
            Ok("baseline") => Sides::Baseline,
            Ok(other) => anyhow::bail!("BENCH_LOAD_ONLY is {other:?}: subject or baseline, or unset for both"),
        },
    };
    let stack = Stack::start("gwload", "").await?;
    println!(
        "gateway load: {PARTITIONS} partitions, {} CPUs; connections {:?}, {} slice(s) of {} ms per side",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        plan.conns,
        plan.rounds,
        plan.slice.as_millis(),
    );
    let result = measure(&stack, &plan).await;
    stack.stop().await?;
    result
}

/// What every client needs to issue requests.
struct Target {
    document: String,
    plain_document: String,
    /// Every document's path, gateway and plain.
    documents: Vec<(String, String)>,
    page: String,
    plain_page: String,
    records: String,
    topic: String,
    producer: FutureProducer,
    produce_timeout: Duration,
    ring: KeyRing,
    /// The authenticating gateway's address and a JWT it accepts.
    authenticated: (std::net::SocketAddr, String),
}

async fn measure(stack: &Stack, plan: &Plan) -> anyhow::Result<()> {
    println!("writing {DOCUMENTS} documents and waiting until they are visible...");
    let mut setup = Http::connect(stack.gateway_address).await?;
    let mut token: Option<String> = None;
    for n in 0..DOCUMENTS {
        let body = serde_json::to_vec(&json!({"key": document_key(n), "value": {"n": n, "status": "placed"}}))?;
        let reply = setup.send("POST", &stack.records_path(), token.as_deref(), Some(&body)).await?;
        ensure!(reply.status == 201, "a setup write answered {}: {}", reply.status, reply.text());
        token = reply.token;
    }
    let reply = setup.send("GET", &stack.page_path(PAGE), token.as_deref(), None).await?;
    ensure!(reply.status == 200, "the first page answered {}: {}", reply.status, reply.text());
    let page: Value = serde_json::from_slice(&reply.body)?;
    ensure!(page["documents"].as_array().map(Vec::len) == Some(PAGE as usize), "the first page is short: {page}");
    let token = reply.token.context("the page returned no token")?;
    let authenticated = stack.start_authenticated_gateway().await?;

    let target = Arc::new(Target {
        document: stack.document_path("d-0000"),
        plain_document: stack.plain_document_path("d-0000"),
        documents: (0..DOCUMENTS)
            .map(|n| (stack.document_path(&document_key(n)), stack.plain_document_path(&document_key(n))))
            .collect(),
        page: stack.page_path(PAGE),
        plain_page: stack.plain_page_path(PAGE),
        records: stack.records_path(),
        topic: stack.topic.clone(),
        producer: stack.producer.clone(),
        produce_timeout: stack.produce_timeout,
        ring: stack.ring.clone(),
        authenticated,
    });
    let mut rows = Vec::new();
    let only = std::env::var("BENCH_LOAD_WORKLOADS").unwrap_or_else(|_| "read,page,write,mixed,auth".into());
    let only: Vec<&str> = only.split(',').map(str::trim).collect();
    for (workload, subject, baseline) in WORKLOADS {
        let short = match subject {
            Op::GatewayRead => "read",
            Op::GatewayPage => "page",
            Op::GatewayReadAny => "mixed",
            Op::AuthenticatedRead => "auth",
            _ => "write",
        };
        if !only.contains(&short) {
            continue;
        }
        // The documents change while both sides read them.
        let (stop_writer, writer) = if subject == Op::GatewayReadAny {
            let (stop, stopped) = tokio::sync::watch::channel(false);
            (Some(stop), Some(tokio::spawn(update_documents(Arc::clone(&target), plan.write_rate, stopped))))
        } else {
            (None, None)
        };
        for &n in &plan.conns {
            println!("{workload}, {n} connection(s)...");
            let mut clients = Vec::with_capacity(n);
            for id in 0..n {
                // Readers share the covered token; writers each start a session of their own.
                let token = (subject != Op::GatewayWrite).then(|| token.clone());
                clients.push(Client::connect(stack, id, Arc::clone(&target), token).await?);
            }
            for op in [subject, baseline] {
                clients = run_slice(clients, op, plan.slice / 5).await?.0;
            }
            let (mut s, mut b) = (Totals::default(), Totals::default());
            let mut paired = Vec::with_capacity(plan.rounds);
            for round in 0..plan.rounds {
                let order = if round % 2 == 0 { [subject, baseline] } else { [baseline, subject] };
                let mut rates = [None, None];
                for op in order.into_iter().filter(|op| plan.sides.runs(*op == subject)) {
                    let (back, slice) = run_slice(clients, op, plan.slice).await?;
                    clients = back;
                    rates[usize::from(op != subject)] = Some(slice.requests as f64 / slice.elapsed.as_secs_f64());
                    if op == subject { &mut s } else { &mut b }.add(slice);
                }
                if let [Some(subject_rate), Some(baseline_rate)] = rates {
                    paired.push(subject_rate / baseline_rate);
                }
            }
            rows.push(Row { workload, conns: n, subject: s, baseline: b, paired });
            let kept = |result| {
                let labels = [("model", stack.model.as_str()), ("result", result)];
                stack.state.metrics.value(Metric::ReadCacheTotal, &labels).unwrap_or(0.0)
            };
            let (hits, misses) = (kept("hit"), kept("miss"));
            if hits + misses > 0.0 {
                println!("  kept snapshots so far: {hits} reads served from memory, {misses} read and kept");
            }
        }
        if let (Some(stop), Some(writer)) = (stop_writer, writer) {
            stop.send_replace(true);
            let updates = writer.await??;
            println!("  ({updates} documents updated meanwhile)");
        }
    }
    print_rows(&rows);
    Ok(())
}

fn document_key(n: usize) -> String {
    format!("d-{n:04}")
}

/// Updates the documents in turn, `rate` a second (bare produce, awaiting each
/// acknowledgement), until `stop`; returns how many it updated.
async fn update_documents(
    target: Arc<Target>,
    rate: usize,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<usize> {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1) as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n = 0;
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return Ok(n),
            _ = tick.tick() => {}
        }
        let payload = serde_json::to_vec(&json!({"n": n, "status": "updated"}))?;
        let key = document_key(n % DOCUMENTS);
        support::produce(&target.producer, target.produce_timeout, &target.topic, &key, &payload, None).await?;
        n += 1;
    }
}

/// One client: a connection to the gateway, one to the plain server, one to the
/// authenticating gateway, its sessions (the authenticating gateway binds its own to the
/// JWT's subject).
struct Client {
    id: usize,
    gateway: Http,
    plain: Http,
    authenticated: Http,
    token: Option<String>,
    authenticated_token: Option<String>,
    /// The session's pairs as a `parsley.causes` value, for the bare produce.
    causes: Option<Vec<u8>>,
    writes: usize,
    /// Reads made, for reading the documents in turn.
    reads: usize,
    target: Arc<Target>,
}

impl Client {
    async fn connect(stack: &Stack, id: usize, target: Arc<Target>, token: Option<String>) -> anyhow::Result<Client> {
        let mut authenticated = Http::connect(target.authenticated.0).await?;
        authenticated.authorization = Some(target.authenticated.1.clone());
        Ok(Client {
            id,
            gateway: Http::connect(stack.gateway_address).await?,
            plain: Http::connect(stack.plain_address).await?,
            authenticated,
            authenticated_token: token.clone(),
            token,
            causes: None,
            writes: 0,
            reads: 0,
            target,
        })
    }

    /// Readies the client for a slice of `op`: a bare produce stamps the session the
    /// gateway would (its pairs as they are now).
    fn prepare(&mut self, op: Op) -> anyhow::Result<()> {
        if op == Op::BareProduce {
            self.causes = match &self.token {
                Some(t) => {
                    let past = token::open(&self.target.ring, t, unix_now(), None, &TokenLimits::default())?.past;
                    (!past.is_empty()).then(|| past.encode())
                }
                None => None,
            };
        }
        Ok(())
    }

    async fn request(&mut self, op: Op) -> anyhow::Result<()> {
        let t = Arc::clone(&self.target);
        match op {
            Op::GatewayRead | Op::GatewayPage => {
                let path = if op == Op::GatewayRead { &t.document } else { &t.page };
                let reply = self.gateway.send("GET", path, self.token.as_deref(), None).await?;
                ensure!(reply.status == 200, "the gated read answered {}: {}", reply.status, reply.text());
                self.token = reply.token;
            }
            Op::AuthenticatedRead => {
                let reply =
                    self.authenticated.send("GET", &t.document, self.authenticated_token.as_deref(), None).await?;
                ensure!(reply.status == 200, "the authenticated read answered {}: {}", reply.status, reply.text());
                self.authenticated_token = reply.token;
            }
            Op::GatewayReadAny | Op::PlainReadAny => {
                // Each client starts at a document of its own.
                let (gated, plain) = &t.documents[(self.id * 7 + self.reads) % t.documents.len()];
                self.reads += 1;
                if op == Op::GatewayReadAny {
                    let reply = self.gateway.send("GET", gated, self.token.as_deref(), None).await?;
                    ensure!(reply.status == 200, "the gated read answered {}: {}", reply.status, reply.text());
                    self.token = reply.token;
                } else {
                    let reply = self.plain.send("GET", plain, None, None).await?;
                    ensure!(reply.status == 200, "the plain handler answered {}: {}", reply.status, reply.text());
                }
            }
            Op::PlainRead | Op::PlainPage => {
                let path = if op == Op::PlainRead { &t.plain_document } else { &t.plain_page };
                let reply = self.plain.send("GET", path, None, None).await?;
                ensure!(reply.status == 200, "the plain handler answered {}: {}", reply.status, reply.text());
            }
            Op::GatewayWrite | Op::BareProduce => {
                let key = format!("w-{}-{}", self.id, self.writes);
                let value = json!({"n": self.writes, "status": "placed"});
                self.writes += 1;
                if op == Op::GatewayWrite {
                    let body = serde_json::to_vec(&json!({"key": key, "value": value}))?;
                    let reply = self.gateway.send("POST", &t.records, self.token.as_deref(), Some(&body)).await?;
                    ensure!(reply.status == 201, "the write answered {}: {}", reply.status, reply.text());
                    self.token = reply.token;
                } else {
                    let payload = serde_json::to_vec(&value)?;
                    let causes = self.causes.as_deref();
                    support::produce(&t.producer, t.produce_timeout, &t.topic, &key, &payload, causes).await?;
                }
            }
        }
        Ok(())
    }
}

/// What one slice did.
struct Slice {
    requests: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    cpu: Cpu,
}

/// Every client issues `op` back to back until `length` has passed; the slice ends when
/// the last client's last request is answered. The clients come back for the next slice.
async fn run_slice(clients: Vec<Client>, op: Op, length: Duration) -> anyhow::Result<(Vec<Client>, Slice)> {
    let cpu_at_start = Cpu::now();
    let started = Instant::now();
    let until = started + length;
    let mut running = Vec::with_capacity(clients.len());
    for mut client in clients {
        running.push(tokio::spawn(async move {
            client.prepare(op)?;
            let mut latencies = Vec::new();
            while Instant::now() < until {
                let sent = Instant::now();
                client.request(op).await?;
                latencies.push(sent.elapsed());
            }
            Ok::<_, anyhow::Error>((client, latencies))
        }));
    }
    let mut clients = Vec::with_capacity(running.len());
    let mut latencies = Vec::new();
    for r in running {
        let (client, l) = r.await??;
        clients.push(client);
        latencies.extend(l);
    }
    let elapsed = started.elapsed();
    let cpu = Cpu::now().since(cpu_at_start);
    Ok((clients, Slice { requests: latencies.len(), elapsed, latencies, cpu }))
}

/// CPU ticks so far of this process (the gateway or the plain server, the clients, the
/// in-process projector, idle while reads run) and of every Postgres server process.
#[derive(Clone, Copy, Default)]
struct Cpu {
    process: u64,
    postgres: u64,
}

impl Cpu {
    fn now() -> Cpu {
        Cpu {
            process: parsley_testkit::cpu_ticks(std::process::id()).unwrap_or(0),
            postgres: parsley_testkit::postgres_processes().iter().map(|p| p.2).sum(),
        }
    }

    /// What was spent since `start` (a Postgres process that ended meanwhile is not counted).
    fn since(self, start: Cpu) -> Cpu {
        Cpu {
            process: self.process.saturating_sub(start.process),
            postgres: self.postgres.saturating_sub(start.postgres),
        }
    }
}

/// One side's slices, summed.
#[derive(Default)]
struct Totals {
    requests: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    cpu: Cpu,
}

impl Totals {
    fn add(&mut self, s: Slice) {
        self.requests += s.requests;
        self.elapsed += s.elapsed;
        self.latencies.extend(s.latencies);
        self.cpu.process += s.cpu.process;
        self.cpu.postgres += s.cpu.postgres;
    }

    /// CPU microseconds per request: (this process, Postgres).
    fn cpu_per_request(&self) -> (f64, f64) {
        let per = |ticks: u64| ticks as f64 / parsley_testkit::TICKS_PER_SECOND * 1e6 / self.requests.max(1) as f64;
        (per(self.cpu.process), per(self.cpu.postgres))
    }

    fn per_second(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
}

struct Row {
    workload: &'static str,
    conns: usize,
    subject: Totals,
    baseline: Totals,
    /// Each round's throughput ratio, subject / baseline (the two slices run back to back).
    paired: Vec<f64>,
}

impl Row {
    /// The median of the rounds' throughput ratios (NaN when one side was not measured): less
    /// moved by one slow slice than the ratio of the totals.
    fn paired_median(&self) -> f64 {
        let mut r = self.paired.clone();
        if r.is_empty() {
            return f64::NAN;
        }
        r.sort_by(f64::total_cmp);
        let mid = r.len() / 2;
        if r.len() % 2 == 1 {
            r[mid]
        } else {
            (r[mid - 1] + r[mid]) / 2.0
        }
    }
}

fn print_rows(rows: &[Row]) {
    println!();
    println!("subject: the gateway; baseline: the plain axum handler (reads, pages) or a bare produce (writes)");
    println!(
        "{:<24} {:>5} | {:>9} {:>8} {:>8} | {:>9} {:>8} {:>8} | {:>7} {:>7} {:>7} {:>7}",
        "workload", "conns", "req/s", "p50 ms", "p99 ms", "base r/s", "p50 ms", "p99 ms", "thr", "p50", "p99", "paired"
    );
    for r in rows {
        let (s, b) = (Stats::of(&r.subject.latencies), Stats::of(&r.baseline.latencies));
        println!(
            "{:<24} {:>5} | {:>9.0} {:>8.3} {:>8.3} | {:>9.0} {:>8.3} {:>8.3} | {:>7.2} {:>7.2} {:>7.2} {:>7.2}",
            r.workload,
            r.conns,
            r.subject.per_second(),
            ms(s.median),
            ms(s.p99),
            r.baseline.per_second(),
            ms(b.median),
            ms(b.p99),
            r.subject.per_second() / r.baseline.per_second(),
            s.median.as_secs_f64() / b.median.as_secs_f64(),
            s.p99.as_secs_f64() / b.p99.as_secs_f64(),
            r.paired_median(),
        );
    }
    println!(
        "thr: subject / baseline requests per second; p50, p99: subject / baseline latency; \
         paired: the median of the rounds' throughput ratios"
    );
    println!();
    println!("CPU per request, microseconds: this process (server, clients, idle projector) and Postgres");
    println!(
        "{:<24} {:>5} | {:>9} {:>9} | {:>9} {:>9} | {:>7} {:>7}",
        "workload", "conns", "process", "postgres", "base proc", "base pg", "proc", "pg"
    );
    for r in rows {
        let (sp, sg) = r.subject.cpu_per_request();
        let (bp, bg) = r.baseline.cpu_per_request();
        println!(
            "{:<24} {:>5} | {:>9.1} {:>9.1} | {:>9.1} {:>9.1} | {:>7.2} {:>7.2}",
            r.workload,
            r.conns,
            sp,
            sg,
            bp,
            bg,
            sp / bp.max(f64::MIN_POSITIVE),
            sg / bg.max(f64::MIN_POSITIVE)
        );
    }
    println!(
        "proc, pg: subject / baseline CPU per request (ticks of 10 ms from /proc: use slices of a second or more)"
    );
}
