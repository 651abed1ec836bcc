//! The ordering store against the real database, statement by statement: whatever an
//! engine's steps change, loading it back restores an engine equal to the one that wrote
//! it (held records verbatim, fed_up_to, frontier, clock, removals and pruning included);
//! task rows, failures, refusals and their clearing behave as documented.

use std::time::Duration;

use parsley::channel::{ChannelId, TopicId};
use parsley::engine::{ChannelFact, EngineConfig, PersistedState, ORDERING_STATE_FORMAT};
use parsley::refusal::{Refusal, RefusalReason};
use parsley::Engine;
use parsley_projector::record::RecordData;
use parsley_store::leases;
use parsley_store::ordering::{self, LoadError, TaskStatus};
use sqlx::PgPool;

use crate::support::*;

fn ch(topic: u8, partition: u32) -> ChannelId {
    ChannelId::new(TopicId::from_bytes([topic; 16]), partition)
}

fn data(i: u8) -> RecordData {
    RecordData {
        key: Some(vec![b'k', i]),
        value: if i.is_multiple_of(2) { Some(vec![i; 3]) } else { None },
        headers: vec![("h".into(), Some(vec![i])), ("null".into(), None)],
        timestamp_ms: Some(1_700_000_000_000 + i64::from(i)),
        skipped: false,
    }
}

async fn commit(pool: &PgPool, model: &str, task: u32, engine: &mut Engine<RecordData>) {
    let changes = engine.take_changes();
    let mut tx = pool.begin().await.unwrap();
    let epoch: i64 = sqlx::query_scalar("SELECT epoch FROM parsley.tasks WHERE model = $1 AND task = $2")
        .bind(model)
        .bind(task as i32)
        .fetch_one(&mut *tx)
        .await
        .expect("task row");
    assert!(leases::lock_and_renew(&mut tx, model, task, epoch, Duration::from_secs(5)).await.unwrap());
    ordering::apply_changes(&mut tx, model, task, &changes).await.unwrap();
    tx.commit().await.unwrap();
}

async fn load(pool: &PgPool, model: &str, task: u32) -> PersistedState<RecordData> {
    let mut conn = pool.acquire().await.unwrap();
    match ordering::load_state(&mut conn, model, task, ORDERING_STATE_FORMAT as i32).await {
        Ok(s) => s,
        Err(LoadError::Refused(r)) => panic!("refused: {r}"),
        Err(LoadError::Database(e)) => panic!("{e:#}"),
    }
}

fn sorted(mut s: PersistedState<RecordData>) -> PersistedState<RecordData> {
    s.held.sort_by_key(|h| (h.channel, h.position));
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_step_writes_restores_the_same_engine() {
    let pool = pool().await;
    let model = unique("store");
    let (a, b, up) = (ch(1, 0), ch(2, 0), ch(9, 3));
    ordering::register_model(&pool, &model, 1, &[("a".into(), a.topic), ("b".into(), b.topic)]).await.unwrap();
    let row = ordering::take_task(&pool, &model, 0, "me").await.unwrap();
    assert_eq!((row.epoch, row.status), (1, TaskStatus::Running));

    let config = EngineConfig::default();
    let mut engine: Engine<RecordData> = Engine::new(config.clone(), [a, b]);
    engine.seed(a, -1).unwrap();
    engine.seed(b, -1).unwrap();
    // b@0 waits for a@1; a@0 delivers at once, carrying an upstream pair.
    let wait_for_a1 = parsley::CausalPast::from_pairs([(a, 1), (up, 40)]).encode();
    engine.receive(b, 0, &[Some(&wait_for_a1)], data(0)).unwrap();
    let up_only = parsley::CausalPast::from_pairs([(up, 7)]).encode();
    engine.receive(a, 0, &[Some(&up_only)], data(1)).unwrap();
    engine.receive(b, 1, &[], data(2)).unwrap();
    assert_eq!(engine.held_count(), 2);
    commit(&pool, &model, 0, &mut engine).await;
    assert_eq!(sorted(load(&pool, &model, 0).await), sorted(engine.snapshot()));
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(ordering::held_on_topic(&mut conn, &model, &b.topic).await.unwrap(), 2);

    // a@1 releases both held records: deletes of held rows, clock and frontier upserts.
    engine.receive(a, 1, &[], data(3)).unwrap();
    assert_eq!(engine.held_count(), 0);
    commit(&pool, &model, 0, &mut engine).await;
    assert_eq!(sorted(load(&pool, &model, 0).await), sorted(engine.snapshot()));
    assert_eq!(engine.delivered_past().get(&up), Some(40));

    // Pruning the upstream channel removes its frontier and clock rows.
    engine.prune(|c| if c.topic == up.topic { ChannelFact::TopicGone } else { ChannelFact::Unknown });
    commit(&pool, &model, 0, &mut engine).await;
    let state = load(&pool, &model, 0).await;
    assert_eq!(state.delivered.get(&up), None);
    assert_eq!(state.frontier.get(&up), None);
    assert_eq!(sorted(state.clone()), sorted(engine.snapshot()));

    // A redeclaration without `b`: its fed_up_to row goes, its clock entry stays.
    let mut narrowed = Engine::restore(config, [a], state).unwrap();
    commit(&pool, &model, 0, &mut narrowed).await;
    let state = load(&pool, &model, 0).await;
    assert!(!state.fed_up_to.contains_key(&b));
    assert_eq!(state.delivered.get(&b), Some(1));
    let rows = ordering::clock_rows(&mut conn, &model).await.unwrap();
    assert_eq!(rows.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_stored_state_is_refused_not_misread() {
    let pool = pool().await;
    let model = unique("format");
    let a = ch(1, 0);
    ordering::register_model(&pool, &model, 1, &[("a".into(), a.topic)]).await.unwrap();
    ordering::take_task(&pool, &model, 0, "me").await.unwrap();
    let mut engine: Engine<RecordData> = Engine::new(EngineConfig::default(), [a]);
    engine.seed(a, -1).unwrap();
    engine.receive(a, 0, &[], data(0)).unwrap();
    commit(&pool, &model, 0, &mut engine).await;

    // A format this build does not know.
    let mut conn = pool.acquire().await.unwrap();
    match ordering::load_state(&mut conn, &model, 0, 99).await.map(|s| Engine::restore(EngineConfig::default(), [a], s))
    {
        Ok(Err(r)) => assert_eq!(r.reason, RefusalReason::UnknownOrderingStateFormat),
        other => panic!("expected a refusal, got {:?}", other.map(|r| r.map(|_| ()))),
    }
    // Damaged causes bytes in a held row.
    sqlx::query(
        "INSERT INTO parsley.held (model, task, topic_id, partition, position, headers, causes)
         VALUES ($1, 0, $2, 0, 5, '', '\\x02')",
    )
    .bind(&model)
    .bind(ordering::uuid_of(&a.topic))
    .execute(&pool)
    .await
    .unwrap();
    match ordering::load_state(&mut conn, &model, 0, ORDERING_STATE_FORMAT as i32).await {
        Err(LoadError::Refused(r)) => {
            assert_eq!((r.reason, r.channel, r.position), (RefusalReason::UnknownOrderingStateFormat, Some(a), Some(5)))
        }
        Err(LoadError::Database(e)) => panic!("{e:#}"),
        Ok(_) => panic!("damaged state loaded"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_rows_record_epochs_failures_and_refusals() {
    let pool = pool().await;
    let model = unique("tasks");
    let a = ch(1, 0);
    ordering::register_model(&pool, &model, 2, &[("a".into(), a.topic)]).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let recorded = ordering::load_model(&mut conn, &model).await.unwrap().unwrap();
    assert_eq!(recorded.task_count, 2);
    assert_eq!(recorded.topics.get("a"), Some(&a.topic));
    // Registering again keeps the recorded identity.
    ordering::register_model(&pool, &model, 2, &[("a".into(), ch(7, 0).topic)]).await.unwrap();
    assert_eq!(ordering::load_model(&mut conn, &model).await.unwrap().unwrap().topics.get("a"), Some(&a.topic));

    let first = ordering::take_task(&pool, &model, 0, "one").await.unwrap();
    let second = ordering::take_task(&pool, &model, 0, "two").await.unwrap();
    assert_eq!((first.epoch, second.epoch, second.owner.as_str()), (1, 2, "two"));
    let lease = Duration::from_secs(5);
    assert!(leases::lock_and_renew(&mut conn, &model, 0, 2, lease).await.unwrap());
    assert!(!leases::lock_and_renew(&mut conn, &model, 0, 1, lease).await.unwrap(), "a stale epoch is fenced");
    assert!(!leases::lock_and_renew(&mut conn, &model, 1, 1, lease).await.unwrap(), "no row");

    // A fenced owner cannot record a failure; the owner can.
    assert!(!ordering::record_failure(&pool, &model, 0, 1, "stale").await.unwrap());
    assert!(ordering::record_failure(&pool, &model, 0, 2, "boom").await.unwrap());
    assert!(ordering::record_failure(&pool, &model, 0, 2, "boom again").await.unwrap());
    let t = &ordering::load_tasks(&mut conn, &model).await.unwrap()[0];
    assert_eq!((t.status, t.failures, t.last_error.as_deref()), (TaskStatus::Failing, 2, Some("boom again")));
    let mut tx = pool.begin().await.unwrap();
    ordering::record_running(&mut tx, &model, 0).await.unwrap();
    ordering::notify(&mut tx, &model, Some(0)).await.unwrap();
    tx.commit().await.unwrap();
    let t = &ordering::load_tasks(&mut conn, &model).await.unwrap()[0];
    assert_eq!((t.status, t.failures, t.last_error.clone()), (TaskStatus::Running, 0, None));

    // A model-wide refusal lands on every task, creating rows for tasks that never ran.
    let refusal = Refusal::at(RefusalReason::TaskWidthChanged, a, Some(3), "width changed");
    ordering::refuse_model(&pool, &model, 2, &refusal).await.unwrap();
    let tasks = ordering::load_tasks(&mut conn, &model).await.unwrap();
    assert_eq!(tasks.len(), 2);
    for t in &tasks {
        assert_eq!(t.status, TaskStatus::Refused);
        assert_eq!(t.refusal.as_ref(), Some(&refusal));
    }
    // A failure recorded while refused leaves the refusal in place.
    assert!(ordering::record_failure(&pool, &model, 0, 2, "ignored while refused").await.unwrap());
    assert_eq!(ordering::load_tasks(&mut conn, &model).await.unwrap()[0].status, TaskStatus::Refused);
    // A start that does not derive the refusal again marks the task running.
    let mut tx = pool.begin().await.unwrap();
    ordering::record_running(&mut tx, &model, 1).await.unwrap();
    tx.commit().await.unwrap();
    let t = &ordering::load_tasks(&mut conn, &model).await.unwrap()[1];
    assert_eq!((t.status, t.refusal.clone()), (TaskStatus::Running, None));
    let mut tx = pool.begin().await.unwrap();
    ordering::record_refusal(&mut tx, &model, 1, &Refusal::new(RefusalReason::OutOfOrderFeed, "x")).await.unwrap();
    tx.commit().await.unwrap();
    let t = &ordering::load_tasks(&mut conn, &model).await.unwrap()[1];
    assert_eq!(t.refusal.as_ref().map(|r| (r.reason, r.channel)), Some((RefusalReason::OutOfOrderFeed, None)));
}

/// The step's first statement sends the clock `NOTIFY` only when asked and only when the task
/// is locked, delivered when the transaction commits (never on a rollback), in the payload
/// every other clock notification uses.
#[tokio::test]
async fn the_lock_statement_notifies_only_when_asked_and_locked() {
    let pool = pool().await;
    let model = unique("lock-notify");
    ordering::register_model(&pool, &model, 1, &[("a".into(), ch(1, 0).topic)]).await.unwrap();
    let epoch = ordering::take_task(&pool, &model, 0, "one").await.unwrap().epoch;
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await.unwrap();
    listener.listen(parsley_store::ordering::CLOCK_NOTIFY_CHANNEL).await.unwrap();
    let lease = Duration::from_secs(5);
    let payload = format!("{model}:0");
    let lock = |epoch: i64, notify: bool, commit: bool| {
        let (pool, model) = (pool.clone(), model.clone());
        async move {
            let mut tx = pool.begin().await.unwrap();
            let locked = leases::lock_renew_and_notify(&mut tx, &model, 0, epoch, lease, notify).await.unwrap();
            if commit {
                tx.commit().await.unwrap();
            } else {
                tx.rollback().await.unwrap();
            }
            locked
        }
    };
    // Notifications of this model heard within a short wait.
    async fn heard(listener: &mut sqlx::postgres::PgListener, payload: &str) -> usize {
        let mut n = 0;
        while let Ok(Some(note)) =
            tokio::time::timeout(Duration::from_millis(300), listener.try_recv()).await.map(Result::unwrap)
        {
            if note.payload() == payload {
                n += 1;
            }
        }
        n
    }
    // Asked, locked and committed: one notification. Repeated past the prepared statement's
    // switch to a generic plan.
    for _ in 0..7 {
        assert!(lock(epoch, true, true).await);
        assert_eq!(heard(&mut listener, &payload).await, 1, "an asked notification is delivered at commit");
        assert!(lock(epoch, false, true).await);
        assert_eq!(heard(&mut listener, &payload).await, 0, "nothing is sent when not asked");
    }
    assert!(lock(epoch, true, false).await);
    assert_eq!(heard(&mut listener, &payload).await, 0, "a rolled-back step notifies nobody");
    assert!(!lock(epoch - 1, true, true).await, "a stale epoch is fenced");
    assert_eq!(heard(&mut listener, &payload).await, 0, "a fenced step notifies nobody");
}

/// Documents written inside a step (its transaction locked the task first) send no
/// notification of their own: the step's `'<model>:<task>'` is the only one. Written, edited
/// or deleted outside a step (by hand, a script), each statement notifies every model (`'*'`),
/// delivered at commit, so a gateway drops the snapshots it kept.
#[tokio::test]
async fn documents_changed_outside_a_step_notify_every_model() {
    use parsley_store::documents::{self, DocumentWrite};

    // A database of its own: in the shared one, other tests' documents written outside a
    // step notify this test's model too.
    let database = unique("edit_notify").replace('-', "_");
    parsley_testkit::create_database(&database_url(), &database).await.unwrap();
    let url = parsley_testkit::with_database(&database_url(), &database).unwrap();
    let pool = parsley_infra::pg::connect(&url, 4, TIMEOUT).await.unwrap();
    parsley_store::migrations::run(&pool).await.unwrap();
    let model = unique("edit-notify");
    ordering::register_model(&pool, &model, 1, &[("a".into(), ch(1, 0).topic)]).await.unwrap();
    let epoch = ordering::take_task(&pool, &model, 0, "one").await.unwrap().epoch;
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await.unwrap();
    listener.listen(parsley_store::ordering::CLOCK_NOTIFY_CHANNEL).await.unwrap();
    let write = |key: &'static str| {
        vec![DocumentWrite { key, doc: "{\"v\":1}".into(), channel: ch(1, 0), position: 0, applied: 1 }]
    };
    // This model's notifications heard within a short wait (other tests' models are ignored).
    let (task_payload, model_payload) = (format!("{model}:0"), parsley_store::EVERY_MODEL_PAYLOAD.to_string());
    async fn heard(listener: &mut sqlx::postgres::PgListener, wanted: &[&str]) -> Vec<String> {
        let mut got = Vec::new();
        while let Ok(Some(note)) =
            tokio::time::timeout(Duration::from_millis(300), listener.try_recv()).await.map(Result::unwrap)
        {
            if wanted.contains(&note.payload()) {
                got.push(note.payload().to_string());
            }
        }
        got
    }
    let wanted = [task_payload.as_str(), model_payload.as_str()];

    // A step: locked (notifying), then its documents written and deleted.
    for _ in 0..7 {
        let mut tx = pool.begin().await.unwrap();
        assert!(leases::lock_renew_and_notify(&mut tx, &model, 0, epoch, Duration::from_secs(5), true).await.unwrap());
        documents::write(&mut tx, &model, 0, write("k")).await.unwrap();
        documents::delete(&mut tx, &model, &["gone".to_string()]).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(heard(&mut listener, &wanted).await, vec![task_payload.clone()], "a step notifies its task only");
    }

    // Outside a step: an insert, an edit and a delete, each committed on its own.
    let mut tx = pool.begin().await.unwrap();
    documents::write(&mut tx, &model, 0, write("by-hand")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(heard(&mut listener, &wanted).await, vec![model_payload.clone()], "a document written by hand");
    sqlx::query("UPDATE projection.documents SET doc = '{\"v\":2}' WHERE model = $1 AND key = 'k'")
        .bind(&model)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(heard(&mut listener, &wanted).await, vec![model_payload.clone()], "a document edited by hand");
    sqlx::query("DELETE FROM projection.documents WHERE model = $1").bind(&model).execute(&pool).await.unwrap();
    assert_eq!(heard(&mut listener, &wanted).await, vec![model_payload.clone()], "documents deleted by hand");
    // Rolled back: nothing.
    let mut tx = pool.begin().await.unwrap();
    documents::write(&mut tx, &model, 0, write("k")).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(heard(&mut listener, &wanted).await, Vec::<String>::new(), "a rolled-back edit notifies nobody");
    // The mark is the step transaction's only: the same connection's next transaction is not a step.
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    assert!(leases::lock_renew_and_notify(&mut tx, &model, 0, epoch, Duration::from_secs(5), false).await.unwrap());
    tx.commit().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    documents::write(&mut tx, &model, 0, write("k")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(heard(&mut listener, &wanted).await, vec![model_payload.clone()], "the step's mark outlived it");
    drop((conn, listener));
    pool.close().await;
    parsley_testkit::drop_database(&database_url(), &database).await.unwrap();
}

/// A step's documents are written in statements of at most `STATEMENT_ROWS` rows: every
/// write beyond the first statement's share is done, in the step's one transaction (a
/// rollback undoes all of them), and reads and deletes of more keys than that find them all.
#[tokio::test]
async fn documents_beyond_one_statement_are_all_written_read_and_deleted() {
    use parsley_store::documents::{self, DocumentWrite, STATEMENT_ROWS};

    let pool = pool().await;
    let model = unique("statement-rows");
    let n = 2 * STATEMENT_ROWS + 5;
    let keys: Vec<String> = (0..n).map(|i| format!("k{i:05}")).collect();
    let writes = |applied: i64| -> Vec<DocumentWrite<'_>> {
        keys.iter()
            .enumerate()
            .map(|(i, key)| DocumentWrite {
                key,
                doc: format!("{{\"i\":{i},\"applied\":{applied}}}").into(),
                channel: ch(1, 0),
                position: i as i64,
                applied,
            })
            .collect()
    };
    let versions = |pool: PgPool, model: String| async move {
        sqlx::query_as::<_, (i64, i64, i64)>(
            "SELECT count(*), coalesce(min(version), 0), coalesce(max(version), 0) FROM projection.documents WHERE model = $1",
        )
        .bind(model)
        .fetch_one(&pool)
        .await
        .unwrap()
    };

    // Inserted, then replaced with their versions increased, in two transactions.
    for applied in [1, 2] {
        let mut tx = pool.begin().await.unwrap();
        documents::write(&mut tx, &model, 0, writes(applied)).await.unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(versions(pool.clone(), model.clone()).await, (n as i64, 3, 3));
    let (doc, version) = document(&pool, &model, &keys[n - 1]).await.unwrap();
    assert_eq!((doc, version), (serde_json::json!({"i": n - 1, "applied": 2}), 3));

    // Read back beyond the first statement's keys.
    let mut conn = pool.acquire().await.unwrap();
    let mut stored = documents::stored(&mut conn, &model, &keys).await.unwrap();
    stored.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(stored.len(), n);
    assert_eq!(stored[n - 1], (keys[n - 1].clone(), serde_json::json!({"i": n - 1, "applied": 2})));
    drop(conn);

    // A rolled-back step leaves every statement's rows as they were.
    let mut tx = pool.begin().await.unwrap();
    documents::write(&mut tx, &model, 0, writes(5)).await.unwrap();
    documents::delete(&mut tx, &model, &keys[..STATEMENT_ROWS + 1]).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(versions(pool.clone(), model.clone()).await, (n as i64, 3, 3));

    // Deleted, every statement's share.
    let mut tx = pool.begin().await.unwrap();
    documents::delete(&mut tx, &model, &keys).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(versions(pool.clone(), model.clone()).await, (0, 0, 0));
}

/// The documents' reads and deletes by key list are planned at each call, for the table as it
/// is then: never kept as prepared statements, whose generic plan — cached after five runs,
/// here while the new database's table holds 50 documents — looked documents up by model
/// alone and compared each with every key of the list, and went on doing so as the table
/// grew (seconds per statement at a few hundred thousand documents). The plan's cost itself
/// is the benchmark's to show; what is checked here is that no such plan can be cached.
#[tokio::test]
async fn reads_and_deletes_by_key_list_are_planned_at_each_call() {
    use parsley_store::documents;

    // A database of its own: its table starts new and small, as a new deployment's does.
    let admin = parsley_testkit::database_url();
    let name = unique("plan_growth").to_ascii_lowercase().replace(['-', '.'], "_");
    parsley_testkit::create_database(&admin, &name).await.unwrap();
    let url = parsley_testkit::with_database(&admin, &name).unwrap();
    let pool = parsley_infra::pg::connect(&url, 1, Duration::from_secs(30)).await.unwrap();
    parsley_store::migrations::run(&pool).await.unwrap();

    let model = "m";
    let keys: Vec<String> = (0..1024).map(|i| format!("k{i:05}")).collect();
    let mut conn = pool.acquire().await.unwrap();
    let insert = |from: i32, to: i32, prefix: &'static str| {
        sqlx::query(
            "INSERT INTO projection.documents (model, key, task, doc, topic_id, partition, position)
             SELECT $1, $2 || lpad(g::text, 5, '0'), 0, '{}', gen_random_uuid(), 0, g FROM generate_series($3, $4) g",
        )
        .bind(model)
        .bind(prefix)
        .bind(from)
        .bind(to)
    };
    insert(0, 49, "k").execute(&mut *conn).await.unwrap();
    // More runs on this connection than a prepared statement takes to cache a generic plan.
    for _ in 0..8 {
        assert_eq!(documents::stored(&mut conn, model, &keys).await.unwrap().len(), 50);
        documents::delete(&mut conn, model, &keys[1000..]).await.unwrap();
    }
    insert(1, 20_000, "x").execute(&mut *conn).await.unwrap();
    let mut stored = documents::stored(&mut conn, model, &keys).await.unwrap();
    stored.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        stored.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        keys[..50].iter().map(String::as_str).collect::<Vec<_>>()
    );
    documents::delete(&mut conn, model, &keys).await.unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM projection.documents WHERE model = $1 AND key LIKE 'k%'")
        .bind(model)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    // Statements this connection keeps prepared that look documents up by a key list.
    let cached = kept_prepared(&mut conn, &["%FROM projection.documents WHERE model%", "%key = ANY(%"]).await;
    drop(conn);
    pool.close().await;
    parsley_testkit::drop_database(&admin, &name).await.unwrap();
    assert_eq!(left, 0, "every listed key is deleted");
    assert!(cached.is_empty(), "kept prepared, so a generic plan can be cached: {cached:?}");
}

/// The delete of a step's released held records is planned at each call, never kept as a
/// prepared statement: a generic plan cached while the task held nothing compared every
/// held row of the task with every released pair, and went on doing so as held rows grew
/// (17 s for 500 pairs among 100 000 held rows in a scratch reproduction).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delete_of_released_held_records_is_planned_at_each_call() {
    // One connection, so the statements below ran on the connection that is asked.
    let pool = parsley_infra::pg::connect(&parsley_testkit::database_url(), 1, Duration::from_secs(30)).await.unwrap();
    let model = unique("held-plan");
    let (a, b) = (ch(1, 0), ch(2, 0));
    ordering::register_model(&pool, &model, 1, &[("a".into(), a.topic), ("b".into(), b.topic)]).await.unwrap();
    ordering::take_task(&pool, &model, 0, "me").await.unwrap();
    let mut engine: Engine<RecordData> = Engine::new(EngineConfig::default(), [a, b]);
    engine.seed(a, -1).unwrap();
    engine.seed(b, -1).unwrap();
    // More steps than a prepared statement takes to cache a generic plan, each holding a
    // record of b until a's next record releases it.
    for i in 0..8i64 {
        let wait = parsley::CausalPast::from_pairs([(a, i)]).encode();
        engine.receive(b, i, &[Some(&wait)], data(i as u8)).unwrap();
        commit(&pool, &model, 0, &mut engine).await;
        assert_eq!(engine.held_count(), 1);
        engine.receive(a, i, &[], data(i as u8)).unwrap();
        assert_eq!(engine.held_count(), 0);
        commit(&pool, &model, 0, &mut engine).await;
    }
    assert_eq!(sorted(load(&pool, &model, 0).await), sorted(engine.snapshot()));
    let cached = kept_prepared(&mut pool.acquire().await.unwrap(), &["%DELETE FROM parsley.held h%"]).await;
    pool.close().await;
    assert!(cached.is_empty(), "kept prepared, so a generic plan can be cached: {cached:?}");
}

/// The statements `conn` keeps prepared whose text matches every `LIKE` pattern of `like`
/// (this query's own text left out).
async fn kept_prepared(conn: &mut sqlx::PgConnection, like: &[&str]) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT statement FROM pg_prepared_statements
          WHERE statement NOT LIKE '%pg_prepared_statements%'
            AND (SELECT bool_and(statement LIKE p) FROM unnest($1::text[]) AS p)",
    )
    .bind(like)
    .fetch_all(conn)
    .await
    .unwrap()
}
