//! Gateway latency against baselines run in the same process, interleaved round by round.
//!
//! Against the real broker and database (`make services-up`; `PARSLEY_KAFKA_BOOTSTRAP` and
//! `DATABASE_URL`), with the real projector running in-process for one model (one topic,
//! [`PARTITIONS`] partitions) and the gateway served on a port-0 listener ([`Stack`]),
//! driven over loopback HTTP/1.1 by a minimal keep-alive client ([`Http`]: no client crate
//! for one request shape). No log subscriber is installed, only the recorder of the
//! `parsley::stage` events: logging costs are not measured. Three measurements, each
//! subject against its baseline; every round runs each variant once, the order alternating
//! (A B, B A, ...; the three read variants rotate) so drift of the shared machine hits all
//! alike:
//!
//! 1. **Read overhead**: a gated single-key `GET` whose token covers an already-applied
//!    write (no waiting) against the same row read by a plain `SELECT` on the gateway's pool,
//!    and by a plain axum handler doing that `SELECT` over HTTP (no gate, no middleware) —
//!    the second separates the HTTP cost from the gate's.
//! 2. **Write latency**: `POST /v1/topics/{topic}/records` against a bare produce of the same
//!    record (key, value bytes and the `parsley.causes` header the gateway stamped) with the
//!    gateway's producer settings (idempotent, `acks=all`), awaiting the acknowledgement.
//!    Both go to the model's topic, so the projector applies both alike.
//! 3. **Write-to-visible**: a `POST` then at once a gated `GET` with the new token (the
//!    gateway waits for the projector, woken by `NOTIFY`) until it returns the write, against
//!    a bare produce to an unprojected topic seen by a read-committed consumer with the
//!    projector's consumer settings, followed by one trivial `INSERT` + `COMMIT`. Each
//!    round starts after a random pause within the projector's step window (`max_step_ms`),
//!    so writes do not arrive in phase with the projector's steps. The gateway's time is
//!    split into stages by the `parsley::stage` events of the projector and the gateway
//!    ([`STAGES`]): the POST, the projector's consume, the step's linger, its transaction,
//!    the `NOTIFY`'s delivery, the shared clock fetch that wakes the read, and the read.
//!
//! Prints min/median/p90/p99 per variant and the ratios subject / baseline (of the medians,
//! p90s and p99s, and the median of the per-round ratios). Absolute times on a shared machine
//! are noise; the ratios are the result. Not a timed test: run it with
//! `cargo bench -p parsley-gateway --bench latency`. Environment: `BENCH_READS` (rounds,
//! default 5000), `BENCH_WRITES` (default 1000), `BENCH_VISIBLE` (default 300),
//! `BENCH_WARMUP` (rounds discarded before each, default 20), `BENCH_STEP_MS` and
//! `BENCH_STEP_LINGER_MS` (the model's `max_step_ms` and `step_linger_ms`, default the
//! configuration's defaults).

// Shared by the benchmarks, each of which uses a part of it.
#[allow(dead_code)]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use parsley_gateway::session::unix_now;
use parsley_gateway::token::{self, TokenLimits};
use parsley_settings::config::Config;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::{Message as _, Offset, TopicPartitionList};
use serde_json::{json, Value};

use support::stages::Recorder;
use support::{env_usize, ms, select_document, Http, Reply, Stack, Stats, PARTITIONS};

fn main() -> anyhow::Result<()> {
    if !support::run_as_benchmark("latency") {
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(bench())
}

/// Rounds per measurement.
struct Plan {
    reads: usize,
    writes: usize,
    visible: usize,
    warmup: usize,
}

async fn bench() -> anyhow::Result<()> {
    let plan = Plan {
        reads: env_usize("BENCH_READS", 5000).max(1),
        writes: env_usize("BENCH_WRITES", 1000).max(1),
        visible: env_usize("BENCH_VISIBLE", 300).max(1),
        warmup: env_usize("BENCH_WARMUP", 20),
    };
    let recorder = Recorder::install()?;

    // The model as a configuration file declares it: the configuration's defaults apply
    // but for what the environment sets.
    let mut settings = String::new();
    for (variable, setting) in [("BENCH_STEP_MS", "max_step_ms"), ("BENCH_STEP_LINGER_MS", "step_linger_ms")] {
        if let Ok(v) = std::env::var(variable) {
            settings.push_str(&format!("{setting} = {v}\n"));
        }
    }
    let stack = Stack::start("gwbench", &settings).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS public.bench_gateway_commits (run text NOT NULL, n bigint NOT NULL)")
        .execute(&stack.pool)
        .await?;
    let bench = Bench {
        gateway: Http::connect(stack.gateway_address).await?,
        plain: Http::connect(stack.plain_address).await?,
        stack: &stack,
        recorder,
        token: None,
    };
    let model = &stack.config.models[0];
    println!(
        "gateway latency: {PARTITIONS} partitions, max_step_ms {}, step_linger_ms {}, {} CPUs; rounds: reads {}, writes {}, visible {} (+{} warm-up each)",
        model.max_step_ms,
        model.step_linger_ms,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        plan.reads,
        plan.writes,
        plan.visible,
        plan.warmup,
    );
    let result = measure(bench, &plan, &stack.config).await;

    sqlx::query("DELETE FROM public.bench_gateway_commits WHERE run = $1")
        .bind(&stack.run)
        .execute(&stack.pool)
        .await?;
    stack.stop().await?;
    result
}

/// What the rounds share.
struct Bench<'a> {
    stack: &'a Stack,
    recorder: Arc<Recorder>,
    gateway: Http,
    plain: Http,
    /// The client's session token.
    token: Option<String>,
}

async fn measure(mut b: Bench<'_>, plan: &Plan, config: &Config) -> anyhow::Result<()> {
    let reads = read_rounds(&mut b, plan).await?;
    let writes = write_rounds(&mut b, plan).await?;
    let visible = visible_rounds(&mut b, plan, config).await?;

    println!();
    println!("{:<48} {:>6} {:>9} {:>9} {:>9} {:>9}", "latency (ms)", "n", "min", "median", "p90", "p99");
    for (name, samples) in [
        ("read: plain SELECT (same pool)", &reads.select),
        ("read: plain axum handler, same SELECT (HTTP)", &reads.plain_http),
        ("read: gateway gated GET (HTTP)", &reads.gateway),
        ("write: bare produce, acks=all", &writes.bare),
        ("write: gateway POST (HTTP)", &writes.gateway),
        ("visible: produce -> read_committed consume", &visible.consume),
        ("visible: INSERT + COMMIT", &visible.commit),
        ("visible: baseline (consume + commit, chained)", &visible.baseline),
        ("visible: gateway POST -> gated GET returns it", &visible.gateway),
        ("visible:   of which the POST", &visible.post),
        ("visible:   of which the GET (waits for it)", &visible.get),
    ] {
        let s = Stats::of(samples);
        println!(
            "{name:<48} {:>6} {:>9.3} {:>9.3} {:>9.3} {:>9.3}",
            samples.len(),
            ms(s.min),
            ms(s.median),
            ms(s.p90),
            ms(s.p99)
        );
    }
    println!();
    println!("{:<48} {:>9} {:>9} {:>9} {:>12}", "ratio subject / baseline", "median", "p90", "p99", "paired med.");
    for (name, subject, baseline) in [
        ("read: gateway / plain SELECT", &reads.gateway, &reads.select),
        ("read: gateway / plain HTTP handler (gate cost)", &reads.gateway, &reads.plain_http),
        ("read: plain HTTP handler / plain SELECT (HTTP)", &reads.plain_http, &reads.select),
        ("write: gateway POST / bare produce", &writes.gateway, &writes.bare),
        ("visible: gateway / (produce->consume + commit)", &visible.gateway, &visible.baseline),
    ] {
        let (s, base) = (Stats::of(subject), Stats::of(baseline));
        println!(
            "{name:<48} {:>9.2} {:>9.2} {:>9.2} {:>12.2}",
            s.median.as_secs_f64() / base.median.as_secs_f64(),
            s.p90.as_secs_f64() / base.p90.as_secs_f64(),
            s.p99.as_secs_f64() / base.p99.as_secs_f64(),
            paired_median(subject, baseline),
        );
    }
    if !visible.stages.is_empty() {
        println!();
        println!(
            "{:<48} {:>9} {:>9} {:>9}   ({} of {} rounds missed a stage event: zero)",
            "visible: gateway stages (ms)",
            "median",
            "mean",
            "p90",
            visible.incomplete,
            visible.stages.len(),
        );
        for (i, (name, _)) in STAGES.iter().enumerate() {
            let times: Vec<Duration> = visible.stages.iter().map(|s| s[i]).collect();
            let s = Stats::of(&times);
            let mean = times.iter().sum::<Duration>() / times.len() as u32;
            println!("{name:<48} {:>9.3} {:>9.3} {:>9.3}", ms(s.median), ms(mean), ms(s.p90));
        }
    }
    if visible.retries > 0 {
        println!("visible: {} gated GET(s) answered 503 and were retried", visible.retries);
    }
    Ok(())
}

struct Reads {
    select: Vec<Duration>,
    plain_http: Vec<Duration>,
    gateway: Vec<Duration>,
}

async fn read_rounds(b: &mut Bench<'_>, plan: &Plan) -> anyhow::Result<Reads> {
    println!("read overhead: writing one document and waiting until it is visible...");
    let key = "r-0";
    let written = b.post(key, &json!({"n": 0, "status": "placed"})).await?;
    b.token = Some(written);
    let first = b.get(key).await?;
    ensure!(first.status == 200, "the first gated read answered {}: {}", first.status, first.text());
    b.token = first.token;
    let gateway_path = b.stack.document_path(key);
    let plain_path = b.stack.plain_document_path(key);

    let mut out = Reads { select: Vec::new(), plain_http: Vec::new(), gateway: Vec::new() };
    for round in 0..plan.warmup + plan.reads {
        let mut times = [Duration::ZERO; 3];
        // Rotate the order of the three variants from round to round.
        for k in 0..3 {
            let variant = (round + k) % 3;
            let started = Instant::now();
            match variant {
                0 => {
                    let row = select_document(&b.stack.pool, &b.stack.model, key).await?;
                    times[0] = started.elapsed();
                    ensure!(row.is_some(), "the plain SELECT found no row");
                }
                1 => {
                    let reply = b.plain.send("GET", &plain_path, None, None).await?;
                    times[1] = started.elapsed();
                    ensure!(reply.status == 200, "the plain handler answered {}: {}", reply.status, reply.text());
                }
                _ => {
                    let reply = b.gateway.send("GET", &gateway_path, b.token.as_deref(), None).await?;
                    times[2] = started.elapsed();
                    ensure!(reply.status == 200, "the gated read answered {}: {}", reply.status, reply.text());
                    b.token = reply.token;
                }
            }
        }
        if round >= plan.warmup {
            out.select.push(times[0]);
            out.plain_http.push(times[1]);
            out.gateway.push(times[2]);
        }
    }
    Ok(out)
}

struct Writes {
    bare: Vec<Duration>,
    gateway: Vec<Duration>,
}

async fn write_rounds(b: &mut Bench<'_>, plan: &Plan) -> anyhow::Result<Writes> {
    println!("write latency...");
    let mut out = Writes { bare: Vec::new(), gateway: Vec::new() };
    for round in 0..plan.warmup + plan.writes {
        let key = format!("w-{round}");
        let value = json!({"n": round, "status": "placed"});
        // The record the gateway will produce: the session's pairs as its causes.
        let causes = match &b.token {
            Some(t) => {
                let past = token::open(&b.stack.ring, t, unix_now(), None, &TokenLimits::default())?.past;
                (!past.is_empty()).then(|| past.encode())
            }
            None => None,
        };
        let payload = serde_json::to_vec(&value)?;
        let (mut bare, mut gateway) = (Duration::ZERO, Duration::ZERO);
        for first in [true, false] {
            if first == (round % 2 == 0) {
                let started = Instant::now();
                b.stack.produce(&b.stack.topic, &key, &payload, causes.as_deref()).await?;
                bare = started.elapsed();
            } else {
                let started = Instant::now();
                let token = b.post(&key, &value).await?;
                gateway = started.elapsed();
                b.token = Some(token);
            }
        }
        if round >= plan.warmup {
            out.bare.push(bare);
            out.gateway.push(gateway);
        }
    }
    Ok(out)
}

struct Visible {
    consume: Vec<Duration>,
    commit: Vec<Duration>,
    baseline: Vec<Duration>,
    gateway: Vec<Duration>,
    post: Vec<Duration>,
    get: Vec<Duration>,
    /// Per round, the time each of [`STAGES`] took.
    stages: Vec<[Duration; STAGES.len()]>,
    /// Rounds in which a stage event was missing (e.g. the read was covered at its first
    /// attempt, so no shared clock fetch woke it).
    incomplete: usize,
    retries: usize,
}

/// The stages of the gateway's write-to-visible, each ending at a point of the timeline:
/// its name, and the `parsley::stage` event that ends it with the stage whose end that event
/// follows (`None`: the client sees the end: the POST's answer, then the GET's).
const STAGES: [(&str, Option<(&str, usize)>); 7] = [
    ("POST answered (produce ack)", None),
    ("projector consume (first record polled)", Some(("first-record", 0))),
    ("step linger (poll ended)", Some(("polled", 1))),
    ("step transaction (committed)", Some(("committed", 2))),
    // The listener may hear the NOTIFY before the projector hears its COMMIT answered.
    ("NOTIFY delivery (listener heard it)", Some(("notified", 2))),
    // A shared clock fetch, or (few reads waiting) a direct wake-up: either event.
    ("wake-up (clock fetched or woken)", Some(("clock-fetched|woken", 4))),
    ("re-check and read (GET answered)", None),
];

/// The stage times of one round, from the POST's start, its answer, the stage events
/// recorded meanwhile and the GET's answer, and whether every event was seen. Each event is
/// the first of its name after the end of the stage it follows (the projector's consume may
/// begin before the POST's answer, so its event follows the POST's start). A stage that
/// ended before the previous one counts as zero, as does one whose event is missing (a read
/// covered at its first attempt waits for no clock fetch): the stages add up to the total.
fn timeline(
    started: Instant,
    posted: Instant,
    events: &[(Instant, String)],
    answered: Instant,
) -> ([Duration; STAGES.len()], bool) {
    let mut ends = [started; STAGES.len()];
    let mut complete = true;
    for (i, (_, event)) in STAGES.iter().enumerate() {
        ends[i] = match event {
            None if i == 0 => posted,
            None => answered,
            Some((name, follows)) => {
                let after = if *follows == 0 { started } else { ends[*follows] };
                let seen =
                    events.iter().find(|(at, e)| name.split('|').any(|n| n == e) && *at >= after).map(|(at, _)| *at);
                complete &= seen.is_some();
                seen.unwrap_or(ends[i - 1])
            }
        };
    }
    let mut out = [Duration::ZERO; STAGES.len()];
    let mut previous = started;
    for (i, end) in ends.into_iter().enumerate() {
        let end = end.max(previous);
        out[i] = end - previous;
        previous = end;
    }
    (out, complete)
}

async fn visible_rounds(b: &mut Bench<'_>, plan: &Plan, config: &Config) -> anyhow::Result<Visible> {
    println!("write-to-visible...");
    // The projector's consumer settings; the raw topic is new, so reading from 0 sees only
    // this measurement's records.
    let consumer: StreamConsumer =
        parsley_projector::kafka::consumer_config(&config.kafka, &format!("{}-raw", b.stack.run)).create()?;
    let mut assignment = TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        assignment.add_partition_offset(&b.stack.raw_topic, partition, Offset::Offset(0))?;
    }
    consumer.assign(&assignment)?;

    // Rounds follow one another at the pace of the projector's steps; a pseudo-random pause
    // (not timed) before each lands the writes at random points of the step window instead
    // of in phase with it.
    let window = Duration::from_millis(config.models[0].max_step_ms);
    let mut jitter = Jitter(u64::from(std::process::id()) | 1);
    let mut out = Visible {
        consume: Vec::new(),
        commit: Vec::new(),
        baseline: Vec::new(),
        gateway: Vec::new(),
        post: Vec::new(),
        get: Vec::new(),
        stages: Vec::new(),
        incomplete: 0,
        retries: 0,
    };
    for round in 0..plan.warmup + plan.visible {
        let key = format!("v-{round}");
        let value = json!({"n": round, "status": "placed"});
        let payload = serde_json::to_vec(&value)?;
        let mut baseline = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let mut gateway = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let mut stages = ([Duration::ZERO; STAGES.len()], true);
        tokio::time::sleep(jitter.below(window)).await;
        for first in [true, false] {
            if first == (round % 2 == 0) {
                // Baseline: produce, see it with a read-committed consumer, commit one row.
                let started = Instant::now();
                b.stack.produce(&b.stack.raw_topic, &key, &payload, None).await?;
                loop {
                    let m = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
                        .await
                        .context("the baseline consumer saw nothing for 30 s")??;
                    if m.key() == Some(key.as_bytes()) {
                        break;
                    }
                }
                let consumed = started.elapsed();
                let mut tx = b.stack.pool.begin().await?;
                sqlx::query("INSERT INTO public.bench_gateway_commits (run, n) VALUES ($1, $2)")
                    .bind(&b.stack.run)
                    .bind(round as i64)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                let total = started.elapsed();
                baseline = (consumed, total - consumed, total);
            } else {
                b.recorder.start();
                let started = Instant::now();
                b.token = Some(b.post(&key, &value).await?);
                let posted_at = Instant::now();
                let posted = posted_at - started;
                loop {
                    let reply = b.get(&key).await?;
                    match reply.status {
                        200 => {
                            let body: Value = serde_json::from_slice(&reply.body)?;
                            ensure!(body["document"]["n"] == json!(round), "the gated read served {body}");
                            b.token = reply.token;
                            break;
                        }
                        503 => out.retries += 1,
                        status => bail!("the gated read answered {status}: {}", reply.text()),
                    }
                }
                let answered_at = Instant::now();
                let total = answered_at - started;
                gateway = (posted, total - posted, total);
                stages = timeline(started, posted_at, &b.recorder.stop(), answered_at);
            }
        }
        if round >= plan.warmup {
            out.consume.push(baseline.0);
            out.commit.push(baseline.1);
            out.baseline.push(baseline.2);
            out.post.push(gateway.0);
            out.get.push(gateway.1);
            out.gateway.push(gateway.2);
            out.stages.push(stages.0);
            out.incomplete += usize::from(!stages.1);
        }
    }
    Ok(out)
}

impl Bench<'_> {
    /// Writes through the gateway; the new token.
    async fn post(&mut self, key: &str, value: &Value) -> anyhow::Result<String> {
        let body = serde_json::to_vec(&json!({"key": key, "value": value}))?;
        let path = self.stack.records_path();
        let reply = self.gateway.send("POST", &path, self.token.as_deref(), Some(&body)).await?;
        ensure!(reply.status == 201, "the write answered {}: {}", reply.status, reply.text());
        reply.token.context("the write returned no token")
    }

    /// Reads `key` through the gateway with the session's token.
    async fn get(&mut self, key: &str) -> anyhow::Result<Reply> {
        let path = self.stack.document_path(key);
        self.gateway.send("GET", &path, self.token.as_deref(), None).await
    }
}

/// Xorshift: pauses spread over a window, no random-number crate needed.
struct Jitter(u64);

impl Jitter {
    fn below(&mut self, bound: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        bound.mul_f64((self.0 % 1_000_000) as f64 / 1e6)
    }
}

/// The median of the per-round ratios subject / baseline: drift between rounds cancels.
fn paired_median(subject: &[Duration], baseline: &[Duration]) -> f64 {
    let mut ratios: Vec<f64> =
        subject.iter().zip(baseline).map(|(s, b)| s.as_secs_f64() / b.as_secs_f64().max(1e-9)).collect();
    ratios.sort_by(f64::total_cmp);
    ratios[(ratios.len() - 1) / 2]
}
