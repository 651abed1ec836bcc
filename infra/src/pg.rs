//! Postgres connections.

use std::time::Duration;

use anyhow::Context as _;
use sqlx::postgres::{PgPool, PgPoolOptions};

/// A connection pool of at most `max_connections` to `url`, failing within `acquire_timeout`
/// if the server does not answer.
pub async fn connect(url: &str, max_connections: u32, acquire_timeout: Duration) -> anyhow::Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        .connect(url)
        .await
        .with_context(|| format!("connecting to Postgres at {} (is it up? `make services-up`)", redact(url)))
}

/// The URL with any password replaced by `***`, for messages and logs.
pub fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    match (authority.rfind('@'), authority.find(':')) {
        (Some(at), Some(colon)) if colon < at => {
            format!("{}{}:***{}", &url[..scheme_end], &authority[..colon], &rest[at..])
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("postgres://parsley:secret@127.0.0.1:5432/parsley"),
            "postgres://parsley:***@127.0.0.1:5432/parsley"
        );
        assert_eq!(redact("postgres://parsley@127.0.0.1:5432/parsley"), "postgres://parsley@127.0.0.1:5432/parsley");
        assert_eq!(redact("postgres://h:5432/db"), "postgres://h:5432/db");
        assert_eq!(redact("not a url"), "not a url");
    }
}
