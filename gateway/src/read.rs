//! The gated read paths: `GET /v1/models/{model}/documents/{key}` (served by the task that
//! owns the key) and `GET /v1/models/{model}/documents?limit=&after=` (served by every
//! task).
//!
//! Each attempt is one statement, one round trip ([`documents::gated_document`],
//! [`documents::gated_page`]): the model's recorded row, the clock rows the core's gate
//! and refresh read, and the document(s) — one snapshot even at `READ COMMITTED`, so the
//! rows served are the rows the clock describes. The gate, the wait, the 503 and the
//! refreshed token are [`crate::gated`]'s, shared with the named queries and embedding
//! programs' own routes; this module is the documents' [`Snapshot`] and their answers.
//!
//! Which clock rows a single-key read fetches depends on the model's shape (its width names
//! the key's owner, its received topics tell upstream channels apart), so the model's row is
//! cached per model ([`crate::gated::Shapes`]) with the shape identity it was recorded under.
//! It is never trusted past a change: every statement also returns the model's recorded
//! shape identity, and when that is not the cached one the store reads that shape's topic
//! identities by the identity (a second statement, once per change); when the shape they
//! give is not the one the rows were chosen by, the cache takes the new row and the attempt
//! is made again with every clock row of the model.
//!
//! A key or cursor no document can have (NUL, not UTF-8 after percent-decoding, longer than
//! `max_key_bytes`) is refused before the database is asked; a database error is an outage
//! (503) only when the database did not answer ([`crate::store_errors`]).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::path::ErrorKind;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use parsley::gate::{ClockRow, ModelShape};
use parsley::kept::KeptRules;
use parsley_store::documents::{self, Document, GateInputs, GatedSnapshot};
use parsley_store::StoreError;
use serde_json::json;

use crate::access::KeyFilter;
use crate::gated::{self, KeptSnapshot, Scope, Snapshot};
use crate::problem::{ApiError, Problem, ProblemType};
use crate::session::{self, SESSION_HEADER};
use crate::state::AppState;
use crate::store_errors;

/// Default and largest page of a collection read.
pub const DEFAULT_LIMIT: u32 = 100;
pub const MAX_LIMIT: u32 = 1000;

/// What a read asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    One {
        key: String,
    },
    /// `filter`: the keys the caller may list (authorization rules with a key binding).
    Page {
        after: Option<String>,
        limit: u32,
        filter: KeyFilter,
    },
}

pub async fn get_document(
    State(state): State<AppState>,
    path: Result<Path<(String, String)>, PathRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Path((model, key)) = path.map_err(path_error)?;
    let now = session::unix_now();
    let caller = session::open_session(&state, &headers, now).await?;
    check_key(&key, state.config.settings.max_key_bytes).map_err(ApiError::InvalidKey)?;
    state.model(&model)?;
    state.config.access.check_read(caller.identity.as_deref(), &model, &key)?;
    gated_read(&state, &caller, now, &model, Target::One { key }).await
}

pub async fn get_collection(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Path(model) = path.map_err(path_error)?;
    let now = session::unix_now();
    let caller = session::open_session(&state, &headers, now).await?;
    let mut target = parse_page(&parse_query(query.as_deref().unwrap_or(""))?, state.config.settings.max_key_bytes)?;
    state.model(&model)?;
    if let Target::Page { filter, .. } = &mut target {
        *filter = state.config.access.list_filter(caller.identity.as_deref(), &model)?;
    }
    gated_read(&state, &caller, now, &model, target).await
}

/// A path that does not decode: a key that is not UTF-8 after percent-decoding is an
/// invalid key; anything else an invalid path.
fn path_error(rejection: PathRejection) -> ApiError {
    if let PathRejection::FailedToDeserializePathParams(e) = &rejection {
        if let ErrorKind::InvalidUtf8InPathParam { key } = e.kind() {
            if key == "key" {
                return ApiError::InvalidKey("the key is not UTF-8 after percent-decoding".into());
            }
        }
    }
    ApiError::InvalidPath(rejection.body_text())
}

/// Whether a key (from a path or a cursor) is one a document can have: no NUL (Postgres
/// `text` cannot hold it), at most `max_key_bytes` bytes. The reason otherwise.
pub fn check_key(key: &str, max_key_bytes: usize) -> Result<(), String> {
    if key.contains('\0') {
        return Err("the key contains NUL (%00), which no document key can hold".into());
    }
    if key.len() > max_key_bytes {
        return Err(format!(
            "the key is {} bytes, longer than any document key (gateway.max_key_bytes = {max_key_bytes})",
            key.len()
        ));
    }
    Ok(())
}

/// Splits a raw query string into its parameters, percent-decoded (`+` is a space). A
/// parameter given twice, a malformed escape or a name or value that is not UTF-8 after
/// decoding is refused, naming the parameter.
pub fn parse_query(raw: &str) -> Result<BTreeMap<String, String>, ApiError> {
    let mut out = BTreeMap::new();
    for pair in raw.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_decode(name)
            .map_err(|why| ApiError::InvalidQuery { parameter: None, detail: format!("a parameter name {why}") })?;
        let value = percent_decode(value).map_err(|why| ApiError::InvalidQuery {
            parameter: Some(name.clone()),
            detail: format!("the value of {name:?} {why}"),
        })?;
        if out.contains_key(&name) {
            return Err(ApiError::InvalidQuery {
                detail: format!("{name:?} is given more than once"),
                parameter: Some(name),
            });
        }
        out.insert(name, value);
    }
    Ok(out)
}

/// Decodes `%XX` escapes and `+`; the error says why it cannot.
fn percent_decode(text: &str) -> Result<String, &'static str> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                // Two hex digits, nothing else (`from_str_radix` alone would take a sign).
                let hex = bytes.get(i + 1..i + 3).filter(|h| h.iter().all(u8::is_ascii_hexdigit));
                let hex = hex.and_then(|h| std::str::from_utf8(h).ok()).ok_or("has a malformed %-escape")?;
                let byte = u8::from_str_radix(hex, 16).map_err(|_| "has a malformed %-escape")?;
                out.push(byte);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| "is not UTF-8 after percent-decoding")
}

/// `limit` (1..=1000, default 100) and `after` (a key; a cursor no document key can be is
/// refused); nothing else.
pub fn parse_page(query: &BTreeMap<String, String>, max_key_bytes: usize) -> Result<Target, ApiError> {
    if let Some(unknown) = query.keys().find(|k| !matches!(k.as_str(), "limit" | "after")) {
        return Err(ApiError::InvalidQuery {
            parameter: Some(unknown.clone()),
            detail: format!("unknown parameter {unknown:?} (expected limit, after)"),
        });
    }
    let limit = match query.get("limit") {
        None => DEFAULT_LIMIT,
        Some(v) => match v.parse::<u32>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => n,
            _ => {
                return Err(ApiError::InvalidQuery {
                    parameter: Some("limit".into()),
                    detail: format!("limit must be a whole number from 1 to {MAX_LIMIT}, not {v:?}"),
                })
            }
        },
    };
    let after = query.get("after").cloned();
    if let Some(a) = &after {
        check_key(a, max_key_bytes).map_err(|why| ApiError::InvalidQuery {
            parameter: Some("after".into()),
            detail: format!("after: {why}"),
        })?;
    }
    Ok(Target::Page { after, limit, filter: KeyFilter::All })
}

async fn gated_read(
    state: &AppState,
    caller: &session::Caller,
    now: u64,
    model_name: &str,
    target: Target,
) -> Result<Response, ApiError> {
    let scope = match &target {
        Target::One { key } => Scope::Key(key),
        Target::Page { .. } => Scope::AllTasks,
    };
    let read = gated::read_as(state, caller, now, model_name, scope, &Documents(&target)).await?;
    Ok(respond(&target, read.data, read.token))
}

/// A document read's snapshot: one statement ([`read_snapshot`]). A covered snapshot is kept
/// in memory for the next reads of the same key or page ([`crate::read_cache`]): a key's until its
/// owner steps, a page's until any task does.
struct Documents<'a>(&'a Target);

impl Documents<'_> {
    /// The name the snapshot is kept under: the document's key, or for a page a name no
    /// document key can have (keys hold no NUL).
    fn kept_name(&self) -> Cow<'_, str> {
        match self.0 {
            Target::One { key } => Cow::Borrowed(key),
            Target::Page { after, limit, filter } => {
                let after = after.as_deref().map_or_else(|| "-".to_string(), |a| format!("+{a}"));
                // A filtered page is another page: kept under its filter too, so it is
                // never served to a caller with another one.
                let filter = match filter {
                    KeyFilter::All => String::new(),
                    KeyFilter::Only { keys, prefixes } => {
                        format!("\0k\0{}\0p\0{}", keys.join("\0"), prefixes.join("\0"))
                    }
                };
                Cow::Owned(format!("\0page\0{limit}\0{after}{filter}"))
            }
        }
    }

    /// The task serving the snapshot under `shape`: the key's owner (`None`: every task —
    /// a page, or a key of a model that routes no key to one task).
    fn served_by(&self, state: &AppState, model: &str, shape: &ModelShape) -> Option<u32> {
        let key_owner = match self.0 {
            Target::One { key } => gated::key_owner(state.model(model).ok()?, key, shape.task_count),
            Target::Page { .. } => None,
        };
        let served: BTreeSet<u32> = key_owner.map_or_else(|| (0..shape.task_count).collect(), |o| [o].into());
        KeptRules::SHIPPED.generation_owner(key_owner, &served)
    }
}

impl Snapshot for Documents<'_> {
    type Data = Data;

    async fn read(&self, state: &AppState, model: &str, inputs: &GateInputs) -> Result<GatedSnapshot<Data>, ApiError> {
        read_snapshot(state, model, self.0, inputs).await
    }

    fn kept(&self, state: &AppState, model: &str) -> Option<KeptSnapshot<Data>> {
        if !state.kept.on() {
            return None;
        }
        let kept = state.kept.get(&state.notifier, model, &self.kept_name())?;
        let data = match self.0 {
            Target::One { .. } => Data::One(kept.body.clone()),
            Target::Page { .. } => Data::Page(kept.body.clone()?),
        };
        Some(KeptSnapshot { shape: Arc::clone(&kept.shape), rows: Arc::clone(&kept.rows), data })
    }

    fn generation(&self, state: &AppState, model: &str, shape: &ModelShape) -> Option<u64> {
        if !state.kept.on() {
            return None;
        }
        state.kept.before_read(&state.notifier, model, self.served_by(state, model, shape))
    }

    fn keep(&self, state: &AppState, model: &str, generation: u64, shape: &ModelShape, rows: &[ClockRow], data: &Data) {
        let body = match data {
            Data::One(body) => body.as_deref(),
            Data::Page(body) => Some(&body[..]),
        };
        let (name, owner) = (self.kept_name(), self.served_by(state, model, shape));
        state.kept.keep(&state.notifier, model, &name, owner, generation, shape, rows, body);
    }
}

fn respond(target: &Target, data: Data, token: HeaderValue) -> Response {
    let body = match data {
        Data::One(body) => body,
        Data::Page(body) => Some(body),
    };
    match body {
        Some(body) => {
            let mut r =
                (StatusCode::OK, [(CONTENT_TYPE, HeaderValue::from_static("application/json"))], body).into_response();
            r.headers_mut().insert(SESSION_HEADER, token);
            r
        }
        None => {
            let key = match target {
                Target::One { key } => key.as_str(),
                Target::Page { .. } => "",
            };
            let problem = Problem::new(
                ProblemType::NotFound,
                "no document with this key exists in a snapshot that covers the session",
            )
            .with("key", json!(key));
            let mut r = problem.into_response();
            r.headers_mut().insert(SESSION_HEADER, token);
            r
        }
    }
}

/// What a read asks for, as data still to be served.
enum Data {
    /// The answer's body, `{"key", "document", "version"}` (`None`: no such document).
    One(Option<Bytes>),
    /// The page's answer body, `{"documents", "next"}`.
    Page(Bytes),
}

/// The model's row, the clock rows `inputs` names and the data, in one statement (a page
/// reads every clock row).
async fn read_snapshot(
    state: &AppState,
    model: &str,
    target: &Target,
    inputs: &GateInputs,
) -> Result<GatedSnapshot<Data>, ApiError> {
    let retry_after = state.config.settings.retry_after_s;
    let failed = |e: StoreError| {
        // The only values from the client: the key or the cursor.
        let rejected = match target {
            Target::One { .. } => ApiError::InvalidKey("the database cannot hold this key".into()),
            Target::Page { .. } => ApiError::InvalidQuery {
                parameter: Some("after".into()),
                detail: "the database cannot hold this cursor".into(),
            },
        };
        store_errors::failed(e, "the read", retry_after, Some(rejected))
    };
    let mut conn = state.reads.acquire().await.map_err(|e| failed(e.into()))?;
    let snapshot = match target {
        Target::One { key } => {
            let s = documents::gated_document(&mut conn, model, key, inputs).await.map_err(failed)?;
            GatedSnapshot { model: s.model, clock: s.clock, data: Data::One(s.data.map(one_body)) }
        }
        Target::Page { after, limit, filter } => {
            let only = match filter {
                KeyFilter::All => None,
                KeyFilter::Only { keys, prefixes } => Some(documents::KeysOnly { keys, prefixes }),
            };
            let s =
                documents::gated_page(&mut conn, model, inputs.cached, after.as_deref(), i64::from(*limit) + 1, only)
                    .await
                    .map_err(failed)?;
            GatedSnapshot { model: s.model, clock: s.clock, data: Data::Page(page_body(s.data, *limit)) }
        }
    };
    conn.release();
    Ok(snapshot)
}

/// A document as an answer gives it, `{"document", "key", "version"}`, appended to `out`. The
/// document is the stored JSON text as Postgres wrote it, copied, not parsed: every number
/// keeps its digits, and the read path parses nothing.
fn push_document(out: &mut Vec<u8>, d: &Document) {
    out.extend_from_slice(b"{\"document\":");
    out.extend_from_slice(d.doc.as_bytes());
    out.extend_from_slice(b",\"key\":");
    push_string(out, &d.key);
    out.extend_from_slice(b",\"version\":");
    out.extend_from_slice(d.version.to_string().as_bytes());
    out.push(b'}');
}

/// `text` as a JSON string.
fn push_string(out: &mut Vec<u8>, text: &str) {
    serde_json::to_writer(out, text).expect("a string serializes");
}

/// What a document's answer adds to its key and JSON text.
const DOCUMENT_FRAMING: usize = 64;

/// A single key's answer body.
fn one_body(d: Document) -> Bytes {
    let mut out = Vec::with_capacity(d.doc.len() + d.key.len() + DOCUMENT_FRAMING);
    push_document(&mut out, &d);
    Bytes::from(out)
}

/// A page's answer body, `{"documents", "next"}`: at most `limit` documents, and the cursor
/// of the next page if `documents` has more.
fn page_body(documents: Vec<Document>, limit: u32) -> Bytes {
    let more = documents.len() > limit as usize;
    let documents = &documents[..documents.len().min(limit as usize)];
    let size: usize = documents.iter().map(|d| d.doc.len() + d.key.len() + DOCUMENT_FRAMING).sum();
    let mut out = Vec::with_capacity(size + DOCUMENT_FRAMING);
    out.extend_from_slice(b"{\"documents\":[");
    for (i, d) in documents.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        push_document(&mut out, d);
    }
    out.extend_from_slice(b"],\"next\":");
    match documents.last().filter(|_| more) {
        Some(last) => push_string(&mut out, &last.key),
        None => out.extend_from_slice(b"null"),
    }
    out.push(b'}');
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// The parameter an error names, if it is an invalid query.
    fn parameter(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidQuery { parameter, .. } => parameter,
            other => panic!("not an invalid query: {other:?}"),
        }
    }

    #[test]
    fn pages_are_bounded() {
        assert_eq!(parse_page(&q(&[]), 8).unwrap(), Target::Page { after: None, limit: 100, filter: KeyFilter::All });
        assert_eq!(
            parse_page(&q(&[("limit", "1000"), ("after", "k")]), 8).unwrap(),
            Target::Page { after: Some("k".into()), limit: 1000, filter: KeyFilter::All }
        );
        for (bad, named) in [
            (&[("limit", "0")][..], "limit"),
            (&[("limit", "1001")], "limit"),
            (&[("limit", "x")], "limit"),
            (&[("offset", "3")], "offset"),
            (&[("after", "a\0b")], "after"),
            (&[("after", "123456789")], "after"),
        ] {
            assert_eq!(parameter(parse_page(&q(bad), 8).unwrap_err()).as_deref(), Some(named), "{bad:?}");
        }
    }

    #[test]
    fn queries_decode_strictly() {
        assert_eq!(parse_query("").unwrap(), q(&[]));
        assert_eq!(parse_query("after=a%20b+c&limit=5&").unwrap(), q(&[("after", "a b c"), ("limit", "5")]));
        assert_eq!(parse_query("after=%C3%A9").unwrap(), q(&[("after", "é")]));
        assert_eq!(parse_query("after").unwrap(), q(&[("after", "")]));
        assert_eq!(parse_query("after=%00").unwrap(), q(&[("after", "\0")]), "decoded; check_key refuses it");
        for (raw, named) in [
            ("after=%FF", Some("after")),
            ("after=%C3", Some("after")),
            ("after=%", Some("after")),
            ("after=%zz", Some("after")),
            ("after=%é", Some("after")),
            ("after=%+1", Some("after")),
            ("limit=1&limit=2", Some("limit")),
            ("%FF=1", None),
        ] {
            assert_eq!(parameter(parse_query(raw).unwrap_err()).as_deref(), named, "{raw}");
        }
    }

    #[test]
    fn bodies_carry_the_stored_text_and_keys_as_json_strings() {
        let d = |key: &str, doc: &str, version| Document { key: key.into(), doc: doc.into(), version };
        let big = r#"{"n": 12345678901234567890123456789, "x": 1.00000000000000000000001}"#;
        let one = one_body(d("a\"b", big, 3));
        let parsed: serde_json::Value = serde_json::from_slice(&one).unwrap();
        assert_eq!(parsed["key"], "a\"b");
        assert_eq!(parsed["version"], 3);
        assert!(std::str::from_utf8(&one).unwrap().contains(big), "the document's text as stored");
        let docs = vec![d("a", "1", 1), d("b", "[2]", 2), d("c", "{}", 1)];
        let page = page_body(docs.clone(), 2);
        assert_eq!(
            std::str::from_utf8(&page).unwrap(),
            r#"{"documents":[{"document":1,"key":"a","version":1},{"document":[2],"key":"b","version":2}],"next":"b"}"#
        );
        let last = page_body(docs, 3);
        let parsed: serde_json::Value = serde_json::from_slice(&last).unwrap();
        assert_eq!(parsed["next"], serde_json::Value::Null);
        assert_eq!(parsed["documents"].as_array().unwrap().len(), 3);
        assert_eq!(&page_body(vec![], 10)[..], br#"{"documents":[],"next":null}"#);
    }

    #[test]
    fn keys_no_document_can_have_are_refused() {
        assert!(check_key("o-17", 8).is_ok());
        assert!(check_key("12345678", 8).is_ok());
        assert!(check_key("123456789", 8).unwrap_err().contains("gateway.max_key_bytes"));
        assert!(check_key("a\0", 8).unwrap_err().contains("NUL"));
    }
}
