//! The gateway binary: `parsley-gateway [--config PATH]` serves until SIGINT/SIGTERM, then
//! fails readiness for `gateway.shutdown_grace_ms` while still serving, and finishes the
//! requests in flight.

use std::path::PathBuf;

use anyhow::bail;
use parsley_gateway::metrics::Metric;
use parsley_gateway::{Gateway, GatewayConfig};
use parsley_infra::cli::{self, Command};
use parsley_infra::{process, telemetry};

/// What `--help` says after the options.
const AFTER_HELP: &str = "\
The configuration file is --config, else $PARSLEY_CONFIG, else config/parsley.toml; its
[gateway] table holds the gateway's settings (docs/gateway.md).
Token keys: PARSLEY_TOKEN_KEYS=<id>:<base64 32 bytes>[,...] (newest first), or a file named by
PARSLEY_TOKEN_KEYS_FILE or gateway.token_keys_file.
Admin routes (/v1/status, /metrics) are served on gateway.admin_listen (default
127.0.0.1:9091), and on the main listener only to `Authorization: Bearer <token>` when
PARSLEY_GATEWAY_ADMIN_TOKEN (or gateway.admin_token_file) is set.
Environment overrides: every key as PARSLEY_<SECTION>__<KEY> (e.g. PARSLEY_GATEWAY__READ_WAIT_MS),
and PARSLEY_KAFKA_BOOTSTRAP, PARSLEY_DATABASE_URL (or DATABASE_URL),
PARSLEY_GATEWAY_LISTEN, PARSLEY_GATEWAY_ADMIN_LISTEN, PARSLEY_GATEWAY_READ_WAIT_MS,
PARSLEY_GATEWAY_RETRY_AFTER_S, PARSLEY_GATEWAY_TOKEN_TTL_S, PARSLEY_GATEWAY_SUBJECT_HEADER.
Logs: RUST_LOG (default info); telemetry.log_format = \"json\" for JSON lines; NO_COLOR.
OpenTelemetry: [telemetry] otlp_endpoint (or gateway.otlp_endpoint), docs/configuration.md.";

/// The command line: `parsley-gateway [--config PATH]`.
fn command() -> Command {
    Command::new("parsley-gateway")
        .version(parsley_infra::version!())
        .about(
            "Serves reads of your own writes: stamps writes with session tokens, gates reads on the projector's clock.",
        )
        .after_help(AFTER_HELP)
        .arg(cli::config_arg())
}

fn main() -> std::process::ExitCode {
    let matches = cli::parse(command());
    let path = cli::config_path(&matches, |v| std::env::var_os(v));
    process::block_on_main(run(path))
}

async fn run(path: PathBuf) -> anyhow::Result<()> {
    let config = GatewayConfig::load(&path)?;
    let export = config.telemetry_export()?;
    let telemetry = telemetry::init(
        "info",
        config.shared.telemetry.log_format,
        "parsley-gateway",
        env!("CARGO_PKG_VERSION"),
        export.as_ref(),
    )?;
    if let Some(e) = &export {
        tracing::info!(endpoint = %e.endpoint.base, protocol = ?e.protocol, "exporting spans and metrics over OTLP");
    }
    let served = serve(config).await;
    // What is still queued is exported before the process ends (blocking: off the workers).
    let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    served
}

async fn serve(config: GatewayConfig) -> anyhow::Result<()> {
    if config.shared.models.is_empty() {
        bail!("the configuration declares no [[models]]: the gateway has nothing to write to or serve");
    }
    let shutdown = process::shutdown_on_signal(|| {
        tracing::info!("shutting down: draining, then finishing the requests in flight")
    });
    let gateway = Gateway::new(config)?;
    let listeners = gateway.bind().await?;
    let models: Vec<String> = gateway.state().config.shared.models.iter().map(|m| m.name.clone()).collect();
    let admin = listeners.admin_addr().transpose()?.map(|a| a.to_string());
    let bearer = gateway.state().config.admin_token.is_some();
    let read_cache_bytes = gateway.state().config.settings.read_cache_bytes;
    tracing::info!(address = %listeners.local_addr()?, admin = ?admin, admin_bearer = bearer, ?models, read_cache_bytes, "serving");
    let state = gateway.state().clone();
    gateway.serve(listeners, shutdown).await?;
    if state.kept.on() {
        // What the kept snapshots did over the process's life, per model.
        for model in &models {
            let count = |result| {
                state.metrics.value(Metric::ReadCacheTotal, &[("model", model), ("result", result)]).unwrap_or(0.0)
            };
            tracing::info!(model, served_from_memory = count("hit"), read_and_kept = count("miss"), "kept snapshots");
        }
    }
    tracing::info!("stopped");
    Ok(())
}
