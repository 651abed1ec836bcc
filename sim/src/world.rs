//! The simulated world and its scheduler: upstream processes, edge producers, session
//! clients and database-hosted projector tasks, each a set of enabled actions the seeded
//! scheduler draws from, one per step. Every host here drives the real core — `Engine`,
//! `CausalPast`, `gate`, `refresh`, `partition_for_key` — exactly as a production host
//! would; the oracle watches from outside.

use std::collections::{BTreeMap, BTreeSet};

use crate::kafka::{FetchError, SimKafka, TxnId};
use crate::oracle::{Actor, Oracle, RecordId, ViolationKind};
use crate::rng::SimRng;
use crate::store::{Payload, SimDb};
use crate::{RunReport, Sabotage, Scenario, Stats};
use parsley::channel::{ChannelId, Position, TopicId};
use parsley::engine::{ChannelFact, Engine, EngineConfig, Receipt};
use parsley::gate::{self, ModelShape, Verdict};
use parsley::host::{ChannelStart, LogStartCheck, Next, Observed, Recorded, TaskHost};
use parsley::murmur2::partition_for_key;
use parsley::past::CausalPast;
use parsley::refusal::{Refusal, RefusalReason};

const MODEL_TOPICS: [&str; 2] = ["orders", "payments"];

/// The weight of an idle task's periodic log-start check once it is due (a task that
/// commits checks right after, before its next step).
const LOG_START_CHECK_WEIGHT: u32 = 2;

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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReadKind {
    Key(u16),
    Collection,
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
    /// Per channel, the log start read at this start (what `StaleLogStart` keeps telling
    /// the engine).
    log_start_at_start: BTreeMap<ChannelId, Position>,
    /// Per channel, the consumer's position: past the last record fed and past the
    /// markers and aborted runs after it.
    read_to: BTreeMap<ChannelId, Position>,
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
    state: TaskState,
    started_once: bool,
    refused: bool,
    /// A refusal the stored status says this task hit: a restart must hit it again.
    expect_refusal: Option<Refusal>,
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
    Retention,
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
    model_topics: Vec<TopicId>,
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
        let model_topics: Vec<TopicId> = MODEL_TOPICS.iter().map(|t| create(&mut kafka, &mut rng, t, n)).collect();
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
                Task {
                    receiver,
                    received,
                    state: TaskState::Down,
                    started_once: false,
                    refused: false,
                    expect_refusal: None,
                }
            })
            .collect();

        // P0 receives both raw partitions and feeds mid and the model; P1 receives mid and
        // one raw partition, so some causes reach it only through P0's stamps.
        let raw0 = ChannelId::new(raw, 0);
        let raw1 = ChannelId::new(raw, 1);
        let mid0 = ChannelId::new(mid, 0);
        let mut shapes: Vec<(Vec<ChannelId>, Vec<Dest>)> = vec![
            (vec![raw0, raw1], vec![Dest::Channel(mid0), Dest::Model(0), Dest::Model(1)]),
            (vec![mid0, raw1], vec![Dest::Model(0), Dest::Model(1)]),
        ];
        if scenario.audit {
            // An auditor downstream of the gateway: it receives an upstream channel and
            // every partition of a topic session clients write to, and sends nothing.
            let mut received = vec![raw0];
            received.extend((0..n).map(|p| ChannelId::new(model_topics[1], p)));
            shapes.push((received, Vec::new()));
        }
        let processes = shapes
            .into_iter()
            .enumerate()
            .map(|(i, (received, outputs))| {
                let actor = Actor::Process(i as u32);
                let receiver = oracle.add_receiver(&format!("P{i}"), Some(actor), &received);
                let mut engine = Engine::new(EngineConfig::default(), received.iter().copied());
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
                Process { receiver, received, outputs, engine, next_fetch, txn: None, pending_sends: 0 }
            })
            .collect();

        let producer = |actor| Producer { actor, token: CausalPast::new(), pending_read: None, last_attempt: 0 };
        let edges = (0..scenario.edges).map(|i| producer(Actor::Edge(i))).collect();
        let clients = (0..scenario.clients).map(|i| producer(Actor::Client(i))).collect();
        let rogue = scenario.corrupt.then(|| producer(Actor::Edge(scenario.edges)));

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
            stats: Stats { tasks: n, ..Stats::default() },
            trace: Vec::new(),
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
                if self.phase == Phase::Drain {
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

    fn is_model(&self, c: &ChannelId) -> bool {
        self.model.received_topics.contains(&c.topic)
    }

    /// What a host learns of a channel to prune by; `PruneDropsLiveCause` makes the host
    /// report the log end as the log start.
    fn fact(&self, c: &ChannelId) -> ChannelFact {
        let fact = self.kafka.fact(c);
        match fact {
            ChannelFact::Live { .. } if self.sabotage == Sabotage::PruneDropsLiveCause => {
                ChannelFact::Live { log_start: self.kafka.partition(c).log_end() }
            }
            other => other,
        }
    }

    /// The gateway's token pruning: pairs on topics that are gone, and pairs on upstream
    /// channels below the log start. Pairs on the model's own channels are kept, as the
    /// clock rows that would cover them are: retention may pass a record its owner still
    /// holds, and dropping the pair would let a read skip it.
    fn prune_token(&self, token: CausalPast) -> CausalPast {
        let keep_received = self.sabotage != Sabotage::TokenPrunesReceivedChannels;
        token.retain(|c, p| match self.fact(&c) {
            ChannelFact::TopicGone => false,
            ChannelFact::Live { log_start } => keep_received && self.is_model(&c) || p >= log_start,
            ChannelFact::Unknown => true,
        })
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
            match c.pending_read {
                Some(_) if self.changes > c.last_attempt => push(Action::ClientRetry(i), 4),
                Some(_) => {}
                None if work => {
                    push(Action::ClientWrite(i), 3);
                    // The key is drawn when the read is performed.
                    push(Action::ClientRead(i, ReadKind::Key(0)), 3);
                    push(Action::ClientRead(i, ReadKind::Collection), 1);
                }
                None => {}
            }
        }
        for (i, p) in self.processes.iter().enumerate() {
            for &c in &p.received {
                if self.kafka.fetchable(&c, p.next_fetch[&c]) && p.engine.refusal().is_none() {
                    // The auditor lags: a backlog is what lets a later write overtake.
                    push(Action::ProcFetch(i, c), if p.outputs.is_empty() { 1 } else { 4 });
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
            if work && !p.outputs.is_empty() {
                push(Action::ProcSend(i), if p.pending_sends > 0 { 4 } else { 1 });
                push(Action::ProcPrune(i), 1);
            }
        }
        for (i, t) in self.tasks.iter().enumerate() {
            match &t.state {
                TaskState::Down => push(Action::TaskStart(i), 3),
                TaskState::Up(run) => {
                    if !t.refused {
                        for &c in &t.received {
                            // Out of range counts: the host must learn of it and act.
                            let from = run.next_fetch[&c];
                            // Markers and aborted runs alone are worth a fetch too: the
                            // consumer's position moves past them.
                            let unread = from < self.kafka.partition(&c).last_stable();
                            if unread || from < self.kafka.log_start(&c) {
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
                        // The projector's periodic check runs between steps, on the channels
                        // holding records; it is worth drawing once a log start moved.
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
                    }
                }
            }
        }
        if self.replica.is_some() && self.replica_version < self.db_version {
            push(Action::ReplicaSync, if work { 2 } else { 3 });
        }
        if work && s.retention_weight > 0 {
            // Which channels can move is worked out when it is drawn (it may be none).
            push(Action::Retention, s.retention_weight);
        }
        if work && s.recreate_weight > 0 && self.recreations < 2 && self.step > s.work_steps / 3 {
            push(Action::RecreateExt, s.recreate_weight);
        }
        out
    }

    /// Whether retention moved the log start of a channel the task holds records on since
    /// the host last checked it.
    fn log_start_check_due(&self, run: &Running) -> bool {
        run.engine()
            .channels_holding()
            .any(|c| run.log_start_checked.get(&c).is_none_or(|&seen| self.kafka.log_start(&c) > seen))
    }

    /// How far retention may move each channel's log start: never past what its
    /// receivers have read (and, on a model channel, never past what its owner has
    /// delivered), never into an open transaction.
    fn retention_bound(&self, c: &ChannelId) -> Position {
        let part = self.kafka.partition(c);
        let mut bound = part.last_stable();
        if self.is_model(c) {
            let rows = &self.db.tasks[c.partition as usize];
            // How far the owner's consumer had read at its last commit: past the markers
            // and aborted runs after its last record. What the host told its engine is not
            // consulted, so a host that keeps only the last record's position refuses
            // falsely once retention passes a trailing marker (`ReadPositionIgnored`).
            let committed_read = self.committed_read.get(c).copied().unwrap_or(0);
            let read = rows.fed_up_to.get(c).map_or(0, |f| f + 1).max(committed_read);
            let holding = rows.held.keys().any(|(h, _)| h == c);
            let limit = if self.scenario.retention_passes_held || !holding {
                read
            } else {
                self.db.undelivered_from(c.partition, c)
            };
            bound = bound.min(limit);
        }
        for p in &self.processes {
            if p.received.contains(c) {
                bound = bound.min(p.engine.fed_up_to(c).map_or(0, |f| f + 1));
            }
        }
        bound
    }

    fn retention_candidates(&self) -> Vec<ChannelId> {
        let mut channels = Vec::new();
        for name in ["raw", "mid", "ext", MODEL_TOPICS[0], MODEL_TOPICS[1]] {
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
                let from_replica = self.replica.is_some() && self.rng.chance(1, 2);
                self.client_read(c, kind, false, from_replica);
            }
            Action::ClientRetry(c) => {
                let kind = self.clients[c].pending_read.expect("a pending read");
                let from_replica = self.replica.is_some() && self.rng.chance(1, 2);
                self.client_read(c, kind, false, from_replica);
            }
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
            Action::ProcPrune(p) => {
                let facts: BTreeMap<ChannelId, ChannelFact> =
                    self.processes[p].engine.frontier().iter().map(|(c, _)| (c, self.fact(&c))).collect();
                let before = self.processes[p].engine.frontier().len();
                self.processes[p].engine.prune(|c| facts.get(c).copied().unwrap_or(ChannelFact::Unknown));
                let after = self.processes[p].engine.frontier().len();
                if after < before {
                    self.stats.prunes += 1;
                }
                self.trace.push(format!("{} P{p} prune frontier {before}->{after}", self.step));
            }
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
            Action::Retention => {
                let candidates = self.retention_candidates();
                if candidates.is_empty() {
                    return;
                }
                let c = *self.rng.pick(&candidates);
                let from = self.kafka.log_start(&c) + 1;
                let to = self.rng.range(from, self.retention_bound(&c));
                self.kafka.advance_log_start(&c, to);
                self.oracle.log_start_advanced(c, to);
                self.stats.retention_advances += 1;
                if self.is_model(&c) && self.db.undelivered_from(c.partition, &c) < to {
                    self.stats.retention_passed_held += 1;
                }
                if self.is_model(&c) && self.kafka.is_control_or_aborted(&c, to - 1) {
                    self.stats.retention_past_control_records += 1;
                }
                self.trace.push(format!("{} retention {} log start {to}", self.step, self.name(&c)));
            }
            Action::RecreateExt => {
                let old = self.kafka.delete_topic("ext").expect("ext exists");
                self.oracle.topic_deleted(old);
                let id = loop {
                    let id = TopicId::from_halves(self.rng.next_u64(), self.rng.next_u64());
                    if !id.is_zero() && self.kafka.topic(&id).is_none() {
                        break id;
                    }
                };
                self.recreations += 1;
                self.kafka.create_topic("ext", id, 1);
                self.names.insert(id, format!("ext#{}", self.recreations));
                self.oracle.name_topic(id, &format!("ext#{}", self.recreations));
                self.stats.topic_recreations += 1;
                self.trace.push(format!("{} ext deleted and recreated as {id}", self.step));
            }
        }
    }

    // ---- producers -------------------------------------------------------------------

    /// Produces one record stamped with `token` (the gateway's write path) and returns
    /// its coordinate and id.
    fn produce_stamped(
        &mut self,
        author: Actor,
        token: &CausalPast,
        channel: ChannelId,
        key: u16,
        corrupt: bool,
    ) -> (Position, RecordId) {
        let mut headers = if token.is_empty() { Vec::new() } else { vec![Some(token.encode())] };
        if corrupt {
            headers = self.damage(token);
        }
        let id = self.oracle.record_count() as RecordId;
        let position = self.kafka.produce(channel, id, key, headers);
        let got = self.oracle.sent(channel, position, key, author, false, corrupt);
        assert_eq!(got, id);
        (position, id)
    }

    /// A damaged `parsley.causes` value: every form here is undecodable.
    fn damage(&mut self, token: &CausalPast) -> Vec<Option<Vec<u8>>> {
        let good = token.encode();
        match self.rng.below(4) {
            0 => {
                let mut v = good;
                v.push(0);
                vec![Some(v)]
            }
            1 => {
                let mut v = good;
                v[0] = 0x02;
                vec![Some(v)]
            }
            2 => vec![Some(Vec::new())],
            _ => vec![Some(good.clone()), Some(good)],
        }
    }

    fn edge_write(&mut self, e: usize) {
        let taken = std::mem::take(&mut self.edges[e].token);
        let token = self.prune_token(taken);
        let key = self.rng.below(u64::from(self.scenario.keys)) as u16;
        let channel = match self.rng.below(5) {
            0 => ChannelId::new(self.raw, 0),
            1 => ChannelId::new(self.raw, 1),
            2 => ChannelId::new(self.kafka.resolve("ext").expect("ext exists"), 0),
            n => self.model_channel(n as usize - 3, key),
        };
        let author = self.edges[e].actor;
        let (position, id) = self.produce_stamped(author, &token, channel, key, false);
        self.edges[e].token = token.merge(channel, position);
        self.trace.push(format!("{} E{e} write #{id} {}@{position} k{key}", self.step, self.name(&channel)));
    }

    /// A producer that writes one record with a damaged causes header, after a good one
    /// its damaged record depends on. It writes nothing after.
    fn rogue_write(&mut self) {
        let mut rogue = self.rogue.take().expect("rogue present");
        let k1 = self.rng.below(u64::from(self.scenario.keys)) as u16;
        let first = {
            let topic = self.rng.below(2) as usize;
            self.model_channel(topic, k1)
        };
        let (p1, _) = self.produce_stamped(rogue.actor, &rogue.token, first, k1, false);
        rogue.token = rogue.token.merge(first, p1);
        let k2 = self.rng.below(u64::from(self.scenario.keys)) as u16;
        let channel = {
            let topic = self.rng.below(2) as usize;
            self.model_channel(topic, k2)
        };
        let (position, id) = self.produce_stamped(rogue.actor, &rogue.token, channel, k2, true);
        self.stats.corrupt_records += 1;
        self.trace.push(format!("{} rogue write damaged #{id} {}@{position}", self.step, self.name(&channel)));
    }

    fn client_write(&mut self, c: usize) {
        let taken = std::mem::take(&mut self.clients[c].token);
        let token = self.prune_token(taken);
        let key = self.rng.below(u64::from(self.scenario.keys)) as u16;
        let channel = {
            let topic = self.rng.below(2) as usize;
            self.model_channel(topic, key)
        };
        let author = self.clients[c].actor;
        let (position, id) = self.produce_stamped(author, &token, channel, key, false);
        self.clients[c].token = token.merge(channel, position);
        self.trace.push(format!("{} C{c} write #{id} {}@{position} k{key}", self.step, self.name(&channel)));
    }

    /// A gated read: fetch every clock row in one snapshot (of the primary or of the
    /// lagging replica), gate, and serve from the same snapshot only if covered. Returns
    /// the verdict. `SplitSnapshot` gates on the primary's rows but serves the replica's.
    fn client_read(&mut self, c: usize, kind: ReadKind, last: bool, from_replica: bool) -> Verdict {
        let taken = std::mem::take(&mut self.clients[c].token);
        let token = self.prune_token(taken);
        let data = match &self.replica {
            Some(replica) if from_replica => replica,
            _ => &self.db,
        };
        let rows = if self.sabotage == Sabotage::SplitSnapshot { self.db.clock_rows() } else { data.clock_rows() };
        // The state `TokenPrunesReceivedChannels` needs: a kept pair below the log start
        // that the owner's clock row does not cover yet.
        let waits_on_passed = token.iter().any(|(ch, p)| {
            self.is_model(&ch)
                && p < self.kafka.log_start(&ch)
                && !rows.iter().any(|r| r.task == ch.partition && r.channel == ch && r.position >= p)
        });
        if waits_on_passed && !last {
            self.stats.reads_on_passed_pairs += 1;
        }
        let served: BTreeSet<u32> = match kind {
            ReadKind::Key(k) => [self.owner_of_key[k as usize]].into_iter().collect(),
            ReadKind::Collection => (0..self.model.task_count).collect(),
        };
        let verdict = match self.sabotage.gate() {
            gate::GateSabotage::None => gate::gate(&token, &self.model, &rows, &served),
            g => gate::gate_sabotaged(&token, &self.model, &rows, &served, g),
        };
        let mut what = match kind {
            ReadKind::Key(k) => format!("read of k{k}"),
            ReadKind::Collection => "collection read".to_string(),
        };
        if from_replica && self.replica.is_some() {
            what.push_str(" (replica)");
        }
        if verdict.is_covered() {
            let observed: Vec<RecordId> = match kind {
                ReadKind::Key(k) => data.doc(self.owner_of_key[k as usize], k).to_vec(),
                ReadKind::Collection => data.tasks.iter().flat_map(|t| t.docs.values().flatten().copied()).collect(),
            };
            if from_replica && self.replica_version < self.db_version {
                self.stats.lagging_replica_reads += 1;
            }
            let key = match kind {
                ReadKind::Key(k) => Some(k),
                ReadKind::Collection => None,
            };
            self.oracle.read(c as u32, key, &observed, &what);
            let refreshed = match self.sabotage.gate() {
                gate::GateSabotage::None => gate::refresh(&token, &self.model, &rows, &served),
                g => gate::refresh_sabotaged(&token, &self.model, &rows, &served, g),
            };
            let client = &mut self.clients[c];
            client.token = refreshed;
            if client.pending_read.take().is_some() {
                self.stats.waited_reads_served += 1;
            }
            self.stats.reads_served += 1;
            self.trace.push(format!("{} C{c} {what} served {} rows", self.step, observed.len()));
        } else {
            let client = &mut self.clients[c];
            client.token = token;
            client.last_attempt = self.changes;
            if client.pending_read.is_none() && !last {
                client.pending_read = Some(kind);
                self.stats.gated_waits += 1;
            }
            self.trace.push(format!("{} C{c} {what} waits", self.step));
        }
        verdict
    }

    // ---- upstream processes ------------------------------------------------------------

    fn proc_fetch(&mut self, p: usize, c: ChannelId) {
        let from = self.processes[p].next_fetch[&c];
        let batch = self.rng.range(1, 2) as usize;
        let records = match self.kafka.fetch(&c, from, batch) {
            Ok(r) => r,
            Err(e) => {
                let detail = format!("P{p} could not fetch {} from {from}: {e:?}", self.name(&c));
                self.oracle.report(ViolationKind::UnexpectedRefusal, detail);
                return;
            }
        };
        for f in records {
            let proc = &mut self.processes[p];
            proc.next_fetch.insert(c, f.position + 1);
            let receipt =
                proc.engine.receive(c, f.position, &header_values(&f.headers), Payload { id: f.id, key: f.key });
            match receipt {
                Ok(Receipt::Duplicate) => self.stats.replays_dropped += 1,
                Ok(Receipt::Accepted { deliveries }) => {
                    if !deliveries.iter().any(|d| d.channel == c && d.position == f.position) {
                        self.stats.upstream_held += 1;
                    }
                    let receiver = proc.receiver;
                    proc.pending_sends += deliveries.len() as u32;
                    let mut names = Vec::new();
                    for d in &deliveries {
                        self.oracle.delivered(receiver, d.channel, d.position, d.payload.id);
                        names.push(format!("#{}", d.payload.id));
                    }
                    self.oracle.commit(receiver);
                    self.stats.upstream_deliveries += deliveries.len() as u64;
                    self.trace.push(format!(
                        "{} P{p} fetch {}@{} -> delivered [{}]",
                        self.step,
                        self.name(&c),
                        f.position,
                        names.join(" ")
                    ));
                }
                Err(refusal) => {
                    self.oracle.report(ViolationKind::UnexpectedRefusal, format!("P{p} refused: {refusal}"));
                    self.trace.push(format!("{} P{p} refused {}", self.step, refusal.reason));
                    return;
                }
            }
        }
    }

    fn proc_send(&mut self, p: usize) {
        let outputs = self.processes[p].outputs.clone();
        let dest = *self.rng.pick(&outputs);
        let key = self.rng.below(u64::from(self.scenario.keys)) as u16;
        let channel = match dest {
            Dest::Channel(c) => c,
            Dest::Model(t) => self.model_channel(t, key),
        };
        let proc = &mut self.processes[p];
        proc.pending_sends = proc.pending_sends.saturating_sub(1);
        let headers = match proc.engine.stamp() {
            Ok(Some(bytes)) => vec![Some(bytes)],
            Ok(None) => Vec::new(),
            Err(refusal) => {
                self.oracle.report(ViolationKind::UnexpectedRefusal, format!("P{p} cannot stamp: {refusal}"));
                return;
            }
        };
        let id = self.oracle.record_count() as RecordId;
        let actor = Actor::Process(p as u32);
        let (position, in_txn) = match &mut proc.txn {
            Some((txn, ids)) => {
                ids.push(id);
                (self.kafka.produce_in(*txn, channel, id, key, headers), true)
            }
            None => (self.kafka.produce(channel, id, key, headers), false),
        };
        let got = self.oracle.sent(channel, position, key, actor, in_txn, false);
        assert_eq!(got, id);
        let txn = if in_txn { " (txn)" } else { "" };
        self.trace.push(format!("{} P{p} send #{id} {}@{position}{txn}", self.step, self.name(&channel)));
    }

    fn proc_end(&mut self, p: usize, commit: bool) {
        let (txn, ids) = self.processes[p].txn.take().expect("an open transaction");
        self.kafka.end_txn(txn, commit);
        self.oracle.txn_ended(&ids, commit);
        if !ids.is_empty() {
            if commit {
                self.stats.txn_commits += 1;
            } else {
                self.stats.txn_aborts += 1;
            }
        }
        let verb = if commit { "commit" } else { "abort" };
        self.trace.push(format!("{} P{p} {verb} txn{txn} ({} records)", self.step, ids.len()));
    }

    // ---- projector tasks -----------------------------------------------------------------
    //
    // A task is the host state machine (`parsley::host::TaskHost`) the projector's task runner
    // drives: it says what to do next, and the functions below answer from the simulated
    // Kafka and database, as the runner answers from the real ones. The scheduler decides
    // only what the machine leaves to a host: which channel to fetch, when a step ends,
    // when an interval passed, and crashes. Host sabotage is injected in the answers.

    fn running(&mut self, t: usize) -> &mut Running {
        match &mut self.tasks[t].state {
            TaskState::Up(run) => run,
            TaskState::Down => panic!("task{t} is down"),
        }
    }

    /// Takes the task: a new machine, which restores from the stored rows (and seeds,
    /// checks log starts, commits the start, resumes each channel's fetch).
    fn task_start(&mut self, t: usize) {
        let recorded = if self.db.tasks[t].refusal.is_some() { Recorded::Refused } else { Recorded::Running };
        let received = self.tasks[t].received.clone();
        let host = TaskHost::new(EngineConfig::default(), received, recorded).with_sabotage(self.sabotage.engine());
        self.tasks[t].expect_refusal = self.db.tasks[t].refusal.clone();
        self.tasks[t].refused = false;
        let run = Running {
            host,
            next_fetch: BTreeMap::new(),
            applied: Vec::new(),
            log_start_checked: BTreeMap::new(),
            log_start_at_start: BTreeMap::new(),
            read_to: BTreeMap::new(),
        };
        self.tasks[t].state = TaskState::Up(Box::new(run));
        self.task_drive(t);
    }

    /// Answers task `t`'s machine until it wants a poll or a feed (the caller's to do), or
    /// stops: the restore path, due checks, the drain, read positions, and a commit the
    /// machine calls for (a refusal, the end of an out-of-range step). Returns where it
    /// stopped.
    fn task_drive(&mut self, t: usize) -> Next {
        loop {
            let next = self.running(t).host.next_action();
            match next {
                Next::Restore => self.task_restore(t),
                Next::ReadStarts(channels) => self.task_read_starts(t, &channels),
                Next::CommitStart => {
                    let start = self.running(t).host.take_start();
                    if start.write_running {
                        self.db.tasks[t].refusal = None;
                    }
                    // Seeds and a refusal: nothing a read sees, so no read retries on it.
                    self.db.commit(t as u32, start.changes, &[], self.sabotage != Sabotage::HeldNotPersisted);
                    self.oracle.commit(self.tasks[t].receiver);
                    self.trace.push(format!("{} task{t} commit start", self.step));
                    self.running(t).host.committed();
                }
                Next::Assign(positions) => self.task_assign(t, positions),
                Next::ObserveLogStarts { channels, check } => {
                    let names: Vec<String> = channels.iter().map(|c| self.name(c)).collect();
                    self.trace.push(format!("{} task{t} checks log start of {}", self.step, names.join(" ")));
                    let refused = self.task_observe_log_starts(t, &channels);
                    if check == LogStartCheck::Periodic {
                        self.stats.log_start_checks += 1;
                        if refused {
                            self.stats.discard_refusals_by_check += 1;
                        }
                    }
                }
                // The simulated topics never change their partition counts.
                Next::CheckWidths => self.running(t).host.skip_check(),
                Next::LearnUpstream(channels) => self.task_prune_upstream(t, &channels),
                Next::Drain => {
                    let receiver = self.tasks[t].receiver;
                    let run = self.running(t);
                    let deliveries = run.host.drain();
                    run.applied.extend(deliveries.iter().map(|d| d.payload));
                    for d in &deliveries {
                        self.oracle.delivered(receiver, d.channel, d.position, d.payload.id);
                    }
                    self.trace.push(format!("{} task{t} drained {}", self.step, deliveries.len()));
                }
                Next::ReadPositions => {
                    // The consumer's position on every channel: past the last record fed
                    // and past the markers and aborted runs after it.
                    let ignore = self.sabotage == Sabotage::ReadPositionIgnored;
                    let run = self.running(t);
                    let positions: Vec<(ChannelId, Position)> =
                        if ignore { Vec::new() } else { run.next_fetch.iter().map(|(&c, &p)| (c, p)).collect() };
                    run.host.read_positions(&positions);
                }
                Next::Commit => self.task_commit(t),
                Next::PersistRefusal(refusal) => {
                    self.oracle.report(ViolationKind::UnexpectedRefusal, format!("task{t} cannot restore: {refusal}"));
                    self.tasks[t].refused = true;
                    return Next::PersistRefusal(refusal);
                }
                Next::Refused(refusal) => {
                    self.tasks[t].refused = true;
                    return Next::Refused(refusal);
                }
                Next::Poll { .. } | Next::Feed | Next::AwaitCommit | Next::Fenced => return next,
            }
        }
    }

    /// The stored rows, as the projector loads them.
    fn task_restore(&mut self, t: usize) {
        let persisted = self.db.persisted(t as u32);
        let held = persisted.held.len();
        self.stats.starts += 1;
        if held > 0 {
            self.stats.restores_with_held += 1;
        }
        self.trace.push(format!("{} task{t} restore ({held} held)", self.step));
        self.running(t).host.restored(persisted, BTreeSet::new());
    }

    /// Each channel's log start (what seeds a channel with no baseline, from its earliest
    /// position) and the log start the host tells the engine, for the start's check.
    fn task_read_starts(&mut self, t: usize, channels: &[ChannelId]) {
        let mut starts = Vec::new();
        let mut baselines = Vec::new();
        for &channel in channels {
            let log_start = self.kafka.log_start(&channel);
            let told = self.told_log_start(t, channel, log_start);
            starts.push(ChannelStart { channel, log_start: told, initial_fed_up_to: log_start - 1 });
            baselines.push((channel, log_start));
        }
        let receiver = self.tasks[t].receiver;
        if !self.tasks[t].started_once {
            self.oracle.start(receiver, &baselines);
            self.tasks[t].started_once = true;
        }
        let observed = self.running(t).host.started(&starts);
        self.judge_log_starts(t, observed);
    }

    /// Resumes each channel's fetch where the machine says (`fed_up_to + 1`); sometimes
    /// from a coarser, older checkpoint (as a host trusting a lagging consumer offset
    /// would), which the engine must drop.
    fn task_assign(&mut self, t: usize, positions: Vec<(ChannelId, Position)>) {
        let mut next_fetch = BTreeMap::new();
        for (c, from) in positions {
            let log_start = self.kafka.log_start(&c);
            let mut resume = from;
            if self.scenario.replay_on_restart && self.rng.chance(1, 3) {
                resume = (resume - self.rng.range(1, 4)).max(log_start);
            }
            next_fetch.insert(c, resume);
        }
        let resume: Vec<String> = next_fetch.iter().map(|(c, p)| format!("{}@{p}", self.name(c))).collect();
        self.trace.push(format!("{} task{t} resume {}", self.step, resume.join(" ")));
        let run = self.running(t);
        run.next_fetch = next_fetch;
        run.host.assigned();
    }

    /// The log start the host tells the engine for `channel`, whose log start is
    /// `log_start`: `StaleLogStart` tells the one read at the task's start, `LogStartAhead`
    /// one two positions further on.
    fn told_log_start(&mut self, t: usize, channel: ChannelId, log_start: Position) -> Position {
        let sabotage = self.sabotage;
        let run = self.running(t);
        run.log_start_checked.insert(channel, log_start);
        let at_start = *run.log_start_at_start.entry(channel).or_insert(log_start);
        match sabotage {
            Sabotage::StaleLogStart => at_start,
            Sabotage::LogStartAhead => log_start + 2,
            _ => log_start,
        }
    }

    /// Answers a log-start check of `channels` (on an out-of-range fetch, or the periodic
    /// check of the channels holding records). Returns whether the task refused.
    fn task_observe_log_starts(&mut self, t: usize, channels: &[ChannelId]) -> bool {
        let mut told = Vec::new();
        for &c in channels {
            let log_start = self.kafka.log_start(&c);
            told.push((c, self.told_log_start(t, c, log_start)));
        }
        let observed = self.running(t).host.log_starts(&told);
        self.judge_log_starts(t, observed)
    }

    /// Has the oracle judge each answer of a log-start check: every log start the engine
    /// let pass, and the refusal if any. Returns whether the task refused.
    fn judge_log_starts(&mut self, t: usize, observed: Observed) -> bool {
        let receiver = self.tasks[t].receiver;
        for c in &observed.accepted {
            self.oracle.log_start_accepted(receiver, c);
        }
        match observed.refusal {
            Some(refusal) => {
                self.task_refused(t, refusal, None);
                true
            }
            None => false,
        }
    }

    /// Fetches a batch of channel `c` and feeds it as the machine says: the poll, due checks,
    /// the drain after a restore, the records, the consumer's position. An out-of-range
    /// fetch has the machine check every log start; if nothing unsettled was lost, the step
    /// ends and the task restores, reading again from `fed_up_to + 1`.
    fn task_feed(&mut self, t: usize, c: ChannelId) {
        let receiver = self.tasks[t].receiver;
        let max = self.rng.range(1, self.scenario.max_batch) as usize;
        let Next::Poll { max_records } = self.running(t).host.next_action() else { return };
        let max = max_records.map_or(max, |m| m.min(max));
        let from = self.running(t).next_fetch[&c];
        let (records, next) = match self.kafka.fetch_to(&c, from, max) {
            Ok(r) => r,
            Err(FetchError::OutOfRange { log_start }) => {
                let name = self.name(&c);
                let line =
                    format!("{} task{t} fetch {name} from {from} out of range (log start {log_start})", self.step);
                self.trace.push(line);
                self.running(t).host.polled(true);
                if self.task_drive(t) == Next::Feed {
                    self.running(t).host.batch_done();
                    self.task_drive(t);
                }
                return;
            }
            Err(FetchError::TopicGone) => panic!("model topics are never deleted"),
        };
        self.running(t).host.polled(false);
        if self.task_drive(t) != Next::Feed {
            return;
        }
        let mut previous = from;
        let mut line = format!("{} task{t} feed {}", self.step, self.name(&c));
        let mut refused = None;
        for f in records {
            if self.kafka.aborted_between(&c, previous, f.position) {
                self.stats.aborted_runs_crossed += 1;
            }
            previous = f.position + 1;
            let run = self.running(t);
            run.next_fetch.insert(c, f.position + 1);
            let payload = Payload { id: f.id, key: f.key };
            match run.host.receive(c, f.position, &header_values(&f.headers), payload) {
                Ok(Receipt::Duplicate) => {
                    self.stats.replays_dropped += 1;
                    line.push_str(&format!(" @{}:dup", f.position));
                }
                Ok(Receipt::Accepted { deliveries }) => {
                    let held = !deliveries.iter().any(|d| d.channel == c && d.position == f.position);
                    if held {
                        self.stats.held += 1;
                    }
                    line.push_str(&format!(" @{}:{}", f.position, if held { "held" } else { "ok" }));
                    for d in &deliveries {
                        self.oracle.delivered(receiver, d.channel, d.position, d.payload.id);
                        line.push_str(&format!(" +#{}", d.payload.id));
                    }
                    let run = self.running(t);
                    run.applied.extend(deliveries.iter().map(|d| d.payload));
                }
                Err(refusal) => {
                    refused = Some((refusal, f.id));
                    break;
                }
            }
        }
        if refused.is_none() {
            // Every record below the consumer's position was fed.
            let run = self.running(t);
            run.next_fetch.insert(c, next);
            run.read_to.insert(c, next);
            if next > previous {
                line.push_str(&format!(" read to {next}"));
            }
        }
        self.trace.push(line);
        if let Some((refusal, id)) = refused {
            self.task_refused(t, refusal, Some(id));
        }
        self.running(t).host.batch_done();
        self.task_drive(t);
    }

    /// A refusal, judged: it is expected only on a damaged record (`UNDECODABLE_METADATA`),
    /// or where the oracle says retention passed a record the task had not delivered
    /// (`POSITIONS_DISCARDED_UNREAD`). The machine then commits the step (or the start)
    /// with the refusal as status.
    fn task_refused(&mut self, t: usize, refusal: Refusal, record: Option<RecordId>) {
        self.stats.refusals += 1;
        self.trace.push(format!("{} task{t} refused {}: {}", self.step, refusal.reason, refusal.diagnosis));
        let receiver = self.tasks[t].receiver;
        let unjustified = match (refusal.reason, refusal.channel) {
            (RefusalReason::UndecodableMetadata, _) if record.is_some_and(|id| self.oracle.record(id).corrupt) => None,
            (RefusalReason::PositionsDiscardedUnread, Some(c)) if self.tasks[t].received.contains(&c) => {
                self.oracle.discard_refusal_unjustified(receiver, &c, refusal.position)
            }
            _ => Some("no damaged record or discarded delivery calls for it".to_string()),
        };
        if let Some(why) = unjustified {
            self.oracle.report(ViolationKind::UnexpectedRefusal, format!("task{t} refused: {refusal} ({why})"));
        }
        let discarded = refusal.reason == RefusalReason::PositionsDiscardedUnread;
        if let Some(before) = self.tasks[t].expect_refusal.take() {
            let same = before.reason == refusal.reason
                && before.channel == refusal.channel
                && before.position == refusal.position;
            if same {
                self.stats.refusals_recurred += 1;
                if discarded {
                    self.stats.discard_refusals_recurred += 1;
                }
            } else {
                self.oracle.report(
                    ViolationKind::RefusalNotRecurring,
                    format!("task{t} refused {before} before its restart, but {refusal} after"),
                );
            }
        } else if discarded {
            self.stats.discard_refusals += 1;
        }
    }

    /// The prune interval passed: the machine asks for the facts of the upstream channels
    /// in the task's clock and frontier, if it has any.
    fn task_prune(&mut self, t: usize) {
        self.running(t).host.prune_due();
        self.task_drive(t);
    }

    /// What Kafka says of each upstream channel (`PruneDropsLiveCause` reports the log end
    /// as the log start); the machine prunes by it.
    fn task_prune_upstream(&mut self, t: usize, channels: &[ChannelId]) {
        let facts: BTreeMap<ChannelId, ChannelFact> = channels.iter().map(|&c| (c, self.fact(&c))).collect();
        let run = self.running(t);
        let before = run.engine().delivered_past().len();
        run.host.upstream_facts(|c| facts.get(c).copied().unwrap_or(ChannelFact::Unknown));
        let after = run.engine().delivered_past().len();
        if after < before {
            self.stats.prunes += 1;
        }
        self.trace.push(format!("{} task{t} prune clock {before}->{after}", self.step));
    }

    /// The periodic log-start check is due: the machine asks for the channels holding
    /// records.
    fn task_check_log_start(&mut self, t: usize) {
        self.running(t).host.log_start_check_due();
        self.task_drive(t);
    }

    /// The scheduler ends the step: an empty poll (which drains, if the step is the first
    /// after a restore and no feed did) and the commit.
    fn task_end_step(&mut self, t: usize) {
        if !matches!(self.running(t).host.next_action(), Next::Poll { .. }) {
            return;
        }
        self.running(t).host.polled(false);
        if self.task_drive(t) != Next::Feed {
            return;
        }
        self.running(t).host.batch_done();
        if matches!(self.task_drive(t), Next::Poll { .. }) {
            self.task_commit(t);
            self.task_drive(t);
        }
    }

    /// Ends the step as the machine says: nothing when it is idle, else one commit of the
    /// engine's changes with the projection writes.
    fn task_commit(&mut self, t: usize) {
        let Some(commit) = self.running(t).host.end_step() else {
            self.trace.push(format!("{} task{t} step idle", self.step));
            return;
        };
        if commit.write_running {
            self.db.tasks[t].refusal = None;
        }
        let run = self.running(t);
        let applied = std::mem::take(&mut run.applied);
        let read_to = run.read_to.clone();
        self.committed_read.extend(read_to);
        let n = applied.len();
        let persist_held = self.sabotage != Sabotage::HeldNotPersisted;
        self.db.commit(t as u32, commit.changes, &applied, persist_held);
        self.db_version += 1;
        self.changes += 1;
        self.oracle.commit(self.tasks[t].receiver);
        self.stats.deliveries += n as u64;
        self.stats.commits += 1;
        self.trace.push(format!("{} task{t} commit ({n} applied)", self.step));
        self.running(t).host.committed();
    }

    /// The engine and the step in progress are gone; only committed rows remain.
    fn task_down(&mut self, t: usize) {
        let receiver = self.tasks[t].receiver;
        self.oracle.discard(receiver);
        self.tasks[t].state = TaskState::Down;
    }

    fn task_crash(&mut self, t: usize) {
        let TaskState::Up(run) = &self.tasks[t].state else { return };
        let held = run.engine().held_count();
        let mid_step = run.host.step_open();
        self.stats.crashes += 1;
        if mid_step {
            self.stats.crashes_mid_step += 1;
        }
        if held > 0 {
            self.stats.crashes_while_held += 1;
        }
        self.trace.push(format!("{} task{t} crash (held {held}, mid-step {mid_step})", self.step));
        self.task_down(t);
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

    /// Channels a refused task owns: a gap on one of them is the refusal speaking.
    fn refused_channels(&self) -> BTreeSet<ChannelId> {
        self.tasks.iter().filter(|t| t.refused).flat_map(|t| t.received.iter().copied()).collect()
    }

    fn final_checks(&mut self) {
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
            self.oracle.check_complete(self.processes[p].receiver);
        }
        // Every read still waiting, and one last collection read per client, must be
        // covered now that everything is delivered — unless a refusal is in the way.
        for c in 0..self.clients.len() {
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
