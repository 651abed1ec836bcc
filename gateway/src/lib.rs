//! The HTTP gateway: session tokens, stamped writes and gated reads (not built yet).
