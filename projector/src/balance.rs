//! Sharing a model's tasks between instances: membership, leases, takeover and hand-back.
//!
//! Every heartbeat (`projector.heartbeat_ms`, and at once when another instance joins,
//! leaves or hands a task back) the balancer of a model in this instance:
//!
//! 1. renews its membership (`parsley.members`) and the leases of the tasks it runs, and
//!    stops the runners of tasks whose epoch moved on (another instance took them while
//!    this one was frozen or cut off);
//! 2. computes its share: the model's tasks spread over the live balanced members as
//!    evenly as possible (within one task; [`leases::shares`]) — or, with a static `tasks`
//!    list, exactly the tasks of the list;
//! 3. over its share, hands back the highest-numbered tasks it runs (each runner finishes
//!    or abandons its step first, then the lease is dropped); under it, takes the free
//!    tasks (never held, handed back, or with an expired lease), lowest first.
//!
//! Which instance *should* run a task is all a lease decides. Every step still locks the
//! task's row and checks its epoch, so an owner that was slow rather than dead — whose lease
//! expired under it — is fenced at its next commit and applies nothing twice. A takeover
//! never waits more than a heartbeat on the row lock of a frozen owner: it retries at the
//! next one, and the server ends the frozen session after `idle_in_transaction` (bounded by
//! the lease in the projector's sessions).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use parsley_store::leases::{self, Claim, Held, Joined};
use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::health::Health;
use crate::metrics::Metric;
use crate::model::{supervise, Ended, ModelPlan, Start, Tracker};
use crate::projection::Projection;
use crate::task::{RunnerSpec, TaskRunner};
use parsley_store::ordering;

/// A task this instance runs: its supervisor, and how to stop it.
struct Owned {
    tracker: Arc<Tracker>,
    stop: watch::Sender<bool>,
    handle: JoinHandle<Ended>,
}

/// The balancer of one model in this instance.
pub(crate) struct Balancer<P: Projection> {
    plan: Arc<ModelPlan>,
    /// The services and instance name runners are started with (its `task` is set per task).
    spec: RunnerSpec<P>,
    /// Tells two processes that share an instance name apart.
    incarnation: String,
    /// The static `tasks` list: only these, and no share.
    only: Option<BTreeSet<u32>>,
    owned: BTreeMap<u32, Owned>,
    /// What the probes read: the membership renewed, the runners' steps.
    health: Arc<Health>,
}

impl<P: Projection> Balancer<P> {
    pub(crate) fn new(
        plan: Arc<ModelPlan>,
        spec: RunnerSpec<P>,
        only: Option<Vec<u32>>,
        health: Arc<Health>,
    ) -> Balancer<P> {
        health.model_joining(&plan.name);
        Balancer {
            plan,
            spec,
            incarnation: incarnation(),
            only: only.map(|t| t.into_iter().collect()),
            owned: BTreeMap::new(),
            health,
        }
    }

    fn labels(&self) -> [(&'static str, &str); 1] {
        [("model", self.plan.name.as_str())]
    }

    /// Balances until `shutdown`, then stops every runner, hands its task back and leaves.
    /// `adopted`: runners already started on tasks this instance took.
    pub(crate) async fn run(
        mut self,
        adopted: Vec<TaskRunner<P>>,
        mut shutdown: watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        for runner in adopted {
            let (task, epoch) = (runner.task(), runner.epoch());
            self.spawn(task, epoch, Start::Runner(Box::new(runner)));
        }
        let mut listener = self.listen().await;
        tracing::info!(model = %self.plan.name, instance = %self.spec.owner, incarnation = %self.incarnation,
            balanced = self.only.is_none(), "joining the model's instances");
        loop {
            if *shutdown.borrow() {
                break;
            }
            self.tick().await;
            let heartbeat = tokio::time::sleep(self.plan.heartbeat);
            tokio::select! {
                _ = heartbeat => {}
                changed = shutdown.changed() => if changed.is_err() { break },
                woke = wake(&mut listener) => if !woke {
                    // The listener's connection failed: heartbeats still come; listen again.
                    listener = self.listen().await;
                },
            }
        }
        self.leave().await;
        Ok(())
    }

    /// A listener for members joining, leaving and handing tasks back; `None` when it
    /// cannot be had (the heartbeat alone then paces the balancing).
    async fn listen(&self) -> Option<PgListener> {
        let listen = async {
            let mut l = PgListener::connect_with(&self.spec.pool).await?;
            l.listen(leases::MEMBERS_NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        };
        match listen.await {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::warn!(model = %self.plan.name, error = %e, "cannot listen for membership changes; balancing on heartbeats only");
                None
            }
        }
    }

    /// One heartbeat: reap, renew, balance, report.
    async fn tick(&mut self) {
        self.reap().await;
        if let Err(e) = self.renew().await {
            self.spec.metrics.add(Metric::LeaseRenewFailuresTotal, &self.labels(), 1.0);
            tracing::warn!(model = %self.plan.name, instance = %self.spec.owner, error = %format!("{e:#}"),
                "could not renew membership and leases; the tasks keep running (their steps renew their leases)");
        } else if let Err(e) = self.balance().await {
            tracing::warn!(model = %self.plan.name, error = %format!("{e:#}"), "could not balance the tasks; trying again");
        }
        self.report();
    }

    /// Forgets the tasks whose supervisor ended (another instance took them).
    async fn reap(&mut self) {
        let ended: Vec<u32> = self.owned.iter().filter(|(_, o)| o.handle.is_finished()).map(|(t, _)| *t).collect();
        for task in ended {
            let owned = self.owned.remove(&task).expect("listed above");
            self.health.runner_ended(&self.plan.name, task);
            let end = owned.handle.await.unwrap_or(Ended::Stopped);
            if end == Ended::Lost {
                self.lost(task);
            }
        }
    }

    fn lost(&self, task: u32) {
        self.spec.metrics.add(Metric::TasksLostTotal, &self.labels(), 1.0);
        self.clear_task_gauges(task);
        tracing::warn!(model = %self.plan.name, task, instance = %self.spec.owner,
            "another instance took the task (this one's lease had expired); standing by");
    }

    /// Renews membership and leases; stops the runners of tasks taken meanwhile.
    async fn renew(&mut self) -> anyhow::Result<()> {
        let pool = &self.spec.pool;
        let balanced = self.only.is_none();
        match leases::join(pool, &self.plan.name, &self.spec.owner, &self.incarnation, balanced, self.plan.lease)
            .await?
        {
            Joined::Member => self.health.model_renewed(&self.plan.name),
            Joined::NameInUse { incarnation, remaining_ms } => anyhow::bail!(
                "another process is running as instance {:?} (incarnation {incarnation}) for {remaining_ms} ms more; \
                 give each instance its own projector.owner, or wait for the old one's lease to pass",
                self.spec.owner
            ),
        }
        let held: Vec<Held> = self
            .owned
            .iter()
            .map(|(t, o)| Held { task: *t, epoch: o.tracker.epoch(), since_step: o.tracker.since_step() })
            .collect();
        for task in leases::renew(pool, &self.plan.name, &held, self.plan.lease).await? {
            if let Some(owned) = self.owned.remove(&task) {
                self.health.runner_ended(&self.plan.name, task);
                // Its step, if one is open, is fenced at its commit; nothing waits for it.
                let _ = owned.stop.send(true);
                self.lost(task);
            }
        }
        Ok(())
    }

    /// Hands back what is over this instance's share; takes free tasks up to it.
    async fn balance(&mut self) -> anyhow::Result<()> {
        let (members, tasks) = {
            let mut conn = self.spec.pool.acquire().await.context("acquiring a connection to balance")?;
            (
                leases::members(&mut conn, &self.plan.name).await?,
                ordering::load_tasks(&mut conn, &self.plan.name).await?,
            )
        };
        let candidates: Vec<u32> = match &self.only {
            Some(only) => only.iter().copied().collect(),
            None => (0..self.plan.task_count).collect(),
        };
        let share = match &self.only {
            Some(only) => only.len() as u32,
            None => {
                let mut live: Vec<String> =
                    members.iter().filter(|m| m.live && m.balanced).map(|m| m.instance.clone()).collect();
                if !live.contains(&self.spec.owner) {
                    live.push(self.spec.owner.clone());
                    live.sort();
                }
                let shares = leases::shares(self.plan.task_count, &live);
                shares.into_iter().find(|(m, _)| *m == self.spec.owner).map_or(0, |(_, k)| k)
            }
        };
        let mine = self.owned.len() as u32;
        if mine > share {
            let give: Vec<u32> = self.owned.keys().rev().take((mine - share) as usize).copied().collect();
            self.hand_back(&give).await;
            return Ok(());
        }
        let mut want = share - mine;
        let live: BTreeSet<u32> = tasks.iter().filter(|t| t.leased()).map(|t| t.task).collect();
        for task in candidates {
            if want == 0 {
                break;
            }
            if self.owned.contains_key(&task) || live.contains(&task) {
                continue;
            }
            match leases::claim(
                &self.spec.pool,
                &self.plan.name,
                task,
                &self.spec.owner,
                self.plan.lease,
                self.plan.heartbeat,
            )
            .await?
            {
                Claim::Taken { row, from } => {
                    match &from {
                        Some(previous) if *previous != self.spec.owner => {
                            self.spec.metrics.add(Metric::TakeoversTotal, &self.labels(), 1.0);
                            tracing::warn!(model = %self.plan.name, task, from = %previous, epoch = row.epoch,
                                "took over the task: its owner's lease had expired");
                        }
                        _ => tracing::info!(model = %self.plan.name, task, epoch = row.epoch, "took the task"),
                    }
                    let epoch = row.epoch;
                    self.spawn(task, epoch, Start::Taken(row));
                    want -= 1;
                }
                Claim::Held { .. } => {}
                Claim::Locked { holder } => {
                    tracing::warn!(model = %self.plan.name, task, waited_ms = self.plan.heartbeat.as_millis() as u64,
                        holder = holder.as_deref().unwrap_or("unknown"),
                        "the task's lease has expired but its row is locked by another session (a frozen owner \
                         mid-step?); retrying at the next heartbeat — the server ends that session after \
                         idle_in_transaction_session_timeout");
                }
            }
        }
        Ok(())
    }

    /// Starts a supervisor for `task`, taken at `epoch`.
    fn spawn(&mut self, task: u32, epoch: i64, start: Start<P>) {
        let tracker = Tracker::new(epoch);
        let (stop, stopped) = watch::channel(false);
        let spec = RunnerSpec { task, ..self.spec.clone() };
        self.health.runner_started(&self.plan.name, task, Arc::clone(&tracker));
        let handle = tokio::spawn(supervise(spec, start, Arc::clone(&tracker), stopped));
        self.owned.insert(task, Owned { tracker, stop, handle });
    }

    /// Stops the runners of `tasks` (each finishes or abandons its step), then drops their
    /// leases so that another instance takes them at once.
    async fn hand_back(&mut self, tasks: &[u32]) {
        let mut stopping = Vec::new();
        for task in tasks {
            if let Some(owned) = self.owned.remove(task) {
                let _ = owned.stop.send(true);
                stopping.push((*task, owned));
            }
        }
        for (task, owned) in stopping {
            let end = owned.handle.await.unwrap_or(Ended::Stopped);
            self.health.runner_ended(&self.plan.name, task);
            if end == Ended::Lost {
                self.lost(task);
                continue;
            }
            let epoch = owned.tracker.epoch();
            match leases::release(&self.spec.pool, &self.plan.name, task, epoch).await {
                Ok(true) => {
                    self.spec.metrics.add(Metric::TasksReleasedTotal, &self.labels(), 1.0);
                    tracing::info!(model = %self.plan.name, task, epoch, "handed the task back");
                }
                Ok(false) => self.lost(task),
                Err(e) => tracing::warn!(model = %self.plan.name, task, error = %format!("{e:#}"),
                    "could not hand the task back; its lease expires instead"),
            }
            self.clear_task_gauges(task);
        }
    }

    /// Stopping: hands every task back and leaves the model's members.
    async fn leave(&mut self) {
        let tasks: Vec<u32> = self.owned.keys().copied().collect();
        self.hand_back(&tasks).await;
        if let Err(e) = leases::leave(&self.spec.pool, &self.plan.name, &self.spec.owner, &self.incarnation).await {
            tracing::warn!(model = %self.plan.name, error = %format!("{e:#}"), "could not leave the model's members; its membership expires instead");
        }
        self.report();
        tracing::info!(model = %self.plan.name, instance = %self.spec.owner, "left the model's instances");
    }

    fn report(&self) {
        let metrics = &self.spec.metrics;
        metrics.set(Metric::TasksOwned, &self.labels(), self.owned.len() as f64);
        for (task, owned) in &self.owned {
            let since = owned.tracker.since_step().unwrap_or(Duration::ZERO);
            let task = task.to_string();
            metrics.set(
                Metric::SecondsSinceStep,
                &[("model", self.plan.name.as_str()), ("task", task.as_str())],
                since.as_secs_f64(),
            );
        }
    }

    fn clear_task_gauges(&self, task: u32) {
        let task = task.to_string();
        self.spec.metrics.set(
            Metric::SecondsSinceStep,
            &[("model", self.plan.name.as_str()), ("task", task.as_str())],
            0.0,
        );
    }
}

/// Waits for a membership notification; `false` when the listener failed (or is absent:
/// then it never returns, and the heartbeat paces the balancing).
async fn wake(listener: &mut Option<PgListener>) -> bool {
    match listener {
        Some(l) => l.recv().await.is_ok(),
        None => std::future::pending().await,
    }
}

/// A token telling this process apart from an earlier or concurrent one of the same
/// instance name: the process ID and the start time.
fn incarnation() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{}-{:x}", std::process::id(), nanos)
}
