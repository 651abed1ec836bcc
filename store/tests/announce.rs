//! Every change a gateway's kept snapshots could hide is announced on the clock channel, and
//! the listener's barrier says when it might not be: on a scratch database migrated by this
//! build, against the real server.

use std::time::Duration;

use parsley_store::listen::barrier;
use parsley_store::{migrations, CLOCK_NOTIFY_CHANNEL};
use parsley_testkit::{database_url, drop_database, scratch_database};
use sqlx::postgres::PgListener;
use sqlx::{Connection as _, Executor as _};

/// The notifications heard behind the next barrier.
async fn heard(listener: &mut PgListener) -> Vec<String> {
    barrier(listener).await.unwrap();
    std::iter::from_fn(|| listener.next_buffered()).map(|n| n.payload().to_string()).collect()
}

#[tokio::test]
async fn edits_outside_a_step_are_announced_and_a_trigger_not_always_is_named() {
    let (name, url) = scratch_database("store_announce").await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    migrations::run(&pool).await.unwrap();

    let mut listener = PgListener::connect_with(&pool).await.unwrap();
    listener.listen(CLOCK_NOTIFY_CHANNEL).await.unwrap();
    assert_eq!(barrier(&mut listener).await.unwrap().unannounced, Vec::<String>::new(), "all in place after migrating");

    // A clock row written outside a step announces every model; inside a step, nothing
    // beyond what the step sends itself.
    let mut conn = pool.acquire().await.unwrap();
    conn.execute("INSERT INTO parsley.models (model, task_count, format_version) VALUES ('m', 1, 1)").await.unwrap();
    conn.execute("INSERT INTO parsley.tasks (model, task, epoch, owner) VALUES ('m', 0, 1, 'test')").await.unwrap();
    assert_eq!(heard(&mut listener).await, vec!["m".to_string()], "a model recorded");
    conn.execute(
        "INSERT INTO parsley.clock (model, task, topic_id, partition, position) \
         VALUES ('m', 0, '11111111-1111-4111-8111-111111111111', 0, 1)",
    )
    .await
    .unwrap();
    assert_eq!(heard(&mut listener).await, vec!["*".to_string()], "a clock row edited outside a step");
    let mut step = conn.begin().await.unwrap();
    step.execute("SELECT set_config('parsley.step', 'on', true)").await.unwrap();
    step.execute("UPDATE parsley.clock SET position = 2 WHERE model = 'm'").await.unwrap();
    step.commit().await.unwrap();
    assert_eq!(heard(&mut listener).await, Vec::<String>::new(), "a step's own clock write");

    // A trigger disabled, or enabled only for the origin role, is named until it fires ALWAYS.
    for (statement, expected) in [
        (
            "ALTER TABLE projection.documents DISABLE TRIGGER documents_edited",
            vec!["projection.documents.documents_edited"],
        ),
        (
            "ALTER TABLE projection.documents ENABLE TRIGGER documents_edited",
            vec!["projection.documents.documents_edited"],
        ),
        (
            "DROP TRIGGER clock_edited ON parsley.clock",
            vec!["projection.documents.documents_edited", "parsley.clock.clock_edited"],
        ),
        ("ALTER TABLE projection.documents ENABLE ALWAYS TRIGGER documents_edited", vec!["parsley.clock.clock_edited"]),
    ] {
        conn.execute(statement).await.unwrap();
        let expected: Vec<String> = expected.into_iter().map(String::from).collect();
        assert_eq!(barrier(&mut listener).await.unwrap().unannounced, expected, "after {statement}");
    }

    // Switched off and on again between two barriers, ending as it was: the list cannot tell,
    // the triggers' fingerprint does.
    let before = barrier(&mut listener).await.unwrap();
    assert_eq!(barrier(&mut listener).await.unwrap().triggers, before.triggers, "nothing touched, same fingerprint");
    conn.execute("ALTER TABLE parsley.clock DISABLE TRIGGER clock_truncated").await.unwrap();
    conn.execute("TRUNCATE parsley.clock").await.unwrap();
    conn.execute("ALTER TABLE parsley.clock ENABLE ALWAYS TRIGGER clock_truncated").await.unwrap();
    let after = barrier(&mut listener).await.unwrap();
    assert_eq!(after.unannounced, before.unannounced, "the same triggers missing as before");
    assert_ne!(after.triggers, before.triggers, "a trigger touched in between is seen");

    drop(conn);
    drop(listener);
    pool.close().await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop_database(&database_url(), &name).await.unwrap();
}
