//! The world's writers and readers: edge producers and session clients writing stamped
//! records through the gateway's write path (and a rogue one writing damaged causes), and
//! session reads through the core's gate and refresh, judged by the oracle.

use super::*;

impl World {
    /// Produces one record stamped with `token` (the gateway's write path) and returns
    /// its coordinate and id.
    pub(super) fn produce_stamped(
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
        let len = headers.first().and_then(|h| h.as_ref()).map_or(0, Vec::len);
        let position = self.kafka.produce(channel, id, key, headers);
        let got = self.oracle.sent(channel, position, key, author, false, corrupt);
        assert_eq!(got, id);
        self.oracle.header_written(id, len);
        (position, id)
    }

    /// A damaged `parsley.causes` value: every form here is undecodable.
    pub(super) fn damage(&mut self, token: &CausalPast) -> Vec<Option<Vec<u8>>> {
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

    pub(super) fn edge_write(&mut self, e: usize) {
        let taken = std::mem::take(&mut self.edges[e].token);
        let token = self.prune_token(taken);
        let key = self.rng.below(u64::from(self.scenario.keys)) as u16;
        let channel = match self.rng.below(3 + self.model_topics.len() as u64) {
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
    pub(super) fn rogue_write(&mut self) {
        let mut rogue = self.rogue.take().expect("rogue present");
        let k1 = self.rng.below(u64::from(self.scenario.keys)) as u16;
        let first = {
            let topic = self.rng.below(self.model_topics.len() as u64) as usize;
            self.model_channel(topic, k1)
        };
        let (p1, _) = self.produce_stamped(rogue.actor, &rogue.token, first, k1, false);
        rogue.token = rogue.token.merge(first, p1);
        let k2 = self.rng.below(u64::from(self.scenario.keys)) as u16;
        let channel = {
            let topic = self.rng.below(self.model_topics.len() as u64) as usize;
            self.model_channel(topic, k2)
        };
        let (position, id) = self.produce_stamped(rogue.actor, &rogue.token, channel, k2, true);
        self.stats.corrupt_records += 1;
        self.trace.push(format!("{} rogue write damaged #{id} {}@{position}", self.step, self.name(&channel)));
    }

    pub(super) fn client_write(&mut self, c: usize) {
        let taken = std::mem::take(&mut self.clients[c].token);
        let token = self.prune_token(taken);
        let key = self.rng.below(u64::from(self.scenario.keys)) as u16;
        // The gateway writes to the topics the model declares, by name (a recreated one too).
        let declared: Vec<usize> = (0..self.model_topics.len())
            .filter(|&i| {
                let t = self.model_topics[i];
                self.declared.contains(&t) || self.recreated_from.get(&t).is_some_and(|old| self.declared.contains(old))
            })
            .collect();
        let topic = declared[self.rng.below(declared.len() as u64) as usize];
        let channel = self.model_channel(topic, key);
        let author = self.clients[c].actor;
        let (position, id) = self.produce_stamped(author, &token, channel, key, false);
        self.clients[c].token = token.merge(channel, position);
        let poison = self.poison_at.is_some_and(|at| self.step >= at);
        if poison {
            // A value the projection rejects for good (say, one its table's constraint
            // refuses): its task must refuse there.
            self.poison_at = None;
            self.oracle.poison(id);
        }
        let what = if poison { " (a value the projection rejects)" } else { "" };
        self.trace.push(format!("{} C{c} write #{id} {}@{position} k{key}{what}", self.step, self.name(&channel)));
    }

    /// A gated read: fetch every clock row in one snapshot (of the primary or of the
    /// lagging replica), gate, and serve from the same snapshot only if covered. Returns
    /// the verdict. `SplitSnapshot` gates on the primary's rows but serves the replica's.
    pub(super) fn client_read(&mut self, c: usize, kind: ReadKind, last: bool, from_replica: bool) -> Verdict {
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
            ReadKind::Collection | ReadKind::Query => (0..self.model.task_count).collect(),
        };
        let demand = self.read_demand(&token);
        let verdict = match self.sabotage.gate() {
            gate::GateSabotage::None => gate::gate(&demand, &self.model, &rows, &served),
            g => gate::gate_sabotaged(&demand, &self.model, &rows, &served, g),
        };
        let mut what = match kind {
            ReadKind::Key(k) => format!("read of k{k}"),
            ReadKind::Collection => "collection read".to_string(),
            ReadKind::Query => "named query".to_string(),
        };
        if from_replica && self.replica.is_some() {
            what.push_str(" (replica)");
        }
        if verdict.is_covered() {
            let observed: Vec<RecordId> = match kind {
                ReadKind::Key(k) => data.doc(self.owner_of_key[k as usize], k).to_vec(),
                ReadKind::Collection | ReadKind::Query => {
                    data.tasks.iter().flat_map(|t| t.docs.values().flatten().copied()).collect()
                }
            };
            if from_replica && self.replica_version < self.db_version {
                self.stats.lagging_replica_reads += 1;
            }
            let key = match kind {
                ReadKind::Key(k) => Some(k),
                ReadKind::Collection | ReadKind::Query => None,
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
}
