//! The HTTP gateway: sealed session tokens, stamped writes and gated reads.
//!
//! # Layout
//! - [`token`]: the session token — envelope, sealing with XChaCha20-Poly1305, key ring,
//!   validation (expiry, subject, size limits, strict causes decoding).

pub mod token;
