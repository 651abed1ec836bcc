//! Kafka and Postgres plumbing shared by the projector and the gateway.
//!
//! - [`services`]: where the services are (`PARSLEY_KAFKA_BOOTSTRAP`, `DATABASE_URL`).
//! - [`http`]: a minimal HTTP/1.1 client for the binaries that call the gateway (the demo,
//!   the checker).
//! - [`kafka`]: client configurations with the project's fixed settings (Java-compatible
//!   murmur2 partitioning, idempotent producers, read-committed consumers without auto
//!   commit) and partition offsets (log start, last stable offset, high watermark).
//! - [`topic_id`]: topic IDs and partition counts through librdkafka's DescribeTopics — one
//!   of the two modules allowed to use `unsafe`.
//! - [`facts`]: the broker-facts policy, once — a topic is gone only when a complete listing
//!   lacks it (or the broker reports a named topic unknown); a failed or partial describe
//!   is unknown — and the listing and describe calls it is applied to.
//! - [`headers`]: record headers read as bytes (names need not be UTF-8) through librdkafka
//!   — the other module allowed to use `unsafe`.
//! - [`pg`]: the Postgres pool, every session bounded (lock, statement and idle-in-transaction
//!   timeouts, server keepalives).
//! - [`metrics`]: the Prometheus registry both services export (each declares its metric
//!   names once, as an enum, with [`metric_names!`]), rendered in the text exposition
//!   format, and the bare `GET /metrics` listener.
//! - [`telemetry`]: the binaries' logs (text or JSON lines carrying trace ids) and the
//!   optional OpenTelemetry export of spans and metrics (OTLP over gRPC or HTTP).
//! - [`backoff`]: the one retry backoff (exponential, capped, with jitter).
//! - [`process`]: the binaries' start-up scaffolding (runtime, shutdown signal).
//! - [`cli`]: the binaries' one argument parser (clap's builder), the shared `--config`
//!   option, and how help and usage errors end the process.
//! - (feature `test-support`, tests only) `headers::produce`: records with raw header names,
//!   for the integration tests (through `parsley-testkit`).

pub mod backoff;
pub mod cli;
pub mod facts;
pub mod headers;
pub mod http;
pub mod kafka;
pub mod metrics;
pub mod pg;
pub mod process;
pub mod services;
pub mod telemetry;
pub mod topic_id;

pub use kafka::PartitionOffsets;
pub use topic_id::{describe_topics, describe_topics_blocking, TopicDescription};
