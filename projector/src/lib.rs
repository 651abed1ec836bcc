//! The Parsley engine hosted on Postgres: a projector that consumes Kafka records
//! (`read_committed`), lets the engine decide delivery, and commits projection rows,
//! ordering state, clock rows and consumed positions in one SQL transaction per step.
//!
//! # Layout
//! The schema, every SQL statement on it, the status reads and the shared configuration are
//! `parsley-store`'s; [`config`], [`migrations`], [`store`] (the ordering state's
//! statements) and [`status`] re-export its modules under the projector's own paths.
//! - [`record`]: what is read out of a consumed Kafka record (the engine's payload,
//!   `parsley_store::record::RecordData`), and what a held record weighs.
//! - [`projection`]: the [`Projection`] seam; [`documents`]: the shipped document
//!   projection (replace / JSON merge patch / tombstone; its statements are the store's).
//! - [`kafka`]: topic resolution, the task consumer's settings, watermarks.
//! - [`task`]: one task's runner — the I/O of the core's step protocol
//!   (`parsley::host::TaskHost`): consumer, transactions, fencing, failure backoff, timers.
//! - [`model`]: a model's topics checked against recorded identities and width, and its
//!   task runners under supervisors; `run` (until shutdown) and `run_once` (one step per task).
//! - [`balance`]: sharing a model's tasks between instances — membership, leases,
//!   takeover on an expired lease, hand-back on rebalancing and at shutdown.
//! - [`metrics`]: Prometheus text.
//! - [`skip`]: the audited way past the one record a task is refused at (`parsley-projector
//!   skip`), and how a restore applies skips.
//!
//! See `docs/projector.md` for the model, schema, step, fencing and restart.

pub mod balance;
pub mod builder;
pub mod config;
pub mod documents;
pub mod kafka;
pub mod metrics;
pub mod migrations;
pub mod model;
pub mod projection;
pub mod record;
pub mod skip;
pub mod sql;
pub mod status;
pub mod store;
pub mod task;

pub use builder::{Projector, ProjectorBuilder};
pub use config::Config;
pub use documents::DocumentProjection;
pub use model::{ModelPlan, ModelProjector};
pub use projection::{Delivered, DynProjection, Projection, ProjectionError, SharedProjection, StepContext};
pub use record::RecordData;
pub use sql::SqlProjection;
pub use task::{StepOutcome, TaskRunner, TaskState};
