//! Shared test machinery: the services from the environment (a clear failure when they are
//! missing), unique names, topics, producers, a model configuration, a recording projection
//! that logs every committed delivery in the step's transaction, and a step driver.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parsley::channel::{ChannelId, TopicId};
use parsley::CausalPast;
use parsley_projector::metrics::{Metrics, METRICS};
use parsley_projector::projection::{Delivered, Projection, ProjectionError, StepContext};
use parsley_projector::{DocumentProjection, ModelProjector};
use parsley_settings::config::{Apply, Config, InitialPosition, ModelConfig, TopicConfig};
use parsley_store::migrations;
use parsley_store::status::{model_report, ModelReport};
pub use parsley_testkit::{
    admin, admin_options, bootstrap, create_topics, database_url, delete_records, delete_topic, produce, producer,
    transactional_producer, unique, TIMEOUT,
};
use sqlx::{PgConnection, PgPool, Row as _};

/// A pool on the test database, with the schema migrated and the test log table present.
pub async fn pool() -> PgPool {
    let pool = parsley_infra::pg::connect(&database_url(), 6, TIMEOUT).await.unwrap_or_else(|e| panic!("{e:#}"));
    migrations::run(&pool).await.unwrap_or_else(|e| panic!("{e:#}"));
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(4242)").execute(&mut *tx).await.unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS public.test_applied (
           seq bigserial PRIMARY KEY, model text NOT NULL, task int NOT NULL, topic text NOT NULL,
           partition int NOT NULL, position bigint NOT NULL)",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    pool
}

/// The topic ID of `name` as the broker reports it now.
pub async fn topic_id(name: &str) -> TopicId {
    let d = parsley_infra::describe_topics(&bootstrap(), &[name.to_string()], TIMEOUT).await.unwrap();
    TopicId::from_bytes(d[0].id)
}

/// A key starting with `base` that murmur2 (the topics' default partitioner) places on
/// `partition` of `partitions`: keyed records on another partition are refused
/// `KEY_PARTITION_MISMATCH`.
pub fn key_on(base: &str, partition: u32, partitions: u32) -> String {
    let placed = |k: &String| parsley::murmur2::partition_for_key(k.as_bytes(), partitions) == partition;
    std::iter::once(base.to_string()).chain((0..).map(|i| format!("{base}.{i}"))).find(placed).unwrap()
}

pub fn causes(pairs: &[(TopicId, u32, i64)]) -> Vec<u8> {
    CausalPast::from_pairs(pairs.iter().map(|(t, p, o)| (ChannelId::new(*t, *p), *o))).encode()
}

/// A configuration with one model receiving `topics` (name, apply), for the test services,
/// with short step bounds and backoff.
pub fn config(model: &str, topics: &[(&str, Apply)]) -> Config {
    let mut c = Config::parse("").unwrap();
    c.kafka.bootstrap = bootstrap();
    c.database.url = Some(database_url().into());
    c.projector.owner = Some(unique("owner"));
    c.projector.metrics_address = String::new();
    c.projector.initial_backoff_ms = 50;
    c.projector.max_backoff_ms = 400;
    c.models.push(ModelConfig {
        name: model.to_string(),
        projection: parsley_settings::config::DOCUMENTS_PROJECTION.to_string(),
        migrations: None,
        options: Default::default(),
        queries: Vec::new(),
        topics: topics.iter().map(|(n, a)| TopicConfig { apply: *a, ..TopicConfig::named(*n) }).collect(),
        initial_position: InitialPosition::Earliest,
        max_step_records: 500,
        max_step_bytes: parsley_settings::config::DEFAULT_MAX_STEP_BYTES,
        max_step_ms: 150,
        step_linger_ms: 5,
        tasks: None,
        on_rejected: Default::default(),
        max_held_records: 100_000,
        max_held_bytes: 256 * 1024 * 1024,
    });
    c.validate().unwrap();
    c
}

/// The document projection, logging every delivery it applies into `test_applied` in the
/// same transaction (so the log holds exactly the committed deliveries), and able to hang
/// forever in a step — a crash between the projection's writes and the commit.
#[derive(Clone)]
pub struct Recording {
    pub inner: DocumentProjection,
    pub hang: Arc<AtomicBool>,
}

impl Recording {
    pub fn new(config: &Config) -> Arc<Recording> {
        Arc::new(Recording {
            inner: DocumentProjection::from_model(&config.models[0]),
            hang: Arc::new(AtomicBool::new(false)),
        })
    }
}

impl Projection for Recording {
    async fn apply(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        record: &Delivered<'_>,
    ) -> Result<(), ProjectionError> {
        self.apply_batch(conn, step, std::slice::from_ref(record)).await
    }

    async fn apply_batch(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        records: &[Delivered<'_>],
    ) -> Result<(), ProjectionError> {
        self.inner.apply_batch(conn, step, records).await?;
        for r in records {
            sqlx::query(
                "INSERT INTO public.test_applied (model, task, topic, partition, position) VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(step.model)
            .bind(step.task as i32)
            .bind(r.topic)
            .bind(r.channel.partition as i32)
            .bind(r.position)
            .execute(&mut *conn)
            .await?;
        }
        if self.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

pub async fn start<P: Projection>(config: &Config, pool: &PgPool, projection: Arc<P>) -> ModelProjector<P> {
    start_with_metrics(config, pool, projection, Metrics::new(METRICS)).await
}

/// [`start`], recording into `metrics` (for tests that read them).
pub async fn start_with_metrics<P: Projection>(
    config: &Config,
    pool: &PgPool,
    projection: Arc<P>,
    metrics: Arc<Metrics>,
) -> ModelProjector<P> {
    ModelProjector::start(config, &config.models[0], pool.clone(), projection, metrics)
        .await
        .unwrap_or_else(|e| panic!("starting the projector: {e:#}"))
}

/// Steps every task until `done` holds (checked after each round) or the timeout passes.
pub async fn drive_until<P, F, Fut>(projector: &mut ModelProjector<P>, what: &str, mut done: F)
where
    P: Projection,
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + TIMEOUT;
    loop {
        projector.run_once().await;
        if done().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
    }
}

/// Steps every task `rounds` times.
pub async fn drive<P: Projection>(projector: &mut ModelProjector<P>, rounds: usize) {
    for _ in 0..rounds {
        projector.run_once().await;
    }
}

pub async fn report(pool: &PgPool, model: &str) -> ModelReport {
    let mut conn = pool.acquire().await.unwrap();
    model_report(&mut conn, model).await.unwrap().expect("the model has state")
}

/// The document of `key`, if any.
pub async fn document(pool: &PgPool, model: &str, key: &str) -> Option<(serde_json::Value, i64)> {
    sqlx::query("SELECT doc, version FROM projection.documents WHERE model = $1 AND key = $2")
        .bind(model)
        .bind(key)
        .fetch_optional(pool)
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1)))
}

/// The committed deliveries of a model in delivery order: (topic, partition, position).
pub async fn applied(pool: &PgPool, model: &str) -> Vec<(String, i32, i64)> {
    sqlx::query("SELECT topic, partition, position FROM public.test_applied WHERE model = $1 ORDER BY seq")
        .bind(model)
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// Fresh names for a model with an orders and a payments topic.
pub struct Names {
    pub model: String,
    pub orders: String,
    pub payments: String,
}

impl Names {
    pub fn new(prefix: &str) -> Names {
        let base = unique(prefix);
        Names { model: base.clone(), orders: format!("{base}.orders"), payments: format!("{base}.payments") }
    }

    /// orders replace, payments merge.
    pub fn config(&self) -> Config {
        config(&self.model, &[(&self.orders, Apply::Replace), (&self.payments, Apply::Merge)])
    }
}

/// Steps every task for at least `span`.
pub async fn drive_for(projector: &mut ModelProjector<Recording>, span: std::time::Duration) {
    let until = Instant::now() + span;
    while Instant::now() < until {
        projector.run_once().await;
    }
}

/// A payment held behind its order, which sits in a Kafka transaction left open (one
/// partition each): returns the transactional producer (to commit or abort) and the order's
/// and the payment's positions.
pub async fn held_payment(n: &Names) -> (rdkafka::producer::FutureProducer, i64, i64) {
    create_topics(&[&n.orders, &n.payments], 1).await;
    let orders_id = topic_id(&n.orders).await;
    let txp = transactional_producer();
    rdkafka::producer::Producer::begin_transaction(&txp).unwrap();
    let order_at = produce(&txp, &n.orders, 0, "o1", Some(br#"{"status":"placed"}"#), None).await;
    let pay_at = produce(
        &producer(),
        &n.payments,
        0,
        "o1",
        Some(br#"{"paid":true}"#),
        Some(&causes(&[(orders_id, 0, order_at)])),
    )
    .await;
    (txp, order_at, pay_at)
}
