//! Every statement on `projection.documents`, the document projection's table: what the
//! projector's document projection reads and writes inside a step, what the gateway's gated
//! reads serve, and what the demo counts.
//!
//! The step's statements return the sqlx error itself, so the projection can tell a value the
//! table refused from an outage (`ProjectionError::database` in the projector).

use anyhow::Context as _;
use parsley::channel::{ChannelId, Position};
use serde_json::Value;
use sqlx::{PgConnection, Row as _};
use uuid::Uuid;

use crate::ordering::uuid_of;

/// One document as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct Document {
    pub key: String,
    pub doc: Value,
    /// How many records were applied to it since it was last created.
    pub version: i64,
}

/// A document a step writes: its new content, the record that wrote it last, and how many
/// of the step's records were applied to it since its last delete (added to its version).
#[derive(Clone, Debug, PartialEq)]
pub struct DocumentWrite {
    pub key: String,
    pub doc: Value,
    pub channel: ChannelId,
    pub position: Position,
    pub applied: i64,
}

/// The stored documents of `keys` (those that exist), as `(key, document)`.
pub async fn stored(
    conn: &mut PgConnection,
    model: &str,
    keys: &[String],
) -> Result<Vec<(String, Value)>, sqlx::Error> {
    let rows = sqlx::query("SELECT key, doc FROM projection.documents WHERE model = $1 AND key = ANY($2)")
        .bind(model)
        .bind(keys)
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows.into_iter().map(|row| (row.get(0), row.get(1))).collect())
}

/// Deletes the documents of `keys`.
pub async fn delete(conn: &mut PgConnection, model: &str, keys: &[String]) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM projection.documents WHERE model = $1 AND key = ANY($2)")
        .bind(model)
        .bind(keys)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Writes `writes` (one statement): a new key is inserted with `applied` as its version, an
/// existing one replaced and its version increased by `applied`.
pub async fn write(
    conn: &mut PgConnection,
    model: &str,
    task: u32,
    writes: Vec<DocumentWrite>,
) -> Result<(), sqlx::Error> {
    let n = writes.len();
    let mut keys: Vec<String> = Vec::with_capacity(n);
    let mut docs: Vec<Value> = Vec::with_capacity(n);
    let mut topics: Vec<Uuid> = Vec::with_capacity(n);
    let mut partitions: Vec<i32> = Vec::with_capacity(n);
    let mut positions: Vec<i64> = Vec::with_capacity(n);
    let mut counts: Vec<i64> = Vec::with_capacity(n);
    for w in writes {
        keys.push(w.key);
        docs.push(w.doc);
        topics.push(uuid_of(&w.channel.topic));
        partitions.push(w.channel.partition as i32);
        positions.push(w.position);
        counts.push(w.applied);
    }
    sqlx::query(
        "INSERT INTO projection.documents AS d (model, key, task, doc, topic_id, partition, position, version)
         SELECT $1, u.key, $2, u.doc, u.topic_id, u.partition, u.position, u.applied
         FROM UNNEST($3::text[], $4::jsonb[], $5::uuid[], $6::int4[], $7::int8[], $8::int8[])
              AS u(key, doc, topic_id, partition, position, applied)
         ON CONFLICT (model, key) DO UPDATE SET
           task = EXCLUDED.task, doc = EXCLUDED.doc, topic_id = EXCLUDED.topic_id,
           partition = EXCLUDED.partition, position = EXCLUDED.position,
           version = d.version + EXCLUDED.version, updated_at = now()",
    )
    .bind(model)
    .bind(task as i32)
    .bind(&keys)
    .bind(&docs)
    .bind(&topics)
    .bind(&partitions)
    .bind(&positions)
    .bind(&counts)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The document of `key`, if there is one.
pub async fn document(conn: &mut PgConnection, model: &str, key: &str) -> Result<Option<Document>, sqlx::Error> {
    let row = sqlx::query("SELECT doc, version FROM projection.documents WHERE model = $1 AND key = $2")
        .bind(model)
        .bind(key)
        .fetch_optional(&mut *conn)
        .await?;
    row.map(|r| Ok(Document { key: key.to_string(), doc: r.try_get(0)?, version: r.try_get(1)? })).transpose()
}

/// At most `limit` documents in key order, those after `after` when given.
pub async fn page(
    conn: &mut PgConnection,
    model: &str,
    after: Option<&str>,
    limit: i64,
) -> Result<Vec<Document>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT key, doc, version FROM projection.documents
         WHERE model = $1 AND ($2::text IS NULL OR key > $2)
         ORDER BY key LIMIT $3",
    )
    .bind(model)
    .bind(after)
    .bind(limit)
    .fetch_all(&mut *conn)
    .await?;
    // A stored document that cannot be decoded is an error, never a panic.
    rows.iter().map(|r| Ok(Document { key: r.try_get(0)?, doc: r.try_get(1)?, version: r.try_get(2)? })).collect()
}

/// How many documents `model` has; 0 when the table does not exist yet (the migrations have
/// not run in this database).
pub async fn count(conn: &mut PgConnection, model: &str) -> anyhow::Result<i64> {
    let has_table: bool = sqlx::query_scalar("SELECT to_regclass('projection.documents') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await
        .context("looking for the documents table")?;
    if !has_table {
        return Ok(0);
    }
    sqlx::query_scalar("SELECT count(*) FROM projection.documents WHERE model = $1")
        .bind(model)
        .fetch_one(&mut *conn)
        .await
        .context("counting documents")
}
