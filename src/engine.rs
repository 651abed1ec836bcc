//! The process engine for one task: receive, hold, decide, deliver. Records go in; the
//! deliveries and the state changes a host must persist come out as values. No I/O.
//!
//! The engine mutates its memory as it goes. A host stages the changes of one step
//! ([`Engine::take_changes`]) into one transaction with the projection writes; if that
//! transaction does not commit, the host discards the engine and restores a new one from
//! what it persisted ([`Engine::restore`]). The engine never assumes a commit happened.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::channel::{ChannelId, Position, TopicId};
use crate::codec::{self, DecodeError};
use crate::decide::{decide, Blocker, Decision};
use crate::past::CausalPast;
use crate::refusal::{Refusal, RefusalReason};

/// The ordering-state format this build writes and can restore.
pub const ORDERING_STATE_FORMAT: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// The largest `parsley.causes` value accepted or sent, in bytes.
    pub metadata_budget: usize,
    /// Most records the task may hold (`None`: unbounded). Holding more refuses
    /// `HELD_LIMIT_EXCEEDED`.
    pub max_held_records: Option<usize>,
    /// Most bytes the held records may weigh (`None`: unbounded): each counts its payload's
    /// weight ([`Engine::with_weigher`]) plus its encoded causes.
    pub max_held_bytes: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { metadata_budget: codec::DEFAULT_METADATA_BUDGET, max_held_records: None, max_held_bytes: None }
    }
}

/// Deliberately broken engine behaviours, switched on only by the simulator's sabotage
/// meta-tests to prove its oracle catches each one. Not part of the API.
#[cfg(feature = "sim")]
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EngineSabotage {
    #[default]
    None,
    /// Every head is deliverable, whatever its causes.
    IgnoreCauses,
    /// A held head does not hold its channel: the first deliverable record behind it goes.
    NoFifoHold,
    /// A re-fed position at or below `fed_up_to` is queued again (when its channel holds
    /// nothing) instead of dropped.
    NoReplayDrop,
    /// An undecodable `parsley.causes` value is read as "no causes".
    UndecodableAsEmpty,
    /// Frontier pairs are pruned below the log start too, so a send stops expressing a
    /// cause that a receiver may not have read.
    PruneStampedBelowLogStart,
    /// A received record's causes are merged into the frontier when it is delivered, not
    /// when it is received, so a send made while a record is held does not express what
    /// that record carried.
    SkipReceiptMerge,
    /// Every record at a position `≡ 6 (mod 7)` is counted as fed and then dropped: neither
    /// held, nor delivered, nor refused.
    SilentDrop,
    /// A send stamps every frontier pair one position further on than the task knows.
    OverExpressCauses,
    /// The delivered past (the clock) takes a received record's causes at receipt, like
    /// the frontier, though the record is only held.
    DeriveClockFromFrontier,
    /// A log start past the settled position never refuses: with nothing held, the
    /// discarded positions count as settled, so holds waiting on them release.
    DeliverPastDeadHolds,
    /// A restore under a declaration that dropped a channel holding records drops those
    /// records instead of refusing `CHANNEL_REMOVED_WITH_HELD_MESSAGES`.
    IgnoreRemovedChannels,
    /// A re-fed position at or below one already fed in this execution is treated as a
    /// replay (dropped) instead of refused `OUT_OF_ORDER_FEED`.
    AcceptOutOfOrderFeed,
    /// A joining channel is seeded where the host says, below what the delivered past
    /// already accounts for on it (the seed floor is ignored).
    IgnoreSeedFloor,
    /// The metadata budget is ignored: any received value decodes, any frontier stamps.
    IgnoreBudget,
    /// A refusal that names a received record counts that record as fed: the step that
    /// persists the refusal persists `fed_up_to` past it, so a restart reads on after the
    /// record and the refusal does not recur.
    RefusedRecordCountedFed,
    /// Host machine ([`crate::host::TaskHost`]): a step's and a start's changes are handed
    /// over without the records they leave held, so the host never persists them.
    HostHeldNotHandedOver,
    /// Host machine: every log start it is told is taken as the first one it was told for
    /// that channel in this execution, so retention that passes a held record while the
    /// task runs goes unnoticed until the next start.
    HostStaleLogStart,
    /// Host machine: every log start it is told is taken two positions further on.
    HostLogStartAhead,
    /// Host machine: the consumer's read positions are ignored, so `fed_up_to` stops at the
    /// last record fed and retention past a trailing transaction marker refuses.
    HostReadPositionIgnored,
}

/// A received, undelivered record, with whatever the host keeps of it (`payload`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldRecord<P> {
    pub channel: ChannelId,
    pub position: Position,
    pub causes: CausalPast,
    pub payload: P,
}

/// A record the engine has delivered: the host hands it to the projection in this step.
pub type Delivery<P> = HeldRecord<P>;

/// What became of one received record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Receipt<P> {
    /// A committed step already accounted for this position (delivered or held): dropped.
    Duplicate,
    /// Fed and queued; `deliveries` are every record the resulting drain delivered, in
    /// delivery order (possibly none, possibly records of other channels).
    Accepted { deliveries: Vec<Delivery<P>> },
}

/// What became of one record received with [`Engine::receive_into`], whose deliveries are
/// appended to the caller's list instead of returned in a list of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fed {
    /// As [`Receipt::Duplicate`]: nothing was appended.
    Duplicate,
    /// As [`Receipt::Accepted`]: the deliveries, if any, were appended in delivery order.
    Accepted,
}

impl<P> Receipt<P> {
    pub(crate) fn of(fed: Fed, deliveries: Vec<Delivery<P>>) -> Receipt<P> {
        match fed {
            Fed::Duplicate => Receipt::Duplicate,
            Fed::Accepted => Receipt::Accepted { deliveries },
        }
    }
}

/// What a host persisted, from which an engine is restored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PersistedState<P> {
    pub format_version: u32,
    /// `fed_up_to` per channel that has a baseline.
    pub fed_up_to: BTreeMap<ChannelId, Position>,
    /// Every held record, in any order.
    pub held: Vec<HeldRecord<P>>,
    pub frontier: CausalPast,
    /// The delivered past: what the task's data reflects.
    pub delivered: CausalPast,
}

impl<P> Default for PersistedState<P> {
    fn default() -> Self {
        PersistedState {
            format_version: ORDERING_STATE_FORMAT,
            fed_up_to: BTreeMap::new(),
            held: Vec::new(),
            frontier: CausalPast::new(),
            delivered: CausalPast::new(),
        }
    }
}

/// The net state changes of one step, for the host to persist in the step's transaction.
/// Held records inserted and delivered within the same step appear in neither list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepChanges<P> {
    pub held_inserted: Vec<HeldRecord<P>>,
    pub held_removed: Vec<(ChannelId, Position)>,
    /// New `fed_up_to` values (upserts).
    pub fed_up_to: Vec<(ChannelId, Position)>,
    /// Channels that left the received set: their `fed_up_to` rows go; their delivered
    /// past stays.
    pub channels_removed: Vec<ChannelId>,
    pub frontier_upserts: Vec<(ChannelId, Position)>,
    pub frontier_removed: Vec<ChannelId>,
    /// Clock (delivered past) rows to upsert.
    pub clock_upserts: Vec<(ChannelId, Position)>,
    /// Clock rows pruned.
    pub clock_removed: Vec<ChannelId>,
    /// Set when the task refused during this step.
    pub refusal: Option<Refusal>,
}

impl<P> StepChanges<P> {
    pub fn is_empty(&self) -> bool {
        self.held_inserted.is_empty()
            && self.held_removed.is_empty()
            && self.fed_up_to.is_empty()
            && self.channels_removed.is_empty()
            && self.frontier_upserts.is_empty()
            && self.frontier_removed.is_empty()
            && self.clock_upserts.is_empty()
            && self.clock_removed.is_empty()
            && self.refusal.is_none()
    }
}

/// What a host knows of a channel when it prunes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChannelFact {
    /// The topic exists; positions below `log_start` are gone.
    Live { log_start: Position },
    /// The topic no longer resolves (deleted, or its name now names another topic ID).
    TopicGone,
    /// Nothing known: keep the pair.
    Unknown,
}

/// Per-channel status for operators.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelStatus {
    pub channel: ChannelId,
    pub fed_up_to: Option<Position>,
    pub settled: Option<Position>,
    pub held: usize,
    pub head: Option<Position>,
    /// Why the head is held (empty when nothing is held).
    pub blockers: Vec<Blocker>,
}

/// A task's status snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineStatus {
    pub refusal: Option<Refusal>,
    pub channels: Vec<ChannelStatus>,
    pub held_total: usize,
    pub frontier_width: usize,
    pub clock_width: usize,
}

#[derive(Debug)]
struct ChannelState<P> {
    fed_up_to: Option<Position>,
    /// Highest position fed in this execution, to detect a host breaking channel order.
    fed_this_execution: Option<Position>,
    held: VecDeque<HeldRecord<P>>,
}

impl<P> ChannelState<P> {
    fn settled(&self) -> Option<Position> {
        match self.held.front() {
            Some(head) => Some(head.position - 1),
            None => self.fed_up_to,
        }
    }
}

#[derive(Debug, Default)]
struct Pending {
    held_inserted: BTreeSet<(ChannelId, Position)>,
    held_removed: BTreeSet<(ChannelId, Position)>,
    fed_up_to: BTreeSet<ChannelId>,
    channels_removed: BTreeSet<ChannelId>,
    refusal: Option<Refusal>,
}

/// The causal delivery engine of one task.
#[derive(Debug)]
pub struct Engine<P> {
    config: EngineConfig,
    /// The received-channel set, in the fixed drain order.
    channels: BTreeMap<ChannelId, ChannelState<P>>,
    /// Kept beside `channels` so the decision unit gets a plain set.
    received: BTreeSet<ChannelId>,
    /// `received` in drain order, as a list the drain walks without collecting it each pass.
    drain_order: Vec<ChannelId>,
    frontier: CausalPast,
    delivered: CausalPast,
    /// The frontier and the delivered past as the host last persisted them (the last
    /// [`Engine::take_changes`], or the state restored): a step's frontier and clock changes
    /// are what differs from them, found once per step rather than tracked per record.
    persisted_frontier: CausalPast,
    persisted_delivered: CausalPast,
    refusal: Option<Refusal>,
    pending: Pending,
    /// How many bytes a held payload counts for (see [`EngineConfig::max_held_bytes`]).
    weigh: fn(&P) -> usize,
    /// The weight of every held record.
    held_bytes: usize,
    /// How many records are held, over every channel.
    held_records: usize,
    /// Channels on which the frontier may not cover what it owes (debug builds, for the
    /// invariant check): a prune dropped the frontier's pair (the clock may keep its own, or
    /// take it again from a held record delivered later), or the state restored was so.
    #[cfg(debug_assertions)]
    lagging: BTreeSet<ChannelId>,
    #[cfg(feature = "sim")]
    sabotage: EngineSabotage,
}

fn weightless<P>(_: &P) -> usize {
    0
}

/// The pairs of `past` that `frontier` does not cover (a lower position, or none), found
/// in one walk of both (each sorted by channel).
#[cfg(debug_assertions)]
fn uncovered<'a>(frontier: &'a CausalPast, past: &'a CausalPast) -> impl Iterator<Item = (ChannelId, Position)> + 'a {
    let mut frontier = frontier.iter().peekable();
    past.iter().filter(move |&(c, p)| {
        while frontier.next_if(|&(f, _)| f < c).is_some() {}
        frontier.peek().is_none_or(|&(f, at)| f != c || at < p)
    })
}

impl<P: Clone> Engine<P> {
    /// A task with no history, receiving `received`. Seed each channel before feeding it.
    pub fn new(config: EngineConfig, received: impl IntoIterator<Item = ChannelId>) -> Self {
        let received: BTreeSet<ChannelId> = received.into_iter().collect();
        Engine {
            config,
            channels: received
                .iter()
                .map(|&c| (c, ChannelState { fed_up_to: None, fed_this_execution: None, held: VecDeque::new() }))
                .collect(),
            drain_order: received.iter().copied().collect(),
            received,
            frontier: CausalPast::new(),
            delivered: CausalPast::new(),
            persisted_frontier: CausalPast::new(),
            persisted_delivered: CausalPast::new(),
            refusal: None,
            pending: Pending::default(),
            weigh: weightless::<P>,
            held_bytes: 0,
            held_records: 0,
            #[cfg(debug_assertions)]
            lagging: BTreeSet::new(),
            #[cfg(feature = "sim")]
            sabotage: EngineSabotage::None,
        }
    }

    /// Sets how many bytes a held payload counts for toward
    /// [`EngineConfig::max_held_bytes`] (default: nothing, only the causes count), and
    /// re-weighs what is held.
    pub fn with_weigher(mut self, weigh: fn(&P) -> usize) -> Self {
        self.weigh = weigh;
        self.held_bytes = self.channels.values().flat_map(|c| c.held.iter()).map(|r| self.weight_of(r)).sum();
        // Restored state weighed anew may pass the byte bound: refuse as `restore` would.
        let _ = self.check_held_limits(None);
        self.check_invariants();
        self
    }

    fn weight_of(&self, record: &HeldRecord<P>) -> usize {
        (self.weigh)(&record.payload) + codec::encoded_len(&record.causes)
    }

    /// The bytes the held records weigh (payload weights plus encoded causes).
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// Refuses `HELD_LIMIT_EXCEEDED` when the held records pass a configured bound; `at`
    /// names the record whose receipt passed it (none at restore).
    fn check_held_limits(&mut self, at: Option<(ChannelId, Position)>) -> Result<(), Refusal> {
        // The kept count, equal to the queued records (as `broken_count` also checks).
        debug_assert_eq!(self.held_records, self.held_count());
        let count = self.held_records;
        let over = match (self.config.max_held_records, self.config.max_held_bytes) {
            (Some(max), _) if count > max => Some(format!("{count} held records, more than max_held_records = {max}")),
            (_, Some(max)) if self.held_bytes > max => {
                Some(format!("{} held bytes, more than max_held_bytes = {max}", self.held_bytes))
            }
            _ => None,
        };
        let Some(over) = over else { return Ok(()) };
        let waiting = self
            .channels
            .iter()
            .filter_map(|(c, s)| s.held.front().map(|h| format!("{c} from {} ({} held)", h.position, s.held.len())))
            .collect::<Vec<_>>()
            .join(", ");
        let diagnosis = format!(
            "the task holds {over}; records wait for their causes on: {waiting}. Deliver the causes \
             (commit or abort the open transactions upstream) or raise the bound and restart"
        );
        Err(self.refuse(match at {
            Some((channel, position)) => {
                Refusal::at(RefusalReason::HeldLimitExceeded, channel, Some(position), diagnosis)
            }
            None => Refusal::new(RefusalReason::HeldLimitExceeded, diagnosis),
        }))
    }

    /// Panics naming the invariant the state breaks, if any; compiled to nothing in release.
    #[inline]
    fn check_invariants(&self) {
        #[cfg(debug_assertions)]
        if let Some(broken) = self.broken_invariant() {
            panic!("engine invariant broken: {broken}");
        }
    }

    /// [`Engine::check_invariants`] of `channel`'s own and the counts only: after a receipt,
    /// a seed or a read position on it, which the end of the step checks in full.
    #[inline]
    fn check_channel_invariants(&self, _channel: &ChannelId) {
        #[cfg(debug_assertions)]
        if let Some(broken) = self.broken_channel_invariant(_channel).or_else(|| self.broken_count()) {
            panic!("engine invariant broken: {broken}");
        }
    }

    /// The first invariant the state breaks, if any. The pasts' own (sorted channels,
    /// positions >= 0) each past checks as it changes.
    #[cfg(debug_assertions)]
    fn broken_invariant(&self) -> Option<String> {
        if !self.channels.keys().eq(&self.received) || !self.drain_order.iter().eq(&self.received) {
            let channels: Vec<_> = self.channels.keys().collect();
            return Some(format!(
                "the channels {channels:?}, received {:?} and drain order {:?} differ",
                self.received, self.drain_order
            ));
        }
        (self.channels.keys().find_map(|c| self.broken_channel_invariant(c)))
            .or_else(|| self.broken_count())
            .or_else(|| self.broken_walked_invariant())
    }

    /// The first broken invariant of one channel's: it holds no record above its
    /// `fed_up_to`; unless the task refused (a refused record counts as fed in this
    /// execution), neither was one fed in this execution.
    #[cfg(debug_assertions)]
    fn broken_channel_invariant(&self, channel: &ChannelId) -> Option<String> {
        let state = self.channels.get(channel)?;
        let fed_here = state.fed_this_execution.filter(|_| self.refusal.is_none());
        let highest_fed = state.held.back().map(|r| r.position).max(fed_here);
        highest_fed.is_some_and(|f| state.fed_up_to.is_none_or(|u| u < f)).then(|| {
            format!(
                "{channel} was fed up to {highest_fed:?} (held or in this execution), above fed_up_to {:?}",
                state.fed_up_to
            )
        })
    }

    /// The first broken invariant of the counts, checked in O(channels): `held_records` is
    /// the number of records queued; the step's refusal, if any, is the sticky one.
    #[cfg(debug_assertions)]
    fn broken_count(&self) -> Option<String> {
        let queued = self.held_count();
        if self.held_records != queued {
            return Some(format!("held_records is {}, but {queued} records are queued", self.held_records));
        }
        if self.pending.refusal.is_some() && self.pending.refusal != self.refusal {
            return Some(format!("the step's refusal {:?} is not the sticky {:?}", self.pending.refusal, self.refusal));
        }
        None
    }

    /// The first broken invariant of those checked by a walk of the pasts and the held
    /// records (O(widths + held records and their causes)):
    /// - the frontier covers the delivered past and every held record's causes (it took
    ///   them at receipt), but on `lagging` channels;
    /// - each channel's queue holds its own records, strictly ascending by position;
    /// - `held_bytes` is the weight of the queued records;
    /// - every record inserted in this step and not delivered is still queued.
    #[cfg(debug_assertions)]
    fn broken_walked_invariant(&self) -> Option<String> {
        if let Some((c, p)) = self.uncovered(&self.delivered) {
            return Some(format!(
                "the frontier is at {:?} on {c}, below the delivered past at {p}",
                self.frontier.get(&c)
            ));
        }
        #[cfg(feature = "sim")]
        let merged_at_receipt = self.sabotage != EngineSabotage::SkipReceiptMerge;
        #[cfg(not(feature = "sim"))]
        let merged_at_receipt = true;
        let held = || self.channels.values().flat_map(|c| c.held.iter());
        let uncovered_cause = |r: &HeldRecord<P>| Some((r.channel, r.position, self.uncovered(&r.causes)?));
        if let Some((channel, position, (c, p))) = held().filter(|_| merged_at_receipt).find_map(uncovered_cause) {
            return Some(format!(
                "the frontier is at {:?} on {c}, below the cause at {p} of held {channel}@{position}",
                self.frontier.get(&c)
            ));
        }
        for (&channel, state) in &self.channels {
            if let Some(r) = state.held.iter().find(|r| r.channel != channel) {
                return Some(format!("{}@{} is queued on {channel}", r.channel, r.position));
            }
            if let Some(i) = (1..state.held.len()).find(|&i| state.held[i - 1].position >= state.held[i].position) {
                return Some(format!(
                    "{channel} queues {} before {}",
                    state.held[i - 1].position,
                    state.held[i].position
                ));
            }
        }
        let weight: usize = held().map(|r| self.weight_of(r)).sum();
        if self.held_bytes != weight {
            return Some(format!("held_bytes is {}, but the queued records weigh {weight}", self.held_bytes));
        }
        let queued_at = |(c, p): &(ChannelId, Position)| {
            self.channels.get(c).is_some_and(|s| s.held.binary_search_by_key(p, |r| r.position).is_ok())
        };
        if let Some((c, p)) = self.pending.held_inserted.iter().find(|key| !queued_at(key)) {
            return Some(format!("{c}@{p} was inserted in this step and not delivered, but is not queued"));
        }
        None
    }

    /// The first pair of `past` the frontier does not cover (but on `lagging` channels).
    #[cfg(debug_assertions)]
    fn uncovered(&self, past: &CausalPast) -> Option<(ChannelId, Position)> {
        uncovered(&self.frontier, past).find(|(c, _)| !self.lagging.contains(c))
    }

    /// Switches on a deliberately broken behaviour (simulator meta-tests only).
    #[cfg(feature = "sim")]
    #[doc(hidden)]
    pub fn set_sabotage(&mut self, sabotage: EngineSabotage) {
        self.sabotage = sabotage;
    }

    /// Restores a task from what its host persisted, now receiving `received` (which may
    /// differ from the set the state was written under: a scope change).
    ///
    /// A channel that left keeps its delivered past; it may leave only if it holds nothing.
    /// A channel that joined starts with no baseline: seed it.
    pub fn restore(
        config: EngineConfig,
        received: impl IntoIterator<Item = ChannelId>,
        state: PersistedState<P>,
    ) -> Result<Self, Refusal> {
        Self::restore_checked(config, received, state, true)
    }

    /// [`Engine::restore`] with a deliberately broken behaviour switched on from the start
    /// (simulator meta-tests only).
    #[cfg(feature = "sim")]
    #[doc(hidden)]
    pub fn restore_sabotaged(
        config: EngineConfig,
        received: impl IntoIterator<Item = ChannelId>,
        state: PersistedState<P>,
        sabotage: EngineSabotage,
    ) -> Result<Self, Refusal> {
        let refuse_removed = sabotage != EngineSabotage::IgnoreRemovedChannels;
        let mut engine = Self::restore_checked(config, received, state, refuse_removed)?;
        engine.set_sabotage(sabotage);
        Ok(engine)
    }

    /// `refuse_removed: false` is the `IgnoreRemovedChannels` sabotage.
    fn restore_checked(
        config: EngineConfig,
        received: impl IntoIterator<Item = ChannelId>,
        state: PersistedState<P>,
        refuse_removed: bool,
    ) -> Result<Self, Refusal> {
        if state.format_version != ORDERING_STATE_FORMAT {
            return Err(Refusal::new(
                RefusalReason::UnknownOrderingStateFormat,
                format!(
                    "stored ordering state has format {} but this build reads format {}",
                    state.format_version, ORDERING_STATE_FORMAT
                ),
            ));
        }
        let mut engine = Engine::new(config, received);
        let mut held = state.held;
        held.sort_by_key(|r| (r.channel, r.position));
        for record in held {
            let Some(ch) = engine.channels.get_mut(&record.channel) else {
                if !refuse_removed {
                    continue;
                }
                let count = 1; // at least this one
                return Err(Refusal::at(
                    RefusalReason::ChannelRemovedWithHeldMessages,
                    record.channel,
                    Some(record.position),
                    format!(
                        "channel {} is no longer received but holds {count} or more records, the first at position {}; \
                         deliver them under the old declaration or restore the channel",
                        record.channel, record.position
                    ),
                ));
            };
            let fed = state.fed_up_to.get(&record.channel).copied();
            if fed.is_none_or(|f| f < record.position) || ch.held.back().is_some_and(|b| b.position >= record.position)
            {
                return Err(Refusal::at(
                    RefusalReason::UnknownOrderingStateFormat,
                    record.channel,
                    Some(record.position),
                    format!(
                        "stored held record at {}@{} is inconsistent with fed_up_to {:?}",
                        record.channel, record.position, fed
                    ),
                ));
            }
            ch.held.push_back(record);
            engine.held_records += 1;
        }
        for (channel, fed) in state.fed_up_to {
            match engine.channels.get_mut(&channel) {
                Some(ch) => ch.fed_up_to = Some(fed),
                None => {
                    engine.pending.channels_removed.insert(channel);
                }
            }
        }
        engine.persisted_frontier = state.frontier.clone();
        engine.persisted_delivered = state.delivered.clone();
        engine.frontier = state.frontier;
        engine.delivered = state.delivered;
        #[cfg(debug_assertions)]
        {
            let held = engine.channels.values().flat_map(|c| c.held.iter());
            let owed = std::iter::once(&engine.delivered).chain(held.map(|r| &r.causes));
            engine.lagging = owed.flat_map(|past| uncovered(&engine.frontier, past).map(|(c, _)| c)).collect();
        }
        engine.held_bytes = engine.channels.values().flat_map(|c| c.held.iter()).map(|r| engine.weight_of(r)).sum();
        // A bound lowered since (or passed by the last receipt before a stop) refuses again.
        let _ = engine.check_held_limits(None);
        engine.check_invariants();
        Ok(engine)
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn received(&self) -> &BTreeSet<ChannelId> {
        &self.received
    }

    pub fn refusal(&self) -> Option<&Refusal> {
        self.refusal.as_ref()
    }

    /// The frontier: what this task's sends must be stamped with.
    pub fn frontier(&self) -> &CausalPast {
        &self.frontier
    }

    /// The delivered past (the task's clock): what its data reflects.
    pub fn delivered_past(&self) -> &CausalPast {
        &self.delivered
    }

    pub fn fed_up_to(&self, channel: &ChannelId) -> Option<Position> {
        self.channels.get(channel).and_then(|c| c.fed_up_to)
    }

    /// How far `channel` is settled: every position at or below it is delivered or will
    /// never yield a record. `None` before anything is known, or if not received.
    pub fn settled(&self, channel: &ChannelId) -> Option<Position> {
        self.channels.get(channel).and_then(|c| c.settled())
    }

    /// Records held on `channel`, head first.
    pub fn held(&self, channel: &ChannelId) -> impl Iterator<Item = &HeldRecord<P>> + '_ {
        self.channels.get(channel).into_iter().flat_map(|c| c.held.iter())
    }

    pub fn held_count(&self) -> usize {
        self.channels.values().map(|c| c.held.len()).sum()
    }

    /// Gives a channel with no baseline its first `fed_up_to`: the committed position
    /// minus one to resume, or the initial position minus one (`log_start - 1` for
    /// earliest, `last_stable_offset - 1` for latest). Never below what the task's delivered
    /// past already accounts for on that channel, so a joining channel cannot deliver a
    /// cause after its effect. Returns the effective baseline: fetch from it plus one.
    /// A channel that already has a baseline keeps it.
    pub fn seed(&mut self, channel: ChannelId, fed_up_to: Position) -> Result<Position, Refusal> {
        self.check_not_refused()?;
        let floor = self.delivered.get(&channel).unwrap_or(-1);
        #[cfg(feature = "sim")]
        let floor = if self.sabotage == EngineSabotage::IgnoreSeedFloor { -1 } else { floor };
        let Some(ch) = self.channels.get_mut(&channel) else {
            return Err(self.refuse(Refusal::at(
                RefusalReason::SubstrateMisconfigured,
                channel,
                None,
                format!("seeded channel {channel}, which this task does not receive"),
            )));
        };
        if let Some(existing) = ch.fed_up_to {
            return Ok(existing);
        }
        if fed_up_to == Position::MAX {
            return Err(self.refuse(Refusal::at(
                RefusalReason::SubstrateMisconfigured,
                channel,
                Some(fed_up_to),
                format!("seeded {channel} at the largest position, which no log reaches"),
            )));
        }
        let baseline = fed_up_to.max(floor).max(-1);
        ch.fed_up_to = Some(baseline);
        self.pending.fed_up_to.insert(channel);
        self.check_channel_invariants(&channel);
        Ok(baseline)
    }

    /// Checks a received channel's log start against what the task has settled: if
    /// retention removed a position at or above `settled + 1` — a record never read, or one
    /// the task still holds — refuses `POSITIONS_DISCARDED_UNREAD`. A held record is safe in
    /// the host's storage, but once its position is below the log start, senders may prune
    /// pairs naming it (the pruning rule), so later records could overtake it: the task
    /// stops rather than deliver with that weaker guarantee.
    pub fn observe_log_start(&mut self, channel: ChannelId, log_start: Position) -> Result<(), Refusal> {
        self.check_not_refused()?;
        let Some(state) = self.channels.get(&channel) else {
            return Ok(());
        };
        let Some(settled) = state.settled() else {
            return Ok(());
        };
        #[cfg(feature = "sim")]
        if log_start > settled.saturating_add(1) && self.sabotage == EngineSabotage::DeliverPastDeadHolds {
            if state.held.is_empty() {
                self.channels.get_mut(&channel).expect("received").fed_up_to = Some(log_start - 1);
                self.pending.fed_up_to.insert(channel);
            }
            self.check_channel_invariants(&channel);
            return Ok(());
        }
        if log_start > settled.saturating_add(1) {
            let what = match state.held.front() {
                Some(head) => format!(
                    "the task still holds {} record(s) from position {}, waiting for their causes",
                    state.held.len(),
                    head.position
                ),
                None => format!("positions {}..{} were never read", settled + 1, log_start - 1),
            };
            return Err(self.refuse(Refusal::at(
                RefusalReason::PositionsDiscardedUnread,
                channel,
                Some(settled + 1),
                format!("log start of {channel} is {log_start}, past settled position {settled}: {what}"),
            )));
        }
        Ok(())
    }

    /// The received channels holding records whose head position is below `log_start(c)`
    /// would be refused by [`Engine::observe_log_start`]; hosts use this to know which
    /// channels are worth a log-start check while running (those holding records).
    pub fn channels_holding(&self) -> impl Iterator<Item = ChannelId> + '_ {
        self.channels.iter().filter(|(_, s)| !s.held.is_empty()).map(|(c, _)| *c)
    }

    /// Receives the record at `(channel, position)`, given the values of every
    /// `parsley.causes` header it carries (`None` for a null value) and what the host keeps
    /// of it. Decodes strictly, drops replays, queues, and drains.
    pub fn receive(
        &mut self,
        channel: ChannelId,
        position: Position,
        causes_headers: &[Option<&[u8]>],
        payload: P,
    ) -> Result<Receipt<P>, Refusal> {
        let mut deliveries = Vec::new();
        let fed = self.receive_into(channel, position, causes_headers, payload, &mut deliveries)?;
        Ok(Receipt::of(fed, deliveries))
    }

    /// As [`Engine::receive`], appending the deliveries to `out` (a host feeding a batch
    /// keeps one list for the step instead of one per record). On an error nothing was
    /// appended.
    pub fn receive_into(
        &mut self,
        channel: ChannelId,
        position: Position,
        causes_headers: &[Option<&[u8]>],
        payload: P,
        out: &mut Vec<Delivery<P>>,
    ) -> Result<Fed, Refusal> {
        #[cfg(feature = "sim")]
        let budget =
            if self.sabotage == EngineSabotage::IgnoreBudget { usize::MAX } else { self.config.metadata_budget };
        #[cfg(not(feature = "sim"))]
        let budget = self.config.metadata_budget;
        self.receive_result_into(channel, position, codec::decode_headers(causes_headers, budget), payload, out)
    }

    /// The budget `parsley.causes` values are decoded with (a host decoding them itself,
    /// for [`Engine::receive_result_into`], uses this one).
    pub fn metadata_budget(&self) -> usize {
        self.config.metadata_budget
    }

    /// As [`Engine::receive_into`], given what decoding the record's `parsley.causes`
    /// headers with [`Engine::metadata_budget`] gave ([`codec::decode_headers`], or a
    /// [`codec::HeaderDecoder`] fed while the headers were read): an error is refused as
    /// `receive_into` refuses it.
    pub fn receive_result_into(
        &mut self,
        channel: ChannelId,
        position: Position,
        decoded: Result<CausalPast, DecodeError>,
        payload: P,
        out: &mut Vec<Delivery<P>>,
    ) -> Result<Fed, Refusal> {
        self.check_not_refused()?;
        let causes = match decoded {
            Ok(causes) => causes,
            #[cfg(feature = "sim")]
            Err(DecodeError::Undecodable(_)) if self.sabotage == EngineSabotage::UndecodableAsEmpty => {
                CausalPast::new()
            }
            Err(DecodeError::Undecodable(m)) => {
                return Err(self.refuse(Refusal::at(
                    RefusalReason::UndecodableMetadata,
                    channel,
                    Some(position),
                    format!("record {channel}@{position}: {m} ({})", m.class()),
                )))
            }
            Err(e @ DecodeError::OverBudget { .. }) => {
                return Err(self.refuse(Refusal::at(
                    RefusalReason::MetadataBudgetExceeded,
                    channel,
                    Some(position),
                    format!("record {channel}@{position}: {e}"),
                )))
            }
        };
        self.receive_decoded_into(channel, position, causes, payload, out)
    }

    /// As [`Engine::receive`], for causes the host already decoded with this engine's budget.
    pub fn receive_decoded(
        &mut self,
        channel: ChannelId,
        position: Position,
        causes: CausalPast,
        payload: P,
    ) -> Result<Receipt<P>, Refusal> {
        let mut deliveries = Vec::new();
        let fed = self.receive_decoded_into(channel, position, causes, payload, &mut deliveries)?;
        Ok(Receipt::of(fed, deliveries))
    }

    /// As [`Engine::receive_decoded`], appending the deliveries to `out`.
    pub fn receive_decoded_into(
        &mut self,
        channel: ChannelId,
        position: Position,
        causes: CausalPast,
        payload: P,
        out: &mut Vec<Delivery<P>>,
    ) -> Result<Fed, Refusal> {
        let fed = self.feed(channel, position, causes, payload, out);
        self.check_channel_invariants(&channel);
        fed
    }

    /// Feeds one record whose causes are decoded: refuses it, drops it as a replay,
    /// delivers it at once, or queues it and drains.
    fn feed(
        &mut self,
        channel: ChannelId,
        position: Position,
        causes: CausalPast,
        payload: P,
        out: &mut Vec<Delivery<P>>,
    ) -> Result<Fed, Refusal> {
        self.check_not_refused()?;
        let Some(ch) = self.channels.get_mut(&channel) else {
            return Err(self.refuse(Refusal::at(
                RefusalReason::SubstrateMisconfigured,
                channel,
                Some(position),
                format!("fed a record of {channel}, which this task does not receive"),
            )));
        };
        let Some(fed_up_to) = ch.fed_up_to else {
            return Err(self.refuse(Refusal::at(
                RefusalReason::SubstrateMisconfigured,
                channel,
                Some(position),
                format!("fed {channel}@{position} before the channel was seeded with a baseline"),
            )));
        };
        if position == Position::MAX {
            return Err(self.refuse(Refusal::at(
                RefusalReason::SubstrateMisconfigured,
                channel,
                Some(position),
                format!("fed {channel}@{position}: no log holds a record at the largest position"),
            )));
        }
        #[cfg(feature = "sim")]
        if self.sabotage == EngineSabotage::AcceptOutOfOrderFeed && (0..=fed_up_to).contains(&position) {
            return Ok(Fed::Duplicate);
        }
        if position < 0 || ch.fed_this_execution.is_some_and(|f| position <= f) {
            let previous = ch.fed_this_execution;
            return Err(self.refuse(Refusal::at(
                RefusalReason::OutOfOrderFeed,
                channel,
                Some(position),
                format!("fed {channel}@{position} after already feeding it up to {previous:?} in this execution"),
            )));
        }
        ch.fed_this_execution = Some(position);
        #[cfg(feature = "sim")]
        let replay_guard = !(self.sabotage == EngineSabotage::NoReplayDrop && ch.held.is_empty());
        #[cfg(not(feature = "sim"))]
        let replay_guard = true;
        if position <= fed_up_to && replay_guard {
            // A committed step already delivered or holds it: a replay after restart.
            return Ok(Fed::Duplicate);
        }
        // A scan, not a search: the causes are few, and an equality check is cheaper than an
        // ordering one (this runs for every record).
        let own = causes.iter().find_map(|(c, p)| (c == channel).then_some(p));
        if let Some(own) = own.filter(|&p| p >= position) {
            return Err(self.refuse(Refusal::at(
                RefusalReason::ImpossibleSelfCause,
                channel,
                Some(position),
                format!(
                    "record {channel}@{position} names its own channel at {own}, at or above itself: \
                     no honest sender can know that position"
                ),
            )));
        }
        let was_empty = ch.held.is_empty();
        ch.fed_up_to = Some(position);
        self.pending.fed_up_to.insert(channel);
        #[cfg(feature = "sim")]
        match self.sabotage {
            EngineSabotage::SilentDrop if position % 7 == 6 => return Ok(Fed::Accepted),
            EngineSabotage::DeriveClockFromFrontier => {
                for (c, p) in causes.iter() {
                    if self.delivered.get(&c).is_none_or(|d| d < p) {
                        self.delivered.merge_in_place(c, p);
                    }
                }
            }
            _ => {}
        }
        // Nothing held on any channel: the drain would offer this record alone, and no other
        // head exists for it to release. Decided here, a deliverable record never enters the
        // queue (nor the step's held rows, nor the held weight) — the drain's outcome,
        // without its queueing. Its own channel's cause is below `position` (checked above),
        // so the channel's settled position cannot block it.
        // (Sabotaged runs take it too: every sabotage acts before it or on the queue's path,
        // which a record it does not deliver takes, so what they break is what ships.)
        if self.held_records == 0
            && decide(&causes, &self.received, |c| self.channels.get(c).and_then(|s| s.settled())).is_deliverable()
        {
            // Receipt raises the frontier by the causes, delivery by the own pair; the
            // delivered past takes both. Each past in one pass (merging commutes).
            self.frontier.raise_record_both(&mut self.delivered, channel, position, &causes);
            let _ = self.check_held_limits(Some((channel, position)));
            out.push(HeldRecord { channel, position, causes, payload });
            return Ok(Fed::Accepted);
        }
        #[cfg(feature = "sim")]
        let merge = self.sabotage != EngineSabotage::SkipReceiptMerge;
        #[cfg(not(feature = "sim"))]
        let merge = true;
        if merge {
            self.frontier.raise_all(&causes);
        }
        let record = HeldRecord { channel, position, causes, payload };
        let ch = self.channels.get_mut(&channel).expect("received channel");
        self.held_bytes += (self.weigh)(&record.payload) + codec::encoded_len(&record.causes);
        ch.held.push_back(record);
        self.held_records += 1;
        self.pending.held_inserted.insert((channel, position));
        // Appending behind a head changes no settled position: nothing new can deliver.
        if was_empty {
            self.drain_inner(out);
        }
        // The record is fed (and held, or delivered); a bound it passed makes the refusal
        // sticky, so the next receipt fails and the host commits this step with the refusal.
        // The deliveries above still belong to this step: they are appended, not lost.
        let _ = self.check_held_limits(Some((channel, position)));
        Ok(Fed::Accepted)
    }

    /// Tells the engine its host's consumer has read `channel` up to `next - 1`: every
    /// position below `next` was fed, or will never yield a record (a transaction marker,
    /// an aborted run). Raises `fed_up_to` to `next - 1`, so log-start checks compare with
    /// how far the channel was read, not with the last record — retention that removes only
    /// control records is then not `POSITIONS_DISCARDED_UNREAD`. The host calls it only once
    /// every record its consumer returned below `next` has been fed. A position at or below
    /// `fed_up_to` changes nothing; feeding a position below `next` afterwards is an
    /// `OUT_OF_ORDER_FEED`.
    pub fn observe_read_position(&mut self, channel: ChannelId, next: Position) -> Result<(), Refusal> {
        self.check_not_refused()?;
        let Some(ch) = self.channels.get_mut(&channel) else {
            return Ok(());
        };
        let Some(fed_up_to) = ch.fed_up_to else {
            return Ok(());
        };
        let read_up_to = next.saturating_sub(1);
        if read_up_to > fed_up_to {
            ch.fed_up_to = Some(read_up_to);
            ch.fed_this_execution = Some(ch.fed_this_execution.map_or(read_up_to, |f| f.max(read_up_to)));
            self.pending.fed_up_to.insert(channel);
        }
        self.check_channel_invariants(&channel);
        Ok(())
    }

    /// Delivers every deliverable head, scanning channels in their fixed order and
    /// repeating until a full pass delivers nothing. Hosts call it after restore, seeding or
    /// a scope change; `receive` drains by itself.
    pub fn drain(&mut self) -> Vec<Delivery<P>> {
        if self.refusal.is_some() {
            return Vec::new();
        }
        let mut deliveries = Vec::new();
        self.drain_inner(&mut deliveries);
        self.check_invariants();
        deliveries
    }

    /// Appends every deliverable head to `deliveries` (see [`Engine::drain`]).
    fn drain_inner(&mut self, deliveries: &mut Vec<Delivery<P>>) {
        loop {
            let before = deliveries.len();
            for i in 0..self.drain_order.len() {
                let channel = self.drain_order[i];
                while let Some(head) = self.channels[&channel].held.front() {
                    let decision =
                        decide(&head.causes, &self.received, |c| self.channels.get(c).and_then(|s| s.settled()));
                    #[cfg(feature = "sim")]
                    let decision = match self.sabotage {
                        EngineSabotage::IgnoreCauses => Decision::Deliverable,
                        EngineSabotage::NoFifoHold if !decision.is_deliverable() => {
                            if let Some(record) = self.sabotage_overtake_head(channel) {
                                self.held_records -= 1;
                                self.deliver(&record);
                                deliveries.push(record);
                            }
                            break;
                        }
                        _ => decision,
                    };
                    if !decision.is_deliverable() {
                        break;
                    }
                    let record =
                        self.channels.get_mut(&channel).expect("received channel").held.pop_front().expect("head");
                    self.held_records -= 1;
                    self.deliver(&record);
                    deliveries.push(record);
                }
            }
            if deliveries.len() == before {
                return;
            }
        }
    }

    /// `NoFifoHold` sabotage: takes the first deliverable record behind a held head.
    #[cfg(feature = "sim")]
    fn sabotage_overtake_head(&mut self, channel: ChannelId) -> Option<HeldRecord<P>> {
        let queue = &self.channels[&channel].held;
        let settled = |c: &ChannelId| self.channels.get(c).and_then(|s| s.settled());
        let i = (1..queue.len()).find(|&i| decide(&queue[i].causes, &self.received, settled).is_deliverable())?;
        self.channels.get_mut(&channel)?.held.remove(i)
    }

    /// Delivers a record taken off its channel's queue.
    fn deliver(&mut self, record: &HeldRecord<P>) {
        self.held_bytes = self.held_bytes.saturating_sub(self.weight_of(record));
        let key = (record.channel, record.position);
        if !self.pending.held_inserted.remove(&key) {
            self.pending.held_removed.insert(key);
        }
        self.advance_pasts(record);
    }

    /// What delivering `record` does to the pasts: the frontier takes its position; the
    /// delivered past takes its position and its causes.
    fn advance_pasts(&mut self, record: &HeldRecord<P>) {
        self.frontier.raise(record.channel, record.position);
        #[cfg(feature = "sim")]
        if self.sabotage == EngineSabotage::SkipReceiptMerge {
            self.frontier.raise_all(&record.causes);
        }
        self.delivered.raise_record(record.channel, record.position, &record.causes);
    }

    /// Drops the pairs that can no longer matter — the only rule that ever drops a pair:
    ///
    /// - **Frontier** (what a send stamps): a pair only when its channel's topic no longer
    ///   resolves. A pair below the channel's log start is kept: a receiver that has not
    ///   read that position yet must still hold the effect (and refuse
    ///   `POSITIONS_DISCARDED_UNREAD` at the cause's channel), not deliver it before a cause
    ///   it never saw.
    /// - **Clock** (what reads are gated on): a pair below its channel's log start or of a
    ///   topic that no longer resolves, except on the task's own received topics — a pruned
    ///   owner entry would turn a valid session token into a permanent gap. Reads stop
    ///   demanding what nobody can deliver any more; sends never stop expressing it.
    pub fn prune(&mut self, fact: impl Fn(&ChannelId) -> ChannelFact) {
        let dead = |c: &ChannelId, p: Position| match fact(c) {
            ChannelFact::Live { log_start } => p < log_start,
            ChannelFact::TopicGone => true,
            ChannelFact::Unknown => false,
        };
        #[cfg(feature = "sim")]
        let stamped_below_log_start = self.sabotage == EngineSabotage::PruneStampedBelowLogStart;
        #[cfg(not(feature = "sim"))]
        let stamped_below_log_start = false;
        let gone = |c: &ChannelId, p: Position| {
            if stamped_below_log_start {
                dead(c, p)
            } else {
                fact(c) == ChannelFact::TopicGone
            }
        };
        let received_topics: BTreeSet<TopicId> = self.received.iter().map(|c| c.topic).collect();
        let frontier_dead: Vec<ChannelId> = self.frontier.iter().filter(|(c, p)| gone(c, *p)).map(|(c, _)| c).collect();
        let clock_dead: Vec<ChannelId> = self
            .delivered
            .iter()
            .filter(|(c, p)| !received_topics.contains(&c.topic) && dead(c, *p))
            .map(|(c, _)| c)
            .collect();
        if !frontier_dead.is_empty() {
            self.frontier = std::mem::take(&mut self.frontier).retain(|c, _| !frontier_dead.contains(&c));
        }
        if !clock_dead.is_empty() {
            self.delivered = std::mem::take(&mut self.delivered).retain(|c, _| !clock_dead.contains(&c));
        }
        #[cfg(debug_assertions)]
        self.lagging.extend(frontier_dead);
        self.check_invariants();
    }

    /// The frontier encoded for a send, or `None` when it is empty (the header is then
    /// omitted). Refuses `METADATA_BUDGET_EXCEEDED` rather than send a value over budget.
    pub fn stamp(&mut self) -> Result<Option<Vec<u8>>, Refusal> {
        self.check_not_refused()?;
        if self.frontier.is_empty() {
            return Ok(None);
        }
        #[cfg(feature = "sim")]
        if self.sabotage == EngineSabotage::OverExpressCauses {
            let beyond = CausalPast::from_pairs(self.frontier.iter().map(|(c, p)| (c, p + 1)));
            return Ok(codec::encode_within(&beyond, self.config.metadata_budget).ok());
        }
        #[cfg(feature = "sim")]
        if self.sabotage == EngineSabotage::IgnoreBudget {
            return Ok(Some(codec::encode(&self.frontier)));
        }
        match codec::encode_within(&self.frontier, self.config.metadata_budget) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) => {
                Err(self
                    .refuse(Refusal::new(RefusalReason::MetadataBudgetExceeded, format!("cannot stamp a send: {e}"))))
            }
        }
    }

    /// Records a refusal the host detected (identity, width, configuration). Sticky.
    pub fn refuse(&mut self, refusal: Refusal) -> Refusal {
        if self.refusal.is_none() {
            self.refusal = Some(refusal.clone());
            self.pending.refusal = Some(refusal.clone());
            #[cfg(feature = "sim")]
            if self.sabotage == EngineSabotage::RefusedRecordCountedFed {
                if let (Some(channel), Some(position)) = (refusal.channel, refusal.position) {
                    if let Some(ch) = self.channels.get_mut(&channel) {
                        if ch.fed_up_to.is_some_and(|f| f < position) {
                            ch.fed_up_to = Some(position);
                            self.pending.fed_up_to.insert(channel);
                        }
                    }
                }
            }
        }
        refusal
    }

    fn check_not_refused(&self) -> Result<(), Refusal> {
        match &self.refusal {
            Some(r) => Err(r.clone()),
            None => Ok(()),
        }
    }

    /// Takes the net state changes since the last call: everything the host must persist
    /// in this step's transaction.
    pub fn take_changes(&mut self) -> StepChanges<P> {
        let pending = std::mem::take(&mut self.pending);
        let held_inserted = pending
            .held_inserted
            .iter()
            .map(|(channel, position)| {
                let queue = &self.channels[channel].held;
                let i = queue
                    .binary_search_by_key(position, |r| r.position)
                    .expect("a record inserted and not removed is still held");
                queue[i].clone()
            })
            .collect();
        let (frontier_upserts, frontier_removed) = self.persisted_frontier.changes_to(&self.frontier);
        let (clock_upserts, clock_removed) = self.persisted_delivered.changes_to(&self.delivered);
        self.persisted_frontier.clone_from(&self.frontier);
        self.persisted_delivered.clone_from(&self.delivered);
        let changes = StepChanges {
            held_inserted,
            held_removed: pending.held_removed.into_iter().collect(),
            fed_up_to: pending
                .fed_up_to
                .iter()
                .filter_map(|c| self.channels.get(c).and_then(|s| s.fed_up_to).map(|p| (*c, p)))
                .collect(),
            channels_removed: pending.channels_removed.into_iter().collect(),
            frontier_upserts,
            frontier_removed,
            clock_upserts,
            clock_removed,
            refusal: pending.refusal,
        };
        // An engine whose step changed nothing was checked when it last changed.
        if !changes.is_empty() {
            self.check_invariants();
        }
        changes
    }

    /// Everything a host would have persisted if every change so far had committed: what
    /// [`Engine::restore`] rebuilds this engine from.
    pub fn snapshot(&self) -> PersistedState<P> {
        PersistedState {
            format_version: ORDERING_STATE_FORMAT,
            fed_up_to: self.channels.iter().filter_map(|(c, s)| s.fed_up_to.map(|f| (*c, f))).collect(),
            held: self.channels.values().flat_map(|s| s.held.iter().cloned()).collect(),
            frontier: self.frontier.clone(),
            delivered: self.delivered.clone(),
        }
    }

    /// Per-channel holds and blockers, the refusal if any, and the widths of the pasts.
    pub fn status(&self) -> EngineStatus {
        let channels = self
            .channels
            .iter()
            .map(|(&channel, s)| {
                let blockers = match s.held.front() {
                    Some(head) => {
                        match decide(&head.causes, &self.received, |c| self.channels.get(c).and_then(|s| s.settled())) {
                            Decision::Held { blockers } => blockers,
                            Decision::Deliverable => Vec::new(),
                        }
                    }
                    None => Vec::new(),
                };
                ChannelStatus {
                    channel,
                    fed_up_to: s.fed_up_to,
                    settled: s.settled(),
                    held: s.held.len(),
                    head: s.held.front().map(|h| h.position),
                    blockers,
                }
            })
            .collect();
        EngineStatus {
            refusal: self.refusal.clone(),
            channels,
            held_total: self.held_count(),
            frontier_width: self.frontier.len(),
            clock_width: self.delivered.len(),
        }
    }
}

#[cfg(all(test, debug_assertions))]
mod tests {
    use super::*;

    const A: ChannelId = ChannelId::new(TopicId::from_bytes([1; 16]), 0);
    const B: ChannelId = ChannelId::new(TopicId::from_bytes([2; 16]), 0);
    const UPSTREAM: ChannelId = ChannelId::new(TopicId::from_bytes([9; 16]), 0);

    type Task = Engine<&'static str>;

    /// A task receiving `A` and `B` that delivered a@0 and holds b@3 (waiting for a@1) and
    /// b@4 behind it: every invariant holds.
    fn busy() -> Task {
        let mut e = Task::new(EngineConfig::default(), [A, B]).with_weigher(|p| p.len());
        e.seed(A, -1).unwrap();
        e.seed(B, -1).unwrap();
        e.receive_decoded(A, 0, CausalPast::new(), "a0").unwrap();
        e.receive_decoded(B, 3, CausalPast::from_pairs([(A, 1), (UPSTREAM, 7)]), "b3").unwrap();
        e.receive_decoded(B, 4, CausalPast::new(), "b4").unwrap();
        assert_eq!(e.held_count(), 2);
        assert_eq!(e.broken_invariant(), None);
        e
    }

    fn held_on(e: &mut Task, channel: ChannelId) -> &mut VecDeque<HeldRecord<&'static str>> {
        &mut e.channels.get_mut(&channel).unwrap().held
    }

    /// Asserts that `e` breaks an invariant, and that the report says `what`.
    fn assert_broken(e: &Task, what: &str) {
        let broken = e.broken_invariant().expect("a broken invariant");
        assert!(broken.contains(what), "{broken:?} does not say {what:?}");
    }

    #[test]
    fn a_frontier_below_the_delivered_past_or_a_held_cause_is_reported_unless_a_prune_let_it_lag() {
        let mut e = busy();
        e.delivered = e.delivered.clone().merge(A, 5);
        assert_broken(&e, "below the delivered past at 5");
        let mut e = busy();
        e.frontier = e.frontier.clone().retain(|c, _| c != UPSTREAM);
        assert_broken(&e, "below the cause at 7 of held");
        let mut e = busy();
        e.frontier = e.frontier.clone().retain(|c, _| c != A);
        assert_broken(&e, "the frontier is at None");
        e.lagging.insert(A);
        assert_eq!(e.broken_invariant(), None, "a lagging channel is exempt");
    }

    #[test]
    fn a_received_topic_gone_lets_the_frontier_lag_through_prune_and_restore() {
        let mut e = busy();
        e.prune(|c| if c.topic == A.topic { ChannelFact::TopicGone } else { ChannelFact::Unknown });
        assert_eq!((e.frontier().get(&A), e.delivered_past().get(&A)), (None, Some(0)));
        assert_eq!(e.lagging, BTreeSet::from([A]));
        assert_eq!(e.broken_invariant(), None);
        let restored = Task::restore(EngineConfig::default(), [A, B], e.snapshot()).unwrap();
        assert_eq!(restored.lagging, BTreeSet::from([A]));
        assert_eq!(restored.broken_invariant(), None);
    }

    #[test]
    fn a_held_record_delivered_after_a_prune_lets_the_frontier_lag() {
        let mut e = busy();
        e.prune(|c| if *c == UPSTREAM { ChannelFact::TopicGone } else { ChannelFact::Unknown });
        assert_eq!(e.lagging, BTreeSet::from([UPSTREAM]));
        // a@1 releases b@3, whose cause the clock now takes and the frontier no longer has.
        let delivered = e.receive_decoded(A, 1, CausalPast::new(), "a1").unwrap();
        assert!(matches!(delivered, Receipt::Accepted { deliveries } if deliveries.len() == 3));
        assert_eq!((e.frontier().get(&UPSTREAM), e.delivered_past().get(&UPSTREAM)), (None, Some(7)));
        assert_eq!(e.broken_invariant(), None);
        let restored = Task::restore(EngineConfig::default(), [A, B], e.snapshot()).unwrap();
        assert_eq!(restored.lagging, BTreeSet::from([UPSTREAM]));
    }

    #[test]
    fn queues_out_of_order_of_another_channel_or_above_fed_up_to_are_reported() {
        let mut e = busy();
        held_on(&mut e, B).swap(0, 1);
        assert_broken(&e, "queues 4 before 3");
        let mut e = busy();
        held_on(&mut e, B)[1].channel = A;
        assert_broken(&e, "is queued on");
        let mut e = busy();
        e.channels.get_mut(&B).unwrap().fed_up_to = Some(3);
        assert_broken(&e, "above fed_up_to Some(3)");
        let mut e = busy();
        e.channels.get_mut(&A).unwrap().fed_this_execution = Some(1);
        assert_broken(&e, "above fed_up_to Some(0)");
        // A refused record counts as fed in this execution, not in `fed_up_to`.
        let err = e.receive_decoded(A, 5, CausalPast::from_pairs([(A, 5)]), "a5").unwrap_err();
        assert_eq!(err.reason, RefusalReason::ImpossibleSelfCause);
        assert_eq!(e.broken_invariant(), None);
    }

    #[test]
    fn a_held_count_or_weight_other_than_the_queues_is_reported() {
        let mut e = busy();
        e.held_records += 1;
        assert_broken(&e, "held_records is 3, but 2 records are queued");
        let mut e = busy();
        held_on(&mut e, B).pop_back();
        assert_broken(&e, "held_records is 2, but 1 records are queued");
        let mut e = busy();
        e.held_bytes -= 1;
        assert_broken(&e, "held_bytes");
    }

    #[test]
    fn channel_sets_step_rows_and_refusals_that_disagree_are_reported() {
        let mut e = busy();
        e.drain_order.reverse();
        assert_broken(&e, "drain order");
        let mut e = busy();
        e.received.remove(&B);
        assert_broken(&e, "received");
        let mut e = busy();
        e.pending.held_inserted.insert((B, 9));
        assert_broken(&e, "is not queued");
        let mut e = busy();
        e.pending.refusal = Some(Refusal::new(RefusalReason::HeldLimitExceeded, "only in the step"));
        assert_broken(&e, "is not the sticky");
    }
}
