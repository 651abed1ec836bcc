//! Before the session: the demo topics (created when missing, checked when present) and the
//! demo's own database (created when missing; dropped and created again when the state in it
//! was derived from topics that no longer exist), then waiting for the services to be ready.

use std::path::Path;
use std::str::FromStr as _;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use parsley::channel::TopicId;
use parsley_store::database::{self, DatabaseName};
use parsley_store::{documents, ordering};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions as _, Connection as _};

use crate::context::{heading, held, say, wait_for, Declared, Demo, KAFKA_TIMEOUT, PARTITIONS};

/// Creates the topics if missing, checks them, and makes sure the database holds either no
/// state for the model or state derived from these very topics.
pub async fn prepare(path: &Path) -> anyhow::Result<()> {
    heading("Setting up");
    let declared = Declared::load(path)?;
    let cluster = &declared.config.kafka.cluster();
    let names = [declared.orders.clone(), declared.payments.clone()];

    let admin: AdminClient<DefaultClientContext> =
        parsley_infra::kafka::admin_config(cluster).create().context("creating a Kafka admin client")?;
    let options = AdminOptions::new().operation_timeout(Some(KAFKA_TIMEOUT)).request_timeout(Some(KAFKA_TIMEOUT));
    let new: Vec<NewTopic<'_>> =
        names.iter().map(|n| NewTopic::new(n, PARTITIONS as i32, TopicReplication::Fixed(1))).collect();
    let results = admin.create_topics(&new, &options).await.context("creating the demo topics")?;
    for result in results {
        match result {
            Ok(name) => say(format!("created topic {name} ({PARTITIONS} partitions)")),
            Err((name, RDKafkaErrorCode::TopicAlreadyExists)) => say(format!("topic {name} exists: reusing it")),
            Err((name, code)) => bail!("creating topic {name}: {code}"),
        }
    }
    let described = wait_for("the demo topics to be described", KAFKA_TIMEOUT, || async {
        // Right after creation the broker may not describe a topic yet.
        Ok(parsley_infra::describe_topics(cluster, &names, KAFKA_TIMEOUT).await.ok())
    })
    .await?;
    for d in &described {
        ensure!(
            d.partitions == PARTITIONS,
            "topic {} has {} partitions; the demo needs {PARTITIONS}, co-partitioned with the other topic. \
             Delete the demo topics (or reset Kafka's data, see docs/development.md) and run again",
            d.name,
            d.partitions
        );
        say(format!("  {} = topic ID {}, {} partitions", d.name, d.id_string(), d.partitions));
    }

    let url = declared.config.database_url()?;
    let options = PgConnectOptions::from_str(url).context("parsing the database URL")?;
    let database = options.get_database().context("the database URL names no database")?.to_string();
    ensure!(
        !database.is_empty() && database.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
        "the demo database name {database:?} must be lower-case letters, digits and _"
    );
    let name = DatabaseName::new(&database)?;
    let mut server = options.clone().database("postgres").connect().await.with_context(|| {
        format!("connecting to Postgres at {} (is it up? `make services-up`)", parsley_infra::pg::redact(url))
    })?;
    let exists = database::exists(&mut server, &name).await.context("looking up the demo database")?;
    let stale = if exists {
        let mut conn = options.connect().await.with_context(|| format!("connecting to database {database}"))?;
        let found = stale_state(&mut conn, &declared, &described).await?;
        conn.close().await.ok();
        found
    } else {
        None
    };
    if let Some(why) = &stale {
        say(format!("database {database}: {why}"));
        say(format!("  dropping and creating {database} again: its state describes topics that are gone"));
        database::drop_forced(&mut server, &name).await?;
    }
    if !exists || stale.is_some() {
        database::create(&mut server, &name).await?;
        say(format!("created database {database}: model {} starts from the topics' beginning", declared.model));
    } else {
        let mut conn = options.connect().await.with_context(|| format!("connecting to database {database}"))?;
        let documents = documents::count(&mut conn, &declared.model).await?;
        conn.close().await.ok();
        say(format!(
            "database {database} exists: model {} resumes from its stored state ({documents} documents from earlier runs)",
            declared.model
        ));
    }
    server.close().await.ok();
    Ok(())
}

/// Why the model's stored state cannot continue on the current topics, if it cannot: a
/// recorded topic ID that the name no longer resolves to (Kafka's data was reset, or a topic
/// was recreated), a recorded topic the configuration no longer declares, or another width.
async fn stale_state(
    conn: &mut PgConnection,
    declared: &Declared,
    described: &[parsley_infra::TopicDescription],
) -> anyhow::Result<Option<String>> {
    if !ordering::schema_exists(conn).await? {
        return Ok(None);
    }
    let Some(recorded) = ordering::load_model(conn, &declared.model).await? else { return Ok(None) };
    if recorded.task_count != PARTITIONS {
        return Ok(Some(format!("model {} was recorded with {} tasks", declared.model, recorded.task_count)));
    }
    for (name, recorded) in &recorded.topics {
        match described.iter().find(|d| &d.name == name) {
            None => {
                return Ok(Some(format!(
                    "model {} records topic {name}, which the demo no longer uses",
                    declared.model
                )))
            }
            Some(d) if TopicId::from_bytes(d.id) != *recorded => {
                return Ok(Some(format!(
                    "model {} records topic {name} as ID {recorded}, but that name is now ID {}",
                    declared.model,
                    d.id_string()
                )))
            }
            Some(_) => {}
        }
    }
    Ok(None)
}

/// Waits until the gateway answers `/readyz` with 200 and every task of the model is taken
/// by the projector named `owner` and running, at most `within`.
pub async fn wait_ready(demo: &Demo, owner: &str, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let last = match demo.gateway.get("/readyz", &[]).await {
            Ok(r) if r.status == 200 => break,
            Ok(r) => format!("{} {}", r.status, String::from_utf8_lossy(&r.body)),
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() >= deadline {
            bail!("the gateway was not ready within {within:?}; its last answer: {last}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    held(format!("gateway ready at http://{} (GET /readyz: database, migrations, Kafka)", demo.gateway.address()));
    let status = wait_for(&format!("projector {owner} to take every task of the model"), within, || async {
        let s = demo.status().await?;
        Ok((s.task_count() == PARTITIONS as usize && s.owners().iter().all(|o| o == owner)).then_some(s))
    })
    .await;
    let status = match status {
        Ok(s) => s,
        Err(e) => {
            let troubles = demo.status().await.map(|s| s.troubles()).unwrap_or_default();
            return Err(e.context(format!("tasks not running: [{}]", troubles.join("; "))));
        }
    };
    let troubles = status.troubles();
    ensure!(troubles.is_empty(), "the projector's tasks are not all running: {}", troubles.join("; "));
    held(format!(
        "projector {owner} runs model {}: {} tasks, all running (GET /v1/status)",
        demo.model,
        status.task_count()
    ));
    Ok(())
}
