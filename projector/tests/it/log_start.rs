//! The periodic log-start check of a running task (`projector.log_start_check_ms`): retention
//! passing a record the task holds refuses `POSITIONS_DISCARDED_UNREAD` without a restart,
//! and identically after one; retention up to what the task has settled refuses nothing;
//! a task holding nothing, or with the check disabled, makes no check (and with it disabled,
//! the refusal waits for the next start).

use std::sync::Arc;
use std::time::Duration;

use parsley::refusal::RefusalReason;
use parsley_projector::metrics::{Metric, Metrics, METRICS};
use parsley_projector::task::{StepOutcome, TaskState};
use parsley_settings::config::Config;
use parsley_store::ordering::TaskStatus;
use parsley_store::status::render;
use rdkafka::producer::Producer as _;

use crate::support::*;

/// The periodic checks task 0 of `model` has made.
fn checks(metrics: &Metrics, model: &str) -> f64 {
    metrics.value(Metric::LogStartChecksTotal, &[("model", model), ("task", "0")]).unwrap_or(0.0)
}

fn with_check_ms(names: &Names, ms: u64) -> Config {
    let mut config = names.config();
    config.projector.log_start_check_ms = ms;
    config.validate().unwrap();
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_past_a_held_record_refuses_while_running_and_again_after_a_restart() {
    let n = Names::new("held-retention");
    let pool = pool().await;

    // The payment's cause, the order, sits in a Kafka transaction that stays open.
    let (txp, _, pay_at) = held_payment(&n).await;

    let config = with_check_ms(&n, 200);
    let metrics = Metrics::new(METRICS);
    let mut projector = start_with_metrics(&config, &pool, Recording::new(&config), Arc::clone(&metrics)).await;
    drive_until(&mut projector, "the payment to be held", || async {
        report(&pool, &n.model).await.task(0).unwrap().held_total == 1
    })
    .await;
    // While the payment is held, the check runs and finds the log start within reach.
    let before = checks(&metrics, &n.model);
    drive_until(&mut projector, "two periodic checks while the payment is held", || async {
        checks(&metrics, &n.model) >= before + 2.0
    })
    .await;
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().status, TaskStatus::Running);

    // Retention removes the held payment's position; the projector keeps running. Its
    // consumer reads on above the payment, so only the periodic check can notice.
    delete_records(&n.payments, 0, pay_at + 1).await;
    let before = checks(&metrics, &n.model);
    drive_until(&mut projector, "the running task to refuse", || async {
        report(&pool, &n.model).await.task(0).unwrap().status == TaskStatus::Refused
    })
    .await;
    let r = report(&pool, &n.model).await;
    let task = r.task(0).unwrap();
    assert_eq!(task.epoch, 1, "refused by the same execution, not at a restart");
    assert!(checks(&metrics, &n.model) > before, "found by a periodic check");
    let refusal = task.refusal.clone().expect("a refused task records its reason");
    assert_eq!(refusal.reason, RefusalReason::PositionsDiscardedUnread);
    assert_eq!(r.describe(&refusal.channel.expect("the refusal names a channel")), format!("{}/0", n.payments));
    assert_eq!(refusal.position, Some(pay_at), "the held payment's position");
    assert!(refusal.diagnosis.contains("holds 1 record"), "{}", refusal.diagnosis);
    let text = render(&r);
    assert!(text.contains(&format!("REFUSED POSITIONS_DISCARDED_UNREAD at {}/0@{pay_at}", n.payments)), "{text}");
    assert!(matches!(projector.tasks()[0].state(), TaskState::Refused(r) if *r == refusal));

    // Committing the cause changes nothing: the refusal is sticky, the payment never applies.
    txp.commit_transaction(TIMEOUT).unwrap();
    for _ in 0..3 {
        assert!(matches!(&projector.run_once().await[0], StepOutcome::Refused(r) if *r == refusal));
    }
    assert!(applied(&pool, &n.model).await.is_empty(), "nothing is delivered once refused");
    assert_eq!(document(&pool, &n.model, "o1").await, None);
    drop(projector);

    // A restart derives the same refusal at start, from the same stored state.
    let mut again = start(&config, &pool, Recording::new(&config)).await;
    assert!(matches!(&again.run_once().await[0], StepOutcome::Refused(_)));
    let r = report(&pool, &n.model).await;
    let task = r.task(0).unwrap();
    assert_eq!((task.epoch, task.status), (2, TaskStatus::Refused));
    let recurred = task.refusal.clone().unwrap();
    assert_eq!(
        (recurred.reason, recurred.channel, recurred.position),
        (refusal.reason, refusal.channel, refusal.position)
    );
    drive(&mut again, 3).await;
    assert!(applied(&pool, &n.model).await.is_empty(), "the held payment is never delivered");
    assert_eq!(document(&pool, &n.model, "o1").await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_up_to_what_is_settled_refuses_nothing_and_holding_nothing_checks_nothing() {
    let n = Names::new("settled-retention");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let orders_id = topic_id(&n.orders).await;
    let pool = pool().await;
    let plain = producer();
    let first_order = produce(&plain, &n.orders, 0, "o0", Some(br#"{"n":0}"#), None).await;
    let first_payment = produce(&plain, &n.payments, 0, "o0", Some(br#"{"paid":true}"#), None).await;

    let config = with_check_ms(&n, 100);
    let metrics = Metrics::new(METRICS);
    let mut projector = start_with_metrics(&config, &pool, Recording::new(&config), Arc::clone(&metrics)).await;
    drive_until(&mut projector, "both records to apply", || async { applied(&pool, &n.model).await.len() == 2 }).await;

    // Holding nothing: retention exactly at fed_up_to + 1 on both channels, and no check
    // at all however long the task runs.
    delete_records(&n.orders, 0, first_order + 1).await;
    delete_records(&n.payments, 0, first_payment + 1).await;
    drive_for(&mut projector, Duration::from_millis(800)).await;
    assert_eq!(checks(&metrics, &n.model), 0.0, "a task holding nothing makes no periodic check");
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().status, TaskStatus::Running);

    // A payment held behind an open transaction; retention exactly at its position
    // (settled + 1) is still within reach.
    let txp = transactional_producer();
    txp.begin_transaction().unwrap();
    let order_at = produce(&txp, &n.orders, 0, "o1", Some(br#"{"n":1}"#), None).await;
    let pay_at =
        produce(&plain, &n.payments, 0, "o1", Some(br#"{"paid":true}"#), Some(&causes(&[(orders_id, 0, order_at)])))
            .await;
    drive_until(&mut projector, "the payment to be held", || async {
        report(&pool, &n.model).await.task(0).unwrap().held_total == 1
    })
    .await;
    delete_records(&n.payments, 0, pay_at).await;
    let before = checks(&metrics, &n.model);
    drive_until(&mut projector, "three periodic checks after the retention", || async {
        checks(&metrics, &n.model) >= before + 3.0
    })
    .await;
    let task = report(&pool, &n.model).await.task(0).unwrap().clone();
    assert_eq!((task.status, task.refusal), (TaskStatus::Running, None));

    // The cause commits: the payment is delivered, nothing is held, the checks stop.
    txp.commit_transaction(TIMEOUT).unwrap();
    drive_until(&mut projector, "the payment to apply", || async {
        report(&pool, &n.model).await.task(0).unwrap().held_total == 0
    })
    .await;
    let settled_checks = checks(&metrics, &n.model);
    drive_for(&mut projector, Duration::from_millis(600)).await;
    assert_eq!(checks(&metrics, &n.model), settled_checks, "no check once nothing is held");
    let log = applied(&pool, &n.model).await;
    assert_eq!(log[2..], [(n.orders.clone(), 0, order_at), (n.payments.clone(), 0, pay_at)]);
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().status, TaskStatus::Running);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disabled_check_makes_no_check_while_records_are_held() {
    let n = Names::new("check-off");
    let pool = pool().await;
    let (txp, _, pay_at) = held_payment(&n).await;

    let config = with_check_ms(&n, 0);
    let metrics = Metrics::new(METRICS);
    let mut projector = start_with_metrics(&config, &pool, Recording::new(&config), Arc::clone(&metrics)).await;
    drive_until(&mut projector, "the payment to be held", || async {
        report(&pool, &n.model).await.task(0).unwrap().held_total == 1
    })
    .await;
    // Without the check, retention passing the held payment goes unnoticed while running
    // (the consumer never fetches below its position) ...
    delete_records(&n.payments, 0, pay_at + 1).await;
    drive_for(&mut projector, Duration::from_millis(600)).await;
    assert_eq!(checks(&metrics, &n.model), 0.0, "log_start_check_ms = 0 disables the check");
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().status, TaskStatus::Running);
    drop(projector);

    // ... until the next start, which always checks.
    let mut again = start(&config, &pool, Recording::new(&config)).await;
    assert!(matches!(&again.run_once().await[0], StepOutcome::Refused(_)));
    let refusal = report(&pool, &n.model).await.task(0).unwrap().refusal.clone().expect("refused at start");
    assert_eq!((refusal.reason, refusal.position), (RefusalReason::PositionsDiscardedUnread, Some(pay_at)));
    txp.abort_transaction(TIMEOUT).unwrap();
}
