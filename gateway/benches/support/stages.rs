//! A recorder of the `parsley::stage` events: the projector's (`first-record` when a step's
//! poll gets its first record, `polled` when the poll ends, `committed` after the step's
//! transaction) and the gateway's (`notified` when the clock listener hears a `NOTIFY`,
//! `clock-fetched` when a model's shared re-check has fetched the clock rows, `woken` when
//! it woke its few waiting reads instead). Installed
//! as the process's only tracing subscriber; every other callsite is disabled for good, so
//! nothing else is logged or paid for.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};

/// The target of the stage events.
const STAGE_TARGET: &str = "parsley::stage";

/// The stage events seen while recording, in order.
#[derive(Default)]
pub struct Recorder {
    recording: AtomicBool,
    events: Mutex<Vec<(Instant, String)>>,
}

impl Recorder {
    /// Installs a recorder as the global subscriber (once per process).
    pub fn install() -> anyhow::Result<Arc<Recorder>> {
        let recorder = Arc::new(Recorder::default());
        tracing::subscriber::set_global_default(Events(Arc::clone(&recorder)))?;
        Ok(recorder)
    }

    /// Starts recording afresh: earlier events are dropped.
    pub fn start(&self) {
        self.events.lock().expect("the recorder's lock").clear();
        self.recording.store(true, Ordering::SeqCst);
    }

    /// Stops recording; the events since [`Recorder::start`].
    pub fn stop(&self) -> Vec<(Instant, String)> {
        self.recording.store(false, Ordering::SeqCst);
        std::mem::take(&mut *self.events.lock().expect("the recorder's lock"))
    }
}

struct Events(Arc<Recorder>);

/// The `stage` field of an event.
struct StageField(Option<String>);

impl Visit for StageField {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "stage" {
            self.0 = Some(value.to_string());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "stage" {
            self.0 = Some(format!("{value:?}").trim_matches('"').to_string());
        }
    }
}

impl Subscriber for Events {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if self.enabled(metadata) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.is_event() && metadata.target() == STAGE_TARGET
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        // Never called: no span is enabled.
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let at = Instant::now();
        if !self.0.recording.load(Ordering::SeqCst) {
            return;
        }
        let mut stage = StageField(None);
        event.record(&mut stage);
        if let Some(stage) = stage.0 {
            self.0.events.lock().expect("the recorder's lock").push((at, stage));
        }
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}
