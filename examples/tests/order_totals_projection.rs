//! The order-totals example's SQL projection on the real broker and database, run through
//! the library's builder: its migrations applied, orders and payments of two customers
//! (co-partitioned by customer, a payment held behind the order it names) projected into
//! `totals.orders` and `totals.payments`, the view the named query reads showing each
//! customer's totals, and a tombstone forgetting a customer. The query itself, through the
//! gateway, is `order_totals.rs`.

use std::time::{Duration, Instant};

use parsley::channel::{ChannelId, TopicId};
use parsley::CausalPast;
use parsley_examples::{example_config, ORDER_TOTALS};
use parsley_projector::Projector;
use parsley_testkit::{bootstrap, create_topics, database_url, produce, producer, unique, TIMEOUT};
use sqlx::PgPool;
use tokio::sync::watch;

/// `(ordered, paid)` of `customer` as text, from the view `customer_total` reads. `None`
/// also while the view does not exist yet (the projector applies the example's migrations
/// at its start); any other error fails the test.
async fn totals(pool: &PgPool, customer: &str) -> Option<(String, String)> {
    match sqlx::query_as("SELECT ordered::text, paid::text FROM totals.customer_totals WHERE customer = $1")
        .bind(customer)
        .fetch_optional(pool)
        .await
    {
        Ok(row) => row,
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => None,
        Err(e) => panic!("reading {customer}'s totals: {e}"),
    }
}

async fn wait_for(pool: &PgPool, customer: &str, want: Option<(&str, &str)>) {
    let want = want.map(|(o, p)| (o.to_string(), p.to_string()));
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let now = totals(pool, customer).await;
        if now == want {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {customer}'s totals {want:?} (now {now:?})");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_and_payments_are_projected_into_customer_totals() {
    let model = unique("totals");
    let (orders, payments) = (format!("{model}.orders"), format!("{model}.payments"));
    create_topics(&[&orders, &payments], 2).await;
    let mut config = example_config(ORDER_TOTALS, &model, &[&orders, &payments]).unwrap();
    config.projector.metrics_address = String::new();
    let pool = parsley_infra::pg::connect(&database_url(), 2, TIMEOUT).await.unwrap();
    // Customers murmur2 places on partitions 0 and 1, as the topics' producers must.
    let placed = |name: &str, partition: u32| {
        (0..)
            .map(|i| format!("{name}{i}-{model}"))
            .find(|c| parsley::murmur2::partition_for_key(c.as_bytes(), 2) == partition)
            .unwrap()
    };
    let (ada, bob) = (placed("ada", 0), placed("bob", 1));
    let id = |what: &str| format!("{what}-{model}");

    let p = producer();
    // ada (partition 0): two orders, and a payment naming the first as its cause.
    let o1_at = produce(&p, &orders, 0, &ada, Some(order(&id("o1"), "10.50").as_bytes()), None).await;
    let orders_id =
        parsley_infra::describe_topics(&bootstrap(), std::slice::from_ref(&orders), TIMEOUT).await.unwrap()[0].id;
    let causes = CausalPast::from_pairs([(ChannelId::new(TopicId::from_bytes(orders_id), 0), o1_at)]).encode();
    produce(&p, &payments, 0, &ada, Some(payment(&id("p1"), &id("o1"), "10.50").as_bytes()), Some(&causes)).await;
    produce(&p, &orders, 0, &ada, Some(order(&id("o2"), "4.50").as_bytes()), None).await;
    // bob (partition 1): one order.
    produce(&p, &orders, 1, &bob, Some(order(&id("o3"), "7").as_bytes()), None).await;

    let (stop, shutdown) = watch::channel(false);
    let run = tokio::spawn(Projector::builder(config).shutdown(shutdown).run());
    // Amounts as written (`10.50` keeps its scale): `:value` is never read through a float.
    wait_for(&pool, &ada, Some(("15.00", "10.50"))).await;
    wait_for(&pool, &bob, Some(("7", "0"))).await;

    // A tombstone on orders forgets bob: his orders and payments.
    produce(&p, &payments, 1, &bob, Some(payment(&id("p2"), &id("o3"), "7").as_bytes()), None).await;
    wait_for(&pool, &bob, Some(("7", "7"))).await;
    produce(&p, &orders, 1, &bob, None, None).await;
    wait_for(&pool, &bob, None).await;
    assert_eq!(totals(&pool, &ada).await, Some(("15.00".to_string(), "10.50".to_string())), "ada is untouched");

    stop.send(true).unwrap();
    tokio::time::timeout(TIMEOUT, run).await.expect("stops at the signal").unwrap().unwrap();
    let applied: Vec<String> =
        sqlx::query_scalar("SELECT name FROM parsley.model_migrations WHERE model = $1 ORDER BY version")
            .bind(&model)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(applied, ["1_create_orders_and_payments.sql", "2_create_customer_totals.sql"]);
}

fn order(id: &str, amount: &str) -> String {
    format!(r#"{{"order": "{id}", "amount": {amount}}}"#)
}

fn payment(id: &str, order: &str, amount: &str) -> String {
    format!(r#"{{"payment": "{id}", "order": "{order}", "amount": {amount}}}"#)
}
