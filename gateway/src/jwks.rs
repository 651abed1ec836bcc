//! The keys bearer JWTs are checked with ([`crate::identity`]): a JWKS fetched from the
//! identity provider's URL, or a JWKS file, a PEM public key file, or an HS256 secret file.
//!
//! A URL's set is fetched at start, then again when its cache lifetime ends (the server's
//! `Cache-Control: max-age`, within `jwks_min_refresh_ms` and `jwks_max_age_s`; without one,
//! `jwks_max_age_s`), and when a token names a `kid` the set lacks — at most once per
//! `jwks_min_refresh_ms`, however many such tokens arrive. A fetch that fails keeps the last
//! good set, and is logged and counted (`parsley_gateway_jwks_fetches_total{result="error"}`);
//! until a first set arrives, requests with a JWT are answered `503` (the credential may be
//! good) and `/readyz` says why. A file is re-read like the token keys: when it changes
//! (checked every `token_keys_reload_ms`) and on `SIGHUP`; a file that no longer parses keeps
//! the set in use.
//!
//! Every set change bumps [`KeyStore::generation`], which empties the verified-token cache.

use std::collections::BTreeMap;
use std::fmt;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context as _};
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::metrics::{Metric, Metrics};

/// Shortest HS256 secret accepted, in bytes (the hash's size, RFC 7518 §3.2).
pub const MIN_SECRET_LEN: usize = 32;
/// Largest JWKS document read, in bytes.
pub const MAX_JWKS_BYTES: usize = 1 << 20;

/// The kind of key, which decides the algorithms it can check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Hmac,
    Rsa,
    /// P-256 (ES256).
    Ec,
    /// Ed25519 (EdDSA).
    Ed,
}

impl Family {
    /// Whether a key of this family checks `alg`.
    pub fn checks(self, alg: Algorithm) -> bool {
        use Algorithm as A;
        match self {
            Family::Hmac => matches!(alg, A::HS256),
            Family::Rsa => matches!(alg, A::RS256 | A::PS256),
            Family::Ec => matches!(alg, A::ES256),
            Family::Ed => matches!(alg, A::EdDSA),
        }
    }
}

/// One verification key.
#[derive(Clone)]
pub struct Key {
    pub kid: Option<String>,
    /// The JWK's `alg`, when it names one: the only algorithm the key checks then.
    pub alg: Option<Algorithm>,
    pub family: Family,
    pub decoding: DecodingKey,
}

impl Key {
    /// Whether this key may check a token signed with `alg`.
    pub fn checks(&self, alg: Algorithm) -> bool {
        self.family.checks(alg) && self.alg.is_none_or(|a| a == alg)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key").field("kid", &self.kid).field("alg", &self.alg).field("family", &self.family).finish()
    }
}

/// A set of verification keys.
#[derive(Clone, Debug, Default)]
pub struct KeySet {
    pub keys: Vec<Key>,
}

impl KeySet {
    /// The key named `kid`; a set of one unnamed key (a PEM file without `pem_kid`, a
    /// secret) answers any `kid` with it.
    pub fn by_kid(&self, kid: &str) -> Option<&Key> {
        match self.keys.as_slice() {
            [only] if only.kid.is_none() => Some(only),
            keys => keys.iter().find(|k| k.kid.as_deref() == Some(kid)),
        }
    }

    /// For a token without `kid`: the one key that checks `alg`, if exactly one does.
    pub fn only_for(&self, alg: Algorithm) -> Option<&Key> {
        let mut fitting = self.keys.iter().filter(|k| k.checks(alg));
        match (fitting.next(), fitting.next()) {
            (Some(k), None) => Some(k),
            _ => None,
        }
    }

    /// The key ids, for logs and `/v1/status`.
    pub fn kids(&self) -> Vec<String> {
        self.keys.iter().map(|k| k.kid.clone().unwrap_or_else(|| "(no kid)".into())).collect()
    }
}

/// The algorithm a JWK's `alg` names, if this gateway checks it.
fn algorithm_named(name: &str) -> Option<Algorithm> {
    Some(match name {
        "HS256" => Algorithm::HS256,
        "RS256" => Algorithm::RS256,
        "PS256" => Algorithm::PS256,
        "ES256" => Algorithm::ES256,
        "EdDSA" => Algorithm::EdDSA,
        _ => return None,
    })
}

/// The algorithms `gateway.auth.algorithms` may name, in the order documented.
pub const ALGORITHMS: [&str; 5] = ["RS256", "PS256", "ES256", "EdDSA", "HS256"];

/// Parses a configured algorithm name.
pub fn parse_algorithm(name: &str) -> anyhow::Result<Algorithm> {
    algorithm_named(name).with_context(|| format!("{name:?} is not one of {}", ALGORITHMS.join(", ")))
}

/// Parses a JWKS document. Keys for encryption (`use: enc`), of other types or curves, or
/// with an algorithm this gateway does not check are skipped (and named in the log); a set
/// with no usable key is an error.
pub fn parse_jwks(bytes: &[u8]) -> anyhow::Result<KeySet> {
    if bytes.len() > MAX_JWKS_BYTES {
        bail!("the JWKS is larger than {MAX_JWKS_BYTES} bytes");
    }
    // Parsed key by key, so one key of a type this gateway does not know skips that key
    // rather than the whole set.
    let raw: serde_json::Value = serde_json::from_slice(bytes).context("the JWKS is not JSON")?;
    let entries = raw.get("keys").and_then(|k| k.as_array()).context("the JWKS has no \"keys\" array")?;
    let mut keys = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        let parsed: Result<JwkSet, _> = serde_json::from_value(serde_json::json!({ "keys": [entry] }));
        let Some(jwk) = parsed.ok().and_then(|mut s| s.keys.pop()) else {
            tracing::warn!(index = i, "a JWKS key of an unknown type or malformed is skipped");
            continue;
        };
        let kid = jwk.common.key_id.clone();
        if matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption)) {
            continue;
        }
        let alg = match entry.get("alg").and_then(|a| a.as_str()) {
            None => None,
            Some(name) => match algorithm_named(name) {
                Some(a) => Some(a),
                None => {
                    tracing::warn!(kid = ?kid, alg = name, "a JWKS key for an algorithm this gateway does not check is skipped");
                    continue;
                }
            },
        };
        let family = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => Family::Rsa,
            AlgorithmParameters::EllipticCurve(p) if p.curve == EllipticCurve::P256 => Family::Ec,
            AlgorithmParameters::OctetKeyPair(p) if p.curve == EllipticCurve::Ed25519 => Family::Ed,
            AlgorithmParameters::OctetKey(_) => Family::Hmac,
            _ => {
                tracing::warn!(kid = ?kid, "a JWKS key on a curve this gateway does not check is skipped");
                continue;
            }
        };
        if alg.is_some_and(|a| !family.checks(a)) {
            tracing::warn!(kid = ?kid, "a JWKS key whose alg does not fit its key type is skipped");
            continue;
        }
        let decoding = match DecodingKey::from_jwk(&jwk) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(kid = ?kid, error = %e, "a JWKS key that does not decode is skipped");
                continue;
            }
        };
        keys.push(Key { kid, alg, family, decoding });
    }
    if keys.is_empty() {
        bail!("the JWKS has no key this gateway can check signatures with");
    }
    Ok(KeySet { keys })
}

/// Parses a PEM public key (RSA, P-256 or Ed25519, `-----BEGIN PUBLIC KEY-----`); `kid`
/// names it for tokens that carry one.
pub fn parse_pem(bytes: &[u8], kid: Option<String>) -> anyhow::Result<KeySet> {
    type Parse = fn(&[u8]) -> jsonwebtoken::errors::Result<DecodingKey>;
    let attempts: [(Family, Parse); 3] = [
        (Family::Rsa, DecodingKey::from_rsa_pem),
        (Family::Ec, DecodingKey::from_ec_pem),
        (Family::Ed, DecodingKey::from_ed_pem),
    ];
    for (family, parse) in attempts {
        if let Ok(decoding) = parse(bytes) {
            return Ok(KeySet { keys: vec![Key { kid, alg: None, family, decoding }] });
        }
    }
    bail!("not a PEM public key of RSA, P-256 or Ed25519 (-----BEGIN PUBLIC KEY-----)")
}

/// An HS256 secret, taken byte for byte (no trimming: a trailing newline is part of it).
pub fn parse_secret(bytes: &[u8]) -> anyhow::Result<KeySet> {
    if bytes.len() < MIN_SECRET_LEN {
        bail!("an HS256 secret must be at least {MIN_SECRET_LEN} bytes, got {}", bytes.len());
    }
    Ok(KeySet {
        keys: vec![Key {
            kid: None,
            alg: Some(Algorithm::HS256),
            family: Family::Hmac,
            decoding: DecodingKey::from_secret(bytes),
        }],
    })
}

/// Where the keys come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Url(String),
    JwksFile(PathBuf),
    PemFile { path: PathBuf, kid: Option<String> },
    SecretFile(PathBuf),
}

impl Source {
    fn file(&self) -> Option<&Path> {
        match self {
            Source::Url(_) => None,
            Source::JwksFile(p) | Source::SecretFile(p) | Source::PemFile { path: p, .. } => Some(p),
        }
    }

    /// Reads a file source.
    fn read_file(&self) -> anyhow::Result<KeySet> {
        let path = self.file().expect("a file source");
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let set = match self {
            Source::JwksFile(_) => parse_jwks(&bytes),
            Source::PemFile { kid, .. } => parse_pem(&bytes, kid.clone()),
            Source::SecretFile(_) => parse_secret(&bytes),
            Source::Url(_) => unreachable!("not a file"),
        };
        set.with_context(|| format!("{} is invalid", path.display()))
    }
}

/// How often keys from a URL are fetched.
#[derive(Clone, Copy, Debug)]
pub struct Refresh {
    /// At most one fetch for unknown `kid`s per this, and the shortest cache lifetime.
    pub min: Duration,
    /// The cache lifetime without a `max-age`, and the longest.
    pub max: Duration,
    /// One fetch's timeout.
    pub timeout: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn stamp(path: &Path) -> Option<FileStamp> {
    let m = std::fs::metadata(path).ok()?;
    Some(FileStamp { modified: m.modified().ok(), len: m.len(), inode: m.ino() })
}

/// The keys in use, shared by every request.
pub struct KeyStore {
    source: Source,
    refresh: Refresh,
    current: RwLock<Option<Arc<KeySet>>>,
    generation: AtomicU64,
    /// The last fetch for an unknown `kid` (the rate-limited kind), and the lock every
    /// fetch holds: one fetch at a time.
    fetched: tokio::sync::Mutex<Option<Instant>>,
    /// When the current set's cache lifetime ends (URL only).
    expires: Mutex<Option<Instant>>,
    /// The last fetch's or read's error, until one succeeds.
    last_error: Mutex<Option<String>>,
    seen: Mutex<Option<FileStamp>>,
    http: Option<reqwest::Client>,
    metrics: Mutex<Option<Arc<Metrics>>>,
}

impl fmt::Debug for KeyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyStore")
            .field("source", &self.source)
            .field("kids", &self.current().map(|s| s.kids()))
            .finish()
    }
}

impl KeyStore {
    /// A store reading `source`. A file is read now (an error refuses the configuration); a
    /// URL is fetched by [`KeyStore::start`].
    pub fn new(source: Source, refresh: Refresh) -> anyhow::Result<KeyStore> {
        let (current, seen, http) = match &source {
            Source::Url(_) => {
                let http = reqwest::Client::builder()
                    .timeout(refresh.timeout)
                    .connect_timeout(refresh.timeout)
                    .redirect(reqwest::redirect::Policy::limited(3))
                    .build()
                    .context("building the JWKS client")?;
                (None, None, Some(http))
            }
            file => (Some(Arc::new(file.read_file()?)), stamp(file.file().expect("a file")), None),
        };
        Ok(KeyStore {
            source,
            refresh,
            current: RwLock::new(current),
            generation: AtomicU64::new(0),
            fetched: tokio::sync::Mutex::new(None),
            expires: Mutex::new(None),
            last_error: Mutex::new(None),
            seen: Mutex::new(seen),
            http,
            metrics: Mutex::new(None),
        })
    }

    pub fn source(&self) -> &Source {
        &self.source
    }

    /// The set in use; `None` until a URL's first fetch succeeds.
    pub fn current(&self) -> Option<Arc<KeySet>> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Bumped at every change of the set.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Why there is no set yet, or why the last fetch failed.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn install(&self, set: KeySet) {
        tracing::info!(source = ?self.source, kids = %set.kids().join(","), "token verification keys loaded");
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(set));
        self.generation.fetch_add(1, Ordering::AcqRel);
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn count(&self, result: &str) {
        if let Some(m) = self.metrics.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            m.add(Metric::JwksFetchesTotal, &[("result", result)], 1.0);
        }
    }

    fn failed(&self, what: &str, e: &anyhow::Error) {
        self.count("error");
        let kept = self.current().map(|s| s.kids().join(","));
        tracing::warn!(source = ?self.source, error = %format!("{e:#}"), kept = ?kept, "{what} failed; the keys in use are kept");
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{e:#}"));
    }

    /// Fetches the URL's set now. A fetch for an unknown `kid` (`timed` false) is skipped
    /// when another such fetch started less than the minimum refresh interval ago; the
    /// timed fetches (at start, at the end of the cache lifetime) do not count against it, so
    /// a key the provider just started signing with is fetched on first sight. Returns
    /// whether a set was installed.
    pub async fn fetch(&self, timed: bool) -> bool {
        let (Source::Url(url), Some(http)) = (&self.source, &self.http) else { return false };
        let mut last = self.fetched.lock().await;
        if !timed {
            if last.is_some_and(|at| at.elapsed() < self.refresh.min) {
                return false;
            }
            *last = Some(Instant::now());
        }
        match fetch_jwks(http, url).await {
            Ok((set, max_age)) => {
                self.count("ok");
                let lifetime = max_age.unwrap_or(self.refresh.max).clamp(self.refresh.min, self.refresh.max);
                *self.expires.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + lifetime);
                self.install(set);
                true
            }
            Err(e) => {
                self.failed("fetching the JWKS", &e);
                false
            }
        }
    }

    /// For a token naming a `kid` the set lacks: fetches again (rate limited) and returns
    /// the set then in use.
    pub async fn refresh_for_unknown_kid(&self) -> Option<Arc<KeySet>> {
        self.fetch(false).await;
        self.current()
    }

    /// Re-reads a file source now.
    pub fn reload_file(&self, why: &str) {
        let Some(path) = self.source.file() else { return };
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = stamp(path);
        match self.source.read_file() {
            Ok(set) => {
                self.count("ok");
                tracing::info!(why, "token verification keys re-read");
                self.install(set);
            }
            Err(e) => self.failed("re-reading the verification keys", &e),
        }
    }

    fn file_changed(&self) -> bool {
        match self.source.file() {
            Some(path) => stamp(path) != *self.seen.lock().unwrap_or_else(|e| e.into_inner()),
            None => false,
        }
    }

    /// The background task: a URL's first fetch and its timed refreshes (retrying every
    /// minimum interval while none succeeded), or a file's reloads (on change, checked every
    /// `poll`, and on `SIGHUP`). Stops when `shutdown` turns true.
    pub fn spawn(
        self: &Arc<Self>,
        metrics: Arc<Metrics>,
        poll: Duration,
        mut shutdown: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        *self.metrics.lock().unwrap_or_else(|e| e.into_inner()) = Some(metrics);
        let store = Arc::clone(self);
        if matches!(store.source, Source::Url(_)) {
            return tokio::spawn(async move {
                let mut first = true;
                loop {
                    let due = *store.expires.lock().unwrap_or_else(|e| e.into_inner());
                    let wait = match (due, store.current()) {
                        (Some(at), Some(_)) => at.saturating_duration_since(Instant::now()),
                        // The first fetch at once; while none succeeded, again every
                        // minimum interval.
                        _ if first => Duration::ZERO,
                        _ => store.refresh.min,
                    };
                    first = false;
                    tokio::select! {
                        _ = shutdown.wait_for(|s| *s) => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                    store.fetch(true).await;
                }
            });
        }
        // Like the token keys: a change seen by polling, or a SIGHUP.
        let mut hangups = signal(SignalKind::hangup()).ok();
        tokio::spawn(async move {
            loop {
                let tick = async {
                    if poll.is_zero() {
                        std::future::pending::<()>().await
                    } else {
                        tokio::time::sleep(poll).await
                    }
                };
                let hangup = async {
                    match hangups.as_mut() {
                        Some(h) => {
                            h.recv().await;
                        }
                        None => std::future::pending::<()>().await,
                    }
                };
                tokio::select! {
                    _ = shutdown.wait_for(|s| *s) => return,
                    _ = hangup => store.reload_file("SIGHUP"),
                    _ = tick => {
                        if store.file_changed() {
                            store.reload_file("file changed");
                        }
                    }
                }
            }
        })
    }
}

/// GETs a JWKS and its cache lifetime (`Cache-Control: max-age`).
async fn fetch_jwks(http: &reqwest::Client, url: &str) -> anyhow::Result<(KeySet, Option<Duration>)> {
    let response = http.get(url).header("accept", "application/json").send().await.context("the request failed")?;
    let status = response.status();
    if !status.is_success() {
        bail!("the JWKS endpoint answered {status}");
    }
    let max_age = response.headers().get_all("cache-control").iter().find_map(|v| max_age(v.to_str().ok()?));
    if response.content_length().is_some_and(|n| n > MAX_JWKS_BYTES as u64) {
        bail!("the JWKS is larger than {MAX_JWKS_BYTES} bytes");
    }
    let bytes = response.bytes().await.context("reading the JWKS")?;
    Ok((parse_jwks(&bytes)?, max_age))
}

/// The `max-age` of a `Cache-Control` value (`no-store` and `no-cache`: zero).
pub fn max_age(value: &str) -> Option<Duration> {
    let mut found = None;
    for directive in value.split(',').map(str::trim) {
        let lower = directive.to_ascii_lowercase();
        if lower == "no-store" || lower == "no-cache" {
            return Some(Duration::ZERO);
        }
        if let Some(n) = lower.strip_prefix("max-age=") {
            found = n.trim_matches('"').parse::<u64>().ok().map(Duration::from_secs);
        }
    }
    found
}

/// The key sources' names for `/v1/status`.
pub fn describe(source: &Source) -> BTreeMap<&'static str, String> {
    let mut out = BTreeMap::new();
    match source {
        Source::Url(u) => out.insert("jwks_url", u.clone()),
        Source::JwksFile(p) => out.insert("jwks_file", p.display().to_string()),
        Source::PemFile { path, .. } => out.insert("pem_file", path.display().to_string()),
        Source::SecretFile(p) => out.insert("hs256_secret_file", p.display().to_string()),
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jwt").join(name)).unwrap()
    }

    #[test]
    fn a_jwks_keeps_the_keys_it_can_check_and_skips_the_rest() {
        let rsa: serde_json::Value = serde_json::from_slice(&fixture("rsa-1.jwk.json")).unwrap();
        let ec: serde_json::Value = serde_json::from_slice(&fixture("ec-1.jwk.json")).unwrap();
        let ed: serde_json::Value = serde_json::from_slice(&fixture("ed-1.jwk.json")).unwrap();
        let mut enc = rsa.clone();
        enc["use"] = "enc".into();
        enc["kid"] = "enc".into();
        let unknown = serde_json::json!({"kty": "XYZ", "kid": "odd"});
        let mut wrong_alg = ec.clone();
        wrong_alg["alg"] = "RS256".into();
        wrong_alg["kid"] = "confused".into();
        let doc = serde_json::json!({"keys": [rsa, ec, ed, enc, unknown, wrong_alg]});
        let set = parse_jwks(doc.to_string().as_bytes()).unwrap();
        assert_eq!(set.kids(), ["rsa-1", "ec-1", "ed-1"]);
        assert!(set.by_kid("rsa-1").unwrap().checks(Algorithm::RS256));
        assert!(set.by_kid("rsa-1").unwrap().checks(Algorithm::PS256));
        assert!(!set.by_kid("rsa-1").unwrap().checks(Algorithm::HS256), "an RSA key never checks an HMAC");
        assert!(set.by_kid("ec-1").unwrap().checks(Algorithm::ES256));
        assert!(!set.by_kid("ed-1").unwrap().checks(Algorithm::ES256));
        assert!(parse_jwks(br#"{"keys": []}"#).is_err());
        assert!(parse_jwks(b"not json").is_err());
        assert!(parse_jwks(br#"{"keys": [{"kty": "XYZ"}]}"#).is_err());
    }

    #[test]
    fn pem_keys_and_secrets() {
        assert_eq!(parse_pem(&fixture("rsa-1.pub.pem"), None).unwrap().keys[0].family, Family::Rsa);
        assert_eq!(parse_pem(&fixture("ec-1.pub.pem"), None).unwrap().keys[0].family, Family::Ec);
        assert_eq!(parse_pem(&fixture("ed-1.pub.pem"), Some("k".into())).unwrap().keys[0].family, Family::Ed);
        assert!(parse_pem(b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", None).is_err());
        assert!(parse_secret(b"short").is_err());
        assert!(parse_secret(&[7u8; 32]).is_ok());
    }

    #[test]
    fn cache_control_gives_the_lifetime() {
        assert_eq!(max_age("public, max-age=600"), Some(Duration::from_secs(600)));
        assert_eq!(max_age("Max-Age=\"60\", must-revalidate"), Some(Duration::from_secs(60)));
        assert_eq!(max_age("no-store"), Some(Duration::ZERO));
        assert_eq!(max_age("public"), None);
    }
}
