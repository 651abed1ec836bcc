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
//! and used through the system's OpenSSL. A failed connection names the URL's setting to
//! check when the failure is a known one ([`explain`]).

use std::str::FromStr as _;
use std::time::Duration;

use anyhow::Context as _;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

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

/// The connect options of `url` with `bounds` set on every session.
pub fn connect_options(url: &str, bounds: &SessionBounds) -> anyhow::Result<PgConnectOptions> {
    let options = PgConnectOptions::from_str(url).with_context(|| format!("invalid database URL {}", redact(url)))?;
    Ok(options.options(bounds.parameters()))
}

/// A connection pool of at most `max_connections` to `url`, every session under `bounds`,
/// failing within `acquire_timeout` if the server does not answer.
pub async fn connect_bounded(
    url: &str,
    max_connections: u32,
    acquire_timeout: Duration,
    bounds: &SessionBounds,
) -> anyhow::Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        .connect_with(connect_options(url, bounds)?)
        .await
        .map_err(|e| {
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
        sqlx::Error::Tls(e) if e.to_string().contains("certificate verify failed") => {
            Some("the server's certificate is not trusted: check sslrootcert in database.url")
        }
        sqlx::Error::Tls(_) => Some("TLS failed: check sslmode, sslrootcert, sslcert and sslkey in database.url"),
        _ => None,
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
    Ok(PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        .connect_lazy_with(connect_options(url, bounds)?))
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
    fn a_bad_url_is_named_without_its_password() {
        let err = format!(
            "{:#}",
            connect_options("postgres://u:secret@h:notaport/db", &SessionBounds::default()).unwrap_err()
        );
        assert!(err.contains("invalid database URL") && !err.contains("secret"), "{err}");
    }
}
