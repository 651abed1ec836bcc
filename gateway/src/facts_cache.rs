//! What the gateway knows about Kafka: topic names ↔ topic IDs and partition counts, and per
//! channel the log start and high watermark. Token hygiene runs on these facts, so they are
//! cached: a miss (or a fact that would refuse or prune a pair) refreshes from the broker
//! before it is acted on, and known topics are refreshed periodically.
//!
//! Every broker call is blocking in librdkafka and runs on tokio's blocking pool through
//! one long-lived read-uncommitted consumer (so its "high watermark" is the log end, not
//! the last stable offset). The consumer joins no group and never consumes.
//!
//! Facts fail closed, by the policy the projector applies too ([`parsley_infra::facts`]): a
//! topic is gone only when the broker says so — a named topic it reports unknown, or an ID
//! absent from a *complete* listing. A topic the broker lists but does not describe (no
//! leader yet, an error, a timeout) is unknown: its cached fact is kept, and a lookup that
//! needs it fails (the request answers 503), never reads it as gone (which would prune a
//! token pair).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use parsley::{ChannelId, Position, TopicId};
use parsley_infra::facts::{self, Fact};
use parsley_infra::kafka::{Cluster, Diagnosing};
use rdkafka::consumer::{BaseConsumer, Consumer as _};

/// One topic as the broker describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicFact {
    pub name: String,
    pub id: TopicId,
    pub partitions: u32,
}

/// Offsets of one channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffsetFacts {
    /// First offset still in the log; `None` when only an acknowledgement is known.
    pub log_start: Option<Position>,
    /// One past the last record in the log.
    pub log_end: Position,
}

#[derive(Debug, Default)]
struct Topics {
    by_name: BTreeMap<String, TopicFact>,
    by_id: BTreeMap<TopicId, String>,
}

impl Topics {
    fn insert(&mut self, fact: TopicFact) {
        if let Some(old) = self.by_name.get(&fact.name) {
            if old.id != fact.id {
                // Recreated: the old ID no longer resolves.
                self.by_id.remove(&old.id);
            }
        }
        self.by_id.insert(fact.id, fact.name.clone());
        self.by_name.insert(fact.name.clone(), fact);
    }

    fn remove_name(&mut self, name: &str) {
        if let Some(old) = self.by_name.remove(name) {
            self.by_id.remove(&old.id);
        }
    }
}

/// The cached facts and the client that refreshes them. Cheap to share (`Arc`).
pub struct KafkaFacts {
    client: Arc<BaseConsumer<Diagnosing>>,
    timeout: Duration,
    topics: RwLock<Topics>,
    offsets: Mutex<BTreeMap<ChannelId, OffsetFacts>>,
    /// Serialises full listings; holds when the last one finished and whether it was
    /// complete.
    listing: tokio::sync::Mutex<Option<(Instant, bool)>>,
}

impl std::fmt::Debug for KafkaFacts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaFacts").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

impl KafkaFacts {
    /// A client for `cluster`; connects lazily (creating it performs no I/O).
    pub fn new(cluster: impl Into<Cluster>, timeout: Duration) -> anyhow::Result<KafkaFacts> {
        let mut config = parsley_infra::kafka::consumer_config(cluster, "parsley-gateway.metadata");
        config.set("isolation.level", "read_uncommitted").set("allow.auto.create.topics", "false");
        // Its failures name the setting to check (logged by `/readyz`).
        let client: BaseConsumer<Diagnosing> =
            Diagnosing::create(&config).context("creating the gateway's Kafka metadata client")?;
        Ok(KafkaFacts {
            client: Arc::new(client),
            timeout,
            topics: RwLock::new(Topics::default()),
            offsets: Mutex::new(BTreeMap::new()),
            listing: tokio::sync::Mutex::new(None),
        })
    }

    fn topics_read(&self) -> std::sync::RwLockReadGuard<'_, Topics> {
        self.topics.read().unwrap_or_else(|e| e.into_inner())
    }

    fn topics_write(&self) -> std::sync::RwLockWriteGuard<'_, Topics> {
        self.topics.write().unwrap_or_else(|e| e.into_inner())
    }

    fn offsets_lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<ChannelId, OffsetFacts>> {
        self.offsets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cached fact of topic `name`, without I/O.
    pub fn cached_topic(&self, name: &str) -> Option<TopicFact> {
        self.topics_read().by_name.get(name).cloned()
    }

    /// The cached name of topic `id`, without I/O.
    pub fn cached_name(&self, id: &TopicId) -> Option<String> {
        self.topics_read().by_id.get(id).cloned()
    }

    /// Topic `name`: from the cache, else from the broker. `Ok(None)`: no such topic.
    pub async fn topic(&self, name: &str) -> anyhow::Result<Option<TopicFact>> {
        if let Some(fact) = self.cached_topic(name) {
            return Ok(Some(fact));
        }
        self.refresh_topics(&[name.to_string()]).await?;
        Ok(self.cached_topic(name))
    }

    /// Re-describes `names` from the broker, updating the cache: a topic the broker says
    /// does not exist is forgotten (its ID stops resolving). Fails if some topic could not
    /// be described; the others are updated all the same, and an undescribed one keeps its
    /// cached fact.
    pub async fn refresh_topics(&self, names: &[String]) -> anyhow::Result<()> {
        if names.is_empty() {
            return Ok(());
        }
        let client = Arc::clone(&self.client);
        let timeout = self.timeout;
        let names = names.to_vec();
        let mut found = tokio::task::spawn_blocking(move || describe(&client, Some(&names), timeout))
            .await
            .context("the topic metadata task panicked")??;
        {
            let mut topics = self.topics_write();
            for fact in std::mem::take(&mut found.facts) {
                topics.insert(fact);
            }
            for name in &found.missing {
                topics.remove_name(name);
            }
        }
        found.complete()
    }

    /// The name of topic `id`: from the cache, else from a full listing of the cluster's
    /// topics. `Ok(None)`: no topic has that ID (it was deleted, or recreated under a new ID).
    pub async fn topic_name(&self, id: &TopicId) -> anyhow::Result<Option<String>> {
        if let Some(name) = self.cached_name(id) {
            return Ok(Some(name));
        }
        let asked = Instant::now();
        let mut last = self.listing.lock().await;
        // A listing that finished after this call began saw the cluster as it is now: a
        // burst of lookups shares it.
        if let Some((at, complete)) = *last {
            if at >= asked {
                return self.name_after_listing(id, complete);
            }
        }
        let client = Arc::clone(&self.client);
        let timeout = self.timeout;
        let found = tokio::task::spawn_blocking(move || describe(&client, None, timeout))
            .await
            .context("the topic listing task panicked")??;
        let complete = found.errors.is_empty();
        {
            let mut topics = self.topics_write();
            if complete {
                // Everything not listed is gone.
                let mut fresh = Topics::default();
                for fact in found.facts {
                    fresh.insert(fact);
                }
                *topics = fresh;
            } else {
                // What did not answer may still exist: learn, forget nothing.
                tracing::warn!(errors = ?found.errors, "the topic listing was incomplete");
                for fact in found.facts {
                    topics.insert(fact);
                }
            }
        }
        *last = Some((Instant::now(), complete));
        self.name_after_listing(id, complete)
    }

    /// The name of `id` after a listing: absent from a complete listing, the topic is gone
    /// (`Ok(None)`); absent from an incomplete one, it is unknown (an error).
    fn name_after_listing(&self, id: &TopicId, complete: bool) -> anyhow::Result<Option<String>> {
        match facts::classify(self.cached_name(id), complete) {
            Fact::Exists(name) => Ok(Some(name)),
            Fact::Gone => Ok(None),
            Fact::Unknown(why) => anyhow::bail!("topic {id} is {why}"),
        }
    }

    /// The names the cache knows (for the periodic refresh).
    pub fn known_names(&self) -> Vec<String> {
        self.topics_read().by_name.keys().cloned().collect()
    }

    /// The cached offsets of `channel`, without I/O.
    pub fn cached_offsets(&self, channel: &ChannelId) -> Option<OffsetFacts> {
        self.offsets_lock().get(channel).copied()
    }

    /// Queries the log start and log end of `channel` (topic `name`) and caches them.
    pub async fn refresh_offsets(&self, channel: ChannelId, name: &str) -> anyhow::Result<OffsetFacts> {
        let client = Arc::clone(&self.client);
        let timeout = self.timeout;
        let topic = name.to_string();
        let partition = i32::try_from(channel.partition).context("partition out of range")?;
        let (low, high) = tokio::task::spawn_blocking(move || {
            client
                .fetch_watermarks(&topic, partition, timeout)
                .with_context(|| format!("querying the offsets of {topic}/{partition}"))
        })
        .await
        .context("the offsets task panicked")??;
        let mut offsets = self.offsets_lock();
        let entry = offsets.entry(channel).or_insert(OffsetFacts { log_start: Some(low), log_end: high });
        // Both only grow (for one topic ID); an older answer racing a newer one must not
        // move them back.
        entry.log_start = Some(entry.log_start.map_or(low, |l| l.max(low)));
        entry.log_end = entry.log_end.max(high);
        Ok(*entry)
    }

    /// Records that the broker acknowledged `offset` on `channel`: the log extends past it.
    pub fn note_acknowledged(&self, channel: ChannelId, offset: Position) {
        let mut offsets = self.offsets_lock();
        let entry = offsets.entry(channel).or_insert(OffsetFacts { log_start: None, log_end: offset + 1 });
        entry.log_end = entry.log_end.max(offset + 1);
    }

    /// Whether the broker answers a metadata request (readiness).
    pub async fn reachable(&self) -> anyhow::Result<()> {
        let client = Arc::clone(&self.client);
        let timeout = self.timeout;
        tokio::task::spawn_blocking(move || {
            client.fetch_metadata(None, timeout).map(|_| ()).context("fetching cluster metadata").map_err(|e| {
                match Diagnosing::diagnose(&client) {
                    Some(d) => e.context(d),
                    None => e,
                }
            })
        })
        .await
        .context("the metadata task panicked")?
    }
}

/// What one describe call learned.
#[derive(Debug, Default)]
struct Described {
    /// Topics that exist, described.
    facts: Vec<TopicFact>,
    /// Asked-for topics the broker says do not exist.
    missing: Vec<String>,
    /// Why some topics could not be described (their existence is unknown).
    errors: Vec<String>,
}

impl Described {
    fn complete(&self) -> anyhow::Result<()> {
        match self.errors.as_slice() {
            [] => Ok(()),
            errors => anyhow::bail!("some topics could not be described: {}", errors.join("; ")),
        }
    }
}

/// Describes `names` (all topics when `None`) by the shared policy: a named topic the
/// broker reports unknown is missing; a topic whose metadata carries another error, or whose
/// describe fails, is reported in `errors` — never as missing.
fn describe(
    client: &BaseConsumer<Diagnosing>,
    names: Option<&[String]>,
    timeout: Duration,
) -> anyhow::Result<Described> {
    let client = client.client();
    let mut out = Described::default();
    let described = match names {
        Some(names) => {
            let mut existing = Vec::new();
            for name in names {
                match facts::named_topic_blocking(client, name, timeout) {
                    Fact::Exists(_) => existing.push(name.clone()),
                    Fact::Gone => out.missing.push(name.clone()),
                    Fact::Unknown(why) => out.errors.push(why),
                }
            }
            facts::describe_each_blocking(client, &existing, timeout, &mut out.errors)?
        }
        None => {
            let listing = facts::list_topics_blocking(client, timeout)?;
            out.errors = listing.errors;
            listing.topics
        }
    };
    out.facts.extend(described.into_iter().map(|d| TopicFact {
        name: d.name,
        id: TopicId::from_bytes(d.id),
        partitions: d.partitions,
    }));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fact(name: &str, id: u8) -> TopicFact {
        TopicFact { name: name.into(), id: TopicId::from_bytes([id; 16]), partitions: 3 }
    }

    #[test]
    fn a_recreated_topic_forgets_its_old_id() {
        let mut t = Topics::default();
        t.insert(fact("orders", 1));
        t.insert(fact("orders", 2));
        assert!(!t.by_id.contains_key(&TopicId::from_bytes([1; 16])));
        assert_eq!(t.by_id.get(&TopicId::from_bytes([2; 16])).map(String::as_str), Some("orders"));
        t.remove_name("orders");
        assert!(t.by_id.is_empty() && t.by_name.is_empty());
    }

    /// Only a complete listing says a topic is gone; after an incomplete one an unlisted ID
    /// is unknown — an error, so the caller answers 503 rather than prune a pair.
    #[tokio::test]
    async fn an_incomplete_listing_never_says_gone() {
        let facts = KafkaFacts::new("127.0.0.1:1", Duration::from_millis(10)).unwrap();
        facts.topics_write().insert(fact("orders", 1));
        let (known, unlisted) = (TopicId::from_bytes([1; 16]), TopicId::from_bytes([9; 16]));
        for complete in [true, false] {
            assert_eq!(facts.name_after_listing(&known, complete).unwrap().as_deref(), Some("orders"));
        }
        assert_eq!(facts.name_after_listing(&unlisted, true).unwrap(), None, "absent from a complete listing: gone");
        let err = facts.name_after_listing(&unlisted, false).unwrap_err();
        assert!(err.to_string().contains("incomplete"), "{err}");

        let partial = Described { errors: vec!["describing topic \"t\": timed out".into()], ..Described::default() };
        assert!(partial.complete().unwrap_err().to_string().contains("timed out"));
        assert!(Described::default().complete().is_ok());
    }

    #[tokio::test]
    async fn acknowledgements_extend_the_log_end_and_never_shrink_it() {
        let facts = KafkaFacts::new("127.0.0.1:1", Duration::from_millis(10)).unwrap();
        let c = ChannelId::new(TopicId::from_bytes([3; 16]), 0);
        facts.note_acknowledged(c, 9);
        facts.note_acknowledged(c, 4);
        assert_eq!(facts.cached_offsets(&c), Some(OffsetFacts { log_start: None, log_end: 10 }));
    }
}
