//! The clock rows after a run equal the delivered past computed independently here: per
//! task, the pointwise maximum over every delivered record of its own coordinate and every
//! pair it carried. The meet query agrees with the rows, and commits NOTIFY the gateway.

use std::collections::BTreeMap;

use parsley::channel::{ChannelId, Position, TopicId};
use parsley_store::ordering::{self, CLOCK_NOTIFY_CHANNEL};
use sqlx::postgres::PgListener;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_rows_equal_the_delivered_past() {
    const PARTITIONS: u32 = 2;
    let n = Names::new("clock");
    create_topics(&[&n.orders, &n.payments], PARTITIONS as i32).await;
    let orders = topic_id(&n.orders).await;
    let payments = topic_id(&n.payments).await;
    let upstream = TopicId::from_bytes([0x5a; 16]); // a channel no task receives
    let pool = pool().await;
    let mut listener = PgListener::connect(&database_url()).await.unwrap();
    listener.listen(CLOCK_NOTIFY_CHANNEL).await.unwrap();

    let p = producer();
    // expected[(task, channel)] = delivered past position
    let mut expected: BTreeMap<(u32, ChannelId), Position> = BTreeMap::new();
    let mut merge = |task: u32, channel: ChannelId, position: Position| {
        let e = expected.entry((task, channel)).or_insert(position);
        *e = (*e).max(position);
    };
    let mut last_order: BTreeMap<u32, i64> = BTreeMap::new();
    for i in 0..24u32 {
        let part = i % PARTITIONS;
        let key = key_on(&format!("k{i}"), part, PARTITIONS);
        if i % 3 != 2 {
            let at = produce(&p, &n.orders, part as i32, &key, Some(format!("{{\"i\":{i}}}").as_bytes()), None).await;
            merge(part, ChannelId::new(orders, part), at);
            last_order.insert(part, at);
        } else {
            // A payment carrying its order, an upstream pair and, when there is one, the
            // other partition's latest order (a channel this task does not receive).
            let mut pairs = vec![(upstream, i % 4, i64::from(i) * 7)];
            if let Some(at) = last_order.get(&part) {
                pairs.push((orders, part, *at));
            }
            let other = (part + 1) % PARTITIONS;
            if let Some(at) = last_order.get(&other) {
                pairs.push((orders, other, *at));
            }
            let header = causes(&pairs);
            let at = produce(&p, &n.payments, part as i32, &key, Some(br#"{"paid":true}"#), Some(&header)).await;
            merge(part, ChannelId::new(payments, part), at);
            for (t, q, o) in pairs {
                merge(part, ChannelId::new(t, q), o);
            }
        }
    }

    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive_until(&mut projector, "every record to apply", || async { applied(&pool, &n.model).await.len() == 24 }).await;

    let mut conn = pool.acquire().await.unwrap();
    let rows = ordering::clock_rows(&mut conn, &n.model).await.unwrap();
    let got: BTreeMap<(u32, ChannelId), Position> = rows.iter().map(|r| ((r.task, r.channel), r.position)).collect();
    assert_eq!(got, expected);

    // The meet: per channel, the minimum over the tasks recording it, and how many do.
    let mut meet: BTreeMap<ChannelId, (Position, u32)> = BTreeMap::new();
    for ((_, channel), position) in &expected {
        let e = meet.entry(*channel).or_insert((*position, 0));
        e.0 = e.0.min(*position);
        e.1 += 1;
    }
    let got_meet: BTreeMap<ChannelId, (Position, u32)> =
        ordering::clock_meet(&mut conn, &n.model).await.unwrap().into_iter().map(|(c, p, k)| (c, (p, k))).collect();
    assert_eq!(got_meet, meet);

    // Commits notified the gateway with `<model>:<task>`.
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < PARTITIONS as usize {
        let note = tokio::time::timeout(TIMEOUT, listener.recv()).await.expect("a notification").unwrap();
        if let Some(task) = note.payload().strip_prefix(&format!("{}:", n.model)) {
            seen.insert(task.to_string());
        }
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec!["0".to_string(), "1".to_string()]);
}
