//! The projector binary: `run` the configured models until SIGINT/SIGTERM (the library's
//! [`Projector`] with the built-in projections), print their `status` from the database,
//! `skip` the record a task is refused at, `create-topics` missing from the cluster, or apply
//! the schema `migrate`ions (the project's and every model's own).

use std::path::PathBuf;

use anyhow::{bail, Context as _};
use parsley_infra::cli::{self, clap, Arg, ArgAction, Command};
use parsley_infra::{process, telemetry};
use parsley_projector::builder::{apply_model_migrations, connect};
use parsley_projector::create_topics::{create_topics, Outcome};
use parsley_projector::skip::{self, SkipRequest};
use parsley_projector::Projector;
use parsley_settings::config::Config;
use parsley_store::ordering::RecordFound;
use parsley_store::{migrations, roles, status, TaskStatus};
use sqlx::PgPool;

/// What `--help` says after the commands and options.
const AFTER_HELP: &str = "\
The configuration file is --config, else $PARSLEY_CONFIG, else config/parsley.toml.
Environment overrides: every key as PARSLEY_<SECTION>__<KEY> (e.g. PARSLEY_DATABASE__URL,
PARSLEY_MODELS__0__MAX_STEP_MS), and PARSLEY_KAFKA_BOOTSTRAP, PARSLEY_DATABASE_URL (or
DATABASE_URL), PARSLEY_METRICS_ADDRESS, PARSLEY_OWNER. Logs: RUST_LOG (default info); telemetry.log_format = \"json\" for JSON lines; NO_COLOR.
OpenTelemetry: [telemetry] otlp_endpoint (or projector.otlp_endpoint), docs/configuration.md.";

/// The command line: `run`, `status`, `skip`, `create-topics` and `migrate`, each taking
/// `--config PATH`.
fn command() -> Command {
    let models =
        |help: &'static str| Arg::new("model").long("model").value_name("NAME").action(ArgAction::Append).help(help);
    let skip_option = |name: &'static str, value: &'static str, help: &'static str| {
        Arg::new(name).long(name).value_name(value).action(ArgAction::Set).help(help)
    };
    Command::new("parsley-projector")
        .version(parsley_infra::version!())
        .about("Delivers Kafka records into Postgres read models in causal order.")
        .after_help(AFTER_HELP)
        .arg(cli::config_arg())
        .subcommand(
            Command::new("run")
                .about("run the configured models (all, or those named) until SIGINT/SIGTERM")
                .arg(models("a model to run (repeatable; default: every configured model)")),
        )
        .subcommand(
            Command::new("status")
                .about("print every task's state from the database; exit 3 when a task is refused")
                .arg(models("a model to report (repeatable; default: every model with state)")),
        )
        .subcommand(
            Command::new("skip")
                .about("move the task refused at that record past it, delivered without effect")
                .long_about(
                    "move the task refused at that record past it: the record is delivered without effect \
                     (recorded in parsley.skips, with WHO, default the OS user); the task runs again at once",
                )
                .arg(models("the model whose task is refused (exactly one)").required(true).action(ArgAction::Set))
                .arg(skip_option("topic", "TOPIC", "the topic of the record").required(true))
                .arg(
                    skip_option("partition", "N", "its partition")
                        .required(true)
                        .value_parser(clap::value_parser!(i32).range(0..)),
                )
                .arg(
                    skip_option("position", "P", "its position (offset)")
                        .required(true)
                        .value_parser(clap::value_parser!(i64).range(0..)),
                )
                .arg(skip_option("reason", "TEXT", "why it is skipped (recorded)").required(true))
                .arg(skip_option("by", "WHO", "who skips it (recorded; default the OS user)")),
        )
        .subcommand(
            Command::new("create-topics")
                .about("create the configured models' missing topics (co-partitioned) and exit; nothing is deleted")
                .arg(models("a model whose topics to create (repeatable; default: every configured model)"))
                .arg(
                    Arg::new("partitions")
                        .long("partitions")
                        .value_name("N")
                        .default_value("4")
                        .value_parser(clap::value_parser!(u32).range(1..))
                        .help("partitions of each created topic"),
                )
                .arg(
                    Arg::new("replication")
                        .long("replication")
                        .value_name("R")
                        .default_value("1")
                        .value_parser(clap::value_parser!(u32).range(1..))
                        .help("replicas of each created topic"),
                ),
        )
        .subcommand(
            Command::new("migrate")
                .about("bring the database schema up to date (the project's and each model's migrations) and exit")
                .arg(Arg::new("create-roles").long("create-roles").action(ArgAction::SetTrue).help(
                    "also make the least-privilege roles: parsley_gateway and each model's read role \
                     parsley_query_<model>, with row-level security on the documents (needs CREATEROLE; \
                     docs/operations.md, \"Database roles\")",
                ))
                .arg(
                    Arg::new("gateway-user")
                        .long("gateway-user")
                        .value_name("ROLE")
                        .requires("create-roles")
                        .help("with --create-roles: the gateway's login role, granted parsley_gateway"),
                ),
        )
}

struct Args {
    command: String,
    config: PathBuf,
    models: Vec<String>,
    /// `skip`'s options, by name (`--topic`, `--partition`, `--position`, `--reason`, `--by`).
    skip: Vec<(String, String)>,
    /// `create-topics`' `--partitions` and `--replication`.
    create: Option<(u32, u32)>,
    /// `migrate --create-roles`, and its `--gateway-user`.
    roles: Option<Option<String>>,
}

const SKIP_OPTIONS: [&str; 5] = ["topic", "partition", "position", "reason", "by"];

fn parse_args() -> Args {
    let matches = cli::parse(command());
    let config = cli::config_path(&matches, |v| std::env::var_os(v));
    let (command, sub) = matches.subcommand().expect("a subcommand is required");
    let models = match sub.try_get_many::<String>("model") {
        Ok(Some(m)) => m.cloned().collect(),
        _ => Vec::new(),
    };
    let skip = SKIP_OPTIONS
        .iter()
        .filter_map(|name| {
            let value = match *name {
                "partition" => sub.try_get_one::<i32>(name).ok().flatten().map(i32::to_string),
                "position" => sub.try_get_one::<i64>(name).ok().flatten().map(i64::to_string),
                _ => sub.try_get_one::<String>(name).ok().flatten().cloned(),
            };
            value.map(|v| (format!("--{name}"), v))
        })
        .collect();
    let create = sub
        .try_get_one::<u32>("partitions")
        .ok()
        .flatten()
        .copied()
        .zip(sub.try_get_one::<u32>("replication").ok().flatten().copied());
    let roles = sub
        .try_get_one::<bool>("create-roles")
        .ok()
        .flatten()
        .copied()
        .unwrap_or(false)
        .then(|| sub.try_get_one::<String>("gateway-user").ok().flatten().cloned());
    Args { command: command.to_string(), config, models, skip, create, roles }
}

/// `skip`'s request from its options; the recorded "who" is `--by`, else the OS user.
fn skip_request(args: &Args) -> anyhow::Result<SkipRequest> {
    let option = |name: &str| {
        args.skip.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()).with_context(|| format!("skip needs {name}"))
    };
    let [model] = args.models.as_slice() else { bail!("skip needs exactly one --model") };
    let partition = option("--partition")?;
    let position = option("--position")?;
    let os_user = ["USER", "LOGNAME", "USERNAME"].iter().find_map(|v| std::env::var(v).ok().filter(|u| !u.is_empty()));
    Ok(SkipRequest {
        model: model.clone(),
        topic: option("--topic")?,
        partition: partition.parse().with_context(|| format!("--partition {partition:?} is not a partition number"))?,
        position: position.parse().with_context(|| format!("--position {position:?} is not a position"))?,
        reason: option("--reason")?,
        by: option("--by").ok().or(os_user).unwrap_or_else(|| "unknown".to_string()),
    })
}

fn main() -> std::process::ExitCode {
    let args = parse_args();
    process::block_on_status(main_async(args))
}

/// Logs as `telemetry.log_format` says; for `run`, spans and metrics exported when an OTLP
/// endpoint is configured.
fn init_telemetry(config: &Config, command: &str) -> anyhow::Result<telemetry::Telemetry> {
    let export = config.telemetry.export(config.projector.otlp_endpoint.as_deref(), "projector.otlp_endpoint")?;
    let export = export.filter(|_| command == "run");
    let t = telemetry::init(
        "info,sqlx::postgres::notice=warn",
        config.telemetry.log_format,
        "parsley-projector",
        env!("CARGO_PKG_VERSION"),
        export.as_ref(),
    )?;
    if let Some(e) = &export {
        tracing::info!(endpoint = %e.endpoint.base, protocol = ?e.protocol, "exporting spans and metrics over OTLP");
    }
    Ok(t)
}

/// The command's exit status when it succeeds: 0, or for `status` 3 when a task is refused
/// (docs/operations.md, "Exit statuses").
async fn main_async(args: Args) -> anyhow::Result<u8> {
    let config = Config::load(&args.config)?;
    let telemetry = init_telemetry(&config, &args.command)?;
    let status = command_status(args, config).await;
    // What is still queued is exported before the process ends (blocking: off the workers).
    let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    status
}

async fn command_status(args: Args, config: Config) -> anyhow::Result<u8> {
    if args.command == "status" {
        let pool = connect(&config, false).await?;
        let refused = print_status(&pool, &args.models).await?;
        return Ok(if refused { cli::exit::REFUSED } else { cli::exit::OK });
    }
    command_main(args, config).await.map(|()| cli::exit::OK)
}

async fn command_main(args: Args, config: Config) -> anyhow::Result<()> {
    match args.command.as_str() {
        "run" => run(config, &args.models).await,
        "skip" => {
            let request = skip_request(&args)?;
            let pool = connect(&config, false).await?;
            let done = skip::skip(&config.kafka, &pool, &request).await?;
            let found = match &done.found {
                RecordFound::Read { .. } => "read from Kafka (its key and parsley.causes headers are recorded)",
                RecordFound::Gone => "gone: retention removed it (recorded as such)",
                RecordFound::Absent => "absent: no data record at that position (recorded as such)",
            };
            println!(
                "skipped {} of model {} (task {}), refused {}; the record was {found}. The task runs again and \
                 delivers it without effect.",
                request.coordinate(),
                request.model,
                request.partition,
                done.refusal_reason.as_deref().unwrap_or("?"),
            );
            Ok(())
        }
        "create-topics" => {
            let (partitions, replication) = args.create.unwrap_or((4, 1));
            for (topic, outcome) in create_topics(&config, &args.models, partitions, replication).await? {
                match outcome {
                    Outcome::Created(p) => println!("created topic {topic} ({p} partitions)"),
                    Outcome::Existed(p) => println!("topic {topic} exists ({p} partitions): left as it is"),
                }
            }
            Ok(())
        }
        "migrate" => {
            let pool = connect(&config, false).await?;
            migrations::run(&pool).await?;
            for model in &config.models {
                if let Some(applied) = apply_model_migrations(&pool, model).await? {
                    println!("model {}: applied {:?}, {} applied before", model.name, applied.applied, applied.already);
                }
            }
            println!("schema is up to date");
            if let Some(gateway_user) = &args.roles {
                let models: Vec<roles::ModelRoles<'_>> =
                    config.models.iter().map(|m| roles::ModelRoles { model: &m.name }).collect();
                roles::create(&pool, &models, gateway_user.as_deref()).await?;
                println!("role {} made (reads the schemas, writes the idempotency keys)", roles::GATEWAY_ROLE);
                for m in &config.models {
                    println!("model {}: named queries run under role {}", m.name, roles::query_role(&m.name));
                }
                match gateway_user {
                    Some(user) => println!("role {} granted to {user}", roles::GATEWAY_ROLE),
                    None => println!(
                        "grant it to the gateway's login role: GRANT {} TO <gateway login role>;",
                        roles::GATEWAY_ROLE
                    ),
                }
            }
            Ok(())
        }
        other => bail!("unknown command {other:?}"),
    }
}

/// Prints each model's report; `true` when a task of one is refused.
async fn print_status(pool: &PgPool, only: &[String]) -> anyhow::Result<bool> {
    let mut conn = pool.acquire().await.context("acquiring a connection")?;
    let names = if only.is_empty() { status::models(&mut conn).await? } else { only.to_vec() };
    if names.is_empty() {
        println!("no models have state in this database");
    }
    let mut refused = false;
    for name in names {
        match status::model_report(&mut conn, &name).await? {
            Some(report) => {
                refused |= report.tasks.iter().any(|t| t.status == TaskStatus::Refused);
                print!("{}", status::render(&report));
            }
            None => println!("model {name}: no state in this database"),
        }
    }
    Ok(refused)
}

/// `run`: the library's projector with the built-in projections, stopped by SIGINT/SIGTERM.
async fn run(config: Config, only: &[String]) -> anyhow::Result<()> {
    let builder = Projector::builder(config);
    if only.is_empty() {
        builder.run().await
    } else {
        builder.models(only.iter().cloned()).run().await
    }
}
