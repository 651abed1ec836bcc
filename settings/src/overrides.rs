//! One rule for environment overrides, for every key of the configuration file.
//!
//! `PARSLEY_<SECTION>__<KEY>` sets `<section>.<key>`: the name after `PARSLEY_` is split at
//! every double underscore, each part lower-cased, and a part that is a number indexes an
//! array of tables (`PARSLEY_MODELS__0__MAX_STEP_MS` sets `models[0].max_step_ms`; the entry
//! must exist in the file). The value is text, read as the key's type: a number, `true` or
//! `false`, an enum's name, a comma-separated list; an empty value unsets a key that may be
//! absent and is the empty string for a text key. The overrides are applied to the file's
//! TOML tree before it is deserialized, so an unknown key is refused by name exactly like one
//! in the file, and the error names the variable too. Variables without a double underscore
//! (`PARSLEY_CONFIG`, `PARSLEY_TOKEN_KEYS`, ...) are not keys and are left alone.
//!
//! The tables whose keys are librdkafka property names ([`PROPERTY_TABLES`]: `[kafka.properties]`
//! and its kin) cannot have their dots spelt in a variable's name: in the part after such a
//! table, each `_` stands for a `.` (`PARSLEY_KAFKA__PROPERTIES__SASL_MECHANISM` sets
//! `kafka.properties."sasl.mechanism"`). librdkafka's property names are dotted; the only
//! settable ones with an underscore ([`UNDERSCORED_PROPERTIES`]) are kept as they are.
//!
//! The names used before this rule are kept as [`ALIASES`] of one key each, with their
//! historical handling of blank values; the `PARSLEY_<SECTION>__<KEY>` form wins over an
//! alias of the same key. `docs/configuration.md` lists both.

use std::collections::BTreeMap;
use std::fmt;

use anyhow::bail;
use serde::de::{self, DeserializeOwned, DeserializeSeed, IntoDeserializer as _, MapAccess, SeqAccess, Visitor};
use serde::forward_to_deserialize_any;

/// Every override's name starts with this.
pub const PREFIX: &str = "PARSLEY_";
/// What separates the parts of a key in a variable's name.
pub const SEPARATOR: &str = "__";

/// Alias of `kafka.bootstrap`.
pub const ENV_KAFKA_BOOTSTRAP: &str = "PARSLEY_KAFKA_BOOTSTRAP";
/// Alias of `database.url_file`: a file holding the database URL.
pub const ENV_DATABASE_URL_FILE: &str = "PARSLEY_DATABASE_URL_FILE";
/// Alias of `database.url` (preferred over [`ENV_DATABASE_URL_FALLBACK`]).
pub const ENV_DATABASE_URL: &str = "PARSLEY_DATABASE_URL";
/// The conventional `DATABASE_URL`, an alias of `database.url` used when [`ENV_DATABASE_URL`]
/// is unset.
pub const ENV_DATABASE_URL_FALLBACK: &str = "DATABASE_URL";
/// Alias of `projector.metrics_address`.
pub const ENV_METRICS_ADDRESS: &str = "PARSLEY_METRICS_ADDRESS";
/// Alias of `projector.owner`.
pub const ENV_OWNER: &str = "PARSLEY_OWNER";
/// Alias of `gateway.listen`.
pub const ENV_GATEWAY_LISTEN: &str = "PARSLEY_GATEWAY_LISTEN";
/// Alias of `gateway.read_wait_ms`.
pub const ENV_GATEWAY_READ_WAIT_MS: &str = "PARSLEY_GATEWAY_READ_WAIT_MS";
/// Alias of `gateway.retry_after_s`.
pub const ENV_GATEWAY_RETRY_AFTER_S: &str = "PARSLEY_GATEWAY_RETRY_AFTER_S";
/// Alias of `gateway.token_ttl_s`.
pub const ENV_GATEWAY_TOKEN_TTL_S: &str = "PARSLEY_GATEWAY_TOKEN_TTL_S";
/// Alias of `gateway.subject_header` (empty: no subject binding).
pub const ENV_GATEWAY_SUBJECT_HEADER: &str = "PARSLEY_GATEWAY_SUBJECT_HEADER";
/// Alias of `gateway.admin_listen` (empty: no admin listener).
pub const ENV_GATEWAY_ADMIN_LISTEN: &str = "PARSLEY_GATEWAY_ADMIN_LISTEN";
/// Alias of `gateway.token_keys_file`.
pub const ENV_TOKEN_KEYS_FILE: &str = "PARSLEY_TOKEN_KEYS_FILE";

/// What an alias does with a value that is empty (after trimming, when it trims).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blank {
    /// Nothing: the file's value or the default applies.
    Ignored,
    /// What the rule does with an empty value: absent for an optional key, `""` for text.
    Applied,
}

/// A variable name kept from before the rule, setting one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Alias {
    pub var: &'static str,
    /// The key, dotted (`gateway.read_wait_ms`).
    pub key: &'static str,
    /// Whether surrounding whitespace is removed from the value.
    pub trim: bool,
    pub blank: Blank,
}

const fn alias(var: &'static str, key: &'static str, trim: bool, blank: Blank) -> Alias {
    Alias { var, key, trim, blank }
}

/// The aliases, in precedence order (the first set one of a key wins).
pub const ALIASES: &[Alias] = &[
    alias(ENV_KAFKA_BOOTSTRAP, "kafka.bootstrap", false, Blank::Ignored),
    alias(ENV_DATABASE_URL, "database.url", false, Blank::Ignored),
    alias(ENV_DATABASE_URL_FALLBACK, "database.url", false, Blank::Ignored),
    alias(ENV_DATABASE_URL_FILE, "database.url_file", true, Blank::Ignored),
    alias(ENV_METRICS_ADDRESS, "projector.metrics_address", false, Blank::Applied),
    alias(ENV_OWNER, "projector.owner", false, Blank::Ignored),
    alias(ENV_GATEWAY_LISTEN, "gateway.listen", true, Blank::Ignored),
    alias(ENV_GATEWAY_READ_WAIT_MS, "gateway.read_wait_ms", true, Blank::Ignored),
    alias(ENV_GATEWAY_RETRY_AFTER_S, "gateway.retry_after_s", true, Blank::Ignored),
    alias(ENV_GATEWAY_TOKEN_TTL_S, "gateway.token_ttl_s", true, Blank::Ignored),
    alias(ENV_GATEWAY_SUBJECT_HEADER, "gateway.subject_header", true, Blank::Applied),
    alias(ENV_TOKEN_KEYS_FILE, "gateway.token_keys_file", true, Blank::Ignored),
    alias(ENV_GATEWAY_ADMIN_LISTEN, "gateway.admin_listen", true, Blank::Applied),
];

/// The tables whose keys are librdkafka property names: in a variable's part after one of
/// them, `_` stands for `.`.
pub const PROPERTY_TABLES: &[[&str; 2]] =
    &[["kafka", "properties"], ["kafka", "property_files"], ["kafka", "consumer"]];

/// librdkafka's properties settable as text whose names hold an underscore (the others with
/// one are callbacks, set through the API): a variable names them as they are.
pub const UNDERSCORED_PROPERTIES: &[&str] = &["log_level", "enabled_events"];

/// `path` with the part after a [`PROPERTY_TABLES`] table read as a property name.
fn property_names(mut path: Vec<String>) -> Vec<String> {
    if path.len() == 3
        && PROPERTY_TABLES.iter().any(|t| path[..2] == t[..])
        && !UNDERSCORED_PROPERTIES.contains(&path[2].as_str())
    {
        path[2] = path[2].replace('_', ".");
    }
    path
}

/// A snapshot of environment variables (names and values as text). `Debug` prints the names
/// only: values may be secrets.
#[derive(Clone, Default)]
pub struct Env {
    vars: BTreeMap<String, String>,
}

impl Env {
    /// This process's environment (variables whose name or value is not UTF-8 are skipped).
    pub fn process() -> Env {
        Env {
            vars: std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                .collect(),
        }
    }

    /// The variables among `names` that `var` says are set: for a caller that can look a
    /// variable up but not list them (then a misspelt key's variable goes unseen).
    pub fn lookup(names: impl IntoIterator<Item = String>, var: impl Fn(&str) -> Option<String>) -> Env {
        Env { vars: names.into_iter().filter_map(|name| var(&name).map(|value| (name, value))).collect() }
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.vars.get(name).map(String::as_str)
    }
}

/// Every variable that can set a key of the table `section` deserialized as `T` (a struct):
/// `PARSLEY_<SECTION>__<FIELD>` for each of its fields, and the section's aliases.
pub fn section_variables<T: DeserializeOwned>(section: &str) -> Vec<String> {
    let prefix = format!("{PREFIX}{}{SEPARATOR}", section.to_ascii_uppercase());
    let generic = fields_of::<T>().iter().map(|f| format!("{prefix}{}", f.to_ascii_uppercase()));
    let aliases = ALIASES.iter().filter(|a| a.key.split('.').next() == Some(section)).map(|a| a.var.to_string());
    generic.chain(aliases).collect()
}

/// The key names a struct `T` deserializes from: its fields and their serde aliases (empty
/// for anything else).
fn fields_of<T: DeserializeOwned>() -> &'static [&'static str] {
    let mut fields = None;
    let _ = T::deserialize(FieldProbe(&mut fields));
    fields.unwrap_or(&[])
}

/// A deserializer that only notes the fields a struct asks for.
struct FieldProbe<'a>(&'a mut Option<&'static [&'static str]>);

impl<'de> de::Deserializer<'de> for FieldProbe<'_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Error> {
        Err(de::Error::custom("not a struct"))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Error> {
        *self.0 = Some(fields);
        Err(de::Error::custom("fields noted"))
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
        unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for Env {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(pairs: I) -> Env {
        Env { vars: pairs.into_iter().map(|(k, v)| (k.into(), v.into())).collect() }
    }
}

impl fmt::Debug for Env {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.vars.keys()).finish()
    }
}

/// One key set by one variable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Override {
    pub var: String,
    /// The key's parts, lower-case (`["models", "0", "max_step_ms"]`).
    pub path: Vec<String>,
    pub value: String,
}

impl Override {
    /// The key as the configuration's messages name it (`models[0].max_step_ms`).
    pub fn key(&self) -> String {
        key_of(&self.path)
    }
}

/// `a.b[0].c` for `["a", "b", "0", "c"]`.
pub fn key_of(path: &[String]) -> String {
    let mut out = String::new();
    for part in path {
        if is_index(part) {
            out.push_str(&format!("[{part}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(part);
        }
    }
    out
}

fn is_index(part: &str) -> bool {
    !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit())
}

/// The overrides `env` holds for the sections `select` accepts (the first part of the key),
/// by key: the `PARSLEY_<SECTION>__<KEY>` variables, then the [`ALIASES`] of keys none of them
/// set. A variable of the form with an empty part is refused by name.
pub fn overrides(env: &Env, select: impl Fn(&str) -> bool) -> anyhow::Result<Vec<Override>> {
    let mut by_key: BTreeMap<Vec<String>, Override> = BTreeMap::new();
    for (var, value) in &env.vars {
        let Some(rest) = var.strip_prefix(PREFIX) else { continue };
        if !rest.contains(SEPARATOR) {
            continue;
        }
        let path = property_names(rest.split(SEPARATOR).map(str::to_ascii_lowercase).collect());
        if path.iter().any(String::is_empty) {
            bail!("{var} is not a configuration key: the form is {PREFIX}<SECTION>{SEPARATOR}<KEY>, parts not empty");
        }
        if !select(&path[0]) {
            continue;
        }
        let o = Override { var: var.clone(), path, value: value.trim().to_string() };
        if let Some(other) = by_key.get(&o.path) {
            bail!("{} and {} both set {}", other.var, o.var, o.key());
        }
        by_key.insert(o.path.clone(), o);
    }
    for a in ALIASES {
        let path: Vec<String> = a.key.split('.').map(str::to_string).collect();
        if !select(&path[0]) || by_key.contains_key(&path) {
            continue;
        }
        let Some(value) = env.get(a.var) else { continue };
        let value = if a.trim { value.trim() } else { value };
        if a.blank == Blank::Ignored && value.trim().is_empty() {
            continue;
        }
        by_key.insert(path.clone(), Override { var: a.var.to_string(), path, value: value.to_string() });
    }
    Ok(by_key.into_values().collect())
}

/// Sets each override's key in `tree` to its value (as text; [`deserialize`] reads it as the
/// key's type). Tables on the way are created; array entries must exist.
pub fn apply(tree: &mut toml::Table, overrides: &[Override]) -> anyhow::Result<()> {
    let mut root = toml::Value::Table(std::mem::take(tree));
    let applied = overrides.iter().try_for_each(|o| set(&mut root, o));
    let toml::Value::Table(table) = root else { unreachable!("the root stays a table") };
    *tree = table;
    applied
}

fn set(root: &mut toml::Value, o: &Override) -> anyhow::Result<()> {
    let mut here = root;
    for (i, part) in o.path.iter().enumerate() {
        let last = i + 1 == o.path.len();
        let at = key_of(&o.path[..i]);
        here = match here {
            toml::Value::Table(t) if last => {
                t.insert(part.clone(), toml::Value::String(o.value.clone()));
                return Ok(());
            }
            toml::Value::Table(t) => t.entry(part.clone()).or_insert_with(|| toml::Value::Table(toml::Table::new())),
            toml::Value::Array(items) => {
                let len = items.len();
                match part.parse::<usize>().ok().and_then(|n| items.get_mut(n)) {
                    Some(entry) if last => {
                        *entry = toml::Value::String(o.value.clone());
                        return Ok(());
                    }
                    Some(entry) => entry,
                    None => bail!(
                        "{} sets {}, but {at} has {len} entries (an override changes an entry, it does not add one)",
                        o.var,
                        o.key()
                    ),
                }
            }
            _ => bail!("{} sets {}, but {at} is not a table", o.var, o.key()),
        };
    }
    Ok(())
}

/// Deserializes `value`, found at `at` in the file's tree, reading the values the overrides
/// set as the types asked for. The error names the key, and the variable when one set it.
pub fn deserialize<T: DeserializeOwned>(value: toml::Value, at: &[&str], overrides: &[Override]) -> anyhow::Result<T> {
    let path: Vec<String> = at.iter().map(|s| s.to_string()).collect();
    let from_env = overrides.iter().any(|o| o.path == path);
    T::deserialize(ValueDeserializer { value, path: path.clone(), overrides, from_env }).map_err(|mut e| {
        let mut full = path;
        full.append(&mut e.path);
        let key = key_of(&full);
        // An unknown key is the variable's when the variable's key goes through it; any other
        // error when it is at or below the variable's key. An error above a variable's key (a
        // table it made, or an entry it changed) mentions the variable after the message.
        let owner =
            overrides.iter().find(|o| if e.at_key { o.path.starts_with(&full) } else { full.starts_with(&o.path) });
        let below = overrides.iter().find(|o| o.path.starts_with(&full));
        let message = match below {
            Some(o) if owner.is_none() => format!("{} ({} sets {})", e.message, o.var, o.key()),
            _ => e.message,
        };
        match (owner, key.is_empty()) {
            (Some(o), _) => anyhow::anyhow!("{} sets {key}: {message}", o.var),
            (None, false) => anyhow::anyhow!("{key}: {message}"),
            (None, true) => anyhow::anyhow!("{message}"),
        }
    })
}

/// The table `section` of the file (`None`: absent, read as empty) with the overrides `env`
/// holds for it applied, deserialized by the rule above; `Ok(None)` when no variable sets a
/// key of the section, so that the caller reads the table as it is. For a section whose owner
/// parses it (the gateway's `[gateway]`).
pub fn section<T: DeserializeOwned>(
    section: &str,
    table: Option<&toml::Table>,
    env: &Env,
) -> anyhow::Result<Option<T>> {
    let overrides = overrides(env, |s| s == section)?;
    if overrides.is_empty() {
        return Ok(None);
    }
    // A variable must name one of the section's keys (the names serde takes for them): the
    // section's owner may look its variables up by those names only.
    let fields = fields_of::<T>();
    if let Some(o) = overrides.iter().find(|o| !fields.is_empty() && !fields.contains(&o.path[1].as_str())) {
        bail!("{} sets {}, which is not a key of [{section}] (its keys: {})", o.var, o.key(), fields.join(", "));
    }
    let mut tree = toml::Table::new();
    tree.insert(section.to_string(), toml::Value::Table(table.cloned().unwrap_or_default()));
    apply(&mut tree, &overrides)?;
    let value = tree.remove(section).expect("inserted above");
    deserialize(value, &[section], &overrides).map(Some)
}

/// A deserialization error and the key it happened at (relative to where deserialization
/// started).
#[derive(Debug)]
pub struct Error {
    path: Vec<String>,
    message: String,
    /// The error is about a key itself (an unknown one), not its value.
    at_key: bool,
}

impl Error {
    fn within(mut self, part: String) -> Error {
        self.path.insert(0, part);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.path.is_empty() {
            true => f.write_str(&self.message),
            false => write!(f, "{}: {}", key_of(&self.path), self.message),
        }
    }
}

impl std::error::Error for Error {}

impl de::Error for Error {
    fn custom<M: fmt::Display>(message: M) -> Error {
        Error { path: Vec::new(), message: message.to_string(), at_key: false }
    }
}

/// A TOML value to deserialize; `from_env` when an override set it (then it is text, read as
/// the type asked for).
struct ValueDeserializer<'a> {
    value: toml::Value,
    path: Vec<String>,
    overrides: &'a [Override],
    from_env: bool,
}

impl<'a> ValueDeserializer<'a> {
    fn child(&self, part: String, value: toml::Value) -> ValueDeserializer<'a> {
        let mut path = self.path.clone();
        path.push(part);
        let from_env = self.from_env || self.overrides.iter().any(|o| o.path == path);
        ValueDeserializer { value, path, overrides: self.overrides, from_env }
    }

    /// The text an override set, when this value is one.
    fn env_text(&self) -> Option<&str> {
        match (&self.value, self.from_env) {
            (toml::Value::String(s), true) => Some(s.as_str()),
            _ => None,
        }
    }
}

fn parse_text<T: std::str::FromStr>(text: &str, what: &str) -> Result<T, Error> {
    text.trim().parse().map_err(|_| de::Error::custom(format!("expected {what}, not {text:?}")))
}

macro_rules! from_env_text {
    ($($method:ident => $visit:ident as $ty:ty, $what:literal;)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
                match self.env_text() {
                    Some(text) => visitor.$visit(parse_text::<$ty>(text, $what)?),
                    None => self.deserialize_any(visitor),
                }
            }
        )*
    };
}

impl<'de> de::Deserializer<'de> for ValueDeserializer<'_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.value {
            toml::Value::String(s) => visitor.visit_string(s),
            toml::Value::Integer(i) => visitor.visit_i64(i),
            toml::Value::Float(f) => visitor.visit_f64(f),
            toml::Value::Boolean(b) => visitor.visit_bool(b),
            toml::Value::Datetime(d) => visitor.visit_string(d.to_string()),
            toml::Value::Array(items) => {
                let entries = items.into_iter().enumerate().map(|(i, v)| (i.to_string(), v)).collect::<Vec<_>>();
                let parent = ValueDeserializer { value: toml::Value::Boolean(false), ..self };
                visitor.visit_seq(Entries { parent, entries: entries.into_iter(), pending: None })
            }
            toml::Value::Table(table) => {
                let entries = table.into_iter().collect::<Vec<_>>();
                let parent = ValueDeserializer { value: toml::Value::Boolean(false), ..self };
                visitor.visit_map(Entries { parent, entries: entries.into_iter(), pending: None })
            }
        }
    }

    from_env_text! {
        deserialize_bool => visit_bool as bool, "true or false";
        deserialize_i8 => visit_i64 as i64, "a whole number";
        deserialize_i16 => visit_i64 as i64, "a whole number";
        deserialize_i32 => visit_i64 as i64, "a whole number";
        deserialize_i64 => visit_i64 as i64, "a whole number";
        deserialize_u8 => visit_u64 as u64, "a whole number at least 0";
        deserialize_u16 => visit_u64 as u64, "a whole number at least 0";
        deserialize_u32 => visit_u64 as u64, "a whole number at least 0";
        deserialize_u64 => visit_u64 as u64, "a whole number at least 0";
        deserialize_f32 => visit_f64 as f64, "a number";
        deserialize_f64 => visit_f64 as f64, "a number";
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.env_text() {
            Some("") => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.env_text() {
            // A list from one variable: its comma-separated items, each read as the item type.
            Some(text) => {
                let items: Vec<toml::Value> = match text.trim() {
                    "" => Vec::new(),
                    t => t.split(',').map(|i| toml::Value::String(i.trim().to_string())).collect(),
                };
                let value = toml::Value::Array(items);
                ValueDeserializer { value, ..self }.deserialize_any(visitor)
            }
            None => self.deserialize_any(visitor),
        }
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.env_text() {
            Some(_) => Err(de::Error::custom("a table: set its keys one by one")),
            None => self.deserialize_any(visitor),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_map(visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        match self.value {
            toml::Value::String(s) => visitor.visit_enum(s.into_deserializer()),
            _ => self.deserialize_any(visitor),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _name: &'static str, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }

    forward_to_deserialize_any! {
        char str string bytes byte_buf unit unit_struct tuple tuple_struct identifier
    }
}

/// The entries of a table or an array, each deserialized at its key.
struct Entries<'a> {
    parent: ValueDeserializer<'a>,
    entries: std::vec::IntoIter<(String, toml::Value)>,
    pending: Option<(String, toml::Value)>,
}

impl<'de> MapAccess<'de> for Entries<'_> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, Error> {
        let Some((key, value)) = self.entries.next() else { return Ok(None) };
        let read = seed.deserialize(key.clone().into_deserializer()).map_err(|mut e: Error| {
            e.at_key = true;
            e.within(key.clone())
        });
        self.pending = Some((key, value));
        read.map(Some)
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, Error> {
        let (key, value) = self.pending.take().ok_or_else(|| de::Error::custom("a value without its key"))?;
        seed.deserialize(self.parent.child(key.clone(), value)).map_err(|e| e.within(key))
    }
}

impl<'de> SeqAccess<'de> for Entries<'_> {
    type Error = Error;

    fn next_element_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<Option<S::Value>, Error> {
        let Some((index, value)) = self.entries.next() else { return Ok(None) };
        seed.deserialize(self.parent.child(index.clone(), value)).map(Some).map_err(|e| e.within(index))
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    /// A section like the gateway's: strict, every key defaulted.
    #[derive(Debug, Default, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields, default)]
    struct Section {
        listen: String,
        read_wait_ms: u64,
        subject_header: Option<String>,
        admin_listen: String,
        enabled: bool,
        ratio: f64,
    }

    fn env(pairs: &[(&str, &str)]) -> Env {
        pairs.iter().copied().collect()
    }

    fn read(table: &str, pairs: &[(&str, &str)]) -> anyhow::Result<Option<Section>> {
        let table: toml::Table = toml::from_str(table).unwrap();
        section("gateway", Some(&table), &env(pairs))
    }

    #[test]
    fn a_variable_sets_its_key_as_the_key_s_type() {
        let s = read(
            "listen = \"a:1\"\nread_wait_ms = 5\n",
            &[
                ("PARSLEY_GATEWAY__READ_WAIT_MS", "300"),
                ("PARSLEY_GATEWAY__ENABLED", "true"),
                ("PARSLEY_GATEWAY__RATIO", "0.5"),
                ("PARSLEY_GATEWAY__SUBJECT_HEADER", "x-user"),
                ("PARSLEY_OTHER__KEY", "not this section"),
            ],
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            s,
            Section {
                listen: "a:1".into(),
                read_wait_ms: 300,
                subject_header: Some("x-user".into()),
                enabled: true,
                ratio: 0.5,
                ..Section::default()
            }
        );
        assert!(read("", &[("PARSLEY_OTHER__KEY", "x")]).unwrap().is_none(), "no override: the caller reads the table");
    }

    #[test]
    fn an_empty_value_is_absent_for_an_optional_key_and_empty_text_for_text() {
        let s = read(
            "subject_header = \"h\"\nadmin_listen = \"b:2\"\n",
            &[("PARSLEY_GATEWAY__SUBJECT_HEADER", ""), ("PARSLEY_GATEWAY__ADMIN_LISTEN", "")],
        )
        .unwrap()
        .unwrap();
        assert_eq!((s.subject_header, s.admin_listen.as_str()), (None, ""));
        let err = read("", &[("PARSLEY_GATEWAY__READ_WAIT_MS", "")]).unwrap_err().to_string();
        assert!(err.contains("PARSLEY_GATEWAY__READ_WAIT_MS") && err.contains("gateway.read_wait_ms"), "{err}");
    }

    #[test]
    fn aliases_keep_their_blank_rule_and_lose_to_the_generic_form() {
        // Blank ignored: the table's value stays.
        let s = read("listen = \"a:1\"\n", &[(ENV_GATEWAY_LISTEN, "  ")]).unwrap();
        assert!(s.is_none(), "an ignored blank alias is no override");
        // Blank applied: empty text (no admin listener), no subject binding.
        let s = read(
            "admin_listen = \"b:2\"\nsubject_header = \"h\"\n",
            &[(ENV_GATEWAY_ADMIN_LISTEN, " "), (ENV_GATEWAY_SUBJECT_HEADER, "")],
        )
        .unwrap()
        .unwrap();
        assert_eq!((s.admin_listen.as_str(), s.subject_header), ("", None));
        // Trimmed; the generic form wins.
        let s = read("", &[(ENV_GATEWAY_LISTEN, " c:3 "), (ENV_GATEWAY_READ_WAIT_MS, "7")]).unwrap().unwrap();
        assert_eq!((s.listen.as_str(), s.read_wait_ms), ("c:3", 7));
        let s = read("", &[(ENV_GATEWAY_LISTEN, "c:3"), ("PARSLEY_GATEWAY__LISTEN", "d:4")]).unwrap().unwrap();
        assert_eq!(s.listen, "d:4");
        // The URL's alias and its fallback, in order.
        let o = overrides(&env(&[(ENV_DATABASE_URL_FALLBACK, "b"), (ENV_DATABASE_URL, "a")]), |_| true).unwrap();
        assert_eq!(
            o,
            vec![Override {
                var: ENV_DATABASE_URL.into(),
                path: vec!["database".into(), "url".into()],
                value: "a".into()
            }]
        );
    }

    #[test]
    fn an_unknown_key_is_refused_naming_the_variable() {
        let err = read("", &[("PARSLEY_GATEWAY__READ_WAITMS", "5")]).unwrap_err().to_string();
        assert!(err.contains("PARSLEY_GATEWAY__READ_WAITMS") && err.contains("read_waitms"), "{err}");
        let err = read("", &[("PARSLEY_GATEWAY__READ_WAIT_MS", "soon")]).unwrap_err().to_string();
        assert!(err.contains("PARSLEY_GATEWAY__READ_WAIT_MS") && err.contains("soon"), "{err}");
        let err = read("", &[("PARSLEY_GATEWAY__LISTEN__PORT", "1")]).unwrap_err().to_string();
        assert!(err.contains("PARSLEY_GATEWAY__LISTEN__PORT"), "{err}");
        let err = overrides(&env(&[("PARSLEY_GATEWAY__", "x")]), |_| true).unwrap_err().to_string();
        assert!(err.contains("PARSLEY_GATEWAY__"), "{err}");
    }

    #[test]
    fn a_variable_names_a_key_by_its_own_name() {
        #[derive(Debug, Default, Deserialize)]
        #[serde(deny_unknown_fields, default)]
        struct Renamed {
            #[serde(alias = "old_ms")]
            new_ms: u64,
        }
        let read = |file: &str, pairs: &[(&str, &str)]| {
            let table: toml::Table = toml::from_str(file).unwrap();
            section::<Renamed>("gateway", Some(&table), &env(pairs))
        };
        assert_eq!(read("", &[("PARSLEY_GATEWAY__NEW_MS", "7")]).unwrap().unwrap().new_ms, 7);
        // A name serde still takes for the key (an alias) is a name of the key.
        assert_eq!(read("", &[("PARSLEY_GATEWAY__OLD_MS", "8")]).unwrap().unwrap().new_ms, 8);
        assert!(section_variables::<Renamed>("gateway").contains(&"PARSLEY_GATEWAY__OLD_MS".to_string()));
        let err = read("", &[("PARSLEY_GATEWAY__NEWMS", "7")]).unwrap_err().to_string();
        assert!(err.contains("PARSLEY_GATEWAY__NEWMS") && err.contains("new_ms"), "{err}");
        // The file's older name and the variable both set the key: refused, naming both.
        let err = read("old_ms = 5\n", &[("PARSLEY_GATEWAY__NEW_MS", "7")]).unwrap_err().to_string();
        assert!(err.contains("PARSLEY_GATEWAY__NEW_MS") && err.contains("duplicate field `new_ms`"), "{err}");
    }

    #[test]
    fn a_section_s_variables_are_its_fields_and_aliases() {
        let names = section_variables::<Section>("gateway");
        for name in
            ["PARSLEY_GATEWAY__LISTEN", "PARSLEY_GATEWAY__READ_WAIT_MS", ENV_GATEWAY_LISTEN, ENV_TOKEN_KEYS_FILE]
        {
            assert!(names.iter().any(|n| n == name), "{name} missing from {names:?}");
        }
        assert!(!names.iter().any(|n| n == ENV_KAFKA_BOOTSTRAP), "another section's alias: {names:?}");
        let looked_up = Env::lookup(names, |n| (n == "PARSLEY_GATEWAY__LISTEN").then(|| "e:5".to_string()));
        assert_eq!(section::<Section>("gateway", None, &looked_up).unwrap().unwrap().listen, "e:5");
    }

    #[test]
    fn values_are_never_printed() {
        let e = env(&[("PARSLEY_DATABASE__URL", "postgres://u:secret@h/d")]);
        assert_eq!(format!("{e:?}"), "{\"PARSLEY_DATABASE__URL\"}");
    }
}
