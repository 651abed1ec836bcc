//! Failed database calls, answered. The store tells them apart ([`StoreError::kind`]); here
//! each becomes its answer. Only a database that did not answer is an outage
//! (`503 unavailable`); a value the database refused (SQLSTATE class 22, data exception) is
//! the client's error when the value came from the client (`400`), and anything else — a
//! statement the database rejects (class 42), a row that does not decode, a conflict — is a
//! bug (`500 internal`), never shown as an outage.

use crate::problem::ApiError;

pub use parsley_store::error::{classify_sqlstate, classify_sqlx, is_undefined_table, ErrorKind, StoreError};

/// The answer to a failed database call made while `doing` something. `client_value`: the
/// answer when the database rejected a value, for the statements that bind a client's
/// value (`None`: no value came from the client, so a rejected one is a bug).
pub fn failed(e: StoreError, doing: &str, retry_after: u64, client_value: Option<ApiError>) -> ApiError {
    match (e.kind(), client_value) {
        (ErrorKind::Unavailable, _) => {
            tracing::warn!(error = %format!("{e:#}"), doing, "the database did not answer");
            ApiError::Unavailable {
                what: "Postgres",
                detail: format!("the database did not answer {doing}"),
                retry_after,
            }
        }
        (ErrorKind::Rejected, Some(answer)) => {
            tracing::info!(error = %format!("{e:#}"), doing, "the database rejected a client's value");
            answer
        }
        (ErrorKind::Rejected | ErrorKind::Conflict | ErrorKind::Invalid | ErrorKind::Bug, _) => {
            ApiError::Internal(anyhow::Error::new(e).context(format!("the database failed {doing}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_database_that_does_not_answer_is_an_outage() {
        for (code, failure) in [
            ("22021", ErrorKind::Rejected),    // invalid byte sequence (NUL in text)
            ("22P02", ErrorKind::Rejected),    // invalid text representation
            ("42601", ErrorKind::Bug),         // syntax error
            ("42P01", ErrorKind::Bug),         // undefined table
            ("23505", ErrorKind::Bug),         // unique violation
            ("08006", ErrorKind::Unavailable), // connection failure
            ("57P01", ErrorKind::Unavailable), // admin shutdown
            ("57014", ErrorKind::Unavailable), // statement timeout
            ("55P03", ErrorKind::Unavailable), // lock not available
            ("40001", ErrorKind::Unavailable), // serialization failure
            ("53300", ErrorKind::Unavailable), // too many connections
            ("XX000", ErrorKind::Unavailable), // internal error
            ("", ErrorKind::Bug),
            ("2", ErrorKind::Bug),
            ("é", ErrorKind::Bug),
        ] {
            assert_eq!(classify_sqlstate(code), failure, "{code:?}");
        }
        assert_eq!(classify_sqlx(&sqlx::Error::PoolTimedOut), ErrorKind::Unavailable);
        assert_eq!(classify_sqlx(&sqlx::Error::RowNotFound), ErrorKind::Bug);
        let wrapped = StoreError::sqlx("loading clock rows", sqlx::Error::PoolClosed).wrap("a read");
        assert_eq!(wrapped.kind(), ErrorKind::Unavailable);
        assert_eq!(StoreError::bug("a stored row does not decode").kind(), ErrorKind::Bug);
    }

    #[test]
    fn answers_follow_the_classification() {
        let outage = failed(sqlx::Error::PoolTimedOut.into(), "the read", 2, None);
        assert!(matches!(outage, ApiError::Unavailable { retry_after: 2, .. }), "{outage:?}");
        let client = failed(StoreError::bug("not sqlx"), "the read", 2, Some(ApiError::InvalidKey("k".into())));
        assert!(matches!(client, ApiError::Internal(_)), "a bug stays a bug even with client input: {client:?}");
    }
}
