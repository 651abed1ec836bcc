//! Leases and balancing against the real database: the statements that decide which
//! instance should run a task (claim, renew, hand back, membership), a takeover that meets a
//! frozen owner's row lock, and instances in one process sharing a model's tasks evenly,
//! taking a stopped instance's tasks at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parsley::channel::{ChannelId, TopicId};
use parsley_projector::DocumentProjection;
use parsley_store::leases::{self, Claim, Held, Joined};
use parsley_store::ordering;
use sqlx::PgPool;
use tokio::sync::watch;

use crate::support::*;

const LEASE: Duration = Duration::from_secs(5);

async fn model_with(pool: &PgPool, tasks: u32) -> String {
    let model = unique("leases");
    let topic = ChannelId::new(TopicId::from_bytes([3; 16]), 0).topic;
    ordering::register_model(pool, &model, tasks, &[("t".into(), topic)]).await.unwrap();
    model
}

async fn expire(pool: &PgPool, model: &str, task: u32) {
    sqlx::query("UPDATE parsley.tasks SET lease_until = now() - interval '1 second' WHERE model = $1 AND task = $2")
        .bind(model)
        .bind(task as i32)
        .execute(pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_is_taken_only_when_its_lease_is_free_and_the_epoch_fences_the_old_owner() {
    let pool = pool().await;
    let model = model_with(&pool, 2).await;
    let wait = Duration::from_millis(500);

    // Never held: taken at epoch 1, from nobody.
    let Claim::Taken { row, from } = leases::claim(&pool, &model, 0, "a", LEASE, wait).await.unwrap() else {
        panic!("a free task is taken")
    };
    assert_eq!((row.epoch, row.owner.as_str(), from), (1, "a", None));
    assert!(row.leased() && row.lease_remaining_ms.unwrap() <= 5000);
    // Held by a live lease: not taken.
    assert_eq!(leases::claim(&pool, &model, 0, "b", LEASE, wait).await.unwrap(), Claim::Held { owner: "a".into() });
    // Renewing with the held epoch keeps it; the step's lock renews too.
    let held = [Held { task: 0, epoch: 1, since_step: Some(Duration::from_millis(200)) }];
    assert_eq!(leases::renew(&pool, &model, &held, LEASE).await.unwrap(), Vec::<u32>::new());
    let mut conn = pool.acquire().await.unwrap();
    let row = &ordering::load_tasks(&mut conn, &model).await.unwrap()[0];
    assert!(row.since_step_ms.unwrap() >= 200, "{row:?}");

    // The lease expires (the owner died or froze): taken over, at a new epoch.
    expire(&pool, &model, 0).await;
    let Claim::Taken { row, from } = leases::claim(&pool, &model, 0, "b", LEASE, wait).await.unwrap() else {
        panic!("an expired lease is taken over")
    };
    assert_eq!((row.epoch, row.owner.as_str(), from.as_deref()), (2, "b", Some("a")));
    // The old owner learns it lost the task; its steps are fenced, its hand-back is refused.
    assert_eq!(leases::renew(&pool, &model, &held, LEASE).await.unwrap(), vec![0]);
    assert!(!leases::lock_and_renew(&mut conn, &model, 0, 1, LEASE).await.unwrap());
    assert!(!leases::release(&pool, &model, 0, 1).await.unwrap());
    assert!(leases::retake(&pool, &model, 0, "a", 1, LEASE).await.unwrap().is_none());

    // The owner starts it again (after a panic) at a new epoch; hands it back; anyone takes it.
    let again = leases::retake(&pool, &model, 0, "b", 2, LEASE).await.unwrap().expect("still b's");
    assert_eq!(again.epoch, 3);
    assert!(leases::release(&pool, &model, 0, 3).await.unwrap());
    let row = &ordering::load_tasks(&mut conn, &model).await.unwrap()[0];
    assert_eq!((row.lease_remaining_ms, row.leased()), (None, false));
    let Claim::Taken { row, from } = leases::claim(&pool, &model, 0, "a", LEASE, wait).await.unwrap() else {
        panic!("a handed-back task is taken")
    };
    assert_eq!((row.epoch, from), (4, None), "a hand-back is not a takeover");
}

/// A frozen owner mid-step holds its task's row lock: a takeover waits at most `lock_wait`,
/// says so and names the session, and succeeds once the session ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_never_waits_unboundedly_on_a_frozen_owner_s_row_lock() {
    let pool = pool().await;
    let model = model_with(&pool, 1).await;
    let Claim::Taken { row, .. } = leases::claim(&pool, &model, 0, "a", LEASE, LEASE).await.unwrap() else {
        panic!("taken")
    };
    // "a" opens a step and freezes inside it; its last committed lease passes.
    expire(&pool, &model, 0).await;
    let mut step = pool.begin().await.unwrap();
    assert!(leases::lock_and_renew(&mut step, &model, 0, row.epoch, LEASE).await.unwrap());
    tokio::time::sleep(Duration::from_millis(100)).await;

    let started = Instant::now();
    let claim = leases::claim(&pool, &model, 0, "b", LEASE, Duration::from_millis(300)).await.unwrap();
    let waited = started.elapsed();
    let Claim::Locked { holder } = claim else { panic!("the row is locked: {claim:?}") };
    assert!(waited < Duration::from_secs(3), "waited {waited:?}");
    let holder = holder.expect("the session holding the lock is described");
    assert!(holder.contains("idle in transaction"), "{holder}");

    // The frozen session ends (the server's idle_in_transaction timeout; here by hand): its
    // uncommitted renewal is gone with it.
    step.rollback().await.unwrap();
    let Claim::Taken { row: taken, from } = leases::claim(&pool, &model, 0, "b", LEASE, LEASE).await.unwrap() else {
        panic!("taken once the lock is gone")
    };
    assert_eq!((taken.epoch, from.as_deref()), (row.epoch + 1, Some("a")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_under_the_same_instance_name_waits_for_the_first_s_lease() {
    let pool = pool().await;
    let model = model_with(&pool, 1).await;
    assert_eq!(leases::join(&pool, &model, "x", "one", true, LEASE).await.unwrap(), Joined::Member);
    assert_eq!(leases::join(&pool, &model, "x", "one", true, LEASE).await.unwrap(), Joined::Member, "renewal");
    let Joined::NameInUse { incarnation, remaining_ms } =
        leases::join(&pool, &model, "x", "two", true, LEASE).await.unwrap()
    else {
        panic!("the name is in use")
    };
    assert_eq!(incarnation, "one");
    assert!(remaining_ms > 0 && remaining_ms <= 5000);
    sqlx::query("UPDATE parsley.members SET lease_until = now() - interval '1 second' WHERE model = $1")
        .bind(&model)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(leases::join(&pool, &model, "x", "two", true, LEASE).await.unwrap(), Joined::Member);
    let mut conn = pool.acquire().await.unwrap();
    let members = leases::members(&mut conn, &model).await.unwrap();
    assert_eq!((members.len(), members[0].live), (1, true));
    // The old incarnation's leave does not remove the new one.
    leases::leave(&pool, &model, "x", "one").await.unwrap();
    assert_eq!(leases::members(&mut conn, &model).await.unwrap().len(), 1);
    leases::leave(&pool, &model, "x", "two").await.unwrap();
    assert!(leases::members(&mut conn, &model).await.unwrap().is_empty());
}

/// How many tasks each instance holds a live lease on.
async fn split(pool: &PgPool, model: &str) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT owner, count(*) FROM parsley.tasks WHERE model = $1 AND lease_until > now() GROUP BY owner ORDER BY owner",
    )
    .bind(model)
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn wait_for_split(pool: &PgPool, model: &str, want: &[i64], what: &str) -> Duration {
    let started = Instant::now();
    loop {
        let now = split(pool, model).await;
        let mut counts: Vec<i64> = now.iter().map(|(_, n)| *n).collect();
        counts.sort_unstable();
        if counts == want {
            return started.elapsed();
        }
        assert!(started.elapsed() < TIMEOUT, "{what}: the split is {now:?}, not {want:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Three instances in one process share a 6-task model 2/2/2; one stops (handing its tasks
/// back) and the two left take them at once — without waiting for a lease to pass — and
/// every record is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_share_the_tasks_evenly_and_take_a_stopped_one_s_at_once() {
    let n = Names::new("balance");
    create_topics(&[&n.orders, &n.payments], 6).await;
    let pool = pool().await;
    let plain = producer();
    let base = n.config();
    let mut stops = Vec::new();
    let mut runs = Vec::new();
    for _ in 0..3 {
        let mut config = base.clone();
        config.projector.owner = Some(unique("inst"));
        config.projector.lease_ms = 30_000; // a lease wait would show as a timeout
        config.projector.heartbeat_ms = 200;
        let projection = Arc::new(DocumentProjection::from_model(&config.models[0]));
        let p = parsley_projector::ModelProjector::prepare(
            &config,
            &config.models[0],
            pool.clone(),
            projection,
            parsley_projector::metrics::Metrics::new(parsley_projector::metrics::METRICS),
        )
        .await
        .unwrap();
        let (stop, shutdown) = watch::channel(false);
        stops.push(stop);
        runs.push(tokio::spawn(p.run(shutdown)));
    }
    wait_for_split(&pool, &n.model, &[2, 2, 2], "three instances").await;
    for p in 0..6 {
        produce(&plain, &n.orders, p, &key_on(&format!("k{p}"), p as u32, 6), Some(br#"{"v":1}"#), None).await;
    }
    // One stops cleanly: the other two take its tasks well before its lease would pass.
    stops[0].send(true).unwrap();
    runs.remove(0).await.unwrap().unwrap();
    let moved = wait_for_split(&pool, &n.model, &[3, 3], "after one stopped").await;
    assert!(moved < Duration::from_secs(10), "{moved:?}");
    for p in 0..6 {
        produce(&plain, &n.orders, p, &key_on(&format!("k{p}"), p as u32, 6), Some(br#"{"v":2}"#), None).await;
    }
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let versions: Vec<(serde_json::Value, i64)> =
            documents_of(&pool, &n.model, (0..6).map(|p| key_on(&format!("k{p}"), p, 6)).collect()).await;
        if versions.iter().all(|(doc, _)| *doc == serde_json::json!({"v": 2})) {
            assert!(versions.iter().all(|(_, v)| *v == 2), "each record applied once: {versions:?}");
            break;
        }
        assert!(Instant::now() < deadline, "the second writes were not applied: {versions:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for s in &stops[1..] {
        s.send(true).unwrap();
    }
    for r in runs {
        r.await.unwrap().unwrap();
    }
    let mut conn = pool.acquire().await.unwrap();
    assert!(leases::members(&mut conn, &n.model).await.unwrap().is_empty(), "every instance left");
    assert!(split(&pool, &n.model).await.is_empty(), "every task handed back");
}

async fn documents_of(pool: &PgPool, model: &str, keys: Vec<String>) -> Vec<(serde_json::Value, i64)> {
    let mut out = Vec::new();
    for k in keys {
        out.push(document(pool, model, &k).await.unwrap_or((serde_json::Value::Null, 0)));
    }
    out
}

/// Instances starting together all find a task nobody has held (no row yet): exactly one
/// takes it, at epoch 1; the others see it held — none overwrites another's fresh claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_racing_for_a_task_never_held_take_it_once() {
    let pool = pool().await;
    for round in 0..5 {
        let model = model_with(&pool, 1).await;
        let claims: Vec<_> = (0..8)
            .map(|i| {
                let (pool, model) = (pool.clone(), model.clone());
                tokio::spawn(
                    async move { leases::claim(&pool, &model, 0, &format!("i{i}"), LEASE, LEASE).await.unwrap() },
                )
            })
            .collect();
        let mut taken = Vec::new();
        for c in claims {
            match c.await.unwrap() {
                Claim::Taken { row, from } => taken.push((row.epoch, row.owner, from)),
                Claim::Held { .. } => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(taken.len(), 1, "round {round}: taken by {taken:?}");
        assert_eq!((taken[0].0, &taken[0].2), (1, &None), "round {round}");
    }
}

/// Two models in each of two instances (as `parsley-projector run` runs every configured
/// model): each model's tasks split 2/2 on its own, and the metrics say what each instance
/// runs; when one instance stops, the other runs all of both models and counts the hand-back
/// as released, not taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn several_models_per_instance_are_balanced_each_on_its_own() {
    use parsley_projector::metrics::{Metric, Metrics, METRICS};
    let pool = pool().await;
    let (m1, m2) = (Names::new("multi-a"), Names::new("multi-b"));
    create_topics(&[&m1.orders, &m1.payments, &m2.orders, &m2.payments], 4).await;
    let mut base = m1.config();
    base.models.push(m2.config().models.remove(0));
    let mut instances = Vec::new();
    for _ in 0..2 {
        let mut config = base.clone();
        config.projector.owner = Some(unique("inst"));
        config.projector.lease_ms = 30_000;
        config.projector.heartbeat_ms = 200;
        let metrics = Metrics::new(METRICS);
        let (stop, shutdown) = watch::channel(false);
        let mut runs = Vec::new();
        for model in &config.models {
            let projection = Arc::new(DocumentProjection::from_model(model));
            let p = parsley_projector::ModelProjector::prepare(
                &config,
                model,
                pool.clone(),
                projection,
                Arc::clone(&metrics),
            )
            .await
            .unwrap();
            runs.push(tokio::spawn(p.run(shutdown.clone())));
        }
        instances.push((stop, runs, metrics));
    }
    wait_for_split(&pool, &m1.model, &[2, 2], "model a").await;
    wait_for_split(&pool, &m2.model, &[2, 2], "model b").await;
    // The gauges follow the heartbeat that took the tasks.
    tokio::time::sleep(Duration::from_millis(600)).await;
    for (_, _, metrics) in &instances {
        for model in [&m1.model, &m2.model] {
            assert_eq!(metrics.value(Metric::TasksOwned, &[("model", model)]), Some(2.0), "{model}");
        }
    }

    let (stop, runs, metrics) = instances.remove(0);
    let released = |m: &Metrics| m.value(Metric::TasksReleasedTotal, &[("model", &m1.model)]).unwrap_or(0.0);
    let before = released(&metrics);
    stop.send(true).unwrap();
    for r in runs {
        r.await.unwrap().unwrap();
    }
    assert_eq!(released(&metrics) - before, 2.0, "its two tasks of model a handed back at stop");
    assert_eq!(metrics.value(Metric::TasksOwned, &[("model", &m1.model)]), Some(0.0));
    wait_for_split(&pool, &m1.model, &[4], "model a, one instance left").await;
    wait_for_split(&pool, &m2.model, &[4], "model b, one instance left").await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (stop, runs, metrics) = instances.remove(0);
    assert_eq!(metrics.value(Metric::TasksOwned, &[("model", &m2.model)]), Some(4.0));
    assert_eq!(metrics.value(Metric::TakeoversTotal, &[("model", &m2.model)]), None, "a hand-back is no takeover");
    stop.send(true).unwrap();
    for r in runs {
        r.await.unwrap().unwrap();
    }
}

/// A static `tasks` list means "only these, whenever free": two instances with the same
/// list are an active and a standby; the standby takes the tasks once the active one stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_static_task_list_runs_only_those_and_two_such_instances_are_active_and_standby() {
    let n = Names::new("static");
    create_topics(&[&n.orders, &n.payments], 4).await;
    let pool = pool().await;
    let start = |owner: String| {
        let mut config = n.config();
        config.projector.owner = Some(owner);
        config.projector.lease_ms = 30_000;
        config.projector.heartbeat_ms = 200;
        config.models[0].tasks = Some(vec![1, 2]);
        let pool = pool.clone();
        async move {
            let projection = Arc::new(DocumentProjection::from_model(&config.models[0]));
            let p = parsley_projector::ModelProjector::prepare(
                &config,
                &config.models[0],
                pool,
                projection,
                parsley_projector::metrics::Metrics::new(parsley_projector::metrics::METRICS),
            )
            .await
            .unwrap();
            let (stop, shutdown) = watch::channel(false);
            (stop, tokio::spawn(p.run(shutdown)))
        }
    };
    let (a, b) = (unique("active"), unique("standby"));
    let (stop_a, run_a) = start(a.clone()).await;
    wait_for_split(&pool, &n.model, &[2], "the first instance takes its two tasks").await;
    let (stop_b, run_b) = start(b.clone()).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let owners: Vec<(i32, String)> =
        sqlx::query_as("SELECT task, owner FROM parsley.tasks WHERE model = $1 AND lease_until > now() ORDER BY task")
            .bind(&n.model)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(owners, vec![(1, a.clone()), (2, a.clone())], "only the listed tasks, and the standby waits");

    stop_a.send(true).unwrap();
    run_a.await.unwrap().unwrap();
    wait_for_split(&pool, &n.model, &[2], "the standby takes over").await;
    assert_eq!(split(&pool, &n.model).await, vec![(b, 2)]);
    stop_b.send(true).unwrap();
    run_b.await.unwrap().unwrap();
}

/// A step's lock renews the lease from the transaction's start; a step longer than the lease
/// extends it before committing, or another instance waiting on the row takes the task the
/// moment the step commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_longer_than_its_lease_keeps_the_task_only_by_extending_the_lease() {
    let pool = pool().await;
    let model = model_with(&pool, 1).await;
    let lease = Duration::from_millis(500);
    let wait = Duration::from_secs(5);
    let Claim::Taken { row, .. } = leases::claim(&pool, &model, 0, "a", lease, wait).await.unwrap() else {
        panic!("a free task is taken")
    };

    // A long step that does not extend: committed with its lease spent, and taken over.
    let mut tx = pool.begin().await.unwrap();
    assert!(leases::lock_and_renew(&mut tx, &model, 0, row.epoch, lease).await.unwrap());
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    tx.commit().await.unwrap();
    let Claim::Taken { row, from } = leases::claim(&pool, &model, 0, "b", lease, wait).await.unwrap() else {
        panic!("a lease spent inside a step is taken over once the step commits")
    };
    assert_eq!(from.as_deref(), Some("a"));

    // The same step extending its lease before it commits keeps the task, even against a
    // claim that was already waiting on the row.
    let mut tx = pool.begin().await.unwrap();
    assert!(leases::lock_and_renew(&mut tx, &model, 0, row.epoch, lease).await.unwrap());
    let claimer = {
        let (pool, model) = (pool.clone(), model.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            leases::claim(&pool, &model, 0, "c", lease, wait).await.unwrap()
        })
    };
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    assert!(leases::extend(&mut tx, &model, 0, row.epoch, lease).await.unwrap());
    tx.commit().await.unwrap();
    assert_eq!(claimer.await.unwrap(), Claim::Held { owner: "b".into() });
    assert_eq!(leases::claim(&pool, &model, 0, "c", lease, wait).await.unwrap(), Claim::Held { owner: "b".into() });
    // Another epoch's extension changes nothing.
    let mut conn = pool.acquire().await.unwrap();
    assert!(!leases::extend(&mut conn, &model, 0, row.epoch - 1, lease).await.unwrap());
}
