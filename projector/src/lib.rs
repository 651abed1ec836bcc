//! The Parsley engine hosted on Postgres: a projector that consumes Kafka records
//! (`read_committed`), lets the engine decide delivery, and commits projection rows,
//! ordering state, clock rows and consumed positions in one SQL transaction per step.
//!
//! # The library
//! A program runs the projector with projections of its own through [`Projector::builder`]:
//! the configuration ([`settings`], the `parsley-settings` crate), a registry of named projections, a shutdown signal. A
//! projection implements [`Projection`] (its object-safe form is [`DynProjection`]); it
//! receives each [`Delivered`] record, in causal order, inside the step's transaction, and
//! fails with a [`ProjectionError`] that says whether the record is at fault. Two are
//! shipped and registered by default: [`DocumentProjection`] (`"documents"`) and
//! [`SqlProjection`] (`"sql"`, statements from configuration). `docs/projections.md` tells
//! how to write each kind.
//!
//! What is documented here is the public surface, versioned as the crate (see "Semver" in
//! `docs/projections.md`). The modules marked hidden are the workspace's own: the binary,
//! the integration tests and the benchmarks drive the task runners and read the state
//! through them; they carry no compatibility promise.
//!
//! # Layout
//! The schema, every SQL statement on it and the status reads are `parsley-store`'s; the
//! shared configuration is `parsley-settings`' (re-exported as [`settings`] for programs
//! that embed the projector).
//! - [`builder`]: the projector as a service — projections registered by name, the start
//!   sequence (metrics, connection, migrations, each model's own migrations, models), and
//!   shutdown; `parsley-projector run` is a thin `main` over it.
//! - [`projection`]: the [`Projection`] seam; `documents`: the shipped document projection
//!   (replace / JSON merge patch / tombstone; its statements are the store's); `sql`: the
//!   SQL projection (the statements configured per topic, with named parameters).
//! - `record`: what is read out of a consumed Kafka record (the engine's payload,
//!   `parsley_store::record::RecordData`), and what a held record weighs.
//! - `kafka`: topic resolution, the task consumer's settings, watermarks.
//! - `task`: one task's runner — the I/O of the core's step protocol
//!   (`parsley::host::TaskHost`): consumer, transactions, fencing, failure backoff, timers.
//! - `model`: a model's topics checked against recorded identities and width, and its
//!   task runners under supervisors; `run` (until shutdown) and `run_once` (one step per task).
//! - `balance`: sharing a model's tasks between instances — membership, leases,
//!   takeover on an expired lease, hand-back on rebalancing and at shutdown.
//! - `metrics`: Prometheus text.
//! - [`health`]: the probes `/livez` and `/readyz` on the metrics listener — a stuck task
//!   runner, the start, each model's membership, stopping.
//! - `skip`: the audited way past the one record a task is refused at (`parsley-projector
//!   skip`), and how a restore applies skips.
//!
//! See `docs/projector.md` for the model, schema, step, fencing and restart.

pub mod builder;
pub mod health;
pub mod projection;

pub(crate) mod balance;
pub(crate) mod documents;
pub(crate) mod sql;

#[doc(hidden)]
pub mod create_topics;

#[doc(hidden)]
pub mod kafka;
#[doc(hidden)]
pub mod metrics;
#[doc(hidden)]
pub mod model;
#[doc(hidden)]
pub mod record;
#[doc(hidden)]
pub mod skip;
#[doc(hidden)]
pub mod task;

pub use builder::{Projector, ProjectorBuilder};
pub use documents::DocumentProjection;
/// The shared configuration (`parsley-settings`), for programs that embed the projector.
pub use parsley_settings as settings;
pub use parsley_settings::Config;
pub use projection::{Delivered, DynProjection, Projection, ProjectionError, SharedProjection, StepContext};
pub use sql::SqlProjection;

#[doc(hidden)]
pub use model::{ModelPlan, ModelProjector};
#[doc(hidden)]
pub use record::RecordData;
#[doc(hidden)]
pub use task::{StepOutcome, TaskRunner, TaskState};
