//! Shared re-checks for waiting reads: one clock fetch per model per wake-up serves every
//! read of that model that is waiting for coverage.
//!
//! A read that is not covered at its first attempt registers with its model's [`Feed`] and
//! waits for clock rows. The feed's task — running only while reads wait — fetches the
//! model's clock rows once per wake-up (a `NOTIFY` from the projector's step, a new waiter,
//! or every `recheck_ms`) and publishes them; each waiter runs the pure gate over them and
//! makes its own snapshot attempt (the check and the data read in one snapshot, as always)
//! only once the published rows cover it. So 1,000 reads waiting on one model cost about one
//! clock query per projector step, not 1,000 (`parsley_gateway_clock_fetches_total`). Each
//! fetch is a debug event of the target `parsley::stage` (`clock-fetched`), for timing a
//! write's way to visibility.
//!
//! While at most [`DIRECT_WAITERS`] reads of a model wait, a wake-up fetches nothing: it
//! wakes them (`woken`) and each makes its snapshot attempt at once — the attempt reads the
//! clock rows it needs anyway, so a lone read waiting for its own write is served one round
//! trip sooner. A direct wake-up is a `parsley::stage` event too (`woken`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parsley::gate::ClockRow;
use parsley_infra::pg::Reuse;
use parsley_store::ordering;
use tokio::sync::{watch, Notify};

use crate::metrics::{Metric, Metrics};
use crate::notify::ClockNotifier;

/// The clock rows a feed last fetched (`None`: none yet).
pub type Rows = Option<Arc<Vec<ClockRow>>>;

/// The most waiting reads of one model that a wake-up wakes to attempt on their own, instead
/// of fetching the clock rows once for all of them: with this few, the attempts cost no more
/// queries than a shared fetch followed by theirs.
pub const DIRECT_WAITERS: usize = 4;

/// What the feeds' tasks read with: the clock channel's notifier, the reads' connections,
/// the metrics, and how often a waiting read re-checks without a notification.
pub struct Source {
    pub notifier: Arc<ClockNotifier>,
    pub reads: Arc<Reuse>,
    pub metrics: Arc<Metrics>,
    pub recheck: Duration,
}

/// Per model, its feed.
pub struct Feeds {
    models: BTreeMap<String, Arc<Feed>>,
    source: Arc<Source>,
}

impl Feeds {
    pub fn new<'a>(models: impl IntoIterator<Item = &'a str>, source: Source) -> Feeds {
        Feeds {
            models: models.into_iter().map(|m| (m.to_string(), Arc::new(Feed::default()))).collect(),
            source: Arc::new(source),
        }
    }

    /// Registers a waiting read of `model` (`None`: not configured); the feed's task starts
    /// if it is not running, and fetches soon (a new waiter is a wake-up).
    pub fn wait(&self, model: &str) -> Option<Waiting> {
        let feed = Arc::clone(self.models.get(model)?);
        feed.waiters.fetch_add(1, Ordering::SeqCst);
        let mut rows = feed.rows.subscribe();
        rows.mark_unchanged();
        let mut woken = feed.woken.subscribe();
        woken.mark_unchanged();
        feed.kick.notify_one();
        if !feed.running.swap(true, Ordering::SeqCst) {
            tokio::spawn(run(Arc::clone(&feed), Arc::clone(&self.source), model.to_string()));
        }
        Some(Waiting { feed, rows, woken })
    }
}

/// One model's feed.
#[derive(Debug)]
pub struct Feed {
    rows: watch::Sender<Rows>,
    /// Counts the wake-ups that fetched nothing (at most [`DIRECT_WAITERS`] waiting).
    woken: watch::Sender<u64>,
    waiters: AtomicUsize,
    running: AtomicBool,
    kick: Notify,
}

impl Default for Feed {
    fn default() -> Self {
        Feed {
            rows: watch::Sender::new(None),
            woken: watch::Sender::new(0),
            waiters: AtomicUsize::new(0),
            running: AtomicBool::new(false),
            kick: Notify::new(),
        }
    }
}

/// A waiting read's registration; dropping it deregisters.
pub struct Waiting {
    feed: Arc<Feed>,
    /// The rows as the feed publishes them.
    pub rows: watch::Receiver<Rows>,
    /// Changes when the feed wakes the waiting reads to attempt on their own.
    pub woken: watch::Receiver<u64>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.feed.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The feed's task: while reads wait, fetch on every wake-up and publish; stop when none is
/// left (the next waiter starts it again).
async fn run(feed: Arc<Feed>, source: Arc<Source>, model: String) {
    let Some(mut bumps) = source.notifier.subscribe(&model) else { return };
    let recheck = source.recheck;
    loop {
        if feed.waiters.load(Ordering::SeqCst) == 0 {
            feed.running.store(false, Ordering::SeqCst);
            // A waiter that registered meanwhile saw `running` still set and spawned nothing:
            // carry on for it, unless one of them has started a task of its own since.
            if feed.waiters.load(Ordering::SeqCst) == 0 || feed.running.swap(true, Ordering::SeqCst) {
                return;
            }
        }
        tokio::select! {
            changed = bumps.changed() => if changed.is_err() { return },
            _ = feed.kick.notified() => {}
            _ = tokio::time::sleep(recheck) => {}
        }
        let waiters = feed.waiters.load(Ordering::SeqCst);
        if waiters == 0 {
            continue;
        }
        if waiters <= DIRECT_WAITERS {
            tracing::debug!(target: "parsley::stage", stage = "woken", model, "waiting reads woken to attempt");
            feed.woken.send_modify(|n| *n += 1);
            continue;
        }
        let fetched = async {
            let mut conn = source.reads.acquire().await.map_err(anyhow::Error::from)?;
            let rows = ordering::clock_rows(&mut conn, &model).await?;
            conn.release();
            anyhow::Ok(rows)
        };
        match fetched.await {
            Ok(rows) => {
                tracing::debug!(target: "parsley::stage", stage = "clock-fetched", model, "clock rows fetched for waiting reads");
                source.metrics.add(Metric::ClockFetchesTotal, &[("model", &model)], 1.0);
                feed.rows.send_replace(Some(Arc::new(rows)));
            }
            Err(e) => {
                tracing::warn!(model, error = %format!("{e:#}"), "fetching clock rows for waiting reads failed");
                // Waiters still time out into a 503 at their deadline.
                tokio::time::sleep(recheck).await;
            }
        }
    }
}
