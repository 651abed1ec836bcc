//! Waking waiting reads: one task `LISTEN`s on the projector's clock channel and bumps a
//! per-model counter (a `tokio::sync::watch`) for every notification; each model's feed
//! ([`crate::feed`]) fetches the clock once per bump for all of the model's waiting reads.
//! Notifications sent while the listener is reconnecting are lost, so the listener bumps
//! every model after a reconnect, and the feeds also re-check on a timer.
//!
//! The same notifications also count, per model and task, the changes a snapshot kept in
//! memory ([`crate::read_cache`]) must not outlive: [`ClockNotifier::generation`] changes with
//! every notification of the task or of the whole model, and a kept snapshot is served only
//! while the generation it was read under is still the current one and the listener is
//! connected ([`ClockNotifier::listening`]). Each notification
//! is a debug event of the target `parsley::stage` (`notified`), for timing a write's way to
//! visibility.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parsley::kept::{Bump, Heard, KeptRules};
use parsley_infra::backoff::{Attempts, Backoff};
use parsley_store::listen::barrier;
use parsley_store::{CLOCK_NOTIFY_CHANNEL, EVERY_MODEL_PAYLOAD};
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::sync::{watch, Notify};

use crate::metrics::{Metric, Metrics};

/// Slots of a model's per-task notification counts: task `t` counts in slot `t %
/// TASK_SLOTS` (two tasks sharing a slot only see each other's changes as their own).
const TASK_SLOTS: usize = 64;

/// Per-model wake-up counters, and per model and task how many notifications arrived.
#[derive(Debug)]
pub struct ClockNotifier {
    models: BTreeMap<String, Counters>,
    /// Whether the listener is connected and listening (notifications are being heard).
    listening: AtomicBool,
    /// Whether every change is announced: the last barrier found every announcing trigger in
    /// place and firing `ALWAYS` (`parsley_store::listen::ANNOUNCING_TRIGGERS`).
    announced: AtomicBool,
    /// Barriers ([`ClockNotifier::caught_up`]): tickets handed out, the highest ticket whose
    /// barrier the listener has passed, and the listener's wake-up.
    barrier_tickets: AtomicU64,
    barrier_passed: watch::Sender<u64>,
    barrier_asked: Notify,
}

#[derive(Debug)]
struct Counters {
    wake: watch::Sender<u64>,
    /// Notifications of the whole model (`<model>`), and wake-ups of every model.
    model: AtomicU64,
    /// Notifications of one task (`<model>:<task>`), by slot.
    tasks: [AtomicU64; TASK_SLOTS],
}

impl Counters {
    fn new() -> Counters {
        Counters {
            wake: watch::Sender::new(0),
            model: AtomicU64::new(0),
            tasks: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl ClockNotifier {
    /// Counters for the configured models.
    pub fn new<'a>(models: impl IntoIterator<Item = &'a str>) -> ClockNotifier {
        ClockNotifier {
            models: models.into_iter().map(|m| (m.to_string(), Counters::new())).collect(),
            listening: AtomicBool::new(false),
            announced: AtomicBool::new(false),
            barrier_tickets: AtomicU64::new(0),
            barrier_passed: watch::Sender::new(0),
            barrier_asked: Notify::new(),
        }
    }

    /// A value that changes whenever a notification of `model`'s task `task` or of the
    /// whole model arrives, or the listener reconnects (`None`: not configured). Never the
    /// same value again after a change.
    pub fn generation(&self, model: &str, task: u32) -> Option<u64> {
        let c = self.models.get(model)?;
        // Both only grow: their sum changes whenever either does.
        Some(c.model.load(Ordering::SeqCst).wrapping_add(c.tasks[task as usize % TASK_SLOTS].load(Ordering::SeqCst)))
    }

    /// A value that changes whenever a notification of any of `model`'s tasks or of the
    /// whole model arrives, or the listener reconnects (`None`: not configured).
    pub fn model_generation(&self, model: &str) -> Option<u64> {
        let c = self.models.get(model)?;
        let tasks = c.tasks.iter().fold(0u64, |sum, t| sum.wrapping_add(t.load(Ordering::SeqCst)));
        Some(c.model.load(Ordering::SeqCst).wrapping_add(tasks))
    }

    /// Waits until every notification committed before this call has been heard (and counted
    /// in the generations), at most `within`: the listener runs one statement on its own
    /// connection — a barrier, since Postgres sends a listening session every notification
    /// committed before a statement ahead of that statement's answer — for every read that
    /// asked before it began. `false`: not listening, or not caught up in time.
    pub async fn caught_up(&self, within: Duration) -> bool {
        if !self.listening() {
            return false;
        }
        let ticket = self.barrier_tickets.fetch_add(1, Ordering::SeqCst) + 1;
        let mut passed = self.barrier_passed.subscribe();
        self.barrier_asked.notify_one();
        let caught_up = tokio::time::timeout(within, passed.wait_for(|p| *p >= ticket)).await;
        matches!(caught_up, Ok(Ok(_))) && self.listening()
    }

    /// Whether notifications are being heard now: the listener is connected and `LISTEN`ing.
    pub fn listening(&self) -> bool {
        self.listening.load(Ordering::SeqCst)
    }

    /// Whether a kept snapshot may be kept and served now: notifications are heard and every
    /// change is announced.
    pub fn may_keep(&self) -> bool {
        KeptRules::SHIPPED.may_keep(self.listening(), self.announced.load(Ordering::SeqCst))
    }

    /// Whether every change is announced (see [`Self::may_keep`]); a change of that changes
    /// every generation, so nothing kept before it is served after. Returns whether it changed.
    pub fn set_announced(&self, on: bool) -> bool {
        let changed = self.announced.swap(on, Ordering::SeqCst) != on;
        if changed {
            self.heard(None, Heard::AnnouncingChanged);
        }
        changed
    }

    /// The listener connected (`true`) or lost its connection (`false`); either way every
    /// generation changes.
    pub fn set_listening(&self, on: bool) {
        self.listening.store(on, Ordering::SeqCst);
        self.heard(None, if on { Heard::Connected } else { Heard::Lost });
    }

    /// The listener's connection was replaced underneath: it listens, but what was committed
    /// meanwhile was never heard.
    pub fn replaced(&self) {
        self.listening.store(true, Ordering::SeqCst);
        self.heard(None, Heard::Replaced);
    }

    /// Counts what the listener heard in the generations it changes ([`KeptRules::bump`]),
    /// and wakes the waiting reads of the models it concerns. `model`: the model a
    /// notification names (`None`: an event of every model, or of the listener itself).
    /// Returns whether a configured model was woken.
    pub fn heard(&self, model: Option<&str>, heard: Heard) -> bool {
        let bump = KeptRules::SHIPPED.bump(heard);
        let s = match bump {
            Bump::Nothing => return false,
            Bump::EveryModel => {
                self.wake_all();
                return !self.models.is_empty();
            }
            Bump::Model | Bump::Task(_) => match model.and_then(|m| self.models.get(m)) {
                Some(s) => s,
                None => return false,
            },
        };
        match bump {
            Bump::Task(t) => s.tasks[t as usize % TASK_SLOTS].fetch_add(1, Ordering::SeqCst),
            _ => s.model.fetch_add(1, Ordering::SeqCst),
        };
        s.wake.send_modify(|n| *n = n.wrapping_add(1));
        true
    }

    /// A receiver that sees every bump of `model` after this call (`None`: not configured).
    pub fn subscribe(&self, model: &str) -> Option<watch::Receiver<u64>> {
        self.models.get(model).map(|s| {
            let mut rx = s.wake.subscribe();
            rx.mark_unchanged();
            rx
        })
    }

    /// Handles one notification payload: `<model>:<task>`, `<model>`, or `*` (every model: a
    /// document changed outside a step). Returns whether a configured model was woken.
    pub fn notified(&self, payload: &str) -> bool {
        if payload == EVERY_MODEL_PAYLOAD {
            return self.heard(None, Heard::EveryModel);
        }
        match payload.rsplit_once(':') {
            Some((model, task)) => match task.parse::<u32>() {
                Ok(task) => self.heard(Some(model), Heard::Task(task)),
                // A payload whose task does not parse counts as the whole model.
                Err(_) => self.heard(Some(model), Heard::Model),
            },
            None => self.heard(Some(payload), Heard::Model),
        }
    }

    /// Wakes every model (after a reconnect, when notifications may have been lost).
    pub fn wake_all(&self) {
        for s in self.models.values() {
            s.model.fetch_add(1, Ordering::SeqCst);
            s.wake.send_modify(|n| *n = n.wrapping_add(1));
        }
    }
}

/// The clock listener's reconnection waits: from 0.1 s, doubling to 5 s, jittered, so the
/// gateways of a fleet do not reconnect in step after a database restart.
pub const RECONNECT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

/// Listens until `shutdown` turns true, reconnecting with backoff ([`RECONNECT_BACKOFF`]).
pub async fn listen(
    pool: PgPool,
    notifier: Arc<ClockNotifier>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut attempts = Attempts::new(RECONNECT_BACKOFF);
    loop {
        if *shutdown.borrow() {
            return;
        }
        let connected = async {
            let mut l = PgListener::connect_with(&pool).await?;
            l.listen(CLOCK_NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let connected = tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => return,
            l = connected => l,
        };
        let mut listener = match connected {
            Ok(l) => l,
            Err(e) => {
                let wait = attempts.next_delay();
                tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "clock listener cannot connect");
                tokio::select! {
                    _ = shutdown.wait_for(|stop| *stop) => return,
                    _ = tokio::time::sleep(wait) => {}
                }
                continue;
            }
        };
        // The backend this LISTEN is on: a barrier answered by another one means the
        // connection was replaced underneath.
        // And the announcing triggers' fingerprint: another one means a trigger was touched.
        let (mut backend_pid, mut triggers) = tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => return,
            first = barrier(&mut listener) => match first {
                Ok(first) => {
                    announce(&notifier, &first.unannounced);
                    (first.backend_pid, first.triggers)
                }
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "clock listener failed after LISTEN; reconnecting");
                    continue;
                }
            },
        };
        tracing::info!(channel = CLOCK_NOTIFY_CHANNEL, backend_pid, "listening for clock changes");
        attempts.reset();
        // Anything committed before LISTEN took effect was not heard: re-check everyone.
        notifier.set_listening(true);
        loop {
            let next = tokio::select! {
                _ = shutdown.wait_for(|stop| *stop) => return,
                // Cancel-safe: sqlx takes a message off the socket only once it is whole.
                n = listener.try_recv() => Some(n),
                _ = notifier.barrier_asked.notified() => None,
            };
            let next = match next {
                Some(n) => n,
                None => {
                    // Every read that asked so far is served by this barrier.
                    let tickets = notifier.barrier_tickets.load(Ordering::SeqCst);
                    match barrier(&mut listener).await {
                        Ok(answer) => {
                            // What arrived meanwhile sqlx kept aside, in order.
                            while let Some(n) = listener.next_buffered() {
                                heard(&notifier, &metrics, n.payload());
                            }
                            if answer.backend_pid != backend_pid {
                                replaced(&notifier, &metrics, backend_pid, answer.backend_pid);
                                backend_pid = answer.backend_pid;
                            }
                            if answer.triggers != triggers {
                                touched(&notifier);
                                triggers = answer.triggers;
                            }
                            announce(&notifier, &answer.unannounced);
                            // Published after a replacement woke everyone, so no read served
                            // past this barrier trusts what the lost connection would have said.
                            notifier.barrier_passed.send_modify(|p| *p = (*p).max(tickets));
                            continue;
                        }
                        Err(e) => {
                            lost(&notifier, &metrics, &e);
                            break;
                        }
                    }
                }
            };
            match next {
                Ok(Some(n)) => heard(&notifier, &metrics, n.payload()),
                Ok(None) => {
                    // The connection was lost and re-established: notifications in between
                    // are gone.
                    metrics.add(Metric::ListenerReconnectsTotal, &[], 1.0);
                    tracing::warn!("clock listener reconnected; re-checking every waiting read");
                    notifier.set_listening(true);
                    match barrier(&mut listener).await {
                        Ok(answer) => {
                            (backend_pid, triggers) = (answer.backend_pid, answer.triggers);
                            announce(&notifier, &answer.unannounced);
                        }
                        Err(e) => {
                            lost(&notifier, &metrics, &e);
                            break;
                        }
                    }
                }
                Err(e) => {
                    lost(&notifier, &metrics, &e);
                    break;
                }
            }
        }
    }
}

/// The listener's connection failed: counted, and every waiting read re-checks until a new
/// connection listens.
fn lost(notifier: &ClockNotifier, metrics: &Metrics, error: &dyn std::fmt::Display) {
    metrics.add(Metric::ListenerReconnectsTotal, &[], 1.0);
    tracing::warn!(error = %format!("{error:#}"), "clock listener failed; reconnecting");
    notifier.set_listening(false);
}

/// The listener's connection was replaced underneath (a barrier answered from another
/// backend): what was committed in between was never heard, so it counts as a reconnect and
/// every model is woken (its kept snapshots no longer served).
fn replaced(notifier: &ClockNotifier, metrics: &Metrics, was: i32, now: i32) {
    metrics.add(Metric::ListenerReconnectsTotal, &[], 1.0);
    tracing::warn!(was, now, "clock listener's connection was replaced; re-checking every waiting read");
    notifier.replaced();
}

/// An announcing trigger was disabled, enabled, dropped or made since the last barrier (its
/// catalog row changed): a change made meanwhile may have gone unannounced, even if every
/// trigger is back now, so every model is woken (nothing kept before is served).
fn touched(notifier: &ClockNotifier) {
    tracing::warn!(
        "an announcing trigger was changed since the last barrier (disabled, enabled, dropped or created): \
         re-checking every waiting read, nothing kept before is served"
    );
    notifier.heard(None, Heard::TriggersTouched);
}

/// Records whether every change is announced, from a barrier's list of the announcing
/// triggers missing or not firing `ALWAYS`; logs when that changes.
fn announce(notifier: &ClockNotifier, unannounced: &[String]) {
    if notifier.set_announced(unannounced.is_empty()) {
        if unannounced.is_empty() {
            tracing::info!("every change is announced on the clock channel: snapshots are kept again");
        } else {
            tracing::warn!(
                triggers = ?unannounced,
                "changes may go unannounced (announcing triggers missing or not ENABLE ALWAYS): \
                 no snapshot is kept until they are back (run `parsley-projector migrate`)"
            );
        }
    }
}

/// One notification heard, whether it came on its own or behind a barrier's answer.
fn heard(notifier: &ClockNotifier, metrics: &Metrics, payload: &str) {
    tracing::debug!(target: "parsley::stage", stage = "notified", payload, "a clock notification arrived");
    metrics.add(Metric::ClockNotificationsTotal, &[], 1.0);
    notifier.notified(payload);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_wake_their_model_only() {
        let n = ClockNotifier::new(["shop", "audit"]);
        let mut shop = n.subscribe("shop").unwrap();
        let audit = n.subscribe("audit").unwrap();
        assert!(n.subscribe("nope").is_none());
        assert!(n.notified("shop:3"));
        assert!(shop.has_changed().unwrap());
        assert!(!audit.has_changed().unwrap());
        shop.mark_unchanged();
        assert!(n.notified("audit"));
        assert!(audit.has_changed().unwrap());
        assert!(!n.notified("other:1"));
        n.wake_all();
        assert!(shop.has_changed().unwrap());
        let (shop, audit) = (n.subscribe("shop").unwrap(), n.subscribe("audit").unwrap());
        let (g_shop, g_audit) = (n.generation("shop", 0).unwrap(), n.generation("audit", 5).unwrap());
        assert!(n.notified("*"), "a document changed outside a step: every model");
        assert!(shop.has_changed().unwrap() && audit.has_changed().unwrap());
        assert!(n.generation("shop", 0) != Some(g_shop) && n.generation("audit", 5) != Some(g_audit));
        assert!(!ClockNotifier::new(["shop"]).notified("**"), "only `*` itself means every model");
    }

    #[tokio::test]
    async fn a_barrier_passes_only_when_the_listener_runs_it() {
        let n = ClockNotifier::new(["shop"]);
        assert!(!n.caught_up(Duration::from_secs(1)).await, "not listening: no barrier");
        n.set_listening(true);
        assert!(!n.caught_up(Duration::from_millis(20)).await, "no listener ran it in time");
        // A listener passing the barrier for every ticket handed out so far.
        let tickets = n.barrier_tickets.load(Ordering::SeqCst);
        n.barrier_passed.send_modify(|p| *p = tickets + 1);
        assert!(n.caught_up(Duration::from_millis(20)).await, "the next ticket was passed");
        n.set_listening(false);
        assert!(!n.caught_up(Duration::from_secs(1)).await);
    }

    #[test]
    fn a_generation_changes_with_its_task_its_model_and_the_listener() {
        let n = ClockNotifier::new(["shop", "audit"]);
        assert_eq!(n.generation("nope", 0), None);
        let g = |t| n.generation("shop", t).unwrap();
        let (t0, t1) = (g(0), g(1));
        n.notified("shop:1");
        assert_eq!(g(0), t0, "another task's step");
        assert_ne!(g(1), t1);
        let (t0, t1) = (g(0), g(1));
        n.notified("audit:0");
        assert_eq!((g(0), g(1)), (t0, t1), "another model's step");
        n.notified("shop");
        assert!(g(0) != t0 && g(1) != t1, "a model-wide change");
        let (t0, t1) = (g(0), g(1));
        assert!(!n.listening());
        n.set_listening(true);
        assert!(n.listening());
        assert!(g(0) != t0 && g(1) != t1, "connecting: what was missed is unknown");
        let t0 = g(0);
        n.set_listening(false);
        assert!(!n.listening() && g(0) != t0);
        let t0 = g(0);
        n.notified("shop:x");
        assert_ne!(g(0), t0, "a payload whose task does not parse counts as the whole model");
        let all = n.model_generation("shop").unwrap();
        n.notified("shop:7");
        let after = n.model_generation("shop").unwrap();
        assert_ne!(after, all, "any task's step changes the whole model's generation");
        n.notified("audit:7");
        assert_eq!(n.model_generation("shop"), Some(after));
    }
}
