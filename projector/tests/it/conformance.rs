//! The conformance kit's self-test: the projector's real step SQL on the real database,
//! driven through the core's step protocol (`TaskHost`) by a seeded fault script, then the
//! oracle's invariants checked on the rows the database holds.
//!
//! No Kafka: the test writes its own log of records (two tasks, each receiving an `orders`
//! and a `payments` channel; records carry causes on the other received channel, on the
//! other task's channels and on an upstream channel, so records are held), with transaction
//! markers between some of them, and plays the consumer itself. Every start and step
//! transaction runs the statements `projector/src/task.rs` runs, in its order:
//! `leases::lock_and_renew` / `lock_renew_and_notify` first (the epoch check under the row
//! lock), then the projection's writes (here: one row per delivery in
//! `public.conformance_applied`), `ordering::apply_changes`, `ordering::record_running`,
//! sometimes `leases::extend`, then the commit; a failure is recorded with
//! `ordering::record_failure`, and every restore reads `ordering::load_state`.
//!
//! The fault script draws, from the seed alone (SplitMix64, the generator of
//! `parsley_sim::rng::SimRng`):
//! - a crash between statements: the transaction is abandoned after k of its statements and
//!   its connection closed; the host is told `failed(Failure::Error)` and records it, or the
//!   process is gone and a new instance takes the task (`ordering::take_task`) and restores;
//! - a lost commit answer: the commit succeeded, the host is told it failed, restores and
//!   must find the step applied;
//! - lease expiry and takeover: a new owner claims the task (`leases::claim`, lease passed),
//!   raising the epoch, before an in-flight step's lock, while the step holds the row lock
//!   (the claim waits for it), or between steps; the old owner carries on unaware until the
//!   epoch check of its next transaction (or `record_failure`) fences it;
//! - a process crash mid-step (before its transaction), and consumers that resume a few
//!   positions below `fed_up_to + 1`, so replays must be dropped;
//! - the balancer's heartbeat (`leases::renew`): the current owner keeps the task, a
//!   superseded one is told it lost it and is stopped.
//!
//! After every commit, in one snapshot, and once everything is published and delivered:
//! every record at or below a channel's `fed_up_to` is applied or held, never both, none
//! above it is either, and held records are the channel's suffix; no record applied twice;
//! per channel in position order; every applied record after each of its causes on the
//! task's received channels; the stored clock and frontier are exactly what the applied
//! (and held) records account for; `fed_up_to` never moves back; no transaction of a fenced
//! owner is visible (a commit at an epoch that moved is reported at once, and rows never go
//! back to an older epoch). At the end: every record applied, nothing held.
//!
//! The meta-tests run the same script with a host that breaks one duty ([`Break`]) and
//! require the invariants to catch it on every seed. `CONFORMANCE_SEEDS=N` (and
//! `CONFORMANCE_SEED_START`, default 1) runs other seeds than 1–4.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use parsley::channel::{ChannelId, Position, TopicId};
use parsley::engine::{Delivery, EngineConfig, Receipt};
use parsley::host::{ChannelStart, Failure, Next, StepCommit, TaskHost};
use parsley::CausalPast;
use parsley_store::leases::{self, Claim};
use parsley_store::ordering::{self, LoadError, TaskRow};
use parsley_store::RecordData;
use sqlx::{Connection as _, PgConnection, PgPool, Row as _};
use uuid::Uuid;

use crate::support::{pool, unique};

/// The seeds of the self-test and of each meta-test: 1–4, or `CONFORMANCE_SEEDS` of them
/// from `CONFORMANCE_SEED_START` (default 1).
const SEEDS: u64 = 4;
/// Seeds run at once, each on its own model (a pool of 6 connections serves them).
const AT_ONCE: usize = 4;
/// Script actions per seed (each one a round of one instance: a start, a step, or both).
const ACTIONS: usize = 300;
/// Records written per seed.
const RECORDS: usize = 160;
const TASKS: u32 = 2;
/// Every lease passes at once: a takeover is possible whenever the script draws one.
const LEASE: Duration = Duration::ZERO;
/// How long a claim waits for a row lock held by a step in flight.
const CLAIM_WAIT: Duration = Duration::from_secs(10);

fn orders(task: u32) -> ChannelId {
    ChannelId::new(TopicId::from_bytes([0x0a; 16]), task)
}

fn payments(task: u32) -> ChannelId {
    ChannelId::new(TopicId::from_bytes([0x0b; 16]), task)
}

/// A channel no task receives: causes there never hold, but reach the clock.
fn upstream() -> ChannelId {
    ChannelId::new(TopicId::from_bytes([0x0c; 16]), 0)
}

fn received(task: u32) -> [ChannelId; 2] {
    [orders(task), payments(task)]
}

/// A host that breaks one duty on purpose (meta-tests only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Break {
    None,
    /// H11: the projection's rows commit in a transaction of their own, before the one that
    /// writes the ordering state.
    SplitTransactions,
    /// H12: the step's first statement locks the task's row without checking the epoch
    /// (`ordering::lock_task`).
    NoEpochCheck,
    /// H7: a consumer resumes at `fed_up_to + 2`.
    ResumeAbove,
    /// H2: the restore leaves out the held records.
    RestoreWithoutHeld,
    /// H8: records are fed without their `parsley.causes` header.
    StripCauses,
    /// H11: the step's transaction leaves out the clock's upserts.
    ClockLeftOut,
    /// H11: the projection applies a step's deliveries in reverse order.
    ProjectReversed,
}

/// SplitMix64, as `parsley_sim::rng::SimRng` (not a dependency: the simulator's crate is
/// built with the core's `sim` feature).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    fn weighted(&mut self, weights: &[u32]) -> usize {
        let mut x = self.below(weights.iter().map(|&w| u64::from(w)).sum());
        for (i, &w) in weights.iter().enumerate() {
            if x < u64::from(w) {
                return i;
            }
            x -= u64::from(w);
        }
        unreachable!()
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

/// One record of the test's log.
struct Rec {
    channel: ChannelId,
    position: Position,
    causes: CausalPast,
    /// The `parsley.causes` header (none when there are no causes).
    header: Option<Vec<u8>>,
    value: Vec<u8>,
}

/// What the test wrote: records in write order, markers (positions without a record)
/// between some of them, and how much of each channel is published.
struct Log {
    records: Vec<Rec>,
    at: BTreeMap<(ChannelId, Position), usize>,
    /// Positions written per channel (records and markers).
    len: BTreeMap<ChannelId, Position>,
    /// Positions a consumer can read per channel.
    visible: BTreeMap<ChannelId, Position>,
    published: usize,
}

impl Log {
    fn generate(rng: &mut Rng, seed: u64) -> Log {
        let channels: Vec<ChannelId> = (0..TASKS).flat_map(received).collect();
        let mut log = Log {
            records: Vec::new(),
            at: BTreeMap::new(),
            len: channels.iter().map(|&c| (c, 0)).collect(),
            visible: channels.iter().map(|&c| (c, 0)).collect(),
            published: 0,
        };
        for i in 0..RECORDS {
            let channel = rng.pick(&channels);
            if rng.chance(1, 6) {
                *log.len.get_mut(&channel).unwrap() += 1 + rng.below(2) as i64;
            }
            let position = log.len[&channel];
            *log.len.get_mut(&channel).unwrap() += 1;
            let mut causes = Vec::new();
            let earlier = |log: &Log, c: ChannelId| -> Vec<Position> {
                log.records.iter().rev().filter(|r| r.channel == c).take(4).map(|r| r.position).collect()
            };
            // On the other channel the task receives: the record may be held behind it.
            let sibling =
                if channel.topic == orders(0).topic { payments(channel.partition) } else { orders(channel.partition) };
            if rng.chance(2, 3) {
                let recent = earlier(&log, sibling);
                if !recent.is_empty() {
                    causes.push((sibling, rng.pick(&recent)));
                }
            }
            if rng.chance(1, 4) {
                let any = rng.pick(&channels);
                let recent = earlier(&log, any);
                if !recent.is_empty() {
                    causes.push((any, rng.pick(&recent)));
                }
            }
            if rng.chance(1, 4) {
                causes.push((upstream(), rng.below(1000) as i64));
            }
            let causes = CausalPast::from_pairs(causes);
            let header = (!causes.is_empty()).then(|| causes.encode());
            log.at.insert((channel, position), log.records.len());
            log.records.push(Rec { channel, position, causes, header, value: format!("{seed}/{i}").into_bytes() });
        }
        // A trailing marker on some channels: only the read position passes it.
        for c in &channels {
            if rng.chance(1, 2) {
                *log.len.get_mut(c).unwrap() += 1;
            }
        }
        log
    }

    fn publish(&mut self, n: usize) {
        for _ in 0..n {
            let Some(r) = self.records.get(self.published) else { return };
            let v = self.visible.get_mut(&r.channel).unwrap();
            *v = (*v).max(r.position + 1);
            self.published += 1;
        }
    }

    fn publish_all(&mut self) {
        self.publish(self.records.len());
        self.visible = self.len.clone();
    }

    fn record(&self, channel: ChannelId, position: Position) -> Option<&Rec> {
        self.at.get(&(channel, position)).map(|&i| &self.records[i])
    }

    /// The last record on `channel` at or below `position`.
    fn last_at_or_below(&self, channel: ChannelId, position: Position) -> Option<&Rec> {
        self.at.range((channel, Position::MIN)..=(channel, position)).next_back().map(|(_, &i)| &self.records[i])
    }
}

/// One instance's runner of one task: its owner name, the epoch it took the task at, the
/// step protocol, and its consumer's next position per channel.
struct Instance {
    owner: String,
    epoch: i64,
    host: TaskHost<RecordData>,
    next: BTreeMap<ChannelId, Position>,
    /// Another owner took the task; this instance does not know it.
    superseded: bool,
}

#[derive(Default)]
struct Slot {
    current: Option<Instance>,
    /// The previous owner, still running, unaware of the takeover.
    zombie: Option<Instance>,
    /// The task's epoch as the test knows it.
    epoch: i64,
}

/// What became of a transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Committed(usize),
    RolledBack,
    Fenced,
}

/// Faults a transaction can meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TxFault {
    None,
    /// Abandoned after this many statements; the host is told it failed.
    Crash(usize),
    /// Abandoned after this many statements; the process is gone.
    ProcessCrash(usize),
    LostAnswer,
    TakeoverBeforeLock,
    TakeoverUnderLock,
}

/// How a round ended for the instance that ran it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Round {
    /// Still running (idle, committed, or failed and restoring).
    Alive { idle: bool },
    /// Fenced, or its process crashed.
    Gone,
}

/// A statement of a start or step transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stmt {
    LockStart,
    LockStep {
        notify: bool,
    },
    CountSkips,
    Project,
    Apply,
    Running,
    Notify,
    Extend,
    /// `Break::SplitTransactions`: commit what was written so far, begin again and lock.
    SplitCommit {
        notify: bool,
    },
}

#[derive(Default, Debug)]
struct Counts {
    actions: usize,
    commits: usize,
    deliveries: usize,
    crashes: usize,
    process_crashes: usize,
    lost_answers: usize,
    takeovers_idle: usize,
    takeovers_before_lock: usize,
    takeovers_under_lock: usize,
    fenced_at_lock: usize,
    fenced_at_failure: usize,
    replays: usize,
    held_max: usize,
    restores_with_held: usize,
    careful_commits: usize,
    empty_polls: usize,
    heartbeats: usize,
    stopped_by_heartbeat: usize,
}

struct Run {
    pool: PgPool,
    seed: u64,
    brk: Break,
    model: String,
    rng: Rng,
    log: Log,
    slots: Vec<Slot>,
    action: usize,
    draining: bool,
    owners: u32,
    seq: i64,
    step_id: i64,
    fates: BTreeMap<i64, Fate>,
    fed_seen: BTreeMap<(u32, ChannelId), Position>,
    violations: Vec<String>,
    counts: Counts,
}

/// What a run found: its violations (empty when every invariant held) and its counts.
struct Outcome {
    violations: Vec<String>,
    counts: Counts,
}

async fn ensure_table(pool: &PgPool) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(4243)").execute(&mut *tx).await.unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS public.conformance_applied (
           model text NOT NULL, seq bigint NOT NULL, task int NOT NULL, epoch bigint NOT NULL, step bigint NOT NULL,
           topic_id uuid NOT NULL, partition int NOT NULL, position bigint NOT NULL, value bytea, causes bytea NOT NULL,
           PRIMARY KEY (model, seq))",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

impl Run {
    async fn new(pool: &PgPool, seed: u64, brk: Break) -> Run {
        let model = unique("conformance");
        let topics = [("orders".to_string(), orders(0).topic), ("payments".to_string(), payments(0).topic)];
        ordering::register_model(pool, &model, TASKS, &topics).await.unwrap();
        let mut rng = Rng(seed);
        let log = Log::generate(&mut rng, seed);
        Run {
            pool: pool.clone(),
            seed,
            brk,
            model,
            rng,
            log,
            slots: (0..TASKS).map(|_| Slot::default()).collect(),
            action: 0,
            draining: false,
            owners: 0,
            seq: 0,
            step_id: 0,
            fates: BTreeMap::new(),
            fed_seen: BTreeMap::new(),
            violations: Vec::new(),
            counts: Counts::default(),
        }
    }

    fn violation(&mut self, what: String) {
        let at = if self.draining { "drain".to_string() } else { format!("action {}", self.action) };
        self.violations.push(format!("seed {} {at}: {what}", self.seed));
    }

    fn instance(&mut self, task: u32, owner: String, row: TaskRow) -> Instance {
        self.slots[task as usize].epoch = row.epoch;
        Instance {
            owner,
            epoch: row.epoch,
            host: TaskHost::new(EngineConfig::default(), received(task), row.status),
            next: BTreeMap::new(),
            superseded: false,
        }
    }

    fn new_owner(&mut self, task: u32) -> String {
        self.owners += 1;
        format!("owner-{task}-{}", self.owners)
    }

    /// A new owner claims the task (its lease passed), raising the epoch.
    async fn claim(pool: PgPool, model: String, task: u32, owner: String) -> TaskRow {
        let deadline = Instant::now() + CLAIM_WAIT;
        loop {
            match leases::claim(&pool, &model, task, &owner, LEASE, CLAIM_WAIT).await.unwrap() {
                Claim::Taken { row, .. } => return row,
                other => {
                    assert!(Instant::now() < deadline, "task {task} not claimed: {other:?}");
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    }

    /// A takeover: the new owner becomes the task's current instance; the one in `slot`
    /// (if any) becomes the zombie.
    async fn takeover(&mut self, task: u32) {
        let owner = self.new_owner(task);
        let row = Run::claim(self.pool.clone(), self.model.clone(), task, owner.clone()).await;
        self.install(task, owner, row);
    }

    fn install(&mut self, task: u32, owner: String, row: TaskRow) {
        let new = self.instance(task, owner, row);
        let slot = &mut self.slots[task as usize];
        if let Some(mut old) = slot.current.replace(new) {
            old.superseded = true;
            slot.zombie = Some(old);
        }
    }

    /// The process of the task's current instance died: another one takes the task as the
    /// projector's start does.
    async fn restart(&mut self, task: u32) {
        let owner = self.new_owner(task);
        let row = ordering::take_task(&self.pool, &self.model, task, &owner).await.unwrap();
        let new = self.instance(task, owner, row);
        self.slots[task as usize].current = Some(new);
    }

    fn draw_fault(&mut self, statements: usize, zombie: bool) -> TxFault {
        if self.draining {
            return TxFault::None;
        }
        let fault = match self.rng.weighted(&[70, 10, 3, 8, 4, 4]) {
            0 => TxFault::None,
            1 => TxFault::Crash(self.rng.below(statements as u64 + 1) as usize),
            2 => TxFault::ProcessCrash(self.rng.below(statements as u64 + 1) as usize),
            3 => TxFault::LostAnswer,
            4 => TxFault::TakeoverBeforeLock,
            _ => TxFault::TakeoverUnderLock,
        };
        match fault {
            // A stale owner's transaction that fails before its lock: `record_failure` must
            // find the epoch moved.
            TxFault::TakeoverBeforeLock | TxFault::TakeoverUnderLock if zombie => TxFault::Crash(0),
            f => f,
        }
    }

    async fn run(mut self) -> Outcome {
        for task in 0..TASKS {
            self.takeover(task).await;
        }
        for action in 0..ACTIONS {
            self.action = action;
            self.counts.actions += 1;
            // Now and then a burst, which the consumers read in several steps.
            let publish = if self.rng.chance(1, 20) { 10 } else { self.rng.below(2) as usize };
            self.log.publish(publish);
            let task = self.rng.below(u64::from(TASKS)) as u32;
            if self.rng.chance(1, 50) {
                self.counts.takeovers_idle += 1;
                self.takeover(task).await;
            }
            if self.rng.chance(1, 8) {
                self.heartbeat(task).await;
            }
            let zombie = self.slots[task as usize].zombie.is_some() && self.rng.chance(1, 3);
            self.round(task, zombie).await;
            if !self.violations.is_empty() {
                return self.outcome();
            }
        }
        self.draining = true;
        self.log.publish_all();
        for task in 0..TASKS {
            for _ in 0..50 {
                if self.slots[task as usize].zombie.is_none() {
                    break;
                }
                self.round(task, true).await;
            }
            self.slots[task as usize].zombie = None;
            let mut done = false;
            for _ in 0..400 {
                let round = self.round(task, false).await;
                if !self.violations.is_empty() {
                    return self.outcome();
                }
                let inst = self.slots[task as usize].current.as_ref().expect("no faults while draining");
                let read_all = received(task).iter().all(|c| inst.next.get(c) == Some(&self.log.len[c]));
                if round == (Round::Alive { idle: true }) && read_all && inst.host.engine().held_count() == 0 {
                    done = true;
                    break;
                }
            }
            if !done {
                self.violation(format!("task {task} did not deliver everything within 400 rounds"));
            }
        }
        self.audit().await;
        self.final_checks().await;
        self.outcome()
    }

    /// The balancer's heartbeat (`leases::renew`) for each instance of the task: the
    /// current owner keeps it; a superseded one learns it lost the task and its runner is
    /// stopped, as `balance.rs` stops it.
    async fn heartbeat(&mut self, task: u32) {
        self.counts.heartbeats += 1;
        let slot = &self.slots[task as usize];
        let epochs = [slot.current.as_ref().map(|i| (i.epoch, true)), slot.zombie.as_ref().map(|i| (i.epoch, false))];
        for (epoch, current) in epochs.into_iter().flatten() {
            let held = [leases::Held { task, epoch, since_step: None }];
            let lost = leases::renew(&self.pool, &self.model, &held, LEASE).await.unwrap();
            match (current, lost.as_slice()) {
                (true, []) => {}
                (false, [t]) if *t == task => {
                    self.counts.stopped_by_heartbeat += 1;
                    self.slots[task as usize].zombie = None;
                }
                _ => {
                    let what = if current { "the current owner" } else { "a superseded owner" };
                    self.violation(format!(
                        "task {task}: the heartbeat of {what} at epoch {epoch} found {lost:?} lost"
                    ));
                }
            }
        }
    }

    fn outcome(self) -> Outcome {
        Outcome { violations: self.violations, counts: self.counts }
    }

    /// One round of the task's current instance (or its zombie): the start sequence when
    /// the protocol asks for it, then one step, as `TaskRunner::run_once` does.
    async fn round(&mut self, task: u32, zombie: bool) -> Round {
        let slot = &mut self.slots[task as usize];
        let Some(mut inst) = (if zombie { slot.zombie.take() } else { slot.current.take() }) else {
            return Round::Gone;
        };
        let round = self.drive(task, &mut inst).await;
        if round != Round::Gone {
            let slot = &mut self.slots[task as usize];
            if inst.superseded {
                slot.zombie = Some(inst);
            } else {
                slot.current = Some(inst);
            }
        }
        round
    }

    async fn drive(&mut self, task: u32, inst: &mut Instance) -> Round {
        loop {
            match inst.host.next_action() {
                Next::Restore => self.restore(task, inst).await,
                Next::ReadStarts(channels) => {
                    let starts: Vec<ChannelStart> = (channels.iter())
                        .map(|&channel| ChannelStart { channel, log_start: 0, initial_fed_up_to: -1 })
                        .collect();
                    let observed = inst.host.started(&starts);
                    if let Some(r) = observed.refusal {
                        self.violation(format!("task {task} refused at start: {r:?}"));
                    }
                }
                Next::CommitStart => {
                    let start = inst.host.take_start();
                    let mut stmts = vec![Stmt::LockStart, Stmt::CountSkips, Stmt::Apply];
                    if start.write_running {
                        stmts.push(Stmt::Running);
                    }
                    if start.notify {
                        stmts.push(Stmt::Notify);
                    }
                    let commit =
                        StepCommit { changes: start.changes, careful: false, write_running: false, notify: false };
                    match self.transact(task, inst, &stmts, &commit, &[]).await {
                        Some(Round::Alive { .. }) => {}
                        Some(gone) => return gone,
                        None => return Round::Alive { idle: false },
                    }
                }
                Next::Assign(positions) => {
                    for (channel, from) in positions {
                        let from = match self.brk {
                            Break::ResumeAbove => from + 1,
                            _ if self.rng.chance(1, 3) => (from - 1 - self.rng.below(4) as i64).max(0),
                            _ => from,
                        };
                        inst.next.insert(channel, from);
                    }
                    inst.host.assigned();
                }
                Next::Poll { .. } => break,
                Next::Fenced => return Round::Gone,
                other => {
                    self.violation(format!("task {task} ({}) met {other:?} at start", inst.owner));
                    return Round::Gone;
                }
            }
        }
        // The step: one batch, as `TaskRunner::step_with`.
        let mut polled = false;
        let mut batch = Vec::new();
        let mut deliveries: Vec<Delivery<RecordData>> = Vec::new();
        loop {
            match inst.host.next_action() {
                Next::Poll { max_records } if !polled => {
                    batch = self.poll(inst, max_records);
                    if batch.is_empty() {
                        self.counts.empty_polls += 1;
                    }
                    polled = true;
                    inst.host.polled(false);
                }
                Next::Poll { .. } | Next::Commit => break,
                Next::Drain => deliveries.extend(inst.host.drain()),
                Next::Feed => {
                    for i in std::mem::take(&mut batch) {
                        let rec = &self.log.records[i];
                        let mut headers: Vec<Option<&[u8]>> = rec.header.iter().map(|h| Some(h.as_slice())).collect();
                        if self.brk == Break::StripCauses {
                            headers.clear();
                        }
                        let payload = RecordData { value: Some(rec.value.clone()), ..RecordData::default() };
                        match inst.host.receive(rec.channel, rec.position, &headers, payload) {
                            Ok(Receipt::Accepted { deliveries: d }) => deliveries.extend(d),
                            Ok(Receipt::Duplicate) => self.counts.replays += 1,
                            Err(r) => {
                                self.violation(format!("task {task} refused {r:?}"));
                                return Round::Gone;
                            }
                        }
                    }
                    inst.host.batch_done();
                }
                Next::ReadPositions => {
                    let positions: Vec<(ChannelId, Position)> = inst.next.iter().map(|(c, p)| (*c, *p)).collect();
                    inst.host.read_positions(&positions);
                }
                other => {
                    self.violation(format!("task {task} ({}) met {other:?} in a step", inst.owner));
                    return Round::Gone;
                }
            }
        }
        if !self.draining && self.rng.chance(1, 40) {
            // The process dies mid-step, before its transaction.
            self.counts.process_crashes += 1;
            if !inst.superseded {
                self.restart(task).await;
            }
            return Round::Gone;
        }
        let Some(commit) = inst.host.end_step() else { return Round::Alive { idle: true } };
        let mut stmts = vec![Stmt::LockStep { notify: false }, Stmt::Project];
        if self.brk == Break::SplitTransactions {
            stmts.push(Stmt::SplitCommit { notify: false });
        }
        stmts.push(Stmt::Apply);
        if commit.write_running {
            stmts.push(Stmt::Running);
        }
        if self.rng.chance(1, 4) {
            stmts.push(Stmt::Extend);
        }
        let changes = &commit.changes;
        let notify = commit.notify || !changes.clock_upserts.is_empty() || !changes.clock_removed.is_empty();
        for s in &mut stmts {
            if let Stmt::LockStep { notify: n } | Stmt::SplitCommit { notify: n } = s {
                *n = notify;
            }
        }
        if commit.careful {
            self.counts.careful_commits += 1;
        }
        self.transact(task, inst, &stmts, &commit, &deliveries).await.unwrap_or(Round::Alive { idle: false })
    }

    /// The consumer: up to the step's bound (one record in a careful first step), from
    /// channels with something published, passing markers. Half the steps read one channel
    /// only, so the other lags and the effects of its records arrive first (and are held).
    fn poll(&mut self, inst: &mut Instance, max: Option<usize>) -> Vec<usize> {
        let want = max.unwrap_or(usize::MAX).min(1 + self.rng.below(6) as usize);
        let channels: Vec<ChannelId> = inst.next.keys().copied().collect();
        let only = self.rng.chance(1, 2).then(|| self.rng.pick(&channels));
        let mut batch = Vec::new();
        for _ in 0..want * 3 {
            if batch.len() >= want {
                break;
            }
            let readable: Vec<ChannelId> = (inst.next.iter())
                .filter(|(c, p)| **p < self.log.visible[*c] && only.is_none_or(|o| o == **c))
                .map(|(c, _)| *c)
                .collect();
            if readable.is_empty() {
                break;
            }
            let c = self.rng.pick(&readable);
            let p = inst.next[&c];
            inst.next.insert(c, p + 1);
            if let Some(&i) = self.log.at.get(&(c, p)) {
                batch.push(i);
            }
        }
        batch
    }

    async fn restore(&mut self, task: u32, inst: &mut Instance) {
        let mut conn = self.pool.acquire().await.unwrap();
        let model_row = ordering::load_model(&mut conn, &self.model).await.unwrap().expect("the model's row");
        match ordering::load_state(&mut conn, &self.model, task, model_row.format_version).await {
            Ok(mut state) => {
                if !state.held.is_empty() {
                    self.counts.restores_with_held += 1;
                }
                if self.brk == Break::RestoreWithoutHeld {
                    state.held.clear();
                }
                let skipped = ordering::skipped_positions(&mut conn, &self.model, task).await.unwrap();
                inst.next.clear();
                inst.host.restored(state, skipped);
            }
            Err(LoadError::Refused(r)) => {
                self.violation(format!("task {task}: stored state unreadable: {r:?}"));
                inst.host.unrestorable(r);
            }
            Err(LoadError::Database(e)) => panic!("loading task {task}: {e}"),
        }
    }

    /// Runs one start or step transaction with the fault the script draws. `None`: the
    /// transaction did not commit, or its answer was lost, and the host was told it failed
    /// (it restores next); `Some`: what became of the instance.
    async fn transact(
        &mut self,
        task: u32,
        inst: &mut Instance,
        stmts: &[Stmt],
        commit: &StepCommit<RecordData>,
        deliveries: &[Delivery<RecordData>],
    ) -> Option<Round> {
        let fault = self.draw_fault(stmts.len(), inst.superseded);
        self.step_id += 1;
        let step = self.step_id;
        let first_seq = self.seq;
        let mut conn = self.pool.acquire().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        if fault == TxFault::TakeoverBeforeLock {
            self.counts.takeovers_before_lock += 1;
            self.takeover(task).await;
            inst.superseded = true;
        }
        let mut claim = None;
        for (k, &stmt) in stmts.iter().enumerate() {
            if matches!(fault, TxFault::Crash(at) | TxFault::ProcessCrash(at) if at == k) {
                drop(tx);
                let _ = conn.close().await;
                return self.crashed(task, inst, step, fault).await;
            }
            let mut locked = self.statement(&mut tx, task, inst, stmt, commit, deliveries, step).await;
            if let Stmt::SplitCommit { notify } = stmt {
                // What was written so far is committed: a crash from here on leaves it.
                tx.commit().await.unwrap();
                tx = conn.begin().await.unwrap();
                locked = self.statement(&mut tx, task, inst, Stmt::LockStep { notify }, commit, deliveries, step).await;
            }
            if !locked {
                tx.rollback().await.unwrap();
                self.fates.insert(step, Fate::Fenced);
                self.counts.fenced_at_lock += 1;
                self.finish_claim(task, inst, claim).await;
                inst.host.fenced();
                return Some(Round::Gone);
            }
            if k == 0 && fault == TxFault::TakeoverUnderLock {
                self.counts.takeovers_under_lock += 1;
                let owner = self.new_owner(task);
                let handle = tokio::spawn(Run::claim(self.pool.clone(), self.model.clone(), task, owner.clone()));
                // Let the claim reach the row lock the transaction holds.
                tokio::time::sleep(Duration::from_millis(5)).await;
                claim = Some((owner, handle));
            }
        }
        if matches!(fault, TxFault::Crash(at) | TxFault::ProcessCrash(at) if at == stmts.len()) {
            drop(tx);
            let _ = conn.close().await;
            return self.crashed(task, inst, step, fault).await;
        }
        tx.commit().await.unwrap();
        drop(conn);
        let rows = (self.seq - first_seq) as usize;
        self.fates.insert(step, Fate::Committed(rows));
        self.counts.commits += 1;
        self.counts.deliveries += rows;
        let current = self.slots[task as usize].epoch;
        if inst.epoch != current {
            self.violation(format!(
                "task {task}: transaction {step} of {} at epoch {} committed while the epoch was {current}",
                inst.owner, inst.epoch
            ));
        }
        self.finish_claim(task, inst, claim).await;
        self.audit().await;
        if fault == TxFault::LostAnswer {
            self.counts.lost_answers += 1;
            return self.failed(task, inst).await;
        }
        inst.host.committed();
        Some(Round::Alive { idle: false })
    }

    /// A claim that waited for the row lock of `inst`'s transaction takes the task now.
    async fn finish_claim(
        &mut self,
        task: u32,
        inst: &mut Instance,
        claim: Option<(String, tokio::task::JoinHandle<TaskRow>)>,
    ) {
        if let Some((owner, handle)) = claim {
            let row = handle.await.unwrap();
            self.install(task, owner, row);
            inst.superseded = true;
        }
    }

    /// The transaction was abandoned (its connection closed).
    async fn crashed(&mut self, task: u32, inst: &mut Instance, step: i64, fault: TxFault) -> Option<Round> {
        self.fates.insert(step, Fate::RolledBack);
        if let TxFault::ProcessCrash(_) = fault {
            self.counts.process_crashes += 1;
            if !inst.superseded {
                self.restart(task).await;
            }
            return Some(Round::Gone);
        }
        self.counts.crashes += 1;
        self.failed(task, inst).await
    }

    /// The host is told the transaction failed and records it, as `TaskRunner::fail`.
    async fn failed(&mut self, task: u32, inst: &mut Instance) -> Option<Round> {
        inst.host.failed(Failure::Error);
        let recorded =
            ordering::record_failure(&self.pool, &self.model, task, inst.epoch, "conformance: injected fault").await;
        match recorded.unwrap() {
            true => {
                inst.host.failure_recorded();
                None
            }
            false => {
                self.counts.fenced_at_failure += 1;
                inst.host.fenced();
                Some(Round::Gone)
            }
        }
    }

    /// Runs one statement; `false` when a lock found the epoch moved (fenced).
    #[allow(clippy::too_many_arguments)]
    async fn statement(
        &mut self,
        conn: &mut PgConnection,
        task: u32,
        inst: &Instance,
        stmt: Stmt,
        commit: &StepCommit<RecordData>,
        deliveries: &[Delivery<RecordData>],
        step: i64,
    ) -> bool {
        let model = self.model.clone();
        match stmt {
            Stmt::LockStart => leases::lock_and_renew(conn, &model, task, inst.epoch, LEASE).await.unwrap(),
            Stmt::SplitCommit { .. } => true,
            Stmt::LockStep { notify } => {
                if self.brk == Break::NoEpochCheck {
                    ordering::lock_task(conn, &model, task).await.unwrap().is_some()
                } else {
                    leases::lock_renew_and_notify(conn, &model, task, inst.epoch, LEASE, notify).await.unwrap()
                }
            }
            Stmt::CountSkips => {
                assert_eq!(ordering::count_skips(conn, &model, task).await.unwrap(), 0);
                true
            }
            Stmt::Project => {
                self.project(conn, task, inst, deliveries, step).await;
                true
            }
            Stmt::Apply => {
                if self.brk == Break::ClockLeftOut {
                    let mut changes = commit.changes.clone();
                    changes.clock_upserts.clear();
                    ordering::apply_changes(conn, &model, task, &changes).await.unwrap();
                } else {
                    ordering::apply_changes(conn, &model, task, &commit.changes).await.unwrap();
                }
                true
            }
            Stmt::Running => {
                ordering::record_running(conn, &model, task).await.unwrap();
                true
            }
            Stmt::Notify => {
                ordering::notify(conn, &model, Some(task)).await.unwrap();
                true
            }
            Stmt::Extend => {
                let extended = leases::extend(conn, &model, task, inst.epoch, LEASE).await.unwrap();
                if !extended && self.brk != Break::NoEpochCheck {
                    self.violation(format!("task {task}: extend under the row lock found another epoch"));
                }
                true
            }
        }
    }

    /// The projection: one row per delivery, in delivery order.
    async fn project(
        &mut self,
        conn: &mut PgConnection,
        task: u32,
        inst: &Instance,
        deliveries: &[Delivery<RecordData>],
        step: i64,
    ) {
        if deliveries.is_empty() {
            return;
        }
        let n = deliveries.len();
        let mut seqs: Vec<i64> = (0..n as i64).map(|i| self.seq + i).collect();
        if self.brk == Break::ProjectReversed {
            seqs.reverse();
        }
        self.seq += n as i64;
        let topics: Vec<Uuid> = deliveries.iter().map(|d| ordering::uuid_of(&d.channel.topic)).collect();
        let partitions: Vec<i32> = deliveries.iter().map(|d| d.channel.partition as i32).collect();
        let positions: Vec<i64> = deliveries.iter().map(|d| d.position).collect();
        let values: Vec<Option<Vec<u8>>> = deliveries.iter().map(|d| d.payload.value.clone()).collect();
        let causes: Vec<Vec<u8>> = deliveries.iter().map(|d| d.causes.encode()).collect();
        sqlx::query(
            "INSERT INTO public.conformance_applied (model, task, epoch, step, seq, topic_id, partition, position, value, causes)
             SELECT $1, $2, $3, $4, * FROM UNNEST($5::int8[], $6::uuid[], $7::int4[], $8::int8[], $9::bytea[], $10::bytea[])",
        )
        .bind(&self.model)
        .bind(task as i32)
        .bind(inst.epoch)
        .bind(step)
        .bind(&seqs)
        .bind(&topics)
        .bind(&partitions)
        .bind(&positions)
        .bind(&values)
        .bind(&causes)
        .execute(&mut *conn)
        .await
        .unwrap();
    }

    /// The oracle's invariants on what the database holds now, in one snapshot.
    async fn audit(&mut self) {
        let mut snap = ordering::begin_snapshot(&self.pool).await.unwrap();
        let applied = sqlx::query(
            "SELECT task, epoch, step, seq, topic_id, partition, position, value, causes
               FROM public.conformance_applied WHERE model = $1 ORDER BY seq",
        )
        .bind(&self.model)
        .fetch_all(&mut *snap)
        .await
        .unwrap();
        let pairs = |table: &str| {
            format!(
                "SELECT task, topic_id, partition, {} FROM parsley.{table} WHERE model = $1",
                match table {
                    "channels" => "fed_up_to",
                    _ => "position",
                }
            )
        };
        let read = |rows: Vec<sqlx::postgres::PgRow>| -> BTreeMap<u32, Vec<(ChannelId, Position)>> {
            let mut out: BTreeMap<u32, Vec<(ChannelId, Position)>> = BTreeMap::new();
            for r in rows {
                let c = ChannelId::new(ordering::topic_of(&r.get::<Uuid, _>(1)), r.get::<i32, _>(2) as u32);
                out.entry(r.get::<i32, _>(0) as u32).or_default().push((c, r.get::<i64, _>(3)));
            }
            out
        };
        let mut tables = Vec::new();
        for table in ["channels", "held", "clock", "frontier"] {
            let rows = sqlx::query(&pairs(table)).bind(&self.model).fetch_all(&mut *snap).await.unwrap();
            tables.push(read(rows));
        }
        snap.rollback().await.unwrap();
        let [channels, held, clock, frontier]: [BTreeMap<u32, Vec<(ChannelId, Position)>>; 4] =
            tables.try_into().unwrap();

        struct Row {
            task: u32,
            epoch: i64,
            seq: i64,
            channel: ChannelId,
            position: Position,
            value: Option<Vec<u8>>,
            causes: Vec<u8>,
        }
        let rows: Vec<Row> = applied
            .iter()
            .map(|r| Row {
                task: r.get::<i32, _>(0) as u32,
                epoch: r.get(1),
                seq: r.get(3),
                channel: ChannelId::new(ordering::topic_of(&r.get::<Uuid, _>(4)), r.get::<i32, _>(5) as u32),
                position: r.get(6),
                value: r.get(7),
                causes: r.get(8),
            })
            .collect();
        let mut found = Vec::new();
        for task in 0..TASKS {
            let mine: Vec<&Row> = rows.iter().filter(|r| r.task == task).collect();
            let fed: BTreeMap<ChannelId, Position> =
                channels.get(&task).cloned().unwrap_or_default().into_iter().collect();
            let held: BTreeSet<(ChannelId, Position)> =
                held.get(&task).cloned().unwrap_or_default().into_iter().collect();
            self.counts.held_max = self.counts.held_max.max(held.len());
            let mut applied_at: BTreeMap<(ChannelId, Position), i64> = BTreeMap::new();
            let mut last_on: BTreeMap<ChannelId, Position> = BTreeMap::new();
            let mut last_epoch = i64::MIN;
            let mut clock_expected: BTreeMap<ChannelId, Position> = BTreeMap::new();
            let mut frontier_expected: BTreeMap<ChannelId, Position> = BTreeMap::new();
            let raise = |m: &mut BTreeMap<ChannelId, Position>, c: ChannelId, p: Position| {
                let e = m.entry(c).or_insert(p);
                *e = (*e).max(p);
            };
            for r in &mine {
                let at = (r.channel, r.position);
                let Some(rec) = self.log.record(r.channel, r.position) else {
                    found.push(format!("task {task}: applied {}@{}, which is no record", r.channel, r.position));
                    continue;
                };
                if !received(task).contains(&r.channel) {
                    found.push(format!(
                        "task {task}: applied {}@{} of a channel it does not receive",
                        r.channel, r.position
                    ));
                }
                if applied_at.insert(at, r.seq).is_some() {
                    found.push(format!("task {task}: {}@{} applied twice", r.channel, r.position));
                }
                if r.value.as_deref() != Some(rec.value.as_slice()) || r.causes != rec.causes.encode() {
                    found.push(format!(
                        "task {task}: {}@{} applied with another payload or causes",
                        r.channel, r.position
                    ));
                }
                if let Some(&last) = last_on.get(&r.channel) {
                    if r.position <= last {
                        found.push(format!(
                            "task {task}: {}@{} applied after {}@{last}",
                            r.channel, r.position, r.channel
                        ));
                    }
                }
                last_on.insert(r.channel, r.position);
                if r.epoch < last_epoch {
                    found.push(format!(
                        "task {task}: {}@{} applied at epoch {} after a row of epoch {last_epoch}",
                        r.channel, r.position, r.epoch
                    ));
                }
                last_epoch = last_epoch.max(r.epoch);
                for (c, p) in rec.causes.iter() {
                    if received(task).contains(&c) {
                        if let Some(cause) = self.log.last_at_or_below(c, p) {
                            let before = applied_at.get(&(cause.channel, cause.position)).is_some_and(|&s| s < r.seq);
                            if !before {
                                found.push(format!(
                                    "task {task}: {}@{} applied before its cause {}@{}",
                                    r.channel, r.position, cause.channel, cause.position
                                ));
                            }
                        }
                    }
                    raise(&mut clock_expected, c, p);
                    raise(&mut frontier_expected, c, p);
                }
                raise(&mut clock_expected, r.channel, r.position);
                raise(&mut frontier_expected, r.channel, r.position);
            }
            for &(c, p) in &held {
                match self.log.record(c, p) {
                    Some(rec) => {
                        for (cc, pp) in rec.causes.iter() {
                            raise(&mut frontier_expected, cc, pp);
                        }
                    }
                    None => found.push(format!("task {task}: holds {c}@{p}, which is no record")),
                }
            }
            for c in received(task) {
                let f = fed.get(&c).copied();
                let up_to = f.unwrap_or(-1);
                for rec in self.log.records.iter().filter(|r| r.channel == c) {
                    let is_applied = applied_at.contains_key(&(c, rec.position));
                    let is_held = held.contains(&(c, rec.position));
                    let what = match (rec.position <= up_to, is_applied, is_held) {
                        (true, true, false) | (true, false, true) | (false, false, false) => continue,
                        (true, false, false) => "at or below fed_up_to but neither applied nor held (lost)",
                        (_, true, true) => "both applied and held",
                        (false, _, _) => "applied or held above fed_up_to",
                    };
                    found.push(format!("task {task}: {c}@{} {what} (fed_up_to {up_to})", rec.position));
                }
                let first_held = held.iter().filter(|(hc, _)| *hc == c).map(|(_, p)| *p).min();
                if let (Some(h), Some(&a)) = (first_held, last_on.get(&c)) {
                    if a > h {
                        found.push(format!("task {task}: {c}@{a} applied while {c}@{h} is held"));
                    }
                }
                if let Some(f) = f {
                    let seen = self.fed_seen.entry((task, c)).or_insert(f);
                    if f < *seen {
                        found.push(format!("task {task}: fed_up_to of {c} moved back from {seen} to {f}"));
                    }
                    *seen = (*seen).max(f);
                }
            }
            let stored_clock: BTreeMap<ChannelId, Position> =
                clock.get(&task).cloned().unwrap_or_default().into_iter().collect();
            if stored_clock != clock_expected {
                found.push(format!(
                    "task {task}: the stored clock {stored_clock:?} is not what the applied rows account for {clock_expected:?}"
                ));
            }
            let stored_frontier: BTreeMap<ChannelId, Position> =
                frontier.get(&task).cloned().unwrap_or_default().into_iter().collect();
            if stored_frontier != frontier_expected {
                found.push(format!(
                    "task {task}: the stored frontier {stored_frontier:?} is not what the applied and held records account \
                     for {frontier_expected:?}"
                ));
            }
        }
        for f in found {
            self.violation(f);
        }
    }

    /// Once everything is published and drained: every record applied, nothing held, every
    /// channel fed to its end, the task rows the last owners', and every transaction's rows
    /// visible exactly when it committed.
    async fn final_checks(&mut self) {
        let mut conn = self.pool.acquire().await.unwrap();
        let rows: Vec<(i64, i64)> =
            sqlx::query_as("SELECT step, count(*) FROM public.conformance_applied WHERE model = $1 GROUP BY step")
                .bind(&self.model)
                .fetch_all(&mut *conn)
                .await
                .unwrap();
        let per_step: BTreeMap<i64, usize> = rows.into_iter().map(|(s, n)| (s, n as usize)).collect();
        let tasks = ordering::load_tasks(&mut conn, &self.model).await.unwrap();
        let mut found = Vec::new();
        for (&step, &fate) in &self.fates {
            let visible = per_step.get(&step).copied().unwrap_or(0);
            let ok = match fate {
                Fate::Committed(n) => visible == n,
                Fate::RolledBack | Fate::Fenced => visible == 0,
            };
            if !ok {
                found.push(format!("transaction {step} ({fate:?}) has {visible} rows visible"));
            }
        }
        for step in per_step.keys().filter(|s| !self.fates.contains_key(s)) {
            found.push(format!("rows of transaction {step}, which never ran"));
        }
        let total: usize = per_step.values().sum();
        if total != self.log.records.len() {
            found.push(format!("{total} rows applied for {} records", self.log.records.len()));
        }
        for row in &tasks {
            let slot = &self.slots[row.task as usize];
            let owner = slot.current.as_ref().map(|i| i.owner.as_str());
            if row.epoch != slot.epoch || Some(row.owner.as_str()) != owner || row.status.as_str() != "running" {
                found.push(format!("task {}: row {row:?}, expected epoch {} owner {owner:?}", row.task, slot.epoch));
            }
        }
        let fed: Vec<(i32, Uuid, i32, i64)> =
            sqlx::query_as("SELECT task, topic_id, partition, fed_up_to FROM parsley.channels WHERE model = $1")
                .bind(&self.model)
                .fetch_all(&mut *conn)
                .await
                .unwrap();
        for (task, topic, partition, f) in fed {
            let c = ChannelId::new(ordering::topic_of(&topic), partition as u32);
            if f != self.log.len[&c] - 1 {
                found.push(format!("task {task}: {c} fed up to {f}, its log ends at {}", self.log.len[&c] - 1));
            }
        }
        for f in found {
            self.violation(f);
        }
    }
}

fn seeds() -> Vec<u64> {
    let var = |name: &str, default: u64| std::env::var(name).map_or(default, |v| v.parse().expect(name));
    let start = var("CONFORMANCE_SEED_START", 1);
    (start..start + var("CONFORMANCE_SEEDS", SEEDS)).collect()
}

/// Runs every seed, each on its own model, a few at once (each run is sequential: its
/// choices depend on its seed alone).
async fn run_seeds(brk: Break) -> Vec<(u64, Outcome)> {
    let pool = pool().await;
    ensure_table(&pool).await;
    let mut out = Vec::new();
    for chunk in seeds().chunks(AT_ONCE) {
        let mut runs = Vec::new();
        for &seed in chunk {
            let run = Run::new(&pool, seed, brk).await;
            runs.push((seed, tokio::spawn(run.run())));
        }
        for (seed, run) in runs {
            out.push((seed, run.await.unwrap()));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_step_sql_keeps_every_invariant_under_the_fault_script() {
    let started = Instant::now();
    let outcomes = run_seeds(Break::None).await;
    let mut total = Counts::default();
    let mut failures = Vec::new();
    for (seed, o) in &outcomes {
        println!("seed {seed}: {:?}", o.counts);
        if !o.violations.is_empty() {
            failures.extend(o.violations.iter().take(10).cloned());
            failures.push(format!(
                "reproduce: CONFORMANCE_SEED_START={seed} CONFORMANCE_SEEDS=1 cargo test -p parsley-projector --test it \
                 conformance::the_real_step_sql -- --nocapture"
            ));
        }
        let c = &o.counts;
        total.actions += c.actions;
        total.commits += c.commits;
        total.deliveries += c.deliveries;
        total.crashes += c.crashes;
        total.process_crashes += c.process_crashes;
        total.lost_answers += c.lost_answers;
        total.takeovers_idle += c.takeovers_idle;
        total.takeovers_before_lock += c.takeovers_before_lock;
        total.takeovers_under_lock += c.takeovers_under_lock;
        total.fenced_at_lock += c.fenced_at_lock;
        total.fenced_at_failure += c.fenced_at_failure;
        total.replays += c.replays;
        total.held_max = total.held_max.max(c.held_max);
        total.restores_with_held += c.restores_with_held;
        total.careful_commits += c.careful_commits;
        total.empty_polls += c.empty_polls;
        total.heartbeats += c.heartbeats;
        total.stopped_by_heartbeat += c.stopped_by_heartbeat;
    }
    println!("{} seeds in {:.1} s: {total:?}", outcomes.len(), started.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "invariants broken:\n{}", failures.join("\n"));
    // Anti-vacuity (over at least the default number of seeds): every fault and every state
    // the invariants are about happened.
    if outcomes.len() < SEEDS as usize {
        return;
    }
    for (what, n) in [
        ("crashes between statements", total.crashes),
        ("process crashes", total.process_crashes),
        ("lost commit answers", total.lost_answers),
        ("takeovers between steps", total.takeovers_idle),
        ("takeovers before a step's lock", total.takeovers_before_lock),
        ("takeovers under a step's lock", total.takeovers_under_lock),
        ("transactions fenced by the epoch check", total.fenced_at_lock),
        ("failures refused under a stale epoch", total.fenced_at_failure),
        ("superseded owners stopped by a heartbeat", total.stopped_by_heartbeat),
        ("replays dropped", total.replays),
        ("restores that brought held records back", total.restores_with_held),
        ("careful steps", total.careful_commits),
    ] {
        assert!(n > 0, "no {what} in {} seeds: the script went quiet", outcomes.len());
    }
    assert!(total.held_max >= 2, "records were hardly ever held: {total:?}");
}

/// Runs the script with a broken host and requires every seed to report it.
async fn caught(brk: Break) {
    let outcomes = run_seeds(brk).await;
    let caught = outcomes.iter().filter(|(_, o)| !o.violations.is_empty()).count();
    for (seed, o) in &outcomes {
        match o.violations.len() {
            0 => println!("{brk:?} seed {seed}: not caught"),
            n => println!("{brk:?} seed {seed}: {n} violations, first:\n  {}", o.violations[..n.min(4)].join("\n  ")),
        }
    }
    assert_eq!(caught, outcomes.len(), "{brk:?} caught on {caught} of {} seeds", outcomes.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_committing_the_projection_apart_from_the_ordering_state_is_caught() {
    caught(Break::SplitTransactions).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_skipping_the_epoch_check_is_caught() {
    caught(Break::NoEpochCheck).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_resuming_above_fed_up_to_is_caught() {
    caught(Break::ResumeAbove).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_restoring_without_its_held_records_is_caught() {
    caught(Break::RestoreWithoutHeld).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_feeding_records_without_their_causes_is_caught() {
    caught(Break::StripCauses).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_leaving_the_clock_out_of_the_step_is_caught() {
    caught(Break::ClockLeftOut).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_projecting_a_step_out_of_delivery_order_is_caught() {
    caught(Break::ProjectReversed).await;
}
