//! The shared configuration of the projector and the gateway: one TOML file, overridable by
//! environment variables, with secrets only from the environment or files.
//!
//! # Layout
//! - [`config`]: the file's tables (`[kafka]`, `[database]`, `[projector]`, `[[models]]`, the
//!   gateway's `[gateway]` carried through), parsed strictly and checked as a whole.
//! - [`contract`]: a received topic's data contract, its JSON Schema (draft 2020-12), read
//!   and compiled once for the gateway's writes and the projector's records alike.
//! - [`overrides`]: the one rule for environment overrides of every key
//!   (`PARSLEY_<SECTION>__<KEY>`).
//! - [`secret`]: values that are never printed.
//! - [`sql_params`]: configured SQL's named parameters (`:name`) turned into `$1..$n`, one
//!   rule for the projector's statements and the gateway's queries.

pub mod config;
pub mod contract;
pub mod overrides;
pub mod secret;
pub mod sql_params;

pub use config::Config;
pub use secret::Secret;
