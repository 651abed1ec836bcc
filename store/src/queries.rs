//! Gated reads over any table: the gateway's named queries (`[[models.queries]]`) and an
//! embedding program's own statements, each run with the clock rows the gate needs in one
//! snapshot.
//!
//! [`in_snapshot`] opens a `REPEATABLE READ, READ ONLY` transaction: its first statement
//! fixes the snapshot, so the model's row and clock rows (the same statement the document
//! reads start with, [`crate::documents::GateInputs`]) and the caller's data statements all
//! see the same committed state, and nothing in it can write. [`json_rows`] is a named
//! query's data statement: the configured SQL (its `:name` parameters already turned into
//! `$1..$n` by [`crate::sql_params`]) as a subquery, each row as a JSON object's text
//! (`to_jsonb(q)::text`: a `numeric` keeps every digit, never read through a float here), at
//! most a limit of them.

use std::future::Future;
use std::pin::Pin;

use crate::error::{Context as _, StoreError};
use serde_json::Value;
use sqlx::{Connection as _, PgConnection, Postgres, Row as _, Transaction};

use crate::documents::{
    recorded_model, shape_kept_changing, split_gated, GateInputs, GatedSnapshot, RecordedModel, ScopedBinds,
    SHAPE_ATTEMPTS,
};
use parsley::gate::ClockRow;

/// A future borrowing a connection: what a data statement's closure returns.
pub type BoxFuture<'c, T> = Pin<Box<dyn Future<Output = T> + Send + 'c>>;

/// How the snapshot's transaction begins.
const BEGIN_READ_ONLY: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY";

/// `model`'s row and the clock rows `inputs` names, then `data`'s statements, in one
/// read-only snapshot. The outer error is the transaction's or the clock statement's; the
/// data's own error is returned as the snapshot's data (the transaction is rolled back).
pub async fn in_snapshot<T, F>(
    conn: &mut PgConnection,
    model: &str,
    inputs: &GateInputs,
    data: &F,
) -> Result<GatedSnapshot<Result<T, sqlx::Error>>, StoreError>
where
    F: for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<T, sqlx::Error>> + ?Sized,
{
    let (mut tx, snapshot) = begin_with_clock(conn, model, inputs).await?;
    let data = data(&mut tx).await;
    finish(tx, snapshot, data).await
}

/// What bounds a named query's data statement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryBounds {
    /// Most rows (the query's `max_rows` plus the one that says there were more).
    pub limit: i64,
    /// The statement's `statement_timeout`, in milliseconds (`SET LOCAL`); `None`: the
    /// session's.
    pub timeout_ms: Option<u64>,
    /// The rows are sent only while the bytes of those before stay within this: the first
    /// row past it is the last one sent, so a result over it is seen to be over it without
    /// being sent whole.
    pub max_bytes: u64,
}

/// A named query ([`json_rows`]) in one read-only snapshot with `model`'s row and the clock
/// rows `inputs` names, the whole snapshot under `role` when given (`SET LOCAL ROLE`: the
/// model's read role, [`crate::roles::query_role`]). The query runs only if `covered` says
/// the snapshot's clock rows cover the read: otherwise the snapshot ends with its data
/// `None` and no data statement has run. Errors as [`in_snapshot`]'s.
#[allow(clippy::too_many_arguments)]
pub async fn named_query(
    conn: &mut PgConnection,
    model: &str,
    inputs: &GateInputs,
    role: Option<&str>,
    covered: impl FnOnce(&RecordedModel, &[ClockRow]) -> bool,
    sql: &str,
    params: &[ParamValue],
    bounds: QueryBounds,
) -> Result<GatedSnapshot<Option<Result<Vec<String>, sqlx::Error>>>, StoreError> {
    let (mut tx, snapshot) = begin_with_clock_as(conn, model, inputs, role).await?;
    if !covered(&snapshot.model, &snapshot.clock) {
        tx.rollback().await.context("ending a snapshot that does not cover the read")?;
        return Ok(GatedSnapshot { model: snapshot.model, clock: snapshot.clock, data: None });
    }
    let data = bounded_json_rows(&mut tx, sql, params, bounds).await;
    let GatedSnapshot { model, clock, data } = finish(tx, snapshot, data).await?;
    Ok(GatedSnapshot { model, clock, data: Some(data) })
}

/// [`json_rows`] under `bounds`: the statement timeout set for this transaction first (when
/// given), the rows cut after the first one whose predecessors' bytes pass `max_bytes`.
async fn bounded_json_rows(
    conn: &mut PgConnection,
    sql: &str,
    params: &[ParamValue],
    bounds: QueryBounds,
) -> Result<Vec<String>, sqlx::Error> {
    if let Some(ms) = bounds.timeout_ms {
        sqlx::query("SELECT set_config('statement_timeout', $1, true)")
            .bind(format!("{ms}ms"))
            .execute(&mut *conn)
            .await?;
    }
    let statement = bounded_rows_statement(sql, params.len());
    let max_bytes = i64::try_from(bounds.max_bytes).unwrap_or(i64::MAX);
    let rows =
        bind_params(sqlx::query(&statement), params).bind(bounds.limit).bind(max_bytes).fetch_all(&mut *conn).await?;
    rows.iter().map(|r| r.try_get::<String, _>(0)).collect()
}

/// [`rows_statement`] with a byte bound `$n+2`: each row's text and a separator counted in
/// the query's order, and the rows after the first one past the bound not sent.
fn bounded_rows_statement(sql: &str, params: usize) -> String {
    format!(
        "SELECT j FROM (SELECT j, sum(octet_length(j) + 1) OVER (ROWS UNBOUNDED PRECEDING) AS upto FROM ({}) AS r(j)) \
         AS w WHERE upto - octet_length(j) - 1 <= ${}",
        rows_statement(sql, params),
        params + 2
    )
}

/// Begins the read-only snapshot and reads the model's row and the clock rows `inputs` name.
async fn begin_with_clock<'c>(
    conn: &'c mut PgConnection,
    model: &str,
    inputs: &GateInputs,
) -> Result<(Transaction<'c, Postgres>, GatedSnapshot<()>), StoreError> {
    begin_with_clock_as(conn, model, inputs, None).await
}

/// [`begin_with_clock`], the snapshot under `role` when given.
async fn begin_with_clock_as<'c>(
    conn: &'c mut PgConnection,
    model: &str,
    inputs: &GateInputs,
    role: Option<&str>,
) -> Result<(Transaction<'c, Postgres>, GatedSnapshot<()>), StoreError> {
    let mut tx = conn.begin_with(BEGIN_READ_ONLY).await.context("beginning a read-only snapshot")?;
    if let Some(role) = role {
        sqlx::query(&format!("SET LOCAL ROLE {}", crate::roles::quote_ident(role)))
            .execute(&mut *tx)
            .await
            .with_context(|| format!("taking the read role {role:?}"))?;
    }
    let binds = ScopedBinds::of(&inputs.clock);
    // The document reads' statement with no data: in this snapshot the model's shape cannot
    // change between the statement and the reading of its topic identities.
    for _ in 0..SHAPE_ATTEMPTS {
        let rows = binds
            .query(
                gated_statement!(data: "", data_join: "", data_nulls: "", clock_filter: scoped_clock_filter!()),
                model,
            )
            .fetch_all(&mut *tx)
            .await
            .with_context(|| format!("reading the clock of model {model:?}"))?;
        let (head, clock) = split_gated(rows)?;
        if let Some(recorded) = recorded_model(&mut tx, model, &head, inputs.cached).await? {
            return Ok((tx, GatedSnapshot { model: recorded, clock, data: () }));
        }
    }
    Err(shape_kept_changing(model))
}

/// Ends the snapshot (a failed data statement rolls it back when `tx` drops) with `data`.
async fn finish<T>(
    tx: Transaction<'_, Postgres>,
    snapshot: GatedSnapshot<()>,
    data: Result<T, sqlx::Error>,
) -> Result<GatedSnapshot<Result<T, sqlx::Error>>, StoreError> {
    if data.is_ok() {
        tx.commit().await.context("ending a read-only snapshot")?;
    }
    Ok(GatedSnapshot { model: snapshot.model, clock: snapshot.clock, data })
}

/// Whether `sql` (a named query, `$1..$n` bound from `params`) can run under `role` (the
/// gateway's own role when `None`): planned, never run, in a read-only transaction rolled
/// back. The error is the database's — `42501` (insufficient privilege) when the role may
/// not read a table the query names.
pub async fn check_query(
    pool: &sqlx::PgPool,
    role: Option<&str>,
    sql: &str,
    params: &[ParamValue],
) -> Result<(), StoreError> {
    let mut conn = pool.acquire().await.context("checking a named query")?;
    let mut tx = conn.begin_with(BEGIN_READ_ONLY).await.context("beginning a named query's check")?;
    if let Some(role) = role {
        sqlx::query(&format!("SET LOCAL ROLE {}", crate::roles::quote_ident(role)))
            .execute(&mut *tx)
            .await
            .with_context(|| format!("taking the read role {role:?}"))?;
    }
    let explain = format!("EXPLAIN {}", rows_statement(sql, params.len()));
    bind_params(sqlx::query(&explain), params)
        .bind(1_i64)
        .fetch_all(&mut *tx)
        .await
        .context("planning a named query")?;
    tx.rollback().await.context("ending a named query's check")?;
    Ok(())
}

/// A named query's statement: `sql` as a subquery, each row as JSON, `LIMIT $n+1`.
fn rows_statement(sql: &str, params: usize) -> String {
    let sql = sql.trim_end().trim_end_matches(';');
    // The newline ends a trailing `--` comment before the subquery is closed.
    format!("SELECT to_jsonb(q)::text FROM (\n{sql}\n) AS q LIMIT ${}", params + 1)
}

/// `query` with `params` bound in order.
fn bind_params<'q>(
    mut query: sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    params: &'q [ParamValue],
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    for p in params {
        query = match p {
            ParamValue::Text(v) => query.bind(v.as_str()),
            ParamValue::Int(v) => query.bind(*v),
            ParamValue::Float(v) => query.bind(*v),
            ParamValue::Bool(v) => query.bind(*v),
            ParamValue::Json(v) => query.bind(v),
        };
    }
    query
}

/// A named query's parameter value, typed as configured.
#[derive(Clone, Debug, PartialEq)]
pub enum ParamValue {
    Text(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Json(Value),
}

/// The rows of `sql` (placeholders `$1..$n`, bound from `params` in order) as the text of
/// JSON objects, column name to value (`to_jsonb(q)::text` of each row: Postgres writes the
/// numbers, a `numeric` with every digit), at most `limit` of them. A trailing `;` is
/// dropped; the query must be one statement that can be a subquery (`SELECT`, `VALUES`,
/// `TABLE`, `WITH … SELECT`).
pub async fn json_rows(
    conn: &mut PgConnection,
    sql: &str,
    params: &[ParamValue],
    limit: i64,
) -> Result<Vec<String>, sqlx::Error> {
    let statement = rows_statement(sql, params.len());
    let rows = bind_params(sqlx::query(&statement), params).bind(limit).fetch_all(&mut *conn).await?;
    rows.iter().map(|r| r.try_get::<String, _>(0)).collect()
}
