//! The ordering state's statements, owned by `parsley-store` ([`parsley_store::ordering`])
//! and re-exported here so the projector's paths stay `crate::store::...`.

pub use parsley_store::ordering::*;
