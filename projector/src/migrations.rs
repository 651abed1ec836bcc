//! The schema migrations, owned by `parsley-store` ([`parsley_store::migrations`]) and
//! re-exported here.

pub use parsley_store::migrations::*;
