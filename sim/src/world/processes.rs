//! The world's upstream processes: consumers of upstream channels that run the real engine
//! and send transactionally, stamping what they deliver onto what they send.

use super::*;

impl World {
    pub(super) fn proc_fetch(&mut self, p: usize, c: ChannelId) {
        let from = self.processes[p].next_fetch[&c];
        let batch = self.rng.range(1, 2) as usize;
        let records = match self.kafka.fetch(&c, from, batch) {
            Ok(r) => r,
            Err(FetchError::OutOfRange { log_start }) => {
                let line = format!(
                    "{} P{p} fetch {} from {from} out of range (log start {log_start})",
                    self.step,
                    self.name(&c)
                );
                self.trace.push(line);
                self.proc_check_log_starts(p);
                return;
            }
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
                    self.oracle.received(receiver, f.id);
                    let mut names = Vec::new();
                    for d in &deliveries {
                        if self.oracle.record(d.payload.id).author == Actor::Process(p as u32) {
                            self.stats.self_deliveries += 1;
                        }
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

    /// After an out-of-range fetch, the process checks the log start of every channel it
    /// receives, in channel order, as a task does: each one the engine lets pass is judged
    /// (nothing it had not delivered may be gone), and so is the refusal, which is due
    /// exactly when retention discarded a record the process had not delivered. A refused
    /// process is never restarted, so it stops for good; its channels are excepted from
    /// completeness.
    pub(super) fn proc_check_log_starts(&mut self, p: usize) {
        self.stats.upstream_log_start_checks += 1;
        let receiver = self.processes[p].receiver;
        let received = self.processes[p].received.clone();
        for c in received {
            let log_start = self.kafka.log_start(&c);
            match self.processes[p].engine.observe_log_start(c, log_start) {
                Ok(()) => self.oracle.log_start_accepted(receiver, &c),
                Err(refusal) => {
                    self.stats.refusals += 1;
                    self.stats.upstream_held_at_refusal += self.processes[p].engine.held_count() as u64;
                    let due = match (refusal.reason, refusal.channel) {
                        (RefusalReason::PositionsDiscardedUnread, Some(ch)) if ch == c => {
                            self.stats.upstream_discard_refusals += 1;
                            self.oracle.discard_refusal_unjustified(receiver, &c, refusal.position)
                        }
                        _ => Some("no discarded delivery calls for it".to_string()),
                    };
                    if let Some(why) = due {
                        self.oracle
                            .report(ViolationKind::UnexpectedRefusal, format!("P{p} refused: {refusal} ({why})"));
                    }
                    self.trace.push(format!("{} P{p} refused {}: {}", self.step, refusal.reason, refusal.diagnosis));
                    return;
                }
            }
        }
        // The engine let every log start pass (the oracle judged each): resume from them.
        for c in self.processes[p].received.clone() {
            let log_start = self.kafka.log_start(&c);
            let next = self.processes[p].next_fetch.get_mut(&c).expect("received");
            *next = (*next).max(log_start);
        }
    }

    /// Commits what each process's engine changed in the action just performed to its
    /// durable rows, as a host commits its ordering state with the step that changed it.
    pub(super) fn persist_processes(&mut self) {
        for proc in &mut self.processes {
            let changes = proc.engine.take_changes();
            if !changes.is_empty() {
                proc.rows.commit(changes, &[], true);
            }
        }
    }

    /// The process crashes: its open transaction aborts, its engine is gone, and it comes
    /// back as a host does — `Engine::restore` from its durable rows, resuming each channel
    /// at `fed_up_to + 1` (a third of restarts a little lower, so replays must drop), then a
    /// drain. What it stamps from then on is judged like any send: its frontier must still
    /// hold every cause of everything it received and delivered before the crash.
    pub(super) fn proc_crash(&mut self, p: usize) {
        if self.processes[p].txn.is_some() {
            self.proc_end(p, false);
        }
        let receiver = self.processes[p].receiver;
        self.oracle.discard(receiver);
        let received = self.processes[p].received.clone();
        let state = self.processes[p].rows.persisted();
        let held = state.held.len();
        let mut engine = match Engine::restore(EngineConfig::default(), received.iter().copied(), state) {
            Ok(engine) => engine,
            Err(refusal) => {
                self.oracle.report(ViolationKind::UnexpectedRefusal, format!("P{p} cannot restore: {refusal}"));
                return;
            }
        };
        engine.set_sabotage(self.sabotage.engine());
        self.stats.process_restarts += 1;
        if held > 0 {
            self.stats.process_restores_with_held += 1;
        }
        let replay = self.scenario.replay_on_restart && self.rng.chance(1, 3);
        for &c in &received {
            let log_start = self.kafka.log_start(&c);
            let fed = match engine.fed_up_to(&c) {
                Some(fed) => fed,
                None => engine.seed(c, log_start - 1).expect("a restored engine seeds"),
            };
            // Below the log start the next fetch is out of range, and the process checks.
            let back = if replay { self.rng.range(0, 3) } else { 0 };
            self.processes[p].next_fetch.insert(c, fed + 1 - back);
        }
        let deliveries = engine.drain();
        let mut names = Vec::new();
        for d in &deliveries {
            self.oracle.delivered(receiver, d.channel, d.position, d.payload.id);
            names.push(format!("#{}", d.payload.id));
        }
        self.oracle.commit(receiver);
        let proc = &mut self.processes[p];
        proc.pending_sends += deliveries.len() as u32;
        proc.engine = engine;
        self.trace.push(format!("{} P{p} crash, restored {held} held -> delivered [{}]", self.step, names.join(" ")));
    }

    /// Prunes the process's frontier with the channel facts Kafka gives.
    pub(super) fn proc_prune(&mut self, p: usize) {
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

    pub(super) fn proc_send(&mut self, p: usize) {
        if self.scenario.retention_passes_unread {
            // Where retention outruns readers, a sender prunes right before each send: the
            // stamp then shows exactly what the pruning rule keeps.
            self.proc_prune(p);
        }
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

    pub(super) fn proc_end(&mut self, p: usize, commit: bool) {
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
}
