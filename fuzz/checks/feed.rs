//! The `feed` fuzz target's property, shared by the cargo-fuzz target
//! (`fuzz/fuzz_targets/feed.rs`) and the stable replay in `tests/fuzz_corpus.rs`.
//!
//! The input is read as a [`Case`]: an engine configuration and a sequence of what a host
//! does to one task's engine — receive records with arbitrary `parsley.causes` headers,
//! drain, commit a step (`take_changes`), crash and restore (with the same or another set
//! of received channels), seed, report read positions, prune, check log starts, stamp — on
//! four channels a task may receive and one it never does, while the world moves log
//! starts and deletes topics. [`run`] plays it against the real [`Engine`] and, beside it,
//! a small model of what must happen that shares no code with the engine. It panics,
//! naming the property and the operation, when:
//!
//! - a record is delivered that is not the head of its channel's queue, or not the record
//!   that was received there (FIFO per channel, nothing invented);
//! - a record is delivered before a cause on a channel the task receives is settled: a
//!   record received there at or below the cause still waits, or the host never accounted
//!   for that position;
//! - a record is delivered at or below a position the task's deliveries already covered on
//!   its channel — its own earlier delivery, or a cause an earlier delivery carried (never
//!   twice, never after its effect), across crashes, restores and scope changes;
//! - a drain leaves a record held whose every cause on a received channel is settled;
//! - a receipt, seed, read position, log-start check, stamp or restore answers otherwise
//!   than the engine's contract says (duplicate, accepted, or refused with which named
//!   reason at which coordinate), or the sticky refusal differs from the one expected;
//! - the held records, `fed_up_to`, held bytes, frontier or delivered past differ from the
//!   model's (pruning may drop only what the pruning rule allows);
//! - the changes of a step, applied to a host's store, are not exactly the engine's state,
//!   or the engine restored from that store differs from the one that produced it.
//!
//! Two kinds of host. An *honest* host (three inputs in four) behaves as the projector
//! does: it reads nothing below a log start nor from a deleted topic, seeds at or above the
//! log start, and reports log starts no later than they are. Then every property above
//! holds. A *chaos* host breaks those rules and feeds extreme positions (`i64::MIN`, `-1`,
//! up to `i64::MAX`, which the engine refuses); the engine must still not panic, must answer per contract, and
//! must keep every property that does not rest on the host's honesty — all but "never at
//! or below a covered position", which a host reporting false log starts can defeat.

use std::collections::{BTreeMap, BTreeSet};

use parsley::codec;
use parsley::engine::{ChannelFact, HeldRecord, PersistedState, StepChanges, ORDERING_STATE_FORMAT};
use parsley::{CausalPast, ChannelId, Engine, EngineConfig, Position, Receipt, Refusal, RefusalReason, TopicId};

/// The topics of the world: `A` (two partitions), `B`, `C` (a high first byte, so the
/// unsigned order matters) and `D`, which no task here receives.
pub const TOPICS: [TopicId; 4] = [
    TopicId::from_bytes([0x0a; 16]),
    TopicId::from_bytes([0x0b; 16]),
    TopicId::from_bytes([0x80; 16]),
    TopicId::from_bytes([0x0d; 16]),
];

/// The channels a task may receive.
pub const CHANNELS: [ChannelId; 4] = [
    ChannelId::new(TOPICS[0], 0),
    ChannelId::new(TOPICS[0], 1),
    ChannelId::new(TOPICS[1], 0),
    ChannelId::new(TOPICS[2], 0),
];

/// Every channel a cause may name: the four above and one no task here receives.
pub const CAUSE_CHANNELS: [ChannelId; 5] =
    [CHANNELS[0], CHANNELS[1], CHANNELS[2], CHANNELS[3], ChannelId::new(TOPICS[3], 5)];

/// A position, resolved against the host's state when the operation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pos {
    /// Near where the host is: for a feed, `gap` past the next position its consumer would
    /// read (positions skipped are transaction markers or aborted records); for a cause,
    /// around the named channel's next position; for a seed, `gap` above the log start.
    Next(u8),
    /// An absolute small position (0..=14): replays, positions out of order.
    At(u8),
    /// One of four extremes; a chaos host uses them as they are, an honest one as `Next(0)`.
    Extreme(u8),
}

/// The `parsley.causes` headers a received record carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Header {
    /// One canonical value of these causes (channel index into [`CAUSE_CHANNELS`], position).
    Causes(Vec<(u8, Pos)>),
    /// No header: no causes.
    Absent,
    /// One header with a null value.
    Null,
    /// The same canonical value twice.
    Twice(Vec<(u8, Pos)>),
    /// A canonical value with the byte at `at` (modulo its length) replaced by `byte`.
    Damaged { causes: Vec<(u8, Pos)>, at: u8, byte: u8 },
    /// Arbitrary bytes.
    Raw(Vec<u8>),
}

/// One thing a host (or the world) does. A `channel` byte names a received channel by
/// index (modulo how many there are), or, from 0xf8 up, any of [`CHANNELS`] (possibly one
/// the task does not receive).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Receive {
        channel: u8,
        position: Pos,
        header: Header,
    },
    Drain,
    /// `take_changes`, applied to the host's store: the step commits.
    Commit,
    /// A crash: the engine is dropped and restored from the store, receiving the channels
    /// of `scope` (a mask over [`CHANNELS`]; `None`: the same ones). Channels without a
    /// baseline are seeded from `seeds`; the consumer resumes up to three positions below
    /// `fed_up_to + 1` (two bits of `rewind` per channel), so replays are dropped.
    Restart {
        scope: Option<u8>,
        seeds: [Pos; 4],
        rewind: u8,
    },
    Seed {
        channel: u8,
        baseline: Pos,
    },
    ObserveReadPosition {
        channel: u8,
        next: Pos,
    },
    /// Prunes with the world's facts: the bits of `unknown` (over [`CAUSE_CHANNELS`]) make
    /// a channel's fact unknown; `skew` makes an honest host's log starts stale, and a
    /// chaos host's wrong.
    Prune {
        unknown: u8,
        skew: u8,
    },
    /// Retention: the log start of a channel of [`CAUSE_CHANNELS`] moves forward by `by`.
    Retention {
        channel: u8,
        by: u8,
    },
    /// A log-start check: an honest host reports the log start up to `at`'s gap stale.
    ObserveLogStart {
        channel: u8,
        at: Pos,
    },
    /// A topic of [`TOPICS`] is deleted: an honest host never reads or receives it again.
    TopicGone {
        topic: u8,
    },
    Stamp,
}

/// The task's configuration and first received channels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setup {
    pub chaos: bool,
    /// Held payloads weigh something ([`weigh`]) toward `max_held_bytes`.
    pub weigh: bool,
    /// Mask over [`CHANNELS`].
    pub received: u8,
    /// At most 15.
    pub max_held_records: Option<usize>,
    /// A multiple of 8, at most 504.
    pub max_held_bytes: Option<usize>,
    /// `None`: the default; otherwise 28..=91 bytes (one pair fits, three topics do not).
    pub metadata_budget: Option<usize>,
    /// The first seed of each channel, as in [`Op::Restart`].
    pub seeds: [Pos; 4],
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Case {
    pub setup: Setup,
    pub ops: Vec<Op>,
}

/// What a case reached: the anti-vacuity evidence of a sweep (a property that holds because
/// nothing happened proves nothing).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub deliveries: usize,
    /// Deliveries of records that had waited: received in an earlier operation.
    pub released: usize,
    pub duplicates: usize,
    pub commits: usize,
    pub restores: usize,
    /// Restores that brought held records back.
    pub restores_holding: usize,
    /// Pairs the pruning rule dropped (frontier and delivered past).
    pub pruned: usize,
    /// Refusals by reason, a restore's refusal of a scope change included.
    pub refusals: BTreeMap<RefusalReason, usize>,
    /// Seeds and feeds at `i64::MAX` the engine refused, as it must.
    pub largest_position_refused: usize,
}

/// How much a held payload (a record number) weighs when [`Setup::weigh`] is set.
pub fn weigh(payload: &u64) -> usize {
    (*payload % 5) as usize * 16
}

/// Checks one input; panics, naming the broken property, if the engine breaks one.
pub fn check(data: &[u8]) {
    run(&parse(data));
}

// ---------------------------------------------------------------------------------------
// Reading the input.

struct Bytes<'a>(std::slice::Iter<'a, u8>);

impl Bytes<'_> {
    fn byte(&mut self) -> Option<u8> {
        self.0.next().copied()
    }

    fn pos(&mut self) -> Option<Pos> {
        Some(match self.byte()? {
            b @ 0..=0xef => Pos::Next(b % 4),
            b @ 0xf0..=0xfe => Pos::At(b - 0xf0),
            0xff => Pos::Extreme(self.byte()? % 4),
        })
    }

    fn causes(&mut self, count: u8) -> Option<Vec<(u8, Pos)>> {
        (0..count).map(|_| Some((self.byte()? % 5, self.pos()?))).collect()
    }

    fn header(&mut self) -> Option<Header> {
        let h = self.byte()?;
        Some(match h {
            0..=0xaf => Header::Causes(self.causes(h & 3)?),
            0xb0..=0xcf => Header::Causes(self.causes(3 + (h & 3))?),
            0xd0..=0xf7 => Header::Absent,
            // One receipt in 32 carries a header no honest sender writes.
            _ => match h & 3 {
                0 => Header::Null,
                1 => {
                    let count = self.byte()? % 4;
                    Header::Twice(self.causes(count)?)
                }
                2 => {
                    let count = self.byte()? % 4;
                    Header::Damaged { causes: self.causes(count)?, at: self.byte()?, byte: self.byte()? }
                }
                _ => {
                    let len = self.byte()? % 16;
                    Header::Raw((0..len).map(|_| self.byte()).collect::<Option<_>>()?)
                }
            },
        })
    }

    fn seeds(&mut self) -> Option<[Pos; 4]> {
        Some([self.pos()?, self.pos()?, self.pos()?, self.pos()?])
    }

    fn op(&mut self) -> Option<Op> {
        Some(match self.byte()? % 20 {
            0..=6 | 19 => Op::Receive { channel: self.byte()?, position: self.pos()?, header: self.header()? },
            7 | 8 => Op::Drain,
            9 | 10 => Op::Commit,
            11 => {
                let scope = self.byte()?;
                Op::Restart {
                    scope: (scope & 0x80 != 0).then_some(scope & 0x0f),
                    seeds: self.seeds()?,
                    rewind: self.byte()?,
                }
            }
            12 => Op::Seed { channel: self.byte()?, baseline: self.pos()? },
            13 => Op::ObserveReadPosition { channel: self.byte()?, next: self.pos()? },
            14 => Op::Prune { unknown: self.byte()?, skew: self.byte()? },
            15 => Op::Retention { channel: self.byte()? % 5, by: self.byte()? % 8 },
            16 => Op::ObserveLogStart { channel: self.byte()?, at: self.pos()? },
            17 => Op::TopicGone { topic: self.byte()? % 4 },
            _ => Op::Stamp,
        })
    }
}

/// Reads any bytes as a case: the setup's bytes (missing ones read as zero), then
/// operations until the bytes run out (an operation cut short is dropped).
pub fn parse(data: &[u8]) -> Case {
    let mut head = [0u8; 5];
    let split = data.len().min(head.len());
    head[..split].copy_from_slice(&data[..split]);
    let mut bytes = Bytes(data[split..].iter());
    let [flags, received, records, held_bytes, budget] = head;
    let seeds = bytes.seeds().unwrap_or([Pos::Next(0); 4]);
    let setup = Setup {
        chaos: flags & 3 == 3,
        weigh: flags & 4 != 0,
        received: received & 0x0f,
        // Each bound in one case of four.
        max_held_records: (records >= 0xc0).then_some(usize::from(records & 0x0f)),
        max_held_bytes: (held_bytes >= 0xc0).then_some(usize::from(held_bytes & 0x3f) * 8),
        metadata_budget: (budget >= 0xc0).then_some(28 + usize::from(budget & 0x3f)),
        seeds,
    };
    let ops = std::iter::from_fn(|| bytes.op()).collect();
    Case { setup, ops }
}

// ---------------------------------------------------------------------------------------
// The model.

/// A refusal as the model predicts it: reason and coordinate (the diagnosis is prose).
type Expected = (RefusalReason, Option<ChannelId>, Option<Position>);

fn key(refusal: &Refusal) -> Expected {
    (refusal.reason, refusal.channel, refusal.position)
}

/// What the task has done, as far as its committed steps go (`committed`) or including the
/// step in progress (`live`). A crash drops `live` back to `committed`.
#[derive(Clone, Debug, Default)]
struct Lineage {
    /// Per received channel: every position at or below it is fed, or the host said it
    /// will never yield a record.
    fed_up_to: BTreeMap<ChannelId, Position>,
    /// Received, not yet delivered: per channel, by position, the causes and the payload.
    held: BTreeMap<ChannelId, BTreeMap<Position, (CausalPast, u64)>>,
    /// Per channel, the highest position the deliveries covered: their own positions and
    /// every cause they carried.
    covered: BTreeMap<ChannelId, Position>,
    /// Per channel, the highest position received causes and deliveries named.
    named: BTreeMap<ChannelId, Position>,
    /// Channels whose delivered-past pair the pruning rule dropped at some point.
    clock_pruned: BTreeSet<ChannelId>,
    /// Channels whose frontier pair the pruning rule dropped at some point.
    frontier_pruned: BTreeSet<ChannelId>,
}

impl Lineage {
    /// How far `channel` is settled: below its first held record, else `fed_up_to`.
    fn settled(&self, channel: &ChannelId) -> Option<Position> {
        match self.held.get(channel).and_then(|h| h.keys().next()) {
            Some(&head) => Some(head - 1),
            None => self.fed_up_to.get(channel).copied(),
        }
    }

    fn held_count(&self) -> usize {
        self.held.values().map(BTreeMap::len).sum()
    }
}

fn raise(map: &mut BTreeMap<ChannelId, Position>, channel: ChannelId, position: Position) {
    let entry = map.entry(channel).or_insert(position);
    *entry = (*entry).max(position);
}

/// What a host persisted: the step changes applied, one after the other.
#[derive(Clone, Debug, Default)]
struct Store {
    fed_up_to: BTreeMap<ChannelId, Position>,
    held: BTreeMap<(ChannelId, Position), HeldRecord<u64>>,
    frontier: BTreeMap<ChannelId, Position>,
    clock: BTreeMap<ChannelId, Position>,
}

impl Store {
    fn apply(&mut self, changes: StepChanges<u64>) -> Result<(), String> {
        for record in changes.held_inserted {
            let at = (record.channel, record.position);
            if self.held.insert(at, record).is_some() {
                return Err(format!("held record {at:?} inserted twice"));
            }
        }
        for at in changes.held_removed {
            if self.held.remove(&at).is_none() {
                return Err(format!("held record {at:?} removed, but the store never had it"));
            }
        }
        self.fed_up_to.extend(changes.fed_up_to);
        for channel in changes.channels_removed {
            if self.held.keys().any(|(c, _)| *c == channel) {
                return Err(format!("channel {channel} removed while the store holds its records"));
            }
            self.fed_up_to.remove(&channel);
        }
        self.frontier.extend(changes.frontier_upserts);
        for channel in changes.frontier_removed {
            self.frontier.remove(&channel);
        }
        self.clock.extend(changes.clock_upserts);
        for channel in changes.clock_removed {
            self.clock.remove(&channel);
        }
        Ok(())
    }

    fn state(&self) -> PersistedState<u64> {
        PersistedState {
            format_version: ORDERING_STATE_FORMAT,
            fed_up_to: self.fed_up_to.clone(),
            held: self.held.values().cloned().collect(),
            frontier: self.frontier.iter().map(|(c, p)| (*c, *p)).collect(),
            delivered: self.clock.iter().map(|(c, p)| (*c, *p)).collect(),
        }
    }
}

/// Held records in one order, so states compare whatever order they were listed in.
fn normalized(mut state: PersistedState<u64>) -> PersistedState<u64> {
    state.held.sort_by_key(|r| (r.channel, r.position));
    state
}

struct Harness {
    chaos: bool,
    config: EngineConfig,
    weigh: bool,
    engine: Engine<u64>,
    store: Store,
    // The world.
    log_start: BTreeMap<ChannelId, Position>,
    gone: BTreeSet<TopicId>,
    // The host.
    received: BTreeSet<ChannelId>,
    /// The next position the host's consumer reads, per channel.
    cursor: BTreeMap<ChannelId, Position>,
    next_payload: u64,
    // The model.
    live: Lineage,
    committed: Lineage,
    /// Highest position fed (or read past) per channel in this execution.
    fed_this_execution: BTreeMap<ChannelId, Position>,
    refusal: Option<Expected>,
    /// The refusal has been reported in a step's changes.
    refusal_reported: bool,
    /// The record of the receipt in progress, if any.
    receiving: Option<u64>,
    tally: Tally,
    /// Where we are, for messages.
    at: String,
}

/// Plays a case and tells what it reached; panics, naming the property, the operation and
/// its index, on a violation.
pub fn run(case: &Case) -> Tally {
    let mut h = Harness::start(&case.setup);
    for (i, op) in case.ops.iter().enumerate() {
        h.at = format!("operation {i} ({op:?})");
        h.apply(op);
        h.check_state();
    }
    // The end of every case: a drain, a commit, and a restore from the store.
    h.at = "the final drain and commit".to_string();
    h.apply(&Op::Drain);
    h.apply(&Op::Commit);
    h.check_state();
    h.tally
}

impl Harness {
    fn start(setup: &Setup) -> Self {
        let config = EngineConfig {
            metadata_budget: setup.metadata_budget.unwrap_or(codec::DEFAULT_METADATA_BUDGET),
            max_held_records: setup.max_held_records,
            max_held_bytes: setup.max_held_bytes,
        };
        let received: BTreeSet<ChannelId> = mask(setup.received).collect();
        let engine = Engine::new(config.clone(), received.iter().copied());
        let engine = if setup.weigh { engine.with_weigher(weigh) } else { engine };
        let mut h = Harness {
            chaos: setup.chaos,
            config,
            weigh: setup.weigh,
            engine,
            store: Store::default(),
            log_start: BTreeMap::new(),
            gone: BTreeSet::new(),
            received,
            cursor: BTreeMap::new(),
            next_payload: 0,
            live: Lineage::default(),
            committed: Lineage::default(),
            fed_this_execution: BTreeMap::new(),
            refusal: None,
            refusal_reported: false,
            receiving: None,
            tally: Tally::default(),
            at: "the start".to_string(),
        };
        h.check_state();
        h.seed_unseeded(&setup.seeds);
        h.check_state();
        h
    }

    fn fail(&self, what: impl std::fmt::Display) -> ! {
        panic!("feed property broken at {}: {what}", self.at)
    }

    fn log_start(&self, channel: &ChannelId) -> Position {
        self.log_start.get(channel).copied().unwrap_or(0)
    }

    fn cursor(&self, channel: &ChannelId) -> Position {
        self.cursor.get(channel).copied().unwrap_or(0)
    }

    /// The channel a `channel` byte names, or `None` when an honest host would not touch it
    /// (its topic is gone) or nothing is received.
    fn channel(&self, selector: u8) -> Option<ChannelId> {
        let channel = if selector >= 0xf8 || self.received.is_empty() {
            CHANNELS[usize::from(selector) % CHANNELS.len()]
        } else {
            *self.received.iter().nth(usize::from(selector) % self.received.len())?
        };
        (self.chaos || !self.gone.contains(&channel.topic)).then_some(channel)
    }

    fn held_bytes(&self) -> usize {
        let weight = |payload: &u64| if self.weigh { weigh(payload) } else { 0 };
        self.live.held.values().flat_map(|h| h.values()).map(|(causes, p)| weight(p) + codec::encoded_len(causes)).sum()
    }

    fn over_held_limits(&self) -> bool {
        self.config.max_held_records.is_some_and(|max| self.live.held_count() > max)
            || self.config.max_held_bytes.is_some_and(|max| self.held_bytes() > max)
    }

    /// The model's refusal becomes `expected` unless the task already refused.
    fn refuse(&mut self, expected: Expected) {
        if self.refusal.is_none() {
            self.refusal = Some(expected);
            *self.tally.refusals.entry(expected.0).or_default() += 1;
        }
    }

    /// Compares an engine answer that is either a refusal or a value with the model's.
    fn expect<T: std::fmt::Debug + PartialEq>(&mut self, got: Result<T, Refusal>, want: Result<T, Expected>) {
        match (&got, &want) {
            (Ok(g), Ok(w)) if g == w => {}
            (Err(g), Err(w)) if key(g) == *w => self.refuse(*w),
            _ => self.fail(format!("the engine answered {got:?}, the contract says {want:?}")),
        }
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Receive { channel, position, header } => {
                if let Some(channel) = self.channel(*channel) {
                    self.receive(channel, *position, header);
                }
            }
            Op::Drain => self.drain(),
            Op::Commit => self.commit(),
            Op::Restart { scope, seeds, rewind } => self.restart(*scope, seeds, *rewind),
            Op::Seed { channel, baseline } => {
                if let Some(channel) = self.channel(*channel) {
                    self.seed(channel, *baseline);
                }
            }
            Op::ObserveReadPosition { channel, next } => {
                if let Some(channel) = self.channel(*channel) {
                    self.observe_read_position(channel, *next);
                }
            }
            Op::Prune { unknown, skew } => self.prune(*unknown, *skew),
            Op::Retention { channel, by } => {
                let channel = CAUSE_CHANNELS[usize::from(*channel) % CAUSE_CHANNELS.len()];
                let start = self.log_start(&channel).saturating_add(i64::from(*by % 8));
                self.log_start.insert(channel, start);
            }
            Op::ObserveLogStart { channel, at } => {
                if let Some(channel) = self.channel(*channel) {
                    self.observe_log_start(channel, *at);
                }
            }
            Op::TopicGone { topic } => {
                self.gone.insert(TOPICS[usize::from(*topic) % TOPICS.len()]);
            }
            Op::Stamp => self.stamp(),
        }
    }

    // -- receive ----------------------------------------------------------------------

    fn feed_position(&self, channel: ChannelId, position: Pos) -> Position {
        let next = |gap: u8| self.cursor(&channel).saturating_add(i64::from(gap));
        let position = match position {
            Pos::Next(gap) => next(gap),
            Pos::At(v) => i64::from(v),
            Pos::Extreme(k) if self.chaos => [i64::MAX, i64::MAX - 1, i64::MAX - 2, i64::MIN, -1][usize::from(k % 5)],
            Pos::Extreme(_) => next(0),
        };
        if self.chaos {
            // Including i64::MAX, which names no record a log can hold: the engine refuses it.
            position
        } else {
            // An honest consumer reads nothing below the log start, and no log reaches the
            // largest position.
            position.max(self.log_start(&channel)).min(i64::MAX - 1)
        }
    }

    fn cause_position(&self, record: (ChannelId, Position), cause: ChannelId, position: Pos) -> Position {
        match position {
            // On the record's own channel, just below it; elsewhere around the next
            // position of that channel: already fed, or not yet.
            Pos::Next(gap) if cause == record.0 => record.1.saturating_sub(1 + i64::from(gap)).max(0),
            Pos::Next(gap) => self.cursor(&cause).saturating_add(i64::from(gap) - 2).max(0),
            Pos::At(v) => i64::from(v),
            Pos::Extreme(k) => [i64::MAX - 1, i64::MAX - 2, 1 << 40, 0][usize::from(k % 4)],
        }
    }

    fn causes(&self, record: (ChannelId, Position), pairs: &[(u8, Pos)]) -> CausalPast {
        CausalPast::from_pairs(pairs.iter().map(|&(c, p)| {
            let cause = CAUSE_CHANNELS[usize::from(c) % CAUSE_CHANNELS.len()];
            (cause, self.cause_position(record, cause, p))
        }))
    }

    fn header_values(&self, record: (ChannelId, Position), header: &Header) -> Vec<Option<Vec<u8>>> {
        match header {
            Header::Causes(pairs) => vec![Some(self.causes(record, pairs).encode())],
            Header::Absent => vec![],
            Header::Null => vec![None],
            Header::Twice(pairs) => {
                let value = self.causes(record, pairs).encode();
                vec![Some(value.clone()), Some(value)]
            }
            Header::Damaged { causes, at, byte } => {
                let mut value = self.causes(record, causes).encode();
                let i = usize::from(*at) % value.len();
                value[i] = *byte;
                vec![Some(value)]
            }
            Header::Raw(bytes) => vec![Some(bytes.clone())],
        }
    }

    /// The contract of `receive`, in the order the engine checks it.
    fn expected_receipt(
        &mut self,
        channel: ChannelId,
        position: Position,
        causes: &Result<CausalPast, codec::DecodeError>,
    ) -> Result<bool, Expected> {
        if let Some(refusal) = self.refusal {
            return Err(refusal);
        }
        let at = (Some(channel), Some(position));
        let causes = match causes {
            Ok(causes) => causes,
            Err(codec::DecodeError::Undecodable(_)) => return Err((RefusalReason::UndecodableMetadata, at.0, at.1)),
            Err(codec::DecodeError::OverBudget { .. }) => {
                return Err((RefusalReason::MetadataBudgetExceeded, at.0, at.1))
            }
        };
        if !self.received.contains(&channel) {
            return Err((RefusalReason::SubstrateMisconfigured, at.0, at.1));
        }
        let Some(&fed_up_to) = self.live.fed_up_to.get(&channel) else {
            return Err((RefusalReason::SubstrateMisconfigured, at.0, at.1));
        };
        if position == i64::MAX {
            self.tally.largest_position_refused += 1;
            return Err((RefusalReason::SubstrateMisconfigured, at.0, at.1));
        }
        if position < 0 || self.fed_this_execution.get(&channel).is_some_and(|&f| position <= f) {
            return Err((RefusalReason::OutOfOrderFeed, at.0, at.1));
        }
        self.fed_this_execution.insert(channel, position);
        if position <= fed_up_to {
            return Ok(false);
        }
        if causes.get(&channel).is_some_and(|own| own >= position) {
            return Err((RefusalReason::ImpossibleSelfCause, at.0, at.1));
        }
        Ok(true)
    }

    fn receive(&mut self, channel: ChannelId, position: Pos, header: &Header) {
        let position = self.feed_position(channel, position);
        let values = self.header_values((channel, position), header);
        let values: Vec<Option<&[u8]>> = values.iter().map(|v| v.as_deref()).collect();
        let payload = self.next_payload;
        self.next_payload += 1;
        let decoded = codec::decode_headers(&values, self.config.metadata_budget);
        let expected = self.expected_receipt(channel, position, &decoded);
        let got = self.engine.receive(channel, position, &values, payload);
        self.receiving = Some(payload);
        self.cursor.insert(channel, self.cursor(&channel).max(position.saturating_add(1)));
        match (got, expected) {
            (Ok(Receipt::Duplicate), Ok(false)) => self.tally.duplicates += 1,
            (Ok(Receipt::Accepted { deliveries }), Ok(true)) => {
                let causes = decoded.expect("accepted, so decoded");
                let was_empty = self.live.held.get(&channel).is_none_or(BTreeMap::is_empty);
                self.live.fed_up_to.insert(channel, position);
                for (c, p) in causes.iter() {
                    raise(&mut self.live.named, c, p);
                }
                self.live.held.entry(channel).or_default().insert(position, (causes, payload));
                for delivery in &deliveries {
                    self.deliver(delivery);
                }
                if was_empty {
                    self.nothing_deliverable("the receipt's drain");
                }
                if self.over_held_limits() {
                    self.refuse((RefusalReason::HeldLimitExceeded, Some(channel), Some(position)));
                }
            }
            (got, expected) => {
                let got = got.map(|r| matches!(r, Receipt::Accepted { .. }));
                self.expect(got, expected);
            }
        }
        self.receiving = None;
    }

    // -- delivery ---------------------------------------------------------------------

    fn deliver(&mut self, delivery: &HeldRecord<u64>) {
        let channel = delivery.channel;
        let head = self.live.held.get(&channel).and_then(|h| h.iter().next());
        let Some((&position, (causes, payload))) = head else {
            self.fail(format!("delivered {channel}@{}, but nothing is held there", delivery.position));
        };
        if (position, causes, payload) != (delivery.position, &delivery.causes, &delivery.payload) {
            self.fail(format!(
                "delivered {channel}@{} (record {}, causes {:?}), but the head of the channel is @{position} \
                 (record {payload}, causes {causes:?}): FIFO broken or a record invented",
                delivery.position, delivery.payload, delivery.causes
            ));
        }
        for (cause, required) in delivery.causes.iter() {
            if self.received.contains(&cause) && self.live.settled(&cause).is_none_or(|s| s < required) {
                self.fail(format!(
                    "delivered {channel}@{position} before its cause {cause}@{required}: the task receives \
                     {cause} and has settled it only to {:?}",
                    self.live.settled(&cause)
                ));
            }
        }
        if !self.chaos {
            if let Some(&covered) = self.live.covered.get(&channel) {
                if position <= covered {
                    self.fail(format!(
                        "delivered {channel}@{position}, at or below {covered}, which earlier deliveries \
                         already covered: delivered twice, or after its effect"
                    ));
                }
            }
        }
        self.live.held.get_mut(&channel).expect("held").remove(&position);
        self.tally.deliveries += 1;
        if self.receiving != Some(delivery.payload) {
            self.tally.released += 1;
        }
        raise(&mut self.live.covered, channel, position);
        raise(&mut self.live.named, channel, position);
        for (c, p) in delivery.causes.iter() {
            raise(&mut self.live.covered, c, p);
        }
    }

    /// Whether a record with these causes may go now, by the rule: every cause on a
    /// received channel is settled.
    fn deliverable(&self, causes: &CausalPast) -> bool {
        causes.iter().all(|(c, p)| !self.received.contains(&c) || self.live.settled(&c).is_some_and(|s| s >= p))
    }

    fn nothing_deliverable(&self, after: &str) {
        for (channel, held) in &self.live.held {
            if let Some((position, (causes, _))) = held.iter().next() {
                if self.deliverable(causes) {
                    self.fail(format!(
                        "{after} left {channel}@{position} held, though every cause it names on a received \
                         channel is settled ({causes:?})"
                    ));
                }
            }
        }
    }

    fn drain(&mut self) {
        let deliveries = self.engine.drain();
        if self.refusal.is_some() && !deliveries.is_empty() {
            self.fail("a refused task delivered");
        }
        for delivery in &deliveries {
            self.deliver(delivery);
        }
        if self.refusal.is_none() {
            self.nothing_deliverable("a drain");
        }
    }

    // -- commit and restore -----------------------------------------------------------

    fn commit(&mut self) {
        let changes = self.engine.take_changes();
        let reported = changes.refusal.as_ref().map(key);
        let due = if self.refusal_reported { None } else { self.refusal };
        if reported != due {
            self.fail(format!("the step's changes report the refusal {reported:?}; due: {due:?}"));
        }
        self.refusal_reported |= reported.is_some();
        if let Err(e) = self.store.apply(changes) {
            self.fail(format!("the step's changes do not apply to the store: {e}"));
        }
        let again = self.engine.take_changes();
        if !again.is_empty() {
            self.fail(format!("changes taken twice: the second take_changes is not empty: {again:?}"));
        }
        let snapshot = normalized(self.engine.snapshot());
        if normalized(self.store.state()) != snapshot {
            self.fail(format!(
                "the store built from the step changes is not the engine's state:\nstore:  {:?}\nengine: {snapshot:?}",
                normalized(self.store.state())
            ));
        }
        match self.restore(self.received.clone()) {
            Ok(restored) => {
                let held_limit = restored.refusal().map(|r| r.reason);
                let due = self.over_held_limits().then_some(RefusalReason::HeldLimitExceeded);
                if normalized(restored.snapshot()) != snapshot
                    || restored.status().channels != self.engine.status().channels
                    || restored.held_bytes() != self.engine.held_bytes()
                    || held_limit != due
                {
                    self.fail(format!(
                        "the engine restored from the committed store differs: {:?} (refusal {held_limit:?}, \
                         due {due:?}) against {:?}",
                        restored.status(),
                        self.engine.status()
                    ));
                }
            }
            Err(refusal) => self.fail(format!("the committed store does not restore: {refusal:?}")),
        }
        self.committed = self.live.clone();
        self.tally.commits += 1;
    }

    fn restore(&self, received: BTreeSet<ChannelId>) -> Result<Engine<u64>, Refusal> {
        let engine = Engine::restore(self.config.clone(), received, self.store.state())?;
        Ok(if self.weigh { engine.with_weigher(weigh) } else { engine })
    }

    fn restart(&mut self, scope: Option<u8>, seeds: &[Pos; 4], rewind: u8) {
        let mut received: BTreeSet<ChannelId> = match scope {
            Some(m) => mask(m).collect(),
            None => self.received.clone(),
        };
        if !self.chaos {
            received.retain(|c| !self.gone.contains(&c.topic));
        }
        // Restore refuses at the first held record (in channel order) whose channel left.
        let stranded = self
            .committed
            .held
            .iter()
            .filter(|(c, h)| !received.contains(c) && !h.is_empty())
            .find_map(|(c, h)| h.keys().next().map(|p| (*c, *p)));
        let engine = match (self.restore(received.clone()), stranded) {
            (Ok(engine), None) => engine,
            (Err(refusal), Some((c, p)))
                if key(&refusal) == (RefusalReason::ChannelRemovedWithHeldMessages, Some(c), Some(p)) =>
            {
                *self.tally.refusals.entry(RefusalReason::ChannelRemovedWithHeldMessages).or_default() += 1;
                // The host keeps its old declaration, which restores.
                received = self.received.clone();
                match self.restore(received.clone()) {
                    Ok(engine) => engine,
                    Err(refusal) => self.fail(format!("the committed store does not restore: {refusal:?}")),
                }
            }
            (got, stranded) => self.fail(format!(
                "restore receiving {received:?} answered {:?}; held records stranded on a leaving channel: \
                 {stranded:?}",
                got.map(|e| e.status())
            )),
        };
        self.engine = engine;
        self.received = received;
        self.tally.restores += 1;
        if self.committed.held_count() > 0 {
            self.tally.restores_holding += 1;
        }
        self.live = self.committed.clone();
        self.live.fed_up_to.retain(|c, _| self.received.contains(c));
        self.fed_this_execution.clear();
        self.refusal = None;
        self.refusal_reported = false;
        if self.over_held_limits() {
            self.refusal = Some((RefusalReason::HeldLimitExceeded, None, None));
        }
        for (i, channel) in CHANNELS.iter().enumerate() {
            if let Some(&fed) = self.live.fed_up_to.get(channel) {
                let back = i64::from((rewind >> (2 * i)) & 3);
                let mut resume = fed.saturating_add(1).saturating_sub(back);
                if !self.chaos {
                    resume = resume.max(self.log_start(channel));
                }
                self.cursor.insert(*channel, resume);
            }
        }
        self.check_state();
        self.seed_unseeded(seeds);
    }

    // -- seeds, read positions, log starts ----------------------------------------------

    /// What a host seeds a channel without a baseline with.
    fn seed_value(&self, channel: ChannelId, baseline: Pos) -> Position {
        let earliest = self.log_start(&channel).saturating_sub(1);
        let value = match baseline {
            Pos::Next(gap) => earliest.saturating_add(i64::from(gap)),
            Pos::At(v) => i64::from(v) - 1,
            Pos::Extreme(k) if self.chaos => [i64::MIN, i64::MAX, i64::MAX - 1, i64::MAX - 2, -2][usize::from(k % 5)],
            Pos::Extreme(_) => earliest,
        };
        if self.chaos {
            value
        } else {
            value.max(earliest).min(i64::MAX - 2)
        }
    }

    fn seed_unseeded(&mut self, seeds: &[Pos; 4]) {
        for (channel, baseline) in CHANNELS.iter().zip(seeds) {
            if self.received.contains(channel) && !self.live.fed_up_to.contains_key(channel) {
                self.seed(*channel, *baseline);
            }
        }
    }

    fn seed(&mut self, channel: ChannelId, baseline: Pos) {
        let value = self.seed_value(channel, baseline);
        let got = self.engine.seed(channel, value);
        if let Some(refusal) = self.refusal {
            return self.expect(got, Err(refusal));
        }
        if !self.received.contains(&channel) {
            return self.expect(got, Err((RefusalReason::SubstrateMisconfigured, Some(channel), None)));
        }
        if let Some(&existing) = self.live.fed_up_to.get(&channel) {
            return self.expect(got, Ok(existing));
        }
        if value == i64::MAX {
            self.tally.largest_position_refused += 1;
            return self.expect(got, Err((RefusalReason::SubstrateMisconfigured, Some(channel), Some(value))));
        }
        // Never below what the delivered past accounts for on the channel. An honest host
        // seeds at or above the log start, and the pruning rule drops only pairs below a
        // log start, so the floor is exactly what the deliveries covered; after a chaos
        // host's false facts it may be anything from the value up to that.
        let floor = value.max(-1);
        let want = floor.max(self.live.covered.get(&channel).copied().unwrap_or(-1));
        let baseline = match got {
            Ok(b) if b == want || (self.chaos && (floor..=want).contains(&b)) => b,
            got => return self.expect(got, Ok(want)),
        };
        self.live.fed_up_to.insert(channel, baseline);
        self.cursor.insert(channel, baseline.saturating_add(1));
    }

    fn observe_read_position(&mut self, channel: ChannelId, next: Pos) {
        let next = match next {
            Pos::Next(gap) => self.cursor(&channel).saturating_add(i64::from(gap)),
            Pos::At(v) => i64::from(v),
            Pos::Extreme(k) if self.chaos => [i64::MIN, i64::MAX, 0, -1][usize::from(k % 4)],
            Pos::Extreme(_) => self.cursor(&channel),
        };
        let got = self.engine.observe_read_position(channel, next);
        if let Some(refusal) = self.refusal {
            return self.expect(got, Err(refusal));
        }
        self.expect(got, Ok(()));
        if !self.received.contains(&channel) {
            return;
        }
        let Some(&fed) = self.live.fed_up_to.get(&channel) else {
            return;
        };
        let read_up_to = next.saturating_sub(1);
        if read_up_to > fed {
            self.live.fed_up_to.insert(channel, read_up_to);
            raise(&mut self.fed_this_execution, channel, read_up_to);
        }
        self.cursor.insert(channel, self.cursor(&channel).max(next));
    }

    fn observe_log_start(&mut self, channel: ChannelId, at: Pos) {
        let world = self.log_start(&channel);
        let log_start = match at {
            // An honest host's facts may be stale, never ahead.
            Pos::Next(gap) if !self.chaos => world.saturating_sub(i64::from(gap)).max(0),
            Pos::Next(gap) => world.saturating_add(i64::from(gap)),
            _ if !self.chaos => world,
            Pos::At(v) => i64::from(v),
            Pos::Extreme(k) => [i64::MIN, i64::MAX, 0, -1][usize::from(k % 4)],
        };
        let got = self.engine.observe_log_start(channel, log_start);
        if let Some(refusal) = self.refusal {
            return self.expect(got, Err(refusal));
        }
        let settled = if self.received.contains(&channel) { self.live.settled(&channel) } else { None };
        match settled {
            // Retention passed a position the task has not settled.
            Some(s) if i128::from(log_start) > i128::from(s) + 1 => {
                self.expect(got, Err((RefusalReason::PositionsDiscardedUnread, Some(channel), Some(s + 1))))
            }
            _ => self.expect(got, Ok(())),
        }
    }

    // -- pruning and stamping -----------------------------------------------------------

    fn fact(&self, channel: &ChannelId, unknown: u8, skew: u8) -> ChannelFact {
        let Some(i) = CAUSE_CHANNELS.iter().position(|c| c == channel) else {
            return ChannelFact::Unknown;
        };
        let world = self.log_start(channel);
        if unknown & (1 << i) != 0 {
            ChannelFact::Unknown
        } else if self.gone.contains(&channel.topic) || (self.chaos && usize::from(skew >> 5) == i) {
            ChannelFact::TopicGone
        } else if self.chaos {
            ChannelFact::Live { log_start: world.saturating_add(i64::from(skew % 8) - 2) }
        } else {
            ChannelFact::Live { log_start: world.saturating_sub(i64::from(skew % 4)).max(0) }
        }
    }

    fn prune(&mut self, unknown: u8, skew: u8) {
        let fact = |c: &ChannelId| self.fact(c, unknown, skew);
        let received_topics: BTreeSet<TopicId> = self.received.iter().map(|c| c.topic).collect();
        // The rule: a frontier pair goes only with its topic; a delivered-past pair goes
        // when its topic is gone or it is below the log start, unless the task receives
        // the topic.
        let frontier_dropped: BTreeSet<ChannelId> =
            self.engine.frontier().iter().filter(|(c, _)| fact(c) == ChannelFact::TopicGone).map(|(c, _)| c).collect();
        let clock_dropped: BTreeSet<ChannelId> = self
            .engine
            .delivered_past()
            .iter()
            .filter(|(c, p)| {
                !received_topics.contains(&c.topic)
                    && match fact(c) {
                        ChannelFact::Live { log_start } => *p < log_start,
                        ChannelFact::TopicGone => true,
                        ChannelFact::Unknown => false,
                    }
            })
            .map(|(c, _)| c)
            .collect();
        let frontier = self.engine.frontier().clone().retain(|c, _| !frontier_dropped.contains(&c));
        let clock = self.engine.delivered_past().clone().retain(|c, _| !clock_dropped.contains(&c));
        let facts: BTreeMap<ChannelId, ChannelFact> = CAUSE_CHANNELS.iter().map(|c| (*c, fact(c))).collect();
        self.engine.prune(|c| facts.get(c).copied().unwrap_or(ChannelFact::Unknown));
        if self.engine.frontier() != &frontier || self.engine.delivered_past() != &clock {
            self.fail(format!(
                "pruning with {facts:?} left frontier {:?} and delivered past {:?}; the rule leaves {frontier:?} \
                 and {clock:?}",
                self.engine.frontier(),
                self.engine.delivered_past()
            ));
        }
        self.tally.pruned += frontier_dropped.len() + clock_dropped.len();
        self.live.frontier_pruned.extend(frontier_dropped);
        self.live.clock_pruned.extend(clock_dropped);
    }

    fn stamp(&mut self) {
        let got = self.engine.stamp();
        if let Some(refusal) = self.refusal {
            return self.expect(got, Err(refusal));
        }
        let frontier = self.engine.frontier().clone();
        if frontier.is_empty() {
            return self.expect(got, Ok(None));
        }
        if codec::encoded_len(&frontier) > self.config.metadata_budget {
            return self.expect(got, Err((RefusalReason::MetadataBudgetExceeded, None, None)));
        }
        match got {
            Ok(Some(bytes)) if CausalPast::decode(&bytes, self.config.metadata_budget).as_ref() == Ok(&frontier) => {}
            got => self.fail(format!("stamp answered {got:?} for the frontier {frontier:?}")),
        }
    }

    // -- the state after every operation -------------------------------------------------

    fn check_state(&self) {
        let refusal = self.engine.refusal().map(key);
        if refusal != self.refusal {
            self.fail(format!("the task's refusal is {refusal:?}; the model's {:?}", self.refusal));
        }
        if self.engine.received() != &self.received {
            self.fail(format!("the task receives {:?}, not {:?}", self.engine.received(), self.received));
        }
        for channel in &CHANNELS {
            let fed = self.engine.fed_up_to(channel);
            if fed != self.live.fed_up_to.get(channel).copied() {
                self.fail(format!(
                    "fed_up_to of {channel} is {fed:?}; the model's {:?}",
                    self.live.fed_up_to.get(channel)
                ));
            }
            let held: Vec<(Position, &CausalPast, u64)> =
                self.engine.held(channel).map(|r| (r.position, &r.causes, r.payload)).collect();
            let model: Vec<(Position, &CausalPast, u64)> = self
                .live
                .held
                .get(channel)
                .into_iter()
                .flat_map(|h| h.iter().map(|(p, (c, payload))| (*p, c, *payload)))
                .collect();
            if held != model {
                self.fail(format!("{channel} holds {held:?}; the model {model:?}"));
            }
        }
        if self.engine.held_bytes() != self.held_bytes() {
            self.fail(format!("held bytes {} ; the model's {}", self.engine.held_bytes(), self.held_bytes()));
        }
        Self::compare_past("delivered past", self.engine.delivered_past(), &self.live.covered, &self.live.clock_pruned)
            .unwrap_or_else(|e| self.fail(e));
        Self::compare_past("frontier", self.engine.frontier(), &self.live.named, &self.live.frontier_pruned)
            .unwrap_or_else(|e| self.fail(e));
    }

    /// A past equals the model's on every channel pruning never touched, and is never above
    /// it on those it did (it names nothing that did not happen).
    fn compare_past(
        what: &str,
        past: &CausalPast,
        model: &BTreeMap<ChannelId, Position>,
        pruned: &BTreeSet<ChannelId>,
    ) -> Result<(), String> {
        for (channel, position) in past.iter() {
            match model.get(&channel) {
                Some(&m) if position == m || (position < m && pruned.contains(&channel)) => {}
                m => return Err(format!("the {what} names {channel}@{position}; the model {m:?}")),
            }
        }
        for (channel, position) in model {
            if past.get(channel).is_none() && !pruned.contains(channel) {
                return Err(format!("the {what} lost {channel}@{position}, which no pruning dropped"));
            }
        }
        Ok(())
    }
}

/// The channels of [`CHANNELS`] a mask selects.
fn mask(bits: u8) -> impl Iterator<Item = ChannelId> {
    CHANNELS.into_iter().enumerate().filter(move |(i, _)| bits & (1 << i) != 0).map(|(_, c)| c)
}
