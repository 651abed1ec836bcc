//! Bounded connections on a real socket, with the real projector behind: a body that does
//! not arrive within `gateway.body_timeout_ms` is answered `408 body-timeout` and holds no
//! in-flight permit, and a flood of 1,024 connections trickling their bodies leaves other
//! requests — `/healthz` and a gated document read — answered within 2 s.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parsley_gateway::{AppState, Gateway, GatewayConfig};
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::support::*;

/// The trickling clients of the flood.
const FLOOD: usize = 1024;
/// The longest another request may take while the flood goes on.
const SERVED_WITHIN: Duration = Duration::from_secs(2);

/// A gateway serving `stack`'s configuration on a real socket: its address, its state, and
/// the sender that stops it.
async fn serve(stack: &Stack) -> (SocketAddr, AppState, watch::Sender<bool>) {
    let gateway = Gateway::new(GatewayConfig::with_keys(stack.config.clone(), ring()).unwrap()).unwrap();
    let listeners = gateway.bind().await.unwrap();
    let address = listeners.main.local_addr().unwrap();
    let state = gateway.state().clone();
    let (stop, shutdown) = watch::channel(false);
    tokio::spawn(async move { gateway.serve(listeners, shutdown).await.unwrap() });
    (address, state, stop)
}

/// `GET path` on a connection of its own: the answer's status line and body.
async fn get(address: SocketAddr, path: &str, token: Option<&str>) -> String {
    let mut socket = TcpStream::connect(address).await.unwrap();
    let session = token.map(|t| format!("Parsley-Session: {t}\r\n")).unwrap_or_default();
    let request = format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n{session}\r\n");
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    socket.read_to_end(&mut answer).await.unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// A write's request head announcing a body of `length` bytes.
fn write_head(topic: &str, length: usize) -> String {
    format!(
        "POST /v1/topics/{topic}/records HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Content-Length: {length}\r\n\r\n"
    )
}

/// Sends a write's head and the start of its body, then one byte every `every` until the
/// server answers; returns the answer.
async fn trickle(address: SocketAddr, topic: String, every: Duration, started: Arc<AtomicUsize>) -> String {
    let mut socket = TcpStream::connect(address).await.unwrap();
    let head = write_head(&topic, 4096);
    socket.write_all(format!("{head}{{\"key\":\"").as_bytes()).await.unwrap();
    started.fetch_add(1, Ordering::SeqCst);
    let mut answer = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        tokio::select! {
            read = socket.read(&mut buffer) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buffer[..n]),
            },
            _ = tokio::time::sleep(every) => {
                if socket.write_all(b"a").await.is_err() {
                    // The server closed its side: read what it answered.
                    let _ = socket.read_to_end(&mut answer).await;
                    break;
                }
            }
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_that_does_not_arrive_in_time_is_answered_408_and_holds_no_permit() {
    let mut s = Stack::new(
        "body-timeout",
        1,
        "listen = \"127.0.0.1:0\"\nbody_timeout_ms = 800\nmax_in_flight = 4\nmax_connections = 64\n\
         database_max_connections = 8",
    )
    .await;
    s.start_projector().await;
    let (address, state, stop) = serve(&s).await;

    let started = Instant::now();
    let answer = trickle(address, s.names.orders.clone(), Duration::from_millis(100), Arc::default()).await;
    let waited = started.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("application/problem+json") && answer.contains("body-timeout"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("connection: close"), "{answer}");
    assert!(waited >= Duration::from_millis(800) && waited < Duration::from_secs(3), "answered after {waited:?}");
    assert_eq!(state.in_flight.available_permits(), 4, "no permit is kept");

    // A body that arrives in time is written as usual.
    let body = json!({"key": "k", "value": {"n": 1}}).to_string();
    let mut socket = TcpStream::connect(address).await.unwrap();
    let request = format!("{}{body}", write_head(&s.names.orders, body.len()))
        .replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n");
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    socket.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    stop.send(true).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_slow_bodies_leaves_other_requests_served_within_two_seconds() {
    let mut s = Stack::new(
        "slow-flood",
        2,
        "listen = \"127.0.0.1:0\"\nbody_timeout_ms = 6000\nmax_in_flight = 64\nmax_connections = 2048\n\
         database_max_connections = 16\nread_wait_ms = 5000\nresponse_timeout_ms = 30000",
    )
    .await;
    s.start_projector().await;
    let (address, state, stop) = serve(&s).await;
    let w = s.write(&s.names.orders, "k", json!({"n": 1}), None).await;
    assert_eq!(w.status, axum::http::StatusCode::CREATED, "{}", w.json);
    let token = w.token();
    let document = format!("/v1/models/{}/documents/k", s.names.model);
    assert!(get(address, &document, Some(&token)).await.starts_with("HTTP/1.1 200"), "served before the flood");

    let started = Arc::new(AtomicUsize::new(0));
    let flood: Vec<_> = (0..FLOOD)
        .map(|_| {
            let (topic, started) = (s.names.orders.clone(), Arc::clone(&started));
            tokio::spawn(trickle(address, topic, Duration::from_millis(250), started))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while started.load(Ordering::SeqCst) < FLOOD {
        assert!(Instant::now() < deadline, "only {} of the flood connected", started.load(Ordering::SeqCst));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let flooded_at = Instant::now();

    // While every flood connection trickles: other requests are answered at once.
    let mut slowest = Duration::ZERO;
    for round in 0..4 {
        let asked = Instant::now();
        let health = get(address, "/healthz", None).await;
        let read = get(address, &document, Some(&token)).await;
        let took = asked.elapsed();
        slowest = slowest.max(took);
        assert!(health.starts_with("HTTP/1.1 200"), "round {round}: {health}");
        assert!(read.starts_with("HTTP/1.1 200") && read.contains("\"n\""), "round {round}: {read}");
        assert!(took < SERVED_WITHIN, "round {round}: answered after {took:?}");
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    assert!(flooded_at.elapsed() < Duration::from_secs(6), "the flood was still on while measuring");
    assert_eq!(state.in_flight.available_permits(), 64, "the trickling bodies hold no permit");
    eprintln!("during the flood of {FLOOD} slow bodies, the slowest /healthz and read pair took {slowest:?}");

    // Each flood connection is answered 408 once its body is late.
    let mut answers = Vec::with_capacity(FLOOD);
    for task in flood {
        answers.push(tokio::time::timeout(Duration::from_secs(30), task).await.expect("the flood ends").unwrap());
    }
    let timed_out = answers.iter().filter(|a| a.starts_with("HTTP/1.1 408")).count();
    assert_eq!(timed_out, FLOOD, "not all 408: {:?}", answers.iter().find(|a| !a.starts_with("HTTP/1.1 408")));
    stop.send(true).unwrap();
}
