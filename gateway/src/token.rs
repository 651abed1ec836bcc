//! Session tokens: a client's causal past, sealed so clients can carry it but not read or
//! forge it. A token is untrusted input even though we minted it: every field is checked,
//! and a damaged token is refused, never read as an empty session.
//!
//! Client form: base64url without padding of
//! `format(0x01) | keyIdLen(u8) | keyId | nonce(24) | ciphertext+tag`, where the first three
//! fields are authenticated as associated data. The plaintext envelope is
//! `version(0x01) | issuedAt(u64 BE, unix seconds) | expiresAt(u64 BE) | subjectLen(u8) |
//! subject(UTF-8) | causes` and `causes` is a `parsley.causes` value, decoded exactly as
//! strictly as a record header.

use std::fmt;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use parsley::codec::{self, DecodeError};
use parsley::CausalPast;

/// The outer token format this build reads and writes.
pub const TOKEN_FORMAT: u8 = 0x01;
/// The plaintext envelope version.
pub const ENVELOPE_VERSION: u8 = 0x01;
const NONCE_LEN: usize = 24;
const TAG_LEN: usize = 16;
const MAX_KEY_ID_LEN: usize = 32;
const MAX_SUBJECT_LEN: usize = 255;

/// A 256-bit sealing key. Never printed.
#[derive(Clone)]
pub struct SecretKey([u8; 32]);

impl SecretKey {
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        SecretKey(bytes)
    }

    /// From base64 (standard or URL-safe, padded or not) of exactly 32 bytes.
    pub fn from_base64(text: &str) -> Result<Self, KeyError> {
        let text = text.trim();
        let bytes = URL_SAFE_NO_PAD
            .decode(text.trim_end_matches('=').replace('+', "-").replace('/', "_"))
            .map_err(|_| KeyError::NotBase64)?;
        let bytes: [u8; 32] = bytes.try_into().map_err(|b: Vec<u8>| KeyError::WrongLength(b.len()))?;
        Ok(SecretKey(bytes))
    }
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretKey(<redacted>)")
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("a token key must be base64 of 32 bytes: not base64")]
    NotBase64,
    #[error("a token key must be base64 of 32 bytes: got {0} bytes")]
    WrongLength(usize),
    #[error("a key id must be 1..=32 characters of [A-Za-z0-9._-]: {0:?}")]
    BadKeyId(String),
    #[error("key id {0:?} is configured twice")]
    DuplicateKeyId(String),
    #[error("no token keys configured")]
    Empty,
    #[error("token key entry {0:?} is not `<key id>:<base64 key>[:seal|:open]`")]
    BadEntry(String),
    #[error("more than one token key is marked `:seal` ({0:?} and {1:?}); exactly one key seals")]
    SeveralSealing(String, String),
    #[error("every token key is marked `:open`: mark the one that seals `:seal`")]
    NoSealingKey,
}

/// What a key of the ring is used for. Every key opens; exactly one also seals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum KeyRole {
    /// Seals new tokens, and opens.
    Seal,
    /// Only opens tokens sealed with it (a key being introduced, or being retired).
    Open,
}

impl KeyRole {
    /// The marker in the key ring's text form, and the metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyRole::Seal => "seal",
            KeyRole::Open => "open",
        }
    }
}

/// The configured keys: one seals, every one opens.
///
/// Keys that only open let a fleet rotate without refusing a session: a new key is first
/// added as open-only everywhere, then made the sealing key, then the old one retired
/// (docs/operations.md, "Rotating the token keys").
#[derive(Clone, Debug)]
pub struct KeyRing {
    /// In configured order.
    keys: Vec<(String, SecretKey)>,
    /// Index of the sealing key in `keys`.
    sealing: usize,
}

impl KeyRing {
    /// Keys in order; the first seals.
    pub fn new(keys: Vec<(String, SecretKey)>) -> Result<Self, KeyError> {
        KeyRing::with_roles(keys.into_iter().map(|(id, key)| (id, key, None)).collect())
    }

    /// Keys in order, each optionally marked. At most one may be marked [`KeyRole::Seal`];
    /// with none marked, the first key not marked [`KeyRole::Open`] seals.
    pub fn with_roles(keys: Vec<(String, SecretKey, Option<KeyRole>)>) -> Result<Self, KeyError> {
        if keys.is_empty() {
            return Err(KeyError::Empty);
        }
        for (i, (id, _, _)) in keys.iter().enumerate() {
            let valid = !id.is_empty()
                && id.len() <= MAX_KEY_ID_LEN
                && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
            if !valid {
                return Err(KeyError::BadKeyId(id.clone()));
            }
            if keys[..i].iter().any(|(other, _, _)| other == id) {
                return Err(KeyError::DuplicateKeyId(id.clone()));
            }
        }
        let mut marked = keys.iter().enumerate().filter(|(_, (_, _, role))| *role == Some(KeyRole::Seal));
        let sealing = match (marked.next(), marked.next()) {
            (Some((_, (a, _, _))), Some((_, (b, _, _)))) => return Err(KeyError::SeveralSealing(a.clone(), b.clone())),
            (Some((i, _)), None) => i,
            (None, _) => {
                keys.iter().position(|(_, _, role)| *role != Some(KeyRole::Open)).ok_or(KeyError::NoSealingKey)?
            }
        };
        Ok(KeyRing { keys: keys.into_iter().map(|(id, key, _)| (id, key)).collect(), sealing })
    }

    /// Parses `id:base64key[:seal|:open]` entries separated by commas or new lines (the form
    /// of `PARSLEY_TOKEN_KEYS` and of the keys file); blank lines and lines starting with `#`
    /// are ignored. At most one entry is marked `:seal`; with none marked, the first entry
    /// not marked `:open` seals — so `new,old` seals with `new`, as it always did.
    pub fn parse(spec: &str) -> Result<Self, KeyError> {
        let mut keys = Vec::new();
        let lines = spec.lines().map(str::trim).filter(|l| !l.starts_with('#'));
        for entry in lines.flat_map(|l| l.split(',')).map(str::trim).filter(|e| !e.is_empty()) {
            let mut parts = entry.split(':');
            let (Some(id), Some(key), role, None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
                return Err(KeyError::BadEntry(redact(entry)));
            };
            let role = match role.map(str::trim) {
                None => None,
                Some("seal") => Some(KeyRole::Seal),
                Some("open") => Some(KeyRole::Open),
                Some(_) => return Err(KeyError::BadEntry(redact(entry))),
            };
            keys.push((id.trim().to_string(), SecretKey::from_base64(key)?, role));
        }
        KeyRing::with_roles(keys)
    }

    /// The sealing key.
    fn sealing(&self) -> (&str, &SecretKey) {
        let (id, key) = &self.keys[self.sealing];
        (id, key)
    }

    /// The id of the key new tokens are sealed with.
    pub fn sealing_key_id(&self) -> &str {
        self.sealing().0
    }

    /// Every key's id and role, in configured order (for logs and metrics; never the keys).
    pub fn roles(&self) -> Vec<(&str, KeyRole)> {
        let role = |i| if i == self.sealing { KeyRole::Seal } else { KeyRole::Open };
        self.keys.iter().enumerate().map(|(i, (id, _))| (id.as_str(), role(i))).collect()
    }

    fn find(&self, id: &str) -> Option<&SecretKey> {
        self.keys.iter().find(|(k, _)| k == id).map(|(_, key)| key)
    }
}

/// Shows only the key id part of a malformed entry.
fn redact(entry: &str) -> String {
    match entry.split_once(':') {
        Some((id, _)) => format!("{id}:<redacted>"),
        None => "<redacted>".to_string(),
    }
}

/// Bounds a token must stay within, checked before and after opening it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenLimits {
    /// Longest client form accepted, in characters.
    pub max_encoded_len: usize,
    /// Most channels a token may name.
    pub max_entries: usize,
}

impl Default for TokenLimits {
    fn default() -> Self {
        TokenLimits { max_encoded_len: 16 * 1024, max_entries: 512 }
    }
}

/// How long a session lives, checked when its token is opened: from its last use
/// (`expiresAt`, set `token_ttl_s` ahead at every re-seal) and from its start (`issuedAt`,
/// kept across re-seals), each with a leeway for the clocks of the gateways that sealed
/// and that open it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    /// Longest a session may last from `issuedAt`, in seconds (`None`: unbounded).
    pub max_age_s: Option<u64>,
    /// Seconds a token is still accepted past its `expiresAt` and past its maximum age.
    pub clock_skew_s: u64,
}

impl Validity {
    /// `expiresAt` exactly, no maximum age: what [`open`] checks.
    pub const EXACT: Validity = Validity { max_age_s: None, clock_skew_s: 0 };

    /// Whether a session issued at `issued_at` is past its maximum age at `now`: the age is
    /// refused from `max_age_s + clock_skew_s` seconds on.
    pub fn too_old(&self, issued_at: u64, now: u64) -> bool {
        self.max_age_s.is_some_and(|max| now >= issued_at.saturating_add(max).saturating_add(self.clock_skew_s))
    }

    /// Whether a token expiring at `expires_at` is expired at `now`: from
    /// `expires_at + clock_skew_s` on.
    pub fn expired(&self, expires_at: u64, now: u64) -> bool {
        now >= expires_at.saturating_add(self.clock_skew_s)
    }
}

/// What a token says: the session's causal past and its validity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    pub issued_at: u64,
    pub expires_at: u64,
    /// The subject the token is bound to, if any.
    pub subject: Option<String>,
    pub past: CausalPast,
}

/// Why a token was refused. Each maps to its own problem type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("token is malformed: {0}")]
    Malformed(String),
    #[error("token is larger than {limit} characters")]
    TooLarge { limit: usize },
    #[error("token names {count} channels, more than the {limit} allowed")]
    TooManyEntries { count: usize, limit: usize },
    #[error("token was sealed with key {0:?}, which is not configured")]
    UnknownKey(String),
    #[error("token failed authentication: it was altered or not sealed by this service")]
    Tampered,
    #[error("token expired at {expires_at} (now {now})")]
    Expired { expires_at: u64, now: u64 },
    /// The session began longer ago than the maximum session age.
    #[error("the session began at {issued_at}, more than the {max_age_s} s a session may last (now {now})")]
    TooOld { issued_at: u64, max_age_s: u64, now: u64 },
    #[error("token is bound to another subject")]
    WrongSubject,
    /// A request carried several tokens bound to different subjects: they are not one
    /// session's, and nothing joins them.
    #[error("the request's tokens are bound to different subjects; only one subject's tokens join")]
    SubjectsDiffer,
    /// A request carried more tokens than `token_max_per_request`.
    #[error("the request carries {count} session tokens, more than the {limit} a request may join")]
    TooManyTokens { count: usize, limit: usize },
    #[error("token's causes are undecodable: {0}")]
    UndecodableCauses(String),
}

impl TokenError {
    /// A short stable name, used for problem types and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenError::Malformed(_) | TokenError::TooLarge { .. } | TokenError::TooManyEntries { .. } => {
                "token-malformed"
            }
            TokenError::UnknownKey(_) | TokenError::Tampered | TokenError::UndecodableCauses(_) => "token-invalid",
            TokenError::Expired { .. } => "token-expired",
            TokenError::TooOld { .. } => "token-too-old",
            TokenError::WrongSubject => "token-wrong-subject",
            TokenError::SubjectsDiffer => "token-subjects-differ",
            TokenError::TooManyTokens { .. } => "too-many-tokens",
        }
    }
}

/// Seals `session` with the ring's sealing key and a random nonce.
pub fn seal(ring: &KeyRing, session: &Session) -> String {
    seal_with_nonce(ring, session, XChaCha20Poly1305::generate_nonce(&mut OsRng).into())
}

/// Seals with a given nonce. Only for tests: a nonce must never repeat under one key.
pub fn seal_with_nonce(ring: &KeyRing, session: &Session, nonce: [u8; NONCE_LEN]) -> String {
    let (key_id, key) = ring.sealing();
    let mut header = vec![TOKEN_FORMAT, key_id.len() as u8];
    header.extend_from_slice(key_id.as_bytes());

    let subject = session.subject.as_deref().unwrap_or("");
    assert!(subject.len() <= MAX_SUBJECT_LEN, "subjects are checked when they enter the gateway");
    let mut plaintext = Vec::with_capacity(18 + subject.len() + codec::encoded_len(&session.past));
    plaintext.push(ENVELOPE_VERSION);
    plaintext.extend_from_slice(&session.issued_at.to_be_bytes());
    plaintext.extend_from_slice(&session.expires_at.to_be_bytes());
    plaintext.push(subject.len() as u8);
    plaintext.extend_from_slice(subject.as_bytes());
    codec::encode_into(&session.past, &mut plaintext);

    let cipher = XChaCha20Poly1305::new((&key.0).into());
    let nonce = XNonce::from(nonce);
    let ciphertext = cipher
        .encrypt(&nonce, Payload { msg: &plaintext, aad: &header })
        .expect("XChaCha20-Poly1305 encryption cannot fail for in-memory buffers");
    let mut out = header;
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&ciphertext);
    URL_SAFE_NO_PAD.encode(out)
}

/// Opens and validates a token: size, format, key, authenticity, envelope, expiry
/// (`now` in unix seconds), subject binding and the causes' strict decoding.
///
/// Subject rule: a token bound to a subject opens only for that subject; an unbound token
/// opens for anyone (the refreshed token is then bound to the caller's subject).
///
/// Expiry is exact and the session's age unbounded here; the gateway opens with
/// [`open_with`] and its configured [`Validity`].
pub fn open(
    ring: &KeyRing,
    token: &str,
    now: u64,
    subject: Option<&str>,
    limits: &TokenLimits,
) -> Result<Session, TokenError> {
    open_with(ring, token, now, subject, limits, &Validity::EXACT)
}

/// [`open`], with the session's maximum age and the clock-skew leeway of `validity`. A
/// session past its maximum age is refused [`TokenError::TooOld`], after the expiry and
/// subject checks (an expired token is `Expired` whatever its age).
pub fn open_with(
    ring: &KeyRing,
    token: &str,
    now: u64,
    subject: Option<&str>,
    limits: &TokenLimits,
    validity: &Validity,
) -> Result<Session, TokenError> {
    open_keyed(ring, token, now, subject, limits, validity).map(|(session, _)| session)
}

/// [`open_with`], also naming the key that sealed the token: a token sealed with the sealing
/// key in use, whose session a re-seal would leave as it is, can be handed back as it came
/// (`session::reseal`).
pub fn open_keyed(
    ring: &KeyRing,
    token: &str,
    now: u64,
    subject: Option<&str>,
    limits: &TokenLimits,
    validity: &Validity,
) -> Result<(Session, String), TokenError> {
    validate(unseal(ring, token, limits)?, now, subject, limits, validity)
}

/// Opens every token of a request that carries several of one session (the session's
/// writes answered concurrently, each with its own token), as [`open_keyed`] opens one.
///
/// Each is first unsealed, so a malformed or tampered token is refused as it would be alone;
/// then the subjects they are bound to must agree ([`TokenError::SubjectsDiffer`]: unbound
/// tokens agree with any); then each is validated against `now` and the caller's `subject`.
/// The caller joins the sessions; this function does not bound how many there are.
pub fn open_several(
    ring: &KeyRing,
    tokens: &[&str],
    now: u64,
    subject: Option<&str>,
    limits: &TokenLimits,
    validity: &Validity,
) -> Result<Vec<(Session, String)>, TokenError> {
    let unsealed = tokens.iter().map(|t| unseal(ring, t, limits)).collect::<Result<Vec<_>, _>>()?;
    let mut bound: Option<&str> = None;
    for u in &unsealed {
        match (bound, u.bound.as_deref()) {
            (_, None) => {}
            (None, Some(b)) => bound = Some(b),
            (Some(a), Some(b)) if a != b => return Err(TokenError::SubjectsDiffer),
            (Some(_), Some(_)) => {}
        }
    }
    unsealed.into_iter().map(|u| validate(u, now, subject, limits, validity)).collect()
}

/// A token decrypted and its envelope parsed, nothing of it checked against the request.
struct Unsealed {
    key_id: String,
    issued_at: u64,
    expires_at: u64,
    bound: Option<String>,
    causes: Vec<u8>,
}

/// Size, format, key, authenticity and envelope of a token.
fn unseal(ring: &KeyRing, token: &str, limits: &TokenLimits) -> Result<Unsealed, TokenError> {
    if token.len() > limits.max_encoded_len {
        return Err(TokenError::TooLarge { limit: limits.max_encoded_len });
    }
    let raw = URL_SAFE_NO_PAD
        .decode(token.trim())
        .map_err(|_| TokenError::Malformed("not base64url without padding".into()))?;
    let malformed = |what: &str| TokenError::Malformed(what.to_string());
    let (&format, rest) = raw.split_first().ok_or_else(|| malformed("empty"))?;
    if format != TOKEN_FORMAT {
        return Err(TokenError::Malformed(format!("unknown token format 0x{format:02x}")));
    }
    let (&key_id_len, rest) = rest.split_first().ok_or_else(|| malformed("truncated before the key id"))?;
    let key_id_len = usize::from(key_id_len);
    if key_id_len == 0 || key_id_len > MAX_KEY_ID_LEN || rest.len() < key_id_len + NONCE_LEN + TAG_LEN {
        return Err(malformed("truncated or bad key id length"));
    }
    let (key_id, rest) = rest.split_at(key_id_len);
    let key_id = std::str::from_utf8(key_id).map_err(|_| malformed("key id is not UTF-8"))?;
    let (nonce, ciphertext) = rest.split_at(NONCE_LEN);
    let key = ring.find(key_id).ok_or_else(|| TokenError::UnknownKey(key_id.to_string()))?;
    let header = &raw[..2 + key_id_len];
    let cipher = XChaCha20Poly1305::new((&key.0).into());
    let plaintext = cipher
        .decrypt(XNonce::from_slice(nonce), Payload { msg: ciphertext, aad: header })
        .map_err(|_| TokenError::Tampered)?;

    // Authenticated from here on, but still checked field by field: a bug in an older
    // build could have sealed something wrong.
    let bad = |what: &str| TokenError::Malformed(format!("envelope: {what}"));
    if plaintext.len() < 18 {
        return Err(bad("truncated"));
    }
    if plaintext[0] != ENVELOPE_VERSION {
        return Err(bad("unknown envelope version"));
    }
    let issued_at = u64::from_be_bytes(plaintext[1..9].try_into().expect("8 bytes"));
    let expires_at = u64::from_be_bytes(plaintext[9..17].try_into().expect("8 bytes"));
    let subject_len = usize::from(plaintext[17]);
    let causes_at = 18 + subject_len;
    if plaintext.len() < causes_at {
        return Err(bad("truncated subject"));
    }
    let bound = std::str::from_utf8(&plaintext[18..causes_at]).map_err(|_| bad("subject is not UTF-8"))?;
    let bound = (!bound.is_empty()).then(|| bound.to_string());
    let causes = plaintext[causes_at..].to_vec();
    Ok(Unsealed { key_id: key_id.to_string(), issued_at, expires_at, bound, causes })
}

/// Expiry, subject binding, maximum age and the causes' strict decoding of an unsealed token.
fn validate(
    u: Unsealed,
    now: u64,
    subject: Option<&str>,
    limits: &TokenLimits,
    validity: &Validity,
) -> Result<(Session, String), TokenError> {
    let Unsealed { key_id, issued_at, expires_at, bound, causes } = u;
    if validity.expired(expires_at, now) {
        return Err(TokenError::Expired { expires_at, now });
    }
    if let Some(bound) = &bound {
        if subject != Some(bound.as_str()) {
            return Err(TokenError::WrongSubject);
        }
    }
    if validity.too_old(issued_at, now) {
        let max_age_s = validity.max_age_s.unwrap_or(u64::MAX);
        return Err(TokenError::TooOld { issued_at, max_age_s, now });
    }
    let past = codec::decode(&causes, usize::MAX).map_err(|e| match e {
        DecodeError::Undecodable(m) => TokenError::UndecodableCauses(format!("{m} ({})", m.class())),
        DecodeError::OverBudget { .. } => TokenError::UndecodableCauses(e.to_string()),
    })?;
    if past.len() > limits.max_entries {
        return Err(TokenError::TooManyEntries { count: past.len(), limit: limits.max_entries });
    }
    Ok((Session { issued_at, expires_at, subject: bound, past }, key_id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use parsley::{ChannelId, TopicId};

    fn ring(ids: &[(&str, u8)]) -> KeyRing {
        KeyRing::new(ids.iter().map(|(id, b)| (id.to_string(), SecretKey::from_bytes([*b; 32]))).collect()).unwrap()
    }

    fn session(subject: Option<&str>) -> Session {
        let c = ChannelId::new(TopicId::from_bytes([7; 16]), 2);
        Session {
            issued_at: 100,
            expires_at: 200,
            subject: subject.map(String::from),
            past: CausalPast::from_pairs([(c, 42)]),
        }
    }

    #[test]
    fn round_trip_and_nonces_differ() {
        let r = ring(&[("k1", 1)]);
        let s = session(None);
        let a = seal(&r, &s);
        let b = seal(&r, &s);
        assert_ne!(a, b, "a fresh nonce per seal");
        assert_eq!(open(&r, &a, 150, None, &TokenLimits::default()).unwrap(), s);
        assert_eq!(open(&r, &a, 150, Some("alice"), &TokenLimits::default()).unwrap(), s, "unbound opens for anyone");
        assert!(!a.contains('=') && !a.contains('+') && !a.contains('/'));
    }

    #[test]
    fn rotation_seals_with_newest_and_opens_with_any() {
        let old = ring(&[("k1", 1)]);
        let rotated = ring(&[("k2", 2), ("k1", 1)]);
        let s = session(None);
        let t_old = seal(&old, &s);
        assert_eq!(open(&rotated, &t_old, 150, None, &TokenLimits::default()).unwrap(), s);
        let t_new = seal(&rotated, &s);
        assert_eq!(open(&old, &t_new, 150, None, &TokenLimits::default()), Err(TokenError::UnknownKey("k2".into())));
    }

    fn key_text(b: u8) -> String {
        URL_SAFE_NO_PAD.encode([b; 32])
    }

    #[test]
    fn the_ring_seals_with_the_marked_key_and_opens_with_every_key() {
        let (k1, k2) = (key_text(1), key_text(2));
        // Unmarked: the first seals, as before roles existed.
        assert_eq!(KeyRing::parse(&format!("new:{k2},old:{k1}")).unwrap().sealing_key_id(), "new");
        // The phases of a rotation.
        let phase1 = KeyRing::parse(&format!("new:{k2}:open,old:{k1}")).unwrap();
        assert_eq!(phase1.sealing_key_id(), "old", "an open-only key never seals");
        assert_eq!(phase1.roles(), vec![("new", KeyRole::Open), ("old", KeyRole::Seal)]);
        let phase2 = KeyRing::parse(&format!("old:{k1}:open\nnew:{k2}:seal\n")).unwrap();
        assert_eq!(phase2.sealing_key_id(), "new");
        assert_eq!(phase2.roles(), vec![("old", KeyRole::Open), ("new", KeyRole::Seal)]);
        let phase3 = KeyRing::parse(&format!("# after the rotation\nnew:{k2}:seal")).unwrap();
        assert_eq!(phase3.roles(), vec![("new", KeyRole::Seal)]);

        let s = session(None);
        let lim = TokenLimits::default();
        let by_old = seal(&phase1, &s);
        let by_new = seal(&phase2, &s);
        for ring in [&phase1, &phase2] {
            assert_eq!(open(ring, &by_old, 150, None, &lim).unwrap(), s);
            assert_eq!(open(ring, &by_new, 150, None, &lim).unwrap(), s);
        }
        assert_eq!(open(&phase3, &by_old, 150, None, &lim), Err(TokenError::UnknownKey("old".into())));

        assert_eq!(
            KeyRing::parse(&format!("a:{k1}:seal,b:{k2}:seal")).unwrap_err(),
            KeyError::SeveralSealing("a".into(), "b".into())
        );
        assert_eq!(KeyRing::parse(&format!("a:{k1}:open,b:{k2}:open")).unwrap_err(), KeyError::NoSealingKey);
        for bad in [format!("a:{k1}:sael"), format!("a:{k1}:seal:x"), format!("a:{k1}:")] {
            let err = KeyRing::parse(&bad).unwrap_err();
            assert!(matches!(err, KeyError::BadEntry(_)), "{bad}: {err:?}");
            assert!(!err.to_string().contains(&k1), "{err}");
        }
    }

    #[test]
    fn max_age_and_expiry_allow_the_clock_skew_and_no_more() {
        let r = ring(&[("k1", 1)]);
        let lim = TokenLimits::default();
        // Issued at 100, expires at 200.
        let t = seal(&r, &session(None));
        let v = Validity { max_age_s: Some(1_000), clock_skew_s: 30 };
        // Expiry: still open up to 29 s past expiresAt, refused from 30 s.
        assert!(open_with(&r, &t, 229, None, &lim, &v).is_ok(), "just inside the leeway");
        assert_eq!(open_with(&r, &t, 230, None, &lim, &v), Err(TokenError::Expired { expires_at: 200, now: 230 }));
        // No leeway: exact.
        let exact = Validity { max_age_s: Some(1_000), clock_skew_s: 0 };
        assert!(open_with(&r, &t, 199, None, &lim, &exact).is_ok());
        assert_eq!(open_with(&r, &t, 200, None, &lim, &exact), Err(TokenError::Expired { expires_at: 200, now: 200 }));

        // Maximum age from issuedAt (100): a session may last 50 s, plus the leeway.
        let v = Validity { max_age_s: Some(50), clock_skew_s: 30 };
        assert!(open_with(&r, &t, 179, None, &lim, &v).is_ok(), "just inside: 79 s old");
        let too_old = TokenError::TooOld { issued_at: 100, max_age_s: 50, now: 180 };
        assert_eq!(open_with(&r, &t, 180, None, &lim, &v), Err(too_old.clone()));
        assert_eq!(too_old.kind(), "token-too-old");
        let exact = Validity { max_age_s: Some(50), clock_skew_s: 0 };
        assert!(open_with(&r, &t, 149, None, &lim, &exact).is_ok());
        assert!(matches!(open_with(&r, &t, 150, None, &lim, &exact), Err(TokenError::TooOld { .. })));
        // Past both bounds, the expiry is what the client is told.
        assert!(matches!(open_with(&r, &t, 10_000, None, &lim, &v), Err(TokenError::Expired { .. })));
        // Unbounded age: only the expiry counts.
        let unbounded = Validity { max_age_s: None, clock_skew_s: 0 };
        assert!(open_with(&r, &t, 199, None, &lim, &unbounded).is_ok());
        assert_eq!(open(&r, &t, 199, None, &lim), open_with(&r, &t, 199, None, &lim, &unbounded));
        // No overflow at the far end of time.
        assert!(!Validity { max_age_s: Some(u64::MAX), clock_skew_s: u64::MAX }.too_old(1, u64::MAX - 1));
        assert!(!Validity { max_age_s: None, clock_skew_s: u64::MAX }.expired(u64::MAX, u64::MAX - 1));
    }

    #[test]
    fn every_refusal_has_its_reason() {
        let r = ring(&[("k1", 1)]);
        let lim = TokenLimits::default();
        let t = seal_with_nonce(&r, &session(Some("alice")), [9; 24]);
        assert_eq!(open(&r, &t, 200, Some("alice"), &lim), Err(TokenError::Expired { expires_at: 200, now: 200 }));
        assert_eq!(open(&r, &t, 150, Some("bob"), &lim), Err(TokenError::WrongSubject));
        assert_eq!(open(&r, &t, 150, None, &lim), Err(TokenError::WrongSubject));
        assert!(open(&r, &t, 150, Some("alice"), &lim).is_ok());
        assert_eq!(open(&ring(&[("k1", 3)]), &t, 150, Some("alice"), &lim), Err(TokenError::Tampered));
        assert!(matches!(open(&r, "%%%", 150, None, &lim), Err(TokenError::Malformed(_))));
        assert!(matches!(open(&r, "", 150, None, &lim), Err(TokenError::Malformed(_))));
        assert_eq!(
            open(&r, &t, 150, Some("alice"), &TokenLimits { max_encoded_len: 10, max_entries: 10 }),
            Err(TokenError::TooLarge { limit: 10 })
        );
        assert_eq!(
            open(&r, &t, 150, Some("alice"), &TokenLimits { max_encoded_len: 10_000, max_entries: 0 }),
            Err(TokenError::TooManyEntries { count: 1, limit: 0 })
        );
    }

    #[test]
    fn every_flipped_bit_is_refused() {
        let r = ring(&[("k1", 1)]);
        let t = seal_with_nonce(&r, &session(None), [5; 24]);
        let raw = URL_SAFE_NO_PAD.decode(&t).unwrap();
        for i in 0..raw.len() {
            for bit in [0x01u8, 0x80] {
                let mut damaged = raw.clone();
                damaged[i] ^= bit;
                let err = open(&r, &URL_SAFE_NO_PAD.encode(&damaged), 150, None, &TokenLimits::default()).unwrap_err();
                assert!(
                    matches!(err, TokenError::Tampered | TokenError::Malformed(_) | TokenError::UnknownKey(_)),
                    "byte {i} bit {bit:#x}: {err:?}"
                );
            }
        }
        // Truncations too.
        for n in 0..raw.len() {
            assert!(open(&r, &URL_SAFE_NO_PAD.encode(&raw[..n]), 150, None, &TokenLimits::default()).is_err());
        }
    }

    #[test]
    fn a_sealed_but_undecodable_past_is_refused_not_emptied() {
        // Seal an envelope by hand whose causes are damaged (as a buggy build might have).
        let r = ring(&[("k1", 1)]);
        let header = vec![TOKEN_FORMAT, 2, b'k', b'1'];
        let mut plain = vec![ENVELOPE_VERSION];
        plain.extend_from_slice(&1u64.to_be_bytes());
        plain.extend_from_slice(&500u64.to_be_bytes());
        plain.push(0);
        plain.extend_from_slice(&[0x01, 0x01, 0x00]);
        let cipher = XChaCha20Poly1305::new((&[1u8; 32]).into());
        let nonce = XNonce::from([3u8; 24]);
        let ct = cipher.encrypt(&nonce, Payload { msg: &plain, aad: &header }).unwrap();
        let token = URL_SAFE_NO_PAD.encode([header, nonce.to_vec(), ct].concat());
        assert!(matches!(open(&r, &token, 10, None, &TokenLimits::default()), Err(TokenError::UndecodableCauses(_))));
    }

    #[test]
    fn key_configuration_is_checked_and_never_printed() {
        let key = URL_SAFE_NO_PAD.encode([4u8; 32]);
        let r = KeyRing::parse(&format!("new:{key}, old:{key}")).unwrap();
        assert_eq!(r.sealing().0, "new");
        assert!(!format!("{r:?}").contains(&key), "keys never appear in Debug output");
        assert!(matches!(KeyRing::parse(""), Err(KeyError::Empty)));
        assert!(matches!(KeyRing::parse("nokey"), Err(KeyError::BadEntry(_))));
        assert!(matches!(KeyRing::parse("a:c2hvcnQ"), Err(KeyError::WrongLength(5))));
        assert!(matches!(KeyRing::parse(&format!("a b:{key}")), Err(KeyError::BadKeyId(_))));
        assert!(matches!(KeyRing::parse(&format!("a:{key},a:{key}")), Err(KeyError::DuplicateKeyId(_))));
        // A malformed entry is echoed without its secret part.
        let err = KeyRing::parse("a-secret-with-no-id").unwrap_err();
        assert!(!err.to_string().contains("secret"), "{err}");
    }

    /// `plaintext` sealed as a token of ring `k1` (key bytes `[1; 32]`) would be: the
    /// opener's envelope and causes parsing meets arbitrary authenticated bytes.
    fn seal_plaintext(plaintext: &[u8], nonce: [u8; 24]) -> String {
        let header = vec![TOKEN_FORMAT, 2, b'k', b'1'];
        let cipher = XChaCha20Poly1305::new((&[1u8; 32]).into());
        let nonce = XNonce::from(nonce);
        let ct = cipher.encrypt(&nonce, Payload { msg: plaintext, aad: &header }).unwrap();
        URL_SAFE_NO_PAD.encode([header, nonce.to_vec(), ct].concat())
    }

    /// Every answer of the opener is a session or a named refusal.
    fn check_open(token: &str, now: u64, subject: Option<&str>) -> Result<Session, TokenError> {
        let limits = TokenLimits { max_encoded_len: 4096, max_entries: 64 };
        let answer = open(&ring(&[("k1", 1), ("k2", 2)]), token, now, subject, &limits);
        match &answer {
            Ok(s) => {
                assert!(now < s.expires_at && s.past.len() <= 64);
                assert!(s.subject.is_none() || s.subject.as_deref() == subject);
            }
            Err(e) => assert!(
                matches!(e.kind(), "token-malformed" | "token-invalid" | "token-expired" | "token-wrong-subject"),
                "{e}"
            ),
        }
        answer
    }

    fn any_session() -> impl proptest::strategy::Strategy<Value = Session> {
        use proptest::prelude::*;
        let pair = (any::<[u8; 16]>(), 0u32..8, 0i64..i64::MAX);
        (any::<u64>(), any::<u64>(), proptest::option::of("[a-z]{0,12}"), proptest::collection::vec(pair, 0..8))
            .prop_map(|(issued_at, expires_at, subject, pairs)| Session {
                issued_at,
                expires_at,
                subject: subject.filter(|s| !s.is_empty()),
                past: CausalPast::from_pairs(
                    pairs.into_iter().map(|(t, p, at)| (ChannelId::new(TopicId::from_bytes(t), p), at)),
                ),
            })
    }

    proptest::proptest! {
        #[test]
        fn fuzz_token_open_arbitrary_text(text in "\\PC{0,300}", now in proptest::prelude::any::<u64>()) {
            let _ = check_open(&text, now, None);
        }

        #[test]
        fn fuzz_token_open_arbitrary_bytes(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            let _ = check_open(&URL_SAFE_NO_PAD.encode(&bytes), 0, None);
            let mut framed = vec![TOKEN_FORMAT, 2, b'k', b'1'];
            framed.extend_from_slice(&bytes);
            let answer = check_open(&URL_SAFE_NO_PAD.encode(&framed), 0, None);
            proptest::prop_assert!(answer.is_err(), "random bytes never authenticate");
        }

        #[test]
        fn fuzz_token_open_authenticated_garbage(
            plaintext in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
            nonce in proptest::prelude::any::<[u8; 24]>(),
            now in 0u64..1000,
        ) {
            // Authentic, so every byte reaches the envelope and causes checks.
            let _ = check_open(&seal_plaintext(&plaintext, nonce), now, Some("alice"));
        }

        #[test]
        fn fuzz_token_open_mutated(
            session in any_session(),
            at in 0usize..400,
            replacement in "[A-Za-z0-9_=+/. -]",
            cut in proptest::prelude::any::<bool>(),
        ) {
            let token = seal_with_nonce(&ring(&[("k1", 1)]), &session, [9; 24]);
            let now = session.expires_at.saturating_sub(1);
            let opened = check_open(&token, now, session.subject.as_deref());
            if session.expires_at > 0 && session.past.len() <= 64 {
                proptest::prop_assert_eq!(opened, Ok(session.clone()), "a sealed session opens as sealed");
            }
            let at = at % token.len();
            let mutated =
                if cut { token[..at].to_string() } else { format!("{}{replacement}{}", &token[..at], &token[at + 1..]) };
            if mutated != token {
                let answer = check_open(&mutated, now, session.subject.as_deref());
                // A change that survives base64 decoding must fail authentication.
                proptest::prop_assert!(answer.is_err() || URL_SAFE_NO_PAD.decode(&mutated).ok() == URL_SAFE_NO_PAD.decode(&token).ok());
            }
        }
    }
}
