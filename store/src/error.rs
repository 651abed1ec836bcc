//! The store's error, [`StoreError`]: what a call was doing (its context, as log lines and
//! messages show it) and what kind of failure it met ([`ErrorKind`]), so that a caller decides
//! by matching rather than by searching a chain of causes.
//!
//! Only a database that did not answer is an outage ([`ErrorKind::Unavailable`]); a value the
//! database refused (SQLSTATE class 22, data exception) is [`ErrorKind::Rejected`], carrying the
//! SQLSTATE and the database's message; a state another party changed under the call — a
//! model's shape changing through every attempt of a read, an applied migration that no longer
//! matches its file — is [`ErrorKind::Conflict`]; an argument the store refused before asking
//! the database (a database name, a migrations folder) is [`ErrorKind::Invalid`]; anything
//! else — a statement the database rejects (class 42), a row that does not decode, an
//! invariant broken — is a bug ([`ErrorKind::Bug`]), never shown as an outage.
//!
//! A task's fencing is not an error: the statements that can find another owner's epoch
//! answer it as a value (`Ok(false)`, `None`, the tasks lost), which each caller branches on.
//!
//! `Display` prints the context; the alternate form (`{:#}`) appends every cause, as an
//! `anyhow` error with context prints, so messages read the same through either.

use std::borrow::Cow;
use std::fmt;

/// A boxed cause.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What kind of failure a [`StoreError`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The database did not answer, or could not now: connection, pool, I/O, TLS, timeouts
    /// and cancellations, shutdown, resources, transient conflicts (SQLSTATE classes 08, 40,
    /// 53, 55, 57, 58, XX). Worth retrying.
    Unavailable,
    /// The database refused a value it was given (class 22).
    Rejected,
    /// Another party changed what the call depends on, during the call or since it was
    /// recorded: the caller decides whether trying again can help.
    Conflict,
    /// The store refused an argument before asking the database.
    Invalid,
    /// Anything else: a bug of ours.
    Bug,
}

/// A failed store call: its kind, what it was doing, and its cause.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database did not answer ([`ErrorKind::Unavailable`]).
    Unavailable {
        context: Cow<'static, str>,
        #[source]
        source: BoxError,
    },
    /// The database refused a value ([`ErrorKind::Rejected`]): its SQLSTATE (class 22) and
    /// message.
    Rejected {
        context: Cow<'static, str>,
        sqlstate: String,
        message: String,
        #[source]
        source: BoxError,
    },
    /// Another party changed what the call depends on ([`ErrorKind::Conflict`]).
    Conflict {
        context: Cow<'static, str>,
        #[source]
        source: Option<BoxError>,
    },
    /// An argument refused before the database was asked ([`ErrorKind::Invalid`]).
    Invalid {
        context: Cow<'static, str>,
        #[source]
        source: Option<BoxError>,
    },
    /// Anything else ([`ErrorKind::Bug`]).
    Bug {
        context: Cow<'static, str>,
        #[source]
        source: Option<BoxError>,
    },
}

impl StoreError {
    /// A failed sqlx call made while doing `context`, classified by [`classify_sqlx`].
    pub fn sqlx(context: impl Into<Cow<'static, str>>, e: sqlx::Error) -> StoreError {
        let answer = answer_of(&e);
        StoreError::classified(classify_sqlx(&e), context.into(), Box::new(e), answer)
    }

    /// A failed migration run made while doing `context`: classified by the sqlx error it
    /// carries; a recorded migration that is missing or changed is a conflict.
    pub fn migrate(context: impl Into<Cow<'static, str>>, e: sqlx::migrate::MigrateError) -> StoreError {
        use sqlx::migrate::MigrateError;
        let (kind, answer) = match &e {
            MigrateError::Execute(s) | MigrateError::ExecuteMigration(s, _) => (classify_sqlx(s), answer_of(s)),
            MigrateError::VersionMissing(_) | MigrateError::VersionMismatch(_) => (ErrorKind::Conflict, None),
            _ => (ErrorKind::Bug, None),
        };
        StoreError::classified(kind, context.into(), Box::new(e), answer)
    }

    /// An error of `kind` caused by `source`; `answer`: the database's SQLSTATE and message.
    fn classified(
        kind: ErrorKind,
        context: Cow<'static, str>,
        source: BoxError,
        answer: Option<(String, String)>,
    ) -> StoreError {
        match kind {
            ErrorKind::Unavailable => StoreError::Unavailable { context, source },
            ErrorKind::Rejected => {
                let (sqlstate, message) = answer.unwrap_or_default();
                StoreError::Rejected { context, sqlstate, message, source }
            }
            ErrorKind::Conflict => StoreError::Conflict { context, source: Some(source) },
            ErrorKind::Invalid => StoreError::Invalid { context, source: Some(source) },
            ErrorKind::Bug => StoreError::Bug { context, source: Some(source) },
        }
    }

    /// A bug with no cause but its description.
    pub fn bug(context: impl Into<Cow<'static, str>>) -> StoreError {
        StoreError::Bug { context: context.into(), source: None }
    }

    /// A conflict with no cause but its description.
    pub fn conflict(context: impl Into<Cow<'static, str>>) -> StoreError {
        StoreError::Conflict { context: context.into(), source: None }
    }

    /// An argument refused, described.
    pub fn invalid(context: impl Into<Cow<'static, str>>) -> StoreError {
        StoreError::Invalid { context: context.into(), source: None }
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        match self {
            StoreError::Unavailable { .. } => ErrorKind::Unavailable,
            StoreError::Rejected { .. } => ErrorKind::Rejected,
            StoreError::Conflict { .. } => ErrorKind::Conflict,
            StoreError::Invalid { .. } => ErrorKind::Invalid,
            StoreError::Bug { .. } => ErrorKind::Bug,
        }
    }

    /// Whether the database did not answer (a retry may succeed).
    pub fn is_unavailable(&self) -> bool {
        self.kind() == ErrorKind::Unavailable
    }

    /// What the call was doing.
    pub fn context(&self) -> &str {
        match self {
            StoreError::Unavailable { context, .. }
            | StoreError::Rejected { context, .. }
            | StoreError::Conflict { context, .. }
            | StoreError::Invalid { context, .. }
            | StoreError::Bug { context, .. } => context,
        }
    }

    /// The SQLSTATE the database answered with, if it answered.
    pub fn sqlstate(&self) -> Option<Cow<'_, str>> {
        if let StoreError::Rejected { sqlstate, .. } = self {
            return Some(Cow::Borrowed(sqlstate));
        }
        match self.sqlx_cause()? {
            sqlx::Error::Database(db) => db.code(),
            _ => None,
        }
    }

    /// Whether the database said a table does not exist (the migrations have not run).
    pub fn is_undefined_table(&self) -> bool {
        self.sqlx_cause().is_some_and(is_undefined_table)
    }

    /// The sqlx error among the causes, if there is one.
    fn sqlx_cause(&self) -> Option<&sqlx::Error> {
        let mut cause = std::error::Error::source(self);
        while let Some(c) = cause {
            if let Some(e) = c.downcast_ref::<sqlx::Error>() {
                return Some(e);
            }
            cause = c.source();
        }
        None
    }

    /// This error under an outer `context`, of the same kind (the error becomes its cause).
    pub fn wrap(self, context: impl Into<Cow<'static, str>>) -> StoreError {
        let context = context.into();
        match self {
            StoreError::Rejected { ref sqlstate, ref message, .. } => {
                let (sqlstate, message) = (sqlstate.clone(), message.clone());
                StoreError::Rejected { context, sqlstate, message, source: Box::new(self) }
            }
            StoreError::Unavailable { .. } => StoreError::Unavailable { context, source: Box::new(self) },
            StoreError::Conflict { .. } => StoreError::Conflict { context, source: Some(Box::new(self)) },
            StoreError::Invalid { .. } => StoreError::Invalid { context, source: Some(Box::new(self)) },
            StoreError::Bug { .. } => StoreError::Bug { context, source: Some(Box::new(self)) },
        }
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.context())?;
        if f.alternate() {
            let mut cause = std::error::Error::source(self);
            while let Some(c) = cause {
                write!(f, ": {c}")?;
                cause = c.source();
            }
        }
        Ok(())
    }
}

/// A sqlx error with no context of its own: the context says what kind it is.
impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> StoreError {
        let context = match classify_sqlx(&e) {
            ErrorKind::Unavailable => "the database did not answer",
            ErrorKind::Rejected => "the database rejected a value",
            _ => "a database call failed",
        };
        StoreError::sqlx(context, e)
    }
}

/// The SQLSTATE and message of a database's answer.
fn answer_of(e: &sqlx::Error) -> Option<(String, String)> {
    match e {
        sqlx::Error::Database(db) => {
            Some((db.code().map(Cow::into_owned).unwrap_or_default(), db.message().to_string()))
        }
        _ => None,
    }
}

/// Classifies a sqlx error.
pub fn classify_sqlx(e: &sqlx::Error) -> ErrorKind {
    match e {
        sqlx::Error::Database(db) => classify_sqlstate(db.code().as_deref().unwrap_or("")),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => ErrorKind::Unavailable,
        _ => ErrorKind::Bug,
    }
}

/// Classifies a SQLSTATE by its class (its first two characters).
pub fn classify_sqlstate(code: &str) -> ErrorKind {
    match code.get(..2) {
        Some("22") => ErrorKind::Rejected,
        Some("08" | "40" | "53" | "55" | "57" | "58" | "XX") => ErrorKind::Unavailable,
        _ => ErrorKind::Bug,
    }
}

/// Whether the database said a table does not exist (the migrations have not run).
pub fn is_undefined_table(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01"))
}

/// A cause the store knows how to classify, under a context.
pub(crate) trait Cause {
    fn under(self, context: Cow<'static, str>) -> StoreError;
}

impl Cause for sqlx::Error {
    fn under(self, context: Cow<'static, str>) -> StoreError {
        StoreError::sqlx(context, self)
    }
}

impl Cause for StoreError {
    fn under(self, context: Cow<'static, str>) -> StoreError {
        self.wrap(context)
    }
}

impl Cause for sqlx::migrate::MigrateError {
    fn under(self, context: Cow<'static, str>) -> StoreError {
        StoreError::migrate(context, self)
    }
}

/// A stored integer out of its range: a row that does not decode.
impl Cause for std::num::TryFromIntError {
    fn under(self, context: Cow<'static, str>) -> StoreError {
        StoreError::Bug { context, source: Some(Box::new(self)) }
    }
}

/// A file of a model's migrations folder that cannot be read: the folder is refused.
impl Cause for std::io::Error {
    fn under(self, context: Cow<'static, str>) -> StoreError {
        StoreError::Invalid { context, source: Some(Box::new(self)) }
    }
}

/// Context for the store's calls, as `anyhow::Context` gives it: `context` for a fixed
/// description, `with_context` for one built only on failure. On an `Option`, `None` is a bug.
pub(crate) trait Context<T> {
    fn context(self, context: &'static str) -> Result<T, StoreError>;
    fn with_context<C: Into<Cow<'static, str>>>(self, context: impl FnOnce() -> C) -> Result<T, StoreError>;
}

impl<T, E: Cause> Context<T> for Result<T, E> {
    fn context(self, context: &'static str) -> Result<T, StoreError> {
        self.map_err(|e| e.under(Cow::Borrowed(context)))
    }

    fn with_context<C: Into<Cow<'static, str>>>(self, context: impl FnOnce() -> C) -> Result<T, StoreError> {
        self.map_err(|e| e.under(context().into()))
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, context: &'static str) -> Result<T, StoreError> {
        self.ok_or_else(|| StoreError::bug(context))
    }

    fn with_context<C: Into<Cow<'static, str>>>(self, context: impl FnOnce() -> C) -> Result<T, StoreError> {
        self.ok_or_else(|| StoreError::bug(context()))
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::error::Error as _;

    use sqlx::error::{DatabaseError, ErrorKind as SqlxKind};

    use super::*;

    /// A database error with a SQLSTATE, as the server would send it.
    #[derive(Debug)]
    struct Answered {
        code: &'static str,
        message: &'static str,
    }

    impl fmt::Display for Answered {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.message)
        }
    }

    impl std::error::Error for Answered {}

    impl DatabaseError for Answered {
        fn message(&self) -> &str {
            self.message
        }

        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.code))
        }

        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }

        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }

        fn into_error(self: Box<Self>) -> BoxError {
            self
        }

        fn kind(&self) -> SqlxKind {
            SqlxKind::Other
        }
    }

    fn answered(code: &'static str, message: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Answered { code, message }))
    }

    #[test]
    fn sqlstates_are_classified_by_their_class() {
        for (code, kind) in [
            ("22021", ErrorKind::Rejected),    // invalid byte sequence (NUL in text)
            ("22P02", ErrorKind::Rejected),    // invalid text representation
            ("22003", ErrorKind::Rejected),    // numeric value out of range
            ("42601", ErrorKind::Bug),         // syntax error
            ("42P01", ErrorKind::Bug),         // undefined table
            ("23505", ErrorKind::Bug),         // unique violation
            ("08006", ErrorKind::Unavailable), // connection failure
            ("08P01", ErrorKind::Unavailable), // protocol violation
            ("40001", ErrorKind::Unavailable), // serialization failure
            ("40P01", ErrorKind::Unavailable), // deadlock detected
            ("53300", ErrorKind::Unavailable), // too many connections
            ("55P03", ErrorKind::Unavailable), // lock not available
            ("57014", ErrorKind::Unavailable), // statement timeout
            ("57P01", ErrorKind::Unavailable), // admin shutdown
            ("58030", ErrorKind::Unavailable), // I/O error
            ("XX000", ErrorKind::Unavailable), // internal error
            ("", ErrorKind::Bug),
            ("2", ErrorKind::Bug),
            ("é", ErrorKind::Bug),
        ] {
            assert_eq!(classify_sqlstate(code), kind, "{code:?}");
            assert_eq!(StoreError::from(answered(code, "m")).kind(), kind, "{code:?}");
        }
    }

    #[test]
    fn sqlx_errors_are_classified_by_variant() {
        let io = || std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        for (e, kind) in [
            (sqlx::Error::Io(io()), ErrorKind::Unavailable),
            (sqlx::Error::Tls("handshake".into()), ErrorKind::Unavailable),
            (sqlx::Error::Protocol("unexpected message".into()), ErrorKind::Unavailable),
            (sqlx::Error::PoolTimedOut, ErrorKind::Unavailable),
            (sqlx::Error::PoolClosed, ErrorKind::Unavailable),
            (sqlx::Error::WorkerCrashed, ErrorKind::Unavailable),
            (sqlx::Error::RowNotFound, ErrorKind::Bug),
            (sqlx::Error::ColumnNotFound("c".into()), ErrorKind::Bug),
            (sqlx::Error::Decode("bad".into()), ErrorKind::Bug),
            (sqlx::Error::Configuration("bad url".into()), ErrorKind::Bug),
            (sqlx::Error::TypeNotFound { type_name: "t".into() }, ErrorKind::Bug),
        ] {
            let name = format!("{e:?}");
            assert_eq!(classify_sqlx(&e), kind, "{name}");
            assert_eq!(StoreError::sqlx("doing", e).kind(), kind, "{name}");
        }
    }

    #[test]
    fn a_rejected_value_carries_its_sqlstate_and_message() {
        let e = StoreError::sqlx("reading a page", answered("22021", "invalid byte sequence"));
        match &e {
            StoreError::Rejected { sqlstate, message, .. } => {
                assert_eq!((sqlstate.as_str(), message.as_str()), ("22021", "invalid byte sequence"));
            }
            other => panic!("not rejected: {other:?}"),
        }
        assert_eq!(e.sqlstate().as_deref(), Some("22021"));
        let wrapped = Err::<(), _>(e).context("a read").unwrap_err();
        assert_eq!(wrapped.kind(), ErrorKind::Rejected);
        assert_eq!(wrapped.sqlstate().as_deref(), Some("22021"));
    }

    #[test]
    fn context_is_kept_and_the_alternate_form_adds_every_cause() {
        let e = Err::<(), _>(sqlx::Error::PoolClosed).with_context(|| format!("loading task {} of model shop", 3));
        let e = Err::<(), _>(e.unwrap_err()).context("a read").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert_eq!(e.to_string(), "a read");
        assert_eq!(format!("{e:#}"), format!("a read: loading task 3 of model shop: {}", sqlx::Error::PoolClosed));
        // Through anyhow, as the binaries print it: the same text, and the kind downcasts.
        let any = anyhow::Error::new(e).context("the status query");
        assert_eq!(
            format!("{any:#}"),
            format!("the status query: a read: loading task 3 of model shop: {}", sqlx::Error::PoolClosed)
        );
        assert_eq!(any.downcast_ref::<StoreError>().map(StoreError::kind), Some(ErrorKind::Unavailable));
        assert_eq!(causes(&StoreError::bug("a stored row does not decode")), 0);
    }

    fn causes(e: &StoreError) -> usize {
        std::iter::successors(e.source(), |&c| c.source()).count()
    }

    #[test]
    fn kinds_of_errors_without_a_database_answer() {
        assert_eq!(None::<()>.context("a gated statement returned no model row").unwrap_err().kind(), ErrorKind::Bug);
        assert_eq!(u32::try_from(-1i32).context("a stored task").unwrap_err().kind(), ErrorKind::Bug);
        let missing = std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory");
        assert_eq!(Err::<(), _>(missing).context("reading a folder").unwrap_err().kind(), ErrorKind::Invalid);
        assert_eq!(StoreError::conflict("the shape changed").kind(), ErrorKind::Conflict);
        assert_eq!(StoreError::invalid("a bad name").kind(), ErrorKind::Invalid);
        assert_eq!(StoreError::bug("x").sqlstate(), None);
    }

    #[test]
    fn migration_errors_are_classified_by_what_they_carry() {
        use sqlx::migrate::MigrateError;
        let e = StoreError::migrate("running", MigrateError::Execute(sqlx::Error::PoolTimedOut));
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        let e = StoreError::migrate("running", MigrateError::ExecuteMigration(answered("42601", "syntax"), 7));
        assert_eq!(e.kind(), ErrorKind::Bug);
        assert_eq!(e.sqlstate().as_deref(), Some("42601"));
        assert_eq!(StoreError::migrate("running", MigrateError::VersionMismatch(7)).kind(), ErrorKind::Conflict);
        assert_eq!(StoreError::migrate("running", MigrateError::VersionMissing(7)).kind(), ErrorKind::Conflict);
        assert_eq!(StoreError::migrate("running", MigrateError::Dirty(7)).kind(), ErrorKind::Bug);
    }

    #[test]
    fn an_undefined_table_is_recognised_through_context() {
        assert!(is_undefined_table(&answered("42P01", "relation does not exist")));
        assert!(!is_undefined_table(&answered("42601", "syntax error")));
        assert!(!is_undefined_table(&sqlx::Error::PoolClosed));
        let e = Err::<(), _>(answered("42P01", "relation does not exist")).context("reading the widths").unwrap_err();
        assert!(e.is_undefined_table());
        assert!(e.wrap("refreshing").is_undefined_table());
        assert!(!StoreError::from(sqlx::Error::PoolClosed).is_undefined_table());
    }
}
