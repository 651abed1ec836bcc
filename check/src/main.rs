//! `parsley-check`: `run` drives a session workload through the gateways (optionally under
//! faults, optionally on processes it starts) and judges it; `verify FILE` judges a saved
//! history again. Progress on stderr; one JSON line on stdout; exit 0 iff no violation and
//! at least one read of each kind was judged (1 otherwise, 2 on an error).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _};
use parsley_check::history;
use parsley_check::judge::{judge, Verdict};
use parsley_check::nemesis::Fault;
use parsley_check::run::{self, Options, Spawn};
use parsley_infra::cli::{self, Arg, ArgAction, ArgMatches, Command};

fn command() -> Command {
    let value = |name: &'static str, help: &'static str| Arg::new(name).long(name).action(ArgAction::Set).help(help);
    Command::new("parsley-check")
        .version(parsley_infra::version!())
        .about("checks the gateway's session guarantees on a deployment, under faults")
        .subcommand(
            Command::new("run")
                .about("run a session workload through the gateways and judge its history")
                .arg(value("gateway", "a gateway's base URL, http://host:port (repeatable)").action(ArgAction::Append))
                .arg(value("model", "the model to read").required(true))
                .arg(value(
                    "query",
                    "MODEL/QUERY: half the single-key reads through this named query of a SQL model applying \
                     the same topics (parameter `key`; one row with `document` and `version`)",
                ))
                .arg(value("replace-topic", "a topic the model applies with replace").required(true))
                .arg(value("merge-topic", "a topic the model applies with merge").required(true))
                .arg(value("duration", "how long to run: 30s, 2m, 500ms").default_value("30s"))
                .arg(value("ops", "stop after this many operations"))
                .arg(value("sessions", "concurrent sessions").default_value("8"))
                .arg(value("keys", "the hot key set's size").default_value("16"))
                .arg(value("write-percent", "how many of every 100 operations are writes").default_value("45"))
                .arg(
                    value("nemesis", "faults: all, none, or kill,stop,gateway-restart,pg-terminate,broker-restart")
                        .default_value("none"),
                )
                .arg(value("nemesis-interval", "time between faults").default_value("5s"))
                .arg(
                    value("projector-pid", "a projector process to freeze and thaw (repeatable)")
                        .action(ArgAction::Append),
                )
                .arg(value("database-url", "the services' database, for pg-terminate (else $DATABASE_URL)"))
                .arg(value("application-name", "pg-terminate only connections with this application_name"))
                .arg(value("spawn-projectors", "start this many projector instances").default_value("0"))
                .arg(value("spawn-gateways", "start this many gateways").default_value("0"))
                .arg(value("config", "the configuration file the spawned services read"))
                .arg(value("bin-dir", "where parsley-projector and parsley-gateway are (default: beside this binary)"))
                .arg(
                    value("spawn-database", "the spawned services' database, created when missing")
                        .default_value("parsley_check"),
                )
                .arg(value("partitions", "partitions of topics the checker creates").default_value("4"))
                .arg(value("base-port", "the first spawned gateway's port").default_value("18780"))
                .arg(value("seed", "the workload's seed (default: from the clock)"))
                .arg(value("history", "save the history to this file (JSON lines)")),
        )
        .subcommand(
            Command::new("verify")
                .about("judge a saved history again")
                .arg(Arg::new("file").required(true).help("a history saved with run --history")),
        )
}

/// `30s`, `2m`, `500ms`, or plain seconds.
fn duration(text: &str) -> anyhow::Result<Duration> {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = number.parse().with_context(|| format!("not a duration: {text:?}"))?;
    Ok(match unit {
        "ms" => Duration::from_millis(n),
        "" | "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        _ => bail!("not a duration: {text:?} (use ms, s or m)"),
    })
}

fn number<T: std::str::FromStr>(m: &ArgMatches, name: &str) -> anyhow::Result<Option<T>> {
    m.get_one::<String>(name)
        .map(|v| v.parse::<T>().map_err(|_| anyhow::anyhow!("--{name}: not a number: {v:?}")))
        .transpose()
}

fn options(m: &ArgMatches) -> anyhow::Result<Options> {
    let s = |name: &str| m.get_one::<String>(name).cloned().unwrap_or_default();
    let spawn_projectors: usize = number(m, "spawn-projectors")?.unwrap_or(0);
    let spawn_gateways: usize = number(m, "spawn-gateways")?.unwrap_or(0);
    let spawn = if spawn_projectors + spawn_gateways > 0 {
        let config = m.get_one::<String>("config").context("--spawn-* needs --config FILE")?;
        let bin_dir = match m.get_one::<String>("bin-dir") {
            Some(d) => PathBuf::from(d),
            None => std::env::current_exe()?.parent().context("the binary's directory")?.to_path_buf(),
        };
        Some(Spawn {
            projectors: spawn_projectors,
            gateways: spawn_gateways,
            config: std::fs::canonicalize(config).with_context(|| format!("--config {config}"))?,
            bin_dir,
            database: s("spawn-database"),
            partitions: number(m, "partitions")?.unwrap_or(4),
            base_port: number(m, "base-port")?.unwrap_or(18780),
        })
    } else {
        None
    };
    Ok(Options {
        gateways: m.get_many::<String>("gateway").map(|g| g.cloned().collect()).unwrap_or_default(),
        model: s("model"),
        replace_topic: s("replace-topic"),
        merge_topic: s("merge-topic"),
        duration: duration(&s("duration"))?,
        max_ops: number(m, "ops")?,
        sessions: number(m, "sessions")?.unwrap_or(8).max(1),
        keys: number(m, "keys")?.unwrap_or(16).max(1),
        write_percent: number(m, "write-percent")?.unwrap_or(45).min(100),
        nemesis: Fault::parse_list(&s("nemesis"))?,
        interval: duration(&s("nemesis-interval"))?,
        projector_pids: m
            .get_many::<String>("projector-pid")
            .map(|p| p.map(|p| p.parse().with_context(|| format!("--projector-pid {p}"))).collect())
            .transpose()?
            .unwrap_or_default(),
        database_url: m
            .get_one::<String>("database-url")
            .cloned()
            .or_else(|| parsley_infra::services::database_url().ok()),
        application_name: m.get_one::<String>("application-name").cloned(),
        spawn,
        repo: std::env::current_dir()?,
        seed: match number(m, "seed")? {
            Some(seed) => seed,
            None => SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos() as u64,
        },
        query: m
            .get_one::<String>("query")
            .map(|q| {
                parsley_check::workload::QueryTarget::parse(q)
                    .with_context(|| format!("--query {q:?}: expected MODEL/QUERY"))
            })
            .transpose()?,
    })
}

/// Prints the violations (each with its excerpt) on stderr and the summary on stdout.
fn report(verdict: &Verdict) -> ExitCode {
    for (i, v) in verdict.violations.iter().enumerate().take(10) {
        eprintln!(
            "[check] VIOLATION {} ({}): session {} operation {} key {}: {}",
            i + 1,
            v.kind.name(),
            v.session,
            v.seq,
            v.key,
            v.detail
        );
        for e in &v.excerpt {
            eprintln!("    {}", serde_json::to_string(e).unwrap_or_default());
        }
    }
    if verdict.violations.len() > 10 {
        eprintln!("[check] … and {} more violation(s)", verdict.violations.len() - 10);
    }
    if verdict.judged_reads == 0 || verdict.judged_collection_reads == 0 {
        eprintln!("[check] not enough was judged: a single-document read and a collection page are both needed");
    }
    println!("{}", verdict.summary());
    if verdict.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

async fn main_result(matches: ArgMatches) -> anyhow::Result<ExitCode> {
    match matches.subcommand() {
        Some(("run", m)) => {
            let options = options(m)?;
            let seed = options.seed;
            eprintln!("[check] seed {seed}");
            let (verdict, events) = run::run(options).await?;
            if let Some(path) = m.get_one::<String>("history") {
                history::save(path.as_ref(), &events)?;
                eprintln!("[check] history saved to {path} ({} events)", events.len());
            }
            Ok(report(&verdict))
        }
        Some(("verify", m)) => {
            let path = m.get_one::<String>("file").expect("required");
            let events = history::load(path.as_ref())?;
            let verdict = judge(&events).map_err(|e| anyhow::anyhow!("{path}: the history is malformed: {e}"))?;
            Ok(report(&verdict))
        }
        _ => unreachable!("a subcommand is required"),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let matches = cli::parse(command());
    match main_result(matches).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("parsley-check: {e:#}");
            ExitCode::from(cli::exit::FAILURE)
        }
    }
}
