//! What the gateway's benchmarks share: the stack they measure (the real projector for one
//! model run in-process, the gateway served on a port-0 listener, and a plain axum server
//! doing the gateway's `SELECT`s without the gate), a minimal keep-alive HTTP/1.1 client,
//! a baseline producer with the gateway's settings, order statistics, and a recorder of the
//! `parsley::stage` events that time a write's way to visibility.
//!
//! No log subscriber is installed, only the stage recorder, which takes the events of that
//! one target and nothing else: logging costs are not measured.

pub mod stages;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use parsley::codec::CAUSES_HEADER;
use parsley_gateway::token::{KeyRing, SecretKey};
use parsley_gateway::{Gateway, GatewayConfig, SESSION_HEADER};
use parsley_projector::metrics::{Metrics, METRICS};
use parsley_projector::{DocumentProjection, ModelProjector};
use parsley_settings::config::Config;
use parsley_store::migrations;
use parsley_testkit::{create_topics, delete_topic, unique};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::{PgPool, Row as _};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub const PARTITIONS: i32 = 4;
/// Long enough that a write-to-visible read never answers 503 on this machine.
const READ_WAIT_MS: u64 = 10_000;

pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Whether `cargo bench` started this binary: `cargo test --benches` does not pass
/// `--bench`, and should not run a measurement against the services.
pub fn run_as_benchmark(name: &str) -> bool {
    if std::env::args().any(|a| a == "--bench") {
        return true;
    }
    println!("{name}: a benchmark; run it with `cargo bench -p parsley-gateway --bench {name}`");
    false
}

/// The measured stack, running.
pub struct Stack {
    pub run: String,
    /// The model's name (the run's).
    pub model: String,
    /// The model's topic.
    pub topic: String,
    /// A topic no model receives, for baselines that must not be projected.
    pub raw_topic: String,
    pub config: Config,
    /// The gateway's pool (the plain handlers use it too).
    pub pool: PgPool,
    pub ring: KeyRing,
    pub gateway_address: SocketAddr,
    pub plain_address: SocketAddr,
    /// The baseline producer: the gateway's settings.
    pub producer: FutureProducer,
    pub produce_timeout: Duration,
    /// The gateway's state (its metrics).
    pub state: parsley_gateway::AppState,
    projector_pool: PgPool,
    /// The services' database URL, and the run's database made through it.
    admin_url: String,
    database: String,
    stop_gateway: watch::Sender<bool>,
    stop_projector: watch::Sender<bool>,
    gateway_task: JoinHandle<anyhow::Result<()>>,
    plain_task: JoinHandle<std::io::Result<()>>,
    projector_task: JoinHandle<anyhow::Result<()>>,
}

impl Stack {
    /// Starts the stack against the services (`PARSLEY_KAFKA_BOOTSTRAP`, `DATABASE_URL`)
    /// for a new model named `prefix` plus a unique suffix. `model_settings` are extra
    /// lines of the model's configuration (e.g. `max_step_ms = 10`); the configuration's
    /// defaults apply to everything else.
    pub async fn start(prefix: &str, model_settings: &str) -> anyhow::Result<Stack> {
        // Checked before anything else: the helpers below panic on a missing variable.
        let bootstrap = parsley_infra::services::kafka_bootstrap()?;
        let database_url = parsley_infra::services::database_url()?;

        let run = unique(prefix);
        // A database of the run's own, dropped at `stop`: nothing is left in the shared one.
        let database = run.replace('-', "_");
        parsley_testkit::create_database(&database_url, &database).await.context("creating the run's database")?;
        let admin_url = database_url;
        let database_url = parsley_testkit::with_database(&admin_url, &database).map_err(anyhow::Error::msg)?;
        let topic = format!("{run}.events");
        let raw_topic = format!("{run}.raw");
        create_topics(&[&topic, &raw_topic], PARTITIONS).await;

        // Kept snapshots as in the gateway by default; `BENCH_READ_CACHE_BYTES` sets their
        // memory (0: off, every read asks Postgres).
        let read_cache_bytes = env_usize("BENCH_READ_CACHE_BYTES", parsley_gateway::settings::DEFAULT_READ_CACHE_BYTES);
        let mut config = Config::parse(&format!(
            "[gateway]\naccess = \"open\"\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"\"\nread_wait_ms = {READ_WAIT_MS}\n\
             read_cache_bytes = {read_cache_bytes}\n\n\
             [[models]]\nname = \"{run}\"\n{model_settings}topics = [{{ name = \"{topic}\" }}]\n"
        ))?;
        config.kafka.bootstrap = bootstrap.clone();
        config.database.url = Some(database_url.clone().into());
        config.projector.owner = Some(unique("owner"));
        config.projector.metrics_address = String::new();
        config.validate()?;

        // The projector, on its own pool (it runs the migrations).
        let projector_pool = parsley_infra::pg::connect(&database_url, 4, Duration::from_secs(30)).await?;
        migrations::run(&projector_pool).await?;
        let model = &config.models[0];
        let projector = ModelProjector::start(
            &config,
            model,
            projector_pool.clone(),
            Arc::new(DocumentProjection::from_model(model)),
            Metrics::new(METRICS),
        )
        .await
        .context("starting the projector")?;
        ensure!(projector.refusal().is_none(), "the model was refused: {:?}", projector.refusal());
        let (stop_projector, projector_shutdown) = watch::channel(false);
        let projector_task = tokio::spawn(projector.run(projector_shutdown));

        // The gateway, served for real on a port-0 listener.
        let ring = KeyRing::new(vec![("bench".to_string(), SecretKey::from_bytes([0x5a; 32]))])?;
        let gateway = Gateway::new(GatewayConfig::with_keys(config.clone(), ring.clone())?)?;
        let state = gateway.state().clone();
        let listener = gateway.bind().await?;
        let gateway_address = listener.local_addr()?;
        let (stop_gateway, gateway_shutdown) = watch::channel(false);
        let gateway_task = tokio::spawn(gateway.serve(listener, gateway_shutdown));

        // The plain handlers: the same SELECTs on the gateway's pool, behind axum alone.
        let plain = Router::new()
            .route("/plain/{model}/{key}", get(plain_read))
            .route("/plain/{model}", get(plain_page))
            .with_state(state.pool.clone());
        let plain_listener = TcpListener::bind("127.0.0.1:0").await?;
        let plain_address = plain_listener.local_addr()?;
        let mut plain_stop = stop_gateway.subscribe();
        let plain_task = tokio::spawn(async move {
            axum::serve(plain_listener, plain)
                .with_graceful_shutdown(async move {
                    let _ = plain_stop.wait_for(|s| *s).await;
                })
                .await
        });

        let producer: FutureProducer = parsley_infra::kafka::producer_config(&bootstrap)
            .set("message.timeout.ms", state.config.settings.produce_timeout_ms.to_string())
            .create()
            .context("creating the baseline producer")?;
        Ok(Stack {
            model: run.clone(),
            run,
            topic,
            raw_topic,
            config,
            pool: state.pool.clone(),
            ring,
            gateway_address,
            plain_address,
            producer,
            produce_timeout: state.config.settings.produce_timeout(),
            state: state.clone(),
            projector_pool,
            admin_url,
            database,
            stop_gateway,
            stop_projector,
            gateway_task,
            plain_task,
            projector_task,
        })
    }

    /// A second gateway over the same model, authenticating callers: RS256 JWTs checked
    /// with the test fixtures' JWKS file (`gateway/tests/fixtures/jwt`), one rule letting
    /// any caller with scope `bench:read` read and list the model. Served until the stack
    /// stops; returns its address and a bearer JWT it accepts (valid for an hour).
    pub async fn start_authenticated_gateway(&self) -> anyhow::Result<(SocketAddr, String)> {
        let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/jwt");
        let jwks = std::env::temp_dir().join(format!("{}-jwks.json", self.run));
        let jwk: serde_json::Value = serde_json::from_slice(&std::fs::read(format!("{fixtures}/rsa-1.jwk.json"))?)?;
        std::fs::write(&jwks, serde_json::json!({"keys": [jwk]}).to_string())?;
        let read_cache_bytes = env_usize("BENCH_READ_CACHE_BYTES", parsley_gateway::settings::DEFAULT_READ_CACHE_BYTES);
        let mut config = self.config.clone();
        config.gateway = Config::parse(&format!(
            "[gateway]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"\"\nread_wait_ms = {READ_WAIT_MS}\n\
             read_cache_bytes = {read_cache_bytes}\n\
             [gateway.auth]\nissuer = \"https://bench\"\naudience = \"bench\"\njwks_file = {:?}\n\
             [[gateway.rules]]\nname = \"bench-readers\"\nallow = [\"read\", \"list\"]\nmodels = [\"{}\"]\n\
             scopes = [\"bench:read\"]\n",
            jwks.to_string_lossy(),
            self.model
        ))?
        .gateway;
        let gateway = Gateway::new(GatewayConfig::with_keys(config, self.ring.clone())?)?;
        let listener = gateway.bind().await?;
        let address = listener.local_addr()?;
        tokio::spawn(gateway.serve(listener, self.stop_gateway.subscribe()));
        let now = parsley_gateway::session::unix_now();
        let claims = serde_json::json!({
            "iss": "https://bench", "aud": "bench", "sub": "bench-reader", "scope": "bench:read",
            "iat": now, "exp": now + 3600,
        });
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::RS256);
        header.kid = Some("rsa-1".into());
        let key = jsonwebtoken::EncodingKey::from_rsa_pem(&std::fs::read(format!("{fixtures}/rsa-1.key.pem"))?)?;
        Ok((address, format!("Bearer {}", jsonwebtoken::encode(&header, &claims, &key)?)))
    }

    /// Stops everything, deletes the run's topics and drops its database — unless
    /// `BENCH_KEEP_DATABASE` is set, for a look at its rows afterwards (its name is printed;
    /// drop it by hand).
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop_gateway.send(true);
        let _ = self.stop_projector.send(true);
        self.gateway_task.await?.context("the gateway failed")?;
        self.plain_task.await?.context("the plain server failed")?;
        self.projector_task.await?.context("the projector failed")?;
        self.projector_pool.close().await;
        delete_topic(&self.topic).await;
        delete_topic(&self.raw_topic).await;
        self.pool.close().await;
        if std::env::var_os("BENCH_KEEP_DATABASE").is_some() {
            eprintln!("kept the run's database {} (BENCH_KEEP_DATABASE)", self.database);
            return Ok(());
        }
        parsley_testkit::drop_database(&self.admin_url, &self.database).await.context("dropping the run's database")
    }

    /// A bare produce with the gateway's producer settings, awaiting the acknowledgement.
    pub async fn produce(&self, topic: &str, key: &str, payload: &[u8], causes: Option<&[u8]>) -> anyhow::Result<()> {
        produce(&self.producer, self.produce_timeout, topic, key, payload, causes).await
    }

    /// The gateway's path of a single-key read of the model.
    pub fn document_path(&self, key: &str) -> String {
        format!("/v1/models/{}/documents/{key}", self.model)
    }

    /// The plain handler's path of the same read.
    pub fn plain_document_path(&self, key: &str) -> String {
        format!("/plain/{}/{key}", self.model)
    }

    /// The gateway's path of the first page of `limit` documents.
    pub fn page_path(&self, limit: u32) -> String {
        format!("/v1/models/{}/documents?limit={limit}", self.model)
    }

    /// The plain handler's path of the same page.
    pub fn plain_page_path(&self, limit: u32) -> String {
        format!("/plain/{}?limit={limit}", self.model)
    }

    /// The gateway's path of a write to the model's topic.
    pub fn records_path(&self) -> String {
        format!("/v1/topics/{}/records", self.topic)
    }
}

/// A produce of `key` and `payload` with the `parsley.causes` header `causes`, awaiting
/// the acknowledgement.
pub async fn produce(
    producer: &FutureProducer,
    timeout: Duration,
    topic: &str,
    key: &str,
    payload: &[u8],
    causes: Option<&[u8]>,
) -> anyhow::Result<()> {
    let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).key(key.as_bytes()).payload(payload);
    if let Some(c) = causes {
        record = record.headers(OwnedHeaders::new().insert(Header { key: CAUSES_HEADER, value: Some(c) }));
    }
    producer
        .send(record, Timeout::After(timeout))
        .await
        .map_err(|(e, _)| anyhow::anyhow!("producing to {topic}: {e}"))?;
    Ok(())
}

async fn plain_read(
    State(pool): State<PgPool>,
    Path((model, key)): Path<(String, String)>,
) -> Result<Json<Value>, StatusCode> {
    let row = select_document(&pool, &model, &key).await.map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let (doc, version) = row.ok_or(StatusCode::NOT_FOUND)?;
    Ok(Json(json!({"key": key, "document": doc, "version": version})))
}

/// The row the gateway's single-key read serves, without the gate.
pub async fn select_document(pool: &PgPool, model: &str, key: &str) -> sqlx::Result<Option<(Value, i64)>> {
    let row = sqlx::query("SELECT doc, version FROM projection.documents WHERE model = $1 AND key = $2")
        .bind(model)
        .bind(key)
        .fetch_optional(pool)
        .await?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

#[derive(Deserialize)]
struct PageQuery {
    limit: u32,
}

/// The gateway's first page without the gate: the same keyset `SELECT` (one row more than
/// the page, to know whether another follows) and the same body.
async fn plain_page(
    State(pool): State<PgPool>,
    Path(model): Path<String>,
    Query(page): Query<PageQuery>,
) -> Result<Json<Value>, StatusCode> {
    let rows = sqlx::query(
        "SELECT key, doc, version FROM projection.documents
         WHERE model = $1 AND ($2::text IS NULL OR key > $2)
         ORDER BY key LIMIT $3",
    )
    .bind(&model)
    .bind(None::<String>)
    .bind(i64::from(page.limit) + 1)
    .fetch_all(&pool)
    .await
    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let more = rows.len() > page.limit as usize;
    let documents: Vec<Value> = rows
        .iter()
        .take(page.limit as usize)
        .map(|r| json!({"key": r.get::<String, _>(0), "document": r.get::<Value, _>(1), "version": r.get::<i64, _>(2)}))
        .collect();
    let next = if more { documents.last().map(|d| d["key"].clone()) } else { None };
    Ok(Json(json!({"documents": documents, "next": next})))
}

/// One HTTP answer.
pub struct Reply {
    pub status: u16,
    pub token: Option<String>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// One keep-alive HTTP/1.1 connection: a request written in one piece, a response with a
/// `content-length` (what the gateway and axum send for these bodies). Enough for one
/// request shape without a client crate.
pub struct Http {
    stream: BufReader<TcpStream>,
    host: String,
    line: String,
    /// Sent as `authorization` with every request, when set (`Bearer <jwt>`).
    pub authorization: Option<String>,
}

impl Http {
    pub async fn connect(address: SocketAddr) -> anyhow::Result<Http> {
        let stream = TcpStream::connect(address).await.with_context(|| format!("connecting to {address}"))?;
        stream.set_nodelay(true)?;
        Ok(Http { stream: BufReader::new(stream), host: address.to_string(), line: String::new(), authorization: None })
    }

    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&[u8]>,
    ) -> anyhow::Result<Reply> {
        let mut request = format!("{method} {path} HTTP/1.1\r\nhost: {}\r\n", self.host);
        if let Some(a) = &self.authorization {
            request.push_str(&format!("authorization: {a}\r\n"));
        }
        if let Some(t) = token {
            request.push_str(&format!("{SESSION_HEADER}: {t}\r\n"));
        }
        if let Some(b) = body {
            request.push_str(&format!("content-type: application/json\r\ncontent-length: {}\r\n", b.len()));
        }
        request.push_str("\r\n");
        let mut request = request.into_bytes();
        request.extend_from_slice(body.unwrap_or_default());
        self.stream.get_mut().write_all(&request).await.context("sending a request")?;

        let status_line = self.read_line().await?;
        let status = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("bad status line {status_line:?}"))?;
        let (mut length, mut token) = (None, None);
        loop {
            let line = self.read_line().await?;
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').with_context(|| format!("bad header line {line:?}"))?;
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length = Some(value.parse::<usize>().context("bad content-length")?);
            } else if name.eq_ignore_ascii_case(SESSION_HEADER) {
                token = Some(value.to_string());
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                bail!("this client reads content-length bodies only, not transfer-encoding {value}");
            }
        }
        let mut body = vec![0; length.context("a response without content-length")?];
        self.stream.read_exact(&mut body).await.context("reading a response body")?;
        Ok(Reply { status, token, body })
    }

    /// One header line without its line end.
    async fn read_line(&mut self) -> anyhow::Result<String> {
        self.line.clear();
        if self.stream.read_line(&mut self.line).await.context("reading a response")? == 0 {
            bail!("the server closed the connection");
        }
        Ok(self.line.trim_end_matches(['\r', '\n']).to_string())
    }
}

/// Order statistics of one variant (nearest rank).
pub struct Stats {
    pub min: Duration,
    pub median: Duration,
    pub p90: Duration,
    pub p99: Duration,
}

impl Stats {
    /// All zero for no samples (a side not measured).
    pub fn of(samples: &[Duration]) -> Stats {
        if samples.is_empty() {
            return Stats { min: Duration::ZERO, median: Duration::ZERO, p90: Duration::ZERO, p99: Duration::ZERO };
        }
        let mut sorted = samples.to_vec();
        sorted.sort();
        let rank = |p: f64| sorted[((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
        Stats { min: sorted[0], median: rank(0.5), p90: rank(0.9), p99: rank(0.99) }
    }
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
