//! Session consistency end to end: write through the gateway, read through the gateway,
//! with the real projector applying the records in between.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use parsley_gateway::metrics::Metric;
use serde_json::{json, Value};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_reads_its_own_writes_never_a_404() {
    let mut s = Stack::new("ryw", 3, "read_wait_ms = 15000").await;
    s.start_projector().await;
    let (orders, payments) = (s.names.orders.clone(), s.names.payments.clone());

    let mut token: Option<String> = None;
    for i in 0..6 {
        let key = format!("order-{i}");
        let w = s.write(&orders, &key, json!({"status": "placed", "n": i}), token.as_deref()).await;
        assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
        assert_eq!(w.json["topic"], json!(orders));
        assert!(w.json["offset"].as_i64().unwrap() >= 0);
        // Read immediately: the gateway waits until the projector has applied the write.
        let r = s.read(&key, Some(&w.token())).await;
        assert_eq!(r.status, StatusCode::OK, "{key}: {}", r.json);
        assert_eq!(r.json["key"], json!(key));
        assert_eq!(r.json["document"], json!({"status": "placed", "n": i}));
        token = Some(r.token());
    }

    // A payment merges into the order; the session sees both.
    let w = s.write(&payments, "order-0", json!({"paid": true}), token.as_deref()).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let r = s.read("order-0", Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["document"], json!({"status": "placed", "n": 0, "paid": true}));
    assert_eq!(r.json["version"], json!(2));

    // The collection is gated on every task and shows every write of the session.
    let l = s.list("", Some(&r.token())).await;
    assert_eq!(l.status, StatusCode::OK, "{}", l.json);
    let keys: Vec<&str> = l.json["documents"].as_array().unwrap().iter().map(|d| d["key"].as_str().unwrap()).collect();
    assert_eq!(keys, (0..6).map(|i| format!("order-{i}")).collect::<Vec<_>>());
    assert_eq!(l.json["next"], Value::Null);
    // Paging.
    let p = s.list("?limit=4", Some(&l.token())).await;
    assert_eq!(p.json["documents"].as_array().unwrap().len(), 4);
    assert_eq!(p.json["next"], json!("order-3"));
    let p2 = s.list("?limit=4&after=order-3", Some(&p.token())).await;
    let rest: Vec<&str> = p2.json["documents"].as_array().unwrap().iter().map(|d| d["key"].as_str().unwrap()).collect();
    assert_eq!(rest, vec!["order-4", "order-5"]);

    // A tombstone deletes; a 404 comes only once the delete is proven applied.
    let w = s.write(&orders, "order-5", Value::Null, Some(&p2.token())).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let r = s.read("order-5", Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.json);
    assert_eq!(r.problem_type(), "https://parsley.dev/problems/not-found");
    assert!(r.token.is_some(), "a 404 carries the refreshed token");
    s.stop_projector().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_the_projector_a_covered_read_is_refused_with_every_gap() {
    let mut s = Stack::new("stopped", 2, "read_wait_ms = 700\nretry_after_s = 2").await;
    let orders = s.names.orders.clone();
    s.start_projector().await;
    let w = s.write(&orders, "a", json!({"v": 1}), None).await;
    let r = s.read("a", Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let applied_partition = w.json["partition"].as_u64().unwrap();
    let applied_offset = w.json["offset"].as_i64().unwrap();
    s.stop_projector().await;

    // Written while nothing applies it: the session's read cannot be covered.
    let w = s.write(&orders, "a", json!({"v": 2}), Some(&r.token())).await;
    assert_eq!(w.status, StatusCode::CREATED, "writes never wait on deliverability: {}", w.json);
    let (partition, offset) = (w.json["partition"].as_u64().unwrap(), w.json["offset"].as_i64().unwrap());
    let token = w.token();
    let started = Instant::now();
    let r = s.read("a", Some(&token)).await;
    assert!(started.elapsed() >= Duration::from_millis(650), "the read waited before refusing");
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.json);
    assert_eq!(r.retry_after.as_deref(), Some("2"));
    assert_eq!(r.content_type.as_deref(), Some("application/problem+json"));
    assert_eq!(r.problem_type(), "https://parsley.dev/problems/not-yet-covered");
    assert!(r.token.is_none(), "nothing was proven, so no token is issued");
    let gaps = r.json["gaps"].as_array().unwrap();
    assert_eq!(gaps.len(), 1, "{}", r.json);
    assert_eq!(gaps[0]["topic"], json!(orders));
    assert_eq!(gaps[0]["partition"], json!(partition));
    assert_eq!(gaps[0]["required"], json!(offset));
    let recorded = if partition == applied_partition { json!(applied_offset) } else { Value::Null };
    assert_eq!(gaps[0]["recorded"], recorded, "{}", r.json);
    assert_eq!(gaps[0]["tasks"], json!([partition]));
    // The collection has the same gap; the old document is never served meanwhile.
    let l = s.list("", Some(&token)).await;
    assert_eq!(l.status, StatusCode::SERVICE_UNAVAILABLE, "{}", l.json);

    // A session that demands nothing is served at once from what is there.
    let r = s.read("a", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["document"], json!({"v": 1}));

    // A read already waiting is woken by the projector's NOTIFY when it catches up: with
    // the fallback re-check 30 s away, only the notification can answer it in time.
    let (patient, _stop) =
        s.other_gateway("read_wait_ms = 30000\nrecheck_ms = 30000\nrequest_timeout_ms = 40000").await;
    let asked = Instant::now();
    let waiting = tokio::spawn({
        let token = token.clone();
        let uri = format!("/v1/models/{}/documents/a", s.names.model);
        async move { send(&patient, Method::GET, &uri, Some(&token), None).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the read waits for coverage");
    s.start_projector().await;
    let r = waiting.await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["document"], json!({"v": 2}));
    assert!(
        asked.elapsed() < Duration::from_secs(20),
        "woken by the notification, not the timer: {:?}",
        asked.elapsed()
    );
    s.stop_projector().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_sessions_see_their_writes_and_never_go_back() {
    const SESSIONS: usize = 4;
    const ROUNDS: usize = 6;
    let mut s = Stack::new("concurrent", 3, "read_wait_ms = 15000").await;
    s.start_projector().await;
    let orders = s.names.orders.clone();
    let payments = s.names.payments.clone();
    let model = s.names.model.clone();
    let router = s.router.clone();

    let mut clients = Vec::new();
    for c in 0..SESSIONS {
        let (router, orders, payments, model) = (router.clone(), orders.clone(), payments.clone(), model.clone());
        clients.push(tokio::spawn(async move {
            let mut token: Option<String> = None;
            let mut last_shared_version = 0i64;
            let mut last_seen: BTreeMap<String, i64> = BTreeMap::new();
            for round in 0..ROUNDS {
                let key = format!("c{c}-k{}", round % 3);
                let body = json!({"key": key, "value": {"client": c, "round": round}});
                let w =
                    send(&router, Method::POST, &format!("/v1/topics/{orders}/records"), token.as_deref(), Some(&body))
                        .await;
                assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
                let r =
                    send(&router, Method::GET, &format!("/v1/models/{model}/documents/{key}"), Some(&w.token()), None)
                        .await;
                assert_eq!(r.status, StatusCode::OK, "client {c} round {round}: {}", r.json);
                assert_eq!(r.json["document"], json!({"client": c, "round": round}), "read-your-writes");
                let version = r.json["version"].as_i64().unwrap();
                assert!(version >= last_seen.get(&key).copied().unwrap_or(0), "monotonic reads on {key}");
                last_seen.insert(key, version);
                token = Some(r.token());

                // Everyone also patches and reads one shared document.
                let patch = json!({"key": "shared", "value": {format!("c{c}"): round}});
                let w = send(
                    &router,
                    Method::POST,
                    &format!("/v1/topics/{payments}/records"),
                    token.as_deref(),
                    Some(&patch),
                )
                .await;
                assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
                let r =
                    send(&router, Method::GET, &format!("/v1/models/{model}/documents/shared"), Some(&w.token()), None)
                        .await;
                assert_eq!(r.status, StatusCode::OK, "{}", r.json);
                assert_eq!(r.json["document"][format!("c{c}")], json!(round), "own patch visible: {}", r.json);
                let version = r.json["version"].as_i64().unwrap();
                assert!(
                    version >= last_shared_version,
                    "monotonic reads: version {version} after {last_shared_version}"
                );
                last_shared_version = version;
                token = Some(r.token());
            }
            // The collection (gated on every task) shows this session's last value per key.
            let l =
                send(&router, Method::GET, &format!("/v1/models/{model}/documents?limit=1000"), token.as_deref(), None)
                    .await;
            assert_eq!(l.status, StatusCode::OK, "{}", l.json);
            let docs = l.json["documents"].as_array().unwrap();
            for k in 0..3 {
                let key = format!("c{c}-k{k}");
                let doc = docs.iter().find(|d| d["key"] == json!(key)).unwrap_or_else(|| panic!("{key} missing"));
                let last_round = (0..ROUNDS).filter(|r| r % 3 == k).max().unwrap();
                assert_eq!(doc["document"], json!({"client": c, "round": last_round}));
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    let shared = s.read("shared", None).await;
    assert_eq!(shared.json["version"], json!((SESSIONS * ROUNDS) as i64));
    s.stop_projector().await;
}

/// A record the projection cannot apply stops its task — failing (retried) or refused
/// (`PROJECTION_REJECTED`), never skipped — and a read blocked by it names the task and why.
/// The model's shape as the gateway caches it is never used past a change: a gateway that
/// served a session (its cache filled), then sees the model's recorded topic identity or
/// width change, answers the very next read — single key or page — by the new shape, exactly
/// as the core's gate does over it, and by the old one again once it is put back. Kept
/// snapshots off: the statement's own check of the shape is what is tested.
///
/// Two tasks; the session wrote a key on partition 0 and reads a key of task 1. Under the
/// recorded identity the pair is received and owned by task 0, which applied it: covered.
/// Under another identity (a topic recreated under the model) it is an upstream pair that
/// task 1 never saw: not covered. Under width 1 a pair on partition 1 has no task: not
/// covered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_model_shape_is_used_by_the_very_next_read() {
    shape_changes_are_seen(false).await;
}

/// The same changes with kept snapshots on (the default), kept for up to a minute: the very
/// next read after a change is answered by the new shape — never from a snapshot kept under
/// the old one, though the same key and page were served from memory just before the change.
/// The change's notification (a trigger's, migration `20261205000000`) may still be on its way
/// when the read arrives; the read's barrier on the listener's connection waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_model_shape_is_used_by_the_very_next_read_past_kept_snapshots() {
    shape_changes_are_seen(true).await;
}

async fn shape_changes_are_seen(kept: bool) {
    use parsley::murmur2::partition_for_key;

    let settings = if kept {
        "read_wait_ms = 300\nread_cache_bytes = 1048576\nread_cache_max_age_ms = 60000"
    } else {
        "read_wait_ms = 300\nread_cache_bytes = 0"
    };
    let mut s = Stack::new(if kept { "shape-kept" } else { "shape-change" }, 2, settings).await;
    let orders = s.names.orders.clone();
    let key_on = |p: u32| (0..).map(|i| format!("k{i}")).find(|k| partition_for_key(k.as_bytes(), 2) == p).unwrap();
    let (k0, k1) = (key_on(0), key_on(1));
    s.start_projector().await;
    let w1 = s.write(&orders, &k1, json!(1), None).await;
    let w0 = s.write(&orders, &k0, json!(0), None).await;
    assert_eq!((w0.json["partition"].clone(), w1.json["partition"].clone()), (json!(0), json!(1)));
    let (on_0, on_1) = (w0.token(), w1.token());
    // Covered once the projector applied both (each read waits at most 300 ms).
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.read(&k1, Some(&on_0)).await.status != StatusCode::OK
        || s.read(&k1, Some(&on_1)).await.status != StatusCode::OK
    {
        assert!(Instant::now() < deadline, "the projector never applied the writes");
    }
    s.stop_projector().await;
    // The next read follows the change at once: with kept snapshots, the read's barrier on
    // the listener's connection makes sure the change's notification has been heard.
    let changed = async |s: &Stack, sql: &str| {
        sqlx::query(sql).bind(&s.names.model).bind(&orders).execute(&s.pool).await.unwrap();
    };
    let recorded = recorded_topic_id(&s, &orders).await;
    let set_identity =
        |id: &str| format!("UPDATE parsley.topics SET topic_id = {id} WHERE model = $1 AND topic_name = $2");
    let (random, put_back) = (set_identity("gen_random_uuid()"), set_identity(&format!("'{recorded}'::uuid")));
    let not_covered = |r: &Reply, what: &str, tasks: Value| {
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{what}: {}", r.json);
        assert_eq!(r.problem_type(), "https://parsley.dev/problems/not-yet-covered", "{what}");
        assert_eq!(r.json["gaps"].as_array().map(|g| g.len()), Some(1), "{what}: {}", r.json);
        assert_eq!(r.json["gaps"][0]["tasks"], tasks, "{what}: {}", r.json);
    };

    // Another identity: the page (every task) and then the key (task 1) see it at once.
    let (page, key) = (|| s.list("", Some(&on_0)), || s.read(&k1, Some(&on_0)));
    served(&s, kept, page, "a page before the change").await;
    changed(&s, &random).await;
    not_covered(&s.list("", Some(&on_0)).await, "a page after the identity changed", json!([0, 1]));
    changed(&s, &put_back).await;
    served(&s, kept, page, "a page with the identity put back").await;
    served(&s, kept, key, "a key with the identity put back").await;
    changed(&s, &random).await;
    not_covered(&s.read(&k1, Some(&on_0)).await, "a key after the identity changed", json!([1]));
    changed(&s, &put_back).await;
    assert_eq!(s.read(&k1, Some(&on_0)).await.status, StatusCode::OK, "the identity put back");

    // Another width: a pair on partition 1 has no task of width 1.
    let set_width =
        |n: i32| format!("UPDATE parsley.models SET task_count = {n} WHERE model = $1 AND $2::text IS NOT NULL");
    let served = s.read(&k1, Some(&on_1)).await;
    assert_eq!(served.status, StatusCode::OK, "{}", served.json);
    changed(&s, &set_width(1)).await;
    not_covered(&s.read(&k1, Some(&on_1)).await, "a key after the width changed", json!([1]));
    changed(&s, &set_width(2)).await;
    assert_eq!(s.read(&k1, Some(&on_1)).await.status, StatusCode::OK, "the width put back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_503_names_the_stopped_task_that_blocks_the_session() {
    use rdkafka::producer::{FutureProducer, FutureRecord};

    let mut s = Stack::new("failing", 1, "read_wait_ms = 800\npublic_diagnostics = true").await;
    s.start_projector().await;
    // A record the document projection cannot apply (not JSON), written around the gateway.
    let raw: FutureProducer = parsley_infra::kafka::producer_config(&bootstrap()).create().unwrap();
    raw.send(FutureRecord::<str, [u8]>::to(&s.names.orders).key("x").payload(b"not json"), TIMEOUT)
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let st = s.status().await;
        if st.json["models"][0]["tasks"][0]["status"] != json!("running") {
            break;
        }
        assert!(Instant::now() < deadline, "the task never reported the record: {}", st.json);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let w = s.write(&s.names.orders.clone(), "x", json!({"ok": true}), None).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.json);
    let r = s.read("x", Some(&w.token())).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.json);
    let tasks = r.json["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 1, "{}", r.json);
    assert_eq!(tasks[0]["task"], json!(0));
    let why = match tasks[0]["status"].as_str() {
        Some("failing") => {
            assert!(tasks[0]["failures"].as_i64().unwrap() >= 1);
            tasks[0]["last_error"].as_str()
        }
        Some("refused") => {
            assert_eq!(tasks[0]["reason"], json!("PROJECTION_REJECTED"), "{}", r.json);
            tasks[0]["diagnosis"].as_str()
        }
        _ => panic!("the task is named failing or refused: {}", r.json),
    };
    assert!(why.unwrap_or_default().contains("not JSON"), "{}", r.json);
    s.stop_projector().await;
}

/// A read waiting alone is woken to attempt on its own, not through a shared clock fetch:
/// served once the projector applies the write, with no fetch made for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_waiting_read_attempts_on_its_own_without_a_shared_fetch() {
    let mut s = Stack::new("lone-wait", 2, "read_wait_ms = 30000\nresponse_timeout_ms = 60000").await;
    let model = s.names.model.clone();
    let w = s.write(&s.names.orders.clone(), "k", json!({"n": 1}), None).await;
    let token = w.token();
    let metric = |s: &Stack, m: Metric| s.state.metrics.value(m, &[("model", &model)]).unwrap_or(0.0);
    let (router, uri) = (s.router.clone(), format!("/v1/models/{model}/documents/k"));
    let read = tokio::spawn(async move { send(&router, Method::GET, &uri, Some(&token), None).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(&s, Metric::GateChecksTotal) < 1.0 {
        assert!(Instant::now() < deadline, "the read made no attempt");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!read.is_finished(), "the read did not wait for the projector");
    s.start_projector().await;
    let r = read.await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["document"], json!({"n": 1}), "{}", r.json);
    assert_eq!(metric(&s, Metric::ClockFetchesTotal), 0.0, "a shared clock fetch was made for one waiting read");
    assert!(metric(&s, Metric::GateChecksTotal) >= 2.0, "the read attempted again once woken");
    s.stop_projector().await;
}

/// A thousand reads waiting on one model share their re-checks: while they wait, each made
/// one gate attempt, and the clock is fetched once per wake-up (a projector step's
/// `NOTIFY`, a new waiter, a re-check tick) for all of them — not once per read; once a
/// fetch shows them covered, each is served by one more attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_waiting_reads_share_one_clock_fetch_per_wake_up() {
    const READS: usize = 1000;
    let mut s = Stack::new(
        "shared-wait",
        2,
        "read_wait_ms = 30000\nresponse_timeout_ms = 60000\nmax_waiting_reads = 2000\nmax_in_flight = 4096",
    )
    .await;
    let model = s.names.model.clone();
    let w = s.write(&s.names.orders.clone(), "k", json!({"n": 1}), None).await;
    let token = w.token();
    let metric = |s: &Stack, m: Metric| s.state.metrics.value(m, &[("model", &model)]).unwrap_or(0.0);

    let mut reads = Vec::new();
    for _ in 0..READS {
        let (router, uri, token) = (s.router.clone(), format!("/v1/models/{model}/documents/k"), token.clone());
        reads.push(tokio::spawn(async move { send(&router, Method::GET, &uri, Some(&token), None).await.status }));
    }
    // Every read made its first attempt once each holds a waiting slot.
    let slots = &s.state.waiting_reads[&model];
    let deadline = Instant::now() + Duration::from_secs(30);
    while 2000 - slots.available_permits() < READS {
        assert!(Instant::now() < deadline, "the reads did not all make their first attempt");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Waiting (the projector is not running): a second of re-check ticks costs the fetches
    // of the ticks, and no read attempts again. Counted from the moment every read has made
    // its first attempt (before it, each new waiter may wake the shared re-check, and on a
    // loaded machine that takes a while), over the time actually slept.
    // (While the first few were the only ones waiting, a wake-up had them attempt again on
    // their own — `feed::DIRECT_WAITERS` — so a handful of checks beyond READS is expected.)
    let (idle_from, idle_fetches) = (Instant::now(), metric(&s, Metric::ClockFetchesTotal));
    let idle_checks = metric(&s, Metric::GateChecksTotal);
    assert!(
        idle_checks <= (READS + 4 * parsley_gateway::feed::DIRECT_WAITERS) as f64,
        "{idle_checks} gate checks for {READS} reads before any of them could be served"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let waited_checks = metric(&s, Metric::GateChecksTotal);
    let waited_fetches = metric(&s, Metric::ClockFetchesTotal);
    let idle_ticks = (idle_from.elapsed().as_millis() / 250) as f64 + 2.0;
    assert_eq!(waited_checks, idle_checks, "no waiting read re-ran the gate on its own");
    assert!(
        waited_fetches - idle_fetches <= idle_ticks,
        "{} fetches in {:?} of 250 ms ticks",
        waited_fetches - idle_fetches,
        idle_from.elapsed()
    );

    let started = Instant::now();
    s.start_projector().await;
    for r in reads {
        assert_eq!(r.await.unwrap(), StatusCode::OK);
    }
    let took = started.elapsed();
    let notifications = s.state.metrics.value(Metric::ClockNotificationsTotal, &[]).unwrap_or(0.0);
    let checks = metric(&s, Metric::GateChecksTotal) - waited_checks;
    let fetches = metric(&s, Metric::ClockFetchesTotal) - waited_fetches;
    let ticks = (took.as_millis() / 250) as f64 + 1.0;
    eprintln!("{READS} waiting reads served in {took:?}: {fetches} shared clock fetches, {notifications} notifications, {checks} serving attempts");
    assert!(fetches <= 2.0 * notifications + ticks, "{fetches} fetches for {notifications} steps and {ticks} ticks");
    assert!(checks <= READS as f64 + 10.0, "each read served by about one more attempt: {checks}");
    s.stop_projector().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_snapshot_serves_the_sessions_it_covers_until_its_owner_steps() {
    use parsley::murmur2::partition_for_key;

    let mut s =
        Stack::new("kept", 2, "read_cache_bytes = 1048576\nread_cache_max_age_ms = 60000\nread_wait_ms = 5000").await;
    let (orders, model) = (s.names.orders.clone(), s.names.model.clone());
    let cache = |s: &Stack, result: &str| {
        s.state.metrics.value(Metric::ReadCacheTotal, &[("model", &model), ("result", result)]).unwrap_or(0.0)
    };
    let notifications = |s: &Stack| s.state.metrics.value(Metric::ClockNotificationsTotal, &[]).unwrap_or(0.0);
    // Waits until the gateway has heard a notification after `before` (the projector's step
    // or a trigger's), so what follows does not race its delivery.
    let heard = async |s: &Stack, before: f64| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while notifications(s) <= before {
            assert!(Instant::now() < deadline, "no notification arrived");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    s.start_projector().await;

    let w1 = s.write(&orders, "k", json!({"v": 1}), None).await;
    let first = s.read("k", Some(&w1.token())).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.json);
    assert_eq!(first.json["document"], json!({"v": 1}));
    assert!(cache(&s, "miss") >= 1.0, "the covered read was offered to keep");
    let first_token = first.token();
    settled_on_a_kept_snapshot(&s, &model, || s.read("k", Some(&first_token))).await;
    let (hits, misses) = (cache(&s, "hit"), cache(&s, "miss"));
    // The same session again, and a new session: served from memory, the same answer and a
    // token as the statement would have refreshed it.
    let again = s.read("k", Some(&first.token())).await;
    let fresh = s.read("k", None).await;
    for r in [&again, &fresh] {
        assert_eq!(r.status, StatusCode::OK, "{}", r.json);
        assert_eq!(r.json, first.json);
    }
    assert_eq!(cache(&s, "hit"), hits + 2.0, "both were served from the kept snapshot");
    assert_eq!(cache(&s, "miss"), misses, "neither read Postgres");
    // The bytes held, as a scrape of the admin listener sets them.
    let scraped = send(&s.admin, Method::GET, "/metrics", None, None).await;
    assert_eq!(scraped.status, StatusCode::OK);
    let held = s.state.metrics.value(Metric::ReadCacheBytes, &[("model", &model)]).unwrap_or(0.0);
    assert!(held > 0.0, "no kept bytes reported");
    let fresh_again = s.read("k", Some(&fresh.token())).await;
    assert_eq!(fresh_again.json, first.json, "the new session's refreshed token is covered by the same snapshot");

    // A session that wrote since is not covered by the kept rows: it reads Postgres (waiting
    // for the projector if need be) and sees its write.
    let before = notifications(&s);
    let w2 = s.write(&orders, "k", json!({"v": 2}), Some(&again.token())).await;
    let mine = s.read("k", Some(&w2.token())).await;
    assert_eq!(mine.status, StatusCode::OK, "{}", mine.json);
    assert_eq!(mine.json["document"], json!({"v": 2}), "a read never goes back behind its session");
    // Once the step's notification arrived, the old snapshot is gone even for a session it
    // covered: every read sees the new document.
    heard(&s, before).await;
    for token in [Some(w1.token()), Some(first.token()), None] {
        let r = s.read("k", token.as_deref()).await;
        assert_eq!(r.json["document"], json!({"v": 2}), "{token:?}: {}", r.json);
    }
    s.stop_projector().await;

    let partition = partition_for_key(b"k", 2);
    // A change by hand notifies the whole model (migration 20261205000000): a topic identity
    // changed in the database is seen by the first read after its notification, not hidden
    // by the kept snapshot.
    // The session also wrote a key on the other partition: after the change its pair there
    // is one the key's owner has never seen.
    let other = (0..).map(|i| format!("j{i}")).find(|j| partition_for_key(j.as_bytes(), 2) != partition).unwrap();
    s.start_projector().await;
    let wj = s.write(&orders, &other, json!("j"), Some(&mine.token())).await;
    let mine = s.read(&other, Some(&wj.token())).await;
    assert_eq!(mine.status, StatusCode::OK, "{}", mine.json);
    s.stop_projector().await;
    let again = s.read("k", Some(&mine.token())).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.json);
    let mine_token = mine.token();
    let kept = settled_on_a_kept_snapshot(&s, &model, || s.read("k", Some(&mine_token))).await;
    assert_eq!(kept.status, StatusCode::OK, "kept before the change: {}", kept.json);
    let set_identity = async |id: &str| {
        let before = notifications(&s);
        set_topic_id(&s, &orders, id).await;
        heard(&s, before).await;
    };
    let recorded = recorded_topic_id(&s, &orders).await;
    set_identity("gen_random_uuid()").await;
    let r = s.read("k", Some(&mine.token())).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "a kept snapshot outlived a shape change: {}", r.json);
    set_identity(&format!("'{recorded}'::uuid")).await;
    let r = s.read("k", Some(&mine.token())).await;
    assert_eq!(r.status, StatusCode::OK, "the identity put back: {}", r.json);
    assert_eq!(r.json["document"], json!({"v": 2}));

    // A document edited by hand notifies every model (`*`, migration 20261206000000): the first
    // read after the notification sees the edit, not the kept snapshot.
    let kept = settled_on_a_kept_snapshot(&s, &model, || s.read("k", Some(&mine_token))).await;
    assert_eq!(kept.json["document"], json!({"v": 2}), "kept before the edit: {}", kept.json);
    let before = notifications(&s);
    sqlx::query("UPDATE projection.documents SET doc = '{\"v\": \"by hand\"}' WHERE model = $1 AND key = 'k'")
        .bind(&model)
        .execute(&s.pool)
        .await
        .unwrap();
    heard(&s, before).await;
    let r = s.read("k", Some(&mine.token())).await;
    assert_eq!(r.json["document"], json!({"v": "by hand"}), "a kept snapshot outlived an edit: {}", r.json);

    // An edit made with the announcing trigger switched off and on again around it (one
    // transaction: nothing is announced, and the trigger is back as it was): the barrier sees
    // the trigger's catalog row changed, and the very next read sees the edit.
    let kept = settled_on_a_kept_snapshot(&s, &model, || s.read("k", Some(&mine_token))).await;
    assert_eq!(kept.json["document"], json!({"v": "by hand"}), "kept before the edit: {}", kept.json);
    let mut tx = s.pool.begin().await.unwrap();
    sqlx::query("ALTER TABLE projection.documents DISABLE TRIGGER documents_edited").execute(&mut *tx).await.unwrap();
    sqlx::query("UPDATE projection.documents SET doc = '{\"v\": \"unannounced\"}' WHERE model = $1 AND key = 'k'")
        .bind(&model)
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("ALTER TABLE projection.documents ENABLE ALWAYS TRIGGER documents_edited")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let r = s.read("k", Some(&mine.token())).await;
    assert_eq!(r.json["document"], json!({"v": "unannounced"}), "a kept snapshot outlived a silent edit: {}", r.json);
}

/// The topic identity `topic` is recorded with for the stack's model.
async fn recorded_topic_id(s: &Stack, topic: &str) -> uuid::Uuid {
    sqlx::query_scalar("SELECT topic_id FROM parsley.topics WHERE model = $1 AND topic_name = $2")
        .bind(&s.names.model)
        .bind(topic)
        .fetch_one(&s.pool)
        .await
        .unwrap()
}

/// Records `topic` for the stack's model under the identity the SQL expression `id` gives.
async fn set_topic_id(s: &Stack, topic: &str, id: &str) {
    sqlx::query(&format!("UPDATE parsley.topics SET topic_id = {id} WHERE model = $1 AND topic_name = $2"))
        .bind(&s.names.model)
        .bind(topic)
        .execute(&s.pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_page_is_served_until_any_task_steps() {
    use parsley::murmur2::partition_for_key;

    let mut s =
        Stack::new("kept-page", 2, "read_cache_bytes = 1048576\nread_cache_max_age_ms = 60000\nread_wait_ms = 5000")
            .await;
    let (orders, model) = (s.names.orders.clone(), s.names.model.clone());
    let notifications = |s: &Stack| s.state.metrics.value(Metric::ClockNotificationsTotal, &[]).unwrap_or(0.0);
    let hits = |s: &Stack| {
        s.state.metrics.value(Metric::ReadCacheTotal, &[("model", &model), ("result", "hit")]).unwrap_or(0.0)
    };
    let key_on = |p: u32| (0..).map(|i| format!("k{i}")).find(|k| partition_for_key(k.as_bytes(), 2) == p).unwrap();
    let (k0, k1) = (key_on(0), key_on(1));
    s.start_projector().await;

    let w = s.write(&orders, &k0, json!(0), None).await;
    let first = s.list("", Some(&w.token())).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.json);
    let keys = |r: &Reply| -> Vec<String> {
        r.json["documents"].as_array().unwrap().iter().map(|d| d["key"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(keys(&first), vec![k0.clone()]);
    let first_token = first.token();
    settled_on_a_kept_snapshot(&s, &model, || s.list("", Some(&first_token))).await;
    let before = hits(&s);
    let again = s.list("", Some(&first.token())).await;
    assert_eq!(again.json, first.json);
    assert_eq!(hits(&s), before + 1.0, "served from the kept page");
    // A page of another size is another snapshot.
    let other = s.list("?limit=5", Some(&first.token())).await;
    assert_eq!(other.status, StatusCode::OK, "{}", other.json);
    assert_eq!(hits(&s), before + 1.0);

    // Another session's write on the other task: once its step's notification arrived, the
    // page is read again and shows it, for the first session too.
    let heard = notifications(&s);
    let w1 = s.write(&orders, &k1, json!(1), None).await;
    let theirs = s.read(&k1, Some(&w1.token())).await;
    assert_eq!(theirs.status, StatusCode::OK, "{}", theirs.json);
    let deadline = Instant::now() + Duration::from_secs(10);
    while notifications(&s) <= heard {
        assert!(Instant::now() < deadline, "no notification arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let now = s.list("", Some(&first.token())).await;
    assert_eq!(now.status, StatusCode::OK, "{}", now.json);
    let mut expected = vec![k0, k1];
    expected.sort();
    assert_eq!(keys(&now), expected, "a kept page outlived another task's step");
    s.stop_projector().await;
}

/// A read answered `200`; with kept snapshots, once it is served from memory.
async fn served<F, Fut>(s: &Stack, kept: bool, read: F, what: &str)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Reply>,
{
    let reply = if kept { settled_on_a_kept_snapshot(s, &s.names.model, &read).await } else { read().await };
    assert_eq!(reply.status, StatusCode::OK, "{what}: {}", reply.json);
}

/// Repeats `read` until one is served from a kept snapshot twice, 100 ms apart: a step's
/// notification heard after a snapshot was kept drops it (the next read keeps it again), so
/// a test counting hits starts once the notifications of its writes have all arrived.
async fn settled_on_a_kept_snapshot<F, Fut>(s: &Stack, model: &str, read: F) -> Reply
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Reply>,
{
    let hits = || s.state.metrics.value(Metric::ReadCacheTotal, &[("model", model), ("result", "hit")]).unwrap_or(0.0);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut served_from_memory = 0;
    loop {
        let before = hits();
        let reply = read().await;
        if hits() > before {
            served_from_memory += 1;
            if served_from_memory == 2 {
                return reply;
            }
        }
        assert!(Instant::now() < deadline, "no read was served from a kept snapshot: {}", reply.json);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
