//! Refusals: the engine stops delivering, with a named reason and a diagnosis, rather than
//! weaken the guarantee. A refusal recurs identically on restart until an operator acts.

use std::fmt;

use crate::channel::{ChannelId, Position};

/// Why a task stopped delivering. The names are stable: they appear in status, metrics,
/// logs and problem documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RefusalReason {
    /// A `parsley.causes` value broke the grammar, or was null, empty or repeated.
    UndecodableMetadata,
    /// A `parsley.causes` value (received or to be sent) exceeded the metadata budget.
    MetadataBudgetExceeded,
    /// Retention passed a position on a received channel that the task has not settled:
    /// one never read, or a record still held.
    PositionsDiscardedUnread,
    /// The host fed a channel at or below a position it had already fed in this execution.
    OutOfOrderFeed,
    /// A topic name now resolves to a different topic ID than the one on record.
    ChannelIdentityChanged,
    /// A received topic was deleted while the task still held records from it.
    ChannelDeletedWithUndeliveredMessages,
    /// A redeclaration dropped a channel that still holds records.
    ChannelRemovedWithHeldMessages,
    /// The received topics' partition count changed under existing state.
    TaskWidthChanged,
    /// Stored ordering state is in a format this build cannot trust.
    UnknownOrderingStateFormat,
    /// An application tried to set a header in the reserved `parsley.` namespace.
    ReservedHeaderUsed,
    /// The substrate is configured in a way the guarantee cannot survive.
    SubstrateMisconfigured,
    /// A record names its own channel at or above its own position: a cause that cannot
    /// exist, which would otherwise hold the channel forever.
    ImpossibleSelfCause,
    /// The projection rejected a delivered record for a reason a retry cannot change (a
    /// value it cannot parse, a constraint, a string the database cannot represent). Only
    /// an operator's `skip` of that record, or a fixed projection, gets past it.
    ProjectionRejected,
    /// Holding one more record would pass the task's configured bound on held records or
    /// held bytes.
    HeldLimitExceeded,
    /// A keyed record is on another partition than its topic's partitioner places its key
    /// on: its task is not the one that owns the key, so two tasks would write one
    /// document and reads of the key would wait on the wrong task's clock. Delivered
    /// through the projection's rejection path: refused at the record (or dead-lettered).
    KeyPartitionMismatch,
}

impl RefusalReason {
    pub const ALL: [RefusalReason; 15] = [
        RefusalReason::UndecodableMetadata,
        RefusalReason::MetadataBudgetExceeded,
        RefusalReason::PositionsDiscardedUnread,
        RefusalReason::OutOfOrderFeed,
        RefusalReason::ChannelIdentityChanged,
        RefusalReason::ChannelDeletedWithUndeliveredMessages,
        RefusalReason::ChannelRemovedWithHeldMessages,
        RefusalReason::TaskWidthChanged,
        RefusalReason::UnknownOrderingStateFormat,
        RefusalReason::ReservedHeaderUsed,
        RefusalReason::SubstrateMisconfigured,
        RefusalReason::ImpossibleSelfCause,
        RefusalReason::ProjectionRejected,
        RefusalReason::HeldLimitExceeded,
        RefusalReason::KeyPartitionMismatch,
    ];

    pub fn as_str(&self) -> &'static str {
        match self {
            RefusalReason::UndecodableMetadata => "UNDECODABLE_METADATA",
            RefusalReason::MetadataBudgetExceeded => "METADATA_BUDGET_EXCEEDED",
            RefusalReason::PositionsDiscardedUnread => "POSITIONS_DISCARDED_UNREAD",
            RefusalReason::OutOfOrderFeed => "OUT_OF_ORDER_FEED",
            RefusalReason::ChannelIdentityChanged => "CHANNEL_IDENTITY_CHANGED",
            RefusalReason::ChannelDeletedWithUndeliveredMessages => "CHANNEL_DELETED_WITH_UNDELIVERED_MESSAGES",
            RefusalReason::ChannelRemovedWithHeldMessages => "CHANNEL_REMOVED_WITH_HELD_MESSAGES",
            RefusalReason::TaskWidthChanged => "TASK_WIDTH_CHANGED",
            RefusalReason::UnknownOrderingStateFormat => "UNKNOWN_ORDERING_STATE_FORMAT",
            RefusalReason::ReservedHeaderUsed => "RESERVED_HEADER_USED",
            RefusalReason::SubstrateMisconfigured => "SUBSTRATE_MISCONFIGURED",
            RefusalReason::ImpossibleSelfCause => "IMPOSSIBLE_SELF_CAUSE",
            RefusalReason::ProjectionRejected => "PROJECTION_REJECTED",
            RefusalReason::HeldLimitExceeded => "HELD_LIMIT_EXCEEDED",
            RefusalReason::KeyPartitionMismatch => "KEY_PARTITION_MISMATCH",
        }
    }

    pub fn parse(name: &str) -> Option<RefusalReason> {
        RefusalReason::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

impl fmt::Display for RefusalReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refusal: the reason, where it happened (when it concerns one channel), and a
/// diagnosis for the operator.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {diagnosis}")]
pub struct Refusal {
    pub reason: RefusalReason,
    pub channel: Option<ChannelId>,
    pub position: Option<Position>,
    pub diagnosis: String,
}

impl Refusal {
    pub fn new(reason: RefusalReason, diagnosis: impl Into<String>) -> Self {
        Refusal { reason, channel: None, position: None, diagnosis: diagnosis.into() }
    }

    pub fn at(
        reason: RefusalReason,
        channel: ChannelId,
        position: Option<Position>,
        diagnosis: impl Into<String>,
    ) -> Self {
        Refusal { reason, channel: Some(channel), position, diagnosis: diagnosis.into() }
    }
}

/// Refuses an application-supplied header in the reserved `parsley.` namespace. Compares
/// bytes, so a name of any characters (or none) is checked without slicing inside one.
pub fn check_application_header(name: &str) -> Result<(), Refusal> {
    if is_reserved_header(name.as_bytes()) {
        return Err(Refusal::new(
            RefusalReason::ReservedHeaderUsed,
            format!("header {name:?} is in the reserved namespace \"parsley.\""),
        ));
    }
    Ok(())
}

/// Whether a header name (as bytes: Kafka header names need not be UTF-8) is in the
/// reserved `parsley.` namespace, compared ASCII-case-insensitively.
pub fn is_reserved_header(name: &[u8]) -> bool {
    let prefix = crate::codec::RESERVED_PREFIX.as_bytes();
    name.len() >= prefix.len() && name[..prefix.len()].eq_ignore_ascii_case(prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for r in RefusalReason::ALL {
            assert_eq!(RefusalReason::parse(r.as_str()), Some(r));
        }
        assert_eq!(RefusalReason::parse("NOPE"), None);
    }

    #[test]
    fn reserved_headers_are_refused_case_insensitively() {
        assert!(check_application_header("trace-id").is_ok());
        assert!(check_application_header("parsley").is_ok());
        for name in ["parsley.causes", "parsley.x", "Parsley.Causes", "PARSLEY."] {
            let err = check_application_header(name).unwrap_err();
            assert_eq!(err.reason, RefusalReason::ReservedHeaderUsed);
        }
    }

    #[test]
    fn header_names_of_any_characters_are_checked_without_panicking() {
        // Names whose multibyte characters straddle the prefix's length are checked whole.
        for name in ["abcdefgé", "é", "", "ééééé", "parsleé.", "pârsley.x", "\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}"]
        {
            assert!(check_application_header(name).is_ok(), "{name:?}");
        }
        assert!(check_application_header("parsley.é").is_err());
        assert!(is_reserved_header(b"PARSLEY.\xff\xfe"));
        assert!(!is_reserved_header(b"\xffarsley.x"));
    }
}
