//! `parsley-check`: the session-guarantee checker. It drives a session workload through one
//! or more gateways, optionally under faults, records everything it saw as a history, and
//! judges the history alone for read-your-writes, monotonic reads, monotonic writes,
//! writes-follow-reads and causal visibility (docs/verification.md, "Session-guarantee
//! checker").
//!
//! Layout:
//! - [`history`]: the recorded events, saved and loaded as JSON lines;
//! - [`judge`]: the pure judge over a history, and its hand-written violation suite;
//! - [`http`]: the minimal HTTP/1.1 client for the gateways (infra's, shared with the demo);
//! - [`workload`]: the sessions (token chains) and what they do;
//! - [`nemesis`]: the faults, and the projector and gateway processes the checker may own;
//! - [`run`]: one run from its options to its verdict.

pub mod history;
pub use parsley_infra::http;
pub mod judge;
pub mod nemesis;
pub mod run;
pub mod workload;
