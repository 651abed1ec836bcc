//! The examples that run, and what their tests share.
//!
//! - `order-totals/`: a SQL projection by configuration (`parsley.toml`, its `migrations/`)
//!   over co-partitioned orders and payments topics, with the named query `customer_total`
//!   and a data contract per topic (`schemas/`).
//! - `custom-projection/` and `src/bin/custom-projection.rs`: a program embedding the
//!   projector with a projection of its own, written in Rust, registered by name.
//!
//! [`example_toml`] and [`example_config`] load an example's file for a run against other
//! names (each test run uses topics and a model of its own), with its migrations folder and
//! its topics' schema files made absolute so the run does not depend on the working
//! directory.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use parsley_settings::config::Config;
use parsley_settings::overrides::Env;

/// The order-totals example's folder.
pub const ORDER_TOTALS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/order-totals");
/// The custom-projection example's folder.
pub const CUSTOM_PROJECTION: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/custom-projection");

/// The repository's root: the examples' files name their migrations and schemas relative to it.
fn repository_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("examples/ is inside the repository").to_path_buf()
}

/// The `parsley.toml` of the example in `dir`, its one model renamed `model`, its topics
/// renamed in order to `topics` (as many as it declares), its migrations folder and schema
/// files absolute.
pub fn example_toml(dir: &str, model: &str, topics: &[&str]) -> anyhow::Result<String> {
    let path = Path::new(dir).join("parsley.toml");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut tree: toml::Table = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let Some(toml::Value::Array(models)) = tree.get_mut("models") else {
        bail!("{} has no [[models]]", path.display())
    };
    let [toml::Value::Table(m)] = models.as_mut_slice() else { bail!("{} must declare one model", path.display()) };
    m.insert("name".into(), model.into());
    if let Some(toml::Value::String(folder)) = m.get("migrations") {
        let absolute = repository_root().join(folder);
        m.insert("migrations".into(), absolute.display().to_string().into());
    }
    let Some(toml::Value::Array(declared)) = m.get_mut("topics") else { bail!("{} has no topics", path.display()) };
    if declared.len() != topics.len() {
        bail!("{} declares {} topics, not {}", path.display(), declared.len(), topics.len());
    }
    for (entry, name) in declared.iter_mut().zip(topics) {
        let toml::Value::Table(t) = entry else { bail!("{}: a topic is not a table", path.display()) };
        t.insert("name".into(), (*name).into());
        if let Some(toml::Value::String(schema)) = t.get("schema") {
            let absolute = repository_root().join(schema);
            t.insert("schema".into(), absolute.display().to_string().into());
        }
    }
    Ok(toml::to_string(&tree)?)
}

/// [`example_toml`] parsed with this process's environment overrides (the database URL and
/// the broker from `DATABASE_URL` and `PARSLEY_KAFKA_BOOTSTRAP`, as for every binary).
pub fn example_config(dir: &str, model: &str, topics: &[&str]) -> anyhow::Result<Config> {
    Config::parse_with_env(&example_toml(dir, model, topics)?, &Env::process())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_examples_parse_renamed() {
        let c = Config::parse(&example_toml(ORDER_TOTALS, "m", &["o", "p"]).unwrap()).unwrap();
        let m = &c.models[0];
        assert_eq!((m.name.as_str(), m.projection.as_str()), ("m", "sql"));
        assert_eq!(m.topics.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["o", "p"]);
        assert!(Path::new(m.migrations.as_deref().unwrap()).join("1_create_orders_and_payments.sql").is_file());
        assert_eq!(m.queries[0].key.as_deref(), Some("customer"));
        assert!(m.topics.iter().all(|t| t.contract.is_some()), "each topic's schema is read");
        let c = Config::parse(&example_toml(CUSTOM_PROJECTION, "n", &["o", "p"]).unwrap()).unwrap();
        assert_eq!(c.models[0].projection, "order-events");
        assert_eq!(c.models[0].options.get("status_field").and_then(|v| v.as_str()), Some("status"));
        assert!(example_toml(ORDER_TOTALS, "m", &["o"]).is_err(), "the topics must all be renamed");
    }

    #[test]
    fn the_files_as_shipped_parse() {
        for dir in [ORDER_TOTALS, CUSTOM_PROJECTION] {
            let text = std::fs::read_to_string(Path::new(dir).join("parsley.toml")).unwrap();
            // Its paths are relative to the repository's root, where it is run from.
            let root = repository_root().display().to_string();
            let text = text.replace("schema = \"examples/", &format!("schema = \"{root}/examples/"));
            Config::parse(&text).unwrap_or_else(|e| panic!("{dir}: {e:#}"));
        }
    }
}
