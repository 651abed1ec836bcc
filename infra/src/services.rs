//! Where the local services are, read from the environment.
//!
//! `make services-up` starts Kafka on 127.0.0.1:9092 and Postgres on 127.0.0.1:5432;
//! `make test` exports both variables below before running the test suite.

/// Environment variable naming the Kafka bootstrap servers (`host:port[,host:port…]`).
pub const KAFKA_BOOTSTRAP_ENV: &str = "PARSLEY_KAFKA_BOOTSTRAP";
/// Environment variable holding the Postgres connection URL.
pub const DATABASE_URL_ENV: &str = "DATABASE_URL";

/// The value the local stack uses for [`KAFKA_BOOTSTRAP_ENV`].
pub const LOCAL_KAFKA_BOOTSTRAP: &str = "127.0.0.1:9092";
/// The value the local stack uses for [`DATABASE_URL_ENV`].
pub const LOCAL_DATABASE_URL: &str = "postgres://parsley:parsley@127.0.0.1:5432/parsley";

/// The Kafka bootstrap servers from [`KAFKA_BOOTSTRAP_ENV`]; an error that says how to get
/// them when unset or empty.
pub fn kafka_bootstrap() -> anyhow::Result<String> {
    required(KAFKA_BOOTSTRAP_ENV, LOCAL_KAFKA_BOOTSTRAP)
}

/// The Postgres URL from [`DATABASE_URL_ENV`]; an error that says how to get it when unset
/// or empty.
pub fn database_url() -> anyhow::Result<String> {
    required(DATABASE_URL_ENV, LOCAL_DATABASE_URL)
}

fn required(name: &str, local: &str) -> anyhow::Result<String> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => Ok(v),
        _ => anyhow::bail!(
            "{name} is not set: run `make services-up` and export {name}={local} \
             (`make test` does both)"
        ),
    }
}
