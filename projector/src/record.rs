//! What the projector keeps of a Kafka record while the engine holds it: key, value,
//! application headers and timestamp — the engine's payload type, [`RecordData`], with the
//! framing that stores the headers in one `bytea` column, both owned by `parsley-store`
//! ([`parsley_store::record`]) — read out of a consumed message, and what a held record weighs.
//!
//! Nothing read from Kafka is trusted to be text: header names and values are kept as the
//! bytes the record carried (read through `parsley_infra::headers`, since the safe
//! `rdkafka` accessors panic on a name that is not UTF-8). Only `parsley.causes` means
//! anything to the engine; every other header is data.

use parsley::codec::{DecodeError, HeaderDecoder, CAUSES_HEADER};
use parsley::{CausalPast, ChannelId};
use rdkafka::message::BorrowedMessage;
use rdkafka::Message as _;

pub use parsley_store::record::{decode_headers, encode_headers, Header, RecordData};

/// One consumed record: where it sits, its `parsley.causes` header values, and its data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Consumed {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// The value of every `parsley.causes` header (usually none or one).
    pub causes_headers: Vec<Option<Vec<u8>>>,
    pub data: RecordData,
}

impl Consumed {
    /// The record's bytes as a step's byte bound counts them: key, value, and the names and
    /// values of its headers (`parsley.causes` included).
    pub fn weight(&self) -> usize {
        let causes: usize =
            self.causes_headers.iter().map(|v| CAUSES_HEADER.len() + v.as_ref().map_or(0, Vec::len)).sum();
        step_weight(&self.data, causes)
    }

    /// Copies what the projector needs out of a borrowed librdkafka message, whatever its
    /// bytes: a header is `parsley.causes` only when its name is exactly those bytes.
    pub fn from_message(m: &BorrowedMessage<'_>) -> Consumed {
        // Split as they are read: only the values kept are copied (not the causes header's
        // name, nor a list of every header first).
        let mut split = HeaderSplit::default();
        parsley_infra::headers::for_each_header(m, |name, value| split.push(name, value));
        let HeaderSplit { causes: causes_headers, headers } = split;
        Consumed {
            topic: m.topic().to_string(),
            partition: m.partition(),
            offset: m.offset(),
            causes_headers,
            data: record_data(m, headers),
        }
    }
}

/// A record as a task's step feeds it, read out of a borrowed librdkafka message in one
/// pass: its channel resolved, its `parsley.causes` headers decoded while their bytes are at
/// hand (never copied), the rest copied as [`Consumed::from_message`] copies it.
#[derive(Debug)]
pub struct Fetched {
    /// The record's channel; `Err`: `topic/partition` of a record the task does not receive.
    pub channel: Result<ChannelId, String>,
    pub offset: i64,
    /// What [`parsley::codec::decode_headers`] makes of its `parsley.causes` headers.
    pub causes: Result<CausalPast, DecodeError>,
    pub data: RecordData,
    /// Its bytes as a step's byte bound counts them (as [`Consumed::weight`]).
    pub weight: usize,
}

impl Fetched {
    /// `channel_of` names the channel of a topic and partition the task receives; causes are
    /// decoded with `budget` (the engine's).
    pub fn from_message(
        m: &BorrowedMessage<'_>,
        channel_of: impl FnOnce(&str, i32) -> Option<ChannelId>,
        budget: usize,
    ) -> Fetched {
        let mut causes = HeaderDecoder::new(budget);
        let mut causes_bytes = 0usize;
        let mut headers = Vec::new();
        parsley_infra::headers::for_each_header(m, |name, value| {
            split_header(name, value, &mut headers, |value| {
                causes_bytes += CAUSES_HEADER.len() + value.map_or(0, <[u8]>::len);
                causes.push(value);
            });
        });
        let (topic, partition) = (m.topic(), m.partition());
        let data = record_data(m, headers);
        Fetched {
            channel: channel_of(topic, partition).ok_or_else(|| format!("{topic}/{partition}")),
            offset: m.offset(),
            causes: causes.finish(),
            weight: step_weight(&data, causes_bytes),
            data,
        }
    }
}

/// A record's data: key, value and timestamp copied from `m`, with its application `headers`.
fn record_data(m: &BorrowedMessage<'_>, headers: Vec<Header>) -> RecordData {
    RecordData {
        key: m.key().map(|k| k.to_vec()),
        value: m.payload().map(|v| v.to_vec()),
        headers,
        timestamp_ms: m.timestamp().to_millis(),
        skipped: false,
    }
}

/// What a step's byte bound counts of a record: key, value, application headers' names and
/// values, and `causes_bytes` (its `parsley.causes` headers' names and values).
fn step_weight(data: &RecordData, causes_bytes: usize) -> usize {
    let headers: usize = data.headers.iter().map(|(n, v)| n.len() + v.as_ref().map_or(0, Vec::len)).sum();
    data.key.as_ref().map_or(0, Vec::len) + data.value.as_ref().map_or(0, Vec::len) + headers + causes_bytes
}

/// Splits a record's headers, in record order, into the values of its `parsley.causes`
/// headers (the engine's) and the application's headers (kept as bytes, whatever they hold).
pub fn split_headers(raw: &[Header]) -> (Vec<Option<Vec<u8>>>, Vec<Header>) {
    let mut split = HeaderSplit::default();
    for (name, value) in raw {
        split.push(name, value.as_deref());
    }
    (split.causes, split.headers)
}

/// A record's headers being split, one at a time, into its `parsley.causes` values and the
/// application's headers (both copied out of what they are borrowed from).
#[derive(Default)]
struct HeaderSplit {
    causes: Vec<Option<Vec<u8>>>,
    headers: Vec<Header>,
}

impl HeaderSplit {
    fn push(&mut self, name: &[u8], value: Option<&[u8]>) {
        split_header(name, value, &mut self.headers, |v| self.causes.push(v.map(<[u8]>::to_vec)));
    }
}

/// One header of a record, split: a `parsley.causes` value (the name exactly those bytes)
/// goes to `causes`; any other header is copied into `headers`.
fn split_header(name: &[u8], value: Option<&[u8]>, headers: &mut Vec<Header>, causes: impl FnOnce(Option<&[u8]>)) {
    if name == CAUSES_HEADER.as_bytes() {
        causes(value);
    } else {
        headers.push((name.to_vec(), value.map(<[u8]>::to_vec)));
    }
}

/// How many bytes a held record counts for toward `max_held_bytes` (the engine adds its
/// encoded causes): key, value, header names and values, and a fixed 64 bytes for the rest
/// of the row (positions, lengths, timestamp).
pub fn weight(data: &RecordData) -> usize {
    const ROW_OVERHEAD: usize = 64;
    let headers: usize = data.headers.iter().map(|(n, v)| n.len() + v.as_ref().map_or(0, Vec::len) + 8).sum();
    ROW_OVERHEAD + data.key.as_ref().map_or(0, Vec::len) + data.value.as_ref().map_or(0, Vec::len) + headers
}

#[cfg(test)]
mod tests {
    use super::*;

    mod fuzz {
        //! The header reader's pure half, fuzzed: whatever bytes a record's headers hold,
        //! splitting them, deciding the causes and framing the rest for storage never
        //! panics, and stored framing reads back exactly. `PROPTEST_CASES=<n>` for a long
        //! run (`make fuzz`).
        use parsley::codec::{self, DEFAULT_METADATA_BUDGET};
        use proptest::prelude::*;

        use super::super::*;

        fn name() -> impl Strategy<Value = Vec<u8>> {
            prop_oneof![
                Just(CAUSES_HEADER.as_bytes().to_vec()),
                Just(b"PARSLEY.CAUSES".to_vec()),
                prop::collection::vec(any::<u8>(), 0..24),
            ]
        }

        fn value() -> impl Strategy<Value = Option<Vec<u8>>> {
            prop_oneof![
                Just(None),
                prop::collection::vec(any::<u8>(), 0..64).prop_map(Some),
                // Something close to a causes value: version byte, a count, then noise.
                prop::collection::vec(any::<u8>(), 0..40).prop_map(|mut v| {
                    v.splice(0..0, [0x01, 0x01]);
                    Some(v)
                }),
            ]
        }

        proptest! {
            #[test]
            fn fuzz_header_reader_any_headers(raw in prop::collection::vec((name(), value()), 0..8)) {
                let (causes, headers) = split_headers(&raw);
                prop_assert_eq!(causes.len() + headers.len(), raw.len());
                prop_assert!(headers.iter().all(|(n, _)| n != CAUSES_HEADER.as_bytes()));
                let values: Vec<Option<&[u8]>> = causes.iter().map(|v| v.as_deref()).collect();
                // Decoded or refused with a named class; never a panic, never salvaged.
                match codec::decode_headers(&values, DEFAULT_METADATA_BUDGET) {
                    Ok(past) if values.len() == 1 => {
                        prop_assert_eq!(Some(past.encode()), values[0].map(<[u8]>::to_vec));
                    }
                    Ok(past) => prop_assert!(values.is_empty() && past.is_empty()),
                    Err(e) => prop_assert!(!e.to_string().is_empty()),
                }
                prop_assert_eq!(decode_headers(&encode_headers(&headers)).unwrap(), headers);
            }

            #[test]
            fn fuzz_stored_headers_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..128)) {
                // Damaged stored framing is an error; what decodes is exactly what was stored.
                if let Ok(headers) = decode_headers(&bytes) {
                    prop_assert_eq!(encode_headers(&headers), bytes);
                }
            }
        }
    }

    #[test]
    fn a_record_weighs_its_bytes_plus_a_fixed_overhead() {
        let empty = RecordData::default();
        assert_eq!(weight(&empty), 64);
        let data = RecordData {
            key: Some(b"k1".to_vec()),
            value: Some(vec![0; 100]),
            headers: vec![(b"trace".to_vec(), Some(b"abc".to_vec())), (b"n".to_vec(), None)],
            timestamp_ms: Some(1),
            skipped: false,
        };
        assert_eq!(weight(&data), 64 + 2 + 100 + (5 + 3 + 8) + (1 + 8));
    }
}
