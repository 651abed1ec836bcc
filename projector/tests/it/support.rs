//! Shared test machinery: the services from the environment (a clear failure when they are
//! missing), unique names, topics, producers, a model configuration, a recording projection
//! that logs every committed delivery in the step's transaction, and a step driver.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parsley::channel::{ChannelId, TopicId};
use parsley::CausalPast;
use parsley_infra::env;
use parsley_projector::config::{Apply, Config, InitialPosition, ModelConfig, TopicConfig};
use parsley_projector::metrics::Metrics;
use parsley_projector::projection::{Delivered, Projection, StepContext};
use parsley_projector::status::{model_report, ModelReport};
use parsley_projector::{migrations, DocumentProjection, ModelProjector};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::types::RDKafkaErrorCode;
use sqlx::{PgConnection, PgPool, Row as _};

pub const TIMEOUT: Duration = Duration::from_secs(30);

pub fn bootstrap() -> String {
    env::kafka_bootstrap().unwrap_or_else(|e| panic!("these tests need the real broker: {e:#}"))
}

pub fn database_url() -> String {
    env::database_url().unwrap_or_else(|e| panic!("these tests need the real database: {e:#}"))
}

/// A name no other run or test uses.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    format!("{prefix}-{}-{}-{}", std::process::id(), nanos % 1_000_000_000_000, COUNTER.fetch_add(1, Ordering::Relaxed))
}

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

pub fn admin() -> AdminClient<DefaultClientContext> {
    parsley_infra::kafka::admin_config(&bootstrap()).create().expect("admin client")
}

pub fn admin_options() -> AdminOptions {
    AdminOptions::new().operation_timeout(Some(TIMEOUT)).request_timeout(Some(TIMEOUT))
}

/// Creates topics, retrying while a deletion of the same name is still in progress.
pub async fn create_topics(names: &[&str], partitions: i32) {
    let admin = admin();
    for name in names {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let results = admin
                .create_topics(&[NewTopic::new(name, partitions, TopicReplication::Fixed(1))], &admin_options())
                .await
                .expect("create_topics request");
            match &results[0] {
                Ok(_) => break,
                Err((_, code)) if Instant::now() < deadline => {
                    eprintln!("create {name}: {code}, retrying");
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err((_, code)) => panic!("creating topic {name}: {code}"),
            }
        }
    }
    // Let metadata settle so the first describe sees every partition.
    tokio::time::sleep(Duration::from_millis(300)).await;
}

pub async fn delete_topic(name: &str) {
    let results = admin().delete_topics(&[name], &admin_options()).await.expect("delete_topics request");
    if let Err((_, code)) = &results[0] {
        panic!("deleting topic {name}: {code}");
    }
}

/// The topic ID of `name` as the broker reports it now.
pub async fn topic_id(name: &str) -> TopicId {
    let d = parsley_infra::describe_topics(&bootstrap(), &[name.to_string()], TIMEOUT).await.unwrap();
    TopicId::from_bytes(d[0].id)
}

pub fn producer() -> FutureProducer {
    parsley_infra::kafka::producer_config(&bootstrap()).create().expect("producer")
}

/// A transactional producer, initialised.
pub fn transactional_producer() -> FutureProducer {
    let p: FutureProducer = parsley_infra::kafka::transactional_producer_config(&bootstrap(), &unique("tx"))
        .create()
        .expect("transactional producer");
    p.init_transactions(TIMEOUT).expect("init_transactions");
    p
}

/// Produces one record to `topic`/`partition` and returns its offset.
pub async fn produce(
    producer: &FutureProducer,
    topic: &str,
    partition: i32,
    key: &str,
    value: Option<&[u8]>,
    causes: Option<&[u8]>,
) -> i64 {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic).partition(partition).key(key);
        if let Some(v) = value {
            record = record.payload(v);
        }
        if let Some(c) = causes {
            record = record.headers(OwnedHeaders::new().insert(Header { key: "parsley.causes", value: Some(c) }));
        }
        match producer.send(record, TIMEOUT).await {
            Ok(d) => return d.offset,
            // A new topic's partitions reach the producer's metadata a moment after creation.
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::UnknownPartition), _))
                if Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err((e, _)) => panic!("producing to {topic}/{partition}: {e}"),
        }
    }
}

pub fn causes(pairs: &[(TopicId, u32, i64)]) -> Vec<u8> {
    CausalPast::from_pairs(pairs.iter().map(|(t, p, o)| (ChannelId::new(*t, *p), *o))).encode()
}

/// A configuration with one model receiving `topics` (name, apply), for the test services,
/// with short step bounds and backoff.
pub fn config(model: &str, topics: &[(&str, Apply)]) -> Config {
    let mut c = Config::parse("").unwrap();
    c.kafka.bootstrap = bootstrap();
    c.database.url = Some(database_url());
    c.projector.owner = Some(unique("owner"));
    c.projector.metrics_address = String::new();
    c.projector.initial_backoff_ms = 50;
    c.projector.max_backoff_ms = 400;
    c.models.push(ModelConfig {
        name: model.to_string(),
        projection: Default::default(),
        topics: topics
            .iter()
            .map(|(n, a)| TopicConfig { name: n.to_string(), apply: *a, initial_position: None })
            .collect(),
        initial_position: InitialPosition::Earliest,
        max_step_records: 500,
        max_step_ms: 150,
        tasks: None,
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
    ) -> anyhow::Result<()> {
        self.apply_batch(conn, step, std::slice::from_ref(record)).await
    }

    async fn apply_batch(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        records: &[Delivered<'_>],
    ) -> anyhow::Result<()> {
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
    start_with_metrics(config, pool, projection, Metrics::new()).await
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
