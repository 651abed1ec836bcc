//! A program embedding the projector with a projection of its own: `order-events` writes
//! one row per delivered record into `order_events.events` (made by the model's migrations
//! folder), with the status the record's JSON value names — in the step's transaction, so a
//! row is there exactly when the record is delivered, in causal order.
//!
//! Everything else — consuming, causal delivery, the clock rows the gateway gates on,
//! leases, retries, refusals, metrics, SIGINT/SIGTERM — is the library's
//! ([`parsley_projector::Projector`]); `documents` and `sql` models in the same file run
//! too. Run it with `--config examples/custom-projection/parsley.toml` from the repository's
//! root.

use std::process::ExitCode;

use parsley_infra::cli::{self, Command};
use parsley_infra::process;
use parsley_projector::projection::{Delivered, Projection, ProjectionError, StepContext};
use parsley_projector::Projector;
use parsley_settings::config::{Config, ModelConfig};
use serde_json::Value;
use sqlx::PgConnection;

/// One row per record, with the status its value names.
struct OrderEvents {
    /// The member of a record's value holding its status (`[models.options] status_field`).
    status_field: String,
}

impl OrderEvents {
    /// Built once per model naming the projection, from the model's configuration.
    fn from_model(model: &ModelConfig) -> anyhow::Result<OrderEvents> {
        let status_field = match model.options.get("status_field") {
            None => "status".to_string(),
            Some(toml::Value::String(field)) => field.clone(),
            Some(other) => anyhow::bail!("models.options.status_field must be a string, not {other}"),
        };
        Ok(OrderEvents { status_field })
    }
}

impl Projection for OrderEvents {
    async fn apply(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        record: &Delivered<'_>,
    ) -> Result<(), ProjectionError> {
        // A value that is not JSON is rejected by its coordinate (never quoting it): the task
        // refuses PROJECTION_REJECTED at the record, or dead-letters it (`on_rejected`).
        let status = match record.value {
            None => None,
            Some(bytes) => {
                let value: Value = serde_json::from_slice(bytes).map_err(|_| {
                    ProjectionError::rejected(format!("the value of {} is not JSON", record.coordinate()))
                })?;
                value.get(&self.status_field).and_then(Value::as_str).map(str::to_string)
            }
        };
        let key = record.key.map(|k| String::from_utf8_lossy(k).into_owned());
        sqlx::query(
            "INSERT INTO order_events.events (model, topic, partition, position, key, status, causes)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             ON CONFLICT (model, topic, partition, position) DO NOTHING",
        )
        .bind(step.model)
        .bind(record.topic)
        .bind(record.channel.partition as i32)
        .bind(record.position)
        .bind(key)
        .bind(status)
        .bind(record.causes.len() as i32)
        .execute(conn)
        .await
        // A constraint or data error rejects the record; anything else is retried.
        .map_err(|e| ProjectionError::database(e, &format!("recording {}", record.coordinate())))?;
        Ok(())
    }
}

fn main() -> ExitCode {
    let command = Command::new("custom-projection")
        .version(parsley_infra::version!())
        .about("The projector with the order-events projection registered.")
        .arg(cli::config_arg());
    let config = cli::config_path(&cli::parse(command), |v| std::env::var_os(v));
    process::block_on_main(async move {
        let config = Config::load(&config)?;
        // Logs and OpenTelemetry as `[telemetry]` says, as the projector binary does.
        let export = config.telemetry.export(config.projector.otlp_endpoint.as_deref(), "projector.otlp_endpoint")?;
        let telemetry = parsley_infra::telemetry::init(
            "info,sqlx::postgres::notice=warn",
            config.telemetry.log_format,
            "custom-projection",
            env!("CARGO_PKG_VERSION"),
            export.as_ref(),
        )?;
        let ran = Projector::builder(config).projection("order-events", OrderEvents::from_model).run().await;
        let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
        ran
    })
}
