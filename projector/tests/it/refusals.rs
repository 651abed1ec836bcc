//! Refusals and failures through the real broker, each visible in the task's status:
//! malformed metadata, metadata over budget, retention past unread positions, a recreated
//! topic, a changed partition count, topics that are not co-partitioned. Records the
//! projection rejects, and transient projection failures, are in `rejections.rs`.

use parsley::refusal::RefusalReason;
use parsley_infra::headers::produce::produce_with_raw_headers;
use parsley_projector::task::StepOutcome;
use parsley_projector::ModelProjector;
use parsley_store::ordering::TaskStatus;
use parsley_store::status::render;
use rdkafka::admin::NewPartitions;

use crate::support::*;

async fn refused_task(pool: &sqlx::PgPool, model: &str, task: u32) -> Option<parsley::Refusal> {
    let r = report(pool, model).await;
    let t = r.task(task)?;
    (t.status == TaskStatus::Refused).then(|| t.refusal.clone().expect("a refused task records its reason"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_header_refuses_and_nothing_after_it_is_delivered() {
    let n = Names::new("undecodable");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let p = producer();
    produce(&p, &n.orders, 0, "o1", Some(b"{}"), None).await;
    let bad_at = produce(&p, &n.orders, 0, "o2", Some(b"{}"), Some(&[0x02, 0x00])).await;
    produce(&p, &n.orders, 0, "o3", Some(b"{}"), None).await;

    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "the task to refuse", || async { refused_task(&pool, &n.model, 0).await.is_some() })
        .await;
    let refusal = refused_task(&pool, &n.model, 0).await.unwrap();
    assert_eq!(refusal.reason, RefusalReason::UndecodableMetadata);
    assert_eq!(refusal.position, Some(bad_at));
    let r = report(&pool, &n.model).await;
    assert_eq!(r.describe(&refusal.channel.unwrap()), format!("{}/0", n.orders));
    let text = render(&r);
    assert!(text.contains(&format!("REFUSED UNDECODABLE_METADATA at {}/0@{bad_at}", n.orders)), "{text}");
    assert!(matches!(projector.run_once().await[0], StepOutcome::Refused(_)));
    assert!(document(&pool, &n.model, "o1").await.is_some(), "records before the bad one are delivered");
    assert_eq!(document(&pool, &n.model, "o2").await, None);
    assert_eq!(document(&pool, &n.model, "o3").await, None, "nothing after it on the channel");
    drop(projector);

    // A restart derives the same refusal again from the same record: identical reason and
    // position, and still nothing after it.
    let mut again = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut again, "the refusal to recur", || async {
        let r = report(&pool, &n.model).await;
        let t = r.task(0).unwrap();
        t.epoch == 2 && t.status == TaskStatus::Refused
    })
    .await;
    let recurred = refused_task(&pool, &n.model, 0).await.unwrap();
    assert_eq!(recurred, refusal);
    drive(&mut again, 2).await;
    assert_eq!(document(&pool, &n.model, "o3").await, None);
}

/// Produces one record with `headers` exactly as given (names and values as bytes).
async fn produce_raw(topic: &str, partition: i32, key: &[u8], headers: Vec<(&'static [u8], Option<Vec<u8>>)>) -> i64 {
    let (topic, key) = (topic.to_string(), key.to_vec());
    tokio::task::spawn_blocking(move || {
        let headers: Vec<(&[u8], Option<&[u8]>)> = headers.iter().map(|(k, v)| (*k, v.as_deref())).collect();
        produce_with_raw_headers(&bootstrap(), &topic, partition, &key, Some(b"{}"), &headers, TIMEOUT)
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("{e:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_causes_headers_or_a_null_one_refuse_as_undecodable_where_they_stand() {
    // The task's reader decodes the causes as it walks a record's headers: a second
    // `parsley.causes` header (even a valid one, even the same bytes) and a null value are
    // each undecodable, refused at the record, with what came before it delivered.
    let n = Names::new("dup-causes");
    create_topics(&[&n.orders, &n.payments], 2).await;
    let orders_id = topic_id(&n.orders).await;
    let pool = pool().await;
    let p = producer();
    let good = causes(&[(orders_id, 0, 0)]);
    let causes_name: &[u8] = b"parsley.causes";
    // Keys murmur2 places on the partitions they are written to.
    let [a1, a2] = ["a1", "a2"].map(|k| key_on(k, 0, 2));
    let [b1, b2] = ["b1", "b2"].map(|k| key_on(k, 1, 2));
    produce(&p, &n.payments, 0, &a1, Some(b"{}"), None).await;
    let twice_at = produce_raw(
        &n.payments,
        0,
        a2.as_bytes(),
        vec![(causes_name, Some(good.clone())), (b"x", None), (causes_name, Some(good))],
    )
    .await;
    produce(&p, &n.payments, 1, &b1, Some(b"{}"), None).await;
    let null_at = produce_raw(&n.payments, 1, b2.as_bytes(), vec![(causes_name, None)]).await;

    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "both tasks to refuse", || async {
        refused_task(&pool, &n.model, 0).await.is_some() && refused_task(&pool, &n.model, 1).await.is_some()
    })
    .await;
    for (task, at, class) in [(0, twice_at, "duplicate_header"), (1, null_at, "null_value")] {
        let refusal = refused_task(&pool, &n.model, task).await.unwrap();
        assert_eq!((refusal.reason, refusal.position), (RefusalReason::UndecodableMetadata, Some(at)), "task {task}");
        assert!(refusal.diagnosis.contains(class), "task {task}: {}", refusal.diagnosis);
    }
    assert!(document(&pool, &n.model, &a1).await.is_some() && document(&pool, &n.model, &b1).await.is_some());
    assert_eq!(document(&pool, &n.model, &a2).await, None);
    assert_eq!(document(&pool, &n.model, &b2).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_over_budget_refuses() {
    let n = Names::new("budget");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let orders_id = topic_id(&n.orders).await;
    let payments_id = topic_id(&n.payments).await;
    let pool = pool().await;
    let wide = causes(&[(orders_id, 0, 5), (payments_id, 3, 9)]);
    assert!(wide.len() > 40);
    let at = produce(&producer(), &n.payments, 0, "o1", Some(b"{}"), Some(&wide)).await;

    let mut config = n.config();
    config.projector.metadata_budget = 40;
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "the task to refuse", || async { refused_task(&pool, &n.model, 0).await.is_some() })
        .await;
    let refusal = refused_task(&pool, &n.model, 0).await.unwrap();
    assert_eq!((refusal.reason, refusal.position), (RefusalReason::MetadataBudgetExceeded, Some(at)));
    assert!(applied(&pool, &n.model).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_past_unread_positions_refuses() {
    let n = Names::new("retention");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let p = producer();
    for i in 0..2 {
        produce(&p, &n.orders, 0, &format!("o{i}"), Some(b"{}"), None).await;
    }
    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "both records to apply", || async { applied(&pool, &n.model).await.len() == 2 }).await;
    drop(projector);

    // While the projector is away, three more records arrive and retention removes two.
    let mut unread = Vec::new();
    for i in 2..5 {
        unread.push(produce(&p, &n.orders, 0, &format!("o{i}"), Some(b"{}"), None).await);
    }
    delete_records(&n.orders, 0, unread[2]).await;

    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    assert!(matches!(projector.run_once().await[0], StepOutcome::Refused(_)));
    let refusal = refused_task(&pool, &n.model, 0).await.expect("refused at start");
    assert_eq!(refusal.reason, RefusalReason::PositionsDiscardedUnread);
    assert_eq!(refusal.position, Some(unread[0]), "the first position never read");
    assert!(render(&report(&pool, &n.model).await).contains("POSITIONS_DISCARDED_UNREAD"));
    assert_eq!(applied(&pool, &n.model).await.len(), 2, "nothing after the gap was delivered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_topic_refuses() {
    let n = Names::new("recreated");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    produce(&producer(), &n.orders, 0, "o1", Some(b"{}"), None).await;
    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "the record to apply", || async { applied(&pool, &n.model).await.len() == 1 }).await;
    drop(projector);
    let old_id = topic_id(&n.orders).await;

    delete_topic(&n.orders).await;
    create_topics(&[&n.orders], 1).await;
    let new_id = topic_id(&n.orders).await;
    assert_ne!(old_id, new_id);

    let projector: ModelProjector<Recording> = start(&config, &pool, Recording::new(&config)).await;
    let refusal = projector.refusal().expect("the model is refused").clone();
    assert_eq!(refusal.reason, RefusalReason::ChannelIdentityChanged);
    assert!(projector.tasks().is_empty());
    let stored = refused_task(&pool, &n.model, 0).await.expect("recorded on the task");
    assert_eq!(stored.reason, RefusalReason::ChannelIdentityChanged);
    assert!(stored.diagnosis.contains(&old_id.to_string()) && stored.diagnosis.contains(&new_id.to_string()));
    assert!(render(&report(&pool, &n.model).await).contains("REFUSED CHANNEL_IDENTITY_CHANGED"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_partition_count_refuses() {
    let n = Names::new("width");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    produce(&producer(), &n.orders, 0, "o1", Some(b"{}"), None).await;
    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "the record to apply", || async { applied(&pool, &n.model).await.len() == 1 }).await;
    drop(projector);

    let grow = [NewPartitions::new(&n.orders, 2), NewPartitions::new(&n.payments, 2)];
    for r in admin().create_partitions(&grow, &admin_options()).await.expect("create_partitions") {
        r.expect("partitions added");
    }
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;

    let projector: ModelProjector<Recording> = start(&config, &pool, Recording::new(&config)).await;
    let refusal = projector.refusal().expect("the model is refused");
    assert_eq!(refusal.reason, RefusalReason::TaskWidthChanged);
    let stored = refused_task(&pool, &n.model, 0).await.expect("recorded on the task");
    assert_eq!(stored.reason, RefusalReason::TaskWidthChanged);
    assert!(render(&report(&pool, &n.model).await).contains("REFUSED TASK_WIDTH_CHANGED"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_that_are_not_co_partitioned_are_refused_with_a_clear_message() {
    let n = Names::new("copart");
    create_topics(&[&n.orders], 2).await;
    create_topics(&[&n.payments], 3).await;
    let pool = pool().await;
    let config = n.config();
    let projector: ModelProjector<Recording> = start(&config, &pool, Recording::new(&config)).await;
    let refusal = projector.refusal().expect("refused");
    assert_eq!(refusal.reason, RefusalReason::SubstrateMisconfigured);
    assert!(
        refusal.diagnosis.contains(&format!("{}=2", n.orders))
            && refusal.diagnosis.contains(&format!("{}=3", n.payments))
    );
    assert!(projector.tasks().is_empty());
}
