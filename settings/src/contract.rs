//! Data contracts: a received topic's JSON Schema (draft 2020-12), named by the topic's
//! `schema` key (a file path, relative to the working directory like a model's
//! `migrations`), read and compiled when the configuration is loaded. The gateway checks
//! every value written to the topic against it before producing (`400 value-invalid`), and
//! the projector every value it reads from the topic before the projection applies it (a
//! rejection naming the JSON pointer: `PROJECTION_REJECTED`, or whatever the model's
//! `on_rejected` says). Both read the same file through this one type, so they hold the
//! same contract.
//!
//! A schema is refused at start, naming the file, when the file is missing, is not JSON, is
//! not a valid draft 2020-12 schema (checked against the meta-schema), declares another
//! draft in `$schema`, or references anything outside itself: no reference is ever
//! fetched, over the network or from a file. `format` is an annotation, as the draft says:
//! not asserted.

use std::fmt;
use std::sync::Arc;

use anyhow::{bail, Context as _};
use serde_json::Value;

/// The one `$schema` a contract may declare (it may also declare none).
pub const DRAFT_2020_12: &str = "https://json-schema.org/draft/2020-12/schema";

/// Most violations reported for one value.
pub const MAX_VIOLATIONS: usize = 10;

/// A topic's compiled schema. Cheap to clone; equal when the file's path and schema are.
#[derive(Clone)]
pub struct Contract {
    path: String,
    schema: Arc<Value>,
    validator: Arc<jsonschema::Validator>,
}

/// One way a value breaks a contract.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Where in the value, as a JSON pointer (RFC 6901; `""`: the value itself).
    pub pointer: String,
    /// The schema keyword that failed (`type`, `required`, `minimum`, ...).
    pub keyword: String,
    /// Where in the schema, as a JSON pointer (`/properties/order/type`).
    pub schema_path: String,
    /// What is wrong, quoting the offending part of the value.
    pub message: String,
    /// What is wrong, with the value's own content withheld (`value is not of type
    /// "string"`): for logs and the projector's refusals, which never quote a payload.
    pub masked: String,
}

impl Contract {
    /// Reads and compiles the schema in the file at `path`; every error names the file.
    pub fn load(path: &str) -> anyhow::Result<Contract> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading the schema file {path:?}"))?;
        let schema: Value =
            serde_json::from_str(&text).with_context(|| format!("the schema file {path:?} is not JSON"))?;
        Contract::compile(path, schema)
    }

    /// Compiles `schema`, said to come from `path` (for messages and equality).
    pub fn compile(path: &str, schema: Value) -> anyhow::Result<Contract> {
        if !schema.is_object() && !schema.is_boolean() {
            bail!("the schema in {path:?} is not a JSON Schema: a schema is an object or a boolean");
        }
        if let Some(declared) = schema.get("$schema") {
            if declared.as_str().map(|s| s.trim_end_matches('#')) != Some(DRAFT_2020_12) {
                bail!("the schema in {path:?} declares \"$schema\": {declared}; only draft 2020-12 ({DRAFT_2020_12}) is read");
            }
        }
        if let Err(e) = jsonschema::draft202012::meta::validate(&schema) {
            bail!(
                "the schema in {path:?} is not a valid draft 2020-12 schema: at {:?}: {e}",
                e.instance_path().as_str()
            );
        }
        let validator = jsonschema::draft202012::options()
            .offline()
            .build(&schema)
            .map_err(|e| anyhow::anyhow!("the schema in {path:?} does not compile: {e}"))?;
        Ok(Contract { path: path.to_string(), schema: Arc::new(schema), validator: Arc::new(validator) })
    }

    /// The file the schema was read from, as configured.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The schema as read.
    pub fn schema(&self) -> &Value {
        &self.schema
    }

    /// Whether `value` keeps the contract.
    pub fn is_valid(&self, value: &Value) -> bool {
        self.validator.is_valid(value)
    }

    /// The ways `value` breaks the contract, at most `limit` of them, in the validator's
    /// order; empty when it keeps it.
    pub fn violations(&self, value: &Value, limit: usize) -> Vec<Violation> {
        if self.validator.is_valid(value) {
            return Vec::new();
        }
        self.validator
            .iter_errors(value)
            .take(limit)
            .map(|e| Violation {
                pointer: e.instance_path().as_str().to_string(),
                keyword: e.kind().keyword().to_string(),
                schema_path: e.schema_path().as_str().to_string(),
                message: e.to_string(),
                masked: e.masked().to_string(),
            })
            .collect()
    }

    /// Why a record's value (its bytes as produced) breaks the contract, without quoting
    /// it: `None` when it keeps it. `what` names the record (`the value of orders/3@42`);
    /// the reason names each violation's pointer and keyword (at most [`MAX_VIOLATIONS`]).
    pub fn refusal(&self, what: &str, bytes: &[u8]) -> Option<String> {
        let value: Value = match serde_json::from_slice(bytes) {
            Ok(v) => v,
            Err(e) => {
                return Some(format!(
                    "{what} is not JSON ({} bytes; error at line {} column {}), so it cannot keep the schema {:?}",
                    bytes.len(),
                    e.line(),
                    e.column(),
                    self.path
                ))
            }
        };
        let violations = self.violations(&value, MAX_VIOLATIONS);
        if violations.is_empty() {
            return None;
        }
        let at: Vec<String> = violations
            .iter()
            .map(|v| format!("pointer {:?} (keyword {:?} at {:?}: {})", v.pointer, v.keyword, v.schema_path, v.masked))
            .collect();
        Some(format!("{what} breaks the schema {:?} at {}", self.path, at.join("; ")))
    }
}

impl PartialEq for Contract {
    fn eq(&self, other: &Contract) -> bool {
        self.path == other.path && self.schema == other.schema
    }
}

impl Eq for Contract {}

impl fmt::Debug for Contract {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Contract").field("path", &self.path).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn order() -> Contract {
        Contract::compile(
            "order.json",
            json!({
                "$schema": DRAFT_2020_12,
                "type": "object",
                "required": ["order", "amount"],
                "properties": {
                    "order": {"type": "string", "minLength": 1},
                    "amount": {"type": "number", "minimum": 0}
                }
            }),
        )
        .unwrap()
    }

    #[test]
    fn a_value_is_checked_with_pointers_and_keywords() {
        let c = order();
        assert!(c.is_valid(&json!({"order": "o-1", "amount": 12.5})));
        assert!(c.violations(&json!({"order": "o-1", "amount": 0}), MAX_VIOLATIONS).is_empty());
        let v = c.violations(&json!({"order": null, "amount": -1}), MAX_VIOLATIONS);
        let found: Vec<(&str, &str)> = v.iter().map(|v| (v.pointer.as_str(), v.keyword.as_str())).collect();
        assert!(found.contains(&("/order", "type")), "{v:?}");
        assert!(found.contains(&("/amount", "minimum")), "{v:?}");
        let missing = c.violations(&json!({}), MAX_VIOLATIONS);
        assert_eq!(missing[0].keyword, "required", "{missing:?}");
        assert_eq!(missing[0].pointer, "");
        assert_eq!(c.violations(&json!([1]), MAX_VIOLATIONS)[0].schema_path, "/type");
    }

    #[test]
    fn violations_are_bounded() {
        let c = Contract::compile("x.json", json!({"items": {"type": "string"}})).unwrap();
        let many: Vec<i32> = (0..50).collect();
        assert_eq!(c.violations(&json!(many), MAX_VIOLATIONS).len(), MAX_VIOLATIONS);
        assert_eq!(c.violations(&json!(many), 3).len(), 3);
    }

    #[test]
    fn a_refusal_names_the_pointer_and_never_quotes_the_value() {
        let c = order();
        assert_eq!(c.refusal("the value of orders/0@1", br#"{"order": "o-1", "amount": 1}"#), None);
        let reason = c.refusal("the value of orders/0@1", br#"{"order": 17, "amount": "secret"}"#).unwrap();
        assert!(reason.contains("orders/0@1") && reason.contains("order.json"), "{reason}");
        assert!(
            reason.contains("pointer \"/order\" (keyword \"type\"") && reason.contains("pointer \"/amount\""),
            "{reason}"
        );
        assert!(!reason.contains("secret") && !reason.contains("17"), "{reason}");
        let reason = c.refusal("the value of orders/0@2", b"secret text").unwrap();
        assert!(reason.contains("not JSON") && !reason.contains("secret"), "{reason}");
    }

    #[test]
    fn only_valid_self_contained_2020_12_schemas_compile() {
        let err = |schema: Value| format!("{:#}", Contract::compile("s.json", schema).unwrap_err());
        assert!(err(json!({"type": "strnig"})).contains("not a valid draft 2020-12 schema"));
        assert!(err(json!({"minimum": "five"})).contains("not a valid draft 2020-12 schema"));
        assert!(err(json!("a string")).contains("not a JSON Schema"));
        assert!(err(json!({"$schema": "http://json-schema.org/draft-07/schema#"})).contains("only draft 2020-12"));
        let remote = err(json!({"$ref": "https://example.com/order.json"}));
        assert!(remote.contains("does not compile"), "{remote}");
        assert!(err(json!({"$ref": "file:///etc/passwd"})).contains("does not compile"));
        // Local references resolve; `true` is a schema.
        let local = json!({"$defs": {"id": {"type": "string"}}, "properties": {"order": {"$ref": "#/$defs/id"}}});
        let c = Contract::compile("s.json", local).unwrap();
        assert_eq!(c.violations(&json!({"order": 1}), 10)[0].pointer, "/order");
        assert!(Contract::compile("t.json", json!(true)).is_ok());
        assert!(Contract::compile("s.json", json!({"$schema": format!("{DRAFT_2020_12}#")})).is_ok());
    }

    #[test]
    fn a_file_is_named_when_missing_or_not_json() {
        let dir = std::env::temp_dir().join(format!("parsley-contract-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.json").display().to_string();
        let e = format!("{:#}", Contract::load(&missing).unwrap_err());
        assert!(e.contains(&missing) && e.contains("reading"), "{e}");
        let bad = dir.join("bad.json");
        std::fs::write(&bad, "{not json").unwrap();
        let e = format!("{:#}", Contract::load(&bad.display().to_string()).unwrap_err());
        assert!(e.contains("bad.json") && e.contains("not JSON"), "{e}");
        let good = dir.join("good.json");
        std::fs::write(&good, r#"{"type": "object"}"#).unwrap();
        let c = Contract::load(&good.display().to_string()).unwrap();
        assert!(c.is_valid(&json!({})) && !c.is_valid(&json!(1)));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
