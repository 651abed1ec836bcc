//! The body of a write, `{"key": string, "value": JSON, "headers": {name: string}?}`, parsed
//! as hostile input: whatever bytes arrive, the answer is a [`WriteBody`] or a named
//! [`BodyError`], never a panic.
//!
//! Refused at the door is everything the projector could never store, since a record the
//! broker accepted is read by its task for good: a poison record would stop its partition.
//! - the key: not a string, empty, longer than `gateway.max_key_bytes`, or holding NUL
//!   (documents are keyed by Postgres `text`, which cannot hold NUL, under a btree index
//!   whose entries are bounded);
//! - the value: NUL in any string or object key (Postgres `jsonb` cannot hold it), a lone
//!   UTF-16 surrogate escape, a number outside the range of a double, a key repeated in one
//!   object (JSON parsers silently keep one of them), nesting deeper than
//!   [`MAX_VALUE_DEPTH`];
//! - the headers: a name that is empty, longer than [`MAX_HEADER_NAME_BYTES`], holds NUL,
//!   repeats, or is in the reserved `parsley.` namespace; a value that is not a string.
//!
//! The value is kept as the exact text the client sent ([`RawValue`]), not re-serialized:
//! the record carries the client's bytes (key order, number spelling) byte for byte. The
//! whitespace around it is not part of it.
//!
//! Each error names where it is (`field`: `key`, `value`, `value.a.b[2]`, `headers.x`) and
//! why (`reason`, a stable name).

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::fmt::{self, Write as _};

use parsley::refusal::check_application_header;
use serde::de::{self, DeserializeSeed, Deserializer as _, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Most levels of arrays and objects in a value (well within the 128 the projector's JSON
/// parser allows).
pub const MAX_VALUE_DEPTH: usize = 64;
/// Longest header name accepted, in bytes.
pub const MAX_HEADER_NAME_BYTES: usize = 256;
/// The largest magnitude of a number in a value: the database stores numbers exactly and
/// gives them back as digits, which beyond this no longer read back as a double.
pub const MAX_NUMBER_MAGNITUDE: f64 = 1e308;

/// A checked write body.
#[derive(Debug, PartialEq, Eq)]
pub struct WriteBody<'a> {
    /// The record key, non-empty, without NUL, at most `max_key_bytes` bytes of UTF-8.
    pub key: String,
    /// The value's JSON text exactly as sent; `None` for `null` (a tombstone).
    pub value: Option<&'a str>,
    /// Application headers in the order sent; names unique.
    pub headers: Vec<(String, String)>,
}

/// Why a body is refused: a stable name, shown as the problem's `reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InvalidReason {
    /// Not JSON, or not the documented object (missing, unknown or repeated fields, wrong
    /// types).
    Shape,
    /// NUL in the key, in a string or object key of the value, or in a header name.
    Nul,
    /// A key repeated in one object of the value, or a header given twice.
    DuplicateKey,
    /// An empty key or header name.
    Empty,
    /// A key or header name longer than its limit.
    TooLong,
    /// Nesting deeper than [`MAX_VALUE_DEPTH`].
    TooDeep,
    /// Valid JSON syntax that no JSON value can hold: a lone surrogate escape, a number
    /// outside the range of a double.
    Unrepresentable,
}

impl InvalidReason {
    pub fn as_str(self) -> &'static str {
        match self {
            InvalidReason::Shape => "shape",
            InvalidReason::Nul => "nul",
            InvalidReason::DuplicateKey => "duplicate-key",
            InvalidReason::Empty => "empty",
            InvalidReason::TooLong => "too-long",
            InvalidReason::TooDeep => "too-deep",
            InvalidReason::Unrepresentable => "unrepresentable",
        }
    }
}

/// A refused body.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// `field` names the part (`None`: the body as a whole).
    #[error("{}{detail}", field.as_ref().map(|f| format!("{f}: ")).unwrap_or_default())]
    Invalid { field: Option<String>, reason: InvalidReason, detail: String },
    /// An application header in the reserved `parsley.` namespace.
    #[error("{0}")]
    ReservedHeader(String),
}

impl BodyError {
    fn invalid(field: impl Into<String>, reason: InvalidReason, detail: impl Into<String>) -> BodyError {
        BodyError::Invalid { field: Some(field.into()), reason, detail: detail.into() }
    }
}

/// The body's shape; the parts are checked one by one after.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire<'a> {
    #[serde(borrow)]
    key: &'a RawValue,
    #[serde(borrow)]
    value: &'a RawValue,
    #[serde(borrow, default)]
    headers: Option<&'a RawValue>,
}

const SHAPE: &str = "expected {\"key\": string, \"value\": JSON or null, \"headers\": {name: string}}";

/// Parses and checks a write body; `max_key_bytes` bounds the key.
pub fn parse(body: &[u8], max_key_bytes: usize) -> Result<WriteBody<'_>, BodyError> {
    let wire: Wire<'_> = serde_json::from_slice(body).map_err(|e| BodyError::Invalid {
        field: None,
        reason: InvalidReason::Shape,
        detail: format!("{SHAPE}: {e}"),
    })?;
    let key = parse_key(wire.key.get(), max_key_bytes)?;
    let value = check_value(wire.value.get())?;
    let headers = match wire.headers {
        None => Vec::new(),
        Some(raw) => parse_headers(raw.get())?,
    };
    Ok(WriteBody { key, value: (value != "null").then_some(value), headers })
}

/// One record of a batch write: its topic and its checked body.
#[derive(Debug, PartialEq, Eq)]
pub struct BatchRecord<'a> {
    pub topic: String,
    pub record: WriteBody<'a>,
}

/// A batch body's shape.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchWire<'a> {
    #[serde(borrow)]
    records: Vec<BatchRecordWire<'a>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchRecordWire<'a> {
    topic: String,
    #[serde(borrow)]
    key: &'a RawValue,
    #[serde(borrow)]
    value: &'a RawValue,
    #[serde(borrow, default)]
    headers: Option<&'a RawValue>,
}

const BATCH_SHAPE: &str =
    "expected {\"records\": [{\"topic\": string, \"key\": string, \"value\": JSON or null, \"headers\": {name: string}}]}";

/// Parses and checks a batch write body — 1 to `max_records` records, each checked as a
/// single write's body ([`parse`]); an error names the record (`records[2].value.a`).
pub fn parse_batch(body: &[u8], max_key_bytes: usize, max_records: usize) -> Result<Vec<BatchRecord<'_>>, BodyError> {
    let wire: BatchWire<'_> = serde_json::from_slice(body).map_err(|e| BodyError::Invalid {
        field: None,
        reason: InvalidReason::Shape,
        detail: format!("{BATCH_SHAPE}: {e}"),
    })?;
    if wire.records.is_empty() || wire.records.len() > max_records {
        return Err(BodyError::invalid(
            "records",
            if wire.records.is_empty() { InvalidReason::Empty } else { InvalidReason::TooLong },
            format!("a batch holds 1 to {max_records} records, not {}", wire.records.len()),
        ));
    }
    let mut out = Vec::with_capacity(wire.records.len());
    for (i, r) in wire.records.into_iter().enumerate() {
        let at = |e: BodyError| match e {
            BodyError::Invalid { field, reason, detail } => BodyError::Invalid {
                field: Some(match field {
                    Some(f) => format!("records[{i}].{f}"),
                    None => format!("records[{i}]"),
                }),
                reason,
                detail,
            },
            BodyError::ReservedHeader(d) => BodyError::ReservedHeader(format!("records[{i}]: {d}")),
        };
        let key = parse_key(r.key.get(), max_key_bytes).map_err(at)?;
        let value = check_value(r.value.get()).map_err(at)?;
        let headers = match r.headers {
            None => Vec::new(),
            Some(raw) => parse_headers(raw.get()).map_err(at)?,
        };
        let record = WriteBody { key, value: (value != "null").then_some(value), headers };
        out.push(BatchRecord { topic: r.topic, record });
    }
    Ok(out)
}

fn parse_key(raw: &str, max_key_bytes: usize) -> Result<String, BodyError> {
    if !raw.starts_with('"') {
        return Err(BodyError::invalid("key", InvalidReason::Shape, "the key must be a JSON string"));
    }
    let key: String = serde_json::from_str(raw).map_err(|e| {
        BodyError::invalid("key", InvalidReason::Unrepresentable, format!("the key is not a valid string: {e}"))
    })?;
    if key.is_empty() {
        return Err(BodyError::invalid("key", InvalidReason::Empty, "the key must not be empty"));
    }
    if key.contains('\0') {
        return Err(BodyError::invalid("key", InvalidReason::Nul, "the key contains NUL (\\u0000)"));
    }
    if key.len() > max_key_bytes {
        return Err(BodyError::invalid(
            "key",
            InvalidReason::TooLong,
            format!("the key is {} bytes of UTF-8, more than the {max_key_bytes} accepted", key.len()),
        ));
    }
    Ok(key)
}

/// Checks a value's text (already valid JSON syntax) and returns it.
pub fn check_value(raw: &str) -> Result<&str, BodyError> {
    let walker = Walker::default();
    let mut de = serde_json::Deserializer::from_str(raw);
    match (Node { walker: &walker, depth: 0 }).deserialize(&mut de) {
        Ok(()) => Ok(raw),
        Err(e) => {
            let ours = walker.failure.borrow_mut().take();
            Err(ours.unwrap_or_else(|| {
                // Not one of ours: serde_json refused a string or number it could scan but
                // not hold.
                let field = walker.field(None);
                BodyError::invalid(field, InvalidReason::Unrepresentable, format!("no JSON value can hold this: {e}"))
            }))
        }
    }
}

/// One step of a value's path.
enum Segment {
    Key(String),
    Index(usize),
}

/// The state of one value's walk: where it is, and the first failure of ours.
#[derive(Default)]
struct Walker {
    path: RefCell<Vec<Segment>>,
    failure: RefCell<Option<BodyError>>,
}

impl Walker {
    /// The field name of the current position, with `last` appended.
    fn field(&self, last: Option<&Segment>) -> String {
        let path = self.path.borrow();
        let mut out = String::from("value");
        for s in path.iter().chain(last) {
            push_segment(&mut out, s);
        }
        out
    }

    fn fail<E: de::Error>(&self, last: Option<&Segment>, reason: InvalidReason, detail: impl Into<String>) -> E {
        let error = BodyError::invalid(self.field(last), reason, detail);
        self.failure.borrow_mut().get_or_insert(error);
        E::custom("refused")
    }
}

/// `.name` for a plain object key, `["..."]` (JSON-escaped) for any other, `[i]` for an
/// index.
fn push_segment(out: &mut String, s: &Segment) {
    match s {
        Segment::Index(i) => {
            let _ = write!(out, "[{i}]");
        }
        Segment::Key(k) if !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') => {
            out.push('.');
            out.push_str(k);
        }
        Segment::Key(k) => {
            let quoted = serde_json::to_string(k).unwrap_or_else(|_| "\"?\"".to_string());
            let _ = write!(out, "[{quoted}]");
        }
    }
}

/// A value at `depth` enclosing arrays and objects.
#[derive(Clone, Copy)]
struct Node<'w> {
    walker: &'w Walker,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for Node<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl Node<'_> {
    fn enter<E: de::Error>(&self) -> Result<Node<'_>, E> {
        if self.depth >= MAX_VALUE_DEPTH {
            return Err(self.walker.fail(
                None,
                InvalidReason::TooDeep,
                format!("the value nests arrays and objects more than {MAX_VALUE_DEPTH} levels deep"),
            ));
        }
        Ok(Node { walker: self.walker, depth: self.depth + 1 })
    }
}

impl<'de> Visitor<'de> for Node<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        // The database keeps a number exactly as written and gives it back as plain digits;
        // within a hair of a double's limit those digits no longer read back as a double,
        // and the document could never be served again.
        if v.abs() > MAX_NUMBER_MAGNITUDE {
            return Err(self.walker.fail(
                None,
                InvalidReason::Unrepresentable,
                format!("a number beyond ±{MAX_NUMBER_MAGNITUDE:e} cannot be read back from the database"),
            ));
        }
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<(), E> {
        if s.contains('\0') {
            return Err(self.walker.fail(None, InvalidReason::Nul, "a string contains NUL (\\u0000)"));
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let child = self.enter()?;
        for index in 0.. {
            self.walker.path.borrow_mut().push(Segment::Index(index));
            let more = seq.next_element_seed(child)?;
            self.walker.path.borrow_mut().pop();
            if more.is_none() {
                break;
            }
        }
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let child = self.enter()?;
        let mut seen = BTreeSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if key.contains('\0') {
                let segment = Segment::Key(key);
                return Err(self.walker.fail(
                    Some(&segment),
                    InvalidReason::Nul,
                    "an object key contains NUL (\\u0000)",
                ));
            }
            if !seen.insert(key.clone()) {
                return Err(self.walker.fail(
                    Some(&Segment::Key(key)),
                    InvalidReason::DuplicateKey,
                    "an object repeats this key (JSON parsers would silently keep only one)",
                ));
            }
            self.walker.path.borrow_mut().push(Segment::Key(key));
            map.next_value_seed(child)?;
            self.walker.path.borrow_mut().pop();
        }
        Ok(())
    }
}

/// Parses the headers object: names checked, values strings, in the order sent.
fn parse_headers(raw: &str) -> Result<Vec<(String, String)>, BodyError> {
    let failure = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_str(raw);
    match de.deserialize_map(HeadersVisitor { failure: &failure }) {
        Ok(headers) => Ok(headers),
        Err(e) => Err(failure.into_inner().unwrap_or_else(|| {
            // The syntax was checked before: a syntax error now is a name no string can hold.
            let reason = match e.classify() {
                serde_json::error::Category::Syntax => InvalidReason::Unrepresentable,
                _ => InvalidReason::Shape,
            };
            BodyError::invalid("headers", reason, format!("headers must be an object of string values: {e}"))
        })),
    }
}

struct HeadersVisitor<'f> {
    failure: &'f RefCell<Option<BodyError>>,
}

impl HeadersVisitor<'_> {
    fn fail<E: de::Error>(&self, error: BodyError) -> E {
        self.failure.borrow_mut().get_or_insert(error);
        E::custom("refused")
    }
}

impl<'de> Visitor<'de> for HeadersVisitor<'_> {
    type Value = Vec<(String, String)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object of string values")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Vec::new())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut headers: Vec<(String, String)> = Vec::new();
        let mut seen = BTreeSet::new();
        while let Some(name) = map.next_key::<String>()? {
            let mut field = String::from("headers");
            push_segment(&mut field, &Segment::Key(name.clone()));
            let invalid = |reason, detail: String| BodyError::invalid(field.clone(), reason, detail);
            if name.is_empty() {
                return Err(self.fail(invalid(InvalidReason::Empty, "a header name must not be empty".into())));
            }
            if name.len() > MAX_HEADER_NAME_BYTES {
                return Err(self.fail(invalid(
                    InvalidReason::TooLong,
                    format!("a header name is {} bytes, more than the {MAX_HEADER_NAME_BYTES} accepted", name.len()),
                )));
            }
            if name.contains('\0') {
                return Err(self.fail(invalid(InvalidReason::Nul, "a header name contains NUL (\\u0000)".into())));
            }
            if let Err(r) = check_application_header(&name) {
                return Err(self.fail(BodyError::ReservedHeader(r.diagnosis)));
            }
            if !seen.insert(name.clone()) {
                return Err(self.fail(invalid(InvalidReason::DuplicateKey, "this header is given twice".into())));
            }
            let value: &RawValue = map.next_value()?;
            let text = value.get();
            if !text.starts_with('"') {
                return Err(self.fail(invalid(InvalidReason::Shape, "a header value must be a JSON string".into())));
            }
            let value: String = serde_json::from_str(text).map_err(|e| {
                self.fail::<A::Error>(invalid(
                    InvalidReason::Unrepresentable,
                    format!("the header value is not a valid string: {e}"),
                ))
            })?;
            headers.push((name, value));
        }
        Ok(headers)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const MAX_KEY: usize = 32;

    fn ok(text: &str) -> WriteBody<'_> {
        parse(text.as_bytes(), MAX_KEY).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    /// `(body, field, reason)`: the body is refused naming that field and reason.
    fn refused(cases: &[(&str, Option<&str>, InvalidReason)]) {
        for &(text, field, reason) in cases {
            match parse(text.as_bytes(), MAX_KEY) {
                Err(BodyError::Invalid { field: f, reason: r, detail }) => {
                    assert_eq!((f.as_deref(), r), (field, reason), "{text}: {detail}");
                    assert!(!detail.is_empty());
                }
                other => panic!("{text}: expected a refusal naming {field:?}, got {other:?}"),
            }
        }
    }

    /// Numbers within a hair of a double's limit are refused: stored exactly, they would
    /// come back as digits no double can hold, and the document could never be read.
    #[test]
    fn numbers_that_could_not_be_read_back_are_refused() {
        ok(r#"{"key":"k","value":1e308}"#);
        ok(r#"{"key":"k","value":-1.5e300}"#);
        ok(r#"{"key":"k","value":123456789012345678901234567890}"#);
        refused(&[
            (r#"{"key":"k","value":-1.7976931348623157e308}"#, Some("value"), InvalidReason::Unrepresentable),
            (
                r#"{"key":"k","value":{"a":[1.7976931348623157e308]}}"#,
                Some("value.a[0]"),
                InvalidReason::Unrepresentable,
            ),
        ]);
    }

    #[test]
    fn the_value_is_kept_byte_for_byte() {
        let b = ok(r#"{"key":"o1","value":  {"b":1, "a":12345678901234567890123, "c":1.50E+3}  }"#);
        assert_eq!(b.value, Some(r#"{"b":1, "a":12345678901234567890123, "c":1.50E+3}"#), "no reordering, no rounding");
        assert_eq!(b.key, "o1");
        assert_eq!(ok(r#"{"key":"o1","value":null}"#).value, None, "null is a tombstone");
        assert_eq!(ok(r#"{"key":"o1","value":" null "}"#).value, Some(r#"" null ""#), "a string is not a tombstone");
        assert_eq!(ok("{\"key\":\"\u{e9}\\u00e9\",\"value\":\"\\ud83d\\ude00\"}").key, "éé", "escapes decode");
        let b = ok(r#"{"key":"k","value":1,"headers":{"b":"2","a":"\u0000 is fine in a value"}}"#);
        assert_eq!(b.headers, vec![("b".into(), "2".into()), ("a".into(), "\0 is fine in a value".into())]);
        assert!(ok(r#"{"key":"k","value":1,"headers":null}"#).headers.is_empty());
        let deep = format!("{}1{}", "[".repeat(MAX_VALUE_DEPTH), "]".repeat(MAX_VALUE_DEPTH));
        ok(&format!(r#"{{"key":"k","value":{deep}}}"#));
        ok(&format!(r#"{{"key":"{}","value":1}}"#, "k".repeat(MAX_KEY)));
        ok(r#"{"key":"k","value":{"a":{"b":1},"b":{"b":2}}}"#);
    }

    #[test]
    fn the_shape_is_checked() {
        use InvalidReason::*;
        refused(&[
            ("", None, Shape),
            ("not json", None, Shape),
            ("[]", None, Shape),
            (r#"{"value":1}"#, None, Shape),
            (r#"{"key":"k"}"#, None, Shape),
            (r#"{"key":"k","value":1,"partition":3}"#, None, Shape),
            (r#"{"key":"k","key":"j","value":1}"#, None, Shape),
            (r#"{"key":"k","value":1} trailing"#, None, Shape),
            (r#"{"key":1,"value":1}"#, Some("key"), Shape),
            (r#"{"key":null,"value":1}"#, Some("key"), Shape),
            (r#"{"key":"k","value":1,"headers":{"h":1}}"#, Some("headers.h"), Shape),
            (r#"{"key":"k","value":1,"headers":["h"]}"#, Some("headers"), Shape),
            ("{\"key\":\"a\u{0}b\",\"value\":1}", None, Shape),
        ]);
        assert!(matches!(parse(b"{\"key\":\"\xff\",\"value\":1}", MAX_KEY), Err(BodyError::Invalid { .. })));
    }

    #[test]
    fn what_cannot_be_stored_is_refused_naming_the_field() {
        use InvalidReason::*;
        let deep = format!("{}1{}", "[".repeat(MAX_VALUE_DEPTH + 1), "]".repeat(MAX_VALUE_DEPTH + 1));
        let deep = format!(r#"{{"key":"k","value":{deep}}}"#);
        let long = format!(r#"{{"key":"{}","value":1}}"#, "k".repeat(MAX_KEY + 1));
        let long_name =
            format!(r#"{{"key":"k","value":1,"headers":{{"{}":"x"}}}}"#, "h".repeat(MAX_HEADER_NAME_BYTES + 1));
        refused(&[
            (r#"{"key":"a\u0000b","value":1}"#, Some("key"), Nul),
            (r#"{"key":"","value":1}"#, Some("key"), Empty),
            (&long, Some("key"), TooLong),
            (r#"{"key":"\ud800","value":1}"#, Some("key"), Unrepresentable),
            (r#"{"key":"k","value":"\u0000"}"#, Some("value"), Nul),
            (r#"{"key":"k","value":{"a":{"b":[0,1,"x\u0000"]}}}"#, Some("value.a.b[2]"), Nul),
            (r#"{"key":"k","value":{"a\u0000":1}}"#, Some(r#"value["a\u0000"]"#), Nul),
            (r#"{"key":"k","value":{"a":1,"b":2,"a":3}}"#, Some("value.a"), DuplicateKey),
            (r#"{"key":"k","value":[{"x.y":{"q":1,"q":1}}]}"#, Some(r#"value[0]["x.y"].q"#), DuplicateKey),
            (r#"{"key":"k","value":{"a":"\ud800"}}"#, Some("value.a"), Unrepresentable),
            (r#"{"key":"k","value":["\udc00x"]}"#, Some("value[0]"), Unrepresentable),
            (r#"{"key":"k","value":{"n":1e999}}"#, Some("value.n"), Unrepresentable),
            (r#"{"key":"k","value":-1e400}"#, Some("value"), Unrepresentable),
            (&deep, Some(&format!("value{}", "[0]".repeat(MAX_VALUE_DEPTH))), TooDeep),
            (r#"{"key":"k","value":1,"headers":{"":"x"}}"#, Some(r#"headers[""]"#), Empty),
            (&long_name, Some(&format!("headers.{}", "h".repeat(MAX_HEADER_NAME_BYTES + 1))), TooLong),
            (r#"{"key":"k","value":1,"headers":{"a\u0000b":"x"}}"#, Some(r#"headers["a\u0000b"]"#), Nul),
            (r#"{"key":"k","value":1,"headers":{"x":"1","x":"2"}}"#, Some("headers.x"), DuplicateKey),
            (r#"{"key":"k","value":1,"headers":{"x":"\udfff"}}"#, Some("headers.x"), Unrepresentable),
            (r#"{"key":"k","value":1,"headers":{"\ud800":"x"}}"#, Some("headers"), Unrepresentable),
        ]);
    }

    #[test]
    fn reserved_headers_are_refused() {
        for name in ["parsley.causes", "Parsley.Anything", "PARSLEY."] {
            let text = format!(r#"{{"key":"k","value":1,"headers":{{"{name}":"x"}}}}"#);
            match parse(text.as_bytes(), MAX_KEY) {
                Err(BodyError::ReservedHeader(d)) => assert!(d.contains(name), "{d}"),
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    /// Any answer is a body or a named refusal; an accepted value is the sent text.
    fn check_any(bytes: &[u8]) {
        match parse(bytes, MAX_KEY) {
            Ok(b) => {
                assert!(!b.key.is_empty() && b.key.len() <= MAX_KEY && !b.key.contains('\0'));
                if let Some(v) = b.value {
                    let text = std::str::from_utf8(bytes).unwrap();
                    assert!(text.contains(v), "the value is a slice of the body");
                    let parsed: serde_json::Value = serde_json::from_str(v).unwrap();
                    assert!(!holds_nul(&parsed), "{v}");
                }
            }
            Err(BodyError::Invalid { detail, .. }) => assert!(!detail.is_empty()),
            Err(BodyError::ReservedHeader(d)) => assert!(d.contains("parsley.")),
        }
    }

    fn holds_nul(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::String(s) => s.contains('\0'),
            serde_json::Value::Array(a) => a.iter().any(holds_nul),
            serde_json::Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || holds_nul(v)),
            _ => false,
        }
    }

    /// JSON text built from hostile pieces: NUL escapes, surrogates, huge numbers,
    /// repeated keys, deep nesting, odd whitespace.
    fn hostile_json() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_string()),
            Just("true".to_string()),
            Just("1e999".to_string()),
            Just("-0".to_string()),
            Just("12345678901234567890123".to_string()),
            Just(r#""\u0000""#.to_string()),
            Just(r#""\ud800""#.to_string()),
            Just(r#""\ud83d\ude00""#.to_string()),
            Just(r#""\udc00\ud800""#.to_string()),
            "[a-z\\x00-\\x1f\"\\\\]{0,6}".prop_map(|s| serde_json::to_string(&s).unwrap()),
            any::<f64>().prop_map(|f| f.to_string()),
        ];
        leaf.prop_recursive(80, 400, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec(
                    (prop_oneof![Just("a"), Just("b"), Just("a\\u0000"), Just("\\ud800")], inner),
                    0..4
                )
                .prop_map(|kv| {
                    let fields: Vec<String> = kv.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
                    format!("{{{}}}", fields.join(","))
                }),
            ]
        })
    }

    proptest! {
        #[test]
        fn fuzz_write_body_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            check_any(&bytes);
        }

        #[test]
        fn fuzz_write_body_hostile_json(
            key in prop_oneof![Just(r#""k""#.to_string()), Just(r#""a\u0000""#.to_string()), Just(r#""""#.to_string()), Just("1".to_string()), "[a-z]{0,40}".prop_map(|s| format!("\"{s}\""))],
            value in hostile_json(),
            headers in prop::option::of(hostile_json()),
            space in "[ \t\n\r]{0,3}",
        ) {
            let body = match headers {
                Some(h) => format!("{{{space}\"key\":{key},\"value\":{space}{value}{space},\"headers\":{h}}}"),
                None => format!("{{\"key\":{key},\"value\":{space}{value}{space}}}"),
            };
            check_any(body.as_bytes());
        }

        #[test]
        fn fuzz_write_body_mutated(cut in 0usize..120, byte in any::<u8>(), value in hostile_json()) {
            let body = format!(r#"{{"key":"k","value":{value},"headers":{{"h":"v"}}}}"#).into_bytes();
            let mut mutated = body.clone();
            let at = cut % mutated.len();
            mutated[at] = byte;
            check_any(&mutated);
            check_any(&body[..at]);
        }
    }
}
