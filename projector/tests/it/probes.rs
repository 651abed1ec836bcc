//! The projector's probes and conventions on the real services: `/livez` and `/readyz` on
//! the metrics listener in each state — ready once joined, a frozen task runner failing
//! liveness (readiness unaffected), `stopping` after the shutdown signal — and
//! `parsley_build_info`; the binary's `--version`, usage errors (exit 2) and `status`
//! exiting 3 while a task is refused.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parsley_projector::Projector;
use parsley_settings::config::Config;
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::watch;

use crate::support::*;

/// A free port on loopback (bound, then released for the projector to bind).
fn free_address() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// `GET path` on the metrics listener: the status code and the body (`None`: no answer).
async fn get(address: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut socket = tokio::net::TcpStream::connect(address).await.ok()?;
    socket.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes()).await.ok()?;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(5), socket.read_to_string(&mut text)).await.ok()?.ok()?;
    let status = text.get(9..12)?.parse().ok()?;
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
    Some((status, body))
}

async fn probe(address: SocketAddr, path: &str) -> (u16, Value) {
    let (status, body) = get(address, path).await.unwrap_or_else(|| panic!("no answer to {path}"));
    (status, serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}")))
}

/// Polls `path` until `want` holds of its answer.
async fn until(address: SocketAddr, path: &str, what: &str, want: impl Fn(u16, &Value) -> bool) -> (u16, Value) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some((status, body)) = get(address, path).await {
            let json: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            if want(status, &json) {
                return (status, json);
            }
            assert!(Instant::now() < deadline, "{what}: {path} still answers {status} {body}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probes_answer_in_each_state_and_a_frozen_runner_fails_liveness() {
    let n = Names::new("probes");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let _pool = pool().await;
    let address = free_address();
    let mut config: Config = n.config();
    config.projector.metrics_address = address.to_string();
    config.projector.runner_stall_ms = 1_000;
    config.models[0].projection = "recording".into();
    let recording = Recording::new(&config);
    let hang = std::sync::Arc::clone(&recording.hang);
    let (stop, shutdown) = watch::channel(false);
    let factory = (*recording).clone();
    let run = tokio::spawn(
        Projector::builder(config).projection("recording", move |_| Ok(factory.clone())).shutdown(shutdown).run(),
    );

    // Ready once started and joined; live.
    let (_, ready) = until(address, "/readyz", "joining", |s, _| s == 200).await;
    assert_eq!(ready["status"], "ready", "{ready}");
    assert_eq!(ready["models"][&n.model]["state"], "joined", "{ready}");
    assert_eq!(probe(address, "/livez").await, (200, serde_json::json!({"status": "live"})));
    let (_, metrics) = get(address, "/metrics").await.unwrap();
    let build = format!("parsley_build_info{{version=\"{}\",commit=\"", env!("CARGO_PKG_VERSION"));
    assert!(metrics.contains(&build), "{metrics}");

    // A step that never returns: liveness fails past runner_stall_ms, naming the task;
    // readiness stays (the instance still holds its membership).
    hang.store(true, Ordering::SeqCst);
    produce(&producer(), &n.orders, 0, "frozen", Some(b"{}"), None).await;
    let (_, stuck) = until(address, "/livez", "the frozen runner", |s, _| s == 503).await;
    assert_eq!(stuck["status"], "stuck", "{stuck}");
    assert_eq!(
        (stuck["stuck"][0]["model"].as_str(), stuck["stuck"][0]["task"].as_u64()),
        (Some(n.model.as_str()), Some(0))
    );
    assert!(stuck["stuck"][0]["in_step_ms"].as_u64().unwrap() > 1_000, "{stuck}");
    let (status, ready) = probe(address, "/readyz").await;
    assert_eq!(status, 200, "a stuck runner is liveness' business: {ready}");

    // Shutdown: the probes still answer while the (frozen) step is waited for.
    stop.send(true).unwrap();
    let (status, stopping) = until(address, "/readyz", "stopping", |_, j| j["status"] == "stopping").await;
    assert_eq!(status, 503, "{stopping}");
    run.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_has_a_version_usage_errors_exit_2_and_status_exits_3_on_a_refused_task() {
    let binary = env!("CARGO_BIN_EXE_parsley-projector");
    let out = Command::new(binary).arg("--version").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    assert!(text.starts_with(&format!("parsley-projector {} (commit ", env!("CARGO_PKG_VERSION"))), "{text}");
    assert!(!text.contains("(commit )"), "{text}");
    for args in
        [&["frobnicate"][..], &["run", "--nope"], &["create-topics", "--partitions", "0"], &["skip", "--model", "m"]]
    {
        let out = Command::new(binary).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }

    let n = Names::new("status-exit");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let dir = parsley_testkit::ScratchDir::new("status-exit");
    let file = dir.join("parsley.toml");
    std::fs::write(
        &file,
        format!(
            "[kafka]\nbootstrap = \"{}\"\n[[models]]\nname = \"{}\"\ntopics = [{{ name = \"{}\" }}, {{ name = \"{}\" }}]\n",
            bootstrap(),
            n.model,
            n.orders,
            n.payments
        ),
    )
    .unwrap();
    let status = || {
        Command::new(binary)
            .args(["status", "--model", &n.model, "--config"])
            .arg(&file)
            .env("DATABASE_URL", database_url())
            .output()
            .unwrap()
    };
    let config = n.config();
    let mut projector = start(&config, &pool, Recording::new(&config)).await;
    drive(&mut projector, 2).await;
    let out = status();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));

    // A damaged parsley.causes header refuses the task.
    produce(&producer(), &n.orders, 0, "bad", Some(b"{}"), Some(&[0x02, 0x00])).await;
    drive_until(&mut projector, "the task to refuse", || async {
        report(&pool, &n.model).await.task(0).is_some_and(|t| t.status == parsley_store::TaskStatus::Refused)
    })
    .await;
    let out = status();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("REFUSED UNDECODABLE_METADATA"), "{text}");

    let out = Command::new(binary)
        .args(["status", "--config"])
        .arg(&file)
        .env("DATABASE_URL", "postgres://nobody:x@127.0.0.1:1/none")
        .env_remove("PARSLEY_DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "a failure: {}", String::from_utf8_lossy(&out.stderr));
}
