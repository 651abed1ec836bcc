//! One run: optionally set up and start the stack's processes (`--spawn-projectors`,
//! `--spawn-gateways`), drive the workload with the nemesis beside it, print progress on
//! stderr, and judge the recorded history.

use std::path::PathBuf;
use std::str::FromStr as _;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _};
use base64::Engine as _;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::types::RDKafkaErrorCode;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions as _, Connection as _};
use tokio::sync::Mutex;

use crate::history::Event;
use crate::http::Client;
use crate::judge::{judge, Verdict};
use crate::nemesis::{self, Fault, Spawned, Targets};
use crate::workload::{self, Recorder, Target};

/// Processes the checker starts and owns for the run.
#[derive(Clone, Debug)]
pub struct Spawn {
    pub projectors: usize,
    pub gateways: usize,
    /// The configuration file both services read (the model and its topics).
    pub config: PathBuf,
    /// Where `parsley-projector` and `parsley-gateway` are.
    pub bin_dir: PathBuf,
    /// The services' database on the server of `$DATABASE_URL`, created when missing.
    pub database: String,
    /// Partitions of each topic, when the checker creates them.
    pub partitions: i32,
    /// The first spawned gateway's port; the others follow.
    pub base_port: u16,
}

#[derive(Clone, Debug)]
pub struct Options {
    pub gateways: Vec<String>,
    pub model: String,
    pub replace_topic: String,
    pub merge_topic: String,
    pub duration: Duration,
    pub max_ops: Option<u64>,
    pub sessions: usize,
    pub keys: usize,
    /// Of every 100 operations, how many are writes (the rest are reads, single keys and
    /// pages 8 to 3).
    pub write_percent: u64,
    pub nemesis: Vec<Fault>,
    pub interval: Duration,
    pub projector_pids: Vec<u32>,
    /// The services' database for `pg-terminate` (spawned stacks use their own).
    pub database_url: Option<String>,
    pub application_name: Option<String>,
    pub spawn: Option<Spawn>,
    pub repo: PathBuf,
    pub seed: u64,
    /// Half the single-key reads through this named query (`--query MODEL/QUERY`).
    pub query: Option<workload::QueryTarget>,
}

/// Runs the workload and judges it; returns the verdict and the history.
pub async fn run(options: Options) -> anyhow::Result<(Verdict, Vec<Event>)> {
    let mut gateways = options.gateways.clone();
    let mut projectors = Vec::new();
    let mut spawned_gateways = Vec::new();
    let mut database_url = options.database_url.clone();
    if let Some(spawn) = &options.spawn {
        let url = prepare(spawn, &options).await?;
        database_url = Some(url.clone());
        let logs = std::env::temp_dir().join(format!("parsley-check-{}", std::process::id()));
        std::fs::create_dir_all(&logs)?;
        eprintln!("[check] spawned processes log to {}", logs.display());
        let config = spawn.config.display().to_string();
        let common = |extra: &[(&str, String)]| {
            let mut env = vec![
                ("PARSLEY_DATABASE_URL".to_string(), url.clone()),
                ("PARSLEY_KAFKA_BOOTSTRAP".to_string(), parsley_infra::services::kafka_bootstrap().unwrap_or_default()),
                ("RUST_LOG".to_string(), "info".to_string()),
            ];
            env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
            env
        };
        let projector = spawn.bin_dir.join("parsley-projector");
        let gateway = spawn.bin_dir.join("parsley-gateway");
        let needed = [(spawn.projectors > 0, &projector), (spawn.gateways > 0, &gateway)];
        for binary in needed.into_iter().filter(|(needed, _)| *needed).map(|(_, b)| b) {
            if !binary.is_file() {
                bail!(
                    "{} is missing: build it with `cargo build -p parsley-projector -p parsley-gateway`",
                    binary.display()
                );
            }
        }
        Spawned::new(
            "migrate",
            projector.clone(),
            &["migrate", "--config", &config],
            common(&[]),
            logs.join("migrate.log"),
        )
        .run_to_end(Duration::from_secs(60))?;
        for i in 0..spawn.projectors {
            let name = format!("p{i}");
            let env = common(&[("PARSLEY_OWNER", format!("check-{}-{name}", std::process::id()))]);
            let mut p = Spawned::new(
                &name,
                projector.clone(),
                &["run", "--config", &config],
                env,
                logs.join(format!("{name}.log")),
            );
            p.start()?;
            projectors.push(Arc::new(Mutex::new(p)));
        }
        let keys = format!("check:{}", base64::engine::general_purpose::STANDARD.encode(random_bytes()?));
        for i in 0..spawn.gateways {
            let name = format!("g{i}");
            let address = format!("127.0.0.1:{}", spawn.base_port + i as u16);
            let env = common(&[
                ("PARSLEY_GATEWAY_LISTEN", address.clone()),
                ("PARSLEY_GATEWAY_ADMIN_LISTEN", String::new()),
                ("PARSLEY_TOKEN_KEYS", keys.clone()),
            ]);
            let mut g =
                Spawned::new(&name, gateway.clone(), &["--config", &config], env, logs.join(format!("{name}.log")));
            g.start()?;
            spawned_gateways.push(Arc::new(Mutex::new(g)));
            gateways.push(format!("http://{address}"));
        }
    }
    if gateways.is_empty() {
        bail!("no gateway: give --gateway URL, or --spawn-gateways N");
    }
    let clients: Vec<Client> = gateways
        .iter()
        .map(|g| Client::new(g.trim_start_matches("http://").trim_end_matches('/'), Duration::from_secs(10)))
        .collect();
    wait_ready(&clients, Duration::from_secs(90)).await?;

    let run_id = format!("chk{}", SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis());
    let keys = match partition_counts(&[&options.replace_topic, &options.merge_topic]).await {
        Ok(partitions) => workload::keys_covering(&run_id, options.keys, &partitions),
        Err(e) => {
            eprintln!("[check] the topics' partitions are unknown ({e:#}): the keys may miss some partitions");
            workload::keys_covering(&run_id, options.keys, &[])
        }
    };
    let recorder = Arc::new(Recorder::new());
    recorder.record(Event::Start {
        run: run_id.clone(),
        model: options.model.clone(),
        gateways: gateways.clone(),
        keys: keys.clone(),
    });
    let target = Arc::new(Target {
        gateways: clients,
        model: options.model.clone(),
        replace_topic: options.replace_topic.clone(),
        merge_topic: options.merge_topic.clone(),
        run: run_id.clone(),
        keys,
        write_percent: options.write_percent,
        query: options.query.clone(),
    });
    eprintln!(
        "[check] run {run_id}: {} session(s) on {} gateway(s) for {:?}, nemesis: {}",
        options.sessions,
        gateways.len(),
        options.duration,
        if options.nemesis.is_empty() {
            "off".to_string()
        } else {
            options.nemesis.iter().map(|f| f.name()).collect::<Vec<_>>().join(",")
        }
    );
    let deadline = Instant::now() + options.duration;
    let targets = Arc::new(Targets {
        projectors: projectors.clone(),
        projector_pids: options.projector_pids.clone(),
        gateways: spawned_gateways.clone(),
        database_url,
        application_name: options.application_name.clone(),
        repo: options.repo.clone(),
    });
    let nemesis =
        tokio::spawn(nemesis::run(targets, options.nemesis.clone(), options.interval, deadline, recorder.clone()));
    let progress = {
        let recorder = recorder.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                let (ops, unavailable) = recorder.counts();
                eprintln!(
                    "[check] {:>7.1}s {ops} operations, {unavailable} answered 503",
                    recorder.now_ms() as f64 / 1000.0
                );
            }
        })
    };
    workload::run(target, recorder.clone(), options.sessions, deadline, options.max_ops, options.seed).await;
    let _ = nemesis.await;
    progress.abort();
    for p in projectors.iter().chain(&spawned_gateways) {
        p.lock().await.stop(Duration::from_secs(10));
    }
    let history = recorder.take();
    let verdict = judge(&history).map_err(|e| anyhow::anyhow!("the history is malformed: {e}"))?;
    Ok((verdict, history))
}

/// Creates the topics and the services' database when missing; returns the database's URL
/// (`$DATABASE_URL` naming that database).
pub async fn prepare(spawn: &Spawn, options: &Options) -> anyhow::Result<String> {
    let bootstrap = parsley_infra::services::kafka_bootstrap()?;
    let admin: AdminClient<DefaultClientContext> =
        parsley_infra::kafka::admin_config(&bootstrap).create().context("creating a Kafka admin client")?;
    let timeout = Duration::from_secs(15);
    let admin_options = AdminOptions::new().operation_timeout(Some(timeout)).request_timeout(Some(timeout));
    let names = [options.replace_topic.as_str(), options.merge_topic.as_str()];
    let new: Vec<NewTopic<'_>> =
        names.iter().map(|n| NewTopic::new(n, spawn.partitions, TopicReplication::Fixed(1))).collect();
    for result in admin.create_topics(&new, &admin_options).await.context("creating the topics")? {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => bail!("creating topic {name}: {code}"),
        }
    }
    let server = parsley_infra::services::database_url()?;
    let options = PgConnectOptions::from_str(&server).context("parsing the database URL")?;
    let name = parsley_store::database::DatabaseName::new(&spawn.database)?;
    let mut connection = options.clone().database("postgres").connect().await.context("connecting to the server")?;
    if !parsley_store::database::exists(&mut connection, &name).await? {
        parsley_store::database::create(&mut connection, &name).await?;
    }
    let _ = connection.close().await;
    with_database(&server, &spawn.database)
}

/// `url` naming `database` instead of its own: the path replaced, the query parameters
/// (`?sslmode=…`) kept but for a `dbname`, which would override the path.
pub fn with_database(url: &str, database: &str) -> anyhow::Result<String> {
    let (base, query) = url.split_once('?').map_or((url, None), |(b, q)| (b, Some(q)));
    let authority = base.find("://").context("the database URL has no scheme")? + 3;
    let path = base[authority..].find('/').map_or(base.len(), |i| authority + i);
    let mut out = format!("{}/{database}", &base[..path]);
    let kept: Vec<&str> = query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty() && p.split('=').next() != Some("dbname"))
        .collect();
    if !kept.is_empty() {
        out.push('?');
        out.push_str(&kept.join("&"));
    }
    Ok(out)
}

/// Each topic's partition count, from the broker of `$PARSLEY_KAFKA_BOOTSTRAP`.
async fn partition_counts(topics: &[&str]) -> anyhow::Result<Vec<u32>> {
    let bootstrap = parsley_infra::services::kafka_bootstrap()?;
    let topics: Vec<String> = topics.iter().map(|t| t.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = parsley_infra::kafka::consumer_config(&bootstrap, "parsley-check.metadata")
            .create()
            .context("creating a Kafka metadata client")?;
        topics
            .iter()
            .map(|topic| {
                let metadata =
                    client.fetch_metadata(Some(topic), Duration::from_secs(10)).context("fetching metadata")?;
                let partitions = metadata.topics().first().map_or(0, |t| t.partitions().len()) as u32;
                if partitions == 0 {
                    bail!("topic {topic} has no partitions (does it exist?)");
                }
                Ok(partitions)
            })
            .collect()
    })
    .await
    .context("the metadata task panicked")?
}

/// Waits until every gateway answers `/readyz` with 200.
async fn wait_ready(clients: &[Client], within: Duration) -> anyhow::Result<()> {
    let began = Instant::now();
    for client in clients {
        loop {
            if client.get("/readyz", &[]).await.is_ok_and(|r| r.status == 200) {
                break;
            }
            if began.elapsed() > within {
                bail!("the gateway at {} was not ready within {within:?}", client.address());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    Ok(())
}

/// 32 bytes from the system's random source: the spawned gateways' token key.
fn random_bytes() -> anyhow::Result<[u8; 32]> {
    use std::io::Read as _;
    let mut key = [0u8; 32];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut key)).context("reading /dev/urandom")?;
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_database_is_replaced_and_the_query_kept() {
        for (url, expected) in [
            ("postgres://u:p@h:5432/parsley", "postgres://u:p@h:5432/chk"),
            ("postgres://u:p@h/parsley?sslmode=disable", "postgres://u:p@h/chk?sslmode=disable"),
            ("postgresql://h?application_name=x&dbname=other", "postgresql://h/chk?application_name=x"),
            ("postgres://h:5432", "postgres://h:5432/chk"),
            ("postgres://h/?dbname=other", "postgres://h/chk"),
        ] {
            assert_eq!(with_database(url, "chk").unwrap(), expected, "{url}");
        }
        assert!(with_database("parsley", "chk").is_err());
    }
}
