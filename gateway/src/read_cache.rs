//! Snapshots kept in memory: a covered document read's whole snapshot — the clock rows the
//! gate and the refresh read, the shape they were chosen by, and the answer's body — kept so
//! that the next reads of the same key (or page) are served without asking Postgres while
//! nothing has changed. A page is served by every task, so "its owner" below is every task
//! for a page: any task's step drops it.
//!
//! A kept snapshot is one snapshot's rows and data, exactly as a statement returned them, so
//! serving it is serving that snapshot: the gate runs over its rows like over any other, and
//! only a session those rows cover is served from it (with the token refreshed over the same
//! rows). A session they do not cover — a write of its own the snapshot predates — reads
//! Postgres as before. So what a read proves does not depend on the cache; the cache only
//! decides how old a covering snapshot may be, and the answer is: no older than the next
//! change of the key's owner. A snapshot is kept under the **generation** of its key's owner
//! task ([`ClockNotifier::generation`]) read before its statement ran, and is served only
//! while that is still the current generation, the listener is connected, and it is younger
//! than `gateway.read_cache_max_age_ms`. Every step that changes a task's clock notifies
//! (`NOTIFY parsley_clock`, in the step's transaction), a change of a model's shape or its
//! removal notifies the whole model (migration `20261205000000`), a document changed outside
//! a step notifies every model (`'*'`, migration `20261206000000`), and a reconnect of the
//! listener changes every generation — so a kept snapshot is dropped by the notification of
//! the first commit after it, which is as soon as a waiting read learns of that commit. The
//! age bound is a backstop.
//!
//! Before a kept snapshot serves a read, the read waits for the listener's barrier
//! ([`crate::notify::ClockNotifier::caught_up`]): past it, every notification committed before
//! the read arrived has been heard, so the snapshot is looked up again under the generations
//! as they are after every change that read must see.
//!
//! A snapshot is kept only if the generation did not change while its statement ran (a
//! notification that arrived meanwhile may be of a commit the snapshot does not have).
//! Memory: at most `gateway.read_cache_bytes` over all models (split evenly between them).
//! When a new snapshot would pass its model's share, room is made one snapshot at a time by
//! the CLOCK rule (second chance): snapshots of absent documents (`404`s) go first, then the
//! oldest kept snapshot not served since the hand last passed it; one that can no longer be
//! served goes whatever it was. A `404` is kept only in room `404`s make: it never evicts a
//! document. 64 MiB by default; `0` turns keeping off.
//!
//! What is counted is what a snapshot holds on the heap ([`charge`]): its key (one shared
//! `Arc<str>` for the map and the clock's slot), the body (copied to an allocation of its
//! exact length, so no spare capacity of the answer's buffer is kept), the rows, the entry
//! itself, and its share of the map's and the rings' tables (sized for their worst load; the
//! tables are shrunk when they hold far fewer entries than they have room for). The shape is
//! one per model, shared by its snapshots. A key whose entry went while its slot is still in
//! a ring is counted until the slot goes. A test measures it all with a counting allocator
//! (`gateway/tests/kept_bytes.rs`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use parsley::gate::{ClockRow, ModelShape};
use parsley::kept::KeptRules;

use crate::notify::ClockNotifier;

/// What a kept snapshot holds besides its rows: the answer's body (`None`: no document).
#[derive(Debug)]
pub struct Kept {
    /// The task that serves the snapshot's data (a key's owner under `shape`), or every task
    /// (`None`, a page): whose generation it was kept under.
    owner: Option<u32>,
    generation: u64,
    at: Instant,
    size: usize,
    /// Served since the clock's hand last passed it (its second chance).
    referenced: AtomicBool,
    pub shape: Arc<ModelShape>,
    pub rows: Arc<[ClockRow]>,
    pub body: Option<Bytes>,
}

/// The generation of `owner` (`None`: of every task of the model).
fn generation(notifier: &ClockNotifier, model: &str, owner: Option<u32>) -> Option<u64> {
    match owner {
        Some(task) => notifier.generation(model, task),
        None => notifier.model_generation(model),
    }
}

/// Per model, its kept snapshots by key.
#[derive(Debug)]
pub struct KeptReads {
    models: BTreeMap<String, Mutex<Model>>,
    /// Each model's share of `read_cache_bytes`; 0: nothing is kept.
    model_bytes: usize,
    max_age: Duration,
}

#[derive(Debug, Default)]
struct Model {
    /// What the entries hold ([`charge`]), and the keys of slots whose entry went.
    bytes: usize,
    keys: HashMap<Arc<str>, Entry>,
    /// The clock's rings, oldest first: snapshots of documents, and of absent ones. A slot
    /// whose key now holds another entry (or none) is skipped when the hand meets it.
    found: VecDeque<Slot>,
    missing: VecDeque<Slot>,
    next_id: u64,
    /// The shape the model's snapshots share (a new one when the model's shape changes).
    shape: Option<Arc<ModelShape>>,
}

#[derive(Debug)]
struct Entry {
    id: u64,
    kept: Arc<Kept>,
}

#[derive(Debug)]
struct Slot {
    key: Arc<str>,
    id: u64,
}

/// What a key held only by a ring's slot (its entry gone) is counted as.
fn stale_key(key: &str) -> usize {
    key.len() + ARC_HEADER
}

impl Model {
    /// Removes `key`'s entry, whose slot stays in its ring: the key is counted until the slot
    /// goes.
    fn remove(&mut self, key: &str) {
        if let Some(e) = self.keys.remove(key) {
            self.bytes -= e.kept.size;
            self.bytes += stale_key(key);
        }
    }

    /// A slot left its ring: its key is no longer counted if its entry had gone.
    fn slot_gone(&mut self, slot: &Slot) {
        if self.keys.get(&slot.key).is_none_or(|e| e.id != slot.id) {
            self.bytes -= stale_key(&slot.key);
        }
    }

    /// The model's shared shape equal to `shape`, made so if the shape changed.
    fn shape(&mut self, shape: &ModelShape) -> Arc<ModelShape> {
        match &self.shape {
            Some(s) if **s == *shape => Arc::clone(s),
            _ => {
                let s = Arc::new(shape.clone());
                self.shape = Some(Arc::clone(&s));
                s
            }
        }
    }

    /// Evicts one snapshot of `ring` by the CLOCK rule: the first in ring order not served
    /// since the hand last passed it, or that can no longer be served (`servable`). `false`:
    /// the ring is empty.
    fn evict_one(&mut self, missing: bool, servable: impl Fn(&Kept) -> bool) -> bool {
        loop {
            let ring = if missing { &mut self.missing } else { &mut self.found };
            let Some(slot) = ring.pop_front() else { return false };
            let Some(entry) = self.keys.get(&slot.key).filter(|e| e.id == slot.id) else {
                self.slot_gone(&slot);
                continue;
            };
            if servable(&entry.kept) && entry.kept.referenced.swap(false, Ordering::Relaxed) {
                ring.push_back(slot);
                continue;
            }
            let size = self.keys.remove(&slot.key).expect("looked up above").kept.size;
            self.bytes -= size;
            return true;
        }
    }

    /// Drops the slots of entries no longer there once they outnumber the live ones, so the
    /// rings stay within twice the entries (each insert pays for one slot of the pass), and
    /// shrinks the map and the rings when they have room for over four times what they
    /// hold, so that the tables stay within what [`charge`] counts for them.
    fn compact(&mut self) {
        if self.found.len() + self.missing.len() > 2 * self.keys.len() + 64 {
            let keys = &self.keys;
            let mut stale = 0;
            let mut live = |s: &Slot| {
                let live = keys.get(&s.key).is_some_and(|e| e.id == s.id);
                if !live {
                    stale += stale_key(&s.key);
                }
                live
            };
            self.found.retain(&mut live);
            self.missing.retain(&mut live);
            self.bytes -= stale;
        }
        let len = self.keys.len();
        if self.keys.capacity() > 4 * len + TABLE_SLACK {
            self.keys.shrink_to(2 * len);
        }
        for ring in [&mut self.found, &mut self.missing] {
            if ring.capacity() > 4 * ring.len() + TABLE_SLACK {
                ring.shrink_to(2 * ring.len());
            }
        }
    }
}

/// The reference counts ahead of an `Arc`'s value.
const ARC_HEADER: usize = 2 * std::mem::size_of::<usize>();
/// The tables' room beyond 4 per entry that is never shrunk away (what a model's first
/// entries find).
const TABLE_SLACK: usize = 64;
/// What an entry holds besides its key, body and rows: the entry in its `Arc`, the headers
/// of the key's and the rows' `Arc`s, the body's shared handle once it is served (`Bytes`
/// makes one on its first clone), and its share of the tables. The map (a `hashbrown`
/// table: one control byte per bucket, at most 8/7 of its entries after growth, less than
/// twice that before) is counted at 4 buckets per entry, as [`Model::compact`] keeps it; the
/// rings (up to two slots per entry, twice that in capacity) at 4 slots.
const ENTRY_OVERHEAD: usize = std::mem::size_of::<Kept>()
    + 3 * ARC_HEADER
    + 4 * std::mem::size_of::<usize>()
    + 4 * (std::mem::size_of::<(Arc<str>, Entry)>() + 1)
    + 4 * std::mem::size_of::<Slot>();

/// What a snapshot under a key of `key_len` bytes, with a body of `body_len` bytes and
/// `rows` clock rows, is counted as (the tables' share included; the key is counted once,
/// the map and its slot share it).
pub fn charge(key_len: usize, body_len: usize, rows: usize) -> usize {
    key_len + body_len + rows * std::mem::size_of::<ClockRow>() + ENTRY_OVERHEAD
}

impl KeptReads {
    /// Room for `bytes` over the configured `models`, each snapshot served for at most `max_age`.
    pub fn new<'a>(models: impl IntoIterator<Item = &'a str>, bytes: usize, max_age: Duration) -> KeptReads {
        let models: BTreeMap<String, Mutex<Model>> =
            models.into_iter().map(|m| (m.to_string(), Mutex::new(Model::default()))).collect();
        let model_bytes = bytes / models.len().max(1);
        KeptReads { models, model_bytes, max_age }
    }

    /// Whether anything is kept at all.
    pub fn on(&self) -> bool {
        self.model_bytes > 0 && !self.max_age.is_zero()
    }

    /// The generation to keep a snapshot under, read before its statement runs: that of the
    /// task serving it (`owner`), or of every task (`None`). `None`: nothing will be kept.
    pub fn before_read(&self, notifier: &ClockNotifier, model: &str, owner: Option<u32>) -> Option<u64> {
        if !self.on() || !notifier.may_keep() {
            return None;
        }
        generation(notifier, model, owner)
    }

    /// The snapshot kept for `key`, if it may still be served.
    pub fn get(&self, notifier: &ClockNotifier, model: &str, key: &str) -> Option<Arc<Kept>> {
        if !self.on() || !notifier.may_keep() {
            return None;
        }
        let mut m = self.models.get(model)?.lock().unwrap_or_else(|e| e.into_inner());
        let kept = &m.keys.get(key)?.kept;
        if self.servable(notifier, model, kept) {
            kept.referenced.store(true, Ordering::Relaxed);
            return Some(Arc::clone(kept));
        }
        m.remove(key);
        m.compact();
        None
    }

    /// Keeps a covered snapshot under `key`, read under the generation `read_under` (from
    /// [`Self::before_read`] for `owner`), unless a notification has arrived since.
    #[allow(clippy::too_many_arguments)]
    pub fn keep(
        &self,
        notifier: &ClockNotifier,
        model: &str,
        key: &str,
        owner: Option<u32>,
        read_under: u64,
        shape: &ModelShape,
        rows: &[ClockRow],
        body: Option<&[u8]>,
    ) {
        let size = charge(key.len(), body.map_or(0, <[u8]>::len), rows.len());
        let now = generation(notifier, model, owner);
        if size > self.model_bytes
            || !notifier.may_keep()
            || KeptRules::SHIPPED.keep_under(Some(read_under), now).is_none()
        {
            return;
        }
        let Some(m) = self.models.get(model) else { return };
        let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
        m.remove(key);
        let missing = body.is_none();
        let servable = |k: &Kept| self.servable(notifier, model, k);
        while m.bytes + size > self.model_bytes {
            // Absent documents first; a snapshot of an absent one never evicts a document.
            if !m.evict_one(true, servable) && (missing || !m.evict_one(false, servable)) {
                return;
            }
        }
        let id = m.next_id;
        m.next_id += 1;
        let kept = Kept {
            owner,
            generation: read_under,
            at: Instant::now(),
            size,
            referenced: AtomicBool::new(false),
            shape: m.shape(shape),
            rows: rows.into(),
            // Exactly the body's bytes, whatever spare room the answer's buffer had.
            body: body.map(Bytes::copy_from_slice),
        };
        let key: Arc<str> = Arc::from(key);
        m.keys.insert(Arc::clone(&key), Entry { id, kept: Arc::new(kept) });
        m.bytes += size;
        let slot = Slot { key, id };
        if missing {
            m.missing.push_back(slot);
        } else {
            m.found.push_back(slot);
        }
        m.compact();
    }

    /// Whether `kept` may still be served: its owner's generation unchanged, and young enough.
    fn servable(&self, notifier: &ClockNotifier, model: &str, kept: &Kept) -> bool {
        let now = generation(notifier, model, kept.owner);
        KeptRules::SHIPPED.servable(kept.generation, now, kept.at.elapsed(), self.max_age)
    }

    /// Bytes held for `model` now (the `parsley_gateway_read_cache_bytes` gauge).
    pub fn bytes(&self, model: &str) -> usize {
        self.models.get(model).map_or(0, |m| m.lock().unwrap_or_else(|e| e.into_inner()).bytes)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn shape() -> ModelShape {
        ModelShape { received_topics: BTreeSet::new(), task_count: 4 }
    }

    fn listening() -> ClockNotifier {
        let n = ClockNotifier::new(["shop", "audit"]);
        n.set_listening(true);
        n.set_announced(true);
        n
    }

    fn keep(k: &KeptReads, n: &ClockNotifier, key: &str, owner: u32, generation: u64, body: &str) {
        k.keep(n, "shop", key, Some(owner), generation, &shape(), &[], Some(body.as_bytes()));
    }

    fn body(k: &KeptReads, n: &ClockNotifier, key: &str) -> Option<Bytes> {
        k.get(n, "shop", key).and_then(|kept| kept.body.clone())
    }

    #[test]
    fn a_snapshot_is_served_until_its_owner_changes() {
        let n = listening();
        let k = KeptReads::new(["shop", "audit"], 1 << 20, Duration::from_secs(60));
        let g = k.before_read(&n, "shop", Some(2)).unwrap();
        keep(&k, &n, "a", 2, g, "{}");
        assert_eq!(body(&k, &n, "a").as_deref(), Some(&b"{}"[..]));
        assert!(body(&k, &n, "b").is_none());
        n.notified("shop:1");
        n.notified("audit:2");
        assert!(body(&k, &n, "a").is_some(), "another task's or model's step keeps it");
        n.notified("shop:2");
        assert!(body(&k, &n, "a").is_none(), "its owner's step drops it");
        assert_eq!(k.bytes("shop"), stale_key("a"), "only its key, held by its ring's slot until the hand passes");
        let g = k.before_read(&n, "shop", Some(2)).unwrap();
        keep(&k, &n, "a", 2, g, "{}");
        n.notified("shop");
        assert!(body(&k, &n, "a").is_none(), "a change of the whole model drops it");
    }

    #[test]
    fn a_snapshot_read_while_a_notification_arrived_is_not_kept() {
        let n = listening();
        let k = KeptReads::new(["shop"], 1 << 20, Duration::from_secs(60));
        let g = k.before_read(&n, "shop", Some(0)).unwrap();
        n.notified("shop:0");
        keep(&k, &n, "a", 0, g, "{}");
        assert!(body(&k, &n, "a").is_none());
    }

    #[test]
    fn nothing_is_kept_or_served_while_the_listener_is_not_connected() {
        let n = ClockNotifier::new(["shop"]);
        n.set_announced(true);
        let k = KeptReads::new(["shop"], 1 << 20, Duration::from_secs(60));
        assert!(k.before_read(&n, "shop", Some(0)).is_none());
        n.set_listening(true);
        let g = k.before_read(&n, "shop", Some(0)).unwrap();
        keep(&k, &n, "a", 0, g, "{}");
        assert!(body(&k, &n, "a").is_some());
        n.set_listening(false);
        assert!(body(&k, &n, "a").is_none());
        n.set_listening(true);
        assert!(body(&k, &n, "a").is_none(), "notifications may have been missed meanwhile");
    }

    #[test]
    fn a_snapshot_is_served_for_its_age_at_most() {
        let n = listening();
        let k = KeptReads::new(["shop"], 1 << 20, Duration::from_millis(30));
        let g = k.before_read(&n, "shop", Some(0)).unwrap();
        keep(&k, &n, "a", 0, g, "{}");
        assert!(body(&k, &n, "a").is_some());
        std::thread::sleep(Duration::from_millis(40));
        assert!(body(&k, &n, "a").is_none());
    }

    #[test]
    fn a_model_s_share_bounds_what_it_keeps_and_zero_keeps_nothing() {
        let n = listening();
        let share = 2 * charge(1, 7, 0);
        let k = KeptReads::new(["shop", "audit"], 2 * share, Duration::from_secs(60));
        let g = k.before_read(&n, "shop", Some(0)).unwrap();
        keep(&k, &n, "a", 0, g, "1234567");
        keep(&k, &n, "b", 0, g, "1234567");
        assert!(body(&k, &n, "a").is_some() && body(&k, &n, "b").is_some());
        assert_eq!(k.bytes("shop"), share);
        keep(&k, &n, "c", 0, g, "1234567");
        assert!(body(&k, &n, "a").is_none() && body(&k, &n, "c").is_some(), "full: the model's snapshots go");
        assert!(k.bytes("shop") <= share);
        // Full again, with one snapshot dropped by its owner's step: only that one goes.
        let g1 = k.before_read(&n, "shop", Some(1)).unwrap();
        keep(&k, &n, "d", 1, g1, "1234567");
        n.notified("shop:1");
        let g0 = k.before_read(&n, "shop", Some(0)).unwrap();
        keep(&k, &n, "e", 0, g0, "1234567");
        assert!(body(&k, &n, "c").is_some() && body(&k, &n, "e").is_some(), "the servable ones stay");
        assert_eq!(k.bytes("shop"), share);
        keep(&k, &n, "big", 0, g, &"a body larger than the model's whole share of the room".repeat(40));
        assert!(body(&k, &n, "big").is_none());
        let off = KeptReads::new(["shop"], 0, Duration::from_secs(60));
        assert!(!off.on() && off.before_read(&n, "shop", Some(0)).is_none());
    }

    fn keep_missing(k: &KeptReads, n: &ClockNotifier, key: &str, owner: u32, generation: u64) {
        k.keep(n, "shop", key, Some(owner), generation, &shape(), &[], None);
    }

    fn kept(k: &KeptReads, n: &ClockNotifier, key: &str) -> bool {
        k.get(n, "shop", key).is_some()
    }

    #[test]
    fn room_is_made_one_snapshot_at_a_time_the_oldest_unserved_first() {
        let n = listening();
        let share = 3 * charge(1, 7, 0);
        let k = KeptReads::new(["shop"], share, Duration::from_secs(60));
        let g = k.before_read(&n, "shop", Some(0)).unwrap();
        keep(&k, &n, "a", 0, g, "1234567");
        keep(&k, &n, "b", 0, g, "1234567");
        keep(&k, &n, "c", 0, g, "1234567");
        assert!(kept(&k, &n, "a"), "served since kept: a second chance");
        keep(&k, &n, "d", 0, g, "1234567");
        assert_eq!(k.bytes("shop"), share);
        assert!(!kept(&k, &n, "b"), "the oldest not served since goes");
        assert!(kept(&k, &n, "a") && kept(&k, &n, "c") && kept(&k, &n, "d"), "only one went");
        // Every snapshot served: the hand clears each once, then takes the first it meets
        // again — `c`, ahead of `a` since `a` went round once more.
        keep(&k, &n, "e", 0, g, "1234567");
        assert!(!kept(&k, &n, "c") && kept(&k, &n, "a") && kept(&k, &n, "d") && kept(&k, &n, "e"));
    }

    #[test]
    fn an_absent_document_never_evicts_a_found_one_and_goes_first() {
        let n = listening();
        let share = 2 * charge(1, 7, 0);
        let k = KeptReads::new(["shop"], share, Duration::from_secs(60));
        let g = k.before_read(&n, "shop", Some(0)).unwrap();
        keep(&k, &n, "a", 0, g, "1234567");
        keep(&k, &n, "b", 0, g, "1234567");
        for i in 0..100 {
            keep_missing(&k, &n, &format!("missing-{i}"), 0, g);
        }
        assert!(kept(&k, &n, "a") && kept(&k, &n, "b"), "a flood of 404s evicts no document");
        assert!(!kept(&k, &n, "missing-0"), "no room: the 404 is not kept");
        assert_eq!(k.bytes("shop"), share);
        // With room, a 404 is kept, and it is the first to go for a document.
        let k = KeptReads::new(["shop"], share, Duration::from_secs(60));
        keep(&k, &n, "a", 0, g, "1234567");
        keep_missing(&k, &n, "gone", 0, g);
        assert!(kept(&k, &n, "gone"));
        keep(&k, &n, "b", 0, g, "1234567");
        assert!(kept(&k, &n, "a") && kept(&k, &n, "b") && !kept(&k, &n, "gone"));
    }

    #[test]
    fn keys_kept_again_and_again_leave_the_rings_bounded() {
        let n = listening();
        let k = KeptReads::new(["shop"], 1 << 20, Duration::from_secs(60));
        let g = k.before_read(&n, "shop", Some(0)).unwrap();
        for _ in 0..10_000 {
            keep(&k, &n, "a", 0, g, "{}");
            keep_missing(&k, &n, "b", 0, g);
        }
        let m = k.models["shop"].lock().unwrap();
        assert_eq!(m.keys.len(), 2);
        assert!(m.found.len() + m.missing.len() <= 2 * m.keys.len() + 65, "{} slots", m.found.len() + m.missing.len());
        let stale: usize = m
            .found
            .iter()
            .chain(&m.missing)
            .filter(|s| m.keys.get(&s.key).is_none_or(|e| e.id != s.id))
            .map(|s| stale_key(&s.key))
            .sum();
        assert_eq!(m.bytes, m.keys.values().map(|e| e.kept.size).sum::<usize>() + stale);
    }

    #[test]
    fn nothing_is_kept_or_served_while_a_change_may_go_unannounced() {
        let n = listening();
        let k = KeptReads::new(["shop"], 1 << 20, Duration::from_secs(60));
        let g = k.before_read(&n, "shop", Some(0)).unwrap();
        keep(&k, &n, "a", 0, g, "{}");
        assert!(body(&k, &n, "a").is_some());
        assert!(n.set_announced(false), "a trigger went missing");
        assert!(body(&k, &n, "a").is_none() && k.before_read(&n, "shop", Some(0)).is_none());
        keep(&k, &n, "b", 0, g, "{}");
        assert!(n.set_announced(true), "the triggers are back");
        assert!(!n.set_announced(true), "no change, no wake-up");
        assert!(body(&k, &n, "a").is_none() && body(&k, &n, "b").is_none(), "what was kept before is never served");
        let g = k.before_read(&n, "shop", Some(0)).unwrap();
        keep(&k, &n, "c", 0, g, "{}");
        assert!(body(&k, &n, "c").is_some(), "kept again once announced");
    }
}
