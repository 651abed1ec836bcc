//! The HTTP gateway: sealed session tokens, stamped writes and gated reads.
//!
//! A client carries its causal past in a sealed token (`Parsley-Session`). Writes stamp the
//! token's pairs on the record as `parsley.causes` and merge the acknowledged coordinate;
//! reads are served only from a snapshot whose clock covers the token (the core's
//! [`parsley::gate`]), waiting a bounded time otherwise, and return the refreshed token.
//!
//! # Layout
//! - [`token`]: the session token — envelope, sealing with XChaCha20-Poly1305, key ring
//!   (one key seals, every key opens), validation (expiry, maximum age, clock-skew leeway,
//!   subject, size limits, strict causes decoding).
//! - [`keys`]: the key ring in use, re-read from its file on `SIGHUP` and when it changes.
//! - [`identity`]: who is calling — the bearer JWT checked with the identity provider's keys
//!   ([`jwks`]: a JWKS URL, a JWKS or PEM file, an HS256 secret), its subject, scopes, claims.
//! - [`access`]: the authorization rules (`[[gateway.rules]]`): who may write which keys of
//!   which topic, read and list which documents, run which named query with which parameters.
//! - [`settings`]: the `[gateway]` table of the shared file, environment overrides, token keys.
//! - [`session`]: opening a request's token, its hygiene against the log (ahead-of-log
//!   refusal, pruning), re-sealing.
//! - [`facts_cache`]: cached Kafka facts — topic names ↔ IDs, partition counts, log start/end.
//! - [`body`]: the write body, parsed and checked as hostile input (the value kept as sent).
//! - [`contracts`]: each topic's data contract (its JSON Schema) held to every value written
//!   to it before producing (`400 value-invalid`).
//! - [`write`]: `POST /v1/topics/{topic}/records`, with `Idempotency-Key` replays.
//! - [`batch`]: `POST /v1/records`, several records in one Kafka transaction.
//! - [`trace`]: W3C `traceparent` continued from a request onto the records it writes.
//! - [`cors`]: cross-origin requests from browser apps (`gateway.cors_allowed_origins`).
//! - [`widths`]: the width each model was recorded with, for refusing writes after a
//!   topic's partition count changed.
//! - [`gated`]: the gate, the wait, the `503` and the refreshed token, for any data: the
//!   documents, the named queries, and an embedding program's own routes ([`gated::Gate`]).
//! - [`read`]: the gated reads, `GET /v1/models/{model}/documents[/{key}]`.
//! - [`queries`]: the named queries, `GET /v1/models/{model}/queries/{name}`.
//! - [`notify`]: the `LISTEN` task waking waiting reads, and the generations of a model's
//!   tasks that kept snapshots are served under.
//! - `shapes`: per model, the row and shape the gated reads last found recorded.
//! - [`read_cache`]: covered document snapshots (keys and pages) kept in memory, served while nothing changed.
//! - [`feed`]: one clock fetch per model per wake-up, shared by every waiting read.
//! - [`ops`]: `/livez` (and `/healthz`), `/readyz`, `/metrics`, `/v1/status` (from SQL aggregates).
//! - [`health`]: the dependencies' states the background checks cache for `/readyz`, and
//!   draining at shutdown.
//! - [`openapi`]: the API's OpenAPI 3.1 document, `GET /openapi.json` (`gateway/openapi.json`).
//! - [`problem`]: the one error type and its problem documents.
//! - [`store_errors`]: the store's failed calls answered (outage `503`, the client's rejected value `400`, a bug `500`).
//! - [`metrics`]: the Prometheus registry.
//! - [`state`]: [`AppState`], what every handler shares, and its lookups.
//! - [`mod@app`]: the routers ([`app()`], [`admin_app()`]), the middleware and the [`Gateway`]
//!   process.
//! - [`server`]: the HTTP/1 server with a header-read timeout, a header size limit and a cap
//!   on open connections.
//! - [`receive`]: a request's body received within `gateway.body_timeout_ms`, before it takes
//!   an in-flight permit.
//!
//! See `docs/gateway.md` for the routes, the token format, the gate and the problem types.

// The embedding surface (docs/gateway.md, "Embedding the gateway"): these modules and the
// re-exports below. The hidden modules are public for the workspace (the binary, the tests,
// the benchmarks, parsley-check) and may change in any release.
pub mod access;
pub mod app;
#[doc(hidden)]
pub mod batch;
#[doc(hidden)]
pub mod body;
#[doc(hidden)]
pub mod contracts;
#[doc(hidden)]
pub mod cors;
#[doc(hidden)]
pub mod facts_cache;
#[doc(hidden)]
pub mod feed;
pub mod gated;
pub mod health;
pub mod identity;
#[doc(hidden)]
pub mod jwks;
#[doc(hidden)]
pub mod keys;
#[doc(hidden)]
pub mod metrics;
#[doc(hidden)]
pub mod notify;
#[doc(hidden)]
pub mod openapi;
#[doc(hidden)]
pub mod ops;
pub mod problem;
#[doc(hidden)]
pub mod queries;
#[doc(hidden)]
pub mod read;
pub mod read_cache;
#[doc(hidden)]
pub mod receive;
#[doc(hidden)]
pub mod server;
#[doc(hidden)]
pub mod session;
pub mod settings;
#[doc(hidden)]
pub mod shapes;
pub mod state;
#[doc(hidden)]
pub mod store_errors;
pub mod token;
#[doc(hidden)]
pub mod trace;
#[doc(hidden)]
pub mod transactions;
#[doc(hidden)]
pub mod widths;
#[doc(hidden)]
pub mod write;

pub use app::{admin_app, app, routes, Gateway, Listeners};
pub use problem::{ApiError, Problem};
pub use session::SESSION_HEADER;
pub use settings::{GatewayConfig, Settings};
pub use state::AppState;
