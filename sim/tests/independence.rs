//! The oracle is evidence only while it is independent of what it judges: it may name
//! channels and positions (the core's plain identity types), and nothing else of the core —
//! not the engine, the host protocol, the gate, pasts, the codec or the decision unit. This
//! test reads its source and fails on any other use of the core.

/// The only core items the oracle may use: identities, not logic.
const ALLOWED: &[&str] = &["parsley::channel::{ChannelId, Position, TopicId}"];

/// Names of the core's logic, which the oracle must never call or hold.
const FORBIDDEN: &[&str] =
    &["TaskHost", "Engine", "gate::", "refresh(", "CausalPast", "codec::", "decide(", "host::", "startup::"];

fn violations(source: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (i, line) in source.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        if code.contains("parsley::") && !ALLOWED.iter().any(|a| code.contains(a)) {
            found.push(format!("line {}: {}", i + 1, line.trim()));
        }
        for name in FORBIDDEN {
            if code.contains(name) {
                found.push(format!("line {}: uses {name}", i + 1));
            }
        }
    }
    found
}

#[test]
fn the_oracle_uses_nothing_of_the_core_but_identities() {
    let source = include_str!("../src/oracle.rs");
    assert!(source.contains("pub struct Oracle"), "include_str! read the wrong file");
    let found = violations(source);
    assert!(found.is_empty(), "the oracle must stay independent of the core's logic:\n{}", found.join("\n"));
}

#[test]
fn the_scan_finds_what_it_looks_for() {
    let sample = "use parsley::host::TaskHost;\n// TaskHost in a comment is fine\nlet e: Engine<u8>;\n";
    let found = violations(sample);
    assert_eq!(found.len(), 4, "{found:?}");
}
