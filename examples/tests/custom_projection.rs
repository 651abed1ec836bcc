//! The custom-projection example run as a process on the real broker and database: the
//! embedding binary applies the model's migrations, runs its Rust projection over the
//! records of two co-partitioned topics — a payment held behind the order it names, then
//! both written in causal order — and stops cleanly at SIGTERM.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use parsley::channel::{ChannelId, TopicId};
use parsley::CausalPast;
use parsley_examples::{example_toml, CUSTOM_PROJECTION};
use parsley_testkit::{bootstrap, create_topics, database_url, produce, producer, unique, Spawned, TIMEOUT};
use sqlx::PgPool;

/// The example's binary on `config`; killed if a test fails before stopping it.
fn spawn(config: &std::path::Path) -> Spawned {
    let child = Command::new(env!("CARGO_BIN_EXE_custom-projection"))
        .arg("--config")
        .arg(config)
        .env("PARSLEY_DATABASE_URL", database_url())
        .env("PARSLEY_KAFKA_BOOTSTRAP", bootstrap())
        .env("PARSLEY_METRICS_ADDRESS", "")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawning custom-projection");
    Spawned::new("custom-projection", child)
}

/// `(topic, key, status, causes)` of the model's rows, in the order they were written.
async fn events(pool: &PgPool, model: &str) -> Vec<(String, Option<String>, Option<String>, i32)> {
    sqlx::query_as("SELECT topic, key, status, causes FROM order_events.events WHERE model = $1 ORDER BY seq")
        .bind(model)
        .fetch_all(pool)
        .await
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedding_binary_projects_records_into_its_own_table_in_causal_order() {
    let model = unique("custom");
    let (orders, payments) = (format!("{model}.orders"), format!("{model}.payments"));
    create_topics(&[&orders, &payments], 2).await;
    let pool = parsley_infra::pg::connect(&database_url(), 2, TIMEOUT).await.unwrap();
    let config = std::env::temp_dir().join(format!("{model}.toml"));
    std::fs::write(&config, example_toml(CUSTOM_PROJECTION, &model, &[&orders, &payments]).unwrap()).unwrap();

    // The payment names the order as its cause but reaches the broker first: the projection
    // must see the order first all the same.
    let orders_id =
        parsley_infra::describe_topics(&bootstrap(), std::slice::from_ref(&orders), TIMEOUT).await.unwrap()[0].id;
    let p = producer();
    let order_at = 0; // the first record of orders/1
    let causes = CausalPast::from_pairs([(ChannelId::new(TopicId::from_bytes(orders_id), 1), order_at)]).encode();
    produce(&p, &payments, 1, "o-2", Some(br#"{"status": "paid"}"#), Some(&causes)).await;
    produce(&p, &orders, 0, "o-1", Some(br#"{"status": "placed"}"#), None).await;

    let binary = spawn(&config);
    let deadline = Instant::now() + TIMEOUT;
    while events(&pool, &model).await.is_empty() {
        assert!(Instant::now() < deadline, "timed out: {:?}", events(&pool, &model).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The payment still waits for its order.
    assert!(!events(&pool, &model).await.iter().any(|e| e.0 == payments), "{:?}", events(&pool, &model).await);
    assert_eq!(produce(&p, &orders, 1, "o-2", Some(br#"{"status": "placed"}"#), None).await, order_at);
    while events(&pool, &model).await.len() < 3 {
        assert!(Instant::now() < deadline, "timed out: {:?}", events(&pool, &model).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    binary.terminate();

    let rows = events(&pool, &model).await;
    let of = |key: &str| -> Vec<(String, Option<String>, i32)> {
        rows.iter().filter(|r| r.1.as_deref() == Some(key)).map(|r| (r.0.clone(), r.2.clone(), r.3)).collect()
    };
    assert_eq!(of("o-1"), [(orders.clone(), Some("placed".to_string()), 0)]);
    assert_eq!(
        of("o-2"),
        [(orders.clone(), Some("placed".to_string()), 0), (payments.clone(), Some("paid".to_string()), 1)],
        "the order before the payment it caused"
    );
    std::fs::remove_file(&config).unwrap();
}
