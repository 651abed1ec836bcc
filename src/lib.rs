//! Parsley core: causal delivery for Kafka records, with no I/O.
//!
//! Records carry their causes as `(channel, position)` pairs in one header,
//! `parsley.causes`. A task delivers a record only after every cause on a channel it
//! receives has been delivered or can never arrive. This crate decides that, and nothing
//! else: hosts (the Postgres projector, the simulator) feed it records and persist what it
//! says changed.
//!
//! # Layout
//! - [`channel`]: channel and topic identities, positions.
//! - [`codec`]: the frozen `parsley.causes` wire format, version 1.
//! - [`past`]: [`CausalPast`], merge and coverage.
//! - [`decide`]: the decision unit, the one place delivery is decided.
//! - [`engine`]: the per-task engine: receive, hold, drain, deliver, prune, restore.
//! - [`startup`]: pure checks a host runs before it starts a task.
//! - [`gate`]: the read gate and token refresh the gateway runs on clock rows.
//! - [`kept`]: the rules of snapshots a reader keeps in memory (when one may be kept, which
//!   changes drop it, when it may serve), which the gateway and the simulator both call.
//! - [`host`]: the start and step sequence of one task as a pure state machine, which the
//!   projector's task runner and the simulator's tasks both drive.
//! - [`refusal`]: named refusals.
//! - [`murmur2`]: Kafka's default key partitioner.
//! - [`partitioner`]: the key partitioners producers use (murmur2, librdkafka's CRC-32).
//!
//! Feature `sim` switches on hidden sabotage hooks (deliberately broken behaviours) for the
//! simulator's meta-tests in the `parsley-sim` crate; production builds never enable it.
//!
//! The crate performs no I/O, reads no clock and draws no randomness; `tests/purity.rs`
//! fails if that stops being true.

pub mod channel;
pub mod codec;
pub mod decide;
pub mod engine;
pub mod gate;
pub mod host;
pub mod kept;
pub mod murmur2;
pub mod partitioner;
pub mod past;
pub mod refusal;
pub mod startup;

pub use channel::{ChannelId, Position, TopicId};
pub use decide::{decide, Blocker, Decision};
pub use engine::{Delivery, Engine, EngineConfig, Fed, HeldRecord, PersistedState, Receipt, StepChanges};
pub use past::{CausalPast, Coverage, Gap};
pub use refusal::{Refusal, RefusalReason};
