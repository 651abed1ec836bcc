//! Parsley core: causal delivery for Kafka records, with no I/O.
pub mod murmur2;
