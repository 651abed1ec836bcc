//! Readiness, status and the served process: `/readyz` against the real services, the
//! admin status from SQL aggregates (held counts and bytes, queue heads and their blockers,
//! clock widths), and `Gateway::serve` answering over TCP on its two listeners — the admin
//! routes only on the admin listener, or on the main one with the admin bearer token — and
//! stopping on its shutdown signal.

use std::net::SocketAddr;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use parsley::CausalPast;
use parsley_gateway::settings::AdminToken;
use parsley_gateway::{Gateway, GatewayConfig};
use rdkafka::producer::Producer as _;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::watch;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_and_status_reflect_the_services_and_the_tasks() {
    let mut s = Stack::new("ops", 2, "").await;
    let r = s.send(Method::GET, "/readyz", None, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["checks"]["migrations"]["ok"], json!(true));

    let st = s.status().await;
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
    let st = s.status().await;
    let model = &st.json["models"][0];
    assert_eq!(model["task_count"], json!(2));
    let tasks = model["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 2);
    assert!(tasks.iter().all(|t| t["status"] == json!("running")), "{st:?}");
    let owner = w.json["partition"].as_u64().unwrap() as usize;
    assert!(tasks[owner]["clock_width"].as_u64().unwrap() >= 1, "{}", st.json);
    assert_eq!((tasks[owner]["held"].clone(), tasks[owner]["held_bytes"].clone()), (json!(0), json!(0)));

    let m = send(&s.admin, Method::GET, "/metrics", None, None).await;
    assert_eq!(m.status, StatusCode::OK);
    s.stop_projector().await;
}

/// A payment held behind an order in an open transaction: the status counts it and its
/// bytes, names it as the head of its queue, and blocks it on exactly the order — from
/// aggregates, without loading the held record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_held_records_from_aggregates() {
    let mut s = Stack::new("ops-held", 1, "").await;
    let (orders, payments) = (s.names.orders.clone(), s.names.payments.clone());
    s.start_projector().await;
    let order_channel = channel(&s.state, &orders, 0).await;
    let txp = transactional_producer();
    txp.begin_transaction().unwrap();
    let order_at = produce(&txp, &orders, 0, "o1", br#"{"status":"placed"}"#, None).await;
    let causes = CausalPast::from_pairs([(order_channel, order_at)]);
    let value = br#"{"paid":true}"#;
    let pay_at = produce(&producer(), &payments, 0, "o1", value, Some(&causes)).await;

    let deadline = std::time::Instant::now() + TIMEOUT;
    let task = loop {
        let st = s.status().await;
        let task = st.json["models"][0]["tasks"][0].clone();
        if task["held"] == json!(1) {
            break task;
        }
        assert!(std::time::Instant::now() < deadline, "the payment is never held: {}", st.json);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let channels = task["channels"].as_array().unwrap();
    let held: Vec<&Value> = channels.iter().filter(|c| c["held"] == json!(1)).collect();
    let [c] = held.as_slice() else { panic!("one channel holds the payment: {task}") };
    assert_eq!(c["channel"]["topic"], json!(payments), "{task}");
    assert_eq!(c["head"], json!(pay_at), "{task}");
    assert_eq!(c["settled"], json!(pay_at - 1), "{task}");
    let bytes = c["held_bytes"].as_i64().unwrap();
    let at_least = (value.len() + "o1".len() + causes.encode().len()) as i64;
    assert!(bytes >= at_least, "held bytes {bytes} count key, value and causes ({at_least}): {task}");
    assert_eq!(task["held_bytes"], json!(bytes));
    assert!(c["oldest_held_age_s"].as_f64().is_some_and(|a| a >= 0.0), "{task}");
    let blockers = c["blockers"].as_array().unwrap();
    let [b] = blockers.as_slice() else { panic!("blocked on the order alone: {task}") };
    assert_eq!(
        (b["channel"].clone(), b["required"].clone()),
        (json!({"topic": orders, "topic_id": order_channel.topic.to_string(), "partition": 0}), json!(order_at)),
        "{task}"
    );
    assert!(b["settled"].as_i64().is_none_or(|s| s < order_at), "the order is not settled: {task}");
    txp.commit_transaction(TIMEOUT).unwrap();
    let deadline = std::time::Instant::now() + TIMEOUT;
    while s.status().await.json["models"][0]["tasks"][0]["held"] != json!(0) {
        assert!(std::time::Instant::now() < deadline, "the payment is never delivered");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    s.stop_projector().await;
}

/// One HTTP/1.1 exchange over TCP; the answer as text.
async fn get(address: SocketAddr, path: &str, headers: &str) -> String {
    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n{headers}\r\n");
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    socket.read_to_string(&mut answer).await.unwrap();
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_answers_over_tcp_and_stops_on_its_signal() {
    let n = Names::new("serve");
    let config = config(&n, "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"");
    let gateway = Gateway::new(GatewayConfig::with_keys(config, ring()).unwrap()).unwrap();
    let listeners = gateway.bind().await.unwrap();
    let address = listeners.local_addr().unwrap();
    let admin = listeners.admin_addr().expect("an admin listener").unwrap();
    let (stop, shutdown) = watch::channel(false);
    let server = tokio::spawn(gateway.serve(listeners, shutdown));

    let answer = get(address, "/healthz", "").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"status\":\"ok\""), "{answer}");
    // Without an admin token the admin routes are the admin listener's alone.
    for path in ["/v1/status", "/metrics"] {
        let answer = get(address, path, "").await;
        assert!(answer.starts_with("HTTP/1.1 404") && answer.contains("problems/no-such-route"), "{answer}");
        let answer = get(admin, path, "").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{path} on the admin listener: {answer}");
    }
    assert!(get(admin, "/healthz", "").await.starts_with("HTTP/1.1 200"));
    let answer = get(admin, "/v1/topics/x/records", "").await;
    assert!(answer.starts_with("HTTP/1.1 404"), "the admin listener serves no client routes: {answer}");

    stop.send(true).unwrap();
    tokio::time::timeout(TIMEOUT, server).await.expect("the server stops").unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_admin_token_the_main_listener_serves_admin_routes_to_its_bearer() {
    let n = Names::new("serve-bearer");
    let config = config(&n, "listen = \"127.0.0.1:0\"\nadmin_listen = \"\"");
    let mut config = GatewayConfig::with_keys(config, ring()).unwrap();
    let token = "it-admin-token-0123456789";
    config.admin_token = Some(AdminToken::new(token).unwrap());
    let gateway = Gateway::new(config).unwrap();
    let listeners = gateway.bind().await.unwrap();
    assert!(listeners.admin_addr().is_none(), "admin_listen = \"\": no admin listener");
    let address = listeners.local_addr().unwrap();
    let (stop, shutdown) = watch::channel(false);
    let server = tokio::spawn(gateway.serve(listeners, shutdown));

    for path in ["/v1/status", "/metrics"] {
        for headers in ["", "Authorization: Bearer wrong-token-0123456789\r\n", "Authorization: Basic eDp5\r\n"] {
            let answer = get(address, path, headers).await;
            assert!(answer.starts_with("HTTP/1.1 401"), "{path} {headers:?}: {answer}");
            assert!(answer.contains("problems/unauthorized"), "{answer}");
            assert!(answer.to_ascii_lowercase().contains("www-authenticate: bearer"), "{answer}");
        }
        let answer = get(address, path, &format!("Authorization: Bearer {token}\r\n")).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
    }
    assert!(get(address, "/healthz", "").await.starts_with("HTTP/1.1 200"), "health stays public");
    stop.send(true).unwrap();
    tokio::time::timeout(TIMEOUT, server).await.expect("the server stops").unwrap().unwrap();
}

/// The gate's check and data read must share one snapshot. They are one statement, run
/// outside any transaction at `READ COMMITTED`: while a writer commits a model's clock row
/// and its document together, over and over, every read of the two by that statement agrees
/// — for a single key (its owner's rows) and for a page (every row) alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_reads_the_clock_and_the_data_in_one_statement() {
    use parsley::{ChannelId, TopicId};
    use parsley_store::documents::{gated_document, gated_page, ClockScope, GateInputs, RecordedModel};

    let pool = pool().await;
    let model = unique("one-statement");
    // The model is the test's own, so any topic ID will do.
    let topic = TopicId::from_bytes([7; 16]);
    let channel = ChannelId::new(topic, 0);
    parsley_store::ordering::register_model(&pool, &model, 1, &[("orders".to_string(), topic)]).await.unwrap();
    parsley_store::ordering::take_task(&pool, &model, 0, "test").await.unwrap();
    let id = uuid::Uuid::from_bytes(*topic.as_bytes());
    sqlx::query("INSERT INTO parsley.clock (model, task, topic_id, partition, position) VALUES ($1, 0, $2, 0, 0)")
        .bind(&model)
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    // Written as a step would be (marked as one: documents changed outside a step notify
    // every model, which would drop the snapshots other tests' gateways keep).
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT set_config('parsley.step', 'on', true)").execute(&mut *tx).await.unwrap();
    sqlx::query(
        "INSERT INTO projection.documents (model, key, task, doc, topic_id, partition, position)
         VALUES ($1, 'k', 0, '{\"n\": 0}', $2, 0, 0)",
    )
    .bind(&model)
    .bind(id)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();

    // The writer: the clock row and the document move together, one transaction each step.
    let (stop, mut stopped) = watch::channel(false);
    let writer = tokio::spawn({
        let (pool, model) = (pool.clone(), model.clone());
        async move {
            let mut n: i64 = 0;
            while !*stopped.borrow_and_update() {
                n += 1;
                let mut tx = pool.begin().await.unwrap();
                sqlx::query("SELECT set_config('parsley.step', 'on', true)").execute(&mut *tx).await.unwrap();
                sqlx::query("UPDATE parsley.clock SET position = $2 WHERE model = $1")
                    .bind(&model)
                    .bind(n)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                sqlx::query(
                    "UPDATE projection.documents SET doc = jsonb_build_object('n', $2::bigint) WHERE model = $1",
                )
                .bind(&model)
                .bind(n)
                .execute(&mut *tx)
                .await
                .unwrap();
                tx.commit().await.unwrap();
            }
            n
        }
    });

    let mut conn = pool.acquire().await.unwrap();
    let isolation: String = sqlx::query_scalar("SHOW transaction_isolation").fetch_one(&mut *conn).await.unwrap();
    assert_eq!(isolation, "read committed", "no transaction gives the snapshot: the statement does");
    let clock = ClockScope::Owner { owner: 0, received: vec![topic], partitions: vec![0] };
    let mut inputs = GateInputs { clock, cached: None };
    let mut seen = std::collections::BTreeSet::new();
    for round in 0..600 {
        let (position, n) = if round % 2 == 0 {
            let read = gated_document(&mut conn, &model, "k", &inputs).await.unwrap();
            // The first read learns the shape; the rest are asked with it, as the gateway does.
            if let RecordedModel::Read { shape, .. } = read.model {
                assert_eq!(round, 0, "the shape did not change");
                inputs.cached = Some(shape);
            }
            let doc = read.data.expect("the document exists");
            (read.clock.iter().find(|r| r.channel == channel).map(|r| r.position), doc.value().unwrap()["n"].as_i64())
        } else {
            let read = gated_page(&mut conn, &model, inputs.cached, None, 10, None).await.unwrap();
            assert_eq!(read.model, RecordedModel::Unchanged);
            (
                read.clock.iter().find(|r| r.channel == channel).map(|r| r.position),
                read.data[0].value().unwrap()["n"].as_i64(),
            )
        };
        assert_eq!(position, n, "round {round}: the clock and the document come from one snapshot");
        seen.insert(n);
    }
    stop.send(true).unwrap();
    let written = writer.await.unwrap();
    assert!(
        seen.len() > 10,
        "the writer committed while the reads ran ({} values seen, {written} written)",
        seen.len()
    );
}

/// The model's shape identity (`parsley.models.shape_id`) is renewed by every change of the
/// width, the format or a topic identity — whoever writes it — and a gated statement asked
/// with the current one answers that the shape is unchanged without reading the topic
/// identities again; asked with any earlier one (or none), it reads the row in full. The
/// document, the page and the named queries' statements alike.
#[tokio::test]
async fn a_gated_statement_reads_the_model_s_row_again_only_when_its_shape_changed() {
    use parsley::TopicId;
    use parsley_store::documents::{gated_document, gated_page, ClockScope, GateInputs, RecordedModel, ShapeId};
    use parsley_store::ordering::register_model;
    use parsley_store::queries::in_snapshot;

    let pool = pool().await;
    let model = unique("shape-id");
    let (orders, payments) = (TopicId::from_bytes([3; 16]), TopicId::from_bytes([4; 16]));
    let mut conn = pool.acquire().await.unwrap();
    // What the three statements say of the model, asked with `cached`.
    async fn recorded(conn: &mut sqlx::PgConnection, model: &str, cached: Option<ShapeId>) -> RecordedModel {
        let inputs = GateInputs { clock: ClockScope::All, cached };
        let one = gated_document(&mut *conn, model, "k", &inputs).await.unwrap().model;
        let page = gated_page(&mut *conn, model, cached, None, 10, None).await.unwrap().model;
        fn nothing(_: &mut sqlx::PgConnection) -> parsley_store::queries::BoxFuture<'_, Result<(), sqlx::Error>> {
            Box::pin(async { Ok(()) })
        }
        let query = in_snapshot(&mut *conn, model, &inputs, &nothing).await.unwrap().model;
        assert_eq!((&page, &query), (&one, &one), "the statements agree");
        one
    }
    // The shape as read in full (asked with none), checked to be unchanged when asked with it.
    async fn current(conn: &mut sqlx::PgConnection, model: &str) -> (ShapeId, parsley_store::ordering::ModelRow) {
        let RecordedModel::Read { shape, row } = recorded(&mut *conn, model, None).await else {
            panic!("model {model} has a row")
        };
        assert_eq!(recorded(&mut *conn, model, Some(shape)).await, RecordedModel::Unchanged);
        (shape, row)
    }
    async fn sql(pool: &sqlx::PgPool, statement: &str, model: &str) {
        sqlx::query(statement).bind(model).execute(pool).await.unwrap();
    }

    assert_eq!(recorded(&mut conn, &model, None).await, RecordedModel::Absent, "no state yet");
    register_model(&pool, &model, 2, &[("orders".to_string(), orders)]).await.unwrap();
    let (first, row) = current(&mut conn, &model).await;
    assert_eq!((row.task_count, row.topics.get("orders")), (2, Some(&orders)));
    let mut seen = vec![first];
    // Asked with the last shape seen: the row in full, under a shape never seen before.
    async fn changed(
        conn: &mut sqlx::PgConnection,
        model: &str,
        seen: &mut Vec<ShapeId>,
        why: &str,
    ) -> parsley_store::ordering::ModelRow {
        let before = *seen.last().unwrap();
        let RecordedModel::Read { shape, row } = recorded(&mut *conn, model, Some(before)).await else {
            panic!("{why}: the row is read again")
        };
        assert!(!seen.contains(&shape), "{why}: a new shape identity");
        assert_eq!(current(&mut *conn, model).await, (shape, row.clone()), "{why}");
        seen.push(shape);
        row
    }

    // Recording the model again as it is changes nothing.
    register_model(&pool, &model, 2, &[("orders".to_string(), orders)]).await.unwrap();
    assert_eq!(recorded(&mut conn, &model, Some(first)).await, RecordedModel::Unchanged);
    sql(&pool, "UPDATE parsley.topics SET recorded_at = now() WHERE model = $1", &model).await;
    assert_eq!(recorded(&mut conn, &model, Some(first)).await, RecordedModel::Unchanged);

    register_model(&pool, &model, 2, &[("payments".to_string(), payments)]).await.unwrap();
    let row = changed(&mut conn, &model, &mut seen, "a topic recorded").await;
    assert_eq!(row.topics.get("payments"), Some(&payments));
    sql(
        &pool,
        "UPDATE parsley.topics SET topic_id = gen_random_uuid() WHERE model = $1 AND topic_name = 'orders'",
        &model,
    )
    .await;
    let row = changed(&mut conn, &model, &mut seen, "a topic identity changed").await;
    assert!(row.topics.get("orders").is_some_and(|id| *id != orders), "{row:?}");
    sql(&pool, "DELETE FROM parsley.topics WHERE model = $1 AND topic_name = 'payments'", &model).await;
    let row = changed(&mut conn, &model, &mut seen, "a topic removed").await;
    assert_eq!(row.topics.len(), 1, "{row:?}");
    sql(&pool, "UPDATE parsley.models SET task_count = 3 WHERE model = $1", &model).await;
    assert_eq!(changed(&mut conn, &model, &mut seen, "the width changed").await.task_count, 3);
    sql(&pool, "UPDATE parsley.models SET format_version = format_version + 1 WHERE model = $1", &model).await;
    changed(&mut conn, &model, &mut seen, "the format changed").await;
    // Truncated (other tests share the table: inside a transaction rolled back).
    {
        let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
        sqlx::query("TRUNCATE parsley.topics").execute(&mut *tx).await.unwrap();
        let inputs = GateInputs { clock: ClockScope::All, cached: seen.last().copied() };
        let RecordedModel::Read { shape, row } = gated_document(&mut tx, &model, "k", &inputs).await.unwrap().model
        else {
            panic!("truncated topics: the row is read again")
        };
        assert!(!seen.contains(&shape) && row.topics.is_empty(), "{row:?}");
        tx.rollback().await.unwrap();
    }
    // A rebuild: the model deleted and recorded again as it first was.
    sql(&pool, "DELETE FROM parsley.topics WHERE model = $1", &model).await;
    sql(&pool, "DELETE FROM parsley.models WHERE model = $1", &model).await;
    assert_eq!(recorded(&mut conn, &model, seen.last().copied()).await, RecordedModel::Absent);
    register_model(&pool, &model, 2, &[("orders".to_string(), orders)]).await.unwrap();
    let row = changed(&mut conn, &model, &mut seen, "the model recorded again").await;
    assert_eq!((row.task_count, row.topics.get("orders")), (2, Some(&orders)));
}

/// A gated statement finds a shape it does not hold, and reads that shape's topic identities
/// with a second statement: while a writer flips the model between two shapes (two tasks
/// with topic `a`, three with topic `b`, each flip one transaction), every read of the model
/// in full is one of the two shapes, never the width of one with the topics of the other —
/// for the document, the page and the named queries' statements alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shape_read_in_full_is_never_mixed_from_two_shapes() {
    use parsley::TopicId;
    use parsley_store::documents::{gated_document, gated_page, ClockScope, GateInputs, RecordedModel};
    use parsley_store::ordering::register_model;
    use parsley_store::queries::in_snapshot;

    let pool = pool().await;
    let model = unique("shape-flip");
    let (a, b) = (TopicId::from_bytes([5; 16]), TopicId::from_bytes([6; 16]));
    register_model(&pool, &model, 2, &[("a".to_string(), a)]).await.unwrap();
    let (stop, mut stopped) = watch::channel(false);
    let writer = tokio::spawn({
        let (pool, model) = (pool.clone(), model.clone());
        async move {
            // One flip, one transaction: the topics first, then the width. Another test's
            // `TRUNCATE parsley.topics` (rolled back) locks the topics, then its trigger the
            // models' rows: a flip that meets it in the other order is a deadlock, which
            // Postgres ends by failing one side — that flip is simply made again.
            async fn flip(
                pool: &sqlx::PgPool,
                model: &str,
                tasks: i32,
                from: &str,
                to: &str,
                id: TopicId,
            ) -> sqlx::Result<()> {
                let mut tx = pool.begin().await?;
                sqlx::query("DELETE FROM parsley.topics WHERE model = $1 AND topic_name = $2")
                    .bind(model)
                    .bind(from)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query("INSERT INTO parsley.topics (model, topic_name, topic_id) VALUES ($1, $2, $3)")
                    .bind(model)
                    .bind(to)
                    .bind(uuid::Uuid::from_bytes(*id.as_bytes()))
                    .execute(&mut *tx)
                    .await?;
                sqlx::query("UPDATE parsley.models SET task_count = $2 WHERE model = $1")
                    .bind(model)
                    .bind(tasks)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await
            }
            let mut flips = 0u32;
            while !*stopped.borrow_and_update() {
                let (tasks, from, to, id) = if flips.is_multiple_of(2) { (3, "a", "b", b) } else { (2, "b", "a", a) };
                match flip(&pool, &model, tasks, from, to, id).await {
                    Ok(()) => flips += 1,
                    Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("40P01") => {}
                    Err(e) => panic!("flipping the shape: {e}"),
                }
                // A flip every millisecond or so still lands between a read's two statements
                // often; back to back, on a loaded machine, it could land there in each of a
                // read's attempts, and the read fails as it should after `SHAPE_ATTEMPTS`.
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            flips
        }
    });
    fn nothing(_: &mut sqlx::PgConnection) -> parsley_store::queries::BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async { Ok(()) })
    }
    let mut conn = pool.acquire().await.unwrap();
    let inputs = GateInputs { clock: ClockScope::All, cached: None };
    let mut widths = std::collections::BTreeSet::new();
    for round in 0..450 {
        let model_read = match round % 3 {
            0 => gated_document(&mut conn, &model, "k", &inputs).await.unwrap().model,
            1 => gated_page(&mut conn, &model, None, None, 10, None).await.unwrap().model,
            _ => in_snapshot(&mut conn, &model, &inputs, &nothing).await.unwrap().model,
        };
        let RecordedModel::Read { row, .. } = model_read else { panic!("round {round}: asked with no shape") };
        let topics: Vec<(&str, TopicId)> = row.topics.iter().map(|(n, id)| (n.as_str(), *id)).collect();
        match row.task_count {
            2 => assert_eq!(topics, [("a", a)], "round {round}: two tasks go with topic a"),
            3 => assert_eq!(topics, [("b", b)], "round {round}: three tasks go with topic b"),
            other => panic!("round {round}: {other} tasks"),
        }
        widths.insert(row.task_count);
    }
    stop.send(true).unwrap();
    let flips = writer.await.unwrap();
    assert_eq!(widths.len(), 2, "both shapes were read ({flips} flips)");
}

/// The status read's transaction (`/v1/status`) is one snapshot: the statement that opens
/// it really gives repeatable read, read only.
#[tokio::test]
async fn the_status_transaction_is_one_read_only_snapshot() {
    let pool = pool().await;
    let mut tx = parsley_store::ordering::begin_snapshot(&pool).await.unwrap();
    let isolation: String = sqlx::query_scalar("SHOW transaction_isolation").fetch_one(&mut *tx).await.unwrap();
    let read_only: String = sqlx::query_scalar("SHOW transaction_read_only").fetch_one(&mut *tx).await.unwrap();
    assert_eq!((isolation.as_str(), read_only.as_str()), ("repeatable read", "on"));
    let write = sqlx::query("CREATE TEMP TABLE gate_must_not_write (x int)").execute(&mut *tx).await;
    assert!(write.is_err(), "a read-only transaction refuses writes");
}

/// Leases in the admin status, and a 503 that names the tasks nobody runs: while the
/// projector runs, each task shows its owner with a live lease and a recent step, and the
/// instance is listed; once it stops (handing its tasks back) a read that waits on a task
/// names it as held by no instance; once a lease is left to expire (an owner that died),
/// the 503 names the expired lease and its owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_leases_and_a_503_names_the_tasks_nobody_runs() {
    let mut s = Stack::new("ops-lease", 1, "read_wait_ms = 300").await;
    let orders = s.names.orders.clone();
    s.start_projector().await;
    let w = s.write(&orders, "k", json!(1), None).await;
    let r = s.read("k", Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let owner = s.config.owner();
    // `start` takes the tasks at once; the instance joins the members at the first beat of
    // `run`, which a loaded machine may not have reached yet.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let st = loop {
        let st = s.status().await;
        if st.json["models"][0]["instances"].as_array().is_some_and(|i| !i.is_empty()) {
            break st;
        }
        assert!(std::time::Instant::now() < deadline, "the instance never joined: {}", st.json);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let model = &st.json["models"][0];
    let task = &model["tasks"][0];
    assert_eq!(task["owner"], json!(owner), "{}", st.json);
    assert_eq!(task["lease"]["held"], json!(true), "{}", st.json);
    assert!(task["lease"]["expires_in_ms"].as_i64().unwrap() > 0, "{}", st.json);
    assert!(task["last_step_ms_ago"].as_i64().is_some(), "{}", st.json);
    assert_eq!(model["instances"], json!([{"instance": owner, "balanced": true, "live": true, "tasks": 1}]));

    // Stopped: the task is handed back, the instance has left.
    s.stop_projector().await;
    let st = s.status().await;
    let model = &st.json["models"][0];
    assert_eq!(model["tasks"][0]["lease"], json!({"held": false, "expires_in_ms": null, "expired_ms_ago": null}));
    assert_eq!(model["instances"], json!([]));
    let w = s.write(&orders, "k", json!(2), Some(&r.token())).await;
    let r = s.read("k", Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.json);
    let detail = r.json["detail"].as_str().unwrap();
    assert!(detail.contains("task 0 is held by no instance"), "{detail}");
    assert_eq!(r.json["tasks"][0]["lease"]["held"], json!(false), "{}", r.json);

    // An owner that died: its lease passed without anyone taking the task.
    sqlx::query("UPDATE parsley.tasks SET owner = 'gone', lease_until = now() - interval '4 seconds' WHERE model = $1")
        .bind(&s.names.model)
        .execute(&s.pool)
        .await
        .unwrap();
    let r = s.read("k", Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.json);
    let detail = r.json["detail"].as_str().unwrap();
    assert!(detail.contains("task 0's lease (owner \"gone\") expired"), "{detail}");
    assert!(r.json["tasks"][0]["lease"]["expired_ms_ago"].as_i64().unwrap() >= 4000, "{}", r.json);
}

/// What kept snapshots rest on (`ClockNotifier::caught_up`): a statement on the listening
/// connection is a barrier. Every notification committed before the statement was sent
/// reaches the listener ahead of the statement's answer, so once the answer is in, sqlx
/// holds each of them. Checked 300 times in a row, each notification sent by another
/// connection and committed just before the barrier.
#[tokio::test]
async fn a_statement_on_the_listening_connection_is_a_barrier_for_notifications() {
    let pool = pool().await;
    let channel = format!("barrier_{}", std::process::id());
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await.unwrap();
    listener.listen(&channel).await.unwrap();
    let mut sender = pool.acquire().await.unwrap();
    for i in 0..300 {
        let payload = i.to_string();
        sqlx::query("SELECT pg_notify($1, $2)").bind(&channel).bind(&payload).execute(&mut *sender).await.unwrap();
        sqlx::query("SELECT 1").execute(&mut listener).await.unwrap();
        let heard: Vec<String> =
            std::iter::from_fn(|| listener.next_buffered()).map(|n| n.payload().to_string()).collect();
        assert_eq!(heard, vec![payload], "round {i}: the barrier's answer came before the notification");
    }
}

/// What noticing a lost listener rests on (`notify::listen`). Once sqlx has dropped a dead
/// listening connection (`try_recv` saw it end), the next statement on the listener
/// reconnects and listens again without a word, so a barrier then answers from another
/// backend: the pid differs from the one seen after `LISTEN`, which is how the gateway
/// counts the loss and stops trusting what it kept, whichever of its calls met the end first.
/// The new backend listens: a notification sent after the reconnect is heard behind the
/// next barrier.
#[tokio::test]
async fn a_barrier_after_the_listening_backend_ended_answers_from_another_backend() {
    use parsley_store::listen::barrier;

    let pool = pool().await;
    let channel = format!("replaced_{}", std::process::id());
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await.unwrap();
    listener.listen(&channel).await.unwrap();
    let first = barrier(&mut listener).await.unwrap().backend_pid;
    let terminated: bool =
        sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(first).fetch_one(&pool).await.unwrap();
    assert!(terminated, "the listening backend {first} was terminated");
    // The listener reads the backend's last words (an error, then the end of the stream),
    // and drops the connection when it meets the end.
    let mut seen = Vec::new();
    loop {
        let next = tokio::time::timeout(Duration::from_secs(10), listener.try_recv()).await;
        let next = next.expect("the listener notices its backend's end within 10 s");
        let dropped = matches!(next, Ok(None));
        seen.push(format!("{next:?}"));
        if dropped {
            break;
        }
        assert!(seen.len() < 5, "the listener never dropped the dead connection: {seen:?}");
    }
    let second =
        barrier(&mut listener).await.expect("a barrier reconnects a listener without a connection").backend_pid;
    assert_ne!(second, first, "the barrier answered from the terminated backend (seen: {seen:?})");
    sqlx::query("SELECT pg_notify($1, 'after')").bind(&channel).execute(&pool).await.unwrap();
    assert_eq!(barrier(&mut listener).await.unwrap().backend_pid, second);
    let heard: Vec<String> = std::iter::from_fn(|| listener.next_buffered()).map(|n| n.payload().to_string()).collect();
    assert_eq!(heard, vec!["after".to_string()], "the new backend listens on the channel");
}
