//! A model: its received topics resolved to topic IDs and checked against what the database
//! recorded (identity, co-partitioning, task width), and the runners of the tasks this
//! instance owns. `run` drives every task until shutdown, each under a supervisor that
//! starts a panicked runner again and a refused one once its refusal is lifted; `run_once`
//! steps each task once, for tests that want to drive the loop deterministically.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use parsley::channel::ChannelId;
use parsley::engine::EngineConfig;
use parsley::refusal::Refusal;
use parsley::startup::{check_task_width, check_topic_identity, task_width};
use parsley::TopicId;
use parsley_infra::backoff::Backoff;
use sqlx::PgPool;
use tokio::sync::watch;

use crate::health::Health;
use crate::kafka;
use crate::metrics::{Metric, Metrics};
use crate::projection::Projection;
use crate::task::{RunnerSpec, StepOutcome, TaskRunner, TaskState};
use parsley_settings::config::{Config, InitialPosition, KafkaConfig, ModelConfig, OnRejected, Partitioner};
use parsley_settings::contract::Contract;
use parsley_store::leases;
use parsley_store::ordering;

/// One received topic of a model, resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedTopic {
    pub name: String,
    pub id: TopicId,
    pub initial: InitialPosition,
    /// The topic's data contract (`schema`): every value read from it is checked against
    /// it before the projection sees it.
    pub contract: Option<Contract>,
    /// How the topic's producers place keys; a keyed record elsewhere is refused
    /// `KEY_PARTITION_MISMATCH` (`none`: not checked).
    pub partitioner: Partitioner,
}

/// Everything a task runner needs to know about its model.
#[derive(Clone, Debug)]
pub struct ModelPlan {
    pub name: String,
    pub task_count: u32,
    pub topics: Vec<PlannedTopic>,
    pub max_step_records: usize,
    /// Most bytes of records (keys, values, headers) a step takes; `None`: no byte bound.
    pub max_step_bytes: Option<usize>,
    pub max_step_time: Duration,
    /// A step with records ends once nothing new arrived for this long.
    pub step_linger: Duration,
    pub metadata_budget: usize,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// How often a task holding records checks the log start of every channel it receives
    /// (in channel order, as at start); `None`: only at start and on an out-of-range fetch.
    pub log_start_check: Option<Duration>,
    /// How often a task with upstream channels in its clock or frontier prunes them;
    /// `None`: never.
    pub prune_interval: Option<Duration>,
    /// How often each task compares its received topics' partition counts with
    /// `task_count`; `None`: only at start.
    pub width_check: Option<Duration>,
    /// How often a refused task re-reads its row to learn whether the refusal was lifted.
    pub refused_recheck: Duration,
    /// Most records one task may hold; `None`: unbounded.
    pub max_held_records: Option<usize>,
    /// Most bytes one task's held records may weigh ([`crate::record::weight`] plus the
    /// encoded causes); `None`: unbounded.
    pub max_held_bytes: Option<usize>,
    /// What a task does with a record the projection rejects.
    pub on_rejected: OnRejected,
    /// How long a task's lease lasts unless renewed (by a step or a heartbeat).
    pub lease: Duration,
    /// How often the instance renews its membership and leases and rebalances.
    pub heartbeat: Duration,
    pub kafka: KafkaConfig,
}

impl ModelPlan {
    /// The received channels of `task`: partition `task` of every received topic.
    /// The task's received channels in channel order — the engine's order, so every
    /// log-start check (at start, on an out-of-range fetch, periodically) visits channels
    /// alike and a refusal recurs on the same channel after a restart.
    pub fn channels(&self, task: u32) -> Vec<ChannelId> {
        let mut channels: Vec<ChannelId> = self.topics.iter().map(|t| ChannelId::new(t.id, task)).collect();
        channels.sort();
        channels
    }

    pub fn channel_of(&self, topic: &str, partition: i32) -> Option<ChannelId> {
        let t = self.topics.iter().find(|t| t.name == topic)?;
        Some(ChannelId::new(t.id, u32::try_from(partition).ok()?))
    }

    /// The data contract of the received topic `id`, if it has one.
    pub fn contract(&self, id: &TopicId) -> Option<&Contract> {
        self.topics.iter().find(|t| t.id == *id).and_then(|t| t.contract.as_ref())
    }

    /// The partitioner of the received topic `id` (`none` for a topic not received).
    pub fn partitioner(&self, id: &TopicId) -> Partitioner {
        self.topics.iter().find(|t| t.id == *id).map_or(Partitioner::None, |t| t.partitioner)
    }

    pub fn topic_name(&self, id: &TopicId) -> Option<&str> {
        self.topics.iter().find(|t| t.id == *id).map(|t| t.name.as_str())
    }

    /// `name/partition` when the topic is received, else the channel ID.
    pub fn describe(&self, channel: &ChannelId) -> String {
        match self.topic_name(&channel.topic) {
            Some(name) => format!("{name}/{}", channel.partition),
            None => channel.to_string(),
        }
    }

    /// The backoff of failed steps and panicked runners (`projector.initial_backoff_ms`,
    /// `max_backoff_ms`), jittered.
    pub fn backoff(&self) -> Backoff {
        Backoff::new(self.initial_backoff, self.max_backoff)
    }

    pub fn kafka_timeout(&self) -> Duration {
        Duration::from_millis(self.kafka.request_timeout_ms)
    }

    /// The engine configuration of every task of the model.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            metadata_budget: self.metadata_budget,
            max_held_records: self.max_held_records,
            max_held_bytes: self.max_held_bytes,
        }
    }
}

/// A model's projector in this instance.
pub struct ModelProjector<P: Projection> {
    plan: Option<Arc<ModelPlan>>,
    name: String,
    /// Runners of tasks taken at start ([`ModelProjector::start`]); `run` adopts them.
    tasks: Vec<TaskRunner<P>>,
    refusal: Option<Refusal>,
    /// The services and identity `run` starts runners with.
    pool: PgPool,
    projection: Arc<P>,
    metrics: Arc<Metrics>,
    owner: String,
    /// The model's static `tasks` list: this instance runs only these (`None`: it shares
    /// all of the model's tasks with the other instances).
    only: Option<Vec<u32>>,
    /// What the probes read (`None`: nobody reads them).
    health: Option<Arc<Health>>,
}

impl<P: Projection> ModelProjector<P> {
    /// [`ModelProjector::prepare`], then takes every task the instance may run
    /// (`model.tasks`, or all) at once — a new epoch each, fencing any other owner — and
    /// starts their runners: the way to drive tasks step by step ([`Self::run_once`]) in
    /// tests and tools. `run` adopts them and then shares them like any other.
    pub async fn start(
        config: &Config,
        model: &ModelConfig,
        pool: PgPool,
        projection: Arc<P>,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<ModelProjector<P>> {
        let mut projector = ModelProjector::prepare(config, model, pool, projection, metrics).await?;
        let Some(plan) = projector.plan.clone() else { return Ok(projector) };
        let tasks = projector.only.clone().unwrap_or_else(|| (0..plan.task_count).collect());
        for task in tasks {
            let runner = TaskRunner::start(
                Arc::clone(&plan),
                task,
                projector.pool.clone(),
                Arc::clone(&projector.projection),
                Arc::clone(&projector.metrics),
                &projector.owner,
            )
            .await?;
            projector.tasks.push(runner);
        }
        Ok(projector)
    }

    /// Resolves and checks the model's topics and records the model, taking no task: `run`
    /// then takes the instance's share. A model-wide refusal (a recreated topic, a changed
    /// partition count, topics that are not co-partitioned) is recorded on every task of
    /// the model when the model has state, and returned as a projector with no plan.
    /// Errors are for unreachable services and broken databases.
    pub async fn prepare(
        config: &Config,
        model: &ModelConfig,
        pool: PgPool,
        projection: Arc<P>,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<ModelProjector<P>> {
        let names: Vec<String> = model.topics.iter().map(|t| t.name.clone()).collect();
        let resolved = kafka::resolve_topics(&config.kafka, &model.name, &names).await?;
        let recorded = {
            let mut conn = pool.acquire().await.context("acquiring a connection")?;
            ordering::load_model(&mut conn, &model.name).await?
        };
        let owner = config.owner();
        let refused = |refusal: Refusal| ModelProjector {
            plan: None,
            name: model.name.clone(),
            tasks: Vec::new(),
            refusal: Some(refusal),
            pool: pool.clone(),
            projection: Arc::clone(&projection),
            metrics: Arc::clone(&metrics),
            owner: owner.clone(),
            only: None,
            health: None,
        };

        // Identity first: a recreated topic must be named as such, whatever its width.
        let mut ids = Vec::with_capacity(resolved.len());
        for topic in &resolved {
            let then = recorded.as_ref().and_then(|m| m.topics.get(&topic.name).copied());
            let held = match then {
                Some(id) => {
                    let mut conn = pool.acquire().await.context("acquiring a connection")?;
                    ordering::held_on_topic(&mut conn, &model.name, &id).await?
                }
                None => 0,
            };
            match check_topic_identity(topic, then, held) {
                Ok(id) => ids.push(id),
                Err(r) => {
                    let r = Refusal { diagnosis: format!("model {}: {}", model.name, r.diagnosis), ..r };
                    return finish_refused(&pool, &model.name, recorded.as_ref().map(|m| m.task_count), r, refused)
                        .await;
                }
            }
        }
        let width = match task_width(&resolved).and_then(|w| {
            check_task_width(recorded.as_ref().map(|m| m.task_count), w)?;
            Ok(w)
        }) {
            Ok(w) => w,
            Err(r) => {
                let r = Refusal { diagnosis: format!("model {}: {}", model.name, r.diagnosis), ..r };
                return finish_refused(&pool, &model.name, recorded.as_ref().map(|m| m.task_count), r, refused).await;
            }
        };
        let pairs: Vec<(String, TopicId)> = names.iter().cloned().zip(ids.iter().copied()).collect();
        ordering::register_model(&pool, &model.name, width, &pairs).await?;

        let plan = Arc::new(ModelPlan {
            name: model.name.clone(),
            task_count: width,
            topics: model
                .topics
                .iter()
                .zip(&ids)
                .map(|(t, id)| PlannedTopic {
                    name: t.name.clone(),
                    id: *id,
                    initial: t.initial_position(model),
                    contract: t.contract.clone(),
                    partitioner: t.partitioner,
                })
                .collect(),
            max_step_records: model.max_step_records,
            max_step_bytes: (model.max_step_bytes > 0).then_some(model.max_step_bytes),
            max_step_time: model.max_step_time(),
            step_linger: model.step_linger(),
            metadata_budget: config.projector.metadata_budget,
            initial_backoff: config.projector.initial_backoff(),
            max_backoff: config.projector.max_backoff(),
            log_start_check: config.projector.log_start_check(),
            prune_interval: config.projector.prune_interval(),
            width_check: config.projector.width_check(),
            refused_recheck: config.projector.refused_recheck(),
            max_held_records: model.held_limits().0,
            max_held_bytes: model.held_limits().1,
            on_rejected: model.on_rejected,
            lease: config.projector.lease(),
            heartbeat: config.projector.heartbeat(),
            kafka: config.kafka.clone(),
        });
        if let Some(t) = model.tasks.iter().flatten().find(|t| **t >= width) {
            anyhow::bail!("models[{:?}].tasks names task {t}, but the model has {width} tasks", model.name);
        }
        Ok(ModelProjector {
            plan: Some(plan),
            name: model.name.clone(),
            tasks: Vec::new(),
            refusal: None,
            pool,
            projection,
            metrics,
            owner,
            only: model.tasks.clone(),
            health: None,
        })
    }

    /// Reports the model's membership and its runners' steps to `health` (the probes).
    pub fn with_health(mut self, health: Arc<Health>) -> Self {
        self.health = Some(health);
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The resolved model (`None` when the model was refused before it was planned).
    pub fn plan(&self) -> Option<&Arc<ModelPlan>> {
        self.plan.as_ref()
    }

    /// The model-wide refusal found at start, if any.
    pub fn refusal(&self) -> Option<&Refusal> {
        self.refusal.as_ref()
    }

    pub fn tasks(&self) -> &[TaskRunner<P>] {
        &self.tasks
    }

    pub fn tasks_mut(&mut self) -> &mut [TaskRunner<P>] {
        &mut self.tasks
    }

    /// One step of every task, in task order.
    pub async fn run_once(&mut self) -> Vec<StepOutcome> {
        let mut outcomes = Vec::with_capacity(self.tasks.len());
        for t in &mut self.tasks {
            outcomes.push(t.run_once().await);
        }
        outcomes
    }

    /// Runs the model's tasks until `shutdown` turns true: joins the model's members and,
    /// every heartbeat, renews this instance's leases and takes or hands back tasks so that
    /// the instances share them evenly (or, with a static `tasks` list, takes those of them
    /// nobody holds) — see [`crate::balance`]. Each task runs on its own tokio task under a
    /// supervisor (see [`supervise`]). At shutdown every step in progress finishes (commits
    /// or rolls back), the tasks are handed back and the instance leaves, so the others take
    /// them at once.
    pub async fn run(self, shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
        let Some(plan) = self.plan else {
            let mut shutdown = shutdown;
            let _ = shutdown.wait_for(|stop| *stop).await;
            return Ok(());
        };
        let spec = |task: u32| RunnerSpec {
            plan: Arc::clone(&plan),
            task,
            pool: self.pool.clone(),
            projection: Arc::clone(&self.projection),
            metrics: Arc::clone(&self.metrics),
            owner: self.owner.clone(),
        };
        let health = self.health.unwrap_or_else(|| Health::new(plan.lease, None));
        let balancer = crate::balance::Balancer::new(Arc::clone(&plan), spec(0), self.only.clone(), health);
        balancer.run(self.tasks, shutdown).await
    }
}

/// What a task's supervisor shares with the balancer and the probes: the epoch its current
/// runner holds, when that runner last stepped, and since when its current step runs.
#[derive(Debug)]
pub struct Tracker {
    epoch: AtomicI64,
    stepped_at: Mutex<Option<Instant>>,
    in_step_since: Mutex<Option<Instant>>,
}

impl Tracker {
    pub(crate) fn new(epoch: i64) -> Arc<Tracker> {
        Arc::new(Tracker {
            epoch: AtomicI64::new(epoch),
            stepped_at: Mutex::new(None),
            in_step_since: Mutex::new(None),
        })
    }

    /// A step begins (`/livez` counts it stuck once it has run past the stall bound).
    pub(crate) fn step_began(&self) {
        *self.in_step_since.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }

    /// The step returned, whatever its outcome.
    pub(crate) fn step_ended(&self) {
        *self.in_step_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// How long the current step has run; `None`: no step is running.
    pub(crate) fn in_step_for(&self) -> Option<Duration> {
        self.in_step_since.lock().unwrap_or_else(|e| e.into_inner()).map(|at| at.elapsed())
    }

    pub(crate) fn epoch(&self) -> i64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// How long ago the runner last stepped; `None`: not yet.
    pub(crate) fn since_step(&self) -> Option<Duration> {
        self.stepped_at.lock().unwrap_or_else(|e| e.into_inner()).map(|at| at.elapsed())
    }

    fn stepped(&self) {
        *self.stepped_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }
}

/// How a task's first runner comes to be.
pub(crate) enum Start<P: Projection> {
    /// A runner already started (adopted from [`ModelProjector::start`]).
    Runner(Box<TaskRunner<P>>),
    /// The task was just taken at this row's epoch; the supervisor starts its runner.
    Taken(ordering::TaskRow),
}

/// How a task's supervisor ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// `stop` turned true; the runner's last step finished.
    Stopped,
    /// Another instance took the task (the runner was fenced, or could not take it again).
    Lost,
}

/// How one run of a task's runner ended.
enum RunEnded {
    /// `stop` turned true.
    Stopped,
    /// Another owner took the task.
    Fenced,
    /// The runner's refusal was lifted: start the task again.
    RefusalLifted,
    /// Taking the task again failed (e.g. the database is unreachable).
    StartFailed(anyhow::Error),
}

/// Runs one task until `stop` turns true or another instance takes it, so that it is never
/// silently dead while its row says `running`: each run of the runner is a tokio task of
/// its own, and when it panics (a bug, or a projection that panics on a record) the
/// supervisor records the panic's message as the task's failure (`failing`,
/// `parsley_projector_panics_total`), waits out a backoff (the projector's, doubling per
/// consecutive panic and reset by a step that goes well), and starts the task again with a
/// new runner — a new epoch, only while this instance still holds the task, state restored
/// from the database, as after a restart. A refused runner re-reads its row every
/// `refused_recheck` and starts again once the refusal was lifted. A fenced runner ends the
/// supervisor: the balancer decides what this instance runs next.
pub(crate) async fn supervise<P: Projection>(
    spec: RunnerSpec<P>,
    first: Start<P>,
    tracker: Arc<Tracker>,
    mut stop: watch::Receiver<bool>,
) -> Ended {
    let (model, task) = (spec.plan.name.clone(), spec.task);
    let task_label = task.to_string();
    let labels = [("model", model.as_str()), ("task", task_label.as_str())];
    // The number of panics since a step last went well (for the backoff).
    let panics = Arc::new(AtomicU32::new(0));
    let mut next = Some(first);
    loop {
        if *stop.borrow() {
            return Ended::Stopped;
        }
        let run = tokio::spawn(run_runner(
            spec.clone(),
            next.take(),
            stop.clone(),
            Arc::clone(&tracker),
            Arc::clone(&panics),
        ));
        let wait = match run.await {
            Ok(RunEnded::Stopped) => return Ended::Stopped,
            Ok(RunEnded::Fenced) => return Ended::Lost,
            Ok(RunEnded::RefusalLifted) => {
                // The new runner sets it again if the refusal recurs.
                spec.metrics.set(Metric::TaskRefused, &labels, 0.0);
                continue;
            }
            Ok(RunEnded::StartFailed(e)) => {
                let first = spec.plan.initial_backoff.max(Duration::from_secs(1)).min(spec.plan.max_backoff);
                let wait = Backoff::new(first, spec.plan.max_backoff).delay(0);
                tracing::warn!(model = %model, task, error = %format!("{e:#}"), retry_in_ms = wait.as_millis() as u64,
                    "could not start the task again; retrying");
                wait
            }
            Err(e) if e.is_panic() => {
                let message = format!("the task runner panicked: {}", panic_message(e.into_panic().as_ref()));
                let n = panics.fetch_add(1, Ordering::SeqCst) + 1;
                let wait = spec.plan.backoff().delay(n - 1);
                tracing::error!(model = %model, task, panics = n, retry_in_ms = wait.as_millis() as u64,
                    error = %message, "task runner panicked; starting it again after the backoff");
                spec.metrics.add(Metric::PanicsTotal, &labels, 1.0);
                spec.metrics.add(Metric::FailuresTotal, &labels, 1.0);
                spec.metrics.set(Metric::TaskFailing, &labels, 1.0);
                if let Err(e) = ordering::record_failure(&spec.pool, &model, task, tracker.epoch(), &message).await {
                    tracing::warn!(model = %model, task, error = %format!("{e:#}"), "could not record the panic");
                }
                wait
            }
            // Cancelled: only when the runtime shuts down.
            Err(_) => return Ended::Stopped,
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.wait_for(|stop| *stop) => return Ended::Stopped,
        }
    }
}

/// One run of a task's runner (`start`, or a new one taking the task again at a new
/// epoch): steps until `stop`; a fenced runner ends the run, a refused one waits for its
/// refusal to be lifted.
async fn run_runner<P: Projection>(
    spec: RunnerSpec<P>,
    start: Option<Start<P>>,
    mut stop: watch::Receiver<bool>,
    tracker: Arc<Tracker>,
    panics: Arc<AtomicU32>,
) -> RunEnded {
    let mut runner = match start {
        Some(Start::Runner(r)) => *r,
        Some(Start::Taken(row)) => spec.start_taken(row).await,
        // Again, at a new epoch, only while this instance still holds the task. The tracker
        // learns the epoch before the (slow) start, so a heartbeat meanwhile renews it.
        None => {
            match leases::retake(&spec.pool, &spec.plan.name, spec.task, &spec.owner, tracker.epoch(), spec.plan.lease)
                .await
            {
                Ok(Some(row)) => {
                    tracker.epoch.store(row.epoch, Ordering::SeqCst);
                    spec.start_taken(row).await
                }
                Ok(None) => {
                    tracing::warn!(model = %spec.plan.name, task = spec.task, "another instance took the task meanwhile");
                    return RunEnded::Fenced;
                }
                Err(e) => return RunEnded::StartFailed(e.into()),
            }
        }
    };
    tracker.epoch.store(runner.epoch(), Ordering::SeqCst);
    loop {
        if *stop.borrow() {
            return RunEnded::Stopped;
        }
        match runner.state() {
            TaskState::Fenced => return RunEnded::Fenced,
            TaskState::Refused(_) => {
                tracker.stepped();
                tokio::select! {
                    _ = tokio::time::sleep(spec.plan.refused_recheck) => {}
                    _ = stop.wait_for(|stop| *stop) => return RunEnded::Stopped,
                }
                match runner.refusal_lifted().await {
                    Ok(true) => return RunEnded::RefusalLifted,
                    Ok(false) => {}
                    Err(e) => tracing::warn!(model = %spec.plan.name, task = spec.task, error = %format!("{e:#}"),
                        "could not re-read a refused task's row"),
                }
                continue;
            }
            TaskState::Failing { retry_at, .. } => {
                let at = *retry_at;
                tokio::select! {
                    _ = tokio::time::sleep_until(at.into()) => {}
                    _ = stop.wait_for(|stop| *stop) => return RunEnded::Stopped,
                }
            }
            TaskState::Running => {}
        }
        tracker.step_began();
        let outcome = runner.run_once().await;
        tracker.step_ended();
        if let StepOutcome::Committed { .. } | StepOutcome::Idle = outcome {
            panics.store(0, Ordering::SeqCst);
            tracker.stepped();
        }
    }
}

/// The message a panic carried (`panic!` with a literal or a formatted message).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// Records a model-wide refusal on every task when the model has state (when it has none,
/// there is nothing to protect and nowhere to record it: the caller reports it).
async fn finish_refused<P: Projection>(
    pool: &PgPool,
    model: &str,
    recorded_width: Option<u32>,
    refusal: Refusal,
    refused: impl FnOnce(Refusal) -> ModelProjector<P>,
) -> anyhow::Result<ModelProjector<P>> {
    if let Some(width) = recorded_width {
        ordering::refuse_model(pool, model, width, &refusal).await?;
    }
    Ok(refused(refusal))
}
