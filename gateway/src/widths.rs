//! The width each configured model was recorded with (`parsley.models.task_count`, the
//! partition count of its received topics when its state was created), cached for the write
//! path: a write to a topic whose partition count has since changed is refused
//! (`409 width-changed`) rather than acknowledged for a partition no task reads.
//!
//! Loaded at the first write, refreshed with the topic facts every `metadata_refresh_ms`,
//! and re-read before a write is refused.

use std::collections::BTreeMap;
use std::sync::Mutex;

use parsley_store::StoreError;
use sqlx::PgPool;

/// Per model: `Some(n)` recorded with `n` tasks, `None` no state yet (the projector records
/// the width it starts with).
#[derive(Debug, Default)]
pub struct RecordedWidths {
    /// `None` until the first successful load.
    widths: Mutex<Option<BTreeMap<String, Option<u32>>>>,
}

impl RecordedWidths {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<BTreeMap<String, Option<u32>>>> {
        self.widths.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a load has ever succeeded.
    pub fn loaded(&self) -> bool {
        self.lock().is_some()
    }

    /// Model `model`'s recorded width: `None` not loaded yet, `Some(None)` no state yet.
    pub fn cached(&self, model: &str) -> Option<Option<u32>> {
        self.lock().as_ref().map(|w| w.get(model).copied().flatten())
    }

    /// Re-reads the recorded widths of `models`. Before the migrations ran no model has
    /// state: every width is unrecorded.
    pub async fn refresh(&self, pool: &PgPool, models: &[String]) -> Result<(), StoreError> {
        let recorded = parsley_store::ordering::recorded_widths(pool, models).await?;
        let widths: BTreeMap<String, Option<u32>> =
            models.iter().map(|m| (m.clone(), recorded.get(m).copied())).collect();
        *self.lock() = Some(widths);
        Ok(())
    }
}
