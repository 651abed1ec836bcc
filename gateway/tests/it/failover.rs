//! Projector high availability under a session workload: several `parsley-projector run`
//! processes share one model's 12 tasks while sessions write and read through a gateway, and
//! instances are killed (`kill -9`), frozen past their lease (`SIGSTOP`, then `SIGCONT`),
//! added, and stopped (`SIGTERM`). Through each, every session reads its own writes and never
//! goes back (a 503 is allowed and retried with the same token; a stale read or a 404 never
//! is), every record is applied exactly once in causal order, and the tasks of an instance
//! that went away run elsewhere within the lease: the takeover time is measured and printed.
//!
//! Ownership is observed where the instances record it: `parsley.tasks` (an owner whose lease
//! is live, and when its runner last stepped) and `parsley.members`. The instances are the
//! real binary, found next to this test executable; `make failover` and `make test` build it
//! (`cargo build -p parsley-projector --bin parsley-projector`). The scenarios run one at a
//! time even when the harness runs tests side by side: their timings are what they measure.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use axum::Router;
use serde_json::{json, Map, Value};
use sqlx::Row as _;
use tokio::sync::{Mutex, MutexGuard};
use tokio::task::JoinHandle;

use crate::support::*;

/// The model's task count: the partitions of each of its topics.
const TASKS: usize = 12;
/// The instances' `lease_ms` and `heartbeat_ms`.
const LEASE: Duration = Duration::from_millis(3000);
const HEARTBEAT: Duration = Duration::from_millis(500);
/// Concurrent sessions of the workload; each writes two keys of its own on two partitions,
/// so the sessions' keys cover every task.
const SESSIONS: usize = 6;
/// How long the gateway waits for coverage before a 503.
const READ_WAIT_MS: u64 = 1000;
/// How long an instance may take to split the tasks with the others, or a session to be
/// served again.
const CONVERGE: Duration = Duration::from_secs(40);

/// Held by each scenario while it runs: their processes would otherwise share two cores and
/// stretch each other's takeover times.
static SERIAL: Mutex<()> = Mutex::const_new(());

/// The projector binary next to this test executable (`target/<profile>/deps/it-<hash>`).
fn projector_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let profile = exe.parent().and_then(Path::parent).expect("the test executable is in target/<profile>/deps");
    let binary = profile.join(format!("parsley-projector{}", std::env::consts::EXE_SUFFIX));
    assert!(
        binary.is_file(),
        "{} is missing: the failover tests run the projector binary; build it with \
         `cargo build -p parsley-projector --bin parsley-projector` (`make failover` and `make test` do)",
        binary.display()
    );
    binary
}

/// Where an instance's process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    Running,
    Stopped,
    Killed,
    Exited,
}

/// One `parsley-projector run` process, its stdout and stderr in `log`.
struct Instance {
    name: String,
    log: PathBuf,
    child: Child,
    life: Life,
}

impl Instance {
    /// The last `lines` lines of its log.
    fn tail(&self, lines: usize) -> String {
        let text =
            std::fs::read_to_string(&self.log).unwrap_or_else(|e| format!("(reading {}: {e})", self.log.display()));
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// How long its log is now: what it logs later starts there.
    fn log_len(&self) -> usize {
        std::fs::read(&self.log).map(|b| b.len()).unwrap_or(0)
    }
}

/// Instances of the projector on one model, a gateway over it, and where they stand.
struct Fleet {
    stack: Stack,
    dir: parsley_testkit::ScratchDir,
    binary: PathBuf,
    instances: Vec<Instance>,
    _serial: MutexGuard<'static, ()>,
}

impl Fleet {
    /// Topics of [`TASKS`] partitions and the gateway; no instance yet.
    async fn new(prefix: &str) -> Fleet {
        let serial = SERIAL.lock().await;
        let binary = projector_binary();
        let stack = Stack::new(prefix, TASKS as i32, &format!("read_wait_ms = {READ_WAIT_MS}")).await;
        let dir = parsley_testkit::ScratchDir::new(prefix);
        Fleet { stack, dir, binary, instances: Vec::new(), _serial: serial }
    }

    /// An instance's configuration file: the model as `support::config` builds it, balanced
    /// (no `tasks`), under its own name, without a metrics listener.
    fn config_file(&self, name: &str) -> String {
        let n = &self.stack.names;
        format!(
            "[kafka]\nbootstrap = \"{bootstrap}\"\n\n\
             [projector]\nowner = \"{name}\"\nmetrics_address = \"\"\ninitial_backoff_ms = 50\nmax_backoff_ms = 400\n\
             lease_ms = {lease}\nheartbeat_ms = {heartbeat}\n\n\
             [[models]]\nname = \"{model}\"\nmax_step_records = 500\nmax_step_ms = 50\nstep_linger_ms = 5\n\
             topics = [\n  {{ name = \"{orders}\", apply = \"replace\" }},\n  {{ name = \"{payments}\", apply = \"merge\" }},\n]\n",
            bootstrap = bootstrap(),
            lease = LEASE.as_millis(),
            heartbeat = HEARTBEAT.as_millis(),
            model = n.model,
            orders = n.orders,
            payments = n.payments,
        )
    }

    /// Starts one more instance, `p<n>`, and returns its name.
    fn spawn(&mut self) -> String {
        let name = format!("p{}", self.instances.len());
        let config = self.dir.join(format!("{name}.toml"));
        std::fs::write(&config, self.config_file(&name)).unwrap();
        let log = self.dir.join(format!("{name}.log"));
        let out = File::create(&log).unwrap();
        let mut command = Command::new(&self.binary);
        command.args(["run", "--config"]).arg(&config);
        // Only the file and the two services decide the instance's settings.
        for (var, _) in std::env::vars_os() {
            if var.to_string_lossy().starts_with("PARSLEY_") {
                command.env_remove(var);
            }
        }
        let child = command
            .env("PARSLEY_DATABASE_URL", database_url())
            .env("PARSLEY_KAFKA_BOOTSTRAP", bootstrap())
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {}: {e}", self.binary.display()));
        self.instances.push(Instance { name: name.clone(), log, child, life: Life::Running });
        name
    }

    fn instance(&mut self, name: &str) -> &mut Instance {
        self.instances.iter_mut().find(|i| i.name == name).unwrap_or_else(|| panic!("no instance {name}"))
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`) to the instance.
    fn signal(&mut self, name: &str, signal: &str) {
        let pid = self.instance(name).child.id();
        let status =
            Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status().expect("running kill");
        assert!(status.success(), "kill -{signal} {name} (pid {pid}) failed");
    }

    /// The database's clock now, as text for a later comparison in SQL.
    async fn db_now(&self) -> String {
        sqlx::query_scalar("SELECT clock_timestamp()::text").fetch_one(&self.stack.pool).await.unwrap()
    }

    /// `kill -9`: no chance to finish a step or hand anything back. Returns when it was killed,
    /// on this clock and on the database's.
    async fn kill_9(&mut self, name: &str) -> (Instant, String) {
        let at = Instant::now();
        let instance = self.instance(name);
        instance.child.kill().expect("kill -9");
        instance.child.wait().expect("reaping the killed instance");
        instance.life = Life::Killed;
        (at, self.db_now().await)
    }

    /// `SIGSTOP`: frozen wherever it is, connections open. Returns when, as [`Fleet::kill_9`].
    async fn freeze(&mut self, name: &str) -> (Instant, String) {
        let at = Instant::now();
        self.signal(name, "STOP");
        self.instance(name).life = Life::Stopped;
        (at, self.db_now().await)
    }

    fn thaw(&mut self, name: &str) {
        self.signal(name, "CONT");
        self.instance(name).life = Life::Running;
    }

    /// `SIGTERM`, without waiting for the exit. Returns when it was sent, as [`Fleet::kill_9`].
    async fn terminate(&mut self, name: &str) -> (Instant, String) {
        let db_at = self.db_now().await;
        let at = Instant::now();
        self.signal(name, "TERM");
        (at, db_at)
    }

    /// Waits for the instance to exit after `SIGTERM`; it must exit cleanly.
    async fn wait_exit(&mut self, name: &str) {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(status) = self.instance(name).child.try_wait().unwrap() {
                self.instance(name).life = Life::Exited;
                assert!(status.success(), "{name} exited with {status} after SIGTERM\n{}", self.describe().await);
                return;
            }
            if Instant::now() > deadline {
                panic!("{name} did not exit within {TIMEOUT:?} of SIGTERM\n{}", self.describe().await);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Tasks per owner, counting only live leases.
    async fn split(&self) -> BTreeMap<String, usize> {
        let rows = sqlx::query(
            "SELECT owner, count(*) FROM parsley.tasks WHERE model = $1 AND lease_until > now() GROUP BY owner",
        )
        .bind(&self.stack.names.model)
        .fetch_all(&self.stack.pool)
        .await
        .unwrap();
        rows.iter().map(|r| (r.get::<String, _>(0), r.get::<i64, _>(1) as usize)).collect()
    }

    /// The tasks `owner` holds with a live lease.
    async fn owned(&self, owner: &str) -> Vec<i32> {
        sqlx::query_scalar(
            "SELECT task FROM parsley.tasks WHERE model = $1 AND owner = $2 AND lease_until > now() ORDER BY task",
        )
        .bind(&self.stack.names.model)
        .bind(owner)
        .fetch_all(&self.stack.pool)
        .await
        .unwrap()
    }

    /// The instances with a live membership.
    async fn members(&self) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT instance FROM parsley.members WHERE model = $1 AND lease_until > now() ORDER BY instance",
        )
        .bind(&self.stack.names.model)
        .fetch_all(&self.stack.pool)
        .await
        .unwrap()
    }

    /// Waits until `names` share the tasks evenly, each holding its share with a live lease
    /// and nobody else holding any; returns how long that took.
    async fn wait_for_even_split(&self, names: &[&str]) -> Duration {
        let share = TASKS / names.len();
        let want: BTreeMap<String, usize> = names.iter().map(|n| (n.to_string(), share)).collect();
        let started = Instant::now();
        loop {
            let split = self.split().await;
            if split == want {
                return started.elapsed();
            }
            if started.elapsed() > CONVERGE {
                panic!(
                    "the tasks were not split {want:?} within {CONVERGE:?}; last split {split:?}\n{}",
                    self.describe().await
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every one of `tasks` has an owner other than `from` with a live lease that
    /// has stepped since `since_db` (the database's clock when `from` went away, taken at
    /// `since`); returns the time from `since` until they were all taken (owned elsewhere
    /// with a live lease), and until they had all stepped too. Gives up after `LEASE` + 10 s.
    async fn wait_for_takeover(
        &self,
        from: &str,
        tasks: &[i32],
        since: Instant,
        since_db: &str,
    ) -> (Duration, Duration) {
        let limit = LEASE + Duration::from_secs(10);
        let mut all_taken = None;
        loop {
            let (owned, taken): (i64, i64) = sqlx::query_as(
                "SELECT count(*), count(*) FILTER (WHERE last_step_at > $4::timestamptz)
                   FROM parsley.tasks WHERE model = $1 AND task = ANY($2) AND owner <> $3 AND lease_until > now()",
            )
            .bind(&self.stack.names.model)
            .bind(tasks)
            .bind(from)
            .bind(since_db)
            .fetch_one(&self.stack.pool)
            .await
            .unwrap();
            if owned as usize == tasks.len() && all_taken.is_none() {
                all_taken = Some(since.elapsed());
            }
            if let Some(at) = all_taken.filter(|_| taken as usize == tasks.len()) {
                return (at, since.elapsed());
            }
            if since.elapsed() > limit {
                panic!(
                    "{taken} of {from}'s tasks {tasks:?} run elsewhere {limit:?} after it went away (at {since_db})\n{}",
                    self.describe().await
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits until the instance logs, after byte `from` of its log, for each of `tasks`, a
    /// line saying another owner or instance took it ([`FENCED`]); returns those lines.
    async fn wait_for_lost(&mut self, name: &str, from: usize, tasks: &[i32]) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let log = std::fs::read(&self.instance(name).log).unwrap();
            let later = String::from_utf8_lossy(&log[from.min(log.len())..]).into_owned();
            let lost: Vec<String> =
                later.lines().filter(|l| FENCED.iter().any(|m| l.contains(m))).map(str::to_string).collect();
            let names_task = |l: &String, t: i32| l.split_whitespace().any(|w| w == format!("task={t}"));
            let missing: Vec<i32> = tasks.iter().copied().filter(|&t| !lost.iter().any(|l| names_task(l, t))).collect();
            if missing.is_empty() {
                return lost;
            }
            if Instant::now() > deadline {
                panic!("{name} never logged that it lost tasks {missing:?} ({FENCED:?})\n{}", self.describe().await);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The tasks and members tables, for a failure message (the log tails are printed when the
    /// fleet is dropped by the panic).
    async fn describe(&self) -> String {
        let model = &self.stack.names.model;
        let mut out = format!("model {model}, logs in {}\n", self.dir.path().display());
        let tasks = sqlx::query(
            "SELECT task, epoch, owner, status, coalesce((lease_until > now())::text, 'null'),
                    coalesce(round(extract(epoch FROM lease_until - now()) * 1000)::text, '-'),
                    coalesce(round(extract(epoch FROM now() - last_step_at) * 1000)::text, '-')
               FROM parsley.tasks WHERE model = $1 ORDER BY task",
        )
        .bind(model)
        .fetch_all(&self.stack.pool)
        .await;
        match tasks {
            Ok(rows) => {
                out.push_str("task epoch owner status lease_live lease_left_ms since_step_ms\n");
                for r in rows {
                    out.push_str(&format!(
                        "{:>4} {:>5} {} {} {} {} {}\n",
                        r.get::<i32, _>(0),
                        r.get::<i64, _>(1),
                        r.get::<String, _>(2),
                        r.get::<String, _>(3),
                        r.get::<String, _>(4),
                        r.get::<String, _>(5),
                        r.get::<String, _>(6),
                    ));
                }
            }
            Err(e) => out.push_str(&format!("(reading parsley.tasks: {e})\n")),
        }
        let members = sqlx::query(
            "SELECT instance, incarnation, balanced, (lease_until > now())::text FROM parsley.members
              WHERE model = $1 ORDER BY instance",
        )
        .bind(model)
        .fetch_all(&self.stack.pool)
        .await;
        match members {
            Ok(rows) => {
                out.push_str("members: instance incarnation balanced lease_live\n");
                for r in rows {
                    out.push_str(&format!(
                        "  {} {} {} {}\n",
                        r.get::<String, _>(0),
                        r.get::<String, _>(1),
                        r.get::<bool, _>(2),
                        r.get::<String, _>(3)
                    ));
                }
            }
            Err(e) => out.push_str(&format!("(reading parsley.members: {e})\n")),
        }
        out.push_str("(the instances' log tails follow the panic)");
        out
    }
}

impl Drop for Fleet {
    /// Ends every instance; after a failure, prints the end of each one's log first.
    fn drop(&mut self) {
        if std::thread::panicking() {
            for i in &self.instances {
                eprintln!("--- {} ({:?}), last lines of {}:\n{}", i.name, i.life, i.log.display(), i.tail(40));
            }
        }
        for i in &mut self.instances {
            let _ = i.child.kill();
            let _ = i.child.wait();
        }
    }
}

/// What the sessions have done so far, read while they run.
struct Progress {
    /// Reads served (200) per session.
    reads: Vec<AtomicU64>,
    writes: AtomicU64,
    /// 503s, each retried with the same token.
    unavailable: AtomicU64,
    violations: AtomicU64,
}

/// What a session knows of one of its keys: it is the only writer.
#[derive(Clone, Debug)]
struct KeyState {
    /// Writes acknowledged: the document's version once all are applied.
    writes: i64,
    /// The document after those writes, in order.
    expected: Value,
    /// The highest session sequence number a read of the key showed.
    last_seen: i64,
}

/// One session's record: its keys, its last token, what went wrong.
struct SessionLog {
    id: usize,
    token: Option<String>,
    keys: BTreeMap<String, KeyState>,
    violations: Vec<String>,
}

impl SessionLog {
    fn violation(&mut self, progress: &Progress, what: String) {
        progress.violations.fetch_add(1, Ordering::Relaxed);
        if self.violations.len() < 10 {
            self.violations.push(format!("session {}: {what}", self.id));
        }
    }

    /// Checks a read of `key`: served, exactly the key's writes so far, never behind an
    /// earlier read. Takes the refreshed token.
    fn check_read(&mut self, progress: &Progress, key: &str, reply: &Reply, what: &str) {
        if reply.status != StatusCode::OK {
            let message = format!("{what} of {key}: {} {}", reply.status, reply.json);
            return self.violation(progress, message);
        }
        progress.reads[self.id].fetch_add(1, Ordering::Relaxed);
        self.token = Some(reply.token());
        let state = self.keys.get_mut(key).unwrap();
        let seen = reply.json["document"]["seq"].as_i64().unwrap_or(-1);
        let went_back = seen < state.last_seen;
        state.last_seen = state.last_seen.max(seen);
        let (version, document) = (reply.json["version"].as_i64(), &reply.json["document"]);
        if version != Some(state.writes) || *document != state.expected {
            let message = format!(
                "{what} of {key}{}: version {version:?} {document}, expected version {} {}",
                if went_back { " went back" } else { "" },
                state.writes,
                state.expected
            );
            self.violation(progress, message);
        }
    }
}

/// Sessions writing and reading through the gateway until stopped.
struct Workload {
    stop: Arc<AtomicBool>,
    progress: Arc<Progress>,
    sessions: Vec<JoinHandle<SessionLog>>,
}

impl Workload {
    fn start(stack: &Stack) -> Workload {
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(Progress {
            reads: (0..SESSIONS).map(|_| AtomicU64::new(0)).collect(),
            writes: AtomicU64::new(0),
            unavailable: AtomicU64::new(0),
            violations: AtomicU64::new(0),
        });
        let sessions = (0..SESSIONS)
            .map(|id| {
                let (router, names) = (stack.router.clone(), clone_names(&stack.names));
                tokio::spawn(session(id, router, names, stop.clone(), progress.clone()))
            })
            .collect();
        Workload { stop, progress, sessions }
    }

    /// Waits until every session has been served `reads` more reads.
    async fn wait_for_reads(&self, fleet: &Fleet, reads: u64) {
        let counts = |p: &Progress| p.reads.iter().map(|r| r.load(Ordering::Relaxed)).collect::<Vec<_>>();
        let from = counts(&self.progress);
        let started = Instant::now();
        loop {
            let now = counts(&self.progress);
            if now.iter().zip(&from).all(|(n, f)| *n >= f + reads) {
                return;
            }
            if started.elapsed() > CONVERGE {
                panic!(
                    "the sessions were not served {reads} more reads within {CONVERGE:?}: {from:?} -> {now:?}, \
                     violations so far {}\n{}",
                    self.progress.violations.load(Ordering::Relaxed),
                    fleet.describe().await
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the sessions, then checks each key through the gateway (with the session's last
    /// token) and in `projection.documents`: its version is the number of its writes and its
    /// document their result in order. Panics listing every violation.
    async fn finish(self, fleet: &Fleet) -> Progress {
        self.stop.store(true, Ordering::Relaxed);
        let mut logs = Vec::new();
        for s in self.sessions {
            logs.push(s.await.expect("a session task panicked"));
        }
        let stack = &fleet.stack;
        let stored: BTreeMap<String, (Value, i64)> =
            sqlx::query("SELECT key, doc, version FROM projection.documents WHERE model = $1")
                .bind(&stack.names.model)
                .fetch_all(&stack.pool)
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get(0), (r.get(1), r.get(2))))
                .collect();
        for log in &mut logs {
            let token = log.token.clone();
            for key in log.keys.keys().cloned().collect::<Vec<_>>() {
                let state = log.keys[&key].clone();
                if state.writes == 0 {
                    continue;
                }
                let reply = gated_read(&stack.router, &stack.names.model, &key, token.as_deref(), &self.progress).await;
                log.check_read(&self.progress, &key, &reply, "final read");
                match stored.get(&key) {
                    Some((doc, version)) if *doc == state.expected && *version == state.writes => {}
                    found => log.violation(
                        &self.progress,
                        format!(
                            "stored {key}: {found:?}, expected version {} {} (applied twice, lost or out of order)",
                            state.writes, state.expected
                        ),
                    ),
                }
            }
        }
        let written: BTreeSet<&String> =
            logs.iter().flat_map(|l| l.keys.iter().filter(|(_, s)| s.writes > 0)).map(|(k, _)| k).collect();
        let extra: Vec<&String> = stored.keys().filter(|k| !written.contains(k)).collect();
        let p = &self.progress;
        eprintln!(
            "workload: {} writes, {:?} reads served per session, {} answered 503 (retried), {} violations",
            p.writes.load(Ordering::Relaxed),
            p.reads.iter().map(|r| r.load(Ordering::Relaxed)).collect::<Vec<_>>(),
            p.unavailable.load(Ordering::Relaxed),
            p.violations.load(Ordering::Relaxed),
        );
        let violations: Vec<&String> = logs.iter().flat_map(|l| &l.violations).collect();
        if !violations.is_empty() || !extra.is_empty() {
            panic!(
                "{} violations ({} shown), documents nobody wrote {extra:?}:\n{}\n{}",
                p.violations.load(Ordering::Relaxed),
                violations.len(),
                violations.iter().map(|v| v.as_str()).collect::<Vec<_>>().join("\n"),
                fleet.describe().await
            );
        }
        Arc::try_unwrap(self.progress).unwrap_or_else(|_| panic!("the sessions are done"))
    }
}

fn clone_names(n: &Names) -> Names {
    Names { model: n.model.clone(), orders: n.orders.clone(), payments: n.payments.clone() }
}

/// Two keys of session `id`, on partitions `id` and `id + SESSIONS` of the model's topics.
fn session_keys(id: usize) -> Vec<String> {
    [id, id + SESSIONS]
        .iter()
        .map(|&partition| {
            (0..)
                .map(|n| format!("s{id}-{n}"))
                .find(|k| parsley::murmur2::partition_for_key(k.as_bytes(), TASKS as u32) as usize == partition)
                .unwrap()
        })
        .collect()
}

/// Reads `key` with `token`; a 503 is counted and retried with the same token, for up to
/// [`CONVERGE`]. Returns the first other answer, or the last 503.
async fn gated_read(router: &Router, model: &str, key: &str, token: Option<&str>, progress: &Progress) -> Reply {
    let uri = format!("/v1/models/{model}/documents/{key}");
    let started = Instant::now();
    loop {
        let reply = send(router, Method::GET, &uri, token, None).await;
        if reply.status != StatusCode::SERVICE_UNAVAILABLE || started.elapsed() > CONVERGE {
            return reply;
        }
        progress.unavailable.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The RFC 7396 merge of `patch` (an object without nulls) into `target`.
fn merged(target: &Value, patch: &Value) -> Value {
    let mut doc = target.as_object().cloned().unwrap_or_default();
    for (k, v) in patch.as_object().unwrap() {
        doc.insert(k.clone(), v.clone());
    }
    Value::Object(doc)
}

/// One session: alternately on its two keys, a write (every third a replace through the
/// orders topic, else a merge patch through the payments topic; each carrying the session's
/// sequence number), then a read of that key with the write's token, then a read of its other
/// key with the read's token. Every read must show exactly the key's writes so far.
async fn session(
    id: usize,
    router: Router,
    names: Names,
    stop: Arc<AtomicBool>,
    progress: Arc<Progress>,
) -> SessionLog {
    let keys = session_keys(id);
    let mut log = SessionLog {
        id,
        token: None,
        keys: keys.iter().map(|k| (k.clone(), KeyState { writes: 0, expected: Value::Null, last_seen: 0 })).collect(),
        violations: Vec::new(),
    };
    let mut seq = 0i64;
    while !stop.load(Ordering::Relaxed) {
        seq += 1;
        let key = &keys[seq as usize % 2];
        let other = &keys[(seq as usize + 1) % 2];
        let state = &log.keys[key];
        let writes = state.writes + 1;
        let (topic, value, expected) = if writes % 3 == 1 {
            let value = json!({"session": id, "key": key, "seq": seq, "writes": writes});
            (&names.orders, value.clone(), value)
        } else {
            let mut patch = Map::new();
            patch.insert("seq".into(), json!(seq));
            patch.insert("writes".into(), json!(writes));
            patch.insert(format!("m{writes}"), json!(seq));
            let patch = Value::Object(patch);
            (&names.payments, patch.clone(), merged(&state.expected, &patch))
        };
        let body = json!({"key": key, "value": value});
        let w = send(&router, Method::POST, &format!("/v1/topics/{topic}/records"), log.token.as_deref(), Some(&body))
            .await;
        if w.status != StatusCode::CREATED {
            // Whether it was produced is unknown: the session's expectations end here.
            log.violation(&progress, format!("write {seq} to {key}: {} {}", w.status, w.json));
            break;
        }
        progress.writes.fetch_add(1, Ordering::Relaxed);
        let state = log.keys.get_mut(key).unwrap();
        state.writes = writes;
        state.expected = expected;
        let written = w.token();
        let r = gated_read(&router, &names.model, key, Some(&written), &progress).await;
        log.check_read(&progress, key, &r, &format!("read after write {seq}"));
        if log.keys[other].writes > 0 {
            let token = log.token.clone().unwrap_or(written);
            let r = gated_read(&router, &names.model, other, Some(&token), &progress).await;
            log.check_read(&progress, other, &r, &format!("read of the other key after write {seq}"));
        }
    }
    log
}

/// A single instance stopped by `SIGTERM` and another started after a pause: the sessions'
/// reads wait and answer 503 meanwhile, never stale, and nothing is applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_single_instance_keeps_every_session_consistent() {
    let mut fleet = Fleet::new("failover-restart").await;
    let first = fleet.spawn();
    let workload = Workload::start(&fleet.stack);
    workload.wait_for_reads(&fleet, 5).await;

    fleet.terminate(&first).await;
    fleet.wait_exit(&first).await;
    tokio::time::sleep(Duration::from_millis(2 * READ_WAIT_MS + 500)).await;
    fleet.spawn();
    workload.wait_for_reads(&fleet, 5).await;
    let progress = workload.finish(&fleet).await;
    assert!(progress.unavailable.load(Ordering::Relaxed) > 0, "the sessions' reads waited out the pause as 503s");
}

/// What a takeover after a crash may take: the lease (the dead owner's last renewal was at
/// most now), then at most a heartbeat until another instance's balancer claims the tasks —
/// plus its tick's own queries and this test's 25 ms polling, bounded together by
/// `TICK_AND_POLL`. A restore and a first step follow the claim, within `FIRST_STEP`.
fn within_a_lease_and_a_heartbeat(event: &str, taken: Duration, stepped: Duration) {
    const TICK_AND_POLL: Duration = Duration::from_millis(500);
    const FIRST_STEP: Duration = Duration::from_secs(2);
    assert!(
        taken <= LEASE + HEARTBEAT + TICK_AND_POLL,
        "after {event} the tasks were taken in {taken:?}: more than the lease ({LEASE:?}) and a heartbeat ({HEARTBEAT:?})"
    );
    assert!(
        stepped <= taken + FIRST_STEP,
        "after {event} the tasks were taken in {taken:?} but first stepped only at {stepped:?}"
    );
}

/// The markers of an instance that finds another took its task: its step rejected by the
/// epoch (the runner's line) or its heartbeat finding the lease gone (the balancer's).
const FENCED: [&str; 2] = ["another owner took the task", "another instance took the task"];

/// Three instances share the 12 tasks 4/4/4; `kill -9` of one under load: its tasks run
/// elsewhere within the lease and a step, the sessions are served again, and the two left
/// share the tasks 6/6.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_of_an_instance_under_load_moves_its_tasks_within_the_lease() {
    let mut fleet = Fleet::new("failover-kill").await;
    for _ in 0..3 {
        fleet.spawn();
    }
    let workload = Workload::start(&fleet.stack);
    let converged = fleet.wait_for_even_split(&["p0", "p1", "p2"]).await;
    eprintln!("3 instances split 4/4/4 after {} ms", converged.as_millis());
    workload.wait_for_reads(&fleet, 5).await;

    let owned = fleet.owned("p1").await;
    let (at, db_at) = fleet.kill_9("p1").await;
    let (taken, stepped) = fleet.wait_for_takeover("p1", &owned, at, &db_at).await;
    eprintln!(
        "takeover after kill -9: taken in {} ms, stepped in {} ms (lease {} ms)",
        taken.as_millis(),
        stepped.as_millis(),
        LEASE.as_millis()
    );
    within_a_lease_and_a_heartbeat("kill -9", taken, stepped);

    workload.wait_for_reads(&fleet, 5).await;
    fleet.wait_for_even_split(&["p0", "p2"]).await;
    workload.finish(&fleet).await;
}

/// An owner frozen (`SIGSTOP`) under load for longer than its lease is taken over; woken
/// (`SIGCONT`), it finds its tasks gone (its step rejected by the epoch, nothing applied
/// twice) and rejoins: the split is 4/4/4 again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_owner_is_taken_over_and_fenced_when_it_wakes() {
    const FROZEN: Duration = Duration::from_secs(8);
    let mut fleet = Fleet::new("failover-freeze").await;
    for _ in 0..3 {
        fleet.spawn();
    }
    let workload = Workload::start(&fleet.stack);
    fleet.wait_for_even_split(&["p0", "p1", "p2"]).await;
    workload.wait_for_reads(&fleet, 5).await;

    let owned = fleet.owned("p0").await;
    let (at, db_at) = fleet.freeze("p0").await;
    let (taken, stepped) = fleet.wait_for_takeover("p0", &owned, at, &db_at).await;
    eprintln!(
        "takeover after SIGSTOP: taken in {} ms, stepped in {} ms (lease {} ms)",
        taken.as_millis(),
        stepped.as_millis(),
        LEASE.as_millis()
    );
    within_a_lease_and_a_heartbeat("SIGSTOP", taken, stepped);
    workload.wait_for_reads(&fleet, 5).await;
    tokio::time::sleep(FROZEN.saturating_sub(at.elapsed())).await;

    let from = fleet.instance("p0").log_len();
    fleet.thaw("p0");
    let lost = fleet.wait_for_lost("p0", from, &owned).await;
    eprintln!("woken after {} ms frozen, p0 logged:\n  {}", at.elapsed().as_millis(), lost.join("\n  "));
    let rejoined = fleet.wait_for_even_split(&["p0", "p1", "p2"]).await;
    eprintln!("split 4/4/4 again {} ms after SIGCONT", rejoined.as_millis());
    workload.wait_for_reads(&fleet, 5).await;
    workload.finish(&fleet).await;
}

/// A fourth instance joins under load: the split becomes 3/3/3/3 without a double delivery.
/// Then one leaves by `SIGTERM`: it hands its tasks back and the others run them at once,
/// well within the lease; the split is 4/4/4 and its membership is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_joining_instance_takes_its_share_and_a_leaving_one_hands_its_tasks_over_at_once() {
    let mut fleet = Fleet::new("failover-join").await;
    for _ in 0..3 {
        fleet.spawn();
    }
    let workload = Workload::start(&fleet.stack);
    fleet.wait_for_even_split(&["p0", "p1", "p2"]).await;
    workload.wait_for_reads(&fleet, 5).await;

    fleet.spawn();
    let joined = fleet.wait_for_even_split(&["p0", "p1", "p2", "p3"]).await;
    eprintln!("4 instances split 3/3/3/3 {} ms after the fourth started", joined.as_millis());
    workload.wait_for_reads(&fleet, 5).await;

    let owned = fleet.owned("p0").await;
    let (at, db_at) = fleet.terminate("p0").await;
    let (_, took) = fleet.wait_for_takeover("p0", &owned, at, &db_at).await;
    eprintln!("takeover after SIGTERM: {} ms (lease {} ms)", took.as_millis(), LEASE.as_millis());
    assert!(took < LEASE, "after SIGTERM the tasks moved in {took:?}: a lease wait, not a hand-over");
    fleet.wait_exit("p0").await;
    fleet.wait_for_even_split(&["p1", "p2", "p3"]).await;
    assert_eq!(fleet.members().await, ["p1", "p2", "p3"], "the leaving instance's membership is gone");
    workload.wait_for_reads(&fleet, 5).await;
    workload.finish(&fleet).await;
}

/// One trace id followed from a `POST` to the projector step that applied its record: the
/// gateway continues the request's `traceparent` onto the record (a new parent id, the same
/// trace), and the projector instance that applied it logs the trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_trace_id_is_followed_from_a_post_to_the_step_that_applied_it() {
    let mut fleet = Fleet::new("trace").await;
    let name = fleet.spawn();
    fleet.wait_for_even_split(&[name.as_str()]).await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let traceparent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let uri = format!("/v1/topics/{}/records", fleet.stack.names.orders);
    let request = axum::http::Request::builder()
        .method(Method::POST)
        .uri(&uri)
        .header("content-type", "application/json")
        .header("traceparent", &traceparent)
        .body(axum::body::Body::from(r#"{"key":"traced","value":{"n":1}}"#))
        .unwrap();
    let response = tower::ServiceExt::oneshot(fleet.stack.router.clone(), request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let token = response.headers()["parsley-session"].to_str().unwrap().to_string();
    let r = fleet.stack.read("traced", Some(&token)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);

    let deadline = Instant::now() + Duration::from_secs(10);
    let line = loop {
        let log = std::fs::read_to_string(&fleet.instance(&name).log).unwrap_or_default();
        if let Some(line) = log.lines().find(|l| l.contains("applied a traced record") && l.contains(trace_id)) {
            break line.to_string();
        }
        assert!(Instant::now() < deadline, "no log line names the trace:\n{}", fleet.instance(&name).tail(30));
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(line.contains(&format!("traceparent=\"00-{trace_id}-")), "{line}");
    assert!(!line.contains("00f067aa0ba902b7"), "the record carries the gateway's own span as parent: {line}");
    assert!(line.contains(&fleet.stack.names.orders), "{line}");
}
