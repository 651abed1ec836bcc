//! The listening side of the clock channel: the statement that makes a `LISTEN` connection a
//! barrier for notifications, tells which server process the connection is, and whether
//! every change is announced on the channel.

use sqlx::postgres::PgListener;

use crate::error::StoreError;

/// The triggers that announce, on the clock channel, the changes no step announces (edits
/// outside a step, a model recorded, removed or reshaped, a truncate): `(table, trigger)`.
/// Each must exist and fire `ALWAYS` (whatever the session's replication role), or a kept
/// snapshot could outlive a change nobody heard of.
pub const ANNOUNCING_TRIGGERS: &[(&str, &str)] = &[
    ("projection.documents", "documents_edited"),
    ("projection.documents", "documents_truncated"),
    ("parsley.models", "models_recorded_or_removed"),
    ("parsley.models", "models_reshaped"),
    ("parsley.models", "models_shape_changed"),
    ("parsley.models", "models_truncated"),
    ("parsley.topics", "topics_recorded"),
    ("parsley.topics", "topics_changed"),
    ("parsley.clock", "clock_edited"),
    ("parsley.clock", "clock_truncated"),
];

/// What a barrier answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Barrier {
    /// The process ID of the connection's server backend (`pg_backend_pid()`).
    pub backend_pid: i32,
    /// The [`ANNOUNCING_TRIGGERS`] that are missing or do not fire `ALWAYS` (`table.trigger`),
    /// in the list's order: while any is, a change may go unannounced.
    pub unannounced: Vec<String>,
    /// The announcing triggers' catalog rows as they are (`oid@xmin` of each, in oid order):
    /// every `DISABLE`, `ENABLE`, `DROP` or `CREATE` of one writes a new row version, so a
    /// fingerprint other than the previous barrier's says a trigger was touched in between
    /// — perhaps switched off, a change made unannounced and switched on again, which the
    /// `unannounced` list of either barrier cannot see.
    pub triggers: String,
}

/// Runs one statement on the listener's own connection: the backend's pid, and which
/// announcing triggers are missing or not `ALWAYS`.
///
/// A barrier: Postgres sends every notification committed before a statement ahead of that
/// statement's answer, and sqlx keeps them aside (`PgListener::next_buffered`), so once this
/// returns, every change committed before it was called has been heard — on this backend.
/// sqlx reconnects a listener it dropped inside its next statement, and listens again,
/// without a word, and what was committed between the old backend's end and the new
/// `LISTEN` is never heard: a pid other than the one seen after `LISTEN` says that happened.
pub async fn barrier(listener: &mut PgListener) -> Result<Barrier, StoreError> {
    let (tables, triggers): (Vec<&str>, Vec<&str>) = ANNOUNCING_TRIGGERS.iter().copied().unzip();
    let (backend_pid, unannounced, triggers): (i32, Vec<String>, String) = sqlx::query_as(
        "SELECT pg_backend_pid(), coalesce(array_agg(t.tbl || '.' || t.name ORDER BY t.n), '{}'), \
                (SELECT coalesce(string_agg(g.oid::text || '@' || g.xmin::text, ',' ORDER BY g.oid), '') \
                 FROM pg_trigger g JOIN unnest($1::text[], $2::text[]) AS a(tbl, name) \
                   ON g.tgrelid = to_regclass(a.tbl) AND g.tgname = a.name) \
         FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS t(tbl, name, n) \
         WHERE NOT EXISTS (SELECT 1 FROM pg_trigger g \
                           WHERE g.tgrelid = to_regclass(t.tbl) AND g.tgname = t.name AND g.tgenabled = 'A')",
    )
    .bind(&tables)
    .bind(&triggers)
    .fetch_one(listener)
    .await
    .map_err(|e| StoreError::sqlx("the barrier on the clock listener's connection", e))?;
    Ok(Barrier { backend_pid, unannounced, triggers })
}
