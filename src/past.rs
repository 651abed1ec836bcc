//! `CausalPast`: a set of `(channel, position)` pairs, one per channel, where a pair stands
//! for every record on that channel at or below the position. One type for the causes a
//! record carries, a client's session token, and the past recorded for a task or a row.

use crate::channel::{ChannelId, Position};
use crate::codec::{self, DecodeError};

/// The longest past [`CausalPast::raise_record`] walks pair by pair rather than searching.
const WALKED: usize = 64;

/// An immutable causal past: at most one position per channel, kept sorted by channel.
///
/// Merging is a pointwise maximum. The value is changed only by consuming it
/// (`merge`, `merge_past`, `retain`), so a past that has been shared never moves under a
/// reader.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct CausalPast {
    /// Strictly ascending by channel; every position is `>= 0`.
    pairs: Vec<(ChannelId, Position)>,
}

/// One channel a token requires that the recorded past does not cover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gap {
    pub channel: ChannelId,
    /// The position the token requires.
    pub required: Position,
    /// The position the recorded past holds, or `None` if it has never recorded the channel.
    pub recorded: Option<Position>,
}

/// The result of checking a token against a recorded past: every gap, in channel order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Coverage {
    pub gaps: Vec<Gap>,
}

impl Coverage {
    pub fn is_covered(&self) -> bool {
        self.gaps.is_empty()
    }
}

impl CausalPast {
    pub fn new() -> Self {
        CausalPast { pairs: Vec::new() }
    }

    /// Builds a past from pairs in any order; several pairs on one channel compress to the
    /// greatest position.
    ///
    /// # Panics
    /// On a negative position: pasts only ever name real offsets.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (ChannelId, Position)>) -> Self {
        let mut v: Vec<(ChannelId, Position)> = pairs.into_iter().collect();
        assert!(v.iter().all(|&(_, p)| p >= 0), "a causal past names offsets >= 0");
        v.sort_unstable();
        // Sorted by (channel, position): keep the last, greatest, entry of each channel.
        let mut out: Vec<(ChannelId, Position)> = Vec::with_capacity(v.len());
        for (c, p) in v {
            match out.last_mut() {
                Some(last) if last.0 == c => last.1 = p,
                _ => out.push((c, p)),
            }
        }
        let past = CausalPast { pairs: out };
        debug_assert!(past.invariants_hold(), "{past:?}");
        past
    }

    /// Wraps pairs the codec has already proven strictly ascending and non-negative.
    pub(crate) fn from_sorted_unchecked(pairs: Vec<(ChannelId, Position)>) -> Self {
        let past = CausalPast { pairs };
        debug_assert!(past.invariants_hold(), "{past:?}");
        past
    }

    /// Whether the pairs keep the type's promise: strictly ascending by channel (so no
    /// channel twice) and no negative position. Debug builds check it after every change.
    pub(crate) fn invariants_hold(&self) -> bool {
        self.pairs.windows(2).all(|w| w[0].0 < w[1].0) && self.pairs.iter().all(|&(_, p)| p >= 0)
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Number of channels named.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Pairs in channel order (the wire order).
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (ChannelId, Position)> + '_ {
        self.pairs.iter().copied()
    }

    pub(crate) fn as_slice(&self) -> &[(ChannelId, Position)] {
        &self.pairs
    }

    pub fn get(&self, channel: &ChannelId) -> Option<Position> {
        self.pairs.binary_search_by(|(c, _)| c.cmp(channel)).ok().map(|i| self.pairs[i].1)
    }

    /// This past with `(channel, position)` merged in (pointwise maximum).
    ///
    /// # Panics
    /// On a negative position.
    #[must_use]
    pub fn merge(mut self, channel: ChannelId, position: Position) -> Self {
        self.merge_in_place(channel, position);
        self
    }

    /// This past merged with `other` (pointwise maximum over the union of channels).
    #[must_use]
    pub fn merge_past(self, other: &CausalPast) -> Self {
        if other.is_empty() {
            return self;
        }
        if self.is_empty() {
            return other.clone();
        }
        let mut out = Vec::with_capacity(self.pairs.len() + other.pairs.len());
        let (mut a, mut b) = (self.pairs.into_iter().peekable(), other.pairs.iter().peekable());
        loop {
            match (a.peek(), b.peek()) {
                (Some(&(ca, pa)), Some(&&(cb, pb))) => {
                    if ca < cb {
                        out.push((ca, pa));
                        a.next();
                    } else if cb < ca {
                        out.push((cb, pb));
                        b.next();
                    } else {
                        out.push((ca, pa.max(pb)));
                        a.next();
                        b.next();
                    }
                }
                (Some(_), None) => out.extend(a.by_ref()),
                (None, Some(_)) => out.extend(b.by_ref().copied()),
                (None, None) => break,
            }
        }
        let past = CausalPast { pairs: out };
        debug_assert!(past.invariants_hold(), "{past:?}");
        past
    }

    /// Keeps only the pairs `keep` accepts (used by pruning, which is the only rule allowed
    /// to drop a pair).
    #[must_use]
    pub fn retain(mut self, mut keep: impl FnMut(ChannelId, Position) -> bool) -> Self {
        self.pairs.retain(|&(c, p)| keep(c, p));
        debug_assert!(self.invariants_hold(), "{self:?}");
        self
    }

    pub(crate) fn merge_in_place(&mut self, channel: ChannelId, position: Position) {
        self.raise(channel, position);
    }

    /// Merges `(channel, position)` in (pointwise maximum) with one search; true when it
    /// changed this past (the channel was new, or below `position`).
    pub(crate) fn raise(&mut self, channel: ChannelId, position: Position) -> bool {
        let raised = self.raise_from(0, channel, position).1;
        debug_assert!(self.invariants_hold(), "{self:?}");
        raised
    }

    /// Merges `other` in (pointwise maximum). Both are sorted, so each pair is searched for
    /// only past the previous one's place.
    pub(crate) fn raise_all(&mut self, other: &CausalPast) {
        let mut from = 0;
        for &(channel, position) in &other.pairs {
            from = self.raise_from(from, channel, position).0 + 1;
        }
        debug_assert!(self.invariants_hold(), "{self:?}");
    }

    /// Merges a record's own pair and its causes in (pointwise maximum): the same result as
    /// `raise(channel, position)` then `raise_all(causes)`, in one ascending pass. A past of
    /// up to [`WALKED`] pairs is walked pair by pair, each step an equality check first (a
    /// record's causes are mostly channels the past already names); a longer one is searched
    /// pair by pair.
    pub(crate) fn raise_record(&mut self, channel: ChannelId, position: Position, causes: &CausalPast) {
        assert!(position >= 0, "a causal past names offsets >= 0");
        if self.pairs.len() > WALKED {
            self.raise(channel, position);
            self.raise_all(causes);
            return;
        }
        let mut at = 0;
        merged_with(channel, position, causes, |c, p| at = self.raise_walking(at, c, p));
        debug_assert!(self.invariants_hold(), "{self:?}");
    }

    /// [`CausalPast::raise_record`] on two pasts at once (a task's frontier and its delivered
    /// past, on a record delivered as it arrives). The two usually name the same channels in
    /// the same places, so each pair is first looked for in `other` where it sits in `self`:
    /// one equality check instead of a walk.
    pub(crate) fn raise_record_both(
        &mut self,
        other: &mut CausalPast,
        channel: ChannelId,
        position: Position,
        causes: &CausalPast,
    ) {
        assert!(position >= 0, "a causal past names offsets >= 0");
        if self.pairs.len() > WALKED || other.pairs.len() > WALKED {
            self.raise_record(channel, position, causes);
            other.raise_record(channel, position, causes);
            return;
        }
        let (mut at, mut other_at) = (0, 0);
        merged_with(channel, position, causes, |c, p| {
            at = self.raise_walking(at, c, p);
            // `self` holds the pair at `at - 1`; a pair on the same channel in `other` is
            // the only one there (channels are unique), so it is raised in place.
            match other.pairs.get_mut(at - 1) {
                Some(pair) if pair.0 == c => {
                    pair.1 = pair.1.max(p);
                    other_at = at;
                }
                _ => other_at = other.raise_walking(other_at, c, p),
            }
        });
        debug_assert!(self.invariants_hold() && other.invariants_hold(), "{self:?}, {other:?}");
    }

    /// Raises `channel` to `position`, walking from index `at` (every pair before it sorts
    /// below `channel`); returns the index after the pair.
    fn raise_walking(&mut self, mut at: usize, channel: ChannelId, position: Position) -> usize {
        while let Some(pair) = self.pairs.get_mut(at) {
            if pair.0 == channel {
                pair.1 = pair.1.max(position);
                return at + 1;
            }
            if pair.0 > channel {
                break;
            }
            at += 1;
        }
        self.pairs.insert(at, (channel, position));
        at + 1
    }

    /// What turns this past into `later`: the pairs of `later` that this past lacks or holds
    /// at another position, and the channels this past names that `later` does not.
    pub(crate) fn changes_to(&self, later: &CausalPast) -> (Vec<(ChannelId, Position)>, Vec<ChannelId>) {
        let (mut upserts, mut removed) = (Vec::new(), Vec::new());
        let (mut a, mut b) = (self.pairs.iter().peekable(), later.pairs.iter().peekable());
        loop {
            match (a.peek(), b.peek()) {
                (Some(&&(ca, pa)), Some(&&(cb, pb))) => match ca.cmp(&cb) {
                    std::cmp::Ordering::Less => {
                        removed.push(ca);
                        a.next();
                    }
                    std::cmp::Ordering::Greater => {
                        upserts.push((cb, pb));
                        b.next();
                    }
                    std::cmp::Ordering::Equal => {
                        if pa != pb {
                            upserts.push((cb, pb));
                        }
                        a.next();
                        b.next();
                    }
                },
                (Some(&&(ca, _)), None) => {
                    removed.push(ca);
                    a.next();
                }
                (None, Some(&&(cb, pb))) => {
                    upserts.push((cb, pb));
                    b.next();
                }
                (None, None) => return (upserts, removed),
            }
        }
    }

    /// [`CausalPast::raise`] searching only from index `from` on (every channel before it
    /// sorts below `channel`); also returns the pair's index.
    fn raise_from(&mut self, from: usize, channel: ChannelId, position: Position) -> (usize, bool) {
        assert!(position >= 0, "a causal past names offsets >= 0");
        match self.find_from(from, &channel) {
            Ok(at) => {
                let raised = self.pairs[at].1 < position;
                if raised {
                    self.pairs[at].1 = position;
                }
                (at, raised)
            }
            Err(at) => {
                self.pairs.insert(at, (channel, position));
                (at, true)
            }
        }
    }

    /// Where `channel` is (`Ok`) or would go (`Err`), searching from index `from` on: the
    /// next few pairs one by one first — a record's causes, merged in order, usually sit a
    /// few pairs apart — then a binary search of the rest.
    fn find_from(&self, from: usize, channel: &ChannelId) -> Result<usize, usize> {
        const NEAR: usize = 4;
        let near_end = (from + NEAR).min(self.pairs.len());
        for at in from..near_end {
            match self.pairs[at].0.cmp(channel) {
                std::cmp::Ordering::Less => {}
                std::cmp::Ordering::Equal => return Ok(at),
                std::cmp::Ordering::Greater => return Err(at),
            }
        }
        match self.pairs[near_end..].binary_search_by(|(c, _)| c.cmp(channel)) {
            Ok(i) => Ok(near_end + i),
            Err(i) => Err(near_end + i),
        }
    }

    /// The canonical `parsley.causes` encoding of this past.
    pub fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    /// Decodes a `parsley.causes` value, exactly as strictly as a received header: a damaged
    /// value is refused, never salvaged into a weaker past.
    pub fn decode(bytes: &[u8], budget: usize) -> Result<Self, DecodeError> {
        codec::decode(bytes, budget)
    }

    /// Checks every channel `token` names against this (recorded) past. Fails closed: a
    /// channel this past has never recorded is a gap.
    pub fn coverage_of(&self, token: &CausalPast) -> Coverage {
        let gaps = token
            .iter()
            .filter_map(|(channel, required)| {
                let recorded = self.get(&channel);
                match recorded {
                    Some(r) if r >= required => None,
                    _ => Some(Gap { channel, required, recorded }),
                }
            })
            .collect();
        Coverage { gaps }
    }

    /// True when every pair of `other` is at or below this past's position on its channel.
    pub fn covers(&self, other: &CausalPast) -> bool {
        other.iter().all(|(c, p)| self.get(&c).is_some_and(|r| r >= p))
    }
}

/// Calls `f` with a record's own pair and its causes merged in ascending channel order (a
/// cause on the record's own channel merged with the own pair into one).
fn merged_with(channel: ChannelId, position: Position, causes: &CausalPast, mut f: impl FnMut(ChannelId, Position)) {
    let mut own = Some((channel, position));
    for &(c, p) in &causes.pairs {
        if let Some((oc, op)) = own.filter(|&(oc, _)| oc <= c) {
            own = None;
            if oc == c {
                f(c, p.max(op));
                continue;
            }
            f(oc, op);
        }
        f(c, p);
    }
    if let Some((oc, op)) = own {
        f(oc, op);
    }
}

impl std::fmt::Debug for CausalPast {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.pairs.iter().map(|(c, p)| (c, p))).finish()
    }
}

impl FromIterator<(ChannelId, Position)> for CausalPast {
    fn from_iter<T: IntoIterator<Item = (ChannelId, Position)>>(iter: T) -> Self {
        CausalPast::from_pairs(iter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::TopicId;

    fn ch(t: u8, p: u32) -> ChannelId {
        ChannelId::new(TopicId::from_bytes([t; 16]), p)
    }

    #[test]
    fn from_pairs_compresses_to_greatest_and_sorts() {
        let past = CausalPast::from_pairs([(ch(2, 0), 5), (ch(1, 3), 7), (ch(2, 0), 9), (ch(2, 0), 1)]);
        assert_eq!(past.iter().collect::<Vec<_>>(), vec![(ch(1, 3), 7), (ch(2, 0), 9)]);
    }

    #[test]
    fn merge_is_pointwise_max() {
        let a = CausalPast::from_pairs([(ch(1, 0), 5), (ch(2, 0), 1)]);
        let b = CausalPast::from_pairs([(ch(1, 0), 3), (ch(3, 0), 4)]);
        let m = a.clone().merge_past(&b);
        assert_eq!(m, CausalPast::from_pairs([(ch(1, 0), 5), (ch(2, 0), 1), (ch(3, 0), 4)]));
        assert_eq!(m, b.clone().merge_past(&a), "merge commutes");
        assert_eq!(a.clone().merge(ch(1, 0), 2), a, "a lower position changes nothing");
        assert_eq!(a.clone().merge(ch(1, 0), 6).get(&ch(1, 0)), Some(6));
    }

    #[test]
    fn raise_all_is_merge_past_and_changes_to_names_what_changed() {
        let a = CausalPast::from_pairs([(ch(1, 0), 5), (ch(2, 0), 1), (ch(4, 0), 9)]);
        let b = CausalPast::from_pairs([(ch(0, 0), 2), (ch(1, 0), 3), (ch(2, 0), 4), (ch(3, 0), 1), (ch(4, 0), 9)]);
        let mut m = a.clone();
        m.raise_all(&b);
        assert_eq!(m, a.clone().merge_past(&b));
        assert_eq!(a.changes_to(&m), (vec![(ch(0, 0), 2), (ch(2, 0), 4), (ch(3, 0), 1)], vec![]));
        // A record's own pair and its causes in one pass: the same as one then the other,
        // wherever the own pair sorts among the causes (first, between, last, on a cause's
        // channel above or below it), and for a past too long to walk.
        let long = CausalPast::from_pairs((0..100).map(|p| (ch(5, p), 1)));
        for past in [a.clone(), CausalPast::new(), long] {
            for own in [(ch(0, 0), 1), (ch(1, 0), 9), (ch(2, 5), 3), (ch(3, 0), 0), (ch(3, 0), 7), (ch(9, 0), 4)] {
                let mut one_pass = past.clone();
                one_pass.raise_record(own.0, own.1, &b);
                let mut two = past.clone();
                two.raise(own.0, own.1);
                two.raise_all(&b);
                assert_eq!(one_pass, two, "own pair {own:?}");
                // Both at once, whether the second past names the same channels or others.
                for second in [past.clone(), m.clone(), CausalPast::new()] {
                    let (mut x, mut y) = (past.clone(), second.clone());
                    x.raise_record_both(&mut y, own.0, own.1, &b);
                    let mut expected = second.clone();
                    expected.raise_record(own.0, own.1, &b);
                    assert_eq!((&x, &y), (&one_pass, &expected), "own pair {own:?}, second {second:?}");
                }
            }
        }
        let mut same = m.clone();
        same.raise_all(&b);
        assert_eq!(same, m);
        assert_eq!(m.changes_to(&same), (vec![], vec![]));
        assert!(same.raise(ch(9, 0), 0) && !same.raise(ch(9, 0), 0) && same.raise(ch(9, 0), 1));
        // A pruned channel is a removal; a lowered or new one an upsert.
        let later = CausalPast::from_pairs([(ch(0, 0), 1), (ch(2, 0), 4), (ch(5, 0), 7)]);
        assert_eq!(m.changes_to(&later), (vec![(ch(0, 0), 1), (ch(5, 0), 7)], vec![ch(1, 0), ch(3, 0), ch(4, 0)]));
        assert_eq!(CausalPast::new().changes_to(&later), (later.iter().collect(), vec![]));
        assert_eq!(later.changes_to(&CausalPast::new()), (vec![], later.iter().map(|(c, _)| c).collect()));
    }

    #[test]
    fn coverage_lists_every_gap_and_fails_closed_on_unknown_channels() {
        let recorded = CausalPast::from_pairs([(ch(1, 0), 10), (ch(2, 0), 3)]);
        let token = CausalPast::from_pairs([(ch(1, 0), 10), (ch(2, 0), 4), (ch(9, 1), 0)]);
        let cov = recorded.coverage_of(&token);
        assert_eq!(
            cov.gaps,
            vec![
                Gap { channel: ch(2, 0), required: 4, recorded: Some(3) },
                Gap { channel: ch(9, 1), required: 0, recorded: None },
            ]
        );
        assert!(!cov.is_covered());
        assert!(recorded.coverage_of(&CausalPast::new()).is_covered());
        assert!(recorded.covers(&CausalPast::from_pairs([(ch(1, 0), 9)])));
    }

    #[test]
    fn the_invariant_check_reports_unsorted_repeated_and_negative_pairs() {
        assert!(CausalPast::new().invariants_hold());
        assert!(CausalPast::from_pairs([(ch(1, 0), 0), (ch(1, 1), 4), (ch(2, 0), 9)]).invariants_hold());
        let broken = [
            ("descending channels", vec![(ch(2, 0), 1), (ch(1, 0), 1)]),
            ("descending partitions", vec![(ch(1, 1), 1), (ch(1, 0), 1)]),
            ("a channel twice", vec![(ch(1, 0), 1), (ch(1, 0), 3)]),
            ("a channel twice, apart", vec![(ch(1, 0), 1), (ch(2, 0), 3), (ch(1, 0), 1)]),
            ("a negative position", vec![(ch(1, 0), 1), (ch(2, 0), -1)]),
        ];
        for (what, pairs) in broken {
            assert!(!CausalPast { pairs }.invariants_hold(), "{what}");
        }
    }

    mod props {
        use proptest::prelude::*;

        use super::*;

        /// A past over a few topics and up to 100 partitions each: short enough to be walked
        /// or long enough to be searched ([`WALKED`]).
        fn past(max: usize) -> impl Strategy<Value = CausalPast> {
            prop::collection::vec(((1u8..4), (0u32..100), (0i64..50)), 0..max)
                .prop_map(|v| CausalPast::from_pairs(v.into_iter().map(|(t, p, pos)| (ch(t, p), pos))))
        }

        proptest! {
            /// A record's own pair and its causes merged in one pass, into one past or into
            /// two at once, give what merging the pair and then the causes gives.
            #[test]
            fn a_records_pairs_in_one_pass_are_the_two_step_merge(
                first in past(120), second in past(120), causes in past(12),
                own_topic in 1u8..4, own_partition in 0u32..100, own_position in 0i64..60,
            ) {
                let own = ch(own_topic, own_partition);
                let two_step = |p: &CausalPast| {
                    let mut p = p.clone();
                    p.raise(own, own_position);
                    p.raise_all(&causes);
                    p
                };
                let mut one = first.clone();
                one.raise_record(own, own_position, &causes);
                prop_assert_eq!(&one, &two_step(&first));
                let (mut a, mut b) = (first.clone(), second.clone());
                a.raise_record_both(&mut b, own, own_position, &causes);
                prop_assert_eq!(&a, &two_step(&first));
                prop_assert_eq!(&b, &two_step(&second));
                // The usual case: two pasts naming the same channels.
                let (mut a, mut b) = (first.clone(), first.clone().retain(|_, p| p > 0));
                let expected = two_step(&b);
                a.raise_record_both(&mut b, own, own_position, &causes);
                prop_assert_eq!(&b, &expected);
            }
        }
    }
}
