//! Integration tests of the projector against the real broker and database started by
//! `make services-up`. They read `PARSLEY_KAFKA_BOOTSTRAP` and `DATABASE_URL` and fail with
//! a message saying how to start the services when either is unset. Every test uses its own
//! topics and model, so tests run in parallel and re-run.

mod causal;
mod clock;
mod conformance;
mod create_topics;
mod fencing;
mod fold;
mod leases;
mod library;
mod log_start;
mod probes;
mod prune;
mod refusals;
mod rejections;
mod restart;
mod robustness;
mod snapshot;
mod sql;
mod store;
mod support;
