//! The gateway binary: `parsley-gateway [--config PATH]` serves until SIGINT/SIGTERM, then
//! finishes the requests in flight.

use std::path::PathBuf;

use anyhow::{bail, Context as _};
use parsley_gateway::{Gateway, GatewayConfig};
use tokio::sync::watch;

const USAGE: &str = "\
usage: parsley-gateway [--config PATH]

The configuration file is --config, else $PARSLEY_CONFIG, else config/parsley.toml; its
[gateway] table holds the gateway's settings (docs/gateway.md).
Token keys: PARSLEY_TOKEN_KEYS=<id>:<base64 32 bytes>[,...] (newest first), or a file named by
PARSLEY_TOKEN_KEYS_FILE or gateway.token_keys_file.
Environment overrides: PARSLEY_KAFKA_BOOTSTRAP, PARSLEY_DATABASE_URL (or DATABASE_URL),
PARSLEY_GATEWAY_LISTEN, PARSLEY_GATEWAY_READ_WAIT_MS, PARSLEY_GATEWAY_RETRY_AFTER_S,
PARSLEY_GATEWAY_TOKEN_TTL_S, PARSLEY_GATEWAY_SUBJECT_HEADER. Logs: RUST_LOG (default info).";

fn parse_args() -> anyhow::Result<PathBuf> {
    let mut config = std::env::var_os("PARSLEY_CONFIG").map(PathBuf::from);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--config" => config = Some(PathBuf::from(args.next().context("--config needs a value")?)),
            "-h" | "--help" | "help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n\n{USAGE}"),
        }
    }
    Ok(config.unwrap_or_else(|| PathBuf::from("config/parsley.toml")))
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    let path = parse_args()?;
    let config = GatewayConfig::load(&path)?;
    if config.shared.models.is_empty() {
        bail!("the configuration declares no [[models]]: the gateway has nothing to write to or serve");
    }
    let (stop, shutdown) = watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down: finishing the requests in flight");
        let _ = stop.send(true);
    });
    let gateway = Gateway::new(config)?;
    let listener = gateway.bind().await?;
    let models: Vec<String> = gateway.state().config.shared.models.iter().map(|m| m.name.clone()).collect();
    tracing::info!(address = %listener.local_addr()?, ?models, "serving");
    gateway.serve(listener, shutdown).await?;
    tracing::info!("stopped");
    Ok(())
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(t) => t,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
