//! The gated read paths: `GET /v1/models/{model}/documents/{key}` (served by the task that
//! owns the key) and `GET /v1/models/{model}/documents?limit=&after=` (served by every
//! task).
//!
//! Each attempt is one statement, one round trip ([`documents::gated_document`],
//! [`documents::gated_page`]): the model's recorded row, the clock rows the core's [`gate`]
//! and [`refresh`] read, and the document(s) — one snapshot even at `READ COMMITTED`, so the
//! rows served are the rows the clock describes. The gate then runs here over those rows;
//! only if it covers the session are the documents served from the same result, with the
//! token refreshed. When the clock does not cover the session the read waits, woken by the
//! projector's `NOTIFY` (and a re-check timer), until `gateway.read_wait_ms` has passed;
//! then it answers 503 with every gap. It never serves data the clock has not proven.
//!
//! Which clock rows a single-key read fetches depends on the model's shape (its width names
//! the key's owner, its received topics tell upstream channels apart), so the shape is
//! cached per model ([`Shapes`]). It is never trusted past a change: every statement also
//! returns the model's recorded row, and when the shape that row gives is not the one the
//! rows were chosen by, the cache takes the new shape and the attempt is made again with
//! every clock row of the model.
//!
//! A key or cursor no document can have (NUL, not UTF-8 after percent-decoding, longer than
//! `max_key_bytes`) is refused before the database is asked; a database error is an outage
//! (503) only when the database did not answer ([`crate::database`]). At most
//! `max_waiting_reads` reads of a model wait at once; beyond that an uncovered read is
//! refused `503 overloaded` at once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use axum::extract::path::ErrorKind;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use parsley::gate::{gate, refresh, GateGap, ModelShape, Verdict};
use parsley::murmur2::partition_for_key;
use parsley::{CausalPast, ChannelId, TopicId};
use parsley_store::config::ModelConfig;
use parsley_store::documents::{self, ClockScope, Document, GatedSnapshot};
use parsley_store::ordering::{self as store, ModelRow, TaskRow, TaskStatus};
use serde_json::{json, Value};

use crate::app::AppState;
use crate::database;
use crate::feed;
use crate::metrics::Metric;
use crate::problem::{ApiError, Problem, ProblemType};
use crate::session::{self, SESSION_HEADER};

/// Default and largest page of a collection read.
pub const DEFAULT_LIMIT: u32 = 100;
pub const MAX_LIMIT: u32 = 1000;

/// What a read asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    One { key: String },
    Page { after: Option<String>, limit: u32 },
}

/// A covered read's result.
struct Served {
    /// `None`: a single document that does not exist (coverage proven).
    body: Option<Value>,
    refreshed: CausalPast,
}

/// An uncovered attempt: the gaps, the model as gated, and whether it has state.
struct Uncovered {
    gaps: Vec<GateGap>,
    shape: Arc<ModelShape>,
    recorded: bool,
}

/// Per model, the shape the last gated read's statement found recorded: the read's next
/// statement picks its clock rows by it, and checks it against the row it returns.
#[derive(Debug, Default)]
pub struct Shapes {
    models: RwLock<BTreeMap<String, Arc<ModelShape>>>,
}

impl Shapes {
    fn get(&self, model: &str) -> Option<Arc<ModelShape>> {
        self.models.read().unwrap_or_else(|e| e.into_inner()).get(model).cloned()
    }

    fn put(&self, model: &str, shape: Arc<ModelShape>) {
        self.models.write().unwrap_or_else(|e| e.into_inner()).insert(model.to_string(), shape);
    }
}

pub async fn get_document(
    State(state): State<AppState>,
    path: Result<Path<(String, String)>, PathRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Path((model, key)) = path.map_err(path_error)?;
    check_key(&key, state.config.settings.max_key_bytes).map_err(ApiError::InvalidKey)?;
    gated_read(&state, &model, Target::One { key }, &headers).await
}

pub async fn get_collection(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Path(model) = path.map_err(path_error)?;
    let target = parse_page(&parse_query(query.as_deref().unwrap_or(""))?, state.config.settings.max_key_bytes)?;
    gated_read(&state, &model, target, &headers).await
}

/// A path that does not decode: a key that is not UTF-8 after percent-decoding is an
/// invalid key; anything else an invalid path.
fn path_error(rejection: PathRejection) -> ApiError {
    if let PathRejection::FailedToDeserializePathParams(e) = &rejection {
        if let ErrorKind::InvalidUtf8InPathParam { key } = e.kind() {
            if key == "key" {
                return ApiError::InvalidKey("the key is not UTF-8 after percent-decoding".into());
            }
        }
    }
    ApiError::InvalidPath(rejection.body_text())
}

/// Whether a key (from a path or a cursor) is one a document can have: no NUL (Postgres
/// `text` cannot hold it), at most `max_key_bytes` bytes. The reason otherwise.
pub fn check_key(key: &str, max_key_bytes: usize) -> Result<(), String> {
    if key.contains('\0') {
        return Err("the key contains NUL (%00), which no document key can hold".into());
    }
    if key.len() > max_key_bytes {
        return Err(format!(
            "the key is {} bytes, longer than any document key (gateway.max_key_bytes = {max_key_bytes})",
            key.len()
        ));
    }
    Ok(())
}

/// Splits a raw query string into its parameters, percent-decoded (`+` is a space). A
/// parameter given twice, a malformed escape or a name or value that is not UTF-8 after
/// decoding is refused, naming the parameter.
pub fn parse_query(raw: &str) -> Result<BTreeMap<String, String>, ApiError> {
    let mut out = BTreeMap::new();
    for pair in raw.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_decode(name)
            .map_err(|why| ApiError::InvalidQuery { parameter: None, detail: format!("a parameter name {why}") })?;
        let value = percent_decode(value).map_err(|why| ApiError::InvalidQuery {
            parameter: Some(name.clone()),
            detail: format!("the value of {name:?} {why}"),
        })?;
        if out.contains_key(&name) {
            return Err(ApiError::InvalidQuery {
                detail: format!("{name:?} is given more than once"),
                parameter: Some(name),
            });
        }
        out.insert(name, value);
    }
    Ok(out)
}

/// Decodes `%XX` escapes and `+`; the error says why it cannot.
fn percent_decode(text: &str) -> Result<String, &'static str> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                // Two hex digits, nothing else (`from_str_radix` alone would take a sign).
                let hex = bytes.get(i + 1..i + 3).filter(|h| h.iter().all(u8::is_ascii_hexdigit));
                let hex = hex.and_then(|h| std::str::from_utf8(h).ok()).ok_or("has a malformed %-escape")?;
                let byte = u8::from_str_radix(hex, 16).map_err(|_| "has a malformed %-escape")?;
                out.push(byte);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| "is not UTF-8 after percent-decoding")
}

/// `limit` (1..=1000, default 100) and `after` (a key; a cursor no document key can be is
/// refused); nothing else.
pub fn parse_page(query: &BTreeMap<String, String>, max_key_bytes: usize) -> Result<Target, ApiError> {
    if let Some(unknown) = query.keys().find(|k| !matches!(k.as_str(), "limit" | "after")) {
        return Err(ApiError::InvalidQuery {
            parameter: Some(unknown.clone()),
            detail: format!("unknown parameter {unknown:?} (expected limit, after)"),
        });
    }
    let limit = match query.get("limit") {
        None => DEFAULT_LIMIT,
        Some(v) => match v.parse::<u32>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => n,
            _ => {
                return Err(ApiError::InvalidQuery {
                    parameter: Some("limit".into()),
                    detail: format!("limit must be a whole number from 1 to {MAX_LIMIT}, not {v:?}"),
                })
            }
        },
    };
    let after = query.get("after").cloned();
    if let Some(a) = &after {
        check_key(a, max_key_bytes).map_err(|why| ApiError::InvalidQuery {
            parameter: Some("after".into()),
            detail: format!("after: {why}"),
        })?;
    }
    Ok(Target::Page { after, limit })
}

async fn gated_read(
    state: &AppState,
    model_name: &str,
    target: Target,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let model = state
        .config
        .shared
        .models
        .iter()
        .find(|m| m.name == model_name)
        .ok_or_else(|| ApiError::UnknownModel(model_name.to_string()))?;
    let now = session::unix_now();
    let caller = session::open_session(state, headers, now)?;
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
        match attempt(state, model, &target, &demand, &token).await? {
            Ok(served) => {
                let waited = started.elapsed();
                state.metrics.observe(Metric::ReadWaitSeconds, &[("model", &model.name)], waited.as_secs_f64());
                let waited_label = if waited > Duration::from_millis(1) { "yes" } else { "no" };
                state.metrics.add(Metric::ReadsTotal, &[("model", &model.name), ("waited", waited_label)], 1.0);
                let token = session::reseal(state, &caller, served.refreshed, now)?;
                return Ok(respond(&target, served.body, token));
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
                let rows = &mut feed
                    .get_or_insert_with(|| {
                        state.feeds.wait(state, &model.name).expect("every configured model has a feed")
                    })
                    .rows;
                let served = served_tasks(&target, &uncovered.shape);
                loop {
                    tokio::select! {
                        changed = rows.changed() => if changed.is_err() { break },
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

/// The tasks a read is served by: the key's owner, or every task for a page.
fn served_tasks(target: &Target, shape: &ModelShape) -> BTreeSet<u32> {
    match target {
        Target::One { key } => [partition_for_key(key.as_bytes(), shape.task_count)].into(),
        Target::Page { .. } => (0..shape.task_count).collect(),
    }
}

fn respond(target: &Target, body: Option<Value>, token: HeaderValue) -> Response {
    match body {
        Some(body) => (StatusCode::OK, [(SESSION_HEADER, token)], Json(body)).into_response(),
        None => {
            let key = match target {
                Target::One { key } => key.as_str(),
                Target::Page { .. } => "",
            };
            let problem = Problem::new(
                ProblemType::NotFound,
                "no document with this key exists in a snapshot that covers the session",
            )
            .with("key", json!(key));
            let mut r = problem.into_response();
            r.headers_mut().insert(SESSION_HEADER, token);
            r
        }
    }
}

/// One gated statement: is `demand` covered, and if so the documents and `token` refreshed.
async fn attempt(
    state: &AppState,
    model: &ModelConfig,
    target: &Target,
    demand: &CausalPast,
    token: &CausalPast,
) -> Result<Result<Served, Uncovered>, ApiError> {
    let cached = state.shapes.get(&model.name);
    // No read yet: the broker's description is the likely shape (checked like any other).
    let mut shape = cached.clone().unwrap_or_else(|| Arc::new(model_shape(state, model, None)));
    let mut scope = clock_scope(target, &shape, demand);
    let snapshot = loop {
        let snapshot = read_snapshot(state, model, target, &scope).await?;
        let recorded = Arc::new(model_shape(state, model, snapshot.model.as_ref()));
        let stale = recorded != shape;
        if stale || cached.is_none() {
            state.shapes.put(&model.name, Arc::clone(&recorded));
        }
        shape = recorded;
        // Rows chosen by the shape this snapshot records (or all of them) are what the gate
        // needs; rows chosen by a stale shape may not be: read again, every row.
        if !stale || scope == ClockScope::All {
            break snapshot;
        }
        scope = ClockScope::All;
    };
    let served = served_tasks(target, &shape);
    let verdict = gate(demand, &shape, &snapshot.clock, &served);
    #[cfg(feature = "unsafe-ungated-reads")]
    let verdict = if ungated::on() { Verdict::Covered } else { verdict };
    match verdict {
        Verdict::Covered => {
            let refreshed = refresh(token, &shape, &snapshot.clock, &served);
            Ok(Ok(Served { body: body(snapshot.data), refreshed }))
        }
        Verdict::NotCovered { gaps } => Ok(Err(Uncovered { gaps, shape, recorded: snapshot.model.is_some() })),
    }
}

/// The clock rows a read needs: for one key, those its owner's gate and refresh read (see
/// [`ClockScope::Owner`]); a page is served by every task and reads every row.
fn clock_scope(target: &Target, shape: &ModelShape, demand: &CausalPast) -> ClockScope {
    match target {
        Target::One { key } => ClockScope::Owner {
            owner: partition_for_key(key.as_bytes(), shape.task_count),
            received: shape.received_topics.iter().copied().collect(),
            partitions: demand.iter().map(|(c, _)| c.partition).collect::<BTreeSet<u32>>().into_iter().collect(),
        },
        Target::Page { .. } => ClockScope::All,
    }
}

/// What a read asks for, as data still to be served.
enum Data {
    One(Option<Document>),
    /// The page with one document more than its limit, if there are more.
    Page {
        documents: Vec<Document>,
        limit: u32,
    },
}

/// The model's row, the clock rows of `scope` and the data, in one statement.
async fn read_snapshot(
    state: &AppState,
    model: &ModelConfig,
    target: &Target,
    scope: &ClockScope,
) -> Result<GatedSnapshot<Data>, ApiError> {
    let retry_after = state.config.settings.retry_after_s;
    let failed = |e: anyhow::Error| {
        // The only values from the client: the key or the cursor.
        let rejected = match target {
            Target::One { .. } => ApiError::InvalidKey("the database cannot hold this key".into()),
            Target::Page { .. } => ApiError::InvalidQuery {
                parameter: Some("after".into()),
                detail: "the database cannot hold this cursor".into(),
            },
        };
        database::failed(e, "the read", retry_after, Some(rejected))
    };
    let mut conn = state.pool.acquire().await.map_err(|e| failed(e.into()))?;
    match target {
        Target::One { key } => {
            let s = documents::gated_document(&mut conn, &model.name, key, scope).await.map_err(failed)?;
            Ok(GatedSnapshot { model: s.model, clock: s.clock, data: Data::One(s.data) })
        }
        Target::Page { after, limit } => {
            let s = documents::gated_page(&mut conn, &model.name, after.as_deref(), i64::from(*limit) + 1)
                .await
                .map_err(failed)?;
            Ok(GatedSnapshot { model: s.model, clock: s.clock, data: Data::Page { documents: s.data, limit: *limit } })
        }
    }
}

/// The answer's body (`None`: no such document).
fn body(data: Data) -> Option<Value> {
    let json_of = |d: Document| json!({"key": d.key, "document": d.doc, "version": d.version});
    match data {
        Data::One(found) => found.map(json_of),
        Data::Page { documents, limit } => {
            let more = documents.len() > limit as usize;
            let documents: Vec<Value> = documents.into_iter().take(limit as usize).map(json_of).collect();
            let next = if more { documents.last().map(|d| d["key"].clone()) } else { None };
            Some(json!({"documents": documents, "next": next}))
        }
    }
}

/// The model's task rows, for a 503's diagnosis.
async fn load_tasks(state: &AppState, model: &str) -> Result<Vec<TaskRow>, ApiError> {
    let retry_after = state.config.settings.retry_after_s;
    let db = |e: anyhow::Error| database::failed(e, "the read", retry_after, None);
    let mut conn = state.pool.acquire().await.map_err(|e| db(e.into()))?;
    store::load_tasks(&mut conn, model).await.map_err(db)
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
            if session::read_stops_demanding(state.receives(&name), position, Some(log_start)) {
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
/// below the log start ([`session::read_stops_demanding`]: clocks prune such entries, so the
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
        let passed = if session::read_stops_demanding(received, gap.required, cached) {
            true
        } else {
            // Still in the log, or not known: keep demanding it (a 503 names the gap).
            match state.facts.refresh_offsets(gap.channel, &name).await {
                Ok(offsets) => session::read_stops_demanding(received, gap.required, offsets.log_start),
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

    pub(super) fn on() -> bool {
        ON.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// The parameter an error names, if it is an invalid query.
    fn parameter(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidQuery { parameter, .. } => parameter,
            other => panic!("not an invalid query: {other:?}"),
        }
    }

    #[test]
    fn pages_are_bounded() {
        assert_eq!(parse_page(&q(&[]), 8).unwrap(), Target::Page { after: None, limit: 100 });
        assert_eq!(
            parse_page(&q(&[("limit", "1000"), ("after", "k")]), 8).unwrap(),
            Target::Page { after: Some("k".into()), limit: 1000 }
        );
        for (bad, named) in [
            (&[("limit", "0")][..], "limit"),
            (&[("limit", "1001")], "limit"),
            (&[("limit", "x")], "limit"),
            (&[("offset", "3")], "offset"),
            (&[("after", "a\0b")], "after"),
            (&[("after", "123456789")], "after"),
        ] {
            assert_eq!(parameter(parse_page(&q(bad), 8).unwrap_err()).as_deref(), Some(named), "{bad:?}");
        }
    }

    #[test]
    fn queries_decode_strictly() {
        assert_eq!(parse_query("").unwrap(), q(&[]));
        assert_eq!(parse_query("after=a%20b+c&limit=5&").unwrap(), q(&[("after", "a b c"), ("limit", "5")]));
        assert_eq!(parse_query("after=%C3%A9").unwrap(), q(&[("after", "é")]));
        assert_eq!(parse_query("after").unwrap(), q(&[("after", "")]));
        assert_eq!(parse_query("after=%00").unwrap(), q(&[("after", "\0")]), "decoded; check_key refuses it");
        for (raw, named) in [
            ("after=%FF", Some("after")),
            ("after=%C3", Some("after")),
            ("after=%", Some("after")),
            ("after=%zz", Some("after")),
            ("after=%é", Some("after")),
            ("after=%+1", Some("after")),
            ("limit=1&limit=2", Some("limit")),
            ("%FF=1", None),
        ] {
            assert_eq!(parameter(parse_query(raw).unwrap_err()).as_deref(), named, "{raw}");
        }
    }

    #[test]
    fn keys_no_document_can_have_are_refused() {
        assert!(check_key("o-17", 8).is_ok());
        assert!(check_key("12345678", 8).is_ok());
        assert!(check_key("123456789", 8).unwrap_err().contains("gateway.max_key_bytes"));
        assert!(check_key("a\0", 8).unwrap_err().contains("NUL"));
    }
}
