//! The gateway's settings: the `[gateway]` table of the shared TOML file (parsed strictly:
//! unknown keys are refused), then environment overrides, then the token keys — which come
//! only from the environment or from a file, never from the shared file, and are never
//! printed.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use axum::http::HeaderName;
use parsley_settings::config::{Config, GATEWAY_SECTION};
use parsley_settings::overrides::{self, Env};
use serde::Deserialize;

use crate::access::{Access, Known, RuleSettings};
use crate::identity::{AuthSettings, Verifier};
use crate::keys::{self, KeySource, TokenKeys};
use crate::token::{KeyRing, TokenLimits, Validity};

/// The older variable names of `[gateway]` keys, kept as aliases by the one override rule
/// ([`parsley_settings::overrides`]): every key is also `PARSLEY_GATEWAY__<KEY>`.
pub use parsley_settings::overrides::{
    ENV_GATEWAY_ADMIN_LISTEN as ENV_ADMIN_LISTEN, ENV_GATEWAY_LISTEN as ENV_LISTEN,
    ENV_GATEWAY_READ_WAIT_MS as ENV_READ_WAIT_MS, ENV_GATEWAY_RETRY_AFTER_S as ENV_RETRY_AFTER_S,
    ENV_GATEWAY_SUBJECT_HEADER as ENV_SUBJECT_HEADER, ENV_GATEWAY_TOKEN_TTL_S as ENV_TOKEN_TTL_S, ENV_TOKEN_KEYS_FILE,
};
/// The admin bearer token itself (overrides `gateway.admin_token_file`).
pub const ENV_ADMIN_TOKEN: &str = "PARSLEY_GATEWAY_ADMIN_TOKEN";
pub use crate::keys::ENV_TOKEN_KEYS;

/// The `[gateway]` table. Every key has a default; `docs/configuration.md` and
/// `docs/gateway.md` list them.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// Address the HTTP server binds.
    pub listen: String,
    /// How long a read waits for the projector to cover the session before answering 503.
    pub read_wait_ms: u64,
    /// How often a waiting read re-checks even without a notification (notifications can be
    /// lost while the listener reconnects).
    pub recheck_ms: u64,
    /// The `Retry-After` of a 503, in seconds.
    pub retry_after_s: u64,
    /// Lifetime of a token from its last use, in seconds.
    pub token_ttl_s: u64,
    /// Longest a session may last from its first token (`issuedAt`), however often it is
    /// used, in seconds; beyond it `400 token-too-old`.
    pub token_max_age_s: u64,
    /// Leeway for the clocks of the gateways of a fleet (and of a JWT's issuer), in
    /// seconds: a token is accepted this long past its expiry and its maximum age, and a
    /// JWT this long past `exp` and before `nbf`.
    pub token_clock_skew_s: u64,
    /// How often the token keys file is checked for a change and re-read, in milliseconds
    /// (0: only on `SIGHUP`).
    pub token_keys_reload_ms: u64,
    /// Longest client form of a token accepted, in characters.
    pub token_max_encoded_len: usize,
    /// Most channels a token may name.
    pub token_max_entries: usize,
    /// Most `Parsley-Session` tokens one request may carry (repeated headers or a comma
    /// list): the gateway answers their join. Beyond it `400 too-many-tokens`.
    pub token_max_per_request: usize,
    /// Largest `parsley.causes` value the gateway stamps on a write, in bytes.
    pub metadata_budget: usize,
    /// Who may call the data routes: `"rules"` (the default with `[gateway.auth]`: a
    /// verified bearer JWT, and a `[[gateway.rules]]` entry allowing the request) or
    /// `"open"` (anyone; logged at WARN at every start). One of the two must be chosen.
    pub access: Option<AccessMode>,
    /// `[gateway.auth]`: authentication by bearer JWTs (issuer, audience, where the keys are).
    pub auth: Option<AuthSettings>,
    /// `[[gateway.rules]]`: the authorization rules (with `access = "rules"`).
    pub rules: Vec<RuleSettings>,
    /// Which role named queries run under: `"auto"` (each model's read role,
    /// `parsley_query_<model>`, when it exists and the gateway may take it; else the
    /// gateway's own, logged at WARN), `"required"` (the read role, or the gateway refuses to
    /// start naming the model) or `"off"` (the gateway's own role).
    pub query_roles: QueryRoles,
    /// With open access, a request header carrying the authenticated subject a token is
    /// bound to (set by an authenticating proxy, which must overwrite any value a client
    /// sent). Absent: tokens are not bound to a subject.
    pub subject_header: Option<String>,
    /// Moved to `[gateway.auth]` (`hs256_secret_file`); refused with a message saying so.
    pub subject_jwt_secret_file: Option<PathBuf>,
    /// Moved to `gateway.auth.issuer`.
    pub subject_jwt_issuer: Option<String>,
    /// Moved to `gateway.auth.audience`.
    pub subject_jwt_audience: Option<String>,
    /// File holding the token keys (`id:base64key[:seal|:open],...`).
    pub token_keys_file: Option<PathBuf>,
    /// Whether a `503 not-yet-covered` on the main listener carries the free-text diagnosis
    /// of a refused task and the last error of a failing one (the reason names, the task
    /// numbers and the gaps are always there; `/v1/status` on the admin listener always has
    /// everything).
    pub public_diagnostics: bool,
    /// How long a write waits for the broker's acknowledgement.
    pub produce_timeout_ms: u64,
    /// Timeout of metadata and offset queries to Kafka.
    pub kafka_timeout_ms: u64,
    /// How often the topic metadata cache refreshes the topics it knows.
    pub metadata_refresh_ms: u64,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// The response timeout: how long the gateway may take to answer a whole request (a
    /// read's wait included) before `503 request-timeout`. Formerly `request_timeout_ms`, a
    /// name still accepted, which also meant the broker's request timeout in `[kafka]`.
    #[serde(alias = "request_timeout_ms")]
    pub response_timeout_ms: u64,
    /// Most HTTP connections the main listener holds open at once; beyond it, new
    /// connections wait in the listening socket's accept queue. Until the name's former
    /// meaning (the pool size, now `database_max_connections`) is gone from every file, it
    /// is refused unless `database_max_connections` is set too ([`Settings::validate`]).
    /// Absent: [`DEFAULT_MAX_CONNECTIONS`].
    pub max_connections: Option<usize>,
    /// Postgres connections of the gateway's pool (formerly `gateway.max_connections`).
    /// Absent: [`DEFAULT_DATABASE_MAX_CONNECTIONS`].
    pub database_max_connections: Option<u32>,
    /// Postgres connections of the named queries' own pool: slow queries wait for one of
    /// these, never for the document reads' connections.
    pub query_max_connections: u32,
    /// How long a request's body may take to arrive in full, from the end of its headers,
    /// before `408 body-timeout` (the connection is closed). A body is received before the
    /// request takes an in-flight permit.
    pub body_timeout_ms: u64,
    /// Longest record key a write may carry (and a read may ask for), in bytes of UTF-8.
    pub max_key_bytes: usize,
    /// How long a client may take to send a request's headers before the connection closes.
    pub header_read_timeout_ms: u64,
    /// Largest request line plus headers accepted (`431` beyond), in bytes.
    pub max_header_bytes: usize,
    /// Most requests handled at once; beyond it a request is answered `503 overloaded` at once.
    pub max_in_flight: usize,
    /// Most reads of one model waiting for coverage at once; beyond it a read not covered at
    /// its first attempt is answered `503 overloaded` at once.
    pub max_waiting_reads: usize,
    /// Memory for covered document snapshots (single keys and pages) kept between reads, in bytes over all models
    /// (each model gets an even share); default 64 MiB; 0: off, every read asks Postgres. A kept
    /// snapshot serves a read only if its own clock rows cover the session, and only until
    /// the gateway hears the next notification of its key's owner task or of its model — so
    /// a change made outside a step (a rebuild, a shape change, a document edited by hand)
    /// notifies too; a read served from memory first waits for a barrier on the listener's
    /// connection, so it never misses a change committed before it arrived (see
    /// `docs/gateway.md`, "Kept snapshots").
    pub read_cache_bytes: usize,
    /// The longest a kept snapshot is served, in milliseconds, notifications or not (for
    /// a notification lost without the listener noticing); 0: nothing is kept.
    pub read_cache_max_age_ms: u64,
    /// Address of the admin listener (`/v1/status`, `/metrics`); empty: none.
    pub admin_listen: String,
    /// File holding the admin bearer token; with one, the main listener serves the admin
    /// routes to requests bearing it.
    pub admin_token_file: Option<PathBuf>,
    /// Origins browser apps may call the gateway from (`https://app.example.com`, or `*`
    /// for any); empty: no CORS headers at all.
    pub cors_allowed_origins: Vec<String>,
    /// How long a write's `Idempotency-Key` is remembered, in seconds: a retry with the same
    /// key and body within it answers the first acknowledgement without writing again.
    pub idempotency_window_s: u64,
    /// Most records one batch write (`POST /v1/records`) may carry.
    pub max_batch_records: usize,
    /// The gateway's OTLP endpoint, replacing `telemetry.otlp_endpoint` (the rest of the
    /// export's settings are `[telemetry]`'s); absent: that one.
    pub otlp_endpoint: Option<String>,
    /// How often the background checks probe the database, the migrations and Kafka for
    /// `/readyz` (which answers from their cache), in milliseconds.
    pub readiness_check_ms: u64,
    /// Consecutive failed checks before a required dependency that was up counts as down
    /// (`/readyz` 503): one failed check is a blip.
    pub readiness_failures: u32,
    /// After SIGTERM, how long the gateway keeps serving while `/readyz` answers `503
    /// draining`, before it stops accepting and drains, in milliseconds.
    pub shutdown_grace_ms: u64,
}

/// The most `max_key_bytes` may be: a document key is indexed by a btree (with the model's
/// name), whose entries Postgres bounds at about 2700 bytes.
pub const MAX_KEY_BYTES_LIMIT: usize = 2048;

/// The longest an idempotency key is remembered: a week.
pub const MAX_IDEMPOTENCY_WINDOW_S: u64 = 7 * 86_400;

/// The most records one batch may carry (one Kafka transaction).
pub const MAX_BATCH_RECORDS_LIMIT: usize = 1_000;

/// `gateway.max_connections` when unset: HTTP connections of the main listener.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// `gateway.database_max_connections` when unset: the gateway's Postgres pool.
pub const DEFAULT_DATABASE_MAX_CONNECTIONS: u32 = 16;

/// `gateway.token_max_per_request` when unset: the tokens a request may join.
pub const DEFAULT_TOKEN_MAX_PER_REQUEST: usize = 16;

/// Largest `gateway.token_max_per_request`: each token is opened (decrypted, decoded) on
/// every request that carries it.
pub const MAX_TOKEN_MAX_PER_REQUEST: usize = 64;

/// `gateway.query_max_connections` when unset: the named queries' own pool.
pub const DEFAULT_QUERY_MAX_CONNECTIONS: u32 = 4;

/// `gateway.read_cache_bytes` when unset: 64 MiB for kept snapshots over all models.
pub const DEFAULT_READ_CACHE_BYTES: usize = 64 << 20;

impl Default for Settings {
    fn default() -> Self {
        let limits = TokenLimits::default();
        Settings {
            listen: "127.0.0.1:8080".to_string(),
            read_wait_ms: 2_000,
            recheck_ms: 250,
            retry_after_s: 1,
            token_ttl_s: 3_600,
            token_max_age_s: 86_400,
            token_clock_skew_s: 30,
            token_keys_reload_ms: 10_000,
            token_max_encoded_len: limits.max_encoded_len,
            token_max_entries: limits.max_entries,
            token_max_per_request: DEFAULT_TOKEN_MAX_PER_REQUEST,
            metadata_budget: parsley::codec::DEFAULT_METADATA_BUDGET,
            access: None,
            auth: None,
            rules: Vec::new(),
            query_roles: QueryRoles::Auto,
            subject_header: None,
            subject_jwt_secret_file: None,
            subject_jwt_issuer: None,
            subject_jwt_audience: None,
            token_keys_file: None,
            public_diagnostics: false,
            produce_timeout_ms: 10_000,
            kafka_timeout_ms: 5_000,
            metadata_refresh_ms: 60_000,
            max_body_bytes: 1024 * 1024,
            response_timeout_ms: 30_000,
            max_connections: None,
            database_max_connections: None,
            query_max_connections: DEFAULT_QUERY_MAX_CONNECTIONS,
            body_timeout_ms: 10_000,
            max_key_bytes: 1024,
            header_read_timeout_ms: 10_000,
            max_header_bytes: 32 * 1024,
            max_in_flight: 1024,
            max_waiting_reads: 256,
            read_cache_bytes: DEFAULT_READ_CACHE_BYTES,
            read_cache_max_age_ms: 1_000,
            admin_listen: "127.0.0.1:9091".to_string(),
            admin_token_file: None,
            cors_allowed_origins: Vec::new(),
            idempotency_window_s: 86_400,
            max_batch_records: 100,
            otlp_endpoint: None,
            readiness_check_ms: 1_000,
            readiness_failures: 2,
            shutdown_grace_ms: 5_000,
        }
    }
}

impl Settings {
    /// Parses the `[gateway]` table (absent: all defaults). Unknown keys are refused.
    pub fn from_table(table: Option<&toml::Table>) -> anyhow::Result<Settings> {
        let settings = match table {
            None => Settings::default(),
            Some(t) => Settings::deserialize(toml::Value::Table(t.clone()))
                .map_err(|e| anyhow::anyhow!("invalid [gateway] table: {e}"))?,
        };
        Ok(settings)
    }

    /// Parses the `[gateway]` table with the overrides `env` holds for it applied: the one
    /// rule of every key ([`parsley_settings::overrides`]: `PARSLEY_GATEWAY__<KEY>`, and the older
    /// names above). Unknown keys are refused, naming the variable that set one.
    pub fn from_table_with_env(table: Option<&toml::Table>, env: &Env) -> anyhow::Result<Settings> {
        match overrides::section(GATEWAY_SECTION, table, env) {
            Ok(Some(settings)) => Ok(settings),
            Ok(None) => Settings::from_table(table),
            Err(e) => Err(anyhow::anyhow!("invalid [gateway] table: {e}")),
        }
    }

    /// Checks what serde cannot; every message names the key.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.listen.parse::<SocketAddr>().is_err() {
            bail!("gateway.listen {:?} is not an address like 127.0.0.1:8080", self.listen);
        }
        if self.read_wait_ms > 60_000 {
            bail!("gateway.read_wait_ms must be at most 60000 (a read holds a connection while it waits)");
        }
        if self.recheck_ms == 0 {
            bail!("gateway.recheck_ms must be at least 1");
        }
        if self.retry_after_s == 0 {
            bail!("gateway.retry_after_s must be at least 1");
        }
        if self.token_ttl_s == 0 {
            bail!("gateway.token_ttl_s must be at least 1");
        }
        if self.token_max_age_s == 0 {
            bail!("gateway.token_max_age_s must be at least 1");
        }
        if self.token_clock_skew_s > MAX_CLOCK_SKEW_S {
            bail!("gateway.token_clock_skew_s must be at most {MAX_CLOCK_SKEW_S} (fix the clocks instead)");
        }
        if self.subject_jwt_secret_file.is_some()
            || self.subject_jwt_issuer.is_some()
            || self.subject_jwt_audience.is_some()
        {
            bail!(
                "gateway.subject_jwt_secret_file, subject_jwt_issuer and subject_jwt_audience moved to [gateway.auth] \
                 (hs256_secret_file, issuer, audience), which also takes a JWKS URL or file"
            );
        }
        match (self.access, &self.auth) {
            (Some(AccessMode::Open), Some(_)) => bail!(
                "gateway.access = \"open\" cannot go with [gateway.auth]: with authentication on, the rules decide \
                 (a rule with no conditions allows every signed-in caller)"
            ),
            (Some(AccessMode::Rules), None) => {
                bail!("gateway.access = \"rules\" needs [gateway.auth] (who the callers are)")
            }
            (None, None) => bail!(
                "choose who may call the gateway: configure [gateway.auth] and [[gateway.rules]] \
                 (docs/gateway.md, \"Authorization\"), or set gateway.access = \"open\" to serve every caller"
            ),
            _ => {}
        }
        if let Some(auth) = &self.auth {
            auth.validate()?;
            if self.subject_header.is_some() {
                bail!("gateway.subject_header goes with open access: with [gateway.auth] the subject is the JWT's sub");
            }
        }
        if self.access_mode() == AccessMode::Open && !self.rules.is_empty() {
            bail!("[[gateway.rules]] need authentication ([gateway.auth]); with gateway.access = \"open\" nothing is checked");
        }
        if self.token_max_encoded_len < 64 {
            bail!("gateway.token_max_encoded_len must be at least 64");
        }
        if self.token_max_entries == 0 {
            bail!("gateway.token_max_entries must be at least 1");
        }
        if !(1..=MAX_TOKEN_MAX_PER_REQUEST).contains(&self.token_max_per_request) {
            bail!("gateway.token_max_per_request must be from 1 to {MAX_TOKEN_MAX_PER_REQUEST}");
        }
        if self.metadata_budget < 16 {
            bail!("gateway.metadata_budget must be at least 16 bytes");
        }
        if let Some(h) = &self.subject_header {
            if HeaderName::try_from(h.as_str()).is_err() {
                bail!("gateway.subject_header {h:?} is not an HTTP header name");
            }
        }
        if self.produce_timeout_ms == 0 || self.kafka_timeout_ms == 0 {
            bail!("gateway.produce_timeout_ms and gateway.kafka_timeout_ms must be at least 1");
        }
        if self.metadata_refresh_ms < 1_000 {
            bail!("gateway.metadata_refresh_ms must be at least 1000");
        }
        if !(100..=60_000).contains(&self.readiness_check_ms) {
            bail!("gateway.readiness_check_ms must be from 100 to 60000, not {}", self.readiness_check_ms);
        }
        if !(1..=100).contains(&self.readiness_failures) {
            bail!("gateway.readiness_failures must be from 1 to 100, not {}", self.readiness_failures);
        }
        if self.shutdown_grace_ms > 600_000 {
            bail!(
                "gateway.shutdown_grace_ms must be at most 600000 (10 minutes), not {}: an orchestrator kills a \
                 process that takes longer to stop",
                self.shutdown_grace_ms
            );
        }
        if self.max_body_bytes == 0 {
            bail!("gateway.max_body_bytes must be at least 1");
        }
        if self.response_timeout_ms <= self.read_wait_ms {
            bail!(
                "gateway.response_timeout_ms (formerly gateway.request_timeout_ms) must be longer than \
                 gateway.read_wait_ms"
            );
        }
        if self.max_connections.is_some() && self.database_max_connections.is_none() {
            bail!(
                "gateway.max_connections is now the cap on HTTP connections; the Postgres pool it used to size is \
                 gateway.database_max_connections. Set gateway.database_max_connections too (default \
                 {DEFAULT_DATABASE_MAX_CONNECTIONS}), so that a file written for the old meaning is not read with \
                 the new one"
            );
        }
        if self.max_connections == Some(0) {
            bail!("gateway.max_connections must be at least 1");
        }
        if self.query_max_connections == 0 {
            bail!("gateway.query_max_connections must be at least 1");
        }
        if self.database_max_connections == Some(0) {
            bail!("gateway.database_max_connections must be at least 1");
        }
        if self.body_timeout_ms == 0 {
            bail!("gateway.body_timeout_ms must be at least 1");
        }
        if !(1..=MAX_KEY_BYTES_LIMIT).contains(&self.max_key_bytes) {
            bail!(
                "gateway.max_key_bytes must be from 1 to {MAX_KEY_BYTES_LIMIT} \
                 (document keys are indexed, and an index entry holds about 2700 bytes)"
            );
        }
        if self.header_read_timeout_ms == 0 {
            bail!("gateway.header_read_timeout_ms must be at least 1");
        }
        if !(MIN_HEADER_BYTES..=MAX_HEADER_BYTES_LIMIT).contains(&self.max_header_bytes) {
            bail!("gateway.max_header_bytes must be from {MIN_HEADER_BYTES} to {MAX_HEADER_BYTES_LIMIT}");
        }
        if self.max_in_flight == 0 {
            bail!("gateway.max_in_flight must be at least 1");
        }
        if self.max_waiting_reads == 0 {
            bail!("gateway.max_waiting_reads must be at least 1");
        }
        if self.read_cache_max_age_ms > 60_000 {
            bail!("gateway.read_cache_max_age_ms must be at most 60000 (0 keeps nothing)");
        }
        for origin in &self.cors_allowed_origins {
            check_origin(origin).map_err(|e| anyhow::anyhow!("gateway.cors_allowed_origins: {e}"))?;
        }
        if !(1..=MAX_BATCH_RECORDS_LIMIT).contains(&self.max_batch_records) {
            bail!("gateway.max_batch_records must be from 1 to {MAX_BATCH_RECORDS_LIMIT}");
        }
        if !(60..=MAX_IDEMPOTENCY_WINDOW_S).contains(&self.idempotency_window_s) {
            bail!("gateway.idempotency_window_s must be from 60 to {MAX_IDEMPOTENCY_WINDOW_S} (7 days)");
        }
        if !self.admin_listen.is_empty() {
            let admin: SocketAddr = self.admin_listen.parse().map_err(|_| {
                anyhow::anyhow!(
                    "gateway.admin_listen {:?} is not an address like 127.0.0.1:9091 (or empty for none)",
                    self.admin_listen
                )
            })?;
            if self.listen.parse::<SocketAddr>().is_ok_and(|main| main == admin && main.port() != 0) {
                bail!("gateway.admin_listen must differ from gateway.listen");
            }
        }
        Ok(())
    }

    /// The access mode in force (validated: chosen, or implied by `[gateway.auth]`).
    pub fn access_mode(&self) -> AccessMode {
        match (self.access, &self.auth) {
            (Some(mode), _) => mode,
            (None, Some(_)) => AccessMode::Rules,
            (None, None) => AccessMode::Open,
        }
    }

    pub fn limits(&self) -> TokenLimits {
        TokenLimits { max_encoded_len: self.token_max_encoded_len, max_entries: self.token_max_entries }
    }
    /// How long a session lives, and the clocks' leeway.
    pub fn validity(&self) -> Validity {
        Validity { max_age_s: Some(self.token_max_age_s), clock_skew_s: self.token_clock_skew_s }
    }
    pub fn token_keys_reload(&self) -> Duration {
        Duration::from_millis(self.token_keys_reload_ms)
    }
    pub fn read_wait(&self) -> Duration {
        Duration::from_millis(self.read_wait_ms)
    }
    pub fn recheck(&self) -> Duration {
        Duration::from_millis(self.recheck_ms)
    }
    pub fn produce_timeout(&self) -> Duration {
        Duration::from_millis(self.produce_timeout_ms)
    }
    pub fn kafka_timeout(&self) -> Duration {
        Duration::from_millis(self.kafka_timeout_ms)
    }
    pub fn metadata_refresh(&self) -> Duration {
        Duration::from_millis(self.metadata_refresh_ms)
    }
    pub fn readiness_check(&self) -> Duration {
        Duration::from_millis(self.readiness_check_ms)
    }
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }
    /// How long the background checks may go without completing a round before `/livez`
    /// fails: three rounds, each bounded by its checks' timeouts.
    pub fn readiness_stall(&self, acquire_timeout: Duration) -> Duration {
        (self.readiness_check() + self.kafka_timeout() + acquire_timeout * 2) * 3
    }
    pub fn response_timeout(&self) -> Duration {
        Duration::from_millis(self.response_timeout_ms)
    }
    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }
    pub fn body_timeout(&self) -> Duration {
        Duration::from_millis(self.body_timeout_ms)
    }
    /// `gateway.max_connections`, or its default.
    pub fn http_connections_cap(&self) -> usize {
        self.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS)
    }
    /// `gateway.database_max_connections`, or its default.
    pub fn database_pool_size(&self) -> u32 {
        self.database_max_connections.unwrap_or(DEFAULT_DATABASE_MAX_CONNECTIONS)
    }
}

/// `gateway.query_roles`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum QueryRoles {
    Auto,
    Required,
    Off,
}

/// `gateway.access`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum AccessMode {
    /// A verified bearer JWT and an allowing rule on every data route.
    Rules,
    /// Every data route open to anyone.
    Open,
}

impl AccessMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AccessMode::Rules => "rules",
            AccessMode::Open => "open",
        }
    }
}

/// The most `token_clock_skew_s` may be: a leeway, not a second lifetime.
pub const MAX_CLOCK_SKEW_S: u64 = 300;

/// The least and the most `max_header_bytes` may be (hyper's read buffer holds about
/// 400 KiB). It should exceed `token_max_encoded_len` by the other headers' size, or long
/// sessions are answered 431.
pub const MIN_HEADER_BYTES: usize = 4096;
pub const MAX_HEADER_BYTES_LIMIT: usize = 256 * 1024;

/// The admin bearer token. Never printed.
#[derive(Clone)]
pub struct AdminToken(String);

/// Shortest admin token accepted, in characters.
pub const MIN_ADMIN_TOKEN_LEN: usize = 16;

impl AdminToken {
    /// A token of visible ASCII (it travels in a header), at least [`MIN_ADMIN_TOKEN_LEN`]
    /// characters. Errors never quote it.
    pub fn new(text: &str) -> anyhow::Result<AdminToken> {
        let text = text.trim();
        if text.len() < MIN_ADMIN_TOKEN_LEN || !text.bytes().all(|b| b.is_ascii_graphic()) {
            bail!("the admin token must be at least {MIN_ADMIN_TOKEN_LEN} characters of visible ASCII");
        }
        Ok(AdminToken(text.to_string()))
    }

    /// Whether `offered` is this token, compared in time independent of where they differ.
    pub fn matches(&self, offered: &[u8]) -> bool {
        constant_time_eq(self.0.as_bytes(), offered)
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

/// Compares every byte whatever the first difference (the length is not secret).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Everything the gateway is configured with.
#[derive(Clone)]
pub struct GatewayConfig {
    /// The shared file: Kafka, database, the models (whose topics the gateway writes to and
    /// whose documents it serves).
    pub shared: Config,
    pub settings: Settings,
    /// The token key ring in use, shared by every clone (a reload is seen by all); never
    /// printed (only key ids and roles are).
    pub keys: Arc<TokenKeys>,
    /// The admin bearer token, if one is configured (never printed).
    pub admin_token: Option<AdminToken>,
    /// With authentication on, the bearer JWT checker (its keys never printed).
    pub verifier: Option<Arc<Verifier>>,
    /// The authorization rules in force (open access: none).
    pub access: Arc<Access>,
}

impl std::fmt::Debug for GatewayConfig {
    /// The database URL may hold a password and the keys are secret: neither is printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let models: Vec<&str> = self.shared.models.iter().map(|m| m.name.as_str()).collect();
        f.debug_struct("GatewayConfig")
            .field("kafka.bootstrap", &self.shared.kafka.bootstrap)
            .field("database.url", &self.shared.database.url.as_ref().map(|u| parsley_infra::pg::redact(u.expose())))
            .field("models", &models)
            .field("settings", &self.settings)
            .field("keys", &self.keys)
            .field("admin_token", &self.admin_token)
            .field("verifier", &self.verifier)
            .field("access", &self.settings.access_mode())
            .finish()
    }
}

impl GatewayConfig {
    /// Reads `path`, applies the environment overrides to both the shared settings and the
    /// gateway's, validates, and loads the token keys.
    pub fn load(path: &Path) -> anyhow::Result<GatewayConfig> {
        let shared = Config::load(path)?;
        let env = Env::process();
        // Every override of `[gateway]` is read here, so that a misspelt key's variable is
        // refused; `from_shared` looks the known ones up by name.
        Settings::from_table_with_env(shared.gateway.as_ref(), &env)
            .with_context(|| format!("invalid configuration in {}", path.display()))?;
        GatewayConfig::from_shared(shared, |name| env.get(name).map(str::to_string))
            .with_context(|| format!("invalid configuration in {}", path.display()))
    }

    /// The gateway's part of an already loaded shared configuration with the given keys
    /// (never reloaded) and no environment overrides (tests, embedding).
    pub fn with_keys(shared: Config, keys: KeyRing) -> anyhow::Result<GatewayConfig> {
        let settings = Settings::from_table(shared.gateway.as_ref())?;
        settings.validate()?;
        let (verifier, access) = load_access(&shared, &settings)?;
        shared.telemetry.export(settings.otlp_endpoint.as_deref(), "gateway.otlp_endpoint")?;
        Ok(GatewayConfig {
            shared,
            settings,
            keys: Arc::new(TokenKeys::given(keys)),
            admin_token: None,
            verifier,
            access,
        })
    }

    /// The gateway's part of an already loaded shared configuration, with environment
    /// variables read through `var`.
    pub fn from_shared(shared: Config, var: impl Fn(&str) -> Option<String>) -> anyhow::Result<GatewayConfig> {
        let env = Env::lookup(overrides::section_variables::<Settings>(GATEWAY_SECTION), &var);
        let settings = Settings::from_table_with_env(shared.gateway.as_ref(), &env)?;
        settings.validate()?;
        let keys = Arc::new(load_keys(&settings, &var)?);
        let admin_token = load_admin_token(&settings, &var)?;
        let (verifier, access) = load_access(&shared, &settings)?;
        shared.telemetry.export(settings.otlp_endpoint.as_deref(), "gateway.otlp_endpoint")?;
        Ok(GatewayConfig { shared, settings, keys, admin_token, verifier, access })
    }

    /// The gateway's OTLP export (`gateway.otlp_endpoint`, else `telemetry.otlp_endpoint`,
    /// with `[telemetry]`'s settings); `None`: nothing is exported. Checked at load.
    pub fn telemetry_export(&self) -> anyhow::Result<Option<parsley_infra::telemetry::Export>> {
        self.shared.telemetry.export(self.settings.otlp_endpoint.as_deref(), "gateway.otlp_endpoint")
    }
}

/// With `[gateway.auth]`, the bearer JWT checker (a key file is read now; a JWKS URL is
/// fetched by the background task), and the rules checked against the configured models.
pub fn load_access(shared: &Config, settings: &Settings) -> anyhow::Result<(Option<Arc<Verifier>>, Arc<Access>)> {
    let verifier = match &settings.auth {
        None => None,
        Some(auth) => Some(Arc::new(Verifier::new(auth, settings.token_clock_skew_s).context("gateway.auth")?)),
    };
    let access = match settings.access_mode() {
        AccessMode::Open => Access::open(),
        AccessMode::Rules => {
            let topics = shared.models.iter().flat_map(|m| m.topics.iter().map(|t| t.name.clone())).collect();
            let known = Known {
                topics: &topics,
                models: shared
                    .models
                    .iter()
                    .map(|m| {
                        let queries = m
                            .queries
                            .iter()
                            .map(|q| (q.name.as_str(), q.params.keys().map(String::as_str).collect()))
                            .collect();
                        (m.name.as_str(), queries)
                    })
                    .collect(),
            };
            Access::rules(&settings.rules, &known)?
        }
    };
    Ok((verifier, Arc::new(access)))
}

/// The admin bearer token: `PARSLEY_GATEWAY_ADMIN_TOKEN`, else the file named by
/// `gateway.admin_token_file`, else none. Errors never quote it.
pub fn load_admin_token(
    settings: &Settings,
    var: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<Option<AdminToken>> {
    if let Some(text) = var(ENV_ADMIN_TOKEN).filter(|v| !v.trim().is_empty()) {
        return AdminToken::new(&text).map(Some).with_context(|| format!("{ENV_ADMIN_TOKEN} is invalid"));
    }
    match &settings.admin_token_file {
        None => Ok(None),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the admin token file {}", path.display()))?;
            AdminToken::new(&text)
                .map(Some)
                .with_context(|| format!("the admin token file {} is invalid", path.display()))
        }
    }
}

/// The token keys: `PARSLEY_TOKEN_KEYS` (not reloadable), else the file named by
/// `PARSLEY_TOKEN_KEYS_FILE` or `gateway.token_keys_file` (reloadable). Errors never quote a
/// key.
pub fn load_keys(settings: &Settings, var: impl Fn(&str) -> Option<String>) -> anyhow::Result<TokenKeys> {
    if let Some(spec) = var(ENV_TOKEN_KEYS).filter(|v| !v.trim().is_empty()) {
        let ring = KeyRing::parse(&spec).with_context(|| format!("{ENV_TOKEN_KEYS} is invalid"))?;
        return Ok(TokenKeys::new(ring, KeySource::Environment));
    }
    match &settings.token_keys_file {
        Some(path) => Ok(TokenKeys::new(keys::read_ring(path)?, KeySource::File(path.clone()))),
        None => bail!(
            "no token keys: export {ENV_TOKEN_KEYS}=<id>:<base64 of 32 random bytes> \
             (or name a file in {ENV_TOKEN_KEYS_FILE} or gateway.token_keys_file)"
        ),
    }
}

/// Checks a configured origin: `*`, or `scheme://host[:port]` with no path.
pub fn check_origin(origin: &str) -> Result<(), String> {
    if origin == "*" {
        return Ok(());
    }
    let Some((scheme, rest)) = origin.split_once("://") else {
        return Err(format!("{origin:?} is not an origin like https://app.example.com"));
    };
    if !matches!(scheme, "http" | "https")
        || rest.is_empty()
        || rest.contains('/')
        || rest.contains(char::is_whitespace)
    {
        return Err(format!("{origin:?} is not an origin like https://app.example.com (scheme and host, no path)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use base64::Engine as _;

    use super::*;

    fn key() -> String {
        base64::engine::general_purpose::STANDARD.encode([9u8; 32])
    }

    /// `text` parsed, with open access unless it chooses (see [`access_must_be_chosen`]).
    fn shared(text: &str) -> Config {
        let mut c = Config::parse(text).unwrap();
        let table = c.gateway.get_or_insert_with(Default::default);
        if !table.contains_key("access") && !table.contains_key("auth") {
            table.insert("access".into(), "open".into());
        }
        c
    }

    #[test]
    fn access_must_be_chosen() {
        let keys = format!("k1:{}", key());
        let err = format!(
            "{:#}",
            GatewayConfig::from_shared(Config::parse("").unwrap(), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap_err()
        );
        assert!(err.contains("gateway.access = \"open\"") && err.contains("[gateway.auth]"), "{err}");
        let dir = std::env::temp_dir().join(format!("parsley-gateway-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let secret = dir.join("secret");
        std::fs::write(&secret, [7u8; 32]).unwrap();
        let auth = format!(
            "[gateway.auth]\nissuer = \"https://idp\"\naudience = \"parsley\"\nhs256_secret_file = {:?}\n",
            secret.to_string_lossy()
        );
        let c = GatewayConfig::from_shared(Config::parse(&auth).unwrap(), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap();
        assert_eq!(c.settings.access_mode(), AccessMode::Rules, "authentication implies the rules");
        assert!(c.verifier.is_some() && !c.access.is_open());
        for (text, says) in [
            (format!("[gateway]\naccess = \"open\"\n{auth}"), "cannot go with [gateway.auth]"),
            ("[gateway]\naccess = \"rules\"\n".to_string(), "needs [gateway.auth]"),
            (
                "[gateway]\naccess = \"open\"\n[[gateway.rules]]\nname = \"r\"\nallow = [\"read\"]\nmodels = [\"*\"]\n"
                    .to_string(),
                "need authentication",
            ),
            ("[gateway]\naccess = \"open\"\nsubject_jwt_secret_file = \"/x\"\n".to_string(), "moved to [gateway.auth]"),
            (format!("[gateway]\nsubject_header = \"x-user\"\n{auth}"), "goes with open access"),
        ] {
            let err = format!(
                "{:#}",
                GatewayConfig::from_shared(Config::parse(&text).unwrap(), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap_err()
            );
            assert!(err.contains(says), "{text}: {err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn defaults_apply_without_a_table() {
        let keys = format!("k1:{}", key());
        let c = GatewayConfig::from_shared(shared(""), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap();
        assert_eq!(c.settings, Settings { access: Some(AccessMode::Open), ..Settings::default() });
        assert_eq!(c.settings.listen, "127.0.0.1:8080");
        assert_eq!(c.settings.read_wait_ms, 2_000);
        assert_eq!(
            (c.settings.read_cache_bytes, c.settings.read_cache_max_age_ms),
            (64 << 20, 1_000),
            "kept snapshots on"
        );
        assert_eq!(c.settings.subject_header, None);
        assert_eq!(
            (c.settings.max_key_bytes, c.settings.max_in_flight, c.settings.max_waiting_reads),
            (1024, 1024, 256)
        );
        assert_eq!(c.settings.admin_listen, "127.0.0.1:9091");
        assert_eq!(
            (c.settings.http_connections_cap(), c.settings.database_pool_size(), c.settings.body_timeout()),
            (4096, 16, Duration::from_secs(10))
        );
        assert!(c.admin_token.is_none());
        let t = "[gateway]\nmax_connections = 100\ndatabase_max_connections = 8\nbody_timeout_ms = 500\n";
        let c = GatewayConfig::from_shared(shared(t), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap();
        assert_eq!(
            (c.settings.http_connections_cap(), c.settings.database_pool_size(), c.settings.body_timeout()),
            (100, 8, Duration::from_millis(500))
        );
        let t = "[gateway]\nmax_key_bytes = 2048\nmax_header_bytes = 4096\nadmin_listen = \"\"\n";
        let c = GatewayConfig::from_shared(shared(t), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap();
        assert_eq!((c.settings.max_key_bytes, c.settings.max_header_bytes), (MAX_KEY_BYTES_LIMIT, MIN_HEADER_BYTES));
        assert_eq!(c.settings.admin_listen, "", "empty: no admin listener");
    }

    #[test]
    fn the_admin_token_comes_from_the_environment_or_a_file_and_is_never_quoted() {
        let keys = format!("k1:{}", key());
        let token = "s3cret-admin-token-0123";
        let c =
            GatewayConfig::from_shared(shared(""), env(&[(ENV_TOKEN_KEYS, &keys), (ENV_ADMIN_TOKEN, token)])).unwrap();
        assert!(c.admin_token.as_ref().is_some_and(|t| t.matches(token.as_bytes())));
        assert!(!c.admin_token.as_ref().unwrap().matches(b"s3cret-admin-token-012"));
        assert!(!format!("{c:?}").contains(token), "never printed");
        for bad in ["short", "has a space in it somewhere"] {
            let err = GatewayConfig::from_shared(shared(""), env(&[(ENV_TOKEN_KEYS, &keys), (ENV_ADMIN_TOKEN, bad)]))
                .unwrap_err();
            let err = format!("{err:#}");
            assert!(err.contains(ENV_ADMIN_TOKEN) && !err.contains(bad), "{err}");
        }
        let dir = std::env::temp_dir().join(format!("parsley-gateway-admin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("admin");
        std::fs::write(&file, format!("{token}\n")).unwrap();
        let text = format!("[gateway]\nadmin_token_file = {:?}\n", file.to_string_lossy());
        let c = GatewayConfig::from_shared(shared(&text), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap();
        assert!(c.admin_token.as_ref().is_some_and(|t| t.matches(token.as_bytes())), "the file's line, trimmed");
        std::fs::remove_dir_all(&dir).unwrap();
        let err = GatewayConfig::from_shared(shared(&text), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap_err();
        assert!(format!("{err:#}").contains("admin token file"), "{err:#}");
        let c =
            GatewayConfig::from_shared(shared(""), env(&[(ENV_TOKEN_KEYS, &keys), (ENV_ADMIN_LISTEN, "")])).unwrap();
        assert_eq!(c.settings.admin_listen, "", "an empty override turns the admin listener off");
    }

    /// `response_timeout_ms` was `request_timeout_ms` (a name `[kafka]` uses for the broker's
    /// request timeout): both are read, one at a time.
    #[test]
    fn the_response_timeout_keeps_its_old_name() {
        let keys = format!("k1:{}", key());
        for key in ["response_timeout_ms", "request_timeout_ms"] {
            let text = format!("[gateway]\n{key} = 45000\n");
            let c = GatewayConfig::from_shared(shared(&text), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap();
            assert_eq!(c.settings.response_timeout(), Duration::from_secs(45), "{key}");
        }
        let both = "[gateway]\nresponse_timeout_ms = 45000\nrequest_timeout_ms = 40000\n";
        let err =
            format!("{:#}", GatewayConfig::from_shared(shared(both), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap_err());
        assert!(err.contains("response_timeout_ms"), "{err}");
        let short = "[gateway]\nread_wait_ms = 5000\nresponse_timeout_ms = 5000\n";
        let err =
            format!("{:#}", GatewayConfig::from_shared(shared(short), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap_err());
        assert!(err.contains("gateway.response_timeout_ms"), "{err}");
    }

    #[test]
    fn the_table_is_strict_and_errors_name_the_key() {
        let keys = format!("k1:{}", key());
        let cases: &[(&str, &str)] = &[
            ("[gateway]\nlisten = \"nowhere\"\n", "gateway.listen"),
            ("[gateway]\nread_wait = 5\n", "read_wait"),
            ("[gateway]\nretry_after_s = 0\n", "gateway.retry_after_s"),
            ("[gateway]\nsubject_header = \"a b\"\n", "gateway.subject_header"),
            ("[gateway]\ntoken_ttl_s = \"long\"\n", "token_ttl_s"),
            ("[gateway]\nread_wait_ms = 40000\n", "gateway.request_timeout_ms"),
            ("[gateway]\nread_cache_max_age_ms = 60001\n", "gateway.read_cache_max_age_ms"),
            ("[gateway]\nread_cache_bytes = -1\n", "read_cache_bytes"),
            ("[gateway]\nmax_key_bytes = 2049\n", "gateway.max_key_bytes"),
            ("[gateway]\nmax_key_bytes = 0\n", "gateway.max_key_bytes"),
            ("[gateway]\nheader_read_timeout_ms = 0\n", "gateway.header_read_timeout_ms"),
            ("[gateway]\nmax_header_bytes = 4095\n", "gateway.max_header_bytes"),
            ("[gateway]\nmax_header_bytes = 1048576\n", "gateway.max_header_bytes"),
            ("[gateway]\nmax_in_flight = 0\n", "gateway.max_in_flight"),
            ("[gateway]\nmax_connections = 16\n", "gateway.database_max_connections"),
            ("[gateway]\nmax_connections = 0\ndatabase_max_connections = 8\n", "gateway.max_connections"),
            ("[gateway]\ndatabase_max_connections = 0\n", "gateway.database_max_connections"),
            ("[gateway]\nquery_max_connections = 0\n", "gateway.query_max_connections"),
            ("[gateway]\nbody_timeout_ms = 0\n", "gateway.body_timeout_ms"),
            ("[gateway]\nmax_waiting_reads = 0\n", "gateway.max_waiting_reads"),
            ("[gateway]\nadmin_listen = \"nowhere\"\n", "gateway.admin_listen"),
            ("[gateway]\nadmin_listen = \"127.0.0.1:8080\"\n", "gateway.admin_listen"),
        ];
        for (text, needle) in cases {
            let err =
                format!("{:#}", GatewayConfig::from_shared(shared(text), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap_err());
            assert!(err.contains(needle), "error for {text:?} does not name {needle:?}: {err}");
        }
    }

    #[test]
    fn environment_overrides_the_table() {
        let keys = format!("k1:{}", key());
        let text = "[gateway]\nlisten = \"127.0.0.1:9000\"\nread_wait_ms = 100\nsubject_header = \"x-user\"\n";
        let c = GatewayConfig::from_shared(
            shared(text),
            env(&[
                (ENV_TOKEN_KEYS, &keys),
                (ENV_LISTEN, "0.0.0.0:81"),
                (ENV_READ_WAIT_MS, "300"),
                (ENV_SUBJECT_HEADER, ""),
            ]),
        )
        .unwrap();
        assert_eq!(c.settings.listen, "0.0.0.0:81");
        assert_eq!(c.settings.read_wait_ms, 300);
        assert_eq!(c.settings.subject_header, None, "an empty override turns subject binding off");
        let err = GatewayConfig::from_shared(shared(text), env(&[(ENV_TOKEN_KEYS, &keys), (ENV_READ_WAIT_MS, "soon")]))
            .unwrap_err();
        assert!(err.to_string().contains(ENV_READ_WAIT_MS), "{err}");
    }

    #[test]
    fn every_key_has_its_variable() {
        let keys = format!("k1:{}", key());
        let text = "[gateway]\nread_wait_ms = 100\n";
        let c = GatewayConfig::from_shared(
            shared(text),
            env(&[
                (ENV_TOKEN_KEYS, &keys),
                ("PARSLEY_GATEWAY__READ_WAIT_MS", "300"),
                ("PARSLEY_GATEWAY__MAX_KEY_BYTES", "64"),
                ("PARSLEY_GATEWAY__SUBJECT_HEADER", "x-user"),
                // The generic form wins over an alias of the same key.
                (ENV_LISTEN, "0.0.0.0:81"),
                ("PARSLEY_GATEWAY__LISTEN", "0.0.0.0:82"),
            ]),
        )
        .unwrap();
        assert_eq!(c.settings.read_wait_ms, 300);
        assert_eq!(c.settings.max_key_bytes, 64);
        assert_eq!(c.settings.subject_header.as_deref(), Some("x-user"));
        assert_eq!(c.settings.listen, "0.0.0.0:82");
        let err = GatewayConfig::from_shared(
            shared(text),
            env(&[(ENV_TOKEN_KEYS, &keys), ("PARSLEY_GATEWAY__MAX_KEY_BYTES", "many")]),
        )
        .unwrap_err();
        assert!(err.to_string().contains("PARSLEY_GATEWAY__MAX_KEY_BYTES"), "{err}");
        let misspelt: Env = [("PARSLEY_GATEWAY__READ_WAITMS", "5")].into_iter().collect();
        let err = Settings::from_table_with_env(None, &misspelt).unwrap_err().to_string();
        assert!(err.contains("PARSLEY_GATEWAY__READ_WAITMS") && err.contains("read_waitms"), "{err}");
    }

    #[test]
    fn keys_come_from_the_environment_or_a_file_and_are_never_quoted() {
        let err = format!("{:#}", GatewayConfig::from_shared(shared(""), env(&[])).unwrap_err());
        assert!(err.contains(ENV_TOKEN_KEYS), "{err}");

        let secret = "k1:bm90LXRoaXJ0eS10d28tYnl0ZXM";
        let err =
            format!("{:#}", GatewayConfig::from_shared(shared(""), env(&[(ENV_TOKEN_KEYS, secret)])).unwrap_err());
        assert!(!err.contains("bm90LXRoaXJ0eS10d28tYnl0ZXM"), "{err}");

        let dir = std::env::temp_dir().join(format!("parsley-gateway-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, format!("new:{}\n", key())).unwrap();
        let path = file.to_string_lossy().into_owned();
        let c = GatewayConfig::from_shared(shared(""), env(&[(ENV_TOKEN_KEYS_FILE, &path)])).unwrap();
        let printed = format!("{c:?}");
        assert!(!printed.contains(&key()), "keys never appear in Debug output");
        let text = format!("[gateway]\ntoken_keys_file = {path:?}\n");
        assert!(GatewayConfig::from_shared(shared(&text), env(&[])).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn session_lifetimes_key_reloads_and_verified_subjects_are_checked() {
        let keys = format!("k1:{}", key());
        let c = GatewayConfig::from_shared(shared(""), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap();
        let s = &c.settings;
        assert_eq!((s.token_max_age_s, s.token_clock_skew_s, s.token_keys_reload_ms), (86_400, 30, 10_000));
        assert_eq!(s.validity(), Validity { max_age_s: Some(86_400), clock_skew_s: 30 });
        assert!(!s.public_diagnostics, "diagnoses are for the admin listener unless asked for");
        assert!(c.verifier.is_none() && c.access.is_open());
        assert_eq!(c.keys.source(), &KeySource::Environment, "keys from the environment are not reloadable");

        let cases: &[(&str, &str)] = &[
            ("[gateway]\ntoken_max_age_s = 0\n", "gateway.token_max_age_s"),
            ("[gateway]\ntoken_clock_skew_s = 301\n", "gateway.token_clock_skew_s"),
            ("[gateway]\nsubject_jwt_issuer = \"x\"\n", "gateway.subject_jwt_secret_file, subject_jwt_issuer"),
            ("[gateway]\npublic_diagnostics = \"yes\"\n", "public_diagnostics"),
        ];
        for (text, needle) in cases {
            let err =
                format!("{:#}", GatewayConfig::from_shared(shared(text), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap_err());
            assert!(err.contains(needle), "error for {text:?} does not name {needle:?}: {err}");
        }

        let dir = std::env::temp_dir().join(format!("parsley-gateway-subjects-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let secret = dir.join("jwt-secret");
        std::fs::write(&secret, "a-secret-of-at-least-thirty-two-bytes\n").unwrap();
        let text = format!(
            "[gateway.auth]\nhs256_secret_file = {:?}\nissuer = \"idp\"\naudience = \"parsley\"\n",
            secret.to_string_lossy()
        );
        let c = GatewayConfig::from_shared(shared(&text), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap();
        assert!(c.verifier.is_some());
        assert!(!format!("{c:?}").contains("a-secret-of"), "never printed");
        let with_keys = GatewayConfig::with_keys(shared(&text), KeyRing::parse(&keys).unwrap()).unwrap();
        assert!(with_keys.verifier.is_some(), "the secret file is read for embedded gateways too");
        assert_eq!(with_keys.keys.source(), &KeySource::Given);
        std::fs::write(&secret, "short\n").unwrap();
        let err =
            format!("{:#}", GatewayConfig::from_shared(shared(&text), env(&[(ENV_TOKEN_KEYS, &keys)])).unwrap_err());
        assert!(err.contains("gateway.auth") && !err.contains("short"), "{err}");

        let file = dir.join("keys");
        std::fs::write(
            &file,
            format!("new:{}:open\nold:{}\n", key(), base64::engine::general_purpose::STANDARD.encode([8u8; 32])),
        )
        .unwrap();
        let path = file.to_string_lossy().into_owned();
        let c = GatewayConfig::from_shared(shared(""), env(&[(ENV_TOKEN_KEYS_FILE, &path)])).unwrap();
        assert_eq!(c.keys.source(), &KeySource::File(file.clone()));
        assert_eq!(c.keys.current().sealing_key_id(), "old", "an open-only key never seals");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_compose_configuration_parses_for_both_services() {
        let shared = Config::parse(include_str!("../../config/compose.toml")).unwrap();
        assert_eq!(shared.model("shop").unwrap().topics.len(), 2);
        let settings = Settings::from_table(shared.gateway.as_ref()).unwrap();
        settings.validate().unwrap();
        assert_eq!(settings.listen, "0.0.0.0:8080");
        assert_eq!(settings.admin_listen, "0.0.0.0:9091");
        assert_eq!(settings.access_mode(), AccessMode::Rules, "compose runs with authentication and rules");
        assert_eq!(settings.rules.len(), 3);
    }

    #[test]
    fn the_demo_configuration_keeps_off_the_default_ports() {
        let shared = Config::parse(include_str!("../../config/demo.toml")).unwrap();
        let settings = Settings::from_table(shared.gateway.as_ref()).unwrap();
        settings.validate().unwrap();
        let defaults = Settings::default();
        assert_ne!(settings.listen, defaults.listen);
        assert_ne!(settings.admin_listen, defaults.admin_listen);
    }
}
