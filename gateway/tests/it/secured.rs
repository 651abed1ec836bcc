//! The projector and the gateway against secured services: the local stack's second broker
//! (SASL_SSL on 127.0.0.1:9094: TLS, SCRAM and PLAIN) and the TLS-only Postgres user
//! `parsley_tls` (`sslmode=verify-full`, a client certificate), which `make services-up`
//! starts beside the plain ones with the certificates of `.local/tls` (scripts/tls.sh). A
//! held payment is released and a session reads its writes; a refused password, an untrusted
//! certificate and a plaintext client each fail with one line naming the setting to check,
//! and `/readyz` names the dependency that failed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use parsley::CausalPast;
use parsley_gateway::{admin_app, app, Gateway, GatewayConfig};
use parsley_infra::kafka::{self, Cluster};
use parsley_projector::metrics::{Metrics, METRICS};
use parsley_projector::{DocumentProjection, ModelProjector};
use parsley_settings::config::Config;
use parsley_store::migrations;
use rdkafka::admin::{AdminClient, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, Producer as _};
use serde_json::json;
use tokio::sync::watch;

use crate::support::*;

/// The secured broker's SASL_SSL listener (scripts/kafka.sh).
const SECURE_BOOTSTRAP: &str = "127.0.0.1:9094";
/// The SASL user and password the secured broker knows (scripts/kafka.sh).
const SASL_USER: &str = "parsley";
const SASL_PASSWORD: &str = "parsley-secret";
/// The TLS-only Postgres user and its password (scripts/postgres.sh).
const TLS_USER: &str = "parsley_tls";
const TLS_PASSWORD: &str = "parsley-tls-secret";

/// A file of the local stack's certificates; fails saying how to make them when missing.
fn tls(file: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.local/tls").join(file);
    assert!(path.exists(), "{} is missing: `make services-up` makes the secured stack's certificates", path.display());
    path.canonicalize().unwrap().to_str().unwrap().to_string()
}

/// `[kafka.properties]` for the secured broker: SASL over TLS, the local CA trusted.
fn properties(mechanism: &str, password: &str, ca: &str) -> BTreeMap<String, String> {
    [
        ("security.protocol", "sasl_ssl"),
        ("sasl.mechanism", mechanism),
        ("sasl.username", SASL_USER),
        ("sasl.password", password),
        ("ssl.ca.location", &tls(ca)),
        // A codec librdkafka only has when built with zstd.
        ("compression.type", "zstd"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn secured_cluster() -> Cluster {
    Cluster::new(SECURE_BOOTSTRAP, properties("SCRAM-SHA-512", SASL_PASSWORD, "ca.pem"))
}

/// The TLS-only user's URL: the server verified against the local CA, a client certificate.
fn secured_url(password: &str, params: &str) -> String {
    format!("postgres://{TLS_USER}:{password}@127.0.0.1:5432/parsley?{params}")
}

fn verified() -> String {
    format!(
        "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
        tls("ca.pem"),
        tls("client.pem"),
        tls("client.key")
    )
}

/// The test configuration (model and topics of `names`) on the secured services.
fn secured_config(names: &Names, cluster: &Cluster, url: &str, gateway: &str) -> Config {
    let mut c = config(names, gateway);
    c.kafka.bootstrap = cluster.bootstrap.clone();
    c.kafka.properties = cluster.properties.clone();
    c.kafka.request_timeout_ms = 3_000;
    c.database.url = Some(url.to_string().into());
    c.validate().unwrap();
    c
}

async fn create_secured_topics(cluster: &Cluster, names: &[&str]) {
    let admin: AdminClient<DefaultClientContext> = kafka::admin_config(cluster).create().unwrap();
    let new: Vec<NewTopic<'_>> = names.iter().map(|n| NewTopic::new(n, 1, TopicReplication::Fixed(1))).collect();
    for result in admin.create_topics(&new, &admin_options()).await.expect("create_topics over SASL_SSL") {
        result.unwrap_or_else(|(name, code)| panic!("creating {name} on the secured broker: {code}"));
    }
}

fn admin_options() -> rdkafka::admin::AdminOptions {
    rdkafka::admin::AdminOptions::new().operation_timeout(Some(TIMEOUT)).request_timeout(Some(TIMEOUT))
}

/// Every check of the answer of `/readyz` as `(dependency, ok)`.
async fn readiness(router: &axum::Router) -> Vec<(String, bool)> {
    let r = send(router, Method::GET, "/readyz", None, None).await;
    let checks = r.json["checks"].as_object().unwrap_or_else(|| panic!("no checks in {}", r.json));
    checks.iter().map(|(name, c)| (name.clone(), c["ok"] == json!(true))).collect()
}

/// The whole path on secured services: topics created, a transaction committed, records
/// consumed and documents read over SASL_SSL (SCRAM-SHA-512, zstd batches); the projector's
/// and the gateway's sessions as the TLS-only user with a client certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_payment_is_released_and_a_session_reads_its_writes_on_secured_services() {
    let cluster = secured_cluster();
    let url = secured_url(TLS_PASSWORD, &verified());
    let names = Names::new("secured");
    create_secured_topics(&cluster, &[&names.orders, &names.payments]).await;
    let config = secured_config(&names, &cluster, &url, "admin_listen = \"127.0.0.1:0\"");

    let pool = parsley_infra::pg::connect(&url, 4, TIMEOUT).await.unwrap_or_else(|e| panic!("{e:#}"));
    let (session_user, current_user): (String, String) =
        sqlx::query_as("SELECT session_user::text, current_user::text").fetch_one(&pool).await.unwrap();
    assert_eq!((session_user.as_str(), current_user.as_str()), (TLS_USER, "parsley"));
    migrations::run(&pool).await.unwrap_or_else(|e| panic!("{e:#}"));

    let gateway = Gateway::new(GatewayConfig::with_keys(config.clone(), ring()).unwrap()).unwrap();
    let (stop_gateway, shutdown) = watch::channel(false);
    let _ = gateway.spawn_background(shutdown);
    let state = gateway.state().clone();
    let (router, admin) = (app(state.clone()), admin_app(state.clone()));

    let model = &config.models[0];
    let projector = ModelProjector::start(
        &config,
        model,
        pool.clone(),
        Arc::new(DocumentProjection::from_model(model)),
        Metrics::new(METRICS),
    )
    .await
    .unwrap_or_else(|e| panic!("starting the projector on the secured services: {e:#}"));
    let (stop_projector, projector_shutdown) = watch::channel(false);
    let projector = tokio::spawn(projector.run(projector_shutdown));

    // A payment caused by an order still in an open transaction is held...
    let order_channel = channel(&state, &names.orders, 0).await;
    let txp: FutureProducer =
        kafka::transactional_producer_config(&cluster, &unique("secured-tx")).create().expect("transactional producer");
    txp.init_transactions(TIMEOUT).expect("init_transactions over SASL_SSL");
    txp.begin_transaction().unwrap();
    let order_at = produce(&txp, &names.orders, 0, "o1", br#"{"status":"placed"}"#, None).await;
    let causes = CausalPast::from_pairs([(order_channel, order_at)]);
    let plain: FutureProducer = kafka::producer_config(&cluster).create().expect("producer");
    produce(&plain, &names.payments, 0, "o1", br#"{"paid":true}"#, Some(&causes)).await;
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let st = send(&admin, Method::GET, "/v1/status", None, None).await;
        if st.json["models"][0]["tasks"][0]["held"] == json!(1) {
            break;
        }
        assert!(Instant::now() < deadline, "the payment is never held: {}", st.json);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // ...and released, merged onto the order, once the transaction commits.
    txp.commit_transaction(TIMEOUT).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let r = send(&router, Method::GET, &format!("/v1/models/{}/documents/o1", names.model), None, None).await;
        if r.status == StatusCode::OK && r.json["document"] == json!({"status": "placed", "paid": true}) {
            break;
        }
        assert!(Instant::now() < deadline, "the payment is never released: {} {}", r.status, r.json);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A write through the gateway, read back with the token it returned.
    let body = json!({"key": "o2", "value": {"status": "placed"}});
    let w = send(&router, Method::POST, &format!("/v1/topics/{}/records", names.orders), None, Some(&body)).await;
    assert!(w.status.is_success(), "{} {}", w.status, w.json);
    let r =
        send(&router, Method::GET, &format!("/v1/models/{}/documents/o2", names.model), Some(&w.token()), None).await;
    assert_eq!((r.status, r.json["document"].clone()), (StatusCode::OK, json!({"status": "placed"})), "{}", r.json);
    assert!(readiness(&router).await.iter().all(|(_, ok)| *ok), "ready on the secured services");

    stop_projector.send(true).unwrap();
    projector.await.unwrap().unwrap_or_else(|e| panic!("the projector failed: {e:#}"));
    let _ = stop_gateway.send(true);
}

/// One line naming the setting to check: the start of a projector on a broker that refuses
/// it, and a connection to Postgres that cannot be made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_refusal_is_one_line_naming_the_setting() {
    let names = Names::new("secured-refused");
    let pool = pool().await;
    let kafka_cases = [
        ("a wrong SASL password", properties("SCRAM-SHA-256", "wrong", "ca.pem"), "sasl.password"),
        ("an untrusted certificate", properties("SCRAM-SHA-256", SASL_PASSWORD, "other-ca.pem"), "ssl.ca.location"),
        ("a plaintext client on the TLS listener", BTreeMap::new(), "security.protocol"),
    ];
    for (what, properties, setting) in kafka_cases {
        let cluster = Cluster::new(SECURE_BOOTSTRAP, properties);
        let config = secured_config(&names, &cluster, &database_url(), "");
        let model = &config.models[0];
        let projection = Arc::new(DocumentProjection::from_model(model));
        let err = match ModelProjector::start(&config, model, pool.clone(), projection, Metrics::new(METRICS)).await {
            Ok(_) => panic!("{what}: the projector started"),
            Err(e) => format!("{e:#}"),
        };
        assert!(err.contains(setting) && !err.contains('\n'), "{what}: not one line naming {setting}: {err}");
        assert!(!err.contains(SASL_PASSWORD), "{what}: the password is printed: {err}");
        eprintln!("{what}: {err}");
    }

    let postgres_cases = [
        ("a wrong password", secured_url("wrong", &verified()), "password in database.url"),
        (
            "an untrusted certificate",
            secured_url(TLS_PASSWORD, &verified().replace("ca.pem", "other-ca.pem")),
            // The explanation, not only the setting (the URL itself names sslrootcert).
            "certificate is not trusted: check sslrootcert",
        ),
        ("a plaintext connection", secured_url(TLS_PASSWORD, "sslmode=disable"), "sslmode"),
    ];
    for (what, url, setting) in postgres_cases {
        let err = match parsley_infra::pg::connect(&url, 1, Duration::from_secs(5)).await {
            Ok(_) => panic!("{what}: connected"),
            Err(e) => format!("{e:#}"),
        };
        assert!(err.contains(setting) && !err.contains('\n'), "{what}: not one line naming {setting}: {err}");
        assert!(!err.contains(TLS_PASSWORD), "{what}: the password is printed: {err}");
        eprintln!("{what}: {err}");
    }
}

/// `/readyz` on secured services says which dependency failed: the database when its
/// password is refused, Kafka when its password is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_names_the_secured_dependency_that_failed() {
    let names = Names::new("secured-ready");
    let gateway = "kafka_timeout_ms = 2000";
    let cases = [
        ("database", secured_cluster(), secured_url("wrong", &verified())),
        (
            "kafka",
            Cluster::new(SECURE_BOOTSTRAP, properties("PLAIN", "wrong", "ca.pem")),
            secured_url(TLS_PASSWORD, &verified()),
        ),
    ];
    for (failed, cluster, url) in cases {
        let mut config = secured_config(&names, &cluster, &url, gateway);
        config.database.acquire_timeout_ms = 2_000;
        let gateway = Gateway::new(GatewayConfig::with_keys(config, ring()).unwrap()).unwrap();
        let router = app(gateway.state().clone());
        let checks = readiness(&router).await;
        let failing: Vec<&str> = checks.iter().filter(|(_, ok)| !ok).map(|(name, _)| name.as_str()).collect();
        let expected: &[&str] = if failed == "database" { &["database", "migrations"] } else { &["kafka"] };
        assert_eq!(failing, expected, "{checks:?}");
    }
}
