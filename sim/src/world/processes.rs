//! The world's upstream processes: consumers of upstream channels that run the real engine
//! and send transactionally, stamping what they deliver onto what they send.

use super::*;

impl World {
    pub(super) fn proc_fetch(&mut self, p: usize, c: ChannelId) {
        if self.scenario.out_of_order_feeds && self.rng.chance(1, OUT_OF_ORDER_ODDS) {
            // The injected host bug: the consumer rewinds within this execution.
            let proc = &self.processes[p];
            let next = proc.next_fetch[&c];
            let back = (next - self.rng.range(1, 3)).max(proc.exec_start[&c]).max(self.kafka.log_start(&c));
            if back < next {
                self.trace.push(format!("{} P{p} host bug: rewinds {} to {back}", self.step, self.name(&c)));
                self.processes[p].next_fetch.insert(c, back);
            }
        }
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
            Err(FetchError::TopicGone) => {
                // The host fails and restarts; its start checks the topics' identities.
                self.trace.push(format!("{} P{p} fetch {}: topic gone", self.step, self.name(&c)));
                self.proc_crash(p);
                return;
            }
        };
        for f in records {
            let receiver = self.processes[p].receiver;
            let out_of_order = self.oracle.fed(receiver, c, f.position);
            let over_budget = self.oracle.over_budget(receiver, f.id);
            if out_of_order {
                self.stats.out_of_order_feeds += 1;
            }
            let name = self.name(&c);
            let proc = &mut self.processes[p];
            proc.next_fetch.insert(c, f.position + 1);
            let receipt =
                proc.engine.receive(c, f.position, &header_values(&f.headers), Payload { id: f.id, key: f.key });
            if receipt.is_ok() && (out_of_order || over_budget) {
                let what = if out_of_order { "an out-of-order feed" } else { "a causes value over its budget" };
                let detail = format!("P{p} accepted {name}@{}, {what}", f.position);
                self.oracle.report(ViolationKind::MissedRefusal, detail);
            }
            let proc = &mut self.processes[p];
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
                    self.trace.push(format!("{} P{p} refused {}: {}", self.step, refusal.reason, refusal.diagnosis));
                    self.stats.refusals += 1;
                    let at = refusal.channel == Some(c) && refusal.position == Some(f.position);
                    match refusal.reason {
                        RefusalReason::OutOfOrderFeed if out_of_order && at => {
                            // Judged; the operator fixes the host and restarts the process.
                            self.stats.out_of_order_refusals += 1;
                            self.proc_crash(p);
                        }
                        RefusalReason::MetadataBudgetExceeded if over_budget && at => {
                            self.stats.budget_refusals_on_receipt += 1;
                        }
                        _ => self.oracle.report(ViolationKind::UnexpectedRefusal, format!("P{p} refused: {refusal}")),
                    }
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
        let forget_frontier = self.sabotage == Sabotage::FrontierNotPersisted;
        for proc in &mut self.processes {
            let mut changes = proc.engine.take_changes();
            if !changes.is_empty() {
                if forget_frontier {
                    changes.frontier_upserts.clear();
                    changes.frontier_removed.clear();
                }
                proc.rows.commit(changes, &[]);
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
        let old = self.processes[p].received.clone();
        let state = self.processes[p].rows.persisted();
        let held = state.held.len();
        let Some(received) = self.proc_declaration(p) else { return };
        let config = self.processes[p].config.clone();
        let sabotage = self.sabotage.engine();
        let mut engine =
            match Engine::restore_sabotaged(config.clone(), received.iter().copied(), state.clone(), sabotage) {
                Ok(engine) => engine,
                Err(refusal) => {
                    let removed = refusal.channel.filter(|c| !received.contains(c) && old.contains(c));
                    let due = removed.is_some_and(|c| self.oracle.held_on(receiver, &c).is_some());
                    if refusal.reason != RefusalReason::ChannelRemovedWithHeldMessages || !due {
                        self.oracle.report(ViolationKind::UnexpectedRefusal, format!("P{p} cannot restore: {refusal}"));
                        return;
                    }
                    // Judged; the operator restores the old declaration.
                    self.stats.removals_refused += 1;
                    self.trace.push(format!("{} P{p} refused {}: {}", self.step, refusal.reason, refusal.diagnosis));
                    match Engine::restore_sabotaged(config, old.iter().copied(), state, sabotage) {
                        Ok(engine) => engine,
                        Err(refusal) => {
                            let detail = format!("P{p} cannot restore its old declaration: {refusal}");
                            self.oracle.report(ViolationKind::UnexpectedRefusal, detail);
                            return;
                        }
                    }
                }
            };
        let received: Vec<ChannelId> = engine.received().iter().copied().collect();
        self.proc_rescope(p, &old, &received);
        self.stats.process_restarts += 1;
        if held > 0 {
            self.stats.process_restores_with_held += 1;
        }
        let replay = self.scenario.replay_on_restart && self.rng.chance(1, 3);
        let mut next_fetch = BTreeMap::new();
        for &c in &received {
            let log_start = self.kafka.log_start(&c);
            let fed = match engine.fed_up_to(&c) {
                Some(fed) => fed,
                // Crashed before its first commit: seeded again, as at its first start.
                None if old.contains(&c) => engine.seed(c, log_start - 1).expect("a restored engine seeds"),
                None => {
                    let fed = engine.seed(c, log_start - 1).expect("a restored engine seeds");
                    // A joining channel: the oracle works out the seed floor on its own.
                    let first = self.oracle.join(receiver, c, log_start);
                    self.stats.channels_joined += 1;
                    if first > log_start {
                        self.stats.joins_above_floor += 1;
                    }
                    self.trace.push(format!("{} P{p} joins {} from {}", self.step, self.name(&c), fed + 1));
                    fed
                }
            };
            // Below the log start the next fetch is out of range, and the process checks.
            let back = if replay && old.contains(&c) { self.rng.range(0, 3) } else { 0 };
            next_fetch.insert(c, fed + 1 - back);
        }
        self.processes[p].received = received;
        self.processes[p].exec_start = next_fetch.clone();
        self.processes[p].next_fetch = next_fetch;
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

    /// What process `p` restarts receiving: what it received, or, where scopes change, now
    /// and then a new declaration — a channel fewer, or one more of `raw`, `mid` and `ext`.
    /// Its host first checks the identity of each received topic: one recreated under its
    /// name refuses `CHANNEL_IDENTITY_CHANGED`, judged by the oracle, and the process stops
    /// (`None`). `IgnoreRecreation` goes on under the new topic instead: its channel joins,
    /// the old one leaves.
    fn proc_declaration(&mut self, p: usize) -> Option<Vec<ChannelId>> {
        let receiver = self.processes[p].receiver;
        let mut received = self.processes[p].received.clone();
        let mut recreated = Vec::new();
        let mut refused = Vec::new();
        for c in &received {
            let name = self.names[&c.topic].split('#').next().expect("a name").to_string();
            let resolved = ResolvedTopic { name: name.clone(), id: self.kafka.resolve(&name), partitions: 1 };
            let held = self.oracle.held_on(receiver, c).map_or(0, |_| 1);
            // The core's check (which `IgnoreRecreation` breaks): a topic it lets through
            // under another ID is taken by name, as a host trusting it would.
            let ignore = self.sabotage == Sabotage::IgnoreRecreation;
            match check_topic_identity_sabotaged(&resolved, Some(c.topic), held, ignore) {
                Err(refusal) => refused.push(refusal),
                Ok(now) if now != c.topic => recreated.push((*c, Some(now))),
                Ok(_) => {}
            }
        }
        let due = self.oracle.identity_changed(receiver);
        if let Some(refusal) = refused.first() {
            self.stats.refusals += 1;
            self.trace.push(format!("{} P{p} refused {}: {}", self.step, refusal.reason, refusal.diagnosis));
            if refusal.reason == RefusalReason::ChannelIdentityChanged && due.is_some() {
                self.stats.identity_refusals += 1;
            } else {
                self.oracle.report(ViolationKind::UnexpectedRefusal, format!("P{p} refused: {refusal}"));
            }
            // Stopped for good: the refusal is sticky in its engine.
            let refusal = refusal.clone();
            self.processes[p].engine.refuse(refusal);
            return None;
        }
        if let Some(c) = due {
            let detail = format!("P{p} restarted on {}, whose topic was recreated, without refusing", self.name(&c));
            self.oracle.report(ViolationKind::MissedRefusal, detail);
        }
        for (c, now) in recreated {
            received.retain(|r| *r != c);
            if let Some(id) = now {
                received.push(ChannelId::new(id, c.partition));
            }
        }
        if self.scenario.scope_changes && self.rng.chance(1, SCOPE_CHANGE_ODDS) {
            let mid = self.kafka.resolve("mid").expect("mid exists");
            let ext = self.kafka.resolve("ext").expect("ext exists");
            let pool = [
                ChannelId::new(self.raw, 0),
                ChannelId::new(self.raw, 1),
                ChannelId::new(mid, 0),
                ChannelId::new(ext, 0),
            ];
            let joinable: Vec<ChannelId> = pool.into_iter().filter(|c| !received.contains(c)).collect();
            if received.len() > 1 && (joinable.is_empty() || self.rng.chance(1, 2)) {
                // Half the time a channel its stored rows hold records on, if any: the
                // removal the engine must refuse.
                let rows = &self.processes[p].rows;
                let holding: Vec<ChannelId> =
                    received.iter().copied().filter(|c| rows.held.keys().any(|(h, _)| h == c)).collect();
                let gone = if !holding.is_empty() && self.rng.chance(1, 2) {
                    *self.rng.pick(&holding)
                } else {
                    *self.rng.pick(&received)
                };
                received.retain(|c| *c != gone);
            } else if !joinable.is_empty() {
                received.push(*self.rng.pick(&joinable));
            }
        }
        received.sort();
        Some(received)
    }

    /// Tells the oracle which channels left process `p`'s scope at its restart (joins are
    /// told as they are seeded). A channel that left while the process held records there
    /// must have been refused.
    fn proc_rescope(&mut self, p: usize, old: &[ChannelId], received: &[ChannelId]) {
        let receiver = self.processes[p].receiver;
        for c in old.iter().filter(|c| !received.contains(c)) {
            if let Some(id) = self.oracle.held_on(receiver, c) {
                let detail = format!("P{p} restored without {} though it held #{id} there", self.name(c));
                self.oracle.report(ViolationKind::MissedRefusal, detail);
            }
            self.oracle.leave(receiver, *c);
            self.stats.channels_left += 1;
            self.trace.push(format!("{} P{p} leaves {}", self.step, self.name(c)));
        }
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
        let over_budget = self.oracle.stamp_over_budget(self.processes[p].receiver);
        let proc = &mut self.processes[p];
        proc.pending_sends = proc.pending_sends.saturating_sub(1);
        let stamp = proc.engine.stamp();
        if over_budget && stamp.is_ok() {
            self.oracle.report(ViolationKind::MissedRefusal, format!("P{p} stamped a send over its metadata budget"));
        }
        let headers = match stamp {
            Ok(Some(bytes)) => vec![Some(bytes)],
            Ok(None) => Vec::new(),
            Err(refusal) if refusal.reason == RefusalReason::MetadataBudgetExceeded && over_budget => {
                self.stats.refusals += 1;
                self.stats.budget_refusals_on_stamp += 1;
                self.trace.push(format!("{} P{p} refused {}: {}", self.step, refusal.reason, refusal.diagnosis));
                return;
            }
            Err(refusal) => {
                self.oracle.report(ViolationKind::UnexpectedRefusal, format!("P{p} cannot stamp: {refusal}"));
                return;
            }
        };
        let len = headers.first().and_then(|h| h.as_ref()).map_or(0, Vec::len);
        let proc = &mut self.processes[p];
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
        self.oracle.header_written(id, len);
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
