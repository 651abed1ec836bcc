//! The document projection's step fold against its meaning: a step's records folded in
//! memory and written at once leave the rows that applying them one record per step leaves.

use parsley::channel::{ChannelId, TopicId};
use parsley::CausalPast;
use parsley_projector::projection::{Delivered, Projection, StepContext};
use parsley_projector::DocumentProjection;
use parsley_settings::config::Apply;
use parsley_testkit::unique;
use sqlx::{PgPool, Row as _};

use crate::support::pool;

/// One record of the generated history: its topic (replace or merge), key and value.
struct Rec {
    merge: bool,
    key: String,
    value: Option<Vec<u8>>,
}

/// A deterministic history over a few keys mixing every operation: replaces, merges that
/// add and remove members, tombstones, and a merge and a replace whose result is `null`.
fn history(seed: u64, n: usize) -> Vec<Rec> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) as usize
    };
    (0..n)
        .map(|i| {
            let key = format!("k{}", next() % 6);
            let (merge, value): (bool, Option<String>) = match next() % 9 {
                0 | 1 => (false, Some(format!(r#"{{"a":{i},"n":{{"x":{i}}}}}"#))),
                2 | 3 => (true, Some(format!(r#"{{"b":{i},"n":{{"y":{i}}}}}"#))),
                4 => (true, Some(r#"{"a":null,"n":{"x":null}}"#.to_string())),
                5 => (false, None),
                6 => (true, Some("null".to_string())),
                7 => (false, Some("null".to_string())),
                _ => (true, Some(format!("[{i}]"))),
            };
            Rec { merge, key, value: value.map(String::into_bytes) }
        })
        .collect()
}

/// `(key, doc, version, partition, position)` of every document of `model`, in key order.
async fn rows(pool: &PgPool, model: &str) -> Vec<(String, serde_json::Value, i64, i32, i64)> {
    sqlx::query("SELECT key, doc, version, partition, position FROM projection.documents WHERE model = $1 ORDER BY key")
        .bind(model)
        .fetch_all(pool)
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folded_step_writes_what_one_record_per_step_writes() {
    let pool = pool().await;
    let projection =
        DocumentProjection::new([("orders".to_string(), Apply::Replace), ("payments".to_string(), Apply::Merge)]);
    let orders = ChannelId::new(TopicId::from_bytes([7; 16]), 0);
    let payments = ChannelId::new(TopicId::from_bytes([8; 16]), 1);
    let causes = CausalPast::default();

    for seed in [1u64, 2, 3, 4] {
        let history = history(seed, 300);
        let delivered: Vec<Delivered<'_>> = history
            .iter()
            .enumerate()
            .map(|(i, r)| Delivered {
                topic: if r.merge { "payments" } else { "orders" },
                channel: if r.merge { payments } else { orders },
                position: i as i64,
                key: Some(r.key.as_bytes()),
                value: r.value.as_deref(),
                headers: &[],
                timestamp_ms: None,
                causes: &causes,
            })
            .collect();

        // One record per step, and steps of varied sizes (1 to 40 records).
        let single = unique("fold-single");
        let folded = unique("fold-batched");
        let mut conn = pool.acquire().await.unwrap();
        for record in &delivered {
            let step = StepContext { model: &single, task: 0 };
            projection.apply_batch(&mut conn, step, std::slice::from_ref(record)).await.unwrap();
        }
        let mut at = 0;
        let mut size = seed as usize;
        while at < delivered.len() {
            size = (size * 7 + 3) % 40 + 1;
            let end = (at + size).min(delivered.len());
            let step = StepContext { model: &folded, task: 0 };
            projection.apply_batch(&mut conn, step, &delivered[at..end]).await.unwrap();
            at = end;
        }
        drop(conn);

        let expected = rows(&pool, &single).await;
        assert!(!expected.is_empty(), "seed {seed}: the history leaves some documents");
        assert!(expected.iter().any(|r| r.2 > 1), "seed {seed}: some document took several records");
        assert_eq!(rows(&pool, &folded).await, expected, "seed {seed}");
        for model in [&single, &folded] {
            sqlx::query("DELETE FROM projection.documents WHERE model = $1").bind(model).execute(&pool).await.unwrap();
        }
    }
}
