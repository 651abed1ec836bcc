//! The read gate and the token refresh: pure functions of a session token, the model's
//! received topics, and the clock rows a read fetched. The gateway fetches rows and calls
//! these; the simulator calls the very same functions.
//!
//! Rules, for a read served by tasks `S` of a model with `N` tasks:
//! - A token pair on a channel of a topic the model receives is covered iff the task that
//!   owns that channel (task = partition) records it at or above the pair. That task alone
//!   applies the channel, whichever task serves the read.
//! - A pair on any other (upstream) channel is covered iff every task in `S` records it at
//!   or above the pair. A task with no row for the channel fails closed.
//! - The refreshed token is the old one merged with what the read proved: each served
//!   task's positions on the model's received channels, and for upstream channels only the
//!   meet over all `N` tasks. A served task's position on *another* task's channel is a
//!   cause its data depends on (a record it delivered carried it): the client has now seen
//!   its effect, so the owner must cover it before serving that client again, or the client
//!   could see an effect and then miss its cause. Such a demand always resolves, because
//!   the owner delivers every position on its channel. Never a task's full clock: an
//!   upstream entry one task happens to hold would raise the client's future demands on
//!   tasks that may never hold it.
//!
//! Before the gate, a token's pairs are checked against the log (the gateway on every
//! request, the simulator the same way), by two more pure rules:
//! - [`keeps_pair`], the token's hygiene: a pair is dropped only when its topic is gone
//!   (deleted, or recreated under a new ID), never for its log start, since the token is
//!   stamped on the session's writes and a receiver that has not read the position must
//!   hold the write rather than apply it before a cause it never saw.
//! - [`read_stops_demanding`], what a read demands: a pair on a channel some model receives
//!   is always demanded (its owner's clock keeps its own channels, so the pair is covered
//!   or the owner refuses); any other pair stops being demanded once it is below its log
//!   start (clocks prune such entries, so it could never be covered). The token keeps it.

use std::collections::{BTreeMap, BTreeSet};

use crate::channel::{ChannelId, Position, TopicId};
use crate::past::CausalPast;

/// One clock row: task `task` has delivered past `position` on `channel`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClockRow {
    pub task: u32,
    pub channel: ChannelId,
    pub position: Position,
}

/// The model a read is gated against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// Topic IDs of every topic the model receives.
    pub received_topics: BTreeSet<TopicId>,
    /// The number of tasks (the received topics' common partition count).
    pub task_count: u32,
}

impl ModelShape {
    /// The task that applies `channel`, if the model receives it.
    pub fn owner_of(&self, channel: &ChannelId) -> Option<u32> {
        self.received_topics.contains(&channel.topic).then_some(channel.partition)
    }
}

/// One token pair the read cannot yet prove.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GateGap {
    pub channel: ChannelId,
    pub required: Position,
    /// The lowest position the required tasks record (`None` if any lacks the channel).
    pub recorded: Option<Position>,
    /// The tasks that must record the channel: the owner for a received channel, the
    /// served tasks for an upstream channel.
    pub tasks: Vec<u32>,
}

/// The verdict of the gate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Covered,
    NotCovered { gaps: Vec<GateGap> },
}

impl Verdict {
    pub fn is_covered(&self) -> bool {
        matches!(self, Verdict::Covered)
    }
}

/// Rows indexed by (task, channel), keeping the greatest position if a row repeats.
fn index(rows: &[ClockRow]) -> BTreeMap<(u32, ChannelId), Position> {
    let mut by_key = BTreeMap::new();
    for r in rows {
        let e = by_key.entry((r.task, r.channel)).or_insert(r.position);
        *e = (*e).max(r.position);
    }
    by_key
}

/// Deliberately broken gate and refresh rules, switched on only by the simulator's
/// sabotage meta-tests to prove its oracle catches each one. Not part of the API.
#[cfg(feature = "sim")]
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GateSabotage {
    #[default]
    None,
    /// A pair whose required tasks have no row at all for its channel counts as covered.
    SkipUnrecorded,
    /// A pair on a received channel is checked on the served tasks, not on its owner.
    ServedTaskOnly,
    /// Refresh merges each served task's full clock.
    RefreshFullClock,
    /// The token's hygiene also drops a pair on a channel a model receives once it is below
    /// the log start, though the owner may still hold the record there.
    PruneReceivedBelowLogStart,
}

/// What is known of a token pair's channel when the token is checked against the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PairFact {
    /// The pair's topic no longer resolves (deleted, or recreated under a new ID).
    TopicGone,
    /// The topic resolves. `received`: some model receives the channel; `log_start`: the
    /// channel's log start, when known.
    Live { received: bool, log_start: Option<Position> },
}

/// Whether a session token keeps its pair at `position` on a channel `fact` describes: a
/// pair is dropped only when its topic is gone, never for its log start.
pub fn keeps_pair(fact: PairFact, position: Position) -> bool {
    keeps_pair_rule(fact, position, false)
}

/// [`keeps_pair`] with a deliberate flaw (simulator meta-tests only).
#[cfg(feature = "sim")]
#[doc(hidden)]
pub fn keeps_pair_sabotaged(fact: PairFact, position: Position, sabotage: GateSabotage) -> bool {
    keeps_pair_rule(fact, position, sabotage == GateSabotage::PruneReceivedBelowLogStart)
}

/// The token's hygiene; `prune_received` is `false` outside the simulator's sabotage
/// meta-tests.
fn keeps_pair_rule(fact: PairFact, position: Position, prune_received: bool) -> bool {
    match fact {
        PairFact::TopicGone => false,
        PairFact::Live { received, log_start } => {
            !(prune_received && received && log_start.is_some_and(|start| position < start))
        }
    }
}

/// `token` less the pairs [`keeps_pair`] drops; `fact` describes each pair's channel.
pub fn prune_token(token: CausalPast, fact: impl Fn(&ChannelId) -> PairFact) -> CausalPast {
    token.retain(|c, p| keeps_pair(fact(&c), p))
}

/// [`prune_token`] with a deliberate flaw (simulator meta-tests only).
#[cfg(feature = "sim")]
#[doc(hidden)]
pub fn prune_token_sabotaged(
    token: CausalPast,
    fact: impl Fn(&ChannelId) -> PairFact,
    sabotage: GateSabotage,
) -> CausalPast {
    token.retain(|c, p| keeps_pair_sabotaged(fact(&c), p, sabotage))
}

/// Whether a read stops demanding a token pair at `position` on a channel whose log start
/// is `log_start` (`None`: not known); `received`: some model receives the channel. The
/// token keeps the pair either way ([`keeps_pair`]).
///
/// A pair on a channel some model receives is always demanded: the owning task's clock
/// keeps its own channels, so the pair is eventually covered or the owner refuses
/// (`POSITIONS_DISCARDED_UNREAD`); retention can pass a record the owner still holds, and a
/// read served without it would not show the session's own write. Any other pair stops
/// being demanded once it is below the log start: clocks prune such entries, so it could
/// never be covered.
pub fn read_stops_demanding(received: bool, position: Position, log_start: Option<Position>) -> bool {
    !received && log_start.is_some_and(|start| position < start)
}

/// What a read of `token` demands: the token less the pairs [`read_stops_demanding`] lets
/// go, and less pairs whose topic is gone (which [`prune_token`] drops from the token too).
pub fn read_demand(token: &CausalPast, fact: impl Fn(&ChannelId) -> PairFact) -> CausalPast {
    token.clone().retain(|c, p| match fact(&c) {
        PairFact::TopicGone => false,
        PairFact::Live { received, log_start } => !read_stops_demanding(received, p, log_start),
    })
}

/// Decides whether a read served by `served` may be answered for `token`, listing every gap.
pub fn gate(token: &CausalPast, model: &ModelShape, rows: &[ClockRow], served: &BTreeSet<u32>) -> Verdict {
    gate_rule(token, model, rows, served, false, false)
}

/// [`gate`] with a deliberate flaw (simulator meta-tests only).
#[cfg(feature = "sim")]
#[doc(hidden)]
pub fn gate_sabotaged(
    token: &CausalPast,
    model: &ModelShape,
    rows: &[ClockRow],
    served: &BTreeSet<u32>,
    sabotage: GateSabotage,
) -> Verdict {
    let skip_unrecorded = sabotage == GateSabotage::SkipUnrecorded;
    let served_only = sabotage == GateSabotage::ServedTaskOnly;
    gate_rule(token, model, rows, served, skip_unrecorded, served_only)
}

/// The gate; both flags are `false` outside the simulator's sabotage meta-tests.
fn gate_rule(
    token: &CausalPast,
    model: &ModelShape,
    rows: &[ClockRow],
    served: &BTreeSet<u32>,
    skip_unrecorded: bool,
    served_only: bool,
) -> Verdict {
    let rows = index(rows);
    let mut gaps = Vec::new();
    for (channel, required) in token.iter() {
        let tasks: Vec<u32> = match model.owner_of(&channel) {
            Some(_) if served_only => served.iter().copied().collect(),
            Some(owner) => vec![owner],
            None => served.iter().copied().collect(),
        };
        let mut recorded: Option<Position> = None;
        let mut all_present = true;
        for t in &tasks {
            match rows.get(&(*t, channel)) {
                Some(&p) => recorded = Some(recorded.map_or(p, |r| r.min(p))),
                None => all_present = false,
            }
        }
        // An owner beyond the model's width, or no task at all, can never cover a pair.
        let possible = !tasks.is_empty() && tasks.iter().all(|t| *t < model.task_count);
        let covered =
            possible && all_present && recorded.is_some_and(|r| r >= required) || skip_unrecorded && recorded.is_none();
        if !covered {
            let recorded = if all_present { recorded } else { None };
            gaps.push(GateGap { channel, required, recorded, tasks });
        }
    }
    if gaps.is_empty() {
        Verdict::Covered
    } else {
        Verdict::NotCovered { gaps }
    }
}

/// The token a covered read hands back: `token` merged with what the read proved.
pub fn refresh(token: &CausalPast, model: &ModelShape, rows: &[ClockRow], served: &BTreeSet<u32>) -> CausalPast {
    refresh_rule(token, model, rows, served, false)
}

/// [`refresh`] with a deliberate flaw (simulator meta-tests only).
#[cfg(feature = "sim")]
#[doc(hidden)]
pub fn refresh_sabotaged(
    token: &CausalPast,
    model: &ModelShape,
    rows: &[ClockRow],
    served: &BTreeSet<u32>,
    sabotage: GateSabotage,
) -> CausalPast {
    refresh_rule(token, model, rows, served, sabotage == GateSabotage::RefreshFullClock)
}

/// The refresh; `full_clock` is `false` outside the simulator's sabotage meta-tests.
fn refresh_rule(
    token: &CausalPast,
    model: &ModelShape,
    rows: &[ClockRow],
    served: &BTreeSet<u32>,
    full_clock: bool,
) -> CausalPast {
    let rows = index(rows);
    let mut proved: Vec<(ChannelId, Position)> = Vec::new();
    // Upstream channels: the meet over all tasks, only if every task records the channel.
    let mut meet: BTreeMap<ChannelId, (Position, BTreeSet<u32>)> = BTreeMap::new();
    for (&(task, channel), &position) in &rows {
        if task >= model.task_count {
            continue;
        }
        if full_clock && served.contains(&task) {
            proved.push((channel, position));
        }
        match model.owner_of(&channel) {
            Some(_) => {
                if served.contains(&task) {
                    proved.push((channel, position));
                }
            }
            None => {
                let e = meet.entry(channel).or_insert((position, BTreeSet::new()));
                e.0 = e.0.min(position);
                e.1.insert(task);
            }
        }
    }
    for (channel, (position, tasks)) in meet {
        if tasks.len() as u32 == model.task_count {
            proved.push((channel, position));
        }
    }
    token.clone().merge_past(&CausalPast::from_pairs(proved))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topic(b: u8) -> TopicId {
        TopicId::from_bytes([b; 16])
    }
    fn ch(t: u8, p: u32) -> ChannelId {
        ChannelId::new(topic(t), p)
    }
    fn row(task: u32, channel: ChannelId, position: Position) -> ClockRow {
        ClockRow { task, channel, position }
    }
    fn model() -> ModelShape {
        ModelShape { received_topics: [topic(1)].into_iter().collect(), task_count: 2 }
    }
    fn served(t: &[u32]) -> BTreeSet<u32> {
        t.iter().copied().collect()
    }

    #[test]
    fn received_channel_pairs_are_checked_on_their_owner() {
        let rows = [row(0, ch(1, 0), 10), row(1, ch(1, 1), 3)];
        // Token names partition 1; the read is served by task 0; task 1 must cover it.
        let token = CausalPast::from_pairs([(ch(1, 1), 3)]);
        assert!(gate(&token, &model(), &rows, &served(&[0])).is_covered());
        let token = CausalPast::from_pairs([(ch(1, 1), 4)]);
        assert_eq!(
            gate(&token, &model(), &rows, &served(&[0])),
            Verdict::NotCovered {
                gaps: vec![GateGap { channel: ch(1, 1), required: 4, recorded: Some(3), tasks: vec![1] }]
            }
        );
        // A row on a received channel held by a non-owner does not count.
        let rows = [row(0, ch(1, 1), 99)];
        let token = CausalPast::from_pairs([(ch(1, 1), 1)]);
        assert!(!gate(&token, &model(), &rows, &served(&[0])).is_covered());
    }

    #[test]
    fn upstream_pairs_need_every_served_task_and_fail_closed() {
        let up = ch(7, 0);
        let rows = [row(0, up, 5), row(1, up, 2)];
        let token = CausalPast::from_pairs([(up, 4)]);
        assert!(gate(&token, &model(), &rows, &served(&[0])).is_covered());
        assert_eq!(
            gate(&token, &model(), &rows, &served(&[0, 1])),
            Verdict::NotCovered {
                gaps: vec![GateGap { channel: up, required: 4, recorded: Some(2), tasks: vec![0, 1] }]
            }
        );
        // A served task with no row for the channel: a gap with nothing recorded.
        let rows = [row(0, up, 5)];
        assert_eq!(
            gate(&token, &model(), &rows, &served(&[0, 1])),
            Verdict::NotCovered { gaps: vec![GateGap { channel: up, required: 4, recorded: None, tasks: vec![0, 1] }] }
        );
        // An empty token is always covered.
        assert!(gate(&CausalPast::new(), &model(), &[], &served(&[0])).is_covered());
    }

    #[test]
    fn owner_beyond_width_is_never_covered() {
        let rows = [row(5, ch(1, 5), 100)];
        let token = CausalPast::from_pairs([(ch(1, 5), 0)]);
        assert!(!gate(&token, &model(), &rows, &served(&[0])).is_covered());
    }

    #[test]
    fn refresh_takes_owned_positions_and_the_upstream_meet_only() {
        let up = ch(7, 0);
        let lonely = ch(8, 0);
        let rows = [
            row(0, ch(1, 0), 10),
            row(1, ch(1, 1), 20),
            row(0, ch(1, 1), 15), // a cause task 0's data depends on: task 1 must cover it next
            row(0, up, 5),
            row(1, up, 3),
            row(0, lonely, 9), // only one task records it: no meet
        ];
        let token = CausalPast::from_pairs([(ch(9, 0), 1)]);
        let fresh = refresh(&token, &model(), &rows, &served(&[0]));
        assert_eq!(fresh, CausalPast::from_pairs([(ch(9, 0), 1), (ch(1, 0), 10), (ch(1, 1), 15), (up, 3)]));
        let fresh_all = refresh(&token, &model(), &rows, &served(&[0, 1]));
        assert_eq!(fresh_all, CausalPast::from_pairs([(ch(9, 0), 1), (ch(1, 0), 10), (ch(1, 1), 20), (up, 3)]));
        // Refresh never lowers the token.
        let high = CausalPast::from_pairs([(ch(1, 0), 50)]);
        assert_eq!(refresh(&high, &model(), &rows, &served(&[0])).get(&ch(1, 0)), Some(50));
    }

    /// `(received, position, log_start, no longer demanded)`.
    fn check_demand(cases: &[(bool, Position, Option<Position>, bool)]) {
        for &(received, position, log_start, dropped) in cases {
            assert_eq!(
                read_stops_demanding(received, position, log_start),
                dropped,
                "received {received}, position {position}, log start {log_start:?}"
            );
        }
    }

    #[test]
    fn reads_keep_demanding_received_channels_whatever_their_log_start() {
        check_demand(&[
            // A received channel: demanded below, at and above the log start, and when unknown.
            (true, 3, Some(10), false),
            (true, 0, Some(1), false),
            (true, 10, Some(10), false),
            (true, 11, Some(10), false),
            (true, 3, None, false),
            // Any other channel: no longer demanded strictly below a known log start only.
            (false, 3, Some(10), true),
            (false, 0, Some(1), true),
            (false, 9, Some(10), true),
            (false, 10, Some(10), false),
            (false, 11, Some(10), false),
            (false, 3, None, false),
        ]);
    }

    #[test]
    fn a_token_drops_a_pair_only_with_its_topic() {
        for received in [true, false] {
            for log_start in [None, Some(0), Some(3), Some(4), Some(100)] {
                assert!(keeps_pair(PairFact::Live { received, log_start }, 3), "{received} {log_start:?}");
            }
        }
        assert!(!keeps_pair(PairFact::TopicGone, 3));
        // Over a token: the gone topic's pair leaves; pairs below their log start stay, and a
        // read stops demanding only the one on a channel no model receives.
        let (gone, own, up, fresh) = (ch(5, 0), ch(1, 0), ch(7, 0), ch(7, 1));
        let token = CausalPast::from_pairs([(gone, 1), (own, 2), (up, 3), (fresh, 4)]);
        let fact = |c: &ChannelId| match c.topic {
            t if t == topic(5) => PairFact::TopicGone,
            t => PairFact::Live { received: t == topic(1), log_start: Some(if c.partition == 0 { 10 } else { 4 }) },
        };
        let kept = prune_token(token.clone(), fact);
        assert_eq!(kept, CausalPast::from_pairs([(own, 2), (up, 3), (fresh, 4)]));
        assert_eq!(read_demand(&kept, fact), CausalPast::from_pairs([(own, 2), (fresh, 4)]));
        assert_eq!(read_demand(&token, fact), CausalPast::from_pairs([(own, 2), (fresh, 4)]));
    }

    /// The sabotage hook breaks the shipped rule: a received channel's pair below its log
    /// start leaves the token; nothing else changes.
    #[cfg(feature = "sim")]
    #[test]
    fn the_sabotaged_hygiene_drops_received_pairs_below_the_log_start() {
        let flawed = |fact, position| keeps_pair_sabotaged(fact, position, GateSabotage::PruneReceivedBelowLogStart);
        assert!(!flawed(PairFact::Live { received: true, log_start: Some(4) }, 3));
        assert!(flawed(PairFact::Live { received: true, log_start: Some(3) }, 3));
        assert!(flawed(PairFact::Live { received: false, log_start: Some(4) }, 3));
        assert!(flawed(PairFact::Live { received: true, log_start: None }, 3));
        assert!(keeps_pair_sabotaged(PairFact::Live { received: true, log_start: Some(4) }, 3, GateSabotage::None));
    }

    /// Found by the simulator (seed 0 of the soak sweep): client A writes w1 to key k1
    /// (channel (1,1), owned by task 1), then r to key k2 (channel (1,0), task 0), so r
    /// carries (1,1)@15. Task 0 delivers r, recording (1,1)@15. Client B reads k2 from task
    /// 0 and sees r — an effect of w1. If the refresh kept only task 0's own channel, B's
    /// next read of k1 from task 1 would pass the gate before task 1 delivered w1, and B
    /// would see r's effect without its cause.
    #[test]
    fn refresh_carries_the_causes_a_served_task_delivered_on_other_channels() {
        let rows = [row(0, ch(1, 0), 3), row(0, ch(1, 1), 15), row(1, ch(1, 1), 10)];
        let after_reading_k2 = refresh(&CausalPast::new(), &model(), &rows, &served(&[0]));
        assert_eq!(after_reading_k2.get(&ch(1, 1)), Some(15));
        assert_eq!(
            gate(&after_reading_k2, &model(), &rows, &served(&[1])),
            Verdict::NotCovered {
                gaps: vec![GateGap { channel: ch(1, 1), required: 15, recorded: Some(10), tasks: vec![1] }]
            },
            "task 1 has not delivered w1 yet: the read of k1 waits"
        );
        let later = [row(0, ch(1, 0), 3), row(0, ch(1, 1), 15), row(1, ch(1, 1), 15)];
        assert!(gate(&after_reading_k2, &model(), &later, &served(&[1])).is_covered());
    }
}
