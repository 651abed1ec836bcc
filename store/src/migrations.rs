//! The schema migrations in the workspace's `migrations/`, embedded in the binary and run with sqlx's
//! migrator (each in its own transaction, under sqlx's advisory lock, recorded in
//! `_sqlx_migrations` exactly as `sqlx migrate run` would record them), and what a readiness
//! check asks of them: which versions this build expects, and which the database applied.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;

use crate::error::{Context as _, StoreError};
use sqlx::error::BoxDynError;
use sqlx::migrate::{Migration, MigrationSource, MigrationType, Migrator};
use sqlx::PgPool;

/// `(file name, contents)` of every migration in the workspace's `migrations/`, in order;
/// the list is written by `build.rs` from the directory itself.
pub const MIGRATIONS: &[(&str, &str)] = include!(concat!(env!("OUT_DIR"), "/migrations.rs"));

#[derive(Debug)]
struct Embedded;

impl MigrationSource<'static> for Embedded {
    fn resolve(self) -> Pin<Box<dyn Future<Output = Result<Vec<Migration>, BoxDynError>> + Send + 'static>> {
        Box::pin(async move { embedded().map_err(|e| e.into()) })
    }
}

/// The embedded migrations as sqlx sees them: version and description from the file name
/// (`<version>_<description>.sql`, underscores read as spaces, as sqlx-cli does).
fn embedded() -> Result<Vec<Migration>, String> {
    MIGRATIONS
        .iter()
        .map(|(name, sql)| {
            let stem = name.strip_suffix(".sql").ok_or_else(|| format!("migration {name} is not a .sql file"))?;
            let (version, description) =
                stem.split_once('_').ok_or_else(|| format!("migration {name} is not <version>_<description>.sql"))?;
            let version: i64 = version.parse().map_err(|_| format!("migration {name} has no numeric version"))?;
            Ok(Migration::new(
                version,
                Cow::Owned(description.replace('_', " ")),
                MigrationType::Simple,
                Cow::Borrowed(sql),
                false,
            ))
        })
        .collect()
}

/// Brings the database schema up to date.
///
/// The migrator's bookkeeping table is named without a schema, and Postgres' default
/// `search_path` is `"$user", public`: for a role named like our `parsley` schema, the table
/// would land in `public` before the first migration and in `parsley` after it, and the
/// next run would apply everything again. So the migrations run on a connection of their
/// own whose `search_path` is `public`, taken out of the pool and closed afterwards.
pub async fn run(pool: &PgPool) -> Result<(), StoreError> {
    let migrator = Migrator::new(Embedded).await.context("loading the embedded migrations")?;
    let mut conn = pool.acquire().await.context("acquiring a connection for the migrations")?.detach();
    sqlx::query("SET search_path TO public").execute(&mut conn).await.context("setting the migrations' search_path")?;
    // `run_direct` is `run` on a connection at hand; `run`'s generic `Acquire` bound makes
    // the caller's future not `Send` for every lifetime, so it could not be spawned.
    let outcome = migrator.run_direct(&mut conn).await.context("running the schema migrations");
    let _ = sqlx::Connection::close(conn).await;
    outcome
}

/// The versions of the embedded migrations (`<version>_<description>.sql`).
pub fn expected_versions() -> BTreeSet<i64> {
    MIGRATIONS.iter().filter_map(|(name, _)| name.split_once('_').and_then(|(v, _)| v.parse().ok())).collect()
}

/// The versions the database records as applied successfully. An error when the migrator's
/// bookkeeping table is not there (no migration ever ran) or the database does not answer.
pub async fn applied_versions(pool: &PgPool) -> Result<BTreeSet<i64>, sqlx::Error> {
    let applied: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM public._sqlx_migrations WHERE success").fetch_all(pool).await?;
    Ok(applied.into_iter().collect())
}

/// Whether the database answers a trivial statement.
pub async fn ping(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(pool).await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_in_the_directory_is_embedded_in_order() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        files.sort();
        let embedded: Vec<&str> = MIGRATIONS.iter().map(|(n, _)| *n).collect();
        assert_eq!(files, embedded);
        for (name, sql) in MIGRATIONS {
            assert_eq!(std::fs::read_to_string(dir.join(name)).unwrap(), *sql);
        }
    }

    #[test]
    fn names_follow_timestamp_verb_noun() {
        let migrations = embedded().unwrap();
        assert_eq!(expected_versions().len(), MIGRATIONS.len());
        assert!(migrations.windows(2).all(|w| w[0].version < w[1].version));
        for (name, _) in MIGRATIONS {
            let stem = name.strip_suffix(".sql").unwrap();
            let (ts, rest) = stem.split_once('_').unwrap();
            assert_eq!(ts.len(), 14, "{name}: the version is a yyyymmddhhmmss timestamp");
            assert!(rest.contains('_'), "{name}: <verb>_<noun>");
        }
    }
}
