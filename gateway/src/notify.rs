//! Waking waiting reads: one task `LISTEN`s on the projector's clock channel and bumps a
//! per-model counter (a `tokio::sync::watch`) for every notification; each model's feed
//! ([`crate::feed`]) fetches the clock once per bump for all of the model's waiting reads.
//! Notifications sent while the listener is reconnecting are lost, so the listener bumps
//! every model after a reconnect, and the feeds also re-check on a timer. Each notification
//! is a debug event of the target `parsley::stage` (`notified`), for timing a write's way to
//! visibility.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parsley_store::CLOCK_NOTIFY_CHANNEL;
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::sync::watch;

use crate::metrics::{Metric, Metrics};

/// Per-model wake-up counters.
#[derive(Debug)]
pub struct ClockNotifier {
    models: BTreeMap<String, watch::Sender<u64>>,
}

impl ClockNotifier {
    /// Counters for the configured models.
    pub fn new<'a>(models: impl IntoIterator<Item = &'a str>) -> ClockNotifier {
        ClockNotifier { models: models.into_iter().map(|m| (m.to_string(), watch::Sender::new(0))).collect() }
    }

    /// A receiver that sees every bump of `model` after this call (`None`: not configured).
    pub fn subscribe(&self, model: &str) -> Option<watch::Receiver<u64>> {
        self.models.get(model).map(|s| {
            let mut rx = s.subscribe();
            rx.mark_unchanged();
            rx
        })
    }

    /// Handles one notification payload: `<model>:<task>` or `<model>`. Returns whether a
    /// configured model was woken.
    pub fn notified(&self, payload: &str) -> bool {
        let model = payload.rsplit_once(':').map_or(payload, |(m, _)| m);
        match self.models.get(model) {
            Some(s) => {
                s.send_modify(|n| *n = n.wrapping_add(1));
                true
            }
            None => false,
        }
    }

    /// Wakes every model (after a reconnect, when notifications may have been lost).
    pub fn wake_all(&self) {
        for s in self.models.values() {
            s.send_modify(|n| *n = n.wrapping_add(1));
        }
    }
}

/// Listens until `shutdown` turns true, reconnecting with backoff.
pub async fn listen(
    pool: PgPool,
    notifier: Arc<ClockNotifier>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = Duration::from_millis(100);
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
                tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "clock listener cannot connect");
                tokio::select! {
                    _ = shutdown.wait_for(|stop| *stop) => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        tracing::info!(channel = CLOCK_NOTIFY_CHANNEL, "listening for clock changes");
        backoff = Duration::from_millis(100);
        // Anything committed before LISTEN took effect was not heard: re-check everyone.
        notifier.wake_all();
        loop {
            let next = tokio::select! {
                _ = shutdown.wait_for(|stop| *stop) => return,
                n = listener.try_recv() => n,
            };
            match next {
                Ok(Some(n)) => {
                    tracing::debug!(target: "parsley::stage", stage = "notified", payload = n.payload(),
                        "a clock notification arrived");
                    metrics.add(Metric::ClockNotificationsTotal, &[], 1.0);
                    notifier.notified(n.payload());
                }
                Ok(None) => {
                    // The connection was lost and re-established: notifications in between
                    // are gone.
                    metrics.add(Metric::ListenerReconnectsTotal, &[], 1.0);
                    tracing::warn!("clock listener reconnected; re-checking every waiting read");
                    notifier.wake_all();
                }
                Err(e) => {
                    metrics.add(Metric::ListenerReconnectsTotal, &[], 1.0);
                    tracing::warn!(error = %e, "clock listener failed; reconnecting");
                    notifier.wake_all();
                    break;
                }
            }
        }
    }
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
    }
}
