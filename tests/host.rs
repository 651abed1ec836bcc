//! The host state machine (`parsley::host`): the transitions of one task's start and step
//! sequence, driven as a host would, with no I/O.

use std::collections::{BTreeMap, BTreeSet};

use parsley::engine::{ChannelFact, HeldRecord, Receipt};
use parsley::host::{ChannelStart, Failure, LogStartCheck, Next, TaskHost, TaskStatus};
use parsley::{CausalPast, ChannelId, EngineConfig, PersistedState, Position, RefusalReason, TopicId};

fn ch(topic: u8) -> ChannelId {
    ChannelId::new(TopicId::from_bytes([topic; 16]), 0)
}

/// The task's two received channels, and an upstream channel of a topic it does not receive.
fn a() -> ChannelId {
    ch(1)
}
fn b() -> ChannelId {
    ch(2)
}
fn up() -> ChannelId {
    ch(9)
}

fn causes(pairs: &[(ChannelId, Position)]) -> Vec<u8> {
    CausalPast::from_pairs(pairs.iter().copied()).encode()
}

/// A record to feed: channel, position, the encoded causes (if any), the payload.
type Rec = (ChannelId, Position, Option<Vec<u8>>, u32);

fn host(recorded: TaskStatus) -> TaskHost<u32> {
    TaskHost::new(EngineConfig::default(), [b(), a()], recorded)
}

/// Drives a start from `state` with every log start at `log_start`; returns what the start
/// check found.
fn start_from(host: &mut TaskHost<u32>, state: PersistedState<u32>, log_start: Position) -> parsley::host::Observed {
    assert_eq!(host.next_action(), Next::Restore);
    host.restored(state, BTreeSet::new());
    assert_eq!(host.next_action(), Next::ReadStarts(vec![a(), b()]), "every channel, in channel order");
    let starts: Vec<ChannelStart> = [a(), b()]
        .iter()
        .map(|&channel| ChannelStart { channel, log_start, initial_fed_up_to: log_start - 1 })
        .collect();
    let observed = host.started(&starts);
    assert_eq!(host.next_action(), Next::CommitStart);
    host.take_start();
    host.committed();
    observed
}

fn started(recorded: TaskStatus) -> TaskHost<u32> {
    let mut h = host(recorded);
    start_from(&mut h, PersistedState::default(), 0);
    assert_eq!(h.next_action(), Next::Assign(vec![(a(), 0), (b(), 0)]));
    h.assigned();
    h
}

/// What one step's batch did.
#[derive(Debug, Default)]
struct Fed {
    delivered: Vec<(ChannelId, Position)>,
    refused: bool,
    read_positions_asked: bool,
}

/// Polls `records` as one batch and feeds it as a host does, answering read positions with
/// `read_to`; stops where the step may end.
fn batch(h: &mut TaskHost<u32>, records: Vec<Rec>, read_to: &[(ChannelId, Position)]) -> Fed {
    let mut fed = Fed::default();
    assert!(matches!(h.next_action(), Next::Poll { .. }), "{:?}", h.next_action());
    h.polled(false);
    let mut records = Some(records);
    loop {
        match h.next_action() {
            Next::Drain => fed.delivered.extend(h.drain().iter().map(|d| (d.channel, d.position))),
            Next::Feed => {
                for (c, p, causes, payload) in records.take().expect("fed once") {
                    let headers: Vec<Option<&[u8]>> = causes.iter().map(|v| Some(v.as_slice())).collect();
                    match h.receive(c, p, &headers, payload) {
                        Ok(Receipt::Accepted { deliveries }) => {
                            fed.delivered.extend(deliveries.iter().map(|d| (d.channel, d.position)))
                        }
                        Ok(Receipt::Duplicate) => {}
                        Err(_) => {
                            fed.refused = true;
                            break;
                        }
                    }
                }
                h.batch_done();
            }
            Next::ReadPositions => {
                fed.read_positions_asked = true;
                h.read_positions(read_to);
            }
            Next::Poll { .. } | Next::Commit => return fed,
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn a_start_restores_seeds_checks_every_log_start_commits_and_assigns() {
    let mut h = host(TaskStatus::Refused);
    assert_eq!(h.next_action(), Next::Restore);
    let mut state = PersistedState::default();
    state.fed_up_to.insert(a(), 4);
    h.restored(state, BTreeSet::new());
    assert_eq!(h.next_action(), Next::ReadStarts(vec![a(), b()]));
    let observed = h.started(&[
        ChannelStart { channel: b(), log_start: 7, initial_fed_up_to: 6 },
        ChannelStart { channel: a(), log_start: 3, initial_fed_up_to: 2 },
    ]);
    assert_eq!((observed.accepted, observed.refusal), (vec![a(), b()], None), "checked in channel order");
    assert_eq!(h.engine().fed_up_to(&a()), Some(4), "a channel with a baseline keeps it");
    assert_eq!(h.engine().fed_up_to(&b()), Some(6), "a channel without one is seeded");
    assert_eq!(h.next_action(), Next::CommitStart);
    let start = h.take_start();
    assert_eq!(start.changes.fed_up_to, vec![(b(), 6)]);
    assert!(start.write_running && start.notify, "a refusal not derived again is cleared");
    assert_eq!(h.next_action(), Next::AwaitCommit);
    h.committed();
    assert_eq!(h.recorded(), TaskStatus::Running);
    assert_eq!(h.next_action(), Next::Assign(vec![(a(), 5), (b(), 7)]));
    h.assigned();
    assert!(h.drain_pending(), "the first step after a restore drains");
    assert_eq!(h.next_action(), Next::Poll { max_records: None });
}

#[test]
fn a_start_that_finds_a_refusal_commits_it_and_the_refusal_is_final() {
    let mut h = host(TaskStatus::Running);
    let mut state = PersistedState::default();
    state.fed_up_to.insert(a(), 4);
    state.fed_up_to.insert(b(), 4);
    assert_eq!(h.next_action(), Next::Restore);
    h.restored(state, BTreeSet::new());
    let observed = h.started(&[
        ChannelStart { channel: a(), log_start: 9, initial_fed_up_to: 8 },
        ChannelStart { channel: b(), log_start: 9, initial_fed_up_to: 8 },
    ]);
    let refusal = observed.refusal.expect("positions 5..8 of a were never read");
    assert_eq!((refusal.reason, refusal.channel), (RefusalReason::PositionsDiscardedUnread, Some(a())));
    assert!(observed.accepted.is_empty(), "b is not checked after a refused");
    let start = h.take_start();
    assert_eq!(start.changes.refusal.as_ref(), Some(&refusal));
    assert!(!start.write_running && start.notify);
    h.committed();
    assert_eq!(h.next_action(), Next::Refused(refusal.clone()));
    assert_eq!(h.recorded(), TaskStatus::Refused);
    h.log_start_check_due();
    h.prune_due();
    h.width_check_due();
    h.interrupted();
    h.failed(Failure::Error);
    assert_eq!(h.next_action(), Next::Refused(refusal), "final until the task is started again");
}

#[test]
fn a_refusal_ends_the_step_without_observing_the_read_position_and_is_final() {
    let mut h = started(TaskStatus::Running);
    let fed = batch(&mut h, vec![(a(), 0, None, 10), (a(), 1, Some(vec![0xff]), 11), (a(), 2, None, 12)], &[(a(), 9)]);
    assert!(fed.refused && !fed.read_positions_asked, "{fed:?}");
    assert_eq!(fed.delivered, vec![(a(), 0)], "nothing after the refused record is fed");
    assert_eq!(h.next_action(), Next::Commit);
    let commit = h.end_step().expect("a refusal commits");
    let refusal = commit.changes.refusal.clone().expect("the refusal is persisted by the step");
    assert_eq!((refusal.reason, refusal.position), (RefusalReason::UndecodableMetadata, Some(1)));
    assert_eq!(commit.changes.fed_up_to, vec![(a(), 0)], "fed_up_to stops before the refused record");
    assert!(commit.notify);
    h.committed();
    assert_eq!(h.next_action(), Next::Refused(refusal.clone()));
    assert_eq!(h.recorded(), TaskStatus::Refused);
    h.log_start_check_due();
    assert_eq!(h.next_action(), Next::Refused(refusal));
}

/// Runs `f`, which must break the protocol, and returns the message the machine refused
/// it with.
fn protocol_violation(f: impl FnOnce()) -> String {
    let payload = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(()) => panic!("an answer in the wrong state was taken"),
        Err(payload) => payload,
    };
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn a_refused_task_cannot_poll() {
    let mut h = started(TaskStatus::Running);
    batch(&mut h, vec![(a(), 0, Some(vec![0xff]), 10)], &[]);
    h.end_step();
    h.committed();
    assert!(matches!(h.next_action(), Next::Refused(_)), "the refusal is final");
    let message = protocol_violation(|| h.polled(false));
    assert!(message.contains("host protocol: polled"), "{message}");
}

#[test]
fn the_read_position_is_observed_after_a_complete_feed_and_moves_fed_up_to() {
    let mut h = started(TaskStatus::Running);
    let fed = batch(&mut h, vec![(a(), 0, None, 10)], &[(a(), 3), (b(), 0)]);
    assert!(fed.read_positions_asked);
    assert_eq!(h.engine().fed_up_to(&a()), Some(2), "read past markers up to 2");
    h.end_step().expect("fed");
    h.committed();
    // An empty poll that only moved the read position still commits; one that moved
    // nothing is idle.
    let fed = batch(&mut h, vec![], &[(a(), 5)]);
    assert!(fed.read_positions_asked);
    assert_eq!(h.end_step().expect("the read position moved").changes.fed_up_to, vec![(a(), 4)]);
    h.committed();
    batch(&mut h, vec![], &[(a(), 5)]);
    assert_eq!(h.end_step(), None, "nothing moved: no transaction");
}

#[test]
fn a_failed_commit_forces_a_restore_before_the_next_feed() {
    let mut h = started(TaskStatus::Running);
    batch(&mut h, vec![], &[]);
    h.end_step().expect("the first step after a start drains and commits");
    h.committed();
    let persisted = h.engine().snapshot();
    batch(&mut h, vec![(a(), 0, None, 10)], &[]);
    assert!(h.step_open());
    h.end_step().expect("fed");
    h.failed(Failure::Error);
    assert_eq!(h.next_action(), Next::Restore, "the engine is ahead of the database");
    h.failure_recorded();
    assert_eq!(h.recorded(), TaskStatus::Failing);
    start_from(&mut h, persisted, 0);
    assert_eq!(h.engine().fed_up_to(&a()), Some(-1), "rebuilt from what was persisted");
    h.assigned();
    // The first step after the restore drains, and commits even with nothing fed: the row
    // says failing and must say running again.
    let fed = batch(&mut h, vec![], &[]);
    assert!(fed.delivered.is_empty());
    let commit = h.end_step().expect("a failing task commits");
    assert!(commit.write_running && commit.notify);
    h.committed();
    assert_eq!(h.recorded(), TaskStatus::Running);
}

#[test]
fn a_failed_step_cannot_feed_before_it_restores() {
    let mut h = started(TaskStatus::Running);
    batch(&mut h, vec![(a(), 0, None, 10)], &[]);
    h.failed(Failure::Error);
    assert_eq!(h.next_action(), Next::Restore);
    let message = protocol_violation(|| {
        h.receive(a(), 1, &[], 11).ok();
    });
    assert!(message.contains("host protocol: receive"), "{message}");
}

/// A started host that committed an empty step, and the state it persisted.
fn committed_once() -> (TaskHost<u32>, PersistedState<u32>) {
    let mut h = started(TaskStatus::Running);
    batch(&mut h, vec![], &[]);
    h.end_step();
    h.committed();
    let persisted = h.engine().snapshot();
    (h, persisted)
}

#[test]
fn careful_after_a_failure_feeds_growing_steps_until_past_the_failed_steps_positions() {
    let (mut h, persisted) = committed_once();
    batch(&mut h, vec![(a(), 0, None, 10), (a(), 1, None, 11), (b(), 0, None, 20)], &[]);
    let commit = h.end_step().expect("fed");
    assert!(!commit.careful, "a batch in one call normally");
    h.failed(Failure::Error);
    start_from(&mut h, persisted.clone(), 0);
    h.assigned();
    assert!(h.careful());
    // One record, then two: the careful steps grow while they commit.
    assert_eq!(h.next_action(), Next::Poll { max_records: Some(1) }, "careful until a@1 and b@0 are fed");
    batch(&mut h, vec![(a(), 0, None, 10)], &[]);
    assert!(h.end_step().expect("fed").careful, "projected one record per call");
    h.committed();
    assert!(h.careful());
    assert_eq!(h.next_action(), Next::Poll { max_records: Some(2) }, "doubled after a careful step committed");
    batch(&mut h, vec![(a(), 1, None, 11), (b(), 0, None, 20)], &[]);
    assert!(h.end_step().expect("fed").careful);
    h.committed();
    assert!(!h.careful());
    assert_eq!(h.next_action(), Next::Poll { max_records: None });
}

#[test]
fn careful_steps_double_while_they_commit_and_start_again_from_one_after_a_failure() {
    let (mut h, persisted) = committed_once();
    let records: Vec<_> = (0..40).map(|p| (a(), p, None, 10)).collect();
    batch(&mut h, records, &[]);
    h.end_step().expect("fed");
    h.failed(Failure::Error);
    start_from(&mut h, persisted.clone(), 0);
    h.assigned();

    // Careful until a@39: steps of 1, 2, 4 and 8 records commit.
    let mut next = 0;
    for want in [1, 2, 4, 8] {
        assert_eq!(h.next_action(), Next::Poll { max_records: Some(want) });
        batch(&mut h, (next..next + want as i64).map(|p| (a(), p, None, 10)).collect(), &[]);
        assert!(h.end_step().expect("fed").careful);
        h.committed();
        next += want as i64;
    }
    // The step of 16 fails: back to one record, from where the database left it (a@15).
    assert_eq!(h.next_action(), Next::Poll { max_records: Some(16) });
    let committed = h.engine().snapshot();
    batch(&mut h, (next..next + 16).map(|p| (a(), p, None, 10)).collect(), &[]);
    h.end_step().expect("fed");
    h.failed(Failure::Error);
    start_from(&mut h, committed, 0);
    h.assigned();
    assert_eq!(h.next_action(), Next::Poll { max_records: Some(1) });
    assert!(h.careful());
}

#[test]
fn a_rejected_batch_makes_the_records_it_delivered_careful_too() {
    let mut h = host(TaskStatus::Running);
    // b@3 is held with no cause left to wait for: the restore's drain delivers it.
    let mut state = PersistedState::default();
    state.fed_up_to.insert(a(), 6);
    state.fed_up_to.insert(b(), 3);
    state.held.push(HeldRecord { channel: b(), position: 3, causes: CausalPast::new(), payload: 7 });
    start_from(&mut h, state.clone(), 0);
    h.assigned();
    let fed = batch(&mut h, vec![(a(), 7, None, 10)], &[]);
    assert_eq!(fed.delivered, vec![(b(), 3), (a(), 7)], "the held record drains, then a@7 delivers");
    h.end_step().expect("fed");
    h.failed(Failure::BatchRejected);
    start_from(&mut h, state.clone(), 0);
    h.assigned();
    // The drain delivers b@3 again; it is past b@3 only once committed.
    batch(&mut h, vec![(a(), 7, None, 10)], &[]);
    assert!(h.end_step().expect("fed").careful);
    h.committed();
    assert!(!h.careful(), "past a@7 and the delivered b@3");

    // A transient failure of the same step covers only what it fed.
    let mut h = host(TaskStatus::Running);
    let mut state = PersistedState::default();
    state.fed_up_to.insert(a(), 6);
    state.fed_up_to.insert(b(), 8);
    state.held.push(HeldRecord { channel: b(), position: 8, causes: CausalPast::new(), payload: 7 });
    start_from(&mut h, state.clone(), 0);
    h.assigned();
    batch(&mut h, vec![], &[]);
    h.end_step();
    h.failed(Failure::Error);
    assert!(!h.careful(), "a drain alone feeds nothing");
}

#[test]
fn an_out_of_range_poll_checks_every_channel_ends_the_step_and_restores() {
    let mut h = started(TaskStatus::Running);
    h.log_start_check_due();
    assert_eq!(h.next_action(), Next::Poll { max_records: None }, "holding nothing: no periodic check");
    h.polled(true);
    assert_eq!(
        h.next_action(),
        Next::ObserveLogStarts { channels: vec![a(), b()], check: LogStartCheck::OutOfRange },
        "before anything is fed"
    );
    let observed = h.log_starts(&[(a(), 0), (b(), 0)]);
    assert_eq!((observed.accepted, observed.refusal), (vec![a(), b()], None));
    assert_eq!(h.next_action(), Next::Drain);
    h.drain();
    assert_eq!(h.next_action(), Next::Feed);
    h.batch_done();
    assert_eq!(h.next_action(), Next::ReadPositions);
    h.read_positions(&[]);
    assert_eq!(h.next_action(), Next::Commit, "the step ends");
    h.end_step().expect("drained");
    h.committed();
    assert_eq!(h.next_action(), Next::Restore, "reads again from fed_up_to + 1 with a new consumer");
}

#[test]
fn an_out_of_range_poll_past_unread_positions_refuses() {
    let mut h = started(TaskStatus::Running);
    h.polled(true);
    let observed = h.log_starts(&[(a(), 5), (b(), 0)]);
    let refusal = observed.refusal.expect("a@0..4 were never read");
    assert_eq!(refusal.reason, RefusalReason::PositionsDiscardedUnread);
    assert_eq!(h.next_action(), Next::Commit);
    h.end_step().expect("the refusal commits");
    h.committed();
    assert_eq!(h.next_action(), Next::Refused(refusal));
}

#[test]
fn the_periodic_check_looks_at_every_channel_once_records_are_held() {
    let mut h = started(TaskStatus::Running);
    batch(&mut h, vec![(b(), 0, Some(causes(&[(a(), 0)])), 20)], &[]);
    h.end_step();
    h.committed();
    assert_eq!(h.engine().channels_holding().collect::<Vec<_>>(), vec![b()]);
    h.log_start_check_due();
    let every = Next::ObserveLogStarts { channels: vec![a(), b()], check: LogStartCheck::Periodic };
    assert_eq!(h.next_action(), every, "every channel in channel order, as at start");
    let observed = h.log_starts(&[(a(), 0), (b(), 0)]);
    assert_eq!(observed.accepted, vec![a(), b()]);
    assert_eq!(h.next_action(), Next::Poll { max_records: None });
    // A check that could not be read is skipped, not a failure.
    h.log_start_check_due();
    h.skip_check();
    assert_eq!(h.next_action(), Next::Poll { max_records: None });
    // Retention past the held record refuses.
    h.log_start_check_due();
    let observed = h.log_starts(&[(a(), 0), (b(), 1)]);
    let refusal = observed.refusal.expect("the held b@0 was passed");
    assert_eq!((refusal.channel, refusal.position), (Some(b()), Some(0)));
    assert_eq!(h.next_action(), Next::Commit);
}

/// Retention passed both a record the task holds (on b) and positions it never read on a
/// channel that sorts earlier (a). The periodic check must refuse where the next start
/// refuses, on a: a check of the holding channels alone refused on b, the refusal was
/// stored, and the restart refused on a — a stored refusal the start did not derive again.
#[test]
fn the_periodic_check_refuses_on_the_channel_a_restart_refuses_on() {
    let mut h = started(TaskStatus::Running);
    batch(&mut h, vec![(b(), 0, Some(causes(&[(a(), 0)])), 20)], &[]);
    h.end_step();
    h.committed();
    let state = h.engine().snapshot();
    h.log_start_check_due();
    let Next::ObserveLogStarts { channels, check: LogStartCheck::Periodic } = h.next_action() else {
        panic!("the periodic check is due: {:?}", h.next_action())
    };
    let log_starts: Vec<(ChannelId, Position)> = channels.iter().map(|&c| (c, if c == a() { 3 } else { 1 })).collect();
    let periodic = h.log_starts(&log_starts).refusal.expect("retention passed a@0..2 and the held b@0");

    let mut restarted = host(TaskStatus::Refused);
    assert_eq!(restarted.next_action(), Next::Restore);
    restarted.restored(state, BTreeSet::new());
    let starts = [
        ChannelStart { channel: a(), log_start: 3, initial_fed_up_to: 2 },
        ChannelStart { channel: b(), log_start: 1, initial_fed_up_to: 0 },
    ];
    let at_start = restarted.started(&starts).refusal.expect("the start refuses too");
    assert_eq!((at_start.reason, at_start.channel, at_start.position), (periodic.reason, Some(a()), Some(0)));
    assert_eq!((periodic.channel, periodic.position), (Some(a()), Some(0)), "the same channel and position");
}

#[test]
fn a_prune_asks_for_the_upstream_channels_only_and_commits_when_it_drops_pairs() {
    let mut h = started(TaskStatus::Running);
    batch(&mut h, vec![(a(), 0, Some(causes(&[(up(), 3)])), 10)], &[]);
    h.end_step();
    h.committed();
    h.prune_due();
    assert_eq!(h.next_action(), Next::LearnUpstream(vec![up()]));
    // A fact that keeps the pair: nothing to commit.
    assert_eq!(h.upstream_facts(|_| ChannelFact::Live { log_start: 0 }), 0);
    assert_eq!(h.next_action(), Next::Poll { max_records: None });
    batch(&mut h, vec![], &[]);
    assert_eq!(h.end_step(), None);
    // Facts that would drop everything drop only the upstream pair.
    h.prune_due();
    assert_eq!(h.next_action(), Next::LearnUpstream(vec![up()]));
    assert_eq!(h.upstream_facts(|_| ChannelFact::TopicGone), 2, "frontier and clock pairs on up");
    assert_eq!(h.engine().delivered_past().get(&a()), Some(0), "the received channel is kept");
    assert!(h.step_open());
    batch(&mut h, vec![], &[]);
    let commit = h.end_step().expect("a prune that dropped pairs commits");
    assert_eq!(commit.changes.clock_removed, vec![up()]);
    h.committed();
    h.prune_due();
    assert_eq!(h.next_action(), Next::Poll { max_records: None }, "no upstream channel left: dropped");
}

#[test]
fn a_width_change_refuses_on_the_grown_topics_channel() {
    let mut h = started(TaskStatus::Running);
    h.width_check_due();
    assert_eq!(h.next_action(), Next::CheckWidths);
    h.widths(1, &[(a(), Some(1)), (b(), None)], |c| format!("topic {c}"));
    assert_eq!(h.next_action(), Next::Poll { max_records: None }, "an unlisted topic is no width change");
    h.width_check_due();
    h.widths(1, &[(a(), Some(1)), (b(), Some(2))], |_| "model m, topic payments".to_string());
    assert_eq!(h.next_action(), Next::Commit);
    let refusal = h.end_step().unwrap().changes.refusal.unwrap();
    assert_eq!((refusal.reason, refusal.channel), (RefusalReason::TaskWidthChanged, Some(b())));
    assert!(refusal.diagnosis.starts_with("model m, topic payments: "), "{}", refusal.diagnosis);
}

/// Starts `h` (channels `a` and `b`, both from 0) from `state` with the records operators
/// `skipped`, and polls its first step: the drain is next.
fn restored_to_drain(h: &mut TaskHost<u32>, state: PersistedState<u32>, skipped: BTreeSet<(ChannelId, Position)>) {
    assert_eq!(h.next_action(), Next::Restore);
    h.restored(state, skipped);
    h.started(&[
        ChannelStart { channel: a(), log_start: 0, initial_fed_up_to: -1 },
        ChannelStart { channel: b(), log_start: 0, initial_fed_up_to: -1 },
    ]);
    h.take_start();
    h.committed();
    h.assigned();
    h.polled(false);
    assert_eq!(h.next_action(), Next::Drain);
}

#[test]
fn a_skipped_record_is_fed_without_causes_and_marked() {
    let mut h: TaskHost<u32> =
        TaskHost::new(EngineConfig::default(), [a(), b()], TaskStatus::Running).with_skipped(|p| p + 1000);
    let mut state = PersistedState::default();
    state.fed_up_to.insert(a(), -1);
    state.fed_up_to.insert(b(), 0);
    // A held record skipped while held, and one skipped before it was fed.
    state.held.push(HeldRecord { channel: b(), position: 0, causes: CausalPast::from_pairs([(a(), 5)]), payload: 1 });
    restored_to_drain(&mut h, state, BTreeSet::from([(b(), 0), (b(), 1)]));
    let mut payloads = BTreeMap::new();
    for d in h.drain() {
        payloads.insert((d.channel, d.position), d.payload);
    }
    let held_cause = causes(&[(a(), 9)]);
    match h.receive(b(), 1, &[Some(&held_cause)], 2) {
        Ok(Receipt::Accepted { deliveries }) => {
            for d in deliveries {
                payloads.insert((d.channel, d.position), d.payload);
            }
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(payloads, BTreeMap::from([((b(), 0), 1001), ((b(), 1), 1002)]), "both delivered, marked");
}

#[test]
fn a_rejection_of_one_record_is_persisted_as_a_refusal() {
    let mut h = started(TaskStatus::Running);
    batch(&mut h, vec![(a(), 0, None, 10)], &[]);
    h.end_step().unwrap();
    h.rejected(a(), 0, "the projection rejected orders/0@0: not JSON".into());
    let Next::PersistRefusal(refusal) = h.next_action() else { panic!("{:?}", h.next_action()) };
    assert_eq!((refusal.reason, refusal.position), (RefusalReason::ProjectionRejected, Some(0)));
    h.refusal_persisted();
    assert_eq!(h.next_action(), Next::Refused(refusal));
    assert_eq!(h.recorded(), TaskStatus::Refused);
}

#[test]
fn stored_state_the_build_cannot_use_is_a_refusal_to_persist() {
    let mut h = host(TaskStatus::Running);
    h.next_action();
    h.restored(PersistedState { format_version: 99, ..PersistedState::default() }, BTreeSet::new());
    let Next::PersistRefusal(refusal) = h.next_action() else { panic!("{:?}", h.next_action()) };
    assert_eq!(refusal.reason, RefusalReason::UnknownOrderingStateFormat);
    // Persisting it failed: restore again.
    h.failed(Failure::Error);
    assert_eq!(h.next_action(), Next::Restore);
}

#[test]
fn a_fence_is_final_and_an_abandoned_round_restores() {
    let mut h = started(TaskStatus::Running);
    h.interrupted();
    assert_eq!(h.next_action(), Next::Poll { max_records: None }, "at rest: nothing to do");
    h.polled(false);
    h.interrupted();
    assert_eq!(h.next_action(), Next::Restore, "a batch polled and never fed: read it again");
    let mut h = started(TaskStatus::Running);
    batch(&mut h, vec![(a(), 0, None, 10)], &[]);
    h.end_step().unwrap();
    h.fenced();
    assert_eq!(h.next_action(), Next::Fenced);
    h.failed(Failure::Error);
    h.interrupted();
    assert_eq!(h.next_action(), Next::Fenced);
}

/// A record's `parsley.causes` header values as a consumer hands them out.
type Headers<'a> = Vec<Option<&'a [u8]>>;

#[test]
fn causes_the_host_decoded_as_it_read_are_fed_as_the_headers_would_be() {
    // Two hosts, one step each: one given the headers, one given what a `HeaderDecoder`
    // made of them while they were read. A skipped record's undecodable header is ignored
    // by both; the first undecodable one refuses both alike.
    let new_host = || {
        let mut h: TaskHost<u32> =
            TaskHost::new(EngineConfig::default(), [a(), b()], TaskStatus::Running).with_skipped(|p| p + 1000);
        restored_to_drain(&mut h, PersistedState::default(), BTreeSet::from([(a(), 1)]));
        assert!(h.drain().is_empty());
        h
    };
    let good = causes(&[(up(), 3), (b(), 0)]);
    let records: Vec<(ChannelId, Position, Headers<'_>, u32)> = vec![
        (a(), 0, vec![Some(&good)], 1),
        (b(), 0, vec![], 2),
        (a(), 1, vec![None], 3),
        (a(), 2, vec![Some(&good), Some(&good)], 4),
        (b(), 1, vec![], 5),
    ];
    let (mut by_headers, mut by_result) = (new_host(), new_host());
    let (mut out_headers, mut out_result) = (Vec::new(), Vec::new());
    let mut refusals = Vec::new();
    for (c, p, headers, payload) in records {
        let one = by_headers.receive_into(c, p, &headers, payload, &mut out_headers);
        let mut decoder = parsley::codec::HeaderDecoder::new(by_result.metadata_budget());
        for h in &headers {
            decoder.push(*h);
        }
        let other = by_result.receive_result_into(c, p, decoder.finish(), payload, &mut out_result);
        assert_eq!(one, other, "record {c}@{p}");
        if let Err(refusal) = one {
            refusals.push(refusal);
            break;
        }
    }
    let delivered = |out: &[parsley::engine::Delivery<u32>]| -> Vec<(Position, u32)> {
        out.iter().map(|d| (d.position, d.payload)).collect()
    };
    assert_eq!(delivered(&out_result), delivered(&out_headers));
    assert_eq!(delivered(&out_headers), vec![(0, 2), (0, 1), (1, 1003)], "the skipped record delivered, marked");
    assert_eq!(refusals.len(), 1, "the duplicate header refuses");
    assert_eq!(refusals[0].reason, RefusalReason::UndecodableMetadata);
}
