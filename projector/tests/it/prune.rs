//! Upstream pruning (`projector.prune_interval_ms`): clock and frontier pairs on channels of
//! topics the model does not receive are kept while the broker says they are live; clock
//! pairs are dropped — with a NOTIFY — once their topic is deleted or retention passed them,
//! frontier pairs (what a send stamps) only once their topic is deleted; the
//! model's own channel is never pruned, and a restart restores the pruned state. With
//! pruning disabled nothing is pruned.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parsley::channel::{ChannelId, Position, TopicId};
use parsley_projector::metrics::{Metric, Metrics, METRICS};
use parsley_settings::config::{Apply, Config};
use parsley_store::ordering::CLOCK_NOTIFY_CHANNEL;
use sqlx::postgres::PgListener;
use sqlx::{PgPool, Row as _};

use crate::support::*;

/// Task 0's rows of `table` (`clock` or `frontier`), read from the database.
async fn rows(pool: &PgPool, table: &str, model: &str) -> BTreeMap<ChannelId, Position> {
    let sql = format!("SELECT topic_id, partition, position FROM parsley.{table} WHERE model = $1 AND task = 0");
    sqlx::query(&sql)
        .bind(model)
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .map(|r| {
            let id: uuid::Uuid = r.get(0);
            let partition: i32 = r.get(1);
            (ChannelId::new(TopicId::from_bytes(*id.as_bytes()), partition as u32), r.get(2))
        })
        .collect()
}

/// The prunes task 0 of `model` has made.
fn prunes(metrics: &Metrics, model: &str) -> f64 {
    metrics.value(Metric::PruneChecksTotal, &[("model", model), ("task", "0")]).unwrap_or(0.0)
}

/// A model receiving `{base}.m` only, next to upstream topics `{base}.u1` and `{base}.u2`.
struct Upstream {
    model: String,
    m: String,
    u1: String,
    u2: String,
}

impl Upstream {
    fn new(prefix: &str) -> Upstream {
        let base = unique(prefix);
        Upstream { model: base.clone(), m: format!("{base}.m"), u1: format!("{base}.u1"), u2: format!("{base}.u2") }
    }

    fn config(&self, prune_interval_ms: u64) -> Config {
        let mut c = config(&self.model, &[(&self.m, Apply::Replace)]);
        c.projector.prune_interval_ms = prune_interval_ms;
        c.validate().unwrap();
        c
    }

    /// Two records on U1, three on U2, then two on M, the first caused by U1/0@1 and
    /// U2/0@1. Returns the channels (M, U1, U2) and M's last offset.
    async fn produce(&self) -> (ChannelId, ChannelId, ChannelId, Position) {
        create_topics(&[&self.m, &self.u1, &self.u2], 1).await;
        let (m, u1, u2) = (topic_id(&self.m).await, topic_id(&self.u1).await, topic_id(&self.u2).await);
        let p = producer();
        for i in 0..2 {
            produce(&p, &self.u1, 0, &format!("u1-{i}"), Some(b"{}"), None).await;
        }
        for i in 0..3 {
            produce(&p, &self.u2, 0, &format!("u2-{i}"), Some(b"{}"), None).await;
        }
        let header = causes(&[(u1, 0, 1), (u2, 0, 1)]);
        produce(&p, &self.m, 0, "a", Some(br#"{"n":1}"#), Some(&header)).await;
        let last = produce(&p, &self.m, 0, "b", Some(br#"{"n":2}"#), None).await;
        (ChannelId::new(m, 0), ChannelId::new(u1, 0), ChannelId::new(u2, 0), last)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_pairs_are_pruned_once_their_topic_is_gone_or_retention_passed_them() {
    let t = Upstream::new("prune");
    let (own, u1, u2, last) = t.produce().await;
    let pool = pool().await;
    let config = t.config(200);
    let metrics = Metrics::new(METRICS);
    let mut projector = start_with_metrics(&config, &pool, Recording::new(&config), Arc::clone(&metrics)).await;
    drive_until(&mut projector, "both records of M to apply", || async { applied(&pool, &t.model).await.len() == 2 })
        .await;
    let live = BTreeMap::from([(own, last), (u1, 1), (u2, 1)]);
    assert_eq!(rows(&pool, "clock", &t.model).await, live);
    assert_eq!(rows(&pool, "frontier", &t.model).await, live);

    // Live: both topics exist, and U2's log start sits exactly at the named position (a
    // pair below the log start is dead, one at it is not). Prunes run and drop nothing.
    delete_records(&t.u2, 0, 1).await;
    let before = prunes(&metrics, &t.model);
    drive_until(&mut projector, "two prunes while the pairs are live", || async {
        prunes(&metrics, &t.model) >= before + 2.0
    })
    .await;
    assert_eq!(rows(&pool, "clock", &t.model).await, live);
    assert_eq!(rows(&pool, "frontier", &t.model).await, live);
    assert_eq!(metrics.value(Metric::PairsPrunedTotal, &[("model", &t.model), ("task", "0")]), None);

    // U1 deleted, U2's retention past the named position: the clock drops both (reads stop
    // demanding them); the frontier — what a send stamps — drops U1's only: a pair leaves
    // it only with its topic. M's stays in both.
    let mut listener = PgListener::connect(&database_url()).await.unwrap();
    listener.listen(CLOCK_NOTIFY_CHANNEL).await.unwrap();
    delete_topic(&t.u1).await;
    delete_records(&t.u2, 0, 2).await;
    let own_only = BTreeMap::from([(own, last)]);
    drive_until(&mut projector, "the upstream clock rows to be pruned", || async {
        rows(&pool, "clock", &t.model).await == own_only
    })
    .await;
    let stamped = BTreeMap::from([(own, last), (u2, 1)]);
    assert_eq!(rows(&pool, "frontier", &t.model).await, stamped);
    let pruned = metrics.value(Metric::PairsPrunedTotal, &[("model", &t.model), ("task", "0")]);
    assert_eq!(pruned, Some(3.0), "two clock pairs and U1's frontier pair");
    // The pruning step notified the gateway that task 0's clock changed. Other tests' models
    // notify on the same channel concurrently: wait for this model's notification.
    let wanted = format!("{}:0", t.model);
    let found = tokio::time::timeout(TIMEOUT, async {
        loop {
            let note = listener.recv().await.unwrap();
            if note.payload() == wanted {
                return;
            }
        }
    })
    .await;
    assert!(found.is_ok(), "no notification {wanted:?} on {CLOCK_NOTIFY_CHANNEL}");
    let engine = projector.tasks()[0].engine();
    assert_eq!(engine.delivered_past().iter().collect::<Vec<_>>(), vec![(own, last)]);
    assert_eq!(engine.frontier().iter().collect::<BTreeMap<_, _>>(), stamped);
    drop(projector);

    // A restart restores the pruned state and keeps it.
    let metrics = Metrics::new(METRICS);
    let mut again = start_with_metrics(&config, &pool, Recording::new(&config), Arc::clone(&metrics)).await;
    drive_for(&mut again, Duration::from_millis(600)).await;
    let engine = again.tasks()[0].engine();
    assert_eq!(engine.delivered_past().iter().collect::<Vec<_>>(), vec![(own, last)]);
    assert_eq!(engine.frontier().iter().collect::<BTreeMap<_, _>>(), stamped);
    assert_eq!(rows(&pool, "clock", &t.model).await, own_only);
    assert_eq!(rows(&pool, "frontier", &t.model).await, stamped);
    assert_eq!(
        metrics.value(Metric::PairsPrunedTotal, &[("model", &t.model), ("task", "0")]),
        None,
        "the prunes after the restart drop nothing more"
    );
    assert_eq!(applied(&pool, &t.model).await.len(), 2, "nothing is delivered twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_pruning_disabled_a_deleted_upstream_topic_keeps_its_pairs() {
    let t = Upstream::new("prune-off");
    let (own, u1, u2, last) = t.produce().await;
    let pool = pool().await;
    let config = t.config(0);
    let metrics = Metrics::new(METRICS);
    let mut projector = start_with_metrics(&config, &pool, Recording::new(&config), Arc::clone(&metrics)).await;
    drive_until(&mut projector, "both records of M to apply", || async { applied(&pool, &t.model).await.len() == 2 })
        .await;
    delete_topic(&t.u1).await;
    delete_records(&t.u2, 0, 2).await;
    drive_for(&mut projector, Duration::from_millis(600)).await;
    let kept = BTreeMap::from([(own, last), (u1, 1), (u2, 1)]);
    assert_eq!(rows(&pool, "clock", &t.model).await, kept);
    assert_eq!(rows(&pool, "frontier", &t.model).await, kept);
    assert_eq!(prunes(&metrics, &t.model), 0.0, "prune_interval_ms = 0 disables pruning");
}
