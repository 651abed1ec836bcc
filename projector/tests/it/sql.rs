//! The SQL projection (`projection = "sql"`) and models' own migrations, through the real
//! broker and database: every named parameter bound as documented, statements run in
//! delivery order and tombstones run their own; a check constraint or a value that is not
//! JSON refuses `PROJECTION_REJECTED` naming the statement and the record, or is
//! dead-lettered; so does a trigger's `RAISE EXCEPTION` (SQLSTATE class `P0`), which `skip`
//! then moves past; a migrations folder applied once with its own bookkeeping (a re-run does
//! nothing, an edited or missing applied file is refused by name, a failing file leaves
//! nothing behind, two instances at once apply each file once, the project's
//! `_sqlx_migrations` untouched).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parsley::refusal::RefusalReason;
use parsley_projector::builder::apply_model_migrations;
use parsley_projector::skip::{skip, SkipRequest};
use parsley_projector::SqlProjection;
use parsley_settings::config::{Apply, Config, OnRejected, SQL_PROJECTION};
use parsley_store::model_migrations::{self, Applied};
use parsley_store::ordering::TaskStatus;
use parsley_store::StoreError;
use rdkafka::admin::{AlterConfig, ResourceSpecifier};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::{PgPool, Row as _};

use crate::support::*;

/// A schema name of its own for a test (the test's tables live in it).
pub fn schema(prefix: &str) -> String {
    unique(prefix).replace('-', "_")
}

/// A fresh migrations folder holding `files` (name, text).
pub fn migrations_folder(name: &str, files: &[(&str, String)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("parsley-it-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (file, text) in files {
        std::fs::write(dir.join(file), text).unwrap();
    }
    dir
}

/// A `sql` model receiving `topics` (name, statements, tombstone statements), with its
/// migrations folder.
fn sql_config(model: &str, dir: &Path, topics: &[(&str, Vec<String>, Vec<String>)]) -> Config {
    let names: Vec<(&str, Apply)> = topics.iter().map(|(t, _, _)| (*t, Apply::Replace)).collect();
    let mut c = config(model, &names);
    let m = &mut c.models[0];
    m.projection = SQL_PROJECTION.to_string();
    m.migrations = Some(dir.display().to_string());
    for (t, (_, statements, tombstone)) in m.topics.iter_mut().zip(topics) {
        t.statements = statements.clone();
        t.tombstone_statements = tombstone.clone();
    }
    c.validate().unwrap_or_else(|e| panic!("{e:#}"));
    c
}

/// Starts the model's SQL projection after applying its migrations.
async fn start_sql(config: &Config, pool: &PgPool) -> parsley_projector::ModelProjector<SqlProjection> {
    apply_model_migrations(pool, &config.models[0]).await.unwrap_or_else(|e| panic!("{e:#}"));
    let projection = SqlProjection::from_model(&config.models[0]).unwrap();
    start(config, pool, Arc::new(projection)).await
}

/// Produces one record with any key (or none), headers and timestamp; returns its offset.
async fn produce_record(
    p: &FutureProducer,
    topic: &str,
    key: Option<&str>,
    value: Option<&[u8]>,
    headers: &[(&str, Option<&[u8]>)],
    timestamp_ms: Option<i64>,
) -> i64 {
    let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic).partition(0);
    if let Some(k) = key {
        record = record.key(k);
    }
    if let Some(v) = value {
        record = record.payload(v);
    }
    if let Some(ts) = timestamp_ms {
        record = record.timestamp(ts);
    }
    let mut owned = OwnedHeaders::new();
    for (name, value) in headers {
        owned = owned.insert(Header { key: name, value: *value });
    }
    record = record.headers(owned);
    p.send(record, TIMEOUT).await.map_err(|(e, _)| e).expect("producing").offset
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_parameter_is_bound_and_statements_run_in_delivery_order() {
    let n = Names::new("sql-params");
    let s = schema("sqlparams");
    create_topics(&[&n.orders], 1).await;
    let pool = pool().await;
    let dir = migrations_folder(
        &s,
        &[(
            "1_create_tables.sql",
            format!(
                "CREATE SCHEMA {s};
                 CREATE TABLE {s}.seen (id text PRIMARY KEY, key_bytes bytea, value jsonb, value_bytes bytea,
                   topic text, part int4, pos int8, ts timestamptz, headers jsonb);
                 CREATE TABLE {s}.log (seq bigserial PRIMARY KEY, id text, pos int8);"
            ),
        )],
    );
    let config = sql_config(
        &n.model,
        &dir,
        &[(
            &n.orders,
            vec![
                format!(
                    "INSERT INTO {s}.seen VALUES (:key, :key_bytes, :value, :value_bytes, :topic, :partition, :offset, \
                     :timestamp, :headers)"
                ),
                // A cast after a parameter, and a name used twice.
                format!("INSERT INTO {s}.log (id, pos) VALUES (:key::text, :offset) -- :value is not read here"),
            ],
            vec![format!("DELETE FROM {s}.seen WHERE id = :key AND topic = :topic")],
        )],
    );

    let p = producer();
    let a_at = produce_record(
        &p,
        &n.orders,
        Some("a"),
        Some(br#"{"n": 1}"#),
        &[("h1", Some(b"v1")), ("h2", None)],
        Some(1_700_000_000_123),
    )
    .await;
    let orders_id = topic_id(&n.orders).await;
    let b_causes = causes(&[(orders_id, 0, a_at)]);
    let b_at =
        produce_record(&p, &n.orders, Some("b"), Some(br#"{"n": 2}"#), &[("parsley.causes", Some(&b_causes))], None)
            .await;
    let c_at = produce_record(&p, &n.orders, Some("c"), Some(b"{}"), &[], None).await;
    produce_record(&p, &n.orders, Some("c"), None, &[], None).await;

    let mut projector = start_sql(&config, &pool).await;
    let log = format!("SELECT count(*) FROM {s}.log");
    let c_gone = format!("SELECT count(*) FROM {s}.seen WHERE id = 'c'");
    drive_until(&mut projector, "every record projected", || async {
        count(&pool, &log).await == 3 && count(&pool, &c_gone).await == 0
    })
    .await;

    let row = sqlx::query(&format!(
        "SELECT key_bytes, value, value_bytes, topic, part, pos, (extract(epoch FROM ts) * 1000)::int8, headers
         FROM {s}.seen WHERE id = 'a'"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(row.get::<Vec<u8>, _>(0), b"a");
    assert_eq!(row.get::<serde_json::Value, _>(1), serde_json::json!({"n": 1}));
    assert_eq!(row.get::<Vec<u8>, _>(2), br#"{"n": 1}"#, "the value's bytes as produced");
    assert_eq!(row.get::<String, _>(3), n.orders);
    assert_eq!(row.get::<i32, _>(4), 0);
    assert_eq!(row.get::<i64, _>(5), a_at);
    assert_eq!(row.get::<i64, _>(6), 1_700_000_000_123);
    assert_eq!(row.get::<serde_json::Value, _>(7), serde_json::json!({"h1": "v1", "h2": null}));
    let headers: serde_json::Value =
        sqlx::query_scalar(&format!("SELECT headers FROM {s}.seen WHERE id = 'b'")).fetch_one(&pool).await.unwrap();
    assert_eq!(headers, serde_json::json!({}), "parsley.causes is not an application header");
    let order: Vec<(String, i64)> =
        sqlx::query_as(&format!("SELECT id, pos FROM {s}.log ORDER BY seq")).fetch_all(&pool).await.unwrap();
    assert_eq!(order, [("a".to_string(), a_at), ("b".to_string(), b_at), ("c".to_string(), c_at)]);
    let r = report(&pool, &n.model).await;
    assert_eq!(r.task(0).unwrap().status, TaskStatus::Running);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_constraint_refuses_projection_rejected_naming_the_statement() {
    let (n, s, pool, config) = orders_with_a_check("sql-check", "sqlcheck").await;
    let p = producer();
    produce(&p, &n.orders, 0, "o1", Some(br#"{"amount": 5}"#), None).await;
    let bad_at = produce(&p, &n.orders, 0, "o2", Some(br#"{"amount": -1}"#), None).await;
    produce(&p, &n.orders, 0, "o3", Some(br#"{"amount": 7}"#), None).await;

    let mut projector = start_sql(&config, &pool).await;
    drive_until(&mut projector, "the task to refuse", || async {
        report(&pool, &n.model).await.task(0).is_some_and(|t| t.status == TaskStatus::Refused)
    })
    .await;
    let refusal = report(&pool, &n.model).await.task(0).unwrap().refusal.clone().unwrap();
    assert_eq!(refusal.reason, RefusalReason::ProjectionRejected, "{refusal}");
    assert_eq!(refusal.position, Some(bad_at), "{refusal}");
    let coordinate = format!("{}/0@{bad_at}", n.orders);
    for part in [coordinate.as_str(), "statements[0]", "23514", "orders_amount_check"] {
        assert!(refusal.diagnosis.contains(part), "{part:?} missing from: {}", refusal.diagnosis);
    }
    assert_eq!(count(&pool, &format!("SELECT count(*) FROM {s}.orders")).await, 1, "only what came before");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_records_are_dead_lettered_and_the_rest_applied() {
    let (n, s, pool, mut config) = orders_with_a_check("sql-dead", "sqldead").await;
    config.models[0].on_rejected = OnRejected::DeadLetter;
    let p = producer();
    produce(&p, &n.orders, 0, "o1", Some(br#"{"amount": 5}"#), None).await;
    let negative_at = produce(&p, &n.orders, 0, "o2", Some(br#"{"amount": -1}"#), None).await;
    let not_json_at = produce(&p, &n.orders, 0, "o3", Some(b"not json"), None).await;
    produce(&p, &n.orders, 0, "o4", Some(br#"{"amount": 7}"#), None).await;

    let mut projector = start_sql(&config, &pool).await;
    let orders = format!("SELECT count(*) FROM {s}.orders");
    drive_until(&mut projector, "the good records applied", || async { count(&pool, &orders).await == 2 }).await;
    let dead: Vec<(i64, String)> =
        sqlx::query_as("SELECT position, reason FROM parsley.dead_letters WHERE model = $1 ORDER BY position")
            .bind(&n.model)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert_eq!(dead[0].0, negative_at);
    assert!(dead[0].1.contains("statements[0]") && dead[0].1.contains("23514"), "{}", dead[0].1);
    assert_eq!(dead[1].0, not_json_at);
    assert!(dead[1].1.contains("not JSON") && !dead[1].1.contains("not json"), "{}", dead[1].1);
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().status, TaskStatus::Running);
}

/// A SQL model over one topic of one partition inserting into `<schema>.orders`, whose
/// `amount` must not be negative: its names, schema, pool and configuration.
async fn orders_with_a_check(prefix: &str, schema_prefix: &str) -> (Names, String, PgPool, Config) {
    let n = Names::new(prefix);
    let s = schema(schema_prefix);
    create_topics(&[&n.orders], 1).await;
    let pool = pool().await;
    let dir = migrations_folder(
        &s,
        &[(
            "1_create_orders.sql",
            format!(
                "CREATE SCHEMA {s}; CREATE TABLE {s}.orders (id text PRIMARY KEY, amount numeric CHECK (amount >= 0));"
            ),
        )],
    );
    let config = sql_config(
        &n.model,
        &dir,
        &[(&n.orders, vec![format!("INSERT INTO {s}.orders VALUES (:key, (:value->>'amount')::numeric)")], vec![])],
    );
    (n, s, pool, config)
}

/// A SQL model like [`orders_with_a_check`] whose table has a trigger raising an exception
/// (SQLSTATE P0001) for an amount over 100.
async fn orders_with_a_trigger(prefix: &str, schema_prefix: &str) -> (Names, String, PgPool, Config) {
    let n = Names::new(prefix);
    let s = schema(schema_prefix);
    create_topics(&[&n.orders], 1).await;
    let pool = pool().await;
    let dir = migrations_folder(
        &s,
        &[(
            "1_create_orders.sql",
            format!(
                "CREATE SCHEMA {s}; CREATE TABLE {s}.orders (id text PRIMARY KEY, amount numeric);
                 CREATE FUNCTION {s}.at_most_100() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN
                   IF NEW.amount > 100 THEN RAISE EXCEPTION 'an order over the limit'; END IF;
                   RETURN NEW;
                 END $$;
                 CREATE TRIGGER at_most_100 BEFORE INSERT ON {s}.orders
                   FOR EACH ROW EXECUTE FUNCTION {s}.at_most_100();"
            ),
        )],
    );
    let config = sql_config(
        &n.model,
        &dir,
        &[(&n.orders, vec![format!("INSERT INTO {s}.orders VALUES (:key, (:value->>'amount')::numeric)")], vec![])],
    );
    (n, s, pool, config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_s_exception_refuses_projection_rejected_and_skip_moves_past_it() {
    let (n, s, pool, config) = orders_with_a_trigger("sql-raise", "sqlraise").await;
    let p = producer();
    produce(&p, &n.orders, 0, "o1", Some(br#"{"amount": 5}"#), None).await;
    let bad_at = produce(&p, &n.orders, 0, "o2", Some(br#"{"amount": 500}"#), None).await;
    produce(&p, &n.orders, 0, "o3", Some(br#"{"amount": 7}"#), None).await;

    let mut projector = start_sql(&config, &pool).await;
    drive_until(&mut projector, "the task to refuse", || async {
        report(&pool, &n.model).await.task(0).is_some_and(|t| t.status == TaskStatus::Refused)
    })
    .await;
    let refusal = report(&pool, &n.model).await.task(0).unwrap().refusal.clone().unwrap();
    assert_eq!(refusal.reason, RefusalReason::ProjectionRejected, "{refusal}");
    assert_eq!(refusal.position, Some(bad_at), "{refusal}");
    let coordinate = format!("{}/0@{bad_at}", n.orders);
    for part in [coordinate.as_str(), "statements[0]", "P0001", "an order over the limit"] {
        assert!(refusal.diagnosis.contains(part), "{part:?} missing from: {}", refusal.diagnosis);
    }
    let orders = format!("SELECT count(*) FROM {s}.orders");
    assert_eq!(count(&pool, &orders).await, 1, "only what came before");

    let request = SkipRequest {
        model: n.model.clone(),
        topic: n.orders.clone(),
        partition: 0,
        position: bad_at,
        reason: "an order over the limit".to_string(),
        by: "it-test".to_string(),
    };
    skip(&config.kafka, &pool, &request).await.unwrap_or_else(|e| panic!("{e}"));
    drop(projector);
    let mut projector = start_sql(&config, &pool).await;
    drive_until(&mut projector, "the record after the skipped one", || async { count(&pool, &orders).await == 2 })
        .await;
    let ids: Vec<String> =
        sqlx::query_scalar(&format!("SELECT id FROM {s}.orders ORDER BY id")).fetch_all(&pool).await.unwrap();
    assert_eq!(ids, ["o1", "o3"]);
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().status, TaskStatus::Running);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_s_exception_is_dead_lettered_under_the_dead_letter_policy() {
    let (n, s, pool, mut config) = orders_with_a_trigger("sql-raise-dead", "sqlraisedead").await;
    config.models[0].on_rejected = OnRejected::DeadLetter;
    let p = producer();
    produce(&p, &n.orders, 0, "o1", Some(br#"{"amount": 5}"#), None).await;
    let bad_at = produce(&p, &n.orders, 0, "o2", Some(br#"{"amount": 500}"#), None).await;
    produce(&p, &n.orders, 0, "o3", Some(br#"{"amount": 7}"#), None).await;

    let mut projector = start_sql(&config, &pool).await;
    let orders = format!("SELECT count(*) FROM {s}.orders");
    drive_until(&mut projector, "the good records applied", || async { count(&pool, &orders).await == 2 }).await;
    let dead: Vec<(i64, String)> =
        sqlx::query_as("SELECT position, reason FROM parsley.dead_letters WHERE model = $1 ORDER BY position")
            .bind(&n.model)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, bad_at);
    assert!(dead[0].1.contains("P0001") && dead[0].1.contains("an order over the limit"), "{}", dead[0].1);
    assert_eq!(report(&pool, &n.model).await.task(0).unwrap().status, TaskStatus::Running);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parameter_that_cannot_be_encoded_refuses_projection_rejected() {
    let n = Names::new("sql-encode");
    let s = schema("sqlencode");
    create_topics(&[&n.orders], 1).await;
    let pool = pool().await;
    let dir = migrations_folder(
        &s,
        &[(
            "1_create_seen.sql",
            format!("CREATE SCHEMA {s}; CREATE TABLE {s}.seen (id text PRIMARY KEY, ts timestamptz);"),
        )],
    );
    let config = sql_config(
        &n.model,
        &dir,
        &[(&n.orders, vec![format!("INSERT INTO {s}.seen VALUES (:key, :timestamp)")], vec![])],
    );
    // The broker refuses timestamps far in the future unless the topic allows them.
    let allow = AlterConfig::new(ResourceSpecifier::Topic(&n.orders))
        .set("message.timestamp.after.max.ms", "9223372036854775807");
    let altered = admin().alter_configs(&[allow], &admin_options()).await.expect("alter_configs request");
    assert!(altered.iter().all(Result::is_ok), "{altered:?}");
    let p = producer();
    produce_record(&p, &n.orders, Some("a"), Some(b"{}"), &[], Some(1_700_000_000_000)).await;
    // Milliseconds whose microseconds since 2000 do not fit in 64 bits: `:timestamp` cannot
    // be encoded as `timestamptz`.
    let far =
        || FutureRecord::<'_, str, [u8]>::to(&n.orders).partition(0).key("b").payload(b"{}").timestamp(i64::MAX / 100);
    let deadline = std::time::Instant::now() + TIMEOUT;
    let far_at = loop {
        // The topic's new setting reaches the broker's log shortly after the answer.
        match p.send(far(), TIMEOUT).await {
            Ok(delivered) => break delivered.offset,
            Err((e, _)) if std::time::Instant::now() < deadline => {
                eprintln!("producing far in the future: {e}, retrying");
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            Err((e, _)) => panic!("producing far in the future: {e}"),
        }
    };

    let mut projector = start_sql(&config, &pool).await;
    drive_until(&mut projector, "the task to refuse", || async {
        report(&pool, &n.model).await.task(0).is_some_and(|t| t.status == TaskStatus::Refused)
    })
    .await;
    let refusal = report(&pool, &n.model).await.task(0).unwrap().refusal.clone().unwrap();
    assert_eq!(refusal.reason, RefusalReason::ProjectionRejected, "{refusal}");
    assert_eq!(refusal.position, Some(far_at), "{refusal}");
    for part in ["statements[0]", "could not be encoded", "timestamp out of range"] {
        assert!(refusal.diagnosis.contains(part), "{part:?} missing from: {}", refusal.diagnosis);
    }
    assert_eq!(count(&pool, &format!("SELECT count(*) FROM {s}.seen")).await, 1, "only what came before");
}

/// The project's migrations as recorded: (version, checksum) of every row.
async fn project_migrations(pool: &PgPool) -> Vec<(i64, Vec<u8>)> {
    sqlx::query_as("SELECT version, checksum FROM public._sqlx_migrations ORDER BY version")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn run_folder(pool: &PgPool, model: &str, dir: &Path) -> Result<Applied, StoreError> {
    let files = model_migrations::read_folder(dir)?;
    model_migrations::run(pool, model, &files).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_s_migrations_are_applied_once_with_their_own_bookkeeping() {
    let pool = pool().await;
    let model = unique("migrations");
    let s = schema("migs");
    let before = project_migrations(&pool).await;
    let first = format!("CREATE SCHEMA {s};\nCREATE TABLE {s}.t (id int PRIMARY KEY);\n");
    let dir = migrations_folder(
        &s,
        &[("1_create_t.sql", first.clone()), ("2_add_name.sql", format!("ALTER TABLE {s}.t ADD COLUMN name text;"))],
    );

    let applied = run_folder(&pool, &model, &dir).await.unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(applied, Applied { applied: vec!["1_create_t.sql".into(), "2_add_name.sql".into()], already: 0 });
    sqlx::query(&format!("INSERT INTO {s}.t (id, name) VALUES (1, 'x')")).execute(&pool).await.unwrap();
    let again = run_folder(&pool, &model, &dir).await.unwrap();
    assert_eq!(again, Applied { applied: vec![], already: 2 }, "a re-run is a no-op");
    let recorded: Vec<(i64, String)> =
        sqlx::query_as("SELECT version, name FROM parsley.model_migrations WHERE model = $1 ORDER BY version")
            .bind(&model)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(recorded, [(1, "1_create_t.sql".to_string()), (2, "2_add_name.sql".to_string())]);
    assert_eq!(project_migrations(&pool).await, before, "the project's _sqlx_migrations are untouched");

    // An applied file edited: refused by name, nothing run.
    std::fs::write(dir.join("1_create_t.sql"), format!("{first}-- an afterthought\n")).unwrap();
    let err = format!("{:#}", run_folder(&pool, &model, &dir).await.unwrap_err());
    assert!(err.contains("1_create_t.sql") && err.contains("changed"), "{err}");
    std::fs::write(dir.join("1_create_t.sql"), &first).unwrap();

    // An applied file gone: refused by name.
    std::fs::rename(dir.join("2_add_name.sql"), dir.join("2_add_name.sql.off")).unwrap();
    let err = format!("{:#}", run_folder(&pool, &model, &dir).await.unwrap_err());
    assert!(err.contains("2_add_name.sql") && err.contains("no longer"), "{err}");
    std::fs::rename(dir.join("2_add_name.sql.off"), dir.join("2_add_name.sql")).unwrap();

    // A failing file: named, rolled back whole, not recorded; fixed, it applies.
    std::fs::write(dir.join("3_broken.sql"), format!("CREATE TABLE {s}.u (id int);\nSELEC 1;\n")).unwrap();
    let err = format!("{:#}", run_folder(&pool, &model, &dir).await.unwrap_err());
    assert!(err.contains("3_broken.sql"), "{err}");
    let u = format!("SELECT count(*) FROM information_schema.tables WHERE table_schema = '{s}' AND table_name = 'u'");
    assert_eq!(count(&pool, &u).await, 0, "the failed file's first statement was rolled back");
    std::fs::write(dir.join("3_broken.sql"), format!("CREATE TABLE {s}.u (id int);\nSELECT 1;\n")).unwrap();
    let fixed = run_folder(&pool, &model, &dir).await.unwrap();
    assert_eq!(fixed, Applied { applied: vec!["3_broken.sql".into()], already: 2 });
    assert_eq!(count(&pool, &u).await, 1);
    assert_eq!(project_migrations(&pool).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_at_once_apply_each_file_once() {
    let pool = pool().await;
    let model = unique("migrations-race");
    let s = schema("migrace");
    let dir = migrations_folder(
        &s,
        &[
            ("1_schema.sql", format!("CREATE SCHEMA {s};")),
            ("2_table.sql", format!("CREATE TABLE {s}.t (id int); SELECT pg_sleep(0.2);")),
        ],
    );
    let (a, b) = tokio::join!(run_folder(&pool, &model, &dir), run_folder(&pool, &model, &dir));
    let (a, b) = (a.unwrap_or_else(|e| panic!("{e:#}")), b.unwrap_or_else(|e| panic!("{e:#}")));
    let mut applied: Vec<String> = a.applied.into_iter().chain(b.applied).collect();
    applied.sort();
    assert_eq!(applied, ["1_schema.sql", "2_table.sql"], "each file once, by one of them");
}

/// Two models whose migrations create the same objects (a shared schema and view, with
/// `IF NOT EXISTS` and `OR REPLACE`), started together: both apply their files. Postgres's
/// `IF NOT EXISTS` does not hold against a concurrent twin (the second waits on the first's
/// catalog row, then fails on it), so model migrations take one lock for every model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_creating_the_same_objects_at_once_both_apply() {
    let pool = pool().await;
    let s = schema("migshared");
    let file = format!(
        "CREATE SCHEMA IF NOT EXISTS {s};\nSELECT pg_sleep(0.3);\n\
         CREATE OR REPLACE VIEW {s}.v AS SELECT 1 AS one;\n"
    );
    let dir = migrations_folder(&s, &[("1_shared.sql", file)]);
    let (first, second) = (unique("migrations-a"), unique("migrations-b"));
    let (a, b) = tokio::join!(run_folder(&pool, &first, &dir), run_folder(&pool, &second, &dir));
    for (model, applied) in [(&first, a), (&second, b)] {
        let applied = applied.unwrap_or_else(|e| panic!("model {model}: {e:#}"));
        assert_eq!(applied.applied, ["1_shared.sql"], "model {model}");
    }
    assert_eq!(count(&pool, &format!("SELECT count(*) FROM {s}.v")).await, 1);
}
