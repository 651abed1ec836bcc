//! The gateway's probes and shutdown on the real services: `/readyz` answers from the cache
//! the background checks keep — a database cut behind a TCP proxy flips it only after the
//! checks in a row failed, and back once one passes, while a burst of probes makes no round
//! trip of its own; an unreachable broker leaves it ready (`degraded`) — and a rolling
//! restart: the gateway binary gets SIGTERM under a running load that a balancer (polling
//! `/readyz`) spreads over it and another gateway, and every request is answered.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use parsley_gateway::metrics::Metric;
use parsley_gateway::{admin_app, Gateway, GatewayConfig};
use parsley_infra::http::Client;
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tower::ServiceExt as _;

use crate::support::*;

/// A TCP proxy to Postgres that can be cut (every connection dropped, new ones closed at
/// once) and restored: a database outage as the gateway sees it.
struct Proxy {
    address: SocketAddr,
    cut: watch::Sender<bool>,
}

impl Proxy {
    async fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (cut, cutting) = watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else { continue };
                if *cutting.borrow() {
                    continue;
                }
                let upstream = upstream.clone();
                let mut cutting = cutting.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(&upstream).await else { return };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cutting.wait_for(|c| *c) => {}
                    }
                });
            }
        });
        Proxy { address, cut }
    }

    fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

async fn readyz(router: &axum::Router) -> Reply {
    send(router, Method::GET, "/readyz", None, None).await
}

async fn until_ready(router: &axum::Router, what: &str, want: impl Fn(&Reply) -> bool) -> Reply {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let r = readyz(router).await;
        if want(&r) {
            return r;
        }
        assert!(Instant::now() < deadline, "{what}: /readyz still answers {} {}", r.status, r.json);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_is_cached_and_flips_only_after_the_background_checks() {
    let url = database_url();
    let upstream = url.split('@').nth(1).and_then(|rest| rest.split('/').next()).expect("host:port in DATABASE_URL");
    let proxy = Proxy::start(upstream.to_string()).await;
    let mut config = config(&Names::new("ready-cache"), "readiness_check_ms = 300\nreadiness_failures = 2");
    config.database.url = Some(url.replacen(upstream, &proxy.address.to_string(), 1).into());
    config.database.acquire_timeout_ms = 500;
    let gateway = Gateway::new(GatewayConfig::with_keys(config, ring()).unwrap()).unwrap();
    let state = gateway.state().clone();
    let (stop, shutdown) = watch::channel(false);
    let _ = gateway.spawn_background(shutdown);
    let admin = admin_app(state.clone());
    let r = until_ready(&admin, "start", |r| r.status == StatusCode::OK).await;
    assert_eq!(r.json["status"], "ready", "{}", r.json);
    assert_eq!(r.json["checks"]["database"]["required"], true);

    // A burst of probes: answered from the cache, no round of checks of their own.
    let (rounds, started) = (state.readiness.rounds(), Instant::now());
    for _ in 0..200 {
        assert_eq!(readyz(&admin).await.status, StatusCode::OK);
    }
    let ran = state.readiness.rounds() - rounds;
    let elapsed = started.elapsed();
    assert!(ran <= elapsed.as_millis() as u64 / 300 + 1, "{ran} rounds of checks for 200 probes in {elapsed:?}");
    let checks = state.metrics.value(Metric::DependencyChecksTotal, &[("dependency", "database"), ("result", "ok")]);
    assert_eq!(checks, Some(state.readiness.rounds() as f64), "one database check per round");

    // The database cut: still ready until two checks in a row failed, then not ready,
    // naming the database.
    proxy.set_cut(true);
    let cut_at = Instant::now();
    assert_eq!(readyz(&admin).await.status, StatusCode::OK, "the cache still says up");
    let r = until_ready(&admin, "the cut", |r| r.status == StatusCode::SERVICE_UNAVAILABLE).await;
    let took = cut_at.elapsed();
    assert!(took >= Duration::from_millis(300), "flipped after {took:?}: before two checks could fail");
    assert_eq!(r.json["type"], "https://parsley.dev/problems/not-ready", "{}", r.json);
    assert_eq!(
        (r.json["status"].clone(), r.json["checks"]["database"]["ok"].clone()),
        (json!("not-ready"), json!(false))
    );
    assert!(r.json["checks"]["database"]["failed_checks"].as_u64().unwrap() >= 2, "{}", r.json);
    assert_eq!(state.metrics.value(Metric::DependencyUp, &[("dependency", "database")]), Some(0.0));
    assert_eq!(send(&admin, Method::GET, "/livez", None, None).await.status, StatusCode::OK, "liveness ignores it");

    // Restored: ready again after the next check that passes.
    proxy.set_cut(false);
    until_ready(&admin, "the restore", |r| r.status == StatusCode::OK).await;
    stop.send(true).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_leaves_the_gateway_ready_but_degraded() {
    let mut config = config(&Names::new("ready-kafka"), "kafka_timeout_ms = 300\nreadiness_check_ms = 200");
    config.kafka.bootstrap = "127.0.0.1:1".to_string();
    let gateway = Gateway::new(GatewayConfig::with_keys(config, ring()).unwrap()).unwrap();
    let (stop, shutdown) = watch::channel(false);
    let _ = gateway.spawn_background(shutdown);
    let admin = admin_app(gateway.state().clone());
    let r = until_ready(&admin, "the broker check", |r| r.json["checks"]["kafka"]["ok"] == json!(false)).await;
    assert_eq!((r.status, r.json["status"].clone()), (StatusCode::OK, json!("degraded")), "{}", r.json);
    assert_eq!(r.json["checks"]["kafka"]["required"], false);
    assert_eq!(r.json["checks"]["database"]["ok"], true);

    // Draining (what SIGTERM starts): not ready, still live, and every answer asks a
    // kept-alive client to reconnect.
    gateway.state().readiness.start_draining();
    let r = readyz(&admin).await;
    assert_eq!(
        (r.status, r.json["status"].clone()),
        (StatusCode::SERVICE_UNAVAILABLE, json!("draining")),
        "{}",
        r.json
    );
    let request = axum::http::Request::builder().uri("/livez").body(axum::body::Body::empty()).unwrap();
    let live = admin.clone().oneshot(request).await.unwrap();
    assert_eq!(live.status(), StatusCode::OK);
    assert_eq!(live.headers().get("connection").map(|v| v.to_str().unwrap()), Some("close"));
    stop.send(true).unwrap();
}

/// Requests answered, by where and how.
#[derive(Default)]
struct Tally {
    answered: AtomicU64,
    to_leaving: AtomicU64,
    unavailable: AtomicU64,
    failures: Mutex<Vec<String>>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gateway_stopped_with_sigterm_under_load_loses_no_request() {
    let mut s = Stack::new("rolling", 2, "").await;
    s.start_projector().await;
    // The gateway that will leave: the binary, on a port of its own, with a grace of 1.5 s.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = parsley_testkit::ScratchDir::new("rolling");
    let file = dir.join("parsley.toml");
    std::fs::write(
        &file,
        format!(
            "[kafka]\nbootstrap = {:?}\n[database]\nurl = {:?}\n[[models]]\nname = {:?}\n\
             topics = [{{ name = {:?} }}, {{ name = {:?}, apply = \"merge\" }}]\n\
             [gateway]\naccess = \"open\"\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"\"\n\
             shutdown_grace_ms = 1500\nreadiness_check_ms = 200\n",
            bootstrap(),
            database_url(),
            s.names.model,
            s.names.orders,
            s.names.payments
        ),
    )
    .unwrap();
    let keys = format!("it:{}", base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [0x42u8; 32]));
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_parsley-gateway"));
    for (var, _) in std::env::vars_os() {
        if var.to_string_lossy().starts_with("PARSLEY_") {
            command.env_remove(var);
        }
    }
    let mut leaving = command
        .args(["--config", file.to_str().unwrap()])
        .env("PARSLEY_TOKEN_KEYS", keys)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("starting parsley-gateway");
    let address = format!("127.0.0.1:{port}");
    let client = Arc::new(Client::new(&address, Duration::from_secs(30)));

    // The balancer: routes to the leaving gateway while its /readyz answers 200 (polled
    // every 100 ms, as a load balancer's health check would), else to the other one.
    let in_rotation = Arc::new(AtomicBool::new(false));
    let balancing = Arc::new(AtomicBool::new(true));
    let balancer = {
        let (client, in_rotation, balancing) = (Arc::clone(&client), Arc::clone(&in_rotation), Arc::clone(&balancing));
        tokio::spawn(async move {
            while balancing.load(Ordering::SeqCst) {
                let ready = client.get("/readyz", &[]).await.is_ok_and(|r| r.status == 200);
                in_rotation.store(ready, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let deadline = Instant::now() + TIMEOUT;
    while !in_rotation.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the gateway binary never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The load: sessions writing and reading their writes, each request to whichever
    // gateway the balancer says.
    let tally = Arc::new(Tally::default());
    let loading = Arc::new(AtomicBool::new(true));
    let s = Arc::new(s);
    let mut workers = Vec::new();
    for worker in 0..6 {
        let (s, client, in_rotation, tally, loading) =
            (Arc::clone(&s), Arc::clone(&client), Arc::clone(&in_rotation), Arc::clone(&tally), Arc::clone(&loading));
        workers.push(tokio::spawn(async move {
            let mut token: Option<String> = None;
            let mut i = 0u64;
            while loading.load(Ordering::SeqCst) {
                i += 1;
                let key = format!("w{worker}-{}", i % 5);
                let write = i % 2 == 1;
                let path = if write {
                    format!("/v1/topics/{}/records", s.names.orders)
                } else {
                    format!("/v1/models/{}/documents/{key}", s.names.model)
                };
                let body = json!({"key": key, "value": {"n": i}});
                let (status, new_token) = if in_rotation.load(Ordering::SeqCst) {
                    tally.to_leaving.fetch_add(1, Ordering::SeqCst);
                    let headers: Vec<(&str, &str)> =
                        token.as_deref().map(|t| vec![("Parsley-Session", t)]).unwrap_or_default();
                    let answer = if write {
                        client.post_json(&path, &headers, &body).await
                    } else {
                        client.get(&path, &headers).await
                    };
                    match answer {
                        Ok(r) => (r.status, r.header("parsley-session").map(str::to_string)),
                        Err(e) => {
                            tally.failures.lock().unwrap().push(format!("{path}: no answer: {e:#}"));
                            continue;
                        }
                    }
                } else {
                    let r = if write {
                        s.send(Method::POST, &path, token.as_deref(), Some(&body)).await
                    } else {
                        s.send(Method::GET, &path, token.as_deref(), None).await
                    };
                    (r.status.as_u16(), r.token.clone())
                };
                tally.answered.fetch_add(1, Ordering::SeqCst);
                match status {
                    200 | 201 | 404 => {}
                    // Documented: a read not covered within read_wait_ms.
                    503 if !write => {
                        tally.unavailable.fetch_add(1, Ordering::SeqCst);
                    }
                    other => tally.failures.lock().unwrap().push(format!("{path}: {other}")),
                }
                if new_token.is_some() {
                    token = new_token;
                }
            }
        }));
    }

    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = tally.to_leaving.load(Ordering::SeqCst);
    let signalled = Instant::now();
    assert!(std::process::Command::new("kill").args(["-TERM", &leaving.id().to_string()]).status().unwrap().success());
    // Readiness fails first, while the gateway still serves.
    let r = client.get("/readyz", &[]).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut r = r;
    while !r.as_ref().is_ok_and(|r| r.status == 503) {
        assert!(Instant::now() < deadline, "readiness never failed: {r:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
        r = client.get("/readyz", &[]).await;
    }
    let draining = r.unwrap();
    assert_eq!(draining.json().unwrap()["status"], "draining");
    let health = client.get("/livez", &[]).await.expect("still serving while draining");
    assert_eq!(health.status, 200);

    let exited = tokio::task::spawn_blocking(move || leaving.wait().unwrap()).await.unwrap();
    let stopped_after = signalled.elapsed();
    assert!(exited.success(), "the gateway exits 0 after a SIGTERM: {exited:?}");
    assert!(
        stopped_after >= Duration::from_millis(1500),
        "stopped {stopped_after:?} after the signal, within the grace"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    loading.store(false, Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }
    balancing.store(false, Ordering::SeqCst);
    balancer.await.unwrap();

    let failures = tally.failures.lock().unwrap().clone();
    let answered = tally.answered.load(Ordering::SeqCst);
    eprintln!(
        "answered {answered} requests, {} to the leaving gateway ({before} before the signal), {} reads 503 \
         not-yet-covered; stopped {stopped_after:?} after SIGTERM",
        tally.to_leaving.load(Ordering::SeqCst),
        tally.unavailable.load(Ordering::SeqCst)
    );
    assert!(failures.is_empty(), "{} requests lost or failed: {failures:?}", failures.len());
    assert!(before > 10 && answered > before, "the load ran through both gateways");
}
