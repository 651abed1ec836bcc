//! The simulated world and its scheduler: upstream processes, edge producers, session
//! clients and database-hosted projector tasks, each a set of enabled actions the seeded
//! scheduler draws from, one per step. Every host here drives the real core — `Engine`,
//! `CausalPast`, `gate`, `refresh`, `partition_for_key` — exactly as a production host
//! would; the oracle watches from outside.
//!
//! This module holds the world's state, its scheduler (`enabled`, `perform`), the
//! environment's actions (retention, recreation, replica syncs) and the final checks; each
//! kind of actor has its own file: [`producers`] (edge producers, session clients and their
//! reads), [`processes`] (upstream processes), [`tasks`] (projector tasks).

mod gateway;
mod processes;
mod producers;
mod tasks;

use std::collections::{BTreeMap, BTreeSet};

use crate::kafka::{FetchError, SimKafka, TxnId};
use crate::oracle::{Actor, Oracle, RecordId, ViolationKind};
use crate::rng::SimRng;
use crate::store::{Payload, SimDb, TaskRows};
use crate::{RunReport, Sabotage, Scenario, Stats};
use parsley::channel::{ChannelId, Position, TopicId};
use parsley::engine::{ChannelFact, Engine, EngineConfig, Receipt};
use parsley::gate::{self, ModelShape, PairFact, Verdict};
use parsley::host::{ChannelStart, Failure, LogStartCheck, Next, Observed, StepCommit, TaskHost, TaskStatus};
use parsley::kept::KeptRules;
use parsley::murmur2::partition_for_key;
use parsley::past::CausalPast;
use parsley::refusal::{Refusal, RefusalReason};
use parsley::startup::{check_topic_identity_sabotaged, ResolvedTopic};

/// The model's topics: a prefix of these (two unless the scenario draws the count).
const MODEL_TOPICS: [&str; 3] = ["orders", "payments", "refunds"];

/// The weight of an idle task's periodic log-start check once it is due (a task that
/// commits checks right after, before its next step).
const LOG_START_CHECK_WEIGHT: u32 = 2;

/// The extra upstream topics of a random topology (a prefix of them, drawn per seed).
const UPSTREAM_TOPICS: [&str; 3] = ["u0", "u1", "u2"];

/// A random topology's processes: 2–4, each receiving a random non-empty set of upstream
/// channels and sending to a random non-empty set of upstream channels and model topics.
/// Nothing keeps a process from sending to a channel it receives (a self-channel) or to a
/// channel whose receiver sends back to it (a cycle): happened-before stays acyclic, so
/// the engine must deliver through both without waiting forever. Every process sends to
/// the model (one or two of its `models` topics), so its causes reach the tasks.
fn random_shapes(rng: &mut SimRng, upstream: &[ChannelId], models: usize) -> Vec<(Vec<ChannelId>, Vec<Dest>)> {
    let count = rng.range(2, 4);
    let subset = |rng: &mut SimRng| -> Vec<ChannelId> {
        let mut picked: Vec<ChannelId> = upstream.iter().copied().filter(|_| rng.chance(1, 3)).collect();
        if picked.is_empty() {
            picked.push(*rng.pick(upstream));
        }
        picked
    };
    (0..count)
        .map(|_| {
            let received = subset(rng);
            let mut outputs: Vec<Dest> = subset(rng).into_iter().map(Dest::Channel).collect();
            outputs.push(Dest::Model(rng.below(models as u64) as usize));
            if rng.chance(1, 2) {
                outputs.push(Dest::Model(rng.below(models as u64) as usize));
            }
            (received, outputs)
        })
        .collect()
}

fn sends_to(p: &Process, c: &ChannelId) -> bool {
    p.outputs.iter().any(|d| matches!(d, Dest::Channel(o) if o == c))
}

/// How many processes send to a channel they receive.
fn topology_self_channels(processes: &[Process]) -> u64 {
    processes.iter().filter(|p| p.received.iter().any(|c| sends_to(p, c))).count() as u64
}

/// How many processes reach a channel they receive through at least one other process.
fn topology_cycles(processes: &[Process]) -> u64 {
    let feeds = |a: usize, b: usize| a != b && processes[b].received.iter().any(|c| sends_to(&processes[a], c));
    (0..processes.len())
        .filter(|&start| {
            let mut seen = BTreeSet::new();
            let mut todo: Vec<usize> = (0..processes.len()).filter(|&b| feeds(start, b)).collect();
            while let Some(q) = todo.pop() {
                if q == start || feeds(q, start) {
                    return true;
                }
                if seen.insert(q) {
                    todo.extend((0..processes.len()).filter(|&b| feeds(q, b)));
                }
            }
            false
        })
        .count() as u64
}

/// Where the scenario has leases (`ha`): how many scheduler steps a lease lasts past its
/// last renewal, how many projector instances share the tasks, and the odds of each fault
/// a step's commit may meet (one in this many).
const LEASE_STEPS: u64 = 30;
const INSTANCES: u32 = 3;
const FREEZE_MID_COMMIT_ODDS: u64 = 14;
const TRANSIENT_FAILURE_ODDS: u64 = 14;
const LOST_ANSWER_ODDS: u64 = 14;
const CRASH_MID_COMMIT_ODDS: u64 = 14;

/// In a scenario whose retention may outrun readers, one retention advance in this many
/// may pass a position a receiver has not read.
const UNREAD_RETENTION_ODDS: u64 = 8;

/// Where processes restart under new declarations, one restart in this many changes scope.
const SCOPE_CHANGE_ODDS: u64 = 2;

/// Where scopes change, at most this many new declarations of the model per run.
const MODEL_RESCOPES: u64 = 3;

/// Where process hosts feed out of order, one fetch in this many rewinds the consumer
/// first (within the execution).
const OUT_OF_ORDER_ODDS: u64 = 40;

/// The small metadata budgets drawn per receiver (bytes), where the scenario has them: a
/// value naming a few topics fits, one naming every topic of the world often does not.
const SMALL_BUDGETS: (i64, i64) = (120, 260);

/// Where an upstream process sends.
#[derive(Clone, Copy, Debug)]
enum Dest {
    /// A fixed channel (an intermediate topic).
    Channel(ChannelId),
    /// A model topic, partitioned by the record's key.
    Model(usize),
}

struct Process {
    receiver: usize,
    received: Vec<ChannelId>,
    outputs: Vec<Dest>,
    engine: Engine<Payload>,
    next_fetch: BTreeMap<ChannelId, Position>,
    txn: Option<(TxnId, Vec<RecordId>)>,
    /// Deliveries not yet followed by a send.
    pending_sends: u32,
    /// Channels this process reads slowly (fetches drawn at the lowest weight), so
    /// retention that keeps pace with a faster receiver outruns it there.
    slow: BTreeSet<ChannelId>,
    /// Its durable ordering state (held records, `fed_up_to`, frontier), committed with
    /// each action that changed the engine: what a restart restores.
    rows: TaskRows,
    config: EngineConfig,
    /// Per channel, where this execution started reading: an out-of-order feed rewinds no
    /// further.
    exec_start: BTreeMap<ChannelId, Position>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum ReadKind {
    Key(u16),
    Collection,
    /// A named query over the model's table, answered by every task: the gateway never
    /// keeps its answers (the `kept` scenario; elsewhere it reads as a collection).
    Query,
}

/// An edge producer or a session client: a token, stamped onto every write.
struct Producer {
    actor: Actor,
    token: CausalPast,
    pending_read: Option<ReadKind>,
    /// The database version of the last attempt that was not covered.
    last_attempt: u64,
}

/// A task that is up: the host state machine the projector's runner drives too (it owns
/// the engine and says what to do next), and what the simulated host keeps beside it.
struct Running {
    host: TaskHost<Payload>,
    /// Per channel, where the next fetch reads (the consumer's position).
    next_fetch: BTreeMap<ChannelId, Position>,
    /// Projection writes of the step in progress.
    applied: Vec<Payload>,
    /// Per channel, the log start the host last checked with the engine: the periodic
    /// check is due once retention moved a holding channel's log start past it.
    log_start_checked: BTreeMap<ChannelId, Position>,
    /// Per channel, the consumer's position: past the last record fed and past the
    /// markers and aborted runs after it.
    read_to: BTreeMap<ChannelId, Position>,
    /// The epoch this execution took the task at, and its instance.
    epoch: u64,
    instance: u32,
    /// Records fed in the step in progress (a careful step that fed one names a rejection).
    fed_in_step: usize,
    /// Per channel, where this execution started reading (its assigned position): an
    /// out-of-order feed rewinds no further.
    exec_start: BTreeMap<ChannelId, Position>,
    /// Channels of a new declaration this start seeded (with the log start it read), which
    /// join the task's scope when the start commits.
    joins: Vec<(ChannelId, Position)>,
}

/// A new declaration of the model's topics being rolled out: the one before (what the
/// operator restores if a task refuses it), and the tasks yet to start under it.
struct Rollout {
    before: BTreeSet<TopicId>,
    pending: BTreeSet<usize>,
}

/// A step's commit sent but not yet arrived at the database (its owner froze meanwhile).
struct InFlight {
    commit: StepCommit<Payload>,
    applied: Vec<Payload>,
    read_to: BTreeMap<ChannelId, Position>,
    /// The epoch as the row said when the step was sent (what `EpochCheckedBeforeLock`
    /// goes by).
    epoch_when_sent: u64,
}

/// An owner's execution, paused past its lease: it may wake before anyone took its task
/// (and go on), or after (a zombie, whose commit must be fenced).
struct Frozen {
    task: usize,
    run: Box<Running>,
    in_flight: Option<InFlight>,
}

impl Running {
    fn engine(&self) -> &Engine<Payload> {
        self.host.engine()
    }

    /// A step is open (the engine is ahead of the database) or due (a drain after a
    /// restore): its commit is worth drawing.
    fn step_pending(&self) -> bool {
        self.host.step_open() || self.host.drain_pending()
    }
}

enum TaskState {
    Down,
    Up(Box<Running>),
}

struct Task {
    receiver: usize,
    received: Vec<ChannelId>,
    config: EngineConfig,
    state: TaskState,
    started_once: bool,
    refused: bool,
    /// A refusal the stored status says this task hit: a restart must hit it again.
    expect_refusal: Option<Refusal>,
    /// Per channel of the model the task receives (as far as its committed state goes):
    /// where reads start to owe its records there (`Position::MIN` since the first start;
    /// a join's first position once it joined again).
    scope_from: BTreeMap<ChannelId, Position>,
    /// The stored refusal was for a declaration the operator withdrew: the next start must
    /// clear it, not meet it again.
    withdrawn: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Work,
    Drain,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    EdgeWrite(usize),
    RogueWrite,
    ClientWrite(usize),
    ClientRead(usize, ReadKind),
    ClientRetry(usize),
    ReplicaSync,
    ProcFetch(usize, ChannelId),
    ProcSend(usize),
    ProcBegin(usize),
    ProcEnd(usize, bool),
    ProcPrune(usize),
    TaskStart(usize),
    TaskFeed(usize, ChannelId),
    TaskPrune(usize),
    TaskCommit(usize),
    TaskCheckLogStart(usize),
    TaskAbort(usize),
    TaskCrash(usize),
    /// An owner pauses past its lease (a stop-the-world pause, a partition).
    TaskFreeze(usize),
    /// A frozen execution (by index into `frozen`) wakes.
    TaskThaw(usize),
    /// A gateway's listener hears its oldest queued notification; drops its connection;
    /// connects again.
    GatewayHear(usize),
    GatewayDrop(usize),
    GatewayConnect(usize),
    /// A client's (or visitor's) read whose statement ran finishes (it is served, and
    /// maybe kept).
    ClientFinish(usize),
    /// A visitor (a reader without a session) reads at a gateway.
    VisitorRead(usize, ReadKind),
    ProcCrash(usize),
    /// The operator rolls out a new declaration of the model's topics (`scopes`).
    ModelRescope,
    /// A topic the model declares is deleted and created again under its name (`scopes`).
    RecreateModelTopic,
    Retention,
    RetentionOutrun,
    RecreateExt,
}

pub(crate) struct World {
    scenario: Scenario,
    sabotage: Sabotage,
    rng: SimRng,
    kafka: SimKafka,
    db: SimDb,
    /// Bumped by every commit.
    db_version: u64,
    /// A read replica that lags the primary (when the scenario has one): a consistent
    /// but older snapshot, brought up to date by `ReplicaSync`.
    replica: Option<SimDb>,
    replica_version: u64,
    /// Bumped by every commit and replica sync: a waiting read retries only after
    /// something it could read changed.
    changes: u64,
    oracle: Oracle,
    names: BTreeMap<TopicId, String>,
    model: ModelShape,
    /// Every topic created for the model; `declared` is the ones it receives now (all, but
    /// where scopes change), and `rollout` a new declaration not yet every task's.
    model_topics: Vec<TopicId>,
    declared: BTreeSet<TopicId>,
    rollout: Option<Rollout>,
    /// Where scopes change, whether this seed recreates a model topic, whether it did, and
    /// the model-wide refusal its next start recorded on every task.
    seed_recreates_model: bool,
    model_recreated: bool,
    model_refusal: Option<Refusal>,
    /// A recreated model topic's new ID, and the one the model declares.
    recreated_from: BTreeMap<TopicId, TopicId>,
    raw: TopicId,
    /// Per key, the task that owns it (murmur2 of the key bytes).
    owner_of_key: Vec<u32>,
    tasks: Vec<Task>,
    processes: Vec<Process>,
    edges: Vec<Producer>,
    clients: Vec<Producer>,
    rogue: Option<Producer>,
    recreations: u32,
    /// Per model channel, how far its owner's consumer had read (its position, past
    /// control records) at the owner's last commit: what retention may pass.
    committed_read: BTreeMap<ChannelId, Position>,
    phase: Phase,
    step: u64,
    stats: Stats,
    trace: Vec<String>,
    /// Owners' executions frozen past their leases.
    frozen: Vec<Frozen>,
    /// From this step on, the next client write carries a value the projection rejects
    /// (where the scenario has leases, on some seeds).
    poison_at: Option<u64>,
    /// The gateways that keep snapshots (the `kept` scenario), the core's rules they keep
    /// them by, and the clients' reads whose statement ran and which finish later.
    gateways: Vec<gateway::Gateway>,
    kept_rules: KeptRules,
    reads_in_flight: BTreeMap<usize, gateway::InFlightRead>,
}

/// A receiver's engine configuration: a small metadata budget where the scenario has them
/// (drawn per receiver, and told to the oracle), else the default.
fn receiver_config(scenario: &Scenario, rng: &mut SimRng, oracle: &mut Oracle, receiver: usize) -> EngineConfig {
    let mut config = EngineConfig::default();
    if scenario.small_budgets {
        config.metadata_budget = rng.range(SMALL_BUDGETS.0, SMALL_BUDGETS.1) as usize;
        oracle.set_budget(receiver, config.metadata_budget);
    }
    config
}

fn key_bytes(key: u16) -> Vec<u8> {
    format!("k{key}").into_bytes()
}

fn header_values(headers: &[Option<Vec<u8>>]) -> Vec<Option<&[u8]>> {
    headers.iter().map(|h| h.as_deref()).collect()
}

impl World {
    pub(crate) fn new(seed: u64, scenario: &Scenario, sabotage: Sabotage) -> World {
        let mut rng = SimRng::new(seed);
        let n = *rng.pick(scenario.task_counts);
        let mut kafka = SimKafka::new();
        let mut names = BTreeMap::new();
        let mut used = BTreeSet::new();
        let mut new_id = |rng: &mut SimRng| loop {
            let id = TopicId::from_halves(rng.next_u64(), rng.next_u64());
            if !id.is_zero() && used.insert(id) {
                return id;
            }
        };
        let mut create = |kafka: &mut SimKafka, rng: &mut SimRng, name: &str, partitions: u32| {
            let id = new_id(rng);
            kafka.create_topic(name, id, partitions);
            names.insert(id, name.to_string());
            id
        };
        let raw = create(&mut kafka, &mut rng, "raw", 2);
        let mid = create(&mut kafka, &mut rng, "mid", 1);
        create(&mut kafka, &mut rng, "ext", 1);
        let models = match scenario.model_topic_counts {
            [only] => *only,
            counts => *rng.pick(counts),
        };
        let model_topics: Vec<TopicId> =
            MODEL_TOPICS[..models].iter().map(|t| create(&mut kafka, &mut rng, t, n)).collect();
        // A random topology adds upstream topics only processes write to, of 1–3 partitions.
        let mut upstream: Vec<ChannelId> = Vec::new();
        if scenario.random_topology {
            let raw_and_mid = [ChannelId::new(raw, 0), ChannelId::new(raw, 1), ChannelId::new(mid, 0)];
            upstream.extend(raw_and_mid);
            for name in &UPSTREAM_TOPICS[..rng.range(1, UPSTREAM_TOPICS.len() as i64) as usize] {
                let partitions = rng.range(1, 3) as u32;
                let id = create(&mut kafka, &mut rng, name, partitions);
                upstream.extend((0..partitions).map(|p| ChannelId::new(id, p)));
            }
        }
        let model = ModelShape { received_topics: model_topics.iter().copied().collect(), task_count: n };
        let mut oracle = Oracle::new(model_topics.iter().copied());
        for (id, name) in &names {
            oracle.name_topic(*id, name);
        }
        let owner_of_key = (0..scenario.keys).map(|k| partition_for_key(&key_bytes(k), n)).collect();

        let tasks = (0..n)
            .map(|i| {
                let received: Vec<ChannelId> = model_topics.iter().map(|&t| ChannelId::new(t, i)).collect();
                let receiver = oracle.add_receiver(&format!("task{i}"), None, &received);
                let config = receiver_config(scenario, &mut rng, &mut oracle, receiver);
                let scope_from = received.iter().map(|&c| (c, Position::MIN)).collect();
                Task {
                    receiver,
                    received,
                    config,
                    state: TaskState::Down,
                    started_once: false,
                    refused: false,
                    expect_refusal: None,
                    scope_from,
                    withdrawn: false,
                }
            })
            .collect();

        // P0 receives both raw partitions and feeds mid and the model; P1 receives mid and
        // one raw partition, so some causes reach it only through P0's stamps.
        let raw0 = ChannelId::new(raw, 0);
        let raw1 = ChannelId::new(raw, 1);
        let mid0 = ChannelId::new(mid, 0);
        let mut shapes: Vec<(Vec<ChannelId>, Vec<Dest>)> = vec![
            (vec![raw0, raw1], [Dest::Channel(mid0)].into_iter().chain((0..models).map(Dest::Model)).collect()),
            (vec![mid0, raw1], (0..models).map(Dest::Model).collect()),
        ];
        if scenario.random_topology {
            shapes = random_shapes(&mut rng, &upstream, models);
        }
        if scenario.retention_passes_unread {
            // A second slow reader: P2 receives mid and lags on raw/0, which P0 reads too.
            shapes.push((vec![mid0, raw0], vec![Dest::Model(models - 1)]));
        }
        if scenario.audit {
            // An auditor downstream of the gateway: it receives an upstream channel and
            // every partition of a topic session clients write to, and sends nothing.
            let mut received = vec![raw0];
            received.extend((0..n).map(|p| ChannelId::new(model_topics[models - 1], p)));
            shapes.push((received, Vec::new()));
        }
        let processes: Vec<Process> = shapes
            .into_iter()
            .enumerate()
            .map(|(i, (received, outputs))| {
                let actor = Actor::Process(i as u32);
                let receiver = oracle.add_receiver(&format!("P{i}"), Some(actor), &received);
                let config = receiver_config(scenario, &mut rng, &mut oracle, receiver);
                let mut engine = Engine::new(config.clone(), received.iter().copied());
                engine.set_sabotage(sabotage.engine());
                let mut next_fetch = BTreeMap::new();
                let mut baselines = Vec::new();
                for &c in &received {
                    let start = kafka.log_start(&c);
                    let fed = engine.seed(c, start - 1).expect("a fresh engine seeds");
                    next_fetch.insert(c, fed + 1);
                    baselines.push((c, start));
                }
                oracle.start(receiver, &baselines);
                // Where retention may outrun readers, P1 lags on raw/1 and P2 on raw/0, which
                // P0 reads too: P0's stamps then name positions they may never read.
                let slow = match i {
                    1 if scenario.retention_passes_unread => [raw1].into(),
                    2 if scenario.retention_passes_unread => [raw0].into(),

                    _ => BTreeSet::new(),
                };
                let rows = TaskRows::default();
                let exec_start = next_fetch.clone();
                Process {
                    receiver,
                    received,
                    outputs,
                    engine,
                    next_fetch,
                    txn: None,
                    pending_sends: 0,
                    slow,
                    rows,
                    config,
                    exec_start,
                }
            })
            .collect();

        let (self_channels, process_cycles) = (topology_self_channels(&processes), topology_cycles(&processes));
        let producer = |actor| Producer { actor, token: CausalPast::new(), pending_read: None, last_attempt: 0 };
        let edges = (0..scenario.edges).map(|i| producer(Actor::Edge(i))).collect();
        let clients = (0..scenario.clients).map(|i| producer(Actor::Client(i))).collect();
        let rogue = scenario.corrupt.then(|| producer(Actor::Edge(scenario.edges)));
        // Early enough that the refused task is often restarted (and must refuse again)
        // before the drain.
        let work = scenario.work_steps as i64;
        let poison_at = (scenario.ha && rng.chance(1, 2)).then(|| rng.range(work / 8, work / 2) as u64);
        let seed_recreates_model = scenario.scope_changes && rng.chance(1, 4);

        World {
            scenario: scenario.clone(),
            sabotage,
            rng,
            kafka,
            db: SimDb::new(n),
            db_version: 1,
            replica: scenario.replica.then(|| SimDb::new(n)),
            replica_version: 1,
            changes: 1,
            oracle,
            names,
            model,
            declared: model_topics.iter().copied().collect(),
            rollout: None,
            seed_recreates_model,
            model_recreated: false,
            model_refusal: None,
            recreated_from: BTreeMap::new(),
            model_topics,
            raw,
            owner_of_key,
            tasks,
            processes,
            edges,
            clients,
            rogue,
            recreations: 0,
            committed_read: BTreeMap::new(),
            phase: Phase::Work,
            step: 0,
            stats: Stats { tasks: n, self_channels, process_cycles, model_topics: models as u64, ..Stats::default() },
            trace: Vec::new(),
            frozen: Vec::new(),
            poison_at,
            gateways: if scenario.kept {
                (0..gateway::GATEWAYS).map(|_| gateway::Gateway::new()).collect()
            } else {
                Vec::new()
            },
            kept_rules: KeptRules::sabotaged(sabotage.kept()),
            reads_in_flight: BTreeMap::new(),
        }
    }

    /// Runs the world to quiescence and judges it.
    pub(crate) fn run(mut self, seed: u64) -> RunReport {
        let mut drained = false;
        loop {
            if self.phase == Phase::Work && self.step >= self.scenario.work_steps {
                self.phase = Phase::Drain;
                self.trace.push(format!("{} drain", self.step));
            }
            if self.phase == Phase::Drain && self.step >= self.scenario.work_steps + self.scenario.drain_budget {
                break;
            }
            let enabled = self.enabled();
            if enabled.is_empty() {
                if self.phase == Phase::Drain && !self.awaiting_lease() {
                    drained = true;
                    break;
                }
                self.step += 1;
                continue;
            }
            let weights: Vec<u32> = enabled.iter().map(|(_, w)| *w).collect();
            let (action, _) = enabled[self.rng.weighted(&weights)];
            self.step += 1;
            self.oracle.set_step(self.step);
            self.perform(action);
            self.persist_processes();
        }
        if drained {
            self.final_checks();
        } else {
            let stuck = self.describe_stuck();
            self.oracle.report(ViolationKind::Wedged, format!("no quiescence within the drain budget: {stuck}"));
        }
        self.stats.steps = self.step;
        self.stats.records = self.oracle.record_count() as u64;
        self.stats.deliveries_checked = self.oracle.deliveries_checked;
        self.stats.deliveries_below_log_start = self.oracle.deliveries_below_log_start;
        RunReport {
            seed,
            scenario: self.scenario.name,
            sabotage: self.sabotage,
            violations: self.oracle.violations().to_vec(),
            stats: self.stats,
            trace: self.trace,
        }
    }

    fn name(&self, c: &ChannelId) -> String {
        let topic = self.names.get(&c.topic).map_or("?", |s| s.as_str());
        format!("{topic}/{}", c.partition)
    }

    fn model_channel(&self, topic: usize, key: u16) -> ChannelId {
        ChannelId::new(self.model_topics[topic], self.owner_of_key[key as usize])
    }

    /// Whether the model declares `c`'s topic now (what the gateway gates by).
    fn is_model(&self, c: &ChannelId) -> bool {
        self.model.received_topics.contains(&c.topic)
    }

    /// Whether `c` is on a topic created for the model, declared now or not (its owner's
    /// stored state may still hold it: retention minds it as a model channel).
    fn is_model_topic(&self, c: &ChannelId) -> bool {
        self.model_topics.contains(&c.topic)
    }

    /// What a host learns of a channel to prune by.
    fn fact(&self, c: &ChannelId) -> ChannelFact {
        self.kafka.fact(c)
    }

    /// What the gateway knows of a token pair's channel: whether its topic is gone, whether
    /// the model receives it, and its log start.
    fn pair_fact(&self, c: &ChannelId) -> PairFact {
        match self.fact(c) {
            ChannelFact::TopicGone => PairFact::TopicGone,
            ChannelFact::Live { log_start } => {
                PairFact::Live { received: self.is_model(c), log_start: Some(log_start) }
            }
            ChannelFact::Unknown => PairFact::Live { received: self.is_model(c), log_start: None },
        }
    }

    /// The gateway's token hygiene, the core's own rule ([`gate::prune_token`]): a pair is
    /// dropped only when its topic is gone, never for its log start. The
    /// `TokenPrunesReceivedChannels` sabotage breaks that rule inside the core.
    fn prune_token(&self, token: CausalPast) -> CausalPast {
        match self.sabotage.gate() {
            gate::GateSabotage::None => gate::prune_token(token, |c| self.pair_fact(c)),
            g => gate::prune_token_sabotaged(token, |c| self.pair_fact(c), g),
        }
    }

    /// What a read demands of the token, the core's own rule ([`gate::read_demand`]): a pair
    /// below its log start on a channel the model does not receive is no longer demanded
    /// (clocks prune those entries), while the token keeps it.
    fn read_demand(&self, token: &CausalPast) -> CausalPast {
        gate::read_demand(token, |c| self.pair_fact(c))
    }

    fn enabled(&self) -> Vec<(Action, u32)> {
        let s = &self.scenario;
        let work = self.phase == Phase::Work;
        let mut out = Vec::new();
        let mut push = |a: Action, w: u32| {
            if w > 0 {
                out.push((a, w));
            }
        };
        if work {
            for e in 0..self.edges.len() {
                push(Action::EdgeWrite(e), 3);
            }
            if self.rogue.is_some() && self.step > s.work_steps / 4 {
                push(Action::RogueWrite, 1);
            }
        }
        for (i, c) in self.clients.iter().enumerate() {
            if self.reads_in_flight.contains_key(&i) {
                push(Action::ClientFinish(i), 3);
                continue;
            }
            match c.pending_read {
                Some(_) if self.changes > c.last_attempt => push(Action::ClientRetry(i), 4),
                Some(_) => {}
                None if work => {
                    // Where gateways keep snapshots, sessions read more than they write, so
                    // reads meet what earlier reads kept.
                    let (write, key, page) = if s.kept { (1, 6, 2) } else { (3, 3, 1) };
                    push(Action::ClientWrite(i), write);
                    // The key is drawn when the read is performed.
                    push(Action::ClientRead(i, ReadKind::Key(0)), key);
                    push(Action::ClientRead(i, ReadKind::Collection), page);
                    if s.kept {
                        push(Action::ClientRead(i, ReadKind::Query), 1);
                    }
                }
                None => {}
            }
        }
        for (i, p) in self.processes.iter().enumerate() {
            let refused = p.engine.refusal().is_some();
            for &c in &p.received {
                // Out of range counts: the process must find out and check its log starts.
                let from = p.next_fetch[&c];
                // A received topic that was deleted: the host finds out on its next fetch.
                let gone = self.kafka.fact(&c) == ChannelFact::TopicGone;
                let fetch = gone || self.kafka.fetchable(&c, from) || from < self.kafka.log_start(&c);
                if fetch && !refused {
                    // The auditor lags: a backlog is what lets a later write overtake.
                    push(Action::ProcFetch(i, c), if p.outputs.is_empty() || p.slow.contains(&c) { 1 } else { 4 });
                }
            }
            match &p.txn {
                Some(_) => {
                    push(Action::ProcEnd(i, true), if work { 2 } else { 4 });
                    push(Action::ProcEnd(i, false), if work { 1 } else { 2 });
                }
                None if work => push(Action::ProcBegin(i), s.txn_weight),
                None => {}
            }
            if work && !p.outputs.is_empty() && !refused {
                push(Action::ProcSend(i), if p.pending_sends > 0 { 4 } else { 1 });
                push(Action::ProcPrune(i), 1);
                // A sender restarts from its durable state, holding or not. Not in the audit
                // scenario, which characterizes a rare limit (about one seed in sixty) on the
                // schedule it was measured with.
                let holding = p.engine.held_count() > 0;
                if !s.audit {
                    push(Action::ProcCrash(i), s.crash_weight * if holding { 2 } else { 1 });
                }
            }
        }
        for (i, t) in self.tasks.iter().enumerate() {
            match &t.state {
                TaskState::Down if self.model_refusal.is_some() => {}
                TaskState::Down if self.claimable(i) => push(Action::TaskStart(i), 3),
                TaskState::Down => {}
                TaskState::Up(run) => {
                    if !t.refused {
                        for &c in &t.received {
                            // Out of range counts: the host must learn of it and act.
                            let from = run.next_fetch[&c];
                            // Markers and aborted runs alone are worth a fetch too: the
                            // consumer's position moves past them.
                            let unread = from < self.kafka.partition(&c).last_stable();
                            // A recreated topic: the host finds out on its next fetch.
                            let gone = self.kafka.fact(&c) == ChannelFact::TopicGone;
                            if gone || unread || from < self.kafka.log_start(&c) {
                                push(Action::TaskFeed(i, c), 4);
                            }
                        }
                        if run.step_pending() {
                            push(Action::TaskCommit(i), 3);
                            if work {
                                push(Action::TaskAbort(i), s.abort_weight);
                            }
                        }
                        if work {
                            push(Action::TaskPrune(i), 1);
                        }
                        // The projector's periodic check runs between steps while the task
                        // holds records; it is worth drawing once a log start moved.
                        if !run.step_pending() && self.log_start_check_due(run) {
                            push(Action::TaskCheckLogStart(i), LOG_START_CHECK_WEIGHT);
                        }
                    }
                    if work {
                        // A task holding records is crashed at double weight: that is the
                        // one road into the held-record restore path.
                        let holding = run.engine().held_count() > 0;
                        let w = if t.refused { 1 } else { s.crash_weight * if holding { 2 } else { 1 } };
                        push(Action::TaskCrash(i), w);
                        if self.may_freeze(i) {
                            push(Action::TaskFreeze(i), 1);
                        }
                    }
                }
            }
        }
        for z in 0..self.frozen.len() {
            push(Action::TaskThaw(z), 1);
        }
        self.gateway_actions(&mut push);
        if self.replica.is_some() && self.replica_version < self.db_version {
            push(Action::ReplicaSync, if work { 2 } else { 3 });
        }
        if work && s.retention_weight > 0 {
            // Which channels can move is worked out when it is drawn (it may be none).
            push(Action::Retention, s.retention_weight);
            if s.outrun_weight > 0 && !self.outrun_candidates().is_empty() {
                push(Action::RetentionOutrun, s.outrun_weight);
            }
        }
        if work && s.recreate_weight > 0 && self.recreations < 2 && self.step > s.work_steps / 3 {
            push(Action::RecreateExt, s.recreate_weight);
        }
        // A few declarations per run, once every task has a committed state to carry over.
        let rescopable = self.rollout.is_none() && !self.model_recreated && self.tasks.iter().all(|t| t.started_once);
        let rescopable = rescopable && self.step > s.work_steps / 3;
        if work && s.scope_changes && rescopable && self.stats.model_rescopes < MODEL_RESCOPES {
            push(Action::ModelRescope, 1);
        }
        // One seed in four, once, late: a model topic deleted and recreated under its name.
        let late = self.step > s.work_steps / 2 && self.seed_recreates_model;
        if work && s.scope_changes && rescopable && late {
            push(Action::RecreateModelTopic, 1);
        }
        out
    }

    /// Whether the task holds records and retention moved the log start of a channel it
    /// receives since the host last checked it (the check then visits every channel).
    fn log_start_check_due(&self, run: &Running) -> bool {
        run.engine().held_count() > 0
            && run
                .host
                .received()
                .iter()
                .any(|c| run.log_start_checked.get(c).is_none_or(|&seen| self.kafka.log_start(c) > seen))
    }

    /// How far retention may move each channel's log start: never past what its
    /// receivers have read (and, on a model channel, never past what its owner has
    /// delivered), never into an open transaction.
    fn retention_bound(&self, c: &ChannelId) -> Position {
        let part = self.kafka.partition(c);
        let mut bound = part.last_stable();
        if self.is_model_topic(c) {
            let rows = &self.db.tasks[c.partition as usize];
            // How far the owner's consumer had read at its last commit: past the markers
            // and aborted runs after its last record. What the host told its engine is not
            // consulted, so a host that keeps only the last record's position refuses
            // falsely once retention passes a trailing marker (`ReadPositionIgnored`).
            let committed_read = self.committed_read.get(c).copied().unwrap_or(0);
            let read = rows.fed_up_to.get(c).map_or(0, |f| f + 1).max(committed_read);
            let holding = rows.held.keys().any(|(h, _)| h == c);
            // Retention outruns a task only once it runs: records discarded before a model's
            // first start are outside its scope. A refused task's channels stay within what
            // it delivered: its restart must find the same refusal first, in channel order.
            let unread = self.scenario.retention_passes_unread;
            let refused = rows.refusal.is_some();
            let t = c.partition as usize;
            // Records a running task holds in a step not yet committed count too.
            let holding_now = match &self.tasks[t].state {
                TaskState::Up(run) => run.engine().held(c).next().map(|h| h.position),
                TaskState::Down => None,
            };
            let limit = if unread && !refused && self.tasks[t].started_once {
                if self.scenario.retention_passes_held {
                    bound
                } else if let Some(head) = holding_now {
                    head.min(self.db.undelivered_from(c.partition, c))
                } else if !holding {
                    bound
                } else {
                    self.db.undelivered_from(c.partition, c)
                }
            } else if unread && refused && holding {
                self.db.undelivered_from(c.partition, c)
            } else if self.scenario.retention_passes_held || !holding {
                read
            } else {
                self.db.undelivered_from(c.partition, c)
            };
            bound = bound.min(limit);
        }
        if !self.scenario.retention_passes_unread {
            for p in &self.processes {
                if p.received.contains(c) {
                    bound = bound.min(p.engine.fed_up_to(c).map_or(0, |f| f + 1));
                }
            }
        }
        bound
    }

    /// Where each receiver of `c` has read to (its next position to read): an upstream
    /// process's and a running task's engine, and the owner's committed rows (what a
    /// restart resumes from).
    fn read_positions(&self, c: &ChannelId) -> Vec<Position> {
        let mut positions: Vec<Position> = self
            .processes
            .iter()
            .filter(|p| p.received.contains(c))
            .map(|p| p.engine.fed_up_to(c).map_or(0, |f| f + 1))
            .collect();
        if self.is_model_topic(c) {
            let t = c.partition as usize;
            let rows = &self.db.tasks[t];
            positions.push(rows.fed_up_to.get(c).map_or(0, |f| f + 1));
            positions.push(self.committed_read.get(c).copied().unwrap_or(0));
            if let TaskState::Up(run) = &self.tasks[t].state {
                positions.push(run.engine().fed_up_to(c).map_or(0, |f| f + 1));
            }
        }
        positions
    }

    /// Cuts a retention target `to` on `c` so that wherever it passes a receiver's read
    /// position it discards at least one record there: the receiver cannot know what lay
    /// at positions it never read, so it refuses even when only markers and aborted records
    /// were lost, and the oracle, which owes a refusal only for a lost record, would call
    /// that refusal unexpected. Returns the new target and whether it passes a read position.
    fn cut_past_unread(&self, c: &ChannelId, mut to: Position) -> (Position, bool) {
        let mut positions = self.read_positions(c);
        positions.sort_unstable_by(|a, b| b.cmp(a));
        for r in positions {
            if r < to && (r.max(0)..to).all(|o| self.kafka.is_control_or_aborted(c, o)) {
                to = r;
            }
        }
        let passes = self.read_positions(c).iter().any(|&r| r < to);
        (to, passes)
    }

    /// Upstream channels a process lags on ([`Process::slow`]) where it holds nothing and has
    /// read everything else it receives, while another process (neither refused) has read
    /// further there; with how far the fastest one read. Retention up to there passes
    /// records the fastest reader delivered and the laggard never read, and the next thing
    /// the fastest one sends the laggard meets at the head of its channel: honestly stamped,
    /// it holds it and refuses at the passed channel; with the cause pruned from the stamp,
    /// it delivers it first (`PruneDropsLiveCause`).
    fn outrun_candidates(&self) -> Vec<(ChannelId, Position)> {
        let mut out = Vec::new();
        let mut channels: Vec<ChannelId> = self.processes.iter().flat_map(|p| p.received.iter().copied()).collect();
        channels.sort();
        channels.dedup();
        for c in channels {
            let running = || self.processes.iter().filter(|p| p.received.contains(&c) && p.engine.refusal().is_none());
            let read = |p: &Process| p.engine.fed_up_to(&c).map_or(0, |f| f + 1);
            let Some(fastest) = running().map(read).max() else { continue };
            // A lagging reader with nothing held or left to read elsewhere: whatever the fastest
            // reader's sends carry next reaches it at the head of its channel.
            let idle = |p: &Process| {
                p.engine.held_count() == 0
                    && (p.received.iter()).all(|d| *d == c || p.next_fetch[d] >= self.kafka.partition(d).last_stable())
            };
            let idle_behind = running().any(|p| p.slow.contains(&c) && idle(p) && read(p) < fastest);
            if idle_behind && fastest > self.kafka.log_start(&c) {
                out.push((c, fastest));
            }
        }
        out
    }

    /// Moves `c`'s log start to `to` (`passes_unread`: past a position a receiver had not
    /// read), told to the oracle and counted.
    fn retain(&mut self, c: ChannelId, to: Position, passes_unread: bool) {
        if passes_unread {
            self.trace.push(format!("{} retention outruns a reader of {}", self.step, self.name(&c)));
            self.stats.retention_passed_unread += 1;
            if self.processes.iter().any(|p| p.received.contains(&c)) {
                self.stats.retention_passed_unread_upstream += 1;
            }
        }
        self.kafka.advance_log_start(&c, to);
        self.oracle.log_start_advanced(c, to);
        self.stats.retention_advances += 1;
        if self.is_model_topic(&c) && self.db.undelivered_from(c.partition, &c) < to {
            self.stats.retention_passed_held += 1;
        }
        if self.is_model_topic(&c) && self.kafka.is_control_or_aborted(&c, to - 1) {
            self.stats.retention_past_control_records += 1;
        }
        self.trace.push(format!("{} retention {} log start {to}", self.step, self.name(&c)));
    }

    fn retention_candidates(&self) -> Vec<ChannelId> {
        let mut channels = Vec::new();
        let names = ["raw", "mid", "ext"].into_iter().chain(MODEL_TOPICS).chain(UPSTREAM_TOPICS);
        for name in names {
            let Some(id) = self.kafka.resolve(name) else { continue };
            let parts = self.kafka.topic(&id).map_or(0, |t| t.partitions.len() as u32);
            for p in 0..parts {
                let c = ChannelId::new(id, p);
                if self.retention_bound(&c) > self.kafka.log_start(&c) {
                    channels.push(c);
                }
            }
        }
        channels
    }

    fn perform(&mut self, action: Action) {
        match action {
            Action::EdgeWrite(e) => self.edge_write(e),
            Action::RogueWrite => self.rogue_write(),
            Action::ClientWrite(c) => self.client_write(c),
            Action::ClientRead(c, kind) => {
                let kind = match kind {
                    ReadKind::Key(_) => ReadKind::Key(self.rng.below(u64::from(self.scenario.keys)) as u16),
                    k => k,
                };
                if self.scenario.kept {
                    return self.gateway_read(c, kind);
                }
                let from_replica = self.replica.is_some() && self.rng.chance(1, 2);
                self.client_read(c, kind, false, from_replica);
            }
            Action::ClientRetry(c) => {
                let kind = self.clients[c].pending_read.expect("a pending read");
                if self.scenario.kept {
                    return self.gateway_read(c, kind);
                }
                let from_replica = self.replica.is_some() && self.rng.chance(1, 2);
                self.client_read(c, kind, false, from_replica);
            }
            Action::ClientFinish(c) => self.gateway_read_finish(c),
            Action::VisitorRead(v, kind) => {
                let kind = match kind {
                    ReadKind::Key(_) => ReadKind::Key(self.rng.below(u64::from(self.scenario.keys)) as u16),
                    k => k,
                };
                self.gateway_read(self.clients.len() + v, kind);
            }
            Action::GatewayHear(g) => self.gateway_hear_one(g),
            Action::GatewayDrop(g) => self.gateway_drop(g),
            Action::GatewayConnect(g) => self.gateway_connect(g),
            Action::ReplicaSync => {
                self.replica = Some(self.db.clone());
                self.replica_version = self.db_version;
                self.changes += 1;
                self.trace.push(format!("{} replica sync to version {}", self.step, self.db_version));
            }
            Action::ProcFetch(p, c) => self.proc_fetch(p, c),
            Action::ProcSend(p) => self.proc_send(p),
            Action::ProcBegin(p) => {
                let txn = self.kafka.begin_txn();
                self.processes[p].txn = Some((txn, Vec::new()));
                self.trace.push(format!("{} P{p} begin txn{txn}", self.step));
            }
            Action::ProcEnd(p, commit) => self.proc_end(p, commit),
            Action::ProcPrune(p) => self.proc_prune(p),
            Action::ProcCrash(p) => self.proc_crash(p),
            Action::TaskStart(t) => self.task_start(t),
            Action::TaskFeed(t, c) => self.task_feed(t, c),
            Action::TaskPrune(t) => self.task_prune(t),
            Action::TaskCommit(t) => {
                self.task_end_step(t);
                // The projector checks before it feeds its next step, once the interval has
                // passed; here, whenever a log start moved under held records since the last
                // check. A record released within the step that retention passed it in is
                // not caught: that window is real (`deliveries_below_log_start`).
                let due = !self.tasks[t].refused
                    && matches!(&self.tasks[t].state, TaskState::Up(run) if self.log_start_check_due(run));
                if due {
                    self.task_check_log_start(t);
                }
            }
            Action::TaskCheckLogStart(t) => self.task_check_log_start(t),
            Action::TaskAbort(t) => {
                self.stats.step_aborts += 1;
                self.trace.push(format!("{} task{t} abort step", self.step));
                self.task_down(t);
                self.task_start(t);
            }
            Action::TaskCrash(t) => self.task_crash(t),
            Action::TaskFreeze(t) => self.task_freeze(t, None),
            Action::TaskThaw(z) => self.task_thaw(z),
            Action::Retention => {
                let candidates = self.retention_candidates();
                if candidates.is_empty() {
                    return;
                }
                let c = *self.rng.pick(&candidates);
                let from = self.kafka.log_start(&c) + 1;
                let mut to = self.rng.range(from, self.retention_bound(&c));
                if self.scenario.retention_passes_unread {
                    // Outrunning a reader ends it (a refusal), so it is the rare case: most
                    // retention stays within what every receiver has read.
                    let reads = self.read_positions(&c);
                    let upstream = self.processes.iter().filter(|p| p.received.contains(&c)).count();
                    let odds = if upstream > 1 { UNREAD_RETENTION_ODDS / 4 } else { UNREAD_RETENTION_ODDS };
                    if !self.rng.chance(1, odds) {
                        to = to.min(reads.iter().copied().min().unwrap_or(to));
                    } else if upstream > 1 || self.rng.chance(1, 2) {
                        // Up to what the fastest reader read: a slower one loses positions.
                        to = to.min(reads.iter().copied().max().unwrap_or(to));
                    }
                    let (cut, passes_unread) = self.cut_past_unread(&c, to);
                    if cut < from {
                        return;
                    }
                    self.retain(c, cut, passes_unread);
                } else {
                    self.retain(c, to, false);
                }
            }
            // Where the scenario has it: retention right up to what the fastest reader of an
            // upstream channel read, while a lagging reader holds nothing.
            Action::RetentionOutrun => {
                let candidates = self.outrun_candidates();
                if candidates.is_empty() {
                    return;
                }
                let (c, fastest) = *self.rng.pick(&candidates);
                let to = fastest.min(self.retention_bound(&c));
                let (cut, passes_unread) = self.cut_past_unread(&c, to);
                if cut <= self.kafka.log_start(&c) || !passes_unread {
                    return;
                }
                self.retain(c, cut, true);
            }
            Action::ModelRescope => self.model_rescope(),
            Action::RecreateModelTopic => self.recreate_model_topic(),
            Action::RecreateExt => {
                let old = self.kafka.delete_topic("ext").expect("ext exists");
                self.oracle.topic_deleted(old);
                let id = self.new_topic_id();
                self.recreations += 1;
                self.kafka.create_topic("ext", id, 1);
                self.names.insert(id, format!("ext#{}", self.recreations));
                self.oracle.name_topic(id, &format!("ext#{}", self.recreations));
                self.stats.topic_recreations += 1;
                self.trace.push(format!("{} ext deleted and recreated as {id}", self.step));
            }
        }
    }

    // ---- quiescence ----------------------------------------------------------------------

    fn describe_stuck(&self) -> String {
        let mut parts = Vec::new();
        for (i, t) in self.tasks.iter().enumerate() {
            if let TaskState::Up(run) = &t.state {
                if run.engine().held_count() > 0 {
                    parts.push(format!("task{i} holds {}", run.engine().held_count()));
                }
            }
        }
        for (i, c) in self.clients.iter().enumerate() {
            if let Some(kind) = c.pending_read {
                parts.push(format!("C{i} waits on {kind:?}"));
            }
        }
        parts.join(", ")
    }

    /// Channels a refused task owns: a gap on one of them is the refusal speaking. And the
    /// channels of a topic the model no longer declares: the gateway demands such a pair of
    /// every served task, which fails closed (a session that wrote there waits until
    /// retention passes its pair), and the model owes nothing there.
    fn refused_channels(&self) -> BTreeSet<ChannelId> {
        let refused = self.tasks.iter().filter(|t| t.refused).flat_map(|t| t.received.iter().copied());
        let undeclared = self.model_topics.iter().filter(|t| !self.declared.contains(t));
        let undeclared = undeclared.flat_map(|&t| (0..self.tasks.len() as u32).map(move |p| ChannelId::new(t, p)));
        refused.chain(undeclared).collect()
    }

    fn final_checks(&mut self) {
        for t in 0..self.tasks.len() {
            let stored = self.db.tasks[t].refusal.as_ref();
            if stored.is_some_and(|r| r.reason == RefusalReason::ChannelRemovedWithHeldMessages) {
                let detail = format!("task{t} still records a refusal of a declaration the operator withdrew");
                self.oracle.report(ViolationKind::RefusalNotRecurring, detail);
            }
        }
        let refused = self.refused_channels();
        for t in 0..self.tasks.len() {
            if self.tasks[t].refused {
                continue;
            }
            if let Some(before) = &self.tasks[t].expect_refusal {
                let detail = format!("task{t} refused {before} before its restart and not after");
                self.oracle.report(ViolationKind::RefusalNotRecurring, detail);
            }
            self.oracle.check_complete(self.tasks[t].receiver);
        }
        for p in 0..self.processes.len() {
            if self.processes[p].engine.refusal().is_none() {
                self.oracle.check_complete(self.processes[p].receiver);
            }
        }
        // Every read still waiting, and one last collection read per client, must be
        // covered now that everything is delivered — unless a refusal is in the way. A model
        // refused as a whole owes readers nothing more (its served reads were judged).
        let clients = if self.model_refusal.is_some() { 0 } else { self.clients.len() };
        for c in 0..clients {
            let kinds: Vec<ReadKind> =
                self.clients[c].pending_read.into_iter().chain(std::iter::once(ReadKind::Collection)).collect();
            for kind in kinds {
                if let Verdict::NotCovered { gaps } = self.client_read(c, kind, true, false) {
                    let blocking: Vec<String> = gaps
                        .iter()
                        .filter(|g| !refused.contains(&g.channel))
                        .map(|g| format!("{} needs {} has {:?}", self.name(&g.channel), g.required, g.recorded))
                        .collect();
                    if !blocking.is_empty() {
                        let detail = format!("client {c}'s {kind:?} read is never covered: {}", blocking.join("; "));
                        self.oracle.report(ViolationKind::ReadNeverCovered, detail);
                    }
                }
            }
        }
    }
}
