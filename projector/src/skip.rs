//! `parsley-projector skip`: the explicit, audited way past the one record a task is
//! refused at.
//!
//! A skip applies only to a task that is refused at that very record, for a reason that
//! belongs to the record itself ([`SKIPPABLE`]). The command locks the task's row (as a
//! step does: the two never interleave), checks the refusal again under the lock, records
//! the skip in `parsley.skips` (who, when, why, the refusal it clears, and the record's key
//! and `parsley.causes` headers as read from Kafka — or that the record is gone), sets the
//! task back to `running` and `NOTIFY`s, all in one transaction. It does not take the task:
//! the epoch stays, so the instance that owns the task (a refused runner re-reads its row
//! periodically) restores and goes on without a restart. A refused task is not stepping,
//! so no step can race the skip; a restore that was already under way notices the new skip
//! under its own row lock and restores again.
//!
//! What a skip means causally (the host side is in `task.rs`): the record is fed to the
//! engine with no causes and delivered without effect when its turn on its channel comes
//! (FIFO). Its position joins the delivered past, so records naming it as a cause proceed
//! and a read whose token names it is covered; its own causes are not waited for (it has no
//! effect, so nothing is reordered); the projection never sees it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use parsley::channel::{ChannelId, Position, TopicId};
use parsley::refusal::RefusalReason;
use rdkafka::consumer::Consumer as _;
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Message as _, Offset, TopicPartitionList};
use sqlx::PgPool;

use crate::kafka;
use crate::record::Consumed;
use parsley_settings::config::KafkaConfig;
use parsley_store::ordering::{self, ModelRow, RecordFound, Skip, TaskRow, TaskStatus};
use parsley_store::StoreError;

/// How a restore applies the skips to a task's stored state (owned by `parsley-store`).
pub use parsley_store::ordering::mark_skipped_held;

/// The refusals a skip can clear: those about one record's own content. Every other reason
/// concerns the model's state or its topics, which skipping one record cannot repair.
pub const SKIPPABLE: [RefusalReason; 5] = [
    RefusalReason::ProjectionRejected,
    RefusalReason::KeyPartitionMismatch,
    RefusalReason::UndecodableMetadata,
    RefusalReason::ImpossibleSelfCause,
    RefusalReason::MetadataBudgetExceeded,
];

/// One skip, as the operator asks for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkipRequest {
    pub model: String,
    pub topic: String,
    pub partition: u32,
    pub position: Position,
    /// Why (required, recorded).
    pub reason: String,
    /// Who (recorded): `--by`, else the OS user.
    pub by: String,
}

impl SkipRequest {
    /// `topic/partition@position`.
    pub fn coordinate(&self) -> String {
        format!("{}/{}@{}", self.topic, self.partition, self.position)
    }
}

/// Why a skip was not recorded. Nothing is written in any of these cases.
#[derive(Debug)]
pub enum SkipError {
    /// `--reason` is empty: a skip must say why.
    NoReason,
    /// The model has no state in this database.
    UnknownModel { model: String },
    /// The model never recorded the topic.
    UnknownTopic { model: String, topic: String },
    /// The partition is beyond the model's task count.
    NoSuchTask { model: String, partition: u32, task_count: u32 },
    /// The task is not refused at this record (it runs, fails, or is refused elsewhere).
    NotRefusedAtRecord { coordinate: String, task: u32, state: String },
    /// The task is refused at this record for a reason a skip cannot clear.
    NotSkippable { coordinate: String, reason: RefusalReason },
    /// A committed step already delivered the record.
    AlreadyDelivered { coordinate: String },
    /// The record was skipped before.
    AlreadySkipped { coordinate: String },
    /// The topic's name no longer resolves to the recorded topic ID.
    TopicIdentityChanged { topic: String, recorded: TopicId, now: Option<TopicId> },
    /// Kafka or the database failed; nothing was recorded (try again).
    Failed(anyhow::Error),
}

impl fmt::Display for SkipError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SkipError::NoReason => write!(f, "a skip needs a --reason: it is recorded with the skip"),
            SkipError::UnknownModel { model } => write!(f, "model {model:?} has no state in this database"),
            SkipError::UnknownTopic { model, topic } => {
                write!(f, "model {model:?} does not receive topic {topic:?} (no recorded identity)")
            }
            SkipError::NoSuchTask { model, partition, task_count } => {
                write!(f, "model {model:?} has {task_count} tasks: there is no partition {partition}")
            }
            SkipError::NotRefusedAtRecord { coordinate, task, state } => write!(
                f,
                "task {task} is not refused at {coordinate} (it is {state}); skip moves a refused task past the \
                 one record it is refused at"
            ),
            SkipError::NotSkippable { coordinate, reason } => write!(
                f,
                "the task is refused {reason} at {coordinate}, which skipping the record cannot repair; skip \
                 clears only {}",
                SKIPPABLE.map(|r| r.as_str()).join(", ")
            ),
            SkipError::AlreadyDelivered { coordinate } => write!(f, "{coordinate} is already delivered"),
            SkipError::AlreadySkipped { coordinate } => write!(f, "{coordinate} is already skipped"),
            SkipError::TopicIdentityChanged { topic, recorded, now } => match now {
                Some(now) => write!(f, "topic {topic:?} is now {now}, not the recorded {recorded}"),
                None => write!(f, "topic {topic:?} (recorded as {recorded}) no longer exists"),
            },
            SkipError::Failed(e) => write!(f, "{e:#}"),
        }
    }
}

impl std::error::Error for SkipError {}

impl From<anyhow::Error> for SkipError {
    fn from(e: anyhow::Error) -> Self {
        SkipError::Failed(e)
    }
}

impl From<StoreError> for SkipError {
    fn from(e: StoreError) -> Self {
        SkipError::Failed(e.into())
    }
}

/// Records the skip of `request` and sets its task running again (see the module
/// documentation). Returns what was recorded.
pub async fn skip(kafka: &KafkaConfig, pool: &PgPool, request: &SkipRequest) -> Result<Skip, SkipError> {
    let reason = request.reason.trim();
    if reason.is_empty() {
        return Err(SkipError::NoReason);
    }
    let coordinate = request.coordinate();
    let (model, channel) = {
        let mut conn = pool.acquire().await.context("acquiring a connection")?;
        let model = ordering::load_model(&mut conn, &request.model)
            .await?
            .ok_or_else(|| SkipError::UnknownModel { model: request.model.clone() })?;
        let topic = *model
            .topics
            .get(&request.topic)
            .ok_or_else(|| SkipError::UnknownTopic { model: request.model.clone(), topic: request.topic.clone() })?;
        if request.partition >= model.task_count {
            return Err(SkipError::NoSuchTask {
                model: request.model.clone(),
                partition: request.partition,
                task_count: model.task_count,
            });
        }
        let channel = ChannelId::new(topic, request.partition);
        // Checked before reading Kafka, so a mistaken command fails fast; again below,
        // under the lock, where it counts.
        let row =
            ordering::load_tasks(&mut conn, &request.model).await?.into_iter().find(|t| t.task == channel.partition);
        refused_at(&model, row.as_ref(), &channel, request.position, &coordinate)?;
        (model, channel)
    };
    let found = read_record(kafka, request, &channel).await?;

    let task = channel.partition;
    let mut tx = pool.begin().await.context("beginning the skip")?;
    let row = ordering::lock_task(&mut tx, &request.model, task).await?;
    let refusal = refused_at(&model, row.as_ref(), &channel, request.position, &coordinate)?;
    if ordering::is_delivered(&mut tx, &request.model, task, &channel, request.position).await? {
        return Err(SkipError::AlreadyDelivered { coordinate });
    }
    let skip = Skip {
        channel,
        position: request.position,
        skipped_by: request.by.clone(),
        skipped_at: String::new(),
        reason: reason.to_string(),
        refusal_reason: Some(refusal.0.as_str().to_string()),
        refusal_diagnosis: Some(refusal.1),
        found,
    };
    if !ordering::insert_skip(&mut tx, &request.model, task, &skip).await? {
        return Err(SkipError::AlreadySkipped { coordinate });
    }
    ordering::record_running(&mut tx, &request.model, task).await?;
    ordering::notify(&mut tx, &request.model, Some(task)).await?;
    tx.commit().await.context("committing the skip")?;
    tracing::info!(model = %request.model, task, record = %coordinate, by = %request.by, found = skip.found.as_str(),
        "skipped a record");
    Ok(skip)
}

/// The task's refusal (reason, diagnosis) when it is refused at `channel@position` for a
/// skippable reason; the named error otherwise.
fn refused_at(
    model: &ModelRow,
    row: Option<&TaskRow>,
    channel: &ChannelId,
    position: Position,
    coordinate: &str,
) -> Result<(RefusalReason, String), SkipError> {
    let not_refused = |state: String| SkipError::NotRefusedAtRecord {
        coordinate: coordinate.to_string(),
        task: channel.partition,
        state,
    };
    let Some(row) = row else { return Err(not_refused("without a row: it never ran".to_string())) };
    let refusal = match (&row.status, &row.refusal) {
        (TaskStatus::Refused, Some(r)) => r,
        (status, _) => return Err(not_refused(status.as_str().to_string())),
    };
    if refusal.channel != Some(*channel) || refusal.position != Some(position) {
        let at = match (refusal.channel, refusal.position) {
            (Some(c), p) => {
                let name = model.topics.iter().find(|(_, id)| **id == c.topic).map(|(n, _)| n.as_str());
                let channel = name.map_or_else(|| c.to_string(), |n| format!("{n}/{}", c.partition));
                p.map_or_else(|| format!(" on {channel}"), |p| format!(" at {channel}@{p}"))
            }
            (None, _) => String::new(),
        };
        return Err(not_refused(format!("refused {}{at}", refusal.reason)));
    }
    if !SKIPPABLE.contains(&refusal.reason) {
        return Err(SkipError::NotSkippable { coordinate: coordinate.to_string(), reason: refusal.reason });
    }
    Ok((refusal.reason, refusal.diagnosis.clone()))
}

/// Reads the record at the skipped position with the projector's read-committed consumer:
/// below the log start it is gone; a first record past the position means there is no data
/// record at it.
async fn read_record(
    kafka_config: &KafkaConfig,
    request: &SkipRequest,
    channel: &ChannelId,
) -> Result<RecordFound, SkipError> {
    let resolved = kafka::resolve_topics(kafka_config, &request.model, std::slice::from_ref(&request.topic)).await?;
    let now = resolved.first().and_then(|t| t.id);
    if now != Some(channel.topic) {
        return Err(SkipError::TopicIdentityChanged { topic: request.topic.clone(), recorded: channel.topic, now });
    }
    let consumer = Arc::new(kafka::task_consumer(kafka_config, &request.model)?);
    let timeout = Duration::from_millis(kafka_config.request_timeout_ms);
    let (log_start, _) = kafka::watermarks(&consumer, &request.topic, channel.partition, timeout).await?;
    if request.position < log_start {
        return Ok(RecordFound::Gone);
    }
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset(&request.topic, channel.partition as i32, Offset::Offset(request.position))
        .with_context(|| format!("assigning {}", request.coordinate()))?;
    consumer.assign(&assignment).context("assigning the skipped record's partition")?;
    match tokio::time::timeout(timeout, consumer.recv()).await {
        Err(_) => Err(SkipError::Failed(anyhow::anyhow!(
            "no record came from {} within {timeout:?}; nothing was recorded",
            request.coordinate()
        ))),
        Ok(Err(KafkaError::MessageConsumption(
            RDKafkaErrorCode::AutoOffsetReset | RDKafkaErrorCode::OffsetOutOfRange,
        ))) => Ok(RecordFound::Gone),
        Ok(Err(e)) => {
            Err(SkipError::Failed(anyhow::Error::new(e).context(format!("reading {}", request.coordinate()))))
        }
        Ok(Ok(m)) if m.offset() == request.position => {
            let consumed = Consumed::from_message(&m);
            Ok(RecordFound::Read { key: consumed.data.key, causes_headers: consumed.causes_headers })
        }
        Ok(Ok(_)) => Ok(RecordFound::Absent),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::RecordData;
    use parsley::engine::{HeldRecord, PersistedState};
    use parsley::{CausalPast, Engine};

    fn ch(topic: u8) -> ChannelId {
        ChannelId::new(TopicId::from_bytes([topic; 16]), 0)
    }

    fn data(key: &[u8]) -> RecordData {
        RecordData { key: Some(key.to_vec()), value: Some(b"{}".to_vec()), ..RecordData::default() }
    }

    /// A held record waiting for a cause that never comes is delivered, without effect,
    /// once skipped; the record behind it on its channel follows in order.
    #[test]
    fn a_skipped_held_record_waits_for_nothing_and_is_marked() {
        let (orders, payments) = (ch(1), ch(2));
        let waits_for_order = CausalPast::from_pairs([(orders, 9)]);
        let state = PersistedState {
            fed_up_to: [(orders, -1), (payments, 1)].into_iter().collect(),
            held: vec![
                HeldRecord { channel: payments, position: 0, causes: waits_for_order.clone(), payload: data(b"p0") },
                HeldRecord { channel: payments, position: 1, causes: CausalPast::new(), payload: data(b"p1") },
            ],
            ..PersistedState::default()
        };
        let restore = |state| Engine::restore(Default::default(), [orders, payments], state).unwrap();

        let mut untouched = restore(state.clone());
        assert!(untouched.drain().is_empty(), "without the skip, the head waits for orders@9");

        let mut skipped = state;
        mark_skipped_held(&mut skipped, &[(payments, 0)].into_iter().collect());
        let delivered = restore(skipped).drain();
        let summary: Vec<(Position, bool, Option<Vec<u8>>)> =
            delivered.iter().map(|d| (d.position, d.payload.skipped, d.payload.key.clone())).collect();
        assert_eq!(summary, vec![(0, true, None), (1, false, Some(b"p1".to_vec()))]);
        assert!(delivered[0].causes.is_empty());
    }

    #[test]
    fn only_refusals_of_a_record_are_skippable() {
        for reason in RefusalReason::ALL {
            let about_one_record = matches!(
                reason,
                RefusalReason::ProjectionRejected
                    | RefusalReason::KeyPartitionMismatch
                    | RefusalReason::UndecodableMetadata
                    | RefusalReason::ImpossibleSelfCause
                    | RefusalReason::MetadataBudgetExceeded
            );
            assert_eq!(SKIPPABLE.contains(&reason), about_one_record, "{reason}");
        }
    }
}
