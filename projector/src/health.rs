//! The projector's probes, served on its metrics listener beside `/metrics`
//! (docs/operations.md, "Probes and shutdown"):
//!
//! - `GET /livez`: the process and its runtime answer, and no task runner is stuck — a step
//!   that has not returned for `projector.runner_stall_ms` (a projection that never returns,
//!   a lost wake-up) fails it, naming the model and the task. A failing task (a database
//!   outage) is not stuck: its steps return, failed, and it backs off. Restarting helps a
//!   stuck runner; it does not help an outage, so liveness ignores outages.
//! - `GET /readyz`: this instance does what it is there for — started (connected, migrated,
//!   every model prepared), a live member of each model it runs (its membership renewed
//!   within a lease, so it holds its tasks or is ready to take them), and not stopping. A
//!   model refused as a whole counts as ready: a restart derives the same refusal.
//!
//! [`Health`] is what the builder, the balancers and the task supervisors report to; its
//! answers are computed from memory, never from a round trip.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use parsley_infra::metrics::{ProbeAnswer, Probes};
use serde_json::{json, Value};

use crate::model::Tracker;

/// Where the instance is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Connecting, migrating, preparing the models: what it is doing.
    Starting(String),
    /// Running its models.
    Running,
    /// Shutdown was signalled: the steps in progress finish and the tasks are handed back.
    Stopping,
}

/// A model's membership, as its balancer last reported it.
#[derive(Clone, Debug)]
enum Membership {
    /// Not joined yet.
    Joining,
    /// The membership was last renewed then.
    Renewed(Instant),
    /// Refused as a whole: it runs nothing until an operator acts.
    Refused,
}

#[derive(Debug)]
struct Inner {
    phase: Phase,
    models: BTreeMap<String, Membership>,
    runners: BTreeMap<(String, u32), Arc<Tracker>>,
}

/// The instance's health: see the module documentation.
#[derive(Debug)]
pub struct Health {
    lease: Duration,
    stall: Option<Duration>,
    inner: Mutex<Inner>,
}

impl Health {
    /// A starting instance whose leases last `lease` and whose steps count as stuck after
    /// `stall` (`None`: never).
    pub fn new(lease: Duration, stall: Option<Duration>) -> Arc<Health> {
        Arc::new(Health {
            lease,
            stall,
            inner: Mutex::new(Inner {
                phase: Phase::Starting("starting".into()),
                models: BTreeMap::new(),
                runners: BTreeMap::new(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_phase(&self, phase: Phase) {
        self.lock().phase = phase;
    }

    pub fn phase(&self) -> Phase {
        self.lock().phase.clone()
    }

    /// `model` will run here: it is joining.
    pub fn model_joining(&self, model: &str) {
        self.lock().models.insert(model.to_string(), Membership::Joining);
    }

    /// `model`'s membership was renewed now.
    pub fn model_renewed(&self, model: &str) {
        self.lock().models.insert(model.to_string(), Membership::Renewed(Instant::now()));
    }

    /// `model` is refused as a whole.
    pub fn model_refused(&self, model: &str) {
        self.lock().models.insert(model.to_string(), Membership::Refused);
    }

    /// A runner of `model`'s `task` reports to `tracker` while this instance runs it.
    pub(crate) fn runner_started(&self, model: &str, task: u32, tracker: Arc<Tracker>) {
        self.lock().runners.insert((model.to_string(), task), tracker);
    }

    pub(crate) fn runner_ended(&self, model: &str, task: u32) {
        self.lock().runners.remove(&(model.to_string(), task));
    }

    /// The stuck runners: `(model, task, how long its step has run)`.
    pub fn stuck(&self) -> Vec<(String, u32, Duration)> {
        let Some(stall) = self.stall else { return Vec::new() };
        self.lock()
            .runners
            .iter()
            .filter_map(|((model, task), t)| t.in_step_for().filter(|d| *d > stall).map(|d| (model.clone(), *task, d)))
            .collect()
    }

    /// `/livez`: the body names every stuck runner.
    pub fn live(&self) -> (bool, Value) {
        let stuck = self.stuck();
        let runners: Vec<Value> = stuck
            .iter()
            .map(|(model, task, d)| json!({"model": model, "task": task, "in_step_ms": d.as_millis() as u64}))
            .collect();
        if stuck.is_empty() {
            (true, json!({"status": "live"}))
        } else {
            (
                false,
                json!({
                    "status": "stuck",
                    "stall_ms": self.stall.map(|d| d.as_millis() as u64),
                    "stuck": runners,
                }),
            )
        }
    }

    /// `/readyz`: the phase, and each model's membership.
    pub fn ready(&self) -> (bool, Value) {
        let inner = self.lock();
        let mut all_joined = true;
        let models: BTreeMap<&str, Value> = inner
            .models
            .iter()
            .map(|(name, m)| {
                let (ok, state) = match m {
                    Membership::Joining => (false, json!({"ok": false, "state": "joining"})),
                    Membership::Refused => (true, json!({"ok": true, "state": "refused"})),
                    Membership::Renewed(at) => {
                        let ago = at.elapsed();
                        let ok = ago < self.lease;
                        let state = if ok { "joined" } else { "lapsed" };
                        (ok, json!({"ok": ok, "state": state, "renewed_ms_ago": ago.as_millis() as u64}))
                    }
                };
                all_joined &= ok;
                (name.as_str(), state)
            })
            .collect();
        let (ok, status) = match &inner.phase {
            Phase::Starting(what) => (false, json!({"status": "starting", "doing": what})),
            Phase::Stopping => (false, json!({"status": "stopping"})),
            Phase::Running if all_joined => (true, json!({"status": "ready"})),
            Phase::Running => (false, json!({"status": "not-ready"})),
        };
        let mut body = status;
        body["models"] = json!(models);
        (ok, body)
    }
}

impl Probes for Health {
    fn live(&self) -> ProbeAnswer {
        let (ok, body) = Health::live(self);
        ProbeAnswer { ok, body: body.to_string() }
    }

    fn ready(&self) -> ProbeAnswer {
        let (ok, body) = Health::ready(self);
        ProbeAnswer { ok, body: body.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_follows_the_phase_and_the_memberships() {
        let h = Health::new(Duration::from_millis(200), Some(Duration::from_secs(1)));
        assert_eq!(h.ready().1["status"], "starting");
        h.set_phase(Phase::Starting("connecting to Postgres".into()));
        assert_eq!(h.ready().1["doing"], "connecting to Postgres");
        h.model_joining("m");
        h.model_refused("r");
        h.set_phase(Phase::Running);
        let (ok, body) = h.ready();
        assert!(!ok, "{body}");
        assert_eq!(body["models"]["m"]["state"], "joining");
        h.model_renewed("m");
        let (ok, body) = h.ready();
        assert!(ok, "{body}");
        assert_eq!(
            (body["models"]["m"]["state"].clone(), body["models"]["r"]["state"].clone()),
            (json!("joined"), json!("refused"))
        );
        std::thread::sleep(Duration::from_millis(250));
        let (ok, body) = h.ready();
        assert!(!ok && body["models"]["m"]["state"] == "lapsed", "{body}");
        h.model_renewed("m");
        assert!(h.ready().0);
        h.set_phase(Phase::Stopping);
        assert_eq!(
            h.ready(),
            (
                false,
                json!({"status": "stopping", "models": {"m": h.ready().1["models"]["m"].clone(), "r": {"ok": true, "state": "refused"}}})
            )
        );
    }

    #[test]
    fn a_step_past_the_bound_fails_liveness_and_a_returned_one_does_not() {
        let h = Health::new(Duration::from_secs(5), Some(Duration::from_millis(100)));
        let t = Tracker::new(1);
        h.runner_started("m", 3, Arc::clone(&t));
        assert!(h.live().0);
        t.step_began();
        assert!(h.live().0, "a step under the bound");
        std::thread::sleep(Duration::from_millis(150));
        let (ok, body) = h.live();
        assert!(!ok, "{body}");
        assert_eq!((body["stuck"][0]["model"].clone(), body["stuck"][0]["task"].clone()), (json!("m"), json!(3)));
        t.step_ended();
        assert!(h.live().0, "the step returned");
        t.step_began();
        std::thread::sleep(Duration::from_millis(150));
        h.runner_ended("m", 3);
        assert!(h.live().0, "a runner no longer here is not this instance's");
        let never = Health::new(Duration::from_secs(5), None);
        never.runner_started("m", 0, t);
        assert!(never.live().0, "runner_stall_ms = 0");
    }
}
