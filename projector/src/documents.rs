//! The generic document projection: one JSON document per record key in
//! `projection.documents`. Per topic, a record's value either replaces the document or is
//! applied to it as a JSON merge patch (RFC 7396); a tombstone (null value) deletes it, and
//! so does a value or patch whose result is JSON `null`.
//!
//! A step's deliveries are folded in memory, in delivery order, and written with at most
//! three statements (read the documents merge patches need, upsert, delete; all in
//! [`parsley_store::documents`]), so the cost per step does not grow with a statement per
//! record. A replacing value is checked by a parse that builds nothing and is written as the
//! record carries it (Postgres parses it into `jsonb`); only merge patches, and the documents
//! they apply to, are parsed into values.
//!
//! A record the table cannot take is *rejected* ([`ProjectionError::Rejected`]), named by
//! its coordinate, before any statement runs: no key, a key that is not UTF-8, a NUL
//! character in the key (Postgres `text` cannot store it), a value that is not JSON, or a
//! `\u0000` escape anywhere in the value (Postgres `jsonb` cannot store it). What only the
//! database can see (a key too long for the index, `54000`) is classified from its
//! SQLSTATE ([`ProjectionError::database`]).

use std::borrow::Cow;
use std::collections::BTreeMap;

use anyhow::anyhow;
use parsley::channel::{ChannelId, Position};
use parsley_store::documents::{self, DocumentWrite};
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use sqlx::PgConnection;

use crate::projection::{Delivered, Projection, ProjectionError, StepContext};
use parsley_settings::config::Apply;

/// Applies RFC 7396 JSON merge patch `patch` to `target`.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(fields) => {
            if !target.is_object() {
                *target = Value::Object(Map::new());
            }
            let object = target.as_object_mut().expect("made an object above");
            for (name, value) in fields {
                if value.is_null() {
                    object.remove(name);
                } else {
                    merge_patch(object.entry(name.clone()).or_insert(Value::Null), value);
                }
            }
        }
        other => *target = other.clone(),
    }
}

/// The document projection of one model.
#[derive(Clone, Debug)]
pub struct DocumentProjection {
    apply_by_topic: BTreeMap<String, Apply>,
}

impl DocumentProjection {
    /// `apply_by_topic`: how each received topic's records are applied.
    pub fn new(apply_by_topic: impl IntoIterator<Item = (String, Apply)>) -> Self {
        DocumentProjection { apply_by_topic: apply_by_topic.into_iter().collect() }
    }

    pub fn from_model(model: &parsley_settings::config::ModelConfig) -> Self {
        DocumentProjection::new(model.topics.iter().map(|t| (t.name.clone(), t.apply)))
    }
}

/// One record's effect on a document.
enum Op<'a> {
    Delete,
    /// The record's value, as it came: checked, never parsed into a [`Value`] (only a
    /// merge patch needs the document's structure).
    Replace(&'a str),
    Merge(Value),
}

/// The record's key as document key text, or why the table cannot take it.
fn key_of<'a>(record: &Delivered<'a>) -> Result<&'a str, ProjectionError> {
    let key = record.key.ok_or_else(|| {
        ProjectionError::rejected(format!(
            "{} has no key; the document projection keys documents by record key",
            record.coordinate()
        ))
    })?;
    let key = std::str::from_utf8(key).map_err(|_| {
        ProjectionError::rejected(format!("the key of {} is not UTF-8; document keys are text", record.coordinate()))
    })?;
    if key.contains('\0') {
        return Err(ProjectionError::rejected(format!(
            "the key of {} contains a NUL character, which Postgres text cannot store",
            record.coordinate()
        )));
    }
    Ok(key)
}

fn op_of<'a>(apply: Apply, record: &Delivered<'a>) -> Result<Op<'a>, ProjectionError> {
    let Some(bytes) = record.value else { return Ok(Op::Delete) };
    let not_json = |e: serde_json::Error| {
        ProjectionError::rejected(format!(
            "the value of {} is not JSON ({} bytes; {} at line {} column {}); the document projection needs JSON values",
            record.coordinate(),
            bytes.len(),
            e.classify_name(),
            e.line(),
            e.column()
        ))
    };
    let has_nul = || {
        ProjectionError::rejected(format!(
            "the value of {} contains a \\u0000 escape (a NUL character), which Postgres jsonb cannot store",
            record.coordinate()
        ))
    };
    match apply {
        Apply::Replace => {
            let scan: Scan = serde_json::from_slice(bytes).map_err(not_json)?;
            if scan.nul {
                return Err(has_nul());
            }
            if scan.null {
                return Ok(Op::Delete);
            }
            // The parser checked every string as UTF-8, and JSON outside strings is ASCII.
            let text = std::str::from_utf8(bytes)
                .map_err(|_| anyhow!("{}: a value the JSON parser accepted is not UTF-8", record.coordinate()))?;
            Ok(Op::Replace(text))
        }
        Apply::Merge => {
            let value: Value = serde_json::from_slice(bytes).map_err(not_json)?;
            if contains_nul(&value) {
                return Err(has_nul());
            }
            Ok(if value.is_null() { Op::Delete } else { Op::Merge(value) })
        }
    }
}

/// What parsing a replacing value found: whether it is `null`, and whether a NUL character
/// appears in any string or member name. The parse is `serde_json`'s, so it accepts and
/// rejects exactly what parsing into a [`Value`] does (numbers out of range included), but
/// it builds nothing.
#[derive(Default)]
struct Scan {
    null: bool,
    nul: bool,
}

impl<'de> Deserialize<'de> for Scan {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Scan, D::Error> {
        deserializer.deserialize_any(ScanVisitor)
    }
}

struct ScanVisitor;

impl<'de> Visitor<'de> for ScanVisitor {
    type Value = Scan;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Scan, E> {
        Ok(Scan::default())
    }

    fn visit_i64<E>(self, _: i64) -> Result<Scan, E> {
        Ok(Scan::default())
    }

    fn visit_u64<E>(self, _: u64) -> Result<Scan, E> {
        Ok(Scan::default())
    }

    fn visit_f64<E>(self, _: f64) -> Result<Scan, E> {
        Ok(Scan::default())
    }

    fn visit_str<E>(self, s: &str) -> Result<Scan, E> {
        Ok(Scan { null: false, nul: s.contains('\0') })
    }

    fn visit_unit<E>(self) -> Result<Scan, E> {
        Ok(Scan { null: true, nul: false })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Scan, A::Error> {
        let mut nul = false;
        while let Some(item) = items.next_element::<Scan>()? {
            nul |= item.nul;
        }
        Ok(Scan { null: false, nul })
    }

    fn visit_map<A: MapAccess<'de>>(self, mut members: A) -> Result<Scan, A::Error> {
        let mut nul = false;
        while let Some((name, value)) = members.next_entry::<Scan, Scan>()? {
            nul |= name.nul || value.nul;
        }
        Ok(Scan { null: false, nul })
    }
}

/// Whether a NUL character appears in any string or member name of `value`.
fn contains_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(contains_nul),
        Value::Object(members) => members.iter().any(|(name, v)| name.contains('\0') || contains_nul(v)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

pub(crate) trait ClassifyName {
    fn classify_name(&self) -> &'static str;
}

impl ClassifyName for serde_json::Error {
    fn classify_name(&self) -> &'static str {
        match self.classify() {
            serde_json::error::Category::Io => "I/O error",
            serde_json::error::Category::Syntax => "syntax error",
            serde_json::error::Category::Data => "data error",
            serde_json::error::Category::Eof => "unexpected end",
        }
    }
}

/// A document while a step folds its records: a replacing value's text until a merge patch
/// needs its structure.
enum Doc<'a> {
    Text(&'a str),
    Parsed(Value),
}

impl<'a> Doc<'a> {
    /// The document's structure, for a merge patch.
    fn into_value(self) -> Result<Value, ProjectionError> {
        match self {
            Doc::Parsed(v) => Ok(v),
            Doc::Text(t) => Ok(serde_json::from_str(t).map_err(|e| anyhow!("re-reading a checked value: {e}"))?),
        }
    }

    /// The document as JSON text, for the write: a replacing value's own text, borrowed.
    fn into_text(self) -> Result<Cow<'a, str>, ProjectionError> {
        match self {
            Doc::Text(t) => Ok(Cow::Borrowed(t)),
            Doc::Parsed(v) => {
                Ok(Cow::Owned(serde_json::to_string(&v).map_err(|e| anyhow!("writing a document as JSON: {e}"))?))
            }
        }
    }
}

/// What a step did to one key, folded.
struct Folded<'a> {
    /// The document after the step (`None`: deleted / absent).
    doc: Option<Doc<'a>>,
    /// Records applied since the last delete in this step.
    applied_since_delete: i64,
    /// A delete happened in this step: the stored row goes, the version restarts.
    reset: bool,
}

impl<'a> Folded<'a> {
    /// Applies the key's next operation.
    fn fold(&mut self, op: Op<'a>) -> Result<(), ProjectionError> {
        match op {
            Op::Delete => self.delete(),
            Op::Replace(text) => {
                self.doc = Some(Doc::Text(text));
                self.applied_since_delete += 1;
            }
            Op::Merge(patch) => {
                let mut doc = self.doc.take().map(Doc::into_value).transpose()?.unwrap_or(Value::Null);
                merge_patch(&mut doc, &patch);
                if doc.is_null() {
                    self.delete();
                } else {
                    self.doc = Some(Doc::Parsed(doc));
                    self.applied_since_delete += 1;
                }
            }
        }
        Ok(())
    }

    fn delete(&mut self) {
        self.doc = None;
        self.reset = true;
        self.applied_since_delete = 0;
    }
}

impl Projection for DocumentProjection {
    async fn apply(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        record: &Delivered<'_>,
    ) -> Result<(), ProjectionError> {
        self.apply_batch(conn, step, std::slice::from_ref(record)).await
    }

    async fn apply_batch(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        records: &[Delivered<'_>],
    ) -> Result<(), ProjectionError> {
        if records.is_empty() {
            return Ok(());
        }
        // Parse every record first: a bad one is rejected before any statement runs.
        let mut keys: Vec<&str> = Vec::with_capacity(records.len());
        let mut ops: Vec<Option<(Op<'_>, (ChannelId, Position))>> = Vec::with_capacity(records.len());
        for r in records {
            // Not the record's fault: the projection was built for other topics.
            let apply = *self
                .apply_by_topic
                .get(r.topic)
                .ok_or_else(|| anyhow!("{}: topic {:?} has no document rule", r.coordinate(), r.topic))?;
            keys.push(key_of(r)?);
            ops.push(Some((op_of(apply, r)?, (r.channel, r.position))));
        }

        // The records of each key together, in delivery order within a key, and the keys in
        // order (the writes touch rows in key order, as every step does): one sort of
        // indices, no map node per key.
        let mut order: Vec<u32> = (0..keys.len() as u32).collect();
        order.sort_unstable_by(|a, b| keys[*a as usize].cmp(keys[*b as usize]).then(a.cmp(b)));
        let same_key = |a: &u32, b: &u32| keys[*a as usize] == keys[*b as usize];

        // Which keys need their stored document: those whose first operation is a merge.
        let wanted: Vec<String> = order
            .chunk_by(same_key)
            .filter(|g| matches!(ops[g[0] as usize], Some((Op::Merge(_), _))))
            .map(|g| keys[g[0] as usize].to_string())
            .collect();
        let mut stored: BTreeMap<String, Value> = BTreeMap::new();
        if !wanted.is_empty() {
            let rows = documents::stored(conn, step.model, &wanted)
                .await
                .map_err(|e| ProjectionError::database(e, "reading documents to merge into"))?;
            stored.extend(rows);
        }

        let mut deleted: Vec<String> = Vec::new();
        let mut writes = Vec::with_capacity(order.len());
        for group in order.chunk_by(same_key) {
            let key = keys[group[0] as usize];
            let mut f = Folded { doc: stored.remove(key).map(Doc::Parsed), applied_since_delete: 0, reset: false };
            let mut last = None;
            for i in group {
                let (op, at) = ops[*i as usize].take().expect("each record is folded once");
                last = Some(at);
                f.fold(op)?;
            }
            // A key deleted during the step and written again starts over: delete it first.
            if f.reset {
                deleted.push(key.to_string());
            }
            if let (Some(doc), Some((channel, position))) = (f.doc, last) {
                writes.push(DocumentWrite {
                    key,
                    doc: doc.into_text()?,
                    channel,
                    position,
                    applied: f.applied_since_delete,
                });
            }
        }
        if !deleted.is_empty() {
            documents::delete(conn, step.model, &deleted)
                .await
                .map_err(|e| ProjectionError::database(e, "deleting documents"))?;
        }
        if !writes.is_empty() {
            documents::write(conn, step.model, step.task, writes)
                .await
                .map_err(|e| ProjectionError::database(e, "writing documents"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// RFC 7396, Appendix A.
    #[test]
    fn merge_patch_matches_the_rfc_examples() {
        let cases = [
            (json!({"a":"b"}), json!({"a":"c"}), json!({"a":"c"})),
            (json!({"a":"b"}), json!({"b":"c"}), json!({"a":"b","b":"c"})),
            (json!({"a":"b"}), json!({"a":null}), json!({})),
            (json!({"a":"b","b":"c"}), json!({"a":null}), json!({"b":"c"})),
            (json!({"a":["b"]}), json!({"a":"c"}), json!({"a":"c"})),
            (json!({"a":"c"}), json!({"a":["b"]}), json!({"a":["b"]})),
            (json!({"a":{"b":"c"}}), json!({"a":{"b":"d","c":null}}), json!({"a":{"b":"d"}})),
            (json!({"a":[{"b":"c"}]}), json!({"a":[1]}), json!({"a":[1]})),
            (json!(["a", "b"]), json!(["c", "d"]), json!(["c", "d"])),
            (json!({"a":"b"}), json!(["c"]), json!(["c"])),
            (json!({"a":"foo"}), json!(null), json!(null)),
            (json!({"a":"foo"}), json!("bar"), json!("bar")),
            (json!({"e":null}), json!({"a":1}), json!({"e":null,"a":1})),
            (json!([1, 2]), json!({"a":"b","c":null}), json!({"a":"b"})),
            (json!({}), json!({"a":{"bb":{"ccc":null}}}), json!({"a":{"bb":{}}})),
        ];
        for (target, patch, expected) in cases {
            let mut doc = target.clone();
            merge_patch(&mut doc, &patch);
            assert_eq!(doc, expected, "{target} + {patch}");
        }
    }

    fn record<'a>(causes: &'a parsley::CausalPast, key: Option<&'a [u8]>, value: Option<&'a [u8]>) -> Delivered<'a> {
        Delivered {
            topic: "orders",
            channel: parsley::ChannelId::new(parsley::TopicId::from_bytes([1; 16]), 2),
            position: 7,
            key,
            value,
            headers: &[],
            timestamp_ms: None,
            causes,
        }
    }

    /// The rejection of `(key, value)`, or `None` when the document projection takes it;
    /// the same whether the value replaces the document (checked, not parsed) or is merged
    /// into it (parsed).
    fn rejection(key: Option<&[u8]>, value: Option<&[u8]>) -> Option<String> {
        let causes = parsley::CausalPast::new();
        let r = record(&causes, key, value);
        let [replace, merge] =
            [Apply::Replace, Apply::Merge].map(|apply| match key_of(&r).and_then(|_| op_of(apply, &r)) {
                Ok(_) => None,
                Err(e @ ProjectionError::Rejected { .. }) => Some(e.to_string()),
                Err(e) => panic!("expected a rejection, got {e}"),
            });
        assert_eq!(replace, merge, "{key:?} {value:?}");
        replace
    }

    /// A replacing value is written as it came; `null` deletes, like a tombstone.
    #[test]
    fn a_replacing_value_is_kept_as_its_text() {
        let causes = parsley::CausalPast::new();
        let text = r#"{ "n": 1e2, "s": "\u00e9", "a": [1.5, null] }"#;
        let r = record(&causes, Some(b"k"), Some(text.as_bytes()));
        assert!(matches!(op_of(Apply::Replace, &r), Ok(Op::Replace(t)) if t == text));
        let r = record(&causes, Some(b"k"), Some(b" null "));
        assert!(matches!(op_of(Apply::Replace, &r), Ok(Op::Delete)));
        assert!(matches!(op_of(Apply::Merge, &r), Ok(Op::Delete)));
    }

    #[test]
    fn a_non_json_value_is_rejected_naming_the_coordinate_not_the_bytes() {
        let err = rejection(Some(b"k"), Some(b"secret-not-json")).expect("not JSON, yet parsed");
        assert!(err.contains("orders/2@7") && err.contains("not JSON"), "{err}");
        assert!(!err.contains("secret"), "payload bytes leaked into: {err}");
    }

    #[test]
    fn records_the_table_cannot_take_are_rejected_before_any_statement() {
        type Case<'a> = (Option<&'a [u8]>, Option<&'a [u8]>, &'a str);
        let cases: [Case<'_>; 10] = [
            (None, Some(b"{}"), "has no key"),
            (Some(b"\xff\xfe"), Some(b"{}"), "not UTF-8"),
            (Some(b"a\0b"), Some(b"{}"), "NUL character"),
            (Some(b"k"), Some(br#"{"a":"x\u0000y"}"#), "\\u0000"),
            (Some(b"k"), Some(br#"{"a\u0000":1}"#), "\\u0000"),
            (Some(b"k"), Some(br#"[[{"deep":["\u0000"]}]]"#), "\\u0000"),
            (Some(b"k"), Some(b"{\"a\":\"x\0y\"}"), "not JSON"),
            (Some(b"k"), Some(br#""\ud800""#), "not JSON"),
            (Some(b"k"), Some(b"[1e400]"), "not JSON"),
            (Some(b"k"), Some(b"{\"a\":1} x"), "not JSON"),
        ];
        for (key, value, expected) in cases {
            let err = rejection(key, value).unwrap_or_else(|| panic!("{key:?} {value:?} was accepted"));
            assert!(err.contains(expected) && err.contains("orders/2@7"), "{key:?} {value:?}: {err}");
        }
        assert_eq!(rejection(Some(b"k"), Some(br#"{"a":"\u0001 ok","b":[1,null,true]}"#)), None);
        assert_eq!(rejection(Some("ключ".as_bytes()), None), None, "a tombstone needs no JSON");
    }
}
