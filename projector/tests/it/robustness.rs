//! The projector against hostile input and a hostile environment: header names that are not
//! UTF-8 are data; a panicking step makes the task `failing` and it recovers without a
//! restart of the process; a refused task starts again once its row is cleared; held
//! records past `max_held_records` refuse; a locked task row costs a bounded wait; partitions
//! added while running refuse every task; and positions read past transaction markers and
//! aborted runs are stored, so retention past them is not a discard.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use parsley::refusal::RefusalReason;
use parsley::Position;
use parsley_infra::headers::produce::produce_with_raw_headers;
use parsley_projector::metrics::{Metric, Metrics, METRICS};
use parsley_projector::projection::{Delivered, Projection, ProjectionError, StepContext};
use parsley_projector::record::{decode_headers, Header};
use parsley_projector::task::{StepOutcome, TaskState};
use parsley_projector::ModelProjector;
use parsley_store::ordering::TaskStatus;
use parsley_store::status::render;
use rdkafka::admin::NewPartitions;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::producer::Producer as _;
use rdkafka::{Offset, TopicPartitionList};
use sqlx::{PgConnection, PgPool, Row as _};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::support::*;

/// Waits until `done` holds, checking every 50 ms, for tests where the projector runs on
/// its own (`ModelProjector::run`).
async fn eventually<F, Fut>(what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + TIMEOUT;
    while !done().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A projector running its tasks in the background, as the binary does.
struct Running {
    stop: watch::Sender<bool>,
    handle: JoinHandle<anyhow::Result<()>>,
}

impl Running {
    fn spawn<P: Projection>(projector: ModelProjector<P>) -> Running {
        let (stop, shutdown) = watch::channel(false);
        Running { stop, handle: tokio::spawn(projector.run(shutdown)) }
    }

    async fn stop(self) {
        self.stop.send(true).unwrap();
        self.handle.await.expect("the model runner").expect("the model run ends cleanly");
    }
}

/// The document projection (with the test log), misbehaving on the record whose key is
/// `key` while `armed`: `Panic` panics in the step, `Reject` rejects the record.
struct Misbehaving {
    inner: Recording,
    key: &'static str,
    armed: AtomicBool,
    how: Misbehaviour,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Misbehaviour {
    Panic,
    Reject,
}

impl Misbehaving {
    fn new(config: &parsley_settings::config::Config, key: &'static str, how: Misbehaviour) -> Arc<Misbehaving> {
        Arc::new(Misbehaving { inner: (*Recording::new(config)).clone(), key, armed: AtomicBool::new(true), how })
    }
}

impl Projection for Misbehaving {
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
        if self.armed.load(Ordering::SeqCst) {
            if let Some(r) = records.iter().find(|r| r.key == Some(self.key.as_bytes())) {
                match self.how {
                    Misbehaviour::Panic => panic!("the test projection chokes on {}", r.coordinate()),
                    Misbehaviour::Reject => {
                        return Err(ProjectionError::rejected(format!(
                            "the test projection rejects {}",
                            r.coordinate()
                        )))
                    }
                }
            }
        }
        self.inner.apply_batch(conn, step, records).await?;
        Ok(())
    }
}

/// The document projection (with the test log), remembering the headers of every record
/// it was handed.
struct Capturing {
    inner: Recording,
    seen: Mutex<Vec<(Position, Vec<Header>)>>,
}

impl Projection for Capturing {
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
        self.seen.lock().unwrap().extend(records.iter().map(|r| (r.position, r.headers.to_vec())));
        self.inner.apply_batch(conn, step, records).await?;
        Ok(())
    }
}

async fn task_row(pool: &PgPool, model: &str, task: u32) -> (String, i64) {
    let row = sqlx::query("SELECT status, epoch FROM parsley.tasks WHERE model = $1 AND task = $2")
        .bind(model)
        .bind(task as i32)
        .fetch_one(pool)
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// What an operator's `skip` does to the row (besides recording the skip): `running`, no
/// refusal. Here without fixing anything else.
async fn clear_refusal_by_hand(pool: &PgPool, model: &str, task: u32) {
    sqlx::query(
        "UPDATE parsley.tasks SET status = 'running', refusal_reason = NULL, refusal_diagnosis = NULL,
           refusal_topic_id = NULL, refusal_partition = NULL, refusal_position = NULL
         WHERE model = $1 AND task = $2 AND status = 'refused'",
    )
    .bind(model)
    .bind(task as i32)
    .execute(pool)
    .await
    .unwrap();
}

/// The `fed_up_to` of `topic`/0 in task 0, as status reports it.
async fn fed_up_to(pool: &PgPool, model: &str, topic: &str) -> Option<Position> {
    let r = report(pool, model).await;
    let t = r.task(0)?;
    t.channels.iter().find(|c| r.describe(&c.channel) == format!("{topic}/0")).and_then(|c| c.fed_up_to)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_names_that_are_not_utf8_are_data_held_restored_and_delivered() {
    let n = Names::new("raw-headers");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let orders_id = topic_id(&n.orders).await;
    let pool = pool().await;

    // The payment's cause, the order, sits in an open transaction; the payment carries
    // header names no UTF-8 decoder accepts, and its `parsley.causes` written as raw bytes.
    let txp = transactional_producer();
    txp.begin_transaction().unwrap();
    let order_at = produce(&txp, &n.orders, 0, "o1", Some(br#"{"status":"placed"}"#), None).await;
    let causes = causes(&[(orders_id, 0, order_at)]);
    let application: Vec<Header> = vec![
        (vec![0xff, 0xfe, b't'], Some(b"v1".to_vec())),
        (vec![0xc3, 0x28], None),
        (b"plain".to_vec(), Some(vec![])),
    ];
    let payments = n.payments.clone();
    let sent = application.clone();
    let pay_at = tokio::task::spawn_blocking(move || {
        let mut headers: Vec<(&[u8], Option<&[u8]>)> = sent.iter().map(|(k, v)| (k.as_slice(), v.as_deref())).collect();
        headers.insert(1, (b"parsley.causes".as_slice(), Some(causes.as_slice())));
        produce_with_raw_headers(&bootstrap(), &payments, 0, b"o1", Some(br#"{"paid":true}"#), &headers, TIMEOUT)
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("{e:#}"));

    let config = n.config();
    let capturing = Arc::new(Capturing { inner: (*Recording::new(&config)).clone(), seen: Mutex::new(Vec::new()) });
    let mut projector = start(&config, &pool, Arc::clone(&capturing)).await;
    drive_until(&mut projector, "the payment to be held behind its order", || async {
        report(&pool, &n.model).await.task(0).is_some_and(|t| t.held_total == 1)
    })
    .await;
    let stored: Vec<u8> = sqlx::query_scalar("SELECT headers FROM parsley.held WHERE model = $1 AND position = $2")
        .bind(&n.model)
        .bind(pay_at)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(decode_headers(&stored).unwrap(), application, "held with its headers as bytes, causes apart");
    drop(projector);

    // A new execution restores the held payment from the database, then delivers it.
    let mut projector = start(&config, &pool, Arc::clone(&capturing)).await;
    drive(&mut projector, 3).await;
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().held_total, 1, "restored, still held");
    txp.commit_transaction(TIMEOUT).unwrap();
    drive_until(&mut projector, "the order and the payment to apply", || async {
        applied(&pool, &n.model).await.len() == 2
    })
    .await;
    assert_eq!(document(&pool, &n.model, "o1").await.unwrap().0, serde_json::json!({"status":"placed","paid":true}));
    let seen = capturing.seen.lock().unwrap().clone();
    let payment = seen.iter().find(|(p, h)| *p == pay_at && !h.is_empty()).expect("the payment was delivered");
    assert_eq!(payment.1, application, "the projection sees the names as bytes, in record order");
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().status, TaskStatus::Running);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_step_is_failing_with_its_message_and_the_task_recovers_without_a_restart() {
    let n = Names::new("panics");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let p = producer();
    let config = n.config();
    let projection = Misbehaving::new(&config, "poison", Misbehaviour::Panic);
    let metrics = Metrics::new(METRICS);
    let projector = start_with_metrics(&config, &pool, Arc::clone(&projection), Arc::clone(&metrics)).await;
    let running = Running::spawn(projector);

    produce(&p, &n.orders, 0, "before", Some(br#"{"n":1}"#), None).await;
    eventually("the record before the poison to apply", || async {
        document(&pool, &n.model, "before").await.is_some()
    })
    .await;
    let poison_at = produce(&p, &n.orders, 0, "poison", Some(br#"{"n":2}"#), None).await;
    eventually("the task to be failing with the panic's message, more than once", || async {
        let r = report(&pool, &n.model).await;
        let t = r.task(0).unwrap();
        t.status == TaskStatus::Failing && t.failures >= 2
    })
    .await;
    let r = report(&pool, &n.model).await;
    let t = r.task(0).unwrap();
    let error = t.last_error.clone().unwrap();
    assert!(error.contains("panicked") && error.contains("chokes on"), "{error}");
    assert!(error.contains(&format!("{}/0@{poison_at}", n.orders)), "{error}");
    assert!(t.epoch > 1, "each panic starts the task again (a new epoch)");
    assert!(t.refusal.is_none(), "a panic is not a refusal");
    let labels = [("model", n.model.as_str()), ("task", "0")];
    assert!(metrics.value(Metric::PanicsTotal, &labels).unwrap_or(0.0) >= 2.0);
    assert_eq!(metrics.value(Metric::TaskFailing, &labels), Some(1.0));
    assert_eq!(document(&pool, &n.model, "poison").await, None);

    // The cause of the panic goes away: the same process recovers, nothing lost or repeated.
    projection.armed.store(false, Ordering::SeqCst);
    eventually("the poison record to apply and the task to run", || async {
        document(&pool, &n.model, "poison").await.is_some()
            && report(&pool, &n.model).await.task(0).unwrap().status == TaskStatus::Running
    })
    .await;
    produce(&p, &n.orders, 0, "after", Some(br#"{"n":3}"#), None).await;
    eventually("a later record to apply", || async { document(&pool, &n.model, "after").await.is_some() }).await;
    let positions: Vec<i64> = applied(&pool, &n.model).await.into_iter().map(|(_, _, p)| p).collect();
    assert_eq!(positions, vec![0, 1, 2], "each record applied once, in order");
    assert_eq!(metrics.value(Metric::TaskFailing, &labels), Some(0.0));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_task_starts_again_once_its_row_is_cleared_and_refuses_again_if_the_cause_remains() {
    let n = Names::new("refused-recheck");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let mut config = n.config();
    config.projector.refused_recheck_ms = 200;
    config.validate().unwrap();
    let projection = Misbehaving::new(&config, "bad", Misbehaviour::Reject);
    let metrics = Metrics::new(METRICS);
    let projector = start_with_metrics(&config, &pool, Arc::clone(&projection), Arc::clone(&metrics)).await;
    let running = Running::spawn(projector);
    let labels = [("model", n.model.as_str()), ("task", "0")];

    let bad_at = produce(&producer(), &n.orders, 0, "bad", Some(br#"{"n":1}"#), None).await;
    eventually("the task to refuse the rejected record", || async {
        task_row(&pool, &n.model, 0).await.0 == "refused"
    })
    .await;
    let (_, refused_epoch) = task_row(&pool, &n.model, 0).await;
    let refusal = report(&pool, &n.model).await.task(0).unwrap().refusal.clone().unwrap();
    assert_eq!(refusal.reason, RefusalReason::ProjectionRejected);
    assert_eq!(refusal.position, Some(bad_at));

    // Cleared by hand while the cause remains: the task starts again (a new epoch) and
    // derives the same refusal.
    clear_refusal_by_hand(&pool, &n.model, 0).await;
    eventually("the task to start again and refuse again", || async {
        let (status, epoch) = task_row(&pool, &n.model, 0).await;
        status == "refused" && epoch > refused_epoch
    })
    .await;
    let again = report(&pool, &n.model).await.task(0).unwrap().refusal.clone().unwrap();
    assert_eq!((again.reason, again.channel, again.position), (refusal.reason, refusal.channel, refusal.position));
    assert_eq!(metrics.value(Metric::TaskRefused, &labels), Some(1.0));

    // The cause is fixed, then the row cleared: the same process delivers and goes on.
    projection.armed.store(false, Ordering::SeqCst);
    clear_refusal_by_hand(&pool, &n.model, 0).await;
    eventually("the record to apply", || async { document(&pool, &n.model, "bad").await.is_some() }).await;
    produce(&producer(), &n.orders, 0, "next", Some(br#"{"n":2}"#), None).await;
    eventually("a later record to apply", || async { document(&pool, &n.model, "next").await.is_some() }).await;
    let t = report(&pool, &n.model).await.task(0).unwrap().clone();
    assert_eq!((t.status, t.refusal), (TaskStatus::Running, None));
    assert_eq!(metrics.value(Metric::TaskRefused, &labels), Some(0.0));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holding_more_than_max_held_records_refuses_and_again_after_a_restart() {
    let n = Names::new("held-limit");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let orders_id = topic_id(&n.orders).await;
    let pool = pool().await;
    let txp = transactional_producer();
    txp.begin_transaction().unwrap();
    let order_at = produce(&txp, &n.orders, 0, "o1", Some(br#"{"status":"placed"}"#), None).await;
    let p = producer();
    let mut effects = Vec::new();
    for i in 0..4 {
        let at = produce(&p, &n.payments, 0, &format!("p{i}"), Some(b"{}"), Some(&causes(&[(orders_id, 0, order_at)])))
            .await;
        effects.push(at);
    }
    let mut config = n.config();
    config.models[0].max_held_records = 3;
    config.validate().unwrap();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "the task to refuse", || async {
        report(&pool, &n.model).await.task(0).unwrap().status == TaskStatus::Refused
    })
    .await;
    let r = report(&pool, &n.model).await;
    let refusal = r.task(0).unwrap().refusal.clone().unwrap();
    assert_eq!(refusal.reason, RefusalReason::HeldLimitExceeded);
    assert_eq!(r.describe(&refusal.channel.expect("names the channel")), format!("{}/0", n.payments));
    assert_eq!(refusal.position, Some(effects[3]), "the fourth effect passes the bound");
    assert!(refusal.diagnosis.contains("max_held_records = 3"), "{}", refusal.diagnosis);
    assert!(render(&r).contains("REFUSED HELD_LIMIT_EXCEEDED"));
    assert!(applied(&pool, &n.model).await.is_empty());
    drop(projector);

    // The fourth effect was fed and is held: a restart derives the refusal from what is
    // held (at restore no single record passes the bound, so none is named).
    let projector = start(&config, &pool, Recording::new(&config)).await;
    match projector.tasks()[0].state() {
        TaskState::Refused(again) => {
            assert_eq!(again.reason, RefusalReason::HeldLimitExceeded);
            assert!(again.diagnosis.contains("4 held records"), "{}", again.diagnosis);
        }
        other => panic!("expected the refusal again at start, got {other:?}"),
    }
    assert!(applied(&pool, &n.model).await.is_empty());
    txp.abort_transaction(TIMEOUT).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_task_row_fails_the_step_within_lock_timeout_and_the_task_recovers_when_released() {
    let n = Names::new("lock-timeout");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let mut config = n.config();
    config.database.lock_timeout_ms = 500;
    config.validate().unwrap();
    // The projector's pool, every session under the configured bounds.
    let bounded = parsley_infra::pg::connect_bounded(&database_url(), 4, TIMEOUT, &config.database.session_bounds())
        .await
        .unwrap();
    let mut conn = bounded.acquire().await.unwrap();
    for (setting, expected) in
        [("lock_timeout", "500ms"), ("statement_timeout", "30s"), ("idle_in_transaction_session_timeout", "1min")]
    {
        let value: String = sqlx::query_scalar(&format!("SHOW {setting}")).fetch_one(&mut *conn).await.unwrap();
        assert_eq!(value, expected, "{setting}");
    }
    drop(conn);
    let pool = pool().await;
    let p = producer();
    let metrics = Metrics::new(METRICS);
    let mut projector = start_with_metrics(&config, &bounded, Recording::new(&config), Arc::clone(&metrics)).await;
    produce(&p, &n.orders, 0, "k1", Some(b"{}"), None).await;
    drive_until(&mut projector, "k1 to apply", || async { document(&pool, &n.model, "k1").await.is_some() }).await;

    // Another session holds the task's row lock (a stuck peer) while a record waits.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM parsley.tasks WHERE model = $1 AND task = 0 FOR UPDATE")
        .bind(&n.model)
        .execute(&mut *holder)
        .await
        .unwrap();
    produce(&p, &n.orders, 0, "k2", Some(b"{}"), None).await;
    let deadline = Instant::now() + TIMEOUT;
    let (error, took) = loop {
        let began = Instant::now();
        match projector.run_once().await.remove(0) {
            StepOutcome::Failed { error } => break (error, began.elapsed()),
            StepOutcome::Idle => assert!(Instant::now() < deadline, "k2 never reached a step"),
            other => panic!("expected the step to fail on the lock, got {other:?}"),
        }
    };
    assert!(error.contains("lock timeout"), "{error}");
    // The step waits the lock timeout; recording the failure waits it once more (the row is
    // locked), and is logged.
    assert!(took < Duration::from_secs(4), "the wait is bounded, took {took:?}");
    assert!(matches!(projector.tasks()[0].state(), TaskState::Failing { .. }));
    let labels = [("model", n.model.as_str()), ("task", "0")];
    assert_eq!(metrics.value(Metric::TaskFailing, &labels), Some(1.0));
    assert_eq!(document(&pool, &n.model, "k2").await, None);

    holder.rollback().await.unwrap();
    drive_until(&mut projector, "k2 to apply once the lock is released", || async {
        document(&pool, &n.model, "k2").await.is_some()
    })
    .await;
    assert_eq!(projector.tasks()[0].state(), &TaskState::Running);
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().status, TaskStatus::Running);
    assert_eq!(applied(&pool, &n.model).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_added_while_running_refuse_every_task() {
    let n = Names::new("width-run");
    create_topics(&[&n.orders, &n.payments], 2).await;
    let pool = pool().await;
    let mut config = n.config();
    config.projector.width_check_ms = 200;
    config.validate().unwrap();
    let metrics = Metrics::new(METRICS);
    let mut projector = start_with_metrics(&config, &pool, Recording::new(&config), Arc::clone(&metrics)).await;
    let p = producer();
    produce(&p, &n.orders, 0, &key_on("a", 0, 2), Some(b"{}"), None).await;
    produce(&p, &n.orders, 1, &key_on("b", 1, 2), Some(b"{}"), None).await;
    drive_until(&mut projector, "both records to apply and a width check per task", || async {
        let checked =
            |task: &str| metrics.value(Metric::WidthChecksTotal, &[("model", &n.model), ("task", task)]).unwrap_or(0.0);
        applied(&pool, &n.model).await.len() == 2 && checked("0") >= 1.0 && checked("1") >= 1.0
    })
    .await;
    assert!(report(&pool, &n.model).await.tasks.iter().all(|t| t.status == TaskStatus::Running));

    let grow = [NewPartitions::new(&n.orders, 3)];
    for r in admin().create_partitions(&grow, &admin_options()).await.expect("create_partitions") {
        r.expect("a partition added");
    }
    drive_until(&mut projector, "every task to refuse", || async {
        report(&pool, &n.model).await.tasks.iter().all(|t| t.status == TaskStatus::Refused)
    })
    .await;
    let r = report(&pool, &n.model).await;
    for t in &r.tasks {
        let refusal = t.refusal.clone().unwrap();
        assert_eq!(refusal.reason, RefusalReason::TaskWidthChanged);
        assert_eq!(r.describe(&refusal.channel.unwrap()), format!("{}/{}", n.orders, t.task));
        assert!(
            refusal.diagnosis.contains("2 tasks") && refusal.diagnosis.contains("3 partitions"),
            "{}",
            refusal.diagnosis
        );
        assert_eq!(t.epoch, 1, "refused by the running execution");
    }
    assert!(projector.tasks().iter().all(|t| matches!(t.state(), TaskState::Refused(_))));
    // Records written meanwhile are not applied.
    produce(&p, &n.orders, 0, "c", Some(b"{}"), None).await;
    drive(&mut projector, 3).await;
    assert_eq!(applied(&pool, &n.model).await.len(), 2);
}

/// A read-committed consumer of the project, assigned at `from`, reads everything there is
/// and then polls on empty for a moment: returns the offsets it returned and its position.
fn read_all(topic: &str, from: i64) -> (Vec<i64>, Option<i64>) {
    let consumer: BaseConsumer =
        parsley_infra::kafka::consumer_config(&bootstrap(), &unique("position")).create().unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Offset(from)).unwrap();
    consumer.assign(&tpl).unwrap();
    let mut offsets = Vec::new();
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < Duration::from_secs(2) {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                offsets.push(rdkafka::Message::offset(&m));
                quiet_since = Instant::now();
            }
            Some(Err(e)) => panic!("consuming {topic}: {e}"),
            None => {}
        }
    }
    let position = consumer.position().unwrap().elements()[0].offset().to_raw();
    (offsets, position)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_committed_position_passes_transaction_markers_and_aborted_runs() {
    let topic = unique("position-fact");
    create_topics(&[&topic], 1).await;
    let txp = transactional_producer();
    txp.begin_transaction().unwrap();
    for i in 0..5 {
        produce(&txp, &topic, 0, &format!("c{i}"), Some(b"{}"), None).await;
    }
    txp.commit_transaction(TIMEOUT).unwrap(); // records 0-4, commit marker 5
    let t = topic.clone();
    let (offsets, position) = tokio::task::spawn_blocking(move || read_all(&t, 0)).await.unwrap();
    assert_eq!(offsets, vec![0, 1, 2, 3, 4]);
    assert_eq!(position, Some(6), "past the commit marker");

    txp.begin_transaction().unwrap();
    for i in 0..3 {
        produce(&txp, &topic, 0, &format!("a{i}"), Some(b"{}"), None).await;
    }
    txp.abort_transaction(TIMEOUT).unwrap(); // aborted records 6-8, abort marker 9
    let t = topic.clone();
    let (offsets, position) = tokio::task::spawn_blocking(move || read_all(&t, 6)).await.unwrap();
    assert_eq!(offsets, Vec::<i64>::new(), "nothing of the aborted run is returned");
    assert_eq!(position, Some(10), "past the aborted run and its marker");
}

/// Retention that removes only control records (and an aborted run) below what the task
/// has read is no discard: the task stored how far its consumer read, past them.
async fn retention_past_control_records_is_not_a_discard(
    n: &Names,
    write: impl Future<Output = (Vec<&'static str>, i64)>,
) {
    let pool = pool().await;
    let (keys, read_to) = write.await;
    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "the committed records to apply and the read position to be stored", || async {
        applied(&pool, &n.model).await.len() == keys.len()
            && fed_up_to(&pool, &n.model, &n.orders).await == Some(read_to)
    })
    .await;
    for _ in 0..3 {
        assert_eq!(projector.run_once().await[0], StepOutcome::Idle, "once stored, idle polls commit nothing");
    }
    drop(projector);

    delete_records(&n.orders, 0, read_to + 1).await;
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    let t = report(&pool, &n.model).await.task(0).unwrap().clone();
    assert_eq!((t.status, t.refusal), (TaskStatus::Running, None), "no POSITIONS_DISCARDED_UNREAD");
    assert_eq!(projector.tasks()[0].state(), &TaskState::Running);
    let after = produce(&producer(), &n.orders, 0, "after", Some(b"{}"), None).await;
    assert_eq!(after, read_to + 1);
    drive_until(&mut projector, "a record written after to apply", || async {
        document(&pool, &n.model, "after").await.is_some()
    })
    .await;
    for key in keys {
        assert!(document(&pool, &n.model, key).await.is_some(), "{key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_past_a_commit_marker_is_not_a_discard() {
    let n = Names::new("past-marker");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let write = async {
        let txp = transactional_producer();
        txp.begin_transaction().unwrap();
        let keys = vec!["t0", "t1", "t2", "t3", "t4"];
        for key in &keys {
            produce(&txp, &n.orders, 0, key, Some(b"{}"), None).await;
        }
        txp.commit_transaction(TIMEOUT).unwrap(); // records 0-4, commit marker 5
        (keys, 5)
    };
    retention_past_control_records_is_not_a_discard(&n, write).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_past_an_aborted_run_is_not_a_discard() {
    let n = Names::new("past-abort");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let write = async {
        produce(&producer(), &n.orders, 0, "k0", Some(b"{}"), None).await; // 0
        let txp = transactional_producer();
        txp.begin_transaction().unwrap();
        for key in ["x1", "x2", "x3"] {
            produce(&txp, &n.orders, 0, key, Some(b"{}"), None).await;
        }
        txp.abort_transaction(TIMEOUT).unwrap(); // aborted 1-3, abort marker 4
        (vec!["k0"], 4)
    };
    retention_past_control_records_is_not_a_discard(&n, write).await;
    assert_eq!(document(&pool().await, &n.model, "x1").await, None, "aborted records never apply");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_task_commits_its_read_position_once_not_on_every_poll() {
    let n = Names::new("idle-position");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let config = n.config();
    let metrics = Metrics::new(METRICS);
    let mut projector = start_with_metrics(&config, &pool, Recording::new(&config), Arc::clone(&metrics)).await;
    let txp = transactional_producer();
    txp.begin_transaction().unwrap();
    produce(&txp, &n.orders, 0, "t0", Some(b"{}"), None).await;
    txp.commit_transaction(TIMEOUT).unwrap(); // record 0, commit marker 1
    drive_until(&mut projector, "the read position past the marker to be stored", || async {
        fed_up_to(&pool, &n.model, &n.orders).await == Some(1)
    })
    .await;
    let labels = [("model", n.model.as_str()), ("task", "0")];
    let steps = metrics.value(Metric::StepsTotal, &labels).unwrap();
    drive(&mut projector, 5).await;
    assert_eq!(metrics.value(Metric::StepsTotal, &labels).unwrap(), steps, "idle polls commit nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_bounds_of_the_default_pool() {
    let pool = pool().await;
    let mut conn = pool.acquire().await.unwrap();
    let expected = [
        ("lock_timeout", "10s"),
        ("statement_timeout", "30s"),
        ("idle_in_transaction_session_timeout", "1min"),
        ("tcp_keepalives_idle", "30"),
    ];
    for (setting, value) in expected {
        let got: String = sqlx::query_scalar(&format!("SHOW {setting}")).fetch_one(&mut *conn).await.unwrap();
        // Over a Unix socket the server reports 0 for keepalives; the tests connect by TCP.
        assert_eq!(got, value, "{setting}");
    }
}
