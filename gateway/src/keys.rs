//! The token key ring a gateway seals and opens with, reloadable without a restart.
//!
//! Keys from a file (`PARSLEY_TOKEN_KEYS_FILE` or `gateway.token_keys_file`) are re-read on
//! `SIGHUP` and, every `gateway.token_keys_reload_ms`, when the file's modification time,
//! size or inode changed. A reload parses the whole file first and swaps the ring in one
//! step; a file that does not parse keeps the ring in use and logs why. Keys from the
//! environment (`PARSLEY_TOKEN_KEYS`) cannot be re-read: a `SIGHUP` is logged and ignored.
//!
//! Exported: `parsley_gateway_token_keys{key_id,role}` (1 for each key of the ring in use, 0
//! for a key or role a reload removed — never a key itself) and
//! `parsley_gateway_token_key_reloads_total{result}` (`ok`, `error`).

use std::fmt;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::metrics::{Metric, Metrics};
use crate::token::KeyRing;

/// The token keys themselves: `id:base64key[:seal|:open][,...]` (unmarked: the first seals).
/// Not reloadable.
pub const ENV_TOKEN_KEYS: &str = "PARSLEY_TOKEN_KEYS";

/// Where the ring came from, which says whether it can be re-read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// A file: re-read on `SIGHUP` and when it changes.
    File(PathBuf),
    /// The `PARSLEY_TOKEN_KEYS` environment variable: fixed for the process's life.
    Environment,
    /// Handed over by the embedding code (tests, benchmarks): fixed, and no signal handler
    /// is installed for it.
    Given,
}

/// What identifies a version of the keys file without reading it.
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

/// The ring in use, swapped whole by a reload. Requests take a snapshot ([`Self::current`])
/// and keep it for what they do with it.
pub struct TokenKeys {
    ring: RwLock<Arc<KeyRing>>,
    source: KeySource,
    /// The file as last read (or tried), for the change poll.
    seen: Mutex<Option<FileStamp>>,
}

impl fmt::Debug for TokenKeys {
    /// Key ids and roles only (`KeyRing`'s `Debug` redacts the keys as well).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ring = self.current();
        f.debug_struct("TokenKeys").field("source", &self.source).field("keys", &ring.roles()).finish()
    }
}

/// Why a reload kept the ring in use.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("token keys from {0} cannot be re-read; restart the gateway to change them")]
    NotReloadable(&'static str),
    #[error(transparent)]
    Invalid(#[from] anyhow::Error),
}

impl TokenKeys {
    pub fn new(ring: KeyRing, source: KeySource) -> TokenKeys {
        let seen = match &source {
            KeySource::File(path) => stamp(path),
            _ => None,
        };
        TokenKeys { ring: RwLock::new(Arc::new(ring)), source, seen: Mutex::new(seen) }
    }

    /// Keys handed over by the embedding code: never reloaded.
    pub fn given(ring: KeyRing) -> TokenKeys {
        TokenKeys::new(ring, KeySource::Given)
    }

    /// The ring in use.
    pub fn current(&self) -> Arc<KeyRing> {
        Arc::clone(&self.ring.read().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn source(&self) -> &KeySource {
        &self.source
    }

    /// Re-reads the keys file and, if it parses, puts its ring in use; otherwise the ring
    /// in use stays. Returns the ring now in use. Errors never quote a key.
    pub fn reload(&self) -> Result<Arc<KeyRing>, ReloadError> {
        let path = match &self.source {
            KeySource::File(path) => path,
            KeySource::Environment => return Err(ReloadError::NotReloadable(ENV_TOKEN_KEYS)),
            KeySource::Given => return Err(ReloadError::NotReloadable("the embedding code")),
        };
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = stamp(path);
        let ring = Arc::new(read_ring(path)?);
        *self.ring.write().unwrap_or_else(|e| e.into_inner()) = Arc::clone(&ring);
        Ok(ring)
    }

    /// Whether the keys file looks different from when it was last read.
    fn file_changed(&self) -> bool {
        match &self.source {
            KeySource::File(path) => stamp(path) != *self.seen.lock().unwrap_or_else(|e| e.into_inner()),
            _ => false,
        }
    }
}

/// Reads and parses a keys file. Errors name the file, never a key.
pub fn read_ring(path: &Path) -> anyhow::Result<KeyRing> {
    let spec =
        std::fs::read_to_string(path).with_context(|| format!("reading the token keys file {}", path.display()))?;
    KeyRing::parse(&spec).with_context(|| format!("the token keys file {} is invalid", path.display()))
}

/// Sets `parsley_gateway_token_keys` for `ring`: 1 for each of its keys under its role, 0
/// for each key id and role of `previous` that is no longer in it.
pub fn publish(metrics: &Metrics, previous: Option<&KeyRing>, ring: &KeyRing) {
    let now = ring.roles();
    for (id, role) in previous.map(KeyRing::roles).unwrap_or_default() {
        if !now.contains(&(id, role)) {
            metrics.set(Metric::TokenKeys, &[("key_id", id), ("role", role.as_str())], 0.0);
        }
    }
    for (id, role) in now {
        metrics.set(Metric::TokenKeys, &[("key_id", id), ("role", role.as_str())], 1.0);
    }
}

/// One reload, logged and counted. `why`: what asked for it.
fn reload_now(keys: &TokenKeys, metrics: &Metrics, why: &str) {
    let previous = keys.current();
    match keys.reload() {
        Ok(ring) => {
            publish(metrics, Some(&previous), &ring);
            metrics.add(Metric::TokenKeyReloadsTotal, &[("result", "ok")], 1.0);
            let roles: Vec<String> = ring.roles().iter().map(|(id, role)| format!("{id}:{}", role.as_str())).collect();
            tracing::info!(why, keys = %roles.join(","), "token keys reloaded");
        }
        Err(ReloadError::NotReloadable(from)) => {
            tracing::warn!(why, from, "token keys cannot be re-read; restart the gateway to change them");
        }
        Err(ReloadError::Invalid(e)) => {
            metrics.add(Metric::TokenKeyReloadsTotal, &[("result", "error")], 1.0);
            let kept = previous.sealing_key_id();
            tracing::error!(why, error = %format!("{e:#}"), sealing = kept, "token keys not reloaded; the ring in use is kept");
        }
    }
}

/// Starts the reloader of `keys` until `shutdown` turns true: on `SIGHUP`, and every `poll`
/// (zero: never) when the keys file changed. The `SIGHUP` handler is installed before this
/// returns, so a signal sent afterwards never takes the default action (terminating the
/// process); if it cannot be installed, that is logged and the file is still polled. Keys
/// handed over by the embedding code get no reloader and no handler.
pub fn spawn_reloader(
    keys: Arc<TokenKeys>,
    metrics: Arc<Metrics>,
    poll: Duration,
    mut shutdown: watch::Receiver<bool>,
) -> Option<JoinHandle<()>> {
    match keys.source() {
        KeySource::Given => return None,
        KeySource::Environment => tracing::info!(
            "token keys from {}: not reloadable (SIGHUP is ignored); restart to change them",
            ENV_TOKEN_KEYS
        ),
        KeySource::File(path) => {
            let every = if poll.is_zero() { "never".to_string() } else { format!("{} ms", poll.as_millis()) };
            tracing::info!(file = %path.display(), poll = %every, "token keys reloadable on SIGHUP and when the file changes");
        }
    }
    let mut hangup = match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::error!(error = %e, "cannot install the SIGHUP handler: token keys reload only when the file changes");
            None
        }
    };
    let polling = !poll.is_zero() && matches!(keys.source(), KeySource::File(_));
    Some(tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                Some(()) = async { hangup.as_mut()?.recv().await }, if hangup.is_some() => {
                    reload_now(&keys, &metrics, "SIGHUP");
                }
                _ = tokio::time::sleep(poll), if polling => {
                    if keys.file_changed() {
                        reload_now(&keys, &metrics, "the keys file changed");
                    }
                }
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use base64::engine::general_purpose::STANDARD;
    use base64::Engine as _;

    use super::*;
    use crate::metrics::METRICS;
    use crate::token::KeyRole;

    fn key(b: u8) -> String {
        STANDARD.encode([b; 32])
    }

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("parsley-gateway-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_reload_swaps_a_good_file_in_and_keeps_the_ring_on_a_bad_one() {
        let dir = dir("keys-reload");
        let file = dir.join("keys");
        std::fs::write(&file, format!("old:{}\n", key(1))).unwrap();
        let keys = TokenKeys::new(read_ring(&file).unwrap(), KeySource::File(file.clone()));
        assert_eq!(keys.current().sealing_key_id(), "old");
        assert!(!keys.file_changed());

        std::fs::write(&file, format!("new:{}:open\nold:{}\n", key(2), key(1))).unwrap();
        let before = keys.current();
        let ring = keys.reload().unwrap();
        assert_eq!(ring.roles(), vec![("new", KeyRole::Open), ("old", KeyRole::Seal)]);
        assert_eq!(keys.current().roles(), ring.roles());
        assert_eq!(before.roles(), vec![("old", KeyRole::Seal)], "a snapshot taken before is unchanged");

        let secret = key(3);
        for bad in [format!("x:{secret}:seal,y:{secret}:seal"), format!("x:{secret}:sael"), String::new()] {
            std::fs::write(&file, &bad).unwrap();
            let err = format!("{:#}", keys.reload().unwrap_err());
            assert!(err.contains("token keys file") && !err.contains(&secret), "{err}");
            assert_eq!(keys.current().roles(), ring.roles(), "the ring in use is kept");
        }
        std::fs::remove_file(&file).unwrap();
        assert!(format!("{:#}", keys.reload().unwrap_err()).contains("reading the token keys file"));
        assert_eq!(keys.current().sealing_key_id(), "old");
        std::fs::remove_dir_all(&dir).unwrap();

        let fixed = TokenKeys::new(ring.as_ref().clone(), KeySource::Environment);
        assert!(matches!(fixed.reload(), Err(ReloadError::NotReloadable(_))));
        assert!(!format!("{fixed:?}").contains(&key(2)), "never printed");
    }

    #[test]
    fn the_poll_sees_a_changed_file() {
        let dir = dir("keys-stamp");
        let file = dir.join("keys");
        std::fs::write(&file, format!("a:{}\n", key(1))).unwrap();
        let keys = TokenKeys::new(read_ring(&file).unwrap(), KeySource::File(file.clone()));
        assert!(!keys.file_changed());
        // Replaced by a rename, as the runbook says: another inode.
        let next = dir.join("keys.next");
        std::fs::write(&next, format!("b:{}\n", key(2))).unwrap();
        std::fs::rename(&next, &file).unwrap();
        assert!(keys.file_changed());
        keys.reload().unwrap();
        assert!(!keys.file_changed(), "read: unchanged until it changes again");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_gauge_names_key_ids_and_roles_and_zeroes_what_a_reload_removed() {
        let metrics = Metrics::new(METRICS);
        let one = KeyRing::parse(&format!("old:{}", key(1))).unwrap();
        publish(&metrics, None, &one);
        let two = KeyRing::parse(&format!("new:{}:seal,old:{}", key(2), key(1))).unwrap();
        publish(&metrics, Some(&one), &two);
        let value = |id, role| metrics.value(Metric::TokenKeys, &[("key_id", id), ("role", role)]);
        assert_eq!(value("new", "seal"), Some(1.0));
        assert_eq!(value("old", "open"), Some(1.0));
        assert_eq!(value("old", "seal"), Some(0.0), "old no longer seals");
        let text = metrics.render();
        assert!(!text.contains(&key(1)) && !text.contains(&key(2)), "{text}");
    }
}
