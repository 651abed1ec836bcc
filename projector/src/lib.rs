//! The Parsley engine hosted on Postgres (see docs/projector.md once it lands).
