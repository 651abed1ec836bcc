//! The ordering state's statements, owned by `parsley-store` ([`parsley_store::ordering`])
//! and re-exported here so the projector's paths stay `crate::store::...`.

pub use parsley_store::ordering::*;

/// The persisted task status under its former name, still used by the task runner.
pub use parsley_store::ordering::TaskStatus as TaskStatusKind;
