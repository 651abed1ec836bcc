//! The deterministic simulator and its ground-truth oracle: the primary evidence that
//! causal delivery and the session guarantees hold. It drives the core (`parsley`, with its
//! hidden sabotage hooks on through the core's `sim` feature) and nothing else.
//!
//! One run is one seed: a simulated Kafka ([`kafka`]), a simulated database ([`store`]),
//! and a world ([`world`]) of upstream processes, edge producers, session clients and
//! projector tasks whose enabled actions a seeded scheduler draws from, one per step. The
//! hosts drive the real core: the projector's step protocol ([`parsley::host::TaskHost`],
//! which each projector task drives exactly as the projector's runner does),
//! [`parsley::Engine`] (receive, drain, `take_changes`,
//! `restore`, `seed`, `observe_log_start`, `prune`, `stamp`),
//! [`parsley::CausalPast`] tokens, [`parsley::gate::gate`] and [`parsley::gate::refresh`] on
//! clock rows read in one snapshot, [`parsley::murmur2::partition_for_key`]. The [`oracle`]
//! never reads an engine's state: it tracks real happened-before and judges every
//! delivery, every served read, every refusal and every log-start check that passes.
//!
//! The simulator is pure like the core — no clock, no threads, no I/O; its
//! only source of choice is [`rng::SimRng`] seeded by the run's seed — so a seed names a
//! run, and running a seed twice yields the same trace.
//!
//! [`Sabotage`] switches on one deliberately broken behaviour (in the engine, the gate, or
//! the host); the meta-tests in `tests/simulation.rs` require the oracle to catch each.

pub mod bits;
pub mod kafka;
pub mod oracle;
pub mod rng;
pub mod store;
mod world;

pub use oracle::{Violation, ViolationKind};
use parsley::engine::EngineSabotage;
use parsley::gate::GateSabotage;

/// The shape and mix of one family of runs.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: &'static str,
    /// Steps of work (writes, sends, reads, crashes, retention) before the drain.
    pub work_steps: u64,
    /// Steps the drain may take to reach quiescence; running out is a wedge.
    pub drain_budget: u64,
    /// The model's task count is drawn from these.
    pub task_counts: &'static [u32],
    pub clients: u32,
    pub edges: u32,
    /// Distinct record keys (documents).
    pub keys: u16,
    pub crash_weight: u32,
    pub abort_weight: u32,
    pub txn_weight: u32,
    pub retention_weight: u32,
    pub recreate_weight: u32,
    /// A rogue producer writes one record with a damaged causes header.
    pub corrupt: bool,
    /// Restarts sometimes resume below `fed_up_to + 1`, so the engine must drop replays.
    pub replay_on_restart: bool,
    /// Largest number of records a task fetches in one feed.
    pub max_batch: i64,
    /// Half the reads go to a read replica that lags the primary.
    pub replica: bool,
    /// An upstream-style process also receives a model topic clients write to (see
    /// [`Scenario::audit`]).
    pub audit: bool,
    /// Retention on the model's own topics may pass records their owner still holds
    /// (never positions it has not read), which the owner must refuse once it notices;
    /// otherwise it stays within what it delivered.
    pub retention_passes_held: bool,
    /// Retention may also pass positions a receiver (a task or an upstream process) has
    /// not read yet, as long as it discards a record there: the receiver must refuse
    /// `POSITIONS_DISCARDED_UNREAD` when it finds out (an out-of-range fetch, a check).
    /// Upstream processes then check log starts on an out-of-range fetch, as tasks do.
    pub retention_passes_unread: bool,
    /// Upstream processes, extra upstream topics and their partitions, and who receives and
    /// sends what, are drawn per seed (cycles and self-channels included) instead of the
    /// fixed two-process graph.
    pub random_topology: bool,
}

impl Scenario {
    /// Everything at once: transactions, crashes, aborts, retention, topic recreation,
    /// replays, reads.
    pub fn soak() -> Scenario {
        Scenario {
            name: "soak",
            work_steps: 900,
            drain_budget: 6000,
            task_counts: &[1, 2, 3, 4],
            clients: 3,
            edges: 2,
            keys: 8,
            crash_weight: 1,
            abort_weight: 1,
            txn_weight: 1,
            retention_weight: 1,
            recreate_weight: 1,
            corrupt: false,
            replay_on_restart: true,
            max_batch: 3,
            replica: true,
            audit: false,
            retention_passes_held: false,
            retention_passes_unread: false,
            random_topology: false,
        }
    }

    /// Crash-heavy: tasks crash and abort steps often, mostly while holding.
    pub fn crashes() -> Scenario {
        Scenario {
            name: "crashes",
            crash_weight: 4,
            abort_weight: 2,
            retention_weight: 0,
            recreate_weight: 0,
            ..Scenario::soak()
        }
    }

    /// A rogue producer's damaged header: its task must refuse, identically across restarts.
    pub fn corrupt() -> Scenario {
        Scenario { name: "corrupt", corrupt: true, work_steps: 600, ..Scenario::soak() }
    }

    /// Long runs on wider models: deeper histories, longer hold chains, more sessions.
    pub fn long() -> Scenario {
        Scenario {
            name: "long",
            work_steps: 4000,
            drain_budget: 20000,
            task_counts: &[3, 4],
            clients: 4,
            edges: 3,
            keys: 12,
            ..Scenario::soak()
        }
    }

    /// Aggressive retention everywhere, including past records the model's tasks still
    /// hold: causes it makes inexpressible are exempt, a task holding a passed record must
    /// refuse `POSITIONS_DISCARDED_UNREAD` (and again after each restart), everything else
    /// must still hold.
    pub fn retention() -> Scenario {
        Scenario { name: "retention", retention_weight: 4, retention_passes_held: true, ..Scenario::soak() }
    }

    /// Retention that outruns readers: it passes positions neither tasks nor upstream
    /// processes have read, so both refuse `POSITIONS_DISCARDED_UNREAD` when they find out,
    /// and records tasks hold, as in `retention` (a running task's periodic check then may
    /// find both at once, and must refuse on the channel its restart refuses on: the first
    /// in channel order). Two processes
    /// lag on a channel the first one reads too. A cause a sender delivered and a receiver
    /// never read is still stamped on the sender's effects, so the receiver holds the
    /// effect and refuses at the cause's channel instead of delivering it first (what a
    /// sender pruning its frontier by the log start, `PruneDropsLiveCause`, breaks).
    pub fn unread() -> Scenario {
        Scenario {
            name: "unread",
            retention_weight: 3,
            retention_passes_held: true,
            retention_passes_unread: true,
            ..Scenario::soak()
        }
    }

    /// Randomized topologies: 2–4 upstream processes over `raw`, `mid` and 1–3 more
    /// upstream topics of 1–3 partitions, with random receive and send sets — cycles and
    /// self-channels included — under everything `soak` does.
    pub fn random() -> Scenario {
        Scenario { name: "random", random_topology: true, ..Scenario::soak() }
    }

    /// A known limit, not a default sweep: a process that receives both an upstream
    /// channel and a topic session clients write to. A client that read an effect of an
    /// upstream record `u` learns `u`, but the refreshed token carries `u`'s channel only
    /// when every task records it (the meet), so the client's next write may reach that
    /// process without expressing `u`: writes-follow-reads is not guaranteed to consumers
    /// of the gateway's topics that also receive upstream channels.
    pub fn audit() -> Scenario {
        Scenario { name: "audit", audit: true, ..Scenario::soak() }
    }

    pub fn all() -> Vec<Scenario> {
        vec![
            Scenario::soak(),
            Scenario::crashes(),
            Scenario::corrupt(),
            Scenario::long(),
            Scenario::retention(),
            Scenario::unread(),
            Scenario::random(),
        ]
    }
}

/// One deliberately broken behaviour, for the meta-tests: each must be caught.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Sabotage {
    None,
    /// Engine: every head is deliverable, whatever its causes.
    IgnoreCauses,
    /// Engine: a record behind a held head may be delivered past it.
    NoFifoHold,
    /// Engine: re-fed positions after a restart are queued again, not dropped.
    NoReplayDrop,
    /// Engine: an undecodable causes header is read as "no causes".
    UndecodableAsEmpty,
    /// Host: a step does not persist the records it leaves held.
    HeldNotPersisted,
    /// Engine: frontier pairs are pruned below the log start (the superseded rule), so a
    /// send stops expressing a cause its receiver may not have read yet.
    PruneDropsLiveCause,
    /// Gate: a channel the required tasks have never recorded counts as covered.
    CoverageSkipsUnrecorded,
    /// Refresh: the token takes each served task's full clock.
    RefreshFullClock,
    /// Gate: a received channel's pair is checked on the served tasks, not its owner.
    GateServedTaskOnly,
    /// Host: the gate checks the primary's clock rows but the data comes from a lagging
    /// replica — check and read not in one snapshot.
    SplitSnapshot,
    /// Gateway: token pairs on the model's own channels are pruned below the log start
    /// too, though the owner may still hold the record there.
    TokenPrunesReceivedChannels,
    /// Host: a running task's log-start checks use the log start it read at its start, so
    /// retention passing a held record goes unnoticed until the next restart.
    StaleLogStart,
    /// Host: log-start checks report the log start two positions further on than it is,
    /// so the task refuses though retention discarded nothing it had not delivered.
    LogStartAhead,
    /// Host: the engine is never told the consumer's position, so `fed_up_to` stops at the
    /// last record and retention passing only a trailing transaction marker refuses.
    ReadPositionIgnored,
    /// Engine: a received record's causes reach the frontier only when it is delivered, so
    /// a process's send while it holds a record does not express that record's causes.
    SkipReceiptMerge,
    /// Engine: some records are counted as fed and dropped, neither delivered nor refused.
    SilentDrop,
    /// Engine: a send stamps each pair one position beyond what the sender knows.
    OverExpressCauses,
    /// Engine: the clock (what reads are gated on) takes a received record's causes at
    /// receipt, as the frontier does, though the record is only held.
    DeriveClockFromFrontier,
    /// Engine: a log start past the settled position never refuses; with nothing held,
    /// the discarded positions count as settled, releasing holds on them.
    DeliverPastDeadHolds,
}

impl Sabotage {
    pub const ALL: [Sabotage; 19] = [
        Sabotage::IgnoreCauses,
        Sabotage::NoFifoHold,
        Sabotage::NoReplayDrop,
        Sabotage::UndecodableAsEmpty,
        Sabotage::HeldNotPersisted,
        Sabotage::PruneDropsLiveCause,
        Sabotage::CoverageSkipsUnrecorded,
        Sabotage::RefreshFullClock,
        Sabotage::GateServedTaskOnly,
        Sabotage::SplitSnapshot,
        Sabotage::TokenPrunesReceivedChannels,
        Sabotage::StaleLogStart,
        Sabotage::LogStartAhead,
        Sabotage::ReadPositionIgnored,
        Sabotage::SkipReceiptMerge,
        Sabotage::SilentDrop,
        Sabotage::OverExpressCauses,
        Sabotage::DeriveClockFromFrontier,
        Sabotage::DeliverPastDeadHolds,
    ];

    fn engine(self) -> EngineSabotage {
        match self {
            Sabotage::IgnoreCauses => EngineSabotage::IgnoreCauses,
            Sabotage::NoFifoHold => EngineSabotage::NoFifoHold,
            Sabotage::NoReplayDrop => EngineSabotage::NoReplayDrop,
            Sabotage::UndecodableAsEmpty => EngineSabotage::UndecodableAsEmpty,
            Sabotage::PruneDropsLiveCause => EngineSabotage::PruneStampedBelowLogStart,
            Sabotage::SkipReceiptMerge => EngineSabotage::SkipReceiptMerge,
            Sabotage::SilentDrop => EngineSabotage::SilentDrop,
            Sabotage::OverExpressCauses => EngineSabotage::OverExpressCauses,
            Sabotage::DeriveClockFromFrontier => EngineSabotage::DeriveClockFromFrontier,
            Sabotage::DeliverPastDeadHolds => EngineSabotage::DeliverPastDeadHolds,
            _ => EngineSabotage::None,
        }
    }

    fn gate(self) -> GateSabotage {
        match self {
            Sabotage::CoverageSkipsUnrecorded => GateSabotage::SkipUnrecorded,
            Sabotage::RefreshFullClock => GateSabotage::RefreshFullClock,
            Sabotage::GateServedTaskOnly => GateSabotage::ServedTaskOnly,
            _ => GateSabotage::None,
        }
    }
}

/// What one run exercised, for the anti-vacuity floors (counted per seed by the tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub tasks: u32,
    pub steps: u64,
    pub records: u64,
    /// Deliveries by projector tasks in committed steps.
    pub deliveries: u64,
    /// Deliveries the oracle judged, committed or not, upstream included.
    pub deliveries_checked: u64,
    pub upstream_deliveries: u64,
    /// Records a projector task held on receipt (not delivered by the receive itself).
    pub held: u64,
    pub upstream_held: u64,
    pub starts: u64,
    pub commits: u64,
    pub crashes: u64,
    pub crashes_mid_step: u64,
    pub crashes_while_held: u64,
    /// Restarts whose restore path brought back held records.
    pub restores_with_held: u64,
    /// Upstream processes crashed and restored from their durable state.
    pub process_restarts: u64,
    /// Of those, restores that brought back held records.
    pub process_restores_with_held: u64,
    pub step_aborts: u64,
    pub txn_commits: u64,
    pub txn_aborts: u64,
    /// Task fetches that skipped over aborted records.
    pub aborted_runs_crossed: u64,
    pub replays_dropped: u64,
    pub reads_served: u64,
    /// Reads served from the replica while it lagged the primary.
    pub lagging_replica_reads: u64,
    /// Reads the gate did not cover at first, which had to wait.
    pub gated_waits: u64,
    pub waited_reads_served: u64,
    /// Read attempts gated on a token pair on a model channel below its log start that the
    /// owner had not yet recorded: what `TokenPrunesReceivedChannels` would wave through.
    pub reads_on_passed_pairs: u64,
    pub retention_advances: u64,
    /// Retention advances on a model channel past a record its owner held.
    pub retention_passed_held: u64,
    /// Retention advances on a model channel whose new log start sits just past a
    /// transaction marker or an aborted record: what a host that compares log starts with
    /// its last record, not its consumer's position, refuses falsely.
    pub retention_past_control_records: u64,
    pub topic_recreations: u64,
    /// Prunes that removed at least one pair.
    pub prunes: u64,
    pub corrupt_records: u64,
    pub refusals: u64,
    /// Refusals hit again, identically, by a refused task after its restart.
    pub refusals_recurred: u64,
    /// Periodic log-start checks of the channels a running task holds records on.
    pub log_start_checks: u64,
    /// `POSITIONS_DISCARDED_UNREAD` refusals hit for the first time (not a recurrence).
    pub discard_refusals: u64,
    /// Of those, the ones the periodic check of a running task found.
    pub discard_refusals_by_check: u64,
    /// Deliveries by tasks (committed or not) of records retention had already passed,
    /// before any check refused.
    pub deliveries_below_log_start: u64,
    /// `POSITIONS_DISCARDED_UNREAD` refusals hit again, identically, at a restart.
    pub discard_refusals_recurred: u64,
    /// Retention advances past a position a receiver (a task or an upstream process) had
    /// not read, discarding a record there.
    pub retention_passed_unread: u64,
    /// Of those, on a channel an upstream process receives.
    pub retention_passed_unread_upstream: u64,
    /// Log-start checks by upstream processes after an out-of-range fetch.
    pub upstream_log_start_checks: u64,
    /// `POSITIONS_DISCARDED_UNREAD` refusals by upstream processes.
    pub upstream_discard_refusals: u64,
    /// Deliveries an upstream process held until it refused: effects whose cause retention
    /// discarded before the process read it.
    pub upstream_held_at_refusal: u64,
    /// Processes that send to a channel they receive (random topologies).
    pub self_channels: u64,
    /// Processes on a cycle: one sends, through other processes, to a channel it receives.
    pub process_cycles: u64,
    /// Deliveries by a process of a record it sent itself.
    pub self_deliveries: u64,
}

/// The outcome of one run.
#[derive(Clone, Debug)]
pub struct RunReport {
    pub seed: u64,
    pub scenario: &'static str,
    pub sabotage: Sabotage,
    pub violations: Vec<Violation>,
    pub stats: Stats,
    /// One line per scheduler step that did something.
    pub trace: Vec<String>,
}

impl RunReport {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// The seed, the scenario and every violation, one per line.
    pub fn summary(&self) -> String {
        let mut s = format!("seed {} scenario {} sabotage {:?}", self.seed, self.scenario, self.sabotage);
        for v in &self.violations {
            s.push_str(&format!("\n  {v}"));
        }
        s
    }
}

/// Runs one seed of `scenario` with `sabotage` switched on, to quiescence, and judges it.
pub fn run(seed: u64, scenario: &Scenario, sabotage: Sabotage) -> RunReport {
    world::World::new(seed, scenario, sabotage).run(seed)
}
