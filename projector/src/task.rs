//! One task of a model: its consumer, its engine, and its steps. A step feeds a batch of
//! consumed records to the engine, hands the deliveries to the projection and commits the
//! projection's writes, the engine's state changes, the task status and a `NOTIFY` in one
//! SQL transaction whose first statement locks the task's row and checks its epoch.
//!
//! If a step does not commit, the engine is discarded and restored from the database, and
//! the task reads again from `fed_up_to + 1` with a new consumer (no record fetched before
//! the failure can reach the new engine).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use parsley::channel::{ChannelId, Position};
use parsley::engine::{ChannelFact, Delivery, Receipt};
use parsley::refusal::{Refusal, RefusalReason};
use parsley::startup::check_task_width;
use parsley::{CausalPast, Engine};
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use sqlx::{PgConnection, PgPool};

use crate::config::{InitialPosition, OnRejected};
use crate::kafka;
use crate::metrics::{Metric, Metrics};
use crate::model::ModelPlan;
use crate::projection::{Delivered, Projection, ProjectionError, StepContext};
use crate::record::{self, Consumed, RecordData};
use crate::skip::mark_skipped_held;
use crate::store::{self, LoadError, TaskStatusKind};

/// Where a task stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskState {
    Running,
    /// The last step failed; the next is tried at `retry_at`.
    Failing {
        failures: u32,
        retry_at: Instant,
        error: String,
    },
    /// Stopped delivering, with a reason, until an operator clears it.
    Refused(Refusal),
    /// Another owner took the task; this runner no longer touches it.
    Fenced,
}

/// What one call of [`TaskRunner::run_once`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepOutcome {
    /// A step committed.
    Committed { fed: usize, replayed: usize, delivered: usize, held: usize },
    /// Nothing arrived within the step's time bound; no transaction was opened.
    Idle,
    /// The step failed and rolled back; it is retried with backoff.
    Failed { error: String },
    /// The task is refused (now or before).
    Refused(Refusal),
    /// Another owner took the task.
    Fenced,
}

/// What the projection sees of a delivery.
fn view<'a>(plan: &'a ModelPlan, d: &'a Delivery<RecordData>) -> Delivered<'a> {
    Delivered {
        topic: plan.topic_name(&d.channel.topic).unwrap_or("?"),
        channel: d.channel,
        position: d.position,
        key: d.payload.key.as_deref(),
        value: d.payload.value.as_deref(),
        headers: &d.payload.headers,
        timestamp_ms: d.payload.timestamp_ms,
        causes: &d.causes,
    }
}

/// A rejection by the projection, carried out of a step's transaction as its error.
/// `record` (channel, position, coordinate) is the record the step applied alone; `None`
/// when a batch was rejected and the record is not known.
#[derive(Debug)]
struct Rejection {
    record: Option<(ChannelId, Position, String)>,
    reason: String,
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.record {
            Some((_, _, coordinate)) => write!(f, "the projection rejected {coordinate}: {}", self.reason),
            None => write!(
                f,
                "the projection rejected a record of the step ({}); retrying one record at a time to name it",
                self.reason
            ),
        }
    }
}

impl std::error::Error for Rejection {}

/// The runner of one task.
pub struct TaskRunner<P: Projection> {
    plan: Arc<ModelPlan>,
    task: u32,
    epoch: i64,
    pool: PgPool,
    projection: Arc<P>,
    metrics: Arc<Metrics>,
    consumer: Option<Arc<StreamConsumer>>,
    engine: Engine<RecordData>,
    state: TaskState,
    /// What the task's row says, so a recovered task writes `running` exactly once.
    stored_status: TaskStatusKind,
    /// The in-memory engine may be ahead of the database (a step did not commit, or was
    /// cancelled): restore before the next step.
    needs_restore: bool,
    /// Offer held heads before feeding (after start or restore).
    needs_drain: bool,
    /// The consumer reported an out-of-range position: compare every log start with what
    /// the task has settled.
    check_log_start: bool,
    /// When log starts were last compared (at start, on an out-of-range fetch, or by the
    /// periodic check of the channels holding records).
    log_start_checked_at: Instant,
    /// When upstream channels were last pruned (or found absent).
    pruned_at: Instant,
    /// When the received topics' partition counts were last compared with the task count.
    width_checked_at: Instant,
    /// This instance's name in the task's row.
    owner: String,
    /// After a failure, steps feed one record at a time until the task is past every
    /// position the failed step had fed, so records before a bad one still commit and
    /// the status names the bad one.
    careful_until: Option<BTreeMap<ChannelId, Position>>,
    /// The records operators skipped (`parsley.skips`), read at every restore: fed without
    /// causes, delivered without effect.
    skipped: BTreeSet<(ChannelId, Position)>,
    /// When each channel's current head started being held.
    head_since: BTreeMap<ChannelId, (Position, Instant)>,
}

fn labels(plan: &ModelPlan, task: &str) -> [(&'static str, String); 2] {
    [("model", plan.name.clone()), ("task", task.to_string())]
}

/// What a task's runner is started from: its model, task number, services and owner name.
/// The supervisor keeps it to start the task again.
pub struct RunnerSpec<P: Projection> {
    pub plan: Arc<ModelPlan>,
    pub task: u32,
    pub pool: PgPool,
    pub projection: Arc<P>,
    pub metrics: Arc<Metrics>,
    pub owner: String,
}

impl<P: Projection> Clone for RunnerSpec<P> {
    fn clone(&self) -> Self {
        RunnerSpec {
            plan: Arc::clone(&self.plan),
            task: self.task,
            pool: self.pool.clone(),
            projection: Arc::clone(&self.projection),
            metrics: Arc::clone(&self.metrics),
            owner: self.owner.clone(),
        }
    }
}

impl<P: Projection> RunnerSpec<P> {
    /// [`TaskRunner::start`]: takes the task (a new epoch) and restores it.
    pub async fn start(&self) -> anyhow::Result<TaskRunner<P>> {
        TaskRunner::start(
            Arc::clone(&self.plan),
            self.task,
            self.pool.clone(),
            Arc::clone(&self.projection),
            Arc::clone(&self.metrics),
            &self.owner,
        )
        .await
    }
}

impl<P: Projection> TaskRunner<P> {
    /// Takes the task (a new epoch fences any previous owner), restores its state, seeds
    /// and checks its positions, and assigns its channels to a new consumer.
    pub async fn start(
        plan: Arc<ModelPlan>,
        task: u32,
        pool: PgPool,
        projection: Arc<P>,
        metrics: Arc<Metrics>,
        owner: &str,
    ) -> anyhow::Result<TaskRunner<P>> {
        let row = store::take_task(&pool, &plan.name, task, owner).await?;
        let mut runner = TaskRunner {
            engine: Engine::new(plan.engine_config(), plan.channels(task)).with_weigher(record::weight),
            plan,
            task,
            epoch: row.epoch,
            pool,
            projection,
            metrics,
            consumer: None,
            state: TaskState::Running,
            stored_status: row.status,
            needs_restore: true,
            needs_drain: true,
            check_log_start: false,
            log_start_checked_at: Instant::now(),
            pruned_at: Instant::now(),
            width_checked_at: Instant::now(),
            owner: owner.to_string(),
            careful_until: None,
            skipped: BTreeSet::new(),
            head_since: BTreeMap::new(),
        };
        tracing::info!(model = %runner.plan.name, task, epoch = row.epoch, owner, "took task");
        // A refusal recorded by an earlier execution is not restored: it is derived again
        // from the same input (the refused record is never marked fed), so a fix the
        // operator made takes effect now, and an unfixed cause refuses identically.
        if let Err(e) = runner.restore(true).await {
            runner.fail(e, &[]).await;
        }
        Ok(runner)
    }

    pub fn task(&self) -> u32 {
        self.task
    }

    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    pub fn state(&self) -> &TaskState {
        &self.state
    }

    /// The engine (for status and tests). Ahead of the database while a step is open.
    pub fn engine(&self) -> &Engine<RecordData> {
        &self.engine
    }

    /// What this runner was started from, to start the task again (after a panic, or once
    /// its refusal was lifted).
    pub fn spec(&self) -> RunnerSpec<P> {
        RunnerSpec {
            plan: Arc::clone(&self.plan),
            task: self.task,
            pool: self.pool.clone(),
            projection: Arc::clone(&self.projection),
            metrics: Arc::clone(&self.metrics),
            owner: self.owner.clone(),
        }
    }

    /// For a refused runner: re-reads the task's row and answers whether the refusal was
    /// lifted (the row no longer says `refused` — an operator's `skip` clears it in the
    /// transaction that records the skip), so the task should start again. A row that
    /// another instance took meanwhile (new epoch, other owner) fences this runner.
    pub async fn refusal_lifted(&mut self) -> anyhow::Result<bool> {
        if !matches!(self.state, TaskState::Refused(_)) {
            return Ok(false);
        }
        let mut conn = self.pool.acquire().await.context("acquiring a connection to re-read a refused task")?;
        let rows = store::load_tasks(&mut conn, &self.plan.name).await?;
        let Some(row) = rows.into_iter().find(|r| r.task == self.task) else { return Ok(false) };
        if row.status == TaskStatusKind::Refused {
            return Ok(false);
        }
        if row.epoch != self.epoch && row.owner != self.owner {
            self.become_fenced();
            return Ok(false);
        }
        tracing::info!(model = %self.plan.name, task = self.task, status = row.status.as_str(),
            "the task's refusal was lifted; starting it again");
        Ok(true)
    }

    fn label_values(&self) -> [(&'static str, String); 2] {
        labels(&self.plan, &self.task.to_string())
    }

    fn metric_add(&self, metric: Metric, v: f64) {
        let l = self.label_values();
        self.metrics.add(metric, &[(l[0].0, &l[0].1), (l[1].0, &l[1].1)], v);
    }

    fn metric_set(&self, metric: Metric, v: f64) {
        let l = self.label_values();
        self.metrics.set(metric, &[(l[0].0, &l[0].1), (l[1].0, &l[1].1)], v);
    }

    fn become_refused(&mut self, refusal: Refusal) {
        tracing::error!(
            model = %self.plan.name, task = self.task, reason = %refusal.reason,
            channel = ?refusal.channel.map(|c| self.plan.describe(&c)), position = ?refusal.position,
            diagnosis = %refusal.diagnosis, "task refused"
        );
        self.metric_set(Metric::TaskRefused, 1.0);
        self.metric_set(Metric::TaskFailing, 0.0);
        self.consumer = None;
        self.state = TaskState::Refused(refusal);
    }

    fn become_fenced(&mut self) {
        tracing::warn!(model = %self.plan.name, task = self.task, epoch = self.epoch, "another owner took the task; stopping it here");
        self.metric_add(Metric::FencedTotal, 1.0);
        self.consumer = None;
        self.state = TaskState::Fenced;
    }

    /// Rebuilds the engine from the database and assigns a new consumer at `fed_up_to + 1`
    /// (seeding channels with no state from their initial positions when `seed`).
    async fn restore(&mut self, seed: bool) -> anyhow::Result<()> {
        self.consumer = None;
        let plan = Arc::clone(&self.plan);
        let mut conn = self.pool.acquire().await.context("acquiring a connection to restore the task")?;
        let model_row = store::load_model(&mut conn, &plan.name)
            .await?
            .with_context(|| format!("model {:?} has no row in parsley.models", plan.name))?;
        let mut state = match store::load_state(&mut conn, &plan.name, self.task, model_row.format_version).await {
            Ok(s) => s,
            Err(LoadError::Database(e)) => return Err(e),
            Err(LoadError::Refused(r)) => return self.persist_start_refusal(r).await,
        };
        self.skipped = store::skipped_positions(&mut conn, &plan.name, self.task).await?;
        mark_skipped_held(&mut state, &self.skipped);
        drop(conn);
        self.engine = match Engine::restore(plan.engine_config(), plan.channels(self.task), state) {
            Ok(e) => e.with_weigher(record::weight),
            Err(r) => return self.persist_start_refusal(r).await,
        };
        let consumer = Arc::new(kafka::task_consumer(&plan.kafka, &plan.name)?);
        let timeout = plan.kafka_timeout();
        if seed {
            self.log_start_checked_at = Instant::now();
            let mut log_starts = Vec::with_capacity(plan.topics.len());
            for topic in &plan.topics {
                let channel = ChannelId::new(topic.id, self.task);
                let (log_start, last_stable) = kafka::watermarks(&consumer, &topic.name, self.task, timeout).await?;
                if self.engine.fed_up_to(&channel).is_none() {
                    let baseline = match topic.initial {
                        InitialPosition::Earliest => log_start - 1,
                        InitialPosition::Latest => last_stable - 1,
                    };
                    let _ = self.engine.seed(channel, baseline);
                }
                log_starts.push((channel, log_start));
            }
            // In channel order, as every other check: a refusal (sticky in the engine and
            // persisted just below) then names the same channel on every start.
            log_starts.sort();
            for (channel, log_start) in log_starts {
                if self.engine.observe_log_start(channel, log_start).is_err() {
                    break;
                }
            }
            let changes = self.engine.take_changes();
            let mut tx = self.pool.begin().await.context("beginning the start transaction")?;
            if store::lock_epoch(&mut tx, &plan.name, self.task).await? != Some(self.epoch) {
                drop(tx);
                self.become_fenced();
                return Ok(());
            }
            // A skip takes this lock too: one recorded since the skips were read means the
            // engine was restored without it.
            if store::count_skips(&mut tx, &plan.name, self.task).await? != self.skipped.len() {
                anyhow::bail!("a record was skipped while the task was restoring; restoring again");
            }
            store::apply_changes(&mut tx, &plan.name, self.task, &changes).await?;
            let status_reset = changes.refusal.is_none() && self.stored_status == TaskStatusKind::Refused;
            if status_reset {
                store::record_running(&mut tx, &plan.name, self.task).await?;
            }
            if changes.refusal.is_some() || status_reset {
                store::notify(&mut tx, &plan.name, Some(self.task)).await?;
            }
            tx.commit().await.context("committing the start transaction")?;
            if status_reset {
                self.stored_status = TaskStatusKind::Running;
            }
            if let Some(r) = changes.refusal {
                self.metric_reason(&r);
                self.become_refused(r);
                return Ok(());
            }
        }
        let mut assignment = TopicPartitionList::new();
        for topic in &plan.topics {
            let channel = ChannelId::new(topic.id, self.task);
            let fed = self.engine.fed_up_to(&channel).with_context(|| format!("channel {channel} has no baseline"))?;
            assignment
                .add_partition_offset(&topic.name, self.task as i32, Offset::Offset(fed + 1))
                .with_context(|| format!("assigning {}/{}", topic.name, self.task))?;
        }
        consumer.assign(&assignment).context("assigning the task's channels")?;
        self.consumer = Some(consumer);
        self.needs_restore = false;
        self.needs_drain = true;
        self.head_since.clear();
        self.refresh_gauges();
        Ok(())
    }

    fn metric_reason(&self, refusal: &Refusal) {
        let l = self.label_values();
        self.metrics.add(
            Metric::RefusalsTotal,
            &[(l[0].0, &l[0].1), (l[1].0, &l[1].1), ("reason", refusal.reason.as_str())],
            1.0,
        );
    }

    /// Persists a refusal found outside a step's own transaction: while restoring (stored
    /// state this build cannot use), or after a step rolled back on a record the projection
    /// rejected.
    async fn persist_start_refusal(&mut self, refusal: Refusal) -> anyhow::Result<()> {
        let mut tx = self.pool.begin().await.context("beginning a refusal transaction")?;
        if store::lock_epoch(&mut tx, &self.plan.name, self.task).await? != Some(self.epoch) {
            drop(tx);
            self.become_fenced();
            return Ok(());
        }
        store::record_refusal(&mut tx, &self.plan.name, self.task, &refusal).await?;
        store::notify(&mut tx, &self.plan.name, Some(self.task)).await?;
        tx.commit().await.context("committing a refusal")?;
        self.metric_reason(&refusal);
        self.become_refused(refusal);
        Ok(())
    }

    /// Runs one step: waits out a failing task's backoff, restores if needed, polls a batch
    /// (bounded in records and time) and commits it in one transaction.
    pub async fn run_once(&mut self) -> StepOutcome {
        match &self.state {
            TaskState::Refused(r) => return StepOutcome::Refused(r.clone()),
            TaskState::Fenced => return StepOutcome::Fenced,
            TaskState::Failing { retry_at, .. } => tokio::time::sleep_until((*retry_at).into()).await,
            TaskState::Running => {}
        }
        if self.needs_restore {
            if let Err(e) = self.restore(true).await {
                return self.fail(e, &[]).await;
            }
            if let Some(outcome) = self.stopped_outcome() {
                return outcome;
            }
        }
        let batch = self.poll().await;
        // Both checks run before the batch is fed, against the engine as the database has
        // it, so a refusal found here is derived identically by the next start.
        let out_of_range = std::mem::take(&mut self.check_log_start);
        if out_of_range {
            if let Err(e) = self.observe_log_starts(&self.plan.channels(self.task)).await {
                return self.fail(e, &[]).await;
            }
        } else if let Some(holding) = self.log_start_check_due() {
            self.metric_add(Metric::LogStartChecksTotal, 1.0);
            if let Err(e) = self.observe_log_starts(&holding).await {
                // Not a failed step: nothing was fed, and the next check comes an interval
                // later (a broker that cannot answer would stall every step otherwise).
                self.metric_add(Metric::KafkaErrorsTotal, 1.0);
                tracing::warn!(model = %self.plan.name, task = self.task, error = %format!("{e:#}"),
                    "the periodic log-start check failed; trying again after the interval");
            }
        }
        self.check_width_if_due().await;
        let pruned = self.prune_upstream_if_due().await;
        let outcome = self.step(batch, pruned).await;
        if out_of_range && self.state == TaskState::Running {
            // Not refused: the log start is still within reach. Read on from fed_up_to + 1
            // with a fresh consumer rather than trust the one that reported the error.
            self.needs_restore = true;
        }
        outcome
    }

    fn stopped_outcome(&self) -> Option<StepOutcome> {
        match &self.state {
            TaskState::Refused(r) => Some(StepOutcome::Refused(r.clone())),
            TaskState::Fenced => Some(StepOutcome::Fenced),
            _ => None,
        }
    }

    /// Collects up to the step's record bound, waiting at most the step's time bound.
    async fn poll(&mut self) -> Vec<Consumed> {
        let Some(consumer) = self.consumer.clone() else { return Vec::new() };
        let max = if self.careful_until.is_some() { 1 } else { self.plan.max_step_records };
        let deadline = tokio::time::Instant::now() + self.plan.max_step_time;
        let mut batch = Vec::new();
        while batch.len() < max {
            // Wait up to the step's deadline for the first record; after that, only while
            // records keep coming (`step_linger`), so a lone write is not held for the window.
            let until = if batch.is_empty() {
                deadline
            } else {
                deadline.min(tokio::time::Instant::now() + self.plan.step_linger)
            };
            match tokio::time::timeout_at(until, consumer.recv()).await {
                Err(_) => break,
                Ok(Ok(message)) => batch.push(Consumed::from_message(&message)),
                Ok(Err(e)) => {
                    self.metric_add(Metric::KafkaErrorsTotal, 1.0);
                    if let KafkaError::MessageConsumption(
                        RDKafkaErrorCode::AutoOffsetReset | RDKafkaErrorCode::OffsetOutOfRange,
                    ) = e
                    {
                        self.check_log_start = true;
                        tracing::warn!(model = %self.plan.name, task = self.task, error = %e, "a position is out of range; checking log starts");
                        break;
                    }
                    tracing::warn!(model = %self.plan.name, task = self.task, error = %e, "Kafka consumer error (retrying)");
                    // Transport errors: librdkafka reconnects; do not spin on them.
                    if batch.is_empty() {
                        tokio::time::sleep(Duration::from_millis(100).min(self.plan.max_step_time)).await;
                    }
                }
            }
        }
        batch
    }

    /// The channels due for the periodic log-start check: those holding records, once the
    /// interval has passed since the last check. A running task never fetches below its
    /// position, so without this, retention passing a held record would be noticed only
    /// at the next start.
    fn log_start_check_due(&self) -> Option<Vec<ChannelId>> {
        let interval = self.plan.log_start_check?;
        if self.log_start_checked_at.elapsed() < interval {
            return None;
        }
        let holding: Vec<ChannelId> = self.engine.channels_holding().collect();
        (!holding.is_empty()).then_some(holding)
    }

    /// Compares the log start of each of `channels` with what the task has settled; a
    /// refusal is left in the engine (sticky) for the step to persist.
    async fn observe_log_starts(&mut self, channels: &[ChannelId]) -> anyhow::Result<()> {
        self.log_start_checked_at = Instant::now();
        let Some(consumer) = self.consumer.clone() else { return Ok(()) };
        for channel in channels {
            let topic = self
                .plan
                .topic_name(&channel.topic)
                .with_context(|| format!("channel {channel} is not received by the model"))?;
            let (log_start, _) =
                kafka::watermarks(&consumer, topic, channel.partition, self.plan.kafka_timeout()).await?;
            if self.engine.observe_log_start(*channel, log_start).is_err() {
                break;
            }
        }
        Ok(())
    }

    /// When due, compares each received topic's partition count with the model's task
    /// count: partitions added while running move keys between tasks, so every task refuses
    /// `TASK_WIDTH_CHANGED` (left in the engine, sticky, for the step to persist; a restart
    /// derives it again at the model's start). A topic the broker does not list is not a
    /// width change (start checks identities), and a broker that cannot answer is logged and
    /// counted, never a failed step: the next interval tries again.
    async fn check_width_if_due(&mut self) {
        let Some(interval) = self.plan.width_check else { return };
        if self.width_checked_at.elapsed() < interval || self.engine.refusal().is_some() {
            return;
        }
        self.width_checked_at = Instant::now();
        let Some(consumer) = self.consumer.clone() else { return };
        let names: Vec<String> = self.plan.topics.iter().map(|t| t.name.clone()).collect();
        let counts = match kafka::partition_counts(&consumer, names, self.plan.kafka_timeout()).await {
            Ok(counts) => counts,
            Err(e) => {
                self.metric_add(Metric::KafkaErrorsTotal, 1.0);
                tracing::warn!(model = %self.plan.name, task = self.task, error = %format!("{e:#}"),
                    "the periodic width check failed; trying again after the interval");
                return;
            }
        };
        self.metric_add(Metric::WidthChecksTotal, 1.0);
        for (topic, count) in self.plan.topics.iter().zip(counts) {
            let Some(count) = count else { continue };
            if let Err(r) = check_task_width(Some(self.plan.task_count), count) {
                let diagnosis = format!("model {}, topic {}: {}", self.plan.name, topic.name, r.diagnosis);
                self.engine.refuse(Refusal::at(r.reason, ChannelId::new(topic.id, self.task), None, diagnosis));
                return;
            }
        }
    }

    /// Tells the engine how far the consumer has read each channel: its position, which
    /// passes transaction markers and aborted runs that yield no record. Call only when
    /// every record the consumer returned has been fed. Returns whether a channel's
    /// `fed_up_to` moved (the step must then commit, though nothing was delivered).
    fn observe_read_positions(&mut self) -> bool {
        let Some(consumer) = self.consumer.clone() else { return false };
        let positions = match consumer.position() {
            Ok(p) => p,
            Err(e) => {
                self.metric_add(Metric::KafkaErrorsTotal, 1.0);
                tracing::warn!(model = %self.plan.name, task = self.task, error = %e, "reading the consumer's position failed");
                return false;
            }
        };
        let mut moved = false;
        for element in positions.elements() {
            let Offset::Offset(next) = element.offset() else { continue };
            let Some(channel) = self.plan.channel_of(element.topic(), element.partition()) else { continue };
            let before = self.engine.fed_up_to(&channel);
            if self.engine.observe_read_position(channel, next).is_err() {
                break;
            }
            moved |= self.engine.fed_up_to(&channel) != before;
        }
        moved
    }

    /// The channels of the task's clock and frontier whose topics the model does not
    /// receive (learned from records' causes), once the prune interval has passed; `None`
    /// when not due or when there are none.
    fn prune_due(&mut self) -> Option<Vec<ChannelId>> {
        let interval = self.plan.prune_interval?;
        if self.pruned_at.elapsed() < interval || self.engine.refusal().is_some() || self.consumer.is_none() {
            return None;
        }
        self.pruned_at = Instant::now();
        let received: BTreeSet<_> = self.plan.topics.iter().map(|t| t.id).collect();
        let upstream: BTreeSet<ChannelId> = (self.engine.delivered_past().iter())
            .chain(self.engine.frontier().iter())
            .map(|(c, _)| c)
            .filter(|c| !received.contains(&c.topic))
            .collect();
        (!upstream.is_empty()).then(|| upstream.into_iter().collect())
    }

    /// When due, learns the facts of the upstream channels and prunes the engine's frontier
    /// and clock by them (the engine's rule: below log start, or topic gone). Channels of
    /// received topics, and anything not learned, are `Unknown`: kept. Returns whether a
    /// pair was pruned, so that the step commits even with nothing else to write. A broker
    /// that cannot answer is logged and counted, never a failed step: the next interval
    /// tries again.
    async fn prune_upstream_if_due(&mut self) -> bool {
        let Some(upstream) = self.prune_due() else { return false };
        let Some(consumer) = self.consumer.clone() else { return false };
        let learned = match kafka::upstream_facts(&consumer, upstream, self.plan.kafka_timeout()).await {
            Ok(learned) => learned,
            Err(e) => {
                self.metric_add(Metric::KafkaErrorsTotal, 1.0);
                tracing::warn!(model = %self.plan.name, task = self.task, error = %format!("{e:#}"),
                    "learning the facts of upstream channels failed; pruning again after the interval");
                return false;
            }
        };
        if !learned.errors.is_empty() {
            self.metric_add(Metric::KafkaErrorsTotal, learned.errors.len() as f64);
            tracing::warn!(model = %self.plan.name, task = self.task, errors = ?learned.errors,
                "some upstream facts are unknown; their pairs are kept until a later prune");
        }
        self.metric_add(Metric::PruneChecksTotal, 1.0);
        let before = self.engine.frontier().len() + self.engine.delivered_past().len();
        self.engine.prune(|c| learned.facts.get(c).copied().unwrap_or(ChannelFact::Unknown));
        let pruned = before - (self.engine.frontier().len() + self.engine.delivered_past().len());
        if pruned > 0 {
            self.metric_add(Metric::PairsPrunedTotal, pruned as f64);
            tracing::info!(model = %self.plan.name, task = self.task, pruned, "pruned upstream pairs");
        }
        pruned > 0
    }

    /// One step; `pruned`: the engine pruned pairs since the last commit, which must commit
    /// even when nothing else happened.
    async fn step(&mut self, batch: Vec<Consumed>, pruned: bool) -> StepOutcome {
        let plan = Arc::clone(&self.plan);
        let mut deliveries: Vec<Delivery<RecordData>> = Vec::new();
        if self.needs_drain {
            deliveries.extend(self.engine.drain());
        }
        // Nothing returned: the consumer may still have read past control records.
        let read_past = batch.is_empty() && self.engine.refusal().is_none() && self.observe_read_positions();
        let idle = batch.is_empty() && deliveries.is_empty() && !self.needs_drain && !pruned && !read_past;
        if idle && self.engine.refusal().is_none() && self.stored_status != TaskStatusKind::Failing {
            self.refresh_gauges();
            return StepOutcome::Idle;
        }
        // From here the engine runs ahead of the database until the commit succeeds.
        self.needs_restore = true;
        let mut fed = 0usize;
        let mut replayed = 0usize;
        let mut fed_marks: BTreeMap<ChannelId, Position> = BTreeMap::new();
        for record in batch {
            if self.engine.refusal().is_some() {
                break;
            }
            let channel = match plan.channel_of(&record.topic, record.partition) {
                Some(c) if c.partition == self.task => c,
                _ => {
                    self.engine.refuse(Refusal::new(
                        RefusalReason::SubstrateMisconfigured,
                        format!(
                            "task {} was handed a record of {}/{}, which it does not receive",
                            self.task, record.topic, record.partition
                        ),
                    ));
                    break;
                }
            };
            fed_marks.insert(channel, record.offset);
            let receipt = if self.skipped.contains(&(channel, record.offset)) {
                // Skipped by an operator: fed with no causes and none of its bytes.
                let skipped = RecordData::skipped(record.data.timestamp_ms);
                self.engine.receive_decoded(channel, record.offset, CausalPast::new(), skipped)
            } else {
                let headers: Vec<Option<&[u8]>> = record.causes_headers.iter().map(|h| h.as_deref()).collect();
                self.engine.receive(channel, record.offset, &headers, record.data)
            };
            match receipt {
                Ok(Receipt::Duplicate) => replayed += 1,
                Ok(Receipt::Accepted { deliveries: d }) => {
                    fed += 1;
                    deliveries.extend(d);
                }
                Err(_refusal) => break,
            }
        }
        if self.engine.refusal().is_none() {
            // Every returned record was fed (a refusal is the only way the loop stops early).
            self.observe_read_positions();
        }
        let changes = self.engine.take_changes();
        let step_started = Instant::now();
        let committed = self.commit(&plan, &deliveries, &changes).await;
        match committed {
            Err(e) => match e.downcast::<Rejection>() {
                Ok(Rejection { record: Some((channel, position, coordinate)), reason }) => {
                    self.refuse_rejected(channel, position, &coordinate, &reason).await
                }
                Ok(batch) => {
                    // A batch cannot say which record the projection rejected: retry one
                    // record at a time, including the held records this step delivered.
                    for d in &deliveries {
                        let mark = fed_marks.entry(d.channel).or_insert(d.position);
                        *mark = (*mark).max(d.position);
                    }
                    let marks: Vec<(ChannelId, Position)> = fed_marks.into_iter().collect();
                    self.fail(anyhow::Error::new(batch), &marks).await
                }
                Err(e) => {
                    let marks: Vec<(ChannelId, Position)> = fed_marks.into_iter().collect();
                    self.fail(e, &marks).await
                }
            },
            Ok(false) => {
                self.become_fenced();
                StepOutcome::Fenced
            }
            Ok(true) => {
                self.needs_restore = false;
                self.needs_drain = false;
                let commit_seconds = step_started.elapsed().as_secs_f64();
                self.metrics.observe(Metric::StepCommitSeconds, &[("model", &plan.name)], commit_seconds);
                self.metrics.observe(Metric::StepRecords, &[("model", &plan.name)], fed as f64);
                self.metric_add(Metric::StepsTotal, 1.0);
                self.metric_add(Metric::RecordsReceivedTotal, fed as f64);
                self.metric_add(Metric::RecordsReplayedTotal, replayed as f64);
                self.metric_add(Metric::RecordsDeliveredTotal, deliveries.len() as f64);
                if self.stored_status == TaskStatusKind::Failing && changes.refusal.is_none() {
                    tracing::info!(model = %plan.name, task = self.task, "task recovered");
                    self.stored_status = TaskStatusKind::Running;
                    self.metric_set(Metric::TaskFailing, 0.0);
                }
                if !matches!(self.state, TaskState::Refused(_)) {
                    self.state = TaskState::Running;
                }
                if let Some(until) = &self.careful_until {
                    if until.iter().all(|(c, p)| self.engine.fed_up_to(c).is_some_and(|f| f >= *p)) {
                        self.careful_until = None;
                    }
                }
                self.refresh_gauges();
                tracing::debug!(model = %plan.name, task = self.task, fed, replayed, delivered = deliveries.len(),
                    held = self.engine.held_count(), "step committed");
                if let Some(r) = changes.refusal {
                    self.metric_reason(&r);
                    self.become_refused(r.clone());
                    return StepOutcome::Refused(r);
                }
                StepOutcome::Committed { fed, replayed, delivered: deliveries.len(), held: self.engine.held_count() }
            }
        }
    }

    /// The step transaction. `Ok(false)`: fenced, nothing written.
    async fn commit(
        &mut self,
        plan: &ModelPlan,
        deliveries: &[Delivery<RecordData>],
        changes: &parsley::StepChanges<RecordData>,
    ) -> anyhow::Result<bool> {
        let mut tx = self.pool.begin().await.context("beginning a step")?;
        if store::lock_epoch(&mut tx, &plan.name, self.task).await? != Some(self.epoch) {
            tx.rollback().await.context("rolling back a fenced step")?;
            return Ok(false);
        }
        let (skipped, dead_lettered) = self.project(&mut tx, plan, deliveries).await?;
        let clock_changed = store::apply_changes(&mut tx, &plan.name, self.task, changes).await?;
        let status_changed = self.stored_status == TaskStatusKind::Failing;
        if status_changed && changes.refusal.is_none() {
            store::record_running(&mut tx, &plan.name, self.task).await?;
        }
        if clock_changed || status_changed || changes.refusal.is_some() {
            store::notify(&mut tx, &plan.name, Some(self.task)).await?;
        }
        tx.commit().await.context("committing a step")?;
        if skipped > 0 {
            self.metric_add(Metric::SkipsTotal, skipped as f64);
        }
        if dead_lettered > 0 {
            self.metric_add(Metric::DeadLettersTotal, dead_lettered as f64);
        }
        Ok(true)
    }

    /// Hands the step's deliveries to the projection, in the step's transaction; returns
    /// how many were skipped (never handed over) and dead-lettered.
    ///
    /// Normally the deliveries go in one batch, and a rejection — which a batch cannot pin
    /// on a record — ends the step with a [`Rejection`] naming none: the task then retries
    /// carefully. In careful mode each record is applied alone, so a rejection names it:
    /// under `on_rejected = "refuse"` it ends the step; under `"dead-letter"` each record
    /// runs under a savepoint, and a rejected one is rolled back to it, stored in
    /// `parsley.dead_letters` and delivered without effect, in this step.
    async fn project(
        &self,
        conn: &mut PgConnection,
        plan: &ModelPlan,
        deliveries: &[Delivery<RecordData>],
    ) -> anyhow::Result<(usize, usize)> {
        let (skipped, effective): (Vec<_>, Vec<_>) = deliveries.iter().partition(|d| d.payload.skipped);
        if effective.is_empty() {
            return Ok((skipped.len(), 0));
        }
        let ctx = StepContext { model: &plan.name, task: self.task };
        if self.careful_until.is_none() {
            let views: Vec<Delivered<'_>> = effective.iter().map(|d| view(plan, d)).collect();
            return match self.projection.apply_batch(conn, ctx, &views).await {
                Ok(()) => Ok((skipped.len(), 0)),
                Err(ProjectionError::Rejected { reason }) => {
                    Err(anyhow::Error::new(Rejection { record: None, reason }))
                }
                Err(ProjectionError::Transient(e)) => Err(e.context("the projection failed")),
            };
        }
        let dead_letter = plan.on_rejected == OnRejected::DeadLetter;
        let mut dead_lettered = 0;
        for d in effective {
            let record = view(plan, d);
            if dead_letter {
                store::set_record_savepoint(conn).await?;
            }
            match self.projection.apply_batch(conn, ctx, std::slice::from_ref(&record)).await {
                Ok(()) if dead_letter => {
                    store::release_record_savepoint(conn).await?;
                }
                Ok(()) => {}
                Err(ProjectionError::Rejected { reason }) if dead_letter => {
                    store::rollback_to_record_savepoint(conn).await?;
                    store::insert_dead_letter(conn, &plan.name, self.task, d, &reason).await?;
                    tracing::warn!(model = %plan.name, task = self.task, record = %record.coordinate(), %reason,
                        "the projection rejected a record; dead-lettered, delivered without effect");
                    dead_lettered += 1;
                }
                Err(ProjectionError::Rejected { reason }) => {
                    let at = Some((d.channel, d.position, record.coordinate()));
                    return Err(anyhow::Error::new(Rejection { record: at, reason }));
                }
                Err(ProjectionError::Transient(e)) => {
                    return Err(e.context(format!("the projection failed on {}", record.coordinate())))
                }
            }
        }
        Ok((skipped.len(), dead_lettered))
    }

    /// The projection rejected one record for good (applied alone, so the record is
    /// certain). The step rolled back: the record is not delivered, and the refusal is
    /// recorded in a transaction of its own. A restart derives it again — the record is fed
    /// and delivered again, and the projection rejects it again — until an operator skips
    /// the record or the projection changes.
    async fn refuse_rejected(
        &mut self,
        channel: ChannelId,
        position: Position,
        coordinate: &str,
        reason: &str,
    ) -> StepOutcome {
        self.needs_restore = true;
        let diagnosis = if reason.contains(coordinate) {
            format!("the projection rejected the record: {reason}")
        } else {
            format!("the projection rejected {coordinate}: {reason}")
        };
        let refusal = Refusal::at(RefusalReason::ProjectionRejected, channel, Some(position), diagnosis);
        if let Err(e) = self.persist_start_refusal(refusal).await {
            return self.fail(e, &[]).await;
        }
        self.stopped_outcome().unwrap_or_else(|| StepOutcome::Failed { error: "the refusal was not recorded".into() })
    }

    /// A step failed: record it (own transaction), back off, and restore before retrying.
    async fn fail(&mut self, error: anyhow::Error, fed_marks: &[(ChannelId, Position)]) -> StepOutcome {
        let message = format!("{error:#}");
        self.needs_restore = true;
        self.consumer = None;
        if !fed_marks.is_empty() {
            let until = self.careful_until.get_or_insert_with(BTreeMap::new);
            for (c, p) in fed_marks {
                let e = until.entry(*c).or_insert(*p);
                *e = (*e).max(*p);
            }
        }
        let failures = match &self.state {
            TaskState::Failing { failures, .. } => failures + 1,
            _ => 1,
        };
        let shift = failures.saturating_sub(1).min(20);
        let backoff = self.plan.initial_backoff.saturating_mul(1 << shift).min(self.plan.max_backoff);
        tracing::warn!(model = %self.plan.name, task = self.task, failures, backoff_ms = backoff.as_millis() as u64,
            error = %message, "step failed; rolled back, retrying the same records");
        self.metric_add(Metric::FailuresTotal, 1.0);
        self.metric_set(Metric::TaskFailing, 1.0);
        match store::record_failure(&self.pool, &self.plan.name, self.task, self.epoch, &message).await {
            Ok(true) => self.stored_status = TaskStatusKind::Failing,
            Ok(false) => {
                self.become_fenced();
                return StepOutcome::Fenced;
            }
            Err(e) => {
                tracing::warn!(model = %self.plan.name, task = self.task, error = %format!("{e:#}"), "could not record the failure")
            }
        }
        self.state = TaskState::Failing { failures, retry_at: Instant::now() + backoff, error: message.clone() };
        StepOutcome::Failed { error: message }
    }

    fn refresh_gauges(&mut self) {
        let now = Instant::now();
        let mut oldest = Duration::ZERO;
        for channel in self.engine.received().clone() {
            match self.engine.held(&channel).next().map(|h| h.position) {
                Some(head) => {
                    let since = self.head_since.entry(channel).or_insert((head, now));
                    if since.0 != head {
                        *since = (head, now);
                    }
                    oldest = oldest.max(now - since.1);
                }
                None => {
                    self.head_since.remove(&channel);
                }
            }
        }
        self.metric_set(Metric::HeldRecords, self.engine.held_count() as f64);
        self.metric_set(Metric::HeldBytes, self.engine.held_bytes() as f64);
        self.metric_set(Metric::HeadHoldAgeSeconds, oldest.as_secs_f64());
        self.metric_set(Metric::ClockWidth, self.engine.delivered_past().len() as f64);
    }
}
