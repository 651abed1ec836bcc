//! The projector binary: `run` the configured models until SIGINT/SIGTERM, print their
//! `status` from the database, or apply the schema `migrate`ions.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use parsley_infra::process;
use parsley_projector::config::Config;
use parsley_projector::metrics::{self, Metrics, METRICS};
use parsley_projector::{migrations, status, DocumentProjection, ModelProjector};
use sqlx::PgPool;

const USAGE: &str = "\
usage: parsley-projector <command> [--config PATH] [options]

commands:
  run [--model NAME]...            run the configured models (all, or those named) until SIGINT/SIGTERM
  status [--model NAME]...         print every task's state from the database
  migrate                          bring the database schema up to date and exit

The configuration file is --config, else $PARSLEY_CONFIG, else config/parsley.toml.
Environment overrides: PARSLEY_KAFKA_BOOTSTRAP, PARSLEY_DATABASE_URL (or DATABASE_URL),
PARSLEY_METRICS_ADDRESS, PARSLEY_OWNER. Logs: RUST_LOG (default info).";

struct Args {
    command: String,
    config: PathBuf,
    models: Vec<String>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = std::env::args().skip(1);
    let command = args.next().unwrap_or_default();
    if command.is_empty() || command == "--help" || command == "-h" || command == "help" {
        println!("{USAGE}");
        std::process::exit(0);
    }
    let mut config = std::env::var_os("PARSLEY_CONFIG").map(PathBuf::from);
    let mut models = Vec::new();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().with_context(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--config" => config = Some(PathBuf::from(value("--config")?)),
            "--model" => models.push(value("--model")?),
            other => bail!("unknown argument {other:?}\n\n{USAGE}"),
        }
    }
    Ok(Args { command, config: config.unwrap_or_else(|| PathBuf::from("config/parsley.toml")), models })
}

fn main() -> std::process::ExitCode {
    process::init_tracing("info,sqlx::postgres::notice=warn");
    process::block_on_main(main_async())
}

async fn main_async() -> anyhow::Result<()> {
    let args = parse_args()?;
    let config = Config::load(&args.config)?;
    match args.command.as_str() {
        "run" => run(config, &args.models).await,
        "status" => {
            let pool = connect(&config, false).await?;
            print_status(&pool, &args.models).await
        }
        "migrate" => {
            let pool = connect(&config, false).await?;
            migrations::run(&pool).await?;
            println!("schema is up to date");
            Ok(())
        }
        other => bail!("unknown command {other:?}\n\n{USAGE}"),
    }
}

/// Connects to Postgres; with `retry`, waits for it with backoff, reporting each attempt.
async fn connect(config: &Config, retry: bool) -> anyhow::Result<PgPool> {
    let url = config.database_url()?;
    let mut wait = Duration::from_millis(500);
    loop {
        match parsley_infra::pg::connect(
            url,
            config.database.max_connections,
            Duration::from_millis(config.database.acquire_timeout_ms),
        )
        .await
        {
            Ok(pool) => return Ok(pool),
            Err(e) if retry => {
                tracing::warn!(error = %format!("{e:#}"), retry_in_ms = wait.as_millis() as u64, "Postgres unavailable");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(30));
            }
            Err(e) => return Err(e),
        }
    }
}

async fn print_status(pool: &PgPool, only: &[String]) -> anyhow::Result<()> {
    let mut conn = pool.acquire().await.context("acquiring a connection")?;
    let names = if only.is_empty() { status::models(&mut conn).await? } else { only.to_vec() };
    if names.is_empty() {
        println!("no models have state in this database");
    }
    for name in names {
        match status::model_report(&mut conn, &name).await? {
            Some(report) => print!("{}", status::render(&report)),
            None => println!("model {name}: no state in this database"),
        }
    }
    Ok(())
}

async fn run(config: Config, only: &[String]) -> anyhow::Result<()> {
    let models: Vec<_> = if only.is_empty() {
        config.models.clone()
    } else {
        only.iter().map(|n| config.model(n).cloned()).collect::<anyhow::Result<_>>()?
    };
    if models.is_empty() {
        bail!("the configuration declares no [[models]]");
    }
    let shutdown = process::shutdown_on_signal(|| tracing::info!("shutting down: finishing the steps in progress"));

    let metrics = Metrics::new(METRICS);
    let mut servers = Vec::new();
    if !config.projector.metrics_address.is_empty() {
        let (listener, addr) = metrics::bind(&config.projector.metrics_address).await?;
        tracing::info!(%addr, "serving metrics at /metrics");
        servers.push(tokio::spawn(metrics::serve(listener, Arc::clone(&metrics), shutdown.clone())));
    }

    let pool = connect(&config, true).await?;
    let mut wait = Duration::from_millis(500);
    loop {
        match migrations::run(&pool).await {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), retry_in_ms = wait.as_millis() as u64, "migrations failed");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(30));
            }
        }
    }

    let mut runs = Vec::new();
    for model in models {
        let mut wait = Duration::from_millis(500);
        let projector = loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            let projection = Arc::new(DocumentProjection::from_model(&model));
            match ModelProjector::start(&config, &model, pool.clone(), projection, Arc::clone(&metrics)).await {
                Ok(p) => break p,
                Err(e) => {
                    tracing::warn!(model = %model.name, error = %format!("{e:#}"), retry_in_ms = wait.as_millis() as u64,
                        "could not start the model; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(30));
                }
            }
        };
        if let Some(r) = projector.refusal() {
            metrics.set("parsley_projector_task_refused", &[("model", &model.name), ("task", "all")], 1.0);
            tracing::error!(model = %model.name, reason = %r.reason, diagnosis = %r.diagnosis,
                "model refused; see `parsley-projector status`");
        } else {
            tracing::info!(model = %model.name, tasks = projector.tasks().len(), "model started");
        }
        runs.push(tokio::spawn(projector.run(shutdown.clone())));
    }
    for r in runs {
        r.await.context("a model runner panicked")??;
    }
    for s in servers {
        let _ = s.await;
    }
    tracing::info!("stopped");
    Ok(())
}
