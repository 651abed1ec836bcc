//! Operational routes: `/healthz` (the process answers), `/readyz` (Postgres answers, the
//! schema migrations are applied, Kafka answers a metadata request), `/metrics`
//! (Prometheus text) and the admin `GET /v1/status` (every configured model's tasks with
//! their status, holds with blockers, refusals and clock sizes — read with the projector's
//! own status code).

use std::collections::BTreeSet;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use parsley::{ChannelId, TopicId};
use parsley_projector::migrations::MIGRATIONS;
use parsley_projector::status::{self, ModelReport};
use serde_json::{json, Value};

use crate::app::AppState;
use crate::problem::{ApiError, Problem};

pub async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// The versions of the embedded migrations (`<version>_<description>.sql`).
fn expected_migrations() -> BTreeSet<i64> {
    MIGRATIONS.iter().filter_map(|(name, _)| name.split_once('_').and_then(|(v, _)| v.parse().ok())).collect()
}

pub async fn readyz(State(state): State<AppState>) -> Response {
    let database = match sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(&state.pool).await {
        Ok(_) => Ok(()),
        Err(e) => Err(e.to_string()),
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
    let kafka = state.facts.reachable().await.map_err(|e| format!("{e:#}"));
    let check = |r: &Result<(), String>| match r {
        Ok(()) => json!({"ok": true}),
        Err(e) => json!({"ok": false, "error": e}),
    };
    let checks = json!({"database": check(&database), "migrations": check(&migrations), "kafka": check(&kafka)});
    if database.is_ok() && migrations.is_ok() && kafka.is_ok() {
        Json(json!({"status": "ready", "checks": checks})).into_response()
    } else {
        let mut p =
            Problem::new("not-ready", "Not ready", StatusCode::SERVICE_UNAVAILABLE, "a dependency is not ready")
                .with("checks", checks);
        p.retry_after = Some(state.config.settings.retry_after_s);
        p.into_response()
    }
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}

pub async fn status(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let unavailable = |e: anyhow::Error| {
        tracing::warn!(error = %format!("{e:#}"), "reading status failed");
        ApiError::Unavailable {
            what: "Postgres",
            detail: "the database did not answer the status query".into(),
            retry_after: state.config.settings.retry_after_s,
        }
    };
    let mut conn = state.pool.acquire().await.map_err(|e| unavailable(e.into()))?;
    let mut models = Vec::new();
    for model in &state.config.shared.models {
        let report = status::model_report(&mut conn, &model.name).await.map_err(unavailable)?;
        models.push(match report {
            Some(r) => report_json(&state, &r),
            None => json!({"model": model.name, "state": null}),
        });
    }
    Ok(Json(json!({"models": models})))
}

fn channel_json(state: &AppState, report: &ModelReport, c: &ChannelId) -> Value {
    let name = report.topics.get(&c.topic).cloned().or_else(|| state.facts.cached_name(&c.topic));
    json!({"topic": name, "topic_id": c.topic.to_string(), "partition": c.partition})
}

fn report_json(state: &AppState, r: &ModelReport) -> Value {
    let topics: Vec<Value> = r
        .topics
        .iter()
        .map(|(id, name): (&TopicId, &String)| json!({"name": name, "topic_id": id.to_string()}))
        .collect();
    let tasks: Vec<Value> = r
        .tasks
        .iter()
        .map(|t| {
            let holds: Vec<Value> = t
                .channels
                .iter()
                .map(|c| {
                    json!({
                        "channel": channel_json(state, r, &c.channel),
                        "fed_up_to": c.fed_up_to,
                        "settled": c.settled,
                        "held": c.held,
                        "head": c.head,
                        "blockers": c.blockers.iter().map(|b| json!({
                            "channel": channel_json(state, r, &b.channel),
                            "required": b.required,
                            "settled": b.settled,
                        })).collect::<Vec<_>>(),
                    })
                })
                .collect();
            json!({
                "task": t.task,
                "status": t.status.as_str(),
                "epoch": t.epoch,
                "owner": t.owner,
                "failures": t.failures,
                "last_error": t.last_error,
                "refusal": t.refusal.as_ref().map(|f| json!({
                    "reason": f.reason.as_str(),
                    "diagnosis": f.diagnosis,
                    "channel": f.channel.map(|c| channel_json(state, r, &c)),
                    "position": f.position,
                })),
                "held": t.held_total,
                "channels": holds,
                "clock_width": t.clock_width,
                "unreadable": t.unreadable.as_ref().map(|u| u.to_string()),
            })
        })
        .collect();
    json!({
        "model": r.model,
        "task_count": r.task_count,
        "format_version": r.format_version,
        "topics": topics,
        "tasks": tasks,
    })
}
