//! Engine behaviour through its public API: hold and release, cascades, restore and replay,
//! seeding, pruning, scope changes, and every refusal the engine raises itself.

use parsley::engine::{ChannelFact, PersistedState, ORDERING_STATE_FORMAT};
use parsley::{CausalPast, ChannelId, Engine, EngineConfig, Fed, Position, Receipt, RefusalReason, TopicId};

fn topic(b: u8) -> TopicId {
    TopicId::from_bytes([b; 16])
}
fn ch(t: u8, p: u32) -> ChannelId {
    ChannelId::new(topic(t), p)
}
const ORDERS: ChannelId = ChannelId::new(TopicId::from_bytes([1; 16]), 0);
const PAYMENTS: ChannelId = ChannelId::new(TopicId::from_bytes([2; 16]), 0);
const UPSTREAM: ChannelId = ChannelId::new(TopicId::from_bytes([9; 16]), 3);

/// Payload = a label, so assertions read as the story they tell.
type Task = Engine<&'static str>;

fn task(channels: &[ChannelId]) -> Task {
    let mut e = Engine::new(EngineConfig::default(), channels.iter().copied());
    for &c in channels {
        e.seed(c, -1).unwrap();
    }
    e
}

fn header(pairs: &[(ChannelId, Position)]) -> Vec<u8> {
    CausalPast::from_pairs(pairs.iter().copied()).encode()
}

/// Feeds one record and returns the labels delivered by the drain it triggered.
fn feed(
    e: &mut Task,
    c: ChannelId,
    o: Position,
    causes: &[(ChannelId, Position)],
    label: &'static str,
) -> Vec<&'static str> {
    let h = header(causes);
    let values: Vec<Option<&[u8]>> = if causes.is_empty() { vec![] } else { vec![Some(&h)] };
    match e.receive(c, o, &values, label).expect("accepted") {
        Receipt::Accepted { deliveries } => deliveries.into_iter().map(|d| d.payload).collect(),
        Receipt::Duplicate => vec!["<duplicate>"],
    }
}

#[test]
fn receive_into_appends_each_record_s_deliveries_to_one_list() {
    let mut e = task(&[ORDERS, PAYMENTS]);
    let mut out = Vec::new();
    let h = header(&[(ORDERS, 1)]);
    // A direct delivery, a held record, then the cause that releases it: one list, in
    // delivery order.
    assert_eq!(e.receive_into(ORDERS, 0, &[], "o0", &mut out), Ok(Fed::Accepted));
    assert_eq!(e.receive_into(PAYMENTS, 0, &[Some(&h)], "p0", &mut out), Ok(Fed::Accepted));
    assert_eq!(e.receive_into(ORDERS, 1, &[], "o1", &mut out), Ok(Fed::Accepted));
    let labels: Vec<&str> = out.iter().map(|d| d.payload).collect();
    assert_eq!(labels, ["o0", "o1", "p0"]);
    // A refused record appends nothing, and neither does anything after it.
    let bad: &[u8] = &[0xff];
    assert!(e.receive_into(PAYMENTS, 1, &[Some(bad)], "bad", &mut out).is_err());
    assert!(e.receive_into(ORDERS, 2, &[], "o2", &mut out).is_err());
    assert_eq!(out.len(), 3);
}

#[test]
fn effect_waits_for_its_cause_on_another_channel() {
    let mut e = task(&[ORDERS, PAYMENTS]);
    assert_eq!(feed(&mut e, PAYMENTS, 0, &[(ORDERS, 0)], "pay"), Vec::<&str>::new());
    let status = e.status();
    let pay = status.channels.iter().find(|s| s.channel == PAYMENTS).unwrap();
    assert_eq!((pay.held, pay.head), (1, Some(0)));
    assert_eq!(pay.blockers.len(), 1);
    assert_eq!((pay.blockers[0].channel, pay.blockers[0].required, pay.blockers[0].settled), (ORDERS, 0, Some(-1)));
    assert_eq!(feed(&mut e, ORDERS, 0, &[], "order"), vec!["order", "pay"]);
    assert_eq!(e.held_count(), 0);
    assert_eq!(e.delivered_past(), &CausalPast::from_pairs([(ORDERS, 0), (PAYMENTS, 0)]));
}

#[test]
fn causes_on_channels_not_received_do_not_hold() {
    let mut e = task(&[PAYMENTS]);
    assert_eq!(feed(&mut e, PAYMENTS, 0, &[(UPSTREAM, 77)], "pay"), vec!["pay"]);
    // The carried pair enters both the frontier and the delivered past.
    assert_eq!(e.frontier().get(&UPSTREAM), Some(77));
    assert_eq!(e.delivered_past().get(&UPSTREAM), Some(77));
}

#[test]
fn fifo_holds_records_behind_a_held_head() {
    let mut e = task(&[ORDERS, PAYMENTS]);
    assert!(feed(&mut e, PAYMENTS, 0, &[(ORDERS, 5)], "p0").is_empty());
    // p1 has no causes of its own but may not overtake p0.
    assert!(feed(&mut e, PAYMENTS, 1, &[], "p1").is_empty());
    assert_eq!(e.held(&PAYMENTS).count(), 2);
    // Orders 0..4 deliver; order 5 releases the chain.
    for o in 0..5 {
        let label = ["o0", "o1", "o2", "o3", "o4"][o as usize];
        assert_eq!(feed(&mut e, ORDERS, o, &[], label), vec![label]);
    }
    assert_eq!(feed(&mut e, ORDERS, 5, &[], "o5"), vec!["o5", "p0", "p1"]);
}

#[test]
fn gaps_in_positions_settle_a_cause() {
    // Offsets 3..=6 are markers or aborted records: never fed. Record 7 settles a cause at 5.
    let mut e = task(&[ORDERS, PAYMENTS]);
    feed(&mut e, ORDERS, 2, &[], "o2");
    assert!(feed(&mut e, PAYMENTS, 0, &[(ORDERS, 5)], "p").is_empty());
    assert_eq!(feed(&mut e, ORDERS, 7, &[], "o7"), vec!["o7", "p"]);
}

#[test]
fn cascades_across_three_channels_deliver_in_causal_order() {
    let (a, b, c) = (ch(1, 0), ch(2, 0), ch(3, 0));
    let mut e = task(&[a, b, c]);
    assert!(feed(&mut e, c, 0, &[(b, 0)], "c0").is_empty());
    assert!(feed(&mut e, b, 0, &[(a, 0)], "b0").is_empty());
    assert_eq!(feed(&mut e, a, 0, &[], "a0"), vec!["a0", "b0", "c0"]);
}

#[test]
fn same_state_same_order() {
    let run = || {
        let (a, b, c) = (ch(1, 0), ch(2, 0), ch(3, 0));
        let mut e = task(&[a, b, c]);
        let mut out = vec![];
        out.extend(feed(&mut e, c, 0, &[(a, 0)], "c0"));
        out.extend(feed(&mut e, b, 0, &[(a, 0)], "b0"));
        out.extend(feed(&mut e, a, 0, &[], "a0"));
        out
    };
    // Channels drain in sorted order: b (0x02…) before c (0x03…).
    assert_eq!(run(), vec!["a0", "b0", "c0"]);
    assert_eq!(run(), run());
}

#[test]
fn impossible_self_cause_is_refused() {
    let mut e = task(&[ORDERS]);
    let h = header(&[(ORDERS, 4)]);
    let err = e.receive(ORDERS, 4, &[Some(&h)], "x").unwrap_err();
    assert_eq!(err.reason, RefusalReason::ImpossibleSelfCause);
    // A cause below itself on its own channel is fine (and settled by FIFO).
    let mut e = task(&[ORDERS]);
    assert_eq!(feed(&mut e, ORDERS, 3, &[(ORDERS, 2)], "o3"), vec!["o3"]);
}

#[test]
fn replay_after_restore_is_dropped_and_held_records_survive() {
    let mut e = task(&[ORDERS, PAYMENTS]);
    feed(&mut e, ORDERS, 0, &[], "o0");
    assert!(feed(&mut e, PAYMENTS, 0, &[(ORDERS, 1)], "p0").is_empty());
    let persisted = e.snapshot();
    assert_eq!(persisted.held.len(), 1);

    let mut again: Task = Engine::restore(EngineConfig::default(), [ORDERS, PAYMENTS], persisted).unwrap();
    assert!(again.drain().is_empty(), "restoring frees nothing early");
    // The host re-reads from fed_up_to + 1, but a replay of older positions is dropped too.
    assert_eq!(again.receive(ORDERS, 0, &[], "o0").unwrap(), Receipt::Duplicate);
    assert_eq!(again.receive(PAYMENTS, 0, &[], "p0-again").unwrap(), Receipt::Duplicate);
    assert_eq!(feed(&mut again, ORDERS, 1, &[], "o1"), vec!["o1", "p0"]);
}

#[test]
fn feeding_a_channel_backwards_in_one_execution_is_refused() {
    let mut e = task(&[ORDERS]);
    feed(&mut e, ORDERS, 5, &[], "o5");
    let err = e.receive(ORDERS, 5, &[], "again").unwrap_err();
    assert_eq!(err.reason, RefusalReason::OutOfOrderFeed);
    assert_eq!((err.channel, err.position), (Some(ORDERS), Some(5)));
    // Sticky: nothing else is accepted, and the refusal is among the step's changes.
    assert_eq!(e.receive(ORDERS, 6, &[], "o6").unwrap_err().reason, RefusalReason::OutOfOrderFeed);
    assert_eq!(e.take_changes().refusal.unwrap().reason, RefusalReason::OutOfOrderFeed);
}

#[test]
fn undecodable_and_over_budget_headers_are_refused_never_treated_as_absent() {
    let cases: Vec<(Vec<Option<&[u8]>>, RefusalReason)> = vec![
        (vec![None], RefusalReason::UndecodableMetadata),
        (vec![Some(&[])], RefusalReason::UndecodableMetadata),
        (vec![Some(&[0x02, 0x00])], RefusalReason::UndecodableMetadata),
        (vec![Some(&[0x01, 0x00]), Some(&[0x01, 0x00])], RefusalReason::UndecodableMetadata),
    ];
    for (values, reason) in cases {
        let mut e = task(&[ORDERS]);
        let err = e.receive(ORDERS, 0, &values, "bad").unwrap_err();
        assert_eq!(err.reason, reason, "{values:?}");
        assert_eq!((err.channel, err.position), (Some(ORDERS), Some(0)));
        assert!(e.delivered_past().is_empty(), "nothing delivered");
    }
    let mut e: Task = Engine::new(EngineConfig { metadata_budget: 10, ..EngineConfig::default() }, [ORDERS]);
    e.seed(ORDERS, -1).unwrap();
    let h = header(&[(UPSTREAM, 1)]);
    let err = e.receive(ORDERS, 0, &[Some(&h)], "big").unwrap_err();
    assert_eq!(err.reason, RefusalReason::MetadataBudgetExceeded);
}

#[test]
fn a_refusal_recurs_identically_after_restart() {
    let bad: Vec<Option<&[u8]>> = vec![Some(&[0x01, 0x05])];
    let mut e = task(&[ORDERS]);
    feed(&mut e, ORDERS, 0, &[], "o0");
    let first = e.receive(ORDERS, 1, &bad, "bad").unwrap_err();
    // The host commits what was delivered before the refusal; the bad record is not fed.
    let persisted = e.snapshot();
    assert_eq!(persisted.fed_up_to.get(&ORDERS), Some(&0));
    let mut again: Task = Engine::restore(EngineConfig::default(), [ORDERS], persisted).unwrap();
    assert_eq!(again.receive(ORDERS, 1, &bad, "bad").unwrap_err(), first);
}

#[test]
fn unseeded_channels_and_strangers_are_refused() {
    let mut e: Task = Engine::new(EngineConfig::default(), [ORDERS]);
    assert_eq!(e.receive(ORDERS, 0, &[], "x").unwrap_err().reason, RefusalReason::SubstrateMisconfigured);
    let mut e = task(&[ORDERS]);
    assert_eq!(e.receive(PAYMENTS, 0, &[], "x").unwrap_err().reason, RefusalReason::SubstrateMisconfigured);
}

#[test]
fn seeding_resumes_and_never_reenters_what_was_delivered() {
    let mut e: Task = Engine::new(EngineConfig::default(), [ORDERS]);
    assert_eq!(e.seed(ORDERS, 41).unwrap(), 41);
    assert_eq!(e.seed(ORDERS, 7).unwrap(), 41, "a baseline, once set, stays");
    assert_eq!(e.receive(ORDERS, 41, &[], "old").unwrap(), Receipt::Duplicate);
    assert_eq!(feed(&mut e, ORDERS, 42, &[], "o42"), vec!["o42"]);

    // A joining channel that the delivered past already names at 10 starts after 10.
    let mut with_payments = task(&[PAYMENTS]);
    feed(&mut with_payments, PAYMENTS, 0, &[(ORDERS, 10)], "p0");
    let persisted = with_payments.snapshot();
    let mut joined: Task = Engine::restore(EngineConfig::default(), [ORDERS, PAYMENTS], persisted).unwrap();
    assert_eq!(joined.settled(&ORDERS), None, "nothing known of the joining channel yet");
    assert_eq!(joined.seed(ORDERS, -1).unwrap(), 10);
    assert_eq!(joined.receive(ORDERS, 10, &[], "o10").unwrap(), Receipt::Duplicate);
}

#[test]
fn log_start_past_unread_positions_is_refused() {
    let mut e = task(&[ORDERS]);
    feed(&mut e, ORDERS, 0, &[], "o0");
    e.observe_log_start(ORDERS, 1).expect("log start at the next position to read loses nothing");
    let err = e.observe_log_start(ORDERS, 3).unwrap_err();
    assert_eq!(err.reason, RefusalReason::PositionsDiscardedUnread);
    assert_eq!(err.position, Some(1));
    assert!(err.diagnosis.contains("never read"), "{}", err.diagnosis);
}

#[test]
fn log_start_past_a_held_record_is_refused() {
    let mut e = task(&[ORDERS, PAYMENTS]);
    assert!(feed(&mut e, PAYMENTS, 4, &[(ORDERS, 0)], "p4").is_empty());
    assert_eq!(e.channels_holding().collect::<Vec<_>>(), vec![PAYMENTS]);
    // Settled on payments is 3 (one below the held head): a log start of 4 loses nothing.
    e.observe_log_start(PAYMENTS, 4).expect("the held record is still in the log");
    let err = e.observe_log_start(PAYMENTS, 5).unwrap_err();
    assert_eq!(err.reason, RefusalReason::PositionsDiscardedUnread);
    assert_eq!((err.channel, err.position), (Some(PAYMENTS), Some(4)));
    assert!(err.diagnosis.contains("still holds 1 record(s) from position 4"), "{}", err.diagnosis);
}

#[test]
fn pruning_drops_only_dead_pairs_and_never_owned_clock_entries_nor_stamped_pairs_below_log_start() {
    let gone = ch(7, 0);
    let mut e = task(&[ORDERS]);
    feed(&mut e, ORDERS, 3, &[(UPSTREAM, 5), (gone, 2), (ch(1, 1), 9)], "o3");
    e.take_changes();
    e.prune(|c| match c {
        c if *c == UPSTREAM => ChannelFact::Live { log_start: 6 },
        c if *c == gone => ChannelFact::TopicGone,
        c if c.topic == ORDERS.topic => ChannelFact::Live { log_start: 100 },
        _ => ChannelFact::Unknown,
    });
    // Frontier (what a send stamps): only the pair of the topic that is gone; pairs below
    // the log start are kept, for receivers that have not read them yet.
    assert_eq!(e.frontier().get(&UPSTREAM), Some(5));
    assert_eq!(e.frontier().get(&gone), None);
    assert_eq!(e.frontier().get(&ORDERS), Some(3));
    // Clock: upstream entries pruned, entries on the task's received topic kept.
    assert_eq!(e.delivered_past().get(&UPSTREAM), None);
    assert_eq!(e.delivered_past().get(&gone), None);
    assert_eq!(e.delivered_past().get(&ORDERS), Some(3));
    assert_eq!(e.delivered_past().get(&ch(1, 1)), Some(9));
    let changes = e.take_changes();
    assert_eq!(changes.clock_removed, vec![gone, UPSTREAM], "in channel order");
    assert!(changes.clock_upserts.is_empty());
    // A live pair at or above log start survives.
    let mut e = task(&[ORDERS]);
    feed(&mut e, ORDERS, 0, &[(UPSTREAM, 5)], "o0");
    e.prune(|_| ChannelFact::Live { log_start: 5 });
    assert_eq!(e.frontier().get(&UPSTREAM), Some(5));
}

#[test]
fn scope_change_keeps_the_delivered_past_and_refuses_dropping_held_records() {
    let mut e = task(&[ORDERS, PAYMENTS]);
    feed(&mut e, ORDERS, 0, &[], "o0");
    let persisted = e.snapshot();
    let mut narrowed: Task = Engine::restore(EngineConfig::default(), [PAYMENTS], persisted).unwrap();
    assert_eq!(narrowed.delivered_past().get(&ORDERS), Some(0), "a leaving channel keeps its delivered past");
    assert_eq!(narrowed.take_changes().channels_removed, vec![ORDERS]);

    let mut e = task(&[ORDERS, PAYMENTS]);
    feed(&mut e, PAYMENTS, 0, &[(ORDERS, 0)], "p0");
    let err = Engine::<&str>::restore(EngineConfig::default(), [ORDERS], e.snapshot()).unwrap_err();
    assert_eq!(err.reason, RefusalReason::ChannelRemovedWithHeldMessages);

    // Dropping a channel that a held record waits on releases it: no longer this task's cause.
    let mut e = task(&[ORDERS, PAYMENTS]);
    feed(&mut e, PAYMENTS, 0, &[(ORDERS, 0)], "p0");
    let mut narrowed: Task = Engine::restore(EngineConfig::default(), [PAYMENTS], e.snapshot()).unwrap();
    assert_eq!(narrowed.drain().into_iter().map(|d| d.payload).collect::<Vec<_>>(), vec!["p0"]);
}

#[test]
fn unknown_state_format_is_refused() {
    let state = PersistedState::<&str> { format_version: ORDERING_STATE_FORMAT + 1, ..Default::default() };
    let err = Engine::restore(EngineConfig::default(), [ORDERS], state).unwrap_err();
    assert_eq!(err.reason, RefusalReason::UnknownOrderingStateFormat);
}

#[test]
fn step_changes_are_net_of_what_the_step_undid() {
    let mut e = task(&[ORDERS, PAYMENTS]);
    e.take_changes();
    // Held and released inside one step: neither inserted nor removed.
    feed(&mut e, PAYMENTS, 0, &[(ORDERS, 0)], "p0");
    feed(&mut e, ORDERS, 0, &[], "o0");
    let changes = e.take_changes();
    assert!(changes.held_inserted.is_empty() && changes.held_removed.is_empty());
    assert_eq!(changes.fed_up_to, vec![(ORDERS, 0), (PAYMENTS, 0)]);
    assert_eq!(changes.clock_upserts, vec![(ORDERS, 0), (PAYMENTS, 0)]);

    // Held across the step boundary: inserted in one step, removed in the next.
    feed(&mut e, PAYMENTS, 1, &[(ORDERS, 1)], "p1");
    let first = e.take_changes();
    assert_eq!(first.held_inserted.len(), 1);
    assert_eq!(first.held_inserted[0].payload, "p1");
    feed(&mut e, ORDERS, 1, &[], "o1");
    let second = e.take_changes();
    assert!(second.held_inserted.is_empty());
    assert_eq!(second.held_removed, vec![(PAYMENTS, 1)]);
    assert!(e.take_changes().is_empty());
}

#[test]
fn stamp_sends_the_frontier_or_nothing() {
    let mut e = task(&[ORDERS]);
    assert_eq!(e.stamp().unwrap(), None);
    feed(&mut e, ORDERS, 4, &[(UPSTREAM, 8)], "o4");
    let stamped = e.stamp().unwrap().unwrap();
    assert_eq!(CausalPast::decode(&stamped, 1 << 20).unwrap(), CausalPast::from_pairs([(ORDERS, 4), (UPSTREAM, 8)]));
    // Receipt alone grows the frontier (not the delivered past).
    let mut e = task(&[ORDERS, PAYMENTS]);
    feed(&mut e, PAYMENTS, 0, &[(ORDERS, 3), (UPSTREAM, 1)], "held");
    assert_eq!(e.frontier().get(&UPSTREAM), Some(1));
    assert_eq!(e.delivered_past().get(&UPSTREAM), None);
    let mut tiny: Task = Engine::new(EngineConfig { metadata_budget: 20, ..EngineConfig::default() }, [ORDERS]);
    tiny.seed(ORDERS, -1).unwrap();
    tiny.receive(ORDERS, 0, &[], "o0").unwrap();
    assert_eq!(tiny.stamp().unwrap_err().reason, RefusalReason::MetadataBudgetExceeded);
}

#[test]
fn a_read_position_past_control_records_keeps_retention_of_markers_from_refusing() {
    // Records 0..=4 of one committed transaction, its marker at 5: the consumer's position
    // is 6 once it has read past the marker.
    let mut e = task(&[ORDERS]);
    for (o, label) in [(0, "r0"), (1, "r1"), (2, "r2"), (3, "r3"), (4, "r4")] {
        feed(&mut e, ORDERS, o, &[], label);
    }
    e.observe_read_position(ORDERS, 6).unwrap();
    let changes = e.take_changes();
    assert_eq!(changes.fed_up_to, vec![(ORDERS, 5)], "the marker's position is persisted as read");
    // Retention removes the segment up to and including the marker: nothing deliverable
    // was lost, and the check survives a restart from what was persisted.
    let mut restored: Task = Engine::restore(EngineConfig::default(), [ORDERS], e.snapshot()).unwrap();
    restored.observe_log_start(ORDERS, 6).unwrap();
    assert!(restored.refusal().is_none());
    // Without the read position the same retention is (wrongly for a marker) a refusal:
    // the check is exactly as strict as what the task was told.
    let mut told_less = task(&[ORDERS]);
    for o in 0..5 {
        feed(&mut told_less, ORDERS, o, &[], "r");
    }
    assert_eq!(told_less.observe_log_start(ORDERS, 6).unwrap_err().reason, RefusalReason::PositionsDiscardedUnread);
}

#[test]
fn a_read_position_never_lowers_and_a_later_feed_below_it_is_out_of_order() {
    let mut e = task(&[ORDERS]);
    feed(&mut e, ORDERS, 0, &[], "r0");
    e.observe_read_position(ORDERS, 3).unwrap();
    e.observe_read_position(ORDERS, 1).unwrap();
    assert_eq!(e.fed_up_to(&ORDERS), Some(2));
    let _ = e.take_changes();
    e.observe_read_position(ORDERS, 3).unwrap();
    assert!(e.take_changes().fed_up_to.is_empty(), "no change, nothing to persist");
    // Position 2 was declared read past: a record there now means the host broke order.
    let h: Vec<Option<&[u8]>> = vec![];
    assert_eq!(e.receive(ORDERS, 2, &h, "late").unwrap_err().reason, RefusalReason::OutOfOrderFeed);
}

#[test]
fn a_read_position_past_a_held_record_keeps_it_held_and_settled_below_it() {
    let mut e = task(&[ORDERS, PAYMENTS]);
    assert!(feed(&mut e, PAYMENTS, 0, &[(ORDERS, 0)], "pay").is_empty());
    e.observe_read_position(PAYMENTS, 4).unwrap();
    assert_eq!(e.fed_up_to(&PAYMENTS), Some(3));
    assert_eq!(e.settled(&PAYMENTS), Some(-1), "the held head still bounds what is settled");
    assert_eq!(feed(&mut e, ORDERS, 0, &[], "order"), vec!["order", "pay"]);
    assert_eq!(e.settled(&PAYMENTS), Some(3));
}

#[test]
fn holding_past_the_record_bound_refuses_and_recurs_after_restore() {
    let config = EngineConfig { max_held_records: Some(2), ..EngineConfig::default() };
    let mut e: Task = Engine::new(config.clone(), [ORDERS, PAYMENTS]);
    e.seed(ORDERS, -1).unwrap();
    e.seed(PAYMENTS, -1).unwrap();
    assert!(feed(&mut e, PAYMENTS, 0, &[(ORDERS, 0)], "p0").is_empty());
    assert!(feed(&mut e, PAYMENTS, 1, &[], "p1").is_empty());
    assert!(e.refusal().is_none(), "at the bound, not past it");
    // A record delivered at once is never counted: an upstream cause does not hold.
    assert_eq!(feed(&mut e, ORDERS, 0, &[(UPSTREAM, 1)], "o0"), vec!["o0", "p0", "p1"]);
    assert!(feed(&mut e, PAYMENTS, 2, &[(ORDERS, 7)], "p2").is_empty());
    assert!(feed(&mut e, PAYMENTS, 3, &[], "p3").is_empty());
    assert!(e.refusal().is_none());
    assert!(feed(&mut e, ORDERS, 5, &[(PAYMENTS, 9)], "o5").is_empty(), "o5 waits for PAYMENTS@9");
    let refusal = e.refusal().cloned().expect("the third held record passes the bound");
    assert_eq!(refusal.reason, RefusalReason::HeldLimitExceeded);
    assert_eq!((refusal.channel, refusal.position), (Some(ORDERS), Some(5)));
    assert!(refusal.diagnosis.contains("max_held_records = 2"), "{}", refusal.diagnosis);
    let changes = e.take_changes();
    assert_eq!(changes.refusal.as_ref().map(|r| r.reason), Some(RefusalReason::HeldLimitExceeded));
    let h: Vec<Option<&[u8]>> = vec![];
    assert_eq!(e.receive(ORDERS, 6, &h, "o6").unwrap_err().reason, RefusalReason::HeldLimitExceeded);
    assert_eq!(e.held_count(), 3, "the record that passed the bound is kept, not dropped");
    // What was persisted refuses again at restore; a raised bound lets it run.
    let again: Task = Engine::restore(config, [ORDERS, PAYMENTS], e.snapshot()).unwrap();
    assert_eq!(again.refusal().map(|r| r.reason), Some(RefusalReason::HeldLimitExceeded));
    let raised = EngineConfig { max_held_records: Some(3), ..EngineConfig::default() };
    assert_eq!(again.held_count(), 3);
    let ok: Task = Engine::restore(raised, [ORDERS, PAYMENTS], e.snapshot()).unwrap();
    assert!(ok.refusal().is_none());
}

#[test]
fn deliveries_of_the_receipt_that_passes_a_bound_are_still_returned() {
    // A receipt that releases a small held record and is itself held with a large payload
    // can pass a byte bound: the refusal is sticky, and the released record is still
    // returned for this step (never lost).
    let config = EngineConfig { max_held_bytes: Some(100), ..EngineConfig::default() };
    let mut e: Task = Engine::new(config, [ORDERS, PAYMENTS]).with_weigher(|label: &&'static str| label.len());
    e.seed(ORDERS, -1).unwrap();
    e.seed(PAYMENTS, -1).unwrap();
    assert!(feed(&mut e, PAYMENTS, 0, &[(ORDERS, 0)], "a").is_empty());
    assert_eq!(e.held_bytes(), 1 + 28);
    let big: &'static str = "oooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooooo";
    // ORDERS@1 settles ORDERS at 0 (nothing at 0), releasing "a"; it waits for PAYMENTS@5.
    assert_eq!(feed(&mut e, ORDERS, 1, &[(PAYMENTS, 5)], big), vec!["a"]);
    assert_eq!(e.held_bytes(), 80 + 28);
    let refusal = e.refusal().expect("108 bytes pass the bound of 100");
    assert_eq!(
        (refusal.reason, refusal.channel, refusal.position),
        (RefusalReason::HeldLimitExceeded, Some(ORDERS), Some(1))
    );
    assert_eq!(e.delivered_past().get(&PAYMENTS), Some(0));
    assert_eq!(e.take_changes().clock_upserts.len(), 2, "the released delivery is part of the step");
}

#[test]
fn holding_past_the_byte_bound_counts_payload_weights_and_causes() {
    let config = EngineConfig { max_held_bytes: Some(100), ..EngineConfig::default() };
    let mut e: Task = Engine::new(config, [ORDERS, PAYMENTS]).with_weigher(|label: &&'static str| label.len());
    e.seed(ORDERS, -1).unwrap();
    e.seed(PAYMENTS, -1).unwrap();
    // One pair encodes in 2 + 26 = 28 bytes; a 30-byte label makes 58.
    let label: &'static str = "pppppppppppppppppppppppppppppp";
    assert!(feed(&mut e, PAYMENTS, 0, &[(ORDERS, 0)], label).is_empty());
    assert_eq!(e.held_bytes(), 58);
    assert!(e.refusal().is_none());
    assert!(feed(&mut e, PAYMENTS, 1, &[(ORDERS, 0)], label).is_empty());
    assert_eq!(e.refusal().map(|r| r.reason), Some(RefusalReason::HeldLimitExceeded));
    assert!(e.refusal().unwrap().diagnosis.contains("116 held bytes"), "{}", e.refusal().unwrap().diagnosis);
    // Restored and weighed again, the same state refuses again.
    let config = EngineConfig { max_held_bytes: Some(100), ..EngineConfig::default() };
    let again: Task = Engine::restore(config, [ORDERS, PAYMENTS], e.snapshot()).unwrap();
    assert!(again.refusal().is_none(), "unweighed, only the causes count: 56 bytes");
    let again = again.with_weigher(|label: &&'static str| label.len());
    assert_eq!(again.refusal().map(|r| r.reason), Some(RefusalReason::HeldLimitExceeded));
}

/// No log holds a record at the largest position (its next position would not exist, and
/// the codec refuses it in a header): a host feeding or seeding it is misconfigured, and
/// the engine refuses rather than stamp a value no receiver can decode or overflow its
/// log-start arithmetic.
#[test]
fn the_largest_position_is_refused_from_the_host() {
    let mut e = task(&[ORDERS]);
    let err = e.receive(ORDERS, Position::MAX, &[], "max").unwrap_err();
    assert_eq!((err.reason, err.position), (RefusalReason::SubstrateMisconfigured, Some(Position::MAX)));
    assert!(e.frontier().get(&ORDERS).is_none(), "nothing of it was kept");

    let mut e: Task = Engine::new(EngineConfig::default(), [ORDERS]);
    let err = e.seed(ORDERS, Position::MAX).unwrap_err();
    assert_eq!(err.reason, RefusalReason::SubstrateMisconfigured);

    // The position below it is a position like any other, and the log-start check does
    // not overflow on it.
    let mut e: Task = Engine::new(EngineConfig::default(), [ORDERS]);
    e.seed(ORDERS, Position::MAX - 1).unwrap();
    e.observe_log_start(ORDERS, 0).unwrap();
    e.observe_log_start(ORDERS, Position::MAX).unwrap();
    assert!(e.stamp().unwrap().is_none());
}
