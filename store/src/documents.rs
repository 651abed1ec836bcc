//! Every statement on `projection.documents`, the document projection's table: what the
//! projector's document projection reads and writes inside a step, what the gateway's gated
//! reads serve, and what the demo counts.
//!
//! A gated read is one statement ([`gated_document`], [`gated_page`]): the model's row, the
//! clock rows the gate needs and the documents, in one snapshot (a single statement is one
//! snapshot even at `READ COMMITTED`) and one round trip, prepared once per connection. The
//! model's topic identities are read — by a second statement, by shape — only when its
//! recorded shape is not the one the caller has cached ([`GateInputs::cached`],
//! `parsley.models.shape_id`, which triggers renew on every change of the width, the format
//! or a topic identity).
//!
//! The step's statements return the sqlx error itself, so the projection can tell a value the
//! table refused from an outage (`ProjectionError::database` in the projector).

use std::borrow::Cow;

use parsley::channel::{ChannelId, Position, TopicId};
use parsley::gate::ClockRow;
use serde_json::Value;
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::types::Oid;
use sqlx::postgres::{PgArgumentBuffer, PgArguments, PgHasArrayType, PgRow, PgTypeInfo, Postgres};
use sqlx::query::Query;
use sqlx::{PgConnection, Row as _};
use uuid::Uuid;

use crate::error::{Context as _, StoreError};
use crate::ordering::{channel_of, topic_of, uuid_of, ModelRow};

/// One document as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct Document {
    pub key: String,
    /// The document as JSON text, as Postgres writes a `jsonb` (`doc::text`): every number
    /// with all its digits, never read through a float here, and valid JSON (Postgres wrote
    /// it). Read it with [`Document::value`] where a parsed value is wanted.
    pub doc: String,
    /// How many records were applied to it since it was last created.
    pub version: i64,
}

impl Document {
    /// The document parsed (numbers beyond `f64` lose digits here, not in [`Document::doc`]).
    pub fn value(&self) -> serde_json::Result<Value> {
        serde_json::from_str(&self.doc)
    }
}

/// A document a step writes: its new content, the record that wrote it last, and how many
/// of the step's records were applied to it since its last delete (added to its version).
#[derive(Clone, Debug, PartialEq)]
pub struct DocumentWrite<'a> {
    pub key: &'a str,
    /// The document as JSON text, valid and free of `\u0000` escapes (the projection checked
    /// it): sent to Postgres as it is, which parses it into `jsonb` once. Borrowed from the
    /// record when the record's value is the document.
    pub doc: Cow<'a, str>,
    pub channel: ChannelId,
    pub position: Position,
    pub applied: i64,
}

/// How many documents one upsert statement of a step writes at most: a step's writes go in
/// statements of this many rows, inside the step's one transaction. One statement of a
/// whole step's rows (tens of thousands under a backlog) made Postgres receive arrays of
/// megabytes into fresh memory — page faults were a quarter of its time — and spill the
/// unnested rows past `work_mem` to a temporary file; statements of about a thousand rows
/// stay in reused memory (docs/projector.md, "Smaller statements and free space on the
/// documents' pages").
pub const STATEMENT_ROWS: usize = 1024;

/// The stored documents of `keys` (those that exist), as `(key, document)`.
///
/// One statement for all of `keys`, planned at each call for its own keys and the table as
/// it is then — not kept as a prepared statement, and so is [`delete`]. A prepared
/// statement's generic plan, cached after five runs on a connection (which a new model's
/// first steps reach while its table holds a few rows), looked documents up by model alone
/// and compared every one of them with each key of the list, and kept doing so as the table
/// grew: seconds per statement at a few hundred thousand documents. A plan made for the
/// call looks the keys up by the primary key, or scans the table once with the keys hashed
/// when that is cheaper — which is why the keys are not split into statements of
/// [`STATEMENT_ROWS`]: a scan per part would read the table once per thousand keys
/// (docs/projector.md, "Key lists planned at each call").
pub async fn stored(
    conn: &mut PgConnection,
    model: &str,
    keys: &[String],
) -> Result<Vec<(String, Value)>, sqlx::Error> {
    let rows = sqlx::query("SELECT key, doc FROM projection.documents WHERE model = $1 AND key = ANY($2)")
        .bind(model)
        .bind(keys)
        .persistent(false)
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows.into_iter().map(|row| (row.get(0), row.get(1))).collect())
}

/// Deletes the documents of `keys`: one statement, planned at each call (see [`stored`]).
pub async fn delete(conn: &mut PgConnection, model: &str, keys: &[String]) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM projection.documents WHERE model = $1 AND key = ANY($2)")
        .bind(model)
        .bind(keys)
        .persistent(false)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// JSON text bound as `jsonb` without a parse on this side: `jsonb`'s binary input is a
/// version byte (1) followed by the JSON text, which Postgres parses as it parses any `jsonb`
/// input, numbers as `numeric` (every digit kept). (Binding a `serde_json::Value` would
/// serialize a parsed document back to text, its numbers through `f64`.) The SQL projection
/// binds `:value` with it too.
pub struct JsonbText<'a>(pub &'a str);

impl sqlx::Type<Postgres> for JsonbText<'_> {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(Oid(JSONB_OID))
    }
}

impl PgHasArrayType for JsonbText<'_> {
    fn array_type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(Oid(JSONB_ARRAY_OID))
    }
}

impl sqlx::Encode<'_, Postgres> for JsonbText<'_> {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        buf.push(JSONB_VERSION);
        buf.extend_from_slice(self.0.as_bytes());
        Ok(IsNull::No)
    }
}

/// The `jsonb` type's OID, its array type's, and the version of its binary format.
const JSONB_OID: u32 = 3802;
const JSONB_ARRAY_OID: u32 = 3807;
const JSONB_VERSION: u8 = 1;

/// Writes `writes` (a statement per [`STATEMENT_ROWS`]): a new key is inserted with
/// `applied` as its version, an existing one replaced and its version increased by `applied`.
pub async fn write(
    conn: &mut PgConnection,
    model: &str,
    task: u32,
    writes: Vec<DocumentWrite<'_>>,
) -> Result<(), sqlx::Error> {
    for part in writes.chunks(STATEMENT_ROWS) {
        write_statement(conn, model, task, part).await?;
    }
    Ok(())
}

/// One upsert statement of at most [`STATEMENT_ROWS`] documents.
async fn write_statement(
    conn: &mut PgConnection,
    model: &str,
    task: u32,
    writes: &[DocumentWrite<'_>],
) -> Result<(), sqlx::Error> {
    let n = writes.len();
    let mut keys: Vec<&str> = Vec::with_capacity(n);
    let mut docs: Vec<JsonbText<'_>> = Vec::with_capacity(n);
    let mut topics: Vec<Uuid> = Vec::with_capacity(n);
    let mut partitions: Vec<i32> = Vec::with_capacity(n);
    let mut positions: Vec<i64> = Vec::with_capacity(n);
    let mut counts: Vec<i64> = Vec::with_capacity(n);
    for w in writes {
        keys.push(w.key);
        docs.push(JsonbText(&w.doc));
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

/// What a gated read's one statement returns: the model as recorded, the clock rows the
/// gate asked for, and the data — all from the statement's one snapshot, so the rows served
/// are the rows the clock describes. The data comes back whether or not the clock covers
/// the session; the caller serves it only once the gate says so.
#[derive(Clone, Debug, PartialEq)]
pub struct GatedSnapshot<T> {
    /// The model's recorded width and topic identities, or that they are the cached ones.
    pub model: RecordedModel,
    pub clock: Vec<ClockRow>,
    pub data: T,
}

/// The identity of a model's recorded shape (`parsley.models.shape_id`): a new random value
/// whenever the model's width, its format or any of its topic identities change, set by
/// triggers (migration `20261203000000`), so one value always means one shape — also across
/// a model deleted and recorded again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShapeId(pub(crate) Uuid);

/// The model as a gated statement found it recorded, in the statement's snapshot.
#[derive(Clone, Debug, PartialEq)]
pub enum RecordedModel {
    /// The model has no row: no state yet.
    Absent,
    /// The model's recorded shape is still [`GateInputs::cached`]: its row was not read again.
    Unchanged,
    /// The model's row and topic identities, recorded under `shape`.
    Read { shape: ShapeId, row: ModelRow },
}

impl RecordedModel {
    /// Whether the model has state (a row) in the snapshot.
    pub fn is_recorded(&self) -> bool {
        !matches!(self, RecordedModel::Absent)
    }
}

/// What a gated statement reads besides its data: the clock rows `clock` names, and the
/// model's row — with its topic identities only if its recorded shape is not `cached`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GateInputs {
    pub clock: ClockScope,
    /// The shape the caller holds (`None`: none, read the row in full).
    pub cached: Option<ShapeId>,
}

/// Which clock rows a gated single-key read fetches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClockScope {
    /// Every row of the model.
    All,
    /// What the core's `gate` and `refresh` read for a read served by task `owner` alone,
    /// given the model's `received` topics: every row of the owner (its received channels
    /// for the refresh, the upstream channels for the gate), every row on a channel the
    /// model does not receive (the refresh's upstream meet is over all tasks), and each task's
    /// row on its own channel for the `partitions` the session names (a received pair is
    /// checked on its owner). A superset of those rows is fetched — the received topics'
    /// rows of those tasks — never fewer.
    Owner { owner: u32, received: Vec<TopicId>, partitions: Vec<u32> },
}

/// A gated read's statement: one row of kind 0 — the model's row (all `NULL` when it has
/// none) and the read's data (`$data` columns from `$data_join`ed subqueries) — and one row
/// of kind 1 per clock row the `$clock_filter` keeps (its data columns `$data_nulls`). Two
/// branches of one `UNION ALL`, so one statement and one snapshot. Binds `$1` the model.
///
/// The clock rows come back as rows, not aggregated into arrays: an aggregate in a lateral
/// subquery cost Postgres more than the rest of the statement together (DECISIONS, "A gated
/// read's clock rows as rows"). The topic identities are not part of it: a caller whose
/// cached shape ([`GateInputs::cached`]) is the recorded one needs none, and anyone else
/// reads them by shape ([`recorded_model`]).
macro_rules! gated_statement {
    (data: $data:literal, data_join: $data_join:literal, data_nulls: $data_nulls:literal, clock_filter: $clock_filter:expr) => {
        concat!(
            "SELECT 0 AS kind, m.task_count, m.format_version, m.shape_id,
                    NULL::int4 AS task, NULL::uuid AS topic_id, NULL::int4 AS partition, NULL::int8 AS position",
            $data,
            " FROM (SELECT $1::text AS model) AS q
             LEFT JOIN parsley.models m ON m.model = q.model ",
            $data_join,
            " UNION ALL
             SELECT 1, NULL, NULL, NULL, c.task, c.topic_id, c.partition, c.position",
            $data_nulls,
            " FROM parsley.clock c WHERE c.model = $1 AND ",
            $clock_filter
        )
    };
}

/// The clock filter of a statement scoped by [`ClockScope`], over binds `$2..$5`
/// ([`ScopedBinds`]): every row, or the owner's, the rows of channels the model does not
/// receive, and the partitions' own tasks' rows.
macro_rules! scoped_clock_filter {
    () => {
        "($2 OR c.task = $3 OR NOT (c.topic_id = ANY($4)) OR (c.task = c.partition AND c.task = ANY($5)))"
    };
}

/// The model (`$1`) and the binds `$2..$5` of a statement whose clock filter is
/// [`scoped_clock_filter!`], for `scope`: every row, or the owner's, the rows of channels the
/// model does not receive, and the partitions' own tasks.
pub(crate) struct ScopedBinds {
    all: bool,
    owner: i32,
    received: Vec<Uuid>,
    partitions: Vec<i32>,
}

impl ScopedBinds {
    pub(crate) fn of(scope: &ClockScope) -> ScopedBinds {
        match scope {
            ClockScope::All => ScopedBinds { all: true, owner: 0, received: Vec::new(), partitions: Vec::new() },
            ClockScope::Owner { owner, received, partitions } => ScopedBinds {
                all: false,
                owner: *owner as i32,
                received: received.iter().map(uuid_of).collect(),
                partitions: partitions.iter().map(|p| *p as i32).collect(),
            },
        }
    }

    /// `sql` with `model` and these bound as `$1..$5`; the caller binds the rest.
    pub(crate) fn query<'q>(&'q self, sql: &'q str, model: &'q str) -> Query<'q, Postgres, PgArguments> {
        sqlx::query(sql).bind(model).bind(self.all).bind(self.owner).bind(&self.received).bind(&self.partitions)
    }
}

/// How many times a gated read is run again when the model's shape changed between its
/// statement and the reading of the new shape's topic identities (each a rare event: a model
/// recorded, widened or migrated) before it fails.
pub(crate) const SHAPE_ATTEMPTS: usize = 8;

/// [`gated_document`]'s statement; binds `$6` the key.
const GATED_DOCUMENT: &str = gated_statement!(
    data: ", d.doc::text AS doc, d.version",
    data_join: "LEFT JOIN LATERAL (SELECT doc, version FROM projection.documents
                                   WHERE model = q.model AND key = $6) AS d ON true",
    data_nulls: ", NULL, NULL",
    clock_filter: scoped_clock_filter!()
);

/// One document, the model's row (as [`GateInputs`] asks) and the clock rows it names, in one
/// statement (one snapshot even at `READ COMMITTED`; no transaction around it).
pub async fn gated_document(
    conn: &mut PgConnection,
    model: &str,
    key: &str,
    inputs: &GateInputs,
) -> Result<GatedSnapshot<Option<Document>>, StoreError> {
    let binds = ScopedBinds::of(&inputs.clock);
    for _ in 0..SHAPE_ATTEMPTS {
        let rows = binds
            .query(GATED_DOCUMENT, model)
            .bind(key)
            .fetch_all(&mut *conn)
            .await
            .with_context(|| format!("reading a document of model {model:?} with its clock"))?;
        let (head, clock) = split_gated(rows)?;
        let doc: Option<String> = head.try_get("doc")?;
        let data = match doc {
            None => None,
            Some(doc) => Some(Document { key: key.to_string(), doc, version: head.try_get("version")? }),
        };
        if let Some(model) = recorded_model(conn, model, &head, inputs.cached).await? {
            return Ok(GatedSnapshot { model, clock, data });
        }
    }
    Err(shape_kept_changing(model))
}

/// The keys a page may hold: exactly these, and those starting with these prefixes (an
/// authorization rule's key binding).
#[derive(Clone, Copy, Debug)]
pub struct KeysOnly<'a> {
    pub keys: &'a [String],
    pub prefixes: &'a [String],
}

/// At most `limit` documents in key order (those after `after` when given; only the keys
/// `only` allows, when given: filtered in the statement, so the page stays full), the
/// model's row (its topic identities unless its shape is still `cached`) and every clock row
/// of the model, in one statement (one snapshot even at `READ COMMITTED`).
pub async fn gated_page(
    conn: &mut PgConnection,
    model: &str,
    cached: Option<ShapeId>,
    after: Option<&str>,
    limit: i64,
    only: Option<KeysOnly<'_>>,
) -> Result<GatedSnapshot<Vec<Document>>, StoreError> {
    let empty: &[String] = &[];
    let (keys, prefixes) = only.map_or((empty, empty), |o| (o.keys, o.prefixes));
    for _ in 0..SHAPE_ATTEMPTS {
        let rows = sqlx::query(gated_statement!(
            data: ", d.keys, d.docs, d.versions",
            data_join: "CROSS JOIN LATERAL (
                            SELECT array_agg(p.key ORDER BY p.key) AS keys, array_agg(p.doc::text ORDER BY p.key) AS docs,
                                   array_agg(p.version ORDER BY p.key) AS versions
                            FROM (SELECT key, doc, version FROM projection.documents
                                  WHERE model = q.model AND ($2::text IS NULL OR key > $2)
                                    AND ($4 OR key = ANY($5::text[])
                                         OR EXISTS (SELECT 1 FROM unnest($6::text[]) AS o(prefix)
                                                    WHERE starts_with(key, o.prefix)))
                                  ORDER BY key LIMIT $3) AS p) AS d",
            data_nulls: ", NULL, NULL, NULL",
            clock_filter: "true"
        ))
        .bind(model)
        .bind(after)
        .bind(limit)
        .bind(only.is_none())
        .bind(keys)
        .bind(prefixes)
        .fetch_all(&mut *conn)
        .await
        .with_context(|| format!("reading a page of model {model:?} with its clock"))?;
        let (head, clock) = split_gated(rows)?;
        // A stored document that cannot be decoded is an error, never a panic.
        let keys: Vec<String> = head.try_get::<Option<_>, _>("keys")?.unwrap_or_default();
        let docs: Vec<String> = head.try_get::<Option<_>, _>("docs")?.unwrap_or_default();
        let versions: Vec<i64> = head.try_get::<Option<_>, _>("versions")?.unwrap_or_default();
        if keys.len() != docs.len() || keys.len() != versions.len() {
            return Err(StoreError::bug("a page's columns differ in length"));
        }
        let data = keys.into_iter().zip(docs).zip(versions).map(|((key, doc), version)| Document { key, doc, version });
        if let Some(model) = recorded_model(conn, model, &head, cached).await? {
            return Ok(GatedSnapshot { model, clock, data: data.collect() });
        }
    }
    Err(shape_kept_changing(model))
}

/// A gated statement's rows: its one row of kind 0 (the model and the data) and its clock rows.
pub(crate) fn split_gated(rows: Vec<PgRow>) -> Result<(PgRow, Vec<ClockRow>), StoreError> {
    let mut head = None;
    let mut clock = Vec::with_capacity(rows.len().saturating_sub(1));
    for row in rows {
        if row.try_get::<i32, _>("kind")? == 0 {
            if head.is_some() {
                return Err(StoreError::bug("a gated statement returned two model rows"));
            }
            head = Some(row);
            continue;
        }
        let task: i32 = row.try_get("task")?;
        let task = u32::try_from(task).with_context(|| format!("a stored task {task} is negative"))?;
        let channel = channel_of(row.try_get("topic_id")?, row.try_get("partition")?)?;
        clock.push(ClockRow { task, channel, position: row.try_get("position")? });
    }
    Ok((head.context("a gated statement returned no model row")?, clock))
}

/// The model as the gated statement's row `head` found it: absent, the `cached` shape, or
/// another shape, whose topic identities are read now — by that shape, so they are the ones
/// the statement's snapshot recorded (a shape identity names one width, format and set of
/// topic identities, never reused). `None` when the model's shape has changed again since
/// the statement: the caller runs it again.
pub(crate) async fn recorded_model(
    conn: &mut PgConnection,
    model: &str,
    head: &PgRow,
    cached: Option<ShapeId>,
) -> Result<Option<RecordedModel>, StoreError> {
    let Some(task_count) = head.try_get::<Option<i32>, _>("task_count")? else {
        return Ok(Some(RecordedModel::Absent));
    };
    let shape = ShapeId(head.try_get("shape_id")?);
    if cached == Some(shape) {
        return Ok(Some(RecordedModel::Unchanged));
    }
    let task_count = u32::try_from(task_count).with_context(|| format!("a model records {task_count} tasks"))?;
    let format_version = head.try_get("format_version")?;
    let row = sqlx::query(
        "SELECT count(m.model) AS found,
                array_agg(t.topic_name) FILTER (WHERE t.topic_name IS NOT NULL) AS names,
                array_agg(t.topic_id) FILTER (WHERE t.topic_name IS NOT NULL) AS ids
         FROM parsley.models m LEFT JOIN parsley.topics t ON t.model = m.model
         WHERE m.model = $1 AND m.shape_id = $2",
    )
    .bind(model)
    .bind(shape.0)
    .fetch_one(&mut *conn)
    .await
    .with_context(|| format!("reading the topic identities of model {model:?}"))?;
    if row.try_get::<i64, _>("found")? == 0 {
        return Ok(None);
    }
    let names: Vec<String> = row.try_get::<Option<_>, _>("names")?.unwrap_or_default();
    let ids: Vec<Uuid> = row.try_get::<Option<_>, _>("ids")?.unwrap_or_default();
    if names.len() != ids.len() {
        return Err(StoreError::bug("a model's topic names and identities differ in number"));
    }
    let row =
        ModelRow { task_count, format_version, topics: names.into_iter().zip(ids.iter().map(topic_of)).collect() };
    Ok(Some(RecordedModel::Read { shape, row }))
}

/// The error of a read whose model's shape changed [`SHAPE_ATTEMPTS`] times in a row.
pub(crate) fn shape_kept_changing(model: &str) -> StoreError {
    StoreError::conflict(format!(
        "the recorded shape of model {model:?} changed {SHAPE_ATTEMPTS} times during one read"
    ))
}

/// How many documents `model` has; 0 when the table does not exist yet (the migrations have
/// not run in this database).
pub async fn count(conn: &mut PgConnection, model: &str) -> Result<i64, StoreError> {
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
