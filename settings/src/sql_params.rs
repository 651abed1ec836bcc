//! Named parameters in configured SQL: `:name` turned into Postgres' `$1..$n`.
//!
//! The statements of a `sql` projection and the gateway's named queries are written in
//! configuration with named parameters (`WHERE id = :key`). One function, [`rewrite`], turns
//! them into positional ones, and both the projector and the gateway use it, so a statement
//! means the same thing wherever it runs.
//!
//! A parameter is `:` followed by a letter or `_`, then letters, digits and `_` (ASCII). The
//! scan knows enough of Postgres' lexical structure to leave alone what only looks like one:
//! `::` casts, `'...'` string literals (`''` inside), `E'...'` strings (backslash escapes),
//! `"..."` quoted identifiers (`""` inside), `$tag$...$tag$` dollar quotes, `--` line
//! comments and `/* ... */` block comments (which nest, as in Postgres). A name used twice is
//! one parameter (`$n` once). Positional parameters (`$1`) written by hand are refused, as
//! are literals, identifiers and comments left open: the statement would not mean what it
//! seems to.
//!
//! What the scan cannot tell is an array slice with a named bound: `a[lo:hi]` reads `:hi`
//! as a parameter (the callers refuse parameters they do not know, naming it); write
//! `a[lo: hi]`.

use std::fmt;

/// A statement with its named parameters replaced by `$1..$n`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rewritten {
    /// The statement as Postgres takes it.
    pub sql: String,
    /// The parameters' names in `$n` order: `names[0]` is `$1`. Each name once.
    pub names: Vec<String>,
}

impl Rewritten {
    /// The `$n` of `name`, if the statement uses it.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| n == name).map(|i| i + 1)
    }
}

/// Why a statement's parameters cannot be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParamError {
    /// `what` (a string literal, a quoted identifier, a dollar quote, a comment) opened at
    /// byte `at` never closes.
    Unterminated { what: &'static str, at: usize },
    /// A positional parameter (`$1`) at byte `at`: parameters are named (`:name`).
    Positional { at: usize },
}

impl fmt::Display for ParamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamError::Unterminated { what, at } => write!(f, "{what} opened at byte {at} is never closed"),
            ParamError::Positional { at } => {
                write!(f, "positional parameter at byte {at}: parameters are named (:name), not numbered ($1)")
            }
        }
    }
}

impl std::error::Error for ParamError {}

fn name_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_'
}

fn name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Whether the byte before `at` continues an identifier or a number (then a quote or `$`
/// at `at` belongs to it, as in `a$b`).
fn after_word(bytes: &[u8], at: usize) -> bool {
    at > 0 && (name_byte(bytes[at - 1]) || bytes[at - 1] == b'$' || bytes[at - 1] >= 0x80)
}

/// Replaces each `:name` of `sql` by its `$n` (see the module documentation).
pub fn rewrite(sql: &str) -> Result<Rewritten, ParamError> {
    let bytes = sql.as_bytes();
    let mut out = String::with_capacity(sql.len());
    let mut names: Vec<String> = Vec::new();
    // Everything before `copied` is in `out`.
    let mut copied = 0;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\'' => {
                let escapes = i > 0 && matches!(bytes[i - 1], b'E' | b'e') && !after_word(bytes, i - 1);
                i = skip_quoted(bytes, i, b'\'', escapes)
                    .ok_or(ParamError::Unterminated { what: "a string literal", at: i })?;
            }
            b'"' => {
                i = skip_quoted(bytes, i, b'"', false)
                    .ok_or(ParamError::Unterminated { what: "a quoted identifier", at: i })?;
            }
            b'-' if bytes.get(i + 1) == Some(&b'-') => {
                i = bytes[i..].iter().position(|&b| b == b'\n').map_or(bytes.len(), |n| i + n + 1);
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                i = skip_block_comment(bytes, i).ok_or(ParamError::Unterminated { what: "a block comment", at: i })?;
            }
            b'$' if !after_word(bytes, i) => {
                if bytes.get(i + 1).is_some_and(u8::is_ascii_digit) {
                    return Err(ParamError::Positional { at: i });
                }
                match dollar_tag(bytes, i) {
                    Some(tag_end) => {
                        let tag = &sql[i..tag_end];
                        i = sql[tag_end..]
                            .find(tag)
                            .map(|n| tag_end + n + tag.len())
                            .ok_or(ParamError::Unterminated { what: "a dollar quote", at: i })?;
                    }
                    None => i += 1,
                }
            }
            b':' if bytes.get(i + 1) == Some(&b':') => i += 2,
            b':' if bytes.get(i + 1).copied().is_some_and(name_start) => {
                let start = i + 1;
                let end = start + bytes[start..].iter().take_while(|&&b| name_byte(b)).count();
                let name = &sql[start..end];
                let n = match names.iter().position(|known| known == name) {
                    Some(k) => k + 1,
                    None => {
                        names.push(name.to_string());
                        names.len()
                    }
                };
                out.push_str(&sql[copied..i]);
                out.push('$');
                out.push_str(&n.to_string());
                copied = end;
                i = end;
            }
            _ => i += 1,
        }
    }
    out.push_str(&sql[copied..]);
    Ok(Rewritten { sql: out, names })
}

/// The index after the literal opened by `quote` at `start` (a doubled quote stays inside;
/// with `escapes`, so does a backslash-escaped character); `None` when it never closes.
fn skip_quoted(bytes: &[u8], start: usize, quote: u8, escapes: bool) -> Option<usize> {
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if escapes => i += 2,
            b if b == quote => {
                if bytes.get(i + 1) == Some(&quote) {
                    i += 2;
                } else {
                    return Some(i + 1);
                }
            }
            _ => i += 1,
        }
    }
    None
}

/// The index after the block comment opened at `start` (comments nest); `None` when it
/// never closes.
fn skip_block_comment(bytes: &[u8], start: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut i = start;
    while i + 1 < bytes.len() {
        match (bytes[i], bytes[i + 1]) {
            (b'/', b'*') => {
                depth += 1;
                i += 2;
            }
            (b'*', b'/') => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => i += 1,
        }
    }
    None
}

/// The index after the opening tag of a dollar quote at `start` (`$$` or `$tag$`, the tag
/// an identifier without `$`); `None` when `$` does not open one.
fn dollar_tag(bytes: &[u8], start: usize) -> Option<usize> {
    let mut i = start + 1;
    if bytes.get(i).is_some_and(|&b| name_start(b) || b >= 0x80) {
        while bytes.get(i).is_some_and(|&b| name_byte(b) || b >= 0x80) {
            i += 1;
        }
    }
    (bytes.get(i) == Some(&b'$')).then_some(i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(sql: &str) -> (String, Vec<String>) {
        let r = rewrite(sql).unwrap_or_else(|e| panic!("{sql:?}: {e}"));
        (r.sql, r.names)
    }

    #[test]
    fn names_become_positions_in_order_of_first_use() {
        let (sql, names) = ok("INSERT INTO t (id, v, k) VALUES (:key, :value->>'a', :key_bytes) -- :x\n");
        assert_eq!(sql, "INSERT INTO t (id, v, k) VALUES ($1, $2->>'a', $3) -- :x\n");
        assert_eq!(names, ["key", "value", "key_bytes"]);
        let (sql, names) = ok("SELECT :b, :a, :b, :_c1");
        assert_eq!(sql, "SELECT $1, $2, $1, $3");
        assert_eq!(names, ["b", "a", "_c1"]);
        let r = rewrite("SELECT :b, :a").unwrap();
        assert_eq!((r.position("a"), r.position("b"), r.position("c")), (Some(2), Some(1), None));
    }

    #[test]
    fn casts_are_not_parameters() {
        let (sql, names) = ok("SELECT (:value->>'amount')::numeric, :key::text, x::int, :t::timestamptz");
        assert_eq!(sql, "SELECT ($1->>'amount')::numeric, $2::text, x::int, $3::timestamptz");
        assert_eq!(names, ["value", "key", "t"]);
    }

    #[test]
    fn literals_identifiers_and_comments_are_left_alone() {
        let cases = [
            "SELECT ':a'",
            "SELECT 'it''s :a'",
            "SELECT E'\\' :a'",
            "SELECT e'\\\\' || ':a'",
            "SELECT \":a\"",
            "SELECT \"a\"\":b\"",
            "SELECT $$ :a $$",
            "SELECT $fn$ :a $ :b $$ $fn$",
            "SELECT 1 -- :a",
            "SELECT /* :a /* :b */ :c */ 1",
            "SELECT U&':a'",
            "SELECT a[1:2]",
            "SELECT a$b, ' :'",
        ];
        for sql in cases {
            let (out, names) = ok(sql);
            assert_eq!(out, sql, "{sql:?} was changed");
            assert!(names.is_empty(), "{sql:?}: {names:?}");
        }
        // What follows a closed literal is scanned again.
        assert_eq!(ok("SELECT 'x', :a, E'y\\'', :b, \"q\", $$z$$, :c -- :d\n/* :e */ :f").1, ["a", "b", "c", "f"]);
    }

    #[test]
    fn an_identifier_ending_in_e_does_not_open_an_escape_string() {
        // `some'...'` is not E'...': the backslash stays an ordinary character.
        let (_, names) = ok("SELECT some'\\' , :a");
        assert_eq!(names, ["a"]);
    }

    #[test]
    fn open_literals_and_positional_parameters_are_refused() {
        let cases = [
            ("SELECT 'a", ParamError::Unterminated { what: "a string literal", at: 7 }),
            ("SELECT \"a", ParamError::Unterminated { what: "a quoted identifier", at: 7 }),
            ("SELECT $q$ a $$", ParamError::Unterminated { what: "a dollar quote", at: 7 }),
            ("SELECT /* /* */", ParamError::Unterminated { what: "a block comment", at: 7 }),
            ("SELECT E'\\'", ParamError::Unterminated { what: "a string literal", at: 8 }),
            ("SELECT $1", ParamError::Positional { at: 7 }),
        ];
        for (sql, error) in cases {
            assert_eq!(rewrite(sql), Err(error.clone()), "{sql:?}");
        }
        assert!(ParamError::Positional { at: 7 }.to_string().contains(":name"));
    }

    #[test]
    fn text_without_parameters_is_unchanged() {
        for sql in ["", "SELECT 1", "DELETE FROM t WHERE id = 'k'", "SELECT ':'", "SELECT 1:", "SELECT a[lo: hi]"] {
            assert_eq!(ok(sql), (sql.to_string(), Vec::new()));
        }
        assert_eq!(ok("SELECT é, :é").1, Vec::<String>::new(), "a name is ASCII");
        assert_eq!(ok("SELECT a :b").0, "SELECT a $1");
    }
}
