//! The nemesis and the processes it acts on: projector and gateway instances the checker
//! spawned (or projector PIDs it was given), the services' database connections, the local
//! Kafka broker. Every fault (and its healing) is recorded in the history with its time.
//!
//! Faults, one every `interval`, taking turns:
//! - `kill`: `kill -9` of a spawned projector instance, restarted a second later;
//! - `stop`: `SIGSTOP` of a projector instance past its lease, then `SIGCONT`;
//! - `gateway-restart`: `kill -9` of a spawned gateway, started again on the same port;
//! - `pg-terminate`: `pg_terminate_backend` of every other session of the services' database
//!   (or only those of one `application_name`);
//! - `broker-restart`: the local broker stopped and started again by `scripts/kafka.sh`
//!   (at most once per run: it takes several seconds).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use sqlx::{Connection as _, PgConnection};
use tokio::sync::Mutex;

use crate::workload::Recorder;

/// One kind of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Kill,
    Stop,
    GatewayRestart,
    PgTerminate,
    BrokerRestart,
}

impl Fault {
    pub const ALL: [Fault; 5] =
        [Fault::Kill, Fault::Stop, Fault::GatewayRestart, Fault::PgTerminate, Fault::BrokerRestart];

    pub fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Stop => "stop",
            Fault::GatewayRestart => "gateway-restart",
            Fault::PgTerminate => "pg-terminate",
            Fault::BrokerRestart => "broker-restart",
        }
    }

    /// `all`, `none`, or names separated by commas.
    pub fn parse_list(text: &str) -> anyhow::Result<Vec<Fault>> {
        match text {
            "all" => return Ok(Fault::ALL.to_vec()),
            "none" | "" => return Ok(Vec::new()),
            _ => {}
        }
        text.split(',')
            .map(|name| {
                Fault::ALL.into_iter().find(|f| f.name() == name.trim()).with_context(|| {
                    format!("unknown fault {name:?}: the faults are all, none, or some of kill, stop, gateway-restart, pg-terminate, broker-restart")
                })
            })
            .collect()
    }
}

/// A process the checker started, and how to start it again.
pub struct Spawned {
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
}

impl Spawned {
    pub fn new(name: &str, program: PathBuf, args: &[&str], env: Vec<(String, String)>, log: PathBuf) -> Spawned {
        Spawned {
            name: name.to_string(),
            program,
            args: args.iter().map(|a| a.to_string()).collect(),
            env,
            log,
            child: None,
        }
    }

    pub fn start(&mut self) -> anyhow::Result<u32> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let mut command = Command::new(&self.program);
        command.args(&self.args);
        // Only the configuration file and these variables decide the process's settings.
        for (var, _) in std::env::vars_os() {
            if var.to_string_lossy().starts_with("PARSLEY_") {
                command.env_remove(var);
            }
        }
        let child = command
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {}", self.program.display()))?;
        let pid = child.id();
        self.child = Some(child);
        Ok(pid)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `kill -9`, reaped.
    pub fn kill(&mut self) -> Option<u32> {
        let mut child = self.child.take()?;
        let pid = child.id();
        let _ = child.kill();
        let _ = child.wait();
        Some(pid)
    }

    /// Runs to completion (a one-shot command such as `migrate`).
    pub fn run_to_end(&mut self, within: Duration) -> anyhow::Result<()> {
        self.start()?;
        let began = Instant::now();
        let child = self.child.as_mut().expect("just started");
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                if !status.success() {
                    bail!("{} {:?} failed ({status}); see {}", self.program.display(), self.args, self.log.display());
                }
                return Ok(());
            }
            if began.elapsed() > within {
                self.kill();
                bail!("{} {:?} did not finish within {within:?}", self.program.display(), self.args);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `SIGCONT` (in case it is stopped), `SIGTERM`, then `kill -9` after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        let Some(pid) = self.pid() else { return };
        signal(pid, "CONT");
        signal(pid, "TERM");
        let began = Instant::now();
        while began.elapsed() < grace {
            if let Some(child) = self.child.as_mut() {
                if child.try_wait().ok().flatten().is_some() {
                    self.child = None;
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.kill();
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Some(pid) = self.pid() {
            signal(pid, "CONT");
        }
        self.kill();
    }
}

/// Sends `signal` (`STOP`, `CONT`, `TERM`) to `pid` with `kill`.
pub fn signal(pid: u32, signal: &str) -> bool {
    Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status().is_ok_and(|s| s.success())
}

/// What the nemesis may act on.
pub struct Targets {
    pub projectors: Vec<Arc<Mutex<Spawned>>>,
    /// Projector processes the checker did not start: only frozen and thawed.
    pub projector_pids: Vec<u32>,
    pub gateways: Vec<Arc<Mutex<Spawned>>>,
    /// The services' database, for `pg-terminate`.
    pub database_url: Option<String>,
    /// Only connections with this `application_name` (else every other session of the database).
    pub application_name: Option<String>,
    /// The repository whose `scripts/kafka.sh` runs the local broker.
    pub repo: PathBuf,
}

/// How long a frozen projector stays frozen: past its lease, so another instance takes over.
pub const FROZEN_FOR: Duration = Duration::from_secs(5);

/// Injects `faults` in turn, one every `interval`, until `deadline`.
pub async fn run(
    targets: Arc<Targets>,
    faults: Vec<Fault>,
    interval: Duration,
    deadline: Instant,
    recorder: Arc<Recorder>,
) {
    let usable: Vec<Fault> = faults
        .into_iter()
        .filter(|f| match f {
            Fault::Kill => !targets.projectors.is_empty(),
            Fault::Stop => !targets.projectors.is_empty() || !targets.projector_pids.is_empty(),
            Fault::GatewayRestart => !targets.gateways.is_empty(),
            Fault::PgTerminate => targets.database_url.is_some(),
            Fault::BrokerRestart => true,
        })
        .collect();
    if usable.is_empty() {
        return;
    }
    let mut turn = 0usize;
    let mut broker_restarted = false;
    loop {
        tokio::time::sleep(interval).await;
        if Instant::now() + interval / 2 >= deadline {
            return;
        }
        let fault = usable[turn % usable.len()];
        let n = turn / usable.len();
        turn += 1;
        let result = match fault {
            Fault::Kill => kill(&targets, n, &recorder).await,
            Fault::Stop => freeze(&targets, n, &recorder).await,
            Fault::GatewayRestart => restart_gateway(&targets, n, &recorder).await,
            Fault::PgTerminate => terminate(&targets, &recorder).await,
            Fault::BrokerRestart if broker_restarted => Ok(()),
            Fault::BrokerRestart => {
                broker_restarted = true;
                restart_broker(&targets, &recorder).await
            }
        };
        if let Err(e) = result {
            eprintln!("[check] the {} fault could not be injected: {e:#}", fault.name());
        }
    }
}

async fn kill(targets: &Targets, n: usize, recorder: &Recorder) -> anyhow::Result<()> {
    let instance = &targets.projectors[n % targets.projectors.len()];
    {
        let mut p = instance.lock().await;
        let pid = p.kill().context("the projector is not running")?;
        recorder.fault(format!("kill -9 projector {} (pid {pid})", p.name));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut p = instance.lock().await;
    let pid = p.start()?;
    recorder.fault(format!("restarted projector {} (pid {pid})", p.name));
    Ok(())
}

async fn freeze(targets: &Targets, n: usize, recorder: &Recorder) -> anyhow::Result<()> {
    let spawned = targets.projectors.len();
    let (pid, name) = if n % (spawned + targets.projector_pids.len()) < spawned {
        let p = targets.projectors[n % (spawned + targets.projector_pids.len())].lock().await;
        (p.pid().context("the projector is not running")?, p.name.clone())
    } else {
        let pid = targets.projector_pids[n % (spawned + targets.projector_pids.len()) - spawned];
        (pid, format!("pid {pid}"))
    };
    if !signal(pid, "STOP") {
        bail!("SIGSTOP to {pid} failed");
    }
    recorder.fault(format!("SIGSTOP projector {name} (pid {pid})"));
    tokio::time::sleep(FROZEN_FOR).await;
    signal(pid, "CONT");
    recorder.fault(format!("SIGCONT projector {name} (pid {pid})"));
    Ok(())
}

async fn restart_gateway(targets: &Targets, n: usize, recorder: &Recorder) -> anyhow::Result<()> {
    let mut g = targets.gateways[n % targets.gateways.len()].lock().await;
    let pid = g.kill().context("the gateway is not running")?;
    recorder.fault(format!("kill -9 gateway {} (pid {pid})", g.name));
    let pid = g.start()?;
    recorder.fault(format!("restarted gateway {} (pid {pid})", g.name));
    Ok(())
}

async fn terminate(targets: &Targets, recorder: &Recorder) -> anyhow::Result<()> {
    let url = targets.database_url.as_deref().context("no database")?;
    let mut connection = PgConnection::connect(url).await.context("connecting to the services' database")?;
    let terminated =
        parsley_store::database::terminate_other_sessions(&mut connection, targets.application_name.as_deref()).await;
    let _ = connection.close().await;
    let terminated = terminated?;
    recorder.fault(format!("pg_terminate_backend of {terminated} connection(s)"));
    Ok(())
}

async fn restart_broker(targets: &Targets, recorder: &Recorder) -> anyhow::Result<()> {
    recorder.fault("broker restart: stopping the Kafka broker".into());
    kafka_script(&targets.repo, "kafka_down").await?;
    let up = kafka_script(&targets.repo, "kafka_up").await;
    recorder.fault("broker restart: the Kafka broker is up again".into());
    up.context("start it with `make services-up`")
}

/// Runs one function of `scripts/kafka.sh` (the broker `make services-up` started).
async fn kafka_script(repo: &std::path::Path, step: &'static str) -> anyhow::Result<()> {
    let repo = repo.to_path_buf();
    let status = tokio::task::spawn_blocking(move || {
        Command::new("bash")
            .current_dir(&repo)
            .args(["-c", &format!("source scripts/lib.sh && source scripts/kafka.sh && {step}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
    })
    .await?
    .with_context(|| format!("running scripts/kafka.sh {step}"))?;
    if !status.success() {
        bail!("scripts/kafka.sh {step} failed ({status})");
    }
    Ok(())
}
