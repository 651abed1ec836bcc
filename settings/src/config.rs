//! Configuration: one TOML file shared by the projector, the gateway and the demo, then
//! environment overrides (one rule for every key: [`crate::overrides`]).
//!
//! Every table refuses unknown keys, and every check names the key it failed on, so a typo
//! stops the process at start with a message instead of silently taking a default. The
//! `[gateway]` table belongs to the gateway, which parses it itself (with the same override
//! rule); here it is only carried through. The database URL is a [`Secret`]: it may hold a
//! password, and `Debug` never prints it. Every key, its default and its override are listed
//! in `docs/configuration.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use parsley_infra::kafka::{self, Cluster};
use parsley_infra::pg::SessionBounds;
use parsley_infra::telemetry::{check_headers, Endpoint, Export, LogFormat, Protocol};
use serde::Deserialize;

use crate::contract::Contract;
use crate::overrides::{self, Env};
use crate::secret::Secret;
use crate::sql_params;

pub use parsley::partitioner::Partitioner;

pub use crate::overrides::{
    ENV_DATABASE_URL, ENV_DATABASE_URL_FALLBACK, ENV_DATABASE_URL_FILE, ENV_KAFKA_BOOTSTRAP, ENV_METRICS_ADDRESS,
    ENV_OWNER,
};

/// The table of the file that belongs to the gateway (parsed by the gateway, carried here).
pub const GATEWAY_SECTION: &str = "gateway";

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub kafka: KafkaConfig,
    #[serde(default)]
    pub database: DatabaseConfig,
    #[serde(default)]
    pub projector: ProjectorSettings,
    /// Logs and OpenTelemetry, for both services.
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// The gateway's own table: parsed (strictly) by the gateway, carried through here.
    #[serde(default)]
    pub gateway: Option<toml::Table>,
}

/// The `[kafka]` table. `Debug` prints secret property values as `***`.
#[derive(Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Bootstrap servers, `host:port[,host:port...]`.
    #[serde(default = "default_bootstrap")]
    pub bootstrap: String,
    /// librdkafka properties set on every client the project creates (security, codecs,
    /// tuning). The project's fixed settings ([`parsley_infra::kafka::FIXED_PROPERTIES`]) are
    /// refused. Once loaded, it holds the values read from `property_files` too.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    /// librdkafka properties read from files (`"sasl.password" = "/run/secrets/kafka"`):
    /// the value is the file's text without its trailing line end. A property may be in
    /// `properties` or here, not both.
    #[serde(default)]
    pub property_files: BTreeMap<String, String>,
    /// Extra librdkafka properties of the projector's task consumers only (e.g.
    /// `fetch.wait.max.ms`), set after `properties`. The fixed settings are refused.
    #[serde(default)]
    pub consumer: BTreeMap<String, String>,
    /// Timeout of metadata, watermark and admin requests, in milliseconds.
    #[serde(default = "default_kafka_timeout_ms")]
    pub request_timeout_ms: u64,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            bootstrap: default_bootstrap(),
            properties: BTreeMap::new(),
            property_files: BTreeMap::new(),
            consumer: BTreeMap::new(),
            request_timeout_ms: default_kafka_timeout_ms(),
        }
    }
}

impl KafkaConfig {
    /// Where and how every client connects: the bootstrap servers and `properties`.
    pub fn cluster(&self) -> Cluster {
        Cluster::new(self.bootstrap.clone(), self.properties.clone())
    }

    /// Reads `property_files` into `properties`; every error names the key.
    fn read_property_files(&mut self) -> anyhow::Result<()> {
        for (name, path) in &self.property_files {
            if let Some(why) = kafka::fixed_property(name) {
                bail!("kafka.property_files.\"{name}\" is fixed by the project and may not be set: {why}");
            }
            if self.properties.contains_key(name) {
                bail!("kafka.properties.\"{name}\" and kafka.property_files.\"{name}\" are both set: set one");
            }
            let value = read_secret_file(path).with_context(|| format!("kafka.property_files.\"{name}\""))?;
            self.properties.insert(name.clone(), value);
        }
        Ok(())
    }
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConfig")
            .field("cluster", &self.cluster())
            .field("property_files", &self.property_files)
            .field("consumer", &self.consumer)
            .field("request_timeout_ms", &self.request_timeout_ms)
            .finish()
    }
}

/// The text of the file at `path` without its trailing line end (a secret's file, as Docker
/// and Kubernetes mount them). The error names the path, never the content.
pub fn read_secret_file(path: &str) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    Ok(text.trim_end_matches(['\n', '\r']).to_string())
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// Postgres URL. Usually from the environment (it may hold a password): a [`Secret`],
    /// never printed. TLS is set by its parameters (`sslmode=verify-full`, `sslrootcert`,
    /// `sslcert`, `sslkey`). Once loaded, it holds the text of `url_file` when that is set.
    #[serde(default)]
    pub url: Option<Secret<String>>,
    /// A file holding the Postgres URL (a mounted secret); excludes `url`.
    #[serde(default)]
    pub url_file: Option<String>,
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// How long to wait for a connection from the pool, in milliseconds.
    #[serde(default = "default_acquire_timeout_ms")]
    pub acquire_timeout_ms: u64,
    /// Longest wait of any statement for a lock (`lock_timeout`), in milliseconds; 0 leaves
    /// the server's setting.
    #[serde(default = "default_lock_timeout_ms")]
    pub lock_timeout_ms: u64,
    /// Longest statement (`statement_timeout`), in milliseconds; 0 leaves the server's setting.
    #[serde(default = "default_statement_timeout_ms")]
    pub statement_timeout_ms: u64,
    /// Longest pause inside an open transaction (`idle_in_transaction_session_timeout`), in
    /// milliseconds; 0 leaves the server's setting.
    #[serde(default = "default_idle_in_transaction_timeout_ms")]
    pub idle_in_transaction_timeout_ms: u64,
    /// Idle seconds before the server probes a connection (`tcp_keepalives_idle`); 0 leaves
    /// the server's setting.
    #[serde(default = "default_keepalives_idle_s")]
    pub keepalives_idle_s: u64,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: None,
            url_file: None,
            max_connections: default_max_connections(),
            acquire_timeout_ms: default_acquire_timeout_ms(),
            lock_timeout_ms: default_lock_timeout_ms(),
            statement_timeout_ms: default_statement_timeout_ms(),
            idle_in_transaction_timeout_ms: default_idle_in_transaction_timeout_ms(),
            keepalives_idle_s: default_keepalives_idle_s(),
        }
    }
}

impl DatabaseConfig {
    /// Reads `url_file` into `url`.
    fn read_url_file(&mut self) -> anyhow::Result<()> {
        let Some(path) = &self.url_file else { return Ok(()) };
        if self.url.is_some() {
            bail!("database.url and database.url_file are both set: set one");
        }
        self.url = Some(read_secret_file(path).context("database.url_file")?.into());
        Ok(())
    }

    /// The bounds of every session the projector and the gateway open.
    pub fn session_bounds(&self) -> SessionBounds {
        let millis = |ms: u64| (ms > 0).then(|| Duration::from_millis(ms));
        SessionBounds {
            lock_timeout: millis(self.lock_timeout_ms),
            statement_timeout: millis(self.statement_timeout_ms),
            idle_in_transaction_timeout: millis(self.idle_in_transaction_timeout_ms),
            keepalives_idle: (self.keepalives_idle_s > 0).then(|| Duration::from_secs(self.keepalives_idle_s)),
        }
    }

    pub fn acquire_timeout(&self) -> Duration {
        Duration::from_millis(self.acquire_timeout_ms)
    }
}

/// The `[telemetry]` table: how both services log, and where they export spans and
/// metrics (docs/configuration.md, "[telemetry]"). `Debug` prints header values as `***`.
#[derive(Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// `"text"` (the default) or `"json"`: one JSON object per log line.
    #[serde(default)]
    pub log_format: LogFormat,
    /// The OTLP collector's base URL (`http://collector:4318`, `https://collector:4317`);
    /// absent: nothing is exported. `gateway.otlp_endpoint` and `projector.otlp_endpoint`
    /// replace it for their service.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// `"http"` (OTLP/HTTP, protobuf; the default) or `"grpc"`.
    #[serde(default)]
    pub otlp_protocol: Protocol,
    /// Headers (gRPC metadata) sent with every export: a hosted collector's key, say.
    #[serde(default)]
    pub otlp_headers: BTreeMap<String, String>,
    /// PEM certificates to trust for an `https://` endpoint instead of the system's roots.
    #[serde(default)]
    pub otlp_ca_file: Option<PathBuf>,
    /// Resource attributes added to every span and metric (`deployment.environment`, …).
    #[serde(default)]
    pub resource_attributes: BTreeMap<String, String>,
    /// How often metrics are exported, in milliseconds (at least 100).
    #[serde(default = "default_otlp_metrics_interval_ms")]
    pub otlp_metrics_interval_ms: u64,
}

fn default_otlp_metrics_interval_ms() -> u64 {
    60_000
}

impl std::fmt::Debug for TelemetryConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let headers: BTreeMap<&str, &str> = self.otlp_headers.keys().map(|k| (k.as_str(), "***")).collect();
        f.debug_struct("TelemetryConfig")
            .field("log_format", &self.log_format)
            .field("otlp_endpoint", &self.otlp_endpoint)
            .field("otlp_protocol", &self.otlp_protocol)
            .field("otlp_headers", &headers)
            .field("otlp_ca_file", &self.otlp_ca_file)
            .field("resource_attributes", &self.resource_attributes)
            .field("otlp_metrics_interval_ms", &self.otlp_metrics_interval_ms)
            .finish()
    }
}

impl TelemetryConfig {
    /// The checked export settings for a service whose own `otlp_endpoint` key (if set)
    /// replaces `telemetry.otlp_endpoint`; `None`: no endpoint, nothing exported. `key`
    /// names the endpoint's key in errors.
    pub fn export(&self, service_endpoint: Option<&str>, key: &str) -> anyhow::Result<Option<Export>> {
        let (url, key) = match service_endpoint {
            Some(url) => (url, key),
            None => match &self.otlp_endpoint {
                Some(url) => (url.as_str(), "telemetry.otlp_endpoint"),
                None => return Ok(None),
            },
        };
        let endpoint = Endpoint::parse(url, self.otlp_protocol).map_err(|e| anyhow::anyhow!("{key} {url:?}: {e}"))?;
        check_headers(&self.otlp_headers).map_err(|e| anyhow::anyhow!("telemetry.otlp_headers: {e}"))?;
        if self.otlp_ca_file.is_some() && !endpoint.tls {
            bail!("telemetry.otlp_ca_file is set but {key} {url:?} is not an https:// URL");
        }
        if self.otlp_metrics_interval_ms < 100 {
            bail!("telemetry.otlp_metrics_interval_ms must be at least 100, not {}", self.otlp_metrics_interval_ms);
        }
        Ok(Some(Export {
            endpoint,
            protocol: self.otlp_protocol,
            headers: self.otlp_headers.clone(),
            ca_file: self.otlp_ca_file.clone(),
            resource: self.resource_attributes.clone(),
            metrics_interval: Duration::from_millis(self.otlp_metrics_interval_ms),
        }))
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProjectorSettings {
    /// This instance's name in `parsley.tasks.owner`. Default: `<hostname>-<pid>`.
    #[serde(default)]
    pub owner: Option<String>,
    /// Address of the Prometheus endpoint (`GET /metrics`); empty to disable.
    #[serde(default = "default_metrics_address")]
    pub metrics_address: String,
    /// Largest `parsley.causes` value accepted, in bytes.
    #[serde(default = "default_metadata_budget")]
    pub metadata_budget: usize,
    /// First wait after a failed step, in milliseconds; doubles per failure.
    #[serde(default = "default_initial_backoff_ms")]
    pub initial_backoff_ms: u64,
    /// Longest wait between retries of a failing step, in milliseconds.
    #[serde(default = "default_max_backoff_ms")]
    pub max_backoff_ms: u64,
    /// How often a running task that holds records compares the log start of the channels
    /// holding them with what it has settled, in milliseconds; 0 disables the check (it
    /// still runs at start and when a fetch is out of range).
    #[serde(default = "default_log_start_check_ms")]
    pub log_start_check_ms: u64,
    /// How often a task whose clock or frontier names channels of topics the model does
    /// not receive (upstream channels) learns their facts (topic still there, log start)
    /// and prunes the pairs they make dead, in milliseconds; 0 disables pruning.
    #[serde(default = "default_prune_interval_ms")]
    pub prune_interval_ms: u64,
    /// How often a refused task re-reads its row, in milliseconds: when the row no longer
    /// says `refused` (an operator's `skip`, or a fix), the task restarts, and derives the
    /// refusal again if its cause remains.
    #[serde(default = "default_refused_recheck_ms")]
    pub refused_recheck_ms: u64,
    /// How often each task compares the partition count of its received topics with the
    /// model's task count (`TASK_WIDTH_CHANGED` when partitions were added), in
    /// milliseconds; 0 disables the check while running (start still checks).
    #[serde(default = "default_width_check_ms")]
    pub width_check_ms: u64,
    /// How long a task's lease lasts unless renewed, in milliseconds: an instance that dies
    /// or freezes loses its tasks this long after its last renewal, and the other instances
    /// take them. Shorter: faster failover; longer: fewer needless takeovers when an instance
    /// or the database pauses (a takeover costs a restore and a repeated step, never a double
    /// delivery).
    #[serde(default = "default_lease_ms")]
    pub lease_ms: u64,
    /// How often an instance renews its membership and its tasks' leases and rebalances, in
    /// milliseconds; less than a third of `lease_ms`.
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// The projector's OTLP endpoint, replacing `telemetry.otlp_endpoint` (see
    /// [`TelemetryConfig`]); absent: that one.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// How long one step of a task runner may take before `/livez` fails (the runner is
    /// stuck: a projection that never returns, a lost wake-up), in milliseconds; 0: never.
    #[serde(default = "default_runner_stall_ms")]
    pub runner_stall_ms: u64,
}

impl Default for ProjectorSettings {
    fn default() -> Self {
        ProjectorSettings {
            owner: None,
            metrics_address: default_metrics_address(),
            metadata_budget: default_metadata_budget(),
            initial_backoff_ms: default_initial_backoff_ms(),
            max_backoff_ms: default_max_backoff_ms(),
            log_start_check_ms: default_log_start_check_ms(),
            prune_interval_ms: default_prune_interval_ms(),
            refused_recheck_ms: default_refused_recheck_ms(),
            width_check_ms: default_width_check_ms(),
            lease_ms: default_lease_ms(),
            heartbeat_ms: default_heartbeat_ms(),
            otlp_endpoint: None,
            runner_stall_ms: default_runner_stall_ms(),
        }
    }
}

impl ProjectorSettings {
    pub fn initial_backoff(&self) -> Duration {
        Duration::from_millis(self.initial_backoff_ms)
    }
    pub fn max_backoff(&self) -> Duration {
        Duration::from_millis(self.max_backoff_ms)
    }
    /// The interval of the periodic log-start check; `None` when disabled.
    pub fn log_start_check(&self) -> Option<Duration> {
        (self.log_start_check_ms > 0).then(|| Duration::from_millis(self.log_start_check_ms))
    }
    /// The interval of upstream pruning; `None` when disabled.
    pub fn prune_interval(&self) -> Option<Duration> {
        (self.prune_interval_ms > 0).then(|| Duration::from_millis(self.prune_interval_ms))
    }
    /// How often a refused task re-reads its row.
    pub fn refused_recheck(&self) -> Duration {
        Duration::from_millis(self.refused_recheck_ms)
    }
    /// The interval of the run-time width check; `None` when disabled.
    pub fn width_check(&self) -> Option<Duration> {
        (self.width_check_ms > 0).then(|| Duration::from_millis(self.width_check_ms))
    }
    /// How long a step may take before the runner counts as stuck; `None`: never.
    pub fn runner_stall(&self) -> Option<Duration> {
        (self.runner_stall_ms > 0).then(|| Duration::from_millis(self.runner_stall_ms))
    }
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }
    pub fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.heartbeat_ms)
    }
}

/// Where a channel with no prior state starts.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum InitialPosition {
    /// The log start: everything still retained.
    #[default]
    Earliest,
    /// The last stable offset: only what is committed from now on.
    Latest,
}

/// How the document projection applies a topic's records.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Apply {
    /// The record's JSON value replaces the document.
    #[default]
    Replace,
    /// The record's JSON value is a merge patch (RFC 7396) applied to the document.
    Merge,
}

/// What a task does with a record its projection rejects for good (a value it cannot
/// parse, a string the database cannot store, a constraint; see `projection.rs`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum OnRejected {
    /// Refuse `PROJECTION_REJECTED` at the record until an operator skips it
    /// (`parsley-projector skip`) or the projection is fixed.
    #[default]
    Refuse,
    /// Store the record in `parsley.dead_letters` and deliver it without effect, in the
    /// same step, and go on.
    DeadLetter,
}

/// The document projection's name: JSON documents keyed by record key
/// (`projection.documents`), the default.
pub const DOCUMENTS_PROJECTION: &str = "documents";
/// The SQL projection's name: the statements configured per topic.
pub const SQL_PROJECTION: &str = "sql";
/// The projections every projector knows; an embedding program registers more by name.
pub const BUILTIN_PROJECTIONS: &[&str] = &[DOCUMENTS_PROJECTION, SQL_PROJECTION];

/// The named parameters a `sql` projection's statements may use, each bound per record:
/// `key` (text), `key_bytes` (bytea), `value` (jsonb), `value_bytes` (bytea), `topic`
/// (text), `partition` (int4), `offset` (int8), `timestamp` (timestamptz), `headers`
/// (jsonb object). See `docs/projections.md`.
pub const STATEMENT_PARAMS: &[&str] =
    &["key", "key_bytes", "value", "value_bytes", "topic", "partition", "offset", "timestamp", "headers"];

/// Most rows a named query may be configured to return.
pub const MAX_QUERY_ROWS: u32 = 100_000;

/// The type of a named query's parameter, as the request's text is read.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ParamType {
    /// As given (bound as `text`).
    Text,
    /// A 64-bit integer (`int8`).
    Int,
    /// A finite 64-bit float (`float8`).
    Float,
    /// `true` or `false`.
    Bool,
    /// A JSON document (`jsonb`).
    Json,
}

impl ParamType {
    /// The name configuration spells it with (`text`, `int`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ParamType::Text => "text",
            ParamType::Int => "int",
            ParamType::Float => "float",
            ParamType::Bool => "bool",
            ParamType::Json => "json",
        }
    }
}

/// A named, read-only, parameterized query of a model (`[[models.queries]]`), served by the
/// gateway under the same gate as the model's documents.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct QueryConfig {
    /// 1 to 63 of `a-z`, `0-9`, `_`, `-`; unique within the model.
    pub name: String,
    /// The statement, with named parameters (`:customer`) for `params`.
    pub sql: String,
    /// Every parameter the statement uses, with its type; each one used.
    #[serde(default)]
    pub params: BTreeMap<String, ParamType>,
    /// The parameter that is the record key (a `text` one): the read is gated on the task
    /// owning that key. Absent: on every task of the model.
    #[serde(default)]
    pub key: Option<String>,
    /// Most rows returned (1 to [`MAX_QUERY_ROWS`]).
    #[serde(default = "default_query_max_rows")]
    pub max_rows: u32,
    /// Longest the query's statement may run, in milliseconds (`SET LOCAL
    /// statement_timeout`); past it the gateway answers `504 query-timeout`. Absent: the
    /// pool's `database.statement_timeout_ms`.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Largest answer, in bytes of its JSON body (1 to [`MAX_QUERY_BYTES`]); a result over
    /// it is refused whole, `422 query-result-too-large`, never truncated.
    #[serde(default = "default_query_max_bytes")]
    pub max_bytes: u64,
}

impl QueryConfig {
    /// A query named `name` running `sql` with `params`, every other key at its default.
    pub fn new(name: impl Into<String>, sql: impl Into<String>, params: BTreeMap<String, ParamType>) -> QueryConfig {
        QueryConfig {
            name: name.into(),
            sql: sql.into(),
            params,
            key: None,
            max_rows: default_query_max_rows(),
            timeout_ms: None,
            max_bytes: default_query_max_bytes(),
        }
    }
}

/// The default `max_bytes` of a named query: 8 MiB.
pub const DEFAULT_QUERY_MAX_BYTES: u64 = 8 << 20;
/// Most bytes a named query may be configured to answer: 1 GiB.
pub const MAX_QUERY_BYTES: u64 = 1 << 30;
/// Longest `timeout_ms` a named query may be configured with: ten minutes.
pub const MAX_QUERY_TIMEOUT_MS: u64 = 600_000;

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Unique model name: letters, digits, `_`, `-`, `.`; at most 63 bytes.
    pub name: String,
    /// The projection the model runs: [`DOCUMENTS_PROJECTION`] (the default),
    /// [`SQL_PROJECTION`], or a name an embedding program registered.
    #[serde(default = "default_projection")]
    pub projection: String,
    /// A folder of the model's own schema migrations (`<version>_<name>.sql`), applied at
    /// start with their own bookkeeping (`parsley.model_migrations`). Relative to the working
    /// directory.
    #[serde(default)]
    pub migrations: Option<String>,
    /// Free-form settings handed to the model's projection (custom projections read them).
    #[serde(default)]
    pub options: toml::Table,
    /// Named, read-only queries the gateway serves for the model.
    #[serde(default)]
    pub queries: Vec<QueryConfig>,
    /// The received topics, co-partitioned (equal partition counts).
    pub topics: Vec<TopicConfig>,
    /// Default initial position of the model's topics.
    #[serde(default)]
    pub initial_position: InitialPosition,
    /// Most records fed to a task in one step.
    #[serde(default = "default_max_step_records")]
    pub max_step_records: usize,
    /// Most bytes of records (keys, values and headers) fed to a task in one step; a step
    /// takes at least one record, however large. 0: no byte bound.
    #[serde(default = "default_max_step_bytes")]
    pub max_step_bytes: usize,
    /// Longest a step waits for records before it commits what it has, in milliseconds.
    #[serde(default = "default_max_step_ms")]
    pub max_step_ms: u64,
    /// Once a step has records, it commits as soon as the consumer has had nothing new for
    /// this long, in milliseconds (0, the default: no wait beyond what is already fetched).
    /// Under load records are already fetched and steps fill to `max_step_records`; a lone
    /// write is applied without waiting out `max_step_ms`.
    #[serde(default = "default_step_linger_ms")]
    pub step_linger_ms: u64,
    /// The tasks this instance runs; all of them when absent.
    #[serde(default)]
    pub tasks: Option<Vec<u32>>,
    /// What a task does with a record the projection rejects: refuse, or dead-letter it.
    #[serde(default)]
    pub on_rejected: OnRejected,
    /// Most records one task may hold waiting for their causes; one more refuses
    /// `HELD_LIMIT_EXCEEDED`. 0: unbounded.
    #[serde(default = "default_max_held_records")]
    pub max_held_records: usize,
    /// Most bytes one task's held records may weigh (key, value, headers, causes and a
    /// fixed overhead per record); more refuses `HELD_LIMIT_EXCEEDED`. 0: unbounded.
    #[serde(default = "default_max_held_bytes")]
    pub max_held_bytes: usize,
}

impl ModelConfig {
    /// A model named `name` receiving `topics`, every other key at its default.
    pub fn new(name: impl Into<String>, topics: Vec<TopicConfig>) -> ModelConfig {
        ModelConfig {
            name: name.into(),
            projection: default_projection(),
            migrations: None,
            options: toml::Table::new(),
            queries: Vec::new(),
            topics,
            initial_position: InitialPosition::default(),
            max_step_records: default_max_step_records(),
            max_step_bytes: default_max_step_bytes(),
            max_step_ms: default_max_step_ms(),
            step_linger_ms: default_step_linger_ms(),
            tasks: None,
            on_rejected: OnRejected::default(),
            max_held_records: default_max_held_records(),
            max_held_bytes: default_max_held_bytes(),
        }
    }

    pub fn max_step_time(&self) -> Duration {
        Duration::from_millis(self.max_step_ms)
    }

    pub fn step_linger(&self) -> Duration {
        Duration::from_millis(self.step_linger_ms)
    }

    /// The engine's held-record bounds (`None`: unbounded).
    pub fn held_limits(&self) -> (Option<usize>, Option<usize>) {
        (
            (self.max_held_records > 0).then_some(self.max_held_records),
            (self.max_held_bytes > 0).then_some(self.max_held_bytes),
        )
    }

    pub fn topic(&self, name: &str) -> Option<&TopicConfig> {
        self.topics.iter().find(|t| t.name == name)
    }

    /// The partitioner that routes a key of the model to one task: its topics' common one
    /// when every topic places keys by it. `None` when a topic is `partitioner = "none"`:
    /// a key's data may then come from any task, and a key read is gated on every task.
    pub fn key_partitioner(&self) -> Option<Partitioner> {
        let first = self.topics.first()?.partitioner;
        (first.routes_keys() && self.topics.iter().all(|t| t.partitioner == first)).then_some(first)
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TopicConfig {
    pub name: String,
    #[serde(default)]
    pub apply: Apply,
    /// Overrides the model's `initial_position` for this topic.
    #[serde(default)]
    pub initial_position: Option<InitialPosition>,
    /// A `sql` model's statements for each of the topic's records that has a value, run in
    /// order in the step's transaction, with named parameters ([`STATEMENT_PARAMS`]).
    #[serde(default)]
    pub statements: Vec<String>,
    /// A `sql` model's statements for a tombstone (a record without a value) of the topic;
    /// without any, a tombstone is delivered without effect.
    #[serde(default)]
    pub tombstone_statements: Vec<String>,
    /// The topic's data contract: a JSON Schema (draft 2020-12) file every value of the
    /// topic must keep (tombstones aside), relative to the working directory. The gateway
    /// refuses a value that breaks it (`400 value-invalid`); the projector rejects a record
    /// whose value breaks it (`PROJECTION_REJECTED`, or the model's `on_rejected`).
    #[serde(default)]
    pub schema: Option<String>,
    /// `schema` read and compiled: set when the configuration is loaded, or by
    /// [`TopicConfig::with_schema`].
    #[serde(skip)]
    pub contract: Option<Contract>,
    /// How the topic's producers place keyed records: `murmur2` (the default, the Java
    /// client's), `crc32` (librdkafka's `consistent_random`, the default of the Python, Go
    /// and .NET clients built on it) or `none` (the key is not the document key). The
    /// gateway routes writes and key reads by it; the projector refuses a keyed record on
    /// another partition (`KEY_PARTITION_MISMATCH`).
    #[serde(default, deserialize_with = "partitioner_by_name")]
    pub partitioner: Partitioner,
}

/// A topic's `partitioner`, by name; another name is refused naming the choices.
fn partitioner_by_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Partitioner, D::Error> {
    let name = String::deserialize(d)?;
    Partitioner::parse(&name).ok_or_else(|| {
        serde::de::Error::custom(format!("unknown partitioner {name:?}: choose {}", Partitioner::choices()))
    })
}

impl TopicConfig {
    /// A topic named `name` with every other key at its default.
    pub fn named(name: impl Into<String>) -> TopicConfig {
        TopicConfig {
            name: name.into(),
            apply: Apply::default(),
            initial_position: None,
            statements: Vec::new(),
            tombstone_statements: Vec::new(),
            schema: None,
            contract: None,
            partitioner: Partitioner::default(),
        }
    }

    /// This topic with the data contract in the file at `path` (read and compiled now).
    pub fn with_schema(mut self, path: impl Into<String>) -> anyhow::Result<TopicConfig> {
        let path = path.into();
        self.contract = Some(Contract::load(&path)?);
        self.schema = Some(path);
        Ok(self)
    }

    /// Reads and compiles `schema` into `contract`.
    fn read_schema(&mut self) -> anyhow::Result<()> {
        self.contract = match &self.schema {
            Some(path) => Some(Contract::load(path)?),
            None => None,
        };
        Ok(())
    }

    pub fn initial_position(&self, model: &ModelConfig) -> InitialPosition {
        self.initial_position.unwrap_or(model.initial_position)
    }

    /// The statements a record runs: `tombstone_statements` for a tombstone, `statements`
    /// for a record with a value.
    pub fn statements_for(&self, tombstone: bool) -> &[String] {
        if tombstone {
            &self.tombstone_statements
        } else {
            &self.statements
        }
    }
}

fn default_projection() -> String {
    DOCUMENTS_PROJECTION.to_string()
}
fn default_query_max_rows() -> u32 {
    1_000
}
fn default_query_max_bytes() -> u64 {
    DEFAULT_QUERY_MAX_BYTES
}
fn default_bootstrap() -> String {
    parsley_infra::services::LOCAL_KAFKA_BOOTSTRAP.to_string()
}
fn default_kafka_timeout_ms() -> u64 {
    10_000
}
fn default_max_connections() -> u32 {
    8
}
fn default_acquire_timeout_ms() -> u64 {
    5_000
}
fn default_lock_timeout_ms() -> u64 {
    10_000
}
fn default_statement_timeout_ms() -> u64 {
    30_000
}
fn default_idle_in_transaction_timeout_ms() -> u64 {
    60_000
}
fn default_keepalives_idle_s() -> u64 {
    30
}
/// The shortest enabled session timeout: below it, ordinary statements would fail.
pub const MIN_SESSION_TIMEOUT_MS: u64 = 100;
fn default_metrics_address() -> String {
    "127.0.0.1:9464".to_string()
}
fn default_metadata_budget() -> usize {
    parsley::codec::DEFAULT_METADATA_BUDGET
}
fn default_initial_backoff_ms() -> u64 {
    100
}
fn default_max_backoff_ms() -> u64 {
    30_000
}
fn default_log_start_check_ms() -> u64 {
    30_000
}
/// The shortest enabled log-start check interval: each check is a watermark request per
/// holding channel, and more often than this would mean nearly every step.
pub const MIN_LOG_START_CHECK_MS: u64 = 100;
fn default_prune_interval_ms() -> u64 {
    300_000
}
/// The shortest enabled prune interval: each prune lists and describes the cluster's topics
/// and queries the log start of every upstream channel.
pub const MIN_PRUNE_INTERVAL_MS: u64 = 100;
fn default_refused_recheck_ms() -> u64 {
    5_000
}
/// The shortest refused-task recheck: each is one small query per refused task.
pub const MIN_REFUSED_RECHECK_MS: u64 = 100;
fn default_width_check_ms() -> u64 {
    30_000
}
fn default_lease_ms() -> u64 {
    5_000
}
fn default_runner_stall_ms() -> u64 {
    120_000
}
/// The shortest enabled stall bound: a step waits up to `max_step_ms` for records and runs
/// statements bounded by `database.statement_timeout_ms`; a bound near those would fail
/// liveness for a step that is merely slow.
pub const MIN_RUNNER_STALL_MS: u64 = 1_000;
fn default_heartbeat_ms() -> u64 {
    1_000
}
/// The shortest lease: a takeover needs a few round trips to the database.
pub const MIN_LEASE_MS: u64 = 500;
/// The shortest heartbeat.
pub const MIN_HEARTBEAT_MS: u64 = 50;
/// The shortest enabled width check: each is a metadata request per task.
pub const MIN_WIDTH_CHECK_MS: u64 = 100;
fn default_max_held_records() -> usize {
    100_000
}
fn default_max_held_bytes() -> usize {
    256 * 1024 * 1024
}
/// The smallest enabled `max_held_bytes`: one record with the largest default causes value.
pub const MIN_MAX_HELD_BYTES: usize = 64 * 1024;
/// The default `max_step_records`. A step takes only what the consumer has already fetched
/// (no linger by default), so the bound only matters under a backlog, where a larger step
/// folds more records per key into one row and commits less often (docs/projector.md,
/// "Steps bounded by bytes"); [`DEFAULT_MAX_STEP_BYTES`] bounds its memory.
pub const DEFAULT_MAX_STEP_RECORDS: usize = 100_000;
fn default_max_step_records() -> usize {
    DEFAULT_MAX_STEP_RECORDS
}
/// The default `max_step_bytes`: 16 MiB of keys, values and headers per task and step.
pub const DEFAULT_MAX_STEP_BYTES: usize = 16 * 1024 * 1024;
fn default_max_step_bytes() -> usize {
    DEFAULT_MAX_STEP_BYTES
}
fn default_step_linger_ms() -> u64 {
    0
}

fn default_max_step_ms() -> u64 {
    100
}

impl Config {
    /// Parses and validates `text` (no environment overrides).
    pub fn parse(text: &str) -> anyhow::Result<Config> {
        Config::parse_with_env(text, &Env::default())
    }

    /// Parses `text`, applies the overrides `env` holds (every section but `[gateway]`, which
    /// the gateway reads itself), validates.
    pub fn parse_with_env(text: &str, env: &Env) -> anyhow::Result<Config> {
        let mut config = Config::from_text(text, env).map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))?;
        config.read_files().map_err(|e| anyhow::anyhow!("invalid configuration: {e:#}"))?;
        config.validate()?;
        Ok(config)
    }

    /// Reads `path`, applies the environment overrides, validates.
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut config = Config::from_text(&text, &Env::process())
            .map_err(|e| anyhow::anyhow!("invalid configuration in {}: {e}", path.display()))?;
        config.read_files().map_err(|e| anyhow::anyhow!("invalid configuration in {}: {e:#}", path.display()))?;
        config.validate().with_context(|| format!("invalid configuration in {}", path.display()))?;
        Ok(config)
    }

    /// Deserializes `text` with the overrides of `env` applied to its tree; without any, the
    /// text is read directly (errors then point at its lines).
    fn from_text(text: &str, env: &Env) -> anyhow::Result<Config> {
        let mut overrides = overrides::overrides(env, |section| section != GATEWAY_SECTION)?;
        if overrides.is_empty() {
            return toml::from_str(text).map_err(anyhow::Error::new);
        }
        let mut tree: toml::Table = toml::from_str(text)?;
        one_database_url(&mut tree, &mut overrides)?;
        overrides::apply(&mut tree, &overrides)?;
        overrides::deserialize(toml::Value::Table(tree), &[], &overrides)
    }

    /// Reads the values given as files: `kafka.property_files`, `database.url_file`, each
    /// topic's `schema`.
    fn read_files(&mut self) -> anyhow::Result<()> {
        self.kafka.read_property_files()?;
        self.database.read_url_file()?;
        for (i, m) in self.models.iter_mut().enumerate() {
            for (j, t) in m.topics.iter_mut().enumerate() {
                t.read_schema().with_context(|| format!("models[{i}].topics[{j}].schema"))?;
            }
        }
        Ok(())
    }

    /// The data contract of topic `name`: the one every model receiving it with a
    /// `schema` declares (validation has checked they agree); `None` when none does.
    pub fn contract(&self, name: &str) -> Option<&Contract> {
        self.models.iter().filter_map(|m| m.topic(name)).find_map(|t| t.contract.as_ref())
    }

    /// Checks what serde cannot; every message names the key.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.kafka.bootstrap.trim().is_empty() {
            bail!("kafka.bootstrap must not be empty");
        }
        for (table, names) in [
            ("properties", self.kafka.properties.keys()),
            ("property_files", self.kafka.property_files.keys()),
            ("consumer", self.kafka.consumer.keys()),
        ] {
            for name in names {
                if let Some(why) = kafka::fixed_property(name) {
                    bail!("kafka.{table}.\"{name}\" is fixed by the project and may not be set: {why}");
                }
            }
        }
        if self.database.max_connections == 0 {
            bail!("database.max_connections must be at least 1");
        }
        for (key, ms) in [
            ("lock_timeout_ms", self.database.lock_timeout_ms),
            ("statement_timeout_ms", self.database.statement_timeout_ms),
            ("idle_in_transaction_timeout_ms", self.database.idle_in_transaction_timeout_ms),
        ] {
            if ms != 0 && ms < MIN_SESSION_TIMEOUT_MS {
                bail!("database.{key} must be 0 (the server's setting) or at least {MIN_SESSION_TIMEOUT_MS}, not {ms}");
            }
            if ms > i32::MAX as u64 {
                bail!("database.{key} must be at most {} (Postgres' limit), not {ms}", i32::MAX);
            }
        }
        if self.database.keepalives_idle_s > i32::MAX as u64 {
            bail!("database.keepalives_idle_s must be at most {}, not {}", i32::MAX, self.database.keepalives_idle_s);
        }
        if self.projector.metadata_budget < 16 {
            bail!("projector.metadata_budget must be at least 16 bytes");
        }
        if self.projector.initial_backoff_ms == 0 {
            bail!("projector.initial_backoff_ms must be at least 1");
        }
        if self.projector.max_backoff_ms < self.projector.initial_backoff_ms {
            bail!("projector.max_backoff_ms must be at least projector.initial_backoff_ms");
        }
        if self.projector.log_start_check_ms != 0 && self.projector.log_start_check_ms < MIN_LOG_START_CHECK_MS {
            bail!(
                "projector.log_start_check_ms must be 0 (disabled) or at least {MIN_LOG_START_CHECK_MS}, not {}",
                self.projector.log_start_check_ms
            );
        }
        if self.projector.prune_interval_ms != 0 && self.projector.prune_interval_ms < MIN_PRUNE_INTERVAL_MS {
            bail!(
                "projector.prune_interval_ms must be 0 (disabled) or at least {MIN_PRUNE_INTERVAL_MS}, not {}",
                self.projector.prune_interval_ms
            );
        }
        if self.projector.refused_recheck_ms < MIN_REFUSED_RECHECK_MS {
            bail!(
                "projector.refused_recheck_ms must be at least {MIN_REFUSED_RECHECK_MS}, not {}",
                self.projector.refused_recheck_ms
            );
        }
        self.telemetry.export(self.projector.otlp_endpoint.as_deref(), "projector.otlp_endpoint")?;
        if self.projector.lease_ms < MIN_LEASE_MS || self.projector.lease_ms > i32::MAX as u64 {
            bail!(
                "projector.lease_ms must be between {MIN_LEASE_MS} and {}, not {}",
                i32::MAX,
                self.projector.lease_ms
            );
        }
        if self.projector.heartbeat_ms < MIN_HEARTBEAT_MS || self.projector.heartbeat_ms * 3 > self.projector.lease_ms {
            bail!(
                "projector.heartbeat_ms must be at least {MIN_HEARTBEAT_MS} and at most a third of projector.lease_ms \
                 ({}), not {}: a lease must survive two missed heartbeats",
                self.projector.lease_ms / 3,
                self.projector.heartbeat_ms
            );
        }
        if self.projector.runner_stall_ms != 0 && self.projector.runner_stall_ms < MIN_RUNNER_STALL_MS {
            bail!(
                "projector.runner_stall_ms must be 0 (never) or at least {MIN_RUNNER_STALL_MS}, not {}",
                self.projector.runner_stall_ms
            );
        }
        if let Some(model) = self
            .models
            .iter()
            .find(|m| self.projector.runner_stall_ms != 0 && m.max_step_ms >= self.projector.runner_stall_ms)
        {
            bail!(
                "projector.runner_stall_ms ({}) must exceed every model's max_step_ms: model {:?} waits up to {} ms \
                 for records in a step",
                self.projector.runner_stall_ms,
                model.name,
                model.max_step_ms
            );
        }
        if self.projector.width_check_ms != 0 && self.projector.width_check_ms < MIN_WIDTH_CHECK_MS {
            bail!(
                "projector.width_check_ms must be 0 (disabled) or at least {MIN_WIDTH_CHECK_MS}, not {}",
                self.projector.width_check_ms
            );
        }
        if !self.projector.metrics_address.is_empty()
            && self.projector.metrics_address.parse::<std::net::SocketAddr>().is_err()
        {
            bail!(
                "projector.metrics_address {:?} is not an address like 127.0.0.1:9464",
                self.projector.metrics_address
            );
        }
        let mut names = BTreeSet::new();
        // Each topic's partitioner, and the first model naming it.
        let mut partitioners: BTreeMap<&str, (&str, Partitioner)> = BTreeMap::new();
        for (i, m) in self.models.iter().enumerate() {
            let at = format!("models[{i}]");
            if !valid_model_name(&m.name) {
                bail!("{at}.name {:?} must be 1 to 63 letters, digits, '_', '-' or '.'", m.name);
            }
            if !names.insert(m.name.as_str()) {
                bail!("{at}.name {:?} is declared twice", m.name);
            }
            if m.topics.is_empty() {
                bail!("{at}.topics must name at least one topic");
            }
            let mut topics = BTreeSet::new();
            for (j, t) in m.topics.iter().enumerate() {
                if t.name.trim().is_empty() || t.name.len() > 249 {
                    bail!("{at}.topics[{j}].name must be a Kafka topic name (1 to 249 characters)");
                }
                if !topics.insert(t.name.as_str()) {
                    bail!("{at}.topics[{j}].name {:?} is declared twice in model {:?}", t.name, m.name);
                }
                // Keys are routed to tasks by one function: co-partitioned topics that
                // place keys differently would put one key on two tasks.
                if let Some((k, first)) = m.topics[..j]
                    .iter()
                    .enumerate()
                    .find(|(_, o)| o.partitioner.routes_keys() && o.partitioner != t.partitioner)
                {
                    if t.partitioner.routes_keys() {
                        bail!(
                            "{at}.topics[{j}].partitioner is {:?} but {at}.topics[{k}] ({:?}) is {:?}: a model's keyed \
                             topics must place keys alike, or one key would belong to two tasks (set \
                             partitioner = \"none\" on a topic whose key is not the document key)",
                            t.partitioner.as_str(),
                            first.name,
                            first.partitioner.as_str()
                        );
                    }
                }
                if let Some((other, o)) = partitioners.get(t.name.as_str()) {
                    if *o != t.partitioner {
                        bail!(
                            "{at}.topics[{j}].partitioner is {:?} but model {other:?} receives topic {:?} with {:?}: a \
                             topic's producers place keys one way",
                            t.partitioner.as_str(),
                            t.name,
                            o.as_str()
                        );
                    }
                } else {
                    partitioners.insert(t.name.as_str(), (m.name.as_str(), t.partitioner));
                }
            }
            if m.max_step_records == 0 {
                bail!("{at}.max_step_records must be at least 1");
            }
            if m.max_step_ms == 0 {
                bail!("{at}.max_step_ms must be at least 1");
            }
            if m.step_linger_ms > m.max_step_ms {
                bail!("{at}.step_linger_ms ({}) must not exceed max_step_ms ({})", m.step_linger_ms, m.max_step_ms);
            }
            if m.max_held_bytes != 0 && m.max_held_bytes < MIN_MAX_HELD_BYTES {
                bail!(
                    "{at}.max_held_bytes must be 0 (unbounded) or at least {MIN_MAX_HELD_BYTES}, not {}",
                    m.max_held_bytes
                );
            }
            if let Some(tasks) = &m.tasks {
                if tasks.is_empty() {
                    bail!("{at}.tasks must list at least one task when present");
                }
            }
            validate_projection(m, &at)?;
            validate_queries(m, &at)?;
        }
        self.validate_contracts()
    }

    /// Every topic's `schema` is loaded, and the models receiving one topic with a `schema`
    /// declare the same one: a topic has one contract, which the gateway holds writes to.
    fn validate_contracts(&self) -> anyhow::Result<()> {
        let mut seen: BTreeMap<&str, (String, &Contract)> = BTreeMap::new();
        for (i, m) in self.models.iter().enumerate() {
            for (j, t) in m.topics.iter().enumerate() {
                let at = format!("models[{i}].topics[{j}].schema");
                let contract = match (&t.schema, &t.contract) {
                    (None, None) => continue,
                    (Some(path), None) => {
                        bail!("{at} {path:?} was not read (load the file, or use TopicConfig::with_schema)")
                    }
                    (None, Some(_)) => bail!("{at} is not set, but topic {:?} holds a contract", t.name),
                    (Some(path), Some(c)) if c.path() != path => {
                        bail!("{at} is {path:?}, but topic {:?} holds the contract of {:?}", t.name, c.path())
                    }
                    (Some(path), Some(c)) => {
                        if path.trim().is_empty() {
                            bail!("{at} must name a file when present");
                        }
                        c
                    }
                };
                match seen.get(t.name.as_str()) {
                    Some((first, other)) if other.schema() != contract.schema() => bail!(
                        "{at} ({:?}) and {first} ({:?}) give topic {:?} different schemas: a topic has one contract",
                        contract.path(),
                        other.path(),
                        t.name
                    ),
                    Some(_) => {}
                    None => {
                        seen.insert(t.name.as_str(), (at, contract));
                    }
                }
            }
        }
        Ok(())
    }

    /// How the producers of `topic` place keys (its configured `partitioner`; the default
    /// for a topic no model receives).
    pub fn partitioner_of(&self, topic: &str) -> Partitioner {
        self.models.iter().find_map(|m| m.topic(topic)).map(|t| t.partitioner).unwrap_or_default()
    }

    /// The model named `name`.
    pub fn model(&self, name: &str) -> anyhow::Result<&ModelConfig> {
        self.models.iter().find(|m| m.name == name).with_context(|| {
            let known: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
            format!("no model named {name:?} in the configuration (models: {known:?})")
        })
    }

    /// The database URL, or an error naming the key and the variables.
    pub fn database_url(&self) -> anyhow::Result<&str> {
        self.database.url.as_ref().map(|u| u.expose().as_str()).filter(|u| !u.trim().is_empty()).with_context(|| {
            format!("database.url is not set: set it in the file or export {ENV_DATABASE_URL} (or {ENV_DATABASE_URL_FALLBACK})")
        })
    }

    /// This instance's owner name.
    pub fn owner(&self) -> String {
        self.projector.owner.clone().unwrap_or_else(default_owner)
    }
}

/// A model's `projection`, `migrations` and its topics' statements; every message names the key.
fn validate_projection(m: &ModelConfig, at: &str) -> anyhow::Result<()> {
    if !valid_projection_name(&m.projection) {
        bail!("{at}.projection {:?} must be 1 to 63 letters, digits, '_', '-' or '.'", m.projection);
    }
    if m.migrations.as_deref().is_some_and(|p| p.trim().is_empty()) {
        bail!("{at}.migrations must name a folder when present");
    }
    let sql = m.projection == SQL_PROJECTION;
    let mut any = false;
    for (j, t) in m.topics.iter().enumerate() {
        for (key, statements) in [("statements", &t.statements), ("tombstone_statements", &t.tombstone_statements)] {
            if statements.is_empty() {
                continue;
            }
            if !sql {
                bail!(
                    "{at}.topics[{j}].{key} is set, but model {:?} runs the {:?} projection: statements are for \
                     projection = \"sql\"",
                    m.name,
                    m.projection
                );
            }
            any = true;
            for (k, statement) in statements.iter().enumerate() {
                let at = format!("{at}.topics[{j}].{key}[{k}]");
                if statement.trim().is_empty() {
                    bail!("{at} is empty");
                }
                let rewritten = sql_params::rewrite(statement).map_err(|e| anyhow::anyhow!("{at}: {e}"))?;
                if let Some(unknown) = rewritten.names.iter().find(|n| !STATEMENT_PARAMS.contains(&n.as_str())) {
                    bail!("{at} uses the unknown parameter :{unknown} (known: {})", STATEMENT_PARAMS.join(", "));
                }
            }
        }
    }
    if sql && !any {
        bail!("{at}: model {:?} runs the \"sql\" projection, but none of its topics has statements", m.name);
    }
    Ok(())
}

/// A model's `queries`: names, parameters declared and used, the key parameter, `max_rows`.
fn validate_queries(m: &ModelConfig, at: &str) -> anyhow::Result<()> {
    let mut names = BTreeSet::new();
    for (q, query) in m.queries.iter().enumerate() {
        let at = format!("{at}.queries[{q}]");
        if !valid_query_name(&query.name) {
            bail!("{at}.name {:?} must be 1 to 63 of a-z, 0-9, '_' or '-'", query.name);
        }
        if !names.insert(query.name.as_str()) {
            bail!("{at}.name {:?} is declared twice in model {:?}", query.name, m.name);
        }
        if query.sql.trim().is_empty() {
            bail!("{at}.sql is empty");
        }
        let rewritten = sql_params::rewrite(&query.sql).map_err(|e| anyhow::anyhow!("{at}.sql: {e}"))?;
        if let Some(undeclared) = rewritten.names.iter().find(|n| !query.params.contains_key(n.as_str())) {
            bail!("{at}.sql uses :{undeclared}, which {at}.params does not declare");
        }
        if let Some(unused) = query.params.keys().find(|p| !rewritten.names.contains(p)) {
            bail!("{at}.params declares {unused:?}, which {at}.sql does not use");
        }
        if let Some(key) = &query.key {
            match query.params.get(key) {
                None => bail!("{at}.key {key:?} is not a parameter declared in {at}.params"),
                Some(ParamType::Text) => {}
                Some(other) => bail!("{at}.key {key:?} must be a text parameter, not {}", other.name()),
            }
        }
        if query.max_rows == 0 || query.max_rows > MAX_QUERY_ROWS {
            bail!("{at}.max_rows must be between 1 and {MAX_QUERY_ROWS}, not {}", query.max_rows);
        }
        if query.timeout_ms.is_some_and(|t| t == 0 || t > MAX_QUERY_TIMEOUT_MS) {
            bail!("{at}.timeout_ms must be between 1 and {MAX_QUERY_TIMEOUT_MS} when set");
        }
        if query.max_bytes == 0 || query.max_bytes > MAX_QUERY_BYTES {
            bail!("{at}.max_bytes must be between 1 and {MAX_QUERY_BYTES}, not {}", query.max_bytes);
        }
    }
    Ok(())
}

/// `database.url` and `database.url_file` are one setting given two ways. A variable that sets
/// one replaces the other from the file; two variables setting both are refused, except that
/// the conventional `DATABASE_URL` (often set for other tools) yields to a URL file.
fn one_database_url(tree: &mut toml::Table, overrides: &mut Vec<overrides::Override>) -> anyhow::Result<()> {
    let sets =
        |overrides: &[overrides::Override], key: &str| overrides.iter().position(|o| o.path == ["database", key]);
    if let (Some(url), Some(file)) = (sets(overrides, "url"), sets(overrides, "url_file")) {
        if overrides[url].var != ENV_DATABASE_URL_FALLBACK {
            bail!("{} and {} both set the database URL: set one", overrides[url].var, overrides[file].var);
        }
        overrides.remove(url);
    }
    if let Some(toml::Value::Table(database)) = tree.get_mut("database") {
        if sets(overrides, "url").is_some() {
            database.remove("url_file");
        }
        if sets(overrides, "url_file").is_some() {
            database.remove("url");
        }
    }
    Ok(())
}

/// `<hostname>-<pid>`: distinct per process, readable in status.
pub fn default_owner() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "projector".to_string());
    format!("{host}-{}", std::process::id())
}

/// A projection's name: what a model's `projection` names and an embedding program
/// registers (the model-name alphabet).
pub fn valid_projection_name(name: &str) -> bool {
    valid_model_name(name)
}

/// A named query's name: it is a URL path segment (`/v1/models/{model}/queries/{name}`).
pub fn valid_query_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'))
}

/// Model names appear in NOTIFY payloads (`<model>:<task>`) and metric labels.
pub fn valid_model_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"
[kafka]
bootstrap = "k:9092"
consumer = { "fetch.wait.max.ms" = "50" }

[database]
url = "postgres://u:p@h/db"
max_connections = 4

[projector]
owner = "a"
metrics_address = "127.0.0.1:9000"

[[models]]
name = "shop"
initial_position = "latest"
max_step_records = 10
max_step_ms = 20
topics = [
  { name = "orders", apply = "replace" },
  { name = "payments", apply = "merge", initial_position = "earliest" },
]

[gateway]
listen = "127.0.0.1:8080"
"#;

    fn error_of(text: &str) -> String {
        format!("{:#}", Config::parse(text).unwrap_err())
    }

    #[test]
    fn a_full_file_parses() {
        let c = Config::parse(FULL).unwrap();
        assert_eq!(c.kafka.bootstrap, "k:9092");
        let m = c.model("shop").unwrap();
        assert_eq!(m.topics[1].apply, Apply::Merge);
        assert_eq!(m.topics[0].initial_position(m), InitialPosition::Latest);
        assert_eq!(m.topics[1].initial_position(m), InitialPosition::Earliest);
        assert_eq!(m.max_step_records, 10);
        assert!(c.gateway.is_some());
        assert!(c.model("nope").is_err());
    }

    const SQL_MODEL: &str = r#"
[[models]]
name = "totals"
projection = "sql"
migrations = "examples/order-totals/migrations"

[[models.topics]]
name = "orders"
statements = ["""INSERT INTO totals.orders (id, customer, amount)
  VALUES (:key, :value->>'customer', (:value->>'amount')::numeric)
  ON CONFLICT (id) DO UPDATE SET customer = EXCLUDED.customer, amount = EXCLUDED.amount"""]
tombstone_statements = ["DELETE FROM totals.orders WHERE id = :key"]

[[models.topics]]
name = "payments"
statements = ["INSERT INTO totals.log VALUES (:topic, :partition, :offset, :timestamp, :headers, :key_bytes, :value_bytes)"]

[models.options]
anything = "goes"
nested = { n = 1 }

[[models.queries]]
name = "customer_total"
sql = "SELECT customer, sum(amount) AS total FROM totals.orders WHERE customer = :customer GROUP BY customer"
params = { customer = "text" }
key = "customer"

[[models.queries]]
name = "big-orders"
sql = "SELECT id FROM totals.orders WHERE amount > :min::numeric AND (:flag OR :doc ? 'x') AND :n > 0"
params = { min = "float", flag = "bool", doc = "json", n = "int" }
max_rows = 5
timeout_ms = 250
max_bytes = 4096
"#;

    #[test]
    fn a_sql_model_parses() {
        let c = Config::parse(SQL_MODEL).unwrap();
        let m = c.model("totals").unwrap();
        assert_eq!(m.projection, SQL_PROJECTION);
        assert_eq!(m.migrations.as_deref(), Some("examples/order-totals/migrations"));
        assert_eq!(m.options.get("anything").and_then(|v| v.as_str()), Some("goes"));
        assert_eq!(m.topics[0].statements.len(), 1);
        assert_eq!(m.topics[0].statements_for(true), ["DELETE FROM totals.orders WHERE id = :key"]);
        assert!(m.topics[1].statements_for(true).is_empty(), "without tombstone statements a tombstone does nothing");
        let q = &m.queries[0];
        assert_eq!((q.name.as_str(), q.key.as_deref(), q.max_rows), ("customer_total", Some("customer"), 1000));
        assert_eq!(q.params.get("customer"), Some(&ParamType::Text));
        assert_eq!((q.timeout_ms, q.max_bytes), (None, DEFAULT_QUERY_MAX_BYTES), "the defaults");
        assert_eq!(QueryConfig::new("customer_total", q.sql.clone(), q.params.clone()).max_bytes, q.max_bytes);
        let q = &m.queries[1];
        assert_eq!(q.max_rows, 5);
        assert_eq!((q.timeout_ms, q.max_bytes), (Some(250), 4096));
        assert_eq!(q.params.get("doc"), Some(&ParamType::Json));
        // The default projection, and the constructor's defaults equal the file's.
        let c = Config::parse("[[models]]\nname = \"m\"\ntopics = [{ name = \"t\" }]\n").unwrap();
        assert_eq!(c.models[0].projection, DOCUMENTS_PROJECTION);
        assert_eq!(c.models[0], ModelConfig::new("m", vec![TopicConfig::named("t")]));
        // A name an embedding program registers is the projector's to check.
        let c =
            Config::parse("[[models]]\nname = \"m\"\nprojection = \"audit\"\ntopics = [{ name = \"t\" }]\n").unwrap();
        assert_eq!(c.models[0].projection, "audit");
    }

    #[test]
    fn sql_models_and_queries_are_refused_by_key() {
        let model = |extra: &str, topic: &str| {
            format!("[[models]]\nname = \"m\"\n{extra}\n[[models.topics]]\nname = \"t\"\n{topic}\n")
        };
        let sql = |topic: &str| model("projection = \"sql\"", topic);
        let query =
            |q: &str| format!("[[models]]\nname = \"m\"\ntopics = [{{ name = \"t\" }}]\n[[models.queries]]\n{q}\n");
        let cases: Vec<(String, &str)> = vec![
            (
                sql("statements = [\"SELECT :nope\"]"),
                "models[0].topics[0].statements[0] uses the unknown parameter :nope",
            ),
            (
                sql("statements = [\"SELECT 1\"]\ntombstone_statements = [\"SELECT :keyy\"]"),
                "tombstone_statements[0] uses the unknown parameter :keyy",
            ),
            (sql("statements = [\"SELECT $1\"]"), "models[0].topics[0].statements[0]: positional"),
            (sql("statements = [\"SELECT ':key\"]"), "models[0].topics[0].statements[0]: a string literal"),
            (sql("statements = [\" \"]"), "models[0].topics[0].statements[0] is empty"),
            (sql(""), "none of its topics has statements"),
            (model("", "statements = [\"SELECT :key\"]"), "models[0].topics[0].statements is set"),
            (
                model("projection = \"audit\"", "tombstone_statements = [\"SELECT :key\"]"),
                "models[0].topics[0].tombstone_statements",
            ),
            (model("projection = \"no way\"", ""), "models[0].projection"),
            (model("migrations = \"\"", ""), "models[0].migrations"),
            (model("", "statement = [\"SELECT 1\"]"), "statement"),
            (query("name = \"Q\"\nsql = \"SELECT 1\""), "models[0].queries[0].name"),
            (query("name = \"q\"\nsql = \"SELECT :a\""), "models[0].queries[0].sql uses :a"),
            (
                query("name = \"q\"\nsql = \"SELECT 1\"\nparams = { a = \"text\" }"),
                "models[0].queries[0].params declares \"a\"",
            ),
            (query("name = \"q\"\nsql = \"SELECT :a\"\nparams = { a = \"date\" }"), "date"),
            (
                query("name = \"q\"\nsql = \"SELECT :a\"\nparams = { a = \"text\" }\nkey = \"b\""),
                "models[0].queries[0].key \"b\"",
            ),
            (
                query("name = \"q\"\nsql = \"SELECT :a\"\nparams = { a = \"int\" }\nkey = \"a\""),
                "must be a text parameter, not int",
            ),
            (query("name = \"q\"\nsql = \"SELECT 1\"\nmax_rows = 0"), "models[0].queries[0].max_rows"),
            (query("name = \"q\"\nsql = \"SELECT 1\"\nmax_rows = 100001"), "models[0].queries[0].max_rows"),
            (query("name = \"q\"\nsql = \"SELECT 1\"\ntimeout_ms = 0"), "models[0].queries[0].timeout_ms"),
            (query("name = \"q\"\nsql = \"SELECT 1\"\nmax_bytes = 0"), "models[0].queries[0].max_bytes"),
            (query("name = \"q\"\nsql = \"\""), "models[0].queries[0].sql is empty"),
            (
                query("name = \"q\"\nsql = \"SELECT 1\"\n[[models.queries]]\nname = \"q\"\nsql = \"SELECT 2\""),
                "models[0].queries[1].name \"q\" is declared twice",
            ),
            (query("name = \"q\"\nsql = \"SELECT 1\"\nrows = 3"), "rows"),
        ];
        for (text, key) in cases {
            let err = error_of(&text);
            assert!(err.contains(key), "error for {text:?} does not name {key:?}: {err}");
        }
    }

    #[test]
    fn the_shipped_example_parses() {
        let text = include_str!("../../config/parsley.toml");
        let c = Config::parse(text).unwrap();
        assert_eq!(c.model("shop").unwrap().topics.len(), 2);
    }

    #[test]
    fn on_rejected_is_refuse_unless_dead_letter_is_asked_for() {
        let policy = |line: &str| {
            Config::parse(&format!("[[models]]\nname = \"m\"\n{line}\ntopics = [{{ name = \"t\" }}]\n"))
                .map(|c| c.models[0].on_rejected)
        };
        assert_eq!(policy("").unwrap(), OnRejected::Refuse);
        assert_eq!(policy("on_rejected = \"refuse\"").unwrap(), OnRejected::Refuse);
        assert_eq!(policy("on_rejected = \"dead-letter\"").unwrap(), OnRejected::DeadLetter);
        let err = format!("{:#}", policy("on_rejected = \"skip\"").unwrap_err());
        assert!(err.contains("on_rejected") || err.contains("dead-letter"), "{err}");
    }

    #[test]
    fn topics_say_how_keys_are_placed() {
        let parse = |topics: &str| Config::parse(&format!("[[models]]\nname = \"m\"\ntopics = [{topics}]\n"));
        let c = parse("{ name = \"a\" }, { name = \"b\", partitioner = \"murmur2\" }").unwrap();
        assert_eq!(c.models[0].topics[0].partitioner, Partitioner::Murmur2, "murmur2 by default");
        assert_eq!(c.models[0].key_partitioner(), Some(Partitioner::Murmur2));
        assert_eq!(c.partitioner_of("a"), Partitioner::Murmur2);
        let c = parse("{ name = \"a\", partitioner = \"crc32\" }, { name = \"b\", partitioner = \"crc32\" }").unwrap();
        assert_eq!(c.models[0].key_partitioner(), Some(Partitioner::Crc32));
        assert_eq!(c.partitioner_of("b"), Partitioner::Crc32);
        // A topic whose key is not the document key: a key read goes to every task.
        let c = parse("{ name = \"a\", partitioner = \"crc32\" }, { name = \"b\", partitioner = \"none\" }").unwrap();
        assert_eq!(c.models[0].key_partitioner(), None);
        assert_eq!(c.partitioner_of("b"), Partitioner::None);

        let err = format!("{:#}", parse("{ name = \"a\", partitioner = \"consistent_random\" }").unwrap_err());
        assert!(err.contains("consistent_random") && err.contains(r#""murmur2", "crc32" or "none""#), "{err}");
        let err = format!("{:#}", parse("{ name = \"a\" }, { name = \"b\", partitioner = \"crc32\" }").unwrap_err());
        assert!(err.contains("models[0].topics[1].partitioner") && err.contains("murmur2"), "{err}");
        let two = "[[models]]\nname = \"m\"\ntopics = [{ name = \"a\" }]\n\
                   [[models]]\nname = \"n\"\ntopics = [{ name = \"a\", partitioner = \"crc32\" }]\n";
        let err = format!("{:#}", Config::parse(two).unwrap_err());
        assert!(err.contains("models[1].topics[0].partitioner") && err.contains("model \"m\""), "{err}");
    }

    #[test]
    fn defaults_apply() {
        let c = Config::parse("[[models]]\nname = \"m\"\ntopics = [{ name = \"t\" }]\n").unwrap();
        let m = &c.models[0];
        assert_eq!(m.topics[0].apply, Apply::Replace);
        assert_eq!(m.initial_position, InitialPosition::Earliest);
        assert_eq!(m.max_step_records, 100_000);
        assert_eq!(m.max_step_bytes, 16 * 1024 * 1024);
        assert_eq!(c.projector.metadata_budget, 256 * 1024);
        assert_eq!(c.kafka.bootstrap, "127.0.0.1:9092");
        assert_eq!(c.projector.log_start_check_ms, 30_000);
        assert_eq!(c.projector.log_start_check(), Some(Duration::from_secs(30)));
        assert_eq!(c.projector.prune_interval(), Some(Duration::from_secs(300)));
        assert_eq!(c.projector.refused_recheck(), Duration::from_secs(5));
        assert_eq!(c.projector.width_check(), Some(Duration::from_secs(30)));
        assert_eq!(m.held_limits(), (Some(100_000), Some(256 * 1024 * 1024)));
        assert_eq!(c.database.session_bounds(), SessionBounds::default());
    }

    #[test]
    fn zero_leaves_a_bound_off() {
        let c = Config::parse(
            "[database]\nlock_timeout_ms = 0\nstatement_timeout_ms = 0\nidle_in_transaction_timeout_ms = 0\n\
             keepalives_idle_s = 0\n[projector]\nwidth_check_ms = 0\n\
             [[models]]\nname = \"m\"\nmax_held_records = 0\nmax_held_bytes = 0\ntopics = [{ name = \"t\" }]\n",
        )
        .unwrap();
        assert_eq!(c.database.session_bounds(), SessionBounds::SERVER_DEFAULTS);
        assert_eq!(c.projector.width_check(), None);
        assert_eq!(c.models[0].held_limits(), (None, None));
        let c = Config::parse("[database]\nlock_timeout_ms = 250\nkeepalives_idle_s = 7\n").unwrap();
        let b = c.database.session_bounds();
        assert_eq!(b.lock_timeout, Some(Duration::from_millis(250)));
        assert_eq!(b.keepalives_idle, Some(Duration::from_secs(7)));
    }

    #[test]
    fn pruning_is_disabled_by_zero_and_bounded_below() {
        let interval = |text: &str| Config::parse(text).map(|c| c.projector.prune_interval());
        assert_eq!(interval("[projector]\nprune_interval_ms = 0\n").unwrap(), None);
        assert_eq!(interval("[projector]\nprune_interval_ms = 100\n").unwrap(), Some(Duration::from_millis(100)));
        let err = format!("{:#}", interval("[projector]\nprune_interval_ms = 99\n").unwrap_err());
        assert!(err.contains("projector.prune_interval_ms") && err.contains("99"), "{err}");
    }

    #[test]
    fn the_log_start_check_is_disabled_by_zero_and_bounded_below() {
        let check = |text: &str| Config::parse(text).map(|c| c.projector.log_start_check());
        assert_eq!(check("[projector]\nlog_start_check_ms = 0\n").unwrap(), None);
        assert_eq!(check("[projector]\nlog_start_check_ms = 100\n").unwrap(), Some(Duration::from_millis(100)));
        let err = format!("{:#}", check("[projector]\nlog_start_check_ms = 99\n").unwrap_err());
        assert!(err.contains("projector.log_start_check_ms") && err.contains("99"), "{err}");
    }

    #[test]
    fn errors_name_the_key() {
        let cases: &[(&str, &str)] = &[
            ("[kafka]\nbootstrapp = \"x\"\n", "bootstrapp"),
            ("[[models]]\nname = \"m\"\ntopics = [{ name = \"t\", apply = \"upsert\" }]\n", "upsert"),
            ("[[models]]\nname = \"m\"\ntopics = [{ name = \"t\", aply = \"merge\" }]\n", "aply"),
            ("[[models]]\nname = \"m\"\ntopics = []\n", "models[0].topics"),
            ("[[models]]\nname = \"m:x\"\ntopics = [{ name = \"t\" }]\n", "models[0].name"),
            ("[[models]]\nname = \"m\"\ntopics = [{ name = \"t\" }, { name = \"t\" }]\n", "models[0].topics[1].name"),
            ("[[models]]\nname = \"m\"\nmax_step_records = 0\ntopics = [{ name = \"t\" }]\n", "models[0].max_step_records"),
            ("[[models]]\nname = \"m\"\ninitial_position = \"middle\"\ntopics = [{ name = \"t\" }]\n", "middle"),
            ("[kafka]\nconsumer = { \"isolation.level\" = \"read_uncommitted\" }\n", "kafka.consumer.\"isolation.level\""),
            ("[kafka.properties]\nacks = \"1\"\n", "kafka.properties.\"acks\""),
            ("[kafka.properties]\n\"request.required.acks\" = \"1\"\n", "kafka.properties.\"request.required.acks\""),
            ("[kafka.properties]\n\"bootstrap.servers\" = \"x:1\"\n", "kafka.bootstrap sets it"),
            ("[kafka.property_files]\n\"group.id\" = \"/dev/null\"\n", "kafka.property_files.\"group.id\""),
            ("[kafka.property_files]\n\"sasl.password\" = \"/nonexistent/p\"\n", "kafka.property_files.\"sasl.password\""),
            ("[database]\nurl_file = \"/nonexistent/u\"\n", "database.url_file"),
            ("[database]\nurl = \"postgres://h/d\"\nurl_file = \"/dev/null\"\n", "database.url and database.url_file"),
            ("[projector]\nmetrics_address = \"nowhere\"\n", "projector.metrics_address"),
            ("[projector]\nmax_backoff_ms = 1\ninitial_backoff_ms = 5\n", "projector.max_backoff_ms"),
            ("[projector]\nlog_start_check_ms = 5\n", "projector.log_start_check_ms"),
            ("[projector]\nlog_start_check_ms = -1\n", "log_start_check_ms"),
            ("[projector]\nprune_interval_ms = 5\n", "projector.prune_interval_ms"),
            ("[projector]\nrefused_recheck_ms = 0\n", "projector.refused_recheck_ms"),
            ("[projector]\nwidth_check_ms = 99\n", "projector.width_check_ms"),
            ("[projector]\nlease_ms = 499\n", "projector.lease_ms"),
            ("[projector]\nlease_ms = 3000\nheartbeat_ms = 1001\n", "projector.heartbeat_ms"),
            ("[projector]\nheartbeat_ms = 10\n", "projector.heartbeat_ms"),
            ("[projector]\nrunner_stall_ms = 999\n", "projector.runner_stall_ms"),
            (
                "[projector]\nrunner_stall_ms = 1000\n[[models]]\nname = \"m\"\nmax_step_ms = 1000\ntopics = [{ name = \"t\" }]\n",
                "projector.runner_stall_ms (1000) must exceed every model's max_step_ms: model \"m\"",
            ),
            ("[database]\nlock_timeout_ms = 5\n", "database.lock_timeout_ms"),
            ("[database]\nstatement_timeout_ms = 99\n", "database.statement_timeout_ms"),
            ("[database]\nidle_in_transaction_timeout_ms = 3000000000\n", "database.idle_in_transaction_timeout_ms"),
            ("[database]\nkeepalives_idle_s = 3000000000\n", "database.keepalives_idle_s"),
            ("[[models]]\nname = \"m\"\nmax_held_bytes = 1000\ntopics = [{ name = \"t\" }]\n", "models[0].max_held_bytes"),
            ("[[models]]\nname = \"m\"\nmax_held_records = -1\ntopics = [{ name = \"t\" }]\n", "max_held_records"),
            ("[[models]]\nname = \"m\"\ntopics = [{ name = \"t\" }]\n[[models]]\nname = \"m\"\ntopics = [{ name = \"t\" }]\n", "models[1].name"),
            ("surprise = 1\n", "surprise"),
        ];
        for (text, key) in cases {
            let err = error_of(text);
            assert!(err.contains(key), "error for {text:?} does not name {key:?}: {err}");
        }
    }

    fn env(pairs: &[(&str, &str)]) -> Env {
        pairs.iter().copied().collect()
    }

    #[test]
    fn environment_overrides_the_file() {
        let c = Config::parse_with_env(
            FULL,
            &env(&[
                (ENV_KAFKA_BOOTSTRAP, "env:1"),
                (ENV_DATABASE_URL_FALLBACK, "postgres://fallback"),
                (ENV_OWNER, "me"),
                (ENV_METRICS_ADDRESS, ""),
            ]),
        )
        .unwrap();
        assert_eq!(c.kafka.bootstrap, "env:1");
        assert_eq!(c.database_url().unwrap(), "postgres://fallback");
        assert_eq!(c.owner(), "me");
        assert_eq!(c.projector.metrics_address, "", "an empty address disables the endpoint");
        let c = Config::parse_with_env(
            FULL,
            &env(&[(ENV_DATABASE_URL, "postgres://preferred"), (ENV_DATABASE_URL_FALLBACK, "postgres://fallback")]),
        )
        .unwrap();
        assert_eq!(c.database_url().unwrap(), "postgres://preferred");
    }

    #[test]
    fn every_key_has_its_variable() {
        let c = Config::parse_with_env(
            FULL,
            &env(&[
                ("PARSLEY_DATABASE__URL", "postgres://generic"),
                ("PARSLEY_DATABASE__MAX_CONNECTIONS", "9"),
                ("PARSLEY_KAFKA__REQUEST_TIMEOUT_MS", "777"),
                ("PARSLEY_PROJECTOR__OWNER", "123"),
                ("PARSLEY_MODELS__0__MAX_STEP_MS", "40"),
                ("PARSLEY_MODELS__0__ON_REJECTED", "dead-letter"),
                ("PARSLEY_MODELS__0__TASKS", "0, 2"),
                ("PARSLEY_MODELS__0__TOPICS__1__APPLY", "replace"),
                ("PARSLEY_MODELS__0__TOPICS__0__PARTITIONER", "crc32"),
                ("PARSLEY_MODELS__0__TOPICS__1__PARTITIONER", "crc32"),
                // The generic form wins over an alias of the same key.
                (ENV_DATABASE_URL, "postgres://alias"),
                // Not configuration keys: left alone.
                ("PARSLEY_CONFIG", "x.toml"),
                ("PARSLEY_TOKEN_KEYS", "k:v"),
            ]),
        )
        .unwrap();
        assert_eq!(c.database_url().unwrap(), "postgres://generic");
        assert_eq!(c.database.max_connections, 9);
        assert_eq!(c.kafka.request_timeout_ms, 777);
        assert_eq!(c.owner(), "123", "a string key takes digits as text");
        let m = &c.models[0];
        assert_eq!((m.max_step_ms, m.on_rejected, m.tasks.clone()), (40, OnRejected::DeadLetter, Some(vec![0, 2])));
        assert_eq!(m.topics[1].apply, Apply::Replace);
        assert_eq!(m.key_partitioner(), Some(Partitioner::Crc32));
        assert_eq!(m.topics[1].initial_position, Some(InitialPosition::Earliest), "the rest of the entry stays");
        assert_eq!(m.max_step_records, 10, "keys not overridden keep the file's value");
    }

    #[test]
    fn an_empty_variable_unsets_an_optional_key() {
        let c = Config::parse_with_env(FULL, &env(&[("PARSLEY_PROJECTOR__OWNER", "")])).unwrap();
        assert_eq!(c.projector.owner, None);
        let c = Config::parse_with_env(FULL, &env(&[("PARSLEY_PROJECTOR__METRICS_ADDRESS", "")])).unwrap();
        assert_eq!(c.projector.metrics_address, "");
        // The aliases keep their own rule: a blank PARSLEY_OWNER is ignored.
        let c = Config::parse_with_env(FULL, &env(&[(ENV_OWNER, " ")])).unwrap();
        assert_eq!(c.projector.owner.as_deref(), Some("a"));
    }

    #[test]
    fn overrides_are_refused_by_name() {
        let cases: &[(&str, &str, &str)] = &[
            ("PARSLEY_KAFKA__BOOTSTRAPP", "x", "bootstrapp"),
            ("PARSLEY_KAFAK__BOOTSTRAP", "x", "kafak"),
            ("PARSLEY_DATABASE__MAX_CONNECTIONS", "many", "database.max_connections"),
            ("PARSLEY_PROJECTOR__METADATA_BUDGET", "-1", "projector.metadata_budget"),
            ("PARSLEY_MODELS__3__MAX_STEP_MS", "5", "models[3]"),
            ("PARSLEY_MODELS__0__ON_REJECTED", "skip", "on_rejected"),
            ("PARSLEY_KAFKA__BOOTSTRAP__X", "x", "kafka.bootstrap"),
            ("PARSLEY_DATABASE____URL", "x", "PARSLEY_DATABASE____URL"),
        ];
        for (var, value, key) in cases {
            let err = match Config::parse_with_env(FULL, &env(&[(var, value)])) {
                Ok(_) => panic!("{var}={value:?} was accepted"),
                Err(e) => format!("{e:#}"),
            };
            assert!(err.contains(key), "error for {var}={value:?} does not name {key:?}: {err}");
            assert!(err.contains(var), "error for {var}={value:?} does not name the variable: {err}");
        }
        // What the variable set is then validated like the file's value.
        let err = format!(
            "{:#}",
            Config::parse_with_env(FULL, &env(&[("PARSLEY_MODELS__0__MAX_STEP_MS", "0")])).unwrap_err()
        );
        assert!(err.contains("models[0].max_step_ms"), "{err}");
    }

    #[test]
    fn kafka_properties_come_from_the_file_the_environment_and_files() {
        let dir = std::env::temp_dir().join(format!("parsley-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (password, url) = (dir.join("sasl-password"), dir.join("database-url"));
        std::fs::write(&password, "hunter2\n").unwrap();
        std::fs::write(&url, "postgres://u:from-file@h/db?sslmode=verify-full\r\n").unwrap();
        let (password, url) = (password.to_str().unwrap(), url.to_str().unwrap());
        let file = "[kafka.properties]\n\"security.protocol\" = \"sasl_ssl\"\n";
        let c = Config::parse_with_env(
            file,
            &env(&[
                ("PARSLEY_KAFKA__PROPERTIES__SASL_MECHANISM", "SCRAM-SHA-256"),
                ("PARSLEY_KAFKA__PROPERTIES__SSL_CA_LOCATION", "/ca.pem"),
                ("PARSLEY_KAFKA__PROPERTIES__LOG_LEVEL", "6"),
                ("PARSLEY_KAFKA__PROPERTY_FILES__SASL_PASSWORD", password),
                ("PARSLEY_KAFKA__CONSUMER__FETCH_WAIT_MAX_MS", "20"),
                (ENV_DATABASE_URL_FILE, url),
                // The conventional variable yields to a URL file.
                (ENV_DATABASE_URL_FALLBACK, "postgres://ignored"),
            ]),
        )
        .unwrap();
        let cluster = c.kafka.cluster();
        let property = |name: &str| cluster.properties.get(name).map(String::as_str);
        assert_eq!(property("security.protocol"), Some("sasl_ssl"));
        assert_eq!(property("sasl.mechanism"), Some("SCRAM-SHA-256"));
        assert_eq!(property("ssl.ca.location"), Some("/ca.pem"));
        assert_eq!(property("log_level"), Some("6"), "an underscored property keeps its name");
        assert_eq!(property("sasl.password"), Some("hunter2"), "read from the file, line end dropped");
        assert_eq!(c.kafka.consumer.get("fetch.wait.max.ms").map(String::as_str), Some("20"));
        assert_eq!(c.database_url().unwrap(), "postgres://u:from-file@h/db?sslmode=verify-full");
        let printed = format!("{c:?}");
        assert!(
            !printed.contains("hunter2") && !printed.contains("from-file") && printed.contains("sasl_ssl"),
            "{printed}"
        );

        // A file's value and the same property in the table; a fixed property; two URLs.
        let refused = |text: &str, pairs: &[(&str, &str)]| match Config::parse_with_env(text, &env(pairs)) {
            Ok(_) => panic!("{text:?} with {pairs:?} was accepted"),
            Err(e) => format!("{e:#}"),
        };
        let err = refused(file, &[("PARSLEY_KAFKA__PROPERTY_FILES__SECURITY_PROTOCOL", password)]);
        assert!(err.contains("kafka.properties.\"security.protocol\" and kafka.property_files"), "{err}");
        let err = refused("", &[("PARSLEY_KAFKA__PROPERTIES__ENABLE_IDEMPOTENCE", "false")]);
        assert!(err.contains("kafka.properties.\"enable.idempotence\" is fixed"), "{err}");
        let err = refused("", &[(ENV_DATABASE_URL, "postgres://a"), (ENV_DATABASE_URL_FILE, url)]);
        assert!(err.contains(ENV_DATABASE_URL) && err.contains(ENV_DATABASE_URL_FILE), "{err}");
        // A variable setting one of the two replaces the other from the file.
        let c =
            Config::parse_with_env("[database]\nurl = \"postgres://file\"\n", &env(&[(ENV_DATABASE_URL_FILE, url)]))
                .unwrap();
        assert!(c.database_url().unwrap().contains("from-file"));
        let c = Config::parse_with_env(
            &format!("[database]\nurl_file = {url:?}\n"),
            &env(&[("PARSLEY_DATABASE__URL", "postgres://env")]),
        )
        .unwrap();
        assert_eq!(c.database_url().unwrap(), "postgres://env");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_topic_s_schema_is_read_and_compiled_at_load_and_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("parsley-config-schema-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path.display().to_string()
        };
        let order = write("order.json", r#"{"type": "object", "required": ["order"]}"#);
        let same = write("same.json", r#"{"type": "object", "required": ["order"]}"#);
        let other = write("other.json", r#"{"type": "object"}"#);
        let not_json = write("not-json.json", "{");
        let not_schema = write("not-schema.json", r#"{"type": 7}"#);
        let missing = dir.join("missing.json").display().to_string();
        let file = |orders: &str, second: Option<&str>| {
            let mut text =
                format!("[[models]]\nname = \"a\"\n[[models.topics]]\nname = \"orders\"\nschema = {orders:?}\n");
            if let Some(path) = second {
                text.push_str(&format!(
                    "[[models]]\nname = \"b\"\n[[models.topics]]\nname = \"orders\"\nschema = {path:?}\n"
                ));
            }
            text
        };
        let c = Config::parse(&file(&order, Some(&same))).unwrap();
        let contract = c.models[0].topics[0].contract.as_ref().expect("compiled at load");
        assert_eq!(contract.path(), order);
        assert!(!contract.is_valid(&serde_json::json!({})));
        assert_eq!(c.contract("orders").map(|c| c.path()), Some(order.as_str()));
        assert_eq!(c.contract("payments"), None);
        let refused = |text: &str| format!("{:#}", Config::parse(text).unwrap_err());
        for (path, says) in [
            (&missing, "reading the schema file"),
            (&not_json, "is not JSON"),
            (&not_schema, "not a valid draft 2020-12 schema"),
        ] {
            let err = refused(&file(path, None));
            assert!(
                err.contains("models[0].topics[0].schema") && err.contains(path.as_str()) && err.contains(says),
                "{err}"
            );
        }
        let err = refused(&file(&order, Some(&other)));
        assert!(err.contains("different schemas") && err.contains("models[1].topics[0].schema"), "{err}");
        // Programmatic: loaded by with_schema, refused when only named.
        let mut c = Config::parse("").unwrap();
        c.models.push(ModelConfig::new("m", vec![TopicConfig::named("orders").with_schema(&order).unwrap()]));
        c.validate().unwrap();
        c.models[0].topics[0].contract = None;
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("was not read"));
        assert!(TopicConfig::named("orders").with_schema(&missing).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_database_url_is_never_printed() {
        let c = Config::parse(FULL).unwrap();
        assert_eq!(c.database_url().unwrap(), "postgres://u:p@h/db");
        let printed = format!("{c:?}");
        assert!(!printed.contains("u:p@h") && printed.contains("***"), "{printed}");
    }

    #[test]
    fn a_missing_database_url_names_the_key() {
        let c = Config::parse("").unwrap();
        let err = c.database_url().unwrap_err().to_string();
        assert!(err.contains("database.url") && err.contains(ENV_DATABASE_URL), "{err}");
    }
}
