//! cargo-fuzz target `decode`: arbitrary bytes and budgets through the `parsley.causes`
//! decoder. The property is `fuzz/checks/decode.rs`, which `tests/fuzz_corpus.rs`
//! also replays on stable.
#![no_main]

#[path = "../checks/decode.rs"]
mod decode;

libfuzzer_sys::fuzz_target!(|data: &[u8]| decode::check(data));
