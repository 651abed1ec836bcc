//! A model: its received topics resolved to topic IDs and checked against what the database
//! recorded (identity, co-partitioning, task width), and the runners of the tasks this
//! instance owns. `run` drives every task until shutdown, each under a supervisor that
//! starts a panicked runner again and a refused one once its refusal is lifted; `run_once`
//! steps each task once, for tests that want to drive the loop deterministically.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use parsley::channel::ChannelId;
use parsley::engine::EngineConfig;
use parsley::refusal::Refusal;
use parsley::startup::{check_task_width, check_topic_identity, task_width};
use parsley::TopicId;
use sqlx::PgPool;
use tokio::sync::watch;

use crate::config::{Config, InitialPosition, KafkaConfig, ModelConfig, OnRejected};
use crate::kafka;
use crate::metrics::{Metric, Metrics};
use crate::projection::Projection;
use crate::store;
use crate::task::{RunnerSpec, StepOutcome, TaskRunner, TaskState};

/// One received topic of a model, resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedTopic {
    pub name: String,
    pub id: TopicId,
    pub initial: InitialPosition,
}

/// Everything a task runner needs to know about its model.
#[derive(Clone, Debug)]
pub struct ModelPlan {
    pub name: String,
    pub task_count: u32,
    pub topics: Vec<PlannedTopic>,
    pub max_step_records: usize,
    pub max_step_time: Duration,
    /// A step with records ends once nothing new arrived for this long.
    pub step_linger: Duration,
    pub metadata_budget: usize,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// How often a task holding records checks those channels' log starts; `None`: only at
    /// start and on an out-of-range fetch.
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
    tasks: Vec<TaskRunner<P>>,
    refusal: Option<Refusal>,
}

impl<P: Projection> ModelProjector<P> {
    /// Resolves and checks the model's topics, records the model, and starts every task it
    /// owns (`model.tasks`, or all). A model-wide refusal (a recreated topic, a changed
    /// partition count, topics that are not co-partitioned) is recorded on every task of
    /// the model when the model has state, and returned as a projector with no tasks.
    /// Errors are for unreachable services and broken databases.
    pub async fn start(
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
            store::load_model(&mut conn, &model.name).await?
        };
        let refused = |refusal: Refusal| ModelProjector {
            plan: None,
            name: model.name.clone(),
            tasks: Vec::new(),
            refusal: Some(refusal),
        };

        // Identity first: a recreated topic must be named as such, whatever its width.
        let mut ids = Vec::with_capacity(resolved.len());
        for topic in &resolved {
            let then = recorded.as_ref().and_then(|m| m.topics.get(&topic.name).copied());
            let held = match then {
                Some(id) => {
                    let mut conn = pool.acquire().await.context("acquiring a connection")?;
                    store::held_on_topic(&mut conn, &model.name, &id).await?
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
        store::register_model(&pool, &model.name, width, &pairs).await?;

        let plan = Arc::new(ModelPlan {
            name: model.name.clone(),
            task_count: width,
            topics: model
                .topics
                .iter()
                .zip(&ids)
                .map(|(t, id)| PlannedTopic { name: t.name.clone(), id: *id, initial: t.initial_position(model) })
                .collect(),
            max_step_records: model.max_step_records,
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
            kafka: config.kafka.clone(),
        });
        let owned: Vec<u32> = match &model.tasks {
            Some(tasks) => {
                if let Some(t) = tasks.iter().find(|t| **t >= width) {
                    anyhow::bail!("models[{:?}].tasks names task {t}, but the model has {width} tasks", model.name);
                }
                tasks.clone()
            }
            None => (0..width).collect(),
        };
        let owner = config.owner();
        let mut tasks = Vec::with_capacity(owned.len());
        for task in owned {
            tasks.push(
                TaskRunner::start(
                    Arc::clone(&plan),
                    task,
                    pool.clone(),
                    Arc::clone(&projection),
                    Arc::clone(&metrics),
                    &owner,
                )
                .await?,
            );
        }
        Ok(ModelProjector { plan: Some(plan), name: model.name.clone(), tasks, refusal: None })
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

    /// Drives every task on its own tokio task until `shutdown` turns true, each under a
    /// supervisor (see [`supervise`]). A step in progress finishes (commits or rolls back)
    /// before its task stops.
    pub async fn run(self, shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
        let mut handles = Vec::new();
        for runner in self.tasks {
            handles.push(tokio::spawn(supervise(runner, shutdown.clone())));
        }
        let mut shutdown = shutdown;
        if handles.is_empty() {
            let _ = shutdown.wait_for(|stop| *stop).await;
        }
        for h in handles {
            h.await.context("a task supervisor panicked")?;
        }
        Ok(())
    }
}

/// How one run of a task's runner ended.
enum RunEnded {
    /// `shutdown` turned true.
    Shutdown,
    /// The runner's refusal was lifted: start the task again.
    RefusalLifted,
    /// Taking the task again failed (e.g. the database is unreachable).
    StartFailed(anyhow::Error),
}

/// Runs one task until shutdown, so that it is never silently dead while its row says
/// `running`: each run of the runner is a tokio task of its own, and when it panics (a bug,
/// or a projection that panics on a record) the supervisor records the panic's message as
/// the task's failure (`failing`, `parsley_projector_panics_total`), waits out a backoff
/// (the projector's, doubling per consecutive panic and reset by a step that goes well),
/// and starts the task again with a new runner — a new epoch, state restored from the
/// database, as after a restart. A refused runner re-reads its row every
/// `refused_recheck` and starts again once the refusal was lifted.
async fn supervise<P: Projection>(first: TaskRunner<P>, mut shutdown: watch::Receiver<bool>) {
    let spec = first.spec();
    let (model, task) = (spec.plan.name.clone(), spec.task);
    let task_label = task.to_string();
    let labels = [("model", model.as_str()), ("task", task_label.as_str())];
    // The epoch of the current runner (for recording its panic) and the number of panics
    // since a step last went well (for the backoff).
    let epoch = Arc::new(AtomicI64::new(first.epoch()));
    let panics = Arc::new(AtomicU32::new(0));
    let mut next = Some(first);
    loop {
        if *shutdown.borrow() {
            return;
        }
        let run = tokio::spawn(run_runner(
            spec.clone(),
            next.take(),
            shutdown.clone(),
            Arc::clone(&epoch),
            Arc::clone(&panics),
        ));
        let wait = match run.await {
            Ok(RunEnded::Shutdown) => return,
            Ok(RunEnded::RefusalLifted) => {
                // The new runner sets it again if the refusal recurs.
                spec.metrics.set(Metric::TaskRefused, &labels, 0.0);
                continue;
            }
            Ok(RunEnded::StartFailed(e)) => {
                let wait = spec.plan.initial_backoff.max(Duration::from_secs(1)).min(spec.plan.max_backoff);
                tracing::warn!(model = %model, task, error = %format!("{e:#}"), retry_in_ms = wait.as_millis() as u64,
                    "could not start the task again; retrying");
                wait
            }
            Err(e) if e.is_panic() => {
                let message = format!("the task runner panicked: {}", panic_message(e.into_panic().as_ref()));
                let n = panics.fetch_add(1, Ordering::SeqCst) + 1;
                let shift = n.saturating_sub(1).min(20);
                let wait = spec.plan.initial_backoff.saturating_mul(1 << shift).min(spec.plan.max_backoff);
                tracing::error!(model = %model, task, panics = n, retry_in_ms = wait.as_millis() as u64,
                    error = %message, "task runner panicked; starting it again after the backoff");
                spec.metrics.add(Metric::PanicsTotal, &labels, 1.0);
                spec.metrics.add(Metric::FailuresTotal, &labels, 1.0);
                spec.metrics.set(Metric::TaskFailing, &labels, 1.0);
                let at = epoch.load(Ordering::SeqCst);
                if let Err(e) = store::record_failure(&spec.pool, &model, task, at, &message).await {
                    tracing::warn!(model = %model, task, error = %format!("{e:#}"), "could not record the panic");
                }
                wait
            }
            // Cancelled: only when the runtime shuts down.
            Err(_) => return,
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
    }
}

/// One run of a task's runner (`runner`, or a new one taking the task): steps until
/// shutdown; a fenced runner waits for shutdown, a refused one for its refusal to be lifted.
async fn run_runner<P: Projection>(
    spec: RunnerSpec<P>,
    runner: Option<TaskRunner<P>>,
    mut shutdown: watch::Receiver<bool>,
    epoch: Arc<AtomicI64>,
    panics: Arc<AtomicU32>,
) -> RunEnded {
    let mut runner = match runner {
        Some(r) => r,
        None => match spec.start().await {
            Ok(r) => r,
            Err(e) => return RunEnded::StartFailed(e),
        },
    };
    epoch.store(runner.epoch(), Ordering::SeqCst);
    loop {
        if *shutdown.borrow() {
            return RunEnded::Shutdown;
        }
        match runner.state() {
            TaskState::Fenced => {
                let _ = shutdown.wait_for(|stop| *stop).await;
                return RunEnded::Shutdown;
            }
            TaskState::Refused(_) => {
                tokio::select! {
                    _ = tokio::time::sleep(spec.plan.refused_recheck) => {}
                    _ = shutdown.wait_for(|stop| *stop) => return RunEnded::Shutdown,
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
                    _ = shutdown.wait_for(|stop| *stop) => return RunEnded::Shutdown,
                }
            }
            TaskState::Running => {}
        }
        if let StepOutcome::Committed { .. } | StepOutcome::Idle = runner.run_once().await {
            panics.store(0, Ordering::SeqCst);
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
        store::refuse_model(pool, model, width, &refusal).await?;
    }
    Ok(refused(refusal))
}
