//! Projector throughput against a naive projector (written below).
fn main() {}
