//! Readiness, status and the served process: `/readyz` against the real services, the
//! admin status read with the projector's status code, and `Gateway::serve` on a port-0
//! listener answering over TCP and stopping on its shutdown signal.

use axum::http::{Method, StatusCode};
use parsley_gateway::{Gateway, GatewayConfig};
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::watch;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_and_status_reflect_the_services_and_the_tasks() {
    let mut s = Stack::new("ops", 2, "").await;
    let r = s.send(Method::GET, "/readyz", None, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["checks"]["migrations"]["ok"], json!(true));

    let st = s.send(Method::GET, "/v1/status", None, None).await;
    assert_eq!(st.status, StatusCode::OK);
    assert_eq!(
        st.json["models"][0],
        json!({"model": s.names.model, "state": null}),
        "no state before the projector ran"
    );

    s.start_projector().await;
    let w = s.write(&s.names.orders.clone(), "k", json!(1), None).await;
    let r = s.read("k", Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let st = s.send(Method::GET, "/v1/status", None, None).await;
    let model = &st.json["models"][0];
    assert_eq!(model["task_count"], json!(2));
    let tasks = model["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 2);
    assert!(tasks.iter().all(|t| t["status"] == json!("running")), "{st:?}");
    let owner = w.json["partition"].as_u64().unwrap() as usize;
    assert!(tasks[owner]["clock_width"].as_u64().unwrap() >= 1, "{}", st.json);
    assert_eq!(tasks[owner]["held"], json!(0));

    let m = s.send(Method::GET, "/metrics", None, None).await;
    assert_eq!(m.status, StatusCode::OK);
    s.stop_projector().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_answers_over_tcp_and_stops_on_its_signal() {
    let n = Names::new("serve");
    let config = config(&n, "listen = \"127.0.0.1:0\"");
    let gateway = Gateway::new(GatewayConfig::with_keys(config, ring()).unwrap()).unwrap();
    let listener = gateway.bind().await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, shutdown) = watch::channel(false);
    let server = tokio::spawn(gateway.serve(listener, shutdown));

    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    socket.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    socket.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"status\":\"ok\""), "{answer}");

    stop.send(true).unwrap();
    tokio::time::timeout(TIMEOUT, server).await.expect("the server stops").unwrap().unwrap();
}

/// The gate's check and data read must share one read-only snapshot: the statement that
/// opens its transaction really gives repeatable read, read only.
#[tokio::test]
async fn the_gate_transaction_is_one_read_only_snapshot() {
    let pool = pool().await;
    let mut tx = pool.begin_with(parsley_gateway::read::GATE_BEGIN).await.unwrap();
    let isolation: String = sqlx::query_scalar("SHOW transaction_isolation").fetch_one(&mut *tx).await.unwrap();
    let read_only: String = sqlx::query_scalar("SHOW transaction_read_only").fetch_one(&mut *tx).await.unwrap();
    assert_eq!((isolation.as_str(), read_only.as_str()), ("repeatable read", "on"));
    let write = sqlx::query("CREATE TEMP TABLE gate_must_not_write (x int)").execute(&mut *tx).await;
    assert!(write.is_err(), "a read-only transaction refuses writes");
}
