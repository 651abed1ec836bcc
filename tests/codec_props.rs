//! Property tests of the `parsley.causes` codec: round trips, canonical uniqueness, and
//! strictness under arbitrary damage.

use parsley::codec::{self, DecodeError, DEFAULT_METADATA_BUDGET};
use parsley::{CausalPast, ChannelId, TopicId};
use proptest::prelude::*;

fn topic_id() -> impl Strategy<Value = TopicId> {
    // Few distinct topics so groups with several partitions are common; include high bits.
    prop_oneof![
        (1u8..=4).prop_map(|b| TopicId::from_bytes([b; 16])),
        (0x7fu8..=0x81).prop_map(|b| TopicId::from_bytes([b; 16])),
        any::<[u8; 16]>().prop_filter("non-zero", |b| *b != [0; 16]).prop_map(TopicId::from_bytes),
    ]
}

fn partition() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..4, 120u32..140, 16_380u32..16_390, Just(i32::MAX as u32), 0u32..=i32::MAX as u32]
}

fn position() -> impl Strategy<Value = i64> {
    prop_oneof![0i64..10, Just(i64::MAX - 1), 0i64..i64::MAX]
}

fn past() -> impl Strategy<Value = CausalPast> {
    prop::collection::vec((topic_id(), partition(), position()), 0..40)
        .prop_map(|v| CausalPast::from_pairs(v.into_iter().map(|(t, p, o)| (ChannelId::new(t, p), o))))
}

/// 512 cases by default; `PROPTEST_CASES=<n>` for a long run (`make fuzz`).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn round_trip(p in past()) {
        let bytes = p.encode();
        prop_assert_eq!(bytes.len(), codec::encoded_len(&p));
        let back = CausalPast::decode(&bytes, DEFAULT_METADATA_BUDGET).unwrap();
        prop_assert_eq!(back, p);
    }

    /// Whatever decodes re-encodes to exactly the same bytes: one encoding per cause set.
    #[test]
    fn anything_that_decodes_is_canonical(bytes in prop_oneof![
        prop::collection::vec(any::<u8>(), 0..120),
        // Mostly well-formed prefixes, so the deeper rules are exercised too.
        prop::collection::vec(prop_oneof![Just(0u8), Just(1u8), Just(0x80u8), any::<u8>()], 0..120)
            .prop_map(|v| [vec![0x01, 0x01], v].concat()),
    ]) {
        if let Ok(p) = codec::decode(&bytes, DEFAULT_METADATA_BUDGET) {
            prop_assert_eq!(p.encode(), bytes);
        }
    }

    /// Damaging a valid value either is refused or yields a value whose encoding is exactly
    /// the damaged bytes: never a silently different reading of the same bytes.
    #[test]
    fn damaged_values_are_refused_or_canonical(p in past(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut bytes = p.encode();
        let i = at.index(bytes.len());
        bytes[i] = byte;
        match codec::decode(&bytes, DEFAULT_METADATA_BUDGET) {
            Ok(q) => prop_assert_eq!(q.encode(), bytes),
            Err(DecodeError::Undecodable(_)) => {}
            Err(e) => prop_assert!(false, "unexpected {e:?}"),
        }
    }

    #[test]
    fn truncation_and_extension_are_refused(p in past(), cut in any::<prop::sample::Index>(), extra in prop::collection::vec(any::<u8>(), 1..10)) {
        let bytes = p.encode();
        let n = cut.index(bytes.len());
        prop_assert!(codec::decode(&bytes[..n], DEFAULT_METADATA_BUDGET).is_err());
        let mut longer = bytes.clone();
        longer.extend_from_slice(&extra);
        prop_assert!(codec::decode(&longer, DEFAULT_METADATA_BUDGET).is_err());
    }

    #[test]
    fn merge_is_a_join(a in past(), b in past(), c in past()) {
        let ab = a.clone().merge_past(&b);
        prop_assert_eq!(&ab, &b.clone().merge_past(&a));
        prop_assert_eq!(ab.clone().merge_past(&c), a.clone().merge_past(&b.clone().merge_past(&c)));
        prop_assert_eq!(a.clone().merge_past(&a), a.clone());
        prop_assert!(ab.covers(&a) && ab.covers(&b));
        prop_assert!(ab.coverage_of(&a).is_covered());
    }

    #[test]
    fn coverage_gaps_are_exactly_the_uncovered_pairs(rec in past(), token in past()) {
        let cov = rec.coverage_of(&token);
        let expected: Vec<ChannelId> = token.iter().filter(|(c, p)| rec.get(c).is_none_or(|r| r < *p)).map(|(c, _)| c).collect();
        prop_assert_eq!(cov.gaps.iter().map(|g| g.channel).collect::<Vec<_>>(), expected);
    }

    /// Values given one at a time decode as the whole list does: same causes, same error.
    #[test]
    fn header_decoder_is_decode_headers(values in prop::collection::vec(prop_oneof![
        1 => Just(None),
        1 => Just(Some(Vec::new())),
        4 => past().prop_map(|p| Some(p.encode())),
        2 => prop::collection::vec(any::<u8>(), 0..40).prop_map(Some),
    ], 0..4), budget in prop_oneof![Just(DEFAULT_METADATA_BUDGET), 0usize..64]) {
        let borrowed: Vec<Option<&[u8]>> = values.iter().map(|v| v.as_deref()).collect();
        let mut decoder = codec::HeaderDecoder::new(budget);
        for v in &borrowed {
            decoder.push(*v);
        }
        prop_assert_eq!(decoder.finish(), codec::decode_headers(&borrowed, budget));
    }
}
