//! Operational routes: `/livez` and `/healthz` (the process answers, its background checks
//! run), `/readyz` (from the cache [`crate::health`] keeps: Postgres answers, the schema
//! migrations are applied, Kafka answers a metadata request, not draining), `/metrics`
//! (Prometheus text) and the admin `GET /v1/status` (every configured model's tasks with
//! their status, refusals, held counts and bytes per channel, each queue head with its
//! blockers, and clock sizes — from SQL aggregates, so a large backlog costs the gateway
//! no memory).

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use parsley::ChannelId;
use parsley_store::ordering::{begin_snapshot, TaskRow};
use parsley_store::status::{model_aggregates, ModelAggregates};
use parsley_store::StoreError;
use serde_json::{json, Value};

use crate::metrics::Metric;
use crate::problem::{ApiError, Problem, ProblemType};
use crate::state::AppState;
use crate::store_errors;

/// `/livez` (and `/healthz`, its older name): `200` while the process answers and its
/// dependency checks complete their rounds; never fails for a dependency.
pub async fn livez(State(state): State<AppState>) -> Response {
    let (live, body) = state.readiness.live();
    if live {
        Json(body).into_response()
    } else {
        let p = Problem::new(ProblemType::NotReady, "the gateway's background checks are stuck").with("live", body);
        p.into_response()
    }
}

/// `/readyz` from the cached dependency states (no round trip, but for the very first probe
/// before the background checks' first round). Each check says which dependency failed in
/// words of its own; the driver's error text (addresses, user names, server messages) goes
/// to the log only, since `/readyz` is public.
pub async fn readyz(State(state): State<AppState>) -> Response {
    crate::health::ensure_checked(&state).await;
    // With authentication on, the keys tokens are checked with: none yet (a JWKS URL whose
    // first fetch failed) answers every signed-in caller 503, so the gateway is not ready.
    let identity = state.config.verifier.as_ref().map(|v| match v.keys.current() {
        Some(_) => Ok(()),
        None => Err(format!(
            "no token verification keys yet: {}",
            v.keys.last_error().unwrap_or_else(|| "the first fetch has not finished".into())
        )),
    });
    let (ready, body) = state.readiness.ready(identity);
    if ready {
        Json(body).into_response()
    } else {
        let title = if body["status"] == "draining" {
            "the gateway is shutting down (draining)"
        } else {
            "a dependency is not ready"
        };
        let mut p = Problem::new(ProblemType::NotReady, title)
            .with("status", body["status"].clone())
            .with("checks", body["checks"].clone());
        p.retry_after = Some(state.config.settings.retry_after_s);
        p.into_response()
    }
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    if state.kept.on() {
        for model in &state.config.shared.models {
            let held = state.kept.bytes(&model.name) as f64;
            state.metrics.set(Metric::ReadCacheBytes, &[("model", &model.name)], held);
        }
    }
    let exposition = state.metrics.exposition();
    ([(header::CONTENT_TYPE, exposition.content_type)], exposition.body).into_response()
}

/// Every configured model's report, read in one read-only snapshot from SQL aggregates: no
/// held record is loaded, only counts, sizes and each queue head's `parsley.causes`.
pub async fn status(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let retry_after = state.config.settings.retry_after_s;
    let db = |e: StoreError| store_errors::failed(e, "the status query", retry_after, None);
    let mut tx = begin_snapshot(&state.pool).await.map_err(|e| db(e.into()))?;
    let mut models = Vec::new();
    for model in &state.config.shared.models {
        let report = model_aggregates(&mut tx, &model.name).await.map_err(db)?;
        models.push(match report {
            Some(r) => report_json(&state, &r),
            None => json!({"model": model.name, "state": null}),
        });
    }
    tx.commit().await.map_err(|e| db(e.into()))?;
    Ok(Json(json!({"models": models, "access": access_json(&state)})))
}

/// Who may call the data routes: the access mode, the rules' names, and with authentication
/// the key source, the key ids in use and the last key fetch error.
fn access_json(state: &AppState) -> Value {
    let config = &state.config;
    let mut access = json!({
        "mode": config.settings.access_mode().as_str(),
        "rules": config.access.rule_names(),
    });
    if let Some(v) = &config.verifier {
        access["keys"] = json!({
            "source": crate::jwks::describe(v.keys.source()),
            "kids": v.keys.current().map(|s| s.kids()),
            "last_error": v.keys.last_error(),
        });
    }
    access
}

fn channel_json(state: &AppState, report: &ModelAggregates, c: &ChannelId) -> Value {
    let name = report.topics.get(&c.topic).cloned().or_else(|| state.facts.cached_name(&c.topic));
    json!({"topic": name, "topic_id": c.topic.to_string(), "partition": c.partition})
}

fn report_json(state: &AppState, r: &ModelAggregates) -> Value {
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
                "lease": lease_json(row),
                "last_step_ms_ago": row.since_step_ms,
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
    let instances: Vec<Value> = r
        .members
        .iter()
        .map(|m| {
            let owned = r.tasks.iter().filter(|t| t.row.owner == m.instance && t.row.leased()).count();
            json!({"instance": m.instance, "balanced": m.balanced, "live": m.live, "tasks": owned})
        })
        .collect();
    json!({
        "model": r.model,
        "task_count": r.row.task_count,
        "format_version": r.row.format_version,
        "topics": topics,
        "instances": instances,
        "tasks": tasks,
    })
}

/// A task's lease: `held` (a live lease), and when it passes (`expires_in_ms`) or passed
/// (`expired_ms_ago`, nobody has taken the task since); both `null` when no instance holds it.
pub(crate) fn lease_json(row: &TaskRow) -> Value {
    let remaining = row.lease_remaining_ms;
    json!({
        "held": row.leased(),
        "expires_in_ms": remaining.filter(|ms| *ms > 0),
        "expired_ms_ago": remaining.filter(|ms| *ms <= 0).map(|ms| -ms),
    })
}
