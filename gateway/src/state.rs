//! The gateway's shared state: [`AppState`], what every handler receives (the
//! configuration, the pool, the Kafka clients, the caches, the metrics and the limits), and
//! its constructor and lookups.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use parsley_settings::config::ModelConfig;
use rdkafka::producer::FutureProducer;
use sqlx::PgPool;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::facts_cache::KafkaFacts;
use crate::keys;
use crate::metrics::{Metrics, METRICS};
use crate::notify::ClockNotifier;
use crate::problem::ApiError;
use crate::settings::GatewayConfig;
use crate::widths::RecordedWidths;

/// What every handler shares. Cheap to clone.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

/// The state itself, shared behind [`AppState`]'s `Arc` (its fields read through `Deref`).
pub struct Inner {
    pub config: GatewayConfig,
    pub pool: PgPool,
    /// The pool's connections as the gated reads and the waiting reads' clock fetches take
    /// them: handed from read to read without sqlx's release round trip, up to all but a
    /// quarter of `database_max_connections` (the rest stay for the writes and the rest).
    pub reads: Arc<parsley_infra::pg::Reuse>,
    /// The named queries' own pool (`gateway.query_max_connections`): a slow query holds one
    /// of these, never a connection the document reads need.
    pub queries: PgPool,
    pub producer: FutureProducer,
    /// The transactional producers of batch writes.
    pub transactions: crate::transactions::Transactions,
    pub facts: KafkaFacts,
    pub notifier: Arc<ClockNotifier>,
    /// Per model, the shared re-checks of waiting reads.
    pub feeds: crate::feed::Feeds,
    /// Per model, the shape gated reads choose their clock rows by.
    pub shapes: crate::shapes::Shapes,
    /// Per model, covered document snapshots (keys and pages) kept in memory (`gateway.read_cache_bytes`).
    pub kept: crate::read_cache::KeptReads,
    pub metrics: Arc<Metrics>,
    /// Names of the topics some configured model receives; ask [`Inner::receives`].
    pub received_topics: BTreeSet<String>,
    /// The topics' data contracts, held to every value written to them.
    pub contracts: crate::contracts::Contracts,
    /// `GET /openapi.json`'s body, made at the first request (the document with each
    /// topic's schema).
    pub openapi: std::sync::OnceLock<axum::body::Bytes>,
    /// The width each model was recorded with, for the write path.
    pub widths: RecordedWidths,
    /// Permits for requests in flight (`gateway.max_in_flight`).
    pub in_flight: Arc<Semaphore>,
    /// Per model, permits for reads waiting for coverage (`gateway.max_waiting_reads`).
    pub waiting_reads: BTreeMap<String, Arc<Semaphore>>,
    /// Per model, the read role its named queries run under (`SET LOCAL ROLE`), as
    /// [`crate::app::Gateway::check_queries`] found it; absent: the gateway's own role.
    pub query_roles: std::sync::RwLock<BTreeMap<String, String>>,
    /// The dependencies' states the background checks keep for `/readyz`, and draining.
    pub readiness: crate::health::Readiness,
}

impl Inner {
    /// Whether some configured model receives topic `name`: the topics writes may go to, and
    /// whose token pairs are never pruned for their log start (see
    /// [`parsley::gate::read_stops_demanding`]).
    pub fn receives(&self, name: &str) -> bool {
        self.received_topics.contains(name)
    }

    /// The configured models receiving topic `name`.
    pub fn models_receiving(&self, name: &str) -> Vec<&str> {
        let models = &self.config.shared.models;
        models.iter().filter(|m| m.topics.iter().any(|t| t.name == name)).map(|m| m.name.as_str()).collect()
    }

    /// Every configured model's name.
    pub fn model_names(&self) -> Vec<String> {
        self.config.shared.models.iter().map(|m| m.name.clone()).collect()
    }

    /// A permit for one more read of `model` to wait for coverage, if one is free.
    pub fn wait_slot(&self, model: &str) -> Option<OwnedSemaphorePermit> {
        self.waiting_reads.get(model).and_then(|s| Arc::clone(s).try_acquire_owned().ok())
    }
}

impl Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    /// Builds the state without touching the network: the pool connects lazily and the Kafka
    /// clients connect in the background.
    pub fn new(config: GatewayConfig) -> anyhow::Result<AppState> {
        let url = config.shared.database_url()?.to_string();
        // Every session (the pool's and the LISTEN connection opened from it) under the
        // [database] bounds.
        let pool = parsley_infra::pg::connect_lazy_bounded(
            &url,
            config.settings.database_pool_size(),
            config.shared.database.acquire_timeout(),
            &config.shared.database.session_bounds(),
        )?;
        let queries = parsley_infra::pg::connect_lazy_bounded(
            &url,
            config.settings.query_max_connections,
            config.shared.database.acquire_timeout(),
            &config.shared.database.session_bounds(),
        )?;
        // Every Kafka client over the configured cluster and its [kafka.properties].
        let cluster = config.shared.kafka.cluster();
        let producer: FutureProducer = parsley_infra::kafka::producer_config(&cluster)
            .set("message.timeout.ms", config.settings.produce_timeout_ms.to_string())
            .create()
            .context("creating the Kafka producer")?;
        let transactions = crate::transactions::Transactions::new(&cluster, config.settings.produce_timeout_ms);
        let facts = KafkaFacts::new(&cluster, config.settings.kafka_timeout())?;
        let notifier = Arc::new(ClockNotifier::new(config.shared.models.iter().map(|m| m.name.as_str())));
        let kept = crate::read_cache::KeptReads::new(
            config.shared.models.iter().map(|m| m.name.as_str()),
            config.settings.read_cache_bytes,
            Duration::from_millis(config.settings.read_cache_max_age_ms),
        );
        let received_topics =
            config.shared.models.iter().flat_map(|m| m.topics.iter().map(|t| t.name.clone())).collect();
        let contracts = crate::contracts::Contracts::of(&config.shared);
        let waiting_reads = config
            .shared
            .models
            .iter()
            .map(|m| (m.name.clone(), Arc::new(Semaphore::new(config.settings.max_waiting_reads))))
            .collect();
        let in_flight = Arc::new(Semaphore::new(config.settings.max_in_flight));
        let metrics = Metrics::new(METRICS);
        // Through the process's meter provider: exported when the binary configured OTLP.
        parsley_infra::telemetry::export_registry(&metrics);
        keys::publish(&metrics, None, &config.keys.current());
        let reads = Arc::new(parsley_infra::pg::Reuse::new(
            pool.clone(),
            parsley_infra::pg::Reuse::keep_of(config.settings.database_pool_size()),
            config.shared.database.acquire_timeout(),
        ));
        let feeds = crate::feed::Feeds::new(
            config.shared.models.iter().map(|m| m.name.as_str()),
            crate::feed::Source {
                notifier: Arc::clone(&notifier),
                reads: Arc::clone(&reads),
                metrics: Arc::clone(&metrics),
                recheck: config.settings.recheck(),
            },
        );
        let readiness = crate::health::Readiness::new(
            config.settings.readiness_failures,
            config.settings.readiness_stall(config.shared.database.acquire_timeout()),
        );
        Ok(AppState(Arc::new(Inner {
            config,
            pool,
            reads,
            queries,
            producer,
            transactions,
            facts,
            notifier,
            feeds,
            shapes: crate::shapes::Shapes::default(),
            kept,
            metrics,
            received_topics,
            contracts,
            openapi: std::sync::OnceLock::new(),
            widths: RecordedWidths::default(),
            in_flight,
            waiting_reads,
            query_roles: Default::default(),
            readiness,
        })))
    }

    /// The read role `model`'s named queries run under, if it has one.
    pub fn query_role(&self, model: &str) -> Option<String> {
        self.query_roles.read().unwrap_or_else(|e| e.into_inner()).get(model).cloned()
    }

    /// The configured model named `name`: `404 unknown-model` naming it when there is none.
    pub fn model(&self, name: &str) -> Result<&ModelConfig, ApiError> {
        self.config
            .shared
            .models
            .iter()
            .find(|m| m.name == name)
            .ok_or_else(|| ApiError::UnknownModel(name.to_string()))
    }
}

/// The shared file of tests that reach no service: the pool connects lazily, Kafka is a
/// closed port.
#[cfg(test)]
pub(crate) const OFFLINE_FILE: &str = r#"
[kafka]
bootstrap = "127.0.0.1:1"
[database]
url = "postgres://nobody:secret@127.0.0.1:1/none"
[[models]]
name = "shop"
topics = [{ name = "orders" }]
"#;

/// A gateway configuration for tests that reach no service: `file` as the shared
/// configuration, with the one token key `k1` (32 bytes of 5).
#[cfg(test)]
pub(crate) fn offline_config(file: &str) -> GatewayConfig {
    use crate::token::{KeyRing, SecretKey};
    let ring = KeyRing::new(vec![("k1".into(), SecretKey::from_bytes([5; 32]))]).unwrap();
    let mut shared = parsley_settings::config::Config::parse(file).unwrap();
    // Open access unless the file chooses (these tests are not about authorization).
    let table = shared.gateway.get_or_insert_with(Default::default);
    if !table.contains_key("access") && !table.contains_key("auth") {
        table.insert("access".into(), "open".into());
    }
    GatewayConfig::with_keys(shared, ring).unwrap()
}

#[cfg(test)]
mod tests {
    //! The state's lookups, on a state built without infrastructure.

    use super::*;

    fn state() -> AppState {
        AppState::new(offline_config(OFFLINE_FILE)).unwrap()
    }

    #[tokio::test]
    async fn a_model_is_found_by_name_or_refused_naming_it() {
        let s = state();
        assert_eq!(s.model("shop").unwrap().name, "shop");
        match s.model("nope") {
            Err(ApiError::UnknownModel(name)) => assert_eq!(name, "nope"),
            other => panic!("expected unknown-model, got {:?}", other.map(|m| &m.name)),
        }
    }
}
