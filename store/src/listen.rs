//! The listening side of the clock channel: the statement that makes a `LISTEN` connection a
//! barrier for notifications, and tells which server process the connection is.

use sqlx::postgres::PgListener;

use crate::error::StoreError;

/// Runs a statement on the listener's own connection and answers the process ID of its
/// server backend (`pg_backend_pid()`).
///
/// A barrier: Postgres sends every notification committed before a statement ahead of that
/// statement's answer, and sqlx keeps them aside (`PgListener::next_buffered`), so once this
/// returns, every change committed before it was called has been heard — on this backend.
/// sqlx reconnects a lost listener inside a statement without a word, and what was committed
/// between the old backend's end and the new `LISTEN` is never heard: a pid other than the
/// one seen after `LISTEN` says that happened.
pub async fn barrier(listener: &mut PgListener) -> Result<i32, StoreError> {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(listener)
        .await
        .map_err(|e| StoreError::sqlx("the barrier on the clock listener's connection", e))
}
