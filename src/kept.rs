//! The rules of snapshots a reader keeps in memory (the gateway's read cache), as pure
//! functions: the gateway and the simulator's gateways both call them, as both hosts of a
//! task drive [`crate::host::TaskHost`].
//!
//! A kept snapshot is one snapshot's clock rows and data, exactly as a statement returned
//! them, kept under the **generation** of the tasks it was served by: a counter of what the
//! reader's listener heard. Serving it is serving that snapshot, so the gate still runs over
//! its rows; the rules below only decide how old a covering snapshot may be — no older than
//! the next announced change of the tasks that serve it:
//!
//! - [`KeptRules::generation_owner`]: a key's snapshot is kept under its owner's generation,
//!   a page's (served by several tasks) under the whole model's.
//! - [`KeptRules::bump`]: which generations each thing the listener hears changes. A
//!   notification of a task changes that task's; of a model, the model's; a document changed
//!   outside a step, every model's. So does every event after which something may have gone
//!   unheard: the listener connecting (again), losing its connection, finding its connection
//!   replaced, a trigger that announces changes touched, announcing turned on or off.
//! - [`KeptRules::keep_under`]: a snapshot is kept under the generation read *before* its
//!   statement, and only if it is still the same after: a notification heard meanwhile may be
//!   of a commit the snapshot does not have.
//! - [`KeptRules::servable`]: a kept snapshot may serve while its generation is current and
//!   it is younger than the maximum age.
//! - [`KeptRules::consult`]: a read is served from a kept snapshot only if the listener is
//!   heard and every change announced, the snapshot is servable, its own rows cover the
//!   session, and the listener has passed a **barrier** since the read arrived (every
//!   notification committed before the read was heard): so a change committed before a read
//!   arrives is seen by that read.
//!
//! Feature `sim` adds [`KeptSabotage`]: broken variants for the simulator's meta-tests.

use std::collections::BTreeSet;
// A span of time as a value (no clock is read here: hosts pass ages in).
use core::time::Duration;

use crate::gate::{gate, refresh, ClockRow, ModelShape};
use crate::past::CausalPast;

/// What a reader's listener heard or went through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heard {
    /// A step of one task changed its clock (or its status).
    Task(u32),
    /// The model's shape changed, or it was removed.
    Model,
    /// A document changed outside a step: every model.
    EveryModel,
    /// The listener connected and listens (again): what was committed before is unheard.
    Connected,
    /// The listener lost its connection: nothing is heard until it connects again.
    Lost,
    /// A barrier was answered by another backend than the one listening: the connection was
    /// replaced underneath, and what was committed meanwhile was never heard.
    Replaced,
    /// A trigger that announces changes was disabled, enabled, dropped or created.
    TriggersTouched,
    /// Whether every change is announced turned on or off.
    AnnouncingChanged,
}

/// The generations a [`Heard`] changes (of the reader's model, or of every model).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bump {
    Nothing,
    Task(u32),
    Model,
    EveryModel,
}

/// What a read does about the snapshot kept for it ([`KeptRules::consult`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Consult {
    /// Read the database: nothing kept may serve this read.
    Read,
    /// Wait for the listener's barrier, then consult again (`barrier_passed`).
    Barrier,
    /// Serve the kept snapshot, with the token refreshed over its rows.
    Serve { refreshed: CausalPast },
}

/// A snapshot kept for a read, as [`KeptRules::consult`] judges it.
#[derive(Clone, Copy, Debug)]
pub struct KeptView<'a> {
    /// Whether it is still servable ([`KeptRules::servable`]).
    pub servable: bool,
    pub shape: &'a ModelShape,
    pub rows: &'a [ClockRow],
    /// The tasks it serves the read by, under its shape.
    pub served: &'a BTreeSet<u32>,
}

/// Deliberately broken rules, for the simulator's meta-tests only.
#[cfg(feature = "sim")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeptSabotage {
    None,
    /// A kept snapshot serves a read without waiting for the listener's barrier.
    NoBarrier,
    /// Connecting, losing or replacing the listener's connection changes no generation, so
    /// snapshots kept before it are served after it.
    KeptAcrossReconnect,
    /// A snapshot is kept under the generation read after its statement, whatever was
    /// heard while it ran.
    GenerationAfterStatement,
    /// A page is kept under the generation of its first serving task only.
    PageUnderOwner,
}

/// The rules of kept snapshots: [`KeptRules::SHIPPED`] everywhere but the simulator's
/// meta-tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeptRules {
    #[cfg(feature = "sim")]
    sabotage: KeptSabotage,
}

impl Default for KeptRules {
    fn default() -> Self {
        KeptRules::SHIPPED
    }
}

impl KeptRules {
    /// The rules as documented above.
    pub const SHIPPED: KeptRules = KeptRules {
        #[cfg(feature = "sim")]
        sabotage: KeptSabotage::None,
    };

    /// The rules with one deliberately broken (simulator only).
    #[cfg(feature = "sim")]
    pub fn sabotaged(sabotage: KeptSabotage) -> KeptRules {
        KeptRules { sabotage }
    }

    #[cfg(feature = "sim")]
    fn broken(&self, sabotage: KeptSabotage) -> bool {
        self.sabotage == sabotage
    }

    /// Whose generation a snapshot served by `served` is kept under: the task serving a
    /// key (`key_owner`), or (`None`) the whole model's, for a page or a key no single task
    /// owns.
    pub fn generation_owner(&self, key_owner: Option<u32>, served: &BTreeSet<u32>) -> Option<u32> {
        #[cfg(feature = "sim")]
        if key_owner.is_none() && self.broken(KeptSabotage::PageUnderOwner) {
            return served.first().copied();
        }
        let _ = served;
        key_owner
    }

    /// The generations `heard` changes.
    pub fn bump(&self, heard: Heard) -> Bump {
        #[cfg(feature = "sim")]
        if self.broken(KeptSabotage::KeptAcrossReconnect)
            && matches!(heard, Heard::Connected | Heard::Lost | Heard::Replaced)
        {
            return Bump::Nothing;
        }
        match heard {
            Heard::Task(task) => Bump::Task(task),
            Heard::Model => Bump::Model,
            Heard::EveryModel
            | Heard::Connected
            | Heard::Lost
            | Heard::Replaced
            | Heard::TriggersTouched
            | Heard::AnnouncingChanged => Bump::EveryModel,
        }
    }

    /// Whether snapshots may be kept and served at all: the listener is heard, and every
    /// change is announced.
    pub fn may_keep(&self, listening: bool, announced: bool) -> bool {
        listening && announced
    }

    /// The generation to keep a snapshot under: `before` (read before its statement ran)
    /// if the generation is still `after`, the same, once it ran; else nothing is kept.
    pub fn keep_under(&self, before: Option<u64>, after: Option<u64>) -> Option<u64> {
        #[cfg(feature = "sim")]
        if self.broken(KeptSabotage::GenerationAfterStatement) {
            return after;
        }
        before.filter(|_| before == after)
    }

    /// Whether a snapshot kept under `kept` may still serve, the generation being `now`:
    /// unchanged, and `age` below `max_age`.
    pub fn servable(&self, kept: u64, now: Option<u64>, age: Duration, max_age: Duration) -> bool {
        now == Some(kept) && age < max_age
    }

    /// What a read with `demand` (its token as the gate reads it) and `token` does about the
    /// snapshot kept for it: read the database, wait for the barrier, or serve it.
    pub fn consult(
        &self,
        kept: Option<KeptView<'_>>,
        may_keep: bool,
        barrier_passed: bool,
        demand: &CausalPast,
        token: &CausalPast,
    ) -> Consult {
        let Some(kept) = kept.filter(|k| may_keep && k.servable) else { return Consult::Read };
        if !gate(demand, kept.shape, kept.rows, kept.served).is_covered() {
            return Consult::Read;
        }
        #[cfg(feature = "sim")]
        let barrier_passed = barrier_passed || self.broken(KeptSabotage::NoBarrier);
        if !barrier_passed {
            return Consult::Barrier;
        }
        Consult::Serve { refreshed: refresh(token, kept.shape, kept.rows, kept.served) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::{ChannelId, TopicId};

    const ORDERS: TopicId = TopicId::from_bytes([1; 16]);

    fn shape() -> ModelShape {
        ModelShape { received_topics: [ORDERS].into(), task_count: 2 }
    }

    #[test]
    fn a_key_is_kept_under_its_owner_and_a_page_under_the_model() {
        let r = KeptRules::SHIPPED;
        assert_eq!(r.generation_owner(Some(1), &[1].into()), Some(1));
        assert_eq!(r.generation_owner(None, &[0, 1].into()), None);
    }

    #[test]
    fn everything_after_which_a_change_may_be_unheard_changes_every_generation() {
        let r = KeptRules::SHIPPED;
        assert_eq!(r.bump(Heard::Task(3)), Bump::Task(3));
        assert_eq!(r.bump(Heard::Model), Bump::Model);
        for heard in [
            Heard::EveryModel,
            Heard::Connected,
            Heard::Lost,
            Heard::Replaced,
            Heard::TriggersTouched,
            Heard::AnnouncingChanged,
        ] {
            assert_eq!(r.bump(heard), Bump::EveryModel, "{heard:?}");
        }
    }

    #[test]
    fn a_snapshot_is_kept_only_when_nothing_was_heard_while_it_was_read() {
        let r = KeptRules::SHIPPED;
        assert_eq!(r.keep_under(Some(4), Some(4)), Some(4));
        assert_eq!(r.keep_under(Some(4), Some(5)), None);
        assert_eq!(r.keep_under(None, Some(5)), None);
        assert_eq!(r.keep_under(None, None), None);
    }

    #[test]
    fn a_snapshot_serves_while_its_generation_is_current_and_it_is_young() {
        let r = KeptRules::SHIPPED;
        let ms = Duration::from_millis;
        assert!(r.servable(7, Some(7), ms(10), ms(100)));
        assert!(!r.servable(7, Some(8), ms(10), ms(100)));
        assert!(!r.servable(7, None, ms(10), ms(100)));
        assert!(!r.servable(7, Some(7), ms(100), ms(100)));
    }

    #[test]
    fn a_kept_snapshot_serves_only_covered_sessions_after_the_barrier() {
        let r = KeptRules::SHIPPED;
        let shape = shape();
        let c0 = ChannelId::new(ORDERS, 0);
        let rows = [ClockRow { task: 0, channel: c0, position: 5 }];
        let served: BTreeSet<u32> = [0].into();
        let view = |servable| Some(KeptView { servable, shape: &shape, rows: &rows, served: &served });
        let covered = CausalPast::new().merge(c0, 5);
        let ahead = CausalPast::new().merge(c0, 6);
        assert_eq!(r.consult(view(true), true, false, &covered, &covered), Consult::Barrier);
        let Consult::Serve { refreshed } = r.consult(view(true), true, true, &covered, &covered) else {
            panic!("a covered session is served after the barrier")
        };
        assert_eq!(refreshed.iter().collect::<Vec<_>>(), vec![(c0, 5)]);
        assert_eq!(r.consult(view(true), true, true, &ahead, &ahead), Consult::Read, "a write it predates");
        assert_eq!(r.consult(view(false), true, true, &covered, &covered), Consult::Read, "not servable");
        assert_eq!(r.consult(view(true), false, true, &covered, &covered), Consult::Read, "not listening");
        assert_eq!(r.consult(None, true, true, &covered, &covered), Consult::Read, "nothing kept");
    }
}
