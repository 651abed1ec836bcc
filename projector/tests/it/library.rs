//! The projector as a library, through the real broker and database: a projection
//! registered by the embedding program (here, the test) runs the models that name it, sees
//! its model's `options`, writes its own table (made by the model's migrations folder) in
//! the step's transaction, and stops at the shutdown signal; the built-in `sql` projection
//! runs through the same builder; an unknown projection name, a name registered twice, a
//! factory's error and an edited applied migration refuse start by name.

use std::time::{Duration, Instant};

use parsley_projector::projection::{Delivered, Projection, ProjectionError, StepContext};
use parsley_projector::Projector;
use parsley_settings::config::{Apply, Config, ModelConfig, SQL_PROJECTION};
use sqlx::{PgConnection, PgPool};
use tokio::sync::watch;

use crate::sql::{migrations_folder, schema};
use crate::support::*;

/// Writes `(label, key, position)` per record into the table its options name.
struct Audit {
    table: String,
    label: String,
}

impl Audit {
    fn from_model(model: &ModelConfig) -> anyhow::Result<Audit> {
        let option = |name: &str| {
            model
                .options
                .get(name)
                .and_then(|v| v.as_str())
                .map(str::to_string)
                .ok_or_else(|| anyhow::anyhow!("models.options.{name} must be a string"))
        };
        Ok(Audit { table: option("table")?, label: option("label")? })
    }
}

impl Projection for Audit {
    async fn apply(
        &self,
        conn: &mut PgConnection,
        _step: StepContext<'_>,
        record: &Delivered<'_>,
    ) -> Result<(), ProjectionError> {
        let key = record.key.map(|k| String::from_utf8_lossy(k).into_owned());
        sqlx::query(&format!("INSERT INTO {} (label, key, position) VALUES ($1, $2, $3)", self.table))
            .bind(&self.label)
            .bind(key)
            .bind(record.position)
            .execute(conn)
            .await
            .map_err(|e| ProjectionError::database(e, "auditing"))?;
        Ok(())
    }
}

/// Runs `builder` on a task of its own; returns the stop switch and the run.
fn spawn_run(
    builder: parsley_projector::ProjectorBuilder,
) -> (watch::Sender<bool>, tokio::task::JoinHandle<anyhow::Result<()>>) {
    let (stop, shutdown) = watch::channel(false);
    (stop, tokio::spawn(builder.shutdown(shutdown).run()))
}

async fn wait_for_count(pool: &PgPool, sql: &str, want: i64) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let n: i64 = sqlx::query_scalar(sql).fetch_one(pool).await.unwrap_or(-1);
        if n == want {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {sql} to be {want} (it is {n})");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn stop_and_join(stop: watch::Sender<bool>, run: tokio::task::JoinHandle<anyhow::Result<()>>) {
    stop.send(true).unwrap();
    tokio::time::timeout(TIMEOUT, run)
        .await
        .expect("the projector stops at the signal")
        .unwrap()
        .unwrap_or_else(|e| panic!("{e:#}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_projection_runs_its_models_with_their_options() {
    let n = Names::new("lib-custom");
    let s = schema("libcustom");
    create_topics(&[&n.orders], 2).await;
    let pool = pool().await;
    let dir = migrations_folder(
        &s,
        &[(
            "1_create_audit.sql",
            format!("CREATE SCHEMA {s}; CREATE TABLE {s}.audit (label text, key text, position bigint);"),
        )],
    );
    let mut config = config(&n.model, &[(&n.orders, Apply::Replace)]);
    let m = &mut config.models[0];
    m.projection = "audit".to_string();
    m.migrations = Some(dir.display().to_string());
    m.options.insert("table".into(), format!("{s}.audit").into());
    m.options.insert("label".into(), "from-options".into());
    // An audit log: its keys are not document keys, wherever they land.
    m.topics[0].partitioner = parsley_settings::config::Partitioner::None;
    config.validate().unwrap();

    let p = producer();
    for (partition, key) in [(0, "k0"), (1, "k1"), (0, "k2")] {
        produce(&p, &n.orders, partition, key, Some(b"anything, not JSON"), None).await;
    }
    let builder = Projector::builder(config).projection("audit", Audit::from_model);
    assert_eq!(builder.projections(), ["audit", "documents", "sql"]);
    let (stop, run) = spawn_run(builder);
    let rows = format!("SELECT count(*) FROM {s}.audit WHERE label = 'from-options'");
    wait_for_count(&pool, &rows, 3).await;
    stop_and_join(stop, run).await;
    let keys: Vec<String> =
        sqlx::query_scalar(&format!("SELECT key FROM {s}.audit ORDER BY key")).fetch_all(&pool).await.unwrap();
    assert_eq!(keys, ["k0", "k1", "k2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_projection_runs_through_the_builder_and_an_edited_migration_refuses_start() {
    let n = Names::new("lib-sql");
    let s = schema("libsql");
    create_topics(&[&n.orders], 1).await;
    let pool = pool().await;
    let create = format!("CREATE SCHEMA {s}; CREATE TABLE {s}.orders (id text PRIMARY KEY, doc jsonb);");
    let dir = migrations_folder(&s, &[("1_create_orders.sql", create.clone())]);
    let mut config = config(&n.model, &[(&n.orders, Apply::Replace)]);
    let m = &mut config.models[0];
    m.projection = SQL_PROJECTION.to_string();
    m.migrations = Some(dir.display().to_string());
    m.topics[0].statements =
        vec![format!("INSERT INTO {s}.orders VALUES (:key, :value) ON CONFLICT (id) DO UPDATE SET doc = EXCLUDED.doc")];
    config.validate().unwrap();

    let p = producer();
    produce(&p, &n.orders, 0, "o1", Some(br#"{"v": 1}"#), None).await;
    produce(&p, &n.orders, 0, "o1", Some(br#"{"v": 2}"#), None).await;
    let (stop, run) = spawn_run(Projector::builder(config.clone()));
    wait_for_count(&pool, &format!("SELECT count(*) FROM {s}.orders WHERE doc = '{{\"v\": 2}}'"), 1).await;
    stop_and_join(stop, run).await;

    std::fs::write(dir.join("1_create_orders.sql"), format!("{create} -- edited")).unwrap();
    let err = Projector::builder(config).shutdown(watch::channel(false).1).run().await.unwrap_err();
    let err = format!("{err:#}");
    assert!(err.contains("1_create_orders.sql") && err.contains(&n.model), "{err}");
}

/// A model named `m` receiving `t` that runs `projection` (no services are reached).
fn offline(projection: &str) -> Config {
    let mut c = Config::parse(&format!(
        "[[models]]\nname = \"m\"\nprojection = \"{projection}\"\ntopics = [{{ name = \"t\" }}]\n"
    ))
    .unwrap();
    c.database.url = Some("postgres://nobody@127.0.0.1:1/none".to_string().into());
    c.projector.metrics_address = String::new();
    c
}

async fn refused(builder: parsley_projector::ProjectorBuilder) -> String {
    let run = builder.shutdown(watch::channel(false).1).run();
    let outcome = tokio::time::timeout(Duration::from_secs(5), run).await.expect("refused before connecting");
    format!("{:#}", outcome.unwrap_err())
}

#[tokio::test]
async fn an_unknown_projection_is_refused_naming_the_registered_ones() {
    let err = refused(Projector::builder(offline("nope"))).await;
    assert!(err.contains("model m") && err.contains("\"nope\"") && err.contains("documents, sql"), "{err}");
    let err = refused(Projector::builder(offline("nope")).projection("audit", Audit::from_model)).await;
    assert!(err.contains("audit, documents, sql"), "{err}");
}

#[tokio::test]
async fn a_factory_s_error_and_a_name_registered_twice_are_refused() {
    let err = refused(Projector::builder(offline("audit")).projection("audit", Audit::from_model)).await;
    assert!(err.contains("model m") && err.contains("models.options.table"), "{err}");
    let err = refused(Projector::builder(offline("audit")).projection("sql", Audit::from_model)).await;
    assert!(err.contains("\"sql\" is registered twice"), "{err}");
    let err = refused(Projector::builder(offline("documents")).models(["other"])).await;
    assert!(err.contains("no model named \"other\""), "{err}");
}
