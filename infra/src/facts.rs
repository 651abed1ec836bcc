//! The broker-facts policy, written once for the projector and the gateway: what the broker
//! says about a topic, and when that means the topic is gone.
//!
//! **A topic is gone only when the broker says so**: a topic asked for by name that the
//! broker reports unknown (`UNKNOWN_TOPIC_OR_PART`), or a topic ID absent from a *complete*
//! listing of the cluster's topics. A topic the broker lists but does not describe (no
//! leader yet, an error, a timeout) makes the listing incomplete, and an ID absent from an
//! incomplete listing is **unknown** — never gone: gone prunes clock pairs and token pairs,
//! unknown only waits (the projector keeps the pair, the gateway answers 503).
//!
//! [`classify`] is the rule; [`list_topics_blocking`] and [`named_topic_blocking`] fetch what
//! it is applied to. Both block the calling thread (run them on tokio's blocking pool).

use std::time::Duration;

use anyhow::Context as _;
use rdkafka::client::{Client, ClientContext};
use rdkafka::types::RDKafkaRespErr;

use crate::topic_id::{describe_topics_blocking, TopicDescription};

/// What is known about a topic (or one of its partitions).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fact<T> {
    /// It exists; what was learned about it.
    Exists(T),
    /// The broker says it does not exist.
    Gone,
    /// Nothing could be learned (why): it may exist or be gone.
    Unknown(String),
}

impl<T> Fact<T> {
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Fact<U> {
        match self {
            Fact::Exists(t) => Fact::Exists(f(t)),
            Fact::Gone => Fact::Gone,
            Fact::Unknown(why) => Fact::Unknown(why),
        }
    }
}

/// The rule: a topic `found` in a listing exists; one a `complete` listing lacks is gone;
/// one an incomplete listing lacks is unknown.
pub fn classify<T>(found: Option<T>, complete: bool) -> Fact<T> {
    match found {
        Some(t) => Fact::Exists(t),
        None if complete => Fact::Gone,
        None => Fact::Unknown("not in an incomplete topic listing: it may exist or be gone".to_string()),
    }
}

/// The rule for a topic asked for by name: the metadata error the broker answered with for
/// it (`None`: no error, it exists). Only `UNKNOWN_TOPIC_OR_PART` says gone; any other error
/// is unknown.
pub fn classify_named(error: Option<RDKafkaRespErr>) -> Fact<()> {
    match error {
        None => Fact::Exists(()),
        Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART) => Fact::Gone,
        Some(e) => Fact::Unknown(format!("error {e:?}")),
    }
}

/// One listing of the cluster's topics: every topic that answered, described, and why the
/// others did not (their existence is unknown).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listing {
    pub topics: Vec<TopicDescription>,
    /// One message per topic (or request) that did not answer; empty: the listing is
    /// complete.
    pub errors: Vec<String>,
}

impl Listing {
    /// Whether every listed topic answered: only then does absence mean gone.
    pub fn is_complete(&self) -> bool {
        self.errors.is_empty()
    }

    /// The fact of topic `id`, by [`classify`].
    pub fn topic(&self, id: &[u8; 16]) -> Fact<&TopicDescription> {
        classify(self.topics.iter().find(|t| t.id == *id), self.is_complete())
    }

    /// The fact of partition `partition` of topic `id`: a partition beyond its topic's count
    /// never existed under that ID, so it is gone like the topic would be.
    pub fn channel(&self, id: &[u8; 16], partition: u32) -> Fact<&TopicDescription> {
        match self.topic(id) {
            Fact::Exists(t) if partition >= t.partitions => Fact::Gone,
            fact => fact,
        }
    }
}

/// Lists the cluster's topics (one metadata request) and describes those that answered
/// (their IDs and partition counts). `Err` only when the listing itself failed, or when no
/// listed topic could be described at all: then nothing is known.
pub fn list_topics_blocking<C: ClientContext>(client: &Client<C>, timeout: Duration) -> anyhow::Result<Listing> {
    let metadata = client.fetch_metadata(None, timeout).context("listing the cluster's topics")?;
    let mut names = Vec::new();
    let mut errors = Vec::new();
    for topic in metadata.topics() {
        match topic.error() {
            None => names.push(topic.name().to_string()),
            // Listed but not answering (no leader yet, say): its ID is not known, so the
            // listing is incomplete.
            Some(e) => errors.push(format!("metadata of topic {:?}: error {e:?}", topic.name())),
        }
    }
    let topics = describe_each_blocking(client, &names, timeout, &mut errors)?;
    Ok(Listing { topics, errors })
}

/// Describes `names` in one call; if that fails (one topic deleted, or not describable,
/// between the listing and the describe fails the whole call), one by one, keeping what
/// answers and adding an error per topic that does not. `Err` when none answers.
pub fn describe_each_blocking<C: ClientContext>(
    client: &Client<C>,
    names: &[String],
    timeout: Duration,
    errors: &mut Vec<String>,
) -> anyhow::Result<Vec<TopicDescription>> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    match describe_topics_blocking(client, names, timeout) {
        Ok(described) => Ok(described),
        Err(whole) => {
            let mut each = Vec::with_capacity(names.len());
            for name in names {
                match describe_topics_blocking(client, std::slice::from_ref(name), timeout) {
                    Ok(d) => each.extend(d),
                    Err(e) => errors.push(format!("describing topic {name:?}: {e:#}")),
                }
            }
            if each.is_empty() {
                return Err(whole.context("describing topics"));
            }
            Ok(each)
        }
    }
}

/// Asks the broker about topic `name` (one metadata request) and classifies the answer by
/// [`classify_named`]; a failed request is unknown. `Exists` carries the partition count
/// the metadata reports.
pub fn named_topic_blocking<C: ClientContext>(client: &Client<C>, name: &str, timeout: Duration) -> Fact<u32> {
    let metadata = match client.fetch_metadata(Some(name), timeout) {
        Ok(m) => m,
        Err(e) => return Fact::Unknown(format!("fetching metadata of topic {name:?}: {e}")),
    };
    let Some(topic) = metadata.topics().iter().find(|t| t.name() == name) else {
        return Fact::Unknown(format!("the broker's metadata does not mention topic {name:?}"));
    };
    match classify_named(topic.error()) {
        Fact::Unknown(why) => Fact::Unknown(format!("metadata of topic {name:?}: {why}")),
        fact => fact.map(|()| topic.partitions().len() as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topic(name: &str, id: u8, partitions: u32) -> TopicDescription {
        TopicDescription { name: name.to_string(), id: [id; 16], partitions }
    }

    #[test]
    fn only_a_complete_listing_says_gone() {
        assert_eq!(classify(Some(7), true), Fact::Exists(7));
        assert_eq!(classify(Some(7), false), Fact::Exists(7));
        assert_eq!(classify::<u8>(None, true), Fact::Gone);
        assert!(matches!(classify::<u8>(None, false), Fact::Unknown(why) if why.contains("incomplete")));
    }

    #[test]
    fn a_named_topic_is_gone_only_when_the_broker_says_unknown_topic() {
        assert_eq!(classify_named(None), Fact::Exists(()));
        assert_eq!(classify_named(Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART)), Fact::Gone);
        for e in [
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_LEADER_NOT_AVAILABLE,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
        ] {
            assert!(matches!(classify_named(Some(e)), Fact::Unknown(_)), "{e:?}");
        }
    }

    #[test]
    fn a_listing_classifies_topics_and_channels() {
        let complete = Listing { topics: vec![topic("orders", 1, 3)], errors: vec![] };
        assert!(complete.is_complete());
        assert_eq!(complete.topic(&[1; 16]), Fact::Exists(&complete.topics[0]));
        assert_eq!(complete.topic(&[9; 16]), Fact::Gone, "absent from a complete listing");
        assert_eq!(complete.channel(&[1; 16], 2), Fact::Exists(&complete.topics[0]));
        assert_eq!(complete.channel(&[1; 16], 3), Fact::Gone, "a partition beyond the count");
        assert_eq!(complete.channel(&[9; 16], 0), Fact::Gone);

        let partial =
            Listing { topics: vec![topic("orders", 1, 3)], errors: vec!["describing \"t\": timed out".into()] };
        assert!(!partial.is_complete());
        assert_eq!(partial.topic(&[1; 16]), Fact::Exists(&partial.topics[0]), "what answered is known");
        assert!(matches!(partial.topic(&[9; 16]), Fact::Unknown(_)), "absent from an incomplete listing");
        assert!(matches!(partial.channel(&[9; 16], 0), Fact::Unknown(_)));
        assert_eq!(partial.channel(&[1; 16], 5), Fact::Gone, "the topic answered: its count is known");
    }
}
