//! One task of a model: its consumer, its engine, and its steps. A step feeds a batch of
//! consumed records to the engine, hands the deliveries to the projection and commits the
//! projection's writes, the engine's state changes, the task status and a `NOTIFY` in one
//! SQL transaction whose first statement locks the task's row and checks its epoch.
//!
//! If a step does not commit, the engine is discarded and restored from the database, and
//! the task reads again from `fed_up_to + 1` with a new consumer (no record fetched before
//! the failure can reach the new engine).
//!
//! The sequence itself — what to do next, and every decision about the engine — is the
//! core's host state machine ([`parsley::host::TaskHost`]), which the simulator drives
//! too; this module is its I/O: the consumer, the SQL, the projection, the timers.
//!
//! While a step's transaction runs, the task reads ahead: the records its consumer returns
//! meanwhile are copied out and kept with the consumer, up to one step's bounds, and the
//! next step's poll takes them first. The client's share of a step (reading records out of
//! librdkafka) then overlaps the database's; the engine sees nothing of it. The read-ahead
//! lives and dies with its consumer, and the consumer's position, which counts records read
//! ahead as read, is capped below them.
//!
//! A step's stages are debug events of the target `parsley::stage` (`first-record`,
//! `polled`, `committed`), so a write's way to visibility can be timed (the gateway's
//! latency benchmark records them); nothing is logged unless that target is enabled.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use parsley::channel::{ChannelId, Position};
use parsley::engine::{ChannelFact, Delivery, Fed};
use parsley::host::{ChannelStart, Failure, LogStartCheck, Next, StepCommit, TaskHost, TaskStatus};
use parsley::partitioner::Partitioner;
use parsley::refusal::{Refusal, RefusalReason};
use parsley::Engine;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use sqlx::{PgConnection, PgPool};

use crate::kafka;
use crate::metrics::{Metric, Metrics};
use crate::model::ModelPlan;
use crate::projection::{Delivered, Projection, ProjectionError, StepContext};
use crate::record::{self, Fetched, RecordData};
use parsley_settings::config::{InitialPosition, OnRejected};
use parsley_store::leases;
use parsley_store::ordering::{self, LoadError};

/// A step that held its task's row for more than this fraction of the lease extends the
/// lease before it commits ([`leases::extend`]).
const LONG_STEP_LEASE_FRACTION: u32 = 4;

/// Where a task stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskState {
    Running,
    /// The last step failed; the next is tried at `retry_at`.
    Failing {
        failures: u32,
        retry_at: Instant,
        error: String,
    },
    /// Stopped delivering, with a reason, until an operator clears it.
    Refused(Refusal),
    /// Another owner took the task; this runner no longer touches it.
    Fenced,
}

/// What one call of [`TaskRunner::run_once`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepOutcome {
    /// A step committed.
    Committed { fed: usize, replayed: usize, delivered: usize, held: usize },
    /// Nothing arrived within the step's time bound; no transaction was opened.
    Idle,
    /// The step failed and rolled back; it is retried with backoff.
    Failed { error: String },
    /// The task is refused (now or before).
    Refused(Refusal),
    /// Another owner took the task.
    Fenced,
}

/// The spans of a step's traced records: each delivery that carries a W3C `traceparent`
/// header (a client opted into tracing it, e.g. through the gateway) gets an `apply` span,
/// the child of the span the header names (the writer's), open from before the step's
/// transaction to its commit. With OpenTelemetry export on they are exported; either way
/// the line [`log_traced`] logs in each names the trace. Records without one get none.
fn traced_spans(plan: &ModelPlan, task: u32, deliveries: &[Delivery<RecordData>]) -> Vec<(usize, tracing::Span)> {
    let mut spans = Vec::new();
    for (i, d) in deliveries.iter().enumerate() {
        let Some(traceparent) = traceparent_of(d) else { continue };
        let mut parts = traceparent.split('-');
        let (Some(_), Some(trace), Some(parent), Some(flags)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (Some(trace_id), Some(parent_id), Some([flags])) =
            (hex_array::<16>(trace), hex_array::<8>(parent), hex_array::<1>(flags))
        else {
            continue;
        };
        let span = tracing::info_span!(
            parent: None,
            "apply",
            otel.name = format!("apply {}", plan.topic_name(&d.channel.topic).unwrap_or("?")),
            otel.kind = "consumer",
            otel.status_code = tracing::field::Empty,
            trace_id = trace,
            span_id = tracing::field::Empty,
            parsley.model = %plan.name,
            parsley.task = task,
            messaging.system = "kafka",
            messaging.kafka.destination.partition = d.channel.partition,
            messaging.kafka.message.offset = d.position,
        );
        parsley_infra::telemetry::set_remote_parent(&span, trace_id, parent_id, flags);
        if let Some((_, span_id, _)) = parsley_infra::telemetry::span_ids(&span) {
            span.record("span_id", parsley_infra::telemetry::hex(&span_id));
        }
        spans.push((i, span));
    }
    spans
}

/// A delivery's `traceparent` header, when it has one in UTF-8 naming a 32-digit trace.
fn traceparent_of(d: &Delivery<RecordData>) -> Option<&str> {
    let value =
        d.payload.headers.iter().find_map(|(name, value)| {
            (name.eq_ignore_ascii_case(b"traceparent")).then_some(value.as_deref()).flatten()
        })?;
    let traceparent = std::str::from_utf8(value).ok()?;
    traceparent.split('-').nth(1).filter(|t| t.len() == 32).map(|_| traceparent)
}

/// Logs each applied traced record inside its span (after the step committed), naming its
/// trace, so a write can be followed from the HTTP request to the step that applied it; the
/// spans end here.
fn log_traced(plan: &ModelPlan, task: u32, deliveries: &[Delivery<RecordData>], spans: Vec<(usize, tracing::Span)>) {
    for (i, span) in spans {
        let d = &deliveries[i];
        let Some(traceparent) = traceparent_of(d) else { continue };
        let trace_id = traceparent.split('-').nth(1).unwrap_or_default();
        span.in_scope(|| {
            tracing::info!(model = %plan.name, task, record = %plan.describe(&d.channel), position = d.position,
                trace_id, traceparent, skipped = d.payload.skipped, "applied a traced record");
        });
    }
}

fn hex_array<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// What the projection sees of a delivery.
fn view<'a>(plan: &'a ModelPlan, d: &'a Delivery<RecordData>) -> Delivered<'a> {
    Delivered {
        topic: plan.topic_name(&d.channel.topic).unwrap_or("?"),
        channel: d.channel,
        position: d.position,
        key: d.payload.key.as_deref(),
        value: d.payload.value.as_deref(),
        headers: &d.payload.headers,
        timestamp_ms: d.payload.timestamp_ms,
        causes: &d.causes,
    }
}

/// Why a delivered record breaks its topic's data contract (`schema`), if it does: a
/// rejection like the projection's, naming the record and each failing JSON pointer, never
/// quoting the value. A tombstone keeps every contract.
fn contract_refusal(plan: &ModelPlan, record: &Delivered<'_>) -> Option<String> {
    let value = record.value?;
    let contract = plan.contract(&record.channel.topic)?;
    contract.refusal(&format!("the value of {}", record.coordinate()), value)
}

/// The longest part of a key a `KEY_PARTITION_MISMATCH` quotes, in characters.
const QUOTED_KEY_CHARS: usize = 120;

/// Why a keyed record may not be delivered to this task: its topic's partitioner places
/// its key on another partition (`KEY_PARTITION_MISMATCH`). Its key's data belongs to that
/// partition's task, and the gateway gates reads of the key on that task's clock. Records
/// without a key, and topics with `partitioner = "none"`, are not checked.
fn misplaced(plan: &ModelPlan, d: &Delivery<RecordData>) -> Option<String> {
    let key = d.payload.key.as_deref()?;
    let partitioner = plan.partitioner(&d.channel.topic);
    let expected = partitioner.partition_for_key(key, plan.task_count)?;
    if expected == d.channel.partition {
        return None;
    }
    let text = String::from_utf8_lossy(key);
    let mut quoted: String = text.chars().take(QUOTED_KEY_CHARS).collect();
    if text.chars().count() > QUOTED_KEY_CHARS {
        quoted.push('…');
    }
    Some(format!(
        "key {quoted:?} found on partition {}, but the topic's partitioner ({partitioner}) places it on \
         partition {expected} of {}; its producer must partition keys like {partitioner}: {}",
        d.channel.partition,
        plan.task_count,
        producer_setting(partitioner)
    ))
}

/// What makes a producer place keys as `partitioner` does, for the refusal's diagnosis.
fn producer_setting(partitioner: Partitioner) -> &'static str {
    match partitioner {
        Partitioner::Murmur2 => {
            "the Java client's default partitioner (without partitioner.ignore.keys), franz-go's default, or \
             partitioner=murmur2_random in librdkafka's clients (confluent-kafka for Python and Go, Confluent.Kafka \
             for .NET); a topic whose producers all keep librdkafka's default consistent_random takes \
             partitioner = \"crc32\" instead"
        }
        Partitioner::Crc32 => {
            "librdkafka's default partitioner, consistent_random (or consistent), in every producer of the topic; \
             a topic whose producers partition by murmur2 takes partitioner = \"murmur2\" instead"
        }
        Partitioner::None => "nothing: keys of this topic are not routed",
    }
}

/// A rejection by the projection, carried out of a step's transaction as its error.
/// `record` (channel, position, coordinate) is the record the step applied alone; `None`
/// when a batch was rejected and the record is not known. `refusal` is the reason a task
/// refuses at the record: `PROJECTION_REJECTED`, or `KEY_PARTITION_MISMATCH` for a keyed
/// record on the wrong partition (found before the projection sees it).
#[derive(Debug)]
struct Rejection {
    record: Option<(ChannelId, Position, String)>,
    reason: String,
    refusal: RefusalReason,
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.record {
            Some((_, _, coordinate)) if self.refusal == RefusalReason::KeyPartitionMismatch => {
                write!(f, "{}: {coordinate}: {}", self.refusal, self.reason)
            }
            Some((_, _, coordinate)) => write!(f, "the projection rejected {coordinate}: {}", self.reason),
            None if self.refusal == RefusalReason::KeyPartitionMismatch => write!(
                f,
                "{}: a record of the step is on the wrong partition ({}); retrying carefully (one record per call) \
                 to name it",
                self.refusal, self.reason
            ),
            None => write!(
                f,
                "the projection rejected a record of the step ({}); retrying carefully (one record per call) to name it",
                self.reason
            ),
        }
    }
}

impl std::error::Error for Rejection {}

/// The runner of one task: the I/O of the task's step protocol. What to do next, and every
/// decision about the engine, is the host state machine's ([`parsley::host::TaskHost`], the
/// one the simulator drives too); the runner answers it from Kafka and Postgres and keeps
/// the timers.
pub struct TaskRunner<P: Projection> {
    plan: Arc<ModelPlan>,
    task: u32,
    epoch: i64,
    pool: PgPool,
    projection: Arc<P>,
    metrics: Arc<Metrics>,
    consumer: Option<TaskConsumer>,
    /// The step protocol, and the engine it owns.
    host: TaskHost<RecordData>,
    state: TaskState,
    /// When log starts were last compared (at start, on an out-of-range fetch, or by the
    /// periodic check of a task holding records).
    log_start_checked_at: Instant,
    /// When upstream channels were last pruned (or found absent).
    pruned_at: Instant,
    /// When the received topics' partition counts were last compared with the task count.
    width_checked_at: Instant,
    /// This instance's name in the task's row.
    owner: String,
    /// How many records operators had skipped (`parsley.skips`) when the task last
    /// restored: a skip recorded since makes the start transaction restore again.
    skips_read: usize,
    /// When each channel's current head started being held.
    head_since: BTreeMap<ChannelId, (Position, Instant)>,
    /// A step's lists, kept empty between steps with their room (bounded by the step's
    /// record bound), so a step under a backlog fills memory it already has.
    buffers: StepBuffers,
}

/// The lists a step fills: the records its poll returned, its deliveries, and the views
/// handed to the projection. Kept from step to step, emptied, so a step reuses memory it
/// already touched (why: docs/projector.md, "A start that does not wait for its metadata
/// client, and a step's lists kept").
#[derive(Default)]
struct StepBuffers {
    batch: Vec<Fetched>,
    deliveries: Vec<Delivery<RecordData>>,
    /// The room of the views a batch hands the projection (empty: they borrow the step's
    /// deliveries, so only the allocation outlives it; [`recycled`]).
    views: Vec<Delivered<'static>>,
}

impl StepBuffers {
    /// Empties the lists, each keeping its room unless the step used far less of it
    /// ([`emptied`]).
    fn end_step(&mut self) {
        let used = self.deliveries.len().max(self.batch.len());
        emptied(&mut self.batch, used);
        emptied(&mut self.deliveries, used);
        emptied(&mut self.views, used);
    }
}

/// Empties `list`. A list whose room is over four times what the step `used` gives most of
/// it back: a backlog's steps keep their room from step to step, and once the backlog is
/// worked off the small steps after it do not hold a backlog's worth per task.
fn emptied<T>(list: &mut Vec<T>, used: usize) {
    list.clear();
    if list.capacity() > KEPT_ROOM_MIN && used < list.capacity() / 4 {
        list.shrink_to(used.max(KEPT_ROOM_MIN));
    }
}

/// The room a step's lists keep however small the steps (entries).
const KEPT_ROOM_MIN: usize = 1024;

/// `list`'s allocation for another type of the same size and alignment, emptied: a collect
/// of an empty iterator over it keeps the allocation in place (for a type that differs
/// only in a lifetime, as the views of a step's deliveries do).
fn recycled<T, U>(mut list: Vec<T>) -> Vec<U> {
    list.clear();
    list.into_iter().map(|_| unreachable!("the list is empty")).collect()
}

/// The task's consumer, with what it returned that no step has fed yet (read while the
/// previous step committed). The two go together: a new consumer reads again from the
/// engine's `fed_up_to + 1`, and what the old one read ahead is dropped with it.
struct TaskConsumer {
    kafka: Arc<StreamConsumer>,
    /// How a record is read: the task's channels, the engine's metadata budget.
    reader: Reader,
    /// Records (and errors) in the order the consumer returned them.
    ahead: VecDeque<Read>,
    /// The records' weight in `ahead`.
    ahead_bytes: usize,
}

/// What the consumer returned: a record read out ([`Fetched`]), or an error.
type Read = Result<Fetched, KafkaError>;

/// Reads records out of the consumer for one task.
struct Reader {
    plan: Arc<ModelPlan>,
    task: u32,
    /// The engine's metadata budget: causes are decoded as they are read.
    budget: usize,
}

impl Reader {
    fn read(&self, received: Result<rdkafka::message::BorrowedMessage<'_>, KafkaError>) -> Read {
        received.map(|m| {
            let channel_of =
                |topic: &str, partition| self.plan.channel_of(topic, partition).filter(|c| c.partition == self.task);
            Fetched::from_message(&m, channel_of, self.budget)
        })
    }
}

impl TaskConsumer {
    fn new(kafka: Arc<StreamConsumer>, reader: Reader) -> TaskConsumer {
        TaskConsumer { kafka, reader, ahead: VecDeque::new(), ahead_bytes: 0 }
    }

    /// The next record or error: what was read ahead first, else what the consumer
    /// returns, waiting until `until` (`None`: only what librdkafka already holds).
    async fn next(&mut self, until: Option<tokio::time::Instant>) -> Option<Read> {
        // Taking what is already there never waits, so a poll of a backlog would keep its
        // worker thread for a whole step: other tasks' starts and steps could not run (at
        // launch, half the tasks began fetching a step later). Yield when the budget is
        // spent.
        tokio::task::coop::consume_budget().await;
        if let Some(item) = self.ahead.pop_front() {
            if let Ok(record) = &item {
                self.ahead_bytes -= record.weight;
            }
            return Some(item);
        }
        let received = match until {
            Some(until) => tokio::time::timeout_at(until, self.kafka.recv()).await.ok()?,
            // A zero timeout would still wait for the timer's next tick (tokio rounds
            // deadlines up to the millisecond), which a lone write paid on its way to
            // visibility.
            None => received_now(self.kafka.recv()).await?,
        };
        Some(self.reader.read(received))
    }

    /// Runs `work` (a step's transaction) to its end, meanwhile keeping what the consumer
    /// returns, up to `max_records` and `max_bytes` read ahead in all. Reading ahead stops
    /// at the first error, which is kept for the next poll too.
    async fn read_ahead_during<F: std::future::Future>(
        &mut self,
        max_records: usize,
        max_bytes: usize,
        work: F,
    ) -> F::Output {
        let mut work = std::pin::pin!(work);
        let kafka = Arc::clone(&self.kafka);
        loop {
            let room = self.ahead.len() < max_records
                && self.ahead_bytes < max_bytes
                && self.ahead.back().is_none_or(|last| last.is_ok());
            tokio::select! {
                biased;
                output = &mut work => return output,
                // Cancel-safe: a `recv` dropped before it is ready took nothing.
                received = kafka.recv(), if room => {
                    let item = self.reader.read(received);
                    if let Ok(record) = &item {
                        self.ahead_bytes += record.weight;
                    }
                    self.ahead.push_back(item);
                    tokio::task::coop::consume_budget().await;
                }
            }
        }
    }

    /// For each channel with records read ahead, the position of the first: the
    /// consumer's position there must not pass it (those records are not fed yet). A
    /// full step takes all that was read ahead; a careful step (one record, then growing)
    /// takes less, and without this cap the records it left would be dropped as replays
    /// (three rejection tests fail so).
    fn first_ahead(&self) -> BTreeMap<ChannelId, Position> {
        let mut first = BTreeMap::new();
        for record in self.ahead.iter().flatten() {
            if let Ok(channel) = record.channel {
                first.entry(channel).or_insert(record.offset);
            }
        }
        first
    }
}

/// `future`'s output if it is ready at its first poll, else `None` (the future is dropped).
/// (Public for the throughput benchmark's naive loop, which batches the same way.)
#[doc(hidden)]
pub async fn received_now<F: std::future::Future>(future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| match future.as_mut().poll(cx) {
        std::task::Poll::Ready(output) => std::task::Poll::Ready(Some(output)),
        std::task::Poll::Pending => std::task::Poll::Ready(None),
    })
    .await
}

fn labels(plan: &ModelPlan, task: &str) -> [(&'static str, String); 2] {
    [("model", plan.name.clone()), ("task", task.to_string())]
}

/// What a task's runner is started from: its model, task number, services and owner name.
/// The supervisor keeps it to start the task again.
pub struct RunnerSpec<P: Projection> {
    pub plan: Arc<ModelPlan>,
    pub task: u32,
    pub pool: PgPool,
    pub projection: Arc<P>,
    pub metrics: Arc<Metrics>,
    pub owner: String,
}

impl<P: Projection> Clone for RunnerSpec<P> {
    fn clone(&self) -> Self {
        RunnerSpec {
            plan: Arc::clone(&self.plan),
            task: self.task,
            pool: self.pool.clone(),
            projection: Arc::clone(&self.projection),
            metrics: Arc::clone(&self.metrics),
            owner: self.owner.clone(),
        }
    }
}

impl<P: Projection> RunnerSpec<P> {
    /// [`TaskRunner::start_taken`] with this spec's services, for a task taken at `row`.
    pub async fn start_taken(&self, row: ordering::TaskRow) -> TaskRunner<P> {
        TaskRunner::start_taken(
            Arc::clone(&self.plan),
            row,
            self.pool.clone(),
            Arc::clone(&self.projection),
            Arc::clone(&self.metrics),
            &self.owner,
        )
        .await
    }
}

impl<P: Projection> TaskRunner<P> {
    /// Takes the task (a new epoch fences any previous owner), restores its state, seeds
    /// and checks its positions, and assigns its channels to a new consumer.
    pub async fn start(
        plan: Arc<ModelPlan>,
        task: u32,
        pool: PgPool,
        projection: Arc<P>,
        metrics: Arc<Metrics>,
        owner: &str,
    ) -> anyhow::Result<TaskRunner<P>> {
        let row = ordering::take_task(&pool, &plan.name, task, owner).await?;
        Ok(TaskRunner::start_taken(plan, row, pool, projection, metrics, owner).await)
    }

    /// Starts the runner of a task this instance has just taken (`row`, at its new epoch:
    /// a claim under the balancer, or [`TaskRunner::start`]): restores its state, seeds and
    /// checks its positions, and assigns its channels to a new consumer. A start that fails
    /// leaves the runner failing, retried with backoff.
    pub async fn start_taken(
        plan: Arc<ModelPlan>,
        row: ordering::TaskRow,
        pool: PgPool,
        projection: Arc<P>,
        metrics: Arc<Metrics>,
        owner: &str,
    ) -> TaskRunner<P> {
        let task = row.task;
        let host = TaskHost::new(plan.engine_config(), plan.channels(task), row.status)
            .with_weigher(record::weight)
            .with_skipped(|data: RecordData| RecordData::skipped(data.timestamp_ms));
        let mut runner = TaskRunner {
            host,
            plan,
            task,
            epoch: row.epoch,
            pool,
            projection,
            metrics,
            consumer: None,
            state: TaskState::Running,
            log_start_checked_at: Instant::now(),
            pruned_at: Instant::now(),
            width_checked_at: Instant::now(),
            owner: owner.to_string(),
            skips_read: 0,
            head_since: BTreeMap::new(),
            buffers: StepBuffers::default(),
        };
        tracing::info!(model = %runner.plan.name, task, epoch = row.epoch, owner, "took task");
        // A refusal recorded by an earlier execution is not restored: it is derived again
        // from the same input (the refused record is never marked fed), so a fix the
        // operator made takes effect now, and an unfixed cause refuses identically.
        if let Err(e) = runner.start_sequence().await {
            runner.fail(e, Failure::Error).await;
        }
        runner
    }

    pub fn task(&self) -> u32 {
        self.task
    }

    /// The task's Kafka consumer, if it has one.
    fn kafka(&self) -> Option<Arc<StreamConsumer>> {
        self.consumer.as_ref().map(|c| Arc::clone(&c.kafka))
    }

    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    pub fn state(&self) -> &TaskState {
        &self.state
    }

    /// The engine (for status and tests). Ahead of the database while a step is open.
    pub fn engine(&self) -> &Engine<RecordData> {
        self.host.engine()
    }

    /// What this runner was started from, to start the task again (after a panic, or once
    /// its refusal was lifted).
    pub fn spec(&self) -> RunnerSpec<P> {
        RunnerSpec {
            plan: Arc::clone(&self.plan),
            task: self.task,
            pool: self.pool.clone(),
            projection: Arc::clone(&self.projection),
            metrics: Arc::clone(&self.metrics),
            owner: self.owner.clone(),
        }
    }

    /// For a refused runner: re-reads the task's row and answers whether the refusal was
    /// lifted (the row no longer says `refused` — an operator's `skip` clears it in the
    /// transaction that records the skip), so the task should start again. A row that
    /// another instance took meanwhile (new epoch, other owner) fences this runner.
    pub async fn refusal_lifted(&mut self) -> anyhow::Result<bool> {
        if !matches!(self.state, TaskState::Refused(_)) {
            return Ok(false);
        }
        let mut conn = self.pool.acquire().await.context("acquiring a connection to re-read a refused task")?;
        let rows = ordering::load_tasks(&mut conn, &self.plan.name).await?;
        let Some(row) = rows.into_iter().find(|r| r.task == self.task) else { return Ok(false) };
        if row.status == TaskStatus::Refused {
            return Ok(false);
        }
        if row.epoch != self.epoch && row.owner != self.owner {
            self.become_fenced();
            return Ok(false);
        }
        tracing::info!(model = %self.plan.name, task = self.task, status = row.status.as_str(),
            "the task's refusal was lifted; starting it again");
        Ok(true)
    }

    fn label_values(&self) -> [(&'static str, String); 2] {
        labels(&self.plan, &self.task.to_string())
    }

    fn metric_add(&self, metric: Metric, v: f64) {
        let l = self.label_values();
        self.metrics.add(metric, &[(l[0].0, &l[0].1), (l[1].0, &l[1].1)], v);
    }

    fn metric_set(&self, metric: Metric, v: f64) {
        let l = self.label_values();
        self.metrics.set(metric, &[(l[0].0, &l[0].1), (l[1].0, &l[1].1)], v);
    }

    fn become_refused(&mut self, refusal: Refusal) {
        tracing::error!(
            model = %self.plan.name, task = self.task, reason = %refusal.reason,
            channel = ?refusal.channel.map(|c| self.plan.describe(&c)), position = ?refusal.position,
            diagnosis = %refusal.diagnosis, "task refused"
        );
        self.metric_set(Metric::TaskRefused, 1.0);
        self.metric_set(Metric::TaskFailing, 0.0);
        self.consumer = None;
        self.state = TaskState::Refused(refusal);
    }

    fn become_fenced(&mut self) {
        tracing::warn!(model = %self.plan.name, task = self.task, epoch = self.epoch, "another owner took the task; stopping it here");
        self.metric_add(Metric::FencedTotal, 1.0);
        self.consumer = None;
        self.state = TaskState::Fenced;
    }

    /// Brings the machine's refusal or fence into the runner's state (once).
    fn settle_stop(&mut self) {
        match self.host.next_action() {
            Next::Refused(r) if !matches!(self.state, TaskState::Refused(_)) => {
                self.metric_reason(&r);
                self.become_refused(r);
            }
            Next::Fenced if self.state != TaskState::Fenced => self.become_fenced(),
            _ => {}
        }
    }

    /// Drives the start, as the machine orders it: restore the engine from the database,
    /// seed channels with no state from their initial positions and check every log start,
    /// commit that (the start transaction), and assign the channels to a new consumer at
    /// `fed_up_to + 1`. Returns at the first step, or once refused or fenced; an error is a
    /// failed start, for [`TaskRunner::fail`].
    async fn start_sequence(&mut self) -> anyhow::Result<()> {
        loop {
            match self.host.next_action() {
                Next::Restore => self.restore().await?,
                Next::ReadStarts(channels) => self.read_starts(&channels).await?,
                Next::CommitStart => self.commit_start().await?,
                Next::Assign(positions) => self.assign(&positions)?,
                Next::PersistRefusal(refusal) => self.persist_refusal(refusal).await?,
                Next::Refused(_) | Next::Fenced => {
                    self.settle_stop();
                    return Ok(());
                }
                _ => return Ok(()),
            }
        }
    }

    /// Loads the task's stored state and the records operators skipped (answer to
    /// [`Next::Restore`]).
    async fn restore(&mut self) -> anyhow::Result<()> {
        self.consumer = None;
        let plan = Arc::clone(&self.plan);
        let mut conn = self.pool.acquire().await.context("acquiring a connection to restore the task")?;
        let model_row = ordering::load_model(&mut conn, &plan.name)
            .await?
            .with_context(|| format!("model {:?} has no row in parsley.models", plan.name))?;
        let state = match ordering::load_state(&mut conn, &plan.name, self.task, model_row.format_version).await {
            Ok(s) => s,
            Err(LoadError::Database(e)) => return Err(e.into()),
            Err(LoadError::Refused(r)) => {
                self.host.unrestorable(r);
                return Ok(());
            }
        };
        let skipped = ordering::skipped_positions(&mut conn, &plan.name, self.task).await?;
        drop(conn);
        self.skips_read = skipped.len();
        self.host.restored(state, skipped);
        Ok(())
    }

    /// Each channel's log start and initial position (its watermarks), read with a new
    /// consumer (answer to [`Next::ReadStarts`]).
    async fn read_starts(&mut self, channels: &[ChannelId]) -> anyhow::Result<()> {
        let plan = Arc::clone(&self.plan);
        let consumer = Arc::new(kafka::task_consumer(&plan.kafka, &plan.name)?);
        self.log_start_checked_at = Instant::now();
        let mut starts = Vec::with_capacity(channels.len());
        for &channel in channels {
            let topic = (plan.topics.iter().find(|t| t.id == channel.topic))
                .with_context(|| format!("channel {channel} is not received by the model"))?;
            let (log_start, last_stable) =
                kafka::watermarks(&consumer, &topic.name, self.task, plan.kafka_timeout()).await?;
            let initial_fed_up_to = match topic.initial {
                InitialPosition::Earliest => log_start - 1,
                InitialPosition::Latest => last_stable - 1,
            };
            starts.push(ChannelStart { channel, log_start, initial_fed_up_to });
        }
        let reader = Reader { plan: Arc::clone(&self.plan), task: self.task, budget: self.host.metadata_budget() };
        self.consumer = Some(TaskConsumer::new(consumer, reader));
        self.host.started(&starts);
        Ok(())
    }

    /// The start transaction (answer to [`Next::CommitStart`]): seeds and a refusal the
    /// start found, `running` again if the row said `refused` and this start refused
    /// nothing.
    async fn commit_start(&mut self) -> anyhow::Result<()> {
        let start = self.host.take_start();
        let plan = Arc::clone(&self.plan);
        let mut tx = self.pool.begin().await.context("beginning the start transaction")?;
        if !leases::lock_and_renew(&mut tx, &plan.name, self.task, self.epoch, plan.lease).await? {
            drop(tx);
            self.host.fenced();
            self.settle_stop();
            return Ok(());
        }
        // A skip takes this lock too: one recorded since the skips were read means the
        // engine was restored without it.
        if ordering::count_skips(&mut tx, &plan.name, self.task).await? != self.skips_read {
            anyhow::bail!("a record was skipped while the task was restoring; restoring again");
        }
        ordering::apply_changes(&mut tx, &plan.name, self.task, &start.changes).await?;
        if start.write_running {
            ordering::record_running(&mut tx, &plan.name, self.task).await?;
        }
        if start.notify {
            ordering::notify(&mut tx, &plan.name, Some(self.task)).await?;
        }
        tx.commit().await.context("committing the start transaction")?;
        self.host.committed();
        self.settle_stop();
        Ok(())
    }

    /// Assigns the channels to the consumer at the positions the machine gives
    /// (`fed_up_to + 1`; answer to [`Next::Assign`]).
    fn assign(&mut self, positions: &[(ChannelId, Position)]) -> anyhow::Result<()> {
        let consumer = self.kafka().context("no consumer to assign the task's channels to")?;
        let mut assignment = TopicPartitionList::new();
        for (channel, from) in positions {
            let name = (self.plan.topic_name(&channel.topic))
                .with_context(|| format!("channel {channel} is not received by the model"))?;
            assignment
                .add_partition_offset(name, self.task as i32, Offset::Offset(*from))
                .with_context(|| format!("assigning {name}/{}", self.task))?;
        }
        consumer.assign(&assignment).context("assigning the task's channels")?;
        self.host.assigned();
        self.head_since.clear();
        self.refresh_gauges();
        Ok(())
    }

    fn metric_reason(&self, refusal: &Refusal) {
        let l = self.label_values();
        self.metrics.add(
            Metric::RefusalsTotal,
            &[(l[0].0, &l[0].1), (l[1].0, &l[1].1), ("reason", refusal.reason.as_str())],
            1.0,
        );
    }

    /// Persists a refusal found outside a step's own transaction (answer to
    /// [`Next::PersistRefusal`]): while restoring (stored state this build cannot use), or
    /// after a step rolled back on a record the projection rejected.
    async fn persist_refusal(&mut self, refusal: Refusal) -> anyhow::Result<()> {
        let mut tx = self.pool.begin().await.context("beginning a refusal transaction")?;
        if !leases::lock_and_renew(&mut tx, &self.plan.name, self.task, self.epoch, self.plan.lease).await? {
            drop(tx);
            self.host.fenced();
            self.settle_stop();
            return Ok(());
        }
        ordering::record_refusal(&mut tx, &self.plan.name, self.task, &refusal).await?;
        ordering::notify(&mut tx, &self.plan.name, Some(self.task)).await?;
        tx.commit().await.context("committing a refusal")?;
        self.host.refusal_persisted();
        self.settle_stop();
        Ok(())
    }

    /// Runs one step: waits out a failing task's backoff, restores if the machine says so,
    /// polls a batch (bounded in records and time), answers the checks that are due, feeds
    /// the batch and commits it in one transaction.
    pub async fn run_once(&mut self) -> StepOutcome {
        match &self.state {
            TaskState::Refused(r) => return StepOutcome::Refused(r.clone()),
            TaskState::Fenced => return StepOutcome::Fenced,
            TaskState::Failing { retry_at, .. } => tokio::time::sleep_until((*retry_at).into()).await,
            TaskState::Running => {}
        }
        // A round whose future was dropped midway left the engine ahead of the database.
        self.host.interrupted();
        if let Err(e) = self.start_sequence().await {
            return self.fail(e, Failure::Error).await;
        }
        if let Some(outcome) = self.stopped_outcome() {
            return outcome;
        }
        self.step().await
    }

    fn stopped_outcome(&self) -> Option<StepOutcome> {
        match &self.state {
            TaskState::Refused(r) => Some(StepOutcome::Refused(r.clone())),
            TaskState::Fenced => Some(StepOutcome::Fenced),
            _ => None,
        }
    }

    /// Tells the machine which intervals passed (the timers are the runner's), right after
    /// the poll, so the checks come before the batch is fed.
    fn tick(&mut self) {
        if self.plan.log_start_check.is_some_and(|i| self.log_start_checked_at.elapsed() >= i) {
            self.host.log_start_check_due();
        }
        if self.plan.width_check.is_some_and(|i| self.width_checked_at.elapsed() >= i) {
            self.width_checked_at = Instant::now();
            self.host.width_check_due();
        }
        if self.plan.prune_interval.is_some_and(|i| self.pruned_at.elapsed() >= i) {
            self.pruned_at = Instant::now();
            self.host.prune_due();
        }
    }

    /// Collects up to the step's record and byte bounds (one record in a careful step; at
    /// least one record, however large), waiting at most the step's time bound. Also
    /// answers whether the consumer reported a position out of range.
    async fn poll(&mut self, max_records: Option<usize>, batch: &mut Vec<Fetched>) -> bool {
        let plan = Arc::clone(&self.plan);
        let Some(consumer) = self.consumer.as_mut() else { return false };
        let max = max_records.map_or(plan.max_step_records, |m| m.min(plan.max_step_records));
        let deadline = tokio::time::Instant::now() + plan.max_step_time;
        let max_bytes = plan.max_step_bytes.unwrap_or(usize::MAX);
        debug_assert!(batch.is_empty(), "a step polls once, into an empty list");
        let mut bytes = 0usize;
        let mut out_of_range = false;
        let mut errors = Vec::new();
        while batch.len() < max && bytes < max_bytes {
            // Wait up to the step's deadline for the first record; after that, only while
            // records keep coming (`step_linger`; by default 0: what is already fetched), so a
            // lone write is not held for the window.
            let until = if batch.is_empty() {
                Some(deadline)
            } else if !plan.step_linger.is_zero() {
                Some(deadline.min(tokio::time::Instant::now() + plan.step_linger))
            } else {
                None
            };
            match consumer.next(until).await {
                None => break,
                Some(Ok(record)) => {
                    if batch.is_empty() {
                        tracing::debug!(target: "parsley::stage", stage = "first-record", model = %plan.name,
                            task = self.task, "a step's first record arrived");
                    }
                    bytes = bytes.saturating_add(record.weight);
                    batch.push(record);
                }
                Some(Err(e)) => {
                    let range = matches!(
                        e,
                        KafkaError::MessageConsumption(
                            RDKafkaErrorCode::AutoOffsetReset | RDKafkaErrorCode::OffsetOutOfRange,
                        )
                    );
                    errors.push(e);
                    if range {
                        out_of_range = true;
                        break;
                    }
                    // Transport errors: librdkafka reconnects; do not spin on them.
                    if batch.is_empty() {
                        tokio::time::sleep(Duration::from_millis(100).min(plan.max_step_time)).await;
                    }
                }
            }
        }
        for e in errors {
            self.metric_add(Metric::KafkaErrorsTotal, 1.0);
            if out_of_range {
                tracing::warn!(model = %plan.name, task = self.task, error = %e, "a position is out of range; checking log starts");
            } else {
                tracing::warn!(model = %plan.name, task = self.task, error = %e, "Kafka consumer error (retrying)");
            }
        }
        if !batch.is_empty() {
            tracing::debug!(target: "parsley::stage", stage = "polled", model = %plan.name, task = self.task,
                records = batch.len(), "a step's poll ended");
        }
        out_of_range
    }

    /// Reads the log start of each of `channels` (answer to [`Next::ObserveLogStarts`]).
    /// A periodic check the broker cannot answer is not a failed step: nothing was fed,
    /// and the next check comes an interval later (a broker that cannot answer would stall
    /// every step otherwise). After an out-of-range poll it is: `Err`.
    async fn observe_log_starts(&mut self, channels: &[ChannelId], check: LogStartCheck) -> anyhow::Result<()> {
        self.log_start_checked_at = Instant::now();
        if check == LogStartCheck::Periodic {
            self.metric_add(Metric::LogStartChecksTotal, 1.0);
        }
        match self.read_log_starts(channels).await {
            Ok(log_starts) => {
                // A refusal is left in the engine (sticky); the step persists it.
                self.host.log_starts(&log_starts);
                Ok(())
            }
            Err(e) if check == LogStartCheck::Periodic => {
                self.metric_add(Metric::KafkaErrorsTotal, 1.0);
                tracing::warn!(model = %self.plan.name, task = self.task, error = %format!("{e:#}"),
                    "the periodic log-start check failed; trying again after the interval");
                self.host.skip_check();
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    async fn read_log_starts(&self, channels: &[ChannelId]) -> anyhow::Result<Vec<(ChannelId, Position)>> {
        let consumer = self.kafka().context("no consumer to read log starts with")?;
        let mut log_starts = Vec::with_capacity(channels.len());
        for channel in channels {
            let topic = self
                .plan
                .topic_name(&channel.topic)
                .with_context(|| format!("channel {channel} is not received by the model"))?;
            let (log_start, _) =
                kafka::watermarks(&consumer, topic, channel.partition, self.plan.kafka_timeout()).await?;
            log_starts.push((*channel, log_start));
        }
        Ok(log_starts)
    }

    /// Reads each received topic's partition count (answer to [`Next::CheckWidths`]): the
    /// machine refuses `TASK_WIDTH_CHANGED` when one differs from the model's task count
    /// (partitions added while running move keys between tasks; a restart derives it again
    /// at the model's start). A broker that cannot answer is logged and counted, never a
    /// failed step: the next interval tries again.
    async fn check_widths(&mut self) {
        let plan = Arc::clone(&self.plan);
        let names: Vec<String> = plan.topics.iter().map(|t| t.name.clone()).collect();
        let counts = match self.kafka() {
            Some(consumer) => kafka::partition_counts(&consumer, names, plan.kafka_timeout()).await,
            None => Err(anyhow::anyhow!("no consumer to read partition counts with")),
        };
        let counts = match counts {
            Ok(counts) => counts,
            Err(e) => {
                self.metric_add(Metric::KafkaErrorsTotal, 1.0);
                tracing::warn!(model = %plan.name, task = self.task, error = %format!("{e:#}"),
                    "the periodic width check failed; trying again after the interval");
                self.host.skip_check();
                return;
            }
        };
        self.metric_add(Metric::WidthChecksTotal, 1.0);
        let counts: Vec<(ChannelId, Option<u32>)> =
            plan.topics.iter().zip(counts).map(|(t, count)| (ChannelId::new(t.id, self.task), count)).collect();
        self.host.widths(plan.task_count, &counts, |c| {
            format!("model {}, topic {}", plan.name, plan.topic_name(&c.topic).unwrap_or("?"))
        });
    }

    /// The consumer's position on each channel, which passes transaction markers and
    /// aborted runs that yield no record (answer to [`Next::ReadPositions`], asked only once
    /// every record the consumer returned was fed). Nothing when it cannot be read.
    fn read_positions(&self) -> Vec<(ChannelId, Position)> {
        let Some(consumer) = &self.consumer else { return Vec::new() };
        let positions = match consumer.kafka.position() {
            Ok(p) => p,
            Err(e) => {
                self.metric_add(Metric::KafkaErrorsTotal, 1.0);
                tracing::warn!(model = %self.plan.name, task = self.task, error = %e, "reading the consumer's position failed");
                return Vec::new();
            }
        };
        let first_ahead = consumer.first_ahead();
        let mut read = Vec::new();
        for element in positions.elements() {
            let Offset::Offset(next) = element.offset() else { continue };
            let Some(channel) = self.plan.channel_of(element.topic(), element.partition()) else { continue };
            // Records read ahead are returned, not fed: read only up to the first of them.
            read.push((channel, first_ahead.get(&channel).map_or(next, |&first| next.min(first))));
        }
        read
    }

    /// Learns the facts of the upstream channels (answer to [`Next::LearnUpstream`]) and
    /// has the machine prune the frontier and clock by them (the engine's rule: below log
    /// start, or topic gone; anything not learned is `Unknown`: kept). A broker that cannot
    /// answer is logged and counted, never a failed step: the next interval tries again.
    async fn prune_upstream(&mut self, upstream: Vec<ChannelId>) {
        let learned = match self.kafka() {
            Some(consumer) => kafka::upstream_facts(&consumer, upstream, self.plan.kafka_timeout()).await,
            None => Err(anyhow::anyhow!("no consumer to learn upstream facts with")),
        };
        let learned = match learned {
            Ok(learned) => learned,
            Err(e) => {
                self.metric_add(Metric::KafkaErrorsTotal, 1.0);
                tracing::warn!(model = %self.plan.name, task = self.task, error = %format!("{e:#}"),
                    "learning the facts of upstream channels failed; pruning again after the interval");
                self.host.skip_check();
                return;
            }
        };
        if !learned.errors.is_empty() {
            self.metric_add(Metric::KafkaErrorsTotal, learned.errors.len() as f64);
            tracing::warn!(model = %self.plan.name, task = self.task, errors = ?learned.errors,
                "some upstream facts are unknown; their pairs are kept until a later prune");
        }
        self.metric_add(Metric::PruneChecksTotal, 1.0);
        let pruned = self.host.upstream_facts(|c| learned.facts.get(c).copied().unwrap_or(ChannelFact::Unknown));
        if pruned > 0 {
            self.metric_add(Metric::PairsPrunedTotal, pruned as f64);
            tracing::info!(model = %self.plan.name, task = self.task, pruned, "pruned upstream pairs");
        }
    }

    /// Feeds the polled batch (answer to [`Next::Feed`]); returns how many records were
    /// fed and how many were replays. A record of a channel the task does not receive
    /// refuses `SUBSTRATE_MISCONFIGURED`; a refusal stops the feed.
    fn feed(&mut self, batch: &mut Vec<Fetched>, deliveries: &mut Vec<Delivery<RecordData>>) -> (usize, usize) {
        let mut fed = 0usize;
        let mut replayed = 0usize;
        // Most records of a step are delivered in it: one allocation for the step's list.
        deliveries.reserve(batch.len());
        // What a refusal leaves unfed is dropped with the drain, as the step's poll ends.
        for record in batch.drain(..) {
            let channel = match record.channel {
                Ok(channel) => channel,
                Err(where_) => {
                    self.host.refuse(Refusal::new(
                        RefusalReason::SubstrateMisconfigured,
                        format!("task {} was handed a record of {where_}, which it does not receive", self.task),
                    ));
                    break;
                }
            };
            match self.host.receive_result_into(channel, record.offset, record.causes, record.data, deliveries) {
                Ok(Fed::Duplicate) => replayed += 1,
                Ok(Fed::Accepted) => fed += 1,
                Err(_refusal) => break,
            }
        }
        self.host.batch_done();
        (fed, replayed)
    }

    /// One step, as the machine orders it: the poll, the checks that are due, the drain
    /// after a restore, the feed, the consumer's position, then the transaction (or none
    /// when the step is idle).
    async fn step(&mut self) -> StepOutcome {
        let mut buffers = std::mem::take(&mut self.buffers);
        let outcome = self.step_with(&mut buffers.batch, &mut buffers.deliveries, &mut buffers.views).await;
        buffers.end_step();
        self.buffers = buffers;
        outcome
    }

    /// [`TaskRunner::step`] with its lists (empty when it starts).
    async fn step_with(
        &mut self,
        batch: &mut Vec<Fetched>,
        deliveries: &mut Vec<Delivery<RecordData>>,
        views: &mut Vec<Delivered<'static>>,
    ) -> StepOutcome {
        let plan = Arc::clone(&self.plan);
        let mut polled = false;
        let mut fed = 0usize;
        let mut replayed = 0usize;
        loop {
            match self.host.next_action() {
                Next::Poll { max_records } if !polled => {
                    let out_of_range = self.poll(max_records, batch).await;
                    polled = true;
                    self.tick();
                    self.host.polled(out_of_range);
                }
                // One batch per step; a refusal or an out-of-range poll ends it.
                Next::Poll { .. } | Next::Commit => break,
                Next::ObserveLogStarts { channels, check } => {
                    if let Err(e) = self.observe_log_starts(&channels, check).await {
                        return self.fail(e, Failure::Error).await;
                    }
                }
                Next::CheckWidths => self.check_widths().await,
                Next::LearnUpstream(channels) => self.prune_upstream(channels).await,
                Next::Drain => deliveries.extend(self.host.drain()),
                Next::Feed => (fed, replayed) = self.feed(batch, deliveries),
                Next::ReadPositions => {
                    let positions = self.read_positions();
                    self.host.read_positions(&positions);
                }
                other => {
                    let error = anyhow::anyhow!("the task's step met {other:?}; restoring");
                    return self.fail(error, Failure::Error).await;
                }
            }
        }
        let Some(commit) = self.host.end_step() else {
            self.refresh_gauges();
            return StepOutcome::Idle;
        };
        let step_started = Instant::now();
        let spans = traced_spans(&plan, self.task, deliveries);
        // The consumer is taken out while the transaction runs, to read ahead meanwhile; a
        // step dropped midway restores with a new consumer anyway.
        let mut consumer = self.consumer.take();
        let committed = match consumer.as_mut() {
            Some(c) => {
                let bytes = plan.max_step_bytes.unwrap_or(usize::MAX);
                c.read_ahead_during(plan.max_step_records, bytes, self.commit(&plan, deliveries, &commit, views)).await
            }
            None => self.commit(&plan, deliveries, &commit, views).await,
        };
        self.consumer = consumer;
        if !matches!(committed, Ok(true)) {
            for (_, span) in &spans {
                span.record("otel.status_code", "error");
            }
        }
        match committed {
            Err(e) => match e.downcast::<Rejection>() {
                Ok(Rejection { record: Some((channel, position, coordinate)), reason, refusal }) if fed <= 1 => {
                    self.refuse_rejected(refusal, channel, position, &coordinate, &reason).await
                }
                // A batch cannot say which record the projection rejected, and a careful
                // step of several records names it but rolled back the records before it:
                // replay carefully from one record, including the held records this step
                // delivered, so the refusal comes from a step that fed its record alone.
                Ok(rejection) => self.fail(anyhow::Error::new(rejection), Failure::BatchRejected).await,
                Err(e) => self.fail(e, Failure::Error).await,
            },
            Ok(false) => {
                self.host.fenced();
                self.become_fenced();
                StepOutcome::Fenced
            }
            Ok(true) => {
                self.host.committed();
                let commit_seconds = step_started.elapsed().as_secs_f64();
                self.metrics.observe(Metric::StepCommitSeconds, &[("model", &plan.name)], commit_seconds);
                self.metrics.observe(Metric::StepRecords, &[("model", &plan.name)], fed as f64);
                self.metric_add(Metric::StepsTotal, 1.0);
                self.metric_add(Metric::RecordsReceivedTotal, fed as f64);
                self.metric_add(Metric::RecordsReplayedTotal, replayed as f64);
                self.metric_add(Metric::RecordsDeliveredTotal, deliveries.len() as f64);
                if commit.write_running {
                    tracing::info!(model = %plan.name, task = self.task, "task recovered");
                    self.metric_set(Metric::TaskFailing, 0.0);
                }
                if !matches!(self.state, TaskState::Refused(_)) {
                    self.state = TaskState::Running;
                }
                self.refresh_gauges();
                let held = self.host.engine().held_count();
                tracing::debug!(model = %plan.name, task = self.task, fed, replayed, delivered = deliveries.len(),
                    held, "step committed");
                log_traced(&plan, self.task, deliveries, spans);
                if let Some(r) = commit.changes.refusal {
                    self.metric_reason(&r);
                    self.become_refused(r.clone());
                    return StepOutcome::Refused(r);
                }
                StepOutcome::Committed { fed, replayed, delivered: deliveries.len(), held }
            }
        }
    }

    /// The step transaction. `Ok(false)`: fenced, nothing written.
    async fn commit(
        &mut self,
        plan: &ModelPlan,
        deliveries: &[Delivery<RecordData>],
        commit: &StepCommit<RecordData>,
        views: &mut Vec<Delivered<'static>>,
    ) -> anyhow::Result<bool> {
        // The clock's NOTIFY goes with the lock, the step's first statement (a round trip
        // fewer; delivered at commit like any NOTIFY, never if the step rolls back).
        let changes = &commit.changes;
        let notify = commit.notify || !changes.clock_upserts.is_empty() || !changes.clock_removed.is_empty();
        let mut tx = self.pool.begin().await.context("beginning a step")?;
        if !leases::lock_renew_and_notify(&mut tx, &plan.name, self.task, self.epoch, plan.lease, notify).await? {
            tx.rollback().await.context("rolling back a fenced step")?;
            return Ok(false);
        }
        let locked_at = Instant::now();
        let (skipped, dead_lettered) = self.project(&mut tx, plan, deliveries, commit.careful, views).await?;
        let clock_changed = ordering::apply_changes(&mut tx, &plan.name, self.task, changes).await?;
        debug_assert!(!clock_changed || notify, "a step changed the clock without a NOTIFY");
        if commit.write_running {
            ordering::record_running(&mut tx, &plan.name, self.task).await?;
        }
        // The lock renewed the lease from the transaction's start; a long step (a large one
        // under a backlog, a slow projection) renews it again from now, or it would commit
        // with its lease spent and be taken over at once. Short steps skip the round trip.
        if locked_at.elapsed() > plan.lease / LONG_STEP_LEASE_FRACTION
            && !leases::extend(&mut tx, &plan.name, self.task, self.epoch, plan.lease).await?
        {
            anyhow::bail!("task {}/{} changed epoch while its row was locked by this step", plan.name, self.task);
        }
        tx.commit().await.context("committing a step")?;
        tracing::debug!(target: "parsley::stage", stage = "committed", model = %plan.name, task = self.task,
            "a step committed");
        if skipped > 0 {
            self.metric_add(Metric::SkipsTotal, skipped as f64);
        }
        if dead_lettered > 0 {
            self.metric_add(Metric::DeadLettersTotal, dead_lettered as f64);
        }
        Ok(true)
    }

    /// Hands the step's deliveries to the projection, in the step's transaction; returns
    /// how many were skipped (never handed over) and dead-lettered.
    ///
    /// Normally the deliveries go in one batch, and a rejection — which a batch cannot pin
    /// on a record — ends the step with a [`Rejection`] naming none: the task then retries
    /// carefully. In careful mode each record is applied alone, so a rejection names it:
    /// under `on_rejected = "refuse"` it ends the step; under `"dead-letter"` each record
    /// runs under a savepoint, and a rejected one is rolled back to it, stored in
    /// `parsley.dead_letters` and delivered without effect, in this step. A record whose
    /// value breaks its topic's data contract is rejected so before the projection sees it.
    async fn project(
        &self,
        conn: &mut PgConnection,
        plan: &ModelPlan,
        deliveries: &[Delivery<RecordData>],
        careful: bool,
        room: &mut Vec<Delivered<'static>>,
    ) -> anyhow::Result<(usize, usize)> {
        let skipped = deliveries.iter().filter(|d| d.payload.skipped).count();
        if skipped == deliveries.len() {
            return Ok((skipped, 0));
        }
        let effective = deliveries.iter().filter(|d| !d.payload.skipped);
        let ctx = StepContext { model: &plan.name, task: self.task };
        if !careful {
            // A record on the wrong partition is named by a careful step, like a rejection.
            if let Some(reason) = effective.clone().find_map(|d| misplaced(plan, d)) {
                let refusal = RefusalReason::KeyPartitionMismatch;
                return Err(anyhow::Error::new(Rejection { record: None, reason, refusal }));
            }
            let mut views: Vec<Delivered<'_>> = recycled(std::mem::take(room));
            views.extend(effective.map(|d| view(plan, d)));
            // A record breaking its topic's contract is a rejection, found before the
            // projection runs: the careful retry names it and `on_rejected` applies.
            if let Some(reason) = views.iter().find_map(|r| contract_refusal(plan, r)) {
                *room = recycled(views);
                let refusal = RefusalReason::ProjectionRejected;
                return Err(anyhow::Error::new(Rejection { record: None, reason, refusal }));
            }
            let applied = self.projection.apply_batch(conn, ctx, &views).await;
            *room = recycled(views);
            return match applied {
                Ok(()) => Ok((skipped, 0)),
                Err(ProjectionError::Rejected { reason }) => Err(anyhow::Error::new(Rejection {
                    record: None,
                    reason,
                    refusal: RefusalReason::ProjectionRejected,
                })),
                Err(ProjectionError::Transient(e)) => Err(e.context("the projection failed")),
            };
        }
        let dead_letter = plan.on_rejected == OnRejected::DeadLetter;
        let mut dead_lettered = 0;
        for d in effective {
            let record = view(plan, d);
            if let Some(reason) = misplaced(plan, d) {
                if !dead_letter {
                    let at = Some((d.channel, d.position, record.coordinate()));
                    let refusal = RefusalReason::KeyPartitionMismatch;
                    return Err(anyhow::Error::new(Rejection { record: at, reason, refusal }));
                }
                let reason = format!("{}: {reason}", RefusalReason::KeyPartitionMismatch);
                ordering::insert_dead_letter(conn, &plan.name, self.task, d, &reason).await?;
                tracing::warn!(model = %plan.name, task = self.task, record = %record.coordinate(), %reason,
                    "a keyed record on the wrong partition; dead-lettered, delivered without effect");
                dead_lettered += 1;
                continue;
            }
            if dead_letter {
                ordering::set_record_savepoint(conn).await?;
            }
            let applied = match contract_refusal(plan, &record) {
                Some(reason) => Err(ProjectionError::Rejected { reason }),
                None => self.projection.apply_batch(conn, ctx, std::slice::from_ref(&record)).await,
            };
            match applied {
                Ok(()) if dead_letter => {
                    ordering::release_record_savepoint(conn).await?;
                }
                Ok(()) => {}
                Err(ProjectionError::Rejected { reason }) if dead_letter => {
                    ordering::rollback_to_record_savepoint(conn).await?;
                    ordering::insert_dead_letter(conn, &plan.name, self.task, d, &reason).await?;
                    tracing::warn!(model = %plan.name, task = self.task, record = %record.coordinate(), %reason,
                        "the projection rejected a record; dead-lettered, delivered without effect");
                    dead_lettered += 1;
                }
                Err(ProjectionError::Rejected { reason }) => {
                    let at = Some((d.channel, d.position, record.coordinate()));
                    let refusal = RefusalReason::ProjectionRejected;
                    return Err(anyhow::Error::new(Rejection { record: at, reason, refusal }));
                }
                Err(ProjectionError::Transient(e)) => {
                    return Err(e.context(format!("the projection failed on {}", record.coordinate())))
                }
            }
        }
        Ok((skipped, dead_lettered))
    }

    /// The projection rejected one record for good (applied alone, so the record is
    /// certain). The step rolled back: the record is not delivered, and the refusal is
    /// recorded in a transaction of its own. A restart derives it again — the record is fed
    /// and delivered again, and the projection rejects it again — until an operator skips
    /// the record or the projection changes.
    async fn refuse_rejected(
        &mut self,
        refusal: RefusalReason,
        channel: ChannelId,
        position: Position,
        coordinate: &str,
        reason: &str,
    ) -> StepOutcome {
        let diagnosis = if refusal == RefusalReason::KeyPartitionMismatch {
            format!("{coordinate}: {reason}")
        } else if reason.contains(coordinate) {
            format!("the projection rejected the record: {reason}")
        } else {
            format!("the projection rejected {coordinate}: {reason}")
        };
        self.host.rejected_as(refusal, channel, position, diagnosis);
        if let Next::PersistRefusal(refusal) = self.host.next_action() {
            if let Err(e) = self.persist_refusal(refusal).await {
                return self.fail(e, Failure::Error).await;
            }
        }
        self.stopped_outcome().unwrap_or_else(|| StepOutcome::Failed { error: "the refusal was not recorded".into() })
    }

    /// A step (or a start) failed: the machine restores before anything is fed again (and
    /// feeds carefully past what the step had fed); record it (own transaction) and back off.
    async fn fail(&mut self, error: anyhow::Error, failure: Failure) -> StepOutcome {
        let message = format!("{error:#}");
        self.host.failed(failure);
        self.consumer = None;
        let failures = match &self.state {
            TaskState::Failing { failures, .. } => failures + 1,
            _ => 1,
        };
        let backoff = self.plan.backoff().delay(failures - 1);
        tracing::warn!(model = %self.plan.name, task = self.task, failures, backoff_ms = backoff.as_millis() as u64,
            error = %message, "step failed; rolled back, retrying the same records");
        self.metric_add(Metric::FailuresTotal, 1.0);
        self.metric_set(Metric::TaskFailing, 1.0);
        match ordering::record_failure(&self.pool, &self.plan.name, self.task, self.epoch, &message).await {
            Ok(true) => self.host.failure_recorded(),
            Ok(false) => {
                self.host.fenced();
                self.become_fenced();
                return StepOutcome::Fenced;
            }
            Err(e) => {
                tracing::warn!(model = %self.plan.name, task = self.task, error = %format!("{e:#}"), "could not record the failure")
            }
        }
        self.state = TaskState::Failing { failures, retry_at: Instant::now() + backoff, error: message.clone() };
        StepOutcome::Failed { error: message }
    }

    fn refresh_gauges(&mut self) {
        let now = Instant::now();
        let mut oldest = Duration::ZERO;
        let engine = self.host.engine();
        for channel in engine.received() {
            match engine.held(channel).next().map(|h| h.position) {
                Some(head) => {
                    let since = self.head_since.entry(*channel).or_insert((head, now));
                    if since.0 != head {
                        *since = (head, now);
                    }
                    oldest = oldest.max(now - since.1);
                }
                None => {
                    self.head_since.remove(channel);
                }
            }
        }
        let (held, bytes, clock) = (engine.held_count(), engine.held_bytes(), engine.delivered_past().len());
        self.metric_set(Metric::HeldRecords, held as f64);
        self.metric_set(Metric::HeldBytes, bytes as f64);
        self.metric_set(Metric::HeadHoldAgeSeconds, oldest.as_secs_f64());
        self.metric_set(Metric::ClockWidth, clock as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::{emptied, recycled, KEPT_ROOM_MIN};

    /// A step's views reuse the last step's allocation: the list comes back empty, with
    /// its room, as a list of a type of the same layout.
    #[test]
    fn a_recycled_list_keeps_its_room() {
        let text = String::from("borrowed");
        let mut borrowed: Vec<&str> = Vec::with_capacity(1000);
        borrowed.extend(std::iter::repeat_n(text.as_str(), 700));
        let at = borrowed.as_ptr() as usize;
        let kept: Vec<&'static str> = recycled(borrowed);
        assert!(kept.is_empty());
        assert_eq!(kept.capacity(), 1000);
        assert_eq!(kept.as_ptr() as usize, at, "the allocation is the same");
    }

    /// A backlog's room is kept while steps stay large, and given back once they are small.
    #[test]
    fn a_step_s_list_keeps_its_room_only_while_the_steps_use_it() {
        let mut list: Vec<u64> = Vec::with_capacity(100_000);
        list.extend(0..60_000);
        emptied(&mut list, 60_000);
        assert!(list.is_empty() && list.capacity() >= 100_000, "a large step keeps the room");
        list.extend(0..30_000);
        emptied(&mut list, 30_000);
        assert!(list.capacity() >= 100_000, "a step using over a quarter keeps it too");
        list.extend(0..10);
        emptied(&mut list, 10);
        assert!(list.is_empty() && list.capacity() < 100_000, "a small step gives most of it back");
        assert!(list.capacity() >= KEPT_ROOM_MIN);
        let kept = list.capacity();
        emptied(&mut list, 0);
        assert_eq!(list.capacity(), kept, "the least room is kept");
    }
}
