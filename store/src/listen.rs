//! The listening side of the clock channel: the statement that makes a `LISTEN` connection a
//! barrier for notifications.

use sqlx::postgres::PgListener;

/// Runs a trivial statement on the listener's own connection. Postgres sends every
/// notification committed before a statement ahead of that statement's answer, and sqlx keeps
/// them aside (`PgListener::next_buffered`): once this returns, every change committed before
/// it was called has been heard.
pub async fn barrier(listener: &mut PgListener) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(listener).await.map(|_| ())
}
