//! A request's session: its caller (the identity of a verified bearer JWT with
//! authentication on, or the subject header's value with open access), the token opened from the `Parsley-Session` header with the key ring in use
//! and the session's bounds (none starts an empty session; a bad one is refused, never
//! read as empty; several of one subject, the answers of a session's concurrent requests,
//! are opened each and joined), its hygiene against the log
//! (refuse positions beyond the log end, prune pairs of topics that are gone — never a pair
//! for its log start: the token is stamped on writes), and the re-sealed token a response
//! carries.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, HeaderValue};
use parsley::gate::{self, PairFact};
use parsley::{CausalPast, ChannelId, Position};

use crate::identity::{AuthError, Identity};
use crate::metrics::Metric;
use crate::problem::ApiError;
use crate::state::AppState;
use crate::token::{self, Session, TokenError};

/// The request and response header carrying the sealed token.
pub const SESSION_HEADER: &str = "parsley-session";

/// Longest subject a token can be bound to (the envelope stores its length in one byte).
const MAX_SUBJECT_LEN: usize = crate::identity::MAX_SUBJECT_LEN;

/// Seconds since the epoch.
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Who is asking and what their session says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The subject: the `sub` of the verified bearer JWT with authentication on, else
    /// the configured subject header's value, if any.
    pub subject: Option<String>,
    /// With authentication on, the verified identity (subject, scopes, claims) the rules
    /// are checked against.
    pub identity: Option<Arc<Identity>>,
    /// SHA-256 of the session token as the request carried it (the idempotency scope of a
    /// caller without a subject).
    pub token_digest: Option<[u8; 32]>,
    /// When the session began (`None`: it begins with this request).
    pub issued_at: Option<u64>,
    pub past: CausalPast,
    /// The token as the request carried it, when a re-seal of the same past could give it
    /// back unchanged: sealed with the key that seals now, bound to exactly the caller's
    /// subject. See [`reseal`].
    pub sealed: Option<Sealed>,
}

/// A request's token as it came, with what [`reseal`] compares before handing it back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sealed {
    pub value: HeaderValue,
    pub key_id: String,
    pub expires_at: u64,
}

/// Establishes the caller and opens the session token, if any — or the request's several
/// tokens of one session ([`session_tokens`]), each checked as a lone token is, into their
/// [`join`].
///
/// With authentication on (`[gateway.auth]`), the caller is the identity of the request's
/// bearer JWT (none or an invalid one: `401 unauthenticated`), its subject the `sub`. With
/// open access, the subject header (if configured) is trusted as sent, so the proxy in
/// front must overwrite it (docs/gateway.md, "Subjects").
pub async fn open_session(state: &AppState, headers: &HeaderMap, now: u64) -> Result<Caller, ApiError> {
    let identity = match &state.config.verifier {
        None => None,
        Some(verifier) => Some(verifier.identify(headers, now).await.map_err(|e| match e {
            AuthError::KeysUnavailable(detail) => ApiError::Unavailable {
                what: "the identity provider's keys",
                detail,
                retry_after: state.config.settings.retry_after_s,
            },
            other => ApiError::Unauthenticated(other.to_string()),
        })?),
    };
    let subject = match &identity {
        Some(id) => Some(id.subject.clone()),
        None => header_subject(state, headers)?,
    };
    let tokens = session_tokens(headers, state.config.settings.token_max_per_request)?;
    if tokens.is_empty() {
        return Ok(Caller {
            subject,
            identity,
            token_digest: None,
            issued_at: None,
            past: CausalPast::new(),
            sealed: None,
        });
    }
    let settings = &state.config.settings;
    let ring = state.config.keys.current();
    let (limits, validity) = (settings.limits(), settings.validity());
    // The idempotency scope of a caller without a subject: the tokens as sent, in order
    // (one token: its text, as before several were accepted).
    let token_digest = Some(digest(tokens.join(",").as_bytes()));
    if let [text] = tokens[..] {
        let (session, key_id) = token::open_keyed(&ring, text, now, subject.as_deref(), &limits, &validity)?;
        // An unbound token opened by a caller with a subject comes back bound: sealed anew.
        let sealed = (session.subject == subject).then(|| Sealed {
            value: HeaderValue::from_str(text).expect("a part of a header value is one"),
            key_id,
            expires_at: session.expires_at,
        });
        return Ok(Caller {
            subject,
            identity,
            token_digest,
            issued_at: Some(session.issued_at),
            past: session.past,
            sealed,
        });
    }
    let opened = token::open_several(&ring, &tokens, now, subject.as_deref(), &limits, &validity)?;
    let (issued_at, past) = join(opened.into_iter().map(|(session, _)| session));
    Ok(Caller { subject, identity, token_digest, issued_at: Some(issued_at), past, sealed: None })
}

/// The tokens a request carries: every `Parsley-Session` header, each a comma-separated
/// list (RFC 9110's list syntax; base64url holds no comma), blanks around them trimmed. An
/// empty element or a value that is not visible ASCII is `token-malformed`; more than
/// `max` tokens in all `too-many-tokens`.
pub fn session_tokens(headers: &HeaderMap, max: usize) -> Result<Vec<&str>, TokenError> {
    let mut tokens = Vec::new();
    for value in headers.get_all(SESSION_HEADER) {
        let text = value.to_str().map_err(|_| TokenError::Malformed("not base64url without padding".into()))?;
        for token in text.split(',') {
            let token = token.trim_matches([' ', '\t']);
            if token.is_empty() {
                return Err(TokenError::Malformed("an empty element in the Parsley-Session list".into()));
            }
            tokens.push(token);
        }
    }
    if tokens.len() > max {
        return Err(TokenError::TooManyTokens { count: tokens.len(), limit: max });
    }
    Ok(tokens)
}

/// The join of several sessions of one subject: the pointwise maximum of their pasts
/// ([`CausalPast::merge_past`]), begun when the oldest of them began (a session's maximum age
/// counts from its start, so a join is as old as its oldest part).
pub fn join(sessions: impl IntoIterator<Item = Session>) -> (u64, CausalPast) {
    let mut issued_at = u64::MAX;
    let mut past = CausalPast::new();
    for session in sessions {
        issued_at = issued_at.min(session.issued_at);
        past = past.merge_past(&session.past);
    }
    (issued_at, past)
}

/// SHA-256 of `bytes`.
fn digest(bytes: &[u8]) -> [u8; 32] {
    use sha2::{Digest as _, Sha256};
    Sha256::digest(bytes).into()
}

/// With open access, the request's subject as its subject header says, if one is configured.
fn header_subject(state: &AppState, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let subject = match &state.config.settings.subject_header {
        None => None,
        Some(name) => match headers.get(name.as_str()) {
            None => None,
            Some(v) => {
                let s = v
                    .to_str()
                    .map_err(|_| ApiError::InvalidSubject(format!("the {name} header is not visible ASCII")))?
                    .trim();
                if s.len() > MAX_SUBJECT_LEN {
                    return Err(ApiError::InvalidSubject(format!(
                        "the {name} header is longer than {MAX_SUBJECT_LEN} bytes"
                    )));
                }
                (!s.is_empty()).then(|| s.to_string())
            }
        },
    };
    Ok(subject)
}

/// Checks every pair against the log and prunes what the core's token hygiene
/// ([`parsley::gate::keeps_pair`]) drops — the engine's rule for what a send stamps:
/// - a pair whose topic ID no longer resolves (deleted, or recreated under a new ID) is
///   pruned;
/// - a pair at or beyond its channel's log end is refused (`token-ahead-of-log`), after the
///   log end was re-read from the broker.
///
/// A pair below its channel's log start is kept: the token is stamped on the session's
/// writes, and a receiver that has not read that position must hold the write (and refuse
/// at the cause's channel) rather than apply it before a cause it never saw. A read stops
/// *demanding* such a pair on a channel no configured model receives
/// ([`parsley::gate::read_stops_demanding`]: clocks prune those entries, so it could never
/// be covered; see `read::discarded`), without dropping it from the token.
///
/// Broker failures answer 503: a pair that cannot be checked is neither trusted nor dropped.
pub async fn sanitize(state: &AppState, past: &CausalPast) -> Result<CausalPast, ApiError> {
    if past.is_empty() {
        return Ok(past.clone());
    }
    let mut pruned: Vec<(ChannelId, &'static str)> = Vec::new();
    for (channel, position) in past.iter() {
        let fact = match state.facts.topic_name(&channel.topic).await.map_err(|e| kafka_unavailable(state, e))? {
            None => PairFact::TopicGone,
            Some(name) => {
                check_partition(state, channel, position, &name).await?;
                let offsets = match state.facts.cached_offsets(&channel) {
                    Some(o) if position < o.log_end => o,
                    _ => state.facts.refresh_offsets(channel, &name).await.map_err(|e| kafka_unavailable(state, e))?,
                };
                if position >= offsets.log_end {
                    return Err(ApiError::TokenAheadOfLog {
                        channel: format!("{name}/{}", channel.partition),
                        position,
                        log_end: offsets.log_end,
                    });
                }
                PairFact::Live { received: state.receives(&name), log_start: offsets.log_start }
            }
        };
        if !gate::keeps_pair(fact, position) {
            // The rule drops a pair only with its topic: a live one never leaves.
            let reason = if fact == PairFact::TopicGone { "topic-gone" } else { "log-start" };
            pruned.push((channel, reason));
        }
    }
    if pruned.is_empty() {
        return Ok(past.clone());
    }
    for &(channel, reason) in &pruned {
        state.metrics.add(Metric::TokenPairsPrunedTotal, &[("reason", reason)], 1.0);
        tracing::debug!(%channel, reason, "token pair pruned");
    }
    Ok(past.clone().retain(|c, _| !pruned.iter().any(|&(p, _)| p == c)))
}

/// A partition beyond the topic's partition count (re-read before refusing) cannot hold the
/// position the token names.
async fn check_partition(state: &AppState, channel: ChannelId, position: Position, name: &str) -> Result<(), ApiError> {
    let within = |state: &AppState| state.facts.cached_topic(name).is_some_and(|t| channel.partition < t.partitions);
    if within(state) {
        return Ok(());
    }
    state.facts.refresh_topics(&[name.to_string()]).await.map_err(|e| kafka_unavailable(state, e))?;
    if within(state) {
        return Ok(());
    }
    Err(ApiError::TokenAheadOfLog { channel: format!("{name}/{}", channel.partition), position, log_end: 0 })
}

pub fn kafka_unavailable(state: &AppState, e: anyhow::Error) -> ApiError {
    tracing::warn!(error = %format!("{e:#}"), "Kafka request failed");
    ApiError::Unavailable {
        what: "Kafka",
        detail: "the broker did not answer a metadata or offsets request".into(),
        retry_after: state.config.settings.retry_after_s,
    }
}

/// Seals `past` for the caller with the sealing key in use: bound to the caller's subject,
/// issued when the session began (the maximum age counts from there), expiring
/// `token_ttl_s` from now. A past that outgrew the limits the next request would check is refused here, so
/// the gateway never hands out a token it would not accept.
///
/// When that token would say exactly what the request's token says — the same past, subject
/// and start, the same sealing key, and the same expiry (the request's token was sealed
/// `token_ttl_s` before this second ends: expiry counts in whole seconds) — the request's token
/// is handed back as it came instead of being sealed again: the same envelope under another
/// nonce would tell the client nothing more. A read repeated within the second it was last
/// answered costs no encryption.
pub fn reseal(state: &AppState, caller: &Caller, past: CausalPast, now: u64) -> Result<HeaderValue, ApiError> {
    let settings = &state.config.settings;
    if let Some(sealed) = &caller.sealed {
        if sealed.expires_at == now.saturating_add(settings.token_ttl_s)
            && past == caller.past
            && sealed.key_id == state.config.keys.current().sealing_key_id()
        {
            return Ok(sealed.value.clone());
        }
    }
    if past.len() > settings.token_max_entries {
        return Err(ApiError::SessionTooLarge {
            detail: format!(
                "the session names {} channels, more than the {} a token may hold; start a new session",
                past.len(),
                settings.token_max_entries
            ),
        });
    }
    let session = Session {
        issued_at: caller.issued_at.unwrap_or(now),
        expires_at: now.saturating_add(settings.token_ttl_s),
        subject: caller.subject.clone(),
        past,
    };
    let sealed = token::seal(&state.config.keys.current(), &session);
    if sealed.len() > settings.token_max_encoded_len {
        return Err(ApiError::SessionTooLarge {
            detail: format!(
                "the session's token would be {} characters, more than the {} accepted; start a new session",
                sealed.len(),
                settings.token_max_encoded_len
            ),
        });
    }
    HeaderValue::from_str(&sealed)
        .map_err(|e| ApiError::Internal(anyhow::anyhow!("sealed token is not a header value: {e}")))
}

/// `POST /v1/sessions`: starts a session (an empty past) or, with a valid token, answers the
/// same session re-sealed. A caller without a subject starts its session before its first
/// idempotent write: its `Idempotency-Key`s are scoped by the token it sends
/// ([`crate::write::idempotency_scope`]), so a retry of a write made without one could not
/// be told from a new write. Reads and writes nothing.
pub async fn post_session(
    axum::extract::State(state): axum::extract::State<AppState>,
    headers: HeaderMap,
) -> Result<axum::response::Response, ApiError> {
    use axum::response::IntoResponse as _;
    let now = unix_now();
    let caller = open_session(&state, &headers, now).await?;
    let token = reseal(&state, &caller, caller.past.clone(), now)?;
    let expires_at = now.saturating_add(state.config.settings.token_ttl_s);
    Ok(([(SESSION_HEADER, token)], axum::Json(serde_json::json!({ "expires_at": expires_at }))).into_response())
}

#[cfg(test)]
mod reseal_tests {
    //! What [`reseal`] hands back: the request's own token only when sealing again would
    //! say exactly the same; a new token otherwise. No infrastructure: nothing here talks
    //! to Kafka or Postgres.

    use axum::http::HeaderMap;
    use parsley::{CausalPast, ChannelId, TopicId};
    use parsley_settings::config::Config;

    use super::*;
    use crate::settings::GatewayConfig;
    use crate::token::{KeyRing, SecretKey, TokenLimits, Validity};

    const FILE: &str = r#"
[kafka]
bootstrap = "127.0.0.1:1"
[database]
url = "postgres://nobody:secret@127.0.0.1:1/none"
[[models]]
name = "shop"
topics = [{ name = "orders" }]
[gateway]
access = "open"
subject_header = "x-subject"
token_ttl_s = 600
"#;

    fn key(b: u8) -> SecretKey {
        SecretKey::from_bytes([b; 32])
    }

    fn state(ring: KeyRing) -> AppState {
        AppState::new(GatewayConfig::with_keys(Config::parse(FILE).unwrap(), ring).unwrap()).unwrap()
    }

    fn past(position: i64) -> CausalPast {
        CausalPast::from_pairs([(ChannelId::new(TopicId::from_bytes([7; 16]), 0), position)])
    }

    fn headers(token: &str, subject: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(SESSION_HEADER, HeaderValue::from_str(token).unwrap());
        if let Some(s) = subject {
            h.insert("x-subject", HeaderValue::from_str(s).unwrap());
        }
        h
    }

    /// The session a token handed out says, opened as the next request would.
    fn opened(state: &AppState, token: &HeaderValue, subject: Option<&str>, now: u64) -> token::Session {
        let ring = state.config.keys.current();
        let validity = Validity { max_age_s: None, clock_skew_s: 0 };
        token::open_with(&ring, token.to_str().unwrap(), now, subject, &TokenLimits::default(), &validity).unwrap()
    }

    #[tokio::test]
    async fn a_token_that_would_be_sealed_the_same_is_handed_back_as_it_came() {
        let s = state(KeyRing::new(vec![("k1".into(), key(1))]).unwrap());
        let now = unix_now();
        let session =
            Session { issued_at: now - 100, expires_at: now + 600, subject: Some("alice".into()), past: past(5) };
        let sent = token::seal(&s.config.keys.current(), &session);
        let caller = open_session(&s, &headers(&sent, Some("alice")), now).await.unwrap();

        // The same past in the second it was sealed: the very token.
        assert_eq!(reseal(&s, &caller, past(5), now).unwrap(), sent.as_str());
        // A grown past, or a second later (a later expiry): sealed anew, the start kept.
        for (p, at) in [(past(6), now), (past(5), now + 1)] {
            let back = reseal(&s, &caller, p.clone(), at).unwrap();
            assert_ne!(back, sent.as_str());
            let again = opened(&s, &back, Some("alice"), at);
            assert_eq!(
                again,
                Session { issued_at: now - 100, expires_at: at + 600, subject: Some("alice".into()), past: p }
            );
        }
    }

    #[tokio::test]
    async fn a_token_a_reseal_would_change_is_sealed_anew() {
        let now = unix_now();
        // An unbound token comes back bound to the caller's subject.
        let s = state(KeyRing::new(vec![("k1".into(), key(1))]).unwrap());
        let unbound = Session { issued_at: now, expires_at: now + 600, subject: None, past: past(5) };
        let sent = token::seal(&s.config.keys.current(), &unbound);
        let caller = open_session(&s, &headers(&sent, Some("bob")), now).await.unwrap();
        let back = reseal(&s, &caller, past(5), now).unwrap();
        assert_ne!(back, sent.as_str());
        assert_eq!(opened(&s, &back, Some("bob"), now).subject.as_deref(), Some("bob"));

        // A token sealed with a key that now only opens comes back sealed with the one that seals.
        let s = state(KeyRing::new(vec![("new".into(), key(2)), ("old".into(), key(1))]).unwrap());
        let old = KeyRing::new(vec![("old".into(), key(1))]).unwrap();
        let sent = token::seal(&old, &unbound);
        let caller = open_session(&s, &headers(&sent, None), now).await.unwrap();
        let back = reseal(&s, &caller, past(5), now).unwrap();
        assert_ne!(back, sent.as_str());
        assert!(token::open(&old, back.to_str().unwrap(), now, None, &TokenLimits::default()).is_err());
        assert_eq!(opened(&s, &back, None, now), unbound);
    }
}
