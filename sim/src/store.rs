//! The simulated database of the projector tasks — per task, the rows a step commits
//! atomically: held records, `fed_up_to`, frontier, clock rows, refusal status and the
//! document projection — and the reads the gateway makes of them. Upstream processes keep
//! their durable ordering state in the same rows ([`TaskRows`]).

use std::collections::BTreeMap;

use parsley::channel::{ChannelId, Position};
use parsley::engine::{HeldRecord, PersistedState, StepChanges, ORDERING_STATE_FORMAT};
use parsley::gate::ClockRow;
use parsley::refusal::Refusal;

/// What a task keeps of a record: the oracle's id for it (its value) and its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Payload {
    pub id: u32,
    pub key: u16,
}

/// Everything one task has committed.
#[derive(Clone, Debug, Default)]
pub struct TaskRows {
    pub fed_up_to: BTreeMap<ChannelId, Position>,
    pub held: BTreeMap<(ChannelId, Position), HeldRecord<Payload>>,
    pub frontier: BTreeMap<ChannelId, Position>,
    pub clock: BTreeMap<ChannelId, Position>,
    pub refusal: Option<Refusal>,
    /// The document projection: per key, the ids of the records applied to it, in order.
    pub docs: BTreeMap<u16, Vec<u32>>,
    /// The lease: the epoch every step checks under the row lock (raised by each
    /// takeover), the instance holding it, and the scheduler step it runs out at.
    pub epoch: u64,
    pub owner: Option<u32>,
    pub lease_until: u64,
    /// The row says `failing`: a step failed since the last one that committed.
    pub failing: bool,
}

/// The simulated database: one set of rows per task.
#[derive(Clone, Debug)]
pub struct SimDb {
    pub tasks: Vec<TaskRows>,
}

impl TaskRows {
    /// What a restore path reads back.
    pub fn persisted(&self) -> PersistedState<Payload> {
        PersistedState {
            format_version: ORDERING_STATE_FORMAT,
            fed_up_to: self.fed_up_to.clone(),
            held: self.held.values().cloned().collect(),
            frontier: self.frontier.iter().map(|(&c, &p)| (c, p)).collect(),
            delivered: self.clock.iter().map(|(&c, &p)| (c, p)).collect(),
        }
    }

    /// Commits one step: the engine's state changes and the projection writes of its
    /// deliveries, atomically.
    pub fn commit(&mut self, changes: StepChanges<Payload>, applied: &[Payload]) {
        self.apply_rows(applied);
        self.apply_state(changes);
    }

    /// The projection's writes of a step.
    pub fn apply_rows(&mut self, applied: &[Payload]) {
        for d in applied {
            self.docs.entry(d.key).or_default().push(d.id);
        }
    }

    /// The ordering state a step changed: held records, `fed_up_to`, frontier, clock,
    /// refusal.
    pub fn apply_state(&mut self, changes: StepChanges<Payload>) {
        for r in changes.held_inserted {
            self.held.insert((r.channel, r.position), r);
        }
        for key in changes.held_removed {
            self.held.remove(&key);
        }
        for (c, p) in changes.fed_up_to {
            self.fed_up_to.insert(c, p);
        }
        for c in changes.channels_removed {
            self.fed_up_to.remove(&c);
        }
        for (c, p) in changes.frontier_upserts {
            self.frontier.insert(c, p);
        }
        for c in changes.frontier_removed {
            self.frontier.remove(&c);
        }
        for (c, p) in changes.clock_upserts {
            self.clock.insert(c, p);
        }
        for c in changes.clock_removed {
            self.clock.remove(&c);
        }
        if let Some(r) = changes.refusal {
            self.refusal = Some(r);
        }
    }
}

impl SimDb {
    pub fn new(tasks: u32) -> Self {
        SimDb { tasks: (0..tasks).map(|_| TaskRows::default()).collect() }
    }

    /// What the task's restore path reads back.
    pub fn persisted(&self, task: u32) -> PersistedState<Payload> {
        self.tasks[task as usize].persisted()
    }

    /// Commits one step of `task` (see [`TaskRows::commit`]).
    pub fn commit(&mut self, task: u32, changes: StepChanges<Payload>, applied: &[Payload]) {
        self.tasks[task as usize].commit(changes, applied);
    }

    /// Every clock row of every task, as the gateway's one snapshot query returns them.
    pub fn clock_rows(&self) -> Vec<ClockRow> {
        let mut rows = Vec::new();
        for (task, t) in self.tasks.iter().enumerate() {
            for (&channel, &position) in &t.clock {
                rows.push(ClockRow { task: task as u32, channel, position });
            }
        }
        rows
    }

    pub fn doc(&self, task: u32, key: u16) -> &[u32] {
        self.tasks[task as usize].docs.get(&key).map_or(&[], |v| v.as_slice())
    }

    /// The first position of `channel` the task has not yet delivered in a committed step:
    /// retention on a model channel never passes it.
    pub fn undelivered_from(&self, task: u32, channel: &ChannelId) -> Position {
        let rows = &self.tasks[task as usize];
        let held = rows.held.keys().filter(|(c, _)| c == channel).map(|&(_, p)| p).min();
        held.unwrap_or_else(|| rows.fed_up_to.get(channel).map_or(0, |f| f + 1))
    }
}
