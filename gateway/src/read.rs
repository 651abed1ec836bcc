//! The gated read paths: `GET /v1/models/{model}/documents/{key}` (served by the task that
//! owns the key) and `GET /v1/models/{model}/documents?limit=&after=` (served by every
//! task).
//!
//! Each attempt is one `REPEATABLE READ, READ ONLY` transaction: it fetches the model's
//! clock rows, asks the core's [`gate`] whether they cover the session, and only then reads
//! the documents — in the same snapshot, so the rows served are the rows the clock
//! describes — and computes the refreshed token with the core's [`refresh`]. When the clock
//! does not cover the session the read waits, woken by the projector's `NOTIFY` (and a
//! re-check timer), until `gateway.read_wait_ms` has passed; then it answers 503 with every
//! gap. It never serves data the clock has not proven.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use parsley::gate::{gate, refresh, ClockRow, GateGap, ModelShape, Verdict};
use parsley::murmur2::partition_for_key;
use parsley::{CausalPast, ChannelId, TopicId};
use parsley_projector::config::ModelConfig;
use parsley_projector::store::{self, ModelRow, TaskRow, TaskStatusKind};
use serde_json::{json, Value};
use sqlx::{Postgres, Row as _, Transaction};

use crate::app::AppState;
use crate::problem::{ApiError, Problem};
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

/// An uncovered attempt: the gaps, the model as gated, and the involved tasks' rows.
struct Uncovered {
    gaps: Vec<GateGap>,
    shape: ModelShape,
    recorded: bool,
    tasks: Vec<TaskRow>,
}

/// Opens the gate's transaction: the clock check and the data read share one snapshot
/// (`REPEATABLE READ`), and nothing in it writes (`READ ONLY`).
pub const GATE_BEGIN: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY";

pub async fn get_document(
    State(state): State<AppState>,
    path: Result<Path<(String, String)>, PathRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Path((model, key)) = path.map_err(|r| ApiError::InvalidPath(r.body_text()))?;
    gated_read(&state, &model, Target::One { key }, &headers).await
}

pub async fn get_collection(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
    query: Result<Query<BTreeMap<String, String>>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Path(model) = path.map_err(|r| ApiError::InvalidPath(r.body_text()))?;
    let Query(query) = query.map_err(|r| ApiError::InvalidQuery(r.body_text()))?;
    let target = parse_page(&query)?;
    gated_read(&state, &model, target, &headers).await
}

/// `limit` (1..=1000, default 100) and `after` (a key); nothing else.
pub fn parse_page(query: &BTreeMap<String, String>) -> Result<Target, ApiError> {
    if let Some(unknown) = query.keys().find(|k| !matches!(k.as_str(), "limit" | "after")) {
        return Err(ApiError::InvalidQuery(format!("unknown parameter {unknown:?} (expected limit, after)")));
    }
    let limit = match query.get("limit") {
        None => DEFAULT_LIMIT,
        Some(v) => match v.parse::<u32>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => n,
            _ => {
                return Err(ApiError::InvalidQuery(format!(
                    "limit must be a whole number from 1 to {MAX_LIMIT}, not {v:?}"
                )))
            }
        },
    };
    Ok(Target::Page { after: query.get("after").cloned(), limit })
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
    let mut demand = token.clone();

    // Subscribe before the first check: a step committed after the check still wakes us.
    let mut woken = state.notifier.subscribe(&model.name).expect("every configured model has a notifier");
    let started = Instant::now();
    let deadline = started + state.config.settings.read_wait();
    let mut log_starts_checked = false;
    loop {
        woken.borrow_and_update();
        state.metrics.add("parsley_gateway_gate_checks_total", &[("model", &model.name)], 1.0);
        match attempt(state, model, &target, &demand, &token).await? {
            Ok(served) => {
                let waited = started.elapsed();
                state.metrics.observe(
                    "parsley_gateway_read_wait_seconds",
                    &[("model", &model.name)],
                    waited.as_secs_f64(),
                );
                let waited_label = if waited > Duration::from_millis(1) { "yes" } else { "no" };
                state.metrics.add(
                    "parsley_gateway_reads_total",
                    &[("model", &model.name), ("waited", waited_label)],
                    1.0,
                );
                let token = session::reseal(state, &caller, served.refreshed, now)?;
                return Ok(respond(&target, served.body, token));
            }
            Err(uncovered) => {
                // Upstream entries below the log start are pruned from clocks: after
                // re-reading the log start, stop demanding such pairs before calling them
                // gaps. (This model's received channels are never pruned from clocks: a gap
                // there is real — the owner is behind or refused.)
                if !log_starts_checked {
                    log_starts_checked = true;
                    let discarded = discarded(state, &uncovered).await;
                    if !discarded.is_empty() {
                        demand = demand.retain(|c, _| !discarded.iter().any(|d| d.channel == c));
                        token = token.retain(|c, _| !discarded.iter().any(|d| d.channel == c && d.from_token));
                        continue;
                    }
                }
                let now_i = Instant::now();
                if now_i >= deadline {
                    state.metrics.add("parsley_gateway_not_covered_total", &[("model", &model.name)], 1.0);
                    state.metrics.observe(
                        "parsley_gateway_read_wait_seconds",
                        &[("model", &model.name)],
                        started.elapsed().as_secs_f64(),
                    );
                    tracing::info!(model = %model.name, gaps = uncovered.gaps.len(), "read not covered in time");
                    return Err(not_yet_covered(state, &model.name, uncovered, started.elapsed()));
                }
                let nap = state.config.settings.recheck().min(deadline - now_i);
                tokio::select! {
                    _ = woken.changed() => {}
                    _ = tokio::time::sleep(nap) => {}
                }
            }
        }
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
                "not-found",
                "Document not found",
                StatusCode::NOT_FOUND,
                "no document with this key exists in a snapshot that covers the session",
            )
            .with("key", json!(key));
            let mut r = problem.into_response();
            r.headers_mut().insert(SESSION_HEADER, token);
            r
        }
    }
}

/// One gate transaction: is `demand` covered, and if so the documents and `token` refreshed.
async fn attempt(
    state: &AppState,
    model: &ModelConfig,
    target: &Target,
    demand: &CausalPast,
    token: &CausalPast,
) -> Result<Result<Served, Uncovered>, ApiError> {
    let db = |e: anyhow::Error| database_unavailable(state, e);
    // One snapshot for the check and the data read, opened in one round trip.
    let mut tx =
        state.pool.begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY").await.map_err(|e| db(e.into()))?;
    let recorded = store::load_model(&mut tx, &model.name).await.map_err(db)?;
    let shape = model_shape(state, model, recorded.as_ref());
    let rows: Vec<ClockRow> = store::clock_rows(&mut tx, &model.name).await.map_err(db)?;
    let served: BTreeSet<u32> = match target {
        Target::One { key } => [partition_for_key(key.as_bytes(), shape.task_count)].into(),
        Target::Page { .. } => (0..shape.task_count).collect(),
    };
    match gate(demand, &shape, &rows, &served) {
        Verdict::Covered => {
            let body = read_documents(&mut tx, &model.name, target).await.map_err(db)?;
            let refreshed = refresh(token, &shape, &rows, &served);
            tx.commit().await.map_err(|e| db(e.into()))?;
            Ok(Ok(Served { body, refreshed }))
        }
        Verdict::NotCovered { gaps } => {
            let tasks = store::load_tasks(&mut tx, &model.name).await.map_err(db)?;
            tx.commit().await.map_err(|e| db(e.into()))?;
            Ok(Err(Uncovered { gaps, shape, recorded: recorded.is_some(), tasks }))
        }
    }
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

async fn read_documents(
    tx: &mut Transaction<'static, Postgres>,
    model: &str,
    target: &Target,
) -> anyhow::Result<Option<Value>> {
    match target {
        Target::One { key } => {
            let row = sqlx::query("SELECT doc, version FROM projection.documents WHERE model = $1 AND key = $2")
                .bind(model)
                .bind(key)
                .fetch_optional(&mut **tx)
                .await?;
            Ok(row.map(|r| json!({"key": key, "document": r.get::<Value, _>(0), "version": r.get::<i64, _>(1)})))
        }
        Target::Page { after, limit } => {
            let rows = sqlx::query(
                "SELECT key, doc, version FROM projection.documents
                 WHERE model = $1 AND ($2::text IS NULL OR key > $2)
                 ORDER BY key LIMIT $3",
            )
            .bind(model)
            .bind(after.as_deref())
            .bind(i64::from(*limit) + 1)
            .fetch_all(&mut **tx)
            .await?;
            let more = rows.len() > *limit as usize;
            let documents: Vec<Value> = rows
                .iter()
                .take(*limit as usize)
                .map(|r| {
                    json!({"key": r.get::<String, _>(0), "document": r.get::<Value, _>(1), "version": r.get::<i64, _>(2)})
                })
                .collect();
            let next = if more { documents.last().map(|d| d["key"].clone()) } else { None };
            Ok(Some(json!({"documents": documents, "next": next})))
        }
    }
}

/// A pair the read stops demanding, and whether the token drops it too.
struct Discarded {
    channel: ChannelId,
    from_token: bool,
}

/// Upstream gap channels (ones this model does not receive) whose pair the log no longer
/// holds: the topic no longer resolves, or the pair is below the re-read log start. Clocks
/// prune such entries, so the read stops demanding them. The token drops them too, except a
/// pair below the log start on a channel another configured model receives: its owner keeps
/// that entry, and may still hold the record ([`session::prunable_below_log_start`]).
async fn discarded(state: &AppState, uncovered: &Uncovered) -> Vec<Discarded> {
    let mut out = Vec::new();
    for gap in &uncovered.gaps {
        if uncovered.shape.owner_of(&gap.channel).is_some() {
            continue;
        }
        let found = match state.facts.topic_name(&gap.channel.topic).await {
            Ok(None) => Some((true, "topic-gone")),
            Ok(Some(name)) => match state.facts.refresh_offsets(gap.channel, &name).await {
                Ok(offsets) if offsets.log_start.is_some_and(|s| gap.required < s) => {
                    let received = state.receives(&name);
                    let from_token = session::prunable_below_log_start(received, gap.required, offsets.log_start);
                    Some((from_token, "below-log-start"))
                }
                // Still in the log, or not known: keep demanding it (a 503 names the gap).
                _ => None,
            },
            Err(_) => None,
        };
        if let Some((from_token, why)) = found {
            out.push(Discarded { channel: gap.channel, from_token });
            if from_token {
                state.metrics.add("parsley_gateway_token_pairs_pruned_total", &[("reason", why)], 1.0);
            }
        }
    }
    out
}

fn database_unavailable(state: &AppState, e: anyhow::Error) -> ApiError {
    tracing::warn!(error = %format!("{e:#}"), "database request failed");
    ApiError::Unavailable {
        what: "Postgres",
        detail: "the database did not answer the read".into(),
        retry_after: state.config.settings.retry_after_s,
    }
}

/// The 503: every gap (topic name, partition, required, recorded) and the status of the
/// involved tasks that are refused, failing or missing.
fn not_yet_covered(state: &AppState, model: &str, uncovered: Uncovered, waited: Duration) -> ApiError {
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
    for t in involved {
        match uncovered.tasks.iter().find(|r| r.task == t) {
            None => tasks.push(json!({"task": t, "status": "missing"})),
            Some(row) => match row.status {
                TaskStatusKind::Running => {}
                TaskStatusKind::Failing => tasks.push(json!({
                    "task": t,
                    "status": "failing",
                    "failures": row.failures,
                    "last_error": row.last_error,
                })),
                TaskStatusKind::Refused => tasks.push(json!({
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
    let waited_ms = waited.as_millis() as u64;
    let detail = if uncovered.recorded {
        format!(
            "the projection of model {model:?} does not yet reflect this session ({} gap(s)) after waiting {waited_ms} ms; retry later",
            gaps.len()
        )
    } else {
        format!("model {model:?} has no state in the database yet (is its projector running?); waited {waited_ms} ms")
    };
    let mut problem = Problem::new("not-yet-covered", "Not yet covered", StatusCode::SERVICE_UNAVAILABLE, detail)
        .with("model", json!(model))
        .with("waited_ms", json!(waited_ms))
        .with("gaps", Value::Array(gaps))
        .with("tasks", Value::Array(tasks));
    problem.retry_after = Some(state.config.settings.retry_after_s);
    ApiError::NotYetCovered(Box::new(problem))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn pages_are_bounded() {
        assert_eq!(parse_page(&q(&[])).unwrap(), Target::Page { after: None, limit: 100 });
        assert_eq!(
            parse_page(&q(&[("limit", "1000"), ("after", "k")])).unwrap(),
            Target::Page { after: Some("k".into()), limit: 1000 }
        );
        for bad in [&[("limit", "0")][..], &[("limit", "1001")], &[("limit", "x")], &[("offset", "3")]] {
            assert!(matches!(parse_page(&q(bad)), Err(ApiError::InvalidQuery(_))), "{bad:?}");
        }
    }
}
