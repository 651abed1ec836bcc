//! Named queries: `GET /v1/models/{model}/queries/{name}?param=…`, the model's
//! `[[models.queries]]` served under the same gate as its documents ([`crate::gated`]).
//!
//! The request's query string gives the parameters, each typed as configured (`text` as
//! given, `int` a 64-bit integer, `float` a finite 64-bit float, `bool` `true`/`false`,
//! `json` a JSON document); a parameter missing, unknown, given twice or not of its type is
//! `400 invalid-query` naming it, before the database is asked. The statement (its `:name`
//! parameters turned into `$n` by [`parsley_settings::sql_params`]) runs in a `REPEATABLE READ,
//! READ ONLY` transaction whose snapshot also gives the clock rows
//! ([`parsley_store::queries::named_query`]): so nothing it runs can write, and its rows are
//! the rows the clock describes. A query with a `key` parameter is gated on the task owning
//! that key (routed as the document reads route keys); one without on every task.
//!
//! The answer is `{"rows": [...], "truncated": bool}`: each row a JSON object, column name to
//! value (`to_jsonb` of the row, as Postgres writes it: a `numeric` with every digit, never
//! read through a float), at most the query's `max_rows` (`truncated` says there were more;
//! the rest are not sent). An unknown model or query is `404` by name; a statement the
//! database fails to run is `500 query-failed` naming the query and the SQLSTATE, never the
//! database's message (it can quote data), which is logged.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use parsley::gate::ClockRow;
use parsley_settings::config::{ParamType, QueryConfig};
use parsley_settings::sql_params;
use parsley_store::documents::{GateInputs, GatedSnapshot, RecordedModel};
use parsley_store::error::{classify_sqlx, ErrorKind, StoreError};
use parsley_store::queries::{self, ParamValue, QueryBounds};
use serde_json::Value;

use crate::gated::{self, Covers, Gated, Scope, Snapshot};
use crate::problem::ApiError;
use crate::read::{check_key, parse_query};
use crate::session;
use crate::state::AppState;
use crate::store_errors;

/// `GET /v1/models/{model}/queries/{name}`.
pub async fn get_query(
    State(state): State<AppState>,
    path: Result<Path<(String, String)>, PathRejection>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Path((model_name, name)) = path.map_err(|r| ApiError::InvalidPath(r.body_text()))?;
    let now = session::unix_now();
    let caller = session::open_session(&state, &headers, now).await?;
    let model = state.model(&model_name)?;
    let query = model
        .queries
        .iter()
        .find(|q| q.name == name)
        .ok_or_else(|| ApiError::UnknownQuery { model: model_name.clone(), query: name.clone() })?;
    let mut given = parse_query(raw.as_deref().unwrap_or(""))?;
    // Parameters an authorization rule binds to the caller's claims are filled in (or
    // checked, when given) before they are typed.
    state.config.access.bind_query(caller.identity.as_deref(), &model.name, &query.name, &mut given)?;
    let prepared = prepare(query, &given, state.config.settings.max_key_bytes)?;
    let scope = prepared.key.as_deref().map_or(Scope::AllTasks, Scope::Key);
    let named = NamedQuery { model: &model.name, query, prepared: &prepared };
    let gated = gated::read_as(&state, &caller, now, &model.name, scope, &named).await?;
    let gated = Gated { data: gated.data?, token: gated.token };
    let body = rows_body(gated.data, query.max_rows as usize);
    // Refused whole rather than cut: a client must never take part of a result for all of it.
    if body.len() as u64 > query.max_bytes {
        return Err(ApiError::QueryResultTooLarge {
            model: model.name.clone(),
            query: query.name.clone(),
            max_bytes: query.max_bytes,
        });
    }
    Ok(Gated { data: ([(CONTENT_TYPE, HeaderValue::from_static("application/json"))], body), token: gated.token }
        .into_response())
}

/// The answer's body, `{"rows": [...], "truncated": bool}`: at most `max_rows` rows, each the
/// JSON text Postgres wrote, copied, not parsed.
fn rows_body(rows: Vec<String>, max_rows: usize) -> Bytes {
    let truncated = rows.len() > max_rows;
    let rows = &rows[..rows.len().min(max_rows)];
    let mut out = Vec::with_capacity(rows.iter().map(|r| r.len() + 1).sum::<usize>() + 32);
    out.extend_from_slice(b"{\"rows\":[");
    for (i, row) in rows.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(row.as_bytes());
    }
    out.extend_from_slice(if truncated { b"],\"truncated\":true}" } else { b"],\"truncated\":false}" });
    Bytes::from(out)
}

/// A query ready to run: its statement with `$n` parameters, their values in `$n` order, and
/// the key's value when the query declares one.
#[derive(Debug, PartialEq)]
pub struct Prepared {
    pub sql: String,
    pub params: Vec<ParamValue>,
    pub key: Option<String>,
}

/// Reads the request's parameters for `query`: every declared one given once, nothing else,
/// each of its type (the key parameter also a key a record can have). The error names the
/// parameter at fault.
pub fn prepare(
    query: &QueryConfig,
    given: &BTreeMap<String, String>,
    max_key_bytes: usize,
) -> Result<Prepared, ApiError> {
    let invalid = |name: &str, detail: String| ApiError::InvalidQuery { parameter: Some(name.to_string()), detail };
    if let Some(unknown) = given.keys().find(|k| !query.params.contains_key(*k)) {
        let expected: Vec<&str> = query.params.keys().map(String::as_str).collect();
        let expected = if expected.is_empty() { "none".to_string() } else { expected.join(", ") };
        return Err(invalid(
            unknown,
            format!("unknown parameter {unknown:?} for query {:?} (expected: {expected})", query.name),
        ));
    }
    // Checked at load: the statement's parameters are exactly the declared ones.
    let rewritten = sql_params::rewrite(&query.sql)
        .map_err(|e| ApiError::Internal(anyhow::anyhow!("query {:?} does not rewrite: {e}", query.name)))?;
    let mut params = Vec::with_capacity(rewritten.names.len());
    for name in &rewritten.names {
        let Some(&kind) = query.params.get(name) else {
            return Err(ApiError::Internal(anyhow::anyhow!("query {:?} uses undeclared :{name}", query.name)));
        };
        let Some(text) = given.get(name) else {
            return Err(invalid(
                name,
                format!("missing parameter {name:?} ({}) of query {:?}", kind.name(), query.name),
            ));
        };
        params.push(typed(kind, text).map_err(|why| invalid(name, format!("parameter {name:?} {why}")))?);
    }
    let key = match &query.key {
        None => None,
        Some(name) => {
            let value = given.get(name).cloned().unwrap_or_default();
            check_key(&value, max_key_bytes)
                .map_err(|why| invalid(name, format!("{name} is the record key: {why}")))?;
            Some(value)
        }
    };
    Ok(Prepared { sql: rewritten.sql, params, key })
}

/// `text` read as a `kind` parameter; why not otherwise (never quoting the value).
fn typed(kind: ParamType, text: &str) -> Result<ParamValue, String> {
    match kind {
        ParamType::Text if text.contains('\0') => Err("contains NUL (%00), which text cannot hold".into()),
        ParamType::Text => Ok(ParamValue::Text(text.to_string())),
        ParamType::Int => text.parse().map(ParamValue::Int).map_err(|_| "must be a whole number (int8)".into()),
        ParamType::Float => match text.parse::<f64>() {
            Ok(v) if v.is_finite() => Ok(ParamValue::Float(v)),
            _ => Err("must be a finite number (float8)".into()),
        },
        ParamType::Bool => match text {
            "true" => Ok(ParamValue::Bool(true)),
            "false" => Ok(ParamValue::Bool(false)),
            _ => Err("must be true or false".into()),
        },
        ParamType::Json => {
            let value: Value = serde_json::from_str(text).map_err(|e| format!("must be JSON: {e}"))?;
            if holds_nul(&value) {
                return Err("holds NUL (\\u0000), which jsonb cannot hold".into());
            }
            Ok(ParamValue::Json(value))
        }
    }
}

/// Whether a string or object key anywhere in `value` holds NUL.
fn holds_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(holds_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || holds_nul(v)),
        _ => false,
    }
}

/// One attempt of a named query: the clock rows and at most `max_rows + 1` rows (the one
/// more says the answer is truncated), in one read-only snapshot.
struct NamedQuery<'a> {
    model: &'a str,
    query: &'a QueryConfig,
    prepared: &'a Prepared,
}

/// The query's failure is kept in the snapshot (see `gated`'s `InTransaction`): it is the
/// answer only if the clock covers the session; before that, the tables it reads may not
/// exist yet, and the read waits.
impl Snapshot for NamedQuery<'_> {
    type Data = Result<Vec<String>, ApiError>;

    async fn read(
        &self,
        state: &AppState,
        model: &str,
        inputs: &GateInputs,
    ) -> Result<GatedSnapshot<Result<Vec<String>, ApiError>>, ApiError> {
        self.read_gated(state, model, inputs, &|_: &RecordedModel, _: &[ClockRow]| true).await
    }

    /// The clock rows first; the statement only in a snapshot whose rows cover the session,
    /// on a connection of the queries' own pool, under the query's bounds.
    async fn read_gated(
        &self,
        state: &AppState,
        model: &str,
        inputs: &GateInputs,
        covers: &Covers<'_>,
    ) -> Result<GatedSnapshot<Result<Vec<String>, ApiError>>, ApiError> {
        let retry_after = state.config.settings.retry_after_s;
        let failed = |e: StoreError| store_errors::failed(e, "the query", retry_after, None);
        let mut conn = state.queries.acquire().await.map_err(|e| failed(e.into()))?;
        let bounds = QueryBounds {
            limit: i64::from(self.query.max_rows) + 1,
            timeout_ms: self.query.timeout_ms,
            max_bytes: self.query.max_bytes,
        };
        let p = self.prepared;
        let role = state.query_role(model);
        let snapshot =
            queries::named_query(&mut conn, model, inputs, role.as_deref(), covers, &p.sql, &p.params, bounds)
                .await
                .map_err(failed)?;
        let rows = match snapshot.data {
            Some(rows) => rows.map_err(|e| self.failed(e, retry_after)),
            // Never served: the gate finds the same rows uncovered.
            None => Err(ApiError::Internal(anyhow::anyhow!("a named query's snapshot did not cover the read"))),
        };
        Ok(GatedSnapshot { model: snapshot.model, clock: snapshot.clock, data: rows })
    }
}

impl NamedQuery<'_> {
    /// The answer to a failed statement: an outage is `503 unavailable`; anything else is
    /// the query's failure, logged in full and answered by SQLSTATE only.
    fn failed(&self, e: sqlx::Error, retry_after: u64) -> ApiError {
        if is_statement_timeout(&e) {
            tracing::warn!(model = self.model, query = %self.query.name, timeout_ms = self.query.timeout_ms,
                "a named query ran past its statement timeout");
            return ApiError::QueryTimeout {
                model: self.model.to_string(),
                query: self.query.name.clone(),
                timeout_ms: self.query.timeout_ms,
            };
        }
        if classify_sqlx(&e) == ErrorKind::Unavailable {
            return store_errors::failed(e.into(), "the query", retry_after, None);
        }
        let sqlstate = match &e {
            sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
            _ => None,
        };
        tracing::warn!(model = self.model, query = %self.query.name, sqlstate, error = %e, "a named query failed");
        ApiError::QueryFailed { model: self.model.to_string(), query: self.query.name.clone(), sqlstate }
    }
}

/// Whether the database cancelled the statement for its statement timeout (SQLSTATE 57014
/// with the timeout's message; a cancel by request or at shutdown is an outage).
fn is_statement_timeout(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            db.code().as_deref() == Some("57014") && db.message().contains("statement timeout")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(sql: &str, params: &[(&str, ParamType)], key: Option<&str>) -> QueryConfig {
        QueryConfig {
            name: "q".into(),
            sql: sql.into(),
            params: params.iter().map(|(n, t)| (n.to_string(), *t)).collect(),
            key: key.map(String::from),
            max_rows: 10,
            timeout_ms: None,
            max_bytes: 1 << 20,
        }
    }

    fn given(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// The parameter an error names, if it is an invalid query.
    fn named(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidQuery { parameter, .. } => parameter,
            other => panic!("not an invalid query: {other:?}"),
        }
    }

    #[test]
    fn rows_are_sent_as_postgres_wrote_them() {
        let rows = vec![r#"{"n": 12345678901234567890123456789}"#.to_string(), r#"{"n": 2e308}"#.to_string()];
        assert_eq!(
            &rows_body(rows.clone(), 5)[..],
            br#"{"rows":[{"n": 12345678901234567890123456789},{"n": 2e308}],"truncated":false}"#
        );
        assert_eq!(&rows_body(rows, 1)[..], br#"{"rows":[{"n": 12345678901234567890123456789}],"truncated":true}"#);
        assert_eq!(&rows_body(vec![], 1)[..], br#"{"rows":[],"truncated":false}"#);
    }

    #[test]
    fn parameters_are_typed_in_statement_order() {
        use ParamType::*;
        let q = query(
            "SELECT :b, :a, :c, :d, :e, :a",
            &[("a", Int), ("b", Text), ("c", Float), ("d", Bool), ("e", Json)],
            Some("b"),
        );
        let p =
            prepare(&q, &given(&[("a", "-7"), ("b", "k 1"), ("c", "2.5"), ("d", "false"), ("e", "{\"x\":[1]}")]), 16)
                .unwrap();
        assert_eq!(p.sql, "SELECT $1, $2, $3, $4, $5, $2");
        assert_eq!(
            p.params,
            vec![
                ParamValue::Text("k 1".into()),
                ParamValue::Int(-7),
                ParamValue::Float(2.5),
                ParamValue::Bool(false),
                ParamValue::Json(serde_json::json!({"x": [1]})),
            ]
        );
        assert_eq!(p.key.as_deref(), Some("k 1"));
        let p = prepare(&query("SELECT 1", &[], None), &given(&[]), 16).unwrap();
        assert_eq!((p.params.len(), p.key), (0, None));
    }

    #[test]
    fn a_bad_parameter_is_refused_by_name() {
        use ParamType::*;
        let q = query(
            "SELECT :n, :f, :b, :j, :t",
            &[("n", Int), ("f", Float), ("b", Bool), ("j", Json), ("t", Text)],
            Some("t"),
        );
        let ok = [("n", "1"), ("f", "1"), ("b", "true"), ("j", "1"), ("t", "k")];
        assert!(prepare(&q, &given(&ok), 16).is_ok());
        let with = |name: &str, value: &str| {
            let mut g = given(&ok);
            g.insert(name.to_string(), value.to_string());
            g
        };
        let without = |name: &str| {
            let mut g = given(&ok);
            g.remove(name);
            g
        };
        for (bad, parameter) in [
            (without("n"), "n"),
            (without("t"), "t"),
            (with("other", "1"), "other"),
            (with("n", "1.5"), "n"),
            (with("n", "99999999999999999999"), "n"),
            (with("n", ""), "n"),
            (with("f", "NaN"), "f"),
            (with("f", "inf"), "f"),
            (with("f", "x"), "f"),
            (with("b", "1"), "b"),
            (with("b", "True"), "b"),
            (with("j", "{"), "j"),
            (with("j", "[\"\\u0000\"]"), "j"),
            (with("t", "a\0b"), "t"),
            (with("t", "12345678901234567"), "t"),
        ] {
            assert_eq!(named(prepare(&q, &bad, 16).unwrap_err()).as_deref(), Some(parameter), "{bad:?}");
        }
    }
}
