//! The projection seam: application code that turns delivered records into rows, inside
//! the step's transaction. The engine has already decided the order; a projection only
//! writes. A projection error is not a refusal: the step rolls back, the task reports
//! `failing`, and the same records are retried with backoff — never skipped.

use std::future::Future;

use anyhow::Context as _;
use parsley::channel::{ChannelId, Position};
use parsley::CausalPast;
use sqlx::PgConnection;

/// The step a delivery belongs to.
#[derive(Clone, Copy, Debug)]
pub struct StepContext<'a> {
    pub model: &'a str,
    pub task: u32,
}

/// One delivered record, handed to the projection in delivery (causal) order.
#[derive(Clone, Copy, Debug)]
pub struct Delivered<'a> {
    /// The name of the record's topic.
    pub topic: &'a str,
    /// The record's own coordinate: channel and position.
    pub channel: ChannelId,
    pub position: Position,
    pub key: Option<&'a [u8]>,
    /// `None` for a tombstone.
    pub value: Option<&'a [u8]>,
    /// Application headers (the `parsley.causes` header is in `causes`).
    pub headers: &'a [(String, Option<Vec<u8>>)],
    pub timestamp_ms: Option<i64>,
    /// The causes the record carried.
    pub causes: &'a CausalPast,
}

impl Delivered<'_> {
    /// `topic/partition@position`, for messages (never the payload).
    pub fn coordinate(&self) -> String {
        format!("{}/{}@{}", self.topic, self.channel.partition, self.position)
    }
}

/// Writes application rows for delivered records.
///
/// `apply` receives one record; `apply_batch` receives every delivery of a step in order,
/// and may be overridden to write them with fewer statements. Both run inside the step's
/// transaction (`conn`), which also commits the ordering state: return an error and
/// nothing of the step is kept.
pub trait Projection: Send + Sync + 'static {
    fn apply(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        record: &Delivered<'_>,
    ) -> impl Future<Output = anyhow::Result<()>> + Send;

    fn apply_batch(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        records: &[Delivered<'_>],
    ) -> impl Future<Output = anyhow::Result<()>> + Send {
        async move {
            for record in records {
                self.apply(conn, step, record).await.with_context(|| format!("projecting {}", record.coordinate()))?;
            }
            Ok(())
        }
    }
}
