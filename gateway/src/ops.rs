//! Operational routes: `/healthz` (the process answers), `/readyz` (Postgres answers, the
//! schema migrations are applied, Kafka answers a metadata request), `/metrics`
//! (Prometheus text) and the admin `GET /v1/status` (every configured model's tasks with
//! their status, refusals, held counts and bytes per channel, each queue head with its
//! blockers, and clock sizes — from SQL aggregates, so a large backlog costs the gateway
//! no memory).

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Context as _;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use parsley::codec;
use parsley::decide::{decide, Blocker, Decision};
use parsley::{ChannelId, Position, TopicId};
use parsley_projector::migrations::MIGRATIONS;
use parsley_projector::store::{self, ModelRow, TaskRow};
use serde_json::{json, Value};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::app::AppState;
use crate::problem::{ApiError, Problem, ProblemType};
use crate::{database, read};

pub async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// The versions of the embedded migrations (`<version>_<description>.sql`).
fn expected_migrations() -> BTreeSet<i64> {
    MIGRATIONS.iter().filter_map(|(name, _)| name.split_once('_').and_then(|(v, _)| v.parse().ok())).collect()
}

/// Each check says which dependency failed in words of its own; the driver's error text
/// (addresses, user names, server messages) goes to the log only, since `/readyz` is public.
pub async fn readyz(State(state): State<AppState>) -> Response {
    let database = match sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(&state.pool).await {
        Ok(_) => Ok(()),
        Err(e) => {
            tracing::warn!(error = %e, "readiness: the database did not answer");
            Err("the database did not answer".to_string())
        }
    };
    let migrations = match &database {
        Err(_) => Err("the database is unreachable".to_string()),
        Ok(()) => match sqlx::query_scalar::<_, i64>("SELECT version FROM public._sqlx_migrations WHERE success")
            .fetch_all(&state.pool)
            .await
        {
            Ok(applied) => {
                let applied: BTreeSet<i64> = applied.into_iter().collect();
                let missing: Vec<i64> = expected_migrations().difference(&applied).copied().collect();
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(format!("migrations not applied: {missing:?} (run `parsley-projector migrate`)"))
                }
            }
            Err(_) => Err("no migrations applied (run `parsley-projector migrate`)".to_string()),
        },
    };
    let kafka = state.facts.reachable().await.map_err(|e| {
        tracing::warn!(error = %format!("{e:#}"), "readiness: the broker did not answer");
        "the broker did not answer a metadata request".to_string()
    });
    let check = |r: &Result<(), String>| match r {
        Ok(()) => json!({"ok": true}),
        Err(e) => json!({"ok": false, "error": e}),
    };
    let checks = json!({"database": check(&database), "migrations": check(&migrations), "kafka": check(&kafka)});
    if database.is_ok() && migrations.is_ok() && kafka.is_ok() {
        Json(json!({"status": "ready", "checks": checks})).into_response()
    } else {
        let mut p = Problem::new(ProblemType::NotReady, "a dependency is not ready").with("checks", checks);
        p.retry_after = Some(state.config.settings.retry_after_s);
        p.into_response()
    }
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    let exposition = state.metrics.exposition();
    ([(header::CONTENT_TYPE, exposition.content_type)], exposition.body).into_response()
}

/// Every configured model's report, read in one read-only snapshot from SQL aggregates: no
/// held record is loaded, only counts, sizes and each queue head's `parsley.causes`.
pub async fn status(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let retry_after = state.config.settings.retry_after_s;
    let db = |e: anyhow::Error| database::failed(e, "the status query", retry_after, None);
    let mut tx = state.pool.begin_with(read::GATE_BEGIN).await.map_err(|e| db(e.into()))?;
    let mut models = Vec::new();
    for model in &state.config.shared.models {
        let report = model_report(&mut tx, &model.name).await.map_err(db)?;
        models.push(match report {
            Some(r) => report_json(&state, &r),
            None => json!({"model": model.name, "state": null}),
        });
    }
    tx.commit().await.map_err(|e| db(e.into()))?;
    Ok(Json(json!({"models": models})))
}

/// One model's status.
struct ModelReport {
    model: String,
    row: ModelRow,
    /// Topic name by ID, as recorded.
    topics: BTreeMap<TopicId, String>,
    tasks: Vec<TaskReport>,
}

/// One task's status.
struct TaskReport {
    row: TaskRow,
    channels: BTreeMap<ChannelId, ChannelReport>,
    clock_width: i64,
    /// Why a queue head's causes could not be read, when one could not.
    unreadable: Option<String>,
}

/// One received channel of a task.
#[derive(Default)]
struct ChannelReport {
    fed_up_to: Option<Position>,
    held: i64,
    held_bytes: i64,
    /// The oldest held position, and how long ago it was received.
    head: Option<Position>,
    oldest_held_age_s: Option<f64>,
    blockers: Vec<Blocker>,
}

impl ChannelReport {
    /// Every position at or below it is delivered or will never yield a record (the
    /// engine's rule: below the head when one is held, else `fed_up_to`).
    fn settled(&self) -> Option<Position> {
        match self.head {
            Some(head) => Some(head - 1),
            None => self.fed_up_to,
        }
    }
}

/// The channels' received positions, held aggregates and queue heads, per task.
const CHANNELS_SQL: &str = "SELECT task, topic_id, partition, fed_up_to FROM parsley.channels WHERE model = $1";
const HELD_SQL: &str = "SELECT task, topic_id, partition, count(*)::bigint, \
     sum(octet_length(headers) + octet_length(causes) + coalesce(octet_length(record_key), 0) \
         + coalesce(octet_length(record_value), 0))::bigint, \
     min(position), extract(epoch FROM now() - min(received_at))::float8 \
     FROM parsley.held WHERE model = $1 GROUP BY task, topic_id, partition";
const HEAD_CAUSES_SQL: &str = "SELECT h.task, h.topic_id, h.partition, h.causes FROM parsley.held h \
     JOIN (SELECT task, topic_id, partition, min(position) AS head FROM parsley.held WHERE model = $1 \
           GROUP BY task, topic_id, partition) m \
       ON h.task = m.task AND h.topic_id = m.topic_id AND h.partition = m.partition AND h.position = m.head \
     WHERE h.model = $1";
const CLOCK_WIDTH_SQL: &str = "SELECT task, count(*)::bigint FROM parsley.clock WHERE model = $1 GROUP BY task";

fn channel_of(topic_id: &Uuid, partition: i32) -> anyhow::Result<ChannelId> {
    let partition = u32::try_from(partition).with_context(|| format!("a stored partition is {partition}"))?;
    Ok(ChannelId::new(store::topic_of(topic_id), partition))
}

fn task_of(task: i32) -> anyhow::Result<u32> {
    u32::try_from(task).with_context(|| format!("a stored task is {task}"))
}

async fn model_report(conn: &mut PgConnection, model: &str) -> anyhow::Result<Option<ModelReport>> {
    let Some(row) = store::load_model(conn, model).await? else { return Ok(None) };
    let topics = row.topics.iter().map(|(name, id)| (*id, name.clone())).collect();
    let mut tasks: BTreeMap<u32, TaskReport> = store::load_tasks(conn, model)
        .await?
        .into_iter()
        .map(|t| (t.task, TaskReport { row: t, channels: BTreeMap::new(), clock_width: 0, unreadable: None }))
        .collect();
    let context = || format!("reading the status of model {model:?}");

    let rows: Vec<(i32, Uuid, i32, i64)> =
        sqlx::query_as(CHANNELS_SQL).bind(model).fetch_all(&mut *conn).await.with_context(context)?;
    for (task, topic_id, partition, fed_up_to) in rows {
        if let Some(t) = tasks.get_mut(&task_of(task)?) {
            t.channels.entry(channel_of(&topic_id, partition)?).or_default().fed_up_to = Some(fed_up_to);
        }
    }
    type HeldRow = (i32, Uuid, i32, i64, Option<i64>, Option<i64>, Option<f64>);
    let rows: Vec<HeldRow> = sqlx::query_as(HELD_SQL).bind(model).fetch_all(&mut *conn).await.with_context(context)?;
    for (task, topic_id, partition, held, bytes, head, age) in rows {
        if let Some(t) = tasks.get_mut(&task_of(task)?) {
            let c = t.channels.entry(channel_of(&topic_id, partition)?).or_default();
            (c.held, c.held_bytes, c.head, c.oldest_held_age_s) = (held, bytes.unwrap_or(0), head, age);
        }
    }
    let heads: Vec<(i32, Uuid, i32, Vec<u8>)> =
        sqlx::query_as(HEAD_CAUSES_SQL).bind(model).fetch_all(&mut *conn).await.with_context(context)?;
    for (task, topic_id, partition, causes) in heads {
        let Some(t) = tasks.get_mut(&task_of(task)?) else { continue };
        let channel = channel_of(&topic_id, partition)?;
        match codec::decode(&causes, usize::MAX) {
            Ok(past) => {
                // The engine's status rule: the head waits for the causes its task has not
                // settled on the channels it receives.
                // Task n receives partition n of each of the model's topics.
                let received: BTreeSet<ChannelId> = row
                    .topics
                    .values()
                    .map(|id| ChannelId::new(*id, t.row.task))
                    .chain(t.channels.keys().copied())
                    .collect();
                let settled = |c: &ChannelId| t.channels.get(c).and_then(ChannelReport::settled);
                if let Decision::Held { blockers } = decide(&past, &received, settled) {
                    if let Some(c) = t.channels.get_mut(&channel) {
                        c.blockers = blockers;
                    }
                }
            }
            Err(e) => {
                t.unreadable = Some(format!("the causes of the head of {channel} do not decode: {e}"));
            }
        }
    }
    let widths: Vec<(i32, i64)> =
        sqlx::query_as(CLOCK_WIDTH_SQL).bind(model).fetch_all(&mut *conn).await.with_context(context)?;
    for (task, width) in widths {
        if let Some(t) = tasks.get_mut(&task_of(task)?) {
            t.clock_width = width;
        }
    }
    Ok(Some(ModelReport { model: model.to_string(), row, topics, tasks: tasks.into_values().collect() }))
}

fn channel_json(state: &AppState, report: &ModelReport, c: &ChannelId) -> Value {
    let name = report.topics.get(&c.topic).cloned().or_else(|| state.facts.cached_name(&c.topic));
    json!({"topic": name, "topic_id": c.topic.to_string(), "partition": c.partition})
}

fn report_json(state: &AppState, r: &ModelReport) -> Value {
    let topics: Vec<Value> =
        r.topics.iter().map(|(id, name)| json!({"name": name, "topic_id": id.to_string()})).collect();
    let tasks: Vec<Value> = r
        .tasks
        .iter()
        .map(|t| {
            let channels: Vec<Value> = t
                .channels
                .iter()
                .map(|(channel, c)| {
                    json!({
                        "channel": channel_json(state, r, channel),
                        "fed_up_to": c.fed_up_to,
                        "settled": c.settled(),
                        "held": c.held,
                        "held_bytes": c.held_bytes,
                        "head": c.head,
                        "oldest_held_age_s": c.oldest_held_age_s,
                        "blockers": c.blockers.iter().map(|b| json!({
                            "channel": channel_json(state, r, &b.channel),
                            "required": b.required,
                            "settled": b.settled,
                        })).collect::<Vec<_>>(),
                    })
                })
                .collect();
            let row = &t.row;
            json!({
                "task": row.task,
                "status": row.status.as_str(),
                "epoch": row.epoch,
                "owner": row.owner,
                "failures": row.failures,
                "last_error": row.last_error,
                "refusal": row.refusal.as_ref().map(|f| json!({
                    "reason": f.reason.as_str(),
                    "diagnosis": f.diagnosis,
                    "channel": f.channel.map(|c| channel_json(state, r, &c)),
                    "position": f.position,
                })),
                "held": t.channels.values().map(|c| c.held).sum::<i64>(),
                "held_bytes": t.channels.values().map(|c| c.held_bytes).sum::<i64>(),
                "channels": channels,
                "clock_width": t.clock_width,
                "unreadable": t.unreadable,
            })
        })
        .collect();
    json!({
        "model": r.model,
        "task_count": r.row.task_count,
        "format_version": r.row.format_version,
        "topics": topics,
        "tasks": tasks,
    })
}
