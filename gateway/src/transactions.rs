//! The gateway's transactional producers for batch writes: a few, made on first use, each
//! with a `transactional.id` of this gateway alone (`<prefix>-<host>-<pid>-<instance>-<n>`:
//! two gateways in one process — an embedding program, a test — must not fence each other's
//! producers); a transaction holds its producer until it commits or aborts.

use parsley_infra::kafka::Cluster;
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer as _};
use rdkafka::util::Timeout;
use tokio::sync::Mutex;

/// How many transactional producers a gateway keeps (batches at once).
pub const TRANSACTIONAL_PRODUCERS: usize = 4;

/// The gateway's transactional producers, made on first use.
pub struct Transactions {
    cluster: Cluster,
    prefix: String,
    produce_timeout_ms: u64,
    slots: Vec<Mutex<Option<FutureProducer>>>,
}

impl Transactions {
    pub fn new(cluster: impl Into<Cluster>, produce_timeout_ms: u64) -> Transactions {
        let host = std::fs::read_to_string("/etc/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "gateway".to_string());
        // Which gateway of this process: each initialization of a transactional id fences the
        // producer that held it before.
        static INSTANCES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let instance = INSTANCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Transactions {
            cluster: cluster.into(),
            prefix: format!("parsley-gateway-{host}-{}-{instance}", std::process::id()),
            produce_timeout_ms,
            slots: (0..TRANSACTIONAL_PRODUCERS).map(|_| Mutex::new(None)).collect(),
        }
    }

    /// A free slot if there is one, else the first to come free.
    pub async fn slot(&self) -> (usize, tokio::sync::MutexGuard<'_, Option<FutureProducer>>) {
        for (i, s) in self.slots.iter().enumerate() {
            if let Ok(guard) = s.try_lock() {
                return (i, guard);
            }
        }
        let pick = (std::process::id() as usize) % self.slots.len();
        (pick, self.slots[pick].lock().await)
    }

    /// Makes a transactional producer and initializes its transactions (fencing any earlier
    /// producer of the same id).
    pub async fn make(&self, n: usize) -> Result<FutureProducer, KafkaError> {
        let id = format!("{}-{n}", self.prefix);
        let producer: FutureProducer = parsley_infra::kafka::transactional_producer_config(&self.cluster, &id)
            .set("message.timeout.ms", self.produce_timeout_ms.to_string())
            .set("transaction.timeout.ms", (self.produce_timeout_ms * 2).max(1_000).to_string())
            .create()?;
        let p = producer.clone();
        let timeout = self.timeout();
        blocking(move || p.init_transactions(timeout)).await?;
        Ok(producer)
    }

    pub fn timeout(&self) -> Timeout {
        Timeout::After(std::time::Duration::from_millis(self.produce_timeout_ms))
    }
}

/// Runs a blocking transaction call off the async threads.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, KafkaError> + Send + 'static,
) -> Result<T, KafkaError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "a Kafka transaction call did not finish");
            Err(KafkaError::Canceled)
        }
    }
}
