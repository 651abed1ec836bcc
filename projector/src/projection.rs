//! The projection seam: application code that turns delivered records into rows, inside
//! the step's transaction. The engine has already decided the order; a projection only
//! writes.
//!
//! A projection fails in one of two ways ([`ProjectionError`]):
//! - **rejected**: the record itself is unacceptable and a retry would give the same
//!   answer — a value the projection cannot parse, a string Postgres cannot store, a
//!   constraint, a data exception, an exception a trigger or function raises, a value that
//!   cannot be encoded for the database. The task refuses `PROJECTION_REJECTED` at that record
//!   (or, with `on_rejected = "dead-letter"`, stores it in `parsley.dead_letters` and goes
//!   on).
//! - **transient**: anything else — a lost connection, a timeout, a serialization failure,
//!   a bug in the projection. The step rolls back, the task reports `failing`, and the same
//!   records are retried with backoff, never skipped.
//!
//! Database errors are classified by SQLSTATE class ([`rejects_record`]), and a value sqlx
//! cannot encode (`sqlx::Error::Encode`) rejects too: a projection that lets `sqlx::Error`
//! convert with `?` is classified without doing anything.
//!
//! [`Projection`] uses `async fn`s and so is not object-safe; [`DynProjection`] is its
//! object-safe form, implemented for every projection, and [`SharedProjection`] what the
//! projector keeps of a projection built from its registry.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use parsley::channel::{ChannelId, Position};
use parsley::CausalPast;
use sqlx::PgConnection;

/// A record header: its name and value as bytes (`None`: a header with a null value).
pub use crate::record::Header;

/// The step a delivery belongs to: the model and its task (partition *i* of every topic
/// the model receives). A projection that keeps rows of several models in one table keys
/// them by `model`.
#[derive(Clone, Copy, Debug)]
pub struct StepContext<'a> {
    pub model: &'a str,
    pub task: u32,
}

/// One delivered record, handed to the projection in delivery (causal) order: every record
/// it names as a cause (`causes`) was delivered before it, in this step or an earlier one.
///
/// The key, value and headers are the record's bytes as produced; a projection decides what
/// they must be, and rejects a record that is not ([`ProjectionError::rejected`], naming
/// [`Delivered::coordinate`], never quoting the payload). [`Delivered::key_str`] and
/// [`Delivered::value_json`] do the usual checks that way.
///
/// ```
/// use parsley::channel::ChannelId;
/// use parsley::{CausalPast, TopicId};
/// use parsley_projector::Delivered;
///
/// let causes = CausalPast::default();
/// let record = Delivered {
///     topic: "orders",
///     channel: ChannelId::new(TopicId::from_bytes([1; 16]), 3),
///     position: 42,
///     key: Some(b"o-1"),
///     value: Some(br#"{"status": "placed"}"#),
///     headers: &[],
///     timestamp_ms: None,
///     causes: &causes,
/// };
/// assert_eq!(record.coordinate(), "orders/3@42");
/// assert_eq!(record.key_str().unwrap(), Some("o-1"));
/// let value: serde_json::Value = record.value_json().unwrap().unwrap();
/// assert_eq!(value["status"], "placed");
///
/// let not_json = Delivered { value: Some(b"secret"), ..record };
/// let rejected = not_json.value_json::<serde_json::Value>().unwrap_err();
/// assert!(rejected.is_rejected());
/// assert!(rejected.to_string().contains("orders/3@42") && !rejected.to_string().contains("secret"));
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Delivered<'a> {
    /// The name of the record's topic.
    pub topic: &'a str,
    /// The record's own coordinate: channel and position.
    pub channel: ChannelId,
    pub position: Position,
    pub key: Option<&'a [u8]>,
    /// `None` for a tombstone.
    pub value: Option<&'a [u8]>,
    /// Application headers, names and values as bytes (a name need not be UTF-8); the
    /// `parsley.causes` header is in `causes`.
    pub headers: &'a [Header],
    pub timestamp_ms: Option<i64>,
    /// The causes the record carried.
    pub causes: &'a CausalPast,
}

impl<'a> Delivered<'a> {
    /// `topic/partition@position`, for messages (never the payload).
    pub fn coordinate(&self) -> String {
        format!("{}/{}@{}", self.topic, self.channel.partition, self.position)
    }

    /// The key as text (`None`: the record has no key); a key that is not UTF-8, or holds a
    /// NUL character (which Postgres `text` cannot store), is a rejection naming the record.
    pub fn key_str(&self) -> Result<Option<&'a str>, ProjectionError> {
        let Some(bytes) = self.key else { return Ok(None) };
        let key = std::str::from_utf8(bytes)
            .map_err(|_| ProjectionError::rejected(format!("the key of {} is not UTF-8", self.coordinate())))?;
        if key.contains('\0') {
            return Err(ProjectionError::rejected(format!(
                "the key of {} contains a NUL character, which Postgres text cannot store",
                self.coordinate()
            )));
        }
        Ok(Some(key))
    }

    /// The value read as JSON into `T` (`None`: a tombstone); a value that does not read is
    /// a rejection naming the record and where the reading failed, never quoting the value.
    pub fn value_json<T: serde::de::DeserializeOwned>(&self) -> Result<Option<T>, ProjectionError> {
        let Some(bytes) = self.value else { return Ok(None) };
        serde_json::from_slice(bytes).map(Some).map_err(|e| {
            ProjectionError::rejected(format!(
                "the value of {} does not read as JSON of the expected shape ({} bytes; error at line {} column {})",
                self.coordinate(),
                bytes.len(),
                e.line(),
                e.column()
            ))
        })
    }
}

/// Whether a database error with this SQLSTATE says the record is unacceptable (a retry
/// gives the same answer): class `22` data exception (e.g. `22P05` an unsupported Unicode
/// escape such as `\u0000` in `jsonb`, `22021` a byte sequence invalid in the encoding),
/// class `23` integrity constraint violation, class `54` program limit exceeded (e.g.
/// `54000` an index row too large for its key), class `P0` raised by PL/pgSQL (e.g.
/// `P0001` a trigger's or function's `RAISE EXCEPTION`, `P0004` a failed `ASSERT`): the
/// code that raised it judged the row it was given. Everything else — connection loss
/// (`08`), serialization failures and deadlocks (`40001`, `40P01`), lock timeouts (`55P03`),
/// an administrator's shutdown (`57P01`), insufficient resources (`53`), a statement the
/// projection got wrong (`42`) — is transient.
pub fn rejects_record(sqlstate: &str) -> bool {
    matches!(sqlstate.get(..2), Some("22" | "23" | "54" | "P0"))
}

/// A database message without the input value some messages quote at their end (class
/// `22`: `invalid input syntax for type integer: "abc"`): everything from the first `: "`
/// is withheld when the message ends with a quote. Identifiers quoted inside a message
/// (`constraint "c"`, `encoding "UTF8": 0x00`) stay.
pub fn withhold_value(message: &str) -> String {
    match message.find(": \"") {
        Some(at) if message.ends_with('"') => format!("{}: (value withheld)", &message[..at]),
        _ => message.to_string(),
    }
}

/// Why a projection did not apply a step's records: the one thing that decides what the
/// task does next (see the module documentation).
///
/// ```
/// use parsley_projector::ProjectionError;
///
/// // The record is at fault: refused (or dead-lettered), never retried.
/// let e = ProjectionError::rejected("the value of orders/0@7 has no \"amount\"");
/// assert!(e.is_rejected());
/// // Anything else is retried with backoff; `?` on an `anyhow::Error` gives this.
/// let e = ProjectionError::from(anyhow::anyhow!("the pricing service timed out"));
/// assert!(!e.is_rejected());
/// // A `sqlx::Error` is classified by its SQLSTATE: a constraint or data error rejects.
/// let e = ProjectionError::database(sqlx::Error::PoolTimedOut, "writing totals");
/// assert!(!e.is_rejected());
/// ```
#[derive(Debug)]
pub enum ProjectionError {
    /// The record is unacceptable, whatever the retry: the task refuses
    /// `PROJECTION_REJECTED` at it (or dead-letters it). `reason` says what is wrong —
    /// the record's coordinate when the projection knows it, the database's message when
    /// the database said no — and never quotes the payload.
    Rejected { reason: String },
    /// A failure a retry may change (or a projection bug): the step rolls back and is
    /// retried with backoff.
    Transient(anyhow::Error),
}

impl ProjectionError {
    pub fn rejected(reason: impl Into<String>) -> Self {
        ProjectionError::Rejected { reason: reason.into() }
    }

    /// Classifies a database error met while `what` (e.g. "writing documents"): rejected
    /// when its SQLSTATE class says the data is unacceptable ([`rejects_record`]), with the
    /// database's message and code — never its detail line, and never the value some
    /// messages end with ([`withhold_value`]): both may quote the data. A value sqlx could
    /// not encode as its parameter (`sqlx::Error::Encode`) is rejected too: the same record
    /// gives the same value on every retry.
    pub fn database(error: sqlx::Error, what: &str) -> Self {
        match &error {
            sqlx::Error::Database(db) => {
                if let Some(code) = db.code().filter(|c| rejects_record(c)) {
                    let constraint = db.constraint().map(|c| format!(", constraint {c:?}")).unwrap_or_default();
                    return ProjectionError::rejected(format!(
                        "{what}: the database rejected the data: {} (SQLSTATE {code}{constraint})",
                        withhold_value(db.message())
                    ));
                }
            }
            sqlx::Error::Encode(e) => {
                return ProjectionError::rejected(format!(
                    "{what}: a value could not be encoded for the database: {}",
                    withhold_value(&e.to_string())
                ));
            }
            _ => {}
        }
        ProjectionError::Transient(anyhow::Error::new(error).context(what.to_string()))
    }

    pub fn is_rejected(&self) -> bool {
        matches!(self, ProjectionError::Rejected { .. })
    }

    /// Adds context to a transient error; a rejection keeps its reason.
    pub fn context(self, what: impl fmt::Display + Send + Sync + 'static) -> Self {
        match self {
            ProjectionError::Transient(e) => ProjectionError::Transient(e.context(what)),
            rejected => rejected,
        }
    }
}

impl fmt::Display for ProjectionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProjectionError::Rejected { reason } => write!(f, "rejected: {reason}"),
            ProjectionError::Transient(e) => write!(f, "{e:#}"),
        }
    }
}

impl std::error::Error for ProjectionError {}

impl From<anyhow::Error> for ProjectionError {
    fn from(e: anyhow::Error) -> Self {
        ProjectionError::Transient(e)
    }
}

impl From<sqlx::Error> for ProjectionError {
    fn from(e: sqlx::Error) -> Self {
        ProjectionError::database(e, "a projection statement")
    }
}

/// Writes application rows for delivered records.
///
/// `apply` receives one record; `apply_batch` receives every delivery of a step in order,
/// and may be overridden to write them with fewer statements. Both run inside the step's
/// transaction (`conn`), which also commits the ordering state: return an error and
/// nothing of the step is kept. A rejection from a batch cannot say which record is at
/// fault: the task retries the records one at a time (each in its own `apply_batch` call)
/// and refuses at the one rejected alone.
///
/// A projection must not commit, roll back or end the transaction it is handed, and what it
/// writes must depend only on the records (a step can be retried after a failure, and a
/// restart redelivers what was not committed). Its tables are its own: create them with the
/// model's `migrations` folder. Register it by name with
/// [`ProjectorBuilder::projection`](crate::ProjectorBuilder::projection); a model names it
/// in its `projection` key.
///
/// ```
/// use parsley_projector::{Delivered, Projection, ProjectionError, StepContext};
/// use sqlx::PgConnection;
///
/// /// The last status of each order, in `app.order_status` (model, id, status).
/// struct OrderStatus;
///
/// #[derive(serde::Deserialize)]
/// struct Order {
///     status: String,
/// }
///
/// impl Projection for OrderStatus {
///     async fn apply(
///         &self,
///         conn: &mut PgConnection,
///         step: StepContext<'_>,
///         record: &Delivered<'_>,
///     ) -> Result<(), ProjectionError> {
///         let Some(id) = record.key_str()? else {
///             return Err(ProjectionError::rejected(format!("{} has no key", record.coordinate())));
///         };
///         match record.value_json::<Order>()? {
///             Some(order) => sqlx::query(
///                 "INSERT INTO app.order_status (model, id, status) VALUES ($1, $2, $3) \
///                  ON CONFLICT (model, id) DO UPDATE SET status = EXCLUDED.status",
///             )
///             .bind(step.model)
///             .bind(id)
///             .bind(order.status)
///             .execute(conn)
///             .await
///             .map_err(|e| ProjectionError::database(e, "writing the order's status"))?,
///             // A tombstone: the order is gone.
///             None => sqlx::query("DELETE FROM app.order_status WHERE model = $1 AND id = $2")
///                 .bind(step.model)
///                 .bind(id)
///                 .execute(conn)
///                 .await?,
///         };
///         Ok(())
///     }
/// }
/// ```
pub trait Projection: Send + Sync + 'static {
    fn apply(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        record: &Delivered<'_>,
    ) -> impl Future<Output = Result<(), ProjectionError>> + Send;

    fn apply_batch(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        records: &[Delivered<'_>],
    ) -> impl Future<Output = Result<(), ProjectionError>> + Send {
        async move {
            for record in records {
                self.apply(conn, step, record)
                    .await
                    .map_err(|e| e.context(format!("projecting {}", record.coordinate())))?;
            }
            Ok(())
        }
    }
}

/// A boxed future of a [`DynProjection`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The object-safe form of [`Projection`], implemented for every `Projection`: what the
/// projector keeps of a projection built from a registry ([`SharedProjection`]), one type
/// for whichever projection each model names. Implement [`Projection`], not this.
pub trait DynProjection: Send + Sync + 'static {
    /// [`Projection::apply_batch`], boxed.
    fn apply_batch_boxed<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        step: StepContext<'a>,
        records: &'a [Delivered<'a>],
    ) -> BoxFuture<'a, Result<(), ProjectionError>>;
}

impl<P: Projection> DynProjection for P {
    fn apply_batch_boxed<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        step: StepContext<'a>,
        records: &'a [Delivered<'a>],
    ) -> BoxFuture<'a, Result<(), ProjectionError>> {
        Box::pin(self.apply_batch(conn, step, records))
    }
}

/// A projection of any type, shared by a model's task runners: what a
/// [`crate::Projector`]'s registry builds for each model. It is itself a [`Projection`], so
/// a [`crate::ModelProjector`] runs it like any other.
pub type SharedProjection = Arc<dyn DynProjection>;

impl Projection for SharedProjection {
    async fn apply(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        record: &Delivered<'_>,
    ) -> Result<(), ProjectionError> {
        self.as_ref().apply_batch_boxed(conn, step, std::slice::from_ref(record)).await
    }

    async fn apply_batch(
        &self,
        conn: &mut PgConnection,
        step: StepContext<'_>,
        records: &[Delivered<'_>],
    ) -> Result<(), ProjectionError> {
        self.as_ref().apply_batch_boxed(conn, step, records).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_classified_by_class() {
        let cases = [
            ("22P05", true),  // unsupported Unicode escape sequence (\u0000 in jsonb)
            ("22021", true),  // invalid byte sequence for encoding (a NUL in text)
            ("22P02", true),  // invalid text representation
            ("22001", true),  // string data right truncation
            ("22012", true),  // division by zero
            ("23505", true),  // unique violation
            ("23514", true),  // check violation
            ("23502", true),  // not-null violation
            ("23503", true),  // foreign key violation
            ("54000", true),  // program limit exceeded: index row size
            ("54001", true),  // statement too complex (stack depth)
            ("40001", false), // serialization failure
            ("40P01", false), // deadlock detected
            ("55P03", false), // lock not available (lock_timeout)
            ("57P01", false), // admin shutdown
            ("57014", false), // query canceled (statement_timeout)
            ("08006", false), // connection failure
            ("53200", false), // out of memory
            ("53300", false), // too many connections
            ("42P01", false), // undefined table: a projection bug, not the record
            ("42601", false), // syntax error
            ("21000", false), // cardinality violation: a batch touching a row twice
            ("XX000", false), // internal error
            ("P0001", true),  // raise_exception: a trigger's or function's RAISE EXCEPTION
            ("P0004", true),  // assert_failure
            ("P0002", true),  // no_data_found (SELECT ... INTO STRICT)
            ("57P04", false), // database dropped
            ("57P05", false), // idle session timeout
            ("25P03", false), // idle in transaction session timeout
            ("2", false),
            ("", false),
        ];
        for (code, rejected) in cases {
            assert_eq!(rejects_record(code), rejected, "SQLSTATE {code:?}");
        }
    }

    #[test]
    fn quoted_values_are_withheld_from_database_messages() {
        let cases = [
            (
                "invalid input syntax for type integer: \"secret\"",
                "invalid input syntax for type integer: (value withheld)",
            ),
            (
                "invalid input syntax for type json: \"a: \"b\"\"",
                "invalid input syntax for type json: (value withheld)",
            ),
            ("invalid byte sequence for encoding \"UTF8\": 0x00", "invalid byte sequence for encoding \"UTF8\": 0x00"),
            (
                "duplicate key value violates unique constraint \"documents_pkey\"",
                "duplicate key value violates unique constraint \"documents_pkey\"",
            ),
            (
                "index row size 8016 exceeds btree version 4 maximum 2704 for index \"documents_pkey\"",
                "index row size 8016 exceeds btree version 4 maximum 2704 for index \"documents_pkey\"",
            ),
            ("unsupported Unicode escape sequence", "unsupported Unicode escape sequence"),
        ];
        for (message, shown) in cases {
            assert_eq!(withhold_value(message), shown);
        }
    }

    #[test]
    fn errors_without_a_sqlstate_are_transient() {
        for e in [sqlx::Error::PoolTimedOut, sqlx::Error::WorkerCrashed, sqlx::Error::RowNotFound] {
            let classified = ProjectionError::database(e, "writing");
            assert!(matches!(classified, ProjectionError::Transient(_)), "{classified}");
        }
        let io = sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset"));
        assert!(!ProjectionError::from(io).is_rejected());
        assert!(!ProjectionError::from(anyhow::anyhow!("boom")).is_rejected());
    }

    #[test]
    fn a_value_that_cannot_be_encoded_is_a_rejection() {
        let e =
            ProjectionError::database(sqlx::Error::Encode("timestamp out of range".into()), "statements[0] on t/0@1");
        assert!(e.is_rejected(), "{e}");
        assert_eq!(
            e.to_string(),
            "rejected: statements[0] on t/0@1: a value could not be encoded for the database: timestamp out of range"
        );
        let quoted = ProjectionError::database(sqlx::Error::Encode("not a number: \"secret\"".into()), "writing");
        assert!(!quoted.to_string().contains("secret"), "{quoted}");
        // Decoding what the database answered is not the record's fault.
        assert!(!ProjectionError::database(sqlx::Error::Decode("bad".into()), "writing").is_rejected());
    }

    #[test]
    fn context_is_added_to_transient_errors_only() {
        let t = ProjectionError::from(anyhow::anyhow!("boom")).context("projecting t/0@1");
        assert_eq!(t.to_string(), "projecting t/0@1: boom");
        let r = ProjectionError::rejected("the value of t/0@1 is not JSON").context("projecting t/0@1");
        assert_eq!(r.to_string(), "rejected: the value of t/0@1 is not JSON");
    }
}
