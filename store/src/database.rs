//! Databases as a whole, for a host that manages its own (the demo creates its database, and
//! drops it when the state in it describes topics that are gone; the checker creates its
//! own and cuts the services' sessions to it). Names are checked to be
//! plain identifiers and quoted; they are never bound as values, since Postgres takes none
//! in these statements.

use std::fmt;

use sqlx::PgConnection;

use crate::error::{Context as _, StoreError};

/// A database name of 1 to 63 lower-case letters, digits and `_`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatabaseName(String);

impl DatabaseName {
    pub fn new(name: &str) -> Result<DatabaseName, StoreError> {
        if !((1..=63).contains(&name.len())
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'))
        {
            return Err(StoreError::invalid(format!(
                "the database name {name:?} must be 1 to 63 lower-case letters, digits and _"
            )));
        }
        Ok(DatabaseName(name.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name as a quoted identifier (it holds no quote: see [`DatabaseName::new`]).
    fn quoted(&self) -> String {
        ["\"", &self.0, "\""].concat()
    }
}

impl fmt::Display for DatabaseName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether the database exists (asked on a connection to any database of the server).
pub async fn exists(server: &mut PgConnection, name: &DatabaseName) -> Result<bool, StoreError> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(name.as_str())
        .fetch_one(&mut *server)
        .await
        .with_context(|| format!("looking up database {name}"))
}

/// Creates the database.
pub async fn create(server: &mut PgConnection, name: &DatabaseName) -> Result<(), StoreError> {
    sqlx::query(&["CREATE DATABASE ", &name.quoted()].concat())
        .execute(&mut *server)
        .await
        .with_context(|| format!("creating database {name}"))?;
    Ok(())
}

/// Drops the database, disconnecting its sessions.
pub async fn drop_forced(server: &mut PgConnection, name: &DatabaseName) -> Result<(), StoreError> {
    sqlx::query(&["DROP DATABASE ", &name.quoted(), " WITH (FORCE)"].concat())
        .execute(&mut *server)
        .await
        .with_context(|| format!("dropping database {name}"))?;
    Ok(())
}

/// Terminates every other session of the database this connection is on (only those whose
/// `application_name` is `application_name`, when given); returns how many were signalled.
/// A fault the session-guarantee checker injects (`parsley-check --nemesis pg-terminate`):
/// the services must survive losing their connections at any moment.
pub async fn terminate_other_sessions(
    connection: &mut PgConnection,
    application_name: Option<&str>,
) -> Result<u64, StoreError> {
    let terminated: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = current_database() AND pid <> pg_backend_pid()
            AND ($1::text IS NULL OR application_name = $1)) AS t",
    )
    .bind(application_name)
    .fetch_one(&mut *connection)
    .await
    .context("terminating the database's other sessions")?;
    Ok(terminated as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_are_taken() {
        for good in ["parsley_demo", "_x", "d2", "2d"] {
            assert_eq!(DatabaseName::new(good).unwrap().quoted(), format!("\"{good}\""));
        }
        for bad in ["", "Demo", "a-b", "a\"b", "a;drop", &"x".repeat(64)] {
            assert!(DatabaseName::new(bad).is_err(), "{bad:?}");
        }
    }
}
