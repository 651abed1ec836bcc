//! Gateway latency against baselines run in the same process, interleaved round by round.
//!
//! Against the real broker and database (`make services-up`; `PARSLEY_KAFKA_BOOTSTRAP` and
//! `DATABASE_URL`), with the real projector running in-process for one model (one topic,
//! [`PARTITIONS`] partitions) and the gateway served by [`Gateway::serve`] on a port-0
//! listener, driven over loopback HTTP/1.1 by a minimal keep-alive client ([`Http`]: no
//! client crate for one request shape). No log subscriber is installed: logging costs are
//! not measured. Three measurements, each subject against its baseline; every round runs
//! each variant once, the order alternating (A B, B A, ...; the three read variants rotate)
//! so drift of the shared machine hits all alike:
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
//!    so writes do not arrive in phase with the projector's steps.
//!
//! Prints min/median/p90/p99 per variant and the ratios subject / baseline (of the medians,
//! p90s and p99s, and the median of the per-round ratios). Absolute times on a shared machine
//! are noise; the ratios are the result. Not a timed test: run it with
//! `cargo bench -p parsley-gateway --bench latency`. Environment: `BENCH_READS` (rounds,
//! default 5000), `BENCH_WRITES` (default 1000), `BENCH_VISIBLE` (default 300),
//! `BENCH_WARMUP` (rounds discarded before each, default 20), `BENCH_STEP_MS` (the model's
//! `max_step_ms`, default the configuration's default).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use parsley::codec::CAUSES_HEADER;
use parsley_gateway::session::unix_now;
use parsley_gateway::token::{self, KeyRing, SecretKey, TokenLimits};
use parsley_gateway::{Gateway, GatewayConfig, SESSION_HEADER};
use parsley_projector::config::Config;
use parsley_projector::metrics::{Metrics, METRICS};
use parsley_projector::{migrations, DocumentProjection, ModelProjector};
use parsley_testkit::{create_topics, delete_topic, unique};
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use rdkafka::{Message as _, Offset, TopicPartitionList};
use serde_json::{json, Value};
use sqlx::{PgPool, Row as _};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const PARTITIONS: i32 = 4;
/// Long enough that a write-to-visible read never answers 503 on this machine.
const READ_WAIT_MS: u64 = 10_000;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not, and should not run a
    // measurement against the services.
    if !std::env::args().any(|a| a == "--bench") {
        println!("latency: a benchmark; run it with `cargo bench -p parsley-gateway --bench latency`");
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
    // Checked before anything else: the helpers below panic on a missing variable.
    let bootstrap = parsley_infra::env::kafka_bootstrap()?;
    let database_url = parsley_infra::env::database_url()?;
    let plan = Plan {
        reads: env_usize("BENCH_READS", 5000).max(1),
        writes: env_usize("BENCH_WRITES", 1000).max(1),
        visible: env_usize("BENCH_VISIBLE", 300).max(1),
        warmup: env_usize("BENCH_WARMUP", 20),
    };

    let run = unique("gwbench");
    let topic = format!("{run}.events");
    let raw_topic = format!("{run}.raw");
    create_topics(&[&topic, &raw_topic], PARTITIONS).await;

    // The model as a configuration file declares it: the configuration's defaults apply.
    let step = std::env::var("BENCH_STEP_MS").map(|v| format!("max_step_ms = {v}\n")).unwrap_or_default();
    let mut config = Config::parse(&format!(
        "[gateway]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"\"\nread_wait_ms = {READ_WAIT_MS}\n\n\
         [[models]]\nname = \"{run}\"\n{step}topics = [{{ name = \"{topic}\" }}]\n"
    ))?;
    config.kafka.bootstrap = bootstrap.clone();
    config.database.url = Some(database_url.clone().into());
    config.projector.owner = Some(unique("owner"));
    config.projector.metrics_address = String::new();
    config.validate()?;

    // The projector, on its own pool (it runs the migrations).
    let projector_pool = parsley_infra::pg::connect(&database_url, 4, Duration::from_secs(30)).await?;
    migrations::run(&projector_pool).await?;
    let model = &config.models[0];
    let projector = ModelProjector::start(
        &config,
        model,
        projector_pool.clone(),
        Arc::new(DocumentProjection::from_model(model)),
        Metrics::new(METRICS),
    )
    .await
    .context("starting the projector")?;
    ensure!(projector.refusal().is_none(), "the model was refused: {:?}", projector.refusal());
    let (stop_projector, projector_shutdown) = watch::channel(false);
    let projector_task = tokio::spawn(projector.run(projector_shutdown));

    // The gateway, served for real on a port-0 listener.
    let ring = KeyRing::new(vec![("bench".to_string(), SecretKey::from_bytes([0x5a; 32]))])?;
    let gateway = Gateway::new(GatewayConfig::with_keys(config.clone(), ring.clone())?)?;
    let state = gateway.state().clone();
    let listener = gateway.bind().await?;
    let gateway_address = listener.local_addr()?;
    let (stop_gateway, gateway_shutdown) = watch::channel(false);
    let gateway_task = tokio::spawn(gateway.serve(listener, gateway_shutdown));

    // The plain handler: the same SELECT on the gateway's pool, behind axum alone.
    let plain = Router::new().route("/plain/{model}/{key}", get(plain_read)).with_state(state.pool.clone());
    let plain_listener = TcpListener::bind("127.0.0.1:0").await?;
    let plain_address = plain_listener.local_addr()?;
    let mut plain_stop = stop_gateway.subscribe();
    let plain_task = tokio::spawn(async move {
        axum::serve(plain_listener, plain)
            .with_graceful_shutdown(async move {
                let _ = plain_stop.wait_for(|s| *s).await;
            })
            .await
    });

    sqlx::query("CREATE TABLE IF NOT EXISTS public.bench_gateway_commits (run text NOT NULL, n bigint NOT NULL)")
        .execute(&state.pool)
        .await?;

    let producer: FutureProducer = parsley_infra::kafka::producer_config(&bootstrap)
        .set("message.timeout.ms", state.config.settings.produce_timeout_ms.to_string())
        .create()
        .context("creating the baseline producer")?;
    let bench = Bench {
        run: run.clone(),
        model: run.clone(),
        topic: topic.clone(),
        raw_topic: raw_topic.clone(),
        pool: state.pool.clone(),
        producer,
        produce_timeout: state.config.settings.produce_timeout(),
        ring,
        gateway: Http::connect(gateway_address).await?,
        plain: Http::connect(plain_address).await?,
        token: None,
    };
    println!(
        "gateway latency: {PARTITIONS} partitions, max_step_ms {}, {} CPUs; rounds: reads {}, writes {}, visible {} (+{} warm-up each)",
        config.models[0].max_step_ms,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        plan.reads,
        plan.writes,
        plan.visible,
        plan.warmup,
    );
    let result = measure(bench, &plan, &config).await;

    let _ = stop_gateway.send(true);
    let _ = stop_projector.send(true);
    gateway_task.await?.context("the gateway failed")?;
    plain_task.await?.context("the plain server failed")?;
    projector_task.await?.context("the projector failed")?;
    sqlx::query("DELETE FROM public.bench_gateway_commits WHERE run = $1").bind(&run).execute(&projector_pool).await?;
    delete_topic(&topic).await;
    delete_topic(&raw_topic).await;
    result
}

async fn plain_read(
    State(pool): State<PgPool>,
    Path((model, key)): Path<(String, String)>,
) -> Result<Json<Value>, StatusCode> {
    let row = select_document(&pool, &model, &key).await.map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let (doc, version) = row.ok_or(StatusCode::NOT_FOUND)?;
    Ok(Json(json!({"key": key, "document": doc, "version": version})))
}

/// The row the gateway's single-key read serves, without the gate's transaction.
async fn select_document(pool: &PgPool, model: &str, key: &str) -> sqlx::Result<Option<(Value, i64)>> {
    let row = sqlx::query("SELECT doc, version FROM projection.documents WHERE model = $1 AND key = $2")
        .bind(model)
        .bind(key)
        .fetch_optional(pool)
        .await?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

/// What the rounds share.
struct Bench {
    run: String,
    model: String,
    topic: String,
    raw_topic: String,
    pool: PgPool,
    /// The baseline producer: the gateway's settings.
    producer: FutureProducer,
    produce_timeout: Duration,
    ring: KeyRing,
    gateway: Http,
    plain: Http,
    /// The client's session token.
    token: Option<String>,
}

async fn measure(mut b: Bench, plan: &Plan, config: &Config) -> anyhow::Result<()> {
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

async fn read_rounds(b: &mut Bench, plan: &Plan) -> anyhow::Result<Reads> {
    println!("read overhead: writing one document and waiting until it is visible...");
    let key = "r-0";
    let written = b.post(key, &json!({"n": 0, "status": "placed"})).await?;
    b.token = Some(written);
    let first = b.get(key).await?;
    ensure!(first.status == 200, "the first gated read answered {}: {}", first.status, first.text());
    b.token = first.token;
    let gateway_path = format!("/v1/models/{}/documents/{key}", b.model);
    let plain_path = format!("/plain/{}/{key}", b.model);

    let mut out = Reads { select: Vec::new(), plain_http: Vec::new(), gateway: Vec::new() };
    for round in 0..plan.warmup + plan.reads {
        let mut times = [Duration::ZERO; 3];
        // Rotate the order of the three variants from round to round.
        for k in 0..3 {
            let variant = (round + k) % 3;
            let started = Instant::now();
            match variant {
                0 => {
                    let row = select_document(&b.pool, &b.model, key).await?;
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

async fn write_rounds(b: &mut Bench, plan: &Plan) -> anyhow::Result<Writes> {
    println!("write latency...");
    let mut out = Writes { bare: Vec::new(), gateway: Vec::new() };
    for round in 0..plan.warmup + plan.writes {
        let key = format!("w-{round}");
        let value = json!({"n": round, "status": "placed"});
        // The record the gateway will produce: the session's pairs as its causes.
        let causes = match &b.token {
            Some(t) => {
                let past = token::open(&b.ring, t, unix_now(), None, &TokenLimits::default())?.past;
                (!past.is_empty()).then(|| past.encode())
            }
            None => None,
        };
        let payload = serde_json::to_vec(&value)?;
        let (mut bare, mut gateway) = (Duration::ZERO, Duration::ZERO);
        for first in [true, false] {
            if first == (round % 2 == 0) {
                let started = Instant::now();
                b.produce(&b.topic, &key, &payload, causes.as_deref()).await?;
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
    retries: usize,
}

async fn visible_rounds(b: &mut Bench, plan: &Plan, config: &Config) -> anyhow::Result<Visible> {
    println!("write-to-visible...");
    // The projector's consumer settings; the raw topic is new, so reading from 0 sees only
    // this measurement's records.
    let consumer: StreamConsumer =
        parsley_projector::kafka::consumer_config(&config.kafka, &format!("{}-raw", b.run)).create()?;
    let mut assignment = TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        assignment.add_partition_offset(&b.raw_topic, partition, Offset::Offset(0))?;
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
        retries: 0,
    };
    for round in 0..plan.warmup + plan.visible {
        let key = format!("v-{round}");
        let value = json!({"n": round, "status": "placed"});
        let payload = serde_json::to_vec(&value)?;
        let mut baseline = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let mut gateway = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        tokio::time::sleep(jitter.below(window)).await;
        for first in [true, false] {
            if first == (round % 2 == 0) {
                // Baseline: produce, see it with a read-committed consumer, commit one row.
                let started = Instant::now();
                b.produce(&b.raw_topic, &key, &payload, None).await?;
                loop {
                    let m = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
                        .await
                        .context("the baseline consumer saw nothing for 30 s")??;
                    if m.key() == Some(key.as_bytes()) {
                        break;
                    }
                }
                let consumed = started.elapsed();
                let mut tx = b.pool.begin().await?;
                sqlx::query("INSERT INTO public.bench_gateway_commits (run, n) VALUES ($1, $2)")
                    .bind(&b.run)
                    .bind(round as i64)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                let total = started.elapsed();
                baseline = (consumed, total - consumed, total);
            } else {
                let started = Instant::now();
                b.token = Some(b.post(&key, &value).await?);
                let posted = started.elapsed();
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
                let total = started.elapsed();
                gateway = (posted, total - posted, total);
            }
        }
        if round >= plan.warmup {
            out.consume.push(baseline.0);
            out.commit.push(baseline.1);
            out.baseline.push(baseline.2);
            out.post.push(gateway.0);
            out.get.push(gateway.1);
            out.gateway.push(gateway.2);
        }
    }
    Ok(out)
}

impl Bench {
    /// Writes through the gateway; the new token.
    async fn post(&mut self, key: &str, value: &Value) -> anyhow::Result<String> {
        let body = serde_json::to_vec(&json!({"key": key, "value": value}))?;
        let path = format!("/v1/topics/{}/records", self.topic);
        let reply = self.gateway.send("POST", &path, self.token.as_deref(), Some(&body)).await?;
        ensure!(reply.status == 201, "the write answered {}: {}", reply.status, reply.text());
        reply.token.context("the write returned no token")
    }

    /// Reads `key` through the gateway with the session's token.
    async fn get(&mut self, key: &str) -> anyhow::Result<Reply> {
        let path = format!("/v1/models/{}/documents/{key}", self.model);
        self.gateway.send("GET", &path, self.token.as_deref(), None).await
    }

    /// A bare produce with the gateway's producer settings, awaiting the acknowledgement.
    async fn produce(&self, topic: &str, key: &str, payload: &[u8], causes: Option<&[u8]>) -> anyhow::Result<()> {
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).key(key.as_bytes()).payload(payload);
        if let Some(c) = causes {
            record = record.headers(OwnedHeaders::new().insert(Header { key: CAUSES_HEADER, value: Some(c) }));
        }
        self.producer
            .send(record, Timeout::After(self.produce_timeout))
            .await
            .map_err(|(e, _)| anyhow::anyhow!("producing to {topic}: {e}"))?;
        Ok(())
    }
}

/// One HTTP answer.
struct Reply {
    status: u16,
    token: Option<String>,
    body: Vec<u8>,
}

impl Reply {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// One keep-alive HTTP/1.1 connection: a request written in one piece, a response with a
/// `content-length` (what the gateway and axum send for these bodies). Enough for one
/// request shape without a client crate.
struct Http {
    stream: BufReader<TcpStream>,
    host: String,
    line: String,
}

impl Http {
    async fn connect(address: SocketAddr) -> anyhow::Result<Http> {
        let stream = TcpStream::connect(address).await.with_context(|| format!("connecting to {address}"))?;
        stream.set_nodelay(true)?;
        Ok(Http { stream: BufReader::new(stream), host: address.to_string(), line: String::new() })
    }

    async fn send(
        &mut self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&[u8]>,
    ) -> anyhow::Result<Reply> {
        let mut request = format!("{method} {path} HTTP/1.1\r\nhost: {}\r\n", self.host);
        if let Some(t) = token {
            request.push_str(&format!("{SESSION_HEADER}: {t}\r\n"));
        }
        if let Some(b) = body {
            request.push_str(&format!("content-type: application/json\r\ncontent-length: {}\r\n", b.len()));
        }
        request.push_str("\r\n");
        let mut request = request.into_bytes();
        request.extend_from_slice(body.unwrap_or_default());
        self.stream.get_mut().write_all(&request).await.context("sending a request")?;

        let status_line = self.read_line().await?;
        let status = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("bad status line {status_line:?}"))?;
        let (mut length, mut token) = (None, None);
        loop {
            let line = self.read_line().await?;
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').with_context(|| format!("bad header line {line:?}"))?;
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length = Some(value.parse::<usize>().context("bad content-length")?);
            } else if name.eq_ignore_ascii_case(SESSION_HEADER) {
                token = Some(value.to_string());
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                bail!("this client reads content-length bodies only, not transfer-encoding {value}");
            }
        }
        let mut body = vec![0; length.context("a response without content-length")?];
        self.stream.read_exact(&mut body).await.context("reading a response body")?;
        Ok(Reply { status, token, body })
    }

    /// One header line without its line end.
    async fn read_line(&mut self) -> anyhow::Result<String> {
        self.line.clear();
        if self.stream.read_line(&mut self.line).await.context("reading a response")? == 0 {
            bail!("the server closed the connection");
        }
        Ok(self.line.trim_end_matches(['\r', '\n']).to_string())
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

/// Order statistics of one variant (nearest rank).
struct Stats {
    min: Duration,
    median: Duration,
    p90: Duration,
    p99: Duration,
}

impl Stats {
    fn of(samples: &[Duration]) -> Stats {
        let mut sorted = samples.to_vec();
        sorted.sort();
        let rank = |p: f64| sorted[((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
        Stats { min: sorted[0], median: rank(0.5), p90: rank(0.9), p99: rank(0.99) }
    }
}

/// The median of the per-round ratios subject / baseline: drift between rounds cancels.
fn paired_median(subject: &[Duration], baseline: &[Duration]) -> f64 {
    let mut ratios: Vec<f64> =
        subject.iter().zip(baseline).map(|(s, b)| s.as_secs_f64() / b.as_secs_f64().max(1e-9)).collect();
    ratios.sort_by(f64::total_cmp);
    ratios[(ratios.len() - 1) / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
