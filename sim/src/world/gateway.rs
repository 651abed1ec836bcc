//! The world's gateways with kept snapshots (the `kept` scenario): each has a listener —
//! a queue of the notifications committed steps sent it, which the scheduler delivers late,
//! and loses when it drops the connection — the generations it counts, the snapshots it
//! keeps, and the barrier. Every decision about a kept snapshot is the core's
//! (`parsley::kept::KeptRules`, which the gateway calls too); the sabotages break those rules.
//!
//! A read arrives, consults what is kept (a barrier first: every queued notification is
//! heard, as Postgres delivers every notification committed before the barrier's statement
//! ahead of its answer), and is served from it, or runs its statement: it reads the
//! generation, then one snapshot of clock rows and data, and finishes in a later step —
//! steps commit and notifications are heard meanwhile — reading the generation again to
//! decide whether to keep the snapshot. The oracle judges every served read for freshness:
//! it shows every change its serving tasks committed before it arrived.

use std::collections::VecDeque;
use std::time::Duration;

use parsley::gate::ClockRow;
use parsley::kept::{Bump, Consult, Heard, KeptRules, KeptView};

use super::*;
use crate::bits::RecordSet;

/// Gateways in the `kept` scenario.
pub(super) const GATEWAYS: usize = 2;

/// Visitors in the `kept` scenario: readers without a session (an empty token), whose reads
/// any snapshot covers, so only freshness stands between them and a stale one.
pub(super) const VISITORS: usize = 2;

/// How long (in scheduler steps, one millisecond each) a kept snapshot may serve.
const MAX_AGE_STEPS: u64 = 150;

fn steps(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A snapshot kept by a gateway.
struct Snapshot {
    generation: u64,
    at: u64,
    rows: Vec<ClockRow>,
    observed: Vec<RecordId>,
}

#[derive(Default)]
pub(super) struct Gateway {
    connected: bool,
    /// Notifications committed and not yet heard, in commit order.
    queue: VecDeque<Heard>,
    model_generation: u64,
    task_generations: BTreeMap<u32, u64>,
    kept: BTreeMap<ReadKind, Snapshot>,
}

impl Gateway {
    pub(super) fn new() -> Gateway {
        Gateway { connected: true, ..Gateway::default() }
    }

    fn generation(&self, owner: Option<u32>) -> u64 {
        let tasks = match owner {
            Some(t) => self.task_generations.get(&t).copied().unwrap_or(0),
            None => self.task_generations.values().sum(),
        };
        self.model_generation + tasks
    }

    fn hear(&mut self, rules: &KeptRules, heard: Heard) {
        match rules.bump(heard) {
            Bump::Nothing => {}
            Bump::Task(t) => *self.task_generations.entry(t).or_default() += 1,
            Bump::Model | Bump::EveryModel => self.model_generation += 1,
        }
    }
}

/// A read whose statement ran and which finishes in a later step.
pub(super) struct InFlightRead {
    gateway: usize,
    kind: ReadKind,
    owner: Option<u32>,
    /// The generation read before the statement (`None`: nothing may be kept).
    before: Option<u64>,
    rows: Vec<ClockRow>,
    observed: Vec<RecordId>,
    refreshed: CausalPast,
    fresh: RecordSet,
    what: String,
}

impl World {
    /// A committed step of task `t` notifies every gateway that is listening; one that is
    /// not loses it.
    pub(super) fn notify_gateways(&mut self, t: usize) {
        for g in &mut self.gateways {
            if g.connected {
                g.queue.push_back(Heard::Task(t as u32));
            } else {
                self.stats.notifications_lost += 1;
            }
        }
    }

    pub(super) fn gateway_hear_one(&mut self, g: usize) {
        let rules = self.kept_rules;
        let gw = &mut self.gateways[g];
        if let Some(heard) = gw.queue.pop_front() {
            gw.hear(&rules, heard);
            self.stats.notifications_heard += 1;
            self.trace.push(format!("{} gateway{g} hears {heard:?}", self.step));
        }
    }

    /// The listener's connection drops: what was queued is lost, and nothing is heard until
    /// it connects again.
    pub(super) fn gateway_drop(&mut self, g: usize) {
        let rules = self.kept_rules;
        let gw = &mut self.gateways[g];
        self.stats.notifications_lost += gw.queue.len() as u64;
        gw.queue.clear();
        gw.connected = false;
        gw.hear(&rules, Heard::Lost);
        self.stats.listener_drops += 1;
        self.trace.push(format!("{} gateway{g} listener drops", self.step));
    }

    pub(super) fn gateway_connect(&mut self, g: usize) {
        let rules = self.kept_rules;
        let gw = &mut self.gateways[g];
        gw.connected = true;
        gw.hear(&rules, Heard::Connected);
        self.trace.push(format!("{} gateway{g} listener connects", self.step));
    }

    /// The enabled actions of the gateways' listeners.
    pub(super) fn gateway_actions(&self, push: &mut impl FnMut(Action, u32)) {
        let work = self.phase == Phase::Work;
        for v in 0..self.gateways.len().min(1) * VISITORS {
            let reader = self.clients.len() + v;
            if self.reads_in_flight.contains_key(&reader) {
                push(Action::ClientFinish(reader), 3);
            } else if work {
                // The key is drawn when the read is performed.
                push(Action::VisitorRead(v, ReadKind::Key(0)), 2);
                push(Action::VisitorRead(v, ReadKind::Collection), 1);
            }
        }
        for (g, gw) in self.gateways.iter().enumerate() {
            if !gw.queue.is_empty() {
                push(Action::GatewayHear(g), 3);
            }
            // Drops are rare next to everything else (drawable one step in five
            // only), but each loses what was queued and every notification until it is back.
            if gw.connected && work && self.step.is_multiple_of(5) {
                push(Action::GatewayDrop(g), 1);
            }
            if !gw.connected {
                push(Action::GatewayConnect(g), 1);
            }
        }
    }

    /// The tasks a read is served by, the receivers of their rows, and the key it reads.
    fn read_scope(&self, kind: ReadKind) -> (BTreeSet<u32>, Option<u32>, Vec<usize>, Option<u16>) {
        let (served, key_owner, key): (BTreeSet<u32>, Option<u32>, Option<u16>) = match kind {
            ReadKind::Key(k) => {
                let owner = self.owner_of_key[k as usize];
                ([owner].into(), Some(owner), Some(k))
            }
            ReadKind::Collection | ReadKind::Query => ((0..self.model.task_count).collect(), None, None),
        };
        let receivers = served.iter().map(|&t| self.tasks[t as usize].receiver).collect();
        (served, key_owner, receivers, key)
    }

    /// A client's read at a gateway: served from what the gateway keeps if the core's rules
    /// say so, else its statement runs now and the read finishes later
    /// ([`World::gateway_read_finish`]), or it waits.
    /// Reader `c` is a client (below `clients.len()`), or a visitor.
    pub(super) fn gateway_read(&mut self, c: usize, kind: ReadKind) {
        let g = self.rng.below(GATEWAYS as u64) as usize;
        let rules = self.kept_rules;
        let visitor = c >= self.clients.len();
        let taken = if visitor { CausalPast::new() } else { std::mem::take(&mut self.clients[c].token) };
        let token = self.prune_token(taken);
        let demand = self.read_demand(&token);
        let (served, key_owner, receivers, key) = self.read_scope(kind);
        let owner = rules.generation_owner(key_owner, &served);
        let who = if visitor { format!("V{}", c - self.clients.len()) } else { format!("C{c}") };
        let what = match kind {
            ReadKind::Key(k) => format!("{who}'s read of k{k} at gateway{g}"),
            ReadKind::Collection => format!("{who}'s collection read at gateway{g}"),
            ReadKind::Query => format!("{who}'s named query at gateway{g}"),
        };
        // What it must show: every change committed before it arrived.
        let fresh = self.oracle.fresh_floor(&receivers, key);
        let mut barrier_passed = false;
        loop {
            let gw = &self.gateways[g];
            let may_keep = gw.connected;
            let now = gw.generation(owner);
            // A named query's answer is never kept, nor looked up.
            let kept = gw.kept.get(&kind).filter(|_| kind != ReadKind::Query);
            let servable = kept.is_some_and(|k| {
                rules.servable(k.generation, Some(now), steps(self.step - k.at), steps(MAX_AGE_STEPS))
            });
            if kept.is_some() && !servable {
                self.gateways[g].kept.remove(&kind);
                self.stats.kept_dropped += 1;
                break;
            }
            let view = kept.map(|k| KeptView { servable, shape: &self.model, rows: &k.rows, served: &served });
            match rules.consult(view, may_keep, barrier_passed, &demand, &token) {
                Consult::Read => break,
                Consult::Barrier => {
                    let heard = self.gateways[g].queue.len() as u64;
                    while !self.gateways[g].queue.is_empty() {
                        self.gateway_hear_one(g);
                    }
                    self.stats.kept_barriers += 1;
                    self.stats.barrier_heard += heard;
                    barrier_passed = true;
                }
                Consult::Serve { refreshed } => {
                    let observed = kept.map(|k| k.observed.clone()).unwrap_or_default();
                    if !visitor {
                        self.oracle.read(c as u32, key, &observed, &format!("{what} (kept)"));
                    }
                    self.oracle.judge_fresh(&fresh, &observed, &format!("{what} (kept)"));
                    self.stats.fresh_reads_judged += 1;
                    self.stats.kept_served += 1;
                    if kind == ReadKind::Collection {
                        self.stats.kept_pages_served += 1;
                    }
                    self.serve(c, refreshed);
                    self.trace.push(format!("{} {what} served from what is kept", self.step));
                    return;
                }
            }
        }
        // The statement: the generation first, then one snapshot of rows and data.
        let before =
            (self.gateways[g].connected && kind != ReadKind::Query).then(|| self.gateways[g].generation(owner));
        let rows = self.db.clock_rows();
        let verdict = gate::gate(&demand, &self.model, &rows, &served);
        if !verdict.is_covered() {
            assert!(!visitor, "an empty token is always covered");
            let client = &mut self.clients[c];
            client.token = token;
            client.last_attempt = self.changes;
            if client.pending_read.is_none() {
                client.pending_read = Some(kind);
                self.stats.gated_waits += 1;
            }
            self.trace.push(format!("{} {what} waits", self.step));
            return;
        }
        let observed: Vec<RecordId> = match kind {
            ReadKind::Key(k) => self.db.doc(self.owner_of_key[k as usize], k).to_vec(),
            ReadKind::Collection | ReadKind::Query => {
                self.db.tasks.iter().flat_map(|t| t.docs.values().flatten().copied()).collect()
            }
        };
        let refreshed = gate::refresh(&token, &self.model, &rows, &served);
        if !visitor {
            self.clients[c].token = token;
        }
        self.trace.push(format!("{} {what} reads its snapshot", self.step));
        let read = InFlightRead { gateway: g, kind, owner, before, rows, observed, refreshed, fresh, what };
        self.reads_in_flight.insert(c, read);
    }

    /// The read's statement is done: it is served, and its snapshot kept if the core's rules
    /// say so (read again, the generation after the statement).
    pub(super) fn gateway_read_finish(&mut self, c: usize) {
        let Some(read) = self.reads_in_flight.remove(&c) else { return };
        let rules = self.kept_rules;
        let key = match read.kind {
            ReadKind::Key(k) => Some(k),
            ReadKind::Collection | ReadKind::Query => None,
        };
        if c < self.clients.len() {
            self.oracle.read(c as u32, key, &read.observed, &read.what);
        }
        self.oracle.judge_fresh(&read.fresh, &read.observed, &read.what);
        self.stats.fresh_reads_judged += 1;
        let gw = &self.gateways[read.gateway];
        let after = gw.connected.then(|| gw.generation(read.owner));
        match rules.keep_under(read.before, after) {
            Some(generation) if gw.connected && read.kind != ReadKind::Query => {
                let snapshot = Snapshot { generation, at: self.step, rows: read.rows, observed: read.observed };
                self.gateways[read.gateway].kept.insert(read.kind, snapshot);
                self.stats.kept_stored += 1;
            }
            _ if read.before.is_some() => self.stats.kept_refused_heard += 1,
            _ => {}
        }
        self.serve(c, read.refreshed);
        self.trace.push(format!("{} {} served", self.step, read.what));
    }

    fn serve(&mut self, c: usize, refreshed: CausalPast) {
        self.stats.reads_served += 1;
        let Some(client) = self.clients.get_mut(c) else { return };
        client.token = refreshed;
        if client.pending_read.take().is_some() {
            self.stats.waited_reads_served += 1;
        }
    }
}
