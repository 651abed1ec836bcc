//! The gateway's idempotency keys (`parsley.idempotency_keys`): every statement on them.
//!
//! A write carrying `Idempotency-Key` first [`begin`]s: the key (within its scope, the
//! request's caller) is claimed as `pending` with the request's hash, unless a live entry
//! holds it. The gateway then writes, and [`finish`]es with the acknowledgement, or
//! [`abandon`]s the claim when the write surely did not happen (so a retry writes), or
//! marks it [`unknown`] when Kafka did not say either way (so a retry never writes a second
//! copy). A retry finds the entry: the same hash and `done` answers the stored
//! acknowledgement; `unknown` answers that the outcome is unknown; `pending` is a request
//! still in flight; another hash is the key reused for another request. The writer
//! [`touch`]es its claim while it writes; a `pending` entry not touched for `stale_after` was
//! left by a gateway that died mid-write: its outcome is unknown too, and it is never taken
//! over. Entries live `window` past their claim;
//! [`purge_expired`] deletes the rest.

use std::time::Duration;

use crate::error::{Context as _, StoreError};
use serde_json::Value;
use sqlx::PgPool;

/// What [`begin`] found.
#[derive(Clone, Debug, PartialEq)]
pub enum Begun {
    /// The key is this request's now: write, then [`finish`] or [`abandon`].
    Claimed,
    /// The same request was written: its acknowledgement.
    Done(Value),
    /// The same request is being written by another call.
    InFlight,
    /// The same request was attempted and whether it was written is unknown: writing it
    /// again could duplicate it.
    Unknown,
    /// The key was used for another request within the window.
    Reused,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Claims `key` in `scope` for the request hashed `hash` (see the module docs).
pub async fn begin(
    pool: &PgPool,
    scope: &str,
    key: &str,
    hash: &[u8],
    window: Duration,
    stale_after: Duration,
) -> Result<Begun, StoreError> {
    let claimed: Option<bool> = sqlx::query_scalar(
        "INSERT INTO parsley.idempotency_keys AS k (scope, key, request_hash, state, expires_at)
         VALUES ($1, $2, $3, 'pending', now() + $4 * interval '1 millisecond')
         ON CONFLICT (scope, key) DO UPDATE
           SET request_hash = EXCLUDED.request_hash, state = 'pending', response = NULL, created_at = now(),
               expires_at = EXCLUDED.expires_at
           WHERE k.expires_at < now()
         RETURNING true",
    )
    .bind(scope)
    .bind(key)
    .bind(hash)
    .bind(millis(window))
    .fetch_optional(pool)
    .await
    .context("claiming an idempotency key")?;
    if claimed.is_some() {
        return Ok(Begun::Claimed);
    }
    let row: Option<(Vec<u8>, String, Option<Value>, bool)> = sqlx::query_as(
        "SELECT request_hash, state, response, created_at < now() - $3 * interval '1 millisecond'
           FROM parsley.idempotency_keys WHERE scope = $1 AND key = $2",
    )
    .bind(scope)
    .bind(key)
    .bind(millis(stale_after))
    .fetch_optional(pool)
    .await
    .context("reading an idempotency key")?;
    Ok(match row {
        // Deleted in between (an abandoned claim): the caller may simply try again.
        None => Begun::InFlight,
        Some((stored, ..)) if stored != hash => Begun::Reused,
        Some((_, state, Some(response), _)) if state == "done" => Begun::Done(response),
        Some((_, state, _, stale)) if state == "unknown" || (state == "pending" && stale) => Begun::Unknown,
        Some(_) => Begun::InFlight,
    })
}

/// Records the acknowledgement of a claimed key's request.
pub async fn finish(pool: &PgPool, scope: &str, key: &str, response: &Value) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE parsley.idempotency_keys SET state = 'done', response = $3
          WHERE scope = $1 AND key = $2 AND state = 'pending'",
    )
    .bind(scope)
    .bind(key)
    .bind(response)
    .execute(pool)
    .await
    .context("recording an idempotent write's acknowledgement")?;
    Ok(())
}

/// Marks a claimed key's writer alive (`created_at` is the claim's last sign of life).
pub async fn touch(pool: &PgPool, scope: &str, key: &str) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE parsley.idempotency_keys SET created_at = now()
          WHERE scope = $1 AND key = $2 AND state = 'pending'",
    )
    .bind(scope)
    .bind(key)
    .execute(pool)
    .await
    .context("marking an idempotent write alive")?;
    Ok(())
}

/// Keeps a claimed key whose write may or may not have happened as `unknown`: a retry
/// answers that rather than writing again.
pub async fn unknown(pool: &PgPool, scope: &str, key: &str) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE parsley.idempotency_keys SET state = 'unknown'
          WHERE scope = $1 AND key = $2 AND state = 'pending'",
    )
    .bind(scope)
    .bind(key)
    .execute(pool)
    .await
    .context("keeping an idempotency key's outcome as unknown")?;
    Ok(())
}

/// Gives up a claimed key whose write surely did not happen, so that a retry writes.
pub async fn abandon(pool: &PgPool, scope: &str, key: &str) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM parsley.idempotency_keys WHERE scope = $1 AND key = $2 AND state = 'pending'")
        .bind(scope)
        .bind(key)
        .execute(pool)
        .await
        .context("giving up an idempotency key")?;
    Ok(())
}

/// Deletes the entries whose window has passed; returns how many.
pub async fn purge_expired(pool: &PgPool) -> Result<u64, StoreError> {
    let done = sqlx::query("DELETE FROM parsley.idempotency_keys WHERE expires_at < now()")
        .execute(pool)
        .await
        .context("purging expired idempotency keys")?;
    Ok(done.rows_affected())
}
