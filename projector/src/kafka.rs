//! Kafka for the projector: resolving the declared topics to topic IDs and partition counts,
//! the task consumer's configuration, partition watermarks, the partition counts the
//! run-time width check compares, and the facts upstream pruning runs on.
//!
//! Topic existence and partition counts come from a metadata request (so a deleted topic is
//! recognised as such, not confused with an unreachable broker); topic IDs come from
//! DescribeTopics through `parsley-infra`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use parsley::engine::ChannelFact;
use parsley::startup::ResolvedTopic;
use parsley::{ChannelId, TopicId};
use parsley_infra::facts::{self, Fact};
use parsley_infra::kafka::Diagnosing;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _, StreamConsumer};
use rdkafka::types::RDKafkaRespErr;

use parsley_settings::config::KafkaConfig;

/// The task consumer's configuration: the project's read-committed, no-auto-commit consumer
/// over the configured cluster and its `[kafka.properties]`
/// (`parsley_infra::kafka::consumer_config`), plus `auto.offset.reset=error` so that a
/// position retention removed is reported instead of silently skipped, plus the operator's
/// `kafka.consumer` properties (which may not override the fixed ones; see `config.rs`).
///
/// The group id (librdkafka wants one even for a manual assignment; nothing is committed
/// to it) is `parsley-projector.<model>`.
pub fn consumer_config(kafka: &KafkaConfig, model: &str) -> ClientConfig {
    let mut c = parsley_infra::kafka::consumer_config(kafka.cluster(), &format!("parsley-projector.{model}"));
    c.set("auto.offset.reset", "error");
    // Steps are bounded in time; fetches should not sit on the broker longer than a step.
    c.set("fetch.wait.max.ms", "50");
    for (k, v) in &kafka.consumer {
        c.set(k, v);
    }
    c
}

/// Creates a task consumer (nothing assigned yet).
pub fn task_consumer(kafka: &KafkaConfig, model: &str) -> anyhow::Result<StreamConsumer> {
    consumer_config(kafka, model).create().context("creating a Kafka consumer")
}

/// Resolves every declared topic: its ID (`None` when the name does not resolve) and
/// partition count (0 when it does not exist).
pub async fn resolve_topics(kafka: &KafkaConfig, model: &str, names: &[String]) -> anyhow::Result<Vec<ResolvedTopic>> {
    let config = consumer_config(kafka, model);
    let names = names.to_vec();
    let timeout = Duration::from_millis(kafka.request_timeout_ms);
    tokio::task::spawn_blocking(move || resolve_topics_blocking(config, &names, timeout))
        .await
        .context("the topic resolution task panicked")?
}

fn resolve_topics_blocking(
    config: ClientConfig,
    names: &[String],
    timeout: Duration,
) -> anyhow::Result<Vec<ResolvedTopic>> {
    let bootstrap = config.get("bootstrap.servers").unwrap_or_default().to_string();
    // The first request of a start: a refused password or an untrusted certificate is named.
    let consumer: BaseConsumer<Diagnosing> =
        Diagnosing::create(&config).context("creating a Kafka client for metadata")?;
    let mut resolved = Vec::with_capacity(names.len());
    let mut existing = Vec::new();
    for name in names {
        let metadata = consumer
            .fetch_metadata(Some(name), timeout)
            .with_context(|| format!("fetching metadata of topic {name:?} (is Kafka reachable?)"))
            .map_err(|e| match Diagnosing::diagnose(&consumer) {
                Some(d) => e.context(format!("Kafka at {bootstrap}: {d}")),
                None => e,
            })?;
        let topic = metadata
            .topics()
            .iter()
            .find(|t| t.name() == name)
            .with_context(|| format!("the broker's metadata does not mention topic {name:?}"))?;
        match topic.error() {
            None => {
                existing.push(name.clone());
                resolved.push(ResolvedTopic {
                    name: name.clone(),
                    id: None,
                    partitions: topic.partitions().len() as u32,
                });
            }
            Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART) => {
                resolved.push(ResolvedTopic { name: name.clone(), id: None, partitions: 0 });
            }
            Some(e) => anyhow::bail!("metadata of topic {name:?}: error {e:?}"),
        }
    }
    let described = parsley_infra::topic_id::describe_topics_blocking(consumer.client(), &existing, timeout)
        .context("resolving topic IDs")?;
    for d in described {
        let r = resolved.iter_mut().find(|r| r.name == d.name).expect("described a topic we asked for");
        r.id = Some(TopicId::from_bytes(d.id));
        // DescribeTopics is the later answer; prefer its partition count.
        r.partitions = d.partitions;
    }
    close_in_background(consumer);
    Ok(resolved)
}

/// Drops `client` on a thread of its own. Destroying a librdkafka client waits for its
/// threads to wind down, about 100 ms here, more than half of a start's time to its first
/// task; nothing depends on the close, so the start does not wait for it (docs/projector.md,
/// "A start that does not wait for its metadata client"). A thread that cannot be started
/// drops the client where it is (the closure is dropped with the failed spawn).
fn close_in_background<C: Send + 'static>(client: C) {
    let _ = std::thread::Builder::new().name("parsley-close".into()).spawn(move || drop(client));
}

/// `(log start, last stable offset)` of a partition, as a read-committed consumer sees them.
pub async fn watermarks(
    consumer: &Arc<StreamConsumer>,
    topic: &str,
    partition: u32,
    timeout: Duration,
) -> anyhow::Result<(i64, i64)> {
    let consumer = Arc::clone(consumer);
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        consumer
            .fetch_watermarks(&topic, partition as i32, timeout)
            .with_context(|| format!("querying the watermarks of {topic}/{partition}"))
    })
    .await
    .context("the watermark task panicked")?
}

/// The partition count of each of `topics` (in order) from one metadata request per
/// topic; `None` for a topic the broker does not know (deleted: not a width change, start
/// checks identities). `Err` when a request fails or a topic answers with another error.
pub async fn partition_counts(
    consumer: &Arc<StreamConsumer>,
    topics: Vec<String>,
    timeout: Duration,
) -> anyhow::Result<Vec<Option<u32>>> {
    let consumer = Arc::clone(consumer);
    tokio::task::spawn_blocking(move || {
        let mut counts = Vec::with_capacity(topics.len());
        for name in &topics {
            let metadata = consumer
                .fetch_metadata(Some(name), timeout)
                .with_context(|| format!("fetching metadata of topic {name:?}"))?;
            let topic = metadata
                .topics()
                .iter()
                .find(|t| t.name() == name)
                .with_context(|| format!("the broker's metadata does not mention topic {name:?}"))?;
            counts.push(match topic.error() {
                None => Some(topic.partitions().len() as u32),
                Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART) => None,
                Some(e) => anyhow::bail!("metadata of topic {name:?}: error {e:?}"),
            });
        }
        Ok(counts)
    })
    .await
    .context("the partition count task panicked")?
}

/// What one round of fact-finding learned about upstream channels.
#[derive(Debug, Default)]
pub struct UpstreamFacts {
    /// A fact per channel asked for (`Unknown` where nothing could be learned).
    pub facts: BTreeMap<ChannelId, ChannelFact>,
    /// What could not be learned, one message per failed request.
    pub errors: Vec<String>,
}

/// Learns the facts of `channels` (channels of topics the model does not receive): lists
/// the cluster's topics and describes them to map topic IDs to names, classified by the
/// shared policy ([`parsley_infra::facts`]): a topic ID absent from a complete listing is
/// `TopicGone`, as is a partition beyond its topic's count; absent from an incomplete one it
/// is `Unknown`; every other channel is `Live` with its log start (the low watermark). A fact
/// that could not be learned is `Unknown` and its error is returned alongside. `Err` only
/// when the listing itself failed (then nothing is known).
pub async fn upstream_facts(
    consumer: &Arc<StreamConsumer>,
    channels: Vec<ChannelId>,
    timeout: Duration,
) -> anyhow::Result<UpstreamFacts> {
    let consumer = Arc::clone(consumer);
    tokio::task::spawn_blocking(move || upstream_facts_blocking(&consumer, &channels, timeout))
        .await
        .context("the upstream facts task panicked")?
}

fn upstream_facts_blocking(
    consumer: &StreamConsumer,
    channels: &[ChannelId],
    timeout: Duration,
) -> anyhow::Result<UpstreamFacts> {
    // The shared policy (`parsley_infra::facts`): an ID missing from an incomplete listing
    // may belong to a topic that did not answer; only a complete one says a topic is gone.
    let listing = facts::list_topics_blocking(consumer.client(), timeout)?;
    let mut errors = listing.errors.clone();
    let mut learned = BTreeMap::new();
    for channel in channels {
        let fact = match listing.channel(channel.topic.as_bytes(), channel.partition) {
            Fact::Gone => ChannelFact::TopicGone,
            Fact::Unknown(_) => ChannelFact::Unknown,
            Fact::Exists(topic) => match consumer.fetch_watermarks(&topic.name, channel.partition as i32, timeout) {
                Ok((log_start, _)) => ChannelFact::Live { log_start },
                Err(e) => {
                    errors.push(format!("querying the log start of {}/{}: {e}", topic.name, channel.partition));
                    ChannelFact::Unknown
                }
            },
        };
        learned.insert(*channel, fact);
    }
    Ok(UpstreamFacts { facts: learned, errors })
}
