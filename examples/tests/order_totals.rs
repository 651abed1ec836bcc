//! The order-totals example end to end on the real broker and database: its SQL projection
//! run by the projector's builder, and the gateway serving the example's named query
//! `customer_total`. A session writes an order and a payment through the gateway and reads
//! the query with the token it got back, right away: the totals reflect both writes
//! (read-your-writes through a named query over the model's own tables).

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use parsley_examples::{example_config, ORDER_TOTALS};
use parsley_gateway::token::{KeyRing, SecretKey};
use parsley_gateway::{Gateway, GatewayConfig, SESSION_HEADER};
use parsley_projector::Projector;
use parsley_settings::config::Config;
use parsley_testkit::{create_topics, unique, TIMEOUT};
use serde_json::{json, Value};
use tokio::sync::watch;
use tower::ServiceExt as _;

/// One answer: status, body, and the session token it carries.
async fn call(
    router: &Router,
    method: Method,
    uri: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, Value, String) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(SESSION_HEADER, t);
    }
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Body::from(b.to_string())
        }
        None => Body::empty(),
    };
    let response = router.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let status = response.status();
    let token = response.headers().get(SESSION_HEADER).map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null), token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_reads_its_order_and_payment_through_the_named_query_at_once() {
    let model = unique("totals-q");
    let (orders, payments) = (format!("{model}.orders"), format!("{model}.payments"));
    create_topics(&[&orders, &payments], 2).await;
    let mut config = example_config(ORDER_TOTALS, &model, &[&orders, &payments]).unwrap();
    config.projector.metrics_address = String::new();
    // A read waits for the projector up to 20 s (a busy machine), never serving stale totals.
    config.gateway = Config::parse("[gateway]\naccess = \"open\"\nread_wait_ms = 20000\nresponse_timeout_ms = 30000\n")
        .unwrap()
        .gateway;

    let (stop, shutdown) = watch::channel(false);
    let projector = tokio::spawn(Projector::builder(config.clone()).shutdown(shutdown.clone()).run());
    let ring = KeyRing::new(vec![("example".to_string(), SecretKey::from_bytes([7; 32]))]).unwrap();
    let gateway = Gateway::new(GatewayConfig::with_keys(config, ring).unwrap()).unwrap();
    let background = gateway.spawn_background(shutdown);
    let router = gateway.router();

    let customer = format!("ada-{model}");
    let id = |what: &str| format!("{what}-{model}");
    let query = format!("/v1/models/{model}/queries/customer_total?customer={customer}");

    // An order, then a payment in the same session: the token carries both.
    let (status, body, token) = call(
        &router,
        Method::POST,
        &format!("/v1/topics/{orders}/records"),
        None,
        Some(json!({"key": customer, "value": {"order": id("o1"), "amount": 12.5}})),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body, token) = call(
        &router,
        Method::POST,
        &format!("/v1/topics/{payments}/records"),
        Some(&token),
        Some(json!({"key": customer, "value": {"payment": id("p1"), "order": id("o1"), "amount": 5}})),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");

    // Read right away with that token: the totals reflect the order and the payment.
    let (status, body, token) = call(&router, Method::GET, &query, Some(&token), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body,
        json!({"rows": [{"customer": customer, "ordered": 12.5, "paid": 5, "due": 7.5}], "truncated": false})
    );

    // A second order: the next read shows it too.
    let (status, body, token) = call(
        &router,
        Method::POST,
        &format!("/v1/topics/{orders}/records"),
        Some(&token),
        Some(json!({"key": customer, "value": {"order": id("o2"), "amount": 10}})),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body, _) = call(&router, Method::GET, &query, Some(&token), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["rows"], json!([{"customer": customer, "ordered": 22.5, "paid": 5, "due": 17.5}]));

    stop.send(true).unwrap();
    tokio::time::timeout(TIMEOUT, projector).await.expect("the projector stops at the signal").unwrap().unwrap();
    for task in background {
        let _ = task.await;
    }
}

/// One answer to a request whose body is `body` as written (numbers as the client wrote
/// them): status, body as sent, token.
async fn call_text(
    router: &Router,
    method: Method,
    uri: &str,
    token: Option<&str>,
    body: Option<String>,
) -> (StatusCode, String, String) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(SESSION_HEADER, t);
    }
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Body::from(b)
        }
        None => Body::empty(),
    };
    let response = router.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let status = response.status();
    let token = response.headers().get(SESSION_HEADER).map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap(), token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn totals_keep_every_digit_and_a_sum_past_f64_is_answered_exactly() {
    let model = unique("totals-n");
    let (orders, payments) = (format!("{model}.orders"), format!("{model}.payments"));
    create_topics(&[&orders, &payments], 2).await;
    let mut config = example_config(ORDER_TOTALS, &model, &[&orders, &payments]).unwrap();
    config.projector.metrics_address = String::new();
    config.gateway = Config::parse("[gateway]\naccess = \"open\"\nread_wait_ms = 20000\nresponse_timeout_ms = 30000\n")
        .unwrap()
        .gateway;
    let database_url = config.database.url.clone().expect("the test database").expose().to_string();

    let (stop, shutdown) = watch::channel(false);
    let projector = tokio::spawn(Projector::builder(config.clone()).shutdown(shutdown.clone()).run());
    let ring = KeyRing::new(vec![("example".to_string(), SecretKey::from_bytes([7; 32]))]).unwrap();
    let gateway = Gateway::new(GatewayConfig::with_keys(config, ring).unwrap()).unwrap();
    let background = gateway.spawn_background(shutdown);
    let router = gateway.router();

    // The SQL projection's `:value` carries the amount with every digit into `numeric`.
    let (precise, big) = (format!("precise-{model}"), format!("big-{model}"));
    let digits = "12345678901234567890123456789.000000000000000000001";
    let (status, body, token) = call_text(
        &router,
        Method::POST,
        &format!("/v1/topics/{orders}/records"),
        None,
        Some(format!(r#"{{"key":"{precise}","value":{{"order":"p-{model}","amount":{digits}}}}}"#)),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let query = |customer: &str| format!("/v1/models/{model}/queries/customer_total?customer={customer}");
    let (status, body, token) = call_text(&router, Method::GET, &query(&precise), Some(&token), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains(&format!(r#""ordered": {digits}"#)), "{body}");
    let pool = sqlx::PgPool::connect(&database_url).await.unwrap();
    let stored: String = sqlx::query_scalar("SELECT amount::text FROM totals.orders WHERE id = $1")
        .bind(format!("p-{model}"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(stored, digits, "the SQL projection stored the amount exactly");

    // Two orders at f64's limit: their sum is past it; the query answers it exactly.
    let mut token = token;
    for n in 1..=2 {
        let (status, body, t) = call_text(
            &router,
            Method::POST,
            &format!("/v1/topics/{orders}/records"),
            Some(&token),
            Some(format!(r#"{{"key":"{big}","value":{{"order":"b{n}-{model}","amount":1e308}}}}"#)),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        token = t;
    }
    let (status, body, _) = call_text(&router, Method::GET, &query(&big), Some(&token), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let exact = format!("2{}", "0".repeat(308));
    assert!(body.contains(&format!(r#""ordered": {exact}"#)) && body.contains(&format!(r#""due": {exact}"#)), "{body}");

    stop.send(true).unwrap();
    tokio::time::timeout(TIMEOUT, projector).await.expect("the projector stops at the signal").unwrap().unwrap();
    for task in background {
        let _ = task.await;
    }
}

/// The example's data contracts at the door: an order whose id is `null` (which
/// `totals.orders.id NOT NULL` would refuse, halting the partition) is `400 value-invalid`
/// naming the pointer, as is a payment missing its order and a batch holding such a value;
/// nothing is produced, and afterwards every partition serves read-your-writes through the
/// named query.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_the_tables_cannot_take_is_refused_at_the_door_and_every_partition_still_serves() {
    const PARTITIONS: u32 = 2;
    let model = unique("totals-c");
    let (orders, payments) = (format!("{model}.orders"), format!("{model}.payments"));
    create_topics(&[&orders, &payments], PARTITIONS as i32).await;
    let mut config = example_config(ORDER_TOTALS, &model, &[&orders, &payments]).unwrap();
    config.projector.metrics_address = String::new();
    config.gateway = Config::parse("[gateway]\naccess = \"open\"\nread_wait_ms = 20000\nresponse_timeout_ms = 30000\n")
        .unwrap()
        .gateway;

    let (stop, shutdown) = watch::channel(false);
    let projector = tokio::spawn(Projector::builder(config.clone()).shutdown(shutdown.clone()).run());
    let ring = KeyRing::new(vec![("example".to_string(), SecretKey::from_bytes([7; 32]))]).unwrap();
    let gateway = Gateway::new(GatewayConfig::with_keys(config, ring).unwrap()).unwrap();
    let background = gateway.spawn_background(shutdown);
    let router = gateway.router();
    let invalid = |status: StatusCode, body: &Value| -> Vec<(String, String)> {
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(body["type"], "https://parsley.dev/problems/value-invalid", "{body}");
        let mut found: Vec<(String, String)> = body["errors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["pointer"].as_str().unwrap().to_string(), e["keyword"].as_str().unwrap().to_string()))
            .collect();
        found.sort();
        found
    };
    let pair = |p: &str, k: &str| (p.to_string(), k.to_string());
    let ada = format!("ada-{model}");

    // The NOT NULL case of the issue: `{"order": null}`.
    let (status, body, _) = call(
        &router,
        Method::POST,
        &format!("/v1/topics/{orders}/records"),
        None,
        Some(json!({"key": ada, "value": {"order": null}})),
    )
    .await;
    assert_eq!(invalid(status, &body), [pair("", "required"), pair("/order", "type")]);
    assert_eq!(body["topic"], json!(orders));
    // A payment without its order, of a negative amount.
    let (status, body, _) = call(
        &router,
        Method::POST,
        &format!("/v1/topics/{payments}/records"),
        None,
        Some(json!({"key": ada, "value": {"payment": "p-1", "amount": -5}})),
    )
    .await;
    assert_eq!(invalid(status, &body), [pair("", "required"), pair("/amount", "exclusiveMinimum")]);
    // A batch holding one such value: refused whole, naming the record.
    let batch = json!({"records": [
        {"topic": orders, "key": ada, "value": {"order": "o-ok", "amount": 1}},
        {"topic": orders, "key": ada, "value": {"order": "o-bad", "amount": "12"}},
    ]});
    let (status, body, _) = call(&router, Method::POST, "/v1/records", None, Some(batch)).await;
    assert_eq!(invalid(status, &body), [pair("/amount", "type")]);
    assert_eq!(body["errors"][0]["record"], json!(1), "{body}");

    // Every partition serves read-your-writes through the named query; nothing refused was
    // written (each customer's total is its one valid order).
    for partition in 0..PARTITIONS {
        let customer = (0..)
            .map(|i| format!("c{i}-{model}"))
            .find(|k| parsley::murmur2::partition_for_key(k.as_bytes(), PARTITIONS) == partition)
            .unwrap();
        let (status, body, token) = call(
            &router,
            Method::POST,
            &format!("/v1/topics/{orders}/records"),
            None,
            Some(json!({"key": customer, "value": {"order": format!("o-{customer}"), "amount": 3}})),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        assert_eq!(body["partition"], json!(partition), "{body}");
        let query = format!("/v1/models/{model}/queries/customer_total?customer={customer}");
        let (status, body, _) = call(&router, Method::GET, &query, Some(&token), None).await;
        assert_eq!(status, StatusCode::OK, "partition {partition}: {body}");
        assert_eq!(body["rows"], json!([{"customer": customer, "ordered": 3, "paid": 0, "due": 3}]), "{body}");
    }
    let (status, body, _) =
        call(&router, Method::GET, &format!("/v1/models/{model}/queries/customer_total?customer={ada}"), None, None)
            .await;
    assert_eq!((status, body["rows"].clone()), (StatusCode::OK, json!([])), "nothing refused was written: {body}");

    stop.send(true).unwrap();
    tokio::time::timeout(TIMEOUT, projector).await.expect("the projector stops at the signal").unwrap().unwrap();
    for task in background {
        let _ = task.await;
    }
}
