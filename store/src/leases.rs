//! Leases and membership: every statement that decides which instance *should* run a task.
//!
//! Instances running a model register in `parsley.members` and renew their row every
//! heartbeat; each task row carries a lease (`owner`, `lease_until`) that its owner renews
//! with every step and every heartbeat. An instance takes a task only when its lease is
//! free — never held, handed back (`NULL`), or past — and taking it raises the epoch. The
//! epoch, checked under the task's row lock by every step, is what decides who *may
//! commit*: a lease that expires while its owner is merely slow costs a takeover, never a
//! double delivery. All times are the database server's (`now()`), one clock for every
//! instance, and they only ever decide liveness.
//!
//! A takeover never waits unboundedly on a row lock held by a frozen owner: [`claim`] waits
//! at most `lock_wait` and answers [`Claim::Locked`], naming the session that holds it.

use std::time::Duration;

use crate::error::{Context as _, StoreError};
use sqlx::{PgConnection, PgPool, Row as _};

use crate::ordering::{task_row, TaskRow};

/// The channel `NOTIFY` is sent on when an instance joins or leaves a model or hands a task
/// back, so the other instances rebalance at once instead of at their next heartbeat. The
/// payload is the model's name.
pub const MEMBERS_NOTIFY_CHANNEL: &str = "parsley_members";

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// What [`join`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Joined {
    /// The instance's row is renewed (or new).
    Member,
    /// A live process of another incarnation holds the name until its lease passes (two
    /// processes configured with the same `owner`, or a restart before the dead process's
    /// lease expired).
    NameInUse { incarnation: String, remaining_ms: i64 },
}

/// Registers or renews `instance` as a member of `model` for `lease`. A row of the same
/// name but another incarnation is taken over only once its lease has passed.
pub async fn join(
    pool: &PgPool,
    model: &str,
    instance: &str,
    incarnation: &str,
    balanced: bool,
    lease: Duration,
) -> Result<Joined, StoreError> {
    let mut tx = pool.begin().await.context("beginning a membership transaction")?;
    let row = sqlx::query(
        "INSERT INTO parsley.members AS m (model, instance, incarnation, balanced, lease_until)
         VALUES ($1, $2, $3, $4, now() + $5 * interval '1 millisecond')
         ON CONFLICT (model, instance) DO UPDATE
           SET incarnation = EXCLUDED.incarnation, balanced = EXCLUDED.balanced, lease_until = EXCLUDED.lease_until,
               joined_at = CASE WHEN m.incarnation = EXCLUDED.incarnation THEN m.joined_at ELSE now() END
           WHERE m.incarnation = EXCLUDED.incarnation OR m.lease_until < now()
         RETURNING (xmax = 0) AS inserted",
    )
    .bind(model)
    .bind(instance)
    .bind(incarnation)
    .bind(balanced)
    .bind(millis(lease))
    .fetch_optional(&mut *tx)
    .await
    .with_context(|| format!("renewing membership of {instance:?} in model {model:?}"))?;
    let Some(row) = row else {
        let (holder, remaining_ms): (String, i64) = sqlx::query_as(
            "SELECT incarnation, (extract(epoch FROM lease_until - now()) * 1000)::bigint
               FROM parsley.members WHERE model = $1 AND instance = $2",
        )
        .bind(model)
        .bind(instance)
        .fetch_one(&mut *tx)
        .await
        .context("reading the member that holds the name")?;
        return Ok(Joined::NameInUse { incarnation: holder, remaining_ms });
    };
    if row.get::<bool, _>("inserted") {
        notify_members(&mut tx, model).await?;
    }
    tx.commit().await.context("committing membership")?;
    Ok(Joined::Member)
}

/// Removes `instance` (this incarnation) from `model` and tells the others.
pub async fn leave(pool: &PgPool, model: &str, instance: &str, incarnation: &str) -> Result<(), StoreError> {
    let mut tx = pool.begin().await.context("beginning a leave transaction")?;
    sqlx::query("DELETE FROM parsley.members WHERE model = $1 AND instance = $2 AND incarnation = $3")
        .bind(model)
        .bind(instance)
        .bind(incarnation)
        .execute(&mut *tx)
        .await
        .with_context(|| format!("leaving model {model:?}"))?;
    notify_members(&mut tx, model).await?;
    tx.commit().await.context("committing a leave")?;
    Ok(())
}

async fn notify_members(conn: &mut PgConnection, model: &str) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(MEMBERS_NOTIFY_CHANNEL)
        .bind(model)
        .execute(&mut *conn)
        .await
        .context("notifying the members")?;
    Ok(())
}

/// One task an instance runs, as its heartbeat renews it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub task: u32,
    /// The epoch the instance's runner holds.
    pub epoch: i64,
    /// How long ago the runner last stepped (`None`: not yet).
    pub since_step: Option<Duration>,
}

/// Renews the leases of `held` (only where the epoch is still the one held) and records
/// when each last stepped. A row locked by a step in progress is skipped: that step renews
/// it as it commits. Returns the tasks whose epoch moved on: another instance took them.
pub async fn renew(pool: &PgPool, model: &str, held: &[Held], lease: Duration) -> Result<Vec<u32>, StoreError> {
    if held.is_empty() {
        return Ok(Vec::new());
    }
    let tasks: Vec<i32> = held.iter().map(|h| h.task as i32).collect();
    let epochs: Vec<i64> = held.iter().map(|h| h.epoch).collect();
    let since: Vec<Option<i64>> = held.iter().map(|h| h.since_step.map(millis)).collect();
    sqlx::query(
        "WITH mine AS (SELECT * FROM unnest($2::int[], $3::bigint[], $4::bigint[]) AS m(task, epoch, since_ms)),
              free AS (SELECT t.task FROM parsley.tasks t JOIN mine m ON t.task = m.task AND t.epoch = m.epoch
                        WHERE t.model = $1 FOR UPDATE OF t SKIP LOCKED)
         UPDATE parsley.tasks t
            SET lease_until = now() + $5 * interval '1 millisecond',
                last_step_at = CASE WHEN m.since_ms IS NULL THEN t.last_step_at
                                    ELSE greatest(t.last_step_at, now() - m.since_ms * interval '1 millisecond') END
           FROM mine m
          WHERE t.model = $1 AND t.task = m.task AND t.epoch = m.epoch AND t.task IN (SELECT task FROM free)",
    )
    .bind(model)
    .bind(&tasks)
    .bind(&epochs)
    .bind(&since)
    .bind(millis(lease))
    .execute(pool)
    .await
    .with_context(|| format!("renewing the leases of model {model:?}"))?;
    let lost: Vec<i32> = sqlx::query_scalar(
        "SELECT m.task FROM unnest($2::int[], $3::bigint[]) AS m(task, epoch)
           LEFT JOIN parsley.tasks t ON t.model = $1 AND t.task = m.task
          WHERE t.epoch IS DISTINCT FROM m.epoch ORDER BY m.task",
    )
    .bind(model)
    .bind(&tasks)
    .bind(&epochs)
    .fetch_all(pool)
    .await
    .with_context(|| format!("reading the epochs of model {model:?}"))?;
    Ok(lost.into_iter().map(|t| t as u32).collect())
}

/// The first statement of every step and start transaction: locks the task's row until
/// the transaction ends, and — when `epoch` still holds it — renews its lease for `lease`
/// and records the step. `false`: fenced, another owner took the task (nothing written).
pub async fn lock_and_renew(
    conn: &mut PgConnection,
    model: &str,
    task: u32,
    epoch: i64,
    lease: Duration,
) -> Result<bool, StoreError> {
    lock_renew_and_notify(conn, model, task, epoch, lease, false).await
}

/// Extends, from this moment, the lease of a task whose row the caller's transaction locked
/// ([`lock_and_renew`]): a step's lock renews the lease from the transaction's start
/// (`now()`), so a step that ran longer than the lease would commit with its lease already
/// spent, and another instance waiting on the row would take the task the moment it
/// commits. `clock_timestamp()` is the statement's own time. `false`: not this epoch's task.
pub async fn extend(
    conn: &mut PgConnection,
    model: &str,
    task: u32,
    epoch: i64,
    lease: Duration,
) -> Result<bool, StoreError> {
    let extended = sqlx::query(
        "UPDATE parsley.tasks SET lease_until = clock_timestamp() + $4 * interval '1 millisecond'
          WHERE model = $1 AND task = $2 AND epoch = $3",
    )
    .bind(model)
    .bind(task as i32)
    .bind(epoch)
    .bind(millis(lease))
    .execute(&mut *conn)
    .await
    .with_context(|| format!("extending the lease of task {model}/{task}"))?;
    Ok(extended.rows_affected() == 1)
}

/// [`lock_and_renew`], and with `notify` the task's clock `NOTIFY` too
/// ([`crate::ordering::notify`]'s channel and payload) — in the same statement, so a step
/// that changes the clock saves a round trip. Only when the task is locked: a fenced step
/// sends nothing (and rolls back). Like any `NOTIFY`, it is delivered when the transaction
/// commits, wherever in the transaction it was sent.
pub async fn lock_renew_and_notify(
    conn: &mut PgConnection,
    model: &str,
    task: u32,
    epoch: i64,
    lease: Duration,
    notify: bool,
) -> Result<bool, StoreError> {
    // The notification sits in a subquery whose condition refers to no row: a one-time
    // filter, so `pg_notify` runs only when asked, in the custom and the generic plan alike
    // (and only for the row the update returns).
    // It also marks the transaction as a step's (`parsley.step`, transaction-local): the
    // documents' edit trigger (migration `20261206000000`) notifies every model for a
    // change made outside a step, and leaves a step's changes to the step's own notification.
    let payload = notify.then(|| crate::ordering::notify_payload(model, Some(task)));
    let locked: Option<(i64, Option<i32>, String)> = sqlx::query_as(
        "UPDATE parsley.tasks SET lease_until = now() + $4 * interval '1 millisecond', last_step_at = now()
          WHERE model = $1 AND task = $2 AND epoch = $3
          RETURNING epoch, (SELECT 1 FROM (SELECT pg_notify($5, $6) WHERE $6::text IS NOT NULL) AS n),
                    set_config('parsley.step', 'on', true)",
    )
    .bind(model)
    .bind(task as i32)
    .bind(epoch)
    .bind(millis(lease))
    .bind(crate::ordering::CLOCK_NOTIFY_CHANNEL)
    .bind(payload)
    .fetch_optional(&mut *conn)
    .await
    .with_context(|| format!("locking task {model}/{task}"))?;
    if let Some((_, notified, _)) = locked {
        if notified.is_some() != notify {
            return Err(StoreError::bug(format!(
                "locking task {model}/{task}: the clock notification was {} when {}",
                if notified.is_some() { "sent" } else { "not sent" },
                if notify { "asked for" } else { "not asked for" }
            )));
        }
    }
    Ok(locked.is_some())
}

/// What [`claim`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The task is this instance's, at the returned row's (new) epoch. `from`: the owner
    /// whose lease had expired (a takeover), `None` when the task was free or handed back.
    Taken { row: TaskRow, from: Option<String> },
    /// Another instance's lease on it is live.
    Held { owner: String },
    /// The row is locked by another session past `lock_wait` (a frozen owner mid-step):
    /// `holder` describes the session holding it, when it can be found.
    Locked { holder: Option<String> },
}

/// Ends a claim that takes nothing, releasing the row lock before the claim returns. A
/// transaction merely dropped is rolled back only when its connection is next used, and
/// until then the row stays locked: a renewal right after a claim that found the task held
/// skipped the row (`SKIP LOCKED`) and recorded nothing.
async fn release_lock(tx: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<(), StoreError> {
    tx.rollback().await.context("ending a claim that took nothing")
}

/// Takes `task` for `instance` if its lease is free (never held, handed back, or expired),
/// raising the epoch — which fences the previous owner's steps — and starting a lease of
/// `lease`. Waits at most `lock_wait` for the row's lock.
pub async fn claim(
    pool: &PgPool,
    model: &str,
    task: u32,
    instance: &str,
    lease: Duration,
    lock_wait: Duration,
) -> Result<Claim, StoreError> {
    let mut tx = pool.begin().await.context("beginning a claim")?;
    sqlx::query(&format!("SET LOCAL lock_timeout = {}", millis(lock_wait).max(1)))
        .execute(&mut *tx)
        .await
        .context("bounding the claim's lock wait")?;
    let current = sqlx::query(
        "SELECT owner, lease_until IS NOT NULL AS leased, coalesce(lease_until > now(), false) AS live
           FROM parsley.tasks WHERE model = $1 AND task = $2 FOR UPDATE",
    )
    .bind(model)
    .bind(task as i32)
    .fetch_optional(&mut *tx)
    .await;
    let current = match current {
        Ok(c) => c,
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {
            drop(tx);
            return Ok(Claim::Locked { holder: lock_holder(pool).await });
        }
        Err(e) => return Err(StoreError::sqlx(format!("locking task {model}/{task} to claim it"), e)),
    };
    let from = match &current {
        Some(row) if row.get::<bool, _>("live") => {
            let owner = row.get("owner");
            release_lock(tx).await?;
            return Ok(Claim::Held { owner });
        }
        Some(row) if row.get::<bool, _>("leased") => Some(row.get::<String, _>("owner")),
        _ => None,
    };
    let row = sqlx::query(&format!(
        "INSERT INTO parsley.tasks (model, task, epoch, owner, lease_until) VALUES ($1, $2, 1, $3, now() + $4 * interval '1 millisecond')
         ON CONFLICT (model, task) DO UPDATE
           SET epoch = parsley.tasks.epoch + 1, owner = EXCLUDED.owner, lease_until = EXCLUDED.lease_until,
               updated_at = now()
           WHERE parsley.tasks.lease_until IS NULL OR parsley.tasks.lease_until <= now()
         RETURNING {}",
        crate::ordering::TASK_COLUMNS
    ))
    .bind(model)
    .bind(task as i32)
    .bind(instance)
    .bind(millis(lease))
    .fetch_optional(&mut *tx)
    .await
    .with_context(|| format!("claiming task {model}/{task}"))?;
    // No row: the task had none when it was looked at, and another instance created it
    // since — with a live lease (the insert waited for that transaction to commit).
    let Some(row) = row else {
        let owner: String = sqlx::query_scalar("SELECT owner FROM parsley.tasks WHERE model = $1 AND task = $2")
            .bind(model)
            .bind(task as i32)
            .fetch_one(&mut *tx)
            .await
            .with_context(|| format!("reading the owner of task {model}/{task}"))?;
        release_lock(tx).await?;
        return Ok(Claim::Held { owner });
    };
    let row = task_row(&row)?;
    tx.commit().await.with_context(|| format!("committing the claim of task {model}/{task}"))?;
    Ok(Claim::Taken { row, from })
}

/// Who holds a lock on the task's row, as well as the server can tell: the sessions of the
/// database that are inside a transaction, oldest first (a frozen owner is "idle in
/// transaction" since it stopped).
async fn lock_holder(pool: &PgPool) -> Option<String> {
    let rows: Vec<(i32, String, String, i64)> = sqlx::query_as(
        "SELECT pid, coalesce(application_name, ''), coalesce(state, ''),
                (extract(epoch FROM now() - state_change) * 1000)::bigint
           FROM pg_stat_activity
          WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL
            AND state LIKE 'idle in transaction%'
          ORDER BY xact_start LIMIT 3",
    )
    .fetch_all(pool)
    .await
    .ok()?;
    if rows.is_empty() {
        return None;
    }
    Some(
        rows.iter()
            .map(|(pid, app, state, ms)| format!("pid {pid} ({app}) {state} for {ms} ms"))
            .collect::<Vec<_>>()
            .join("; "),
    )
}

/// Starts `task` again for its owner after its runner ended (a panic, a lifted refusal):
/// a new epoch, only while `epoch` still holds it. `None`: another instance took it.
pub async fn retake(
    pool: &PgPool,
    model: &str,
    task: u32,
    instance: &str,
    epoch: i64,
    lease: Duration,
) -> Result<Option<TaskRow>, StoreError> {
    let row = sqlx::query(&format!(
        "UPDATE parsley.tasks SET epoch = epoch + 1, owner = $3, lease_until = now() + $5 * interval '1 millisecond',
                updated_at = now()
          WHERE model = $1 AND task = $2 AND epoch = $4
         RETURNING {}",
        crate::ordering::TASK_COLUMNS
    ))
    .bind(model)
    .bind(task as i32)
    .bind(instance)
    .bind(epoch)
    .bind(millis(lease))
    .fetch_optional(pool)
    .await
    .with_context(|| format!("taking task {model}/{task} again"))?;
    row.as_ref().map(task_row).transpose()
}

/// Hands `task` back (its runner has stopped): the lease is dropped while `epoch` still
/// holds it, and the other instances are told, so one takes it at once.
pub async fn release(pool: &PgPool, model: &str, task: u32, epoch: i64) -> Result<bool, StoreError> {
    let mut tx = pool.begin().await.context("beginning a release")?;
    let released = sqlx::query(
        "UPDATE parsley.tasks SET lease_until = NULL, updated_at = now() WHERE model = $1 AND task = $2 AND epoch = $3",
    )
    .bind(model)
    .bind(task as i32)
    .bind(epoch)
    .execute(&mut *tx)
    .await
    .with_context(|| format!("handing back task {model}/{task}"))?
    .rows_affected()
        > 0;
    notify_members(&mut tx, model).await?;
    tx.commit().await.context("committing a release")?;
    Ok(released)
}

/// A member of a model, as the balancer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub instance: String,
    pub balanced: bool,
    /// Its lease has not passed.
    pub live: bool,
}

/// The members of `model` (live or not), by name.
pub async fn members(conn: &mut PgConnection, model: &str) -> Result<Vec<Member>, StoreError> {
    let rows: Vec<(String, bool, bool)> = sqlx::query_as(
        "SELECT instance, balanced, lease_until > now() FROM parsley.members WHERE model = $1 ORDER BY instance",
    )
    .bind(model)
    .fetch_all(&mut *conn)
    .await
    .with_context(|| format!("reading the members of model {model:?}"))?;
    Ok(rows.into_iter().map(|(instance, balanced, live)| Member { instance, balanced, live }).collect())
}

/// How many tasks each live balanced member of a model should run: `tasks` shared as
/// evenly as possible (within one task) over `members` (sorted by name), the larger shares
/// to the first. Every instance computes the same shares from the same rows.
pub fn shares(tasks: u32, members: &[String]) -> Vec<(String, u32)> {
    if members.is_empty() {
        return Vec::new();
    }
    let n = members.len() as u32;
    let (base, extra) = (tasks / n, tasks % n);
    members.iter().enumerate().map(|(i, m)| (m.clone(), base + u32::from((i as u32) < extra))).collect()
}

#[cfg(test)]
mod tests {
    use super::shares;

    #[test]
    fn shares_are_even_within_one_task_and_sum_to_the_tasks() {
        for tasks in 0..40u32 {
            for n in 1..8usize {
                let members: Vec<String> = (0..n).map(|i| format!("i{i}")).collect();
                let s = shares(tasks, &members);
                assert_eq!(s.iter().map(|(_, k)| k).sum::<u32>(), tasks);
                let (min, max) = (s.iter().map(|x| x.1).min().unwrap(), s.iter().map(|x| x.1).max().unwrap());
                assert!(max - min <= 1, "{tasks} over {n}: {s:?}");
            }
        }
        assert_eq!(
            shares(12, &["a".into(), "b".into(), "c".into()]).iter().map(|x| x.1).collect::<Vec<_>>(),
            [4, 4, 4]
        );
        assert_eq!(shares(12, &["a".into(), "b".into(), "c".into(), "d".into(), "e".into()])[0].1, 3);
        assert!(shares(12, &[]).is_empty());
    }
}
