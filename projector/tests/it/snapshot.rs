//! Host duty R1 on the real database: a gated read's clock rows and the data it serves come
//! from one snapshot (docs/verification.md, "Host duties"). The simulator's `SplitSnapshot`
//! breaks only the simulator's own model of the read; no pure function can carry a property
//! of SQL snapshots, so this test holds the statements the gateway ships —
//! `parsley_store::documents::gated_document` and `gated_page` — to it directly, while steps
//! commit concurrently (a document and the clock row that says it was applied, in one
//! transaction, as a projector's step writes them). Its meta-test shows that the same
//! judgement catches a read made of two statements.

use std::borrow::Cow;
use std::collections::BTreeSet;

use parsley::channel::{ChannelId, Position, TopicId};
use parsley::engine::StepChanges;
use parsley::gate::ClockRow;
use parsley_store::documents::{self, ClockScope, Document, DocumentWrite, GateInputs};
use parsley_store::{ordering, RecordData};
use sqlx::PgPool;

use crate::support::{pool, unique};

/// Steps the writer commits while the reader reads.
const STEPS: Position = 300;

fn changes(c: ChannelId, v: Position) -> StepChanges<RecordData> {
    StepChanges {
        held_inserted: Vec::new(),
        held_removed: Vec::new(),
        fed_up_to: vec![(c, v)],
        channels_removed: Vec::new(),
        frontier_upserts: vec![(c, v)],
        frontier_removed: Vec::new(),
        clock_upserts: vec![(c, v)],
        clock_removed: Vec::new(),
        refusal: None,
    }
}

/// A model of one task receiving `c`, its task row taken.
async fn model(pool: &PgPool) -> (String, ChannelId) {
    let model = unique("snapshot");
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let topic = TopicId::from_halves(0x5a5a_0000 | u64::from(std::process::id()), nanos as u64 | 1);
    ordering::register_model(pool, &model, 1, &[("orders".to_string(), topic)]).await.unwrap();
    ordering::take_task(pool, &model, 0, "snapshot-test").await.unwrap();
    (model, ChannelId::new(topic, 0))
}

/// One step at position `v`: document `k` becomes `{"v": v}` and the clock says `c` was
/// delivered up to `v`, in one transaction.
async fn step(pool: &PgPool, model: &str, c: ChannelId, v: Position) {
    let mut tx = pool.begin().await.unwrap();
    let doc = Cow::Owned(format!("{{\"v\": {v}}}"));
    let write = DocumentWrite { key: "k", doc, channel: c, position: v, applied: 1 };
    documents::write(&mut tx, model, 0, vec![write]).await.unwrap();
    ordering::apply_changes(&mut tx, model, 0, &changes(c, v)).await.unwrap();
    tx.commit().await.unwrap();
}

/// What one read saw: the clock's position on `c` (if it had a row) must be reflected by the
/// document — the rows served are the rows the clock describes. Returns that position.
fn judge(clock: &[ClockRow], doc: Option<&Document>, c: ChannelId) -> Result<Option<Position>, String> {
    let said = clock.iter().filter(|r| r.task == 0 && r.channel == c).map(|r| r.position).max();
    let shows = doc.map(|d| d.value().unwrap()["v"].as_i64().expect("v"));
    match said {
        Some(p) if shows.is_none_or(|v| v < p) => {
            Err(format!("the clock says {c}@{p} was applied, the document served shows {shows:?}"))
        }
        _ => Ok(said),
    }
}

fn inputs() -> GateInputs {
    GateInputs { clock: ClockScope::All, cached: None }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gated_statements_read_the_clock_and_the_data_in_one_snapshot() {
    let pool = pool().await;
    let (model, c) = model(&pool).await;
    let writer = {
        let (pool, model) = (pool.clone(), model.clone());
        tokio::spawn(async move {
            for v in 0..STEPS {
                step(&pool, &model, c, v).await;
            }
        })
    };
    let mut conn = pool.acquire().await.unwrap();
    let mut seen = BTreeSet::new();
    let mut reads = 0;
    while !writer.is_finished() {
        let one = documents::gated_document(&mut conn, &model, "k", &inputs()).await.unwrap();
        let said = judge(&one.clock, one.data.as_ref(), c).unwrap_or_else(|e| panic!("a document read: {e}"));
        let page = documents::gated_page(&mut conn, &model, None, None, 10, None).await.unwrap();
        judge(&page.clock, page.data.first(), c).unwrap_or_else(|e| panic!("a page read: {e}"));
        seen.extend(said);
        reads += 2;
    }
    writer.await.unwrap();
    // Not vacuous: the reads met the clock at many positions while steps committed.
    assert!(seen.len() >= 10, "{reads} reads saw only {} clock positions: {seen:?}", seen.len());
    println!("{reads} gated reads under {STEPS} concurrent steps, {} clock positions met, all consistent", seen.len());
}

/// The meta-test: a read that takes its data from one statement and its clock rows from a
/// later one (a step committing between them, as one may whenever they are two statements
/// outside one snapshot) is caught by the judgement above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_in_two_statements_is_caught() {
    let pool = pool().await;
    let (model, c) = model(&pool).await;
    step(&pool, &model, c, 0).await;
    let mut conn = pool.acquire().await.unwrap();
    let data = documents::gated_document(&mut conn, &model, "k", &inputs()).await.unwrap().data;
    step(&pool, &model, c, 1).await;
    let clock = documents::gated_document(&mut conn, &model, "k", &inputs()).await.unwrap().clock;
    let verdict = judge(&clock, data.as_ref(), c);
    assert!(verdict.is_err(), "a split read went unnoticed: {verdict:?}");
    // And the one statement, read again, is consistent.
    let one = documents::gated_document(&mut conn, &model, "k", &inputs()).await.unwrap();
    assert_eq!(judge(&one.clock, one.data.as_ref(), c), Ok(Some(1)));
}
