//! Smoke tests against the real local broker and database (`make services-up`).
//!
//! They read `PARSLEY_KAFKA_BOOTSTRAP` and `DATABASE_URL` and fail, saying how to start the
//! services, when either is unset. Every run uses fresh topic, transactional-id and channel
//! names, so runs and parallel tests do not see each other's data.

use std::time::{Duration, Instant};

use parsley::murmur2::partition_for_key;
use parsley_infra::kafka::{consumer_config, partition_offsets, producer_config, transactional_producer_config};
use parsley_infra::{describe_topics, pg, PartitionOffsets};
use parsley_testkit::{bootstrap, create_topics, database_url, delete_topic, unique, TIMEOUT};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::postgres::PgListener;

/// Describes one topic, retrying until `accept` holds (the broker's metadata may trail the
/// controller by a moment right after a create or delete).
async fn describe_until(
    name: &str,
    accept: impl Fn(&parsley_infra::TopicDescription) -> bool,
) -> parsley_infra::TopicDescription {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let last = describe_topics(&bootstrap(), &[name.to_string()], Duration::from_secs(10)).await;
        match last {
            Ok(mut d) if accept(&d[0]) => return d.remove(0),
            other if Instant::now() >= deadline => panic!("describing {name}: {other:?}"),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// A read-committed consumer assigned to `topic`/`partition` from `offset`.
fn consumer_at(topic: &str, partition: i32, offset: i64) -> StreamConsumer {
    let consumer: StreamConsumer = consumer_config(&bootstrap(), &unique("smoke-reader")).create().expect("consumer");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(offset)).unwrap();
    consumer.assign(&tpl).expect("assign");
    consumer
}

/// Receives messages until `n` have arrived or `wait` has passed, mapping each with `f`.
async fn receive<T>(
    consumer: &StreamConsumer,
    n: usize,
    wait: Duration,
    f: impl Fn(&BorrowedMessage<'_>) -> T,
) -> Vec<T> {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + wait;
    while out.len() < n {
        match tokio::time::timeout_at(deadline, consumer.recv()).await {
            Ok(Ok(m)) => out.push(f(&m)),
            Ok(Err(e)) => panic!("consumer error: {e}"),
            Err(_) => break,
        }
    }
    out
}

fn value_of(m: &BorrowedMessage<'_>) -> (i64, String) {
    (m.offset(), String::from_utf8(m.payload().unwrap_or_default().to_vec()).unwrap())
}

async fn offsets(topic: &str) -> PartitionOffsets {
    partition_offsets(&bootstrap(), topic, 0, Duration::from_secs(10)).await.expect("partition offsets")
}

/// Offsets of partition 0 once no transaction is open (last stable = high watermark), or the
/// last answer after [`TIMEOUT`].
async fn settled_offsets(topic: &str) -> PartitionOffsets {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let o = offsets(topic).await;
        if o.last_stable == o.high_watermark || Instant::now() >= deadline {
            return o;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn transactional_producer() -> FutureProducer {
    let p: FutureProducer =
        transactional_producer_config(&bootstrap(), &unique("smoke-tx")).create().expect("transactional producer");
    p.init_transactions(TIMEOUT).expect("init_transactions");
    p
}

async fn send(p: &FutureProducer, topic: &str, key: &str, value: &str) -> (i32, i64) {
    let d = p.send(FutureRecord::to(topic).key(key).payload(value), TIMEOUT).await.map_err(|(e, _)| e).expect("send");
    (d.partition, d.offset)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_ids_are_nonzero_and_change_when_a_topic_is_recreated() {
    let name = unique("smoke-topic-id");
    create_topics(&[&name], 3).await;
    let first = describe_until(&name, |d| d.partitions == 3).await;
    assert_eq!(first.name, name);
    assert_ne!(first.id, [0u8; 16], "topic ID must not be zero");

    let other = unique("smoke-topic-id-b");
    create_topics(&[&other], 1).await;
    describe_until(&other, |d| d.partitions == 1).await;
    // Several topics in one call come back in the order asked.
    let both = describe_topics(&bootstrap(), &[other.clone(), name.clone()], TIMEOUT).await.unwrap();
    assert_eq!(both.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), [other.as_str(), name.as_str()]);
    assert_eq!(both[1], first);
    assert_ne!(both[0].id, first.id);

    delete_topic(&name).await;
    create_topics(&[&name], 2).await;
    // The recreated topic is recognisable by its new width; its identity must be new too.
    let second = describe_until(&name, |d| d.partitions == 2).await;
    assert_ne!(second.id, [0u8; 16]);
    assert_ne!(second.id, first.id, "a recreated topic must get a new topic ID");
    eprintln!("{name}: {} then {}", first.id_string(), second.id_string());

    delete_topic(&name).await;
    delete_topic(&other).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describing_an_unknown_topic_is_a_clear_error() {
    let missing = unique("smoke-no-such-topic");
    let err = describe_topics(&bootstrap(), std::slice::from_ref(&missing), TIMEOUT).await.expect_err("unknown topic");
    let text = format!("{err:#}");
    assert!(text.contains(&missing) && text.contains("no such topic"), "unexpected error text: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_records_land_on_the_java_default_partition() {
    const PARTITIONS: u32 = 7;
    let topic = unique("smoke-murmur2");
    create_topics(&[&topic], PARTITIONS as i32).await;
    describe_until(&topic, |d| d.partitions == PARTITIONS).await;

    let producer: FutureProducer = producer_config(&bootstrap()).create().expect("producer");
    let mut keys: Vec<Vec<u8>> = (0..200).map(|i| format!("key-{i}").into_bytes()).collect();
    // An empty key is a key (murmur2 of no bytes), unlike a missing one.
    keys.push(Vec::new());
    keys.push(b"a".to_vec());
    keys.push(vec![0x00, 0xff, 0x80, 0x7f]);
    keys.push("clé-ünïcode-🔑".as_bytes().to_vec());
    keys.push(vec![0xab; 1000]);
    let mut seen = std::collections::BTreeSet::new();
    for key in &keys {
        let partition = producer
            .send(FutureRecord::to(&topic).key(key.as_slice()).payload("v"), TIMEOUT)
            .await
            .map_err(|(e, _)| e)
            .expect("send")
            .partition;
        assert_eq!(partition as u32, partition_for_key(key, PARTITIONS), "key {key:?} went to partition {partition}");
        seen.insert(partition);
    }
    assert_eq!(seen.len(), PARTITIONS as usize, "200 keys should reach every partition");
    delete_topic(&topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_committed_sees_committed_transactions_only() {
    let topic = unique("smoke-tx-visibility");
    create_topics(&[&topic], 1).await;
    describe_until(&topic, |d| d.partitions == 1).await;
    let producer = transactional_producer();
    let consumer = consumer_at(&topic, 0, 0);

    // An open transaction is invisible.
    producer.begin_transaction().unwrap();
    for i in 0..3 {
        send(&producer, &topic, "k", &format!("committed-{i}")).await;
    }
    producer.flush(TIMEOUT).unwrap();
    let early = receive(&consumer, 1, Duration::from_secs(2), value_of).await;
    assert!(early.is_empty(), "records of an open transaction were visible: {early:?}");

    // Commit makes it visible, in order.
    producer.commit_transaction(TIMEOUT).unwrap();
    let got = receive(&consumer, 3, TIMEOUT, value_of).await;
    assert_eq!(got, [(0, "committed-0".into()), (1, "committed-1".into()), (2, "committed-2".into())]);

    // Aborted records are skipped; the next committed record follows.
    producer.begin_transaction().unwrap();
    send(&producer, &topic, "k", "aborted-0").await;
    send(&producer, &topic, "k", "aborted-1").await;
    producer.flush(TIMEOUT).unwrap();
    producer.abort_transaction(TIMEOUT).unwrap();
    producer.begin_transaction().unwrap();
    let (_, after_offset) = send(&producer, &topic, "k", "after-abort").await;
    producer.commit_transaction(TIMEOUT).unwrap();
    let got = receive(&consumer, 1, TIMEOUT, value_of).await;
    assert_eq!(got, [(after_offset, "after-abort".to_string())]);
    let more = receive(&consumer, 1, Duration::from_secs(1), value_of).await;
    assert!(more.is_empty(), "unexpected records after the last commit: {more:?}");
    delete_topic(&topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_stable_offset_stops_at_an_open_transaction() {
    let topic = unique("smoke-lso");
    create_topics(&[&topic], 1).await;
    describe_until(&topic, |d| d.partitions == 1).await;
    let producer = transactional_producer();

    // A committed transaction: records at 0..=1, commit marker at 2.
    producer.begin_transaction().unwrap();
    send(&producer, &topic, "k", "a").await;
    send(&producer, &topic, "k", "b").await;
    producer.commit_transaction(TIMEOUT).unwrap();
    // commit_transaction returns once the coordinator has decided; the commit marker is written
    // to the partition just after, and only then does the last stable offset move.
    let settled = settled_offsets(&topic).await;
    assert_eq!(settled, PartitionOffsets { log_start: 0, last_stable: 3, high_watermark: 3 });

    // An open transaction starting at offset 3.
    producer.begin_transaction().unwrap();
    let (_, first_open) = send(&producer, &topic, "k", "c").await;
    send(&producer, &topic, "k", "d").await;
    producer.flush(TIMEOUT).unwrap();
    assert_eq!(first_open, 3);
    let open = offsets(&topic).await;
    assert_eq!(open, PartitionOffsets { log_start: 0, last_stable: 3, high_watermark: 5 });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(offsets(&topic).await, open, "the last stable offset must stay while the transaction is open");

    // Commit: records 3..=4, marker at 5; everything is stable.
    producer.commit_transaction(TIMEOUT).unwrap();
    let after = settled_offsets(&topic).await;
    assert_eq!(after, PartitionOffsets { log_start: 0, last_stable: 6, high_watermark: 6 });
    delete_topic(&topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_headers_read_back_byte_for_byte() {
    let topic = unique("smoke-headers");
    create_topics(&[&topic], 1).await;
    describe_until(&topic, |d| d.partitions == 1).await;
    let binary: Vec<u8> = vec![0x00, 0xff, 0x00, 0x7f, 0x80, 0xff, 0x00];
    let sent: Vec<(&str, Option<Vec<u8>>)> = vec![
        ("text", Some(b"hello".to_vec())),
        ("binary", Some(binary.clone())),
        ("empty", Some(Vec::new())),
        ("dup", Some(b"1".to_vec())),
        ("dup", Some(b"2".to_vec())),
        ("none", None),
        ("all-bytes", Some((0..=255u8).collect())),
    ];
    let mut headers = OwnedHeaders::new();
    for (key, value) in &sent {
        headers = headers.insert(Header { key, value: value.as_deref() });
    }
    let producer: FutureProducer = producer_config(&bootstrap()).create().expect("producer");
    producer
        .send(FutureRecord::to(&topic).key("k").payload(&binary[..]).headers(headers), TIMEOUT)
        .await
        .map_err(|(e, _)| e)
        .expect("send");

    let consumer = consumer_at(&topic, 0, 0);
    let got = receive(&consumer, 1, TIMEOUT, |m| {
        let headers = m
            .headers()
            .map(|h| h.iter().map(|h| (h.key.to_string(), h.value.map(<[u8]>::to_vec))).collect::<Vec<_>>())
            .unwrap_or_default();
        (m.payload().map(<[u8]>::to_vec), headers)
    })
    .await;
    assert_eq!(got.len(), 1, "the record did not come back");
    let (payload, headers) = &got[0];
    assert_eq!(payload.as_deref(), Some(&binary[..]));
    let expected: Vec<(String, Option<Vec<u8>>)> = sent.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    assert_eq!(headers, &expected);
    delete_topic(&topic).await;
}

/// Asserts that no notification arrives for a while.
async fn quiet(listener: &mut PgListener) {
    if let Ok(n) = tokio::time::timeout(Duration::from_millis(700), listener.recv()).await {
        panic!("unexpected notification: {:?}", n.map(|n| n.payload().to_string()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_is_delivered_at_commit_and_never_after_rollback() {
    let url = database_url();
    let pool = pg::connect(&url, 2, Duration::from_secs(10)).await.expect("connect");
    let one: i32 = sqlx::query_scalar("select 1").fetch_one(&pool).await.unwrap();
    assert_eq!(one, 1);

    let channel = unique("smoke_notify").replace('-', "_");
    let mut listener = PgListener::connect(&url).await.expect("listener");
    listener.listen(&channel).await.expect("listen");

    // Sent inside a transaction: nothing before COMMIT, delivered after.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("select pg_notify($1, 'committed')").bind(&channel).execute(&mut *tx).await.unwrap();
    quiet(&mut listener).await;
    tx.commit().await.unwrap();
    let n = tokio::time::timeout(TIMEOUT, listener.recv()).await.expect("notification after commit").unwrap();
    assert_eq!((n.channel(), n.payload()), (channel.as_str(), "committed"));

    // Rolled back: never delivered. The next committed notification is the next one seen.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("select pg_notify($1, 'rolled-back')").bind(&channel).execute(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    quiet(&mut listener).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("select pg_notify($1, 'after-rollback')").bind(&channel).execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    let n = tokio::time::timeout(TIMEOUT, listener.recv()).await.expect("notification after commit").unwrap();
    assert_eq!(n.payload(), "after-rollback");
    quiet(&mut listener).await;
}

/// A pooled connection used within `pg::CHECK_IDLE_AFTER` is handed out without a check; one
/// idle for longer is checked first, and a dead one is replaced before any statement runs.
#[tokio::test]
async fn a_pooled_connection_is_checked_only_after_the_idle_window() {
    let pool = pg::connect(&database_url(), 1, Duration::from_secs(10)).await.expect("pool");
    let admin = pg::connect(&database_url(), 1, Duration::from_secs(10)).await.expect("admin pool");
    let pid = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()").fetch_one(&pool).await
    };
    let kill = |victim: i32| {
        let admin = admin.clone();
        async move {
            let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
                .bind(victim)
                .fetch_one(&admin)
                .await
                .expect("terminate");
            assert!(killed, "the pool's session {victim} was not terminated");
            // The backend is gone once it leaves pg_stat_activity.
            let deadline = Instant::now() + TIMEOUT;
            while sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)")
                .bind(victim)
                .fetch_one(&admin)
                .await
                .expect("activity")
            {
                assert!(Instant::now() < deadline, "session {victim} did not end");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };

    // A session is terminated only once its connection is back in the pool: sqlx tests a
    // returned connection in a task of its own, and a test that met the termination would
    // close it and open another — handed out fresh, neither checked nor reused unchecked.
    let returned = |pool: &sqlx::PgPool| {
        let pool = pool.clone();
        async move {
            let deadline = Instant::now() + TIMEOUT;
            while pool.num_idle() < 1 {
                assert!(Instant::now() < deadline, "the connection never went back to the pool");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    };

    // Idle past the window: the check finds the terminated session and the pool opens a
    // new one; the statement succeeds on it.
    let first = pid(pool.clone()).await.expect("first statement");
    returned(&pool).await;
    kill(first).await;
    tokio::time::sleep(pg::CHECK_IDLE_AFTER + Duration::from_millis(300)).await;
    let second = pid(pool.clone()).await.expect("a connection idle past the window is checked and replaced");
    assert_ne!(first, second, "the terminated session was handed out again");

    // Within the window: handed out unchecked, so the statement on the terminated session
    // fails — and the pool replaces the connection for the next one. (Tried again if the
    // termination itself took so long that the connection left the window.)
    let mut victim = second;
    for attempt in 1.. {
        returned(&pool).await;
        let used = Instant::now();
        kill(victim).await;
        let outcome = pid(pool.clone()).await;
        if used.elapsed() >= pg::CHECK_IDLE_AFTER {
            assert!(attempt < 5, "terminating a session took over {:?} five times", pg::CHECK_IDLE_AFTER);
            victim = outcome.expect("a connection idle past the window is checked and replaced");
            continue;
        }
        assert!(outcome.is_err(), "a connection reused within the window was checked");
        break;
    }
    let replaced = pid(pool.clone()).await.expect("the broken connection is replaced");
    assert_ne!(replaced, victim);
}

/// `pg::Reuse` hands a released connection to the next caller as it is (the same session),
/// sends one dropped without a release back to the pool (whose test ends the transaction it
/// left), keeps at most `keep` connections out so the pool's other users are never starved,
/// and gives a kept connection idle past `pg::CHECK_IDLE_AFTER` back to the pool, which
/// replaces it if it died meanwhile.
#[tokio::test]
async fn reused_connections_go_from_caller_to_caller_within_their_bound() {
    async fn pid(conn: &mut sqlx::PgConnection) -> Result<i32, sqlx::Error> {
        sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(conn).await
    }
    // A second is the wait of a caller beyond the bound, and long enough for the pool's test
    // of a returned connection on a loaded machine.
    let pool = pg::connect(&database_url(), 2, Duration::from_secs(1)).await.expect("pool");
    let admin = pg::connect(&database_url(), 1, Duration::from_secs(10)).await.expect("admin pool");
    let reuse = pg::Reuse::new(pool.clone(), 1, Duration::from_secs(1));

    // Released: the next caller gets the same session.
    let mut conn = reuse.acquire().await.expect("acquire");
    let first = pid(&mut conn).await.expect("statement");
    conn.release();
    assert_eq!(reuse.idle(), 1, "a released connection is kept");
    let mut conn = reuse.acquire().await.expect("acquire");
    assert_eq!(reuse.idle(), 0);
    assert_eq!(pid(&mut conn).await.expect("statement"), first, "the released session was not handed on");

    // At most `keep` out: another caller waits and times out, while the pool still serves
    // its other users.
    let waited = Instant::now();
    let refused = reuse.acquire().await.err().expect("a second connection beyond keep = 1");
    assert!(matches!(refused, sqlx::Error::PoolTimedOut), "{refused:?}");
    assert!(waited.elapsed() >= Duration::from_millis(900), "gave up after {:?}", waited.elapsed());
    let mut other = pool.acquire().await.expect("the pool's other user is served");
    assert_ne!(pid(&mut other).await.expect("statement"), first);
    drop(other);

    // Dropped inside a transaction without a release (as a cancelled request drops it):
    // back to the pool, whose test ends the transaction before the session serves anyone.
    let dropped = pid(&mut conn).await.expect("statement");
    {
        let mut tx = sqlx::Connection::begin(&mut *conn).await.expect("begin");
        sqlx::query("CREATE TEMP TABLE left_behind (x int)").execute(&mut *tx).await.expect("create");
    }
    drop(conn);
    assert_eq!(reuse.idle(), 0, "a connection dropped without a release was kept");
    let mut seen = false;
    for _ in 0..10 {
        let mut conn = reuse.acquire().await.expect("acquire");
        let (session, clean): (i32, bool) = sqlx::query_as(
            "SELECT pg_backend_pid(), pg_current_xact_id_if_assigned() IS NULL AND to_regclass('pg_temp.left_behind') IS NULL",
        )
        .fetch_one(&mut *conn)
        .await
        .expect("statement");
        assert!(clean, "session {session} was handed out inside the transaction a dropped caller left");
        seen |= session == dropped;
        if seen {
            break;
        }
        drop(conn); // to the pool, which hands out its sessions in turn
    }
    assert!(seen, "the dropped session {dropped} never came back from the pool");

    // Kept past the window: given back to the pool, which finds the session dead and opens
    // another.
    let mut conn = reuse.acquire().await.expect("acquire");
    let kept = pid(&mut conn).await.expect("statement");
    conn.release();
    let killed: bool =
        sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(kept).fetch_one(&admin).await.expect("terminate");
    assert!(killed);
    tokio::time::sleep(pg::CHECK_IDLE_AFTER + Duration::from_millis(300)).await;
    let mut conn = reuse.acquire().await.expect("a connection past the window");
    assert_eq!(reuse.idle(), 0, "the connection idle past the window stayed kept");
    let now = pid(&mut conn).await.expect("the dead session was replaced before any statement");
    assert_ne!(now, kept);

    // A quiet path's kept connection goes back to the pool when swept, not before.
    conn.release();
    assert_eq!(reuse.give_back_idle(), 0, "a connection within the window was given back");
    tokio::time::sleep(pg::CHECK_IDLE_AFTER + Duration::from_millis(300)).await;
    assert_eq!(reuse.give_back_idle(), 1);
    assert_eq!(reuse.idle(), 0);

    // At shutdown every kept connection goes back, and the pool's close completes.
    reuse.acquire().await.expect("acquire").release();
    assert_eq!(reuse.give_back_all(), 1);
    tokio::time::timeout(Duration::from_secs(10), pool.close())
        .await
        .expect("the pool's close waited on a kept connection");
}
