//! Pure checks a host runs before starting a model's tasks: co-partitioning, task width
//! and topic identity against what the ordering state recorded.

use crate::channel::TopicId;
use crate::refusal::{Refusal, RefusalReason};

/// What the substrate says of one declared topic now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedTopic {
    pub name: String,
    /// `None` when the name no longer resolves (the topic was deleted).
    pub id: Option<TopicId>,
    pub partitions: u32,
}

/// The common partition count of a model's received topics — its number of tasks.
/// Refuses `SUBSTRATE_MISCONFIGURED` when they differ or a topic has no partitions.
pub fn task_width(topics: &[ResolvedTopic]) -> Result<u32, Refusal> {
    let Some(first) = topics.first() else {
        return Err(Refusal::new(RefusalReason::SubstrateMisconfigured, "the model receives no topics"));
    };
    if first.partitions == 0 || topics.iter().any(|t| t.partitions != first.partitions) {
        let shape: Vec<String> = topics.iter().map(|t| format!("{}={}", t.name, t.partitions)).collect();
        return Err(Refusal::new(
            RefusalReason::SubstrateMisconfigured,
            format!("received topics must be co-partitioned (equal partition counts), found {}", shape.join(", ")),
        ));
    }
    Ok(first.partitions)
}

/// Refuses `TASK_WIDTH_CHANGED` when existing state was written for another task count.
pub fn check_task_width(recorded: Option<u32>, observed: u32) -> Result<(), Refusal> {
    match recorded {
        Some(r) if r != observed => Err(Refusal::new(
            RefusalReason::TaskWidthChanged,
            format!(
                "ordering state was written for {r} tasks but the received topics now have {observed} partitions; \
                 keys would move between tasks, so the state cannot be reused"
            ),
        )),
        _ => Ok(()),
    }
}

/// Checks a declared topic against the identity on record.
///
/// - a name that now resolves to another topic ID: `CHANNEL_IDENTITY_CHANGED`;
/// - a recorded topic that no longer resolves while the task holds records from it:
///   `CHANNEL_DELETED_WITH_UNDELIVERED_MESSAGES`;
/// - a topic that does not resolve at all otherwise: `SUBSTRATE_MISCONFIGURED`.
pub fn check_topic_identity(
    topic: &ResolvedTopic,
    recorded: Option<TopicId>,
    held_on_topic: usize,
) -> Result<TopicId, Refusal> {
    identity_rule(topic, recorded, held_on_topic, false)
}

/// [`check_topic_identity`] with its sabotage hook (simulator only): `ignore_recreation`
/// resolves the topic by name, going on under a recreated one.
#[cfg(feature = "sim")]
pub fn check_topic_identity_sabotaged(
    topic: &ResolvedTopic,
    recorded: Option<TopicId>,
    held_on_topic: usize,
    ignore_recreation: bool,
) -> Result<TopicId, Refusal> {
    identity_rule(topic, recorded, held_on_topic, ignore_recreation)
}

fn identity_rule(
    topic: &ResolvedTopic,
    recorded: Option<TopicId>,
    held_on_topic: usize,
    ignore_recreation: bool,
) -> Result<TopicId, Refusal> {
    match (topic.id, recorded) {
        (Some(now), Some(then)) if now != then && !ignore_recreation => Err(Refusal::new(
            RefusalReason::ChannelIdentityChanged,
            format!(
                "topic {:?} was {then} when this state was written and is now {now}: \
                 it was deleted and recreated, and positions in the new topic mean nothing to this state",
                topic.name
            ),
        )),
        (Some(now), _) => Ok(now),
        (None, Some(then)) if held_on_topic > 0 => Err(Refusal::new(
            RefusalReason::ChannelDeletedWithUndeliveredMessages,
            format!(
                "topic {:?} ({then}) was deleted while {held_on_topic} of its records are held undelivered",
                topic.name
            ),
        )),
        (None, _) => Err(Refusal::new(
            RefusalReason::SubstrateMisconfigured,
            format!("declared topic {:?} does not exist", topic.name),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, id: Option<u8>, partitions: u32) -> ResolvedTopic {
        ResolvedTopic { name: name.into(), id: id.map(|b| TopicId::from_bytes([b; 16])), partitions }
    }

    #[test]
    fn width_requires_co_partitioning() {
        assert_eq!(task_width(&[t("a", Some(1), 4), t("b", Some(2), 4)]), Ok(4));
        let err = task_width(&[t("a", Some(1), 4), t("b", Some(2), 3)]).unwrap_err();
        assert_eq!(err.reason, RefusalReason::SubstrateMisconfigured);
        assert!(err.diagnosis.contains("a=4") && err.diagnosis.contains("b=3"));
        assert!(task_width(&[]).is_err());
    }

    #[test]
    fn width_change_is_refused() {
        assert!(check_task_width(None, 4).is_ok());
        assert!(check_task_width(Some(4), 4).is_ok());
        assert_eq!(check_task_width(Some(4), 6).unwrap_err().reason, RefusalReason::TaskWidthChanged);
    }

    #[test]
    fn identity_checks() {
        let one = Some(TopicId::from_bytes([1; 16]));
        assert!(check_topic_identity(&t("a", Some(1), 1), one, 0).is_ok());
        assert!(check_topic_identity(&t("a", Some(1), 1), None, 0).is_ok());
        assert_eq!(
            check_topic_identity(&t("a", Some(2), 1), one, 0).unwrap_err().reason,
            RefusalReason::ChannelIdentityChanged
        );
        assert_eq!(
            check_topic_identity(&t("a", None, 0), one, 3).unwrap_err().reason,
            RefusalReason::ChannelDeletedWithUndeliveredMessages
        );
        assert_eq!(
            check_topic_identity(&t("a", None, 0), one, 0).unwrap_err().reason,
            RefusalReason::SubstrateMisconfigured
        );
    }
}
