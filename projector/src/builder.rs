//! The projector as a library: [`Projector::builder`] takes the configuration, a registry
//! of named projections and a shutdown signal, and [`ProjectorBuilder::run`] does what
//! `parsley-projector run` does — the binary is a thin `main` over it.
//!
//! A model's `projection` key names the projection it runs: `"documents"` and `"sql"` are
//! registered by default ([`parsley_settings::config::BUILTIN_PROJECTIONS`]); a program embedding the
//! projector registers its own ([`ProjectorBuilder::projection`]). Each registered name
//! maps to a factory called once per model naming it, with the model's configuration (its
//! `[models.options]` table included), before anything connects: an unknown name, or a
//! factory that fails, refuses start naming the model.
//!
//! `run` then, in order: serves `/metrics` and the probes `/livez` and `/readyz` ([`crate::health`])
//! (unless `projector.metrics_address` is empty);
//! connects to Postgres and applies the project's migrations, retrying while the database is
//! unavailable; applies each model's own migrations folder
//! ([`parsley_store::model_migrations`]: an edited applied file refuses start by name);
//! prepares each model (its topics resolved and checked, retried while Kafka or Postgres
//! is unavailable) and runs its tasks under the balancer until shutdown, when every step
//! in progress finishes and the tasks are handed back; the probes answer until then
//! (`/readyz`: `stopping`). Retries wait the jittered backoff of [`parsley_infra::backoff`].

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use parsley_store::model_migrations::{self, Applied, ModelMigration};
use parsley_store::ErrorKind;
use sqlx::PgPool;
use tokio::sync::watch;

use parsley_infra::backoff::Attempts;
use parsley_infra::metrics::Probes;

use crate::documents::DocumentProjection;
use crate::health::{Health, Phase};
use crate::metrics::{self, Metric, Metrics, METRICS};
use crate::model::ModelProjector;
use crate::projection::{Projection, SharedProjection};
use crate::sql::SqlProjection;
use parsley_settings::config::{valid_projection_name, Config, ModelConfig, DOCUMENTS_PROJECTION, SQL_PROJECTION};
use parsley_store::migrations;

/// Builds a model's projection from its configuration.
type Factory = Box<dyn Fn(&ModelConfig) -> anyhow::Result<SharedProjection> + Send + Sync>;

/// The projector service. See [`Projector::builder`].
#[derive(Debug)]
pub struct Projector;

impl Projector {
    /// A projector over `config`, with the built-in projections registered and the process's
    /// SIGINT/SIGTERM as shutdown unless [`ProjectorBuilder::shutdown`] is given.
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use parsley_settings::config::{Config, ModelConfig};
    /// use parsley_projector::projection::{Delivered, Projection, ProjectionError, StepContext};
    /// use parsley_projector::Projector;
    /// use sqlx::PgConnection;
    ///
    /// /// Counts each model's records in a table of its own (created by the model's
    /// /// `migrations` folder).
    /// struct Counter {
    ///     table_label: String,
    /// }
    ///
    /// impl Projection for Counter {
    ///     async fn apply(
    ///         &self,
    ///         conn: &mut PgConnection,
    ///         step: StepContext<'_>,
    ///         record: &Delivered<'_>,
    ///     ) -> Result<(), ProjectionError> {
    ///         sqlx::query(
    ///             "INSERT INTO app.counts (label, model, n) VALUES ($1, $2, 1) \
    ///              ON CONFLICT (label, model) DO UPDATE SET n = app.counts.n + 1",
    ///         )
    ///         .bind(&self.table_label)
    ///         .bind(step.model)
    ///         .execute(conn)
    ///         .await
    ///         .map_err(|e| ProjectionError::database(e, &format!("counting {}", record.coordinate())))?;
    ///         Ok(())
    ///     }
    /// }
    ///
    /// # async fn example() -> anyhow::Result<()> {
    /// let config = Config::load("parsley.toml".as_ref())?;
    /// let (stop, shutdown) = tokio::sync::watch::channel(false);
    /// Projector::builder(config)
    ///     // Models with `projection = "counter"` run it; `[models.options] label = "..."`.
    ///     .projection("counter", |model: &ModelConfig| {
    ///         let label = model.options.get("label").and_then(|v| v.as_str()).unwrap_or("all");
    ///         Ok(Counter { table_label: label.to_string() })
    ///     })
    ///     .shutdown(shutdown)
    ///     .run()
    ///     .await?;
    /// # drop(stop);
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(config: Config) -> ProjectorBuilder {
        ProjectorBuilder {
            config,
            registry: BTreeMap::new(),
            twice: Vec::new(),
            models: None,
            shutdown: None,
            health: None,
        }
        .projection(DOCUMENTS_PROJECTION, |model: &ModelConfig| Ok(DocumentProjection::from_model(model)))
        .projection(SQL_PROJECTION, SqlProjection::from_model)
    }
}

/// A projector being configured: see [`Projector::builder`].
#[must_use = "a builder does nothing until `run`"]
pub struct ProjectorBuilder {
    config: Config,
    registry: BTreeMap<String, Factory>,
    /// Names registered more than once (refused by `run`).
    twice: Vec<String>,
    models: Option<Vec<String>>,
    shutdown: Option<watch::Receiver<bool>>,
    health: Option<Arc<Health>>,
}

impl std::fmt::Debug for ProjectorBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProjectorBuilder")
            .field("projections", &self.projections())
            .field("models", &self.models)
            .finish_non_exhaustive()
    }
}

impl ProjectorBuilder {
    /// Registers the projection `name`: every model whose `projection` key names it runs
    /// what `factory` builds from the model's configuration (read `model.options` for the
    /// model's own settings). `factory` runs once per such model, at start, before anything
    /// connects; its error refuses start, naming the model. A name is letters, digits, `_`,
    /// `-`, `.` (at most 63); a name registered twice — a built-in one included — is refused
    /// by [`ProjectorBuilder::run`].
    pub fn projection<P, F>(mut self, name: &str, factory: F) -> Self
    where
        P: Projection,
        F: Fn(&ModelConfig) -> anyhow::Result<P> + Send + Sync + 'static,
    {
        let boxed: Factory = Box::new(move |model| Ok(Arc::new(factory(model)?) as SharedProjection));
        if self.registry.insert(name.to_string(), boxed).is_some() {
            self.twice.push(name.to_string());
        }
        self
    }

    /// Runs only the models named (the binary's `--model`); by default, every configured
    /// model.
    pub fn models(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.models = Some(names.into_iter().map(Into::into).collect());
        self
    }

    /// Stops when `shutdown` turns `true` (instead of at SIGINT/SIGTERM): every step in
    /// progress finishes, the tasks are handed back, and `run` returns.
    pub fn shutdown(mut self, shutdown: watch::Receiver<bool>) -> Self {
        self.shutdown = Some(shutdown);
        self
    }

    /// Reports to `health` (made with [`ProjectorBuilder::new_health`]) instead of a health
    /// of its own: for a program that serves the probes itself, or a test that reads them.
    pub fn health(mut self, health: Arc<Health>) -> Self {
        self.health = Some(health);
        self
    }

    /// A health for this builder's configuration (its lease and `runner_stall_ms`).
    pub fn new_health(&self) -> Arc<Health> {
        Health::new(self.config.projector.lease(), self.config.projector.runner_stall())
    }

    /// The registered projection names, in order.
    pub fn projections(&self) -> Vec<&str> {
        self.registry.keys().map(String::as_str).collect()
    }

    /// Runs the models until shutdown (see the module documentation for the sequence).
    /// Errors: a configuration the projector cannot run (no models, an unknown model or
    /// projection, a factory's error, a migrations folder that cannot be read or an edited
    /// applied migration, a failing migration), and an unusable metrics address. An
    /// unavailable database or broker is waited for, not an error.
    pub async fn run(self) -> anyhow::Result<()> {
        let health = self.health.clone().unwrap_or_else(|| self.new_health());
        let ProjectorBuilder { config, registry, twice, models, shutdown, .. } = self;
        if let Some(name) = twice.first() {
            bail!("the projection {name:?} is registered twice");
        }
        if let Some(name) = registry.keys().find(|n| !valid_projection_name(n)) {
            bail!("the projection name {name:?} must be 1 to 63 letters, digits, '_', '-' or '.'");
        }
        let models: Vec<ModelConfig> = match &models {
            None => config.models.clone(),
            Some(names) => names.iter().map(|n| config.model(n).cloned()).collect::<anyhow::Result<_>>()?,
        };
        if models.is_empty() {
            bail!("the configuration declares no [[models]]");
        }
        let mut planned = Vec::with_capacity(models.len());
        for model in models {
            let projection = build_projection(&registry, &model)?;
            let migrations = match &model.migrations {
                Some(dir) => model_migrations::read_folder(Path::new(dir))
                    .with_context(|| format!("model {}: its migrations", model.name))?,
                None => Vec::new(),
            };
            planned.push((model, projection, migrations));
        }
        let shutdown = shutdown.unwrap_or_else(|| {
            parsley_infra::process::shutdown_on_signal(|| {
                tracing::info!("shutting down: finishing the steps in progress")
            })
        });

        let metrics = Metrics::new(METRICS);
        // Through the process's meter provider: exported when the binary configured OTLP.
        parsley_infra::telemetry::export_registry(&metrics);
        metrics.set(
            Metric::BuildInfo,
            &[("version", env!("CARGO_PKG_VERSION")), ("commit", env!("PARSLEY_BUILD_COMMIT"))],
            1.0,
        );
        // The probes answer until the tasks are handed back, after the shutdown signal.
        let (stop_server, server_shutdown) = watch::channel(false);
        let mut servers = Vec::new();
        if !config.projector.metrics_address.is_empty() {
            let (listener, addr) = metrics::bind(&config.projector.metrics_address).await?;
            tracing::info!(%addr, "serving /metrics, /livez and /readyz");
            let probes: Arc<dyn Probes> = health.clone();
            servers.push(tokio::spawn(metrics::serve_with_probes(
                listener,
                Arc::clone(&metrics),
                Some(probes),
                server_shutdown,
            )));
        }
        let result = run_models(&config, planned, &shutdown, &metrics, &health).await;
        let _ = stop_server.send(true);
        for s in servers {
            let _ = s.await;
        }
        if result.is_ok() {
            tracing::info!("stopped");
        }
        result
    }
}

/// What `run` does once the probes are served: connect, migrate, prepare and run the models
/// until shutdown, reporting each phase to `health`.
async fn run_models(
    config: &Config,
    planned: Vec<(ModelConfig, SharedProjection, Vec<ModelMigration>)>,
    shutdown: &watch::Receiver<bool>,
    metrics: &Arc<Metrics>,
    health: &Arc<Health>,
) -> anyhow::Result<()> {
    {
        let health = Arc::clone(health);
        let mut shutdown = shutdown.clone();
        tokio::spawn(async move {
            if shutdown.wait_for(|stop| *stop).await.is_ok() {
                health.set_phase(Phase::Stopping);
            }
        });
    }
    health.set_phase(Phase::Starting("connecting to Postgres".into()));
    let shutdown = shutdown.clone();
    let mut backoff = Backoff::new(&shutdown);
    let pool = loop {
        match connect(config, false).await {
            Ok(pool) => break pool,
            Err(e) if backoff.wait("Postgres unavailable", None, &e).await => {}
            Err(_) => return Ok(()),
        }
    };
    health.set_phase(Phase::Starting("applying the migrations".into()));
    let mut backoff = Backoff::new(&shutdown);
    loop {
        match migrations::run(&pool).await {
            Ok(()) => break,
            Err(e) if backoff.wait("migrations failed", None, &e).await => {}
            Err(_) => return Ok(()),
        }
    }
    for (model, _, files) in &planned {
        if files.is_empty() {
            continue;
        }
        // Retried only while the database is unavailable: a file that fails on its own
        // text would fail again.
        let mut backoff = Backoff::new(&shutdown);
        let applied = loop {
            match model_migrations::run(&pool, &model.name, files).await {
                Ok(applied) => break applied,
                Err(e) if e.kind() != ErrorKind::Unavailable => return Err(e.into()),
                Err(e)
                    if backoff
                        .wait("could not apply the model's migrations; retrying", Some(&model.name), &e)
                        .await => {}
                Err(_) => return Ok(()),
            }
        };
        log_applied(&model.name, &applied);
    }

    let mut runs = Vec::new();
    for (model, projection, _) in planned {
        health.set_phase(Phase::Starting(format!("preparing model {}", model.name)));
        let mut backoff = Backoff::new(&shutdown);
        let projector = loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            let projection = Arc::new(Arc::clone(&projection));
            match ModelProjector::prepare(config, &model, pool.clone(), projection, Arc::clone(metrics)).await {
                Ok(p) => break p,
                Err(e) if backoff.wait("could not start the model; retrying", Some(&model.name), &e).await => {}
                Err(_) => return Ok(()),
            }
        };
        if let Some(r) = projector.refusal() {
            health.model_refused(&model.name);
            metrics.set(Metric::TaskRefused, &[("model", &model.name), ("task", "all")], 1.0);
            tracing::error!(model = %model.name, reason = %r.reason, diagnosis = %r.diagnosis,
                    "model refused; see `parsley-projector status`");
        } else {
            let tasks = projector.plan().map_or(0, |p| p.task_count);
            tracing::info!(model = %model.name, projection = %model.projection, tasks, only = ?model.tasks,
                    "model started; sharing its tasks");
        }
        runs.push(tokio::spawn(projector.with_health(Arc::clone(health)).run(shutdown.clone())));
    }
    if !*shutdown.borrow() {
        health.set_phase(Phase::Running);
    }
    for r in runs {
        r.await.context("a model runner panicked")??;
    }
    Ok(())
}

/// The projection `model` names, built by its registered factory.
fn build_projection(registry: &BTreeMap<String, Factory>, model: &ModelConfig) -> anyhow::Result<SharedProjection> {
    let factory = registry.get(&model.projection).with_context(|| {
        let known: Vec<&str> = registry.keys().map(String::as_str).collect();
        format!(
            "model {}: no projection named {:?} is registered (registered: {})",
            model.name,
            model.projection,
            known.join(", ")
        )
    })?;
    factory(model).with_context(|| format!("model {}: building its {:?} projection", model.name, model.projection))
}

/// Applies the migrations folder of `model` (if it names one) once: for `parsley-projector
/// migrate` and tools. [`ProjectorBuilder::run`] does it at start.
pub async fn apply_model_migrations(pool: &PgPool, model: &ModelConfig) -> anyhow::Result<Option<Applied>> {
    let Some(dir) = &model.migrations else { return Ok(None) };
    let files: Vec<ModelMigration> = model_migrations::read_folder(Path::new(dir))
        .with_context(|| format!("model {}: its migrations", model.name))?;
    let applied = model_migrations::run(pool, &model.name, &files).await?;
    log_applied(&model.name, &applied);
    Ok(Some(applied))
}

fn log_applied(model: &str, applied: &Applied) {
    tracing::info!(model, applied = ?applied.applied, already = applied.already, "model migrations up to date");
}

/// Connects to Postgres with the configured pool size and session bounds; with `retry`,
/// waits for it with backoff, reporting each attempt.
pub async fn connect(config: &Config, retry: bool) -> anyhow::Result<PgPool> {
    let url = config.database_url()?;
    let mut attempts = Attempts::new(START_BACKOFF);
    loop {
        match parsley_infra::pg::connect_bounded(
            url,
            config.database.max_connections,
            config.database.acquire_timeout(),
            &session_bounds(config),
        )
        .await
        {
            Ok(pool) => return Ok(pool),
            Err(e) if retry => {
                let wait = attempts.next_delay();
                tracing::warn!(error = %format!("{e:#}"), retry_in_ms = wait.as_millis() as u64, "Postgres unavailable");
                tokio::time::sleep(wait).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The database's session bounds, with the two that free a frozen or vanished instance's
/// row locks capped by the lease: a session idle inside a transaction for longer than
/// `lease_ms` (a frozen owner mid-step) is ended by the server, and so is one whose client
/// stopped answering keepalives; a takeover then waits no longer than about a lease.
fn session_bounds(config: &Config) -> parsley_infra::pg::SessionBounds {
    let mut bounds = config.database.session_bounds();
    let lease = config.projector.lease().max(Duration::from_secs(1));
    bounds.idle_in_transaction_timeout = Some(bounds.idle_in_transaction_timeout.map_or(lease, |d| d.min(lease)));
    bounds.keepalives_idle = Some(bounds.keepalives_idle.map_or(lease, |d| d.min(lease)).max(Duration::from_secs(1)));
    bounds
}

/// The jittered backoff between attempts at start ([`START_BACKOFF`]), cut short by shutdown.
struct Backoff {
    attempts: Attempts,
    shutdown: watch::Receiver<bool>,
}

/// The waits at start: from 0.5 s, doubling to 30 s, jittered.
const START_BACKOFF: parsley_infra::backoff::Backoff =
    parsley_infra::backoff::Backoff::new(Duration::from_millis(500), Duration::from_secs(30));

impl Backoff {
    fn new(shutdown: &watch::Receiver<bool>) -> Backoff {
        Backoff { attempts: Attempts::new(START_BACKOFF), shutdown: shutdown.clone() }
    }

    /// Logs `message` (of `model`, if any) with `error` and waits before the next attempt;
    /// `false` (give up) once shutdown is signalled.
    async fn wait(&mut self, message: &str, model: Option<&str>, error: &impl std::fmt::Display) -> bool {
        if *self.shutdown.borrow() {
            return false;
        }
        let wait = self.attempts.next_delay();
        tracing::warn!(model, error = %format!("{error:#}"), retry_in_ms = wait.as_millis() as u64, "{message}");
        let slept = tokio::select! {
            _ = tokio::time::sleep(wait) => true,
            _ = self.shutdown.wait_for(|stop| *stop) => false,
        };
        slept && !*self.shutdown.borrow()
    }
}
