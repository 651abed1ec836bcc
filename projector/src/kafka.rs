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
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _, StreamConsumer};
use rdkafka::types::RDKafkaRespErr;

use crate::config::KafkaConfig;

/// The task consumer's configuration: the project's read-committed, no-auto-commit consumer
/// (`parsley_infra::kafka::consumer_config`), plus `auto.offset.reset=error` so that a
/// position retention removed is reported instead of silently skipped, plus the operator's
/// extra properties (which may not override the fixed ones; see `config.rs`).
///
/// The group id (librdkafka wants one even for a manual assignment; nothing is committed
/// to it) is `parsley-projector.<model>`.
pub fn consumer_config(kafka: &KafkaConfig, model: &str) -> ClientConfig {
    let mut c = parsley_infra::kafka::consumer_config(&kafka.bootstrap, &format!("parsley-projector.{model}"));
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
    let consumer: BaseConsumer = config.create().context("creating a Kafka client for metadata")?;
    let mut resolved = Vec::with_capacity(names.len());
    let mut existing = Vec::new();
    for name in names {
        let metadata = consumer
            .fetch_metadata(Some(name), timeout)
            .with_context(|| format!("fetching metadata of topic {name:?} (is Kafka reachable?)"))?;
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
    Ok(resolved)
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
/// the cluster's topics (metadata) and describes them to map topic IDs to names; a topic ID
/// no longer among them is `TopicGone`, as is a partition beyond its topic's count; every
/// other channel is `Live` with its log start (the low watermark). A fact that could not be
/// learned is `Unknown` and its error is returned alongside. `Err` only when the listing
/// itself failed (then nothing is known).
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
    let metadata = consumer.fetch_metadata(None, timeout).context("listing the cluster's topics")?;
    let mut names = Vec::new();
    let mut errors = Vec::new();
    for topic in metadata.topics() {
        match topic.error() {
            None => names.push(topic.name().to_string()),
            // Listed but not answering (e.g. no leader yet): its ID is not known, so the
            // listing is incomplete.
            Some(e) => errors.push(format!("metadata of topic {:?}: error {e:?}", topic.name())),
        }
    }
    let described = match parsley_infra::describe_topics_blocking(consumer.client(), &names, timeout) {
        Ok(d) => d,
        // One topic deleted (or not describable) between the listing and the describe fails
        // the whole call: describe one by one and keep what answers.
        Err(whole) => {
            let mut each = Vec::with_capacity(names.len());
            for name in &names {
                match parsley_infra::describe_topics_blocking(consumer.client(), std::slice::from_ref(name), timeout) {
                    Ok(d) => each.extend(d),
                    Err(e) => errors.push(format!("{e:#}")),
                }
            }
            if each.is_empty() && !names.is_empty() {
                return Err(whole.context("describing the cluster's topics"));
            }
            each
        }
    };
    // An ID missing from an incomplete listing may belong to a topic that did not answer:
    // only a complete one says a topic is gone.
    let complete = errors.is_empty();
    let by_id: BTreeMap<TopicId, (String, u32)> =
        described.into_iter().map(|d| (TopicId::from_bytes(d.id), (d.name, d.partitions))).collect();
    let mut facts = BTreeMap::new();
    for channel in channels {
        let fact = match by_id.get(&channel.topic) {
            None if complete => ChannelFact::TopicGone,
            None => ChannelFact::Unknown,
            Some((_, partitions)) if channel.partition >= *partitions => ChannelFact::TopicGone,
            Some((name, _)) => match consumer.fetch_watermarks(name, channel.partition as i32, timeout) {
                Ok((log_start, _)) => ChannelFact::Live { log_start },
                Err(e) => {
                    errors.push(format!("querying the log start of {name}/{}: {e}", channel.partition));
                    ChannelFact::Unknown
                }
            },
        };
        facts.insert(*channel, fact);
    }
    Ok(UpstreamFacts { facts, errors })
}
