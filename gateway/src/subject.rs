//! Verified subjects: the subject a session is bound to, taken from the `sub` claim of a
//! bearer JWT (`Authorization: Bearer <jwt>`) checked with an HMAC secret, instead of a
//! header an authenticating proxy sets.
//!
//! Only HS256 is accepted, and the header's `alg` must say exactly that: `none`, other HMAC
//! sizes and every public-key algorithm are refused before the signature is looked at, so a
//! token cannot pick how it is checked. The signature is compared in constant time (`hmac`'s
//! `verify_slice`). `exp` is required and `nbf` honoured, both with the clock-skew leeway
//! (`gateway.token_clock_skew_s`); `iss` and `aud` are checked when configured. A header
//! with `crit` is refused: no extension is understood. JWKS and RSA/ECDSA keys are not
//! supported (they would need crates the gateway does not have).

use std::fmt;
use std::path::Path;

use anyhow::{bail, Context as _};
use axum::http::{header, HeaderMap};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use serde_json::{Map, Value};
use sha2::Sha256;

/// The one algorithm accepted.
pub const ALGORITHM: &str = "HS256";
/// Shortest HMAC secret accepted, in bytes (the hash's size, RFC 7518 §3.2).
pub const MIN_SECRET_LEN: usize = 32;
/// Longest JWT accepted, in characters.
pub const MAX_JWT_LEN: usize = 8192;
/// Longest subject a token can be bound to (the envelope stores its length in one byte).
pub const MAX_SUBJECT_LEN: usize = 255;

/// The HMAC secret. Never printed.
#[derive(Clone)]
pub struct HmacSecret(Vec<u8>);

impl HmacSecret {
    /// At least [`MIN_SECRET_LEN`] bytes. Errors never quote it.
    pub fn new(bytes: Vec<u8>) -> anyhow::Result<HmacSecret> {
        if bytes.len() < MIN_SECRET_LEN {
            bail!("the subject JWT secret must be at least {MIN_SECRET_LEN} bytes, got {}", bytes.len());
        }
        Ok(HmacSecret(bytes))
    }

    /// The file's bytes, less leading and trailing ASCII whitespace (a trailing newline).
    pub fn from_file(path: &Path) -> anyhow::Result<HmacSecret> {
        let bytes =
            std::fs::read(path).with_context(|| format!("reading the subject JWT secret file {}", path.display()))?;
        HmacSecret::new(bytes.trim_ascii().to_vec())
            .with_context(|| format!("the subject JWT secret file {} is invalid", path.display()))
    }
}

impl fmt::Debug for HmacSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HmacSecret(<redacted>)")
    }
}

/// Why a request's subject could not be verified. Each is answered `401
/// subject-unverified`, with this as the detail (never the token).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubjectError {
    #[error("this gateway takes the subject from a bearer token: send Authorization: Bearer <JWT>")]
    Missing,
    #[error("more than one Authorization header")]
    Repeated,
    #[error("the bearer token is not a JWT: {0}")]
    Malformed(String),
    #[error("the bearer token's alg is {0:?}; only HS256 is accepted")]
    Algorithm(String),
    #[error("the bearer token's signature does not verify")]
    BadSignature,
    #[error("the bearer token expired at {exp} (now {now})")]
    Expired { exp: u64, now: u64 },
    #[error("the bearer token is not valid before {nbf} (now {now})")]
    NotYetValid { nbf: u64, now: u64 },
    #[error("the bearer token's {0} claim is missing or not what this gateway accepts")]
    Claim(&'static str),
}

/// Checks bearer JWTs and names their subject.
#[derive(Clone, Debug)]
pub struct SubjectVerifier {
    secret: HmacSecret,
    /// The `iss` a token must carry, if set.
    issuer: Option<String>,
    /// The audience a token's `aud` must name, if set.
    audience: Option<String>,
    clock_skew_s: u64,
}

impl SubjectVerifier {
    pub fn new(secret: HmacSecret, issuer: Option<String>, audience: Option<String>, clock_skew_s: u64) -> Self {
        SubjectVerifier { secret, issuer, audience, clock_skew_s }
    }

    /// The subject of the request's bearer JWT, verified at `now` (unix seconds).
    pub fn subject_of(&self, headers: &HeaderMap, now: u64) -> Result<String, SubjectError> {
        let mut values = headers.get_all(header::AUTHORIZATION).iter();
        let value = match (values.next(), values.next()) {
            (None, _) => return Err(SubjectError::Missing),
            (Some(_), Some(_)) => return Err(SubjectError::Repeated),
            (Some(v), None) => v.as_bytes(),
        };
        let jwt = value
            .split_at_checked(7)
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case(b"bearer "))
            .map(|(_, rest)| rest.trim_ascii())
            .ok_or(SubjectError::Missing)?;
        let jwt = std::str::from_utf8(jwt).map_err(|_| SubjectError::Malformed("not text".into()))?;
        self.verify(jwt, now)
    }

    /// The `sub` of `jwt` once its algorithm, signature, times and configured claims check.
    pub fn verify(&self, jwt: &str, now: u64) -> Result<String, SubjectError> {
        let malformed = |what: &str| SubjectError::Malformed(what.to_string());
        if jwt.len() > MAX_JWT_LEN {
            return Err(SubjectError::Malformed(format!("longer than {MAX_JWT_LEN} characters")));
        }
        let mut parts = jwt.split('.');
        let (Some(head), Some(body), Some(signature), None) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(malformed("not three dot-separated parts"));
        };
        let header = json_object(head).ok_or_else(|| malformed("the header is not base64url of a JSON object"))?;
        match header.get("alg") {
            Some(Value::String(alg)) if alg == ALGORITHM => {}
            Some(Value::String(alg)) => return Err(SubjectError::Algorithm(alg.clone())),
            _ => return Err(SubjectError::Algorithm(String::new())),
        }
        if header.contains_key("crit") {
            return Err(malformed("the header has critical extensions (crit), which are not supported"));
        }
        let signature = URL_SAFE_NO_PAD.decode(signature).map_err(|_| malformed("the signature is not base64url"))?;
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret.0).expect("HMAC takes a key of any length");
        mac.update(&jwt.as_bytes()[..head.len() + 1 + body.len()]);
        mac.verify_slice(&signature).map_err(|_| SubjectError::BadSignature)?;

        // Authentic from here on; the claims still decide.
        let claims = json_object(body).ok_or_else(|| malformed("the payload is not base64url of a JSON object"))?;
        let exp = claims.get("exp").and_then(numeric_date).ok_or(SubjectError::Claim("exp"))?;
        if now >= exp.saturating_add(self.clock_skew_s) {
            return Err(SubjectError::Expired { exp, now });
        }
        if let Some(nbf) = claims.get("nbf") {
            let nbf = numeric_date(nbf).ok_or(SubjectError::Claim("nbf"))?;
            if now.saturating_add(self.clock_skew_s) < nbf {
                return Err(SubjectError::NotYetValid { nbf, now });
            }
        }
        if let Some(issuer) = &self.issuer {
            if claims.get("iss").and_then(Value::as_str) != Some(issuer.as_str()) {
                return Err(SubjectError::Claim("iss"));
            }
        }
        if let Some(audience) = &self.audience {
            let named = match claims.get("aud") {
                Some(Value::String(a)) => a == audience,
                Some(Value::Array(all)) => all.iter().any(|a| a.as_str() == Some(audience.as_str())),
                _ => false,
            };
            if !named {
                return Err(SubjectError::Claim("aud"));
            }
        }
        match claims.get("sub") {
            Some(Value::String(sub)) if !sub.is_empty() && !sub.chars().any(char::is_control) => Ok(sub.clone()),
            _ => Err(SubjectError::Claim("sub")),
        }
    }
}

/// A base64url (no padding) JSON object.
fn json_object(part: &str) -> Option<Map<String, Value>> {
    let bytes = URL_SAFE_NO_PAD.decode(part).ok()?;
    match serde_json::from_slice(&bytes).ok()? {
        Value::Object(map) => Some(map),
        _ => None,
    }
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

/// Signs `claims` as an HS256 JWT with `secret` (tests, and operators' smoke checks).
pub fn sign_hs256(secret: &[u8], claims: &Value) -> String {
    sign_with_header(secret, &serde_json::json!({"alg": ALGORITHM, "typ": "JWT"}), claims)
}

/// Signs `claims` under an arbitrary `header` with HMAC-SHA256 (tests of refused headers).
pub fn sign_with_header(secret: &[u8], header: &Value, claims: &Value) -> String {
    let head = URL_SAFE_NO_PAD.encode(header.to_string());
    let body = URL_SAFE_NO_PAD.encode(claims.to_string());
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(format!("{head}.{body}").as_bytes());
    let signature = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
    format!("{head}.{body}.{signature}")
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use serde_json::json;

    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn verifier(issuer: Option<&str>, audience: Option<&str>) -> SubjectVerifier {
        SubjectVerifier::new(
            HmacSecret::new(SECRET.to_vec()).unwrap(),
            issuer.map(String::from),
            audience.map(String::from),
            30,
        )
    }

    #[test]
    fn a_signed_token_names_its_subject() {
        let v = verifier(None, None);
        let jwt = sign_hs256(SECRET, &json!({"sub": "alice", "exp": 1000}));
        assert_eq!(v.verify(&jwt, 500), Ok("alice".to_string()));
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_str(&format!("bearer {jwt}")).unwrap());
        assert_eq!(v.subject_of(&headers, 500), Ok("alice".to_string()));
        headers.append(header::AUTHORIZATION, HeaderValue::from_str(&format!("Bearer {jwt}")).unwrap());
        assert_eq!(v.subject_of(&headers, 500), Err(SubjectError::Repeated));
        assert_eq!(v.subject_of(&HeaderMap::new(), 500), Err(SubjectError::Missing));
        let mut basic = HeaderMap::new();
        basic.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic YWxpY2U6cHc="));
        assert_eq!(v.subject_of(&basic, 500), Err(SubjectError::Missing));
    }

    #[test]
    fn only_hs256_is_accepted_whatever_the_token_says() {
        let v = verifier(None, None);
        let claims = json!({"sub": "alice", "exp": 1000});
        for alg in ["none", "None", "NONE", "HS512", "HS384", "RS256", "ES256", "hs256", ""] {
            let jwt = sign_with_header(SECRET, &json!({"alg": alg}), &claims);
            assert_eq!(v.verify(&jwt, 500), Err(SubjectError::Algorithm(alg.to_string())), "{alg}");
        }
        // `none` with an empty signature, as an attacker would send it.
        let head = URL_SAFE_NO_PAD.encode(r#"{"alg":"none"}"#);
        let body = URL_SAFE_NO_PAD.encode(claims.to_string());
        assert!(matches!(v.verify(&format!("{head}.{body}."), 500), Err(SubjectError::Algorithm(_))));
        let no_alg = sign_with_header(SECRET, &json!({"typ": "JWT"}), &claims);
        assert_eq!(v.verify(&no_alg, 500), Err(SubjectError::Algorithm(String::new())));
        let crit = sign_with_header(SECRET, &json!({"alg": "HS256", "crit": ["b64"], "b64": false}), &claims);
        assert!(matches!(v.verify(&crit, 500), Err(SubjectError::Malformed(_))));
    }

    #[test]
    fn a_forged_or_damaged_token_is_refused() {
        let v = verifier(None, None);
        let jwt = sign_hs256(SECRET, &json!({"sub": "alice", "exp": 1000}));
        let other = sign_hs256(b"another secret of thirty-two bytes!", &json!({"sub": "alice", "exp": 1000}));
        assert_eq!(v.verify(&other, 500), Err(SubjectError::BadSignature));
        // Someone else's subject spliced into a valid signature.
        let (head, rest) = jwt.split_once('.').unwrap();
        let signature = rest.split_once('.').unwrap().1;
        let forged = format!("{head}.{}.{signature}", URL_SAFE_NO_PAD.encode(r#"{"sub":"bob","exp":1000}"#));
        assert_eq!(v.verify(&forged, 500), Err(SubjectError::BadSignature));
        for bad in ["", "a.b", "a.b.c.d", "!!.e30.x", &format!("{jwt}="), &"a".repeat(MAX_JWT_LEN + 1)] {
            assert!(matches!(v.verify(bad, 500), Err(SubjectError::Malformed(_))), "{bad:.40}");
        }
        let mut flipped = jwt.clone().into_bytes();
        let last = flipped.len() - 2;
        flipped[last] = if flipped[last] == b'A' { b'B' } else { b'A' };
        assert!(v.verify(std::str::from_utf8(&flipped).unwrap(), 500).is_err());
    }

    #[test]
    fn exp_and_nbf_allow_the_clock_skew_and_no_more() {
        let v = verifier(None, None);
        let jwt = sign_hs256(SECRET, &json!({"sub": "alice", "exp": 1000, "nbf": 400}));
        assert!(v.verify(&jwt, 1029).is_ok(), "just inside the leeway past exp");
        assert_eq!(v.verify(&jwt, 1030), Err(SubjectError::Expired { exp: 1000, now: 1030 }));
        assert!(v.verify(&jwt, 370).is_ok(), "just inside the leeway before nbf");
        assert_eq!(v.verify(&jwt, 369), Err(SubjectError::NotYetValid { nbf: 400, now: 369 }));
        let exact = SubjectVerifier::new(HmacSecret::new(SECRET.to_vec()).unwrap(), None, None, 0);
        assert!(exact.verify(&jwt, 999).is_ok() && exact.verify(&jwt, 400).is_ok());
        assert!(exact.verify(&jwt, 1000).is_err() && exact.verify(&jwt, 399).is_err());
        let fractional = sign_hs256(SECRET, &json!({"sub": "alice", "exp": 1000.9}));
        assert!(exact.verify(&fractional, 999).is_ok() && exact.verify(&fractional, 1000).is_err());
        let no_exp = sign_hs256(SECRET, &json!({"sub": "alice"}));
        assert_eq!(v.verify(&no_exp, 0), Err(SubjectError::Claim("exp")));
        let text_exp = sign_hs256(SECRET, &json!({"sub": "alice", "exp": "1000"}));
        assert_eq!(v.verify(&text_exp, 0), Err(SubjectError::Claim("exp")));
    }

    #[test]
    fn issuer_audience_and_subject_are_checked() {
        let v = verifier(Some("https://idp.example"), Some("parsley"));
        let ok = json!({"sub": "alice", "exp": 1000, "iss": "https://idp.example", "aud": ["x", "parsley"]});
        assert_eq!(v.verify(&sign_hs256(SECRET, &ok), 0), Ok("alice".into()));
        let mut c = ok.clone();
        c["aud"] = json!("parsley");
        assert!(v.verify(&sign_hs256(SECRET, &c), 0).is_ok());
        for (claim, value) in
            [("iss", json!("https://evil.example")), ("iss", Value::Null), ("aud", json!(["x"])), ("aud", json!(1))]
        {
            let mut c = ok.clone();
            c[claim] = value;
            assert_eq!(v.verify(&sign_hs256(SECRET, &c), 0), Err(SubjectError::Claim(claim)));
        }
        for sub in [json!(""), json!(7), Value::Null, json!("a\u{0}b")] {
            let mut c = ok.clone();
            c["sub"] = sub;
            assert_eq!(v.verify(&sign_hs256(SECRET, &c), 0), Err(SubjectError::Claim("sub")));
        }
    }

    #[test]
    fn the_secret_is_long_and_never_printed() {
        assert!(HmacSecret::new(b"short".to_vec()).is_err());
        let v = verifier(None, None);
        assert!(!format!("{v:?}").contains("0123456789abcdef"), "{v:?}");
        let dir = std::env::temp_dir().join(format!("parsley-gateway-jwt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("secret");
        std::fs::write(&file, [SECRET, b"\n"].concat()).unwrap();
        let from_file = HmacSecret::from_file(&file).unwrap();
        assert_eq!(from_file.0, SECRET, "the trailing newline is not part of the secret");
        std::fs::write(&file, b"too short\n").unwrap();
        let err = format!("{:#}", HmacSecret::from_file(&file).unwrap_err());
        assert!(err.contains("secret file") && !err.contains("too short"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
