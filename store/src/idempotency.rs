//! The gateway's idempotency keys (`parsley.idempotency_keys`): every statement on them.
//!
//! A write carrying `Idempotency-Key` first [`begin`]s: the key (within its scope, the
//! request's subject) is claimed as `pending` with the request's hash, unless a live entry
//! holds it. The gateway then writes, and [`finish`]es with the acknowledgement — or
//! [`abandon`]s the claim when the write failed, so a retry writes. A retry finds the
//! entry: the same hash and `done` answers the stored acknowledgement; `pending` is a
//! request still in flight; another hash is the key reused for another request. A
//! `pending` entry older than `stale_after` (its gateway died mid-write) is taken over by a
//! retry of the same request. Entries live `window` past their claim; [`purge_expired`]
//! deletes the rest.

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
              OR (k.state = 'pending' AND k.request_hash = EXCLUDED.request_hash
                  AND k.created_at < now() - $5 * interval '1 millisecond')
         RETURNING true",
    )
    .bind(scope)
    .bind(key)
    .bind(hash)
    .bind(millis(window))
    .bind(millis(stale_after))
    .fetch_optional(pool)
    .await
    .context("claiming an idempotency key")?;
    if claimed.is_some() {
        return Ok(Begun::Claimed);
    }
    let row: Option<(Vec<u8>, String, Option<Value>)> = sqlx::query_as(
        "SELECT request_hash, state, response FROM parsley.idempotency_keys WHERE scope = $1 AND key = $2",
    )
    .bind(scope)
    .bind(key)
    .fetch_optional(pool)
    .await
    .context("reading an idempotency key")?;
    Ok(match row {
        // Deleted in between (an abandoned claim): the caller may simply try again.
        None => Begun::InFlight,
        Some((stored, _, _)) if stored != hash => Begun::Reused,
        Some((_, state, Some(response))) if state == "done" => Begun::Done(response),
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

/// Gives up a claimed key whose write failed, so that a retry writes.
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
