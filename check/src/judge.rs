//! The judge: session guarantees checked from a recorded history alone (no database, no
//! token, no clock row). Pure: events in, a verdict out.
//!
//! **Causal past.** Each session's knowledge after each of its operations is a vector clock
//! over sessions (`session → seq`): knowing `(Y, q)` means knowing everything session `Y`
//! knew after its operation `q`. A write is known to its own session from then on (only a
//! write the gateway acknowledged with `201`: the token holds nothing of another); a read
//! that returns a document learns every write the document names and, through each, what
//! that write's session knew when it sent it; a session that starts from another's token
//! starts with that session's knowledge. A read also learns a **floor**: the key's document
//! was at `version` v, so every later read that knows this read must see version ≥ v.
//!
//! **Reflected.** A document names its last replace `R` and the merges applied after it
//! (each adds one field, and only a replace removes fields). A required write `w` on the key
//! is reflected when the document names it, or when it was applied before `R` (then `R`
//! overwrote it). It is certainly *not* reflected when it is absent and must have been
//! applied after `R`: the document has no replace at all, `R` is in `w`'s causal past (the
//! projector applies causally), or the apply order says so — `version` counts the records
//! applied to the document, so a replace shown with `m` merges after it was applied at
//! index `version − m`, and a merge shown after a replace applied at `i` was applied after
//! `i`. Only certain violations are reported; an absent write whose order against `R` the
//! history cannot tell is not judged.
//!
//! **Kinds**, by why the reader had to see the write (the first that applies):
//! read-your-writes (its own), monotonic reads (an earlier read of its returned it, or a
//! version floor of its own), monotonic writes (a later write of the same session is seen),
//! writes-follow-reads (a write it has seen was sent by a session that had read it), and
//! causal visibility (any other path through the history). A collection page is judged the
//! same way, document by document; a key of the run inside the page's range that the page
//! leaves out is an absent document. `503`s and failed requests are counted, never judged.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::history::{Apply, Event, Observed, Outcome, WriteId};

/// A vector clock over sessions.
type Clock = BTreeMap<u64, u64>;

/// Which guarantee a violation breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    ReadYourWrites,
    MonotonicReads,
    MonotonicWrites,
    WritesFollowReads,
    CausalVisibility,
    /// Documents that no apply order explains: a replace shown at two different apply
    /// indexes, or a field naming a write nobody in the history sent.
    Inconsistent,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::ReadYourWrites => "read-your-writes",
            Kind::MonotonicReads => "monotonic-reads",
            Kind::MonotonicWrites => "monotonic-writes",
            Kind::WritesFollowReads => "writes-follow-reads",
            Kind::CausalVisibility => "causal-visibility",
            Kind::Inconsistent => "inconsistent",
        }
    }
}

/// One violation, with the few events that explain it.
#[derive(Clone, Debug, Serialize)]
pub struct Violation {
    pub kind: Kind,
    /// Found in a collection page rather than a single-document read.
    pub collection: bool,
    pub session: u64,
    pub seq: u64,
    pub key: String,
    pub detail: String,
    pub excerpt: Vec<Event>,
}

/// What a history shows.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Verdict {
    pub ops: u64,
    pub writes: u64,
    pub reads: u64,
    pub collection_reads: u64,
    /// `503` answers.
    pub unavailable: u64,
    /// Requests without an answer (or with an unexpected status).
    pub failed: u64,
    pub faults: u64,
    /// Single-document reads (`200` or `404`) and pages (`200`) judged.
    pub judged_reads: u64,
    /// Of the judged single-document reads, those through a named query.
    pub judged_query_reads: u64,
    pub judged_collection_reads: u64,
    pub violations: Vec<Violation>,
}

impl Verdict {
    /// The checker's success rule: no violation, and at least one read of each kind judged.
    pub fn passed(&self) -> bool {
        self.violations.is_empty() && self.judged_reads > 0 && self.judged_collection_reads > 0
    }

    /// The one JSON line printed on stdout.
    pub fn summary(&self) -> serde_json::Value {
        let mut by_kind: BTreeMap<&str, u64> = BTreeMap::new();
        for v in &self.violations {
            *by_kind.entry(v.kind.name()).or_default() += 1;
        }
        serde_json::json!({
            "ops": self.ops, "writes": self.writes, "reads": self.reads,
            "collection_reads": self.collection_reads, "unavailable": self.unavailable,
            "faults": self.faults, "violations": self.violations.len(),
            "failed": self.failed, "judged_reads": self.judged_reads,
            "judged_query_reads": self.judged_query_reads,
            "judged_collection_reads": self.judged_collection_reads, "by_kind": by_kind,
        })
    }
}

/// A document as the judge reads it.
#[derive(Clone, Debug)]
struct Doc {
    replace: Option<WriteId>,
    merges: Vec<WriteId>,
    version: i64,
    /// Fields that name no write (malformed, or written by no one in the history).
    foreign: Vec<String>,
}

impl Doc {
    fn parse(observed: &Observed) -> Doc {
        let mut doc = Doc { replace: None, merges: Vec::new(), version: observed.version, foreign: Vec::new() };
        if let Some(fields) = observed.document.as_object() {
            for (name, value) in fields {
                match (name.as_str(), value.as_str()) {
                    ("r", Some(id)) => match WriteId::parse(id) {
                        Some(id) => doc.replace = Some(id),
                        None => doc.foreign.push(format!("r={id}")),
                    },
                    (id, Some("m")) => match WriteId::parse(id) {
                        Some(id) => doc.merges.push(id),
                        None => doc.foreign.push(id.to_string()),
                    },
                    (other, _) => doc.foreign.push(other.to_string()),
                }
            }
        } else {
            doc.foreign.push(observed.document.to_string());
        }
        doc
    }

    fn names(&self) -> impl Iterator<Item = WriteId> + '_ {
        self.replace.iter().copied().chain(self.merges.iter().copied())
    }

    fn shows(&self, w: WriteId) -> bool {
        self.replace == Some(w) || self.merges.contains(&w)
    }

    /// The apply index of the replace shown (every merge after it is shown).
    fn replace_index(&self) -> i64 {
        self.version - self.merges.len() as i64
    }
}

struct WriteInfo {
    event: usize,
    ok: bool,
}

/// One judged observation: a document of `key` (or none) seen by an operation.
struct Look<'a> {
    event: usize,
    session: u64,
    seq: u64,
    /// The model whose apply order the document shows ([`source`]).
    source: &'a str,
    key: &'a str,
    doc: Option<Doc>,
    collection: bool,
}

/// A version floor's place: (model, session, key).
type FloorKey<'a> = (&'a str, u64, &'a str);

/// Which model's apply order an operation's documents show: the named query's
/// (`<model>/<query>`) for a read through one, `""` (the documents model) otherwise. Two
/// models applying the same topics each deliver causally, but may interleave concurrent
/// writes differently, so apply indexes and version floors are facts of one model; the
/// writes a reader must see are the same for every model.
fn source(e: &Event) -> &str {
    match e {
        Event::Read { query: Some(q), .. } => q,
        _ => "",
    }
}

/// Judges `history`. A history that is not well formed (operations out of sequence, a
/// session starting from an unknown one, a cycle of observations) is an error.
pub fn judge(history: &[Event]) -> Result<Verdict, String> {
    let mut verdict = Verdict::default();
    let mut keys: BTreeSet<String> = BTreeSet::new();
    let mut starts: BTreeMap<u64, Option<(u64, u64)>> = BTreeMap::new();
    let mut ops: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    let mut writes: BTreeMap<WriteId, WriteInfo> = BTreeMap::new();
    for (i, e) in history.iter().enumerate() {
        match e {
            Event::Start { keys: k, .. } => keys.extend(k.iter().cloned()),
            Event::Session { session, from, from_seq, .. } => {
                if starts.insert(*session, from.map(|f| (f, *from_seq))).is_some() {
                    return Err(format!("session {session} starts twice"));
                }
            }
            Event::Fault { .. } => verdict.faults += 1,
            Event::Write { session, seq, key, outcome, .. } => {
                keys.insert(key.clone());
                writes.insert(WriteId::new(*session, *seq), WriteInfo { event: i, ok: *outcome == Outcome::Ok });
            }
            Event::Read { .. } | Event::Page { .. } => {}
        }
        if let Some((session, seq)) = e.op() {
            let list = ops.entry(session).or_default();
            if seq != list.len() as u64 + 1 {
                return Err(format!("session {session}: operation {seq} follows operation {}", list.len()));
            }
            list.push(i);
            verdict.ops += 1;
            let outcome = match e {
                Event::Write { outcome, .. } => {
                    verdict.writes += 1;
                    *outcome
                }
                Event::Read { outcome, .. } => {
                    verdict.reads += 1;
                    *outcome
                }
                Event::Page { outcome, .. } => {
                    verdict.collection_reads += 1;
                    *outcome
                }
                _ => unreachable!("only operations have a session and a seq"),
            };
            match outcome {
                Outcome::Unavailable => verdict.unavailable += 1,
                Outcome::Failed => verdict.failed += 1,
                Outcome::Ok | Outcome::NotFound => {}
            }
        }
    }
    for (session, from) in &starts {
        if let Some((from, seq)) = from {
            if ops.get(from).map_or(0, Vec::len) < *seq as usize {
                return Err(format!(
                    "session {session} starts from operation {seq} of session {from}, which never ran"
                ));
            }
        }
    }

    // The documents each operation saw.
    let seen = |e: &Event| -> Vec<Observed> {
        match e {
            Event::Read { outcome: Outcome::Ok, document: Some(d), .. } if keys.contains(&d.key) => vec![d.clone()],
            Event::Page { outcome: Outcome::Ok, documents, .. } => {
                documents.iter().filter(|d| keys.contains(&d.key)).cloned().collect()
            }
            _ => Vec::new(),
        }
    };

    // Vector clocks after each operation, in an order where every dependency comes first.
    let mut clocks: BTreeMap<u64, Vec<Clock>> = BTreeMap::new();
    let sessions: BTreeSet<u64> = ops.keys().chain(starts.keys()).copied().collect();
    loop {
        let mut progress = false;
        let mut done = true;
        for &s in &sessions {
            let list = ops.get(&s).map(Vec::as_slice).unwrap_or_default();
            if !clocks.contains_key(&s) {
                let initial = match starts.get(&s).copied().flatten() {
                    None => Some(Clock::new()),
                    Some((from, seq)) => clocks.get(&from).and_then(|c| c.get(seq as usize)).cloned(),
                };
                match initial {
                    Some(c) => {
                        clocks.insert(s, vec![c]);
                        progress = true;
                    }
                    None => {
                        done = false;
                        continue;
                    }
                }
            }
            loop {
                let computed = clocks[&s].len() - 1;
                if computed == list.len() {
                    break;
                }
                let n = computed as u64 + 1;
                let mut clock = clocks[&s][computed].clone();
                let mut ready = true;
                for d in seen(&history[list[computed]]) {
                    for w in Doc::parse(&d).names().filter(|w| writes.contains_key(w)) {
                        match clocks.get(&w.session).and_then(|c| c.get(w.seq as usize - 1)) {
                            Some(past) => {
                                join(&mut clock, past);
                                bump(&mut clock, w.session, w.seq);
                            }
                            None => ready = false,
                        }
                    }
                }
                if !ready {
                    done = false;
                    break;
                }
                bump(&mut clock, s, n);
                clocks.get_mut(&s).expect("present").push(clock);
                progress = true;
            }
        }
        if done {
            break;
        }
        if !progress {
            return Err("the history's observations form a cycle (a read shows a write sent after it)".into());
        }
    }

    // Facts about each key's apply order, from every document shown.
    // Per model ([`source`]): each apply order is that model's.
    let mut exact: BTreeMap<(&str, WriteId), (i64, usize)> = BTreeMap::new();
    let mut lower: BTreeMap<(&str, WriteId), i64> = BTreeMap::new();
    // Version floors per (model, session, key), by seq; writes per (session, key).
    let mut floors: BTreeMap<FloorKey<'_>, Vec<(u64, i64)>> = BTreeMap::new();
    let mut own: BTreeMap<(u64, &str), Vec<u64>> = BTreeMap::new();
    // The first operation of each session that saw each write.
    let mut saw: BTreeMap<u64, BTreeMap<WriteId, u64>> = BTreeMap::new();
    let mut looks: Vec<Look<'_>> = Vec::new();
    for (i, e) in history.iter().enumerate() {
        let Some((s, q)) = e.op() else { continue };
        match e {
            Event::Write { key, outcome: Outcome::Ok, .. } => own.entry((s, key.as_str())).or_default().push(q),
            Event::Read { key, outcome: outcome @ (Outcome::Ok | Outcome::NotFound), document, query, .. } => {
                verdict.judged_reads += 1;
                verdict.judged_query_reads += u64::from(query.is_some());
                let doc = if *outcome == Outcome::Ok { document.as_ref().map(Doc::parse) } else { None };
                looks.push(Look { event: i, session: s, seq: q, source: source(e), key, doc, collection: false });
            }
            Event::Page { outcome: Outcome::Ok, documents, after, next, .. } => {
                verdict.judged_collection_reads += 1;
                for k in keys.iter().filter(|k| k.as_str() > after.as_str() && next.as_ref().is_none_or(|n| *k <= n)) {
                    let doc = documents.iter().find(|d| &d.key == k).map(Doc::parse);
                    looks.push(Look { event: i, session: s, seq: q, source: "", key: k, doc, collection: true });
                }
            }
            _ => {}
        }
        for d in seen(e) {
            let doc = Doc::parse(&d);
            let key = keys.get(&d.key).expect("seen documents are of the run's keys").as_str();
            let list = floors.entry((source(e), s, key)).or_default();
            let best = list.last().map_or(doc.version, |&(_, v)| v.max(doc.version));
            list.push((q, best));
            for w in doc.names() {
                saw.entry(s).or_default().entry(w).or_insert(q);
            }
            if let Some(r) = doc.replace {
                let at = doc.replace_index();
                match exact.get(&(source(e), r)) {
                    Some(&(known, first)) if known != at => verdict.violations.push(Violation {
                        kind: Kind::Inconsistent,
                        collection: matches!(e, Event::Page { .. }),
                        session: s,
                        seq: q,
                        key: d.key.clone(),
                        detail: format!(
                            "replace {} shown as applied at index {at}, and at index {known} by an earlier read",
                            r.name()
                        ),
                        excerpt: vec![history[first].clone(), e.clone()],
                    }),
                    Some(_) => {}
                    None => {
                        exact.insert((source(e), r), (at, i));
                    }
                }
                for m in &doc.merges {
                    let l = lower.entry((source(e), *m)).or_insert(at + 1);
                    *l = (*l).max(at + 1);
                }
            }
            for w in doc.names().filter(|w| !writes.contains_key(w)) {
                verdict.violations.push(Violation {
                    kind: Kind::Inconsistent,
                    collection: matches!(e, Event::Page { .. }),
                    session: s,
                    seq: q,
                    key: d.key.clone(),
                    detail: format!("the document names write {}, which no session of the history sent", w.name()),
                    excerpt: vec![e.clone()],
                });
            }
            if !doc.foreign.is_empty() {
                verdict.violations.push(Violation {
                    kind: Kind::Inconsistent,
                    collection: matches!(e, Event::Page { .. }),
                    session: s,
                    seq: q,
                    key: d.key.clone(),
                    detail: format!("the document holds fields no write of the history sets: {:?}", doc.foreign),
                    excerpt: vec![e.clone()],
                });
            }
        }
    }

    let past = |w: WriteId| -> &Clock { &clocks[&w.session][w.seq as usize - 1] };
    let knows = |clock: &Clock, w: WriteId| clock.get(&w.session).is_some_and(|&q| q >= w.seq);
    for look in &looks {
        // What the reader knew before this operation, and what this very document shows: a
        // page's documents come from several tasks, and only later reads must reflect the
        // causal past of what another document of the page showed.
        let mut clock = clocks[&look.session][look.seq as usize - 1].clone();
        for w in look.doc.iter().flat_map(Doc::names).filter(|w| writes.contains_key(w)) {
            join(&mut clock, past(w));
            bump(&mut clock, w.session, w.seq);
        }
        let clock = &clock;
        let read = &history[look.event];
        // The highest version floor the reader knows.
        let mut floor: Option<(i64, u64, u64)> = None;
        for (&y, &upto) in clock {
            if let Some(list) = floors.get(&(look.source, y, look.key)) {
                let i = list.partition_point(|&(q, _)| q <= upto);
                if i > 0 && floor.is_none_or(|(v, _, _)| list[i - 1].1 > v) {
                    let v = list[i - 1].1;
                    let q = list[..i].iter().find(|&&(_, m)| m == v).map_or(list[i - 1].0, |&(q, _)| q);
                    floor = Some((v, y, q));
                }
            }
        }
        // Every acknowledged write on the key in the reader's causal past.
        let mut found = false;
        for (&y, &upto) in clock {
            let Some(seqs) = own.get(&(y, look.key)) else { continue };
            for &q in seqs.iter().take_while(|&&q| q <= upto) {
                let w = WriteId::new(y, q);
                let missing = match &look.doc {
                    None => true,
                    Some(doc) if doc.shows(w) => false,
                    Some(doc) => match doc.replace {
                        None => true,
                        Some(r) => {
                            let r_ok = writes.get(&r).is_some_and(|i| i.ok);
                            (r_ok && knows(past(w), r))
                                || exact.get(&(look.source, w)).is_some_and(|&(at, _)| at > doc.replace_index())
                                || lower.get(&(look.source, w)).is_some_and(|&at| at > doc.replace_index())
                        }
                    },
                };
                if !missing {
                    continue;
                }
                found = true;
                let (kind, witness) = classify(look, w, &saw, &writes, &own, &ops);
                let mut excerpt = vec![history[writes[&w].event].clone()];
                excerpt.extend(witness.map(|e| history[e].clone()));
                excerpt.push(read.clone());
                let shown = match &look.doc {
                    None => "no document".to_string(),
                    Some(d) => format!(
                        "a document at version {} showing {}",
                        d.version,
                        d.names().map(|w| w.name()).collect::<Vec<_>>().join(", ")
                    ),
                };
                verdict.violations.push(Violation {
                    kind,
                    collection: look.collection,
                    session: look.session,
                    seq: look.seq,
                    key: look.key.to_string(),
                    detail: format!(
                        "{} of session {} returned {shown}: it lacks write {} ({}), which the session knows and \
                         which was applied after what the document shows",
                        match &history[look.event] {
                            Event::Read { query: Some(q), .. } => format!("a read through the named query {q}"),
                            _ if look.collection => "a collection page".to_string(),
                            _ => "a read".to_string(),
                        },
                        look.session,
                        w.name(),
                        match history[writes[&w].event] {
                            Event::Write { apply: Apply::Replace, .. } => "replace",
                            _ => "merge",
                        }
                    ),
                    excerpt,
                });
            }
        }
        // The version floor, when no write already explains the read.
        let version = look.doc.as_ref().map_or(0, |d| d.version);
        if let Some((v, y, q)) = floor.filter(|&(v, _, _)| v > version && !found) {
            let kind = if y == look.session { Kind::MonotonicReads } else { Kind::CausalVisibility };
            let earlier = ops[&y][q as usize - 1];
            verdict.violations.push(Violation {
                kind,
                collection: look.collection,
                session: look.session,
                seq: look.seq,
                key: look.key.to_string(),
                detail: format!(
                    "the document is at version {version}, below version {v} that operation {q} of session {y} \
                     saw and this session knows"
                ),
                excerpt: vec![history[earlier].clone(), read.clone()],
            });
        }
    }
    Ok(verdict)
}

/// Why session `look.session` had to see `w`, and the event that shows it (if not `w`'s own).
fn classify(
    look: &Look<'_>,
    w: WriteId,
    saw: &BTreeMap<u64, BTreeMap<WriteId, u64>>,
    writes: &BTreeMap<WriteId, WriteInfo>,
    own: &BTreeMap<(u64, &str), Vec<u64>>,
    ops: &BTreeMap<u64, Vec<usize>>,
) -> (Kind, Option<usize>) {
    let s = look.session;
    if w.session == s {
        return (Kind::ReadYourWrites, None);
    }
    let empty = BTreeMap::new();
    let mine = saw.get(&s).unwrap_or(&empty);
    if let Some(&q) = mine.get(&w).filter(|&&q| q < look.seq) {
        return (Kind::MonotonicReads, Some(ops[&s][q as usize - 1]));
    }
    // Writes the reader saw (up to this operation) or sent.
    let sent = own.iter().filter(|((y, _), _)| *y == s).flat_map(|(_, seqs)| seqs.iter().map(|&q| WriteId::new(s, q)));
    let witnesses: Vec<WriteId> =
        mine.iter().filter(|(_, &q)| q <= look.seq).map(|(x, _)| *x).chain(sent.filter(|x| x.seq < look.seq)).collect();
    if let Some(x) = witnesses.iter().find(|x| x.session == w.session && x.seq > w.seq && writes.contains_key(x)) {
        return (Kind::MonotonicWrites, Some(writes[x].event));
    }
    for x in witnesses.iter().filter(|x| writes.contains_key(x)) {
        if saw.get(&x.session).and_then(|m| m.get(&w)).is_some_and(|&q| q < x.seq) {
            return (Kind::WritesFollowReads, Some(writes[x].event));
        }
    }
    (Kind::CausalVisibility, None)
}

fn join(into: &mut Clock, other: &Clock) {
    for (&s, &q) in other {
        bump(into, s, q);
    }
}

fn bump(clock: &mut Clock, session: u64, seq: u64) {
    let e = clock.entry(session).or_insert(seq);
    *e = (*e).max(seq);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A hand-written history: operations are appended in the order given.
    #[derive(Default)]
    struct H {
        events: Vec<Event>,
        next: BTreeMap<u64, u64>,
    }

    impl H {
        fn seq(&mut self, s: u64) -> u64 {
            let n = self.next.entry(s).or_insert(0);
            *n += 1;
            *n
        }

        fn write(&mut self, s: u64, key: &str, apply: Apply) -> WriteId {
            let seq = self.seq(s);
            self.events.push(Event::Write {
                session: s,
                seq,
                key: key.into(),
                apply,
                outcome: Outcome::Ok,
                gateway: 0,
                start_ms: 0,
                end_ms: 0,
            });
            WriteId::new(s, seq)
        }

        /// A read returning a document of replace `r` and merges `m` at `version`.
        fn read(&mut self, s: u64, key: &str, doc: Option<(Option<WriteId>, &[WriteId], i64)>) {
            let seq = self.seq(s);
            let (outcome, document) = match doc {
                None => (Outcome::NotFound, None),
                Some((r, m, version)) => (Outcome::Ok, Some(observed(key, r, m, version))),
            };
            self.events.push(Event::Read {
                session: s,
                seq,
                key: key.into(),
                outcome,
                document,
                query: None,
                gateway: 0,
                start_ms: 0,
                end_ms: 0,
            });
        }

        fn page(&mut self, s: u64, after: &str, documents: Vec<Observed>) {
            let seq = self.seq(s);
            self.events.push(Event::Page {
                session: s,
                seq,
                after: after.into(),
                limit: 100,
                outcome: Outcome::Ok,
                documents,
                next: None,
                gateway: 0,
                start_ms: 0,
                end_ms: 0,
            });
        }

        fn handover(&mut self, to: u64, from: u64) {
            let from_seq = self.next.get(&from).copied().unwrap_or(0);
            self.events.push(Event::Session { session: to, from: Some(from), from_seq, at_ms: 0 });
        }

        fn kinds(&self) -> Vec<(Kind, bool)> {
            let verdict = judge(&self.events).unwrap();
            verdict.violations.iter().map(|v| (v.kind, v.collection)).collect()
        }
    }

    fn observed(key: &str, r: Option<WriteId>, m: &[WriteId], version: i64) -> Observed {
        let mut doc = serde_json::Map::new();
        if let Some(r) = r {
            doc.insert("r".into(), json!(r.name()));
        }
        for w in m {
            doc.insert(w.name(), json!("m"));
        }
        Observed { key: key.into(), document: doc.into(), version }
    }

    #[test]
    fn a_faithful_history_has_no_violation() {
        let mut h = H::default();
        let a = h.write(1, "k", Apply::Replace);
        h.read(1, "k", Some((Some(a), &[], 1)));
        let b = h.write(2, "k", Apply::Merge);
        h.read(2, "k", Some((Some(a), &[b], 2)));
        // Session 1 does not know b: a document without it is fine.
        h.read(1, "k", Some((Some(a), &[], 1)));
        h.page(2, "", vec![observed("k", Some(a), &[b], 2)]);
        // A concurrent replace c (unknown order against b's session) overwrote what it likes.
        let c = h.write(3, "k", Apply::Replace);
        h.read(3, "k", Some((Some(c), &[], 3)));
        let v = judge(&h.events).unwrap();
        assert!(v.violations.is_empty(), "{:#?}", v.violations);
        assert!(v.passed());
        assert_eq!((v.ops, v.writes, v.reads, v.collection_reads, v.judged_reads), (8, 3, 4, 1, 4));
    }

    #[test]
    fn read_your_writes() {
        let mut h = H::default();
        let a = h.write(1, "k", Apply::Replace);
        h.read(2, "k", Some((Some(a), &[], 1)));
        h.write(2, "k", Apply::Merge);
        // Session 2's own merge is missing, and it was applied after a (2 had read a).
        h.read(2, "k", Some((Some(a), &[], 1)));
        assert_eq!(h.kinds(), [(Kind::ReadYourWrites, false)]);
        // Without a document at all.
        let mut h = H::default();
        h.write(1, "k", Apply::Replace);
        h.read(1, "k", None);
        assert_eq!(h.kinds(), [(Kind::ReadYourWrites, false)]);
    }

    #[test]
    fn two_models_may_apply_concurrent_writes_in_different_orders() {
        // Session 1's replace a and session 2's concurrent merge b: the documents model
        // applied b then a (the replace overwrote it), the query's model a then b.
        let mut h = H::default();
        let a = h.write(1, "k", Apply::Replace);
        let b = h.write(2, "k", Apply::Merge);
        h.read(3, "k", Some((Some(a), &[], 2)));
        h.read(3, "k", Some((Some(a), &[b], 2)));
        if let Some(Event::Read { query, .. }) = h.events.last_mut() {
            *query = Some("check_q/document".into());
        }
        assert_eq!(h.kinds(), [], "each model's apply order is its own");
        // Within one model, the same two documents are two apply orders.
        let mut h = H::default();
        let a = h.write(1, "k", Apply::Replace);
        let b = h.write(2, "k", Apply::Merge);
        h.read(3, "k", Some((Some(a), &[], 2)));
        h.read(3, "k", Some((Some(a), &[b], 2)));
        assert_eq!(h.kinds(), [(Kind::Inconsistent, false)]);
    }

    #[test]
    fn a_named_query_s_answer_is_judged_as_a_document_read() {
        let mut h = H::default();
        let a = h.write(1, "k", Apply::Replace);
        h.read(1, "k", Some((Some(a), &[], 1)));
        h.write(1, "k", Apply::Merge);
        h.read(1, "k", Some((Some(a), &[], 1)));
        if let Some(Event::Read { query, .. }) = h.events.last_mut() {
            *query = Some("check_q/document".into());
        }
        let verdict = judge(&h.events).unwrap();
        assert_eq!((verdict.judged_reads, verdict.judged_query_reads), (2, 1));
        let v = &verdict.violations[..];
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].kind, Kind::ReadYourWrites);
        assert!(v[0].detail.contains("named query check_q/document"), "{}", v[0].detail);
    }

    #[test]
    fn monotonic_reads() {
        let mut h = H::default();
        let a = h.write(1, "k", Apply::Replace);
        let b = h.write(1, "k", Apply::Merge);
        h.read(2, "k", Some((Some(a), &[b], 2)));
        // Back to version 1: the version floor.
        h.read(2, "k", Some((Some(a), &[], 1)));
        assert_eq!(h.kinds(), [(Kind::MonotonicReads, false)]);
        // A write seen earlier, missing later at the same version (a replaced document).
        let mut h = H::default();
        let a = h.write(1, "k", Apply::Merge);
        h.read(2, "k", Some((None, &[a], 1)));
        h.read(2, "k", Some((None, &[], 1)));
        assert_eq!(h.kinds(), [(Kind::MonotonicReads, false)]);
    }

    #[test]
    fn monotonic_writes() {
        let mut h = H::default();
        let a = h.write(1, "k", Apply::Merge);
        let b = h.write(1, "k", Apply::Merge);
        // b without a, which session 1 sent first.
        h.read(2, "k", Some((None, &[b], 1)));
        let _ = a;
        assert_eq!(h.kinds(), [(Kind::MonotonicWrites, false)]);
    }

    #[test]
    fn writes_follow_reads() {
        let mut h = H::default();
        let a = h.write(1, "j", Apply::Merge);
        h.read(2, "j", Some((None, &[a], 1)));
        let b = h.write(2, "k", Apply::Merge);
        // Session 3 sees b, whose sender had read a; then a's key without a.
        h.read(3, "k", Some((None, &[b], 1)));
        h.read(3, "j", None);
        assert_eq!(h.kinds(), [(Kind::WritesFollowReads, false)]);
    }

    #[test]
    fn causal_visibility() {
        let mut h = H::default();
        let a = h.write(1, "j", Apply::Replace);
        h.read(2, "j", Some((Some(a), &[], 1)));
        h.write(2, "x", Apply::Merge);
        // Session 3 starts with session 2's token: it knows a only through 2's read.
        h.handover(3, 2);
        h.read(3, "j", None);
        assert_eq!(h.kinds(), [(Kind::CausalVisibility, false)]);
        // The version floor learnt through another session.
        let mut h = H::default();
        let a = h.write(1, "j", Apply::Replace);
        let b = h.write(1, "j", Apply::Merge);
        h.read(2, "j", Some((Some(a), &[b], 2)));
        h.handover(3, 2);
        h.read(3, "j", Some((Some(a), &[], 1)));
        assert_eq!(h.kinds(), [(Kind::CausalVisibility, false)]);
    }

    #[test]
    fn collection_pages_are_judged_document_by_document() {
        let mut h = H::default();
        let a = h.write(1, "k1", Apply::Replace);
        let b = h.write(1, "k2", Apply::Replace);
        h.page(1, "", vec![observed("k1", Some(a), &[], 1), observed("k2", Some(b), &[], 1)]);
        assert!(h.kinds().is_empty());
        // The page leaves out k2, which session 1 wrote.
        h.page(1, "", vec![observed("k1", Some(a), &[], 1)]);
        assert_eq!(h.kinds(), [(Kind::ReadYourWrites, true)]);
        // A key beyond the page's range is not required.
        let mut h = H::default();
        h.write(1, "k2", Apply::Replace);
        let seq = h.seq(1);
        h.events.push(Event::Page {
            session: 1,
            seq,
            after: "k2".into(),
            limit: 1,
            outcome: Outcome::Ok,
            documents: vec![],
            next: None,
            gateway: 0,
            start_ms: 0,
            end_ms: 0,
        });
        assert!(h.kinds().is_empty());
    }

    #[test]
    fn an_absent_write_whose_order_is_unknown_is_not_judged() {
        let mut h = H::default();
        h.write(1, "k", Apply::Merge);
        let c = h.write(2, "k", Apply::Replace);
        // c may have been applied after a: a is overwritten, not missing.
        h.read(1, "k", Some((Some(c), &[], 2)));
        assert!(h.kinds().is_empty());
        // But not if the order is known: a shown after c elsewhere.
        let mut h = H::default();
        let a = h.write(1, "k", Apply::Merge);
        let c = h.write(2, "k", Apply::Replace);
        h.read(3, "k", Some((Some(c), &[a], 2)));
        h.read(1, "k", Some((Some(c), &[], 1)));
        assert_eq!(h.kinds(), [(Kind::ReadYourWrites, false)]);
    }

    #[test]
    fn unavailable_and_failed_answers_are_counted_never_judged() {
        let mut h = H::default();
        h.write(1, "k", Apply::Replace);
        let seq = h.seq(1);
        h.events.push(Event::Read {
            session: 1,
            seq,
            key: "k".into(),
            outcome: Outcome::Unavailable,
            document: None,
            query: None,
            gateway: 0,
            start_ms: 0,
            end_ms: 0,
        });
        let v = judge(&h.events).unwrap();
        assert_eq!((v.unavailable, v.judged_reads, v.violations.len()), (1, 0, 0));
        assert!(!v.passed(), "nothing was judged");
    }

    #[test]
    fn inconsistent_documents_and_malformed_histories() {
        let mut h = H::default();
        let a = h.write(1, "k", Apply::Replace);
        h.read(2, "k", Some((Some(a), &[], 1)));
        h.read(3, "k", Some((Some(a), &[], 2)));
        h.read(3, "k", Some((Some(WriteId::new(9, 9)), &[], 3)));
        assert_eq!(h.kinds(), [(Kind::Inconsistent, false), (Kind::Inconsistent, false)]);
        let mut h = H::default();
        h.write(1, "k", Apply::Replace);
        h.next.insert(1, 5);
        h.write(1, "k", Apply::Replace);
        assert!(judge(&h.events).unwrap_err().contains("follows"));
    }
}
