//! The project's schema and everything on it. This crate is the only one that writes SQL
//! against the `parsley` and `projection` schemas; the projector, the gateway and the demo
//! stand on it.
//!
//! # Layout
//! - [`config`]: the shared TOML configuration (`[kafka]`, `[database]`, `[projector]`,
//!   `[[models]]`, the gateway's `[gateway]` carried through); [`env`]: the one rule for
//!   environment overrides of every key; [`secret`]: values that are never printed.
//! - [`migrations`]: the embedded schema migrations (`store/migrations/`) and their runner.

pub mod config;
pub mod env;
pub mod migrations;
pub mod secret;

pub use config::Config;
pub use secret::Secret;
