//! The host's side of one task as a pure state machine: the start and step sequence that
//! every host of an [`Engine`] runs — the projector's task runner on Postgres and Kafka, and
//! the simulator's tasks — in one place. It performs no I/O and reads no clock: it says what
//! to do next ([`TaskHost::next_action`]), the host does it, and hands the result back through one
//! of the input methods. Timing stays with the host, which tells the machine when an
//! interval passed ([`TaskHost::log_start_check_due`], [`TaskHost::width_check_due`],
//! [`TaskHost::prune_due`]).
//!
//! The machine owns the engine and makes every decision about it that is not I/O: when to
//! restore, seed and check log starts, which channels a periodic check or a prune is about,
//! when to drain, how a skipped record is fed, when the consumer's read position may be
//! observed, when a step is idle, what the task's row must say after a commit, when to
//! feed carefully (few records a step, one per projection call) and when that ends, and that a refusal or a fence
//! is final for this execution.
//!
//! # States
//!
//! ```text
//!  Restore ──▶ ReadStarts ──▶ CommitStart ──▶ StartCommitting ──▶ Assign ──▶ Step ◀─────────────┐
//!   ▲  │                                          │ (a refusal)                 │ end_step()   │ committed()
//!   │  └── (state it cannot use) ──▶ PersistRefusal ──▶ Refused ◀── (a refusal) ─ Committing ───┘
//!   │                                     ▲                                       │
//!   │                                     └────────────── rejected() ─────────────┘
//!   ├── failed(), from any state but Refused and Fenced
//!   ├── a step after an out-of-range poll, once committed (or idle)
//!   └── interrupted(), when a round was abandoned midway          fenced(), from any state ──▶ Fenced
//!
//!  Step:  Between ──polled()──▶ Polled ──(due checks, drain())── receive()… ──▶ Feeding
//!            ▲                                                                     │ batch_done()
//!            └──────────── read_positions() ◀── Fed ◀──────────────────────────────┘
//! ```
//!
//! | state | `next_action()` | the host answers with |
//! |---|---|---|
//! | Restore | `Restore` | [`restored`](TaskHost::restored) (stored state and skips) or [`unrestorable`](TaskHost::unrestorable) |
//! | ReadStarts | `ReadStarts(every channel)` | [`started`](TaskHost::started): seeds channels without a baseline, checks every log start in channel order |
//! | CommitStart | `CommitStart` | [`take_start`](TaskHost::take_start), then `committed` / `failed` / `fenced` |
//! | Assign | `Assign(channel, fed_up_to + 1)` | [`assigned`](TaskHost::assigned) once the consumer reads from there |
//! | Step, between batches | a due check, else `Poll` (or `Commit` once an out-of-range step must end) | [`polled`](TaskHost::polled), or [`end_step`](TaskHost::end_step) |
//! | Step, polled | a due check, then `Drain` after a restore, then `Feed` | [`log_starts`](TaskHost::log_starts), [`widths`](TaskHost::widths), [`upstream_facts`](TaskHost::upstream_facts), [`skip_check`](TaskHost::skip_check); [`drain`](TaskHost::drain); [`receive`](TaskHost::receive)… then [`batch_done`](TaskHost::batch_done) |
//! | Step, fed | `ReadPositions` | [`read_positions`](TaskHost::read_positions) |
//! | any step state, engine refused | `Commit` | [`end_step`](TaskHost::end_step) |
//! | Committing | `AwaitCommit` | [`committed`](TaskHost::committed), [`failed`](TaskHost::failed), [`rejected`](TaskHost::rejected), [`fenced`](TaskHost::fenced) |
//! | PersistRefusal | `PersistRefusal(refusal)` | [`refusal_persisted`](TaskHost::refusal_persisted) / `failed` / `fenced` |
//! | Refused, Fenced | `Refused(refusal)`, `Fenced` | nothing: final until the task is started again |
//!
//! Due checks come in this order: the log starts of every channel after an out-of-range
//! poll, the log starts of every channel when the periodic check is due and the task holds
//! records, the partition counts of the received topics when the width check is due, the
//! facts of the upstream channels when the prune is due. They run between batches, never
//! inside one, and before the drain, so they see the engine as the database has it after a
//! commit; and every log-start check visits the channels in channel order, as the start
//! does: a refusal found by one is derived again, identically, by the next start.
//!
//! The rules, each in one place below:
//! - A failure (`failed`) restores before anything is fed again, and the engine is rebuilt
//!   from what was persisted; the positions the failed step had fed (and, when the
//!   projection rejected a batch, those it delivered) make the task *careful*: it projects
//!   one record per call until `fed_up_to` is past each, and polls one record in its first
//!   careful step and twice as many in each next one that commits (1, 2, 4, … up to
//!   [`MAX_CAREFUL_RECORDS`] and the host's own bound), so the replay of a large failed step
//!   takes a logarithmic number of steps more than its size, not one step per record. A
//!   host whose projection rejects a record in a careful step that fed more than one
//!   record reports a failure (`BatchRejected`), not the rejection: the replay then starts
//!   again from one record, and the rejection is found by a step that fed that record
//!   alone, after every record before it committed.
//! - A refusal ends the step (`Commit`) and, once committed, is final; so is a fence.
//! - The read position is observed only after a batch was fed completely (no refusal
//!   stopped it), so `fed_up_to` never passes a record that was not fed.
//! - After an out-of-range poll whose check refused nothing, the step ends and the task
//!   restores (reads again from `fed_up_to + 1`) rather than trust the consumer.
//! - A step is idle (nothing to commit) when it fed nothing, delivered nothing, drained
//!   nothing, pruned nothing and moved no read position, unless the engine refused or the
//!   row says `failing` (the next commit writes `running`).

use std::collections::{BTreeMap, BTreeSet};

use crate::channel::{ChannelId, Position, TopicId};
use crate::codec::DecodeError;
#[cfg(feature = "sim")]
use crate::engine::EngineSabotage;
use crate::engine::{ChannelFact, Delivery, Engine, EngineConfig, Fed, PersistedState, Receipt, StepChanges};
use crate::past::CausalPast;
use crate::refusal::{Refusal, RefusalReason};
use crate::startup::check_task_width;

/// A task's status as its row records it — the one status type of the workspace: the step
/// protocol decides on it, the store persists it (`parsley.tasks.status`), every status view
/// shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskStatus {
    /// Stepping normally.
    Running,
    /// A step failed; it is retried with backoff, and the next commit writes `running` again.
    Failing,
    /// Stopped delivering with a named reason until an operator acts; a start that does not
    /// derive the refusal again writes `running`.
    Refused,
}

impl TaskStatus {
    pub const ALL: [TaskStatus; 3] = [TaskStatus::Running, TaskStatus::Failing, TaskStatus::Refused];

    /// The word stored in `parsley.tasks.status` and shown by every status view.
    pub fn as_str(&self) -> &'static str {
        match self {
            TaskStatus::Running => "running",
            TaskStatus::Failing => "failing",
            TaskStatus::Refused => "refused",
        }
    }

    /// The status a stored word names, if any.
    pub fn parse(word: &str) -> Option<TaskStatus> {
        TaskStatus::ALL.into_iter().find(|t| t.as_str() == word)
    }
}

impl std::fmt::Display for TaskStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why log starts are to be read while the task runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogStartCheck {
    /// The consumer reported a position out of range: every received channel. Not
    /// answering it fails the step.
    OutOfRange,
    /// The periodic check, once the task holds records: every received channel, in
    /// channel order, as at start. Not answering it ([`TaskHost::skip_check`]) is not a
    /// failure: the next interval tries again.
    Periodic,
}

/// What the host does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Load the persisted state and the skipped records: [`TaskHost::restored`].
    Restore,
    /// Read each channel's log start and initial position: [`TaskHost::started`].
    ReadStarts(Vec<ChannelId>),
    /// Commit the start transaction: [`TaskHost::take_start`].
    CommitStart,
    /// Read each channel from this position (`fed_up_to + 1`): [`TaskHost::assigned`].
    Assign(Vec<(ChannelId, Position)>),
    /// Read these channels' log starts: [`TaskHost::log_starts`].
    ObserveLogStarts { channels: Vec<ChannelId>, check: LogStartCheck },
    /// Read the partition count of every received topic: [`TaskHost::widths`].
    CheckWidths,
    /// Learn the facts of these upstream channels: [`TaskHost::upstream_facts`].
    LearnUpstream(Vec<ChannelId>),
    /// Poll a batch (at most `max_records`, when set): [`TaskHost::polled`]; or end the step.
    Poll { max_records: Option<usize> },
    /// Deliver what became deliverable while the task was down: [`TaskHost::drain`].
    Drain,
    /// Feed the polled batch: [`TaskHost::receive`] per record, then [`TaskHost::batch_done`].
    Feed,
    /// Read the consumer's position on each channel: [`TaskHost::read_positions`].
    ReadPositions,
    /// End the step now: [`TaskHost::end_step`].
    Commit,
    /// A commit is in flight: answer with its result.
    AwaitCommit,
    /// Record this refusal in a transaction of its own: [`TaskHost::refusal_persisted`].
    PersistRefusal(Refusal),
    /// Refused: nothing more in this execution.
    Refused(Refusal),
    /// Another owner took the task: nothing more in this execution.
    Fenced,
}

/// One channel's facts at start: its log start, and the `fed_up_to` to seed it with if it
/// has no baseline (the initial position minus one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelStart {
    pub channel: ChannelId,
    pub log_start: Position,
    pub initial_fed_up_to: Position,
}

/// What a log-start check found: the channels whose log start was accepted, in the order
/// checked, and the refusal that stopped it, if any.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    pub accepted: Vec<ChannelId>,
    pub refusal: Option<Refusal>,
}

/// The start transaction's content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StartCommit<P> {
    /// Seeds and a refusal the start found.
    pub changes: StepChanges<P>,
    /// Write `running`: the row said `refused`, and this start derived no refusal.
    pub write_running: bool,
    /// Notify readers: the status changed.
    pub notify: bool,
}

/// A step's transaction content (the deliveries are the host's: it collected them from
/// [`TaskHost::drain`] and [`TaskHost::receive`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepCommit<P> {
    pub changes: StepChanges<P>,
    /// Hand the projection one record per call, so a rejection names its record.
    pub careful: bool,
    /// Write `running`: the row said `failing`, and the step did not refuse.
    pub write_running: bool,
    /// Notify readers even if the clock did not change: the status did.
    pub notify: bool,
}

/// How a step (or a start) failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// It did not commit: an error of the database, the broker or the projection.
    Error,
    /// The projection rejected the step's batch without naming a record: the careful retry
    /// also covers the records the step delivered.
    BatchRejected,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Batch {
    /// No batch in progress.
    Between,
    /// A batch was polled; due checks and the drain come before it is fed.
    Polled,
    Feeding,
    /// Fed completely: the read position is observed next.
    Fed,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Restore,
    ReadStarts,
    CommitStart,
    StartCommitting { refusal: Option<Refusal>, write_running: bool },
    Assign,
    Step(Batch),
    Committing { refusal: Option<Refusal>, write_running: bool },
    PersistRefusal(Refusal),
    Refused(Refusal),
    Fenced,
}

/// What the step in progress did, since the last commit.
#[derive(Debug, Default)]
struct StepMarks {
    /// The engine is ahead of the database: the step is not idle.
    open: bool,
    /// Per channel, the highest position fed.
    fed: BTreeMap<ChannelId, Position>,
    /// Per channel, the highest position delivered.
    delivered: BTreeMap<ChannelId, Position>,
}

fn unchanged<P>(payload: P) -> P {
    payload
}

/// Applies operators' skips to stored state before an engine is restored from it: a held
/// record that was skipped waits for nothing (its causes go) and carries what `skip` makes
/// of its payload. A skipped record not yet fed is treated alike when it is fed
/// ([`TaskHost::receive`]). Whatever restores an engine outside the machine (a status read)
/// applies the same rule with this function.
pub fn skip_held<P: Clone>(state: &mut PersistedState<P>, skipped: &BTreeSet<(ChannelId, Position)>, skip: fn(P) -> P) {
    for held in &mut state.held {
        if skipped.contains(&(held.channel, held.position)) {
            held.causes = CausalPast::new();
            held.payload = skip(held.payload.clone());
        }
    }
}

/// The host's side of one task: see the [module documentation](self).
#[derive(Debug)]
pub struct TaskHost<P> {
    config: EngineConfig,
    /// The received channels, in channel order.
    received: Vec<ChannelId>,
    engine: Engine<P>,
    weigh: Option<fn(&P) -> usize>,
    /// What a skipped record's payload becomes (none of its bytes, a mark).
    skip: fn(P) -> P,
    #[cfg(feature = "sim")]
    sabotage: EngineSabotage,
    /// The first log start told per channel in this execution (`HostStaleLogStart`).
    #[cfg(feature = "sim")]
    first_log_starts: BTreeMap<ChannelId, Position>,
    phase: Phase,
    recorded: TaskStatus,
    /// Records an operator skipped: fed without causes, as `skip` makes them.
    skipped: BTreeSet<(ChannelId, Position)>,
    /// Careful until `fed_up_to` reaches each of these.
    careful_until: Option<BTreeMap<ChannelId, Position>>,
    /// The records the next careful step polls: 1 after a failure, doubled by every careful
    /// step that commits.
    careful_records: usize,
    step: StepMarks,
    /// Offer the held heads before the next feed (after every restore).
    drain_due: bool,
    out_of_range: bool,
    log_start_due: bool,
    width_due: bool,
    prune_due: bool,
    /// An out-of-range poll was checked: restore once this step is over.
    restore_after_step: bool,
}

/// The most records a careful step polls, however many careful steps committed before it
/// (the host's own step bound applies too).
pub const MAX_CAREFUL_RECORDS: usize = 1 << 16;

impl<P: Clone> TaskHost<P> {
    /// A task receiving `received`, whose row says `recorded`. It restores first.
    pub fn new(config: EngineConfig, received: impl IntoIterator<Item = ChannelId>, recorded: TaskStatus) -> Self {
        let received: Vec<ChannelId> = received.into_iter().collect::<BTreeSet<_>>().into_iter().collect();
        TaskHost {
            engine: Engine::new(config.clone(), received.iter().copied()),
            config,
            received,
            weigh: None,
            skip: unchanged::<P>,
            #[cfg(feature = "sim")]
            sabotage: EngineSabotage::None,
            #[cfg(feature = "sim")]
            first_log_starts: BTreeMap::new(),
            phase: Phase::Restore,
            recorded,
            skipped: BTreeSet::new(),
            careful_until: None,
            careful_records: 1,
            step: StepMarks::default(),
            drain_due: true,
            out_of_range: false,
            log_start_due: false,
            width_due: false,
            prune_due: false,
            restore_after_step: false,
        }
    }

    /// How many bytes a held payload weighs ([`Engine::with_weigher`]), for every engine
    /// this machine restores.
    pub fn with_weigher(mut self, weigh: fn(&P) -> usize) -> Self {
        self.weigh = Some(weigh);
        self
    }

    /// What a skipped record's payload becomes when it is fed or restored held.
    pub fn with_skipped(mut self, skip: fn(P) -> P) -> Self {
        self.skip = skip;
        self
    }

    /// A deliberately broken engine for every engine this machine restores (simulator
    /// meta-tests only).
    #[cfg(feature = "sim")]
    #[doc(hidden)]
    pub fn with_sabotage(mut self, sabotage: EngineSabotage) -> Self {
        self.sabotage = sabotage;
        self
    }

    /// The engine, for status and gauges. Ahead of the database while a step is open.
    pub fn engine(&self) -> &Engine<P> {
        &self.engine
    }

    /// The received channels, in channel order.
    pub fn received(&self) -> &[ChannelId] {
        &self.received
    }

    /// What the task's row says, as far as this machine knows.
    pub fn recorded(&self) -> TaskStatus {
        self.recorded
    }

    /// Whether steps project one record per call, feeding few records a step (after a failure).
    pub fn careful(&self) -> bool {
        self.careful_until.is_some()
    }

    /// Whether the engine is ahead of the database: a step is open.
    pub fn step_open(&self) -> bool {
        matches!(self.phase, Phase::Step(_)) && self.step.open
    }

    /// Whether the next batch starts with a drain (the first step after a restore).
    pub fn drain_pending(&self) -> bool {
        matches!(self.phase, Phase::Step(_)) && self.drain_due
    }

    /// What to do next. Asking again without answering asks the same; a due check with
    /// nothing to look at (nothing held, no upstream channel) is dropped here.
    pub fn next_action(&mut self) -> Next {
        match &self.phase {
            Phase::Restore => Next::Restore,
            Phase::ReadStarts => Next::ReadStarts(self.received.clone()),
            Phase::CommitStart => Next::CommitStart,
            Phase::StartCommitting { .. } | Phase::Committing { .. } => Next::AwaitCommit,
            Phase::Assign => Next::Assign(
                self.received.iter().filter_map(|c| self.engine.fed_up_to(c).map(|f| (*c, f + 1))).collect(),
            ),
            Phase::PersistRefusal(r) => Next::PersistRefusal(r.clone()),
            Phase::Refused(r) => Next::Refused(r.clone()),
            Phase::Fenced => Next::Fenced,
            Phase::Step(batch) => {
                let batch = *batch;
                self.next_in_step(batch)
            }
        }
    }

    fn next_in_step(&mut self, batch: Batch) -> Next {
        if self.engine.refusal().is_some() {
            // A refusal ends the step: it commits with the refusal, nothing more is fed.
            return Next::Commit;
        }
        match batch {
            Batch::Feeding => return Next::Feed,
            Batch::Fed => return Next::ReadPositions,
            Batch::Between | Batch::Polled => {}
        }
        if self.out_of_range {
            return Next::ObserveLogStarts { channels: self.received.clone(), check: LogStartCheck::OutOfRange };
        }
        if self.log_start_due {
            // Every received channel in channel order, as a start checks them: the first
            // channel that refuses is then the one the next start refuses on too.
            if self.engine.held_count() > 0 {
                return Next::ObserveLogStarts { channels: self.received.clone(), check: LogStartCheck::Periodic };
            }
            self.log_start_due = false;
        }
        if self.width_due {
            return Next::CheckWidths;
        }
        if self.prune_due {
            let upstream = self.upstream();
            if !upstream.is_empty() {
                return Next::LearnUpstream(upstream);
            }
            self.prune_due = false;
        }
        match batch {
            Batch::Between if self.restore_after_step => Next::Commit,
            Batch::Between => Next::Poll { max_records: self.careful_until.is_some().then_some(self.careful_records) },
            _ if self.drain_due => Next::Drain,
            _ => Next::Feed,
        }
    }

    /// The channels of the clock and frontier on topics the task does not receive.
    fn upstream(&self) -> Vec<ChannelId> {
        let received: BTreeSet<TopicId> = self.received.iter().map(|c| c.topic).collect();
        let upstream: BTreeSet<ChannelId> = (self.engine.delivered_past().iter())
            .chain(self.engine.frontier().iter())
            .map(|(c, _)| c)
            .filter(|c| !received.contains(&c.topic))
            .collect();
        upstream.into_iter().collect()
    }

    fn expect(&self, ok: bool, input: &str) {
        assert!(ok, "host protocol: {input} in state {:?}", self.phase);
    }

    /// Panics naming the broken invariant of the machine's own state, if one is (debug
    /// builds only; the engine checks its own).
    fn check_invariants(&self) {
        debug_assert_eq!(self.broken_invariant(), None, "host invariant broken in state {:?}", self.phase);
    }

    /// The first invariant of the machine's own state that does not hold, if any:
    /// - `received` is strictly ascending and is the engine's received set;
    /// - a careful step polls between 1 and [`MAX_CAREFUL_RECORDS`] records, and exactly 1
    ///   when the task is not careful; a careful task waits for at least one channel;
    /// - a step that fed or delivered anything is open (not idle).
    fn broken_invariant(&self) -> Option<&'static str> {
        if !self.received.windows(2).all(|w| w[0] < w[1]) || !self.received.iter().eq(self.engine.received()) {
            return Some("the received channels are not ascending, or not the engine's");
        }
        if !(1..=MAX_CAREFUL_RECORDS).contains(&self.careful_records) {
            return Some("a careful step polls no records, or more than MAX_CAREFUL_RECORDS");
        }
        if self.careful_until.as_ref().map_or(self.careful_records != 1, |until| until.is_empty()) {
            return Some("a task not careful polls more than 1 record carefully, or a careful one waits for nothing");
        }
        if !self.step.open && (!self.step.fed.is_empty() || !self.step.delivered.is_empty()) {
            return Some("a step that fed or delivered records is not open");
        }
        None
    }

    fn in_step(&self, batches: &[Batch]) -> bool {
        matches!(self.phase, Phase::Step(b) if batches.contains(&b))
    }

    // ---- start -------------------------------------------------------------------------

    /// The stored state and the skipped records (answer to [`Next::Restore`]). Rebuilds the
    /// engine; state this build cannot use is a refusal to persist.
    pub fn restored(&mut self, mut state: PersistedState<P>, skipped: BTreeSet<(ChannelId, Position)>) {
        self.expect(self.phase == Phase::Restore, "restored");
        skip_held(&mut state, &skipped, self.skip);
        self.skipped = skipped;
        self.step = StepMarks::default();
        self.out_of_range = false;
        self.restore_after_step = false;
        #[cfg(feature = "sim")]
        let restored =
            Engine::restore_sabotaged(self.config.clone(), self.received.iter().copied(), state, self.sabotage);
        #[cfg(not(feature = "sim"))]
        let restored = Engine::restore(self.config.clone(), self.received.iter().copied(), state);
        match restored {
            Err(refusal) => self.phase = Phase::PersistRefusal(refusal),
            Ok(engine) => {
                let engine = match self.weigh {
                    Some(weigh) => engine.with_weigher(weigh),
                    None => engine,
                };
                self.engine = engine;
                #[cfg(feature = "sim")]
                self.engine.set_sabotage(self.sabotage);
                self.drain_due = true;
                self.phase = Phase::ReadStarts;
            }
        }
        self.check_invariants();
    }

    /// The stored state cannot be read (answer to [`Next::Restore`]): a refusal to persist.
    pub fn unrestorable(&mut self, refusal: Refusal) {
        self.expect(self.phase == Phase::Restore, "unrestorable");
        self.phase = Phase::PersistRefusal(refusal);
    }

    /// The channels' facts at start (answer to [`Next::ReadStarts`]): seeds every channel
    /// that has no baseline, then compares every log start with what is settled, in channel
    /// order, so a refusal names the same channel on every start.
    pub fn started(&mut self, starts: &[ChannelStart]) -> Observed {
        self.expect(self.phase == Phase::ReadStarts, "started");
        for s in starts {
            if self.engine.fed_up_to(&s.channel).is_none() {
                // Refused already (a bound passed at restore): the start commits that.
                let _ = self.engine.seed(s.channel, s.initial_fed_up_to);
            }
        }
        let mut by_channel: Vec<(ChannelId, Position)> = starts.iter().map(|s| (s.channel, s.log_start)).collect();
        by_channel.sort();
        let observed = self.observe(&by_channel);
        self.log_start_due = false;
        self.phase = Phase::CommitStart;
        observed
    }

    fn observe(&mut self, log_starts: &[(ChannelId, Position)]) -> Observed {
        #[cfg(feature = "sim")]
        let sabotaged = self.sabotaged_log_starts(log_starts);
        #[cfg(feature = "sim")]
        let log_starts = &sabotaged[..];
        let mut observed = Observed::default();
        if self.engine.refusal().is_none() {
            for &(channel, log_start) in log_starts {
                if self.engine.observe_log_start(channel, log_start).is_err() {
                    break;
                }
                observed.accepted.push(channel);
            }
        }
        observed.refusal = self.engine.refusal().cloned();
        observed
    }

    /// The start transaction (answer to [`Next::CommitStart`]); then `committed`, `failed`
    /// or `fenced`.
    /// The log starts as a sabotaged machine takes them (simulator only).
    #[cfg(feature = "sim")]
    fn sabotaged_log_starts(&mut self, told: &[(ChannelId, Position)]) -> Vec<(ChannelId, Position)> {
        let mut out = Vec::with_capacity(told.len());
        for &(channel, log_start) in told {
            let first = *self.first_log_starts.entry(channel).or_insert(log_start);
            out.push(match self.sabotage {
                EngineSabotage::HostStaleLogStart => (channel, first),
                EngineSabotage::HostLogStartAhead => (channel, log_start + 2),
                _ => (channel, log_start),
            });
        }
        out
    }

    /// A sabotaged machine's changes (simulator only): `HostHeldNotHandedOver` leaves out
    /// the records a step leaves held.
    #[cfg(feature = "sim")]
    fn sabotaged_changes(&self, mut changes: StepChanges<P>) -> StepChanges<P> {
        if self.sabotage == EngineSabotage::HostHeldNotHandedOver {
            changes.held_inserted.clear();
        }
        changes
    }

    pub fn take_start(&mut self) -> StartCommit<P> {
        self.expect(self.phase == Phase::CommitStart, "take_start");
        let changes = self.engine.take_changes();
        #[cfg(feature = "sim")]
        let changes = self.sabotaged_changes(changes);
        let write_running = changes.refusal.is_none() && self.recorded == TaskStatus::Refused;
        let notify = changes.refusal.is_some() || write_running;
        self.phase = Phase::StartCommitting { refusal: changes.refusal.clone(), write_running };
        StartCommit { changes, write_running, notify }
    }

    /// The consumer reads each channel from the assigned position (answer to
    /// [`Next::Assign`]): steps begin, the first one with a drain.
    pub fn assigned(&mut self) {
        self.expect(self.phase == Phase::Assign, "assigned");
        self.phase = Phase::Step(Batch::Between);
    }

    // ---- timers ------------------------------------------------------------------------

    /// The periodic log-start interval passed. The check is asked for once the task holds
    /// records; every log-start check (at start, after an out-of-range poll) satisfies it.
    pub fn log_start_check_due(&mut self) {
        self.log_start_due = true;
    }

    /// The width-check interval passed.
    pub fn width_check_due(&mut self) {
        self.width_due = true;
    }

    /// The prune interval passed. Dropped if the task has no upstream channel then.
    pub fn prune_due(&mut self) {
        self.prune_due = true;
    }

    // ---- the step ----------------------------------------------------------------------

    /// A batch was polled (answer to [`Next::Poll`]); `out_of_range`: the consumer reported
    /// a position out of range. The host keeps the batch until [`Next::Feed`].
    pub fn polled(&mut self, out_of_range: bool) {
        self.expect(self.in_step(&[Batch::Between]), "polled");
        self.out_of_range |= out_of_range;
        self.phase = Phase::Step(Batch::Polled);
    }

    /// Log starts read for [`Next::ObserveLogStarts`], in the order asked.
    pub fn log_starts(&mut self, log_starts: &[(ChannelId, Position)]) -> Observed {
        self.expect(self.in_step(&[Batch::Between, Batch::Polled]), "log_starts");
        let observed = self.observe(log_starts);
        self.log_start_due = false;
        if std::mem::take(&mut self.out_of_range) && observed.refusal.is_none() {
            // Nothing unsettled was lost: read on from fed_up_to + 1 with a new consumer
            // rather than trust the one that reported the error.
            self.restore_after_step = true;
        }
        observed
    }

    /// Partition counts read for [`Next::CheckWidths`], one per received channel's topic
    /// (`None`: the broker did not list it — not a width change; start checks identities).
    /// A count other than `task_count` refuses `TASK_WIDTH_CHANGED` on that channel;
    /// `what(channel)` names it in the diagnosis.
    pub fn widths(
        &mut self,
        task_count: u32,
        counts: &[(ChannelId, Option<u32>)],
        what: impl Fn(&ChannelId) -> String,
    ) {
        self.expect(self.in_step(&[Batch::Between, Batch::Polled]) && self.width_due, "widths");
        self.width_due = false;
        for &(channel, count) in counts {
            let Some(count) = count else { continue };
            if let Err(r) = check_task_width(Some(task_count), count) {
                let diagnosis = format!("{}: {}", what(&channel), r.diagnosis);
                self.engine.refuse(Refusal::at(r.reason, channel, None, diagnosis));
                return;
            }
        }
    }

    /// The facts of the upstream channels for [`Next::LearnUpstream`]: prunes the frontier
    /// and clock by them (the engine's rule). Channels of received topics are never pruned
    /// here, whatever `fact` says. Returns how many pairs went; a prune that dropped any
    /// must commit.
    pub fn upstream_facts(&mut self, fact: impl Fn(&ChannelId) -> ChannelFact) -> usize {
        self.expect(self.in_step(&[Batch::Between, Batch::Polled]) && self.prune_due, "upstream_facts");
        self.prune_due = false;
        let received: BTreeSet<TopicId> = self.received.iter().map(|c| c.topic).collect();
        let width = |e: &Engine<P>| e.frontier().len() + e.delivered_past().len();
        let before = width(&self.engine);
        self.engine.prune(|c| if received.contains(&c.topic) { ChannelFact::Unknown } else { fact(c) });
        let pruned = before - width(&self.engine);
        if pruned > 0 {
            self.step.open = true;
        }
        pruned
    }

    /// The facts for a periodic log-start check, a width check or a prune could not be
    /// read: not a failure; the next interval tries again.
    pub fn skip_check(&mut self) {
        match self.next_action() {
            Next::ObserveLogStarts { check: LogStartCheck::Periodic, .. } => self.log_start_due = false,
            Next::CheckWidths => self.width_due = false,
            Next::LearnUpstream(_) => self.prune_due = false,
            _ => self.expect(false, "skip_check"),
        }
    }

    /// Offers the held heads (answer to [`Next::Drain`]): the deliveries belong to this step.
    pub fn drain(&mut self) -> Vec<Delivery<P>> {
        self.expect(self.in_step(&[Batch::Polled]) && self.drain_due, "drain");
        self.drain_due = false;
        self.step.open = true;
        let deliveries = self.engine.drain();
        self.mark_delivered(&deliveries);
        self.check_invariants();
        deliveries
    }

    fn mark_delivered(&mut self, deliveries: &[Delivery<P>]) {
        for d in deliveries {
            let mark = self.step.delivered.entry(d.channel).or_insert(d.position);
            *mark = (*mark).max(d.position);
        }
    }

    /// Feeds one record of the polled batch, with the values of its `parsley.causes`
    /// headers. A record an operator skipped is fed without causes, its payload as
    /// [`TaskHost::with_skipped`] makes it. After an error (a refusal) feed no more of the
    /// batch: call [`TaskHost::batch_done`].
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

    /// As [`TaskHost::receive`], appending the deliveries to `out`: a host feeding a batch
    /// keeps one list for the step.
    pub fn receive_into(
        &mut self,
        channel: ChannelId,
        position: Position,
        causes_headers: &[Option<&[u8]>],
        payload: P,
        out: &mut Vec<Delivery<P>>,
    ) -> Result<Fed, Refusal> {
        self.feed_one(channel, position, payload, out, |engine, payload, out| {
            engine.receive_into(channel, position, causes_headers, payload, out)
        })
    }

    /// The budget `parsley.causes` values are decoded with, for a host that decodes them
    /// while it reads a record ([`TaskHost::receive_result_into`]).
    pub fn metadata_budget(&self) -> usize {
        self.engine.metadata_budget()
    }

    /// As [`TaskHost::receive_into`], given what decoding the record's `parsley.causes`
    /// headers with [`TaskHost::metadata_budget`] gave (see
    /// [`Engine::receive_result_into`]). A record an operator skipped ignores it, as
    /// `receive_into` ignores its headers.
    pub fn receive_result_into(
        &mut self,
        channel: ChannelId,
        position: Position,
        decoded: Result<CausalPast, DecodeError>,
        payload: P,
        out: &mut Vec<Delivery<P>>,
    ) -> Result<Fed, Refusal> {
        self.feed_one(channel, position, payload, out, |engine, payload, out| {
            engine.receive_result_into(channel, position, decoded, payload, out)
        })
    }

    /// One record of the batch: the step's marks, an operator's skip, and `receive` (the
    /// engine's receipt of the record's causes) for any other record.
    fn feed_one(
        &mut self,
        channel: ChannelId,
        position: Position,
        payload: P,
        out: &mut Vec<Delivery<P>>,
        receive: impl FnOnce(&mut Engine<P>, P, &mut Vec<Delivery<P>>) -> Result<Fed, Refusal>,
    ) -> Result<Fed, Refusal> {
        let ready = self.in_step(&[Batch::Feeding]) || (self.in_step(&[Batch::Polled]) && !self.drain_due);
        self.expect(ready, "receive");
        self.phase = Phase::Step(Batch::Feeding);
        self.step.open = true;
        let mark = self.step.fed.entry(channel).or_insert(position);
        *mark = (*mark).max(position);
        let before = out.len();
        let fed = if self.skipped.contains(&(channel, position)) {
            let payload = (self.skip)(payload);
            self.engine.receive_decoded_into(channel, position, CausalPast::new(), payload, out)
        } else {
            receive(&mut self.engine, payload, out)
        };
        self.mark_delivered(&out[before..]);
        self.check_invariants();
        fed
    }

    /// A refusal the host found in the batch (a record of a channel the task does not
    /// receive): the step ends with it.
    pub fn refuse(&mut self, refusal: Refusal) {
        self.expect(matches!(self.phase, Phase::Step(_)), "refuse");
        self.step.open = true;
        self.engine.refuse(refusal);
    }

    /// Every record of the polled batch was fed, or a refusal stopped the feed.
    pub fn batch_done(&mut self) {
        let ready = self.in_step(&[Batch::Feeding]) || (self.in_step(&[Batch::Polled]) && !self.drain_due);
        self.expect(ready || self.engine.refusal().is_some(), "batch_done");
        self.phase = Phase::Step(if self.engine.refusal().is_some() { Batch::Between } else { Batch::Fed });
    }

    /// The consumer's position on each channel (answer to [`Next::ReadPositions`]; `next`
    /// is one past what it read, past transaction markers and aborted runs). Raises
    /// `fed_up_to` to `next - 1`. Returns whether a channel moved (the step then commits).
    pub fn read_positions(&mut self, positions: &[(ChannelId, Position)]) -> bool {
        self.expect(self.in_step(&[Batch::Fed]), "read_positions");
        #[cfg(feature = "sim")]
        let positions = if self.sabotage == EngineSabotage::HostReadPositionIgnored { &[] } else { positions };
        self.phase = Phase::Step(Batch::Between);
        let mut moved = false;
        for &(channel, next) in positions {
            let before = self.engine.fed_up_to(&channel);
            if self.engine.observe_read_position(channel, next).is_err() {
                break;
            }
            moved |= self.engine.fed_up_to(&channel) != before;
        }
        self.step.open |= moved;
        self.check_invariants();
        moved
    }

    /// Ends the step: `None` when it is idle (no transaction), else what to commit; then
    /// `committed`, `failed`, `rejected` or `fenced`.
    pub fn end_step(&mut self) -> Option<StepCommit<P>> {
        let refused = self.engine.refusal().is_some();
        self.expect(
            matches!(self.phase, Phase::Step(Batch::Between))
                || (refused && self.in_step(&[Batch::Polled, Batch::Feeding])),
            "end_step",
        );
        if !self.step.open && !refused && self.recorded != TaskStatus::Failing {
            self.step = StepMarks::default();
            self.phase = self.after_step();
            return None;
        }
        self.check_invariants();
        let changes = self.engine.take_changes();
        #[cfg(feature = "sim")]
        let changes = self.sabotaged_changes(changes);
        let write_running = self.recorded == TaskStatus::Failing && changes.refusal.is_none();
        let notify = self.recorded == TaskStatus::Failing || changes.refusal.is_some();
        self.phase = Phase::Committing { refusal: changes.refusal.clone(), write_running };
        Some(StepCommit { changes, careful: self.careful_until.is_some(), write_running, notify })
    }

    fn after_step(&mut self) -> Phase {
        if std::mem::take(&mut self.restore_after_step) {
            Phase::Restore
        } else {
            Phase::Step(Batch::Between)
        }
    }

    /// The start or step transaction committed.
    pub fn committed(&mut self) {
        let (refusal, write_running, start) = match &self.phase {
            Phase::StartCommitting { refusal, write_running } => (refusal.clone(), *write_running, true),
            Phase::Committing { refusal, write_running } => (refusal.clone(), *write_running, false),
            _ => return self.expect(false, "committed"),
        };
        if write_running {
            self.recorded = TaskStatus::Running;
        }
        if let Some(r) = refusal {
            self.recorded = TaskStatus::Refused;
            self.phase = Phase::Refused(r);
            return;
        }
        if start {
            self.phase = Phase::Assign;
            return;
        }
        if let Some(until) = &self.careful_until {
            if until.iter().all(|(c, p)| self.engine.fed_up_to(c).is_some_and(|f| f >= *p)) {
                self.careful_until = None;
                self.careful_records = 1;
            } else {
                self.careful_records = self.careful_records.saturating_mul(2).min(MAX_CAREFUL_RECORDS);
            }
        }
        self.step = StepMarks::default();
        self.phase = self.after_step();
        self.check_invariants();
    }

    /// The start, the step, or a read it needed failed (nothing of it committed): restore
    /// before anything is fed again. The positions the step had fed make the task careful.
    pub fn failed(&mut self, failure: Failure) {
        if matches!(self.phase, Phase::Refused(_) | Phase::Fenced) {
            return;
        }
        let mut marks = std::mem::take(&mut self.step.fed);
        if failure == Failure::BatchRejected {
            for (c, p) in std::mem::take(&mut self.step.delivered) {
                let mark = marks.entry(c).or_insert(p);
                *mark = (*mark).max(p);
            }
        }
        self.careful_records = 1;
        if !marks.is_empty() {
            let until = self.careful_until.get_or_insert_with(BTreeMap::new);
            for (c, p) in marks {
                let mark = until.entry(c).or_insert(p);
                *mark = (*mark).max(p);
            }
        }
        self.step = StepMarks::default();
        self.out_of_range = false;
        self.restore_after_step = false;
        self.phase = Phase::Restore;
        self.check_invariants();
    }

    /// The host recorded the failure in the task's row.
    pub fn failure_recorded(&mut self) {
        self.recorded = TaskStatus::Failing;
    }

    /// The projection rejected the one record at `(channel, position)` of a careful step
    /// for good (the step rolled back): `PROJECTION_REJECTED`, recorded on its own.
    pub fn rejected(&mut self, channel: ChannelId, position: Position, diagnosis: String) {
        self.rejected_as(RefusalReason::ProjectionRejected, channel, position, diagnosis);
    }

    /// [`TaskHost::rejected`] under another record-level reason the host found at delivery
    /// (`KEY_PARTITION_MISMATCH`): the same path, a refusal recorded on its own.
    pub fn rejected_as(&mut self, reason: RefusalReason, channel: ChannelId, position: Position, diagnosis: String) {
        self.expect(matches!(self.phase, Phase::Committing { .. }), "rejected");
        self.step = StepMarks::default();
        self.phase = Phase::PersistRefusal(Refusal::at(reason, channel, Some(position), diagnosis));
    }

    /// The refusal of [`Next::PersistRefusal`] is recorded: final.
    pub fn refusal_persisted(&mut self) {
        let Phase::PersistRefusal(r) = &self.phase else { return self.expect(false, "refusal_persisted") };
        self.recorded = TaskStatus::Refused;
        self.phase = Phase::Refused(r.clone());
    }

    /// Another owner took the task (its epoch moved): final.
    pub fn fenced(&mut self) {
        self.phase = Phase::Fenced;
    }

    /// The host starts a new round of work. If the last one was abandoned midway (its
    /// future dropped), the engine may be ahead of the database and the consumer ahead of
    /// the engine: restore. At rest (between steps, or stopped) this changes nothing.
    pub fn interrupted(&mut self) {
        let at_rest = match &self.phase {
            Phase::Step(Batch::Between) => !self.step.open,
            Phase::Restore | Phase::PersistRefusal(_) | Phase::Refused(_) | Phase::Fenced => true,
            _ => false,
        };
        if !at_rest {
            self.step = StepMarks::default();
            self.out_of_range = false;
            self.restore_after_step = false;
            self.phase = Phase::Restore;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: ChannelId = ChannelId::new(TopicId::from_bytes([1; 16]), 0);
    const B: ChannelId = ChannelId::new(TopicId::from_bytes([2; 16]), 0);

    /// A machine whose state is consistent: a new one, receiving `A` and `B`.
    fn fresh() -> TaskHost<u32> {
        let h = TaskHost::new(EngineConfig::default(), [B, A], TaskStatus::Running);
        assert_eq!(h.broken_invariant(), None);
        h
    }

    fn assert_broken(h: &TaskHost<u32>, what: &str) {
        let broken = h.broken_invariant().expect("a broken invariant");
        assert!(broken.contains(what), "{broken:?} does not say {what:?}");
    }

    #[test]
    fn received_channels_out_of_order_or_not_the_engines_are_reported() {
        let mut h = fresh();
        h.received.reverse();
        assert_broken(&h, "received channels");
        let mut h = fresh();
        h.received.pop();
        assert_broken(&h, "received channels");
    }

    #[test]
    fn careful_bounds_out_of_range_or_without_a_careful_task_are_reported() {
        let mut h = fresh();
        h.careful_records = 0;
        assert_broken(&h, "no records");
        let mut h = fresh();
        h.careful_records = MAX_CAREFUL_RECORDS + 1;
        assert_broken(&h, "more than MAX_CAREFUL_RECORDS");
        let mut h = fresh();
        h.careful_records = 4;
        assert_broken(&h, "not careful");
        h.careful_until = Some(BTreeMap::from([(A, 7)]));
        assert_eq!(h.broken_invariant(), None, "a careful task may poll 4");
        h.careful_until = Some(BTreeMap::new());
        assert_broken(&h, "waits for nothing");
    }

    #[test]
    fn a_step_that_fed_or_delivered_while_closed_is_reported() {
        let mut h = fresh();
        h.step.fed.insert(A, 3);
        assert_broken(&h, "not open");
        h.step.open = true;
        assert_eq!(h.broken_invariant(), None);
        let mut h = fresh();
        h.step.delivered.insert(B, 0);
        assert_broken(&h, "not open");
    }
}
