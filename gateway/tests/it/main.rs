//! Integration tests of the gateway against the real broker and database started by
//! `make services-up`, with the real projector applying records. They read
//! `PARSLEY_KAFKA_BOOTSTRAP` and `DATABASE_URL` and fail with a message saying how to start
//! the services when either is unset. Every test uses its own topics and model.

mod api;
mod auth;
mod bounded_queries;
mod connections;
mod contracts;
mod edge;
mod failover;
mod fleet;
mod hostile;
mod joined;
mod numbers;
mod ops;
mod outcomes;
mod probes;
mod producers;
mod queries;
mod retention;
mod roles;
mod secured;
mod sessions;
mod support;
mod telemetry;
mod tokens;
