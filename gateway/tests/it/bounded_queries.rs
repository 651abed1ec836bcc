//! Named queries bounded, on the real stack: the gate is checked before the data statement
//! runs (a session not yet covered runs none), a query past its `timeout_ms` answers `504
//! query-timeout`, a result over its `max_bytes` answers `422 query-result-too-large` with
//! nothing of it sent, and a pool of the queries' own (`gateway.query_max_connections`)
//! exhausted by slow queries leaves the document reads answering.

use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use parsley_settings::config::{Config, QueryConfig};
use serde_json::{json, Value};

use crate::support::*;

const PROBLEM: &str = "https://parsley.dev/problems/";

/// A query with every key at its default but those `edit` sets.
fn query(name: &str, sql: String, edit: impl FnOnce(&mut QueryConfig)) -> QueryConfig {
    let mut q = QueryConfig::new(name, sql, Default::default());
    edit(&mut q);
    q
}

fn add_queries(c: &mut Config, queries: Vec<QueryConfig>) {
    c.models[0].queries.extend(queries);
}

async fn run(s: &Stack, name: &str, token: Option<&str>) -> Reply {
    s.send(Method::GET, &format!("/v1/models/{}/queries/{name}", s.names.model), token, None).await
}

fn problem(r: &Reply, status: u16, kind: &str) {
    assert_eq!((r.status.as_u16(), r.problem_type()), (status, format!("{PROBLEM}{kind}").as_str()), "{}", r.json);
}

/// Backends holding the session advisory lock `key` (a bigint key below 2^31: `classid` 0).
async fn lock_holders(s: &Stack, key: i64) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 0 AND objid = $1::bigint::oid \
         AND objsubid = 1 AND granted",
    )
    .bind(key)
    .fetch_one(&s.pool)
    .await
    .unwrap()
}

/// A session the clock does not cover yet makes no data statement run: the query takes a
/// session advisory lock (a trace that outlives its read-only transaction), and while the
/// projector is stopped every attempt of the read — the first, and the re-checks of its wait
/// — leaves none. Once the projector covers the session, the same read runs the statement
/// and the lock is there: the trace is real.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_not_yet_covered_runs_no_data_statement() {
    let key: i64 = 1_000_000 + i64::from(std::process::id() % 1_000_000) * 1000 + i64::from(rand_part());
    let mut s = Stack::with_config("bounded-gate", 2, "read_wait_ms = 600\nrecheck_ms = 50", |_, c| {
        let sql = format!("SELECT 1 AS ran FROM (SELECT pg_advisory_lock({key})) AS l");
        add_queries(c, vec![query("traced", sql, |_| {})]);
    })
    .await;
    let w = s.write(&s.names.orders.clone(), "o-1", json!({"total": 1}), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let token = w.token();

    let r = run(&s, "traced", Some(&token)).await;
    problem(&r, 503, "not-yet-covered");
    assert!(r.json["waited_ms"].as_u64().unwrap() >= 600, "the read waited and re-checked: {}", r.json);
    assert_eq!(lock_holders(&s, key).await, 0, "no attempt of an uncovered read ran the query's statement");

    s.start_projector().await;
    let deadline = Instant::now() + TIMEOUT;
    let r = loop {
        let r = run(&s, "traced", Some(&token)).await;
        if r.status != StatusCode::SERVICE_UNAVAILABLE || Instant::now() > deadline {
            break r;
        }
    };
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["rows"], json!([{"ran": 1}]), "{}", r.json);
    assert_eq!(lock_holders(&s, key).await, 1, "the covered read ran the statement once its snapshot covered it");
    s.stop_projector().await;
}

/// A few bits that differ between runs of the test binary, for a lock key of its own.
fn rand_part() -> u32 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos() % 1000
}

/// A query running past its `timeout_ms` is cancelled by the database and answered `504
/// query-timeout` naming it, in about its timeout; the same statement under a longer one
/// answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_past_its_timeout_answers_504() {
    let mut s = Stack::with_config("bounded-timeout", 1, "", |_, c| {
        let sql = "SELECT pg_sleep(2) IS NULL AS slept".to_string();
        add_queries(
            c,
            vec![
                query("slow", sql.clone(), |q| q.timeout_ms = Some(100)),
                query("patient", sql, |q| q.timeout_ms = Some(5_000)),
            ],
        );
    })
    .await;
    s.start_projector().await;
    let started = Instant::now();
    let r = run(&s, "slow", None).await;
    problem(&r, 504, "query-timeout");
    assert!(started.elapsed() < Duration::from_millis(1_500), "cancelled at its timeout: {:?}", started.elapsed());
    assert_eq!((r.json["query"].clone(), r.json["timeout_ms"].clone()), (json!("slow"), json!(100)), "{}", r.json);
    assert!(r.json["detail"].as_str().unwrap().contains("100 ms"), "{}", r.json);

    let r = run(&s, "patient", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["rows"], json!([{"slept": false}]), "{}", r.json);
    s.stop_projector().await;
}

/// A result larger than its query's `max_bytes` is refused whole, `422
/// query-result-too-large` — a problem document, no row of it, not a truncated body — while
/// the same rows under a larger bound, and fewer rows under the same bound, are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_over_max_bytes_is_refused_whole() {
    let rows = |n: u32| format!("SELECT i, repeat('x', 1000) AS pad FROM generate_series(1, {n}) AS i ORDER BY i");
    let mut s = Stack::with_config("bounded-bytes", 1, "", |_, c| {
        add_queries(
            c,
            vec![
                query("big", rows(50), |q| q.max_bytes = 10_000),
                query("big-allowed", rows(50), |q| q.max_bytes = 100_000),
                query("fits", rows(5), |q| q.max_bytes = 10_000),
                // More rows than max_rows, each small: truncated by rows, within the bytes.
                query("many-small", "SELECT i FROM generate_series(1, 5000) AS i ORDER BY i".into(), |q| {
                    q.max_rows = 10;
                    q.max_bytes = 1_000;
                }),
            ],
        );
    })
    .await;
    s.start_projector().await;

    let r = run(&s, "big", None).await;
    problem(&r, 422, "query-result-too-large");
    assert_eq!((r.json["query"].clone(), r.json["max_bytes"].clone()), (json!("big"), json!(10_000)), "{}", r.json);
    assert!(r.json.get("rows").is_none() && r.json.get("truncated").is_none(), "nothing of the result: {}", r.json);
    assert!(!r.json.to_string().contains("xxxx"), "no row is quoted: {}", r.json);

    let r = run(&s, "big-allowed", None).await;
    assert_eq!(r.status, StatusCode::OK);
    let all = r.json["rows"].as_array().unwrap();
    assert_eq!((all.len(), r.json["truncated"].clone()), (50, json!(false)));
    assert!(serde_json::to_vec(&r.json).unwrap().len() > 10_000, "the refused result really is over 10000 bytes");

    let r = run(&s, "fits", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["rows"].as_array().unwrap().len(), 5);

    let r = run(&s, "many-small", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let first: Vec<Value> = (1..=10).map(|i| json!({"i": i})).collect();
    assert_eq!((r.json["rows"].clone(), r.json["truncated"].clone()), (json!(first), json!(true)));
    s.stop_projector().await;
}

/// The named queries run on a pool of their own size: with `query_max_connections = 2`,
/// four slow queries at once hold two connections (the others wait their turn), and
/// meanwhile a write is read back through the document route at once. Every query answers
/// in the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_queries_exhausting_their_pool_leave_document_reads_answering() {
    let marker = format!("slow_{}", unique("q").replace(['-', '.'], "_"));
    let mut s = Stack::with_config(
        "bounded-pool",
        1,
        "query_max_connections = 2\ndatabase_max_connections = 4\nread_cache_bytes = 0",
        |_, c| {
            let sql = format!("SELECT pg_sleep(2.5) IS NULL AS {marker}");
            add_queries(c, vec![query("slow", sql, |q| q.timeout_ms = Some(10_000))]);
        },
    )
    .await;
    s.start_projector().await;
    // The model has state before the queries start.
    let w = s.write(&s.names.orders.clone(), "warm", json!(0), None).await;
    assert_eq!(s.read("warm", Some(&w.token())).await.status, StatusCode::OK);

    let started = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..4 {
        let router = s.router.clone();
        let uri = format!("/v1/models/{}/queries/slow", s.names.model);
        slow.push(tokio::spawn(async move { send(&router, Method::GET, &uri, None, None).await }));
    }
    // The queries hold the pool's two connections.
    let running = |pool: sqlx::PgPool, marker: String| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%pg_sleep(2.5)%' \
             AND query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()",
        )
        .bind(marker)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(1);
    while running(s.pool.clone(), marker.clone()).await < 2 {
        assert!(Instant::now() < deadline, "the slow queries did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A session writes and reads its write while the query pool is exhausted.
    let read_started = Instant::now();
    let w = s.write(&s.names.orders.clone(), "o-1", json!({"total": 3}), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let r = s.read("o-1", Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["document"], json!({"total": 3}));
    let read_took = read_started.elapsed();
    assert!(read_took < Duration::from_millis(1_000), "the document read answered in {read_took:?}");
    assert_eq!(running(s.pool.clone(), marker.clone()).await, 2, "the queries still hold their pool, no more");
    assert!(
        slow.iter().all(|h| !h.is_finished()),
        "the read answered while every slow query was still waiting or running"
    );

    for h in slow {
        let r = h.await.unwrap();
        assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    }
    let all_took = started.elapsed();
    assert!(all_took >= Duration::from_millis(5_000), "two at a time: {all_took:?}");
    s.stop_projector().await;
}
