//! A database created by the previous layout's code migrates forward without loss.
//!
//! `fixtures/previous-layout.sql` is a `pg_dump --inserts` of a database migrated by the
//! projector built from the commit before migrations moved to the workspace root (when the
//! store kept a hand-written list of `store/migrations/`), with a model's ordering state,
//! clock, documents and an idempotency key in it. The dump is restored into a scratch
//! database and brought up to date by this build's embedded migrations: sqlx refuses to run
//! if an applied migration's recorded checksum no longer matches its file, so a migration
//! renamed, renumbered or edited since fails here. Every row must survive and read back
//! through the store.

use std::collections::{BTreeMap, BTreeSet};

use parsley_store::{migrations, ordering};
use parsley_testkit::{database_url, drop_database, scratch_database};
use sqlx::{Connection as _, Row as _};

const FIXTURE: &str = include_str!("fixtures/previous-layout.sql");

/// Row counts of the tables the fixture fills.
async fn counts(conn: &mut sqlx::PgConnection) -> BTreeMap<&'static str, i64> {
    let mut out = BTreeMap::new();
    for table in [
        "parsley.models",
        "parsley.topics",
        "parsley.tasks",
        "parsley.channels",
        "parsley.frontier",
        "parsley.clock",
        "parsley.idempotency_keys",
        "projection.documents",
    ] {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}")).fetch_one(&mut *conn).await.unwrap();
        out.insert(table, n);
    }
    out
}

#[tokio::test]
async fn a_database_of_the_previous_layout_migrates_forward_without_loss() {
    let (name, url) = scratch_database("store_forward").await;

    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(FIXTURE).execute(&mut conn).await.expect("restoring the previous layout's dump");
    // The dump leaves the session's search_path empty; a new connection starts as any would.
    conn.close().await.unwrap();
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    let before = counts(&mut conn).await;
    assert_eq!(before["projection.documents"], 2, "the fixture holds documents: {before:?}");
    let recorded: BTreeSet<i64> = sqlx::query_scalar("SELECT version FROM public._sqlx_migrations WHERE success")
        .fetch_all(&mut conn)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(recorded.len(), 11, "the previous layout had applied its eleven migrations");

    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    migrations::run(&pool).await.expect("this build's migrations run on the previous layout's database");

    let applied = migrations::applied_versions(&pool).await.unwrap();
    assert_eq!(applied, migrations::expected_versions(), "every embedded migration is applied");
    assert!(recorded.is_subset(&applied), "what the previous layout applied stays applied");
    assert_eq!(counts(&mut conn).await, before, "no row was lost or added by migrating forward");

    let model = ordering::load_model(&mut conn, "shop").await.unwrap().expect("the model survives");
    assert_eq!(model.task_count, 2);
    assert_eq!(model.topics.len(), 2);
    let tasks = ordering::load_tasks(&mut conn, "shop").await.unwrap();
    assert_eq!(tasks.iter().map(|t| (t.task, t.epoch)).collect::<Vec<_>>(), vec![(0, 3), (1, 2)]);
    let doc =
        sqlx::query("SELECT doc::text, version FROM projection.documents WHERE model = 'shop' AND key = 'order-2'")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    let body: serde_json::Value = serde_json::from_str(&doc.get::<String, _>(0)).unwrap();
    assert_eq!(body, serde_json::json!({"item": "mug", "paid": 12, "status": "paid", "total": 12}));
    assert_eq!(doc.get::<i64, _>(1), 2);

    conn.close().await.unwrap();
    pool.close().await;
    drop_database(&database_url(), &name).await.unwrap();
}
