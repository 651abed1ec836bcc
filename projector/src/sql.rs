//! The SQL projection (`projection = "sql"`): the statements configured per topic, run for
//! each delivered record in the step's transaction, in delivery order.
//!
//! Each statement is written with named parameters (`:key`, `:value`, ...; the list is
//! [`parsley_settings::config::STATEMENT_PARAMS`]), turned into `$1..$n` once, at construction, by the
//! store's one rule ([`parsley_settings::sql_params`]); sqlx prepares it once per connection
//! and keeps it. A record with a value runs its topic's `statements`, a tombstone its
//! `tombstone_statements` (none: delivered without effect).
//!
//! A record the statements cannot take is *rejected* ([`ProjectionError::Rejected`]) by
//! its coordinate before any statement runs, when a statement needs what the record cannot
//! give: a `:key` that is not UTF-8 or holds a NUL, a `:value` that is not JSON, a
//! `:headers` name or value that is not UTF-8. A statement the database refuses is
//! classified by [`ProjectionError::database`], naming the statement: a data exception, a
//! constraint (a `CHECK`, a unique key), an exception a trigger or function raises (class
//! `P0`) or a parameter that cannot be encoded rejects the record like any other rejection
//! (`PROJECTION_REJECTED`, or a dead letter); anything else (a missing table, a lost
//! connection, a timeout) fails the step, which is retried.
//!
//! The statements run one record at a time: they are the user's, so nothing here can fold
//! two records into one statement. When a step's batch is rejected, the task applies its
//! records one at a time to name the rejected one (see [`crate::task`]).

use std::collections::BTreeMap;

use anyhow::{anyhow, Context as _};
use parsley_settings::sql_params;
use serde_json::{Map, Value};
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::types::Oid;
use sqlx::postgres::{PgArgumentBuffer, PgTypeInfo};
use sqlx::{PgConnection, Postgres};

use parsley_store::documents::JsonbText;

use crate::documents::ClassifyName as _;
use crate::projection::{Delivered, Projection, ProjectionError, StepContext};
use parsley_settings::config::ModelConfig;

/// A named parameter of a statement, bound per record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Param {
    Key,
    KeyBytes,
    Value,
    ValueBytes,
    Topic,
    Partition,
    Offset,
    Timestamp,
    Headers,
}

impl Param {
    fn named(name: &str) -> Option<Param> {
        Some(match name {
            "key" => Param::Key,
            "key_bytes" => Param::KeyBytes,
            "value" => Param::Value,
            "value_bytes" => Param::ValueBytes,
            "topic" => Param::Topic,
            "partition" => Param::Partition,
            "offset" => Param::Offset,
            "timestamp" => Param::Timestamp,
            "headers" => Param::Headers,
            _ => return None,
        })
    }
}

/// One configured statement, rewritten.
#[derive(Clone, Debug)]
struct Statement {
    /// Where it is configured (`topic "orders" statements[0]`), for messages.
    name: String,
    sql: String,
    /// The parameter of each `$n`, in order.
    params: Vec<Param>,
}

/// A topic's statements.
#[derive(Clone, Debug, Default)]
struct TopicStatements {
    value: Vec<Statement>,
    tombstone: Vec<Statement>,
}

/// The SQL projection of one model.
#[derive(Clone, Debug)]
pub struct SqlProjection {
    topics: BTreeMap<String, TopicStatements>,
}

impl SqlProjection {
    /// The model's statements, rewritten; an error names the statement (configuration
    /// validation has already refused what this refuses).
    pub fn from_model(model: &ModelConfig) -> anyhow::Result<SqlProjection> {
        let mut topics = BTreeMap::new();
        for topic in &model.topics {
            let compile = |key: &str, statements: &[String]| -> anyhow::Result<Vec<Statement>> {
                statements
                    .iter()
                    .enumerate()
                    .map(|(k, text)| {
                        let name = format!("topic {:?} {key}[{k}]", topic.name);
                        let rewritten =
                            sql_params::rewrite(text).map_err(|e| anyhow!("model {}: {name}: {e}", model.name))?;
                        let params = rewritten
                            .names
                            .iter()
                            .map(|n| {
                                Param::named(n).with_context(|| {
                                    format!("model {}: {name} uses the unknown parameter :{n}", model.name)
                                })
                            })
                            .collect::<anyhow::Result<_>>()?;
                        Ok(Statement { name, sql: rewritten.sql, params })
                    })
                    .collect()
            };
            let statements = TopicStatements {
                value: compile("statements", &topic.statements)?,
                tombstone: compile("tombstone_statements", &topic.tombstone_statements)?,
            };
            topics.insert(topic.name.clone(), statements);
        }
        Ok(SqlProjection { topics })
    }
}

/// A record's timestamp bound as `timestamptz`: milliseconds since the Unix epoch, sent in
/// Postgres' binary form (microseconds since 2000-01-01 UTC).
struct Timestamptz(i64);

/// Milliseconds from the Unix epoch to 2000-01-01 UTC, Postgres' epoch.
const POSTGRES_EPOCH_MS: i64 = 946_684_800_000;
/// `timestamptz`'s type OID (built in, fixed).
const TIMESTAMPTZ_OID: u32 = 1184;

impl sqlx::Type<Postgres> for Timestamptz {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(Oid(TIMESTAMPTZ_OID))
    }
}

impl sqlx::Encode<'_, Postgres> for Timestamptz {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        let micros = (self.0 - POSTGRES_EPOCH_MS).checked_mul(1000).ok_or("timestamp out of range")?;
        buf.extend(&micros.to_be_bytes());
        Ok(IsNull::No)
    }
}

/// What a record gives the statements that is derived (checked) from its bytes: computed
/// once per record, only when one of its statements uses it.
#[derive(Default)]
struct Derived<'a> {
    key: Option<&'a str>,
    /// The value's JSON text, checked to be JSON but not parsed into numbers: bound as
    /// `jsonb` text, so Postgres reads every number as `numeric`, all its digits kept.
    value: Option<&'a str>,
    headers: Option<Value>,
}

fn derive<'a>(record: &Delivered<'a>, statements: &[Statement]) -> Result<Derived<'a>, ProjectionError> {
    let uses = |p: Param| statements.iter().any(|s| s.params.contains(&p));
    let mut derived = Derived::default();
    if uses(Param::Key) {
        if let Some(bytes) = record.key {
            let key = std::str::from_utf8(bytes).map_err(|_| {
                ProjectionError::rejected(format!(
                    "the key of {} is not UTF-8, and :key is text (:key_bytes takes any key)",
                    record.coordinate()
                ))
            })?;
            if key.contains('\0') {
                return Err(ProjectionError::rejected(format!(
                    "the key of {} contains a NUL character, which Postgres text cannot store (:key_bytes takes any key)",
                    record.coordinate()
                )));
            }
            derived.key = Some(key);
        }
    }
    if uses(Param::Value) {
        if let Some(bytes) = record.value {
            let value = std::str::from_utf8(bytes).map_err(|_| {
                ProjectionError::rejected(format!(
                    "the value of {} is not UTF-8 ({} bytes), and :value is jsonb (:value_bytes takes any value)",
                    record.coordinate(),
                    bytes.len()
                ))
            })?;
            // A syntax check only: `IgnoredAny` reads numbers without converting them.
            serde_json::from_str::<serde::de::IgnoredAny>(value).map_err(|e| {
                ProjectionError::rejected(format!(
                    "the value of {} is not JSON ({} bytes; {} at line {} column {}), and :value is jsonb \
                     (:value_bytes takes any value)",
                    record.coordinate(),
                    bytes.len(),
                    e.classify_name(),
                    e.line(),
                    e.column()
                ))
            })?;
            derived.value = Some(value);
        }
    }
    if uses(Param::Headers) {
        let mut headers = Map::new();
        for (i, (name, value)) in record.headers.iter().enumerate() {
            let text = |bytes: &[u8], what: &str| {
                std::str::from_utf8(bytes).map(str::to_string).map_err(|_| {
                    ProjectionError::rejected(format!(
                        "the {what} of header {i} of {} is not UTF-8, and :headers holds text",
                        record.coordinate()
                    ))
                })
            };
            let name = text(name, "name")?;
            let value = match value {
                Some(v) => Value::String(text(v, "value")?),
                None => Value::Null,
            };
            headers.insert(name, value);
        }
        derived.headers = Some(Value::Object(headers));
    }
    Ok(derived)
}

impl Projection for SqlProjection {
    async fn apply(
        &self,
        conn: &mut PgConnection,
        _step: StepContext<'_>,
        record: &Delivered<'_>,
    ) -> Result<(), ProjectionError> {
        let topic = self.topics.get(record.topic).ok_or_else(|| {
            ProjectionError::Transient(anyhow!("{} is of a topic the model has no statements for", record.coordinate()))
        })?;
        let statements = if record.value.is_some() { &topic.value } else { &topic.tombstone };
        if statements.is_empty() {
            return Ok(());
        }
        let derived = derive(record, statements)?;
        for statement in statements {
            let mut query = sqlx::query(&statement.sql);
            for param in &statement.params {
                query = match param {
                    Param::Key => query.bind(derived.key),
                    Param::KeyBytes => query.bind(record.key),
                    Param::Value => query.bind(derived.value.map(JsonbText)),
                    Param::ValueBytes => query.bind(record.value),
                    Param::Topic => query.bind(record.topic),
                    Param::Partition => query.bind(record.channel.partition as i32),
                    Param::Offset => query.bind(record.position),
                    Param::Timestamp => query.bind(record.timestamp_ms.map(Timestamptz)),
                    Param::Headers => query.bind(derived.headers.as_ref()),
                };
            }
            query
                .execute(&mut *conn)
                .await
                .map_err(|e| ProjectionError::database(e, &format!("{} on {}", statement.name, record.coordinate())))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parsley::channel::ChannelId;
    use parsley::{CausalPast, TopicId};

    fn model(toml: &str) -> ModelConfig {
        parsley_settings::config::Config::parse(toml).unwrap().models.remove(0)
    }

    const MODEL: &str = r#"
[[models]]
name = "m"
projection = "sql"
[[models.topics]]
name = "orders"
statements = ["INSERT INTO t VALUES (:key, :value, :offset, :key)", "SELECT :headers, :timestamp::text, ':key'"]
tombstone_statements = ["DELETE FROM t WHERE id = :key_bytes"]
[[models.topics]]
name = "payments"
"#;

    #[test]
    fn statements_are_rewritten_per_topic() {
        let p = SqlProjection::from_model(&model(MODEL)).unwrap();
        let orders = &p.topics["orders"];
        assert_eq!(orders.value[0].sql, "INSERT INTO t VALUES ($1, $2, $3, $1)");
        assert_eq!(orders.value[0].params, [Param::Key, Param::Value, Param::Offset]);
        assert_eq!(orders.value[1].sql, "SELECT $1, $2::text, ':key'");
        assert_eq!(orders.value[1].name, "topic \"orders\" statements[1]");
        assert_eq!(orders.tombstone[0].params, [Param::KeyBytes]);
        assert!(p.topics["payments"].value.is_empty());
    }

    fn record<'a>(
        key: Option<&'a [u8]>,
        value: Option<&'a [u8]>,
        headers: &'a [crate::record::Header],
        causes: &'a CausalPast,
    ) -> Delivered<'a> {
        Delivered {
            topic: "orders",
            channel: ChannelId::new(TopicId::from_bytes([7; 16]), 3),
            position: 42,
            key,
            value,
            headers,
            timestamp_ms: Some(0),
            causes,
        }
    }

    #[test]
    fn what_a_statement_cannot_take_is_rejected_by_coordinate() {
        let p = SqlProjection::from_model(&model(MODEL)).unwrap();
        let statements = &p.topics["orders"].value;
        let causes = CausalPast::default();
        let fine = [(b"h".to_vec(), Some(b"v".to_vec())), (b"n".to_vec(), None)];
        let d = derive(&record(Some(b"k"), Some(b"{\"a\":1}"), &fine, &causes), statements).unwrap();
        assert_eq!(d.key, Some("k"));
        assert_eq!(d.value, Some("{\"a\":1}"));
        let big =
            derive(&record(Some(b"k"), Some(b"[1e400, 12345678901234567890123456789]"), &[], &causes), statements);
        assert_eq!(big.unwrap().value, Some("[1e400, 12345678901234567890123456789]"), "numbers as written");
        assert_eq!(d.headers, Some(serde_json::json!({"h": "v", "n": null})));
        let bad_header = [(vec![0xff], None)];
        type Case<'a> = (Option<&'a [u8]>, Option<&'a [u8]>, &'a [crate::record::Header], &'a str);
        let cases: [Case<'_>; 5] = [
            (Some(&[0xff]), Some(b"1"), &[], "the key of orders/3@42 is not UTF-8"),
            (Some(b"a\0b"), Some(b"1"), &[], "the key of orders/3@42 contains a NUL"),
            (Some(b"k"), Some(b"{"), &[], "the value of orders/3@42 is not JSON"),
            (Some(b"k"), Some(b"\"\xff\""), &[], "the value of orders/3@42 is not UTF-8"),
            (Some(b"k"), Some(b"1"), &bad_header, "the name of header 0 of orders/3@42 is not UTF-8"),
        ];
        for (key, value, headers, reason) in cases {
            match derive(&record(key, value, headers, &causes), statements) {
                Err(ProjectionError::Rejected { reason: r }) => assert!(r.contains(reason), "{r}"),
                Err(e) => panic!("{reason}: not a rejection: {e}"),
                Ok(_) => panic!("{reason}: accepted"),
            }
        }
        // A tombstone's statements need neither: an absent key and value bind NULL.
        let d = derive(&record(None, None, &[], &causes), &p.topics["orders"].tombstone).unwrap();
        assert!(d.key.is_none() && d.value.is_none() && d.headers.is_none());
    }
}
