//! Least privilege in Postgres, on the real database: the roles `migrate --create-roles`
//! makes (parsley_store::roles), named queries run under their model's read role, which reads
//! its own model's documents and the gate's rows and nothing else, and the gateway's check at
//! start, which refuses a query its role may not run, naming it.

use axum::http::{Method, StatusCode};
use parsley_gateway::{Gateway, GatewayConfig};
use parsley_settings::config::{Config, ParamType, QueryConfig};
use parsley_store::roles::{self, ModelRoles};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::support::*;

fn query(name: &str, sql: String) -> QueryConfig {
    QueryConfig { max_rows: 100, ..QueryConfig::new(name, sql, Default::default()) }
}

/// The model's queries: its own documents, another model's (by a `WHERE` of its own), and
/// `extra` ones.
fn with_queries(n: &Names, c: &mut Config, extra: Vec<QueryConfig>) {
    let m = &n.model;
    c.models[0].queries = vec![
        query("own", format!("SELECT key FROM projection.documents WHERE model = '{m}' ORDER BY key")),
        // This model's and its neighbour's (named after it) rows, by their own WHERE.
        query(
            "every-model",
            format!("SELECT key, model FROM projection.documents WHERE model LIKE '{m}%' ORDER BY key"),
        ),
        QueryConfig {
            params: [("n".to_string(), ParamType::Int)].into(),
            ..query("typed", format!("SELECT count(*) AS c FROM projection.documents WHERE model = '{m}' AND :n = :n"))
        },
    ];
    c.models[0].queries.extend(extra);
}

/// Makes the roles of `model` (the test user, a member of the gateway's role, may then take
/// its read role).
async fn make_roles(s: &Stack) {
    roles::create(&s.pool, &[ModelRoles { model: &s.names.model }], Some("parsley"))
        .await
        .unwrap_or_else(|e| panic!("making the roles (the test user needs CREATEROLE): {e:#}"));
}

/// Drops the model's read role and its policy (roles are the cluster's, not the database's).
async fn drop_roles(s: &Stack) {
    let role = roles::query_role(&s.names.model);
    let quoted = roles::quote_ident(&role);
    for statement in [
        format!("DROP POLICY IF EXISTS {quoted} ON projection.documents"),
        format!("DROP OWNED BY {quoted}"),
        format!("DROP ROLE IF EXISTS {quoted}"),
    ] {
        let _ = sqlx::query(&statement).execute(&s.pool).await;
    }
}

/// A gateway over the stack's configuration whose named queries were checked at start.
async fn checked_gateway(s: &Stack, table: &str) -> anyhow::Result<(axum::Router, watch::Sender<bool>)> {
    let mut config = s.config.clone();
    config.gateway =
        Config::parse(&format!("[gateway]\naccess = \"open\"\nadmin_listen = \"\"\n{table}")).unwrap().gateway;
    let gateway = Gateway::new(GatewayConfig::with_keys(config, ring()).unwrap()).unwrap();
    gateway.check_queries().await?;
    let (stop, shutdown) = watch::channel(false);
    let _ = gateway.spawn_background(shutdown);
    Ok((gateway.router(), stop))
}

fn keys(rows: &Value) -> Vec<String> {
    rows["rows"].as_array().unwrap().iter().map(|r| r["key"].as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_query_under_its_read_role_reads_only_its_models_documents() {
    let mut s = Stack::with_config("roles-read", 1, "read_wait_ms = 5000", |n, c| with_queries(n, c, vec![])).await;
    s.start_projector().await;
    make_roles(&s).await;
    let (router, _stop) = checked_gateway(&s, "read_wait_ms = 5000\nquery_roles = \"required\"").await.unwrap();
    let w = s.write(&s.names.orders, "mine", json!({"v": 1}), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    // Another model's document in the same table.
    let other = format!("{}-neighbour", s.names.model);
    sqlx::query(
        "INSERT INTO projection.documents (model, key, task, doc, topic_id, partition, position)
         VALUES ($1, 'theirs', 0, '{}', gen_random_uuid(), 0, 0)",
    )
    .bind(&other)
    .execute(&s.pool)
    .await
    .unwrap();
    let token = w.token();
    let uri = |q: &str| format!("/v1/models/{}/queries/{q}", s.names.model);
    let own = send(&router, Method::GET, &uri("own"), Some(&token), None).await;
    assert_eq!((own.status, keys(&own.json)), (StatusCode::OK, vec!["mine".to_string()]), "{}", own.json);
    let every = send(&router, Method::GET, &uri("every-model"), Some(&token), None).await;
    assert_eq!(every.status, StatusCode::OK, "{}", every.json);
    let models: Vec<&str> =
        every.json["rows"].as_array().unwrap().iter().map(|r| r["model"].as_str().unwrap()).collect();
    assert!(!models.is_empty() && models.iter().all(|m| *m == s.names.model), "row-level security: {models:?}");
    let typed = send(&router, Method::GET, &format!("{}?n=3", uri("typed")), Some(&token), None).await;
    assert_eq!((typed.status, typed.json["rows"][0]["c"].clone()), (StatusCode::OK, json!(1)), "{}", typed.json);
    // The gateway's own role (the owner here) still sees every model's rows.
    let (open, _stop2) = checked_gateway(&s, "read_wait_ms = 5000\nquery_roles = \"off\"").await.unwrap();
    let all = send(&open, Method::GET, &uri("every-model"), Some(&token), None).await;
    assert!(all.json["rows"].as_array().unwrap().iter().any(|r| r["model"] == json!(other)), "{}", all.json);
    sqlx::query("DELETE FROM projection.documents WHERE model = $1").bind(&other).execute(&s.pool).await.unwrap();
    drop_roles(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_its_role_may_not_run_stops_the_gateway_at_start_naming_it() {
    let extra = vec![query("dead-letters", "SELECT * FROM parsley.dead_letters".to_string())];
    let s = Stack::with_config("roles-refused", 1, "", move |n, c| with_queries(n, c, extra)).await;
    make_roles(&s).await;
    let err = format!("{:#}", checked_gateway(&s, "query_roles = \"required\"").await.expect_err("refused"));
    assert!(err.contains("\"dead-letters\"") && err.contains(&roles::query_role(&s.names.model)), "{err}");
    // The ordering state is not the read role's either.
    let s2 = Stack::with_config("roles-refused-2", 1, "", |n, c| {
        with_queries(n, c, vec![query("tasks", "SELECT * FROM parsley.tasks".to_string())])
    })
    .await;
    make_roles(&s2).await;
    let err = format!("{:#}", checked_gateway(&s2, "").await.expect_err("refused under auto too"));
    assert!(err.contains("\"tasks\""), "{err}");
    drop_roles(&s).await;
    drop_roles(&s2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_calling_a_privileged_function_stops_the_gateway_at_start() {
    let extra = vec![query("read-file", "SELECT pg_read_file('/etc/hostname') AS f".to_string())];
    let s = Stack::with_config("roles-function", 1, "", move |n, c| with_queries(n, c, extra)).await;
    make_roles(&s).await;
    let err = format!("{:#}", checked_gateway(&s, "query_roles = \"required\"").await.expect_err("refused"));
    assert!(err.contains("\"read-file\"") && err.contains("pg_read_file"), "{err}");
    drop_roles(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_read_roles_that_do_not_exist_stop_the_gateway() {
    let s = Stack::with_config("roles-missing", 1, "", |n, c| with_queries(n, c, vec![])).await;
    let err = format!("{:#}", checked_gateway(&s, "query_roles = \"required\"").await.expect_err("refused"));
    assert!(err.contains("--create-roles") && err.contains(&s.names.model), "{err}");
    // Under "auto" the gateway starts, its queries under its own role (logged).
    assert!(checked_gateway(&s, "").await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_role_reads_what_it_serves_and_not_the_dead_letters() {
    let s = Stack::new("roles-gateway", 1, "").await;
    make_roles(&s).await;
    let under_gateway_role = |sql: &'static str| {
        let pool = s.pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("SET LOCAL ROLE parsley_gateway").execute(&mut *tx).await.unwrap();
            let done = sqlx::query(sql).execute(&mut *tx).await;
            tx.rollback().await.unwrap();
            done.map(|_| ()).map_err(|e| e.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned()))
        }
    };
    for allowed in [
        "SELECT count(*) FROM parsley.clock",
        "SELECT count(*) FROM parsley.models",
        "SELECT count(*) FROM projection.documents",
        "SELECT count(*) FROM parsley.held",
        "DELETE FROM parsley.idempotency_keys WHERE false",
        // The admin status's instances, and the readiness check's statement.
        "SELECT count(*) FROM parsley.members",
        "SELECT version FROM public._sqlx_migrations WHERE success",
    ] {
        assert_eq!(under_gateway_role(allowed).await, Ok(()), "{allowed}");
    }
    for refused in [
        "SELECT count(*) FROM parsley.dead_letters",
        "SELECT count(*) FROM parsley.skips",
        "DELETE FROM parsley.clock WHERE false",
        "UPDATE projection.documents SET doc = doc WHERE false",
        "DELETE FROM public._sqlx_migrations WHERE false",
    ] {
        assert_eq!(under_gateway_role(refused).await, Err(Some("42501".to_string())), "{refused}");
    }
    drop_roles(&s).await;
}
