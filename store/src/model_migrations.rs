//! A model's own schema migrations: the `.sql` files of the folder its `migrations` key
//! names, applied at start with their own bookkeeping (`parsley.model_migrations`), never
//! sqlx's `_sqlx_migrations` (the project's), whose versions they could collide with.
//!
//! A file is `<version>_<name>.sql`, the version a positive integer, unique in the folder;
//! other entries of the folder are ignored. The files run in version order, each in its own
//! transaction together with its bookkeeping row, so a file is applied once and completely or
//! not at all (a file must not hold transaction control of its own). An applied file is
//! recorded with its checksum (sha256 of its bytes, computed by the server): when the text
//! of an applied file changes, or an applied file is gone from the folder, [`run`] refuses,
//! naming it — the schema would no longer be what the files say. Each file's transaction
//! holds one advisory lock shared by every model of the database, so two instances starting
//! together apply each file once, and two models never run DDL at the same time: Postgres's
//! `CREATE ... IF NOT EXISTS` and `CREATE OR REPLACE` are not safe against a concurrent twin
//! (a unique violation in the catalog, `tuple concurrently updated`), and models may share
//! objects — a schema, an extension, a view.

use std::path::Path;

use sqlx::{Executor as _, PgPool};

use crate::error::{Context as _, StoreError};

/// One migration file of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelMigration {
    pub version: i64,
    /// The file name (`0001_create_orders.sql`): how messages and the bookkeeping name it.
    pub file: String,
    pub sql: String,
}

/// What [`run`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// The files applied by this run, in order.
    pub applied: Vec<String>,
    /// How many files an earlier run had applied (checked unchanged).
    pub already: usize,
}

/// The migration files of `dir`, in version order; every error names the folder or file.
pub fn read_folder(dir: &Path) -> Result<Vec<ModelMigration>, StoreError> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("reading the migrations folder {}", dir.display()))?;
    let mut migrations = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("reading the migrations folder {}", dir.display()))?;
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(stem) = file.strip_suffix(".sql") else { continue };
        let version = stem
            .split_once('_')
            .filter(|(_, name)| !name.is_empty())
            .and_then(|(v, _)| v.parse::<i64>().ok())
            .filter(|v| *v > 0)
            .ok_or_else(|| {
                StoreError::invalid(format!(
                    "migration {file} in {}: the name must be <version>_<name>.sql, the version a positive integer",
                    dir.display()
                ))
            })?;
        let sql = std::fs::read_to_string(entry.path())
            .with_context(|| format!("reading migration {file} in {}", dir.display()))?;
        migrations.push(ModelMigration { version, file, sql });
    }
    migrations.sort_by_key(|m| m.version);
    if let Some(w) = migrations.windows(2).find(|w| w[0].version == w[1].version) {
        return Err(StoreError::invalid(format!(
            "migrations {} and {} in {} have the same version {}",
            w[0].file,
            w[1].file,
            dir.display(),
            w[0].version
        )));
    }
    Ok(migrations)
}

/// Applies the files of `migrations` that `model` has not applied, after checking that every
/// applied one is still there, unchanged. Each file runs in a transaction of its own that
/// first takes the database's migrations lock (every model's) and checks the file is still unapplied (another
/// instance may have applied it meanwhile). A failing file's error names it; its
/// transaction rolled back.
pub async fn run(pool: &PgPool, model: &str, migrations: &[ModelMigration]) -> Result<Applied, StoreError> {
    let recorded: Vec<(i64, String, bool)> = sqlx::query_as(
        "SELECT a.version, a.name, coalesce(a.checksum = sha256(f.sql), false) \
         FROM parsley.model_migrations a \
         LEFT JOIN unnest($2::bigint[], $3::bytea[]) AS f(version, sql) ON f.version = a.version \
         WHERE a.model = $1 ORDER BY a.version",
    )
    .bind(model)
    .bind(migrations.iter().map(|m| m.version).collect::<Vec<_>>())
    .bind(migrations.iter().map(|m| m.sql.as_bytes()).collect::<Vec<_>>())
    .fetch_all(pool)
    .await
    .with_context(|| format!("reading the applied migrations of model {model}"))?;
    for (version, name, same) in &recorded {
        match migrations.iter().find(|m| m.version == *version) {
            None => {
                return Err(StoreError::conflict(format!(
                    "model {model}: migration {name} (version {version}) was applied, but is no longer in the \
                     migrations folder; restore it"
                )))
            }
            Some(m) if !same => return Err(changed(model, m)),
            Some(_) => {}
        }
    }
    let mut done = Applied { applied: Vec::new(), already: recorded.len() };
    for m in migrations.iter().filter(|m| !recorded.iter().any(|(v, _, _)| *v == m.version)) {
        let mut tx = pool.begin().await.with_context(|| format!("model {model}: beginning migration {}", m.file))?;
        // One lock for every model: another model's file may create the same objects.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('parsley.model_migrations'), 0)")
            .execute(&mut *tx)
            .await
            .with_context(|| format!("model {model}: locking its migrations"))?;
        let meanwhile: Option<bool> = sqlx::query_scalar(
            "SELECT checksum = sha256($3) FROM parsley.model_migrations WHERE model = $1 AND version = $2",
        )
        .bind(model)
        .bind(m.version)
        .bind(m.sql.as_bytes())
        .fetch_optional(&mut *tx)
        .await
        .with_context(|| format!("model {model}: reading migration {}", m.file))?;
        match meanwhile {
            Some(true) => {
                // Another instance applied it meanwhile.
                tx.rollback().await.with_context(|| format!("model {model}: migration {}", m.file))?;
                done.already += 1;
                continue;
            }
            Some(false) => return Err(changed(model, m)),
            None => {}
        }
        // Through `Executor` rather than `RawSql::execute`, an `async fn` whose future is not
        // `Send` for every lifetime (the projector's start could not be spawned).
        tx.execute(sqlx::raw_sql(&m.sql)).await.with_context(|| format!("model {model}: migration {}", m.file))?;
        sqlx::query(
            "INSERT INTO parsley.model_migrations (model, version, name, checksum) VALUES ($1, $2, $3, sha256($4))",
        )
        .bind(model)
        .bind(m.version)
        .bind(&m.file)
        .bind(m.sql.as_bytes())
        .execute(&mut *tx)
        .await
        .with_context(|| format!("model {model}: recording migration {}", m.file))?;
        tx.commit().await.with_context(|| format!("model {model}: committing migration {}", m.file))?;
        done.applied.push(m.file.clone());
    }
    Ok(done)
}

/// The conflict of an applied migration whose text has changed.
fn changed(model: &str, m: &ModelMigration) -> StoreError {
    StoreError::conflict(format!(
        "model {model}: migration {} was applied, and its text has changed since; restore the applied text and put \
         the change in a new file",
        m.file
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(files: &[(&str, &str)]) -> std::path::PathBuf {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("parsley-model-migrations-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, sql) in files {
            std::fs::write(dir.join(name), sql).unwrap();
        }
        dir
    }

    #[test]
    fn files_are_read_in_version_order_and_others_ignored() {
        let dir = folder(&[("10_b.sql", "B"), ("2_a.sql", "A"), ("README.md", "x"), ("0003_c_d.sql", "C")]);
        let read = read_folder(&dir).unwrap();
        let got: Vec<(i64, &str, &str)> = read.iter().map(|m| (m.version, m.file.as_str(), m.sql.as_str())).collect();
        assert_eq!(got, [(2, "2_a.sql", "A"), (3, "0003_c_d.sql", "C"), (10, "10_b.sql", "B")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_names_and_duplicate_versions_are_refused_by_name() {
        for (files, named) in [
            (&[("x_a.sql", "")][..], "x_a.sql"),
            (&[("1.sql", "")][..], "1.sql"),
            (&[("0_zero.sql", "")][..], "0_zero.sql"),
            (&[("1_.sql", "")][..], "1_.sql"),
            (&[("1_a.sql", ""), ("01_b.sql", "")][..], "same version 1"),
        ] {
            let dir = folder(files);
            let err = format!("{:#}", read_folder(&dir).unwrap_err());
            assert!(err.contains(named), "{files:?}: {err}");
            std::fs::remove_dir_all(&dir).unwrap();
        }
        let err = format!("{:#}", read_folder(Path::new("/nonexistent/migrations")).unwrap_err());
        assert!(err.contains("/nonexistent/migrations"), "{err}");
    }
}
