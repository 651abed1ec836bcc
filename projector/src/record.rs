//! What the projector keeps of a Kafka record while the engine holds it: key, value,
//! application headers and timestamp — the engine's payload type — and the framing that
//! stores the headers in one `bytea` column.
//!
//! Nothing read from Kafka is trusted to be text: header names and values are kept as the
//! bytes the record carried (read through `parsley_infra::headers`, since the safe
//! `rdkafka` accessors panic on a name that is not UTF-8). Only `parsley.causes` means
//! anything to the engine; every other header is data.

use anyhow::bail;
use parsley::codec::CAUSES_HEADER;
use rdkafka::message::BorrowedMessage;
use rdkafka::Message as _;

/// One application header: name and value as bytes (`None`: a null value).
pub type Header = (Vec<u8>, Option<Vec<u8>>);

/// A received record's data, as the engine carries it from receipt to delivery. The
/// `parsley.causes` header is not among `headers`: the engine holds it, decoded, as the
/// record's causes (and the store keeps its canonical bytes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordData {
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    /// Application headers in record order, names and values as bytes (a name need not be
    /// UTF-8); `None` is a header with a null value.
    pub headers: Vec<Header>,
    /// The record's timestamp in milliseconds since the epoch, when it has one.
    pub timestamp_ms: Option<i64>,
    /// An operator skipped the record (`parsley.skips`): it is delivered without causes and
    /// without effect, never handed to the projection. Not stored with a held record: a
    /// restore derives it again from the skip table.
    pub skipped: bool,
}

impl RecordData {
    /// What the engine carries for a skipped record: its timestamp and the mark, none of
    /// its bytes (they have no effect, so they are neither held nor projected).
    pub fn skipped(timestamp_ms: Option<i64>) -> RecordData {
        RecordData { timestamp_ms, skipped: true, ..RecordData::default() }
    }
}

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
    /// Copies what the projector needs out of a borrowed librdkafka message, whatever its
    /// bytes: a header is `parsley.causes` only when its name is exactly those bytes.
    pub fn from_message(m: &BorrowedMessage<'_>) -> Consumed {
        let (causes_headers, headers) = split_headers(parsley_infra::headers::message_headers(m));
        Consumed {
            topic: m.topic().to_string(),
            partition: m.partition(),
            offset: m.offset(),
            causes_headers,
            data: RecordData {
                key: m.key().map(|k| k.to_vec()),
                value: m.payload().map(|v| v.to_vec()),
                headers,
                timestamp_ms: m.timestamp().to_millis(),
                skipped: false,
            },
        }
    }
}

/// Splits a record's headers, in record order, into the values of its `parsley.causes`
/// headers (the engine's) and the application's headers (kept as bytes, whatever they hold).
pub fn split_headers(raw: Vec<Header>) -> (Vec<Option<Vec<u8>>>, Vec<Header>) {
    let mut causes = Vec::new();
    let mut headers = Vec::new();
    for (name, value) in raw {
        if name == CAUSES_HEADER.as_bytes() {
            causes.push(value);
        } else {
            headers.push((name, value));
        }
    }
    (causes, headers)
}

/// How many bytes a held record counts for toward `max_held_bytes` (the engine adds its
/// encoded causes): key, value, header names and values, and a fixed 64 bytes for the rest
/// of the row (positions, lengths, timestamp).
pub fn weight(data: &RecordData) -> usize {
    const ROW_OVERHEAD: usize = 64;
    let headers: usize = data.headers.iter().map(|(n, v)| n.len() + v.as_ref().map_or(0, Vec::len) + 8).sum();
    ROW_OVERHEAD + data.key.as_ref().map_or(0, Vec::len) + data.value.as_ref().map_or(0, Vec::len) + headers
}

/// Encodes headers as: for each header, `u32` name length, name bytes, `i32` value length
/// (`-1` for a null value), value bytes; all integers big-endian. No headers: no bytes.
pub fn encode_headers(headers: &[Header]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        out.extend_from_slice(&(name.len() as u32).to_be_bytes());
        out.extend_from_slice(name);
        match value {
            Some(v) => {
                out.extend_from_slice(&(v.len() as i32).to_be_bytes());
                out.extend_from_slice(v);
            }
            None => out.extend_from_slice(&(-1i32).to_be_bytes()),
        }
    }
    out
}

/// Decodes [`encode_headers`]; anything else is an error. Names are bytes, as written.
pub fn decode_headers(mut bytes: &[u8]) -> anyhow::Result<Vec<Header>> {
    fn take<'a>(bytes: &mut &'a [u8], n: usize) -> anyhow::Result<&'a [u8]> {
        if bytes.len() < n {
            bail!("stored headers are truncated");
        }
        let (head, tail) = bytes.split_at(n);
        *bytes = tail;
        Ok(head)
    }
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let len = u32::from_be_bytes(take(&mut bytes, 4)?.try_into().expect("4 bytes")) as usize;
        let name = take(&mut bytes, len)?.to_vec();
        let len = i32::from_be_bytes(take(&mut bytes, 4)?.try_into().expect("4 bytes"));
        let value = match len {
            -1 => None,
            n if n >= 0 => Some(take(&mut bytes, n as usize)?.to_vec()),
            n => bail!("stored header value length {n} is negative"),
        };
        out.push((name, value));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let cases: Vec<Vec<Header>> = vec![
            vec![],
            vec![(b"a".to_vec(), None)],
            vec![(b"trace".to_vec(), Some(b"x\0y".to_vec())), (vec![], Some(vec![])), (b"n".to_vec(), None)],
            vec![(vec![0xff, 0xfe, b'x'], Some(vec![0xc3])), (vec![0x80], None)],
        ];
        for headers in cases {
            assert_eq!(decode_headers(&encode_headers(&headers)).unwrap(), headers);
        }
    }

    #[test]
    fn damaged_headers_are_errors() {
        let good = encode_headers(&[(b"abc".to_vec(), Some(b"value".to_vec()))]);
        for cut in 1..good.len() {
            assert!(decode_headers(&good[..cut]).is_err(), "cut at {cut}");
        }
        assert!(decode_headers(&[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xfe]).is_err());
    }

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
                let (causes, headers) = split_headers(raw.clone());
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
