//! Least-privilege roles (`parsley-projector migrate --create-roles`, or the same statements
//! by hand, docs/operations.md "Database roles").
//!
//! - The projector's login role owns the schemas (it runs the migrations) and needs nothing
//!   here.
//! - [`GATEWAY_ROLE`] (no login; granted to the gateway's login role): reads what the gateway
//!   serves — the models and their topics, the clocks, the documents — and what its admin
//!   status aggregates (`parsley.tasks`, `parsley.channels`, `parsley.held`, the projector
//!   instances in `parsley.members`), and writes only the idempotency keys; and which
//!   migrations are applied (`public._sqlx_migrations`, read by its readiness check). Not the
//!   dead letters, the skips or the frontier ([`GATEWAY_READS`]).
//! - One read role per model ([`query_role`], no login; granted to [`GATEWAY_ROLE`] so the
//!   gateway may `SET ROLE` to it): the role a model's named queries run under. It reads the
//!   gate's rows (`parsley.models`, `parsley.topics`, `parsley.clock`) and the model's own
//!   data — its rows of `projection.documents` (row-level security: a policy per model) and
//!   every table of the schema named after the model (a SQL model's tables) — and nothing
//!   else: not `parsley.dead_letters`, not the ordering state, not another model's rows, and
//!   no function beyond what `PUBLIC` may run (`pg_read_file` is not among them).
//!
//! With the roles made, `projection.documents` has row-level security on: its owner (the
//! projector), [`GATEWAY_ROLE`] (every row) and each model's read role (its own rows) read
//! it; any other role reads no row.

use std::fmt::Write as _;

use sqlx::{PgPool, Row as _};

use crate::error::{Context as _, StoreError};

/// The gateway's group role.
pub const GATEWAY_ROLE: &str = "parsley_gateway";
/// The tables [`GATEWAY_ROLE`] reads (a later migration adding one the gateway reads adds
/// it here; run `migrate --create-roles` again after upgrading).
pub const GATEWAY_READS: &[&str] = &[
    "parsley.models",
    "parsley.topics",
    "parsley.clock",
    "parsley.tasks",
    "parsley.channels",
    "parsley.held",
    "parsley.members",
    "projection.documents",
];

/// What every model's read role is named after.
pub const QUERY_ROLE_PREFIX: &str = "parsley_query_";

/// The read role of `model`'s named queries: `parsley_query_<model>`, shortened with a hash
/// of the name when it would pass Postgres's 63 bytes (which would otherwise truncate it).
pub fn query_role(model: &str) -> String {
    let full = format!("{QUERY_ROLE_PREFIX}{model}");
    if full.len() <= 63 {
        return full;
    }
    // FNV-1a: stable across builds, enough to tell apart names that share their first bytes.
    // The name keeps as much of the model as fits beside the hash: prefix, model, `_`, 16 hex.
    let hash = model.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let room = 63 - QUERY_ROLE_PREFIX.len() - 1 - 16;
    let cut = model.char_indices().map(|(i, _)| i).take_while(|i| *i <= room).last().unwrap_or(0);
    format!("{QUERY_ROLE_PREFIX}{}_{hash:016x}", &model[..cut])
}

/// `name` as a quoted SQL identifier.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `text` as a quoted SQL literal.
fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// A model the roles are made for.
#[derive(Clone, Debug)]
pub struct ModelRoles<'a> {
    pub model: &'a str,
}

/// The statements that make the roles for `models` (idempotent: a role or policy that exists
/// is kept, grants are repeated), and that grant [`GATEWAY_ROLE`] to `gateway_login` when
/// given.
pub fn statements(models: &[ModelRoles<'_>], gateway_login: Option<&str>) -> Vec<String> {
    let gw = quote_ident(GATEWAY_ROLE);
    let mut out = vec![
        create_role(GATEWAY_ROLE),
        format!("GRANT USAGE ON SCHEMA parsley, projection TO {gw}"),
        // Exactly these: whatever an earlier grant gave beyond them is taken back.
        format!("REVOKE ALL ON ALL TABLES IN SCHEMA parsley, projection FROM {gw}"),
        format!("ALTER DEFAULT PRIVILEGES IN SCHEMA parsley, projection REVOKE ALL ON TABLES FROM {gw}"),
        format!("GRANT SELECT ON {} TO {gw}", GATEWAY_READS.join(", ")),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON parsley.idempotency_keys TO {gw}"),
        // `/readyz` checks that every migration the gateway knows is applied.
        format!("GRANT SELECT ON public._sqlx_migrations TO {gw}"),
        "ALTER TABLE projection.documents ENABLE ROW LEVEL SECURITY".to_string(),
        policy("parsley_gateway_reads", GATEWAY_ROLE, "true"),
    ];
    for m in models {
        let role = query_role(m.model);
        let r = quote_ident(&role);
        out.push(create_role(&role));
        out.push(format!("GRANT {r} TO {gw}"));
        out.push(format!("GRANT USAGE ON SCHEMA parsley, projection TO {r}"));
        out.push(format!("GRANT SELECT ON parsley.models, parsley.topics, parsley.clock TO {r}"));
        out.push(format!("GRANT SELECT ON projection.documents TO {r}"));
        out.push(policy(&role, &role, &format!("model = {}", quote_literal(m.model))));
        // A SQL model's own schema, named after the model, when it exists (its migrations
        // may not have run yet: run this again after them).
        let schema = quote_ident(m.model);
        let mut block = String::new();
        let _ = write!(
            block,
            "DO $grant$ BEGIN IF EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = {lit}) THEN \
             EXECUTE 'GRANT USAGE ON SCHEMA ' || {q} || ' TO ' || {rq}; \
             EXECUTE 'GRANT SELECT ON ALL TABLES IN SCHEMA ' || {q} || ' TO ' || {rq}; \
             EXECUTE 'ALTER DEFAULT PRIVILEGES IN SCHEMA ' || {q} || ' GRANT SELECT ON TABLES TO ' || {rq}; \
             END IF; END $grant$",
            lit = quote_literal(m.model),
            q = quote_literal(&schema),
            rq = quote_literal(&r),
        );
        out.push(block);
    }
    if let Some(login) = gateway_login {
        out.push(format!("GRANT {gw} TO {}", quote_ident(login)));
    }
    out
}

fn create_role(name: &str) -> String {
    format!(
        "DO $role$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {}) THEN \
         CREATE ROLE {} NOLOGIN; END IF; END $role$",
        quote_literal(name),
        quote_ident(name)
    )
}

fn policy(name: &str, role: &str, using: &str) -> String {
    format!(
        "DO $policy$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_policies WHERE schemaname = 'projection' \
         AND tablename = 'documents' AND policyname = {}) THEN \
         CREATE POLICY {} ON projection.documents FOR SELECT TO {} USING ({}); END IF; END $policy$",
        quote_literal(name),
        quote_ident(name),
        quote_ident(role),
        using
    )
}

/// Makes the roles for `models` in one transaction (needs `CREATEROLE`, and to own
/// `projection.documents`: run it as the projector's login role). Returns the statements run.
pub async fn create(
    pool: &PgPool,
    models: &[ModelRoles<'_>],
    gateway_login: Option<&str>,
) -> Result<Vec<String>, StoreError> {
    let statements = statements(models, gateway_login);
    let mut tx = pool.begin().await.context("beginning the roles' transaction")?;
    // One maker at a time (roles are the cluster's: two makers would both find a role absent).
    sqlx::query("SELECT pg_advisory_xact_lock(7305611046201738605)")
        .execute(&mut *tx)
        .await
        .context("waiting for the roles' lock")?;
    for s in &statements {
        sqlx::query(s).execute(&mut *tx).await.with_context(|| format!("making the database roles: {s}"))?;
    }
    tx.commit().await.context("committing the roles")?;
    Ok(statements)
}

/// Whether the role `name` exists and the current user may `SET ROLE` to it.
pub async fn usable(pool: &PgPool, name: &str) -> Result<bool, StoreError> {
    let row = sqlx::query(
        "SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)
                AND pg_has_role(current_user, (SELECT oid FROM pg_roles WHERE rolname = $1), 'MEMBER') AS usable",
    )
    .bind(name)
    .fetch_one(pool)
    .await
    .context("looking a database role up")?;
    Ok(row.try_get::<Option<bool>, _>("usable")?.unwrap_or(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_roles_are_named_after_their_model_within_63_bytes() {
        assert_eq!(query_role("shop"), "parsley_query_shop");
        let long = "m".repeat(63);
        let role = query_role(&long);
        assert!(role.len() <= 63 && role.starts_with(QUERY_ROLE_PREFIX), "{role}");
        assert_ne!(query_role(&format!("{long}x")[1..]), role, "different models, different roles");
    }

    #[test]
    fn identifiers_and_literals_are_quoted() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
        let s = statements(&[ModelRoles { model: "o'brien" }], Some("gw")).join("\n");
        assert!(s.contains("model = 'o''brien'") && s.contains("GRANT \"parsley_gateway\" TO \"gw\""), "{s}");
    }
}
