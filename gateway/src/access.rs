//! Who may do what: the authorization rules of `[[gateway.rules]]`, checked on every data
//! route once the gateway authenticates callers (`gateway.access = "rules"`, the default
//! with `[gateway.auth]`).
//!
//! A rule allows some actions — `write` (records to its `topics`), `read` (one document of
//! its `models`), `list` (pages of their documents), `query` (their named `queries`, all of
//! them when none are listed) — to callers whose token carries every scope in `scopes` and
//! every claim value in `claims`. It may bind what the caller touches to the caller:
//! `key = "{sub}"` (the record or document key must be exactly that) or
//! `key_prefix = "{claim.tenant}:"` (it must start with that); `params.customer =
//! "{claim.customer_id}"` fixes a named query's parameter (the caller may leave it out, or
//! give that very value). Templates name `{sub}` or `{claim.NAME}` (`NAME` a top-level
//! claim, or a JSON pointer like `/realm_access/roles`... any claim holding text or a
//! number); a claim missing or empty fails the rule, so a binding never widens to "every
//! key".
//!
//! Rules only allow: a request is allowed when one rule that covers its action and resource
//! allows it, and refused `403 forbidden` otherwise — naming the rules that failed and why
//! (a scope, a claim, the key binding: never the data or the claim values); with no rule
//! for it at all, nothing is allowed. A batch write is allowed only if every record is. A
//! collection read returns only keys some passing rule allows: the filter runs in the
//! statement ([`KeyFilter`]), so pages stay full.

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use serde_json::Value;

use crate::identity::Identity;
use crate::problem::ApiError;

/// An action a rule allows.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// `POST /v1/topics/{topic}/records` and `POST /v1/records`.
    Write,
    /// `GET /v1/models/{model}/documents/{key}`.
    Read,
    /// `GET /v1/models/{model}/documents`.
    List,
    /// `GET /v1/models/{model}/queries/{name}`.
    Query,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Write => "write",
            Action::Read => "read",
            Action::List => "list",
            Action::Query => "query",
        }
    }
}

/// A claim's wanted value: one, or any of several.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum ClaimMatch {
    One(String),
    AnyOf(Vec<String>),
}

/// One `[[gateway.rules]]` entry as configured.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RuleSettings {
    /// Named in refusals and logs; unique.
    pub name: String,
    pub allow: Vec<Action>,
    /// The topics `write` covers (`*`: every received topic).
    #[serde(default)]
    pub topics: Vec<String>,
    /// The models `read`, `list` and `query` cover (`*`: every model).
    #[serde(default)]
    pub models: Vec<String>,
    /// The named queries `query` covers (absent: every query of the models).
    #[serde(default)]
    pub queries: Vec<String>,
    /// Scopes the token must all carry (`scope` or `scp`).
    #[serde(default)]
    pub scopes: Vec<String>,
    /// Claims the token must carry with these values (a list: any of them; a claim that is
    /// a list matches when it holds one).
    #[serde(default)]
    pub claims: BTreeMap<String, ClaimMatch>,
    /// The key must be exactly this (a template).
    pub key: Option<String>,
    /// The key must start with this (a template).
    pub key_prefix: Option<String>,
    /// Named-query parameters fixed to these (templates).
    #[serde(default)]
    pub params: BTreeMap<String, String>,
}

/// A piece of a template.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Text(String),
    Subject,
    Claim(String),
}

/// `{sub}` and `{claim.NAME}` in text (`{{` and `}}` for braces).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

impl Template {
    pub fn parse(text: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    literal.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    literal.push('}');
                }
                '{' => {
                    let mut name = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some(c) => name.push(c),
                            None => return Err(format!("{text:?} has a {{ without its }}")),
                        }
                    }
                    if !literal.is_empty() {
                        parts.push(Part::Text(std::mem::take(&mut literal)));
                    }
                    parts.push(match name.as_str() {
                        "sub" => Part::Subject,
                        _ => match name.strip_prefix("claim.") {
                            Some(claim) if !claim.is_empty() => Part::Claim(claim.to_string()),
                            _ => {
                                return Err(format!(
                                    "{text:?} names {{{name}}}: a template names {{sub}} or {{claim.NAME}}"
                                ))
                            }
                        },
                    });
                }
                '}' => return Err(format!("{text:?} has a }} without its {{ (write }}}} for a brace)")),
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            parts.push(Part::Text(literal));
        }
        Ok(Template { source: text.to_string(), parts })
    }

    /// The text for `who`; why not when a claim it names is missing, empty or not a scalar.
    pub fn render(&self, who: &Identity) -> Result<String, String> {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::Subject => out.push_str(&who.subject),
                Part::Claim(name) => match who.claim(name) {
                    Some(Value::String(s)) if !s.is_empty() => out.push_str(s),
                    Some(v @ (Value::Number(_) | Value::Bool(_))) => out.push_str(&v.to_string()),
                    Some(_) => return Err(format!("claim {name:?} is not text or a number, or is empty")),
                    None => return Err(format!("the token has no claim {name:?}")),
                },
            }
        }
        Ok(out)
    }
}

/// Names a rule covers: some, or every one (`*`).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Names {
    Every,
    Some(BTreeSet<String>),
}

impl Names {
    fn of(list: &[String]) -> Names {
        if list.iter().any(|n| n == "*") {
            Names::Every
        } else {
            Names::Some(list.iter().cloned().collect())
        }
    }

    fn covers(&self, name: &str) -> bool {
        match self {
            Names::Every => true,
            Names::Some(names) => names.contains(name),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum KeyBinding {
    Exact(Template),
    Prefix(Template),
}

/// A checked rule.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Rule {
    name: String,
    actions: BTreeSet<Action>,
    topics: Names,
    models: Names,
    /// `None`: every query of the models.
    queries: Option<BTreeSet<String>>,
    scopes: Vec<String>,
    claims: BTreeMap<String, ClaimMatch>,
    key: Option<KeyBinding>,
    params: BTreeMap<String, Template>,
}

/// What a collection read may return.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyFilter {
    All,
    /// Only these keys, and keys starting with these prefixes.
    Only {
        keys: Vec<String>,
        prefixes: Vec<String>,
    },
}

/// What the configuration says of the models, for checking rules against it.
pub struct Known<'a> {
    pub topics: &'a BTreeSet<String>,
    /// Model name → its queries → their parameter names.
    pub models: BTreeMap<&'a str, BTreeMap<&'a str, BTreeSet<&'a str>>>,
}

/// The rules in force, or none (open access).
#[derive(Clone, Debug)]
pub struct Access {
    /// `None`: open access, everything allowed.
    rules: Option<Vec<Rule>>,
}

impl Access {
    /// Open access: every data route allowed to anyone.
    pub fn open() -> Access {
        Access { rules: None }
    }

    pub fn is_open(&self) -> bool {
        self.rules.is_none()
    }

    /// The rules, checked against what is configured; every error names the rule and key.
    pub fn rules(settings: &[RuleSettings], known: &Known<'_>) -> anyhow::Result<Access> {
        let mut rules = Vec::with_capacity(settings.len());
        let mut names = BTreeSet::new();
        for (i, s) in settings.iter().enumerate() {
            let at = format!("gateway.rules[{i}] ({:?})", s.name);
            let rule = check_rule(s, known).map_err(|e| anyhow::anyhow!("{at}: {e}"))?;
            if !names.insert(rule.name.clone()) {
                anyhow::bail!("{at}: another rule has this name");
            }
            rules.push(rule);
        }
        Ok(Access { rules: Some(rules) })
    }

    /// The rule names, for `/v1/status`.
    pub fn rule_names(&self) -> Vec<String> {
        self.rules.iter().flatten().map(|r| r.name.clone()).collect()
    }

    /// Whether `who` may write records with `keys` to `topic`.
    pub fn check_write(&self, who: Option<&Identity>, topic: &str, keys: &[&str]) -> Result<(), ApiError> {
        let Some(rules) = &self.rules else { return Ok(()) };
        let what = format!("write to topic {topic:?}");
        let covering: Vec<&Rule> =
            rules.iter().filter(|r| r.actions.contains(&Action::Write) && r.topics.covers(topic)).collect();
        check_keys(&covering, who, &what, keys)
    }

    /// Whether `who` may read the document `key` of `model`.
    pub fn check_read(&self, who: Option<&Identity>, model: &str, key: &str) -> Result<(), ApiError> {
        let Some(rules) = &self.rules else { return Ok(()) };
        let what = format!("read documents of model {model:?}");
        let covering: Vec<&Rule> =
            rules.iter().filter(|r| r.actions.contains(&Action::Read) && r.models.covers(model)).collect();
        check_keys(&covering, who, &what, &[key])
    }

    /// The keys of `model` whose pages `who` may list.
    pub fn list_filter(&self, who: Option<&Identity>, model: &str) -> Result<KeyFilter, ApiError> {
        let Some(rules) = &self.rules else { return Ok(KeyFilter::All) };
        let what = format!("list documents of model {model:?}");
        let covering: Vec<&Rule> =
            rules.iter().filter(|r| r.actions.contains(&Action::List) && r.models.covers(model)).collect();
        let who = identity(who)?;
        let mut failures = Vec::new();
        let (mut keys, mut prefixes) = (Vec::new(), Vec::new());
        let mut any = false;
        for rule in &covering {
            if let Err(why) = conditions(rule, who) {
                failures.push((rule.name.clone(), why));
                continue;
            }
            match &rule.key {
                None => return Ok(KeyFilter::All),
                Some(KeyBinding::Exact(t)) => match t.render(who) {
                    Ok(k) => {
                        any = true;
                        keys.push(k)
                    }
                    Err(why) => failures.push((rule.name.clone(), why)),
                },
                Some(KeyBinding::Prefix(t)) => match t.render(who) {
                    Ok(p) => {
                        any = true;
                        prefixes.push(p)
                    }
                    Err(why) => failures.push((rule.name.clone(), why)),
                },
            }
        }
        if any {
            return Ok(KeyFilter::Only { keys, prefixes });
        }
        Err(forbidden(&what, failures))
    }

    /// Whether `who` may run `query` of `model`, with `given` (the request's parameters)
    /// completed with the parameters the first allowing rule binds.
    pub fn bind_query(
        &self,
        who: Option<&Identity>,
        model: &str,
        query: &str,
        given: &mut BTreeMap<String, String>,
    ) -> Result<(), ApiError> {
        let Some(rules) = &self.rules else { return Ok(()) };
        let what = format!("run query {query:?} of model {model:?}");
        let who = identity(who)?;
        let mut failures = Vec::new();
        'rules: for rule in rules.iter().filter(|r| {
            r.actions.contains(&Action::Query)
                && r.models.covers(model)
                && r.queries.as_ref().is_none_or(|q| q.contains(query))
        }) {
            if let Err(why) = conditions(rule, who) {
                failures.push((rule.name.clone(), why));
                continue;
            }
            let mut bound = Vec::new();
            for (name, template) in &rule.params {
                let value = match template.render(who) {
                    Ok(v) => v,
                    Err(why) => {
                        failures.push((rule.name.clone(), why));
                        continue 'rules;
                    }
                };
                if given.get(name).is_some_and(|v| *v != value) {
                    failures.push((
                        rule.name.clone(),
                        format!("parameter {name:?} is bound to {}; leave it out", template.source),
                    ));
                    continue 'rules;
                }
                bound.push((name.clone(), value));
            }
            given.extend(bound);
            return Ok(());
        }
        Err(forbidden(&what, failures))
    }
}

/// The caller's identity, which every rule needs.
fn identity(who: Option<&Identity>) -> Result<&Identity, ApiError> {
    // Rules are only in force with authentication on, which has verified a token by now.
    who.ok_or_else(|| ApiError::Unauthenticated("this route needs a bearer token".into()))
}

/// Every key allowed by some covering rule, or a refusal naming the failures.
fn check_keys(covering: &[&Rule], who: Option<&Identity>, what: &str, keys: &[&str]) -> Result<(), ApiError> {
    let who = identity(who)?;
    let mut failures = Vec::new();
    let passing: Vec<&Rule> = covering
        .iter()
        .copied()
        .filter(|rule| match conditions(rule, who) {
            Ok(()) => true,
            Err(why) => {
                failures.push((rule.name.clone(), why));
                false
            }
        })
        .collect();
    if passing.is_empty() {
        return Err(forbidden(what, failures));
    }
    for key in keys {
        let mut key_failures = Vec::new();
        let allowed = passing.iter().any(|rule| match key_allowed(rule, who, key) {
            Ok(()) => true,
            Err(why) => {
                key_failures.push((rule.name.clone(), why));
                false
            }
        });
        if !allowed {
            failures.extend(key_failures);
            return Err(forbidden(what, failures));
        }
    }
    Ok(())
}

/// The rule's scopes and claims, checked; why not (naming the scope or claim, never its value).
fn conditions(rule: &Rule, who: &Identity) -> Result<(), String> {
    for scope in &rule.scopes {
        if !who.scopes.contains(scope) {
            return Err(format!("the token lacks scope {scope:?}"));
        }
    }
    for (name, wanted) in &rule.claims {
        let Some(value) = who.claim(name) else { return Err(format!("the token has no claim {name:?}")) };
        let wanted: &[String] = match wanted {
            ClaimMatch::One(v) => std::slice::from_ref(v),
            ClaimMatch::AnyOf(v) => v,
        };
        let matches = |v: &Value| match v {
            Value::String(s) => wanted.contains(s),
            Value::Number(_) | Value::Bool(_) => wanted.contains(&v.to_string()),
            _ => false,
        };
        let ok = match value {
            Value::Array(items) => items.iter().any(matches),
            other => matches(other),
        };
        if !ok {
            return Err(format!("claim {name:?} is not a value the rule accepts"));
        }
    }
    Ok(())
}

/// The rule's key binding, checked for `key`.
fn key_allowed(rule: &Rule, who: &Identity, key: &str) -> Result<(), String> {
    match &rule.key {
        None => Ok(()),
        Some(KeyBinding::Exact(t)) => {
            let bound = t.render(who)?;
            if key == bound {
                Ok(())
            } else {
                Err(format!("the key must be {}", t.source))
            }
        }
        Some(KeyBinding::Prefix(t)) => {
            let bound = t.render(who)?;
            if key.starts_with(&bound) {
                Ok(())
            } else {
                Err(format!("the key must start with {}", t.source))
            }
        }
    }
}

/// The `403 forbidden` for `what`, naming each failed rule and why.
fn forbidden(what: &str, failures: Vec<(String, String)>) -> ApiError {
    if failures.is_empty() {
        return ApiError::Forbidden { detail: format!("no rule allows this caller to {what}"), rules: Vec::new() };
    }
    let reasons: Vec<String> = failures.iter().map(|(rule, why)| format!("rule {rule:?}: {why}")).collect();
    ApiError::Forbidden {
        detail: format!("not allowed to {what}: {}", reasons.join("; ")),
        rules: failures.into_iter().map(|(rule, _)| rule).collect(),
    }
}

fn check_rule(s: &RuleSettings, known: &Known<'_>) -> anyhow::Result<Rule> {
    use anyhow::bail;
    if s.name.trim().is_empty() {
        bail!("name must not be empty");
    }
    if s.allow.is_empty() {
        bail!("allow must name at least one of write, read, list, query");
    }
    let actions: BTreeSet<Action> = s.allow.iter().copied().collect();
    let writes = actions.contains(&Action::Write);
    let reads = actions.iter().any(|a| *a != Action::Write);
    if writes == s.topics.is_empty() {
        bail!("topics is needed with allow = write, and only then");
    }
    if reads == s.models.is_empty() {
        bail!("models is needed with allow = read, list or query, and only then");
    }
    for topic in &s.topics {
        if topic != "*" && !known.topics.contains(topic) {
            bail!("topics names {topic:?}, which no model receives");
        }
    }
    for model in &s.models {
        if model != "*" && !known.models.contains_key(model.as_str()) {
            bail!("models names {model:?}, which is not a configured model");
        }
    }
    let queries = if s.queries.is_empty() { None } else { Some(s.queries.iter().cloned().collect::<BTreeSet<_>>()) };
    if (queries.is_some() || !s.params.is_empty()) && !actions.contains(&Action::Query) {
        bail!("queries and params go with allow = query");
    }
    let listed: Vec<&str> = match Names::of(&s.models) {
        Names::Every => known.models.keys().copied().collect(),
        Names::Some(_) => s.models.iter().map(String::as_str).collect(),
    };
    for query in queries.iter().flatten() {
        if !Names::of(&s.models).eq(&Names::Every) {
            for model in &listed {
                if !known.models.get(model).is_some_and(|q| q.contains_key(query.as_str())) {
                    bail!("queries names {query:?}, which model {model:?} does not have");
                }
            }
        }
    }
    for name in s.params.keys() {
        let declared = listed.iter().any(|m| {
            known.models.get(m).is_some_and(|qs| {
                qs.iter().any(|(q, params)| {
                    queries.as_ref().is_none_or(|set| set.contains(*q)) && params.contains(name.as_str())
                })
            })
        });
        if !declared {
            bail!("params.{name} is no parameter of the queries this rule covers");
        }
    }
    let key = match (&s.key, &s.key_prefix) {
        (Some(_), Some(_)) => bail!("key and key_prefix cannot both be set"),
        (Some(k), None) => Some(KeyBinding::Exact(Template::parse(k).map_err(|e| anyhow::anyhow!("key: {e}"))?)),
        (None, Some(p)) => {
            Some(KeyBinding::Prefix(Template::parse(p).map_err(|e| anyhow::anyhow!("key_prefix: {e}"))?))
        }
        (None, None) => None,
    };
    if key.is_some() && !actions.iter().any(|a| matches!(a, Action::Write | Action::Read | Action::List)) {
        bail!("key and key_prefix bind write, read and list; for a query, bind its parameter (params.NAME)");
    }
    let params = s
        .params
        .iter()
        .map(|(n, t)| Ok((n.clone(), Template::parse(t).map_err(|e| anyhow::anyhow!("params.{n}: {e}"))?)))
        .collect::<anyhow::Result<_>>()?;
    for scope in &s.scopes {
        if scope.is_empty() || scope.contains(char::is_whitespace) {
            bail!("scopes holds {scope:?}, which no token can carry");
        }
    }
    Ok(Rule {
        name: s.name.clone(),
        actions,
        topics: Names::of(&s.topics),
        models: Names::of(&s.models),
        queries,
        scopes: s.scopes.clone(),
        claims: s.claims.clone(),
        key,
        params,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn who(sub: &str, scopes: &[&str], claims: Value) -> Identity {
        let mut all = claims.as_object().cloned().unwrap_or_default();
        all.insert("sub".into(), json!(sub));
        Identity {
            subject: sub.into(),
            scopes: scopes.iter().map(|s| s.to_string()).collect(),
            claims: all,
            expires_at: u64::MAX,
            not_before: None,
        }
    }

    fn access(text: &str) -> anyhow::Result<Access> {
        #[derive(Deserialize)]
        struct File {
            rules: Vec<RuleSettings>,
        }
        let file: File = toml::from_str(text)?;
        let topics: BTreeSet<String> = ["orders".to_string(), "payments".to_string()].into();
        let known = Known {
            topics: &topics,
            models: BTreeMap::from([(
                "totals",
                BTreeMap::from([("by_customer", BTreeSet::from(["customer"])), ("top", BTreeSet::new())]),
            )]),
        };
        Access::rules(&file.rules, &known)
    }

    const RULES: &str = r#"
[[rules]]
name = "own-orders"
allow = ["write"]
topics = ["orders"]
scopes = ["orders:write"]
key = "{sub}"

[[rules]]
name = "tenant-reads"
allow = ["read", "list"]
models = ["totals"]
key_prefix = "{claim.tenant}:"

[[rules]]
name = "own-total"
allow = ["query"]
models = ["totals"]
queries = ["by_customer"]
params = { customer = "{claim.customer_id}" }

[[rules]]
name = "admins"
allow = ["write", "read", "list", "query"]
topics = ["*"]
models = ["*"]
claims = { role = ["admin", "ops"] }
"#;

    #[test]
    fn writes_are_bound_to_the_callers_key() {
        let a = access(RULES).unwrap();
        let alice = who("alice", &["orders:write"], json!({}));
        assert!(a.check_write(Some(&alice), "orders", &["alice"]).is_ok());
        let err = a.check_write(Some(&alice), "orders", &["bob"]).unwrap_err();
        let text = format!("{err:?}");
        assert!(text.contains("own-orders") && text.contains("{sub}") && !text.contains("bob"), "{text}");
        assert!(a.check_write(Some(&alice), "orders", &["alice", "bob"]).is_err(), "a batch is all or nothing");
        let no_scope = who("alice", &[], json!({}));
        assert!(a.check_write(Some(&no_scope), "orders", &["alice"]).is_err());
        assert!(a.check_write(Some(&alice), "payments", &["alice"]).is_err(), "no rule covers payments for alice");
        let admin = who("root", &[], json!({"role": ["ops"]}));
        assert!(a.check_write(Some(&admin), "payments", &["anyone"]).is_ok());
        assert!(a.check_write(None, "orders", &["alice"]).is_err());
    }

    #[test]
    fn reads_and_lists_follow_the_prefix() {
        let a = access(RULES).unwrap();
        let acme = who("u1", &[], json!({"tenant": "acme"}));
        assert!(a.check_read(Some(&acme), "totals", "acme:1").is_ok());
        assert!(a.check_read(Some(&acme), "totals", "globex:1").is_err());
        assert_eq!(
            a.list_filter(Some(&acme), "totals").unwrap(),
            KeyFilter::Only { keys: vec![], prefixes: vec!["acme:".into()] }
        );
        let nobody = who("u2", &[], json!({}));
        assert!(a.list_filter(Some(&nobody), "totals").is_err(), "a missing claim never widens to every key");
        let empty = who("u3", &[], json!({"tenant": ""}));
        assert!(a.check_read(Some(&empty), "totals", ":x").is_err(), "an empty claim fails the rule");
        let admin = who("root", &[], json!({"role": "admin"}));
        assert_eq!(a.list_filter(Some(&admin), "totals").unwrap(), KeyFilter::All);
    }

    #[test]
    fn query_parameters_are_bound() {
        let a = access(RULES).unwrap();
        let c = who("u1", &[], json!({"customer_id": 42}));
        let mut given = BTreeMap::new();
        a.bind_query(Some(&c), "totals", "by_customer", &mut given).unwrap();
        assert_eq!(given["customer"], "42");
        let mut same = BTreeMap::from([("customer".to_string(), "42".to_string())]);
        assert!(a.bind_query(Some(&c), "totals", "by_customer", &mut same).is_ok());
        let mut other = BTreeMap::from([("customer".to_string(), "7".to_string())]);
        assert!(a.bind_query(Some(&c), "totals", "by_customer", &mut other).is_err());
        assert!(a.bind_query(Some(&c), "totals", "top", &mut BTreeMap::new()).is_err(), "not covered");
    }

    #[test]
    fn rules_are_checked_against_the_configuration() {
        for (bad, says) in [
            ("[[rules]]\nname = \"r\"\nallow = [\"write\"]\ntopics = [\"nope\"]\n", "no model receives"),
            ("[[rules]]\nname = \"r\"\nallow = [\"read\"]\nmodels = [\"nope\"]\n", "not a configured model"),
            ("[[rules]]\nname = \"r\"\nallow = [\"read\"]\n", "models is needed"),
            ("[[rules]]\nname = \"r\"\nallow = []\n", "allow must name"),
            ("[[rules]]\nname = \"r\"\nallow = [\"read\"]\nmodels = [\"totals\"]\nkey = \"{nope}\"\n", "{sub}"),
            ("[[rules]]\nname = \"r\"\nallow = [\"query\"]\nmodels = [\"totals\"]\nqueries = [\"x\"]\n", "does not have"),
            ("[[rules]]\nname = \"r\"\nallow = [\"query\"]\nmodels = [\"totals\"]\nparams = { x = \"{sub}\" }\n", "no parameter"),
            ("[[rules]]\nname = \"r\"\nallow = [\"query\"]\nmodels = [\"totals\"]\nkey = \"{sub}\"\n", "params.NAME"),
            (
                "[[rules]]\nname = \"r\"\nallow = [\"read\"]\nmodels = [\"totals\"]\n[[rules]]\nname = \"r\"\nallow = [\"read\"]\nmodels = [\"totals\"]\n",
                "another rule",
            ),
        ] {
            let err = format!("{:#}", access(bad).unwrap_err());
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn templates() {
        let t = Template::parse("{claim.tenant}:{sub}:{{x}}").unwrap();
        assert_eq!(t.render(&who("a", &[], json!({"tenant": "t"}))).unwrap(), "t:a:{x}");
        assert!(Template::parse("{oops").is_err());
        assert!(Template::parse("x}").is_err());
        let pointer = Template::parse("{claim./org/id}").unwrap();
        assert_eq!(pointer.render(&who("a", &[], json!({"org": {"id": "o1"}}))).unwrap(), "o1");
    }
}
