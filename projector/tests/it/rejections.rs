//! Records the projection rejects for good, through the real broker and database: a value
//! that is not JSON, NUL characters, a key too long for the index, data a custom
//! projection's table refuses — each refused `PROJECTION_REJECTED` at its record, naming
//! it, again after a restart — while a transient database failure stays `failing` and
//! recovers. The ways past a rejected record: `parsley-projector skip` (a running projector
//! goes on without a restart, and what waited on the record is delivered) and the
//! dead-letter policy. A keyed record on the wrong partition is refused `KEY_PARTITION_MISMATCH`
//! by the same path.

use std::process::{Command, Output};
use std::sync::Arc;

use parsley::refusal::{Refusal, RefusalReason};
use parsley::CausalPast;
use parsley_projector::metrics::{Metric, Metrics, METRICS};
use parsley_projector::projection::{Delivered, Projection, ProjectionError, StepContext};
use parsley_projector::record::decode_headers;
use parsley_projector::skip::{skip, SkipError, SkipRequest};
use parsley_settings::config::{Config, OnRejected};
use parsley_store::ordering::{RecordFound, TaskStatus};
use parsley_store::status::render;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use sqlx::{PgConnection, PgPool, Row as _};

use crate::support::*;

async fn refused(pool: &PgPool, model: &str) -> Option<Refusal> {
    let r = report(pool, model).await;
    let t = r.task(0)?;
    (t.status == TaskStatus::Refused).then(|| t.refusal.clone().expect("a refused task records its reason"))
}

/// Steps until task 0 is refused; returns the refusal.
async fn drive_until_refused<P: Projection>(
    projector: &mut parsley_projector::ModelProjector<P>,
    pool: &PgPool,
    model: &str,
) -> Refusal {
    drive_until(projector, "the task to refuse", || async { refused(pool, model).await.is_some() }).await;
    refused(pool, model).await.unwrap()
}

fn skip_request(n: &Names, position: i64, reason: &str) -> SkipRequest {
    SkipRequest {
        model: n.model.clone(),
        topic: n.orders.clone(),
        partition: 0,
        position,
        reason: reason.to_string(),
        by: "it-test".to_string(),
    }
}

fn assert_rejected_at(refusal: &Refusal, position: i64, diagnosis_has: &[&str]) {
    assert_eq!(refusal.reason, RefusalReason::ProjectionRejected, "{refusal}");
    assert_eq!(refusal.position, Some(position), "{refusal}");
    for part in diagnosis_has {
        assert!(refusal.diagnosis.contains(part), "{part:?} missing from: {}", refusal.diagnosis);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_that_is_not_json_is_refused_at_its_record_and_the_refusal_recurs() {
    let n = Names::new("notjson");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let p = producer();
    produce(&p, &n.orders, 0, "o1", Some(br#"{"ok":1}"#), None).await;
    let bad_at = produce(&p, &n.orders, 0, "o2", Some(b"secret, not json"), None).await;
    produce(&p, &n.orders, 0, "o3", Some(br#"{"ok":3}"#), None).await;

    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    let refusal = drive_until_refused(&mut projector, &pool, &n.model).await;
    let coordinate = format!("{}/0@{bad_at}", n.orders);
    assert_rejected_at(&refusal, bad_at, &[&coordinate, "not JSON"]);
    assert!(!refusal.diagnosis.contains("secret"), "the payload must not appear: {}", refusal.diagnosis);
    let r = report(&pool, &n.model).await;
    assert_eq!(r.describe(&refusal.channel.unwrap()), format!("{}/0", n.orders));
    let text = render(&r);
    assert!(text.contains(&format!("REFUSED PROJECTION_REJECTED at {coordinate}")), "{text}");
    assert!(document(&pool, &n.model, "o1").await.is_some(), "the record before the rejected one commits");
    assert_eq!(document(&pool, &n.model, "o3").await, None, "nothing after it on the channel");
    let t = r.task(0).unwrap();
    let orders = t.channels.iter().find(|c| r.describe(&c.channel) == format!("{}/0", n.orders)).unwrap();
    assert_eq!(orders.fed_up_to, Some(bad_at - 1), "the rejected record is not marked delivered");
    drop(projector);

    // A restart derives the same refusal from the same record.
    let mut again = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut again, "the refusal to recur", || async {
        let r = report(&pool, &n.model).await;
        let t = r.task(0).unwrap();
        t.epoch == 2 && t.status == TaskStatus::Refused
    })
    .await;
    assert_eq!(refused(&pool, &n.model).await.unwrap(), refusal);
    drive(&mut again, 2).await;
    assert_eq!(document(&pool, &n.model, "o3").await, None);
    assert_eq!(applied(&pool, &n.model).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_characters_are_refused_and_skip_moves_past_each_record() {
    let n = Names::new("nul");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let p = producer();
    produce(&p, &n.orders, 0, "k1", Some(br#"{"ok":1}"#), None).await;
    let nul_key_at = produce(&p, &n.orders, 0, "a\0b", Some(br#"{"ok":2}"#), None).await;
    let nul_value_at = produce(&p, &n.orders, 0, "k3", Some(br#"{"x":"a\u0000b"}"#), None).await;
    produce(&p, &n.orders, 0, "k4", Some(br#"{"ok":4}"#), None).await;

    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    let refusal = drive_until_refused(&mut projector, &pool, &n.model).await;
    assert_rejected_at(&refusal, nul_key_at, &["NUL character", &format!("{}/0@{nul_key_at}", n.orders)]);

    // Skip is refused, with a named error and nothing written, anywhere but there.
    let elsewhere = skip(&config.kafka, &pool, &skip_request(&n, nul_value_at, "wrong record")).await;
    assert!(matches!(elsewhere, Err(SkipError::NotRefusedAtRecord { .. })), "{elsewhere:?}");
    let no_reason = skip(&config.kafka, &pool, &skip_request(&n, nul_key_at, " ")).await;
    assert!(matches!(no_reason, Err(SkipError::NoReason)), "{no_reason:?}");

    let done = skip(&config.kafka, &pool, &skip_request(&n, nul_key_at, "a NUL in the key")).await.unwrap();
    assert_eq!(
        done.found,
        RecordFound::Read { key: Some(b"a\0b".to_vec()), causes_headers: vec![] },
        "the record's key is recorded as read"
    );
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().status, TaskStatus::Running);
    let again = skip(&config.kafka, &pool, &skip_request(&n, nul_key_at, "twice")).await;
    assert!(matches!(again, Err(SkipError::NotRefusedAtRecord { .. })), "{again:?}");
    drop(projector);

    // The next start feeds the skipped record without effect and stops at the next one.
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    let refusal = drive_until_refused(&mut projector, &pool, &n.model).await;
    assert_rejected_at(&refusal, nul_value_at, &["\\u0000", &format!("{}/0@{nul_value_at}", n.orders)]);
    let r = report(&pool, &n.model).await;
    let t = r.task(0).unwrap();
    let orders = t.channels.iter().find(|c| r.describe(&c.channel) == format!("{}/0", n.orders)).unwrap();
    assert_eq!(orders.fed_up_to, Some(nul_value_at - 1), "the skipped record counts as delivered");
    assert_eq!(t.skips.len(), 1);
    let text = render(&r);
    assert!(text.contains(&format!("skipped {}/0@{nul_key_at} by \"it-test\"", n.orders)), "{text}");
    assert!(text.contains("cleared PROJECTION_REJECTED"), "{text}");

    skip(&config.kafka, &pool, &skip_request(&n, nul_value_at, "a NUL in the value")).await.unwrap();
    drop(projector);
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "the record after both to apply", || async {
        document(&pool, &n.model, "k4").await.is_some()
    })
    .await;
    let positions: Vec<i64> = applied(&pool, &n.model).await.into_iter().map(|(_, _, p)| p).collect();
    assert_eq!(positions, vec![0, nul_value_at + 1], "the skipped records never reach the projection");
    assert_eq!(document(&pool, &n.model, "k3").await, None);
    assert_eq!(refused(&pool, &n.model).await, None);
}

/// A hex string of `len` characters from a fixed xorshift sequence: incompressible enough
/// that Postgres cannot squeeze it under the btree row limit.
fn hex_key(len: usize) -> String {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from_digit((x % 16) as u32, 16).unwrap()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_too_long_for_the_index_is_refused_from_the_database_error() {
    let n = Names::new("longkey");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let p = producer();
    produce(&p, &n.orders, 0, "k1", Some(br#"{"ok":1}"#), None).await;
    let key = hex_key(16_000);
    let long_at = produce(&p, &n.orders, 0, &key, Some(br#"{"ok":2}"#), None).await;
    produce(&p, &n.orders, 0, "k3", Some(br#"{"ok":3}"#), None).await;

    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    let refusal = drive_until_refused(&mut projector, &pool, &n.model).await;
    // The batch could not say which record failed; the careful retry, one record at a
    // time, names it.
    assert_rejected_at(&refusal, long_at, &[&format!("{}/0@{long_at}", n.orders), "SQLSTATE 54000", "index row"]);
    assert!(!refusal.diagnosis.contains(&key[..32]), "the key must not appear: {}", refusal.diagnosis);
    assert!(document(&pool, &n.model, "k1").await.is_some());
    assert_eq!(document(&pool, &n.model, "k3").await, None);
}

/// A custom projection writing each record's value, as an integer, into a table with a
/// constraint: the `?` on its statements classifies the database's errors.
struct Numbers;

impl Projection for Numbers {
    async fn apply(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        record: &Delivered<'_>,
    ) -> Result<(), ProjectionError> {
        let value = String::from_utf8_lossy(record.value.unwrap_or_default()).into_owned();
        sqlx::query("INSERT INTO public.test_numbers (model, position, n) VALUES ($1, $2, $3::text::int)")
            .bind(step.model)
            .bind(record.position)
            .bind(value)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

async fn numbers(pool: &PgPool, model: &str) -> Vec<i32> {
    sqlx::query_scalar("SELECT n FROM public.test_numbers WHERE model = $1 ORDER BY position")
        .bind(model)
        .fetch_all(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_projection_s_constraint_and_data_errors_are_rejections() {
    let n = Names::new("numbers");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(4243)").execute(&mut *tx).await.unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS public.test_numbers (
           model text NOT NULL, position bigint NOT NULL, n int NOT NULL CHECK (n > 0), PRIMARY KEY (model, position))",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let p = producer();
    produce(&p, &n.orders, 0, "a", Some(b"7"), None).await;
    let negative_at = produce(&p, &n.orders, 0, "b", Some(b"-5"), None).await;
    let word_at = produce(&p, &n.orders, 0, "c", Some(b"secret"), None).await;
    produce(&p, &n.orders, 0, "d", Some(b"9"), None).await;

    let config = n.config();
    let mut projector = start(&config, &pool, Arc::new(Numbers)).await;
    let refusal = drive_until_refused(&mut projector, &pool, &n.model).await;
    assert_rejected_at(&refusal, negative_at, &["SQLSTATE 23514", "check constraint"]);
    assert_eq!(numbers(&pool, &n.model).await, vec![7]);

    skip(&config.kafka, &pool, &skip_request(&n, negative_at, "negative")).await.unwrap();
    drop(projector);
    let mut projector = start(&config, &pool, Arc::new(Numbers)).await;
    let refusal = drive_until_refused(&mut projector, &pool, &n.model).await;
    assert_rejected_at(&refusal, word_at, &["SQLSTATE 22P02", "(value withheld)"]);
    assert!(!refusal.diagnosis.contains("secret"), "the value must not appear: {}", refusal.diagnosis);
}

/// The document projection with a short `lock_timeout` in its step, so that a row held
/// by another transaction fails the step (SQLSTATE 55P03, transient) instead of waiting.
struct Impatient(Arc<Recording>);

impl Projection for Impatient {
    async fn apply(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        record: &Delivered<'_>,
    ) -> Result<(), ProjectionError> {
        self.apply_batch(conn, step, std::slice::from_ref(record)).await
    }

    async fn apply_batch(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        records: &[Delivered<'_>],
    ) -> Result<(), ProjectionError> {
        sqlx::query("SET LOCAL lock_timeout = '100ms'").execute(&mut *conn).await?;
        self.0.apply_batch(conn, step, records).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_database_failure_stays_failing_and_recovers() {
    let n = Names::new("locked");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let p = producer();
    produce(&p, &n.orders, 0, "o1", Some(br#"{"v":1}"#), None).await;
    let config = n.config();
    let projection = Arc::new(Impatient(Recording::new(&config)));
    let mut projector = start(&config, &pool, Arc::clone(&projection)).await;
    drive_until(&mut projector, "the first version", || async { document(&pool, &n.model, "o1").await.is_some() })
        .await;

    // Another transaction holds the document's row.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM projection.documents WHERE model = $1 AND key = 'o1' FOR UPDATE")
        .bind(&n.model)
        .execute(&mut *holder)
        .await
        .unwrap();
    produce(&p, &n.orders, 0, "o1", Some(br#"{"v":2}"#), None).await;
    drive_until(&mut projector, "the task to fail repeatedly", || async {
        let r = report(&pool, &n.model).await;
        let t = r.task(0).unwrap();
        t.status == TaskStatus::Failing && t.failures >= 3
    })
    .await;
    let r = report(&pool, &n.model).await;
    let t = r.task(0).unwrap();
    let error = t.last_error.clone().unwrap();
    assert!(error.contains("lock timeout"), "{error}");
    assert!(t.refusal.is_none(), "a transient failure is not a rejection");
    assert!(render(&r).contains("FAILING"));
    assert_eq!(document(&pool, &n.model, "o1").await.unwrap().1, 1);

    holder.rollback().await.unwrap();
    drive_until(&mut projector, "the step to go through", || async {
        document(&pool, &n.model, "o1").await.is_some_and(|(_, version)| version == 2)
    })
    .await;
    drive_until(&mut projector, "the task to run again", || async {
        report(&pool, &n.model).await.task(0).unwrap().status == TaskStatus::Running
    })
    .await;
}

/// Writes a configuration file for the binary: the test services and nothing else (the
/// folder holding it goes when the returned value drops).
fn config_file() -> (parsley_testkit::ScratchDir, std::path::PathBuf) {
    let dir = parsley_testkit::ScratchDir::new("projector-config");
    let path = dir.join("parsley.toml");
    std::fs::write(&path, format!("[kafka]\nbootstrap = \"{}\"\n", bootstrap())).unwrap();
    (dir, path)
}

/// Runs `parsley-projector skip` with `args` (after `--config PATH`).
async fn skip_command(path: &std::path::Path, args: Vec<String>) -> Output {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_parsley-projector"))
            .arg("skip")
            .arg("--config")
            .arg(&path)
            .args(&args)
            .env("PARSLEY_DATABASE_URL", database_url())
            .env("PARSLEY_KAFKA_BOOTSTRAP", bootstrap())
            .env("RUST_LOG", "warn")
            .output()
            .expect("running parsley-projector skip")
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_by_the_command_line_lets_a_running_projector_go_on_without_a_restart() {
    let n = Names::new("skipcli");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let orders_id = topic_id(&n.orders).await;
    let pool = pool().await;
    let p = producer();
    produce(&p, &n.orders, 0, "o1", Some(br#"{"ok":1}"#), None).await;
    let bad_at = produce(&p, &n.orders, 0, "o2", Some(b"not json"), None).await;
    // Waits for the poison record: delivered once the poison is skipped.
    let waiting = causes(&[(orders_id, 0, bad_at)]);
    produce(&p, &n.payments, 0, "pay", Some(br#"{"paid":true}"#), Some(&waiting)).await;
    produce(&p, &n.orders, 0, "o3", Some(br#"{"ok":3}"#), None).await;

    let mut config: Config = n.config();
    config.projector.refused_recheck_ms = 200;
    let metrics = Metrics::new(METRICS);
    let projector = start_with_metrics(&config, &pool, Recording::new(&config), Arc::clone(&metrics)).await;
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(projector.run(shutdown));
    wait_for("the task to refuse", || async { refused(&pool, &n.model).await.is_some() }).await;
    let refusal = refused(&pool, &n.model).await.unwrap();
    assert_rejected_at(&refusal, bad_at, &["not JSON"]);
    assert_eq!(document(&pool, &n.model, "pay").await, None, "the payment waits for the rejected order");

    let (_dir, path) = config_file();
    let args = |position: i64| -> Vec<String> {
        [
            "--model",
            &n.model,
            "--topic",
            &n.orders,
            "--partition",
            "0",
            "--position",
            &position.to_string(),
            "--reason",
            "poison order",
            "--by",
            "operator-7",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let wrong = skip_command(&path, args(bad_at + 1)).await;
    assert!(!wrong.status.success());
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert!(stderr.contains("is not refused at"), "{stderr}");

    let done = skip_command(&path, args(bad_at)).await;
    let stdout = String::from_utf8_lossy(&done.stdout);
    assert!(done.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&done.stderr));
    assert!(stdout.contains(&format!("skipped {}/0@{bad_at}", n.orders)), "{stdout}");

    // The running projector picks the skip up by itself: what came after the skipped
    // record, and what waited on it, is delivered.
    wait_for("the records after the skipped one", || async {
        document(&pool, &n.model, "o3").await.is_some() && document(&pool, &n.model, "pay").await.is_some()
    })
    .await;
    assert_eq!(document(&pool, &n.model, "o2").await, None, "the skipped record has no effect");
    let projected: Vec<(String, i64)> = applied(&pool, &n.model).await.into_iter().map(|(t, _, p)| (t, p)).collect();
    assert!(!projected.contains(&(n.orders.clone(), bad_at)), "{projected:?}");

    let row = sqlx::query(
        "SELECT skipped_by, reason, record_found, record_key, refusal_reason FROM parsley.skips WHERE model = $1",
    )
    .bind(&n.model)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(row.get::<String, _>(0), "operator-7");
    assert_eq!(row.get::<String, _>(1), "poison order");
    assert_eq!(row.get::<String, _>(2), "read");
    assert_eq!(row.get::<Option<Vec<u8>>, _>(3), Some(b"o2".to_vec()));
    assert_eq!(row.get::<Option<String>, _>(4).as_deref(), Some("PROJECTION_REJECTED"));
    let r = report(&pool, &n.model).await;
    assert_eq!(r.task(0).unwrap().status, TaskStatus::Running);
    let text = render(&r);
    assert!(text.contains(&format!("skipped {}/0@{bad_at} by \"operator-7\"", n.orders)), "{text}");
    let clock = sqlx::query_scalar::<_, i64>(
        "SELECT position FROM parsley.clock WHERE model = $1 AND topic_id = $2 AND partition = 0",
    )
    .bind(&n.model)
    .bind(uuid::Uuid::from_bytes(*orders_id.as_bytes()))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(clock > bad_at, "the skipped position is in the delivered past (clock {clock})");
    let labels = [("model", n.model.as_str()), ("task", "0")];
    assert_eq!(metrics.value(Metric::SkipsTotal, &labels), Some(1.0));

    stop.send(true).unwrap();
    running.await.unwrap().unwrap();
}

/// Polls `done` until it holds or the timeout passes (for a projector running by itself).
async fn wait_for<F, Fut>(what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + TIMEOUT;
    while !done().await {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_policy_stores_the_rejected_record_and_goes_on() {
    let n = Names::new("deadletter");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let orders_id = topic_id(&n.orders).await;
    let pool = pool().await;
    let p = producer();
    produce(&p, &n.orders, 0, "o1", Some(br#"{"ok":1}"#), None).await;
    let record = FutureRecord::<str, [u8]>::to(&n.orders)
        .partition(0)
        .key("o2")
        .payload(b"not json")
        .headers(OwnedHeaders::new().insert(Header { key: "trace", value: Some("t-1") }));
    let bad_at = p.send(record, TIMEOUT).await.map_err(|(e, _)| e).unwrap().offset;
    let waiting = causes(&[(orders_id, 0, bad_at)]);
    produce(&p, &n.payments, 0, "pay", Some(br#"{"paid":true}"#), Some(&waiting)).await;
    produce(&p, &n.orders, 0, "o3", Some(br#"{"ok":3}"#), None).await;

    let mut config = n.config();
    config.models[0].on_rejected = OnRejected::DeadLetter;
    let metrics = Metrics::new(METRICS);
    let mut projector = start_with_metrics(&config, &pool, Recording::new(&config), Arc::clone(&metrics)).await;
    drive_until(&mut projector, "the records after the rejected one", || async {
        document(&pool, &n.model, "o3").await.is_some() && document(&pool, &n.model, "pay").await.is_some()
    })
    .await;
    assert_eq!(refused(&pool, &n.model).await, None);
    assert_eq!(document(&pool, &n.model, "o2").await, None);

    let rows = sqlx::query(
        "SELECT position, record_key, record_value, headers, causes, reason FROM parsley.dead_letters WHERE model = $1",
    )
    .bind(&n.model)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_eq!(row.get::<i64, _>(0), bad_at);
    assert_eq!(row.get::<Option<Vec<u8>>, _>(1), Some(b"o2".to_vec()));
    assert_eq!(row.get::<Option<Vec<u8>>, _>(2), Some(b"not json".to_vec()));
    assert_eq!(decode_headers(&row.get::<Vec<u8>, _>(3)).unwrap(), vec![(b"trace".to_vec(), Some(b"t-1".to_vec()))]);
    assert_eq!(row.get::<Vec<u8>, _>(4), CausalPast::new().encode());
    let reason: String = row.get(5);
    assert!(reason.contains(&format!("{}/0@{bad_at}", n.orders)) && reason.contains("not JSON"), "{reason}");
    let labels = [("model", n.model.as_str()), ("task", "0")];
    assert_eq!(metrics.value(Metric::DeadLettersTotal, &labels), Some(1.0));
    let text = render(&report(&pool, &n.model).await);
    assert!(text.contains("dead letters: 1") && text.contains(&format!("{}/0@{bad_at}", n.orders)), "{text}");
    drop(projector);

    // Delivered without effect means delivered: a restart neither retries nor repeats it.
    let mut again = start(&config, &pool, Recording::new(&config)).await;
    drive(&mut again, 3).await;
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM parsley.dead_letters WHERE model = $1")
        .bind(&n.model)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1);
    assert_eq!(applied(&pool, &n.model).await.len(), 3, "o1, o3 and the payment, once each");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_clears_an_undecodable_record_and_a_rejected_record_that_was_held() {
    let n = Names::new("skipheld");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let orders_id = topic_id(&n.orders).await;
    let pool = pool().await;
    let p = producer();
    produce(&p, &n.orders, 0, "o1", Some(br#"{"ok":1}"#), None).await;
    let undecodable_at = produce(&p, &n.orders, 0, "o2", Some(br#"{"ok":2}"#), Some(&[0x02, 0x00])).await;

    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    let refusal = drive_until_refused(&mut projector, &pool, &n.model).await;
    assert_eq!((refusal.reason, refusal.position), (RefusalReason::UndecodableMetadata, Some(undecodable_at)));
    let done = skip(&config.kafka, &pool, &skip_request(&n, undecodable_at, "damaged header")).await.unwrap();
    assert_eq!(
        done.found,
        RecordFound::Read { key: Some(b"o2".to_vec()), causes_headers: vec![Some(vec![0x02, 0x00])] },
        "the damaged header is recorded as read"
    );
    drop(projector);

    // The skipped record counts as delivered: a payment naming a later order is held.
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    let o3_at = undecodable_at + 1;
    let waiting = causes(&[(orders_id, 0, o3_at)]);
    let pay_at = produce(&p, &n.payments, 0, "pay", Some(b"not json"), Some(&waiting)).await;
    produce(&p, &n.payments, 0, "pay2", Some(br#"{"paid":2}"#), None).await;
    drive_until(&mut projector, "both payments held", || async {
        report(&pool, &n.model).await.task(0).unwrap().held_total == 2
    })
    .await;
    assert_eq!(refused(&pool, &n.model).await, None);
    assert_eq!(produce(&p, &n.orders, 0, "o3", Some(br#"{"ok":3}"#), None).await, o3_at);
    let refusal = drive_until_refused(&mut projector, &pool, &n.model).await;
    assert_rejected_at(&refusal, pay_at, &[&format!("{}/0@{pay_at}", n.payments), "not JSON"]);
    let r = report(&pool, &n.model).await;
    assert_eq!(r.task(0).unwrap().held_total, 2, "the rejected payment is still held");
    drop(projector);

    let held = SkipRequest { topic: n.payments.clone(), ..skip_request(&n, pay_at, "unparseable payment") };
    skip(&config.kafka, &pool, &held).await.unwrap();
    let r = report(&pool, &n.model).await;
    let payments = r.task(0).unwrap().channels.iter().find(|c| r.describe(&c.channel) == format!("{}/0", n.payments));
    assert!(payments.unwrap().blockers.is_empty(), "status applies the skip: the held head waits for nothing");
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "everything after the skipped records", || async {
        document(&pool, &n.model, "o3").await.is_some() && document(&pool, &n.model, "pay2").await.is_some()
    })
    .await;
    assert_eq!(document(&pool, &n.model, "pay").await, None);
    assert_eq!(document(&pool, &n.model, "o2").await, None);
    let r = report(&pool, &n.model).await;
    let t = r.task(0).unwrap();
    assert_eq!((t.status, t.held_total, t.skips.len()), (TaskStatus::Running, 0, 2));
}

/// A rejected batch is replayed carefully in growing steps (1, 2, 4, … records); a step of
/// several records that meets the rejection starts the replay again from one record, so the
/// refusal comes from a step that fed the record alone: every record before it committed,
/// nothing after it did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_deep_in_a_large_batch_is_refused_exactly_at_its_record() {
    let n = Names::new("deepreject");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let p = producer();
    let mut bad_at = None;
    for i in 0..40 {
        let value = if i == 27 { b"not json".to_vec() } else { format!(r#"{{"i":{i}}}"#).into_bytes() };
        let at = produce(&p, &n.orders, 0, &format!("k{i:02}"), Some(&value), None).await;
        if i == 27 {
            bad_at = Some(at);
        }
    }
    let bad_at = bad_at.unwrap();

    let mut config = n.config();
    config.models[0].max_step_ms = 1_000;
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    let refusal = drive_until_refused(&mut projector, &pool, &n.model).await;
    assert_rejected_at(&refusal, bad_at, &[&format!("{}/0@{bad_at}", n.orders), "not JSON"]);
    let positions: Vec<i64> = applied(&pool, &n.model).await.iter().map(|a| a.2).collect();
    assert_eq!(positions, (0..bad_at).collect::<Vec<i64>>(), "every record before it applied once, in order");
    assert!(document(&pool, &n.model, "k26").await.is_some());
    assert_eq!(document(&pool, &n.model, "k28").await, None, "nothing after it");
    let r = report(&pool, &n.model).await;
    let t = r.task(0).unwrap();
    let orders = t.channels.iter().find(|c| r.describe(&c.channel) == format!("{}/0", n.orders)).unwrap();
    assert_eq!(orders.fed_up_to, Some(bad_at - 1), "the rejected record is not marked delivered");
}

/// A keyed record on another partition than the topic's partitioner (murmur2 by default)
/// places its key on is refused `KEY_PARTITION_MISMATCH` at that record, by the rejection
/// path: a batch holding it is retried carefully, what came before it commits, the
/// diagnosis names the key, both partitions and the producer setting; the other task goes
/// on; a restart refuses the same record again; `skip` moves past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_on_another_partition_than_its_partitioner_places_it_is_refused_by_name() {
    let n = Names::new("misplaced");
    create_topics(&[&n.orders, &n.payments], 2).await;
    let pool = pool().await;
    let p = producer();
    let (before, misplaced, after) = (key_on("before", 0, 2), key_on("misplaced", 1, 2), key_on("after", 0, 2));
    let other = key_on("other", 1, 2);
    produce(&p, &n.orders, 0, &before, Some(br#"{"ok":1}"#), None).await;
    let misplaced_at = produce(&p, &n.orders, 0, &misplaced, Some(br#"{"ok":2}"#), None).await;
    produce(&p, &n.orders, 0, &after, Some(br#"{"ok":3}"#), None).await;
    produce(&p, &n.orders, 1, &other, Some(br#"{"ok":4}"#), None).await;

    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    let refusal = drive_until_refused(&mut projector, &pool, &n.model).await;
    assert_eq!((refusal.reason, refusal.position), (RefusalReason::KeyPartitionMismatch, Some(misplaced_at)));
    for part in [
        format!("{}/0@{misplaced_at}", n.orders),
        format!("key {misplaced:?} found on partition 0"),
        "places it on partition 1 of 2".to_string(),
        "partitioner=murmur2_random".to_string(),
    ] {
        assert!(refusal.diagnosis.contains(&part), "{part:?} missing from: {}", refusal.diagnosis);
    }
    let text = render(&report(&pool, &n.model).await);
    assert!(text.contains(&format!("REFUSED KEY_PARTITION_MISMATCH at {}/0@{misplaced_at}", n.orders)), "{text}");
    drive_until(&mut projector, "task 1 to apply its record", || async {
        document(&pool, &n.model, &other).await.is_some()
    })
    .await;
    assert!(document(&pool, &n.model, &before).await.is_some(), "the record before the misplaced one commits");
    assert_eq!(document(&pool, &n.model, &misplaced).await, None);
    assert_eq!(document(&pool, &n.model, &after).await, None, "nothing after it on the channel");
    drop(projector);

    // A restart refuses the same record again; a skip moves past it.
    let mut again = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut again, "the refusal to recur", || async {
        report(&pool, &n.model).await.task(0).is_some_and(|t| t.epoch == 2 && t.status == TaskStatus::Refused)
    })
    .await;
    assert_eq!(refused(&pool, &n.model).await.unwrap(), refusal);
    skip(&config.kafka, &pool, &skip_request(&n, misplaced_at, "a producer partitioning by CRC-32")).await.unwrap();
    drop(again);
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "the record after it to apply", || async {
        document(&pool, &n.model, &after).await.is_some()
    })
    .await;
    assert_eq!(document(&pool, &n.model, &misplaced).await, None, "the skipped record has no effect");
    assert_eq!(refused(&pool, &n.model).await, None);
}
