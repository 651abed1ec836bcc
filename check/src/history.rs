//! The recorded history of a run: one JSON object per line, in the order the events were
//! recorded. The judge ([`crate::judge`]) reads nothing else, so a saved history
//! (`--history FILE`) is re-checked offline exactly as the run judged it.
//!
//! A session is a token chain: its operations are numbered `seq` = 1, 2, … in the order it
//! issued them, one at a time. A write's value names the write, `"<session>.<seq>"`:
//! a replace writes `{"r": "<id>"}`, a merge `{"<id>": "m"}` (a JSON merge patch adding one
//! field), so every document a read returns names the replace it shows and the merges
//! applied since.

use std::io::{BufRead as _, Write as _};
use std::path::Path;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A write's identity: its session and its place in the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WriteId {
    pub session: u64,
    pub seq: u64,
}

impl WriteId {
    pub fn new(session: u64, seq: u64) -> WriteId {
        WriteId { session, seq }
    }

    /// `"<session>.<seq>"`, as it appears in documents.
    pub fn name(&self) -> String {
        format!("{}.{}", self.session, self.seq)
    }

    pub fn parse(text: &str) -> Option<WriteId> {
        let (s, q) = text.split_once('.')?;
        Some(WriteId { session: s.parse().ok()?, seq: q.parse().ok()? })
    }
}

/// Which topic a write went to, and so how the projector applies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Apply {
    Replace,
    Merge,
}

impl Apply {
    /// The record value naming write `id`.
    pub fn value(self, id: WriteId) -> Value {
        match self {
            Apply::Replace => serde_json::json!({ "r": id.name() }),
            Apply::Merge => serde_json::json!({ id.name(): "m" }),
        }
    }
}

/// How an operation ended, as the client saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// `201` for a write, `200` for a read.
    Ok,
    /// `404 not-found` of a single-document read: coverage proven, no document.
    NotFound,
    /// A `503` (with `Retry-After`): counted, never judged.
    Unavailable,
    /// No answer (connection refused or cut, timeout) or another status: never judged; a
    /// write may still have been applied.
    Failed,
}

/// One document as a read returned it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Observed {
    pub key: String,
    pub document: Value,
    pub version: i64,
}

/// One line of the history.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// The first line: what the run was pointed at, and its key set (every key it writes).
    Start { run: String, model: String, gateways: Vec<String>, keys: Vec<String> },
    /// Session `session` begins with the token session `from` had after its operation
    /// `from_seq` (0: before any), or with no token (`from` absent).
    Session {
        session: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from: Option<u64>,
        #[serde(default)]
        from_seq: u64,
        at_ms: u64,
    },
    Write {
        session: u64,
        seq: u64,
        key: String,
        apply: Apply,
        outcome: Outcome,
        gateway: usize,
        start_ms: u64,
        end_ms: u64,
    },
    /// A single-document read; `document` is present when `outcome` is `ok`. With `query`
    /// (`<model>/<query>`), the read went through that named query of a SQL model applying
    /// the same topics: its one row's `document` and `version` are the document (no row: no
    /// document), judged exactly as a document read.
    Read {
        session: u64,
        seq: u64,
        key: String,
        outcome: Outcome,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        document: Option<Observed>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        query: Option<String>,
        gateway: usize,
        start_ms: u64,
        end_ms: u64,
    },
    /// A collection page: `limit` documents after `after`; `next` as the gateway said.
    Page {
        session: u64,
        seq: u64,
        after: String,
        limit: u32,
        outcome: Outcome,
        #[serde(default)]
        documents: Vec<Observed>,
        #[serde(default)]
        next: Option<String>,
        gateway: usize,
        start_ms: u64,
        end_ms: u64,
    },
    /// A fault the nemesis injected (or healed), with the wall clock time.
    Fault { what: String, at_ms: u64, unix_ms: u64 },
}

impl Event {
    /// The session and sequence number of an operation.
    pub fn op(&self) -> Option<(u64, u64)> {
        match self {
            Event::Write { session, seq, .. } | Event::Read { session, seq, .. } | Event::Page { session, seq, .. } => {
                Some((*session, *seq))
            }
            _ => None,
        }
    }
}

/// Writes `events` as JSON lines.
pub fn save(path: &Path, events: &[Event]) -> anyhow::Result<()> {
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    for e in events {
        serde_json::to_writer(&mut out, e)?;
        out.write_all(b"\n")?;
    }
    out.flush().with_context(|| format!("writing {}", path.display()))
}

/// Reads a history saved by [`save`].
pub fn load(path: &Path) -> anyhow::Result<Vec<Event>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut events = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let event = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not a history event", path.display(), n + 1))?;
        events.push(event);
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_as_json_lines() {
        let events = vec![
            Event::Session { session: 2, from: Some(1), from_seq: 3, at_ms: 5 },
            Event::Read {
                session: 2,
                seq: 1,
                key: "k".into(),
                outcome: Outcome::Ok,
                document: Some(Observed {
                    key: "k".into(),
                    document: Apply::Merge.value(WriteId::new(1, 2)),
                    version: 1,
                }),
                query: Some("check_q/document".into()),
                gateway: 0,
                start_ms: 6,
                end_ms: 7,
            },
        ];
        let path = std::env::temp_dir().join(format!("parsley-check-history-{}.jsonl", std::process::id()));
        save(&path, &events).unwrap();
        assert_eq!(load(&path).unwrap(), events);
        let _ = std::fs::remove_file(path);
        assert_eq!(WriteId::parse("12.7"), Some(WriteId::new(12, 7)));
        assert_eq!(WriteId::parse("r"), None);
    }
}
