//! The gateway's probes (docs/operations.md, "Probes and shutdown"):
//!
//! - `/readyz` answers from a cache of the dependencies' states that a background task
//!   ([`run_checks`]) refreshes every `gateway.readiness_check_ms`: no probe makes a round
//!   trip (only the very first, when no round has run yet, runs one). Per dependency:
//!   - `database` and `migrations` are **required**: without them nothing is served (reads,
//!     the gate, idempotent writes). A required dependency that was up counts as down only
//!     after `gateway.readiness_failures` consecutive failed checks, so one failed check (a
//!     blip) takes no gateway out of service.
//!   - `kafka` is **not required**: while the broker does not answer, writes fail (`503`)
//!     but covered reads are still served, and every gateway of a fleet shares the broker —
//!     taking them all out of service would serve nothing at all. It is reported, and the
//!     answer says `degraded`.
//!   - `identity_keys` (with `[gateway.auth]`) is required, read from memory at each probe:
//!     without keys every signed-in caller is answered `503`.
//! - Once shutdown is signalled the gateway is **draining**: `/readyz` answers `503`
//!   (`draining`) for `gateway.shutdown_grace_ms` while everything is still served, so a
//!   load balancer stops sending before the listeners close ([`crate::app::Gateway::serve`]).
//! - `/livez` (and `/healthz`, its older name) fails only when the background checks have
//!   stopped completing (a stuck task), never for a dependency.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use parsley_store::migrations;
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::metrics::Metric;
use crate::state::AppState;

/// A dependency the background checks probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Dependency {
    Database,
    Migrations,
    Kafka,
}

impl Dependency {
    pub const ALL: [Dependency; 3] = [Dependency::Database, Dependency::Migrations, Dependency::Kafka];

    pub fn as_str(self) -> &'static str {
        match self {
            Dependency::Database => "database",
            Dependency::Migrations => "migrations",
            Dependency::Kafka => "kafka",
        }
    }

    /// Whether the gateway is not ready while it is down.
    pub fn required(self) -> bool {
        !matches!(self, Dependency::Kafka)
    }
}

/// What the checks know of one dependency.
#[derive(Clone, Debug)]
struct Known {
    /// Up as far as readiness is concerned (see the module documentation).
    up: bool,
    /// The last check's failure, in words fit for a public answer.
    error: Option<String>,
    /// Consecutive failed checks.
    failures: u32,
    checked_at: Instant,
}

/// The cached readiness: see the module documentation.
#[derive(Debug)]
pub struct Readiness {
    known: Mutex<BTreeMap<Dependency, Known>>,
    rounds: AtomicU64,
    last_round: Mutex<Option<Instant>>,
    /// Set once the background checks run (liveness watches them only then).
    checking: AtomicBool,
    draining: AtomicBool,
    /// The first probe's round, shared by concurrent first probes.
    first: tokio::sync::Mutex<()>,
    failures_to_down: u32,
    /// How long the background checks may go without a round before `/livez` fails.
    stall: Duration,
}

impl Readiness {
    /// `failures_to_down`: consecutive failed checks before a dependency that was up counts
    /// as down; `stall`: how long the checks may go without completing a round.
    pub fn new(failures_to_down: u32, stall: Duration) -> Readiness {
        Readiness {
            known: Mutex::new(BTreeMap::new()),
            rounds: AtomicU64::new(0),
            last_round: Mutex::new(None),
            checking: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            first: tokio::sync::Mutex::new(()),
            failures_to_down: failures_to_down.max(1),
            stall,
        }
    }

    fn known(&self) -> MutexGuard<'_, BTreeMap<Dependency, Known>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records one check of `dependency`; returns whether it is up now.
    pub fn record(&self, dependency: Dependency, result: Result<(), String>) -> bool {
        let mut known = self.known();
        let previous = known.get(&dependency).cloned();
        let now = Instant::now();
        let entry = match result {
            Ok(()) => Known { up: true, error: None, failures: 0, checked_at: now },
            Err(error) => {
                let failures = previous.as_ref().map_or(0, |p| p.failures) + 1;
                // A first check decides at once; a dependency that was up stays up until
                // `failures_to_down` checks in a row failed.
                let up = previous.is_some_and(|p| p.up) && failures < self.failures_to_down;
                Known { up, error: Some(error), failures, checked_at: now }
            }
        };
        let up = entry.up;
        known.insert(dependency, entry);
        up
    }

    /// A round of checks completed.
    fn round_done(&self) {
        self.rounds.fetch_add(1, Ordering::SeqCst);
        *self.last_round.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }

    /// How many rounds of checks ran (each is one round trip per dependency).
    pub fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::SeqCst)
    }

    /// Shutdown was signalled: `/readyz` answers `503 draining` from now on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// `/livez`: `(ok, body)`.
    pub fn live(&self) -> (bool, Value) {
        if self.checking.load(Ordering::SeqCst) {
            let last = *self.last_round.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(ago) = last.map(|at| at.elapsed()).filter(|ago| *ago > self.stall) {
                return (
                    false,
                    json!({"status": "stuck", "error": "the dependency checks have not completed a round",
                           "last_round_ms_ago": ago.as_millis() as u64}),
                );
            }
        }
        (true, json!({"status": "ok"}))
    }

    /// `/readyz` from the cache (and the identity keys' state, `identity`, when
    /// authentication is on): `(ready, body)`.
    pub fn ready(&self, identity: Option<Result<(), String>>) -> (bool, Value) {
        let known = self.known();
        let mut checks = serde_json::Map::new();
        let mut ready = true;
        let mut degraded = false;
        for dependency in Dependency::ALL {
            let (up, value) = match known.get(&dependency) {
                None => (false, json!({"ok": false, "error": "not checked yet", "required": dependency.required()})),
                Some(k) => {
                    let mut v = json!({"ok": k.up, "required": dependency.required(),
                                       "checked_ms_ago": k.checked_at.elapsed().as_millis() as u64});
                    if let Some(e) = &k.error {
                        v["error"] = json!(e);
                        v["failed_checks"] = json!(k.failures);
                    }
                    (k.up, v)
                }
            };
            if dependency.required() {
                ready &= up;
            } else {
                degraded |= !up;
            }
            checks.insert(dependency.as_str().into(), value);
        }
        if let Some(identity) = identity {
            let value = match &identity {
                Ok(()) => json!({"ok": true, "required": true}),
                Err(e) => json!({"ok": false, "required": true, "error": e}),
            };
            ready &= identity.is_ok();
            checks.insert("identity_keys".into(), value);
        }
        let status = if self.draining() {
            ready = false;
            "draining"
        } else if !ready {
            "not-ready"
        } else if degraded {
            "degraded"
        } else {
            "ready"
        };
        (ready, json!({"status": status, "checks": checks}))
    }
}

/// One round: each dependency checked once (bounded by `database.acquire_timeout_ms` and
/// `gateway.kafka_timeout_ms`), the cache and the metrics updated.
pub async fn check_round(state: &AppState) {
    let database = match migrations::ping(&state.pool).await {
        Ok(_) => Ok(()),
        Err(e) => {
            tracing::warn!(error = %e, "readiness: the database did not answer");
            Err("the database did not answer".to_string())
        }
    };
    let migrations = match &database {
        Err(_) => Err("the database is unreachable".to_string()),
        Ok(()) => match migrations::applied_versions(&state.pool).await {
            Ok(applied) => {
                let missing: Vec<i64> = migrations::expected_versions().difference(&applied).copied().collect();
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(format!("migrations not applied: {missing:?} (run `parsley-projector migrate`)"))
                }
            }
            Err(_) => Err("no migrations applied (run `parsley-projector migrate`)".to_string()),
        },
    };
    let kafka = state.facts.reachable().await.map_err(|e| {
        tracing::warn!(error = %format!("{e:#}"), "readiness: the broker did not answer");
        "the broker did not answer a metadata request".to_string()
    });
    for (dependency, result) in
        [(Dependency::Database, database), (Dependency::Migrations, migrations), (Dependency::Kafka, kafka)]
    {
        let outcome = if result.is_ok() { "ok" } else { "error" };
        let name = dependency.as_str();
        state.metrics.add(Metric::DependencyChecksTotal, &[("dependency", name), ("result", outcome)], 1.0);
        let up = state.readiness.record(dependency, result);
        state.metrics.set(Metric::DependencyUp, &[("dependency", name)], if up { 1.0 } else { 0.0 });
    }
    state.readiness.round_done();
}

/// Runs a round unless one already ran: the first probe's, before the background checks'
/// first round.
pub async fn ensure_checked(state: &AppState) {
    if state.readiness.rounds() > 0 {
        return;
    }
    let _first = state.readiness.first.lock().await;
    if state.readiness.rounds() == 0 {
        check_round(state).await;
    }
}

/// The background checks: a round at once, then every `gateway.readiness_check_ms`, until
/// `shutdown` turns true (the gateway stops them after its listeners drained).
pub async fn run_checks(state: AppState, mut shutdown: watch::Receiver<bool>) {
    state.readiness.checking.store(true, Ordering::SeqCst);
    let every = state.config.settings.readiness_check();
    loop {
        {
            let _round = state.readiness.first.lock().await;
            check_round(&state).await;
        }
        tokio::select! {
            _ = shutdown.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(r: &Readiness, dependency: Dependency) -> Value {
        r.ready(None).1["checks"][dependency.as_str()].clone()
    }

    #[test]
    fn a_required_dependency_is_down_after_the_failures_in_a_row() {
        let r = Readiness::new(2, Duration::from_secs(30));
        assert!(!r.ready(None).0, "nothing checked yet");
        for d in Dependency::ALL {
            r.record(d, Ok(()));
        }
        assert_eq!(r.ready(None).1["status"], "ready");
        assert!(r.record(Dependency::Database, Err("the database did not answer".into())), "one failure: a blip");
        assert!(r.ready(None).0);
        assert_eq!(check(&r, Dependency::Database)["failed_checks"], 1);
        assert!(!r.record(Dependency::Database, Err("the database did not answer".into())));
        let (ready, body) = r.ready(None);
        assert!(!ready && body["status"] == "not-ready", "{body}");
        assert!(r.record(Dependency::Database, Ok(())), "one good check brings it back");
        assert!(r.ready(None).0);
    }

    #[test]
    fn a_first_failed_check_decides_at_once() {
        let r = Readiness::new(3, Duration::from_secs(30));
        assert!(!r.record(Dependency::Database, Err("x".into())));
        r.record(Dependency::Migrations, Ok(()));
        r.record(Dependency::Kafka, Ok(()));
        assert!(!r.ready(None).0);
    }

    #[test]
    fn kafka_down_is_degraded_not_unready() {
        let r = Readiness::new(1, Duration::from_secs(30));
        for d in Dependency::ALL {
            r.record(d, Ok(()));
        }
        r.record(Dependency::Kafka, Err("the broker did not answer a metadata request".into()));
        let (ready, body) = r.ready(None);
        assert!(ready, "{body}");
        assert_eq!(body["status"], "degraded");
        assert_eq!(body["checks"]["kafka"]["ok"], false);
        assert_eq!(body["checks"]["kafka"]["required"], false);
    }

    #[test]
    fn identity_keys_and_draining_fail_readiness() {
        let r = Readiness::new(1, Duration::from_secs(30));
        for d in Dependency::ALL {
            r.record(d, Ok(()));
        }
        let (ready, body) = r.ready(Some(Err("no token verification keys yet".into())));
        assert!(!ready && body["checks"]["identity_keys"]["ok"] == false, "{body}");
        assert!(r.ready(Some(Ok(()))).0);
        r.start_draining();
        let (ready, body) = r.ready(Some(Ok(())));
        assert!(!ready && body["status"] == "draining", "{body}");
    }

    #[test]
    fn liveness_fails_only_when_running_checks_stop_completing() {
        let r = Readiness::new(1, Duration::from_millis(50));
        assert!(r.live().0, "no background checks: nothing to watch");
        r.checking.store(true, Ordering::SeqCst);
        r.round_done();
        assert!(r.live().0);
        std::thread::sleep(Duration::from_millis(80));
        let (live, body) = r.live();
        assert!(!live && body["status"] == "stuck", "{body}");
        r.round_done();
        assert!(r.live().0);
        r.record(Dependency::Database, Err("down".into()));
        assert!(r.live().0, "a dependency never fails liveness");
    }
}
