//! The `decode` fuzz target's property, shared by the cargo-fuzz target
//! (`fuzz/fuzz_targets/decode.rs`) and the stable replay in `tests/fuzz_corpus.rs`.
//!
//! Input: one byte choosing the budget, then the `parsley.causes` value. Whatever the bytes:
//! - decoding never panics;
//! - a value over the budget is refused as over budget (naming its size and the budget),
//!   and a value within it never is;
//! - a value that decodes re-encodes to exactly the same bytes (one encoding per cause set),
//!   with the size `encoded_len` predicts, fits `encode_within` at the same budget, and
//!   holds only real pairs (a non-zero topic, a partition the format can carry, a position
//!   in `0..i64::MAX`, channels strictly ascending);
//! - a value that does not decode is refused with a named malformation whose byte offset
//!   lies within the value;
//! - the budget only bounds the size: a value within it reads the same under any larger one.

use parsley::channel::MAX_PARTITION;
use parsley::codec::{self, DecodeError, Malformation};
use parsley::CausalPast;

/// The budget the first byte chooses for a value of `len` bytes: the default most often,
/// and the edges (exactly the size, one byte short, zero, small, unbounded) the rest.
pub fn budget(selector: u8, len: usize) -> usize {
    match selector & 7 {
        0..=2 => codec::DEFAULT_METADATA_BUDGET,
        3 => len,
        4 => len.saturating_sub(1),
        5 => 0,
        6 => usize::from(selector >> 3) * 4,
        _ => usize::MAX,
    }
}

/// Checks one input; panics, naming the broken property, if the codec breaks one.
pub fn check(data: &[u8]) {
    let Some((&selector, value)) = data.split_first() else {
        return;
    };
    let budget = budget(selector, value.len());
    let decoded = codec::decode(value, budget);
    if value.len() > budget {
        assert_eq!(
            decoded,
            Err(DecodeError::OverBudget { size: value.len(), budget }),
            "a value over the budget must be refused as such, before it is read: {value:02x?}"
        );
        return;
    }
    match decoded {
        Ok(past) => check_canonical(value, budget, &past),
        Err(DecodeError::Undecodable(malformation)) => check_named(value, &malformation),
        Err(e @ DecodeError::OverBudget { .. }) => {
            panic!("a value of {} bytes within the budget {budget} was refused: {e}", value.len())
        }
    }
    // The budget bounds the size and nothing else: an unbounded decode reads the same.
    assert_eq!(
        codec::decode(value, usize::MAX),
        codec::decode(value, budget),
        "the verdict on a value within the budget changed with the budget: {value:02x?}"
    );
}

fn check_canonical(value: &[u8], budget: usize, past: &CausalPast) {
    assert_eq!(past.encode(), value, "a decoded value re-encodes to other bytes: not canonical");
    assert_eq!(codec::encoded_len(past), value.len(), "encoded_len disagrees with the encoding");
    assert_eq!(
        codec::encode_within(past, budget).as_deref(),
        Ok(value),
        "a value that decoded within the budget does not encode within it"
    );
    assert_eq!(CausalPast::decode(value, budget).as_ref(), Ok(past), "CausalPast::decode reads differently");
    let pairs: Vec<_> = past.iter().collect();
    for window in pairs.windows(2) {
        assert!(window[0].0 < window[1].0, "channels not strictly ascending: {pairs:?}");
    }
    for (channel, position) in pairs {
        assert!(!channel.topic.is_zero(), "a decoded pair names the zero topic");
        assert!(channel.partition <= MAX_PARTITION, "partition {} beyond the format", channel.partition);
        assert!((0..i64::MAX).contains(&position), "position {position} names no record a log can hold");
    }
}

fn check_named(value: &[u8], malformation: &Malformation) {
    let offset = match *malformation {
        Malformation::DuplicateHeader { .. } | Malformation::NullValue => {
            panic!("decoding one value reported a header-level malformation: {malformation:?}")
        }
        Malformation::EmptyValue => {
            assert!(value.is_empty(), "a value of {} bytes was called empty", value.len());
            0
        }
        Malformation::UnknownVersion { version } => {
            assert_eq!(Some(&version), value.first(), "the unknown version is not the first byte");
            0
        }
        Malformation::Truncated { offset, .. }
        | Malformation::TrailingBytes { offset, .. }
        | Malformation::NonMinimalVarint { offset }
        | Malformation::VarintOutOfRange { offset }
        | Malformation::ZeroTopicId { offset }
        | Malformation::TopicsNotAscending { offset }
        | Malformation::EmptyGroup { offset, .. }
        | Malformation::PartitionsNotAscending { offset, .. }
        | Malformation::NegativePosition { offset, .. }
        | Malformation::PositionOutOfRange { offset, .. } => offset,
    };
    assert!(offset <= value.len(), "{malformation:?} points past the value's {} bytes", value.len());
    let class = malformation.class();
    assert!(
        !class.is_empty() && class.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
        "malformation class {class:?} is not a stable name"
    );
    assert!(!malformation.to_string().is_empty(), "{malformation:?} has no message");
}
