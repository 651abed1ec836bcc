//! Causal delivery through the real broker: a cause in an open Kafka transaction holds its
//! effect until the commit; a cause on an aborted run is settled by the next record.

use parsley_projector::task::StepOutcome;
use rdkafka::producer::Producer as _;
use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_waits_for_its_order_in_an_open_transaction() {
    let n = Names::new("open-tx");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let orders_id = topic_id(&n.orders).await;
    let pool = pool().await;

    // The order is written inside a Kafka transaction that stays open for now.
    let txp = transactional_producer();
    txp.begin_transaction().unwrap();
    let order_at = produce(&txp, &n.orders, 0, "o1", Some(br#"{"status":"placed","total":10}"#), None).await;
    // The payment names the order's coordinate, as the gateway would after the ack.
    let plain = producer();
    let pay_at =
        produce(&plain, &n.payments, 0, "o1", Some(br#"{"paid":true}"#), Some(&causes(&[(orders_id, 0, order_at)])))
            .await;

    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "the payment to be received and held", || async {
        report(&pool, &n.model).await.task(0).unwrap().held_total == 1
    })
    .await;
    // More steps change nothing: the order is invisible to a read_committed consumer.
    drive(&mut projector, 3).await;
    assert_eq!(document(&pool, &n.model, "o1").await, None, "the payment must not apply before its order");
    let r = report(&pool, &n.model).await;
    let task = r.task(0).unwrap();
    assert_eq!(task.held_total, 1);
    let payments = task.channels.iter().find(|c| r.describe(&c.channel) == format!("{}/0", n.payments)).unwrap();
    assert_eq!(payments.head, Some(pay_at));
    assert_eq!(payments.blockers.len(), 1);
    assert_eq!(r.describe(&payments.blockers[0].channel), format!("{}/0", n.orders));
    assert_eq!(payments.blockers[0].required, order_at);
    let rendered = parsley_store::status::render(&r);
    assert!(rendered.contains(&format!("blocked on {}/0 required {order_at}", n.orders)), "{rendered}");

    txp.commit_transaction(TIMEOUT).unwrap();
    drive_until(&mut projector, "both records to apply", || async {
        document(&pool, &n.model, "o1").await.is_some_and(|(d, _)| d.get("paid").is_some())
    })
    .await;
    let (doc, version) = document(&pool, &n.model, "o1").await.unwrap();
    assert_eq!(
        doc,
        json!({"status": "placed", "total": 10, "paid": true}),
        "the order replaced, then the payment merged"
    );
    assert_eq!(version, 2);
    assert_eq!(
        applied(&pool, &n.model).await,
        vec![(n.orders.clone(), 0, order_at), (n.payments.clone(), 0, pay_at)],
        "delivered in causal order, once each"
    );
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().held_total, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cause_on_an_aborted_run_is_settled_by_the_next_record() {
    let n = Names::new("aborted");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let orders_id = topic_id(&n.orders).await;
    let pool = pool().await;

    let txp = transactional_producer();
    txp.begin_transaction().unwrap();
    let aborted_at = produce(&txp, &n.orders, 0, "o1", Some(br#"{"status":"never"}"#), None).await;
    txp.abort_transaction(TIMEOUT).unwrap();
    let plain = producer();
    let pay_at =
        produce(&plain, &n.payments, 0, "o1", Some(br#"{"paid":true}"#), Some(&causes(&[(orders_id, 0, aborted_at)])))
            .await;

    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "the payment to be held", || async {
        report(&pool, &n.model).await.task(0).unwrap().held_total == 1
    })
    .await;
    drive(&mut projector, 2).await;
    assert_eq!(
        report(&pool, &n.model).await.task(0).unwrap().held_total,
        1,
        "nothing settles the aborted position yet"
    );

    let next_at = produce(&plain, &n.orders, 0, "o2", Some(br#"{"status":"placed"}"#), None).await;
    assert!(next_at > aborted_at + 1, "the abort marker sits between them");
    drive_until(&mut projector, "the payment to be released", || async {
        report(&pool, &n.model).await.task(0).unwrap().held_total == 0
    })
    .await;
    // The aborted record never arrives; the next record settles its position. The new
    // order is not a cause of the payment, so the two may apply in either order.
    let mut log = applied(&pool, &n.model).await;
    log.sort();
    let mut expected = vec![(n.orders.clone(), 0, next_at), (n.payments.clone(), 0, pay_at)];
    expected.sort();
    assert_eq!(log, expected);
    assert_eq!(document(&pool, &n.model, "o1").await.unwrap().0, json!({"paid": true}));
    let outcomes = projector.run_once().await;
    assert!(outcomes.iter().all(|o| matches!(o, StepOutcome::Idle)), "{outcomes:?}");
}
