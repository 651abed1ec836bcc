//! The project's schema and everything on it. This crate is the only one that writes SQL
//! against the `parsley` and `projection` schemas; the projector, the gateway and the demo
//! stand on it.
//!
//! The configuration these statements are run under is `parsley-settings`'.
//!
//! # Layout
//! - [`migrations`]: the embedded schema migrations (`migrations/` at the workspace root) and
//!   their runner;
//!   [`model_migrations`]: a model's own migrations folder, with its own bookkeeping.
//! - [`ordering`]: every statement on the ordering state (`parsley` schema): models, topic
//!   identities, task epochs and the persisted [`TaskStatus`], loading a task's state,
//!   writing a step's changes, clock rows, the `NOTIFY` channel, skips and dead letters;
//!   [`record`]: what a held record keeps (the engine's payload) and its header framing.
//! - [`leases`]: membership and task leases — which instance *should* run each task
//!   (the epoch still decides who may commit), takeover, hand-back, the even shares.
//! - [`idempotency`]: the gateway's idempotency keys (a retried write answered from the
//!   first acknowledgement).
//! - [`documents`]: every statement on `projection.documents`.
//! - [`listen`]: the barrier statement on the clock channel's `LISTEN` connection.
//! - [`queries`]: gated reads over any table (the gateway's named queries, an embedding
//!   program's statements): the clock rows and the data in one read-only snapshot.
//! - [`roles`]: the least-privilege roles (the gateway's, each model's read role) and the
//!   row-level security that keeps a model's read role to its own documents.
//! - [`status`]: task status read back, in full (the projector's `status`) or from SQL
//!   aggregates (the gateway's `/v1/status`).
//! - [`error`]: every public function's error, [`StoreError`]: what the call was doing and
//!   its kind (outage, rejected value, conflict, invalid argument, bug);
//!   [`database`]: databases as a whole (the demo's own).

pub mod database;
// `#[macro_use]`: the gated reads' model-and-clock statement is shared with `queries`.
#[macro_use]
pub mod documents;
pub mod error;
pub mod idempotency;
pub mod leases;
pub mod listen;
pub mod migrations;
pub mod model_migrations;
pub mod ordering;
pub mod queries;
pub mod record;
pub mod roles;
pub mod status;

pub use error::{ErrorKind, StoreError};
pub use ordering::{TaskStatus, CLOCK_NOTIFY_CHANNEL, EVERY_MODEL_PAYLOAD};
pub use record::RecordData;
