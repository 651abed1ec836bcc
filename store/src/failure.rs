//! Failed database calls, told apart by what the database said. Only a database that did
//! not answer is an outage ([`Failure::Unavailable`]); a value the database refused
//! (SQLSTATE class 22, data exception) is [`Failure::ValueRejected`]; anything else — a
//! statement the database rejects (class 42), a row that does not decode — is a bug
//! ([`Failure::Bug`]), never shown as an outage.

/// What a failed database call was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The database did not answer, or could not now: connection, pool, I/O, TLS, timeouts
    /// and cancellations, shutdown, resources, transient conflicts (SQLSTATE classes 08, 40,
    /// 53, 55, 57, 58, XX).
    Unavailable,
    /// The database refused a value it was given (class 22).
    ValueRejected,
    /// Anything else: a bug of ours.
    Bug,
}

/// Classifies a sqlx error.
pub fn classify_sqlx(e: &sqlx::Error) -> Failure {
    match e {
        sqlx::Error::Database(db) => classify_sqlstate(db.code().as_deref().unwrap_or("")),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => Failure::Unavailable,
        _ => Failure::Bug,
    }
}

/// Classifies a SQLSTATE by its class (its first two characters).
pub fn classify_sqlstate(code: &str) -> Failure {
    match code.get(..2) {
        Some("22") => Failure::ValueRejected,
        Some("08" | "40" | "53" | "55" | "57" | "58" | "XX") => Failure::Unavailable,
        _ => Failure::Bug,
    }
}

/// Classifies an error that may wrap a sqlx error (this crate's functions add context); an
/// error with no sqlx error inside is a bug.
pub fn classify(e: &anyhow::Error) -> Failure {
    e.chain().find_map(|c| c.downcast_ref::<sqlx::Error>()).map_or(Failure::Bug, classify_sqlx)
}

/// Whether the database said a table does not exist (the migrations have not run).
pub fn is_undefined_table(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01"))
}
