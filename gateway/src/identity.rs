//! Who is calling: the bearer JWT of a request (`Authorization: Bearer <jwt>`), checked with
//! the identity provider's keys ([`crate::jwks`]) by `jsonwebtoken`, and the [`Identity`] it
//! names — subject, scopes and every claim — for the authorization rules
//! ([`crate::access`]) and the session binding.
//!
//! The token's `alg` must be one of `gateway.auth.algorithms` and one the chosen key can
//! check (an RSA key never checks an HMAC, whatever the token says; `none` is no algorithm).
//! The key is the one its `kid` names — an unknown `kid` fetches the JWKS again, rate
//! limited — or, without a `kid`, the one key that checks the algorithm. Then `iss` and
//! `aud` must be the configured ones, `exp` is required, `nbf` and `iat` are honoured with
//! the leeway (`gateway.token_clock_skew_s`), and `exp` may lie at most
//! `max_jwt_lifetime_s` after `iat` (after now, without `iat`).
//!
//! A verified token is kept (by its text, until its `exp` or until the keys change) so that
//! a client sending the same JWT on every request pays for one signature check.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{header, HeaderMap};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use jsonwebtoken::{Algorithm, Validation};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::jwks::{self, KeySet, KeyStore, Refresh, Source};

/// Longest JWT accepted, in characters.
pub const MAX_JWT_LEN: usize = 8192;
/// Longest subject a session can be bound to (the envelope stores its length in one byte).
pub const MAX_SUBJECT_LEN: usize = 255;
/// Most verified tokens kept; the cache is emptied when full.
pub const VERIFIED_CACHE: usize = 16_384;

/// `[gateway.auth]`: where the keys come from and what a token must say.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AuthSettings {
    /// The `iss` every token must carry (required).
    pub issuer: String,
    /// The audience every token's `aud` must name (required).
    pub audience: String,
    /// The identity provider's JWKS URL (`https://idp.example.com/.well-known/jwks.json`).
    pub jwks_url: Option<String>,
    /// A JWKS file (re-read when it changes and on SIGHUP).
    pub jwks_file: Option<std::path::PathBuf>,
    /// A PEM public key file (RSA, P-256 or Ed25519).
    pub pem_file: Option<std::path::PathBuf>,
    /// The `kid` of the PEM file's key (absent: the key checks tokens whatever their `kid`).
    pub pem_kid: Option<String>,
    /// A file holding an HS256 secret, taken byte for byte (at least 32 bytes).
    pub hs256_secret_file: Option<std::path::PathBuf>,
    /// The algorithms accepted; default: RS256, PS256, ES256 and EdDSA for public keys,
    /// HS256 for a secret.
    #[serde(default)]
    pub algorithms: Vec<String>,
    /// At most one JWKS fetch for unknown `kid`s per this many milliseconds; also the
    /// shortest cache lifetime.
    #[serde(default = "default_min_refresh_ms")]
    pub jwks_min_refresh_ms: u64,
    /// The JWKS cache lifetime when the server gives none, and the longest, in seconds.
    #[serde(default = "default_jwks_max_age_s")]
    pub jwks_max_age_s: u64,
    /// One JWKS fetch's timeout.
    #[serde(default = "default_jwks_timeout_ms")]
    pub jwks_timeout_ms: u64,
    /// The longest a token may be valid for (`exp` − `iat`), in seconds.
    #[serde(default = "default_max_jwt_lifetime_s")]
    pub max_jwt_lifetime_s: u64,
}

fn default_min_refresh_ms() -> u64 {
    10_000
}
fn default_jwks_max_age_s() -> u64 {
    3_600
}
fn default_jwks_timeout_ms() -> u64 {
    5_000
}
fn default_max_jwt_lifetime_s() -> u64 {
    86_400
}

impl AuthSettings {
    /// The key source; exactly one must be named.
    pub fn source(&self) -> anyhow::Result<Source> {
        let mut named = Vec::new();
        if let Some(url) = &self.jwks_url {
            named.push(Source::Url(url.clone()));
        }
        if let Some(p) = &self.jwks_file {
            named.push(Source::JwksFile(p.clone()));
        }
        if let Some(p) = &self.pem_file {
            named.push(Source::PemFile { path: p.clone(), kid: self.pem_kid.clone() });
        }
        if let Some(p) = &self.hs256_secret_file {
            named.push(Source::SecretFile(p.clone()));
        }
        match named.len() {
            1 => Ok(named.pop().expect("one")),
            0 => anyhow::bail!(
                "gateway.auth needs one of jwks_url, jwks_file, pem_file or hs256_secret_file (where the keys are)"
            ),
            _ => anyhow::bail!("gateway.auth names more than one of jwks_url, jwks_file, pem_file, hs256_secret_file"),
        }
    }

    /// The accepted algorithms.
    pub fn algorithms(&self) -> anyhow::Result<Vec<Algorithm>> {
        if self.algorithms.is_empty() {
            return Ok(match self.source()? {
                Source::SecretFile(_) => vec![Algorithm::HS256],
                _ => vec![Algorithm::RS256, Algorithm::PS256, Algorithm::ES256, Algorithm::EdDSA],
            });
        }
        let algs: Vec<Algorithm> =
            self.algorithms.iter().map(|a| jwks::parse_algorithm(a)).collect::<anyhow::Result<_>>()?;
        let hmac = algs.contains(&Algorithm::HS256);
        let secret = matches!(self.source()?, Source::SecretFile(_));
        if hmac && algs.len() > 1 {
            anyhow::bail!("HS256 cannot be accepted together with public-key algorithms (one key would check both)");
        }
        if hmac != secret {
            anyhow::bail!("HS256 goes with hs256_secret_file, and the public-key algorithms with the other sources");
        }
        Ok(algs)
    }

    /// Checks what serde cannot; every message names the key.
    pub fn validate(&self) -> anyhow::Result<()> {
        use anyhow::Context as _;
        if self.issuer.trim().is_empty() {
            anyhow::bail!("gateway.auth.issuer must not be empty");
        }
        if self.audience.trim().is_empty() {
            anyhow::bail!("gateway.auth.audience must not be empty");
        }
        if let Some(url) = &self.jwks_url {
            let parsed = reqwest::Url::parse(url).with_context(|| format!("gateway.auth.jwks_url {url:?}"))?;
            if !matches!(parsed.scheme(), "https" | "http") {
                anyhow::bail!("gateway.auth.jwks_url {url:?} must be http:// or https://");
            }
            if parsed.scheme() == "http" && !parsed.host_str().is_some_and(is_loopback_or_local) {
                tracing::warn!(url, "gateway.auth.jwks_url is plain http: the keys can be replaced in transit");
            }
        }
        self.source().context("gateway.auth")?;
        self.algorithms().context("gateway.auth.algorithms")?;
        if self.jwks_min_refresh_ms == 0 || self.jwks_timeout_ms == 0 {
            anyhow::bail!("gateway.auth.jwks_min_refresh_ms and gateway.auth.jwks_timeout_ms must be at least 1");
        }
        if self.jwks_max_age_s * 1000 < self.jwks_min_refresh_ms {
            anyhow::bail!("gateway.auth.jwks_max_age_s must not be shorter than gateway.auth.jwks_min_refresh_ms");
        }
        if self.max_jwt_lifetime_s == 0 {
            anyhow::bail!("gateway.auth.max_jwt_lifetime_s must be at least 1");
        }
        Ok(())
    }

    pub fn refresh(&self) -> Refresh {
        Refresh {
            min: Duration::from_millis(self.jwks_min_refresh_ms),
            max: Duration::from_secs(self.jwks_max_age_s),
            timeout: Duration::from_millis(self.jwks_timeout_ms),
        }
    }
}

fn is_loopback_or_local(host: &str) -> bool {
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// A verified caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The `sub` claim.
    pub subject: String,
    /// The `scope` (space-separated) and `scp` (a list, or space-separated) claims.
    pub scopes: BTreeSet<String>,
    /// Every claim, as the token carried it.
    pub claims: Map<String, Value>,
    /// `exp`, unix seconds.
    pub expires_at: u64,
    /// `nbf`, if any.
    pub not_before: Option<u64>,
}

impl Identity {
    /// The claim at `name`: a JSON pointer when it starts with `/` (`/realm_access/roles`),
    /// else the top-level claim of that exact name (which may hold dots, like
    /// `https://example.com/tenant`).
    pub fn claim(&self, name: &str) -> Option<&Value> {
        if name == "sub" {
            return self.claims.get("sub");
        }
        if let Some(pointer) = name.strip_prefix('/') {
            let mut at: Option<&Value> = None;
            for (i, part) in pointer.split('/').enumerate() {
                let part = part.replace("~1", "/").replace("~0", "~");
                at = if i == 0 {
                    self.claims.get(&part)
                } else {
                    match at? {
                        Value::Object(m) => m.get(&part),
                        Value::Array(a) => part.parse::<usize>().ok().and_then(|i| a.get(i)),
                        _ => None,
                    }
                };
            }
            return at;
        }
        self.claims.get(name)
    }
}

/// Why a request's credential was refused: each is answered `401` with
/// `WWW-Authenticate: Bearer error="invalid_token"`, and this as the detail (never the
/// token).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("this route needs a bearer token: send Authorization: Bearer <JWT>")]
    Missing,
    #[error("more than one Authorization header")]
    Repeated,
    #[error("the bearer token is not a JWT: {0}")]
    Malformed(String),
    #[error("the bearer token's alg {0:?} is not accepted here")]
    Algorithm(String),
    #[error("no key of this gateway is named by the bearer token's kid {0:?}")]
    UnknownKey(String),
    #[error("the bearer token has no kid, and no single key checks {0}")]
    NoKey(String),
    #[error("the bearer token's signature does not verify")]
    BadSignature,
    #[error("the bearer token expired at {exp} (now {now})")]
    Expired { exp: u64, now: u64 },
    #[error("the bearer token is not valid before {nbf} (now {now})")]
    NotYetValid { nbf: u64, now: u64 },
    #[error("the bearer token was issued in the future ({iat}, now {now})")]
    IssuedInFuture { iat: u64, now: u64 },
    #[error("the bearer token is valid for {lifetime} s, longer than the {max} s this gateway accepts")]
    TooLong { lifetime: u64, max: u64 },
    #[error("the bearer token's {0} claim is missing or not what this gateway accepts")]
    Claim(&'static str),
    /// Not the caller's fault: no key set could be had yet (answered `503`).
    #[error("the identity provider's keys are unavailable: {0}")]
    KeysUnavailable(String),
}

/// Checks bearer JWTs.
pub struct Verifier {
    issuer: String,
    audience: String,
    algorithms: Vec<Algorithm>,
    leeway_s: u64,
    max_lifetime_s: u64,
    pub keys: Arc<KeyStore>,
    /// Verified tokens by text, with the key generation they were checked under.
    verified: Mutex<(u64, HashMap<String, Arc<Identity>>)>,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier")
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("algorithms", &self.algorithms)
            .field("keys", &self.keys)
            .finish()
    }
}

impl Verifier {
    /// A verifier of `settings` (validated), with the clocks' leeway.
    pub fn new(settings: &AuthSettings, leeway_s: u64) -> anyhow::Result<Verifier> {
        settings.validate()?;
        let keys = Arc::new(KeyStore::new(settings.source()?, settings.refresh())?);
        Ok(Verifier {
            issuer: settings.issuer.clone(),
            audience: settings.audience.clone(),
            algorithms: settings.algorithms()?,
            leeway_s,
            max_lifetime_s: settings.max_jwt_lifetime_s,
            keys,
            verified: Mutex::new((0, HashMap::new())),
        })
    }

    /// The identity of the request's bearer JWT, verified at `now` (unix seconds).
    pub async fn identify(&self, headers: &HeaderMap, now: u64) -> Result<Arc<Identity>, AuthError> {
        let jwt = bearer(headers)?;
        self.verify(jwt, now).await
    }

    /// The identity `jwt` names once its algorithm, key, signature, times and claims check.
    pub async fn verify(&self, jwt: &str, now: u64) -> Result<Arc<Identity>, AuthError> {
        if jwt.len() > MAX_JWT_LEN {
            return Err(AuthError::Malformed(format!("longer than {MAX_JWT_LEN} characters")));
        }
        let generation = self.keys.generation();
        let kept = {
            let cache = self.verified.lock().unwrap_or_else(|e| e.into_inner());
            if cache.0 == generation {
                cache.1.get(jwt).cloned()
            } else {
                None
            }
        };
        if let Some(identity) = kept {
            self.check_times(identity.expires_at, identity.not_before, now)?;
            return Ok(identity);
        }
        let identity = Arc::new(self.verify_uncached(jwt, now).await?);
        let mut cache = self.verified.lock().unwrap_or_else(|e| e.into_inner());
        if cache.0 != generation || cache.1.len() >= VERIFIED_CACHE {
            *cache = (generation, HashMap::new());
        }
        cache.1.insert(jwt.to_string(), Arc::clone(&identity));
        Ok(identity)
    }

    fn check_times(&self, exp: u64, nbf: Option<u64>, now: u64) -> Result<(), AuthError> {
        if now >= exp.saturating_add(self.leeway_s) {
            return Err(AuthError::Expired { exp, now });
        }
        if let Some(nbf) = nbf {
            if now.saturating_add(self.leeway_s) < nbf {
                return Err(AuthError::NotYetValid { nbf, now });
            }
        }
        Ok(())
    }

    async fn verify_uncached(&self, jwt: &str, now: u64) -> Result<Identity, AuthError> {
        let malformed = |what: &str| AuthError::Malformed(what.to_string());
        let mut parts = jwt.split('.');
        let (Some(head), Some(_), Some(_), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(malformed("not three dot-separated parts"));
        };
        let raw_header: Map<String, Value> = URL_SAFE_NO_PAD
            .decode(head)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| malformed("the header is not base64url of a JSON object"))?;
        let alg_name = raw_header.get("alg").and_then(Value::as_str).unwrap_or_default();
        let alg = jwks::parse_algorithm(alg_name)
            .ok()
            .filter(|a| self.algorithms.contains(a))
            .ok_or_else(|| AuthError::Algorithm(alg_name.to_string()))?;
        if raw_header.contains_key("crit") {
            return Err(malformed("the header has critical extensions (crit), which are not supported"));
        }
        let kid = match raw_header.get("kid") {
            None => None,
            Some(Value::String(k)) => Some(k.as_str()),
            Some(_) => return Err(malformed("the header's kid is not a string")),
        };
        let set = match self.keys.current() {
            Some(set) => set,
            None => self.keys.refresh_for_unknown_kid().await.ok_or_else(|| {
                AuthError::KeysUnavailable(self.keys.last_error().unwrap_or_else(|| "not fetched yet".into()))
            })?,
        };
        let set = match kid {
            Some(kid) if set.by_kid(kid).is_none() => {
                // A key the provider may have added since: fetch again (rate limited).
                match self.keys.refresh_for_unknown_kid().await {
                    Some(fresh) if fresh.by_kid(kid).is_some() => fresh,
                    _ => return Err(AuthError::UnknownKey(kid.to_string())),
                }
            }
            _ => set,
        };
        let key = pick(&set, kid, alg)?;
        let mut validation = Validation::new(alg);
        validation.required_spec_claims.clear();
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.validate_aud = false;
        let data = jsonwebtoken::decode::<Map<String, Value>>(jwt, &key.decoding, &validation).map_err(|e| {
            use jsonwebtoken::errors::ErrorKind as K;
            match e.kind() {
                K::InvalidSignature => AuthError::BadSignature,
                K::InvalidAlgorithm => AuthError::Algorithm(alg_name.to_string()),
                _ => AuthError::Malformed(e.to_string()),
            }
        })?;
        // Authentic from here on; the claims still decide.
        let claims = data.claims;
        self.identity_of(claims, now)
    }

    /// The identity of authentic `claims`, once they are what this gateway accepts.
    fn identity_of(&self, claims: Map<String, Value>, now: u64) -> Result<Identity, AuthError> {
        let exp = claims.get("exp").and_then(numeric_date).ok_or(AuthError::Claim("exp"))?;
        let nbf = match claims.get("nbf") {
            None => None,
            Some(v) => Some(numeric_date(v).ok_or(AuthError::Claim("nbf"))?),
        };
        self.check_times(exp, nbf, now)?;
        let iat = match claims.get("iat") {
            None => None,
            Some(v) => Some(numeric_date(v).ok_or(AuthError::Claim("iat"))?),
        };
        if let Some(iat) = iat {
            if iat > now.saturating_add(self.leeway_s) {
                return Err(AuthError::IssuedInFuture { iat, now });
            }
        }
        let lifetime = exp.saturating_sub(iat.unwrap_or(now));
        if lifetime > self.max_lifetime_s {
            return Err(AuthError::TooLong { lifetime, max: self.max_lifetime_s });
        }
        if claims.get("iss").and_then(Value::as_str) != Some(self.issuer.as_str()) {
            return Err(AuthError::Claim("iss"));
        }
        let audience_named = match claims.get("aud") {
            Some(Value::String(a)) => *a == self.audience,
            Some(Value::Array(all)) => all.iter().any(|a| a.as_str() == Some(self.audience.as_str())),
            _ => false,
        };
        if !audience_named {
            return Err(AuthError::Claim("aud"));
        }
        let subject = match claims.get("sub") {
            Some(Value::String(sub))
                if !sub.is_empty() && sub.len() <= MAX_SUBJECT_LEN && !sub.chars().any(char::is_control) =>
            {
                sub.clone()
            }
            _ => return Err(AuthError::Claim("sub")),
        };
        let mut scopes = BTreeSet::new();
        for name in ["scope", "scp"] {
            match claims.get(name) {
                Some(Value::String(s)) => scopes.extend(s.split_ascii_whitespace().map(String::from)),
                Some(Value::Array(all)) => scopes.extend(all.iter().filter_map(Value::as_str).map(String::from)),
                _ => {}
            }
        }
        Ok(Identity { subject, scopes, claims, expires_at: exp, not_before: nbf })
    }
}

/// The key that checks a token of `alg` naming `kid`.
fn pick<'s>(set: &'s KeySet, kid: Option<&str>, alg: Algorithm) -> Result<&'s jwks::Key, AuthError> {
    let key = match kid {
        Some(kid) => set.by_kid(kid).ok_or_else(|| AuthError::UnknownKey(kid.to_string()))?,
        None => set.only_for(alg).ok_or_else(|| AuthError::NoKey(format!("{alg:?}")))?,
    };
    if !key.checks(alg) {
        // An RSA public key offered as an HMAC secret, and its kin.
        return Err(AuthError::Algorithm(format!("{alg:?}")));
    }
    Ok(key)
}

/// The bearer JWT of `headers`.
pub fn bearer(headers: &HeaderMap) -> Result<&str, AuthError> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let value = match (values.next(), values.next()) {
        (None, _) => return Err(AuthError::Missing),
        (Some(_), Some(_)) => return Err(AuthError::Repeated),
        (Some(v), None) => v.as_bytes(),
    };
    let jwt = value
        .split_at_checked(7)
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case(b"bearer "))
        .map(|(_, rest)| rest.trim_ascii())
        .ok_or(AuthError::Missing)?;
    std::str::from_utf8(jwt).map_err(|_| AuthError::Malformed("not text".into()))
}

/// A JWT NumericDate: seconds since the epoch, possibly fractional (truncated); a negative
/// one is the epoch.
fn numeric_date(v: &Value) -> Option<u64> {
    if let Some(n) = v.as_u64() {
        return Some(n);
    }
    let f = v.as_f64().filter(|f| f.is_finite())?;
    Some(if f <= 0.0 { 0 } else { f as u64 })
}

#[cfg(test)]
mod tests {
    use jsonwebtoken::{encode, EncodingKey, Header};
    use serde_json::json;

    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef\n";

    fn settings_with(source: &str, path: &std::path::Path) -> AuthSettings {
        let text = format!(
            "issuer = \"https://idp.test\"\naudience = \"parsley\"\n{source} = {:?}\n",
            path.display().to_string()
        );
        toml::from_str(&text).unwrap()
    }

    fn temp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("parsley-identity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn fixture(name: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jwt").join(name)
    }

    fn claims(sub: &str) -> Value {
        json!({"sub": sub, "iss": "https://idp.test", "aud": "parsley", "exp": 2000, "iat": 1000, "scope": "a b"})
    }

    fn hs(claims: &Value) -> String {
        encode(&Header::new(Algorithm::HS256), claims, &EncodingKey::from_secret(SECRET)).unwrap()
    }

    #[tokio::test]
    async fn hs256_secrets_are_taken_byte_for_byte() {
        let v = Verifier::new(&settings_with("hs256_secret_file", &temp("secret", SECRET)), 0).unwrap();
        let id = v.verify(&hs(&claims("alice")), 1500).await.unwrap();
        assert_eq!(id.subject, "alice");
        assert_eq!(id.scopes, BTreeSet::from(["a".to_string(), "b".to_string()]));
        let trimmed =
            encode(&Header::new(Algorithm::HS256), &claims("alice"), &EncodingKey::from_secret(&SECRET[..32])).unwrap();
        assert_eq!(v.verify(&trimmed, 1500).await, Err(AuthError::BadSignature), "the newline is part of the secret");
    }

    #[tokio::test]
    async fn public_keys_check_their_own_algorithms_only() {
        let v = Verifier::new(&settings_with("pem_file", &fixture("rsa-1.pub.pem")), 0).unwrap();
        let private = std::fs::read(fixture("rsa-1.key.pem")).unwrap();
        for alg in [Algorithm::RS256, Algorithm::PS256] {
            let jwt = encode(&Header::new(alg), &claims("bob"), &EncodingKey::from_rsa_pem(&private).unwrap()).unwrap();
            assert_eq!(v.verify(&jwt, 1500).await.unwrap().subject, "bob");
        }
        // The public key's PEM used as an HMAC secret: refused before any signature check.
        let public = std::fs::read(fixture("rsa-1.pub.pem")).unwrap();
        let confused =
            encode(&Header::new(Algorithm::HS256), &claims("eve"), &EncodingKey::from_secret(&public)).unwrap();
        assert_eq!(v.verify(&confused, 1500).await, Err(AuthError::Algorithm("HS256".into())));
        let none = format!(
            "{}.{}.",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"none"}"#),
            URL_SAFE_NO_PAD.encode(claims("eve").to_string())
        );
        assert_eq!(v.verify(&none, 1500).await, Err(AuthError::Algorithm("none".into())));
    }

    #[tokio::test]
    async fn times_and_claims_are_checked() {
        let v = Verifier::new(&settings_with("hs256_secret_file", &temp("secret2", SECRET)), 30).unwrap();
        let mut c = claims("alice");
        assert!(v.verify(&hs(&c), 2029).await.is_ok(), "inside the leeway");
        assert_eq!(v.verify(&hs(&c), 2030).await, Err(AuthError::Expired { exp: 2000, now: 2030 }));
        c["nbf"] = json!(1600);
        assert_eq!(v.verify(&hs(&c), 1500).await, Err(AuthError::NotYetValid { nbf: 1600, now: 1500 }));
        let mut c = claims("alice");
        c["exp"] = json!(1000 + 86_401);
        assert!(matches!(v.verify(&hs(&c), 1500).await, Err(AuthError::TooLong { .. })));
        for (claim, value) in
            [("iss", json!("https://evil")), ("aud", json!(["x"])), ("sub", json!("")), ("exp", Value::Null)]
        {
            let mut c = claims("alice");
            c[claim] = value;
            assert!(matches!(v.verify(&hs(&c), 1500).await, Err(AuthError::Claim(_))), "{claim}");
        }
        let id = v.verify(&hs(&claims("carol")), 1500).await.unwrap();
        assert_eq!(id.claim("/aud"), Some(&json!("parsley")));
    }

    #[test]
    fn a_configuration_names_one_source_and_fitting_algorithms() {
        let ok: AuthSettings = toml::from_str(
            "issuer = \"i\"\naudience = \"a\"\njwks_url = \"https://idp/keys\"\nalgorithms = [\"RS256\", \"ES256\"]\n",
        )
        .unwrap();
        assert!(ok.validate().is_ok());
        let mut two = ok.clone();
        two.jwks_file = Some("x".into());
        assert!(two.validate().is_err());
        let mut hs_with_url = ok.clone();
        hs_with_url.algorithms = vec!["HS256".into()];
        assert!(hs_with_url.validate().is_err());
        let mut unknown = ok.clone();
        unknown.algorithms = vec!["HS512".into()];
        assert!(unknown.validate().is_err());
        let mut blank = ok;
        blank.issuer = " ".into();
        assert!(blank.validate().is_err());
    }
}
