//! The shared configuration, owned by `parsley-store` ([`parsley_store::config`]) and
//! re-exported here so the projector's paths stay `crate::config::...`.

pub use parsley_store::config::*;
