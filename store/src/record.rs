//! What is kept of a Kafka record while the engine holds it — key, value, application
//! headers and timestamp: the engine's payload type, [`RecordData`] — and the framing that
//! stores the headers in one `bytea` column (`parsley.held.headers`,
//! `parsley.dead_letters.headers`, `parsley.skips.causes_headers`).
//!
//! Nothing read from Kafka is trusted to be text: header names and values are kept as the
//! bytes the record carried. Only `parsley.causes` means anything to the engine; every other
//! header is data.

use crate::error::StoreError;

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
pub fn decode_headers(mut bytes: &[u8]) -> Result<Vec<Header>, StoreError> {
    fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Result<&'a [u8], StoreError> {
        if bytes.len() < n {
            return Err(StoreError::bug("stored headers are truncated"));
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
            n => return Err(StoreError::bug(format!("stored header value length {n} is negative"))),
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
}
