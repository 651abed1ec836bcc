//! `parsley-demo`: the scripted session behind `make demo` (`scripts/demo.sh` starts the
//! services, the projector and the gateway, and calls these steps in order). Each step prints
//! its part of the narrative and checks what it shows; any expectation that does not hold
//! ends the process with a non-zero status and says which.
//!
//! # Layout
//! - [`context`]: the configuration, topics, producers, the gateway's status, output helpers.
//! - [`setup`]: `prepare` (topics and the demo database) and `wait-ready`.
//! - [`held`]: part 1, a payment held until the transaction holding its order commits.
//! - [`session`]: parts 2 and 3, read-your-writes through the gateway, a tampered token,
//!   and a read refused with its gaps while the projector is stopped.
//! - `http`: the minimal HTTP/1.1 client the steps use (infra's, shared with the checker).

mod context;
mod held;
use parsley_infra::http;
mod session;
mod setup;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;

use crate::context::Demo;

const USAGE: &str = "\
usage: parsley-demo <step> [--config PATH] [--run ID] [options]

steps (scripts/demo.sh runs them in this order):
  prepare                     create the demo topics if missing; create the demo database, or
                              recreate it when its state names topics that no longer exist
  wait-ready --owner NAME [--timeout SECONDS]
                              wait for the gateway's /readyz and for projector NAME to take every task
  held-effect                 part 1: a payment held until the transaction holding its order commits
  read-your-writes            part 2: write, read back with the token, stamped causes, tampered token
  outage --state FILE         part 3 (projector stopped): the session's read is refused with its gap
  recover --state FILE        part 3 (projector started again): the same read is served

The configuration is --config, else $PARSLEY_CONFIG, else config/demo.toml. --run makes this
run's document keys unique (default: the current time).";

struct Args {
    step: String,
    config: PathBuf,
    run: String,
    owner: Option<String>,
    timeout: Duration,
    state: Option<PathBuf>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = std::env::args().skip(1);
    let step = args.next().unwrap_or_default();
    if step.is_empty() || matches!(step.as_str(), "-h" | "--help" | "help") {
        println!("{USAGE}");
        std::process::exit(0);
    }
    if matches!(step.as_str(), "-V" | "--version") {
        println!("parsley-demo {}", parsley_infra::version!());
        std::process::exit(0);
    }
    let mut parsed = Args {
        step,
        config: std::env::var_os("PARSLEY_CONFIG").map_or_else(|| PathBuf::from("config/demo.toml"), PathBuf::from),
        run: default_run_id(),
        owner: None,
        timeout: Duration::from_secs(60),
        state: None,
    };
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().with_context(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--config" => parsed.config = PathBuf::from(value("--config")?),
            "--run" => parsed.run = value("--run")?,
            "--owner" => parsed.owner = Some(value("--owner")?),
            "--state" => parsed.state = Some(PathBuf::from(value("--state")?)),
            "--timeout" => {
                let v = value("--timeout")?;
                let seconds: u64 = v.parse().with_context(|| format!("--timeout {v:?} is not a number of seconds"))?;
                parsed.timeout = Duration::from_secs(seconds);
            }
            other => usage(&format!("unknown argument {other:?}")),
        }
    }
    Ok(parsed)
}

/// A usage error: named on stderr with the usage, exit status 2.
fn usage(message: &str) -> ! {
    eprintln!("parsley-demo: {message}\n\n{USAGE}");
    std::process::exit(i32::from(parsley_infra::cli::exit::USAGE))
}

fn default_run_id() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    format!("t{secs}")
}

fn main() -> std::process::ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("demo FAILED: starting the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo FAILED: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    let args = parse_args()?;
    if args.step == "prepare" {
        return setup::prepare(&args.config).await;
    }
    let demo = Demo::load(&args.config, &args.run).await?;
    let state = || args.state.clone().context("this step needs --state FILE");
    match args.step.as_str() {
        "wait-ready" => {
            let owner = args.owner.as_deref().context("wait-ready needs --owner NAME")?;
            setup::wait_ready(&demo, owner, args.timeout).await
        }
        "held-effect" => held::run(&demo).await,
        "read-your-writes" => session::read_your_writes(&demo).await,
        "outage" => session::outage(&demo, &state()?).await,
        "recover" => session::recover(&demo, &state()?).await,
        other => usage(&format!("unknown step {other:?}")),
    }
}
