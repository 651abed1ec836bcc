//! The workload: concurrent sessions, each a token chain, writing (replace and merge) and
//! reading (single documents and collection pages) a small hot key set through the
//! gateways, recording every operation. Now and then a session ends and a new one starts
//! with another live session's token: it reads what the other wrote.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parsley::murmur2::partition_for_key;
use serde_json::json;
use tokio::sync::Mutex;

use crate::history::{Apply, Event, Observed, Outcome, WriteId};
use crate::http::{Client, Response};

/// The gateway's session header.
pub const SESSION_HEADER: &str = "Parsley-Session";

/// Where events are recorded, on one clock (milliseconds since the run began).
pub struct Recorder {
    began: Instant,
    events: StdMutex<Vec<Event>>,
}

impl Recorder {
    pub fn new() -> Recorder {
        Recorder { began: Instant::now(), events: StdMutex::new(Vec::new()) }
    }

    pub fn now_ms(&self) -> u64 {
        self.began.elapsed().as_millis() as u64
    }

    pub fn record(&self, event: Event) {
        self.events.lock().expect("the history lock is never poisoned").push(event);
    }

    /// A fault, with the run's clock and the wall clock; also told on stderr.
    pub fn fault(&self, what: String) {
        let unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        eprintln!("[check] {:>7.1}s fault: {what}", self.now_ms() as f64 / 1000.0);
        self.record(Event::Fault { what, at_ms: self.now_ms(), unix_ms });
    }

    pub fn take(&self) -> Vec<Event> {
        std::mem::take(&mut *self.events.lock().expect("the history lock is never poisoned"))
    }

    /// Operations recorded so far, and how many were 503s.
    pub fn counts(&self) -> (u64, u64) {
        let events = self.events.lock().expect("the history lock is never poisoned");
        let ops = events.iter().filter(|e| e.op().is_some()).count() as u64;
        let unavailable = events
            .iter()
            .filter(|e| {
                matches!(
                    e,
                    Event::Write { outcome: Outcome::Unavailable, .. }
                        | Event::Read { outcome: Outcome::Unavailable, .. }
                        | Event::Page { outcome: Outcome::Unavailable, .. }
                )
            })
            .count() as u64;
        (ops, unavailable)
    }
}

impl Default for Recorder {
    fn default() -> Recorder {
        Recorder::new()
    }
}

/// What the sessions are pointed at.
#[derive(Clone, Debug)]
pub struct Target {
    pub gateways: Vec<Client>,
    pub model: String,
    pub replace_topic: String,
    pub merge_topic: String,
    /// The run's keys; they share a prefix no other run uses, `<run>-`.
    pub run: String,
    pub keys: Vec<String>,
    /// Of every 100 operations, how many are writes; of the rest, 8 in 11 read one key and
    /// 3 in 11 a page.
    pub write_percent: u64,
    /// A named query that answers a key's document (see [`QueryTarget`]): with it, half the
    /// single-key reads go through it.
    pub query: Option<QueryTarget>,
}

/// A named query of a SQL model that applies the same topics as the document model (replace
/// and merge alike), taking the key as its parameter `key` and answering at most one row
/// with the columns `document` (the document as the documents model would hold it) and
/// `version` (the records applied to it). `config/check.toml`'s `check_q/document` is one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueryTarget {
    pub model: String,
    pub name: String,
}

impl QueryTarget {
    /// `<model>/<query>`.
    pub fn parse(text: &str) -> Option<QueryTarget> {
        let (model, name) = text.split_once('/')?;
        (!model.is_empty() && !name.is_empty() && !name.contains('/'))
            .then(|| QueryTarget { model: model.to_string(), name: name.to_string() })
    }

    pub fn label(&self) -> String {
        format!("{}/{}", self.model, self.name)
    }
}

/// The run's hot keys, `<run>-kNN`: at least `wanted`, and enough that every partition of
/// every topic (`partitions`, each topic's count) holds one of them, partitioned as the
/// producers partition (murmur2 of the key). The first key of each partition not yet
/// covered is taken, then the lowest-numbered others up to `wanted`.
pub fn keys_covering(run: &str, wanted: usize, partitions: &[u32]) -> Vec<String> {
    let name = |i: usize| format!("{run}-k{i:02}");
    let mut uncovered: BTreeSet<(usize, u32)> =
        partitions.iter().enumerate().flat_map(|(t, &n)| (0..n).map(move |p| (t, p))).collect();
    let mut chosen: BTreeSet<usize> = BTreeSet::new();
    // Murmur2 spreads keys evenly: a few hundred candidates cover any count a test or a
    // small deployment has, so the bound only stops a pathological count.
    for i in 0..100_000 {
        if uncovered.is_empty() {
            break;
        }
        let key = name(i);
        let mut covers = false;
        for (t, &n) in partitions.iter().enumerate() {
            covers |= uncovered.remove(&(t, partition_for_key(key.as_bytes(), n)));
        }
        if covers {
            chosen.insert(i);
        }
    }
    let mut i = 0;
    while chosen.len() < wanted.max(1) {
        chosen.insert(i);
        i += 1;
    }
    chosen.into_iter().map(name).collect()
}

/// One session slot: the session now using it, its last operation, its token.
struct Slot {
    session: u64,
    seq: u64,
    token: Option<String>,
}

/// SplitMix64: the workload's choices, reproducible from a seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Runs `sessions` sessions until `deadline` or until `max_ops` operations were issued.
pub async fn run(
    target: Arc<Target>,
    recorder: Arc<Recorder>,
    sessions: usize,
    deadline: Instant,
    max_ops: Option<u64>,
    seed: u64,
) {
    let ids = Arc::new(AtomicU64::new(1));
    let issued = Arc::new(AtomicU64::new(0));
    let slots: Arc<Vec<Mutex<Slot>>> = Arc::new(
        (0..sessions)
            .map(|_| {
                let session = ids.fetch_add(1, Ordering::SeqCst);
                recorder.record(Event::Session { session, from: None, from_seq: 0, at_ms: recorder.now_ms() });
                Mutex::new(Slot { session, seq: 0, token: None })
            })
            .collect(),
    );
    let mut tasks = Vec::new();
    for me in 0..sessions {
        let (target, recorder, slots, ids, issued) =
            (target.clone(), recorder.clone(), slots.clone(), ids.clone(), issued.clone());
        let mut rng = Rng::new(seed ^ (me as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline && max_ops.is_none_or(|m| issued.fetch_add(1, Ordering::SeqCst) < m) {
                if sessions > 1 && rng.below(100) < 2 {
                    let other = (me + 1 + rng.below(sessions as u64 - 1) as usize) % sessions;
                    let (from, from_seq, token) = {
                        let o = slots[other].lock().await;
                        (o.session, o.seq, o.token.clone())
                    };
                    let session = ids.fetch_add(1, Ordering::SeqCst);
                    recorder.record(Event::Session { session, from: Some(from), from_seq, at_ms: recorder.now_ms() });
                    *slots[me].lock().await = Slot { session, seq: 0, token };
                }
                let mut slot = slots[me].lock().await;
                let outcome = step(&target, &recorder, &mut slot, &mut rng).await;
                drop(slot);
                if matches!(outcome, Outcome::Unavailable | Outcome::Failed) {
                    tokio::time::sleep(Duration::from_millis(50 + rng.below(150))).await;
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// One operation of the slot's session.
async fn step(target: &Target, recorder: &Recorder, slot: &mut Slot, rng: &mut Rng) -> Outcome {
    slot.seq += 1;
    let (session, seq) = (slot.session, slot.seq);
    let gateway = rng.below(target.gateways.len() as u64) as usize;
    let client = &target.gateways[gateway];
    let headers: Vec<(&str, &str)> = slot.token.as_deref().map(|t| vec![(SESSION_HEADER, t)]).unwrap_or_default();
    let start_ms = recorder.now_ms();
    let dice = rng.below(100);
    let writes = target.write_percent.min(100);
    if dice < writes {
        let key = target.keys[rng.below(target.keys.len() as u64) as usize].clone();
        let apply = if rng.below(2) == 0 { Apply::Replace } else { Apply::Merge };
        let topic = match apply {
            Apply::Replace => &target.replace_topic,
            Apply::Merge => &target.merge_topic,
        };
        let body = json!({ "key": key, "value": apply.value(WriteId::new(session, seq)) });
        let answer = client.post_json(&format!("/v1/topics/{topic}/records"), &headers, &body).await;
        let outcome = outcome(&answer, 201);
        if outcome == Outcome::Ok {
            adopt(slot, &answer);
        }
        recorder.record(Event::Write {
            session,
            seq,
            key,
            apply,
            outcome,
            gateway,
            start_ms,
            end_ms: recorder.now_ms(),
        });
        outcome
    } else if dice < writes + (100 - writes) * 8 / 11 {
        let key = target.keys[rng.below(target.keys.len() as u64) as usize].clone();
        if let Some(query) = target.query.as_ref().filter(|_| rng.below(2) == 0) {
            return query_read(target, recorder, slot, query, key, gateway, start_ms).await;
        }
        let answer = client.get(&format!("/v1/models/{}/documents/{key}", target.model), &headers).await;
        let mut outcome = outcome(&answer, 200);
        let mut document = None;
        if let Ok(r) = &answer {
            if r.status == 404 && r.header(SESSION_HEADER).is_some() {
                outcome = Outcome::NotFound;
            }
            if outcome == Outcome::Ok {
                document = r.json().ok().and_then(|v| {
                    Some(Observed {
                        key: key.clone(),
                        document: v.get("document")?.clone(),
                        version: v.get("version")?.as_i64()?,
                    })
                });
                if document.is_none() {
                    outcome = Outcome::Failed;
                }
            }
        }
        let read = ReadDone { key, outcome, document, query: None };
        finish_read(recorder, slot, &answer, read, gateway, start_ms)
    } else {
        let after = format!("{}-", target.run);
        let limit = target.keys.len() as u32;
        let answer =
            client.get(&format!("/v1/models/{}/documents?limit={limit}&after={after}", target.model), &headers).await;
        let mut outcome = outcome(&answer, 200);
        let (mut documents, mut next) = (Vec::new(), None);
        if let Some(r) = answer.as_ref().ok().filter(|_| outcome == Outcome::Ok) {
            let page = r.json().ok().and_then(|v| {
                let docs = v.get("documents")?.as_array()?.iter().map(|d| {
                    Some(Observed {
                        key: d.get("key")?.as_str()?.to_string(),
                        document: d.get("document")?.clone(),
                        version: d.get("version")?.as_i64()?,
                    })
                });
                let docs: Option<Vec<Observed>> = docs.collect();
                Some((docs?, v.get("next")?.as_str().map(str::to_string)))
            });
            match page {
                Some((d, n)) => (documents, next) = (d, n),
                None => outcome = Outcome::Failed,
            }
        }
        if outcome == Outcome::Ok {
            adopt(slot, &answer);
        }
        recorder.record(Event::Page {
            session,
            seq,
            after,
            limit,
            outcome,
            documents,
            next,
            gateway,
            start_ms,
            end_ms: recorder.now_ms(),
        });
        outcome
    }
}

/// A single-key read through the named query `query`: its one row is the document, no row
/// is no document (the answer is gated like a document read: coverage proven either way).
async fn query_read(
    target: &Target,
    recorder: &Recorder,
    slot: &mut Slot,
    query: &QueryTarget,
    key: String,
    gateway: usize,
    start_ms: u64,
) -> Outcome {
    let client = &target.gateways[gateway];
    let token = slot.token.clone();
    let headers: Vec<(&str, &str)> = token.as_deref().map(|t| vec![(SESSION_HEADER, t)]).unwrap_or_default();
    let answer = client.get(&format!("/v1/models/{}/queries/{}?key={key}", query.model, query.name), &headers).await;
    let mut outcome = outcome(&answer, 200);
    let mut document = None;
    if let Some(r) = answer.as_ref().ok().filter(|_| outcome == Outcome::Ok) {
        let rows = r.json().ok().and_then(|v| v.get("rows")?.as_array().cloned());
        match rows.as_deref() {
            Some([]) => outcome = Outcome::NotFound,
            Some([row]) => {
                document = (|| {
                    Some(Observed {
                        key: key.clone(),
                        document: row.get("document")?.clone(),
                        version: row.get("version")?.as_i64()?,
                    })
                })();
                if document.is_none() {
                    outcome = Outcome::Failed;
                }
            }
            _ => outcome = Outcome::Failed,
        }
        if outcome == Outcome::Failed {
            eprintln!(
                "[check] {} answered what is not one document: {}",
                query.label(),
                String::from_utf8_lossy(&r.body)
            );
        }
    }
    let read = ReadDone { key, outcome, document, query: Some(query.label()) };
    finish_read(recorder, slot, &answer, read, gateway, start_ms)
}

/// What a single-key read found.
struct ReadDone {
    key: String,
    outcome: Outcome,
    document: Option<Observed>,
    query: Option<String>,
}

/// Records a single-key read (the session goes on with its token if it was answered).
fn finish_read(
    recorder: &Recorder,
    slot: &mut Slot,
    answer: &anyhow::Result<Response>,
    read: ReadDone,
    gateway: usize,
    start_ms: u64,
) -> Outcome {
    if matches!(read.outcome, Outcome::Ok | Outcome::NotFound) {
        adopt(slot, answer);
    }
    recorder.record(Event::Read {
        session: slot.session,
        seq: slot.seq,
        key: read.key,
        outcome: read.outcome,
        document: read.document,
        query: read.query,
        gateway,
        start_ms,
        end_ms: recorder.now_ms(),
    });
    read.outcome
}

/// `expected`: ok; a 503: unavailable; anything else (no answer included): failed.
fn outcome(answer: &anyhow::Result<Response>, expected: u16) -> Outcome {
    match answer {
        Ok(r) if r.status == expected => Outcome::Ok,
        Ok(r) if r.status == 503 => Outcome::Unavailable,
        // A single read's `404 not-found` is told apart by its caller.
        Ok(r) if r.status == 404 => Outcome::Failed,
        Ok(r) => {
            eprintln!("[check] unexpected {}: {}", r.status, String::from_utf8_lossy(&r.body));
            Outcome::Failed
        }
        Err(_) => Outcome::Failed,
    }
}

/// The session goes on with the token the gateway answered.
fn adopt(slot: &mut Slot, answer: &anyhow::Result<Response>) {
    if let Some(t) = answer.as_ref().ok().and_then(|r| r.header(SESSION_HEADER)) {
        slot.token = Some(t.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keys_cover_every_partition_of_every_topic() {
        for (wanted, partitions) in [(16, vec![4, 4]), (1, vec![4, 4]), (3, vec![32, 7]), (20, vec![]), (0, vec![1])] {
            let keys = keys_covering("chk1", wanted, &partitions);
            assert!(keys.len() >= wanted.max(1), "{wanted} {partitions:?}: {keys:?}");
            for &n in &partitions {
                let covered: BTreeSet<u32> = keys.iter().map(|k| partition_for_key(k.as_bytes(), n)).collect();
                assert_eq!(covered.len(), n as usize, "{wanted} {partitions:?}: {keys:?}");
            }
            assert!(keys.iter().all(|k| k.starts_with("chk1-k")), "{keys:?}");
        }
        assert_eq!(keys_covering("chk1", 3, &[]), ["chk1-k00", "chk1-k01", "chk1-k02"]);
    }

    #[test]
    fn a_query_is_named_model_slash_query() {
        let q = QueryTarget::parse("check_q/document").unwrap();
        assert_eq!((q.model.as_str(), q.name.as_str(), q.label()), ("check_q", "document", "check_q/document".into()));
        for bad in ["check_q", "/document", "check_q/", "a/b/c", ""] {
            assert_eq!(QueryTarget::parse(bad), None, "{bad:?}");
        }
    }
}
