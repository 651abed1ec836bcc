//! The ground-truth oracle. It never reads an engine's frontier or clock, a decision, a
//! token or a gate verdict: it learns what really happened — who sent what after
//! delivering or reading what, which transactions committed, what retention discarded —
//! and judges every delivery and every served read against that.
//!
//! Happened-before is tracked exactly, as sets of record ids: a record's history is its
//! sender's knowledge when it was sent. A process knows what it has delivered (in a
//! committed step) and, transitively, their histories; a session client or edge producer
//! also knows its own earlier writes (session order), and a client knows what its reads
//! returned and their histories. A cause counts against a delivery unless its topic was
//! deleted before the record was sent: a pair is dropped from what a send stamps only with
//! its topic, never for its log start.
//!
//! A served read must reflect every record of its scope (the model's own channels) in the
//! session's past — its own writes, what its reads returned, and their causes — whatever
//! the log start: the gateway never stops demanding a pair on a channel the model receives.
//! Retention excuses a cause only on other channels, and only as the log start stands when
//! the read is served (clocks prune such entries, so a read stops demanding them).
//!
//! Retention that passes a record a task has not delivered takes that record out of the
//! protocol's reach in the same way, so the task must stop there: the oracle says, from
//! what retention discarded and what the task delivered, when a task's
//! `POSITIONS_DISCARDED_UNREAD` is due and when a log-start check must not pass.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::bits::RecordSet;
use parsley::channel::{ChannelId, Position, TopicId};

pub type RecordId = u32;

/// Who sent a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Actor {
    /// An edge producer: stamps from its token, never reads.
    Edge(u32),
    /// A session client: writes and gated reads.
    Client(u32),
    /// An upstream process running the engine.
    Process(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordStatus {
    /// Inside a transaction not yet ended.
    Open,
    Committed,
    Aborted,
}

/// Everything the oracle knows about one record.
#[derive(Clone, Debug)]
pub struct RecordFacts {
    pub channel: ChannelId,
    pub position: Position,
    pub key: u16,
    pub author: Actor,
    pub status: RecordStatus,
    /// Its `parsley.causes` header was damaged on purpose.
    pub corrupt: bool,
    /// Its true causes (what a session that read it must see, on the model's channels).
    pub hist: RecordSet,
    /// The causes its send expressed: every true cause but those of deleted topics. A cause
    /// retention passed is still stamped, so a receiver that never read it must not deliver
    /// this record before it (it holds, and refuses at the cause's channel).
    pub stamped: RecordSet,
    /// For a client's write: what the client had learned through reads before sending it.
    pub read_knowledge: Option<RecordSet>,
    /// The length in bytes of its `parsley.causes` value (0 without one).
    pub header_len: usize,
}

/// What broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ViolationKind {
    /// A record was delivered before one of its expressible causes on a received channel.
    CausalOrder,
    /// A client's write was delivered before that client's earlier write.
    MonotonicWrites,
    /// A client's write was delivered before a write the client had read (or its causes).
    WritesFollowReads,
    /// A channel's records were not delivered in position order, or one was skipped.
    Fifo,
    /// A record was delivered twice by one receiver (counting committed steps only).
    Duplicate,
    /// At quiescence, a committed record on a received channel was never delivered.
    Incomplete,
    /// A record whose causes header is damaged was delivered.
    UndecodableDelivered,
    /// The record delivered at a coordinate is not the record stored there.
    PayloadMismatch,
    /// A read did not reflect the client's own write.
    ReadYourWrites,
    /// A read did not reflect a write an earlier read of the session returned.
    MonotonicReads,
    /// A read did not reflect a write in the session's causal past.
    StaleRead,
    /// A read could never be served, though everything had been delivered.
    ReadNeverCovered,
    /// The world did not reach quiescence within its budget.
    Wedged,
    /// A task or process refused without a damaged record to refuse, or for another reason.
    UnexpectedRefusal,
    /// A refused task, restarted, did not refuse again identically.
    RefusalNotRecurring,
    /// A task's log-start check passed although retention had discarded a record the task
    /// had not delivered.
    MissedRefusal,
    /// After a restart (its step rolled back, its engine restored from what it committed),
    /// a receiver delivered a record it had already delivered, or did not resume a channel
    /// at the record after its last committed delivery there.
    RestartOrder,
    /// A read served without a change its served tasks committed before it arrived.
    NotFresh,
    /// On a channel that joined its scope, a receiver delivered a record its delivered past
    /// already accounted for (itself, or a cause of something it delivered): at or below
    /// the seed floor, so a cause delivered after its effect.
    BehindSeedFloor,
}

impl ViolationKind {
    pub fn name(&self) -> &'static str {
        match self {
            ViolationKind::CausalOrder => "causal-order",
            ViolationKind::MonotonicWrites => "monotonic-writes",
            ViolationKind::WritesFollowReads => "writes-follow-reads",
            ViolationKind::Fifo => "fifo",
            ViolationKind::Duplicate => "duplicate",
            ViolationKind::Incomplete => "incomplete",
            ViolationKind::UndecodableDelivered => "undecodable-delivered",
            ViolationKind::PayloadMismatch => "payload-mismatch",
            ViolationKind::ReadYourWrites => "read-your-writes",
            ViolationKind::MonotonicReads => "monotonic-reads",
            ViolationKind::StaleRead => "stale-read",
            ViolationKind::ReadNeverCovered => "read-never-covered",
            ViolationKind::Wedged => "wedged",
            ViolationKind::UnexpectedRefusal => "unexpected-refusal",
            ViolationKind::RefusalNotRecurring => "refusal-not-recurring",
            ViolationKind::MissedRefusal => "missed-refusal",
            ViolationKind::RestartOrder => "restart-order",
            ViolationKind::NotFresh => "not-fresh",
            ViolationKind::BehindSeedFloor => "behind-seed-floor",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub kind: ViolationKind,
    /// The scheduler step it was found at.
    pub step: u64,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {}: {}: {}", self.step, self.kind.name(), self.detail)
    }
}

/// One delivering party (a projector task or an upstream process), as the oracle sees it.
#[derive(Debug)]
struct Receiver {
    name: String,
    /// The process that delivers, whose knowledge grows with its deliveries.
    actor: Option<Actor>,
    received: BTreeSet<ChannelId>,
    started: bool,
    /// Records on received channels at or above the baseline.
    relevant: RecordSet,
    baseline: BTreeMap<ChannelId, Position>,
    /// Delivered in committed steps.
    committed: RecordSet,
    /// Delivered in the step in progress.
    staged: Vec<RecordId>,
    /// What the step in progress taught it by receipt alone: the causes of the records it
    /// received (held or not), which its frontier must contain from then on.
    staged_receipts: RecordSet,
    /// Channels not delivered on since its last rollback (it runs on an engine restored
    /// from what it committed): the next delivery on each must resume where its committed
    /// deliveries end.
    awaiting_resume: BTreeSet<ChannelId>,
    /// Per channel, the index (into the channel's records) of the next record expected.
    next_committed: BTreeMap<ChannelId, usize>,
    next_staged: BTreeMap<ChannelId, usize>,
    /// Records it received (held or delivered) in committed steps, and in the step in
    /// progress: what it holds is what it received and has not delivered.
    receipts: RecordSet,
    staged_receipt_ids: Vec<RecordId>,
    /// Per channel, the highest position its host fed since its last (re)start: feeding
    /// at or below it again is an out-of-order feed.
    fed: BTreeMap<ChannelId, Position>,
    /// Per channel that joined its scope, the index of the first record above the seed
    /// floor: nothing before it may be delivered.
    floor: BTreeMap<ChannelId, usize>,
    /// Its metadata budget (bytes), when it has one worth judging.
    budget: Option<usize>,
    /// What its database rows hold: the records applied by commits that got through,
    /// whichever execution sent them.
    db_applied: RecordSet,
}

#[derive(Debug, Default)]
struct ClientFacts {
    own: RecordSet,
    seen: RecordSet,
    via_reads: RecordSet,
    /// What the session's reads must reflect: its own writes, what its reads returned, and
    /// their true causes. A cause retention passed is kept: the token still names its pair
    /// (a pair is dropped only with its topic), and on a channel the model receives a read
    /// keeps demanding it. What a read is excused is decided when it is served
    /// ([`Oracle::read`]).
    required: RecordSet,
}

/// The oracle.
#[derive(Debug)]
pub struct Oracle {
    records: Vec<RecordFacts>,
    by_channel: BTreeMap<ChannelId, Vec<RecordId>>,
    /// Records retention has passed (below their channel's log start now) or of a deleted
    /// topic: on a channel the model does not receive, a read no longer demands them.
    gone: RecordSet,
    /// Records of a deleted topic: the only causes a send stops expressing (a pair is
    /// dropped from a frontier or a token only with its channel).
    deleted: RecordSet,
    deleted_topics: BTreeSet<TopicId>,
    /// Per channel, how far retention has moved its log start.
    log_start: BTreeMap<ChannelId, Position>,
    /// Records whose value the projection rejects for good.
    poison: RecordSet,
    committed: RecordSet,
    model_topics: BTreeSet<TopicId>,
    /// Once the model's declaration changed: per channel of a topic it declares, the first
    /// position its reads owe (records below it lie behind its owner's seed floor, where
    /// the owner joined the channel again). `None`: every record of the model's topics.
    scope: Option<BTreeMap<ChannelId, Position>>,
    model_records: RecordSet,
    by_key: BTreeMap<u16, RecordSet>,
    receivers: Vec<Receiver>,
    knowledge: BTreeMap<Actor, RecordSet>,
    clients: BTreeMap<u32, ClientFacts>,
    violations: Vec<Violation>,
    step: u64,
    /// Topic names, for readable violations.
    names: BTreeMap<TopicId, String>,
    /// Deliveries judged (including ones in steps that never committed).
    pub deliveries_checked: u64,
    /// Deliveries by a projector task of a record retention had already passed: the
    /// window a periodic log-start check leaves open (judged like any other delivery).
    pub deliveries_below_log_start: u64,
    pub reads_checked: u64,
}

impl Oracle {
    pub fn new(model_topics: impl IntoIterator<Item = TopicId>) -> Self {
        Oracle {
            records: Vec::new(),
            by_channel: BTreeMap::new(),
            gone: RecordSet::new(),
            deleted: RecordSet::new(),
            deleted_topics: BTreeSet::new(),
            log_start: BTreeMap::new(),
            poison: RecordSet::new(),
            committed: RecordSet::new(),
            model_topics: model_topics.into_iter().collect(),
            scope: None,
            model_records: RecordSet::new(),
            by_key: BTreeMap::new(),
            receivers: Vec::new(),
            knowledge: BTreeMap::new(),
            clients: BTreeMap::new(),
            violations: Vec::new(),
            step: 0,
            names: BTreeMap::new(),
            deliveries_checked: 0,
            deliveries_below_log_start: 0,
            reads_checked: 0,
        }
    }

    pub fn name_topic(&mut self, topic: TopicId, name: &str) {
        self.names.insert(topic, name.to_string());
    }

    fn in_read_scope(&self, channel: &ChannelId, position: Position) -> bool {
        match &self.scope {
            None => self.model_topics.contains(&channel.topic),
            Some(scope) => scope.get(channel).is_some_and(|&from| position >= from),
        }
    }

    /// The model's declaration changed (a topic left or joined it): reads owe the records
    /// on `scope`'s channels from each one's first position, and nothing on any other
    /// channel. A topic the model stopped declaring is then like any upstream topic: its
    /// records are owed to no read (the gateway demands its pairs of every served task, so
    /// it fails closed on them), and where an owner joins a channel again, what its
    /// delivered past accounts for there (below its seed floor) is owed no more.
    pub fn set_read_scope(&mut self, scope: BTreeMap<ChannelId, Position>) {
        self.scope = Some(scope);
        self.model_records = RecordSet::new();
        self.by_key.clear();
        for id in 0..self.records.len() {
            let r = &self.records[id];
            if self.in_read_scope(&r.channel, r.position) {
                self.model_records.insert(id as RecordId);
                self.by_key.entry(r.key).or_default().insert(id as RecordId);
            }
        }
    }

    fn channel_name(&self, c: &ChannelId) -> String {
        match self.names.get(&c.topic) {
            Some(name) => format!("{name}/{}", c.partition),
            None => c.to_string(),
        }
    }

    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    pub fn violations(&self) -> &[Violation] {
        &self.violations
    }

    pub fn record(&self, id: RecordId) -> &RecordFacts {
        &self.records[id as usize]
    }

    pub fn record_count(&self) -> usize {
        self.records.len()
    }

    fn violate(&mut self, kind: ViolationKind, detail: String) {
        // One run can break the same rule many times; the first few say enough.
        if self.violations.iter().filter(|v| v.kind == kind).count() < 5 {
            self.violations.push(Violation { kind, step: self.step, detail });
        }
    }

    /// Reports a violation the world detected (wedge, refusals, reads never covered).
    pub fn report(&mut self, kind: ViolationKind, detail: String) {
        self.violate(kind, detail);
    }

    fn describe(&self, id: RecordId) -> String {
        let r = &self.records[id as usize];
        format!("#{id}({}@{} by {:?})", self.channel_name(&r.channel), r.position, r.author)
    }

    /// Registers a delivering party; returns its index.
    pub fn add_receiver(&mut self, name: &str, actor: Option<Actor>, received: &[ChannelId]) -> usize {
        self.receivers.push(Receiver {
            name: name.to_string(),
            actor,
            received: received.iter().copied().collect(),
            started: false,
            relevant: RecordSet::new(),
            baseline: BTreeMap::new(),
            committed: RecordSet::new(),
            staged: Vec::new(),
            staged_receipts: RecordSet::new(),
            awaiting_resume: BTreeSet::new(),
            next_committed: BTreeMap::new(),
            next_staged: BTreeMap::new(),
            receipts: RecordSet::new(),
            staged_receipt_ids: Vec::new(),
            fed: BTreeMap::new(),
            floor: BTreeMap::new(),
            budget: None,
            db_applied: RecordSet::new(),
        });
        self.receivers.len() - 1
    }

    /// The receiver's first start: history below `baselines` is outside its scope.
    pub fn start(&mut self, receiver: usize, baselines: &[(ChannelId, Position)]) {
        let rc = &mut self.receivers[receiver];
        if rc.started {
            return;
        }
        rc.started = true;
        for &(channel, baseline) in baselines {
            rc.baseline.insert(channel, baseline);
            let ids = self.by_channel.get(&channel).map(Vec::as_slice).unwrap_or(&[]);
            let first = ids.partition_point(|&id| self.records[id as usize].position < baseline);
            for &id in &ids[..first] {
                rc.relevant.remove(id);
            }
            rc.next_committed.insert(channel, first);
            rc.next_staged.insert(channel, first);
        }
    }

    /// A record was appended at `(channel, position)` by `author`; returns its id.
    pub fn sent(
        &mut self,
        channel: ChannelId,
        position: Position,
        key: u16,
        author: Actor,
        in_txn: bool,
        corrupt: bool,
    ) -> RecordId {
        let id = self.records.len() as RecordId;
        let hist = self.knowledge.get(&author).cloned().unwrap_or_default();
        let stamped = hist.minus(&self.deleted);
        let read_knowledge = match author {
            Actor::Client(c) => Some(self.clients.entry(c).or_default().via_reads.clone()),
            _ => None,
        };
        let status = if in_txn { RecordStatus::Open } else { RecordStatus::Committed };
        self.records.push(RecordFacts {
            channel,
            position,
            key,
            author,
            status,
            corrupt,
            hist,
            stamped,
            read_knowledge,
            header_len: 0,
        });
        let ids = self.by_channel.entry(channel).or_default();
        assert!(ids.last().is_none_or(|&last| self.records[last as usize].position < position), "appends grow");
        ids.push(id);
        if !in_txn {
            self.committed.insert(id);
        }
        if self.in_read_scope(&channel, position) {
            self.model_records.insert(id);
            self.by_key.entry(key).or_default().insert(id);
        }
        for rc in &mut self.receivers {
            if rc.received.contains(&channel) && rc.baseline.get(&channel).is_none_or(|&b| position >= b) {
                rc.relevant.insert(id);
            }
        }
        match author {
            // Session order: an edge producer's or client's write is a cause of its later ones.
            Actor::Edge(_) | Actor::Client(_) => {
                self.knowledge.entry(author).or_default().insert(id);
                if let Actor::Client(c) = author {
                    let facts = self.clients.entry(c).or_default();
                    facts.own.insert(id);
                    facts.required.insert(id);
                }
            }
            // A process's own sends are not its causes: only deliveries are.
            Actor::Process(_) => {}
        }
        id
    }

    pub fn txn_ended(&mut self, ids: &[RecordId], commit: bool) {
        for &id in ids {
            self.records[id as usize].status = if commit { RecordStatus::Committed } else { RecordStatus::Aborted };
            if commit {
                self.committed.insert(id);
            }
        }
    }

    pub fn log_start_advanced(&mut self, channel: ChannelId, log_start: Position) {
        let start = self.log_start.entry(channel).or_insert(log_start);
        *start = (*start).max(log_start);
        for &id in self.by_channel.get(&channel).map(Vec::as_slice).unwrap_or(&[]) {
            if self.records[id as usize].position < log_start {
                self.gone.insert(id);
            }
        }
    }

    pub fn topic_deleted(&mut self, topic: TopicId) {
        self.deleted_topics.insert(topic);
        for (channel, ids) in &self.by_channel {
            if channel.topic == topic {
                for &id in ids {
                    self.gone.insert(id);
                    self.deleted.insert(id);
                }
            }
        }
    }

    /// Judges one delivery by `receiver` of the record at `(channel, position)`, whose
    /// payload says it is record `payload_id`.
    pub fn delivered(&mut self, receiver: usize, channel: ChannelId, position: Position, payload_id: RecordId) {
        self.deliveries_checked += 1;
        let name = self.receivers[receiver].name.clone();
        let ids: Vec<RecordId> = self.by_channel.get(&channel).cloned().unwrap_or_default();
        let Ok(index) = ids.binary_search_by_key(&position, |&id| self.records[id as usize].position) else {
            self.violate(
                ViolationKind::PayloadMismatch,
                format!("{name} delivered {channel}@{position}, where no record was sent"),
            );
            return;
        };
        let id = ids[index];
        let below = self.log_start.get(&channel).is_some_and(|&start| position < start);
        if below && self.receivers[receiver].actor.is_none() {
            self.deliveries_below_log_start += 1;
        }
        if id != payload_id {
            self.violate(
                ViolationKind::PayloadMismatch,
                format!(
                    "{name} delivered {channel}@{position} carrying record #{payload_id}, but #{id} is stored there"
                ),
            );
        }
        let rc = &self.receivers[receiver];
        let already = rc.committed.contains(id) || rc.staged.contains(&id);
        if already {
            self.violate(ViolationKind::Duplicate, format!("{name} delivered {} a second time", self.describe(id)));
        }
        if self.records[id as usize].corrupt {
            self.violate(
                ViolationKind::UndecodableDelivered,
                format!("{name} delivered {}, whose causes header is damaged", self.describe(id)),
            );
        }
        // FIFO: the record must be the next committed record of its channel not yet delivered.
        let rc = &self.receivers[receiver];
        let mut next = rc.next_staged.get(&channel).copied().unwrap_or(0);
        while next < ids.len() && self.records[ids[next] as usize].status == RecordStatus::Aborted {
            next += 1;
        }
        let resuming = self.receivers[receiver].awaiting_resume.remove(&channel);
        if resuming && (already || next != index) {
            let detail = match ids.get(next) {
                _ if already => format!("after a restart {name} delivered {} again", self.describe(id)),
                Some(&e) => format!(
                    "after a restart {name} resumed {} at {}, not at {}, the record after its last committed delivery",
                    self.channel_name(&channel),
                    self.describe(id),
                    self.describe(e)
                ),
                None => format!("after a restart {name} delivered {} out of position order", self.describe(id)),
            };
            self.violate(ViolationKind::RestartOrder, detail);
        }
        if !already && next != index {
            let detail = match ids.get(next) {
                Some(&e) if next < index => format!(
                    "{name} delivered {} while {} ({:?}) before it on the channel was not yet delivered",
                    self.describe(id),
                    self.describe(e),
                    self.records[e as usize].status
                ),
                _ => format!("{name} delivered {} out of position order", self.describe(id)),
            };
            self.violate(ViolationKind::Fifo, detail);
        }
        if self.receivers[receiver].floor.get(&channel).is_some_and(|&first| index < first) {
            let detail = format!(
                "{name} delivered {} on {}, which joined its scope above it: its delivered past already accounted \
                 for it",
                self.describe(id),
                self.channel_name(&channel)
            );
            self.violate(ViolationKind::BehindSeedFloor, detail);
        }
        // Causal order: every stamped cause on a received channel delivered first.
        let rc = &self.receivers[receiver];
        let facts = &self.records[id as usize];
        let mut missing = facts.stamped.missing(&rc.relevant, &rc.committed);
        missing.retain(|m| !rc.staged.contains(m));
        let mut found = Vec::new();
        for a in missing.into_iter().take(3) {
            let cause = &self.records[a as usize];
            let kind = match (facts.author, cause.author) {
                (Actor::Client(w), Actor::Client(c)) if w == c => ViolationKind::MonotonicWrites,
                _ if facts.read_knowledge.as_ref().is_some_and(|k| k.contains(a)) => ViolationKind::WritesFollowReads,
                _ => ViolationKind::CausalOrder,
            };
            found.push((kind, format!("{name} delivered {} before its cause {}", self.describe(id), self.describe(a))));
        }
        for (kind, detail) in found {
            self.violate(kind, detail);
        }
        let rc = &mut self.receivers[receiver];
        if !already {
            rc.staged.push(id);
            if index + 1 > next {
                rc.next_staged.insert(channel, index + 1);
            }
        }
    }

    /// `receiver` received record `id` (whether it held or delivered it). A delivering
    /// process's frontier must contain every cause of every record it received, so from
    /// the step's commit on its sends must express them: receipt is knowledge, as delivery
    /// is (the record itself becomes a cause only when delivered).
    pub fn received(&mut self, receiver: usize, id: RecordId) {
        let hist = &self.records[id as usize].hist;
        let rc = &mut self.receivers[receiver];
        if rc.actor.is_some() {
            rc.staged_receipts.union_with(hist);
        }
        rc.staged_receipt_ids.push(id);
    }

    /// Record `id`'s value is one the projection rejects for good: a task must refuse
    /// `PROJECTION_REJECTED` there, and its rows must never show it.
    pub fn poison(&mut self, id: RecordId) {
        self.poison.insert(id);
    }

    pub fn is_poison(&self, id: RecordId) -> bool {
        self.poison.contains(id)
    }

    /// The database applied `ids` to `receiver`'s rows, in this order, in one commit —
    /// whichever execution sent it (the owner, or a zombie whose late step got through).
    /// Judged on what the rows hold, not on any execution's deliveries: each record is
    /// applied once, after every stamped cause on a received channel, and never a record
    /// the projection rejects.
    pub fn applied(&mut self, receiver: usize, ids: &[RecordId]) {
        let name = self.receivers[receiver].name.clone();
        for &id in ids {
            let mut found = Vec::new();
            if self.receivers[receiver].db_applied.contains(id) {
                found.push((
                    ViolationKind::Duplicate,
                    format!("the rows of {name} got {} applied a second time", self.describe(id)),
                ));
            }
            if self.poison.contains(id) {
                found.push((
                    ViolationKind::MissedRefusal,
                    format!("the rows of {name} show {}, which its projection rejects", self.describe(id)),
                ));
            }
            let rc = &self.receivers[receiver];
            for a in self.records[id as usize].stamped.missing(&rc.relevant, &rc.db_applied).into_iter().take(3) {
                let detail = format!(
                    "the rows of {name} got {} applied before its cause {}",
                    self.describe(id),
                    self.describe(a)
                );
                found.push((ViolationKind::CausalOrder, detail));
            }
            for (kind, detail) in found {
                self.violate(kind, detail);
            }
            self.receivers[receiver].db_applied.insert(id);
        }
    }

    /// What a read arriving now must show, whoever asks: every record the rows of
    /// `receivers` (the tasks serving it) hold, of `key` only if it reads one key.
    pub fn fresh_floor(&self, receivers: &[usize], key: Option<u16>) -> RecordSet {
        let mut floor = RecordSet::new();
        for &r in receivers {
            floor.union_with(&self.receivers[r].db_applied);
        }
        match key {
            Some(k) => match self.by_key.get(&k) {
                Some(of_key) => floor.minus(&floor.minus(of_key)),
                None => RecordSet::new(),
            },
            None => floor,
        }
    }

    /// Judges a served read's freshness: `observed` must hold every record of `floor`
    /// ([`Oracle::fresh_floor`] when the read arrived).
    pub fn judge_fresh(&mut self, floor: &RecordSet, observed: &[RecordId], what: &str) {
        let mut seen = RecordSet::new();
        for &id in observed {
            seen.insert(id);
        }
        let missing = floor.minus(&seen);
        let first = missing.iter().next();
        if let Some(m) = first {
            let detail = format!(
                "{what} lacks {} ({} record(s) in all), committed before the read arrived",
                self.describe(m),
                missing.len()
            );
            self.violate(ViolationKind::NotFresh, detail);
        }
    }

    /// The receiver's step committed: its deliveries and receipts stand.
    pub fn commit(&mut self, receiver: usize) {
        let rc = &mut self.receivers[receiver];
        let staged = std::mem::take(&mut rc.staged);
        let receipts = std::mem::take(&mut rc.staged_receipts);
        for id in std::mem::take(&mut rc.staged_receipt_ids) {
            rc.receipts.insert(id);
        }
        for &id in &staged {
            rc.committed.insert(id);
        }
        rc.next_committed = rc.next_staged.clone();
        if let Some(actor) = rc.actor {
            let mut learned = receipts;
            for &id in &staged {
                learned.insert(id);
                learned.union_with(&self.records[id as usize].hist);
            }
            self.knowledge.entry(actor).or_default().union_with(&learned);
        }
    }

    /// The receiver's step rolled back (abort or crash): its deliveries never happened, and
    /// it goes on with an engine restored from what it committed, whose first delivery on
    /// each channel must repeat nothing and resume where its committed deliveries end.
    pub fn discard(&mut self, receiver: usize) {
        let rc = &mut self.receivers[receiver];
        rc.staged.clear();
        rc.staged_receipts = RecordSet::new();
        rc.staged_receipt_ids.clear();
        rc.fed.clear();
        rc.next_staged = rc.next_committed.clone();
        rc.awaiting_resume = rc.received.clone();
    }

    /// Judges a read served to client `client`: `observed` are the record ids the served
    /// rows reflect; `key` is the single key read, or `None` for a whole collection.
    pub fn read(&mut self, client: u32, key: Option<u16>, observed: &[RecordId], what: &str) {
        self.reads_checked += 1;
        // Retention excuses a cause only on a channel the model does not receive, as the
        // log start stands now; a deleted topic's records are excused everywhere (their pairs
        // leave the token with the topic). On the model's own channels a cause is required
        // whatever the log start: its owner delivers it or refuses, and the read waits.
        let mut excused = self.gone.minus(&self.model_records);
        excused.union_with(&self.deleted);
        let required = self.clients.entry(client).or_default().required.minus(&excused);
        let scope = match key {
            Some(k) => self.by_key.get(&k).cloned().unwrap_or_default(),
            None => self.model_records.clone(),
        };
        let observed_set: RecordSet = observed.iter().copied().collect();
        let missing = required.missing(&scope, &observed_set);
        let facts = self.clients.entry(client).or_default();
        let labelled: Vec<(ViolationKind, RecordId)> = missing
            .into_iter()
            .filter(|&m| !self.records[m as usize].corrupt)
            .map(|m| {
                let kind = if facts.own.contains(m) {
                    ViolationKind::ReadYourWrites
                } else if facts.seen.contains(m) {
                    ViolationKind::MonotonicReads
                } else {
                    ViolationKind::StaleRead
                };
                (kind, m)
            })
            .collect();
        for (kind, m) in labelled.into_iter().take(3) {
            let detail = format!("client {client}'s {what} did not reflect {}", self.describe(m));
            self.violate(kind, detail);
        }
        // Knowledge is closed under history, so a record already learned through a read
        // brings nothing new.
        let mut learned = RecordSet::new();
        let mut now_required = RecordSet::new();
        let known = &self.clients.entry(client).or_default().via_reads;
        for &o in observed {
            if !known.contains(o) {
                learned.insert(o);
                learned.union_with(&self.records[o as usize].hist);
                now_required.insert(o);
                now_required.union_with(&self.records[o as usize].hist);
            }
        }
        let facts = self.clients.entry(client).or_default();
        facts.seen.union_with(&observed_set);
        facts.via_reads.union_with(&learned);
        facts.required.union_with(&now_required);
        self.knowledge.entry(Actor::Client(client)).or_default().union_with(&learned);
    }

    /// The first record on `channel` that retention has passed and `receiver` has not
    /// delivered — counting the step in progress, which commits with whatever a check
    /// concludes. Once such a record is below the log start, senders may drop pairs naming
    /// it, so nothing orders later records after it: the receiver must stop.
    pub fn passed_undelivered(&self, receiver: usize, channel: &ChannelId) -> Option<RecordId> {
        let log_start = self.log_start.get(channel).copied()?;
        let rc = &self.receivers[receiver];
        let ids = self.by_channel.get(channel)?;
        ids.iter()
            .copied()
            .take_while(|&id| self.records[id as usize].position < log_start)
            .filter(|&id| rc.relevant.contains(id) && self.records[id as usize].status == RecordStatus::Committed)
            .find(|&id| !rc.committed.contains(id) && !rc.staged.contains(&id))
    }

    /// Why a `POSITIONS_DISCARDED_UNREAD` refusal by `receiver` on `channel` from
    /// `position` is not due, or `None` when it is: retention passed a record the receiver
    /// had not delivered, and `position` lies after the last record it delivered there and
    /// at or before the first it did not (between them lie only offsets that hold no
    /// deliverable record: markers and aborted records).
    pub fn discard_refusal_unjustified(
        &self,
        receiver: usize,
        channel: &ChannelId,
        position: Option<Position>,
    ) -> Option<String> {
        let name = &self.receivers[receiver].name;
        let Some(first) = self.passed_undelivered(receiver, channel) else {
            let log_start = self.log_start.get(channel).copied().unwrap_or(0);
            return Some(format!(
                "retention (log start {log_start}) passed no record of {} that {name} had not delivered",
                self.channel_name(channel)
            ));
        };
        let rc = &self.receivers[receiver];
        let last_delivered = self.by_channel[channel]
            .iter()
            .copied()
            .filter(|&id| rc.committed.contains(id) || rc.staged.contains(&id))
            .map(|id| self.records[id as usize].position)
            .max();
        let first_position = self.records[first as usize].position;
        match position {
            Some(p) if last_delivered.is_none_or(|d| d < p) && p <= first_position => None,
            _ => Some(format!(
                "{name} refused {} from {position:?}, but retention passed {} (first undelivered) after it delivered \
                 up to {last_delivered:?}",
                self.channel_name(channel),
                self.describe(first)
            )),
        }
    }

    /// The receiver's host checked `channel`'s log start and the receiver went on: nothing
    /// it had not delivered may be below the log start.
    pub fn log_start_accepted(&mut self, receiver: usize, channel: &ChannelId) {
        if let Some(first) = self.passed_undelivered(receiver, channel) {
            let log_start = self.log_start.get(channel).copied().unwrap_or(0);
            let detail = format!(
                "{} went on past log start {log_start} of {}, though retention discarded {}, which it had not \
                 delivered",
                self.receivers[receiver].name,
                self.channel_name(channel),
                self.describe(first)
            );
            self.violate(ViolationKind::MissedRefusal, detail);
        }
    }

    /// Records a record's `parsley.causes` value length, as written.
    pub fn header_written(&mut self, id: RecordId, len: usize) {
        self.records[id as usize].header_len = len;
    }

    /// The receiver's metadata budget, judged by [`Oracle::over_budget`] and
    /// [`Oracle::stamp_over_budget`].
    pub fn set_budget(&mut self, receiver: usize, budget: usize) {
        self.receivers[receiver].budget = Some(budget);
    }

    /// Whether record `id`'s causes value is larger than the receiver's budget: its receipt
    /// must be refused `METADATA_BUDGET_EXCEEDED`.
    pub fn over_budget(&self, receiver: usize, id: RecordId) -> bool {
        self.receivers[receiver].budget.is_some_and(|b| self.records[id as usize].header_len > b)
    }

    /// Whether a send by `receiver` now must be refused `METADATA_BUDGET_EXCEEDED`: the
    /// value naming every channel of what it knows (its deliveries, their histories, the
    /// histories of what it received; deleted topics aside) is larger than its budget. The
    /// value's size follows from the frozen grammar alone: a version byte, a varint topic
    /// count, per topic 16 bytes and a varint partition count, per channel a varint
    /// partition and an 8-byte position.
    pub fn stamp_over_budget(&self, receiver: usize) -> bool {
        let rc = &self.receivers[receiver];
        let (Some(budget), Some(actor)) = (rc.budget, rc.actor) else { return false };
        let Some(known) = self.knowledge.get(&actor) else { return false };
        let channels: BTreeSet<ChannelId> = (self.by_channel.iter())
            .filter(|(_, ids)| ids.iter().any(|&id| known.contains(id) && !self.deleted.contains(id)))
            .map(|(c, _)| *c)
            .collect();
        if channels.is_empty() {
            return false;
        }
        let varint = |v: usize| {
            if v < 128 {
                1
            } else if v < 1 << 14 {
                2
            } else if v < 1 << 21 {
                3
            } else {
                4
            }
        };
        let mut topics: BTreeMap<TopicId, usize> = BTreeMap::new();
        let mut size = 1;
        for c in &channels {
            *topics.entry(c.topic).or_default() += 1;
            size += varint(c.partition as usize) + 8;
        }
        size += varint(topics.len()) + topics.values().map(|&n| 16 + varint(n)).sum::<usize>();
        size > budget
    }

    /// The receiver's host fed `position` on `channel`: whether that is an out-of-order
    /// feed (at or below a position already fed there since its last start), which the
    /// engine must refuse `OUT_OF_ORDER_FEED`.
    pub fn fed(&mut self, receiver: usize, channel: ChannelId, position: Position) -> bool {
        let fed = self.receivers[receiver].fed.entry(channel).or_insert(-1);
        let out_of_order = position <= *fed;
        *fed = (*fed).max(position);
        out_of_order
    }

    /// The receiver's engine was restored (a new execution): what it fed before may be fed
    /// again (a replay the engine drops), so no position counts as fed any more.
    pub fn restored(&mut self, receiver: usize) {
        self.receivers[receiver].fed.clear();
    }

    /// The first record on `channel` the receiver received in a committed step and has not
    /// delivered: while one exists, a declaration without the channel must be refused
    /// `CHANNEL_REMOVED_WITH_HELD_MESSAGES`.
    pub fn held_on(&self, receiver: usize, channel: &ChannelId) -> Option<RecordId> {
        let rc = &self.receivers[receiver];
        let ids = self.by_channel.get(channel)?;
        ids.iter().copied().find(|&id| rc.receipts.contains(id) && !rc.committed.contains(id))
    }

    /// A received channel whose topic was deleted (its name now names another topic):
    /// restoring the receiver's state must be refused `CHANNEL_IDENTITY_CHANGED`.
    pub fn identity_changed(&self, receiver: usize) -> Option<ChannelId> {
        self.receivers[receiver].received.iter().copied().find(|c| self.deleted_topics.contains(&c.topic))
    }

    /// The receiver no longer receives `channel` (a new declaration, at a restart): what it
    /// did not deliver there is owed no more, and no cause there holds its deliveries.
    pub fn leave(&mut self, receiver: usize, channel: ChannelId) {
        let ids = self.by_channel.get(&channel).cloned().unwrap_or_default();
        let rc = &mut self.receivers[receiver];
        rc.received.remove(&channel);
        rc.awaiting_resume.remove(&channel);
        for id in ids {
            if !rc.committed.contains(id) {
                rc.relevant.remove(id);
            }
        }
    }

    /// The receiver starts receiving `channel` at a restart, from `log_start`: the records
    /// its delivered past already accounts for there (those it delivered, and every cause
    /// of what it delivered, up to the highest such position: the seed floor) are outside
    /// its scope, and must never be delivered; every later record at or above the log
    /// start is owed. Returns the first position in scope.
    pub fn join(&mut self, receiver: usize, channel: ChannelId, log_start: Position) -> Position {
        let ids = self.by_channel.get(&channel).cloned().unwrap_or_default();
        let rc = &self.receivers[receiver];
        let accounted = |id: RecordId| {
            rc.committed.contains(id)
                || rc.committed.iter().any(|d| {
                    let facts = &self.records[d as usize];
                    facts.stamped.contains(id)
                })
        };
        let floor = ids.iter().rev().copied().find(|&id| accounted(id)).map(|id| self.records[id as usize].position);
        let first_position = floor.map_or(log_start, |f| (f + 1).max(log_start));
        let first = ids.partition_point(|&id| self.records[id as usize].position < first_position);
        let rc = &mut self.receivers[receiver];
        rc.received.insert(channel);
        rc.baseline.insert(channel, first_position);
        rc.floor.insert(channel, first);
        rc.next_committed.insert(channel, first);
        rc.next_staged.insert(channel, first);
        for &id in &ids[first..] {
            rc.relevant.insert(id);
        }
        first_position
    }

    /// At quiescence: every committed record on the receiver's channels was delivered.
    pub fn check_complete(&mut self, receiver: usize) {
        let rc = &self.receivers[receiver];
        let mut missing = rc.relevant.missing(&self.committed, &rc.committed);
        missing.retain(|&m| !self.records[m as usize].corrupt);
        let name = rc.name.clone();
        for m in missing.into_iter().take(3) {
            let detail = format!("{name} never delivered {}", self.describe(m));
            self.violate(ViolationKind::Incomplete, detail);
        }
    }
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
    fn kinds(o: &Oracle) -> Vec<ViolationKind> {
        o.violations().iter().map(|v| v.kind).collect()
    }

    /// A model of two topics (1 and 2), one task receiving partition 0 of both.
    fn model() -> (Oracle, usize) {
        let mut o = Oracle::new([topic(1), topic(2)]);
        let task = o.add_receiver("task0", None, &[ch(1, 0), ch(2, 0)]);
        o.start(task, &[(ch(1, 0), 0), (ch(2, 0), 0)]);
        (o, task)
    }

    #[test]
    fn an_effect_before_its_cause_is_flagged_and_labelled_by_session() {
        let (mut o, task) = model();
        let a = o.sent(ch(1, 0), 0, 1, Actor::Client(0), false, false);
        let b = o.sent(ch(2, 0), 0, 1, Actor::Client(0), false, false);
        o.delivered(task, ch(2, 0), 0, b);
        assert_eq!(kinds(&o), vec![ViolationKind::MonotonicWrites]);
        // In the other order nothing is wrong.
        let (mut o, task) = model();
        let a2 = o.sent(ch(1, 0), 0, 1, Actor::Edge(0), false, false);
        let b2 = o.sent(ch(2, 0), 0, 1, Actor::Edge(0), false, false);
        o.delivered(task, ch(1, 0), 0, a2);
        o.delivered(task, ch(2, 0), 0, b2);
        o.commit(task);
        o.check_complete(task);
        assert!(o.violations().is_empty(), "{:?}", o.violations());
        assert_eq!((a, b), (a2, b2));
    }

    /// A pair is dropped from what a send stamps only with its channel: a cause retention
    /// passed before the effect was sent is still a cause the receiver must deliver first
    /// (or refuse at its channel), so delivering the effect without it is effect before
    /// cause. A cause whose topic was deleted is not expressed any more.
    #[test]
    fn a_cause_below_the_log_start_when_the_effect_was_sent_is_still_required_first() {
        let (mut o, task) = model();
        let a = o.sent(ch(1, 0), 0, 1, Actor::Edge(0), false, false);
        o.log_start_advanced(ch(1, 0), 1);
        let b = o.sent(ch(2, 0), 0, 1, Actor::Edge(0), false, false);
        assert!(o.record(b).stamped.contains(a) && o.record(b).hist.contains(a));
        o.delivered(task, ch(2, 0), 0, b);
        assert_eq!(kinds(&o), vec![ViolationKind::CausalOrder]);

        let (mut o, task) = model();
        o.sent(ch(1, 0), 0, 1, Actor::Edge(0), false, false);
        o.topic_deleted(topic(1));
        let b = o.sent(ch(2, 0), 0, 1, Actor::Edge(0), false, false);
        o.delivered(task, ch(2, 0), 0, b);
        assert!(o.violations().is_empty(), "{:?}", o.violations());
    }

    /// A read must reflect a cause on the model's own channels whatever the log start: a
    /// cause retention passed before its effect was sent is still in the session's past once
    /// a read returned the effect (the token keeps its pair, and a read keeps demanding a
    /// pair on a received channel). Only a deleted topic's records are excused there.
    #[test]
    fn reads_require_causes_on_the_models_channels_whatever_the_log_start() {
        let (mut o, _) = model();
        let a = o.sent(ch(1, 0), 0, 5, Actor::Client(0), false, false);
        o.log_start_advanced(ch(1, 0), 1);
        let b = o.sent(ch(2, 0), 0, 6, Actor::Client(0), false, false);
        o.read(1, Some(6), &[b], "read of k6");
        o.read(1, Some(5), &[], "read of k5");
        assert_eq!(kinds(&o), vec![ViolationKind::StaleRead]);
        o.read(1, Some(5), &[a], "read of k5 again");
        assert_eq!(o.violations().len(), 1);

        let (mut o, _) = model();
        o.sent(ch(1, 0), 0, 5, Actor::Client(0), false, false);
        let b = o.sent(ch(2, 0), 0, 6, Actor::Client(0), false, false);
        o.read(1, Some(6), &[b], "read of k6");
        o.topic_deleted(topic(1));
        o.read(1, Some(5), &[], "read of k5");
        assert!(o.violations().is_empty(), "{:?}", o.violations());
    }

    #[test]
    fn process_knowledge_comes_from_committed_deliveries_only() {
        let mut o = Oracle::new([topic(1)]);
        let p = o.add_receiver("P0", Some(Actor::Process(0)), &[ch(9, 0)]);
        o.start(p, &[(ch(9, 0), 0)]);
        let task = o.add_receiver("task0", None, &[ch(1, 0), ch(9, 0)]);
        o.start(task, &[(ch(1, 0), 0), (ch(9, 0), 0)]);
        let x = o.sent(ch(9, 0), 0, 0, Actor::Edge(0), false, false);
        o.delivered(p, ch(9, 0), 0, x);
        o.discard(p);
        let y = o.sent(ch(1, 0), 0, 0, Actor::Process(0), false, false);
        o.delivered(p, ch(9, 0), 0, x);
        o.commit(p);
        let z = o.sent(ch(1, 0), 1, 0, Actor::Process(0), false, false);
        assert!(o.record(y).hist.is_empty(), "a discarded delivery taught nothing");
        assert!(o.record(z).hist.contains(x));
        o.delivered(task, ch(1, 0), 0, y);
        o.delivered(task, ch(1, 0), 1, z);
        assert_eq!(kinds(&o), vec![ViolationKind::CausalOrder]);
    }

    /// Receipt is knowledge: a process that received `x` and holds it must express `x`'s
    /// causes on what it sends next (its frontier merged them), though not `x` itself; a
    /// receipt in a step that rolled back teaches nothing.
    #[test]
    fn process_knowledge_grows_by_receipt_of_causes() {
        let (mut o, task) = model();
        let p = o.add_receiver("P0", Some(Actor::Process(0)), &[ch(9, 0)]);
        o.start(p, &[(ch(9, 0), 0)]);
        let w = o.sent(ch(2, 0), 0, 1, Actor::Edge(0), false, false);
        let x = o.sent(ch(9, 0), 0, 1, Actor::Edge(0), false, false);
        o.received(p, x);
        o.discard(p);
        let y0 = o.sent(ch(1, 0), 0, 1, Actor::Process(0), false, false);
        assert!(o.record(y0).hist.is_empty(), "a rolled-back receipt taught nothing");
        o.received(p, x);
        o.commit(p);
        let y = o.sent(ch(1, 0), 1, 1, Actor::Process(0), false, false);
        assert!(o.record(y).stamped.contains(w) && !o.record(y).hist.contains(x));
        o.delivered(task, ch(1, 0), 0, y0);
        o.delivered(task, ch(1, 0), 1, y);
        assert_eq!(kinds(&o), vec![ViolationKind::CausalOrder]);
    }

    #[test]
    fn fifo_duplicates_aborts_and_completeness() {
        let (mut o, task) = model();
        let r0 = o.sent(ch(1, 0), 0, 1, Actor::Process(0), true, false);
        let r1 = o.sent(ch(1, 0), 2, 1, Actor::Process(0), false, false);
        let r2 = o.sent(ch(1, 0), 3, 1, Actor::Process(0), false, false);
        o.txn_ended(&[r0], false);
        // The aborted record is skipped by FIFO and by completeness.
        o.delivered(task, ch(1, 0), 2, r1);
        o.commit(task);
        assert!(o.violations().is_empty(), "{:?}", o.violations());
        o.delivered(task, ch(1, 0), 2, r1);
        assert_eq!(kinds(&o), vec![ViolationKind::Duplicate]);
        o.discard(task);
        o.check_complete(task);
        assert_eq!(kinds(&o), vec![ViolationKind::Duplicate, ViolationKind::Incomplete]);
        let (mut o, task) = model();
        let _ = o.sent(ch(1, 0), 0, 1, Actor::Process(0), false, false);
        let s1 = o.sent(ch(1, 0), 1, 1, Actor::Process(0), false, false);
        o.delivered(task, ch(1, 0), 1, s1);
        assert_eq!(kinds(&o), vec![ViolationKind::Fifo]);
        let _ = r2;
    }

    /// After a rollback the receiver must resume each channel at the record after its last
    /// committed delivery and repeat none; a rolled-back delivery may (must) come again.
    #[test]
    fn after_a_restart_nothing_is_delivered_again_and_each_channel_resumes_in_order() {
        let (mut o, task) = model();
        let a = o.sent(ch(1, 0), 0, 1, Actor::Edge(0), false, false);
        let b = o.sent(ch(1, 0), 1, 1, Actor::Edge(0), false, false);
        let c = o.sent(ch(1, 0), 2, 1, Actor::Edge(0), false, false);
        o.delivered(task, ch(1, 0), 0, a);
        o.commit(task);
        o.delivered(task, ch(1, 0), 1, b);
        o.discard(task);
        o.delivered(task, ch(1, 0), 1, b);
        o.commit(task);
        assert!(o.violations().is_empty(), "{:?}", o.violations());
        o.discard(task);
        o.delivered(task, ch(1, 0), 1, b);
        assert_eq!(kinds(&o), vec![ViolationKind::Duplicate, ViolationKind::RestartOrder]);
        let (mut o, task) = model();
        let _ = o.sent(ch(1, 0), 0, 1, Actor::Edge(0), false, false);
        let c2 = o.sent(ch(1, 0), 1, 1, Actor::Edge(1), false, false);
        o.discard(task);
        o.delivered(task, ch(1, 0), 1, c2);
        assert_eq!(kinds(&o), vec![ViolationKind::RestartOrder, ViolationKind::Fifo]);
        let _ = c;
    }

    #[test]
    fn a_damaged_record_or_a_wrong_payload_is_flagged() {
        let (mut o, task) = model();
        let bad = o.sent(ch(1, 0), 0, 1, Actor::Edge(0), false, true);
        o.delivered(task, ch(1, 0), 0, bad);
        assert_eq!(kinds(&o), vec![ViolationKind::UndecodableDelivered]);
        let (mut o, task) = model();
        let a = o.sent(ch(1, 0), 0, 1, Actor::Edge(0), false, false);
        o.delivered(task, ch(1, 0), 0, a + 1);
        o.delivered(task, ch(2, 0), 7, a);
        assert_eq!(kinds(&o), vec![ViolationKind::PayloadMismatch, ViolationKind::PayloadMismatch]);
    }

    #[test]
    fn a_discard_refusal_is_due_exactly_when_retention_passed_an_undelivered_record() {
        let (mut o, task) = model();
        let a = o.sent(ch(1, 0), 0, 1, Actor::Edge(0), false, false);
        // Offset 1 holds no record (a transaction marker); b sits at 2, c at 3 (aborted).
        let b = o.sent(ch(1, 0), 2, 1, Actor::Edge(0), false, false);
        let c = o.sent(ch(1, 0), 3, 1, Actor::Process(0), true, false);
        o.txn_ended(&[c], false);
        o.delivered(task, ch(1, 0), 0, a);
        o.commit(task);
        // Retention passed only a delivered record: a check must pass, a refusal is not due.
        o.log_start_advanced(ch(1, 0), 2);
        o.log_start_accepted(task, &ch(1, 0));
        assert!(o.violations().is_empty(), "{:?}", o.violations());
        assert!(o.discard_refusal_unjustified(task, &ch(1, 0), Some(1)).is_some());
        // Retention passes b, which the task has not delivered: the refusal is due, from a
        // position after a and at or before b; going on past it is a missed refusal.
        o.log_start_advanced(ch(1, 0), 3);
        assert_eq!(o.passed_undelivered(task, &ch(1, 0)), Some(b));
        assert_eq!(o.discard_refusal_unjustified(task, &ch(1, 0), Some(1)), None);
        assert_eq!(o.discard_refusal_unjustified(task, &ch(1, 0), Some(2)), None);
        for wrong in [Some(0), Some(3), None] {
            assert!(o.discard_refusal_unjustified(task, &ch(1, 0), wrong).is_some(), "{wrong:?}");
        }
        assert!(o.discard_refusal_unjustified(task, &ch(2, 0), Some(0)).is_some(), "the other channel lost nothing");
        o.log_start_accepted(task, &ch(1, 0));
        assert_eq!(kinds(&o), vec![ViolationKind::MissedRefusal]);
        // A delivery in the step in progress counts (the step commits with the check's
        // outcome); a rolled-back one does not; an aborted record is never owed.
        let (mut o, task) = model();
        let a = o.sent(ch(1, 0), 0, 1, Actor::Edge(0), false, false);
        let c = o.sent(ch(1, 0), 1, 1, Actor::Process(0), true, false);
        o.txn_ended(&[c], false);
        o.log_start_advanced(ch(1, 0), 2);
        o.delivered(task, ch(1, 0), 0, a);
        o.log_start_accepted(task, &ch(1, 0));
        assert!(o.violations().is_empty(), "{:?}", o.violations());
        o.discard(task);
        assert_eq!(o.passed_undelivered(task, &ch(1, 0)), Some(a));
        o.log_start_accepted(task, &ch(1, 0));
        assert_eq!(kinds(&o), vec![ViolationKind::MissedRefusal]);
    }

    #[test]
    fn reads_must_reflect_the_sessions_writes_and_what_it_saw() {
        let (mut o, _) = model();
        let w = o.sent(ch(1, 0), 0, 5, Actor::Client(0), false, false);
        o.read(0, Some(5), &[], "read of k5");
        assert_eq!(kinds(&o), vec![ViolationKind::ReadYourWrites]);
        // A read of another key does not need w; a collection read does.
        o.read(0, Some(6), &[], "read of k6");
        assert_eq!(o.violations().len(), 1);
        o.read(0, None, &[w], "collection read");
        assert_eq!(o.violations().len(), 1);
        // Client 1 reads x (by an edge producer, after its write v): later reads of v's
        // key must show v (causal past), and of x's key must show x (monotonic reads).
        let v = o.sent(ch(2, 0), 0, 7, Actor::Edge(0), false, false);
        let x = o.sent(ch(1, 0), 1, 8, Actor::Edge(0), false, false);
        o.read(1, Some(8), &[x], "read of k8");
        o.read(1, Some(7), &[], "read of k7");
        o.read(1, Some(8), &[], "read of k8 again");
        assert_eq!(
            kinds(&o),
            vec![ViolationKind::ReadYourWrites, ViolationKind::StaleRead, ViolationKind::MonotonicReads]
        );
        let _ = v;
    }
}
