//! Projector throughput against a naive projector, in one harness on the same data.
//!
//! N small JSON records (each carrying a `parsley.causes` header naming an upstream
//! channel) are produced to one topic with 4 partitions. Then, each on its own model:
//! - `parsley`: the projector (4 tasks, causal gating, ordering state, clock rows, one
//!   transaction per step);
//! - `naive`: 4 consumers doing the same SQL — the document projection's batched upserts
//!   plus the consumed offset stored in the same transaction — with no causal gating and
//!   no ordering state;
//! - `per-row`: the naive loop, but one upsert statement per record.
//!
//! Each variant reads all N records from the start; the time is from start to the last
//! commit. Not a timed test: run it with
//! `cargo bench -p parsley-projector --bench throughput` (env: `BENCH_RECORDS`, default
//! 100000; `BENCH_STEP_RECORDS`, default 2000; `BENCH_SKIP_PER_ROW=1` to skip the slow one).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use parsley::channel::{ChannelId, TopicId};
use parsley::CausalPast;
use parsley_projector::config::{Apply, Config, InitialPosition, ModelConfig, TopicConfig};
use parsley_projector::metrics::{Metrics, METRICS};
use parsley_projector::projection::{Delivered, Projection, StepContext};
use parsley_projector::record::Consumed;
use parsley_projector::{kafka, migrations, DocumentProjection, ModelProjector};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::{PgPool, Row as _};
use tokio::sync::watch;

const PARTITIONS: u32 = 4;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not, and should not run
    // a multi-minute measurement against the services.
    if !std::env::args().any(|a| a == "--bench") {
        println!("throughput: a benchmark; run it with `cargo bench -p parsley-projector --bench throughput`");
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build()?;
    runtime.block_on(bench())
}

async fn bench() -> anyhow::Result<()> {
    let bootstrap = parsley_infra::env::kafka_bootstrap()?;
    let database_url = parsley_infra::env::database_url()?;
    let records = env_usize("BENCH_RECORDS", 100_000);
    let step = env_usize("BENCH_STEP_RECORDS", 2_000);
    let pool = parsley_infra::pg::connect(&database_url, 12, Duration::from_secs(30)).await?;
    migrations::run(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS public.bench_naive_offsets (
           model text NOT NULL, partition int NOT NULL, next_offset bigint NOT NULL, PRIMARY KEY (model, partition))",
    )
    .execute(&pool)
    .await?;

    let run = format!("bench-{}-{}", std::process::id(), rand_suffix());
    let topic = format!("{run}.events");
    let admin: AdminClient<DefaultClientContext> = parsley_infra::kafka::admin_config(&bootstrap).create()?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for r in admin.create_topics(&[NewTopic::new(&topic, PARTITIONS as i32, TopicReplication::Fixed(1))], &opts).await?
    {
        r.map_err(|(t, e)| anyhow::anyhow!("creating {t}: {e}"))?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    println!("producing {records} records to {topic} ({PARTITIONS} partitions)...");
    let produced = Instant::now();
    produce(&bootstrap, &topic, records).await?;
    println!("  produced in {:.1}s", produced.elapsed().as_secs_f64());

    let mut config = Config::parse("")?;
    config.kafka.bootstrap = bootstrap.clone();
    config.database.url = Some(database_url.into());
    config.projector.metrics_address = String::new();

    let naive = naive_run(&config, &pool, &topic, &format!("{run}-naive"), records, step, true).await?;
    let gated = parsley_run(&config, &pool, &topic, &format!("{run}-parsley"), records, step).await?;
    let per_row = if std::env::var("BENCH_SKIP_PER_ROW").is_ok() {
        None
    } else {
        Some(naive_run(&config, &pool, &topic, &format!("{run}-per-row"), records, step, false).await?)
    };

    println!();
    println!("records: {records}, partitions: {PARTITIONS}, step bound: {step} records / 100 ms");
    println!("naive (same SQL, no gating): {naive:>10.0} records/s");
    println!("parsley projector:           {gated:>10.0} records/s");
    println!("ratio parsley / naive:       {:>10.2}", gated / naive);
    if let Some(per_row) = per_row {
        println!("naive per-row upserts:       {per_row:>10.0} records/s");
        println!("ratio parsley / per-row:     {:>10.2}", gated / per_row);
    }
    Ok(())
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() % 1_000_000_000)
        .unwrap_or(0)
}

async fn produce(bootstrap: &str, topic: &str, records: usize) -> anyhow::Result<()> {
    let producer: FutureProducer = parsley_infra::kafka::producer_config(bootstrap)
        .set("linger.ms", "20")
        .set("batch.num.messages", "10000")
        .set("queue.buffering.max.messages", "1000000")
        .create()?;
    let upstream = TopicId::from_bytes([0x42; 16]);
    let mut pending = Vec::with_capacity(20_000);
    for i in 0..records {
        let key = format!("k{i}");
        let value = format!("{{\"n\":{i},\"status\":\"placed\"}}");
        let causes = CausalPast::from_pairs([(ChannelId::new(upstream, (i % 8) as u32), i as i64)]).encode();
        let record = FutureRecord::to(topic)
            .key(&key)
            .payload(&value)
            .headers(OwnedHeaders::new().insert(Header { key: "parsley.causes", value: Some(&causes) }));
        let delivery = producer.send_result(record).map_err(|(e, _)| anyhow::anyhow!("enqueueing: {e}"))?;
        pending.push(delivery);
        if pending.len() == 20_000 {
            for d in pending.drain(..) {
                d.await.context("delivery canceled")?.map_err(|(e, _)| anyhow::anyhow!("producing: {e}"))?;
            }
        }
    }
    for d in pending {
        d.await.context("delivery canceled")?.map_err(|(e, _)| anyhow::anyhow!("producing: {e}"))?;
    }
    Ok(())
}

fn model_config(name: &str, topic: &str, step: usize) -> ModelConfig {
    ModelConfig {
        name: name.to_string(),
        projection: Default::default(),
        topics: vec![TopicConfig { name: topic.to_string(), apply: Apply::Replace, initial_position: None }],
        initial_position: InitialPosition::Earliest,
        max_step_records: step,
        max_step_ms: 100,
        step_linger_ms: 5,
        tasks: None,
        on_rejected: Default::default(),
        max_held_records: 100_000,
        max_held_bytes: 256 * 1024 * 1024,
    }
}

async fn parsley_run(
    config: &Config,
    pool: &PgPool,
    topic: &str,
    model: &str,
    records: usize,
    step: usize,
) -> anyhow::Result<f64> {
    let mut config = config.clone();
    config.models = vec![model_config(model, topic, step)];
    let projection = Arc::new(DocumentProjection::from_model(&config.models[0]));
    let started = Instant::now();
    let projector =
        ModelProjector::start(&config, &config.models[0], pool.clone(), projection, Metrics::new(METRICS)).await?;
    let (stop, shutdown) = watch::channel(false);
    let running = tokio::spawn(projector.run(shutdown));
    wait_for(
        pool,
        "SELECT coalesce(sum(fed_up_to + 1), 0)::int8 FROM parsley.channels WHERE model = $1",
        model,
        records,
    )
    .await?;
    let elapsed = started.elapsed().as_secs_f64();
    stop.send(true)?;
    running.await??;
    let held: i64 =
        sqlx::query_scalar("SELECT count(*) FROM parsley.held WHERE model = $1").bind(model).fetch_one(pool).await?;
    anyhow::ensure!(held == 0, "records left held");
    println!("  parsley: {records} records in {elapsed:.1}s");
    Ok(records as f64 / elapsed)
}

async fn wait_for(pool: &PgPool, sql: &str, model: &str, records: usize) -> anyhow::Result<()> {
    loop {
        let done: i64 = sqlx::query(sql).bind(model).fetch_one(pool).await?.get(0);
        if done as usize >= records {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The naive projector: per partition, poll a batch, apply it with the document
/// projection (batched or per row), store the next offset, commit.
async fn naive_run(
    config: &Config,
    pool: &PgPool,
    topic: &str,
    model: &str,
    records: usize,
    step: usize,
    batched: bool,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut handles = Vec::new();
    let (stop, shutdown) = watch::channel(false);
    for partition in 0..PARTITIONS {
        let consumer: StreamConsumer = kafka::consumer_config(&config.kafka, model).create()?;
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, partition as i32, Offset::Offset(0))?;
        consumer.assign(&tpl)?;
        let pool = pool.clone();
        let (topic, model) = (topic.to_string(), model.to_string());
        let projection = DocumentProjection::new([(topic.clone(), Apply::Replace)]);
        let shutdown = shutdown.clone();
        handles.push(tokio::spawn(async move {
            let channel = ChannelId::new(TopicId::from_bytes([0x11; 16]), partition);
            let no_causes = CausalPast::new();
            while !*shutdown.borrow() {
                let deadline = tokio::time::Instant::now() + Duration::from_millis(100);
                let mut batch: Vec<Consumed> = Vec::new();
                while batch.len() < step {
                    match tokio::time::timeout_at(deadline, consumer.recv()).await {
                        Err(_) => break,
                        Ok(Ok(m)) => batch.push(Consumed::from_message(&m)),
                        Ok(Err(e)) => anyhow::bail!("consumer: {e}"),
                    }
                }
                let Some(last) = batch.last().map(|c| c.offset) else { continue };
                let views: Vec<Delivered<'_>> = batch
                    .iter()
                    .map(|c| Delivered {
                        topic: &topic,
                        channel,
                        position: c.offset,
                        key: c.data.key.as_deref(),
                        value: c.data.value.as_deref(),
                        headers: &c.data.headers,
                        timestamp_ms: c.data.timestamp_ms,
                        causes: &no_causes,
                    })
                    .collect();
                let ctx = StepContext { model: &model, task: partition };
                let mut tx = pool.begin().await?;
                if batched {
                    projection.apply_batch(&mut tx, ctx, &views).await?;
                } else {
                    for v in &views {
                        projection.apply(&mut tx, ctx, v).await?;
                    }
                }
                sqlx::query(
                    "INSERT INTO public.bench_naive_offsets (model, partition, next_offset) VALUES ($1, $2, $3)
                     ON CONFLICT (model, partition) DO UPDATE SET next_offset = EXCLUDED.next_offset",
                )
                .bind(&model)
                .bind(partition as i32)
                .bind(last + 1)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
            }
            Ok(())
        }));
    }
    wait_for(
        pool,
        "SELECT coalesce(sum(next_offset), 0)::int8 FROM public.bench_naive_offsets WHERE model = $1",
        model,
        records,
    )
    .await?;
    let elapsed = started.elapsed().as_secs_f64();
    stop.send(true)?;
    for h in handles {
        h.await??;
    }
    println!("  {}: {records} records in {elapsed:.1}s", if batched { "naive" } else { "per-row" });
    Ok(records as f64 / elapsed)
}
