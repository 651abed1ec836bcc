//! What kept snapshots are counted as against what they hold on the heap, measured by a
//! counting allocator (this test binary's global allocator, so the test is alone in it).
//!
//! The bound (`gateway.read_cache_bytes`) is only as good as the count: every figure below
//! asserts the count is never below what the allocator saw, and not far above it.
//!
//! `unsafe`: implementing `GlobalAlloc` is an unsafe trait whose methods are unsafe; each
//! one only counts and forwards its arguments, unchanged, to `System`, so every caller's
//! contract with this allocator is exactly its contract with `System`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use parsley::channel::{ChannelId, TopicId};
use parsley::gate::{ClockRow, ModelShape};
use parsley_gateway::notify::ClockNotifier;
use parsley_gateway::read_cache::KeptReads;

/// Bytes allocated and not yet freed, as asked for (`Layout::size`).
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's layout, forwarded as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `System` through this allocator, with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's layout, forwarded as is.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `System` through this allocator, with this layout.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn shape() -> ModelShape {
    let topics: BTreeSet<TopicId> = [TopicId::from_bytes([1; 16]), TopicId::from_bytes([2; 16])].into();
    ModelShape { received_topics: topics, task_count: 8 }
}

fn rows(n: usize) -> Vec<ClockRow> {
    (0..n)
        .map(|i| ClockRow {
            task: i as u32,
            channel: ChannelId::new(TopicId::from_bytes([1; 16]), i as u32),
            position: 1000 + i as i64,
        })
        .collect()
}

/// An answer's body as the gateway builds one: a buffer with spare room.
fn answer(rng: &mut Rng) -> Vec<u8> {
    let len = 40 + rng.below(900) as usize;
    let mut out = Vec::with_capacity(2 * len);
    out.resize(len, b'x');
    out
}

/// Keeps `n` snapshots (every tenth a 404) under keys `{prefix}{i}`, as the read path does.
fn fill(kept: &KeptReads, notifier: &ClockNotifier, prefix: &str, n: usize, rng: &mut Rng) {
    let shape = shape();
    let rows = rows(4);
    for i in 0..n {
        let key = format!("{prefix}{i:07}");
        let owner = rng.below(8) as u32;
        let generation = kept.before_read(notifier, "shop", Some(owner)).expect("keeping is on");
        let body = (i % 10 != 0).then(|| answer(rng));
        kept.keep(notifier, "shop", &key, Some(owner), generation, &shape, &rows, body.as_deref());
    }
}

/// Asserts `counted` is at least `measured` and at most 1.5 times it.
fn close(what: &str, counted: usize, measured: isize) {
    eprintln!("{what}: counted {counted} bytes, the allocator saw {measured}");
    assert!(measured > 0, "{what}: nothing measured");
    assert!(counted as isize >= measured, "{what}: counted {counted} bytes, below the {measured} held");
    assert!(
        (counted as f64) <= 1.5 * measured as f64,
        "{what}: counted {counted} bytes, over 1.5x the {measured} held"
    );
}

#[test]
fn kept_snapshots_are_counted_as_what_they_hold() {
    // Nothing is printed until every figure is taken: the harness's captured output is
    // allocated too.
    let notifier = ClockNotifier::new(["shop"]);
    notifier.set_listening(true);
    notifier.set_announced(true);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);

    // Room for everything: 20 000 snapshots, then each served once (a served body gets its
    // shared handle).
    let kept = KeptReads::new(["shop"], 1 << 30, Duration::from_secs(600));
    let before = live();
    fill(&kept, &notifier, "customer-", 20_000, &mut rng);
    let filled = (kept.bytes("shop"), live() - before);
    for i in 0..20_000 {
        let served = kept.get(&notifier, "shop", &format!("customer-{i:07}")).expect("kept");
        drop(served.body.clone());
    }
    let served = (kept.bytes("shop"), live() - before);

    // The same keys kept again: the old entries' slots wait in the rings until compacted.
    fill(&kept, &notifier, "customer-", 20_000, &mut rng);
    let twice = (kept.bytes("shop"), live() - before);

    // Every owner steps: each read drops its snapshot, and the tables shrink behind them.
    for task in 0..8 {
        notifier.notified(&format!("shop:{task}"));
    }
    let mut dropped = 0;
    for i in 0..19_990 {
        dropped += usize::from(kept.get(&notifier, "shop", &format!("customer-{i:07}")).is_none());
    }
    let left = (kept.bytes("shop"), live() - before);
    drop(kept);

    // A bound that fills: 60 000 snapshots through 4 MiB, so most are evicted on the way.
    let bound = 4 << 20;
    let kept = KeptReads::new(["shop"], bound, Duration::from_secs(600));
    let before = live();
    fill(&kept, &notifier, "order-", 60_000, &mut rng);
    let through = (kept.bytes("shop"), live() - before);

    close("20 000 kept", filled.0, filled.1);
    close("20 000 kept and served", served.0, served.1);
    close("20 000 kept twice", twice.0, twice.1);
    assert_eq!(dropped, 19_990, "every owner stepped: none is served");
    close("10 left after 19 990 dropped", left.0, left.1);
    assert!(left.1 < 200_000, "the tables shrank: {} bytes held for 10 snapshots", left.1);
    close("60 000 through 4 MiB", through.0, through.1);
    assert!(through.0 <= bound, "within the bound");
    assert!(through.1 <= bound as isize, "what is held is within the bound: {}", through.1);
}
