//! Batch writes, `POST /v1/records`: several records, to any topics configured models
//! receive, produced in **one Kafka transaction** — all of them become visible to the
//! projector (a `read_committed` consumer) or none — each stamped with the session's past,
//! and the token merged with every acknowledged coordinate. An order and its payment can
//! be written atomically.
//!
//! Each record is checked exactly as a single write's body is ([`crate::body::parse_batch`]),
//! and its value against its topic's data contract ([`crate::contracts`]); every topic must
//! be received and of its recorded width before anything is produced.
//! `Idempotency-Key` works as for single writes.
//!
//! The gateway keeps a few transactional producers ([`crate::transactions::Transactions`]), each with a
//! `transactional.id` of this gateway (`<prefix>-<pid>-<instance>-<n>`): a transaction holds its
//! producer until it commits or aborts, so batches run at most that many at once and the
//! others wait their turn. A producer whose transaction failed is dropped and made anew.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use parsley::{CausalPast, ChannelId};
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureRecord, Producer as _};
use serde_json::json;

use crate::body::{self, BatchRecord};
use crate::facts_cache::TopicFact;
use crate::metrics::Metric;
use crate::problem::ApiError;
use crate::session::{self, kafka_unavailable, SESSION_HEADER};
use crate::state::AppState;
use crate::trace::TraceContext;
use crate::transactions::blocking;
use crate::write::{self, body_bytes, Settled, Written};
use tracing::Instrument as _;

pub async fn post_batch(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let now = session::unix_now();
    let caller = session::open_session(&state, &headers, now).await?;
    let settings = &state.config.settings;
    let bytes = body_bytes(body, settings.max_body_bytes)?;
    let records = body::parse_batch(&bytes, settings.max_key_bytes, settings.max_batch_records)?;
    let mut facts: Vec<TopicFact> = Vec::new();
    for r in &records {
        if facts.iter().any(|f| f.name == r.topic) {
            continue;
        }
        if !state.receives(&r.topic) {
            return Err(ApiError::UnknownTopic(r.topic.clone(), "is not received by any configured model".into()));
        }
        let fact = match state.facts.topic(&r.topic).await.map_err(|e| kafka_unavailable(&state, e))? {
            Some(f) => f,
            None => return Err(ApiError::UnknownTopic(r.topic.clone(), "does not exist on the broker".into())),
        };
        facts.push(write::check_width(&state, fact, None).await?);
    }
    // All or nothing: every record's topic and key allowed, or nothing is written.
    for r in &records {
        state.config.access.check_write(caller.identity.as_deref(), &r.topic, &[r.record.key.as_str()])?;
    }
    // All or nothing: every value keeps its topic's contract.
    state.contracts.check_batch(&records)?;
    let past = session::sanitize(&state, &caller.past).await?;
    let id = write::claim_id(&headers, &caller)?;
    let route = "/v1/records".to_string();
    let (span, trace) = crate::trace::write_span(&headers, &format!("POST {route}"));
    let written = {
        let (state, past, bytes) = (state.clone(), past.clone(), bytes.clone());
        write::written_apart(&state.clone(), id, route, bytes.clone(), move |claim| {
            async move {
                // Parsed again inside the task, which owns its bytes; checked above already.
                let settings = &state.config.settings;
                let written = match body::parse_batch(&bytes, settings.max_key_bytes, settings.max_batch_records) {
                    Ok(records) => produce_batch(&state, &facts, &past, &records, &trace).await,
                    Err(e) => Err(e.into()),
                };
                match written {
                    Ok(acked) => {
                        tracing::Span::current().record("messaging.batch.message_count", acked.len());
                        let body = json!({"records": acked.iter().map(|(topic, c, offset)| json!({
                        "topic": topic, "partition": c.partition, "offset": offset,
                    })).collect::<Vec<_>>()});
                        let coordinates: Vec<(ChannelId, i64)> = acked.iter().map(|(_, c, o)| (*c, *o)).collect();
                        write::settle(&state, claim, Settled::Done(&write::acknowledgement(&body, &coordinates))).await;
                        Ok((body, coordinates))
                    }
                    Err(e) => {
                        write::settle(&state, claim, Settled::failed(&e)).await;
                        Err(e)
                    }
                }
            }
            .instrument(span)
        })
        .await?
    };
    let (body, coordinates) = match written {
        Written::Replay(ack) => return write::replay(&state, &caller, &past, &ack, now),
        Written::Done(done) => done,
    };
    let merged = coordinates.iter().fold(past, |p, (c, o)| p.merge(*c, *o));
    let token = session::reseal(&state, &caller, merged, now)?;
    Ok((StatusCode::CREATED, [(SESSION_HEADER, token)], Json(body)).into_response())
}

/// Produces `records` in one transaction on a transactional producer; answers each
/// record's topic and acknowledged coordinate, in the order given.
async fn produce_batch(
    state: &AppState,
    facts: &[TopicFact],
    past: &CausalPast,
    records: &[BatchRecord<'_>],
    trace: &TraceContext,
) -> Result<Vec<(String, ChannelId, i64)>, ApiError> {
    let traceparent = trace.header();
    let causes = write::encode_causes(state, past)?;
    let transactions = &state.transactions;
    let (n, mut slot) = transactions.slot().await;
    if slot.is_none() {
        *slot = Some(transactions.make(n).await.map_err(|e| batch_failed(state, "starting transactions", e, None))?);
    }
    let producer = slot.clone().expect("made above");
    let started = Instant::now();
    let p = producer.clone();
    if let Err(e) = blocking(move || p.begin_transaction()).await {
        *slot = None;
        return Err(batch_failed(state, "beginning a transaction", e, None));
    }
    // From here until it commits or aborts, the transaction is open: should this future be
    // dropped (the runtime shutting down), the guard aborts it at once and frees the slot.
    let mut open = OpenTransaction { slot: &mut slot, done: false };
    let mut deliveries = Vec::with_capacity(records.len());
    let mut failed = None;
    for r in records {
        let headers = write::stamped_headers(&r.record.headers, causes.as_deref(), &traceparent);
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&r.topic).key(r.record.key.as_bytes()).headers(headers);
        let fact = facts.iter().find(|f| f.name == r.topic).expect("checked above");
        if let Some(partition) = write::placed_partition(state, &r.topic, &r.record.key, fact) {
            record = record.partition(partition);
        }
        if let Some(v) = r.record.value {
            record = record.payload(v.as_bytes());
        }
        match producer.send_result(record) {
            Ok(delivery) => deliveries.push(delivery),
            Err((e, _)) => {
                failed = Some(e);
                break;
            }
        }
    }
    let mut acked = Vec::with_capacity(records.len());
    if failed.is_none() {
        for (r, delivery) in records.iter().zip(deliveries) {
            match delivery.await {
                Ok(Ok(d)) => {
                    let fact = facts.iter().find(|f| f.name == r.topic).expect("checked above");
                    let partition = u32::try_from(d.partition).unwrap_or(u32::MAX);
                    acked.push((r.topic.clone(), ChannelId::new(fact.id, partition), d.offset));
                }
                Ok(Err((e, _))) => {
                    failed = Some(e);
                    break;
                }
                Err(_) => {
                    failed = Some(KafkaError::Canceled);
                    break;
                }
            }
        }
    }
    let timeout = transactions.timeout();
    if let Some(e) = failed {
        let p = producer.clone();
        let aborted = blocking(move || p.abort_transaction(timeout)).await;
        open.done = true;
        if let Err(abort) = aborted {
            tracing::warn!(error = %abort, "aborting a failed batch's transaction failed; the producer is made anew");
            **open.slot = None;
        }
        return Err(batch_failed(state, "producing a batch", e, Some(false)));
    }
    let p = producer.clone();
    let committed = blocking(move || p.commit_transaction(timeout)).await;
    if let Err(e) = committed {
        let p = producer.clone();
        let aborted = blocking(move || p.abort_transaction(timeout)).await.is_ok();
        open.done = true;
        if !aborted {
            **open.slot = None;
        }
        return Err(batch_failed(state, "committing a batch", e, Some(!aborted)));
    }
    open.done = true;
    state.metrics.observe(Metric::WriteAckSeconds, &[], started.elapsed().as_secs_f64());
    for (topic, channel, offset) in &acked {
        state.facts.note_acknowledged(*channel, *offset);
        state.metrics.add(Metric::WritesTotal, &[("topic", topic)], 1.0);
    }
    state.metrics.add(Metric::BatchesTotal, &[], 1.0);
    tracing::info!(records = acked.len(), causes = past.len(), trace_id = %trace.trace_id_hex(), "batch committed");
    Ok(acked)
}

/// A transaction begun on a slot's producer, aborted at once if dropped before it is done.
struct OpenTransaction<'a, 'b> {
    slot: &'a mut tokio::sync::MutexGuard<'b, Option<rdkafka::producer::FutureProducer>>,
    done: bool,
}

impl Drop for OpenTransaction<'_, '_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // The producer leaves the slot (the next batch makes one anew, whose initialization
        // fences this one); its transaction is aborted off the async threads.
        if let Some(producer) = self.slot.take() {
            tracing::warn!("a batch was dropped mid-transaction; aborting its transaction");
            let timeout = rdkafka::util::Timeout::After(std::time::Duration::from_secs(10));
            tokio::task::spawn_blocking(move || {
                if let Err(e) = producer.abort_transaction(timeout) {
                    tracing::warn!(error = %e, "aborting a dropped batch's transaction failed; the next producer of its slot fences it");
                }
            });
        }
    }
}

/// A batch that did not commit. `unknown`: whether it may have committed anyway (a commit
/// that failed and could not be aborted); `None`: nothing was produced yet.
fn batch_failed(state: &AppState, doing: &str, e: KafkaError, unknown: Option<bool>) -> ApiError {
    tracing::warn!(error = %e, doing, "batch not written");
    let detail = match unknown {
        Some(true) => "Kafka did not confirm the batch's transaction; it may or may not have been committed",
        _ => "Kafka could not write the batch; none of its records was written",
    };
    ApiError::WriteFailed {
        detail: detail.to_string(),
        retry_after: state.config.settings.retry_after_s,
        unknown: unknown == Some(true),
    }
}

#[cfg(test)]
mod tests {
    use crate::body::{parse_batch, InvalidReason};
    use crate::problem::ApiError;

    #[test]
    fn batch_bodies_are_checked_record_by_record() {
        let ok = parse_batch(
            br#"{"records":[{"topic":"orders","key":"o1","value":{"a":1}},{"topic":"payments","key":"o1","value":null,"headers":{"h":"v"}}]}"#,
            64,
            10,
        )
        .unwrap();
        assert_eq!((ok[0].topic.as_str(), ok[0].record.value), ("orders", Some(r#"{"a":1}"#)));
        assert_eq!((ok[1].record.value, ok[1].record.headers.len()), (None, 1));
        for (body, field, reason) in [
            (r#"{"records":[]}"#, Some("records"), InvalidReason::Empty),
            (r#"{"records":[{"topic":"t","key":"","value":1}]}"#, Some("records[0].key"), InvalidReason::Empty),
            (
                r#"{"records":[{"topic":"t","key":"k","value":1},{"topic":"t","key":"k","value":{"a":"\u0000"}}]}"#,
                Some("records[1].value.a"),
                InvalidReason::Nul,
            ),
            (r#"{"records":[{"topic":"t","key":"k","value":1,"extra":1}]}"#, None, InvalidReason::Shape),
            (r#"[]"#, None, InvalidReason::Shape),
        ] {
            match parse_batch(body.as_bytes(), 64, 10) {
                Err(crate::body::BodyError::Invalid { field: f, reason: r, .. }) => {
                    assert_eq!((f.as_deref(), r), (field, reason), "{body}")
                }
                other => panic!("{body}: {other:?}"),
            }
        }
        let many = format!(r#"{{"records":[{}]}}"#, [r#"{"topic":"t","key":"k","value":1}"#; 11].join(","));
        assert!(matches!(
            parse_batch(many.as_bytes(), 64, 10),
            Err(crate::body::BodyError::Invalid { reason: InvalidReason::TooLong, .. })
        ));
        let reserved = br#"{"records":[{"topic":"t","key":"k","value":1,"headers":{"parsley.causes":"x"}}]}"#;
        let e = ApiError::from(parse_batch(reserved, 64, 10).unwrap_err());
        assert_eq!(e.kind(), "reserved-header");
    }
}
