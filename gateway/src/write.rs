//! The write path, `POST /v1/topics/{topic}/records`: open and check the session, produce
//! the record with the session's pairs as its `parsley.causes` header (idempotent producer,
//! `acks=all`, murmur2 partitioning), await the broker's acknowledgement, merge the
//! acknowledged coordinate — never a position computed from a log end — and hand back the
//! re-sealed token. A write never waits for the record to become deliverable.

use std::collections::BTreeMap;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use parsley::codec::{self, CAUSES_HEADER};
use parsley::murmur2::partition_for_key;
use parsley::refusal::check_application_header;
use parsley::ChannelId;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::util::Timeout;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::app::AppState;
use crate::problem::ApiError;
use crate::session::{self, kafka_unavailable, SESSION_HEADER};

/// The request body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteRequest {
    pub key: String,
    /// Any JSON value; `null` writes a tombstone (the document is deleted).
    pub value: Value,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

/// Parses and checks a body: JSON of the right shape, no header in the reserved namespace.
pub fn parse_body(body: Result<Bytes, BytesRejection>) -> Result<WriteRequest, ApiError> {
    let body = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::BodyTooLarge { limit: 0 }
        } else {
            ApiError::InvalidBody(r.body_text())
        }
    })?;
    let request: WriteRequest = serde_json::from_slice(&body).map_err(|e| {
        ApiError::InvalidBody(format!(
            "expected {{\"key\": string, \"value\": JSON or null, \"headers\": {{name: string}}}}: {e}"
        ))
    })?;
    for name in request.headers.keys() {
        check_application_header(name).map_err(|r| ApiError::ReservedHeader(r.diagnosis))?;
    }
    Ok(request)
}

pub async fn post_record(
    State(state): State<AppState>,
    topic: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Path(topic) = topic.map_err(|r| ApiError::InvalidPath(r.body_text()))?;
    let now = session::unix_now();
    let caller = session::open_session(&state, &headers, now)?;
    let request = parse_body(body).map_err(|e| match e {
        ApiError::BodyTooLarge { .. } => ApiError::BodyTooLarge { limit: state.config.settings.max_body_bytes },
        other => other,
    })?;
    if !state.receives(&topic) {
        return Err(ApiError::UnknownTopic(topic, "is not received by any configured model".into()));
    }
    let fact = match state.facts.topic(&topic).await.map_err(|e| kafka_unavailable(&state, e))? {
        Some(f) => f,
        None => return Err(ApiError::UnknownTopic(topic, "does not exist on the broker".into())),
    };
    let past = session::sanitize(&state, &caller.past).await?;

    let causes = if past.is_empty() {
        None
    } else {
        let budget = state.config.settings.metadata_budget;
        Some(
            codec::encode_within(&past, budget)
                .map_err(|_| ApiError::MetadataBudgetExceeded { size: codec::encoded_len(&past), budget })?,
        )
    };
    let payload =
        (!request.value.is_null()).then(|| serde_json::to_vec(&request.value).expect("a JSON value serializes"));
    let mut record_headers = OwnedHeaders::new_with_capacity(request.headers.len() + 1);
    for (name, value) in &request.headers {
        record_headers = record_headers.insert(Header { key: name, value: Some(value.as_bytes()) });
    }
    if let Some(c) = &causes {
        record_headers = record_headers.insert(Header { key: CAUSES_HEADER, value: Some(c.as_slice()) });
    }
    let mut record: FutureRecord<'_, [u8], [u8]> =
        FutureRecord::to(&topic).key(request.key.as_bytes()).headers(record_headers);
    if let Some(p) = &payload {
        record = record.payload(p.as_slice());
    }

    let started = Instant::now();
    let delivery = state
        .producer
        .send(record, Timeout::After(state.config.settings.produce_timeout()))
        .await
        .map_err(|(e, _)| write_failed(&state, &topic, e))?;
    state.metrics.observe("parsley_gateway_write_ack_seconds", &[], started.elapsed().as_secs_f64());
    let partition = u32::try_from(delivery.partition)
        .map_err(|_| ApiError::Internal(anyhow::anyhow!("the broker acknowledged partition {}", delivery.partition)))?;
    let channel = ChannelId::new(fact.id, partition);
    state.facts.note_acknowledged(channel, delivery.offset);
    state.metrics.add("parsley_gateway_writes_total", &[("topic", &topic)], 1.0);
    let expected = partition_for_key(request.key.as_bytes(), fact.partitions);
    if expected != partition {
        // Reads route this key to task `expected`; the producer's partitioner disagreed.
        tracing::error!(topic, partition, expected, "the producer did not partition by murmur2 of the key");
    }
    tracing::info!(topic, partition, offset = delivery.offset, causes = past.len(), "write acknowledged");

    let token = session::reseal(&state, &caller, past.merge(channel, delivery.offset), now)?;
    let body = json!({"topic": topic, "partition": partition, "offset": delivery.offset});
    Ok((StatusCode::CREATED, [(SESSION_HEADER, token)], Json(body)).into_response())
}

fn write_failed(state: &AppState, topic: &str, e: KafkaError) -> ApiError {
    tracing::warn!(topic, error = %e, "write not acknowledged");
    if e.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageSizeTooLarge) {
        return ApiError::BodyTooLarge { limit: state.config.settings.max_body_bytes };
    }
    let detail = match e.rdkafka_error_code() {
        Some(code) => format!("{code:?}"),
        None => "the producer failed".to_string(),
    };
    ApiError::WriteFailed { detail, retry_after: state.config.settings.retry_after_s }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<WriteRequest, ApiError> {
        parse_body(Ok(Bytes::from(text.to_string())))
    }

    #[test]
    fn bodies_are_checked_with_a_named_reason() {
        let ok = parse(r#"{"key":"o1","value":{"total":3},"headers":{"trace":"x"}}"#).unwrap();
        assert_eq!(ok.key, "o1");
        assert_eq!(ok.headers.get("trace").map(String::as_str), Some("x"));
        assert!(parse(r#"{"key":"o1","value":null}"#).unwrap().value.is_null(), "null is a tombstone");
        for (text, needle) in [
            ("not json", "expected"),
            (r#"{"value":1}"#, "missing field `key`"),
            (r#"{"key":"k"}"#, "missing field `value`"),
            (r#"{"key":1,"value":1}"#, "invalid type"),
            (r#"{"key":"k","value":1,"extra":true}"#, "unknown field `extra`"),
            (r#"{"key":"k","value":1,"headers":{"h":1}}"#, "invalid type"),
        ] {
            match parse(text) {
                Err(ApiError::InvalidBody(d)) => assert!(d.contains(needle), "{text}: {d}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        for name in ["parsley.causes", "Parsley.Anything"] {
            let text = format!(r#"{{"key":"k","value":1,"headers":{{"{name}":"x"}}}}"#);
            assert!(matches!(parse(&text), Err(ApiError::ReservedHeader(_))), "{name}");
        }
    }
}
