//! Failed database calls, answered. The store tells them apart ([`parsley_store::failure`]);
//! here each becomes its answer. Only a database that did not answer is an outage
//! (`503 unavailable`); a value the database refused (SQLSTATE class 22, data exception) is
//! the client's error when the value came from the client (`400`), and anything else — a
//! statement the database rejects (class 42), a row that does not decode — is a bug
//! (`500 internal`), never shown as an outage.

use crate::problem::ApiError;

pub use parsley_store::failure::{classify, classify_sqlstate, classify_sqlx, is_undefined_table, Failure};

/// The answer to a failed database call made while `doing` something. `client_value`: the
/// answer when the database rejected a value, for the statements that bind a client's
/// value (`None`: no value came from the client, so a rejected one is a bug).
pub fn failed(e: anyhow::Error, doing: &str, retry_after: u64, client_value: Option<ApiError>) -> ApiError {
    match (classify(&e), client_value) {
        (Failure::Unavailable, _) => {
            tracing::warn!(error = %format!("{e:#}"), doing, "the database did not answer");
            ApiError::Unavailable {
                what: "Postgres",
                detail: format!("the database did not answer {doing}"),
                retry_after,
            }
        }
        (Failure::ValueRejected, Some(answer)) => {
            tracing::info!(error = %format!("{e:#}"), doing, "the database rejected a client's value");
            answer
        }
        (Failure::ValueRejected | Failure::Bug, _) => {
            ApiError::Internal(e.context(format!("the database failed {doing}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_database_that_does_not_answer_is_an_outage() {
        for (code, failure) in [
            ("22021", Failure::ValueRejected), // invalid byte sequence (NUL in text)
            ("22P02", Failure::ValueRejected), // invalid text representation
            ("42601", Failure::Bug),           // syntax error
            ("42P01", Failure::Bug),           // undefined table
            ("23505", Failure::Bug),           // unique violation
            ("08006", Failure::Unavailable),   // connection failure
            ("57P01", Failure::Unavailable),   // admin shutdown
            ("57014", Failure::Unavailable),   // statement timeout
            ("55P03", Failure::Unavailable),   // lock not available
            ("40001", Failure::Unavailable),   // serialization failure
            ("53300", Failure::Unavailable),   // too many connections
            ("XX000", Failure::Unavailable),   // internal error
            ("", Failure::Bug),
            ("2", Failure::Bug),
            ("é", Failure::Bug),
        ] {
            assert_eq!(classify_sqlstate(code), failure, "{code:?}");
        }
        assert_eq!(classify_sqlx(&sqlx::Error::PoolTimedOut), Failure::Unavailable);
        assert_eq!(classify_sqlx(&sqlx::Error::RowNotFound), Failure::Bug);
        let wrapped = anyhow::Error::new(sqlx::Error::PoolClosed).context("loading clock rows").context("a read");
        assert_eq!(classify(&wrapped), Failure::Unavailable);
        assert_eq!(classify(&anyhow::anyhow!("a stored row does not decode")), Failure::Bug);
    }

    #[test]
    fn answers_follow_the_classification() {
        let outage = failed(anyhow::Error::new(sqlx::Error::PoolTimedOut), "the read", 2, None);
        assert!(matches!(outage, ApiError::Unavailable { retry_after: 2, .. }), "{outage:?}");
        let client = failed(anyhow::anyhow!("not sqlx"), "the read", 2, Some(ApiError::InvalidKey("k".into())));
        assert!(matches!(client, ApiError::Internal(_)), "a bug stays a bug even with client input: {client:?}");
    }
}
