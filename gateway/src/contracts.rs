//! Data contracts at the door: a value written to a topic with a schema (the topic's
//! `schema` in the configuration, compiled by [`parsley_settings::contract`]) is checked
//! against it before anything is produced, single writes and every record of a batch alike.
//! A value that breaks it is `400 value-invalid`, naming each failing JSON pointer and
//! keyword (at most [`MAX_VIOLATIONS`] in all; in a batch, with the record's index and
//! topic), and nothing is produced. A tombstone (`null`) is not checked: it deletes, it
//! carries no value.
//!
//! The projector checks every record it reads from the topic against the same file, so a
//! record from another producer that breaks the contract is rejected there by name
//! (`PROJECTION_REJECTED`, or the model's `on_rejected`).

use std::collections::BTreeMap;

use parsley_settings::config::Config;
use parsley_settings::contract::{Contract, Violation, MAX_VIOLATIONS};
use serde_json::{json, Value};

use crate::body::BatchRecord;
use crate::problem::ApiError;

/// The topics' contracts, by topic name (a topic has one: the configuration's validation
/// refuses two models giving one topic different schemas).
#[derive(Clone, Debug, Default)]
pub struct Contracts(BTreeMap<String, Contract>);

/// One way a written value breaks its topic's contract.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueError {
    /// In a batch: the record's index in `records`.
    pub record: Option<usize>,
    pub topic: String,
    pub violation: Violation,
}

impl ValueError {
    /// The problem document's `errors` item.
    pub fn to_json(&self) -> Value {
        let v = &self.violation;
        let mut item = json!({
            "pointer": v.pointer, "keyword": v.keyword, "schema_path": v.schema_path, "message": v.message,
        });
        if let Some(i) = self.record {
            item["record"] = json!(i);
            item["topic"] = json!(self.topic);
        }
        item
    }
}

impl Contracts {
    /// Every configured topic's contract.
    pub fn of(config: &Config) -> Contracts {
        let mut map = BTreeMap::new();
        for t in config.models.iter().flat_map(|m| &m.topics) {
            if let Some(c) = &t.contract {
                map.entry(t.name.clone()).or_insert_with(|| c.clone());
            }
        }
        Contracts(map)
    }

    /// The contract of topic `name`, if it has one.
    pub fn get(&self, name: &str) -> Option<&Contract> {
        self.0.get(name)
    }

    /// Every topic with a contract, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Contract)> {
        self.0.iter().map(|(n, c)| (n.as_str(), c))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Checks one write's value (`None`: a tombstone) against its topic's contract.
    pub fn check(&self, topic: &str, value: Option<&str>) -> Result<(), ApiError> {
        let mut errors = Vec::new();
        self.collect(topic, value, None, &mut errors)?;
        if errors.is_empty() {
            return Ok(());
        }
        Err(ApiError::ValueInvalid { topic: Some(topic.to_string()), errors })
    }

    /// Checks every record of a batch; all of them keep their contracts, or the batch is
    /// refused naming the records that do not.
    pub fn check_batch(&self, records: &[BatchRecord<'_>]) -> Result<(), ApiError> {
        let mut errors = Vec::new();
        for (i, r) in records.iter().enumerate() {
            if errors.len() >= MAX_VIOLATIONS {
                break;
            }
            self.collect(&r.topic, r.record.value, Some(i), &mut errors)?;
        }
        if errors.is_empty() {
            return Ok(());
        }
        Err(ApiError::ValueInvalid { topic: None, errors })
    }

    /// Adds the ways `value` breaks `topic`'s contract to `errors`, up to [`MAX_VIOLATIONS`]
    /// in all.
    fn collect(
        &self,
        topic: &str,
        value: Option<&str>,
        record: Option<usize>,
        errors: &mut Vec<ValueError>,
    ) -> Result<(), ApiError> {
        let (Some(contract), Some(raw)) = (self.get(topic), value) else { return Ok(()) };
        // The body parser has checked the value is JSON; a failure here is a bug.
        let value: Value = serde_json::from_str(raw)
            .map_err(|e| ApiError::Internal(anyhow::anyhow!("a checked value did not parse again: {e}")))?;
        let room = MAX_VIOLATIONS.saturating_sub(errors.len());
        errors.extend(contract.violations(&value, room).into_iter().map(|violation| ValueError {
            record,
            topic: topic.to_string(),
            violation,
        }));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use parsley_settings::config::{ModelConfig, TopicConfig};
    use serde_json::json;

    use super::*;
    use crate::body::WriteBody;

    fn contracts() -> Contracts {
        let schema = json!({"type": "object", "required": ["order"], "properties": {"order": {"type": "string"}}});
        let mut topic = TopicConfig::named("orders");
        topic.schema = Some("order.json".into());
        topic.contract = Some(Contract::compile("order.json", schema).unwrap());
        let mut config = Config::parse("").unwrap();
        config.models.push(ModelConfig::new("m", vec![topic, TopicConfig::named("payments")]));
        config.validate().unwrap();
        Contracts::of(&config)
    }

    fn record(topic: &str, value: Option<&'static str>) -> BatchRecord<'static> {
        BatchRecord { topic: topic.into(), record: WriteBody { key: "k".into(), value, headers: Vec::new() } }
    }

    #[test]
    fn a_value_is_checked_against_its_topic_s_contract_only() {
        let c = contracts();
        c.check("orders", Some(r#"{"order": "o-1"}"#)).unwrap();
        c.check("orders", None).expect("a tombstone carries no value");
        c.check("payments", Some("17")).expect("no contract");
        let Err(ApiError::ValueInvalid { topic, errors }) = c.check("orders", Some(r#"{"order": null}"#)) else {
            panic!("accepted")
        };
        assert_eq!(topic.as_deref(), Some("orders"));
        assert_eq!(errors.len(), 1);
        let item = errors[0].to_json();
        assert_eq!(
            (&item["pointer"], &item["keyword"], &item["schema_path"]),
            (&json!("/order"), &json!("type"), &json!("/properties/order/type"))
        );
        assert!(item.get("record").is_none());
    }

    #[test]
    fn a_batch_names_its_records_and_reports_at_most_ten() {
        let c = contracts();
        c.check_batch(&[record("orders", Some(r#"{"order": "o"}"#)), record("payments", Some("1"))]).unwrap();
        let batch = [record("payments", Some("1")), record("orders", Some("[]")), record("orders", Some("{}"))];
        let Err(ApiError::ValueInvalid { topic: None, errors }) = c.check_batch(&batch) else { panic!("accepted") };
        let named: Vec<(Option<usize>, &str)> =
            errors.iter().map(|e| (e.record, e.violation.keyword.as_str())).collect();
        assert_eq!(named, [(Some(1), "type"), (Some(2), "required")]);
        assert_eq!(errors[0].to_json()["topic"], "orders");
        let many: Vec<BatchRecord<'static>> = (0..30).map(|_| record("orders", Some("1"))).collect();
        let Err(ApiError::ValueInvalid { errors, .. }) = c.check_batch(&many) else { panic!("accepted") };
        assert_eq!(errors.len(), MAX_VIOLATIONS);
    }
}
