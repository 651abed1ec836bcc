//! The decision unit: the one place delivery is decided. A pure function of its
//! arguments — no clock, no timestamps, no I/O — so the simulator, the Postgres host and a
//! reader of this file all see the same rule.

use std::collections::BTreeSet;

use crate::channel::{ChannelId, Position};
use crate::past::CausalPast;

/// A cause that keeps a record from being delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocker {
    pub channel: ChannelId,
    /// The position on `channel` that must be settled first.
    pub required: Position,
    /// How far `channel` is settled now; `None` before anything is known of it.
    pub settled: Option<Position>,
}

/// The verdict for one record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Deliverable,
    Held { blockers: Vec<Blocker> },
}

impl Decision {
    pub fn is_deliverable(&self) -> bool {
        matches!(self, Decision::Deliverable)
    }
}

/// Decides whether a record carrying `causes` may be delivered by a task receiving
/// `received`, where `settled(c)` is how far received channel `c` is settled (every position
/// at or below it is delivered or will never yield a record), or `None` if unknown.
///
/// Deliverable iff for every pair `(c, p)`: `c` is not received, or `settled(c)` is known
/// and `p <= settled(c)`. Causes on channels the task does not receive are not its to
/// wait for: another task delivers them.
pub fn decide(
    causes: &CausalPast,
    received: &BTreeSet<ChannelId>,
    settled: impl Fn(&ChannelId) -> Option<Position>,
) -> Decision {
    let mut blockers = Vec::new();
    // Both sequences are sorted by channel: walk them together, linear in their widths.
    let mut received_iter = received.iter().peekable();
    for (channel, required) in causes.iter() {
        while received_iter.next_if(|r| **r < channel).is_some() {}
        if received_iter.peek() != Some(&&channel) {
            continue;
        }
        let now = settled(&channel);
        if now.is_none_or(|s| s < required) {
            blockers.push(Blocker { channel, required, settled: now });
        }
    }
    if blockers.is_empty() {
        Decision::Deliverable
    } else {
        Decision::Held { blockers }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::TopicId;
    use std::collections::BTreeMap;

    fn ch(t: u8, p: u32) -> ChannelId {
        ChannelId::new(TopicId::from_bytes([t; 16]), p)
    }

    /// One row of the decision table: causes, received channels, settled positions, and the
    /// blockers expected (empty = deliverable).
    fn check(
        causes: &[(ChannelId, Position)],
        received: &[ChannelId],
        settled: &[(ChannelId, Position)],
        expected: &[Blocker],
    ) {
        let causes = CausalPast::from_pairs(causes.iter().copied());
        let received: BTreeSet<ChannelId> = received.iter().copied().collect();
        let settled: BTreeMap<ChannelId, Position> = settled.iter().copied().collect();
        let got = decide(&causes, &received, |c| settled.get(c).copied());
        let want =
            if expected.is_empty() { Decision::Deliverable } else { Decision::Held { blockers: expected.to_vec() } };
        assert_eq!(got, want, "causes {causes:?} received {received:?} settled {settled:?}");
    }

    #[test]
    fn decision_table() {
        let (a, b, x) = (ch(1, 0), ch(2, 0), ch(9, 0));
        // No causes: deliverable at once.
        check(&[], &[a], &[], &[]);
        // Cause on a channel not received: ignored, whatever its position.
        check(&[(x, 1_000)], &[a], &[], &[]);
        // Cause on a received channel, settled at or beyond it.
        check(&[(a, 5)], &[a], &[(a, 5)], &[]);
        check(&[(a, 5)], &[a], &[(a, 9)], &[]);
        // Settled below the cause: held, the blocker names both positions.
        check(&[(a, 5)], &[a], &[(a, 4)], &[Blocker { channel: a, required: 5, settled: Some(4) }]);
        // Nothing known of the channel yet: held with settled unknown.
        check(&[(a, 0)], &[a], &[], &[Blocker { channel: a, required: 0, settled: None }]);
        // Several causes: every blocker is listed, in channel order.
        check(
            &[(b, 3), (a, 7), (x, 2)],
            &[a, b],
            &[(a, 1), (b, 2)],
            &[
                Blocker { channel: a, required: 7, settled: Some(1) },
                Blocker { channel: b, required: 3, settled: Some(2) },
            ],
        );
        // One satisfied, one not.
        check(&[(a, 1), (b, 3)], &[a, b], &[(a, 1), (b, 2)], &[Blocker { channel: b, required: 3, settled: Some(2) }]);
        // Settled of -1 (nothing fed yet) holds position 0.
        check(&[(a, 0)], &[a], &[(a, -1)], &[Blocker { channel: a, required: 0, settled: Some(-1) }]);
    }
}
