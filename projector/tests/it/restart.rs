//! Restart with records held: after a graceful stop, after a crash inside a step (the step
//! future dropped and the connections closed before the commit), and after `kill -9` of the
//! binary under load. Nothing is lost, nothing is delivered twice.

use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parsley_testkit::Spawned;
use rdkafka::producer::Producer as _;
use serde_json::json;
use sqlx::Row as _;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_records_survive_a_graceful_restart_and_deliver_once() {
    let n = Names::new("restart");
    let pool = pool().await;
    let (txp, order_at, pay_at) = held_payment(&n).await;
    let config = n.config();

    let mut first = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut first, "the payment to be held", || async {
        report(&pool, &n.model).await.task(0).unwrap().held_total == 1
    })
    .await;
    drop(first);

    let mut second = start(&config, &pool, Recording::new(&config)).await;
    assert_eq!(second.tasks()[0].engine().held_count(), 1, "restored from the database");
    drive(&mut second, 2).await;
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().held_total, 1, "still held after restart");
    assert_eq!(document(&pool, &n.model, "o1").await, None);

    txp.commit_transaction(TIMEOUT).unwrap();
    drive_until(&mut second, "both records to apply", || async {
        report(&pool, &n.model).await.task(0).unwrap().held_total == 0
    })
    .await;
    drive(&mut second, 2).await;
    assert_eq!(
        applied(&pool, &n.model).await,
        vec![(n.orders.clone(), 0, order_at), (n.payments.clone(), 0, pay_at)],
        "each delivered exactly once, in causal order"
    );
    assert_eq!(document(&pool, &n.model, "o1").await, Some((json!({"status": "placed", "paid": true}), 2)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_inside_a_step_loses_nothing_and_repeats_nothing() {
    let n = Names::new("crash");
    let (txp, order_at, pay_at) = held_payment(&n).await;
    let config = n.config();

    // The first instance has its own pool: closing it is the crash of its process.
    let crashing_pool = pool().await;
    let projection = Recording::new(&config);
    let mut first = start(&config, &crashing_pool, projection.clone()).await;
    drive_until(&mut first, "the payment to be held", || async {
        report(&crashing_pool, &n.model).await.task(0).unwrap().held_total == 1
    })
    .await;

    txp.commit_transaction(TIMEOUT).unwrap();
    projection.hang.store(true, Ordering::SeqCst);
    // Step until one hangs after the projection wrote both deliveries, before the commit.
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let stepped = tokio::time::timeout(Duration::from_secs(2), first.run_once()).await;
        if stepped.is_err() {
            break; // the step future is dropped here, mid-transaction
        }
        assert!(Instant::now() < deadline, "no step ever reached the projection");
    }
    drop(first);
    crashing_pool.close().await;

    let pool = pool().await;
    let r = report(&pool, &n.model).await;
    assert_eq!(r.task(0).unwrap().held_total, 1, "the uncommitted step released nothing");
    assert_eq!(document(&pool, &n.model, "o1").await, None);
    assert!(applied(&pool, &n.model).await.is_empty(), "nothing of the crashed step was committed");

    let mut second = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut second, "both records to apply after the crash", || async {
        document(&pool, &n.model, "o1").await.is_some_and(|(d, _)| d.get("paid").is_some())
    })
    .await;
    drive(&mut second, 2).await;
    assert_eq!(applied(&pool, &n.model).await, vec![(n.orders.clone(), 0, order_at), (n.payments.clone(), 0, pay_at)]);
    assert_eq!(document(&pool, &n.model, "o1").await, Some((json!({"status": "placed", "paid": true}), 2)));
}

/// `parsley-projector run --config <path>` on the services, or on `database` and `kafka`.
struct Binary;

impl Binary {
    fn spawn(config_path: &std::path::Path) -> Spawned {
        Binary::spawn_with(config_path, &database_url(), &bootstrap(), Stdio::inherit())
    }

    fn spawn_with(config_path: &std::path::Path, database: &str, kafka: &str, stderr: Stdio) -> Spawned {
        let child = Command::new(env!("CARGO_BIN_EXE_parsley-projector"))
            .args(["run", "--config"])
            .arg(config_path)
            .env("PARSLEY_DATABASE_URL", database)
            .env("PARSLEY_KAFKA_BOOTSTRAP", kafka)
            .env("PARSLEY_METRICS_ADDRESS", "")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawning parsley-projector");
        Spawned::new("the projector", child)
    }
}

async fn documents_with(pool: &sqlx::PgPool, model: &str, field: &str) -> i64 {
    sqlx::query("SELECT count(*) FROM projection.documents WHERE model = $1 AND doc ? $2")
        .bind(model)
        .bind(field)
        .fetch_one(pool)
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_binary_under_load_loses_and_repeats_nothing() {
    const RECORDS: usize = 400;
    let n = Names::new("kill9");
    create_topics(&[&n.orders, &n.payments], 2).await;
    let orders_id = topic_id(&n.orders).await;
    let pool = pool().await;
    let dir = parsley_testkit::ScratchDir::new("projector-config");
    let path = dir.join("parsley.toml");
    std::fs::write(
        &path,
        format!(
            "[[models]]\nname = \"{}\"\nmax_step_records = 10\nmax_step_ms = 20\ntopics = [\n  {{ name = \"{}\", apply = \"replace\" }},\n  {{ name = \"{}\", apply = \"merge\" }},\n]\n",
            n.model, n.orders, n.payments
        ),
    )
    .unwrap();

    // The backlog is written before the binary starts, so the binary cannot keep pace with the
    // writes and finish before the kill.
    let plain = producer();
    let mut expected = Vec::new();
    for i in 0..RECORDS {
        let key = format!("k{i}");
        let partition = parsley::murmur2::partition_for_key(key.as_bytes(), 2) as i32;
        let order_at =
            produce(&plain, &n.orders, partition, &key, Some(format!("{{\"n\":{i}}}").as_bytes()), None).await;
        let cause = causes(&[(orders_id, partition as u32, order_at)]);
        produce(&plain, &n.payments, partition, &key, Some(br#"{"paid":true}"#), Some(&cause)).await;
        expected.push(key);
    }
    let binary = Binary::spawn(&path);
    // Kill it while it is working through the backlog.
    let deadline = Instant::now() + TIMEOUT;
    while documents_with(&pool, &n.model, "n").await < (RECORDS / 10) as i64 {
        assert!(Instant::now() < deadline, "the binary made no progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    binary.kill_9();
    let at_kill = documents_with(&pool, &n.model, "paid").await;

    let binary = Binary::spawn(&path);
    // Up (its membership registered, so its shutdown handling too) before it may be stopped.
    let pid = binary.child.id();
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let joined: i64 =
            sqlx::query_scalar("SELECT count(*) FROM parsley.members WHERE model = $1 AND instance LIKE $2")
                .bind(&n.model)
                .bind(format!("%-{pid}"))
                .fetch_one(&pool)
                .await
                .unwrap();
        if joined > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the restarted binary did not join the model");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = Instant::now() + TIMEOUT * 2;
    while documents_with(&pool, &n.model, "paid").await < RECORDS as i64 {
        assert!(Instant::now() < deadline, "the restarted binary did not finish the backlog");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    binary.terminate();
    assert!(at_kill < RECORDS as i64, "the kill landed after all the work ({at_kill} done): not a crash under load");

    let rows = sqlx::query("SELECT key, doc, version FROM projection.documents WHERE model = $1 ORDER BY key")
        .bind(&n.model)
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(rows.len(), RECORDS);
    for row in rows {
        let key: String = row.get(0);
        let doc: serde_json::Value = row.get(1);
        let version: i64 = row.get(2);
        let i: usize = key[1..].parse().unwrap();
        assert_eq!(doc, json!({"n": i, "paid": true}), "{key}");
        assert_eq!(version, 2, "{key}: each record applied exactly once");
    }
    let r = report(&pool, &n.model).await;
    assert!(r.tasks.iter().all(|t| t.held_total == 0 && t.epoch == 2), "{r:?}");
}

/// With Postgres or Kafka unreachable the binary neither exits nor stays silent: it keeps
/// retrying with backoff and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_services_are_retried_and_reported() {
    let n = Names::new("unreachable");
    let dir = parsley_testkit::ScratchDir::new("projector-config");
    let path = dir.join("parsley.toml");
    std::fs::write(
        &path,
        format!(
            "[kafka]\nrequest_timeout_ms = 500\n[database]\nacquire_timeout_ms = 500\n[[models]]\nname = \"{}\"\ntopics = [{{ name = \"{}\" }}]\n",
            n.model, n.orders
        ),
    )
    .unwrap();
    let cases = [
        ("postgres://parsley:secret-password@127.0.0.1:1/parsley".to_string(), bootstrap(), "Postgres unavailable"),
        (database_url(), "127.0.0.1:1".to_string(), "could not start the model; retrying"),
    ];
    for (database, kafka, expected) in cases {
        let mut binary = Binary::spawn_with(&path, &database, &kafka, Stdio::piped());
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(binary.child.try_wait().unwrap().is_none(), "the projector exited instead of retrying ({expected})");
        binary.child.kill().unwrap();
        let output =
            std::mem::replace(&mut binary.child, Command::new("true").spawn().unwrap()).wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.matches(expected).count() >= 2, "expected repeated {expected:?} in:\n{stderr}");
        assert!(!stderr.contains("secret-password"), "the database password leaked into the logs:\n{stderr}");
    }
}

/// A step takes records up to `max_step_bytes` of keys, values and headers (and at least
/// one record, however large), and up to `max_step_records`, whichever binds first; every
/// record is applied once, in order, across the steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_stops_at_its_byte_bound_and_takes_at_least_one_record() {
    let n = Names::new("stepbytes");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let p = producer();
    // Ten records of 1 000-byte values, then one of 5 000 bytes, then ten more.
    let value = |i: usize, len: usize| format!(r#"{{"i":{i},"pad":"{}"}}"#, "x".repeat(len - 19)).into_bytes();
    for i in 0..21 {
        let len = if i == 10 { 5_000 } else { 1_000 };
        produce(&p, &n.orders, 0, &format!("k{i:02}"), Some(&value(i, len)), None).await;
    }
    let mut config = n.config();
    config.models[0].max_step_bytes = 3_000;
    config.models[0].max_step_records = 100;
    config.models[0].max_step_ms = 2_000;
    let mut projector = start(&config, &pool, Recording::new(&config)).await;

    let mut fed_per_step = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while fed_per_step.iter().sum::<usize>() < 21 && Instant::now() < deadline {
        for outcome in projector.run_once().await {
            if let parsley_projector::StepOutcome::Committed { fed, .. } = outcome {
                if fed > 0 {
                    fed_per_step.push(fed);
                }
            }
        }
    }
    assert_eq!(fed_per_step.iter().sum::<usize>(), 21, "every record fed once: {fed_per_step:?}");
    // 1 000-byte records (plus a 3-byte key): the third one reaches 3 000 bytes.
    assert!(fed_per_step.iter().all(|f| *f <= 3), "no step above the byte bound: {fed_per_step:?}");
    assert!(fed_per_step.len() >= 7, "the bound split the records into steps: {fed_per_step:?}");
    let applied: Vec<i64> = applied(&pool, &n.model).await.iter().map(|a| a.2).collect();
    assert_eq!(applied, (0..21).collect::<Vec<i64>>(), "applied once each, in order");
    assert_eq!(document(&pool, &n.model, "k10").await.unwrap().0["i"], 10, "the record over the bound is applied");
}

/// While a step commits, the task reads ahead, and the next step takes those records
/// first. Kafka transactions put a commit marker after every three records, so the
/// consumer's position passes positions no record holds. Every record is applied once and
/// in order (a record read ahead and then lost, or taken for a replay, would be missing),
/// and the recorded position passes the last marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_read_ahead_during_a_commit_are_fed_by_the_next_steps_across_markers() {
    let n = Names::new("readahead");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let txp = transactional_producer();
    let mut last = 0;
    for t in 0..10 {
        txp.begin_transaction().unwrap();
        for i in 0..3 {
            let k = t * 3 + i;
            last = produce(&txp, &n.orders, 0, &format!("k{k:02}"), Some(format!(r#"{{"i":{k}}}"#).as_bytes()), None)
                .await;
        }
        txp.commit_transaction(TIMEOUT).unwrap();
    }
    // Two records a step: a step's commit always leaves records to read ahead.
    let mut config = n.config();
    config.models[0].max_step_records = 2;
    config.models[0].max_step_ms = 2_000;
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    let (orders, model) = (n.orders.clone(), n.model.clone());
    drive_until(&mut projector, "every record applied", || {
        let (pool, model) = (pool.clone(), model.clone());
        async move { applied(&pool, &model).await.len() >= 30 }
    })
    .await;
    drive(&mut projector, 5).await;
    let applied: Vec<i64> = applied(&pool, &model).await.iter().map(|a| a.2).collect();
    let positions: Vec<i64> = (0..10).flat_map(|t| (0..3).map(move |i| t * 4 + i)).collect();
    assert_eq!(applied, positions, "every record applied once, in order, none taken for a replay");
    let task = report(&pool, &model).await.task(0).unwrap().clone();
    assert_eq!((task.status, task.refusal), (parsley_store::ordering::TaskStatus::Running, None));
    // The last marker sits one past the last record: the position passed it.
    let fed_up_to = {
        let r = report(&pool, &model).await;
        let t = r.task(0).unwrap().clone();
        t.channels.iter().find(|c| r.describe(&c.channel) == format!("{orders}/0")).and_then(|c| c.fed_up_to)
    };
    assert_eq!(fed_up_to, Some(last + 1), "read up to the last commit marker");
}
