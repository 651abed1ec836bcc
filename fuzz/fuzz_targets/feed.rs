//! cargo-fuzz target `feed`: arbitrary sequences of a host's operations on one task's
//! engine. The property is `fuzz/checks/feed.rs`, which `tests/fuzz_corpus.rs` also
//! replays on stable.
#![no_main]

#[path = "../checks/feed.rs"]
mod feed;

libfuzzer_sys::fuzz_target!(|data: &[u8]| feed::check(data));
