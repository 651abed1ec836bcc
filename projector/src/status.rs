//! Task status read from the database, owned by `parsley-store` ([`parsley_store::status`])
//! and re-exported here for `parsley-projector status` and the tests.

pub use parsley_store::status::*;
