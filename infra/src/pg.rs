//! Postgres connections: the pool, and the bounds every session of the projector and the
//! gateway runs under.
//!
//! A stuck peer must cost a bounded, logged wait, never a hung task. Each session is opened
//! with `lock_timeout`, `statement_timeout`, `idle_in_transaction_session_timeout` and the
//! server's TCP keepalive settings as startup parameters (`-c name=value`), so they hold for
//! every statement on every connection of the pool, including a `LISTEN` connection opened
//! from it. sqlx opens its sockets without `SO_KEEPALIVE` and has no setting for it, so the
//! keepalive is the server's: it detects a client that vanished and ends its session,
//! releasing the row locks it held.
//!
//! TLS is the URL's: `sslmode` (`verify-full` checks the certificate and the host name),
//! `sslrootcert` (the CA file), `sslcert` and `sslkey` (a client certificate), read by sqlx
//! and used through rustls (with the system's trust store when `sslrootcert` is not given;
//! not OpenSSL, whose trust store load cost about 50 ms of CPU per connection: see
//! docs/DECISIONS.md, "Postgres TLS through rustls"). A failed connection names the URL's
//! setting to check when the failure is a known one ([`explain`]).

use std::ops::{Deref, DerefMut};
use std::str::FromStr as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions as _, Postgres};
use tokio::sync::{Semaphore, SemaphorePermit};

/// The bounds of every Postgres session; `None` leaves the server's own setting (off by
/// default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionBounds {
    /// Longest wait for a lock (a row lock held by a stuck peer): `lock_timeout`.
    pub lock_timeout: Option<Duration>,
    /// Longest statement: `statement_timeout`.
    pub statement_timeout: Option<Duration>,
    /// Longest pause inside an open transaction: `idle_in_transaction_session_timeout`.
    pub idle_in_transaction_timeout: Option<Duration>,
    /// Idle time before the server probes the connection: `tcp_keepalives_idle`, with
    /// probes every third of it (`tcp_keepalives_interval`, at least 1 s) and 3 probes
    /// (`tcp_keepalives_count`): a vanished client is dropped after about twice this.
    pub keepalives_idle: Option<Duration>,
}

impl Default for SessionBounds {
    /// 10 s lock waits, 30 s statements, 60 s idle in a transaction, 30 s keepalive idle.
    fn default() -> Self {
        SessionBounds {
            lock_timeout: Some(Duration::from_secs(10)),
            statement_timeout: Some(Duration::from_secs(30)),
            idle_in_transaction_timeout: Some(Duration::from_secs(60)),
            keepalives_idle: Some(Duration::from_secs(30)),
        }
    }
}

impl SessionBounds {
    /// No bound set: every setting is the server's.
    pub const SERVER_DEFAULTS: SessionBounds = SessionBounds {
        lock_timeout: None,
        statement_timeout: None,
        idle_in_transaction_timeout: None,
        keepalives_idle: None,
    };

    /// When sqlx logs a statement (its text included) as slow, at `WARN`: once it has used a
    /// quarter of `statement_timeout` (at least 1 s, sqlx's own default), or after 10 s with
    /// no statement timeout. A step's upsert under a backlog writes tens of thousands of rows
    /// and takes seconds by design; at sqlx's 1 s every such step logged a warning.
    pub fn slow_statement(&self) -> Duration {
        self.statement_timeout.map_or(Duration::from_secs(10), |t| (t / 4).max(Duration::from_secs(1)))
    }

    /// The startup parameters these bounds set, as `(name, value)`; milliseconds for the
    /// timeouts, whole seconds for the keepalive.
    pub fn parameters(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        let millis = |d: Duration| format!("{}ms", d.as_millis());
        if let Some(d) = self.lock_timeout {
            out.push(("lock_timeout", millis(d)));
        }
        if let Some(d) = self.statement_timeout {
            out.push(("statement_timeout", millis(d)));
        }
        if let Some(d) = self.idle_in_transaction_timeout {
            out.push(("idle_in_transaction_session_timeout", millis(d)));
        }
        if let Some(d) = self.keepalives_idle {
            let idle = d.as_secs().max(1);
            out.push(("tcp_keepalives_idle", idle.to_string()));
            out.push(("tcp_keepalives_interval", (idle / 3).max(1).to_string()));
            out.push(("tcp_keepalives_count", "3".to_string()));
        }
        out
    }
}

/// The connect options of `url` with `bounds` set on every session, and sqlx's warning of a
/// slow statement at [`SessionBounds::slow_statement`].
pub fn connect_options(url: &str, bounds: &SessionBounds) -> anyhow::Result<PgConnectOptions> {
    let options = PgConnectOptions::from_str(url).with_context(|| format!("invalid database URL {}", redact(url)))?;
    Ok(options.options(bounds.parameters()).log_slow_statements(log::LevelFilter::Warn, bounds.slow_statement()))
}

/// A connection pool of at most `max_connections` to `url`, every session under `bounds`,
/// failing within `acquire_timeout` if the server does not answer.
pub async fn connect_bounded(
    url: &str,
    max_connections: u32,
    acquire_timeout: Duration,
    bounds: &SessionBounds,
) -> anyhow::Result<PgPool> {
    pool_options(max_connections, acquire_timeout).connect_with(connect_options(url, bounds)?).await.map_err(|e| {
        let hint = explain(&e).unwrap_or("is it up? `make services-up`");
        anyhow::Error::new(e).context(format!("connecting to Postgres at {}: {hint}", redact(url)))
    })
}

/// The setting of the database URL to check for a known connection failure: a refused
/// password, a server that wants TLS or a client certificate, an untrusted certificate.
pub fn explain(error: &sqlx::Error) -> Option<&'static str> {
    match error {
        sqlx::Error::Database(db) => {
            let message = db.message();
            match db.code().as_deref() {
                Some("28P01") => Some("the server refused the password: check the password in database.url"),
                Some("28000") if message.contains("no encryption") => Some(
                    "the server accepts this user over TLS only: set sslmode=verify-full and sslrootcert in database.url",
                ),
                Some("28000") if message.contains("certificate") => {
                    Some("the server wants a client certificate: set sslcert and sslkey in database.url")
                }
                _ => None,
            }
        }
        // rustls reports a refused certificate from inside the handshake's I/O ("invalid
        // peer certificate: UnknownIssuer"), other TLS failures as TLS errors.
        sqlx::Error::Io(e) => tls_failure(&e.to_string()),
        sqlx::Error::Tls(e) => tls_failure(&e.to_string())
            .or(Some("TLS failed: check sslmode, sslrootcert, sslcert and sslkey in database.url")),
        _ => None,
    }
}

/// The setting to check for a TLS failure's message, when it is a known one.
fn tls_failure(message: &str) -> Option<&'static str> {
    if message.contains("invalid peer certificate: NotValidForName") {
        Some("the server's certificate does not name this host: check the host in database.url (or sslmode)")
    } else if message.contains("invalid peer certificate") {
        Some("the server's certificate is not trusted: check sslrootcert in database.url")
    } else if message.contains("received fatal alert") || message.contains("peer sent no certificates") {
        Some("the server refused the TLS session: check sslcert and sslkey in database.url")
    } else {
        None
    }
}

/// [`connect_bounded`] with the default [`SessionBounds`].
pub async fn connect(url: &str, max_connections: u32, acquire_timeout: Duration) -> anyhow::Result<PgPool> {
    connect_bounded(url, max_connections, acquire_timeout, &SessionBounds::default()).await
}

/// Like [`connect_bounded`], but connecting on first use (nothing touches the network here).
pub fn connect_lazy_bounded(
    url: &str,
    max_connections: u32,
    acquire_timeout: Duration,
    bounds: &SessionBounds,
) -> anyhow::Result<PgPool> {
    Ok(pool_options(max_connections, acquire_timeout).connect_lazy_with(connect_options(url, bounds)?))
}

/// How long a pooled connection may sit idle and still be handed out without a check.
pub const CHECK_IDLE_AFTER: Duration = Duration::from_secs(1);

/// The pool's options. A connection idle for longer than [`CHECK_IDLE_AFTER`] is checked
/// with a round trip before it is handed out (one that fails the check is closed and another
/// taken); one returned to the pool within that time is handed out as it is. sqlx's default
/// checks every connection at every acquire — a round trip as long as a short statement
/// itself, about a fifth of a covered read's CPU in the gateway. A connection that breaks
/// between uses fails its statement either way (a check only narrows the window), and the
/// pool then replaces it.
fn pool_options(max_connections: u32, acquire_timeout: Duration) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > CHECK_IDLE_AFTER {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// Connections of a pool kept out of it between the uses of one hot path, handed from one
/// use to the next without sqlx's release round trip.
///
/// sqlx tests every connection returned to its pool with a round trip (a `Sync` and its
/// `ReadyForQuery`, in a task spawned for it) before another caller may take it: as much
/// CPU as a short statement's, on both sides, for every use. A connection handed back here
/// with [`Reused::release`] — after its statements completed, so it is known to be idle
/// and outside any transaction — goes to the next caller as it is. One dropped without it
/// (an error, or a request cancelled in the middle of a statement) goes back to sqlx's
/// pool, whose test brings it back to a ready state or closes it.
///
/// At most `keep` connections are out through this at once (callers beyond wait, within the
/// pool's acquire timeout), so the pool always has the rest for its other users: held
/// connections are invisible to it. A kept connection idle for more than
/// [`CHECK_IDLE_AFTER`] goes back to the pool (which checks it before handing it out).
pub struct Reuse {
    pool: PgPool,
    idle: Mutex<Vec<(PoolConnection<Postgres>, Instant)>>,
    permits: Semaphore,
    keep: usize,
    acquire_timeout: Duration,
}

/// A connection taken from a [`Reuse`]: dereferences to the connection; hand it back with
/// [`Reused::release`] once its statements completed.
pub struct Reused<'a> {
    conn: Option<PoolConnection<Postgres>>,
    reuse: &'a Reuse,
    permit: Option<SemaphorePermit<'a>>,
}

impl Reuse {
    /// Up to `keep` connections of `pool` reused; `0` passes every call through to the pool.
    pub fn new(pool: PgPool, keep: usize, acquire_timeout: Duration) -> Reuse {
        Reuse { pool, idle: Mutex::new(Vec::new()), permits: Semaphore::new(keep), keep, acquire_timeout }
    }

    /// The share of a pool of `max_connections` a hot path keeps: all but a quarter (at
    /// least one) left to the pool's other users.
    pub fn keep_of(max_connections: u32) -> usize {
        let max = max_connections as usize;
        max - (max / 4).max(1).min(max)
    }

    /// How many connections are kept idle now.
    pub fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// A connection: the most recently released one if it has not been idle for long, else
    /// one from the pool.
    pub async fn acquire(&self) -> Result<Reused<'_>, sqlx::Error> {
        if self.keep == 0 {
            return Ok(Reused { conn: Some(self.pool.acquire().await?), reuse: self, permit: None });
        }
        let deadline = Instant::now() + self.acquire_timeout;
        let permit = tokio::time::timeout_at(deadline.into(), self.permits.acquire())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        self.give_back_idle();
        let fresh = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let conn = match fresh {
            Some((conn, _)) => conn,
            None => tokio::time::timeout_at(deadline.into(), self.pool.acquire())
                .await
                .map_err(|_| sqlx::Error::PoolTimedOut)??,
        };
        Ok(Reused { conn: Some(conn), reuse: self, permit: Some(permit) })
    }

    /// Gives every kept connection back to the pool: at shutdown, so that a `close` of the
    /// pool (which waits for every connection out of it) does not wait on them; returns how
    /// many.
    pub fn give_back_all(&self) -> usize {
        let all: Vec<_> = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|e| e.into_inner()));
        all.len()
    }

    /// Gives the connections kept idle for longer than [`CHECK_IDLE_AFTER`] back to the pool
    /// (which tests them now, checks them again before handing one out, and closes them
    /// after its idle timeout); returns how many. Every acquire does it; call it now and
    /// then too, so a quiet path does not keep its connections out of the pool.
    pub fn give_back_idle(&self) -> usize {
        let stale: Vec<_> = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            // The oldest are at the front.
            let expired = idle.iter().take_while(|(_, at)| now.duration_since(*at) > CHECK_IDLE_AFTER).count();
            idle.drain(..expired).collect()
        };
        stale.len()
    }
}

impl Reused<'_> {
    /// Hands the connection back for the next caller. Call it only once the statements run
    /// on it completed (results read, any transaction ended): a connection merely dropped
    /// goes back to the pool, which tests it first.
    pub fn release(mut self) {
        if let (Some(conn), true) = (self.conn.take(), self.permit.is_some()) {
            self.reuse.idle.lock().unwrap_or_else(|e| e.into_inner()).push((conn, Instant::now()));
        }
    }
}

impl Deref for Reused<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.conn.as_ref().expect("a reused connection is present until released")
    }
}

impl DerefMut for Reused<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn.as_mut().expect("a reused connection is present until released")
    }
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
    use super::*;

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

    #[test]
    fn a_statement_is_slow_after_a_quarter_of_its_timeout() {
        assert_eq!(SessionBounds::default().slow_statement(), Duration::from_millis(7_500));
        let short = SessionBounds { statement_timeout: Some(Duration::from_secs(2)), ..SessionBounds::default() };
        assert_eq!(short.slow_statement(), Duration::from_secs(1), "never below sqlx's own second");
        assert_eq!(SessionBounds::SERVER_DEFAULTS.slow_statement(), Duration::from_secs(10));
    }

    #[test]
    fn bounds_become_startup_parameters() {
        let p = SessionBounds::default().parameters();
        let expected = [
            ("lock_timeout", "10000ms"),
            ("statement_timeout", "30000ms"),
            ("idle_in_transaction_session_timeout", "60000ms"),
            ("tcp_keepalives_idle", "30"),
            ("tcp_keepalives_interval", "10"),
            ("tcp_keepalives_count", "3"),
        ];
        let got: Vec<(&str, &str)> = p.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(got, expected);
        assert!(SessionBounds::SERVER_DEFAULTS.parameters().is_empty());
        let short = SessionBounds { keepalives_idle: Some(Duration::from_secs(1)), ..SessionBounds::SERVER_DEFAULTS };
        assert_eq!(short.parameters()[1], ("tcp_keepalives_interval", "1".to_string()));
    }

    #[test]
    fn tls_failures_name_the_setting_to_check() {
        let io = |m: &str| sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string()));
        let untrusted = io("invalid peer certificate: UnknownIssuer");
        assert!(explain(&untrusted).is_some_and(|h| h.contains("not trusted") && h.contains("sslrootcert")));
        let wrong_host = io("invalid peer certificate: NotValidForName");
        assert!(explain(&wrong_host).is_some_and(|h| h.contains("does not name this host")));
        assert_eq!(explain(&io("connection refused")), None);
        let tls = sqlx::Error::Tls("handshake failure".into());
        assert!(explain(&tls).is_some_and(|h| h.starts_with("TLS failed")));
    }

    #[test]
    fn a_bad_url_is_named_without_its_password() {
        let err = format!(
            "{:#}",
            connect_options("postgres://u:secret@h:notaport/db", &SessionBounds::default()).unwrap_err()
        );
        assert!(err.contains("invalid database URL") && !err.contains("secret"), "{err}");
    }
}
