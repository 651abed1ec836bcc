//! Task status read from the database, two ways:
//! - [`model_report`], for `parsley-projector status` and tests: each task's status (running,
//!   failing with its last error, refused with reason, diagnosis, channel and position), its
//!   held queues with the blockers of each head (computed by restoring the task's engine from
//!   the stored state and asking it), the size of its clock, the records operators skipped and
//!   the records dead-lettered;
//! - [`model_aggregates`], for the gateway's `GET /v1/status`: the same status from SQL
//!   aggregates (counts, sizes, ages, and each queue head's `parsley.causes`), so that a large
//!   backlog costs the reader no memory.
//!
//! Both carry the persisted [`TaskStatus`] of each task.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use crate::error::{Context as _, StoreError};
use parsley::channel::{ChannelId, Position, TopicId};
use parsley::codec;
use parsley::decide::{decide, Blocker, Decision};
use parsley::engine::{ChannelStatus, EngineConfig};
use parsley::refusal::Refusal;
use parsley::Engine;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::ordering::{self as store, DeadLetter, LoadError, ModelRow, RecordFound, Skip, TaskRow, TaskStatus};
use crate::record::RecordData;

/// How many of a task's latest dead letters a report lists (all are counted).
pub const LATEST_DEAD_LETTERS: usize = 5;

/// The status of one task.
#[derive(Clone, Debug)]
pub struct TaskReport {
    pub task: u32,
    pub epoch: i64,
    pub owner: String,
    pub status: TaskStatus,
    pub last_error: Option<String>,
    pub failures: i32,
    pub refusal: Option<Refusal>,
    /// The owner's lease: milliseconds until it passes (negative: passed that long ago);
    /// `None`: no instance holds the task.
    pub lease_remaining_ms: Option<i64>,
    /// Milliseconds since the owner's runner last stepped.
    pub since_step_ms: Option<i64>,
    /// Per channel: fed_up_to, settled, held count, head and the head's blockers.
    pub channels: Vec<ChannelStatus>,
    pub held_total: usize,
    pub clock_width: usize,
    /// Why the stored state could not be read, when it could not.
    pub unreadable: Option<Refusal>,
    /// Every record an operator skipped in this task, oldest first.
    pub skips: Vec<Skip>,
    /// How many records the task dead-lettered, and the latest few, newest first.
    pub dead_letters: usize,
    pub latest_dead_letters: Vec<DeadLetter>,
}

/// The status of one model.
#[derive(Clone, Debug)]
pub struct ModelReport {
    pub model: String,
    pub task_count: u32,
    pub format_version: i32,
    /// Topic name by ID, as recorded.
    pub topics: BTreeMap<TopicId, String>,
    pub tasks: Vec<TaskReport>,
}

impl ModelReport {
    pub fn task(&self, task: u32) -> Option<&TaskReport> {
        self.tasks.iter().find(|t| t.task == task)
    }

    /// `topic/partition` for a channel of a recorded topic, else the channel ID.
    pub fn describe(&self, channel: &ChannelId) -> String {
        match self.topics.get(&channel.topic) {
            Some(name) => format!("{name}/{}", channel.partition),
            None => channel.to_string(),
        }
    }
}

/// Every model's name.
pub async fn models(conn: &mut PgConnection) -> Result<Vec<String>, StoreError> {
    sqlx::query_scalar("SELECT model FROM parsley.models ORDER BY model")
        .fetch_all(&mut *conn)
        .await
        .context("listing models")
}

/// The status of `model`, or `None` if it has no state.
pub async fn model_report(conn: &mut PgConnection, model: &str) -> Result<Option<ModelReport>, StoreError> {
    let Some(row) = store::load_model(conn, model).await? else { return Ok(None) };
    let topics: BTreeMap<TopicId, String> = row.topics.iter().map(|(n, id)| (*id, n.clone())).collect();
    let mut skips = store::skips(conn, model).await?;
    let mut dead_letters = store::dead_letters(conn, model, LATEST_DEAD_LETTERS).await?;
    let mut tasks = Vec::new();
    for t in store::load_tasks(conn, model).await? {
        let (dead_count, latest_dead) = dead_letters.remove(&t.task).unwrap_or_default();
        let mut report = TaskReport {
            task: t.task,
            epoch: t.epoch,
            owner: t.owner,
            status: t.status,
            last_error: t.last_error,
            failures: t.failures,
            refusal: t.refusal,
            lease_remaining_ms: t.lease_remaining_ms,
            since_step_ms: t.since_step_ms,
            channels: Vec::new(),
            held_total: 0,
            clock_width: 0,
            unreadable: None,
            skips: skips.iter().filter(|(task, _)| *task == t.task).map(|(_, s)| s.clone()).collect(),
            dead_letters: dead_count,
            latest_dead_letters: latest_dead,
        };
        skips.retain(|(task, _)| *task != t.task);
        match store::load_state(conn, model, t.task, row.format_version).await {
            Err(LoadError::Database(e)) => return Err(e),
            Err(LoadError::Refused(r)) => report.unreadable = Some(r),
            Ok(mut state) => {
                // Skipped held records wait for nothing, as the task's restore has them.
                let skipped = report.skips.iter().map(|s| (s.channel, s.position)).collect();
                store::mark_skipped_held(&mut state, &skipped);
                // The received set as stored: every channel with a baseline or a held record.
                let received: BTreeSet<ChannelId> =
                    state.fed_up_to.keys().copied().chain(state.held.iter().map(|h| h.channel)).collect();
                report.clock_width = state.delivered.len();
                match Engine::<RecordData>::restore(
                    EngineConfig { metadata_budget: usize::MAX, ..EngineConfig::default() },
                    received,
                    state,
                ) {
                    Ok(engine) => {
                        let s = engine.status();
                        report.channels = s.channels;
                        report.held_total = s.held_total;
                    }
                    Err(r) => report.unreadable = Some(r),
                }
            }
        }
        tasks.push(report);
    }
    Ok(Some(ModelReport {
        model: model.to_string(),
        task_count: row.task_count,
        format_version: row.format_version,
        topics,
        tasks,
    }))
}

fn position(p: Option<Position>) -> String {
    p.map_or_else(|| "none".to_string(), |p| p.to_string())
}

/// A lease in words: held for how much longer, or since when nobody holds it.
pub fn describe_lease(remaining_ms: Option<i64>) -> String {
    match remaining_ms {
        Some(ms) if ms > 0 => format!("lease {ms} ms left"),
        Some(ms) => format!("LEASE EXPIRED {} ms ago, not taken over", -ms),
        None => "not leased: no instance holds it".to_string(),
    }
}

/// Renders a report for operators.
pub fn render(report: &ModelReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "model {} ({} tasks, ordering-state format {})",
        report.model, report.task_count, report.format_version
    );
    for (id, name) in &report.topics {
        let _ = writeln!(out, "  topic {name} = {id}");
    }
    for t in &report.tasks {
        let state = match t.status {
            TaskStatus::Running => "running".to_string(),
            TaskStatus::Failing => format!(
                "FAILING ({} failed attempts): {}",
                t.failures,
                t.last_error.as_deref().unwrap_or("no error recorded")
            ),
            TaskStatus::Refused => match &t.refusal {
                Some(r) => {
                    let at = match (r.channel, r.position) {
                        (Some(c), Some(p)) => format!(" at {}@{p}", report.describe(&c)),
                        (Some(c), None) => format!(" on {}", report.describe(&c)),
                        _ => String::new(),
                    };
                    format!("REFUSED {}{at}: {}", r.reason, r.diagnosis)
                }
                None => "REFUSED (no reason recorded)".to_string(),
            },
        };
        let _ = writeln!(
            out,
            "  task {}: {state}; epoch {} owner {:?} ({}; {}); held {}; clock {} channels",
            t.task,
            t.epoch,
            t.owner,
            describe_lease(t.lease_remaining_ms),
            t.since_step_ms.map_or_else(|| "no step recorded".to_string(), |ms| format!("last step {ms} ms ago")),
            t.held_total,
            t.clock_width
        );
        if let Some(r) = &t.unreadable {
            let _ = writeln!(out, "    stored state unreadable: {r}");
        }
        for s in &t.skips {
            let found = match &s.found {
                RecordFound::Read { key, causes_headers } => format!(
                    "record read: key {}, {} parsley.causes header(s)",
                    key.as_ref().map_or_else(|| "null".to_string(), |k| format!("{} bytes", k.len())),
                    causes_headers.len()
                ),
                RecordFound::Gone => "record gone (below the log start) when skipped".to_string(),
                RecordFound::Absent => "no data record at that position".to_string(),
            };
            let cleared = s.refusal_reason.as_deref().map(|r| format!("cleared {r}; ")).unwrap_or_default();
            let _ = writeln!(
                out,
                "    skipped {}@{} by {:?} at {}: {:?} ({cleared}{found})",
                report.describe(&s.channel),
                s.position,
                s.skipped_by,
                s.skipped_at,
                s.reason
            );
        }
        if t.dead_letters > 0 {
            let _ = writeln!(out, "    dead letters: {} (latest first)", t.dead_letters);
            for d in &t.latest_dead_letters {
                let _ = writeln!(
                    out,
                    "      {}@{} at {}: {}",
                    report.describe(&d.channel),
                    d.position,
                    d.dead_lettered_at,
                    d.reason
                );
            }
        }
        for c in &t.channels {
            let _ = write!(
                out,
                "    {}: fed_up_to {}, settled {}",
                report.describe(&c.channel),
                position(c.fed_up_to),
                position(c.settled)
            );
            if c.held > 0 {
                let _ = write!(out, ", held {} (head {})", c.held, position(c.head));
                for b in &c.blockers {
                    let _ = write!(
                        out,
                        "; blocked on {} required {} settled {}",
                        report.describe(&b.channel),
                        b.required,
                        position(b.settled)
                    );
                }
            }
            let _ = writeln!(out);
        }
    }
    out
}

/// One model's status from SQL aggregates ([`model_aggregates`]).
#[derive(Clone, Debug)]
pub struct ModelAggregates {
    pub model: String,
    pub row: ModelRow,
    /// Topic name by ID, as recorded.
    pub topics: BTreeMap<TopicId, String>,
    pub tasks: Vec<TaskAggregates>,
    /// The instances registered for the model (live or not).
    pub members: Vec<crate::leases::Member>,
}

/// One task's status from SQL aggregates.
#[derive(Clone, Debug)]
pub struct TaskAggregates {
    pub row: TaskRow,
    pub channels: BTreeMap<ChannelId, ChannelAggregates>,
    pub clock_width: i64,
    /// Why a queue head's causes could not be read, when one could not.
    pub unreadable: Option<String>,
}

/// One received channel of a task, from SQL aggregates.
#[derive(Clone, Debug, Default)]
pub struct ChannelAggregates {
    pub fed_up_to: Option<Position>,
    pub held: i64,
    pub held_bytes: i64,
    /// The oldest held position, and how long ago it was received.
    pub head: Option<Position>,
    pub oldest_held_age_s: Option<f64>,
    pub blockers: Vec<Blocker>,
}

impl ChannelAggregates {
    /// Every position at or below it is delivered or will never yield a record (the
    /// engine's rule: below the head when one is held, else `fed_up_to`).
    pub fn settled(&self) -> Option<Position> {
        match self.head {
            Some(head) => Some(head - 1),
            None => self.fed_up_to,
        }
    }
}

/// The channels' received positions, held aggregates and queue heads, per task.
const CHANNELS_SQL: &str = "SELECT task, topic_id, partition, fed_up_to FROM parsley.channels WHERE model = $1";
const HELD_SQL: &str = "SELECT task, topic_id, partition, count(*)::bigint, \
     sum(octet_length(headers) + octet_length(causes) + coalesce(octet_length(record_key), 0) \
         + coalesce(octet_length(record_value), 0))::bigint, \
     min(position), extract(epoch FROM now() - min(received_at))::float8 \
     FROM parsley.held WHERE model = $1 GROUP BY task, topic_id, partition";
const HEAD_CAUSES_SQL: &str = "SELECT h.task, h.topic_id, h.partition, h.causes FROM parsley.held h \
     JOIN (SELECT task, topic_id, partition, min(position) AS head FROM parsley.held WHERE model = $1 \
           GROUP BY task, topic_id, partition) m \
       ON h.task = m.task AND h.topic_id = m.topic_id AND h.partition = m.partition AND h.position = m.head \
     WHERE h.model = $1";
const CLOCK_WIDTH_SQL: &str = "SELECT task, count(*)::bigint FROM parsley.clock WHERE model = $1 GROUP BY task";

fn aggregate_channel(topic_id: &Uuid, partition: i32) -> Result<ChannelId, StoreError> {
    let partition = u32::try_from(partition).with_context(|| format!("a stored partition is {partition}"))?;
    Ok(ChannelId::new(store::topic_of(topic_id), partition))
}

fn aggregate_task(task: i32) -> Result<u32, StoreError> {
    u32::try_from(task).with_context(|| format!("a stored task is {task}"))
}

/// The status of `model` from SQL aggregates (no held record is loaded, only counts, sizes
/// and each queue head's `parsley.causes`), or `None` if it has no state. Run it in one
/// snapshot ([`crate::ordering::begin_snapshot`]) for a consistent picture.
pub async fn model_aggregates(conn: &mut PgConnection, model: &str) -> Result<Option<ModelAggregates>, StoreError> {
    let Some(row) = store::load_model(conn, model).await? else { return Ok(None) };
    let topics = row.topics.iter().map(|(name, id)| (*id, name.clone())).collect();
    let mut tasks: BTreeMap<u32, TaskAggregates> = store::load_tasks(conn, model)
        .await?
        .into_iter()
        .map(|t| (t.task, TaskAggregates { row: t, channels: BTreeMap::new(), clock_width: 0, unreadable: None }))
        .collect();
    let context = || format!("reading the status of model {model:?}");

    let rows: Vec<(i32, Uuid, i32, i64)> =
        sqlx::query_as(CHANNELS_SQL).bind(model).fetch_all(&mut *conn).await.with_context(context)?;
    for (task, topic_id, partition, fed_up_to) in rows {
        if let Some(t) = tasks.get_mut(&aggregate_task(task)?) {
            t.channels.entry(aggregate_channel(&topic_id, partition)?).or_default().fed_up_to = Some(fed_up_to);
        }
    }
    type HeldRow = (i32, Uuid, i32, i64, Option<i64>, Option<i64>, Option<f64>);
    let rows: Vec<HeldRow> = sqlx::query_as(HELD_SQL).bind(model).fetch_all(&mut *conn).await.with_context(context)?;
    for (task, topic_id, partition, held, bytes, head, age) in rows {
        if let Some(t) = tasks.get_mut(&aggregate_task(task)?) {
            let c = t.channels.entry(aggregate_channel(&topic_id, partition)?).or_default();
            (c.held, c.held_bytes, c.head, c.oldest_held_age_s) = (held, bytes.unwrap_or(0), head, age);
        }
    }
    let heads: Vec<(i32, Uuid, i32, Vec<u8>)> =
        sqlx::query_as(HEAD_CAUSES_SQL).bind(model).fetch_all(&mut *conn).await.with_context(context)?;
    for (task, topic_id, partition, causes) in heads {
        let Some(t) = tasks.get_mut(&aggregate_task(task)?) else { continue };
        let channel = aggregate_channel(&topic_id, partition)?;
        match codec::decode(&causes, usize::MAX) {
            Ok(past) => {
                // The engine's status rule: the head waits for the causes its task has not
                // settled on the channels it receives.
                // Task n receives partition n of each of the model's topics.
                let received: BTreeSet<ChannelId> = row
                    .topics
                    .values()
                    .map(|id| ChannelId::new(*id, t.row.task))
                    .chain(t.channels.keys().copied())
                    .collect();
                let settled = |c: &ChannelId| t.channels.get(c).and_then(ChannelAggregates::settled);
                if let Decision::Held { blockers } = decide(&past, &received, settled) {
                    if let Some(c) = t.channels.get_mut(&channel) {
                        c.blockers = blockers;
                    }
                }
            }
            Err(e) => {
                t.unreadable = Some(format!("the causes of the head of {channel} do not decode: {e}"));
            }
        }
    }
    let widths: Vec<(i32, i64)> =
        sqlx::query_as(CLOCK_WIDTH_SQL).bind(model).fetch_all(&mut *conn).await.with_context(context)?;
    for (task, width) in widths {
        if let Some(t) = tasks.get_mut(&aggregate_task(task)?) {
            t.clock_width = width;
        }
    }
    let members = crate::leases::members(conn, model).await?;
    Ok(Some(ModelAggregates { model: model.to_string(), row, topics, tasks: tasks.into_values().collect(), members }))
}

#[cfg(test)]
mod tests {
    use parsley::refusal::RefusalReason;

    /// Every reason a status can show has its runbook in the operations guide.
    #[test]
    fn every_refusal_reason_has_a_runbook() {
        let guide = include_str!("../../docs/operations.md");
        for reason in RefusalReason::ALL {
            let heading = format!("\n### `{reason}`\n");
            assert!(guide.contains(&heading), "docs/operations.md has no runbook heading {heading:?}");
        }
    }
}
