//! The write path, `POST /v1/topics/{topic}/records`: open and check the session, check the
//! body ([`crate::body`]: what could never be stored is refused, the value kept as sent),
//! the value against the topic's data contract ([`crate::contracts`]) and the topic's
//! width (a topic whose partition count is not a receiving model's recorded width is
//! refused `409`), produce the record with the session's pairs as its `parsley.causes`
//! header (idempotent producer, `acks=all`, the key placed by the topic's partitioner:
//! librdkafka's murmur2, or CRC-32 computed here for a `crc32` topic), await the broker's
//! acknowledgement, merge the acknowledged coordinate — never a position computed from a
//! log end — and hand back the re-sealed token. A write never waits for the record to
//! become deliverable.
//!
//! The claim of the request's `Idempotency-Key`, the produce and the recording of its
//! outcome run to the end in a task of their own ([`written_apart`]): a client that hangs
//! up, or a response timeout, drops the handler but not the write, so a claim is never left
//! behind without its outcome. A write Kafka did not confirm either way keeps its claim as
//! `unknown`: a retry answers `409 idempotency-outcome-unknown`, never a second copy.

use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use parsley::codec::{self, CAUSES_HEADER};
use parsley::partitioner::Partitioner;
use parsley::{CausalPast, ChannelId, TopicId};
use parsley_store::idempotency::{self, Begun};
use parsley_store::StoreError;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::util::Timeout;
use serde_json::{json, Value};

use crate::body::{self, WriteBody};
use crate::facts_cache::TopicFact;
use crate::metrics::Metric;
use crate::problem::ApiError;
use crate::session::{self, kafka_unavailable, SESSION_HEADER};
use crate::state::AppState;
use crate::store_errors;
use crate::trace::{TraceContext, TRACEPARENT};
use tracing::Instrument as _;

/// The body's bytes, or why there are none.
pub fn body_bytes(body: Result<Bytes, BytesRejection>, max_body_bytes: usize) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::BodyTooLarge { limit: max_body_bytes }
        } else {
            ApiError::InvalidBody(r.body_text())
        }
    })
}

/// The request header naming a write's idempotency key.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";
/// The response header marking an answer replayed from an earlier, identical request.
pub const IDEMPOTENCY_REPLAYED_HEADER: &str = "idempotency-replayed";
/// The longest idempotency key accepted, in bytes.
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 255;

/// The request's `Idempotency-Key`, if it carries one: 1 to 255 bytes of visible ASCII,
/// given once.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY_HEADER).iter();
    let Some(value) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err(ApiError::InvalidIdempotencyKey("more than one Idempotency-Key header".into()));
    }
    let bytes = value.as_bytes();
    if bytes.is_empty() || bytes.len() > MAX_IDEMPOTENCY_KEY_BYTES || !bytes.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(ApiError::InvalidIdempotencyKey(format!(
            "an Idempotency-Key is 1 to {MAX_IDEMPOTENCY_KEY_BYTES} bytes of visible ASCII (no spaces)"
        )));
    }
    Ok(Some(String::from_utf8_lossy(bytes).into_owned()))
}

/// What identifies a request for its idempotency key: SHA-256 over the route and the body.
pub fn request_hash(route: &str, body: &[u8]) -> Vec<u8> {
    use sha2::{Digest as _, Sha256};
    let mut h = Sha256::new();
    h.update(route.as_bytes());
    h.update([0u8]);
    h.update(body);
    h.finalize().to_vec()
}

/// A write's idempotency claim, held while it is written.
pub struct Claim {
    scope: String,
    key: String,
}

impl Claim {
    /// The claim's scope and key.
    pub fn id(&self) -> (String, String) {
        (self.scope.clone(), self.key.clone())
    }
}

/// What an idempotent request found before writing.
pub enum Idempotent {
    /// No key, or the key is this request's now: write.
    Write(Option<Claim>),
    /// The same request was written: its acknowledgement (the `201` body, plus `topic_ids`).
    Replay(Value),
}

/// The request's idempotency key and the scope it is claimed in (`(scope, key)`), if it
/// carries one.
pub fn claim_id(headers: &HeaderMap, caller: &session::Caller) -> Result<Option<(String, String)>, ApiError> {
    Ok(idempotency_key(headers)?.map(|key| (idempotency_scope(caller), key)))
}

/// Claims the request's idempotency key `id` ([`claim_id`]), if it has one (`route` and
/// `body` identify the request). A key used for another request is `409
/// idempotency-key-reused`; one whose request is still being written, `409
/// idempotency-key-in-flight`; one whose request's outcome is unknown, `409
/// idempotency-outcome-unknown`.
pub async fn claim_idempotency(
    state: &AppState,
    id: Option<(String, String)>,
    route: &str,
    body: &[u8],
) -> Result<Idempotent, ApiError> {
    let Some((scope, key)) = id else { return Ok(Idempotent::Write(None)) };
    let settings = &state.config.settings;
    let window = Duration::from_secs(settings.idempotency_window_s);
    // A claim not marked alive for this long (its writer does so every half produce
    // timeout, `written_apart`) was left by a gateway that died mid-write.
    let stale_after = settings.produce_timeout() * 2;
    let begun = idempotency::begin(&state.pool, &scope, &key, &request_hash(route, body), window, stale_after)
        .await
        .map_err(|e| store_errors::failed(e, "the idempotency key", settings.retry_after_s, None))?;
    match begun {
        Begun::Claimed => Ok(Idempotent::Write(Some(Claim { scope, key }))),
        Begun::Done(ack) => {
            state.metrics.add(Metric::IdempotentReplaysTotal, &[], 1.0);
            Ok(Idempotent::Replay(ack))
        }
        Begun::InFlight => Err(ApiError::IdempotencyKeyInFlight { key, retry_after: settings.retry_after_s }),
        Begun::Unknown => Err(ApiError::IdempotencyOutcomeUnknown(key)),
        Begun::Reused => Err(ApiError::IdempotencyKeyReused(key)),
    }
}

/// Whose keys a request's `Idempotency-Key` is among: its subject's (`sub:<subject>`), else
/// its session token's (`token:<SHA-256 of the token as sent>`), else — a caller with
/// neither — a scope of its own that no other request has (`new:<random>`): its key is
/// scoped to the session this request starts, so no caller can claim or replay another's.
pub fn idempotency_scope(caller: &session::Caller) -> String {
    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
    match (&caller.subject, &caller.token_digest) {
        (Some(subject), _) => format!("sub:{subject}"),
        (None, Some(digest)) => format!("token:{}", hex(digest)),
        (None, None) => {
            use chacha20poly1305::aead::rand_core::RngCore as _;
            let mut fresh = [0u8; 16];
            chacha20poly1305::aead::OsRng.fill_bytes(&mut fresh);
            format!("new:{}", hex(&fresh))
        }
    }
}

/// How a write ended, as its idempotency claim records it.
pub enum Settled<'a> {
    /// Written: the acknowledgement retries are answered with.
    Done(&'a Value),
    /// Surely not written: the key is given up, so that a retry writes.
    NotWritten,
    /// Maybe written: the claim is kept as `unknown`, so that a retry does not write again.
    Unknown,
}

impl Settled<'_> {
    /// How a failed write ended: an error that may have left the record written is
    /// `Unknown`, any other `NotWritten`.
    pub fn failed(e: &ApiError) -> Settled<'static> {
        match e {
            ApiError::WriteFailed { unknown: true, .. } | ApiError::WidthChanged { written: Some(_), .. } => {
                Settled::Unknown
            }
            _ => Settled::NotWritten,
        }
    }
}

/// Settles a claim (see [`Settled`]). The database is tried a few times: a claim left
/// `pending` reads as unknown once stale, never as free, so a failure here costs the key, not
/// a duplicate. A failure to record is logged, never the request's answer.
pub async fn settle(state: &AppState, claim: Option<Claim>, outcome: Settled<'_>) {
    let Some(Claim { scope, key }) = claim else { return };
    let mut last = None;
    for attempt in 0..3u32 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
        }
        let done = match outcome {
            Settled::Done(ack) => idempotency::finish(&state.pool, &scope, &key, ack).await,
            Settled::NotWritten => idempotency::abandon(&state.pool, &scope, &key).await,
            Settled::Unknown => idempotency::unknown(&state.pool, &scope, &key).await,
        };
        match done {
            Ok(()) => return,
            Err(e) => last = Some(e),
        }
    }
    if let Some(e) = last {
        tracing::warn!(error = %format!("{e:#}"), "could not settle an idempotency key; a retry within the window answers 409 (in flight, then outcome unknown)");
    }
}

/// What [`written_apart`] answers: a replayed acknowledgement, or the write's own answer.
pub enum Written<T> {
    Replay(Value),
    Done(T),
}

/// Claims the request's idempotency key `id` ([`claim_id`]) and runs `write` with the claim —
/// a produce and the recording of its outcome — in a task of its own, so that a claim, once
/// made, is settled whatever becomes of the request (a client hanging up, the response
/// timeout); answers the replayed acknowledgement or what `write` answered. While `write`
/// runs, its claim is marked alive every half produce timeout, so that a write that takes
/// long (a batch waiting for a transactional producer) is never taken for one whose gateway
/// died.
pub async fn written_apart<T, W>(
    state: &AppState,
    id: Option<(String, String)>,
    route: String,
    bytes: Bytes,
    write: impl FnOnce(Option<Claim>) -> W + Send + 'static,
) -> Result<Written<T>, ApiError>
where
    T: Send + 'static,
    W: std::future::Future<Output = Result<T, ApiError>> + Send + 'static,
{
    let state = state.clone();
    let task = tokio::spawn(async move {
        let claim = match claim_idempotency(&state, id, &route, &bytes).await? {
            Idempotent::Replay(ack) => return Ok(Written::Replay(ack)),
            Idempotent::Write(claim) => claim,
        };
        let Some((scope, key)) = claim.as_ref().map(Claim::id) else { return write(None).await.map(Written::Done) };
        let every = state.config.settings.produce_timeout() / 2;
        let keep_alive = async move {
            loop {
                tokio::time::sleep(every).await;
                if let Err(e) = idempotency::touch(&state.pool, &scope, &key).await {
                    tracing::warn!(error = %format!("{e:#}"), "could not mark an idempotent write alive");
                }
            }
        };
        tokio::select! {
            biased;
            answer = write(claim) => answer.map(Written::Done),
            never = keep_alive => never,
        }
    });
    match task.await {
        Ok(answer) => answer,
        Err(e) => Err(ApiError::Internal(anyhow::anyhow!("a write's task did not finish: {e}"))),
    }
}

/// Answers a replayed request: the stored acknowledgement, its coordinates merged into this
/// request's session as the first answer merged them.
pub fn replay(
    state: &AppState,
    caller: &session::Caller,
    past: &CausalPast,
    ack: &Value,
    now: u64,
) -> Result<Response, ApiError> {
    let bad = || ApiError::Internal(anyhow::anyhow!("a stored idempotent acknowledgement is malformed"));
    let mut merged = past.clone();
    for record in ack.get("records").and_then(Value::as_array).ok_or_else(bad)? {
        let topic: TopicId = record["topic_id"].as_str().and_then(|t| t.parse().ok()).ok_or_else(bad)?;
        let partition = record["partition"].as_u64().and_then(|p| u32::try_from(p).ok()).ok_or_else(bad)?;
        let offset = record["offset"].as_i64().ok_or_else(bad)?;
        merged = merged.merge(ChannelId::new(topic, partition), offset);
    }
    let token = session::reseal(state, caller, merged, now)?;
    let body = ack.get("body").cloned().ok_or_else(bad)?;
    Ok((
        StatusCode::CREATED,
        [(SESSION_HEADER, token), (IDEMPOTENCY_REPLAYED_HEADER, HeaderValue::from_static("true"))],
        Json(body),
    )
        .into_response())
}

/// What an idempotent write stores: the `201` body, and each record's coordinate with its
/// topic ID (to merge into a retry's session).
pub fn acknowledgement(body: &Value, records: &[(ChannelId, i64)]) -> Value {
    let records: Vec<Value> = records
        .iter()
        .map(|(c, offset)| json!({"topic_id": c.topic.to_string(), "partition": c.partition, "offset": offset}))
        .collect();
    json!({"body": body, "records": records})
}

pub async fn post_record(
    State(state): State<AppState>,
    topic: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Path(topic) = topic.map_err(|r| ApiError::InvalidPath(r.body_text()))?;
    let now = session::unix_now();
    let caller = session::open_session(&state, &headers, now).await?;
    let settings = &state.config.settings;
    let bytes = body_bytes(body, settings.max_body_bytes)?;
    let request = body::parse(&bytes, settings.max_key_bytes)?;
    if !state.receives(&topic) {
        return Err(ApiError::UnknownTopic(topic, "is not received by any configured model".into()));
    }
    state.config.access.check_write(caller.identity.as_deref(), &topic, &[request.key.as_str()])?;
    state.contracts.check(&topic, request.value)?;
    let fact = match state.facts.topic(&topic).await.map_err(|e| kafka_unavailable(&state, e))? {
        Some(f) => f,
        None => return Err(ApiError::UnknownTopic(topic, "does not exist on the broker".into())),
    };
    let fact = check_width(&state, fact, None).await?;
    let past = session::sanitize(&state, &caller.past).await?;
    let route = format!("/v1/topics/{topic}/records");
    let id = claim_id(&headers, &caller)?;
    let (span, trace) = crate::trace::write_span(&headers, &format!("POST {route}"));
    let written = {
        let (state, topic, past, bytes, route) =
            (state.clone(), topic.clone(), past.clone(), bytes.clone(), route.clone());
        written_apart(&state.clone(), id, route.clone(), bytes.clone(), move |claim| {
            async move {
                // Parsed again inside the task, which owns its bytes; checked above already.
                let written = match body::parse(&bytes, state.config.settings.max_key_bytes) {
                    Ok(request) => produce_one(&state, &topic, fact, &past, &request, &trace).await,
                    Err(e) => Err(e.into()),
                };
                match &written {
                    Ok((channel, offset)) => {
                        let span = tracing::Span::current();
                        span.record("messaging.destination.name", topic.as_str());
                        span.record("messaging.kafka.destination.partition", channel.partition);
                        span.record("messaging.kafka.message.offset", *offset);
                        let body = ack_body(&topic, *channel, *offset);
                        settle(&state, claim, Settled::Done(&acknowledgement(&body, &[(*channel, *offset)]))).await;
                    }
                    Err(e) => settle(&state, claim, Settled::failed(e)).await,
                }
                written
            }
            .instrument(span)
        })
        .await?
    };
    let (channel, offset) = match written {
        Written::Replay(ack) => return replay(&state, &caller, &past, &ack, now),
        Written::Done(coordinate) => coordinate,
    };
    let body = ack_body(&topic, channel, offset);
    let token = session::reseal(&state, &caller, past.merge(channel, offset), now)?;
    Ok((StatusCode::CREATED, [(SESSION_HEADER, token)], Json(body)).into_response())
}

/// A single write's `201` body.
fn ack_body(topic: &str, channel: ChannelId, offset: i64) -> Value {
    json!({"topic": topic, "partition": channel.partition, "offset": offset})
}

/// The session's past as the `parsley.causes` value a write stamps (`None`: empty), within
/// the metadata budget.
pub fn encode_causes(state: &AppState, past: &CausalPast) -> Result<Option<Vec<u8>>, ApiError> {
    if past.is_empty() {
        return Ok(None);
    }
    let budget = state.config.settings.metadata_budget;
    codec::encode_within(past, budget)
        .map(Some)
        .map_err(|_| ApiError::MetadataBudgetExceeded { size: codec::encoded_len(past), budget })
}

/// A produced record's headers: the application's in the order sent, then `parsley.causes`
/// (when the session has a past) and the gateway's `traceparent` (unless the application
/// gave one).
pub fn stamped_headers(app_headers: &[(String, String)], causes: Option<&[u8]>, traceparent: &str) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new_with_capacity(app_headers.len() + 2);
    for (name, value) in app_headers {
        headers = headers.insert(Header { key: name.as_str(), value: Some(value.as_bytes()) });
    }
    if let Some(c) = causes {
        headers = headers.insert(Header { key: CAUSES_HEADER, value: Some(c) });
    }
    if !app_headers.iter().any(|(name, _)| name.eq_ignore_ascii_case(TRACEPARENT)) {
        headers = headers.insert(Header { key: TRACEPARENT, value: Some(traceparent.as_bytes()) });
    }
    headers
}

/// The partition a record keyed `key` is produced to when the gateway places it itself:
/// on a topic whose producers place keys by CRC-32 (`partitioner = "crc32"`), the partition
/// CRC-32 names over the topic's partition count. `None`: the producer's own partitioner
/// (murmur2, librdkafka's `murmur2_random`) places it — for `murmur2` topics, and for
/// `none` topics, whose keys are not routed.
pub fn placed_partition(state: &AppState, topic: &str, key: &str, fact: &TopicFact) -> Option<i32> {
    match state.config.shared.partitioner_of(topic) {
        Partitioner::Crc32 => {
            Partitioner::Crc32.partition_for_key(key.as_bytes(), fact.partitions).and_then(|p| i32::try_from(p).ok())
        }
        Partitioner::Murmur2 | Partitioner::None => None,
    }
}

/// Produces one checked record stamped with `past`, and awaits the acknowledgement.
async fn produce_one(
    state: &AppState,
    topic: &str,
    fact: TopicFact,
    past: &CausalPast,
    request: &WriteBody<'_>,
    trace: &TraceContext,
) -> Result<(ChannelId, i64), ApiError> {
    let settings = &state.config.settings;
    let causes = encode_causes(state, past)?;
    let traceparent = trace.header();
    let WriteBody { key, value, headers: app_headers } = request;
    let record_headers = stamped_headers(app_headers, causes.as_deref(), &traceparent);
    let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).key(key.as_bytes()).headers(record_headers);
    if let Some(partition) = placed_partition(state, topic, key, &fact) {
        record = record.partition(partition);
    }
    if let Some(v) = value {
        // The client's bytes, as sent.
        record = record.payload(v.as_bytes());
    }

    let started = Instant::now();
    let delivery = state
        .producer
        .send(record, Timeout::After(settings.produce_timeout()))
        .await
        .map_err(|(e, _)| write_failed(state, topic, e))?;
    state.metrics.observe(Metric::WriteAckSeconds, &[], started.elapsed().as_secs_f64());
    let partition = u32::try_from(delivery.partition)
        .map_err(|_| ApiError::Internal(anyhow::anyhow!("the broker acknowledged partition {}", delivery.partition)))?;
    let channel = ChannelId::new(fact.id, partition);
    state.facts.note_acknowledged(channel, delivery.offset);
    state.metrics.add(Metric::WritesTotal, &[("topic", topic)], 1.0);
    let partitioner = state.config.shared.partitioner_of(topic);
    let expected = partitioner.partition_for_key(key.as_bytes(), fact.partitions);
    if expected.is_some_and(|e| e != partition) {
        // The producer saw another partition count than the cache: the topic may have
        // grown. Re-read it; a record no task reads is not claimed.
        check_width(state, fact, Some((partition, delivery.offset))).await?;
        // Reads route this key to task `expected`; the producer's partitioner disagreed.
        tracing::error!(topic, partition, expected, %partitioner, "the producer did not partition by the topic's partitioner");
    }
    tracing::info!(topic, partition, offset = delivery.offset, causes = past.len(), trace_id = %trace.trace_id_hex(),
        "write acknowledged");
    Ok((channel, delivery.offset))
}

/// Refuses a write (`409 width-changed`) to a topic whose partition count is not the task
/// count some model receiving it recorded. A mismatch seen in the caches is re-read from the
/// broker and the database before refusing (`written` set: re-read unconditionally, the
/// record is already in the log). Returns the topic's fact as last read.
pub async fn check_width(
    state: &AppState,
    fact: TopicFact,
    written: Option<(u32, i64)>,
) -> Result<TopicFact, ApiError> {
    let models = state.models_receiving(&fact.name);
    let mismatch = |fact: &TopicFact, widths: &crate::widths::RecordedWidths| {
        models.iter().find_map(|m| match widths.cached(m) {
            Some(Some(n)) if n != fact.partitions => Some((m.to_string(), n)),
            _ => None,
        })
    };
    if !state.widths.loaded() {
        state.widths.refresh(&state.pool, &state.model_names()).await.map_err(|e| widths_unavailable(state, e))?;
    }
    if written.is_none() && mismatch(&fact, &state.widths).is_none() {
        return Ok(fact);
    }
    // Re-read both sides; on a failure, decide on what is cached.
    let fact = match state.facts.refresh_topics(std::slice::from_ref(&fact.name)).await {
        Ok(()) => state.facts.cached_topic(&fact.name).unwrap_or(fact),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "re-reading a topic's partition count failed");
            fact
        }
    };
    if let Err(e) = state.widths.refresh(&state.pool, &state.model_names()).await {
        tracing::warn!(error = %format!("{e:#}"), "re-reading the models' recorded widths failed");
    }
    match mismatch(&fact, &state.widths) {
        None => Ok(fact),
        Some((model, task_count)) => {
            state.metrics.add(Metric::WidthChangedTotal, &[("topic", &fact.name)], 1.0);
            tracing::warn!(topic = %fact.name, partitions = fact.partitions, model, task_count, ?written, "write to a topic whose width changed");
            Err(ApiError::WidthChanged { topic: fact.name, partitions: fact.partitions, model, task_count, written })
        }
    }
}

fn widths_unavailable(state: &AppState, e: StoreError) -> ApiError {
    store_errors::failed(e, "the models' recorded widths", state.config.settings.retry_after_s, None)
}

fn write_failed(state: &AppState, topic: &str, e: KafkaError) -> ApiError {
    tracing::warn!(topic, error = %e, "write not acknowledged");
    if e.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageSizeTooLarge) {
        return ApiError::BodyTooLarge { limit: state.config.settings.max_body_bytes };
    }
    ApiError::WriteFailed {
        detail: write_failed_detail(e.rdkafka_error_code()),
        retry_after: state.config.settings.retry_after_s,
        unknown: !surely_not_written(&e),
    }
}

/// Whether a produce error leaves the record surely unwritten: refused before it left the
/// gateway (its queue full, an unknown topic or partition, an invalid argument), or refused
/// by the broker for what it is (too large, invalid, not allowed). Anything else — a timeout
/// above all, or a connection lost while the record was on its way — may have written it.
pub fn surely_not_written(e: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        e,
        KafkaError::MessageProduction(
            C::QueueFull
                | C::UnknownTopic
                | C::UnknownPartition
                | C::InvalidArgument
                | C::MessageSizeTooLarge
                | C::InvalidMessageSize
                | C::InvalidMessage
                | C::InvalidRecord
                | C::InvalidTopic
                | C::InvalidRequiredAcks
                | C::UnknownTopicOrPartition
                | C::TopicAuthorizationFailed
                | C::ClusterAuthorizationFailed
                | C::PolicyViolation
        )
    )
}

/// What a client is told of an unacknowledged write: which side failed, in the gateway's
/// words — never the client library's error names (they are in the log above).
fn write_failed_detail(code: Option<RDKafkaErrorCode>) -> String {
    match code {
        Some(RDKafkaErrorCode::MessageTimedOut | RDKafkaErrorCode::RequestTimedOut) => {
            "Kafka did not acknowledge the write in time; it may or may not have been written".to_string()
        }
        Some(RDKafkaErrorCode::QueueFull) => "the gateway's queue of writes to Kafka is full".to_string(),
        _ => "Kafka refused or could not take the write".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_failures_are_told_without_the_client_library_s_error_names() {
        for code in [
            Some(RDKafkaErrorCode::MessageTimedOut),
            Some(RDKafkaErrorCode::QueueFull),
            Some(RDKafkaErrorCode::NotLeaderForPartition),
            None,
        ] {
            let detail = write_failed_detail(code);
            assert!(detail.contains("Kafka"), "{detail}");
            assert!(!detail.contains("Timed") && !detail.contains("Leader") && !detail.contains('_'), "{detail}");
        }
    }

    #[test]
    fn only_errors_that_leave_a_record_unwritten_give_its_key_up() {
        for code in [RDKafkaErrorCode::QueueFull, RDKafkaErrorCode::MessageSizeTooLarge, RDKafkaErrorCode::UnknownTopic]
        {
            assert!(surely_not_written(&KafkaError::MessageProduction(code)), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::RequestTimedOut,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::BrokerTransportFailure,
        ] {
            assert!(!surely_not_written(&KafkaError::MessageProduction(code)), "{code:?}");
        }
        assert!(!surely_not_written(&KafkaError::Canceled), "a dropped delivery may have been written");
    }
}
