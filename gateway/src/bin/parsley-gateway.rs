//! The gateway binary: `parsley-gateway [--config PATH]` serves until SIGINT/SIGTERM, then
//! finishes the requests in flight.

use std::path::PathBuf;

use anyhow::{bail, Context as _};
use parsley_gateway::{Gateway, GatewayConfig};
use parsley_infra::process;

const USAGE: &str = "\
usage: parsley-gateway [--config PATH]

The configuration file is --config, else $PARSLEY_CONFIG, else config/parsley.toml; its
[gateway] table holds the gateway's settings (docs/gateway.md).
Token keys: PARSLEY_TOKEN_KEYS=<id>:<base64 32 bytes>[,...] (newest first), or a file named by
PARSLEY_TOKEN_KEYS_FILE or gateway.token_keys_file.
Admin routes (/v1/status, /metrics) are served on gateway.admin_listen (default
127.0.0.1:9091), and on the main listener only to `Authorization: Bearer <token>` when
PARSLEY_GATEWAY_ADMIN_TOKEN (or gateway.admin_token_file) is set.
Environment overrides: PARSLEY_KAFKA_BOOTSTRAP, PARSLEY_DATABASE_URL (or DATABASE_URL),
PARSLEY_GATEWAY_LISTEN, PARSLEY_GATEWAY_ADMIN_LISTEN, PARSLEY_GATEWAY_READ_WAIT_MS,
PARSLEY_GATEWAY_RETRY_AFTER_S, PARSLEY_GATEWAY_TOKEN_TTL_S, PARSLEY_GATEWAY_SUBJECT_HEADER.
Logs: RUST_LOG (default info).";

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
    process::init_tracing("info");
    process::block_on_main(run())
}

async fn run() -> anyhow::Result<()> {
    let path = parse_args()?;
    let config = GatewayConfig::load(&path)?;
    if config.shared.models.is_empty() {
        bail!("the configuration declares no [[models]]: the gateway has nothing to write to or serve");
    }
    let shutdown = process::shutdown_on_signal(|| tracing::info!("shutting down: finishing the requests in flight"));
    let gateway = Gateway::new(config)?;
    let listeners = gateway.bind().await?;
    let models: Vec<String> = gateway.state().config.shared.models.iter().map(|m| m.name.clone()).collect();
    let admin = listeners.admin_addr().transpose()?.map(|a| a.to_string());
    let bearer = gateway.state().config.admin_token.is_some();
    tracing::info!(address = %listeners.local_addr()?, admin = ?admin, admin_bearer = bearer, ?models, "serving");
    gateway.serve(listeners, shutdown).await?;
    tracing::info!("stopped");
    Ok(())
}
