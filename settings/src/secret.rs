//! [`Secret`]: a value that is never printed. `Debug` and `Display` show `***`; the value
//! itself is reached only through [`Secret::expose`], at the one place that needs it (for
//! the database URL: opening the pool; messages that name the server use
//! `parsley_infra::pg::redact`).

use std::fmt;

use serde::{Deserialize, Deserializer};

/// A value that `Debug` and `Display` print as `***`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret<T>(T);

impl<T> Secret<T> {
    pub fn new(value: T) -> Secret<T> {
        Secret(value)
    }

    /// The value itself: for the code that uses it, never for messages.
    pub fn expose(&self) -> &T {
        &self.0
    }

    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> From<T> for Secret<T> {
    fn from(value: T) -> Secret<T> {
        Secret(value)
    }
}

impl From<&str> for Secret<String> {
    fn from(value: &str) -> Secret<String> {
        Secret(value.to_string())
    }
}

impl<T> fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl<T> fmt::Display for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Secret<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Secret<T>, D::Error> {
        T::deserialize(deserializer).map(Secret)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_never_printed() {
        let s: Secret<String> = "postgres://user:hunter2@db/x".into();
        assert_eq!(format!("{s:?} {s} {:?}", Some(&s)), "*** *** Some(***)");
        assert_eq!(s.expose(), "postgres://user:hunter2@db/x");
        let parsed: Secret<String> =
            toml::from_str::<toml::Table>("v = \"p\"").unwrap()["v"].clone().try_into().unwrap();
        assert_eq!(parsed.into_inner(), "p");
    }
}
