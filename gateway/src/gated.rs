//! Gated reads, for any data: the one implementation of the gate, the wait, the `503` and the
//! refreshed token that the document routes, the named queries and an embedding program's
//! own routes all use.
//!
//! A gated read proves that the data it serves reflects the session: the data and the clock
//! rows the core's [`gate`] and [`refresh`] read come from **one snapshot**, the gate runs over
//! those rows, and only if they cover the session's token is the data served, with the token
//! refreshed. Otherwise the read waits (woken by the projector's `NOTIFY` through the model's
//! shared [`crate::feed`], and a re-check timer) until `gateway.read_wait_ms` has passed, then
//! answers `503 not-yet-covered` with `Retry-After` and every gap. It never serves data the
//! clock has not proven. At most `max_waiting_reads` reads of a model wait at once; beyond that
//! an uncovered read is refused `503 overloaded` at once.
//!
//! A [`Snapshot`] may also offer a snapshot an earlier read kept in memory (the documents'
//! reads of a key or a page do, unless `gateway.read_cache_bytes` is 0: [`crate::read_cache`]). It is one
//! snapshot like any other and passes through the same gate over its own rows; only when
//! that gate does not cover the session is a statement run.
//!
//! What a read is served by is its [`Scope`]: the task owning one record key (the key is routed
//! exactly as the producer's partitioner routes it, so the owner is the task that applies every
//! record of that key), or every task (the data may come from any of them, so every task's
//! clock must cover the session).
//!
//! # Entry points
//! - [`Gate`]: an axum extractor holding the state and the request's headers; its
//!   [`Gate::query`] runs a closure's statements in the snapshot (a read-only transaction) and
//!   [`Gate::read`] any [`Snapshot`].
//! - [`read`] and [`query`]: the same as functions of the state and the headers.
//! - [`Snapshot`]: how one attempt reads the clock rows and the data in one snapshot. The
//!   document routes implement it with a single statement; [`query`] with a
//!   `REPEATABLE READ, READ ONLY` transaction ([`parsley_store::queries::in_snapshot`]).
//!
//! # Example: a custom route with the gateway's semantics
//!
//! ```no_run
//! use axum::extract::Path;
//! use axum::routing::get;
//! use axum::{Json, Router};
//! use parsley_gateway::gated::{Gate, Gated, Scope};
//! use parsley_gateway::{ApiError, Gateway};
//! use sqlx::Row as _;
//!
//! /// The orders of one customer, from the embedding program's own table, once the
//! /// projection reflects the caller's session (the customer is the record key).
//! async fn orders(gate: Gate, Path(customer): Path<String>) -> Result<Gated<Json<Vec<String>>>, ApiError> {
//!     let key = customer.clone();
//!     let gated = gate
//!         .query("shop", Scope::Key(&key), move |conn| {
//!             let customer = customer.clone();
//!             Box::pin(async move {
//!                 let rows = sqlx::query("SELECT id FROM shop.orders WHERE customer = $1 ORDER BY id")
//!                     .bind(customer)
//!                     .fetch_all(conn)
//!                     .await?;
//!                 rows.iter().map(|r| r.try_get::<String, _>(0)).collect()
//!             })
//!         })
//!         .await?;
//!     // 200 with the JSON body and the refreshed token in `Parsley-Session`.
//!     Ok(gated.map(Json))
//! }
//!
//! # async fn embed(gateway: Gateway) {
//! // The gateway's routes merged with the program's own (the gateway's state serves both).
//! let app: Router = parsley_gateway::routes(gateway.state().clone())
//!     .merge(Router::new().route("/shop/customers/{customer}/orders", get(orders)).with_state(gateway.state().clone()));
//! # let _ = app;
//! # }
//! ```

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{FromRef, FromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use parsley::gate::{gate, read_stops_demanding, refresh, ClockRow, GateGap, ModelShape, Verdict};
use parsley::kept::{Consult, KeptRules, KeptView};
use parsley::{CausalPast, ChannelId, TopicId};
use parsley_settings::config::ModelConfig;
use parsley_store::documents::{ClockScope, GateInputs, GatedSnapshot, RecordedModel};
use parsley_store::ordering::{self, ModelRow, TaskRow, TaskStatus};
use parsley_store::StoreError;
use serde_json::{json, Value};
use sqlx::PgConnection;

use crate::feed;
use crate::metrics::Metric;
use crate::problem::{ApiError, Problem, ProblemType};
use crate::session::{self, SESSION_HEADER};
use crate::shapes::Recorded;
use crate::state::AppState;
use crate::store_errors;

/// What a gated read is served by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope<'a> {
    /// The task that owns this record key: the key's partition under the partitioner the
    /// model's topics are configured with (`murmur2` by default, or `crc32`), as the
    /// gateway's writes and the topics' producers place it. Its clock covers the model's
    /// channels it applies, and the upstream pairs it has seen. A model with a topic whose
    /// key is not the document key (`partitioner = "none"`) routes no key to one task: the
    /// read is served by every task, as [`Scope::AllTasks`].
    Key(&'a str),
    /// Every task of the model: data that may come from any key. The read is covered when
    /// each task's clock covers the session (the meet of all tasks).
    AllTasks,
}

/// A covered read: its data and the session's refreshed token. As a response (when the data
/// is one), the data's response with the token in `Parsley-Session`.
#[derive(Debug)]
pub struct Gated<T> {
    pub data: T,
    /// The refreshed, sealed token, for the `Parsley-Session` response header.
    pub token: HeaderValue,
}

impl<T> Gated<T> {
    /// The same read with its data transformed (e.g. `gated.map(Json)`).
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Gated<U> {
        Gated { data: f(self.data), token: self.token }
    }
}

impl<T: IntoResponse> IntoResponse for Gated<T> {
    fn into_response(self) -> Response {
        let mut response = self.data.into_response();
        response.headers_mut().insert(SESSION_HEADER, self.token);
        response
    }
}

/// One attempt's read: the model's recorded row, the clock rows `inputs` names and the data,
/// all from one snapshot — so the rows served are the rows the clock describes. The data is
/// read whether or not the clock covers the session; it is served only once the gate says so
/// (a snapshot whose data statement may fail before the clock covers — a table the
/// projector creates at start — carries the failure in its `Data`, as [`query`] does).
/// An attempt may be made several times in one read (after a wait, or with every clock row
/// when the model's shape changed). The store's gated statements take `inputs` as they are
/// (`parsley_store::documents::gated_document`, `parsley_store::queries::in_snapshot`).
pub trait Snapshot: Sync {
    /// What the read serves.
    type Data: Send;

    /// Reads `model`'s row (as `inputs` asks), the clock rows `inputs` names and the data in
    /// one snapshot.
    fn read(
        &self,
        state: &AppState,
        model: &str,
        inputs: &GateInputs,
    ) -> impl Future<Output = Result<GatedSnapshot<Self::Data>, ApiError>> + Send;

    /// [`Snapshot::read`], told how to check the snapshot's clock rows before its data is
    /// read: `covers` says whether the model's row and clock rows the snapshot read cover the
    /// session (as the gate will judge them). A snapshot that can read its data after its
    /// clock rows in the same transaction reads it only when they do, so no data statement
    /// runs for a session it cannot serve (the named queries: [`crate::queries`]); its data
    /// is then never looked at. The default reads as [`Snapshot::read`] does.
    fn read_gated(
        &self,
        state: &AppState,
        model: &str,
        inputs: &GateInputs,
        covers: &Covers<'_>,
    ) -> impl Future<Output = Result<GatedSnapshot<Self::Data>, ApiError>> + Send {
        let _ = covers;
        self.read(state, model, inputs)
    }

    /// A covered snapshot an earlier read kept in memory that may serve this read without a
    /// statement ([`crate::read_cache`]): it is served only if its own rows cover the session, like
    /// any snapshot. `None` (the default): every attempt reads.
    fn kept(&self, _state: &AppState, _model: &str) -> Option<KeptSnapshot<Self::Data>> {
        None
    }

    /// What a snapshot about to be read would be kept under (read before the statement, for
    /// [`Snapshot::keep`]; `shape`: the shape its rows are chosen by). `None` (the default):
    /// nothing is kept.
    fn generation(&self, _state: &AppState, _model: &str, _shape: &ModelShape) -> Option<u64> {
        None
    }

    /// Offers a covered snapshot, read under `generation` and `shape`, to later reads.
    fn keep(
        &self,
        _state: &AppState,
        _model: &str,
        _generation: u64,
        _shape: &ModelShape,
        _rows: &[ClockRow],
        _data: &Self::Data,
    ) {
    }
}

/// Whether a snapshot's recorded model and clock rows cover the read ([`Snapshot::read_gated`]).
pub type Covers<'a> = dyn Fn(&RecordedModel, &[ClockRow]) -> bool + Sync + 'a;

/// A snapshot kept in memory ([`Snapshot::kept`]): the clock rows and data of one statement,
/// and the shape the rows were chosen by.
pub struct KeptSnapshot<T> {
    pub shape: Arc<ModelShape>,
    pub rows: Arc<[ClockRow]>,
    pub data: T,
}

/// A future borrowing a connection, as a data statement's closure returns it.
pub use parsley_store::queries::BoxFuture;

/// The data statements of [`query`], run in the snapshot's read-only transaction.
struct InTransaction<F>(F);

/// A data statement's failure is kept in the snapshot, not returned from it: it matters only
/// if the clock covers the session. In a snapshot that does not, the projector may not even
/// have created the tables the statements read yet (a model's migrations run at its start),
/// and the read waits for the clock like any other.
impl<T, F> Snapshot for InTransaction<F>
where
    T: Send,
    F: for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<T, sqlx::Error>> + Send + Sync,
{
    type Data = Result<T, ApiError>;

    async fn read(
        &self,
        state: &AppState,
        model: &str,
        inputs: &GateInputs,
    ) -> Result<GatedSnapshot<Result<T, ApiError>>, ApiError> {
        let retry_after = state.config.settings.retry_after_s;
        let failed = |e: StoreError| store_errors::failed(e, "the read", retry_after, None);
        let mut conn = state.reads.acquire().await.map_err(|e| failed(e.into()))?;
        let snapshot = parsley_store::queries::in_snapshot(&mut conn, model, inputs, &self.0).await.map_err(failed)?;
        // A failed data statement left its transaction to a rollback: the pool's test ends it.
        if snapshot.data.is_ok() {
            conn.release();
        }
        let data = snapshot.data.map_err(|e| failed(StoreError::sqlx("the data statement", e)));
        Ok(GatedSnapshot { model: snapshot.model, clock: snapshot.clock, data })
    }
}

/// A gated read of `model` for the request's session (its `Parsley-Session` header, the
/// subject from `headers`): `statements` run on a connection inside a `REPEATABLE READ, READ
/// ONLY` transaction whose snapshot also gives the clock rows, and their result is served
/// once that clock covers the session — after waiting if need be, else `503
/// not-yet-covered`. A failed statement is `503 unavailable` when the database did not
/// answer, `500 internal` otherwise. The closure may run more than once.
pub async fn query<T, F>(
    state: &AppState,
    headers: &HeaderMap,
    model: &str,
    scope: Scope<'_>,
    statements: F,
) -> Result<Gated<T>, ApiError>
where
    T: Send,
    F: for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<T, sqlx::Error>> + Send + Sync,
{
    let gated = read(state, headers, model, scope, &InTransaction(statements)).await?;
    Ok(Gated { data: gated.data?, token: gated.token })
}

/// The request's state and headers, for gated reads in a handler: `gate.query(...)` /
/// `gate.read(...)` are [`query`] / [`read`]. Extracted from any router state the gateway's
/// [`AppState`] can be taken from ([`FromRef`]).
#[derive(Clone)]
pub struct Gate {
    pub state: AppState,
    pub headers: HeaderMap,
}

impl<S> FromRequestParts<S> for Gate
where
    AppState: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Gate, Self::Rejection> {
        Ok(Gate { state: AppState::from_ref(state), headers: parts.headers.clone() })
    }
}

impl Gate {
    /// [`query`] for this request.
    pub async fn query<T, F>(&self, model: &str, scope: Scope<'_>, statements: F) -> Result<Gated<T>, ApiError>
    where
        T: Send,
        F: for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<T, sqlx::Error>> + Send + Sync,
    {
        query(&self.state, &self.headers, model, scope, statements).await
    }

    /// [`read`] for this request.
    pub async fn read<S: Snapshot>(
        &self,
        model: &str,
        scope: Scope<'_>,
        snapshot: &S,
    ) -> Result<Gated<S::Data>, ApiError> {
        read(&self.state, &self.headers, model, scope, snapshot).await
    }
}

/// A covered attempt's result.
struct Served<T> {
    data: T,
    refreshed: CausalPast,
}

/// An uncovered attempt: the gaps, the model as gated, and whether it has state.
struct Uncovered {
    gaps: Vec<GateGap>,
    shape: ModelShape,
    recorded: bool,
}

/// A gated read of `model` for the request's session: `snapshot` read as often as it takes
/// (see the module's documentation), its data served with the refreshed token once its clock
/// rows cover the session. `404 unknown-model` for a model not configured; the session's
/// refusals (`400 token-*`, `403`, `401`) as for every route.
pub async fn read<S: Snapshot>(
    state: &AppState,
    headers: &HeaderMap,
    model_name: &str,
    scope: Scope<'_>,
    snapshot: &S,
) -> Result<Gated<S::Data>, ApiError> {
    let now = session::unix_now();
    let caller = session::open_session(state, headers, now).await?;
    read_as(state, &caller, now, model_name, scope, snapshot).await
}

/// [`read`] for a caller whose session is already open (a route that authorizes the caller
/// before reading).
pub async fn read_as<S: Snapshot>(
    state: &AppState,
    caller: &session::Caller,
    now: u64,
    model_name: &str,
    scope: Scope<'_>,
    snapshot: &S,
) -> Result<Gated<S::Data>, ApiError> {
    let model = state.model(model_name)?;
    // What the client keeps, and what this read must prove: the token less the upstream
    // pairs found discarded at the first uncovered attempt.
    let mut token = session::sanitize(state, &caller.past).await?;
    let mut demand = known_demand(state, &token).await;

    let started = Instant::now();
    let deadline = started + state.config.settings.read_wait();
    let mut log_starts_checked = false;
    // Held while waiting: at most `max_waiting_reads` reads of a model wait at once.
    let mut waiting = None;
    // The model's shared re-checks, once the first attempt found the read not covered.
    let mut feed: Option<feed::Waiting> = None;
    loop {
        state.metrics.add(Metric::GateChecksTotal, &[("model", &model.name)], 1.0);
        match attempt(state, model, scope, snapshot, &demand, &token).await? {
            Ok(served) => {
                let waited = started.elapsed();
                state.metrics.observe(Metric::ReadWaitSeconds, &[("model", &model.name)], waited.as_secs_f64());
                let waited_label = if waited > Duration::from_millis(1) { "yes" } else { "no" };
                state.metrics.add(Metric::ReadsTotal, &[("model", &model.name), ("waited", waited_label)], 1.0);
                let token = session::reseal(state, caller, served.refreshed, now)?;
                return Ok(Gated { data: served.data, token });
            }
            Err(uncovered) => {
                // Upstream entries below the log start are pruned from clocks: once the log
                // start shows it, stop demanding such pairs before calling them gaps (the
                // token keeps them). This model's received channels are never pruned from
                // clocks: a gap there is real — the owner is behind or refused.
                if !log_starts_checked {
                    log_starts_checked = true;
                    let discarded = discarded(state, &uncovered).await;
                    if !discarded.is_empty() {
                        demand = demand.retain(|c, _| !discarded.iter().any(|d| d.channel == c));
                        token = token.retain(|c, _| !discarded.iter().any(|d| d.channel == c && d.from_token));
                        continue;
                    }
                }
                if waiting.is_none() {
                    waiting = Some(state.wait_slot(&model.name).ok_or_else(|| {
                        state.metrics.add(Metric::OverloadedTotal, &[("limit", "max_waiting_reads")], 1.0);
                        ApiError::Overloaded {
                            detail: format!(
                                "{} reads of model {:?} are already waiting for the projector (gateway.max_waiting_reads); retry later",
                                state.config.settings.max_waiting_reads, model.name
                            ),
                            retry_after: state.config.settings.retry_after_s,
                        }
                    })?);
                }
                if Instant::now() >= deadline {
                    state.metrics.add(Metric::NotCoveredTotal, &[("model", &model.name)], 1.0);
                    state.metrics.observe(
                        Metric::ReadWaitSeconds,
                        &[("model", &model.name)],
                        started.elapsed().as_secs_f64(),
                    );
                    tracing::info!(model = %model.name, gaps = uncovered.gaps.len(), "read not covered in time");
                    // The tasks' rows only say why: read once, for the answer.
                    let tasks = load_tasks(state, &model.name).await?;
                    return Err(not_yet_covered(state, &model.name, uncovered, tasks, started.elapsed()));
                }
                // Wait for shared clock rows that cover the read (then attempt: the check and
                // the data in one snapshot), or for the deadline (then attempt once more,
                // and answer 503 with what it finds).
                let feed::Waiting { rows, woken, .. } = feed
                    .get_or_insert_with(|| state.feeds.wait(&model.name).expect("every configured model has a feed"));
                let served = served_tasks(model, scope, &uncovered.shape);
                loop {
                    tokio::select! {
                        changed = rows.changed() => if changed.is_err() { break },
                        // Few reads wait: attempt at once, the attempt reads the clock itself.
                        _ = woken.changed() => break,
                        _ = tokio::time::sleep_until(deadline.into()) => break,
                    }
                    let covered = rows
                        .borrow_and_update()
                        .as_ref()
                        .is_some_and(|rows| gate(&demand, &uncovered.shape, rows, &served).is_covered());
                    if covered {
                        break;
                    }
                }
            }
        }
    }
}

/// The task owning `key` in `model` of `task_count` tasks: the key's partition under the
/// model's key partitioner; `None` when the model routes no key to one task (a topic with
/// `partitioner = "none"`).
pub fn key_owner(model: &ModelConfig, key: &str, task_count: u32) -> Option<u32> {
    model.key_partitioner()?.partition_for_key(key.as_bytes(), task_count)
}

/// The tasks a read is served by: the key's owner, or every task.
fn served_tasks(model: &ModelConfig, scope: Scope<'_>, shape: &ModelShape) -> BTreeSet<u32> {
    match scope {
        Scope::Key(key) => match key_owner(model, key, shape.task_count) {
            Some(owner) => [owner].into(),
            None => (0..shape.task_count).collect(),
        },
        Scope::AllTasks => (0..shape.task_count).collect(),
    }
}

/// The longest a read waits for the listener's barrier before a kept snapshot may serve it;
/// past it the read runs its statement instead.
const KEPT_BARRIER_WAIT: Duration = Duration::from_millis(100);

/// One snapshot: is `demand` covered, and if so the data and `token` refreshed.
async fn attempt<S: Snapshot>(
    state: &AppState,
    model: &ModelConfig,
    scope: Scope<'_>,
    reader: &S,
    demand: &CausalPast,
    token: &CausalPast,
) -> Result<Result<Served<S::Data>, Uncovered>, ApiError> {
    #[cfg(feature = "unsafe-ungated-reads")]
    let (keeping, unchecked) = (!ungated::on(), ungated::kept_unchecked());
    #[cfg(not(feature = "unsafe-ungated-reads"))]
    let (keeping, unchecked) = (true, false);
    // A snapshot kept in memory serves the read if its own rows cover the session, and if it
    // is still kept once every notification committed before this read has been heard (a
    // barrier on the listener's connection, shared by the reads that ask meanwhile): so a
    // change committed before the read arrived — a step, or an edit by hand — is never
    // hidden by a snapshot taken before it.
    // The rules are the core's (`parsley::kept`): what is kept is servable (`reader.kept`
    // answers only with a snapshot whose generation is current and that is young enough).
    let consult = |kept: Option<&KeptSnapshot<S::Data>>, barrier_passed: bool| {
        let served = kept.map(|k| served_tasks(model, scope, &k.shape)).unwrap_or_default();
        let view = kept.map(|k| KeptView { servable: true, shape: &k.shape, rows: &k.rows, served: &served });
        let may_keep = state.notifier.may_keep();
        if unchecked {
            // The checker's sabotage: what is kept serves without its gate (after the barrier).
            return match kept {
                Some(_) if may_keep && !barrier_passed => Consult::Barrier,
                Some(k) if may_keep => Consult::Serve { refreshed: refresh(token, &k.shape, &k.rows, &served) },
                _ => Consult::Read,
            };
        }
        KeptRules::SHIPPED.consult(view, may_keep, barrier_passed, demand, token)
    };
    if keeping {
        let mut kept = reader.kept(state, &model.name);
        let mut verdict = consult(kept.as_ref(), false);
        if verdict == Consult::Barrier && state.notifier.caught_up(KEPT_BARRIER_WAIT).await {
            kept = reader.kept(state, &model.name);
            verdict = consult(kept.as_ref(), true);
        }
        if let (Consult::Serve { refreshed }, Some(kept)) = (verdict, kept) {
            state.metrics.add(Metric::ReadCacheTotal, &[("model", &model.name), ("result", "hit")], 1.0);
            return Ok(Ok(Served { data: kept.data, refreshed }));
        }
    }
    // The row the rows are chosen by: the cached one (none yet: the broker's description is
    // the likely shape, checked like any other).
    let mut known = state.shapes.get(&model.name);
    let mut shape = model_shape(state, model, known.as_deref().map(|k| &k.row));
    let generation = keeping.then(|| reader.generation(state, &model.name, &shape)).flatten();
    let mut moved = false;
    let mut clock = clock_scope(model, scope, &shape, demand);
    let snapshot = loop {
        let inputs = GateInputs { clock, cached: known.as_ref().map(|k| k.shape) };
        // The gate's own verdict over what the snapshot records, for a reader that checks it
        // before reading its data: the same judgement as below, stale shapes included.
        let covers = |recorded: &RecordedModel, rows: &[ClockRow]| {
            let row = match recorded {
                RecordedModel::Unchanged => known.as_deref().map(|k| &k.row),
                RecordedModel::Absent => None,
                RecordedModel::Read { row, .. } => Some(row),
            };
            let recorded_shape = model_shape(state, model, row);
            if recorded_shape != shape && inputs.clock != ClockScope::All {
                return false;
            }
            #[cfg(feature = "unsafe-ungated-reads")]
            if ungated::on() {
                return true;
            }
            gate(demand, &recorded_shape, rows, &served_tasks(model, scope, &recorded_shape)).is_covered()
        };
        let snapshot = reader.read_gated(state, &model.name, &inputs, &covers).await?;
        let recorded = match &snapshot.model {
            RecordedModel::Unchanged => known.clone(),
            RecordedModel::Absent => None,
            RecordedModel::Read { shape, row } => Some(Arc::new(Recorded { shape: *shape, row: row.clone() })),
        };
        if !matches!(snapshot.model, RecordedModel::Unchanged) {
            state.shapes.put(&model.name, recorded.clone());
        }
        let recorded_shape = model_shape(state, model, recorded.as_deref().map(|r| &r.row));
        let stale = recorded_shape != shape;
        moved |= stale;
        (known, shape) = (recorded, recorded_shape);
        // Rows chosen by the shape this snapshot records (or all of them) are what the gate
        // needs; rows chosen by a stale shape may not be: read again, every row.
        if !stale || inputs.clock == ClockScope::All {
            break snapshot;
        }
        clock = ClockScope::All;
    };
    let served = served_tasks(model, scope, &shape);
    let verdict = gate(demand, &shape, &snapshot.clock, &served);
    #[cfg(feature = "unsafe-ungated-reads")]
    let verdict = if ungated::on() { Verdict::Covered } else { verdict };
    match verdict {
        Verdict::Covered => {
            let refreshed = refresh(token, &shape, &snapshot.clock, &served);
            // Kept only when its rows were chosen by the shape the generation was read for.
            if let (Some(generation), false, true) = (generation, moved, snapshot.model.is_recorded()) {
                state.metrics.add(Metric::ReadCacheTotal, &[("model", &model.name), ("result", "miss")], 1.0);
                reader.keep(state, &model.name, generation, &shape, &snapshot.clock, &snapshot.data);
            }
            Ok(Ok(Served { data: snapshot.data, refreshed }))
        }
        Verdict::NotCovered { gaps } => Ok(Err(Uncovered { gaps, shape, recorded: snapshot.model.is_recorded() })),
    }
}

/// The clock rows a read needs: for one key, those its owner's gate and refresh read (see
/// [`ClockScope::Owner`]); a read served by every task reads every row.
fn clock_scope(model: &ModelConfig, scope: Scope<'_>, shape: &ModelShape, demand: &CausalPast) -> ClockScope {
    let owner = match scope {
        Scope::Key(key) => key_owner(model, key, shape.task_count),
        Scope::AllTasks => None,
    };
    match owner {
        Some(owner) => ClockScope::Owner {
            owner,
            received: shape.received_topics.iter().copied().collect(),
            partitions: demand.iter().map(|(c, _)| c.partition).collect::<BTreeSet<u32>>().into_iter().collect(),
        },
        None => ClockScope::All,
    }
}

/// The model's task rows, for a 503's diagnosis.
async fn load_tasks(state: &AppState, model: &str) -> Result<Vec<TaskRow>, ApiError> {
    let retry_after = state.config.settings.retry_after_s;
    let db = |e: StoreError| store_errors::failed(e, "the read", retry_after, None);
    let mut conn = state.pool.acquire().await.map_err(|e| db(e.into()))?;
    ordering::load_tasks(&mut conn, model).await.map_err(db)
}

/// The model as the projector recorded it (topic identities and task count); for a model
/// with no state yet, as the broker describes its topics now.
fn model_shape(state: &AppState, model: &ModelConfig, recorded: Option<&ModelRow>) -> ModelShape {
    let mut received_topics = BTreeSet::new();
    for t in &model.topics {
        let id = recorded
            .and_then(|r| r.topics.get(&t.name).copied())
            .or_else(|| state.facts.cached_topic(&t.name).map(|f| f.id));
        received_topics.extend(id);
    }
    let task_count = recorded.map(|r| r.task_count).unwrap_or_else(|| {
        model.topics.iter().find_map(|t| state.facts.cached_topic(&t.name)).map_or(1, |f| f.partitions.max(1))
    });
    ModelShape { received_topics, task_count }
}

/// The token less the upstream pairs the cached log starts already show passed (what
/// [`discarded`] would find at the first uncovered attempt, without the attempt).
async fn known_demand(state: &AppState, token: &CausalPast) -> CausalPast {
    let mut passed = Vec::new();
    for (channel, position) in token.iter() {
        let Some(log_start) = state.facts.cached_offsets(&channel).and_then(|o| o.log_start) else { continue };
        if position >= log_start {
            continue;
        }
        if let Ok(Some(name)) = state.facts.topic_name(&channel.topic).await {
            if read_stops_demanding(state.receives(&name), position, Some(log_start)) {
                passed.push(channel);
            }
        }
    }
    if passed.is_empty() {
        token.clone()
    } else {
        token.clone().retain(|c, _| !passed.contains(&c))
    }
}

/// A pair the read stops demanding, and whether the token drops it too.
struct Discarded {
    channel: ChannelId,
    from_token: bool,
}

/// Upstream gap channels (ones this model does not receive) whose pair nobody can deliver
/// any more: the topic no longer resolves (the token drops the pair too), or the pair is
/// below the log start ([`read_stops_demanding`]: clocks prune such entries, so the
/// read stops demanding it — the token keeps it, since it is stamped on the session's writes
/// and a receiver that has not read the position must still wait for it). The log start is
/// the cached one when that already proves the pair passed (log starts only grow), else
/// re-read from the broker.
async fn discarded(state: &AppState, uncovered: &Uncovered) -> Vec<Discarded> {
    let mut out = Vec::new();
    for gap in &uncovered.gaps {
        if uncovered.shape.owner_of(&gap.channel).is_some() {
            continue;
        }
        let name = match state.facts.topic_name(&gap.channel.topic).await {
            Ok(None) => {
                out.push(Discarded { channel: gap.channel, from_token: true });
                state.metrics.add(Metric::TokenPairsPrunedTotal, &[("reason", "topic-gone")], 1.0);
                continue;
            }
            Ok(Some(name)) => name,
            Err(_) => continue,
        };
        let received = state.receives(&name);
        let cached = state.facts.cached_offsets(&gap.channel).and_then(|o| o.log_start);
        let passed = if read_stops_demanding(received, gap.required, cached) {
            true
        } else {
            // Still in the log, or not known: keep demanding it (a 503 names the gap).
            match state.facts.refresh_offsets(gap.channel, &name).await {
                Ok(offsets) => read_stops_demanding(received, gap.required, offsets.log_start),
                Err(_) => false,
            }
        };
        if passed {
            out.push(Discarded { channel: gap.channel, from_token: false });
        }
    }
    out
}

/// The 503: every gap (topic name, partition, required, recorded) and the status of the
/// involved tasks that are refused, failing or missing — their diagnosis and last error
/// only with `gateway.public_diagnostics`.
fn not_yet_covered(
    state: &AppState,
    model: &str,
    uncovered: Uncovered,
    task_rows: Vec<TaskRow>,
    waited: Duration,
) -> ApiError {
    let name_of = |id: &TopicId| state.facts.cached_name(id);
    let mut involved = BTreeSet::new();
    let gaps: Vec<Value> = uncovered
        .gaps
        .iter()
        .map(|g| {
            involved.extend(g.tasks.iter().copied());
            json!({
                "topic": name_of(&g.channel.topic),
                "topic_id": g.channel.topic.to_string(),
                "partition": g.channel.partition,
                "required": g.required,
                "recorded": g.recorded,
                "tasks": g.tasks,
            })
        })
        .collect();
    let mut tasks = Vec::new();
    // Tasks nobody runs: their lease passed (or was handed back) and no instance took them.
    let mut unowned = Vec::new();
    for t in involved {
        match task_rows.iter().find(|r| r.task == t) {
            None => tasks.push(json!({"task": t, "status": "missing"})),
            Some(row) => match row.status {
                _ if !row.leased() => {
                    unowned.push(match row.lease_remaining_ms {
                        Some(ms) => format!("task {t}'s lease (owner {:?}) expired {} ms ago", row.owner, -ms),
                        None => format!("task {t} is held by no instance"),
                    });
                    tasks.push(json!({
                        "task": t,
                        "status": row.status.as_str(),
                        "owner": row.owner,
                        "lease": crate::ops::lease_json(row),
                        "last_step_ms_ago": row.since_step_ms,
                    }));
                }
                TaskStatus::Running => {}
                TaskStatus::Failing => tasks.push(json!({
                    "task": t,
                    "status": "failing",
                    "failures": row.failures,
                    "last_error": row.last_error,
                })),
                TaskStatus::Refused => tasks.push(json!({
                    "task": t,
                    "status": "refused",
                    "reason": row.refusal.as_ref().map(|r| r.reason.as_str()),
                    "diagnosis": row.refusal.as_ref().map(|r| r.diagnosis.clone()),
                    "channel": row.refusal.as_ref().and_then(|r| r.channel).map(|c| json!({
                        "topic": name_of(&c.topic),
                        "topic_id": c.topic.to_string(),
                        "partition": c.partition,
                    })),
                    "position": row.refusal.as_ref().and_then(|r| r.position),
                })),
            },
        }
    }
    // The free text of a refusal or a failure can quote records and database messages: it
    // is for the admin listener (`/v1/status`) unless `gateway.public_diagnostics` says
    // otherwise. Reasons, task numbers and gaps stay.
    if !state.config.settings.public_diagnostics {
        for task in tasks.iter_mut().filter_map(Value::as_object_mut) {
            task.remove("diagnosis");
            task.remove("last_error");
        }
    }
    let waited_ms = waited.as_millis() as u64;
    let detail = if uncovered.recorded && !unowned.is_empty() {
        format!(
            "the projection of model {model:?} does not yet reflect this session ({} gap(s)) after waiting {waited_ms} ms, \
             and nobody is taking it further: {} and no instance has taken it over (is a projector instance running?); retry later",
            gaps.len(),
            unowned.join(", ")
        )
    } else if uncovered.recorded {
        format!(
            "the projection of model {model:?} does not yet reflect this session ({} gap(s)) after waiting {waited_ms} ms; retry later",
            gaps.len()
        )
    } else {
        format!("model {model:?} has no state in the database yet (is its projector running?); waited {waited_ms} ms")
    };
    let mut problem = Problem::new(ProblemType::NotYetCovered, detail)
        .with("model", json!(model))
        .with("waited_ms", json!(waited_ms))
        .with("gaps", Value::Array(gaps))
        .with("tasks", Value::Array(tasks));
    problem.retry_after = Some(state.config.settings.retry_after_s);
    ApiError::NotYetCovered(Box::new(problem))
}
/// Reads served without the gate, stale data and all: the broken gateway that proves
/// `parsley-check` is not vacuous. Only in a build with the test feature
/// `unsafe-ungated-reads`, and only once the process switched it on; never in a release.
#[cfg(feature = "unsafe-ungated-reads")]
pub mod ungated {
    use std::sync::atomic::{AtomicBool, Ordering};

    static ON: AtomicBool = AtomicBool::new(false);

    /// Every read of this process from now on skips the gate (`true`) or is gated again.
    pub fn serve_ungated_reads(on: bool) {
        ON.store(on, Ordering::SeqCst);
    }

    pub(crate) fn on() -> bool {
        ON.load(Ordering::SeqCst)
    }

    static KEPT_UNCHECKED: AtomicBool = AtomicBool::new(false);

    /// Every kept snapshot of this process from now on is served without the gate over its
    /// rows (`true`), or only to the sessions its rows cover again: the broken cache that
    /// proves `parsley-check` sees what kept snapshots would break.
    pub fn serve_kept_snapshots_unchecked(on: bool) {
        KEPT_UNCHECKED.store(on, Ordering::SeqCst);
    }

    pub(crate) fn kept_unchecked() -> bool {
        KEPT_UNCHECKED.load(Ordering::SeqCst)
    }
}
