//! The world's upstream processes: consumers of upstream channels that run the real engine
//! and send transactionally, stamping what they deliver onto what they send.

use super::*;

impl World {
    pub(super) fn proc_fetch(&mut self, p: usize, c: ChannelId) {
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

    pub(super) fn proc_send(&mut self, p: usize) {
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
