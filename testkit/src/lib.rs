//! The workspace's test kit: helpers for integration tests against the real local services
//! (a dev-dependency of every crate that has such tests): the services from the environment,
//! unique names, an admin client, topics and producers, and records with raw header names.
//! They panic with a clear message, as a test should, instead of returning errors. The
//! workspace's own invariants (`tests/invariants.rs`) are checked here too.

use std::process::{Child, Command};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};

use parsley_infra::{kafka, services};

/// Producing a record whose header names are raw bytes (not UTF-8): the one audited
/// `unsafe` producer lives in `parsley_infra::headers`.
pub use parsley_infra::headers::produce::produce_with_raw_headers;

/// How long any one broker or database operation of a test may take.
pub const TIMEOUT: Duration = Duration::from_secs(30);

pub fn bootstrap() -> String {
    services::kafka_bootstrap().unwrap_or_else(|e| panic!("these tests need the real broker: {e:#}"))
}

pub fn database_url() -> String {
    services::database_url().unwrap_or_else(|e| panic!("these tests need the real database: {e:#}"))
}

/// A folder of its own under the system's temporary folder (named by [`unique`]), removed
/// with everything in it when dropped — unless the test is failing (the thread panicking),
/// when what the test left there (configurations, process logs) stays for the diagnosis.
pub struct ScratchDir(std::path::PathBuf);

impl ScratchDir {
    pub fn new(prefix: &str) -> ScratchDir {
        let dir = std::env::temp_dir().join(unique(prefix));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        ScratchDir(dir)
    }

    pub fn path(&self) -> &std::path::Path {
        &self.0
    }

    /// `name` inside the folder.
    pub fn join(&self, name: impl AsRef<std::path::Path>) -> std::path::PathBuf {
        self.0.join(name)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept for the diagnosis: {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A name no other run or test uses: prefix, process id, time, counter.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    format!("{prefix}-{}-{}-{}", std::process::id(), nanos % 1_000_000_000_000, COUNTER.fetch_add(1, Ordering::Relaxed))
}

pub fn admin() -> AdminClient<DefaultClientContext> {
    kafka::admin_config(&bootstrap()).create().expect("admin client")
}

pub fn admin_options() -> AdminOptions {
    AdminOptions::new().operation_timeout(Some(TIMEOUT)).request_timeout(Some(TIMEOUT))
}

/// Creates topics, retrying while a deletion of the same name is still in progress.
pub async fn create_topics(names: &[&str], partitions: i32) {
    let admin = admin();
    for name in names {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let results = admin
                .create_topics(&[NewTopic::new(name, partitions, TopicReplication::Fixed(1))], &admin_options())
                .await
                .expect("create_topics request");
            match &results[0] {
                Ok(_) => break,
                Err((_, code)) if Instant::now() < deadline => {
                    eprintln!("create {name}: {code}, retrying");
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err((_, code)) => panic!("creating topic {name}: {code}"),
            }
        }
    }
    // Wait until the broker's metadata lists every partition of each topic: a broker that
    // has just started can acknowledge a creation before its metadata shows the topic, and
    // the first describe of a test must see it.
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let cluster = bootstrap();
    tokio::task::spawn_blocking(move || {
        let admin: AdminClient<DefaultClientContext> =
            kafka::admin_config(cluster.as_str()).create().expect("admin client");
        for name in names {
            let deadline = Instant::now() + TIMEOUT;
            loop {
                let listed = admin.inner().fetch_metadata(Some(&name), Duration::from_secs(5)).ok().is_some_and(|m| {
                    m.topics()
                        .iter()
                        .any(|t| t.name() == name && t.error().is_none() && t.partitions().len() == partitions as usize)
                });
                if listed {
                    break;
                }
                assert!(Instant::now() < deadline, "topic {name} never appeared in the broker's metadata");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    })
    .await
    .expect("waiting for the topics' metadata");
}

pub async fn delete_topic(name: &str) {
    let results = admin().delete_topics(&[name], &admin_options()).await.expect("delete_topics request");
    if let Err((_, code)) = &results[0] {
        panic!("deleting topic {name}: {code}");
    }
}

/// Moves the log start of `topic`/`partition` to `before`, as retention would.
pub async fn delete_records(topic: &str, partition: i32, before: i64) {
    let mut cut = TopicPartitionList::new();
    cut.add_partition_offset(topic, partition, Offset::Offset(before)).unwrap();
    admin().delete_records(&cut, &admin_options()).await.expect("delete_records");
}

/// A plain (idempotent) producer.
pub fn producer() -> FutureProducer {
    kafka::producer_config(&bootstrap()).create().expect("producer")
}

/// A transactional producer, initialised.
pub fn transactional_producer() -> FutureProducer {
    let p: FutureProducer =
        kafka::transactional_producer_config(&bootstrap(), &unique("tx")).create().expect("transactional producer");
    p.init_transactions(TIMEOUT).expect("init_transactions");
    p
}

/// Produces one record to `topic`/`partition`, with `causes` (encoded) as its
/// `parsley.causes` header, and returns its offset.
pub async fn produce(
    producer: &FutureProducer,
    topic: &str,
    partition: i32,
    key: &str,
    value: Option<&[u8]>,
    causes: Option<&[u8]>,
) -> i64 {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic).partition(partition).key(key);
        if let Some(v) = value {
            record = record.payload(v);
        }
        if let Some(c) = causes {
            record = record.headers(OwnedHeaders::new().insert(Header { key: "parsley.causes", value: Some(c) }));
        }
        match producer.send(record, TIMEOUT).await {
            Ok(d) => return d.offset,
            // A new topic's partitions reach the producer's metadata a moment after creation.
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::UnknownPartition), _))
                if Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err((e, _)) => panic!("producing to {topic}/{partition}: {e}"),
        }
    }
}

/// A process a test started: SIGKILLed and reaped when dropped, so a test that fails before
/// stopping it leaves nothing running. `name` is what messages call it.
pub struct Spawned {
    pub child: Child,
    name: &'static str,
}

impl Spawned {
    pub fn new(name: &'static str, child: Child) -> Spawned {
        Spawned { child, name }
    }

    /// SIGKILL: no chance to finish what it was doing.
    pub fn kill_9(mut self) {
        self.child.kill().unwrap_or_else(|e| panic!("kill -9 of {}: {e}", self.name));
        self.child.wait().unwrap_or_else(|e| panic!("reaping {}: {e}", self.name));
    }

    /// SIGTERM, then waits up to [`TIMEOUT`] for a clean exit (status 0).
    pub fn terminate(mut self) {
        let status = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        assert!(status.success(), "kill -TERM of {} failed", self.name);
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "{} exited with {status} after SIGTERM", self.name);
                return;
            }
            assert!(Instant::now() < deadline, "{} did not stop after SIGTERM", self.name);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Linux reports `/proc/<pid>/stat` times in USER_HZ, 100 on every architecture it runs on.
pub const TICKS_PER_SECOND: f64 = 100.0;

/// A process's CPU so far, utime + stime in ticks ([`TICKS_PER_SECOND`]), from `/proc`.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    // After the name: state is field 3, utime field 14, stime field 15.
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// Every Postgres server process on this machine: pid, process title, CPU ticks so far.
pub fn postgres_processes() -> Vec<(u32, String, u64)> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut out = Vec::new();
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/comm")) else { continue };
        if comm.trim() != "postgres" {
            continue;
        }
        let title = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        if let Some(ticks) = cpu_ticks(pid) {
            out.push((pid, title, ticks));
        }
    }
    out
}

/// `url` (a `postgres://` URL) naming `database` instead of its own database; its query
/// parameters are kept.
pub fn with_database(url: &str, database: &str) -> Result<String, String> {
    let authority = url.find("://").ok_or("the database URL has no scheme")? + 3;
    let (base, query) = url.split_once('?').map(|(b, q)| (b, Some(q))).unwrap_or((url, None));
    let path = base[authority..].find('/').map(|i| authority + i).unwrap_or(base.len());
    let mut out = format!("{}/{database}", &base[..path]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok(out)
}

/// A new empty database on the test server (named after `prefix`), for one test:
/// `(name, URL)`. Drop it with [`drop_database`]`(&database_url(), &name)`.
pub async fn scratch_database(prefix: &str) -> (String, String) {
    let admin = database_url();
    let name = unique(prefix).to_ascii_lowercase().replace(['-', '.'], "_");
    create_database(&admin, &name).await.unwrap_or_else(|e| panic!("creating the scratch database {name}: {e}"));
    let url = with_database(&admin, &name).unwrap_or_else(|e| panic!("{e}"));
    (name, url)
}

/// Creates the empty database `name` through `admin_url`'s database (the role needs
/// `CREATEDB`), for a benchmark run that leaves nothing behind; drop it with
/// [`drop_database`].
pub async fn create_database(admin_url: &str, name: &str) -> Result<(), sqlx::Error> {
    use sqlx::Connection as _;
    let mut admin = sqlx::PgConnection::connect(admin_url).await?;
    sqlx::query(&format!("CREATE DATABASE \"{name}\"")).execute(&mut admin).await?;
    admin.close().await
}

/// Drops the database `name`, ending its sessions (`WITH (FORCE)`). That is refused (SQLSTATE
/// 42501) while an autovacuum worker, a process this role may not signal, works in it: the
/// drop is retried for up to ten seconds, as the worker soon ends.
pub async fn drop_database(admin_url: &str, name: &str) -> Result<(), sqlx::Error> {
    use sqlx::Connection as _;
    let mut admin = sqlx::PgConnection::connect(admin_url).await?;
    let mut attempts = 0;
    loop {
        match sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).execute(&mut admin).await {
            Ok(_) => return admin.close().await,
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42501") && attempts < 40 => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => return Err(e),
        }
    }
}
