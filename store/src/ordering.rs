//! The ordering state: every statement on the `parsley` schema — model and topic identities,
//! task ownership (epochs) and the persisted task status ([`TaskStatus`]), loading a task's
//! persisted state, writing one step's [`StepChanges`] inside the step's transaction, clock
//! rows and the `NOTIFY` that announces them, skips and dead letters.
//!
//! Table names are written out in every statement, never spliced in: the two pasts a task
//! persists (frontier and clock) are told apart by [`Past`], which picks the statement.
//! Queries are checked at run time (not by sqlx's macros); the projector's integration tests
//! (`projector/tests/it/store.rs` and the rest) run every statement here.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Context as _, StoreError};
use parsley::channel::{ChannelId, Position, TopicId};
use parsley::engine::{HeldRecord, PersistedState, StepChanges, ORDERING_STATE_FORMAT};
use parsley::gate::ClockRow;
use parsley::refusal::{Refusal, RefusalReason};
use parsley::CausalPast;
use sqlx::{PgConnection, PgPool, Postgres, Row as _, Transaction};
use uuid::Uuid;

use crate::record::{decode_headers, encode_headers, Header, RecordData};

/// The channel `NOTIFY` is sent on after a step changed a task's clock or status; the
/// payload is `<model>:<task>`. Triggers also send `<model>` (a model recorded, removed or
/// reshaped) and [`EVERY_MODEL_PAYLOAD`].
pub const CLOCK_NOTIFY_CHANNEL: &str = "parsley_clock";

/// The payload of a change to every model: documents inserted, updated or deleted outside a
/// step (migration `20261206000000`). No model name contains `*`.
pub const EVERY_MODEL_PAYLOAD: &str = "*";

pub fn uuid_of(topic: &TopicId) -> Uuid {
    Uuid::from_bytes(*topic.as_bytes())
}

pub fn topic_of(uuid: &Uuid) -> TopicId {
    TopicId::from_bytes(*uuid.as_bytes())
}

pub(crate) fn channel_of(topic_id: Uuid, partition: i32) -> Result<ChannelId, StoreError> {
    let partition = u32::try_from(partition).with_context(|| format!("stored partition {partition} is negative"))?;
    Ok(ChannelId::new(topic_of(&topic_id), partition))
}

/// What the database records of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelRow {
    pub task_count: u32,
    pub format_version: i32,
    /// TaskStatus topic identities, by name.
    pub topics: BTreeMap<String, TopicId>,
}

pub async fn load_model(conn: &mut PgConnection, model: &str) -> Result<Option<ModelRow>, StoreError> {
    let row = sqlx::query("SELECT task_count, format_version FROM parsley.models WHERE model = $1")
        .bind(model)
        .fetch_optional(&mut *conn)
        .await
        .with_context(|| format!("reading model {model:?}"))?;
    let Some(row) = row else { return Ok(None) };
    let task_count: i32 = row.get(0);
    let format_version: i32 = row.get(1);
    let topics = sqlx::query("SELECT topic_name, topic_id FROM parsley.topics WHERE model = $1")
        .bind(model)
        .fetch_all(&mut *conn)
        .await
        .with_context(|| format!("reading the topic identities of model {model:?}"))?
        .into_iter()
        .map(|r| (r.get::<String, _>(0), topic_of(&r.get::<Uuid, _>(1))))
        .collect();
    Ok(Some(ModelRow { task_count: task_count as u32, format_version, topics }))
}

/// Records a model (if new) and the identities of topics it did not record yet. Existing
/// rows are never changed: a changed identity or width is refused before this is called.
pub async fn register_model(
    pool: &PgPool,
    model: &str,
    task_count: u32,
    topics: &[(String, TopicId)],
) -> Result<(), StoreError> {
    let mut tx = pool.begin().await.context("beginning the model registration")?;
    sqlx::query(
        "INSERT INTO parsley.models (model, task_count, format_version) VALUES ($1, $2, $3)
         ON CONFLICT (model) DO NOTHING",
    )
    .bind(model)
    .bind(task_count as i32)
    .bind(ORDERING_STATE_FORMAT as i32)
    .execute(&mut *tx)
    .await
    .with_context(|| format!("recording model {model:?}"))?;
    let names: Vec<String> = topics.iter().map(|(n, _)| n.clone()).collect();
    let ids: Vec<Uuid> = topics.iter().map(|(_, id)| uuid_of(id)).collect();
    sqlx::query(
        "INSERT INTO parsley.topics (model, topic_name, topic_id)
         SELECT $1, * FROM UNNEST($2::text[], $3::uuid[])
         ON CONFLICT (model, topic_name) DO NOTHING",
    )
    .bind(model)
    .bind(&names)
    .bind(&ids)
    .execute(&mut *tx)
    .await
    .with_context(|| format!("recording the topic identities of model {model:?}"))?;
    tx.commit().await.context("committing the model registration")?;
    Ok(())
}

/// How many records a model's tasks hold from one topic.
pub async fn held_on_topic(conn: &mut PgConnection, model: &str, topic: &TopicId) -> Result<usize, StoreError> {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM parsley.held WHERE model = $1 AND topic_id = $2")
        .bind(model)
        .bind(uuid_of(topic))
        .fetch_one(&mut *conn)
        .await
        .with_context(|| format!("counting held records of model {model:?}"))?;
    Ok(n as usize)
}

/// A task's row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskRow {
    pub task: u32,
    pub epoch: i64,
    pub owner: String,
    pub status: TaskStatus,
    pub last_error: Option<String>,
    pub failures: i32,
    pub refusal: Option<Refusal>,
    /// Milliseconds until the owner's lease passes, by the database's clock (negative: it
    /// passed that long ago); `None`: no instance holds the task (never leased, or handed
    /// back).
    pub lease_remaining_ms: Option<i64>,
    /// Milliseconds since the owner's runner last stepped; `None`: not recorded.
    pub since_step_ms: Option<i64>,
}

impl TaskRow {
    /// Some instance holds a live lease on the task.
    pub fn leased(&self) -> bool {
        self.lease_remaining_ms.is_some_and(|ms| ms > 0)
    }
}

/// The task status type is the core's: one type for the protocol, the rows and every view.
pub use parsley::host::TaskStatus;

/// The columns of a task row, in the order [`task_row`] reads them by name.
macro_rules! task_columns {
    () => {
        "task, epoch, owner, status, last_error, failures, refusal_reason, refusal_diagnosis, \
         refusal_topic_id, refusal_partition, refusal_position, \
         (extract(epoch FROM lease_until - now()) * 1000)::bigint AS lease_remaining_ms, \
         (extract(epoch FROM now() - last_step_at) * 1000)::bigint AS since_step_ms"
    };
}

/// The columns of a task row, for statements outside this module.
pub(crate) const TASK_COLUMNS: &str = task_columns!();

pub(crate) fn task_row(row: &sqlx::postgres::PgRow) -> Result<TaskRow, StoreError> {
    let reason: Option<String> = row.get("refusal_reason");
    let refusal = match reason {
        None => None,
        Some(name) => {
            let reason = RefusalReason::parse(&name)
                .with_context(|| format!("stored refusal reason {name:?} is unknown to this build"))?;
            let topic: Option<Uuid> = row.get("refusal_topic_id");
            let partition: Option<i32> = row.get("refusal_partition");
            let channel = match (topic, partition) {
                (Some(t), Some(p)) => Some(channel_of(t, p)?),
                _ => None,
            };
            Some(Refusal {
                reason,
                channel,
                position: row.get("refusal_position"),
                diagnosis: row.get::<Option<String>, _>("refusal_diagnosis").unwrap_or_default(),
            })
        }
    };
    Ok(TaskRow {
        task: row.get::<i32, _>("task") as u32,
        epoch: row.get("epoch"),
        owner: row.get("owner"),
        status: {
            let word = row.get::<&str, _>("status");
            TaskStatus::parse(word).with_context(|| format!("unknown task status {word:?}"))?
        },
        last_error: row.get("last_error"),
        failures: row.get("failures"),
        refusal,
        lease_remaining_ms: row.get("lease_remaining_ms"),
        since_step_ms: row.get("since_step_ms"),
    })
}

/// Takes a task: increments its epoch (creating the row at epoch 1) and names `owner`.
/// From the moment this commits, the previous owner's steps abort.
pub async fn take_task(pool: &PgPool, model: &str, task: u32, owner: &str) -> Result<TaskRow, StoreError> {
    let row = sqlx::query(concat!(
        "INSERT INTO parsley.tasks (model, task, epoch, owner) VALUES ($1, $2, 1, $3)
         ON CONFLICT (model, task) DO UPDATE
           SET epoch = parsley.tasks.epoch + 1, owner = EXCLUDED.owner, updated_at = now()
         RETURNING ",
        task_columns!()
    ))
    .bind(model)
    .bind(task as i32)
    .bind(owner)
    .fetch_one(pool)
    .await
    .with_context(|| format!("taking task {model}/{task}"))?;
    task_row(&row)
}

/// Every task row of a model, by task.
pub async fn load_tasks(conn: &mut PgConnection, model: &str) -> Result<Vec<TaskRow>, StoreError> {
    sqlx::query(concat!("SELECT ", task_columns!(), " FROM parsley.tasks WHERE model = $1 ORDER BY task"))
        .bind(model)
        .fetch_all(&mut *conn)
        .await
        .with_context(|| format!("reading the tasks of model {model:?}"))?
        .iter()
        .map(task_row)
        .collect()
}

/// Why a task's state could not be loaded.
#[derive(Debug)]
pub enum LoadError {
    /// The stored state cannot be trusted by this build.
    Refused(Refusal),
    /// The database failed.
    Database(StoreError),
}

/// Loads everything a task persisted, for [`parsley::Engine::restore`].
pub async fn load_state(
    conn: &mut PgConnection,
    model: &str,
    task: u32,
    format_version: i32,
) -> Result<PersistedState<RecordData>, LoadError> {
    let db = |what: &'static str| move |e: sqlx::Error| LoadError::Database(StoreError::sqlx(what, e));
    let fed_up_to =
        sqlx::query("SELECT topic_id, partition, fed_up_to FROM parsley.channels WHERE model = $1 AND task = $2")
            .bind(model)
            .bind(task as i32)
            .fetch_all(&mut *conn)
            .await
            .map_err(db("reading fed_up_to"))?
            .into_iter()
            .map(|r| Ok((channel_of(r.get(0), r.get(1)).map_err(LoadError::Database)?, r.get::<i64, _>(2))))
            .collect::<Result<BTreeMap<ChannelId, Position>, LoadError>>()?;
    let rows = sqlx::query(
        "SELECT topic_id, partition, position, record_key, record_value, headers, timestamp_ms, causes
         FROM parsley.held WHERE model = $1 AND task = $2 ORDER BY topic_id, partition, position",
    )
    .bind(model)
    .bind(task as i32)
    .fetch_all(&mut *conn)
    .await
    .map_err(db("reading held records"))?;
    let mut held = Vec::with_capacity(rows.len());
    for r in rows {
        let channel = channel_of(r.get(0), r.get(1)).map_err(LoadError::Database)?;
        let position: i64 = r.get(2);
        let unreadable = |what: String| {
            LoadError::Refused(Refusal::at(
                RefusalReason::UnknownOrderingStateFormat,
                channel,
                Some(position),
                format!("stored held record {channel}@{position}: {what}"),
            ))
        };
        let causes_bytes: Vec<u8> = r.get(7);
        let causes = CausalPast::decode(&causes_bytes, usize::MAX)
            .map_err(|e| unreadable(format!("its causes do not decode: {e}")))?;
        let headers_bytes: Vec<u8> = r.get(5);
        let headers = decode_headers(&headers_bytes).map_err(|e| unreadable(format!("{e}")))?;
        held.push(HeldRecord {
            channel,
            position,
            causes,
            payload: RecordData { key: r.get(3), value: r.get(4), headers, timestamp_ms: r.get(6), skipped: false },
        });
    }
    let frontier = load_past(conn, Past::Frontier, model, task).await.map_err(LoadError::Database)?;
    let delivered = load_past(conn, Past::Clock, model, task).await.map_err(LoadError::Database)?;
    Ok(PersistedState { format_version: format_version as u32, fed_up_to, held, frontier, delivered })
}

/// The two pasts a task persists, each in its own table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Past {
    /// `parsley.frontier`: what the task received (for stamping sends).
    Frontier,
    /// `parsley.clock`: what the task delivered (the delivered past; reads are gated on it).
    Clock,
}

impl Past {
    /// The table's name, for messages.
    pub fn table(self) -> &'static str {
        match self {
            Past::Frontier => "parsley.frontier",
            Past::Clock => "parsley.clock",
        }
    }

    fn select(self) -> &'static str {
        match self {
            Past::Frontier => {
                "SELECT topic_id, partition, position FROM parsley.frontier WHERE model = $1 AND task = $2"
            }
            Past::Clock => "SELECT topic_id, partition, position FROM parsley.clock WHERE model = $1 AND task = $2",
        }
    }

    fn delete(self) -> &'static str {
        match self {
            Past::Frontier => {
                "DELETE FROM parsley.frontier t USING UNNEST($3::uuid[], $4::int4[]) AS d(topic_id, partition)
                 WHERE t.model = $1 AND t.task = $2 AND t.topic_id = d.topic_id AND t.partition = d.partition"
            }
            Past::Clock => {
                "DELETE FROM parsley.clock t USING UNNEST($3::uuid[], $4::int4[]) AS d(topic_id, partition)
                 WHERE t.model = $1 AND t.task = $2 AND t.topic_id = d.topic_id AND t.partition = d.partition"
            }
        }
    }
}

async fn load_past(conn: &mut PgConnection, past: Past, model: &str, task: u32) -> Result<CausalPast, StoreError> {
    let rows = sqlx::query(past.select())
        .bind(model)
        .bind(task as i32)
        .fetch_all(&mut *conn)
        .await
        .with_context(|| format!("reading {} of task {model}/{task}", past.table()))?;
    let mut pairs = Vec::with_capacity(rows.len());
    for r in rows {
        pairs.push((channel_of(r.get(0), r.get(1))?, r.get::<i64, _>(2)));
    }
    Ok(CausalPast::from_pairs(pairs))
}

fn split_channels(channels: impl IntoIterator<Item = ChannelId>) -> (Vec<Uuid>, Vec<i32>) {
    channels.into_iter().map(|c| (uuid_of(&c.topic), c.partition as i32)).unzip()
}

fn split_pairs(pairs: &[(ChannelId, Position)]) -> (Vec<Uuid>, Vec<i32>, Vec<i64>) {
    let mut topics = Vec::with_capacity(pairs.len());
    let mut partitions = Vec::with_capacity(pairs.len());
    let mut positions = Vec::with_capacity(pairs.len());
    for (c, p) in pairs {
        topics.push(uuid_of(&c.topic));
        partitions.push(c.partition as i32);
        positions.push(*p);
    }
    (topics, partitions, positions)
}

/// Writes one step's ordering-state changes. Runs inside the step's transaction, after
/// [`crate::leases::lock_and_renew`]. Returns whether the clock (delivered past) changed.
pub async fn apply_changes(
    conn: &mut PgConnection,
    model: &str,
    task: u32,
    changes: &StepChanges<RecordData>,
) -> Result<bool, StoreError> {
    let task_i = task as i32;
    if !changes.held_removed.is_empty() {
        let (topics, partitions, positions) = split_pairs(&changes.held_removed);
        // Planned at each call, not kept prepared: a generic plan cached while the task held
        // nothing scanned the removed pairs once per held row — 17 s for 500 pairs among
        // 100 000 held rows in a scratch reproduction (DECISIONS, "The documents' reads and
        // deletes by key list").
        sqlx::query(
            "DELETE FROM parsley.held h
             USING UNNEST($3::uuid[], $4::int4[], $5::int8[]) AS d(topic_id, partition, position)
             WHERE h.model = $1 AND h.task = $2
               AND h.topic_id = d.topic_id AND h.partition = d.partition AND h.position = d.position",
        )
        .bind(model)
        .bind(task_i)
        .bind(&topics)
        .bind(&partitions)
        .bind(&positions)
        .persistent(false)
        .execute(&mut *conn)
        .await
        .context("deleting delivered held records")?;
    }
    if !changes.held_inserted.is_empty() {
        let n = changes.held_inserted.len();
        let mut topics = Vec::with_capacity(n);
        let mut partitions = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        let mut keys: Vec<Option<Vec<u8>>> = Vec::with_capacity(n);
        let mut values: Vec<Option<Vec<u8>>> = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        let mut timestamps: Vec<Option<i64>> = Vec::with_capacity(n);
        let mut causes = Vec::with_capacity(n);
        for r in &changes.held_inserted {
            topics.push(uuid_of(&r.channel.topic));
            partitions.push(r.channel.partition as i32);
            positions.push(r.position);
            keys.push(r.payload.key.clone());
            values.push(r.payload.value.clone());
            headers.push(encode_headers(&r.payload.headers));
            timestamps.push(r.payload.timestamp_ms);
            causes.push(r.causes.encode());
        }
        sqlx::query(
            "INSERT INTO parsley.held
               (model, task, topic_id, partition, position, record_key, record_value, headers, timestamp_ms, causes)
             SELECT $1, $2, * FROM UNNEST($3::uuid[], $4::int4[], $5::int8[], $6::bytea[], $7::bytea[],
                                          $8::bytea[], $9::int8[], $10::bytea[])",
        )
        .bind(model)
        .bind(task_i)
        .bind(&topics)
        .bind(&partitions)
        .bind(&positions)
        .bind(&keys)
        .bind(&values)
        .bind(&headers)
        .bind(&timestamps)
        .bind(&causes)
        .execute(&mut *conn)
        .await
        .context("inserting held records")?;
    }
    // How far each channel was fed and the pasts' raised pairs — a step's usual writes — in
    // one statement (three round trips were a third of a one-record step's transaction).
    if !changes.fed_up_to.is_empty() || !changes.frontier_upserts.is_empty() || !changes.clock_upserts.is_empty() {
        let fed = split_pairs(&changes.fed_up_to);
        let frontier = split_pairs(&changes.frontier_upserts);
        let clock = split_pairs(&changes.clock_upserts);
        sqlx::query(
            "WITH fed AS (
               INSERT INTO parsley.channels (model, task, topic_id, partition, fed_up_to)
               SELECT $1, $2, * FROM UNNEST($3::uuid[], $4::int4[], $5::int8[])
               ON CONFLICT (model, task, topic_id, partition) DO UPDATE SET fed_up_to = EXCLUDED.fed_up_to
             ), frontier AS (
               INSERT INTO parsley.frontier (model, task, topic_id, partition, position)
               SELECT $1, $2, * FROM UNNEST($6::uuid[], $7::int4[], $8::int8[])
               ON CONFLICT (model, task, topic_id, partition) DO UPDATE SET position = EXCLUDED.position
             )
             INSERT INTO parsley.clock (model, task, topic_id, partition, position)
             SELECT $1, $2, * FROM UNNEST($9::uuid[], $10::int4[], $11::int8[])
             ON CONFLICT (model, task, topic_id, partition) DO UPDATE SET position = EXCLUDED.position",
        )
        .bind(model)
        .bind(task_i)
        .bind(&fed.0)
        .bind(&fed.1)
        .bind(&fed.2)
        .bind(&frontier.0)
        .bind(&frontier.1)
        .bind(&frontier.2)
        .bind(&clock.0)
        .bind(&clock.1)
        .bind(&clock.2)
        .execute(&mut *conn)
        .await
        .context("writing fed_up_to, the frontier and the clock")?;
    }
    if !changes.channels_removed.is_empty() {
        let (topics, partitions) = split_channels(changes.channels_removed.iter().copied());
        sqlx::query(
            "DELETE FROM parsley.channels c USING UNNEST($3::uuid[], $4::int4[]) AS d(topic_id, partition)
             WHERE c.model = $1 AND c.task = $2 AND c.topic_id = d.topic_id AND c.partition = d.partition",
        )
        .bind(model)
        .bind(task_i)
        .bind(&topics)
        .bind(&partitions)
        .execute(&mut *conn)
        .await
        .context("deleting channels that left the received set")?;
    }
    remove_past(conn, Past::Frontier, model, task_i, &changes.frontier_removed).await?;
    remove_past(conn, Past::Clock, model, task_i, &changes.clock_removed).await?;
    if let Some(refusal) = &changes.refusal {
        record_refusal(conn, model, task, refusal).await?;
    }
    Ok(!changes.clock_upserts.is_empty() || !changes.clock_removed.is_empty())
}

async fn remove_past(
    conn: &mut PgConnection,
    past: Past,
    model: &str,
    task: i32,
    channels: &[ChannelId],
) -> Result<(), StoreError> {
    if channels.is_empty() {
        return Ok(());
    }
    let (topics, partitions) = split_channels(channels.iter().copied());
    sqlx::query(past.delete())
        .bind(model)
        .bind(task)
        .bind(&topics)
        .bind(&partitions)
        .execute(&mut *conn)
        .await
        .with_context(|| format!("pruning {}", past.table()))?;
    Ok(())
}

/// Marks a task refused, with the reason, diagnosis and where it happened.
pub async fn record_refusal(
    conn: &mut PgConnection,
    model: &str,
    task: u32,
    refusal: &Refusal,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE parsley.tasks SET status = 'refused', refusal_reason = $3, refusal_diagnosis = $4,
           refusal_topic_id = $5, refusal_partition = $6, refusal_position = $7, updated_at = now()
         WHERE model = $1 AND task = $2",
    )
    .bind(model)
    .bind(task as i32)
    .bind(refusal.reason.as_str())
    .bind(&refusal.diagnosis)
    .bind(refusal.channel.map(|c| uuid_of(&c.topic)))
    .bind(refusal.channel.map(|c| c.partition as i32))
    .bind(refusal.position)
    .execute(&mut *conn)
    .await
    .with_context(|| format!("recording the refusal of task {model}/{task}"))?;
    Ok(())
}

/// Refuses every task of a model (a model-wide refusal: identity, width, format), creating
/// rows for tasks that never ran so the refusal is visible for each.
pub async fn refuse_model(pool: &PgPool, model: &str, task_count: u32, refusal: &Refusal) -> Result<(), StoreError> {
    let mut tx = pool.begin().await.context("beginning a model refusal")?;
    sqlx::query(
        "INSERT INTO parsley.tasks (model, task, epoch, owner)
         SELECT $1, t, 0, '' FROM generate_series(0, $2 - 1) AS t
         ON CONFLICT (model, task) DO NOTHING",
    )
    .bind(model)
    .bind(task_count as i32)
    .execute(&mut *tx)
    .await
    .with_context(|| format!("creating the task rows of model {model:?}"))?;
    sqlx::query(
        "UPDATE parsley.tasks SET status = 'refused', refusal_reason = $2, refusal_diagnosis = $3,
           refusal_topic_id = $4, refusal_partition = $5, refusal_position = $6, updated_at = now()
         WHERE model = $1 AND status <> 'refused'",
    )
    .bind(model)
    .bind(refusal.reason.as_str())
    .bind(&refusal.diagnosis)
    .bind(refusal.channel.map(|c| uuid_of(&c.topic)))
    .bind(refusal.channel.map(|c| c.partition as i32))
    .bind(refusal.position)
    .execute(&mut *tx)
    .await
    .with_context(|| format!("refusing model {model:?}"))?;
    notify(&mut tx, model, None).await?;
    tx.commit().await.context("committing a model refusal")?;
    Ok(())
}

/// Marks a task running again after failures, or after a refusal an earlier execution
/// recorded and this one did not derive again (inside a step or start transaction).
pub async fn record_running(conn: &mut PgConnection, model: &str, task: u32) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE parsley.tasks SET status = 'running', last_error = NULL, failures = 0, failing_since = NULL,
           refusal_reason = NULL, refusal_diagnosis = NULL, refusal_topic_id = NULL, refusal_partition = NULL,
           refusal_position = NULL, updated_at = now()
         WHERE model = $1 AND task = $2 AND status <> 'running'",
    )
    .bind(model)
    .bind(task as i32)
    .execute(&mut *conn)
    .await
    .with_context(|| format!("marking task {model}/{task} running"))?;
    Ok(())
}

/// Records a failed step in its own small transaction, only while `epoch` still owns the
/// task. Returns `false` when the task was taken by another owner.
pub async fn record_failure(
    pool: &PgPool,
    model: &str,
    task: u32,
    epoch: i64,
    error: &str,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "UPDATE parsley.tasks SET status = 'failing', last_error = $4, failures = failures + 1,
           failing_since = coalesce(failing_since, now()), updated_at = now()
         WHERE model = $1 AND task = $2 AND epoch = $3 AND status <> 'refused'",
    )
    .bind(model)
    .bind(task as i32)
    .bind(epoch)
    .bind(error)
    .execute(pool)
    .await
    .with_context(|| format!("recording the failure of task {model}/{task}"))?;
    if done.rows_affected() == 1 {
        return Ok(true);
    }
    let current: Option<i64> = sqlx::query_scalar("SELECT epoch FROM parsley.tasks WHERE model = $1 AND task = $2")
        .bind(model)
        .bind(task as i32)
        .fetch_optional(pool)
        .await
        .with_context(|| format!("reading the epoch of task {model}/{task}"))?;
    Ok(current == Some(epoch))
}

/// `NOTIFY parsley_clock, '<model>:<task>'` (or `'<model>'` for a model-wide change),
/// delivered to listeners exactly when the surrounding transaction commits.
pub async fn notify(conn: &mut PgConnection, model: &str, task: Option<u32>) -> Result<(), StoreError> {
    let payload = notify_payload(model, task);
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(CLOCK_NOTIFY_CHANNEL)
        .bind(payload)
        .execute(&mut *conn)
        .await
        .context("notifying the clock change")?;
    Ok(())
}

/// The clock notification's payload: `<model>:<task>`, or `<model>` for a model-wide change.
pub(crate) fn notify_payload(model: &str, task: Option<u32>) -> String {
    match task {
        Some(t) => format!("{model}:{t}"),
        None => model.to_string(),
    }
}

/// Every clock row of a model (what the gateway's gate reads).
pub async fn clock_rows(conn: &mut PgConnection, model: &str) -> Result<Vec<ClockRow>, StoreError> {
    let rows = sqlx::query(
        "SELECT task, topic_id, partition, position FROM parsley.clock WHERE model = $1
         ORDER BY task, topic_id, partition",
    )
    .bind(model)
    .fetch_all(&mut *conn)
    .await
    .with_context(|| format!("reading the clock of model {model:?}"))?;
    rows.into_iter()
        .map(|r| {
            Ok(ClockRow {
                task: r.get::<i32, _>(0) as u32,
                channel: channel_of(r.get(1), r.get(2))?,
                position: r.get(3),
            })
        })
        .collect()
}

/// Per channel of a model: the meet (lowest position over the tasks that record it) and
/// how many tasks record it — the collection gate's one query.
pub async fn clock_meet(conn: &mut PgConnection, model: &str) -> Result<Vec<(ChannelId, Position, u32)>, StoreError> {
    let rows = sqlx::query(
        "SELECT topic_id, partition, MIN(position), COUNT(*) FROM parsley.clock WHERE model = $1
         GROUP BY topic_id, partition ORDER BY topic_id, partition",
    )
    .bind(model)
    .fetch_all(&mut *conn)
    .await
    .with_context(|| format!("reading the clock meet of model {model:?}"))?;
    rows.into_iter().map(|r| Ok((channel_of(r.get(0), r.get(1))?, r.get(2), r.get::<i64, _>(3) as u32))).collect()
}

/// A task's row, locked until the surrounding transaction ends (as a step locks it): the
/// `skip` command's first statement, so that it and the task's steps never interleave.
pub async fn lock_task(conn: &mut PgConnection, model: &str, task: u32) -> Result<Option<TaskRow>, StoreError> {
    sqlx::query(concat!("SELECT ", task_columns!(), " FROM parsley.tasks WHERE model = $1 AND task = $2 FOR UPDATE"))
        .bind(model)
        .bind(task as i32)
        .fetch_optional(&mut *conn)
        .await
        .with_context(|| format!("locking task {model}/{task}"))?
        .as_ref()
        .map(task_row)
        .transpose()
}

/// Whether a committed step accounted for `channel@position` and no longer holds it: the
/// task delivered it (or, for a position without a record, passed it).
pub async fn is_delivered(
    conn: &mut PgConnection,
    model: &str,
    task: u32,
    channel: &ChannelId,
    position: Position,
) -> Result<bool, StoreError> {
    let row: Option<(i64, bool)> = sqlx::query_as(
        "SELECT c.fed_up_to, EXISTS (SELECT 1 FROM parsley.held h WHERE h.model = c.model AND h.task = c.task
                                       AND h.topic_id = c.topic_id AND h.partition = c.partition AND h.position = $5)
         FROM parsley.channels c WHERE c.model = $1 AND c.task = $2 AND c.topic_id = $3 AND c.partition = $4",
    )
    .bind(model)
    .bind(task as i32)
    .bind(uuid_of(&channel.topic))
    .bind(channel.partition as i32)
    .bind(position)
    .fetch_optional(&mut *conn)
    .await
    .with_context(|| format!("reading the position of task {model}/{task} on {channel}"))?;
    Ok(row.is_some_and(|(fed_up_to, held)| position <= fed_up_to && !held))
}

/// What `parsley.skips` records of one skipped record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skip {
    pub channel: ChannelId,
    pub position: Position,
    pub skipped_by: String,
    /// `skipped_at` as the database prints it (filled in when read back).
    pub skipped_at: String,
    pub reason: String,
    /// The refusal the skip cleared: its reason's name and its diagnosis.
    pub refusal_reason: Option<String>,
    pub refusal_diagnosis: Option<String>,
    pub found: RecordFound,
}

/// What the `skip` command found in Kafka at the skipped position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordFound {
    /// The record: its key and every `parsley.causes` header value as read.
    Read { key: Option<Vec<u8>>, causes_headers: Vec<Option<Vec<u8>>> },
    /// Below the log start: retention removed it.
    Gone,
    /// No data record at the position (a transaction marker, an aborted or compacted record).
    Absent,
}

impl RecordFound {
    pub fn as_str(&self) -> &'static str {
        match self {
            RecordFound::Read { .. } => "read",
            RecordFound::Gone => "gone",
            RecordFound::Absent => "absent",
        }
    }
}

/// Records a skip (inside the `skip` command's transaction, after [`lock_task`]). Returns
/// `false` when the record was skipped before (nothing written).
pub async fn insert_skip(conn: &mut PgConnection, model: &str, task: u32, skip: &Skip) -> Result<bool, StoreError> {
    let (key, causes_headers) = match &skip.found {
        RecordFound::Read { key, causes_headers } => {
            let framed: Vec<Header> =
                causes_headers.iter().map(|v| (parsley::codec::CAUSES_HEADER.as_bytes().to_vec(), v.clone())).collect();
            (key.clone(), Some(encode_headers(&framed)))
        }
        RecordFound::Gone | RecordFound::Absent => (None, None),
    };
    let done = sqlx::query(
        "INSERT INTO parsley.skips (model, task, topic_id, partition, position, skipped_by, reason, refusal_reason,
           refusal_diagnosis, record_found, record_key, causes_headers)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
         ON CONFLICT (model, task, topic_id, partition, position) DO NOTHING",
    )
    .bind(model)
    .bind(task as i32)
    .bind(uuid_of(&skip.channel.topic))
    .bind(skip.channel.partition as i32)
    .bind(skip.position)
    .bind(&skip.skipped_by)
    .bind(&skip.reason)
    .bind(&skip.refusal_reason)
    .bind(&skip.refusal_diagnosis)
    .bind(skip.found.as_str())
    .bind(key)
    .bind(causes_headers)
    .execute(&mut *conn)
    .await
    .with_context(|| format!("recording the skip of {}@{} in task {model}/{task}", skip.channel, skip.position))?;
    Ok(done.rows_affected() == 1)
}

/// The skipped positions of a task, for a restore: every skipped record is fed without
/// causes and delivered without effect.
pub async fn skipped_positions(
    conn: &mut PgConnection,
    model: &str,
    task: u32,
) -> Result<BTreeSet<(ChannelId, Position)>, StoreError> {
    sqlx::query("SELECT topic_id, partition, position FROM parsley.skips WHERE model = $1 AND task = $2")
        .bind(model)
        .bind(task as i32)
        .fetch_all(&mut *conn)
        .await
        .with_context(|| format!("reading the skips of task {model}/{task}"))?
        .into_iter()
        .map(|r| Ok((channel_of(r.get(0), r.get(1))?, r.get::<i64, _>(2))))
        .collect()
}

/// How many skips a task has; a restore compares it, under the row lock, with what it read.
pub async fn count_skips(conn: &mut PgConnection, model: &str, task: u32) -> Result<usize, StoreError> {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM parsley.skips WHERE model = $1 AND task = $2")
        .bind(model)
        .bind(task as i32)
        .fetch_one(&mut *conn)
        .await
        .with_context(|| format!("counting the skips of task {model}/{task}"))?;
    Ok(n as usize)
}

/// Every skip of a model, oldest first, by task.
pub async fn skips(conn: &mut PgConnection, model: &str) -> Result<Vec<(u32, Skip)>, StoreError> {
    let rows = sqlx::query(
        "SELECT task, topic_id, partition, position, skipped_by, skipped_at::text, reason, refusal_reason,
                refusal_diagnosis, record_found, record_key, causes_headers
         FROM parsley.skips WHERE model = $1 ORDER BY task, skipped_at, topic_id, partition, position",
    )
    .bind(model)
    .fetch_all(&mut *conn)
    .await
    .with_context(|| format!("reading the skips of model {model:?}"))?;
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let channel = channel_of(r.get(1), r.get(2))?;
        let position: i64 = r.get(3);
        let found = match r.get::<&str, _>(9) {
            "read" => {
                let framed: Option<Vec<u8>> = r.get(11);
                let causes_headers = decode_headers(framed.as_deref().unwrap_or_default())
                    .with_context(|| format!("the causes headers of the skip of {channel}@{position}"))?
                    .into_iter()
                    .map(|(_, v)| v)
                    .collect();
                RecordFound::Read { key: r.get(10), causes_headers }
            }
            "gone" => RecordFound::Gone,
            _ => RecordFound::Absent,
        };
        out.push((
            r.get::<i32, _>(0) as u32,
            Skip {
                channel,
                position,
                skipped_by: r.get(4),
                skipped_at: r.get(5),
                reason: r.get(6),
                refusal_reason: r.get(7),
                refusal_diagnosis: r.get(8),
                found,
            },
        ));
    }
    Ok(out)
}

/// Stores a record the projection rejected under the dead-letter policy, inside the step
/// that delivers it without effect.
pub async fn insert_dead_letter(
    conn: &mut PgConnection,
    model: &str,
    task: u32,
    record: &HeldRecord<RecordData>,
    reason: &str,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO parsley.dead_letters (model, task, topic_id, partition, position, record_key, record_value,
           headers, timestamp_ms, causes, reason)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    )
    .bind(model)
    .bind(task as i32)
    .bind(uuid_of(&record.channel.topic))
    .bind(record.channel.partition as i32)
    .bind(record.position)
    .bind(&record.payload.key)
    .bind(&record.payload.value)
    .bind(encode_headers(&record.payload.headers))
    .bind(record.payload.timestamp_ms)
    .bind(record.causes.encode())
    .bind(reason)
    .execute(&mut *conn)
    .await
    .with_context(|| format!("storing the dead letter {}@{}", record.channel, record.position))?;
    Ok(())
}

/// One dead letter, as read back (without its bytes, for status).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    pub channel: ChannelId,
    pub position: Position,
    pub reason: String,
    pub dead_lettered_at: String,
}

/// Per task of a model: how many dead letters it has, and the latest `latest` of them,
/// newest first.
pub async fn dead_letters(
    conn: &mut PgConnection,
    model: &str,
    latest: usize,
) -> Result<BTreeMap<u32, (usize, Vec<DeadLetter>)>, StoreError> {
    let rows = sqlx::query(
        "SELECT task, topic_id, partition, position, reason, dead_lettered_at::text, total FROM (
           SELECT d.*, row_number() OVER w AS n, count(*) OVER (PARTITION BY task) AS total
           FROM parsley.dead_letters d WHERE model = $1
           WINDOW w AS (PARTITION BY task ORDER BY dead_lettered_at DESC, topic_id, partition, position DESC)
         ) d WHERE n <= $2 ORDER BY task, n",
    )
    .bind(model)
    .bind(latest as i64)
    .fetch_all(&mut *conn)
    .await
    .with_context(|| format!("reading the dead letters of model {model:?}"))?;
    let mut out: BTreeMap<u32, (usize, Vec<DeadLetter>)> = BTreeMap::new();
    for r in rows {
        let entry = out.entry(r.get::<i32, _>(0) as u32).or_insert((r.get::<i64, _>(6) as usize, Vec::new()));
        entry.1.push(DeadLetter {
            channel: channel_of(r.get(1), r.get(2))?,
            position: r.get(3),
            reason: r.get(4),
            dead_lettered_at: r.get(5),
        });
    }
    Ok(out)
}

/// Applies the skips to a task's stored state before the engine is restored from it: a
/// skipped record that is held loses its causes (it waits for nothing) and is marked, so
/// that its delivery is not handed to the projection. A skipped record not yet fed is
/// marked when it is fed (the projector's task runner).
pub fn mark_skipped_held(state: &mut PersistedState<RecordData>, skipped: &BTreeSet<(ChannelId, Position)>) {
    for held in &mut state.held {
        if skipped.contains(&(held.channel, held.position)) {
            held.causes = CausalPast::new();
            held.payload = RecordData::skipped(held.payload.timestamp_ms);
        }
    }
}

/// The recorded width (`task_count`) of each of `models` that has state; before the
/// migrations ran no model has any.
pub async fn recorded_widths(pool: &PgPool, models: &[String]) -> Result<BTreeMap<String, u32>, StoreError> {
    let rows: Vec<(String, i32)> =
        match sqlx::query_as("SELECT model, task_count FROM parsley.models WHERE model = ANY($1)")
            .bind(models)
            .fetch_all(pool)
            .await
        {
            Ok(rows) => rows,
            Err(e) if crate::error::is_undefined_table(&e) => Vec::new(),
            Err(e) => return Err(e).context("reading the models' recorded widths"),
        };
    rows.into_iter()
        .map(|(model, task_count)| {
            let n = u32::try_from(task_count).with_context(|| format!("model {model:?} records {task_count} tasks"))?;
            Ok((model, n))
        })
        .collect()
}

/// Whether the ordering state's tables exist (the migrations ran) in the database `conn` is on.
pub async fn schema_exists(conn: &mut PgConnection) -> Result<bool, StoreError> {
    sqlx::query_scalar("SELECT to_regclass('parsley.topics') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await
        .context("looking for the projector's schema")
}

/// Opens the transaction of the gateway's status read: one snapshot for its several
/// aggregates (`REPEATABLE READ`), in which nothing writes (`READ ONLY`), in one round trip.
/// (A gated read needs none: its check and data are one statement, [`crate::documents`].)
pub async fn begin_snapshot(pool: &PgPool) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    pool.begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY").await
}

/// The savepoint a step sets before each record it applies alone under the dead-letter
/// policy: a rejected record is rolled back to it, the rest of the step stays.
pub async fn set_record_savepoint(conn: &mut PgConnection) -> Result<(), StoreError> {
    sqlx::query("SAVEPOINT parsley_record").execute(&mut *conn).await.context("setting a savepoint")?;
    Ok(())
}

/// The record was applied: its savepoint is released.
pub async fn release_record_savepoint(conn: &mut PgConnection) -> Result<(), StoreError> {
    sqlx::query("RELEASE SAVEPOINT parsley_record").execute(&mut *conn).await.context("releasing a savepoint")?;
    Ok(())
}

/// The record was rejected: what it wrote is undone.
pub async fn rollback_to_record_savepoint(conn: &mut PgConnection) -> Result<(), StoreError> {
    sqlx::query("ROLLBACK TO SAVEPOINT parsley_record")
        .execute(&mut *conn)
        .await
        .context("rolling back to a savepoint")?;
    Ok(())
}
