//! Kafka client configurations and partition offsets.
//!
//! Every producer of the project partitions keys like the Java client's default partitioner
//! (`murmur2_random` in librdkafka: murmur2 of the key bytes, positive, modulo the partition
//! count — the same function as `parsley::murmur2::partition_for_key`) and is idempotent with
//! `acks=all`. Every consumer reads committed data only and never commits offsets by itself:
//! the database is the source of truth for positions.

use std::time::Duration;

use anyhow::Context as _;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};

/// Configuration for an admin client.
pub fn admin_config(bootstrap: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap);
    c
}

/// Configuration for a producer: `partitioner=murmur2_random`, `enable.idempotence=true`,
/// `acks=all`. Callers may add settings but must not change these three.
pub fn producer_config(bootstrap: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap)
        .set("partitioner", "murmur2_random")
        .set("enable.idempotence", "true")
        .set("acks", "all");
    c
}

/// [`producer_config`] plus a `transactional.id`, for a producer that writes in Kafka
/// transactions (`init_transactions` before the first `begin_transaction`).
pub fn transactional_producer_config(bootstrap: &str, transactional_id: &str) -> ClientConfig {
    let mut c = producer_config(bootstrap);
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
pub fn consumer_config(bootstrap: &str, group_id: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap)
        .set("group.id", group_id)
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false");
    c
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
    bootstrap: &str,
    topic: &str,
    partition: i32,
    timeout: Duration,
) -> anyhow::Result<PartitionOffsets> {
    // ListOffsets(LATEST) answers the last stable offset under read_committed and the high
    // watermark under read_uncommitted; librdkafka sends the consumer's isolation level.
    let committed: BaseConsumer =
        consumer_config(bootstrap, OFFSETS_QUERY_GROUP).create().context("creating a read-committed consumer")?;
    let (log_start, last_stable) = committed
        .fetch_watermarks(topic, partition, timeout)
        .with_context(|| format!("querying the last stable offset of {topic}/{partition}"))?;
    let uncommitted: BaseConsumer = consumer_config(bootstrap, OFFSETS_QUERY_GROUP)
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
    bootstrap: &str,
    topic: &str,
    partition: i32,
    timeout: Duration,
) -> anyhow::Result<PartitionOffsets> {
    let (bootstrap, topic) = (bootstrap.to_string(), topic.to_string());
    tokio::task::spawn_blocking(move || partition_offsets_blocking(&bootstrap, &topic, partition, timeout))
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
}
