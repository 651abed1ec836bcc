//! Kafka client configurations and partition offsets.
//!
//! Every client of the project starts from a [`Cluster`]: the bootstrap servers and the
//! operator's librdkafka properties (`[kafka.properties]`: TLS, SASL, compression, tuning),
//! applied to every client, producer, consumer and admin alike. The project's fixed settings
//! ([`FIXED_PROPERTIES`]) are set after them, so they hold whatever the properties say, and a
//! configuration that tries to set one is refused by name when it is loaded.
//!
//! Every producer of the project partitions keys like the Java client's default partitioner
//! (`murmur2_random` in librdkafka: murmur2 of the key bytes, positive, modulo the partition
//! count — the same function as `parsley::murmur2::partition_for_key`) and is idempotent with
//! `acks=all`. Every consumer reads committed data only and never commits offsets by itself:
//! the database is the source of truth for positions.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context as _;
use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, FromClientConfigAndContext, RDKafkaLogLevel};
use rdkafka::consumer::{BaseConsumer, Consumer as _, ConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult};

/// The settings the project fixes on its clients, each with the reason; librdkafka's other
/// names for them are listed too. `[kafka.properties]` and `kafka.consumer` may not set them.
pub const FIXED_PROPERTIES: &[(&str, &str)] = &[
    ("bootstrap.servers", "kafka.bootstrap sets it"),
    ("metadata.broker.list", "kafka.bootstrap sets it"),
    ("partitioner", "producers partition keys like the Java client (murmur2_random), as reads are routed"),
    ("enable.idempotence", "producers are idempotent"),
    ("acks", "producers wait for every in-sync replica (all)"),
    ("request.required.acks", "producers wait for every in-sync replica (all)"),
    ("transactional.id", "each transactional producer gets its own"),
    ("group.id", "each consumer gets its own (nothing is committed to it)"),
    ("isolation.level", "consumers read committed records only"),
    ("enable.auto.commit", "positions are kept in the database, never committed to Kafka"),
    ("auto.commit.enable", "positions are kept in the database, never committed to Kafka"),
    ("enable.auto.offset.store", "positions are kept in the database, never committed to Kafka"),
    ("auto.offset.reset", "a position that retention removed is reported, never skipped"),
    ("enable.partition.eof", "the end of a partition is not an event the project reads"),
];

/// Why `name` is fixed by the project, when it is.
pub fn fixed_property(name: &str) -> Option<&'static str> {
    FIXED_PROPERTIES.iter().find(|(n, _)| *n == name).map(|(_, why)| *why)
}

/// Whether the value of property `name` is a secret (a password, a key, a client secret):
/// never printed.
pub fn secret_property(name: &str) -> bool {
    ["password", "secret", ".pem", "oauthbearer.config"].iter().any(|s| name.contains(s))
}

/// Where the project's Kafka clients connect and how: the bootstrap servers and the
/// operator's librdkafka properties, set on every client before the fixed settings. A
/// bootstrap string alone converts into a cluster without properties (plaintext, no
/// authentication). `Debug` prints secret values ([`secret_property`]) as `***`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Cluster {
    /// `host:port[,host:port...]`.
    pub bootstrap: String,
    /// librdkafka properties by name (`security.protocol`, `sasl.mechanism`, ...).
    pub properties: BTreeMap<String, String>,
}

impl Cluster {
    /// A cluster reached at `bootstrap` with `properties`.
    pub fn new(bootstrap: impl Into<String>, properties: BTreeMap<String, String>) -> Cluster {
        Cluster { bootstrap: bootstrap.into(), properties }
    }

    /// The properties, then `bootstrap.servers`: where every client configuration starts.
    fn base(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        for (name, value) in &self.properties {
            c.set(name, value);
        }
        c.set("bootstrap.servers", &self.bootstrap);
        c
    }
}

impl From<&str> for Cluster {
    fn from(bootstrap: &str) -> Cluster {
        Cluster::new(bootstrap, BTreeMap::new())
    }
}

impl From<&String> for Cluster {
    fn from(bootstrap: &String) -> Cluster {
        Cluster::from(bootstrap.as_str())
    }
}

impl From<&Cluster> for Cluster {
    fn from(cluster: &Cluster) -> Cluster {
        cluster.clone()
    }
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let properties: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| (k.as_str(), if secret_property(k) { "***" } else { v.as_str() }))
            .collect();
        f.debug_struct("Cluster").field("bootstrap", &self.bootstrap).field("properties", &properties).finish()
    }
}

/// Configuration for an admin client.
pub fn admin_config(cluster: impl Into<Cluster>) -> ClientConfig {
    cluster.into().base()
}

/// Configuration for a producer: `partitioner=murmur2_random`, `enable.idempotence=true`,
/// `acks=all`. Callers may add settings but must not change these three.
pub fn producer_config(cluster: impl Into<Cluster>) -> ClientConfig {
    let mut c = cluster.into().base();
    c.set("partitioner", "murmur2_random").set("enable.idempotence", "true").set("acks", "all");
    c
}

/// [`producer_config`] plus a `transactional.id`, for a producer that writes in Kafka
/// transactions (`init_transactions` before the first `begin_transaction`).
pub fn transactional_producer_config(cluster: impl Into<Cluster>, transactional_id: &str) -> ClientConfig {
    let mut c = producer_config(cluster);
    c.set("transactional.id", transactional_id);
    c
}

/// Configuration for a consumer: `isolation.level=read_committed`,
/// `enable.auto.commit=false`, `enable.auto.offset.store=false`.
///
/// The project assigns partitions by hand and keeps positions in the database, never in
/// Kafka. librdkafka still needs a `group.id` to accept a manual assignment; with `assign`
/// (not `subscribe`) the consumer joins no group, and without commits the group stores
/// nothing.
pub fn consumer_config(cluster: impl Into<Cluster>, group_id: &str) -> ClientConfig {
    let mut c = cluster.into().base();
    c.set("group.id", group_id)
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false");
    c
}

/// How long [`Diagnosing::diagnose`] waits for the reason of a failure just reported.
pub const DIAGNOSIS_WAIT: Duration = Duration::from_millis(500);

/// A client context that logs what librdkafka reports through `tracing` and keeps its last
/// error. A refused password, an untrusted certificate or a plaintext client on a TLS
/// listener is reported only here: the request that meets it fails as a transport failure or
/// a timeout, so a caller adds [`Diagnosing::diagnose`] to that error.
#[derive(Debug, Default)]
pub struct Diagnosing {
    /// The latest reasons, oldest first (at most [`KEPT_REASONS`]).
    reasons: Mutex<Vec<String>>,
}

/// How many of the latest reasons a [`Diagnosing`] context keeps.
const KEPT_REASONS: usize = 16;

impl Diagnosing {
    /// The last error librdkafka reported to `consumer`, led by the setting to check when it
    /// is a known failure ([`explain`]), for a request that just failed. librdkafka queues
    /// its logs and errors for the client's poll (a client used only for requests never
    /// polls) and may fail the request a moment before it says why: this polls for up to
    /// [`DIAGNOSIS_WAIT`] until a reason is there.
    pub fn diagnose(consumer: &BaseConsumer<Diagnosing>) -> Option<String> {
        let deadline = std::time::Instant::now() + DIAGNOSIS_WAIT;
        loop {
            // Serves the queued events (logs, errors) through the context; the consumer has
            // nothing assigned, so no record comes out.
            while let Some(polled) = consumer.poll(Duration::ZERO) {
                if let Err(e) = polled {
                    consumer.context().keep(&e.to_string());
                }
            }
            let reasons = consumer.context().reasons.lock().unwrap_or_else(|e| e.into_inner()).clone();
            // A known failure says more than what follows from it ("all brokers are down").
            let known = reasons.iter().rev().find_map(|r| known_failure(r).map(|_| explain(r)));
            if known.is_some() || std::time::Instant::now() >= deadline {
                return known.or_else(|| reasons.last().cloned());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A client of `config` with this context, librdkafka's logs at info and above passed
    /// on (rdkafka derives the level from the `log` crate's, which the project does not use;
    /// a plaintext client's disconnection by a TLS listener is logged at info).
    pub fn create<T: FromClientConfigAndContext<Diagnosing>>(config: &ClientConfig) -> KafkaResult<T> {
        let mut config = config.clone();
        config.set_log_level(RDKafkaLogLevel::Info);
        config.create_with_context(Diagnosing::default())
    }

    fn keep(&self, reason: &str) {
        let mut reasons = self.reasons.lock().unwrap_or_else(|e| e.into_inner());
        if reasons.len() == KEPT_REASONS {
            reasons.remove(0);
        }
        reasons.push(reason.to_string());
    }
}

impl ClientContext for Diagnosing {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        // A connection's failure (facility FAIL) is a reason whatever its level.
        let severe = matches!(
            level,
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error
        );
        if facility == "FAIL" || severe {
            self.keep(message);
        }
        match level {
            RDKafkaLogLevel::Warning => tracing::warn!(facility, "librdkafka: {message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info | RDKafkaLogLevel::Debug => {
                tracing::debug!(facility, "librdkafka: {message}")
            }
            _ => tracing::error!(facility, "librdkafka: {message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(%error, "librdkafka: {reason}");
        self.keep(reason);
    }
}

impl ConsumerContext for Diagnosing {}

/// librdkafka's error text, led by the `[kafka.properties]` setting to check when it is a
/// known failure: refused credentials, an untrusted certificate, a security protocol that
/// does not match the listener.
pub fn explain(reason: &str) -> String {
    match known_failure(reason) {
        Some(s) => format!("{s} ({reason})"),
        None => reason.to_string(),
    }
}

/// What a known failure means and the setting to check.
fn known_failure(reason: &str) -> Option<&'static str> {
    let r = reason.to_ascii_lowercase();
    if r.contains("sasl authentication error") || r.contains("authentication failed") {
        Some("the broker refused the credentials: check kafka.properties sasl.username, sasl.password and sasl.mechanism")
    } else if r.contains("certificate verify failed") {
        Some("the broker's certificate is not trusted: check kafka.properties ssl.ca.location")
    } else if r.contains("security.protocol")
        || r.contains("wrong version number")
        || (r.contains("disconnected") && r.contains("in state apiversion_query"))
    {
        // A TLS listener closes a plaintext client's connection at its first request.
        Some("the listener speaks another protocol: check kafka.properties security.protocol")
    } else {
        None
    }
}

/// Group id of the short-lived consumers that only query offsets.
const OFFSETS_QUERY_GROUP: &str = "parsley-offsets-query";

/// Offsets of one partition, as the broker reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartitionOffsets {
    /// First offset still in the log (records before it were deleted or compacted away).
    pub log_start: i64,
    /// Last stable offset: the first offset of the earliest open transaction, or the high
    /// watermark when none is open. A read-committed consumer reads up to here.
    pub last_stable: i64,
    /// High watermark: one past the last replicated record (committed or not).
    pub high_watermark: i64,
}

/// Queries [`PartitionOffsets`] of `topic`/`partition`, blocking up to about twice `timeout`
/// (one query per isolation level).
pub fn partition_offsets_blocking(
    cluster: impl Into<Cluster>,
    topic: &str,
    partition: i32,
    timeout: Duration,
) -> anyhow::Result<PartitionOffsets> {
    // ListOffsets(LATEST) answers the last stable offset under read_committed and the high
    // watermark under read_uncommitted; librdkafka sends the consumer's isolation level.
    let cluster = cluster.into();
    let committed: BaseConsumer =
        consumer_config(&cluster, OFFSETS_QUERY_GROUP).create().context("creating a read-committed consumer")?;
    let (log_start, last_stable) = committed
        .fetch_watermarks(topic, partition, timeout)
        .with_context(|| format!("querying the last stable offset of {topic}/{partition}"))?;
    let uncommitted: BaseConsumer = consumer_config(&cluster, OFFSETS_QUERY_GROUP)
        .set("isolation.level", "read_uncommitted")
        .create()
        .context("creating a read-uncommitted consumer")?;
    let (_, high_watermark) = uncommitted
        .fetch_watermarks(topic, partition, timeout)
        .with_context(|| format!("querying the high watermark of {topic}/{partition}"))?;
    Ok(PartitionOffsets { log_start, last_stable, high_watermark })
}

/// Async form of [`partition_offsets_blocking`], run on tokio's blocking pool.
pub async fn partition_offsets(
    cluster: impl Into<Cluster>,
    topic: &str,
    partition: i32,
    timeout: Duration,
) -> anyhow::Result<PartitionOffsets> {
    let (cluster, topic) = (cluster.into(), topic.to_string());
    tokio::task::spawn_blocking(move || partition_offsets_blocking(cluster, &topic, partition, timeout))
        .await
        .context("the partition offsets task panicked")?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_settings_are_present() {
        let p = transactional_producer_config("b:1", "tx");
        assert_eq!(p.get("partitioner"), Some("murmur2_random"));
        assert_eq!(p.get("enable.idempotence"), Some("true"));
        assert_eq!(p.get("acks"), Some("all"));
        assert_eq!(p.get("transactional.id"), Some("tx"));
        let c = consumer_config("b:1", "g");
        assert_eq!(c.get("isolation.level"), Some("read_committed"));
        assert_eq!(c.get("enable.auto.commit"), Some("false"));
        assert_eq!(c.get("group.id"), Some("g"));
    }

    #[test]
    fn properties_reach_every_client_and_the_fixed_settings_win() {
        let properties: BTreeMap<String, String> = [
            ("security.protocol", "sasl_ssl"),
            ("sasl.password", "hunter2"),
            ("acks", "0"),
            ("isolation.level", "read_uncommitted"),
            ("bootstrap.servers", "elsewhere:1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let cluster = Cluster::new("b:1", properties);
        for c in [
            admin_config(&cluster),
            producer_config(&cluster),
            transactional_producer_config(&cluster, "tx"),
            consumer_config(&cluster, "g"),
        ] {
            assert_eq!(c.get("security.protocol"), Some("sasl_ssl"));
            assert_eq!(c.get("bootstrap.servers"), Some("b:1"));
        }
        assert_eq!(producer_config(&cluster).get("acks"), Some("all"));
        assert_eq!(consumer_config(&cluster, "g").get("isolation.level"), Some("read_committed"));
        let printed = format!("{cluster:?}");
        assert!(printed.contains("sasl_ssl") && !printed.contains("hunter2"), "{printed}");
        assert!(fixed_property("acks").is_some() && fixed_property("request.required.acks").is_some());
        assert!(fixed_property("sasl.password").is_none());
        assert_eq!(admin_config("plain:1").get("bootstrap.servers"), Some("plain:1"));
    }
}
