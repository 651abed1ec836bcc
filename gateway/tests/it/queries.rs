//! Named queries (`GET /v1/models/{model}/queries/{name}`) and the public gated-read helper on
//! the real stack: the same gate, wait, `503` and refreshed token as the documents, for a
//! query gated on its key's owner and one gated on every task; parameters refused by name;
//! truncation; errors that never quote data; a read-only snapshot; and an embedding program
//! that merges the gateway's router into its own app with a gated route of its own.

use std::time::{Duration, Instant};

use axum::extract::Path;
use axum::http::{Method, StatusCode};
use axum::routing::get;
use axum::{Json, Router};
use parsley_gateway::gated::{Gate, Gated, Scope};
use parsley_gateway::metrics::Metric;
use parsley_gateway::ApiError;
use parsley_settings::config::{Config, ParamType, QueryConfig};
use serde_json::{json, Value};

use crate::support::*;

const NOT_YET_COVERED: &str = "https://parsley.dev/problems/not-yet-covered";

/// A sequence the `writes` query tries to advance.
fn sequence(n: &Names) -> String {
    format!("seq_{}", n.model.replace(['-', '.'], "_"))
}

/// A table no one creates, as a model's own table is before its migrations have run.
fn unmade_table(n: &Names) -> String {
    format!("unmade_{}", n.model.replace(['-', '.'], "_"))
}

/// The model's queries, over its documents (`projection.documents`).
fn with_queries(n: &Names, c: &mut Config) {
    use ParamType::*;
    let m = &n.model;
    let q = |name: &str, sql: String, params: &[(&str, ParamType)], key: Option<&str>, max_rows: u32| QueryConfig {
        name: name.to_string(),
        sql,
        params: params.iter().map(|(p, t)| (p.to_string(), *t)).collect(),
        key: key.map(String::from),
        max_rows,
        ..QueryConfig::new(name, "", Default::default())
    };
    c.models[0].queries = vec![
        q(
            "order",
            format!(
                "SELECT key, doc->>'customer' AS customer, (doc->>'amount')::int AS amount, (doc->>'paid')::bool AS paid
                 FROM projection.documents WHERE model = '{m}' AND key = :id"
            ),
            &[("id", Text)],
            Some("id"),
            1000,
        ),
        q(
            "by-customer",
            format!(
                "SELECT key FROM projection.documents WHERE model = '{m}' AND doc->>'customer' = :customer ORDER BY key"
            ),
            &[("customer", Text)],
            None,
            1000,
        ),
        q(
            "at-least",
            format!(
                "SELECT key, (doc->>'amount')::int AS amount FROM projection.documents
                 WHERE model = '{m}' AND (doc->>'amount')::int >= :min ORDER BY key;"
            ),
            &[("min", Int)],
            None,
            2,
        ),
        q(
            "typed",
            "SELECT :n AS n, :f AS f, :b AS b, :j AS j, :t AS t -- echoes its parameters".into(),
            &[("n", Int), ("f", Float), ("b", Bool), ("j", Json), ("t", Text)],
            None,
            10,
        ),
        q("as-int", "SELECT (:v)::int AS n".into(), &[("v", Text)], None, 10),
        q("writes", format!("SELECT nextval('{}') AS n", sequence(n)), &[], None, 10),
        q("unmade", format!("SELECT * FROM {}", unmade_table(n)), &[], None, 10),
    ];
}

/// `GET /v1/models/{model}/queries/{query}` through `router`.
async fn query(router: &Router, model: &str, query: &str, token: Option<&str>) -> Reply {
    send(router, Method::GET, &format!("/v1/models/{model}/queries/{query}"), token, None).await
}

fn keys(reply: &Reply) -> Vec<String> {
    let rows = reply.json["rows"].as_array().unwrap_or_else(|| panic!("no rows in {} {}", reply.status, reply.json));
    rows.iter().map(|r| r["key"].as_str().unwrap().to_string()).collect()
}

/// A `503 not-yet-covered` with `Retry-After` and at least one gap.
fn assert_not_yet_covered(r: &Reply) {
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.json);
    assert_eq!(r.problem_type(), NOT_YET_COVERED, "{}", r.json);
    assert_eq!(r.retry_after.as_deref(), Some("1"), "{}", r.json);
    assert!(!r.json["gaps"].as_array().unwrap().is_empty(), "{}", r.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn named_queries_are_gated_like_documents() {
    let mut s = Stack::with_config("queries", 2, "read_wait_ms = 800\nretry_after_s = 1", with_queries).await;
    let (waiting, _stop) = s.other_gateway("read_wait_ms = 30000\nresponse_timeout_ms = 60000").await;
    let (m, orders, payments) = (s.names.model.clone(), s.names.orders.clone(), s.names.payments.clone());

    // No projector: a keyed query over the session's write waits, then 503 with the gaps.
    let w = s.write(&orders, "o1", json!({"customer": "alice", "amount": 5}), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let started = Instant::now();
    let r = query(&s.router, &m, "order?id=o1", Some(&w.token())).await;
    assert_not_yet_covered(&r);
    assert!(started.elapsed() >= Duration::from_millis(800), "it waited read_wait_ms first");
    assert_eq!(r.json["model"], json!(m));

    // A query whose table does not exist yet (a model's own tables are made by its migrations
    // when the projector starts): a session the clock does not cover waits for the clock like
    // any other read; only a covered one gets the database's failure.
    let r = query(&s.router, &m, "unmade", Some(&w.token())).await;
    assert_not_yet_covered(&r);
    let r = query(&s.router, &m, "unmade", None).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", r.json);
    assert_eq!((&r.json["query"], &r.json["sqlstate"]), (&json!("unmade"), &json!("42P01")), "{}", r.json);

    // A read waiting through a gateway with a long wait is served once the projector commits.
    let read = {
        let (router, m, token) = (waiting.clone(), m.clone(), w.token());
        tokio::spawn(async move { query(&router, &m, "order?id=o1", Some(&token)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.start_projector().await;
    let r = read.await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(
        r.json,
        json!({"rows": [{"key": "o1", "customer": "alice", "amount": 5, "paid": null}], "truncated": false})
    );
    assert_eq!(r.content_type.as_deref(), Some("application/json"));
    assert!(open(&r.token()).past.covers(&open(&w.token()).past), "the refreshed token covers the write");

    // Read-your-writes right after each write, keyed (the owner) and across every task.
    let pay = s.write(&payments, "o1", json!({"paid": true}), Some(&r.token())).await;
    let r = query(&waiting, &m, "order?id=o1", Some(&pay.token())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["rows"][0]["paid"], json!(true), "{}", r.json);
    let mut token = r.token();
    for (key, customer, amount) in [("o2", "bob", 2), ("o3", "alice", 9), ("o4", "alice", 1)] {
        let w = s.write(&orders, key, json!({"customer": customer, "amount": amount}), Some(&token)).await;
        assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
        token = w.token();
    }
    let r = query(&waiting, &m, "by-customer?customer=alice", Some(&token)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(keys(&r), ["o1", "o3", "o4"], "the query without a key sees every write of the session");
    assert_eq!(r.json["truncated"], json!(false));

    // At most max_rows (2) rows; `truncated` says there were more.
    let r = query(&waiting, &m, "at-least?min=1", Some(&r.token())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json, json!({"rows": [{"key": "o1", "amount": 5}, {"key": "o2", "amount": 2}], "truncated": true}));
    let r = query(&waiting, &m, "at-least?min=5", Some(&r.token())).await;
    assert_eq!(r.json, json!({"rows": [{"key": "o1", "amount": 5}, {"key": "o3", "amount": 9}], "truncated": false}));
    let r = query(&waiting, &m, "at-least?min=10", Some(&r.token())).await;
    assert_eq!(r.json, json!({"rows": [], "truncated": false}));

    // The projector stopped: a query gated on every task is refused once its wait is over.
    s.stop_projector().await;
    let w = s.write(&orders, "o5", json!({"customer": "alice", "amount": 3}), Some(&r.token())).await;
    let r = query(&s.router, &m, "by-customer?customer=alice", Some(&w.token())).await;
    assert_not_yet_covered(&r);
    assert!(s.state.metrics.value(Metric::NotCoveredTotal, &[("model", &m)]).unwrap_or(0.0) >= 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parameters_are_typed_and_refused_by_name() {
    let s = Stack::with_config("query-params", 1, "", with_queries).await;
    let m = s.names.model.clone();
    // No session: nothing to prove, so these run without a projector.
    let r = query(&s.router, &m, "typed?n=-7&f=2.5&b=true&j=%7B%22a%22%3A%5B1%2Cnull%5D%7D&t=x+y", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["rows"], json!([{"n": -7, "f": 2.5, "b": true, "j": {"a": [1, null]}, "t": "x y"}]));
    assert!(r.token.is_some(), "a session token comes with every covered read");
    let reads = |waited: &str| s.state.metrics.value(Metric::ReadsTotal, &[("model", &m), ("waited", waited)]);
    let served = reads("no").unwrap_or(0.0) + reads("yes").unwrap_or(0.0);
    assert_eq!(served, 1.0, "a query is counted as a read of its model");

    let ok = "n=1&f=1&b=false&j=1&t=k";
    for (q, parameter) in [
        ("typed?f=1&b=false&j=1&t=k".to_string(), "n"),
        (format!("typed?{ok}&other=1"), "other"),
        (format!("typed?{ok}&n=2"), "n"),
        ("typed?n=1.5&f=1&b=false&j=1&t=k".into(), "n"),
        ("typed?n=1&f=nan&b=false&j=1&t=k".into(), "f"),
        ("typed?n=1&f=1&b=yes&j=1&t=k".into(), "b"),
        ("typed?n=1&f=1&b=false&j=%7B&t=k".into(), "j"),
        ("typed?n=1&f=1&b=false&j=1&t=a%00b".into(), "t"),
        ("order".into(), "id"),
        ("order?id=%FF".into(), "id"),
    ] {
        let r = query(&s.router, &m, &q, None).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{q}: {}", r.json);
        assert_eq!(r.problem_type(), "https://parsley.dev/problems/invalid-query", "{q}: {}", r.json);
        assert_eq!(r.json["parameter"], json!(parameter), "{q}: {}", r.json);
    }

    let r = query(&s.router, &m, "nope", None).await;
    assert_eq!((r.status, r.problem_type()), (StatusCode::NOT_FOUND, "https://parsley.dev/problems/unknown-query"));
    assert_eq!((&r.json["model"], &r.json["query"]), (&json!(m), &json!("nope")));
    let r = query(&s.router, "no-such-model", "order?id=1", None).await;
    assert_eq!((r.status, r.problem_type()), (StatusCode::NOT_FOUND, "https://parsley.dev/problems/unknown-model"));

    // A statement the database refuses is a 500 naming the query and the SQLSTATE, never the
    // database's message (it quotes the value).
    let r = query(&s.router, &m, "as-int?v=secret-abc", None).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", r.json);
    assert_eq!(r.problem_type(), "https://parsley.dev/problems/query-failed");
    assert_eq!((&r.json["query"], &r.json["sqlstate"]), (&json!("as-int"), &json!("22P02")));
    assert!(!r.json.to_string().contains("secret-abc"), "{}", r.json);

    // The snapshot is read-only: advancing a sequence is refused (25006).
    sqlx::query(&format!("CREATE SEQUENCE {}", sequence(&s.names))).execute(&s.pool).await.unwrap();
    let r = query(&s.router, &m, "writes", None).await;
    assert_eq!((r.status, &r.json["sqlstate"]), (StatusCode::INTERNAL_SERVER_ERROR, &json!("25006")), "{}", r.json);
    sqlx::query(&format!("DROP SEQUENCE {}", sequence(&s.names))).execute(&s.pool).await.unwrap();
}

/// An embedding program's route: the document of `key` from its own statement, gated on the
/// key's owner.
async fn own_route(model: String, gate: Gate, key: String) -> Result<Gated<Json<Value>>, ApiError> {
    let (name, scope_key) = (model.clone(), key.clone());
    let gated = gate
        .query(&name, Scope::Key(&scope_key), move |conn| {
            let (model, key) = (model.clone(), key.clone());
            Box::pin(async move {
                sqlx::query_scalar::<_, Value>("SELECT doc FROM projection.documents WHERE model = $1 AND key = $2")
                    .bind(model)
                    .bind(key)
                    .fetch_optional(conn)
                    .await
            })
        })
        .await?;
    Ok(gated.map(|doc| Json(json!({"mine": doc}))))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_embedding_app_merges_the_router_and_gates_its_own_route() {
    let mut s = Stack::new("embedded", 2, "read_wait_ms = 800\nretry_after_s = 1").await;
    let m = s.names.model.clone();
    let route_model = m.clone();
    let app: Router = Router::new()
        .route("/mine/{key}", get(move |gate: Gate, Path(key): Path<String>| own_route(route_model.clone(), gate, key)))
        .with_state(s.state.clone())
        .merge(parsley_gateway::routes(s.state.clone()));

    // The gateway's routes are served by the merged app.
    let w = send(
        &app,
        Method::POST,
        &format!("/v1/topics/{}/records", s.names.orders),
        None,
        Some(&json!({"key": "k1", "value": {"n": 1}})),
    )
    .await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);

    // The custom route, uncovered: the same wait and 503 as the gateway's reads.
    let started = Instant::now();
    let r = send(&app, Method::GET, "/mine/k1", Some(&w.token()), None).await;
    assert_not_yet_covered(&r);
    assert!(started.elapsed() >= Duration::from_millis(800));

    // Covered once the projector commits; its refreshed token serves the gateway's own route.
    s.start_projector().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let r = loop {
        let r = send(&app, Method::GET, "/mine/k1", Some(&w.token()), None).await;
        if r.status == StatusCode::OK {
            break r;
        }
        assert_not_yet_covered(&r);
        assert!(Instant::now() < deadline, "the custom route was never covered");
    };
    assert_eq!(r.json, json!({"mine": {"n": 1}}));
    assert!(open(&r.token()).past.covers(&open(&w.token()).past), "the refreshed token covers the write");
    let d = send(&app, Method::GET, &format!("/v1/models/{m}/documents/k1"), Some(&r.token()), None).await;
    assert_eq!(d.status, StatusCode::OK, "{}", d.json);
    assert_eq!(d.json["document"], json!({"n": 1}));
    // A session with nothing to prove is served at once; a missing row is the route's to say.
    let r = send(&app, Method::GET, "/mine/absent", None, None).await;
    assert_eq!((r.status, &r.json), (StatusCode::OK, &json!({"mine": null})));
    s.stop_projector().await;
}
