//! The world's projector tasks: each drives the core's host protocol (`TaskHost`) exactly as
//! the projector's runner does, answered from the simulated database and Kafka, with the
//! host sabotages injected in the answers.

use super::*;

impl World {
    //
    // A task is the host state machine (`parsley::host::TaskHost`) the projector's task runner
    // drives: it says what to do next, and the functions below answer from the simulated
    // Kafka and database, as the runner answers from the real ones. The scheduler decides
    // only what the machine leaves to a host: which channel to fetch, when a step ends,
    // when an interval passed, and crashes. Host sabotage is injected in the answers.

    pub(super) fn running(&mut self, t: usize) -> &mut Running {
        match &mut self.tasks[t].state {
            TaskState::Up(run) => run,
            TaskState::Down => panic!("task{t} is down"),
        }
    }

    /// Whether an instance may take task `t` now: always without leases; with them, once
    /// the last owner's lease ran out (a live owner renews in time; a crashed or frozen one
    /// does not).
    pub(super) fn claimable(&self, t: usize) -> bool {
        let rows = &self.db.tasks[t];
        !self.scenario.ha || rows.owner.is_none() || rows.lease_until <= self.step
    }

    /// Whether task `t`'s owner may pause: a paused instance runs nothing else, so one
    /// instance must be left to take the task over.
    pub(super) fn may_freeze(&self, t: usize) -> bool {
        self.scenario.ha && self.frozen.iter().filter(|f| f.task == t).count() + 1 < INSTANCES as usize
    }

    /// A task is down and its lease has not run out yet: time must pass before the world
    /// is quiet.
    pub(super) fn awaiting_lease(&self) -> bool {
        (0..self.tasks.len()).any(|t| matches!(self.tasks[t].state, TaskState::Down) && !self.claimable(t))
    }

    /// Takes the task: an instance claims it at a new epoch (fencing every execution
    /// before), and a new machine restores from the stored rows (and seeds, checks log
    /// starts, commits the start, resumes each channel's fetch).
    pub(super) fn task_start(&mut self, t: usize) {
        if self.model_identity_refused() {
            return;
        }
        let frozen: Vec<u32> = self.frozen.iter().filter(|f| f.task == t).map(|f| f.run.instance).collect();
        let free: Vec<u32> = (0..INSTANCES).filter(|i| !frozen.contains(i)).collect();
        let instance = *self.rng.pick(&free);
        if !frozen.is_empty() {
            self.stats.takeovers_of_frozen += 1;
        }
        let rows = &mut self.db.tasks[t];
        rows.epoch += 1;
        rows.owner = Some(instance);
        rows.lease_until = u64::MAX;
        let epoch = rows.epoch;
        if self.tasks[t].started_once {
            // Whatever the last execution delivered and did not commit is gone.
            self.oracle.discard(self.tasks[t].receiver);
        }
        if self.scenario.ha {
            self.trace.push(format!("{} task{t} taken by instance {instance} at epoch {epoch}", self.step));
        }
        let rows = &self.db.tasks[t];
        let recorded = if rows.refusal.is_some() {
            TaskStatus::Refused
        } else if rows.failing {
            TaskStatus::Failing
        } else {
            TaskStatus::Running
        };
        let received = self.tasks[t].received.clone();
        let config = self.tasks[t].config.clone();
        let host = TaskHost::new(config, received, recorded).with_sabotage(self.sabotage.engine());
        // A refusal of a declaration the operator withdrew is not met again: the start
        // under the old declaration clears it.
        let withdrawn = std::mem::take(&mut self.tasks[t].withdrawn);
        self.tasks[t].expect_refusal = if withdrawn { None } else { self.db.tasks[t].refusal.clone() };
        self.tasks[t].refused = false;
        let run = Running {
            host,
            next_fetch: BTreeMap::new(),
            applied: Vec::new(),
            log_start_checked: BTreeMap::new(),
            read_to: BTreeMap::new(),
            epoch,
            instance,
            fed_in_step: 0,
            exec_start: BTreeMap::new(),
            joins: Vec::new(),
        };
        self.tasks[t].state = TaskState::Up(Box::new(run));
        self.task_drive(t);
    }

    /// Answers task `t`'s machine until it wants a poll or a feed (the caller's to do), or
    /// stops: the restore path, due checks, the drain, read positions, and a commit the
    /// machine calls for (a refusal, the end of an out-of-range step). Returns where it
    /// stopped.
    pub(super) fn task_drive(&mut self, t: usize) -> Next {
        loop {
            if !matches!(self.tasks[t].state, TaskState::Up(_)) {
                // The step's commit froze or crashed its owner.
                return Next::Fenced;
            }
            let next = self.running(t).host.next_action();
            match next {
                Next::Restore => self.task_restore(t),
                Next::ReadStarts(channels) => self.task_read_starts(t, &channels),
                Next::CommitStart => {
                    let start = self.running(t).host.take_start();
                    if start.write_running && self.db.tasks[t].refusal.take().is_some() {
                        self.stats.refusals_cleared += 1;
                    }
                    let joins = std::mem::take(&mut self.running(t).joins);
                    self.task_rescoped(t, &joins);
                    self.rollout_started(t);
                    // Seeds and a refusal: nothing a read sees, so no read retries on it.
                    self.db.commit(t as u32, start.changes, &[]);
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
                    let run = self.running(t);
                    let positions: Vec<(ChannelId, Position)> = run.next_fetch.iter().map(|(&c, &p)| (c, p)).collect();
                    run.host.read_positions(&positions);
                }
                Next::Commit => self.task_commit(t),
                Next::PersistRefusal(refusal) if self.removal_due(t, &refusal) => {
                    // Judged; persisted as the projector records it, and the operator
                    // withdraws the declaration.
                    self.stats.refusals += 1;
                    self.stats.task_removals_refused += 1;
                    self.trace.push(format!("{} task{t} refused {}: {}", self.step, refusal.reason, refusal.diagnosis));
                    self.db.tasks[t].refusal = Some(refusal.clone());
                    self.running(t).host.refusal_persisted();
                    self.tasks[t].refused = true;
                    self.withdraw_declaration();
                    return Next::Refused(refusal);
                }
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
    pub(super) fn task_restore(&mut self, t: usize) {
        let persisted = self.db.persisted(t as u32);
        let held = persisted.held.len();
        self.stats.starts += 1;
        if held > 0 {
            self.stats.restores_with_held += 1;
        }
        self.trace.push(format!("{} task{t} restore ({held} held)", self.step));
        self.oracle.restored(self.tasks[t].receiver);
        self.running(t).host.restored(persisted, BTreeSet::new());
    }

    /// The start commits under the task's declaration: a channel it received and no longer
    /// does leaves (what it held there must have been refused; nothing there is owed to it
    /// any more), and a new one joins from the log start the start seeded it at (the oracle
    /// works out the seed floor on its own). Until the start commits, the stored state is
    /// the old declaration's.
    fn task_rescoped(&mut self, t: usize, joins: &[(ChannelId, Position)]) {
        let receiver = self.tasks[t].receiver;
        let left: Vec<ChannelId> =
            self.tasks[t].scope_from.keys().copied().filter(|c| !self.tasks[t].received.contains(c)).collect();
        for c in &left {
            if let Some(id) = self.oracle.held_on(receiver, c) {
                let detail = format!("task{t} restored without {} though it held #{id} there", self.name(c));
                self.oracle.report(ViolationKind::MissedRefusal, detail);
            }
            self.oracle.leave(receiver, *c);
            self.tasks[t].scope_from.remove(c);
            // Nothing reads it for the task any more: a join seeds afresh.
            self.committed_read.remove(c);
            self.stats.task_channels_left += 1;
            self.trace.push(format!("{} task{t} leaves {}", self.step, self.name(c)));
        }
        for &(c, log_start) in joins {
            let first = self.oracle.join(receiver, c, log_start);
            self.tasks[t].scope_from.insert(c, first);
            self.stats.task_channels_joined += 1;
            if first > log_start {
                self.stats.task_joins_above_floor += 1;
            }
            self.trace.push(format!("{} task{t} joins {} from {first}", self.step, self.name(&c)));
        }
        if !left.is_empty() || !joins.is_empty() {
            self.refresh_read_scope();
        }
    }

    /// Whether a refusal at restore is the removal the oracle owes: a channel the task
    /// received, no longer declared, where it holds records.
    fn removal_due(&self, t: usize, refusal: &Refusal) -> bool {
        let task = &self.tasks[t];
        refusal.reason == RefusalReason::ChannelRemovedWithHeldMessages
            && refusal.channel.is_some_and(|c| {
                task.scope_from.contains_key(&c)
                    && !task.received.contains(&c)
                    && self.oracle.held_on(task.receiver, &c).is_some()
            })
    }

    // ---- the model's declaration ----------------------------------------------------------

    /// A topic the model declares is deleted and created again under its name, with a new
    /// ID: writers go on under the name; the model's tasks find out at their next fetch of
    /// it, and the start that follows refuses the model (see `model_identity_refused`).
    pub(super) fn recreate_model_topic(&mut self) {
        let declared: Vec<TopicId> = self.declared.iter().copied().collect();
        let old = *self.rng.pick(&declared);
        let name = self.names[&old].clone();
        self.kafka.delete_topic(&name).expect("a declared topic exists");
        self.oracle.topic_deleted(old);
        let id = self.new_topic_id();
        self.kafka.create_topic(&name, id, self.model.task_count);
        self.names.insert(id, format!("{name}#1"));
        self.oracle.name_topic(id, &format!("{name}#1"));
        let index = self.model_topics.iter().position(|&t| t == old).expect("a model topic");
        self.model_topics[index] = id;
        self.recreated_from.insert(id, old);
        self.model_recreated = true;
        self.stats.model_topic_recreations += 1;
        self.trace.push(format!("{} {name} deleted and recreated as {id}", self.step));
    }

    /// The model's checks at a task's start, as the projector makes them before it takes
    /// any task: each declared topic resolved by name against the ID its state recorded
    /// (the core's rule, which `IgnoreRecreation` breaks). A recreated topic refuses the
    /// whole model `CHANNEL_IDENTITY_CHANGED`, recorded on every task, judged by the oracle;
    /// it stays refused (the operator must reset it). Returns whether the model is refused.
    fn model_identity_refused(&mut self) -> bool {
        let ignore = self.sabotage == Sabotage::IgnoreRecreation;
        let mut refusal = None;
        for &topic in &self.declared {
            let name = self.names[&topic].split('#').next().expect("a name").to_string();
            let resolved = ResolvedTopic { id: self.kafka.resolve(&name), name, partitions: 1 };
            let held = (0..self.tasks.len())
                .filter(|&t| self.oracle.held_on(self.tasks[t].receiver, &ChannelId::new(topic, t as u32)).is_some())
                .count();
            if let Err(r) = check_topic_identity_sabotaged(&resolved, Some(topic), held, ignore) {
                refusal = Some(r);
                break;
            }
        }
        let due = (0..self.tasks.len()).find_map(|t| self.oracle.identity_changed(self.tasks[t].receiver));
        let Some(refusal) = refusal else {
            if let Some(c) = due {
                let detail =
                    format!("the model started on {}, whose topic was recreated, without refusing", self.name(&c));
                self.oracle.report(ViolationKind::MissedRefusal, detail);
                // Caught; the world stops the model as the check should have.
                let r = Refusal::at(RefusalReason::ChannelIdentityChanged, c, None, "not refused".to_string());
                self.refuse_model(r);
                return true;
            }
            return false;
        };
        self.stats.refusals += 1;
        self.trace.push(format!("{} the model refused {}: {}", self.step, refusal.reason, refusal.diagnosis));
        if refusal.reason == RefusalReason::ChannelIdentityChanged && due.is_some() {
            self.stats.model_identity_refusals += 1;
        } else {
            self.oracle.report(ViolationKind::UnexpectedRefusal, format!("the model refused: {refusal}"));
        }
        self.refuse_model(refusal);
        true
    }

    /// Records `refusal` on every task of the model, which stop.
    fn refuse_model(&mut self, refusal: Refusal) {
        for t in 0..self.tasks.len() {
            self.task_crash(t);
            self.db.tasks[t].refusal = Some(refusal.clone());
            self.tasks[t].refused = true;
        }
        self.model_refusal = Some(refusal);
    }

    /// The operator rolls out a new declaration of the model's topics (where scopes change):
    /// a topic leaves — half the time one a task holds records on, which that task must
    /// refuse at its restart — or a new topic, created now, joins. Every task restarts under
    /// it. A topic that left never joins again but through a withdrawal: sessions learn of
    /// its later records only as upstream causes (see `declare`).
    pub(super) fn model_rescope(&mut self) {
        let mut declared = self.declared.clone();
        let next_name = MODEL_TOPICS.get(self.model_topics.len()).copied();
        if declared.len() > 1 && (next_name.is_none() || self.rng.chance(1, 2)) {
            let holding: Vec<TopicId> = declared
                .iter()
                .copied()
                .filter(|&topic| {
                    (0..self.tasks.len()).any(|t| {
                        let c = ChannelId::new(topic, t as u32);
                        self.oracle.held_on(self.tasks[t].receiver, &c).is_some()
                    })
                })
                .collect();
            let pool: Vec<TopicId> =
                if !holding.is_empty() && self.rng.chance(1, 2) { holding } else { declared.iter().copied().collect() };
            let gone = *self.rng.pick(&pool);
            declared.remove(&gone);
            self.stats.model_topics_removed += 1;
        } else if let Some(name) = next_name {
            let id = self.new_topic_id();
            self.kafka.create_topic(name, id, self.model.task_count);
            self.names.insert(id, name.to_string());
            self.oracle.name_topic(id, name);
            self.model_topics.push(id);
            declared.insert(id);
            self.stats.model_topics_added += 1;
        } else {
            return;
        }
        self.stats.model_rescopes += 1;
        let before = std::mem::replace(&mut self.declared, declared);
        self.declare(Some(before));
    }

    /// A topic ID no topic has.
    pub(super) fn new_topic_id(&mut self) -> TopicId {
        loop {
            let id = TopicId::from_halves(self.rng.next_u64(), self.rng.next_u64());
            if !id.is_zero() && self.kafka.topic(&id).is_none() && !self.names.contains_key(&id) {
                return id;
            }
        }
    }

    /// A task refused the new declaration: the operator restores the one before, and the
    /// refused task's next start must clear its refusal.
    fn withdraw_declaration(&mut self) {
        let before = self.rollout.take().expect("a refused removal follows a new declaration").before;
        for t in 0..self.tasks.len() {
            let refused = self.db.tasks[t].refusal.as_ref();
            if refused.is_some_and(|r| r.reason == RefusalReason::ChannelRemovedWithHeldMessages) {
                self.tasks[t].withdrawn = true;
            }
        }
        self.stats.declarations_withdrawn += 1;
        self.trace.push(format!("{} the operator withdraws the declaration", self.step));
        self.declared = before;
        self.declare(None);
    }

    /// Every task restarts under `self.declared`, the rollout from `before` (if any) until
    /// each has started under it. Meanwhile the gateway gates by both declarations: a topic
    /// leaving stays the model's own until no task may still apply it (its pairs demanded
    /// of their owner, its positions carried by the refresh as causes), so a withdrawal
    /// that brings it back finds sessions' tokens as a model channel expects them.
    fn declare(&mut self, before: Option<BTreeSet<TopicId>>) {
        let names: Vec<String> = self.declared.iter().map(|t| self.names[t].clone()).collect();
        self.trace.push(format!("{} the model declares {}", self.step, names.join(" ")));
        self.model.received_topics = self.declared.clone();
        if let Some(before) = before {
            self.model.received_topics.extend(before.iter().copied());
            self.rollout = Some(Rollout { before, pending: (0..self.tasks.len()).collect() });
        }
        for t in 0..self.tasks.len() {
            self.task_crash(t);
            self.tasks[t].received = self.declared.iter().map(|&topic| ChannelId::new(topic, t as u32)).collect();
        }
        self.refresh_read_scope();
    }

    /// Task `t` committed its start under the declaration: once every task has, the
    /// rollout is over and the gateway gates by the new declaration alone.
    fn rollout_started(&mut self, t: usize) {
        let Some(rollout) = &mut self.rollout else { return };
        rollout.pending.remove(&t);
        if rollout.pending.is_empty() {
            self.rollout = None;
            self.model.received_topics = self.declared.clone();
            self.trace.push(format!("{} the declaration is rolled out", self.step));
            self.refresh_read_scope();
        }
    }

    /// What reads owe: each declared channel from where its owner's scope starts; nothing
    /// on a channel its owner left and has not joined again.
    pub(super) fn refresh_read_scope(&mut self) {
        let mut scope = BTreeMap::new();
        for &topic in &self.model.received_topics {
            for (t, task) in self.tasks.iter().enumerate() {
                let c = ChannelId::new(topic, t as u32);
                if let Some(&from) = task.scope_from.get(&c) {
                    scope.insert(c, from);
                }
            }
        }
        self.oracle.set_read_scope(scope);
    }

    /// Each channel's log start (what seeds a channel with no baseline, from its earliest
    /// position) and the log start the host tells the engine, for the start's check.
    pub(super) fn task_read_starts(&mut self, t: usize, channels: &[ChannelId]) {
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
        } else {
            // Channels of a new declaration, joined when the start commits.
            let joins: Vec<(ChannelId, Position)> =
                baselines.iter().copied().filter(|(c, _)| !self.tasks[t].scope_from.contains_key(c)).collect();
            self.running(t).joins = joins;
        }
        let observed = self.running(t).host.started(&starts);
        self.judge_log_starts(t, observed);
    }

    /// Resumes each channel's fetch where the machine says (`fed_up_to + 1`); sometimes
    /// from a coarser, older checkpoint (as a host trusting a lagging consumer offset
    /// would), which the engine must drop.
    pub(super) fn task_assign(&mut self, t: usize, positions: Vec<(ChannelId, Position)>) {
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
        run.exec_start = next_fetch.clone();
        run.next_fetch = next_fetch;
        run.host.assigned();
    }

    /// The log start the host tells the machine for `channel`, whose log start is
    /// `log_start`: the broker's, as read now (the machine's `StaleLogStart` and
    /// `LogStartAhead` hooks break what it makes of it).
    pub(super) fn told_log_start(&mut self, t: usize, channel: ChannelId, log_start: Position) -> Position {
        self.running(t).log_start_checked.insert(channel, log_start);
        log_start
    }

    /// Answers a log-start check of `channels` (every received channel: on an out-of-range
    /// fetch, or the periodic check while holding records). Returns whether the task refused.
    pub(super) fn task_observe_log_starts(&mut self, t: usize, channels: &[ChannelId]) -> bool {
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
    pub(super) fn judge_log_starts(&mut self, t: usize, observed: Observed) -> bool {
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
    pub(super) fn task_feed(&mut self, t: usize, c: ChannelId) {
        let receiver = self.tasks[t].receiver;
        let max = self.rng.range(1, self.scenario.max_batch) as usize;
        let Next::Poll { max_records } = self.running(t).host.next_action() else { return };
        let max = max_records.map_or(max, |m| m.min(max));
        if self.scenario.out_of_order_feeds && self.rng.chance(1, OUT_OF_ORDER_ODDS) {
            self.task_rewind(t, c);
        }
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
            Err(FetchError::TopicGone) => {
                // The consumer reports an unknown topic; the runner restarts the task, and
                // the start checks the model's topics.
                self.trace.push(format!("{} task{t} fetch {}: topic gone", self.step, self.name(&c)));
                self.task_crash(t);
                return;
            }
        };
        self.running(t).host.polled(false);
        if self.task_drive(t) != Next::Feed {
            return;
        }
        let mut previous = from;
        let mut line = format!("{} task{t} feed {}", self.step, self.name(&c));
        let mut refused = None;
        let mut out_of_order_refused = None;
        for f in records {
            if self.kafka.aborted_between(&c, previous, f.position) {
                self.stats.aborted_runs_crossed += 1;
            }
            previous = f.position + 1;
            let run = self.running(t);
            run.next_fetch.insert(c, f.position + 1);
            let payload = Payload { id: f.id, key: f.key };
            run.fed_in_step += 1;
            let receipt = run.host.receive(c, f.position, &header_values(&f.headers), payload);
            if receipt.is_ok() && self.oracle.over_budget(receiver, f.id) {
                let detail = format!("task{t} accepted #{}, whose causes value is over its metadata budget", f.id);
                self.oracle.report(ViolationKind::MissedRefusal, detail);
            }
            let out_of_order = self.task_fed(t, c, f.position, receipt.is_ok());
            match receipt {
                Ok(Receipt::Duplicate) => {
                    self.stats.replays_dropped += 1;
                    line.push_str(&format!(" @{}:dup", f.position));
                }
                Ok(Receipt::Accepted { deliveries }) => {
                    // Held or delivered, the step's commit stores it: while it is held there,
                    // a declaration without the channel must be refused.
                    self.oracle.received(receiver, f.id);
                    let held = !deliveries.iter().any(|d| d.channel == c && d.position == f.position);
                    if held {
                        self.stats.held += 1;
                        if self.running(t).engine().channels_holding().nth(1).is_some() {
                            self.stats.held_on_two_channels += 1;
                        }
                    }
                    line.push_str(&format!(" @{}:{}", f.position, if held { "held" } else { "ok" }));
                    for d in &deliveries {
                        self.oracle.delivered(receiver, d.channel, d.position, d.payload.id);
                        line.push_str(&format!(" +#{}", d.payload.id));
                    }
                    let run = self.running(t);
                    run.applied.extend(deliveries.iter().map(|d| d.payload));
                }
                Err(refusal) if out_of_order && self.out_of_order_refusal_due(&refusal, c, f.position) => {
                    out_of_order_refused = Some(refusal);
                    break;
                }
                Err(refusal) => {
                    refused = Some((refusal, f.id));
                    break;
                }
            }
        }
        if refused.is_none() && out_of_order_refused.is_none() {
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
        if let Some(refusal) = &out_of_order_refused {
            self.stats.refusals += 1;
            self.stats.out_of_order_refusals += 1;
            self.stats.task_out_of_order_refusals += 1;
            self.trace.push(format!("{} task{t} refused {}: {}", self.step, refusal.reason, refusal.diagnosis));
        }
        self.running(t).host.batch_done();
        let careful = self.running(t).host.careful();
        // A careful step is one batch, as the projector's runner steps (its poll bounded
        // by the machine), so a rejection in one record's step names that record.
        if matches!(self.task_drive(t), Next::Poll { .. }) && careful && self.running(t).host.step_open() {
            self.task_commit(t);
            self.task_drive(t);
        }
        if out_of_order_refused.is_some() {
            self.task_restart_fixed(t);
        }
    }

    /// The injected host bug (where the scenario has it): the consumer of channel `c`
    /// rewinds by one to three positions, never below where this execution started reading
    /// nor below the log start, so the next feed repeats positions already fed.
    fn task_rewind(&mut self, t: usize, c: ChannelId) {
        let log_start = self.kafka.log_start(&c);
        let back = self.rng.range(1, 3);
        let run = self.running(t);
        let next = run.next_fetch[&c];
        let to = (next - back).max(run.exec_start.get(&c).copied().unwrap_or(next)).max(log_start);
        if to < next {
            run.next_fetch.insert(c, to);
            self.trace.push(format!("{} task{t} host bug: rewinds {} to {to}", self.step, self.name(&c)));
        }
    }

    /// Tells the oracle task `t`'s host fed `position` on `c` (the engine `accepted` it, or
    /// not): returns whether it was fed already in this execution, which the engine must
    /// refuse `OUT_OF_ORDER_FEED` — accepting it is a missed refusal.
    fn task_fed(&mut self, t: usize, c: ChannelId, position: Position, accepted: bool) -> bool {
        let out_of_order = self.oracle.fed(self.tasks[t].receiver, c, position);
        if out_of_order {
            self.stats.out_of_order_feeds += 1;
            if accepted {
                let detail = format!("task{t} accepted {}@{position}, an out-of-order feed", self.name(&c));
                self.oracle.report(ViolationKind::MissedRefusal, detail);
            }
        }
        out_of_order
    }

    /// Whether `refusal` is the `OUT_OF_ORDER_FEED` due for feeding `position` on `c` again.
    fn out_of_order_refusal_due(&self, refusal: &Refusal, c: ChannelId, position: Position) -> bool {
        refusal.reason == RefusalReason::OutOfOrderFeed
            && refusal.channel == Some(c)
            && refusal.position == Some(position)
    }

    /// After a judged `OUT_OF_ORDER_FEED`, the operator fixes the host, clears the refusal
    /// and restarts the task: it restores from its rows (what it fed again was never
    /// committed) and must go on as if the bug had never been.
    fn task_restart_fixed(&mut self, t: usize) {
        if !self.tasks[t].refused || !matches!(self.tasks[t].state, TaskState::Up(_)) {
            return;
        }
        self.db.tasks[t].refusal = None;
        self.trace.push(format!("{} task{t} restarted by the operator, its host fixed", self.step));
        self.task_down(t);
        self.task_start(t);
    }

    /// A refusal, judged: it is expected only on a damaged record (`UNDECODABLE_METADATA`),
    /// or where the oracle says retention passed a record the task had not delivered
    /// (`POSITIONS_DISCARDED_UNREAD`). The machine then commits the step (or the start)
    /// with the refusal as status.
    pub(super) fn task_refused(&mut self, t: usize, refusal: Refusal, record: Option<RecordId>) {
        self.stats.refusals += 1;
        self.trace.push(format!("{} task{t} refused {}: {}", self.step, refusal.reason, refusal.diagnosis));
        let receiver = self.tasks[t].receiver;
        let unjustified = match (refusal.reason, refusal.channel) {
            (RefusalReason::UndecodableMetadata, _) if record.is_some_and(|id| self.oracle.record(id).corrupt) => None,
            (RefusalReason::MetadataBudgetExceeded, _)
                if record.is_some_and(|id| self.oracle.over_budget(receiver, id)) =>
            {
                self.stats.budget_refusals_on_receipt += 1;
                None
            }
            (RefusalReason::PositionsDiscardedUnread, Some(c)) if self.tasks[t].received.contains(&c) => {
                self.oracle.discard_refusal_unjustified(receiver, &c, refusal.position)
            }
            _ => Some("no damaged record or discarded delivery calls for it".to_string()),
        };
        let unjustified_is_none = unjustified.is_none();
        if let Some(why) = unjustified {
            self.oracle.report(ViolationKind::UnexpectedRefusal, format!("task{t} refused: {refusal} ({why})"));
        }
        let discarded = refusal.reason == RefusalReason::PositionsDiscardedUnread;
        if let Some(before) = self.tasks[t].expect_refusal.take() {
            let same = before.reason == refusal.reason
                && before.channel == refusal.channel
                && before.position == refusal.position;
            // A refusal on receipt is met on the channel the host happens to fetch first: with
            // values over budget on two channels, a restart may meet the other one first
            // (both due; see docs/verification.md, Findings).
            let other_channel = refusal.reason == RefusalReason::MetadataBudgetExceeded
                && before.reason == refusal.reason
                && before.channel != refusal.channel
                && unjustified_is_none;
            if same || other_channel {
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
    pub(super) fn task_prune(&mut self, t: usize) {
        self.running(t).host.prune_due();
        self.task_drive(t);
    }

    /// What Kafka says of each upstream channel; the machine prunes by it.
    pub(super) fn task_prune_upstream(&mut self, t: usize, channels: &[ChannelId]) {
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

    /// The periodic log-start check is due: the machine asks for every received channel
    /// if the task holds records.
    pub(super) fn task_check_log_start(&mut self, t: usize) {
        self.running(t).host.log_start_check_due();
        self.task_drive(t);
    }

    /// The scheduler ends the step: an empty poll (which drains, if the step is the first
    /// after a restore and no feed did) and the commit.
    pub(super) fn task_end_step(&mut self, t: usize) {
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

    /// Ends the step as the machine says: nothing when it is idle, else one transaction
    /// of the engine's changes with the projection writes — which the projection may
    /// reject, and which (where the scenario has leases) may fail, lose its answer, die
    /// with its process, or be in flight when its owner freezes.
    pub(super) fn task_commit(&mut self, t: usize) {
        let Some(commit) = self.running(t).host.end_step() else {
            self.trace.push(format!("{} task{t} step idle", self.step));
            return;
        };
        if commit.careful {
            self.stats.careful_commits += 1;
        }
        let run = self.running(t);
        let applied = std::mem::take(&mut run.applied);
        let read_to = run.read_to.clone();
        let fed = std::mem::take(&mut run.fed_in_step);
        let epoch_when_sent = self.db.tasks[t].epoch;
        // The projection rejects a value for good: one record per call (careful) names it;
        // a batch cannot, and is retried carefully.
        if let Some(&rejected) = applied.iter().find(|p| self.oracle.is_poison(p.id)) {
            if commit.careful && fed <= 1 {
                return self.task_rejected(t, rejected.id);
            }
            self.stats.batch_rejections += 1;
            self.trace.push(format!("{} task{t} projection rejects a batch holding #{}", self.step, rejected.id));
            return self.task_failed(t, Failure::BatchRejected);
        }
        let in_flight = InFlight { commit, applied, read_to, epoch_when_sent };
        if self.scenario.ha && self.phase == Phase::Work {
            if self.may_freeze(t) && self.rng.chance(1, FREEZE_MID_COMMIT_ODDS) {
                return self.task_freeze(t, Some(in_flight));
            }
            if self.rng.chance(1, CRASH_MID_COMMIT_ODDS) {
                self.stats.crashes_mid_commit += 1;
                if self.sabotage == Sabotage::StepInTwoTransactions {
                    // The rows' transaction committed; the ordering state's never will.
                    self.db.tasks[t].apply_rows(&in_flight.applied);
                    let ids: Vec<RecordId> = in_flight.applied.iter().map(|p| p.id).collect();
                    self.oracle.applied(self.tasks[t].receiver, &ids);
                    self.db_version += 1;
                    self.changes += 1;
                }
                self.trace.push(format!("{} task{t} dies mid-commit", self.step));
                return self.task_crash(t);
            }
            if self.rng.chance(1, TRANSIENT_FAILURE_ODDS) {
                self.stats.transient_failures += 1;
                self.trace.push(format!("{} task{t} commit fails", self.step));
                return self.task_failed(t, Failure::Error);
            }
            if self.rng.chance(1, LOST_ANSWER_ODDS) {
                let epoch = self.running(t).epoch;
                let arrived = self.rng.chance(1, 2) && self.task_db_commit(t, &in_flight, epoch);
                if arrived {
                    self.oracle.commit(self.tasks[t].receiver);
                    self.stats.lost_answers_applied += 1;
                } else {
                    self.stats.lost_answers_not_applied += 1;
                }
                self.trace.push(format!("{} task{t} commit answer lost (applied: {arrived})", self.step));
                return self.task_failed(t, Failure::Error);
            }
        }
        self.task_arrives(t, in_flight);
    }

    /// The owner's step transaction reaches the database: applied (the epoch holds), or
    /// fenced.
    pub(super) fn task_arrives(&mut self, t: usize, in_flight: InFlight) {
        let epoch = self.running(t).epoch;
        if !self.task_db_commit(t, &in_flight, epoch) {
            self.trace.push(format!("{} task{t} fenced at commit", self.step));
            self.running(t).host.fenced();
            return;
        }
        let n = in_flight.applied.len();
        self.oracle.commit(self.tasks[t].receiver);
        self.stats.deliveries += n as u64;
        self.stats.commits += 1;
        if in_flight.commit.write_running && self.scenario.ha {
            self.stats.recoveries_recorded += 1;
        }
        self.trace.push(format!("{} task{t} commit ({n} applied)", self.step));
        self.running(t).host.committed();
    }

    /// The database's side of a step's transaction sent at `epoch`: the row lock and the
    /// epoch check, the projection's rows, the ordering state, one commit. Returns whether
    /// it was applied (false: another owner's epoch, nothing written).
    /// `EpochCheckedBeforeLock` goes by the epoch the row said when the step was sent;
    /// `ZombieStepAccepted` checks none.
    pub(super) fn task_db_commit(&mut self, t: usize, in_flight: &InFlight, epoch: u64) -> bool {
        let accepted = match self.sabotage {
            Sabotage::ZombieStepAccepted => true,
            Sabotage::EpochCheckedBeforeLock => in_flight.epoch_when_sent == epoch,
            _ => self.db.tasks[t].epoch == epoch,
        };
        if !accepted {
            return false;
        }
        if in_flight.commit.write_running {
            self.db.tasks[t].refusal = None;
            self.db.tasks[t].failing = false;
        }
        self.committed_read.extend(in_flight.read_to.clone());
        // The step's NOTIFY: its clock changed, or its status did.
        let changes = &in_flight.commit.changes;
        if in_flight.commit.notify || !changes.clock_upserts.is_empty() || !changes.clock_removed.is_empty() {
            self.notify_gateways(t);
        }
        self.db.commit(t as u32, in_flight.commit.changes.clone(), &in_flight.applied);
        let ids: Vec<RecordId> = in_flight.applied.iter().map(|p| p.id).collect();
        self.oracle.applied(self.tasks[t].receiver, &ids);
        self.db_version += 1;
        self.changes += 1;
        true
    }

    /// The step (nothing of it applied, as far as the host knows) failed: the machine
    /// restores before anything is fed again, and the failure is recorded in the row (its
    /// own transaction, epoch checked).
    pub(super) fn task_failed(&mut self, t: usize, failure: Failure) {
        let receiver = self.tasks[t].receiver;
        self.oracle.discard(receiver);
        let run = self.running(t);
        run.applied.clear();
        run.read_to.clear();
        run.fed_in_step = 0;
        run.host.failed(failure);
        let epoch = run.epoch;
        if self.db.tasks[t].epoch == epoch {
            self.db.tasks[t].failing = true;
            self.stats.failures_recorded += 1;
            self.running(t).host.failure_recorded();
        } else {
            self.running(t).host.fenced();
            return;
        }
        self.task_drive(t);
    }

    /// The projection rejected record `id` alone, in a careful step: the step rolls back,
    /// and the refusal is recorded on its own (epoch checked). A restart must meet it again.
    pub(super) fn task_rejected(&mut self, t: usize, id: RecordId) {
        let receiver = self.tasks[t].receiver;
        self.oracle.discard(receiver);
        let (channel, position) = (self.oracle.record(id).channel, self.oracle.record(id).position);
        let run = self.running(t);
        run.applied.clear();
        run.read_to.clear();
        run.fed_in_step = 0;
        run.host.rejected(channel, position, format!("the projection rejected record #{id}"));
        let Next::PersistRefusal(refusal) = self.running(t).host.next_action() else {
            panic!("a rejection is persisted next");
        };
        if self.db.tasks[t].epoch != self.running(t).epoch {
            self.running(t).host.fenced();
            return;
        }
        self.db.tasks[t].refusal = Some(refusal.clone());
        self.db_version += 1;
        self.changes += 1;
        self.running(t).host.refusal_persisted();
        self.tasks[t].refused = true;
        self.stats.refusals += 1;
        self.trace.push(format!("{} task{t} refused {}: {}", self.step, refusal.reason, refusal.diagnosis));
        if !self.oracle.is_poison(id) {
            let detail = format!("task{t} refused: {refusal} (its projection accepts the value)");
            self.oracle.report(ViolationKind::UnexpectedRefusal, detail);
        }
        match self.tasks[t].expect_refusal.take() {
            Some(before) if before == refusal => self.stats.rejections_recurred += 1,
            Some(before) => {
                let detail = format!("task{t} refused {before} before its restart, but {refusal} after");
                self.oracle.report(ViolationKind::RefusalNotRecurring, detail);
            }
            None => self.stats.rejections += 1,
        }
    }

    /// The owner pauses past its lease (with its step's commit in flight, or between
    /// steps): it stops renewing, and the task is free once the lease runs out.
    pub(super) fn task_freeze(&mut self, t: usize, in_flight: Option<InFlight>) {
        let TaskState::Up(run) = std::mem::replace(&mut self.tasks[t].state, TaskState::Down) else { return };
        self.db.tasks[t].lease_until = self.step + LEASE_STEPS;
        self.stats.freezes += 1;
        if in_flight.is_some() {
            self.stats.freezes_mid_commit += 1;
        }
        let what = if in_flight.is_some() { "with a commit in flight" } else { "between steps" };
        self.trace.push(format!("{} task{t} owner (epoch {}) freezes {what}", self.step, run.epoch));
        self.frozen.push(Frozen { task: t, run, in_flight });
    }

    /// A frozen execution wakes. Before a takeover it goes on (its commit in flight
    /// arrives). After one it is a zombie: its commit (in flight, or of the step it had
    /// open) or its lease renewal finds another epoch, and it stops there.
    pub(super) fn task_thaw(&mut self, z: usize) {
        let Frozen { task: t, mut run, in_flight } = self.frozen.remove(z);
        let epoch = run.epoch;
        if self.db.tasks[t].epoch == epoch {
            debug_assert!(matches!(self.tasks[t].state, TaskState::Down), "a claim raises the epoch");
            self.db.tasks[t].lease_until = u64::MAX;
            self.stats.thaws_resumed += 1;
            self.trace.push(format!("{} task{t} owner (epoch {epoch}) wakes and goes on", self.step));
            self.tasks[t].state = TaskState::Up(run);
            if let Some(in_flight) = in_flight {
                self.task_arrives(t, in_flight);
                self.task_drive(t);
            }
            return;
        }
        let in_flight = in_flight.or_else(|| {
            let commit = if run.host.step_open() { run.host.end_step() } else { None }?;
            let applied = std::mem::take(&mut run.applied);
            Some(InFlight { commit, applied, read_to: run.read_to.clone(), epoch_when_sent: self.db.tasks[t].epoch })
        });
        let Some(in_flight) = in_flight else {
            // Its renewal names its old epoch.
            if self.sabotage != Sabotage::ZombieStepAccepted {
                self.stats.zombie_renewals_fenced += 1;
                run.host.fenced();
            }
            self.trace.push(format!("{} zombie of task{t} (epoch {epoch}) wakes, renews, stops", self.step));
            return;
        };
        // A value the projection rejects rolls the zombie's step back whatever the epoch.
        let rejected = in_flight.applied.iter().any(|p| self.oracle.is_poison(p.id));
        if !rejected && self.task_db_commit(t, &in_flight, epoch) {
            self.trace.push(format!("{} zombie of task{t} (epoch {epoch}) commits late", self.step));
            run.host.committed();
        } else {
            self.stats.zombie_commits_fenced += 1;
            self.trace.push(format!("{} zombie of task{t} (epoch {epoch}) fenced at commit", self.step));
            run.host.fenced();
        }
    }

    /// The engine and the step in progress are gone; only committed rows remain.
    pub(super) fn task_down(&mut self, t: usize) {
        let receiver = self.tasks[t].receiver;
        self.oracle.discard(receiver);
        self.tasks[t].state = TaskState::Down;
        // Its lease is renewed no more.
        self.db.tasks[t].lease_until = self.step + LEASE_STEPS;
    }

    pub(super) fn task_crash(&mut self, t: usize) {
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
}
