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
use parsley::kept::KeptSabotage;

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
    /// Upstream processes restart now and then under a new declaration: a channel leaves
    /// (refused `CHANNEL_REMOVED_WITH_HELD_MESSAGES` while it holds records there, and the
    /// operator restores the old declaration) or joins (seeded no lower than its delivered
    /// past accounts for) — `ext` among them, whose recreation then changes the identity
    /// of a received topic (`CHANNEL_IDENTITY_CHANGED` at the next start).
    pub scope_changes: bool,
    /// The upstream processes' hosts have a bug: now and then a consumer rewinds a little
    /// within the execution and feeds positions again, which the engine must refuse
    /// `OUT_OF_ORDER_FEED` (the operator then restarts the process with the bug fixed).
    pub out_of_order_feeds: bool,
    /// Receivers get small metadata budgets (drawn per seed and receiver), so values over
    /// budget are refused `METADATA_BUDGET_EXCEEDED`: on receipt by tasks and processes,
    /// and on a process's stamp.
    pub small_budgets: bool,
    /// Several projector instances share the tasks through leases: an owner freezes (its
    /// lease runs out, and it may wake later with a step's commit still in flight), another
    /// instance takes the task at a new epoch, and the old owner's late commit must be
    /// fenced; commits fail transiently, lose their answers (the outcome unknown to the
    /// host), and the projection rejects a record now and then (`PROJECTION_REJECTED`).
    pub ha: bool,
    /// The model's topic count is drawn from these (each topic co-partitioned into the
    /// model's tasks); a single choice draws nothing, so the seed's world is unchanged.
    pub model_topic_counts: &'static [usize],
    /// Two gateways keep covered snapshots in memory, each with a listener whose
    /// notifications the scheduler delays, loses (the connection drops) and delivers; a
    /// read's statement spans scheduler steps, and every read must be fresh: it reflects
    /// every change its serving tasks committed before it arrived.
    pub kept: bool,
    /// Weight of a retention that outruns a lagging upstream reader at the moment it holds
    /// nothing: up to exactly what the fastest reader of the channel read (0: none). Used
    /// with `retention_passes_unread`.
    pub outrun_weight: u32,
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
            scope_changes: false,
            out_of_order_feeds: false,
            small_budgets: false,
            ha: false,
            model_topic_counts: &[2],
            kept: false,
            outrun_weight: 0,
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
    /// sender pruning its frontier by the log start, `PruneDropsLiveCause`, breaks). Besides
    /// the usual retention, a second kind outruns a lagging process when it holds nothing and
    /// has read everything else it receives: up to exactly what the fastest reader read.
    pub fn unread() -> Scenario {
        Scenario {
            name: "unread",
            retention_weight: 3,
            retention_passes_held: true,
            retention_passes_unread: true,
            outrun_weight: 2,
            ..Scenario::soak()
        }
    }

    /// Randomized topologies: 2–4 upstream processes over `raw`, `mid` and 1–3 more
    /// upstream topics of 1–3 partitions, with random receive and send sets — cycles and
    /// self-channels included — and 1–3 model topics, under everything `soak` does.
    pub fn random() -> Scenario {
        Scenario { name: "random", random_topology: true, model_topic_counts: &[1, 2, 3], ..Scenario::soak() }
    }

    /// Scope changes at upstream processes' restarts (channels leaving and joining, the seed
    /// floor, a received topic recreated), crash-heavy so restarts are frequent.
    pub fn scopes() -> Scenario {
        Scenario { name: "scopes", scope_changes: true, crash_weight: 2, work_steps: 700, ..Scenario::soak() }
    }

    /// A host that feeds out of order now and then (a bug injected on purpose): the engine
    /// must refuse `OUT_OF_ORDER_FEED` exactly when it feeds a position again.
    pub fn hostile_host() -> Scenario {
        Scenario { name: "hostile_host", out_of_order_feeds: true, work_steps: 700, ..Scenario::soak() }
    }

    /// Small metadata budgets: refusals on receipt and on stamping, each due exactly when
    /// the value is over the budget. No topic is recreated, so what a process's frontier
    /// names is what it knows.
    pub fn budget() -> Scenario {
        Scenario { name: "budget", small_budgets: true, recreate_weight: 0, work_steps: 700, ..Scenario::soak() }
    }

    /// Budget pressure in random graphs: `budget`'s small metadata budgets over `random`'s
    /// topologies and 1–3 model topics, so what a stamp names grows with the graph. No
    /// topic is recreated, as in `budget`: a frontier names exactly what its process knows.
    pub fn random_budget() -> Scenario {
        Scenario { name: "random_budget", random_topology: true, model_topic_counts: &[1, 2, 3], ..Scenario::budget() }
    }

    /// High availability: leases, takeovers, zombies with late commits, failing and
    /// rejected steps (see [`Scenario::ha`] the field).
    pub fn ha() -> Scenario {
        Scenario { name: "ha", ha: true, crash_weight: 1, work_steps: 800, ..Scenario::soak() }
    }

    /// Kept snapshots at two gateways (see [`Scenario::kept`] the field), on models of 2–4
    /// tasks so that pages are served by several; no replica (its reads are stale by
    /// design, and nothing read from it is kept).
    pub fn kept() -> Scenario {
        Scenario {
            name: "kept",
            kept: true,
            replica: false,
            task_counts: &[2, 3, 4],
            keys: 4,
            clients: 4,
            work_steps: 700,
            ..Scenario::soak()
        }
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
            Scenario::scopes(),
            Scenario::hostile_host(),
            Scenario::budget(),
            Scenario::ha(),
            Scenario::random_budget(),
            Scenario::kept(),
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
    /// Token hygiene (the core's `gate::keeps_pair`, which the gateway and the simulator
    /// call): token pairs on the model's own channels are pruned below the log start too,
    /// though the owner may still hold the record there.
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
    /// Engine: a restore under a declaration without a channel holding records drops them
    /// instead of refusing `CHANNEL_REMOVED_WITH_HELD_MESSAGES`.
    IgnoreRemovedChannels,
    /// Host: a restart resolves received topics by name and goes on under a recreated one
    /// (the old channel leaves, the new one joins) instead of refusing
    /// `CHANNEL_IDENTITY_CHANGED`.
    IgnoreRecreation,
    /// Engine: a position fed again within an execution is dropped as a replay instead of
    /// refused `OUT_OF_ORDER_FEED`.
    AcceptOutOfOrderFeed,
    /// Engine: a joining channel is seeded at the host's initial position, below what the
    /// delivered past accounts for on it.
    IgnoreSeedFloor,
    /// Engine: the metadata budget is ignored on receipt and on stamping.
    IgnoreBudget,
    /// Engine: a refusal naming a received record counts the record as fed, so the refusal
    /// is persisted with `fed_up_to` past it and a restart does not meet it again.
    RefusedRecordCountedFed,
    /// Host (an upstream process): its steps do not persist the frontier, so a restarted
    /// sender restores a frontier behind what it knew and stamps its next sends with less
    /// than their causes.
    FrontierNotPersisted,
    /// Host (the step transaction): the epoch is checked when the step is sent, not under
    /// the task's row lock when it commits, so a commit in flight while its owner froze
    /// and another instance took the task is applied over the new owner's work.
    EpochCheckedBeforeLock,
    /// Host (the step transaction): a step commits in two transactions, the projection's
    /// rows first and the ordering state (held records, `fed_up_to`, frontier, clock)
    /// second, so a crash between them leaves rows the restored engine delivers again.
    StepInTwoTransactions,
    /// Host (the step transaction): no epoch is checked at all, so a zombie's step is
    /// accepted after another instance took its task.
    ZombieStepAccepted,
    /// Kept snapshots (`parsley::kept`): a kept snapshot serves a read without the
    /// listener's barrier, so a change committed before the read but not yet heard is
    /// missed.
    KeptNoBarrier,
    /// Kept snapshots: the listener's reconnect changes no generation, so what was kept
    /// before notifications were lost is served after.
    KeptAcrossReconnect,
    /// Kept snapshots: kept under the generation read after the statement, so a change
    /// heard while it ran is hidden.
    KeptGenerationAfterStatement,
    /// Kept snapshots: a page is kept under its first task's generation only, so another
    /// task's step does not drop it.
    KeptPageUnderOwner,
}

impl Sabotage {
    pub const ALL: [Sabotage; 33] = [
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
        Sabotage::IgnoreRemovedChannels,
        Sabotage::IgnoreRecreation,
        Sabotage::AcceptOutOfOrderFeed,
        Sabotage::IgnoreSeedFloor,
        Sabotage::IgnoreBudget,
        Sabotage::RefusedRecordCountedFed,
        Sabotage::FrontierNotPersisted,
        Sabotage::EpochCheckedBeforeLock,
        Sabotage::StepInTwoTransactions,
        Sabotage::ZombieStepAccepted,
        Sabotage::KeptNoBarrier,
        Sabotage::KeptAcrossReconnect,
        Sabotage::KeptGenerationAfterStatement,
        Sabotage::KeptPageUnderOwner,
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
            Sabotage::IgnoreRemovedChannels => EngineSabotage::IgnoreRemovedChannels,
            Sabotage::AcceptOutOfOrderFeed => EngineSabotage::AcceptOutOfOrderFeed,
            Sabotage::IgnoreSeedFloor => EngineSabotage::IgnoreSeedFloor,
            Sabotage::IgnoreBudget => EngineSabotage::IgnoreBudget,
            Sabotage::RefusedRecordCountedFed => EngineSabotage::RefusedRecordCountedFed,
            Sabotage::HeldNotPersisted => EngineSabotage::HostHeldNotHandedOver,
            Sabotage::StaleLogStart => EngineSabotage::HostStaleLogStart,
            Sabotage::LogStartAhead => EngineSabotage::HostLogStartAhead,
            Sabotage::ReadPositionIgnored => EngineSabotage::HostReadPositionIgnored,
            _ => EngineSabotage::None,
        }
    }

    fn kept(self) -> KeptSabotage {
        match self {
            Sabotage::KeptNoBarrier => KeptSabotage::NoBarrier,
            Sabotage::KeptAcrossReconnect => KeptSabotage::KeptAcrossReconnect,
            Sabotage::KeptGenerationAfterStatement => KeptSabotage::GenerationAfterStatement,
            Sabotage::KeptPageUnderOwner => KeptSabotage::PageUnderOwner,
            _ => KeptSabotage::None,
        }
    }

    fn gate(self) -> GateSabotage {
        match self {
            Sabotage::CoverageSkipsUnrecorded => GateSabotage::SkipUnrecorded,
            Sabotage::RefreshFullClock => GateSabotage::RefreshFullClock,
            Sabotage::GateServedTaskOnly => GateSabotage::ServedTaskOnly,
            Sabotage::TokenPrunesReceivedChannels => GateSabotage::PruneReceivedBelowLogStart,
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
    /// Process restarts under a declaration without a channel it received.
    pub channels_left: u64,
    /// Of those, refused `CHANNEL_REMOVED_WITH_HELD_MESSAGES` (records held there).
    pub removals_refused: u64,
    /// Process restarts under a declaration with a channel it did not receive.
    pub channels_joined: u64,
    /// Of those, joins whose seed floor (what the delivered past accounts for) lay above
    /// the initial position.
    pub joins_above_floor: u64,
    /// Restarts that found a received topic recreated (`CHANNEL_IDENTITY_CHANGED`).
    pub identity_refusals: u64,
    /// New declarations of the model's topics rolled out (every task restarts under one):
    /// a topic removed, or one added.
    pub model_rescopes: u64,
    pub model_topics_removed: u64,
    pub model_topics_added: u64,
    /// Task restarts under a declaration without a channel the task received, and of
    /// those, refused `CHANNEL_REMOVED_WITH_HELD_MESSAGES` (the operator then withdrew the
    /// declaration, and the refused task's next start cleared its refusal).
    pub task_channels_left: u64,
    pub task_removals_refused: u64,
    pub refusals_cleared: u64,
    pub declarations_withdrawn: u64,
    /// A model topic deleted and recreated, and the model refused `CHANNEL_IDENTITY_CHANGED`
    /// at the next start of one of its tasks.
    pub model_topic_recreations: u64,
    pub model_identity_refusals: u64,
    /// Task restarts under a declaration with a channel the task did not receive, and of
    /// those, joins seeded above the log start (what the task's delivered past accounts for).
    pub task_channels_joined: u64,
    pub task_joins_above_floor: u64,
    /// Feeds of a position already fed in the execution (the injected host bug).
    pub out_of_order_feeds: u64,
    /// `OUT_OF_ORDER_FEED` refusals.
    pub out_of_order_refusals: u64,
    /// `METADATA_BUDGET_EXCEEDED` refusals on receipt (tasks and processes).
    pub budget_refusals_on_receipt: u64,
    /// `METADATA_BUDGET_EXCEEDED` refusals on a process's stamp.
    pub budget_refusals_on_stamp: u64,
    /// Owners frozen (a pause past their lease), and of those, frozen with a step's
    /// commit in flight.
    pub freezes: u64,
    pub freezes_mid_commit: u64,
    /// Tasks taken by an instance at a new epoch while the previous owner's execution was
    /// frozen.
    pub takeovers_of_frozen: u64,
    /// Frozen owners that woke before anyone took their task, and went on.
    pub thaws_resumed: u64,
    /// Frozen owners that woke after a takeover, with a commit in flight or a step to
    /// commit, and were fenced (no statement of theirs applied); and those fenced by their
    /// lease renewal with nothing to commit.
    pub zombie_commits_fenced: u64,
    pub zombie_renewals_fenced: u64,
    /// Step commits that failed (nothing applied) and were retried from a restore.
    pub transient_failures: u64,
    /// Step commits whose answer was lost: applied, or not, unknown to the host.
    pub lost_answers_applied: u64,
    pub lost_answers_not_applied: u64,
    /// Processes that died in the middle of a step's transaction.
    pub crashes_mid_commit: u64,
    /// Failures recorded in the task's row (`failing`), and steps that wrote it back to
    /// `running`.
    pub failures_recorded: u64,
    pub recoveries_recorded: u64,
    /// Step commits that carried `careful` (one record per projection call).
    pub careful_commits: u64,
    /// Batches the projection rejected without naming a record (a careful retry follows).
    pub batch_rejections: u64,
    /// `PROJECTION_REJECTED` refusals: first, and met again after a restart.
    pub rejections: u64,
    pub rejections_recurred: u64,
    /// The model's topic count in this world (each co-partitioned into its tasks).
    pub model_topics: u64,
    /// Receipts that left a task holding records on two channels at once (both waiting on
    /// a third: only with three model topics).
    pub held_on_two_channels: u64,
    /// `OUT_OF_ORDER_FEED` refusals by projector tasks (of `out_of_order_refusals`).
    pub task_out_of_order_refusals: u64,
    /// Reads served from a kept snapshot, and of those, pages.
    pub kept_served: u64,
    pub kept_pages_served: u64,
    /// Barriers run for a read a kept snapshot covered, and notifications they made the
    /// listener hear first.
    pub kept_barriers: u64,
    pub barrier_heard: u64,
    /// Snapshots kept, and covered reads whose snapshot was not kept because a
    /// notification was heard while their statement ran.
    pub kept_stored: u64,
    pub kept_refused_heard: u64,
    /// Kept snapshots found no longer servable (their generation moved, or too old).
    pub kept_dropped: u64,
    /// Notifications heard on their own, and lost with a dropped connection.
    pub notifications_heard: u64,
    pub notifications_lost: u64,
    pub listener_drops: u64,
    /// Served reads judged for freshness.
    pub fresh_reads_judged: u64,
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
