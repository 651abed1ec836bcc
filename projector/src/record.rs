//! What the projector keeps of a Kafka record while the engine holds it: key, value,
//! application headers and timestamp — the engine's payload type — and the framing that
//! stores the headers in one `bytea` column.

use anyhow::bail;
use parsley::codec::CAUSES_HEADER;
use rdkafka::message::Headers as _;

/// A received record's data, as the engine carries it from receipt to delivery. The
/// `parsley.causes` header is not among `headers`: the engine holds it, decoded, as the
/// record's causes (and the store keeps its canonical bytes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordData {
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    /// Application headers in record order; `None` is a header with a null value.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// The record's timestamp in milliseconds since the epoch, when it has one.
    pub timestamp_ms: Option<i64>,
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
    /// Copies what the projector needs out of a borrowed librdkafka message.
    pub fn from_message<M: rdkafka::Message>(m: &M) -> Consumed {
        let mut causes_headers = Vec::new();
        let mut headers = Vec::new();
        if let Some(hs) = m.headers() {
            for h in hs.iter() {
                let value = h.value.map(|v| v.to_vec());
                if h.key == CAUSES_HEADER {
                    causes_headers.push(value);
                } else {
                    headers.push((h.key.to_string(), value));
                }
            }
        }
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
            },
        }
    }
}

/// Encodes headers as: for each header, `u32` name length, name bytes, `i32` value length
/// (`-1` for a null value), value bytes; all integers big-endian. No headers: no bytes.
pub fn encode_headers(headers: &[(String, Option<Vec<u8>>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        out.extend_from_slice(&(name.len() as u32).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
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

/// Decodes [`encode_headers`]; anything else is an error.
pub fn decode_headers(mut bytes: &[u8]) -> anyhow::Result<Vec<(String, Option<Vec<u8>>)>> {
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
        let name = String::from_utf8(take(&mut bytes, len)?.to_vec())
            .map_err(|_| anyhow::anyhow!("stored header name is not UTF-8"))?;
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
        let cases: Vec<Vec<(String, Option<Vec<u8>>)>> = vec![
            vec![],
            vec![("a".into(), None)],
            vec![("trace".into(), Some(b"x\0y".to_vec())), ("".into(), Some(vec![])), ("n".into(), None)],
        ];
        for headers in cases {
            assert_eq!(decode_headers(&encode_headers(&headers)).unwrap(), headers);
        }
    }

    #[test]
    fn damaged_headers_are_errors() {
        let good = encode_headers(&[("abc".into(), Some(b"value".to_vec()))]);
        for cut in 1..good.len() {
            assert!(decode_headers(&good[..cut]).is_err(), "cut at {cut}");
        }
        assert!(decode_headers(&[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xfe]).is_err());
    }
}
