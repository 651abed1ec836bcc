//! The frozen `parsley.causes` header, version 1: a strict, canonical binary encoding of a
//! [`CausalPast`]. One cause set has exactly one encoding; anything else is undecodable.
//!
//! ```text
//! value          := version topicCount group*
//! version        := uint8 0x01
//! topicCount     := varint
//! group          := topicId(16 bytes) partitionCount(varint >= 1) pair*
//! pair           := partition(varint) position(int64 big-endian, >= 0)
//! ```
//! Varints are unsigned LEB128, minimal spelling only, at most 2³¹−1. Topic IDs strictly
//! ascending (unsigned bytes), never all zero; partitions strictly ascending per group.

use crate::channel::{ChannelId, TopicId, MAX_PARTITION};
use crate::past::CausalPast;

/// The one header key the protocol uses.
pub const CAUSES_HEADER: &str = "parsley.causes";
/// Header keys with this prefix belong to the protocol; applications may not set them.
pub const RESERVED_PREFIX: &str = "parsley.";
/// The only version this build reads and writes.
pub const VERSION: u8 = 0x01;
/// Default bound on an encoded value: refused before any broker or database limit is hit.
pub const DEFAULT_METADATA_BUDGET: usize = 256 * 1024;

/// Each way a `parsley.causes` value can be malformed. `offset` is the byte index where
/// the problem was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformation {
    #[error("the record carries {count} parsley.causes headers; exactly one is allowed")]
    DuplicateHeader { count: usize },
    #[error("the parsley.causes header is present with a null value")]
    NullValue,
    #[error("the parsley.causes header is present with an empty value")]
    EmptyValue,
    #[error("unknown version 0x{version:02x} (this build reads version 0x01)")]
    UnknownVersion { version: u8 },
    #[error("truncated at byte {offset}: expected {expected}")]
    Truncated { offset: usize, expected: &'static str },
    #[error("{count} trailing byte(s) after the last group, from byte {offset}")]
    TrailingBytes { offset: usize, count: usize },
    #[error("varint at byte {offset} is not minimally encoded")]
    NonMinimalVarint { offset: usize },
    #[error("varint at byte {offset} exceeds 2^31-1")]
    VarintOutOfRange { offset: usize },
    #[error("topic ID at byte {offset} is all zeros")]
    ZeroTopicId { offset: usize },
    #[error("topic ID at byte {offset} does not sort strictly after the previous one")]
    TopicsNotAscending { offset: usize },
    #[error("group for topic {topic} at byte {offset} has zero partitions")]
    EmptyGroup { offset: usize, topic: TopicId },
    #[error("partition {partition} of topic {topic} at byte {offset} does not sort strictly after the previous one")]
    PartitionsNotAscending { offset: usize, topic: TopicId, partition: u32 },
    #[error("position {position} for {topic}/{partition} at byte {offset} is negative")]
    NegativePosition { offset: usize, topic: TopicId, partition: u32, position: i64 },
    /// `i64::MAX` names no record a log can hold (the position after it is not
    /// representable): only a forged or damaged value carries it.
    #[error("position {position} for {topic}/{partition} at byte {offset} is beyond any log (the largest is 2^63-2)")]
    PositionOutOfRange { offset: usize, topic: TopicId, partition: u32, position: i64 },
}

impl Malformation {
    /// A stable, machine-readable name for the class of malformation.
    pub fn class(&self) -> &'static str {
        match self {
            Malformation::DuplicateHeader { .. } => "duplicate_header",
            Malformation::NullValue => "null_value",
            Malformation::EmptyValue => "empty_value",
            Malformation::UnknownVersion { .. } => "unknown_version",
            Malformation::Truncated { .. } => "truncated",
            Malformation::TrailingBytes { .. } => "trailing_bytes",
            Malformation::NonMinimalVarint { .. } => "non_minimal_varint",
            Malformation::VarintOutOfRange { .. } => "varint_out_of_range",
            Malformation::ZeroTopicId { .. } => "zero_topic_id",
            Malformation::TopicsNotAscending { .. } => "topics_not_ascending",
            Malformation::EmptyGroup { .. } => "empty_group",
            Malformation::PartitionsNotAscending { .. } => "partitions_not_ascending",
            Malformation::NegativePosition { .. } => "negative_position",
            Malformation::PositionOutOfRange { .. } => "position_out_of_range",
        }
    }
}

/// Why a value could not be turned into a cause set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Maps to the refusal `UNDECODABLE_METADATA`.
    #[error("{0}")]
    Undecodable(#[from] Malformation),
    /// Maps to the refusal `METADATA_BUDGET_EXCEEDED`.
    #[error("value of {size} bytes exceeds the metadata budget of {budget} bytes")]
    OverBudget { size: usize, budget: usize },
}

/// The encoded form of a past would not fit the metadata budget.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("encoded causes of {size} bytes exceed the metadata budget of {budget} bytes")]
pub struct BudgetExceeded {
    pub size: usize,
    pub budget: usize,
}

/// Decodes the `parsley.causes` headers of one record, given the values of every header
/// with that key in the record (`None` for a null value). No header means no causes;
/// more than one, a null or an empty value is undecodable — never treated as absent.
pub fn decode_headers(values: &[Option<&[u8]>], budget: usize) -> Result<CausalPast, DecodeError> {
    match values {
        [] => Ok(CausalPast::new()),
        [None] => Err(Malformation::NullValue.into()),
        [Some(bytes)] => decode(bytes, budget),
        more => Err(Malformation::DuplicateHeader { count: more.len() }.into()),
    }
}

/// [`decode_headers`] for a reader that meets a record's headers one at a time and cannot
/// keep them (a consumer handing out borrowed values): each value is given as it is met,
/// the first decoded at once, while its bytes are at hand. [`HeaderDecoder::finish`] is
/// `decode_headers` of every value given, in the same order of checks.
#[derive(Debug)]
pub struct HeaderDecoder {
    budget: usize,
    count: usize,
    first: Option<Result<CausalPast, DecodeError>>,
}

impl HeaderDecoder {
    pub fn new(budget: usize) -> Self {
        HeaderDecoder { budget, count: 0, first: None }
    }

    /// One `parsley.causes` header's value (`None` for a null value). Values after the
    /// first are counted, not read: the record is then undecodable whatever they hold.
    pub fn push(&mut self, value: Option<&[u8]>) {
        self.count += 1;
        if self.count == 1 {
            self.first = Some(decode_headers(&[value], self.budget));
        } else {
            self.first = None;
        }
    }

    /// The record's causes: what [`decode_headers`] makes of the values given.
    pub fn finish(self) -> Result<CausalPast, DecodeError> {
        match (self.count, self.first) {
            (0, _) => Ok(CausalPast::new()),
            (1, Some(decoded)) => decoded,
            (count, _) => Err(Malformation::DuplicateHeader { count }.into()),
        }
    }
}

/// Decodes one `parsley.causes` value strictly: every malformation is refused, and a value
/// larger than `budget` bytes is refused before it is read.
pub fn decode(bytes: &[u8], budget: usize) -> Result<CausalPast, DecodeError> {
    if bytes.len() > budget {
        return Err(DecodeError::OverBudget { size: bytes.len(), budget });
    }
    if bytes.is_empty() {
        return Err(Malformation::EmptyValue.into());
    }
    if bytes[0] != VERSION {
        return Err(Malformation::UnknownVersion { version: bytes[0] }.into());
    }
    let mut r = Reader { bytes, at: 1 };
    let topic_count = r.varint("topic count")?;
    // Never trust a count for allocation, but size it once: each group takes at least 17
    // bytes (its topic ID and count) and each pair at least 9 (a partition and its
    // position), so the bytes left bound the pairs — exactly, when the varints are one byte.
    let groups_at_least = (topic_count as usize).saturating_mul(17);
    let mut pairs = Vec::with_capacity(r.remaining().saturating_sub(groups_at_least) / 9);
    let mut previous_topic: Option<TopicId> = None;
    for _ in 0..topic_count {
        let topic_offset = r.at;
        let topic = TopicId::from_bytes(r.array::<16>("a 16-byte topic ID")?);
        if topic.is_zero() {
            return Err(Malformation::ZeroTopicId { offset: topic_offset }.into());
        }
        if previous_topic.is_some_and(|prev| prev >= topic) {
            return Err(Malformation::TopicsNotAscending { offset: topic_offset }.into());
        }
        previous_topic = Some(topic);
        let count_offset = r.at;
        let partition_count = r.varint("a partition count")?;
        if partition_count == 0 {
            return Err(Malformation::EmptyGroup { offset: count_offset, topic }.into());
        }
        let mut previous_partition: Option<u32> = None;
        for _ in 0..partition_count {
            let partition_offset = r.at;
            let partition = r.varint("a partition")?;
            if previous_partition.is_some_and(|prev| prev >= partition) {
                return Err(Malformation::PartitionsNotAscending { offset: partition_offset, topic, partition }.into());
            }
            previous_partition = Some(partition);
            let position_offset = r.at;
            let position = i64::from_be_bytes(r.array::<8>("an 8-byte position")?);
            if position < 0 {
                return Err(
                    Malformation::NegativePosition { offset: position_offset, topic, partition, position }.into()
                );
            }
            if position == i64::MAX {
                return Err(
                    Malformation::PositionOutOfRange { offset: position_offset, topic, partition, position }.into()
                );
            }
            pairs.push((ChannelId::new(topic, partition), position));
        }
    }
    if r.remaining() > 0 {
        return Err(Malformation::TrailingBytes { offset: r.at, count: r.remaining() }.into());
    }
    Ok(CausalPast::from_sorted_unchecked(pairs))
}

/// The canonical encoding of `past`.
pub fn encode(past: &CausalPast) -> Vec<u8> {
    let mut out = Vec::with_capacity(encoded_len(past));
    encode_into(past, &mut out);
    out
}

/// The canonical encoding of `past`, refused if it would exceed `budget` bytes.
pub fn encode_within(past: &CausalPast, budget: usize) -> Result<Vec<u8>, BudgetExceeded> {
    let size = encoded_len(past);
    if size > budget {
        return Err(BudgetExceeded { size, budget });
    }
    Ok(encode(past))
}

/// Appends the canonical encoding of `past` to `out`.
pub fn encode_into(past: &CausalPast, out: &mut Vec<u8>) {
    out.push(VERSION);
    let groups = past.as_slice().chunk_by(|a, b| a.0.topic == b.0.topic);
    put_varint(out, groups.clone().count() as u32);
    for group in groups {
        out.extend_from_slice(group[0].0.topic.as_bytes());
        put_varint(out, group.len() as u32);
        for &(channel, position) in group {
            put_varint(out, channel.partition);
            out.extend_from_slice(&position.to_be_bytes());
        }
    }
}

/// The exact size `encode` will produce, without encoding.
pub fn encoded_len(past: &CausalPast) -> usize {
    let mut size = 1;
    let mut topics = 0u32;
    let mut previous: Option<TopicId> = None;
    let mut group_len = 0u32;
    for (channel, _) in past.iter() {
        if previous != Some(channel.topic) {
            if previous.is_some() {
                size += varint_len(group_len);
            }
            topics += 1;
            size += 16;
            group_len = 0;
            previous = Some(channel.topic);
        }
        group_len += 1;
        size += varint_len(channel.partition) + 8;
    }
    if previous.is_some() {
        size += varint_len(group_len);
    }
    size + varint_len(topics)
}

fn varint_len(v: u32) -> usize {
    match v {
        0..=0x7f => 1,
        0x80..=0x3fff => 2,
        0x4000..=0x1f_ffff => 3,
        0x20_0000..=0xfff_ffff => 4,
        _ => 5,
    }
}

/// Writes `v` as a minimal unsigned LEB128 varint.
///
/// # Panics
/// If `v` exceeds 2³¹−1, which the format cannot carry (partitions and counts never do).
pub fn put_varint(out: &mut Vec<u8>, mut v: u32) {
    assert!(v <= MAX_PARTITION, "varint {v} exceeds 2^31-1");
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn array<const N: usize>(&mut self, expected: &'static str) -> Result<[u8; N], Malformation> {
        let Some(slice) = self.bytes.get(self.at..self.at + N) else {
            return Err(Malformation::Truncated { offset: self.at, expected });
        };
        self.at += N;
        Ok(slice.try_into().expect("slice of length N"))
    }

    /// A minimal unsigned LEB128 varint in 0..=2³¹−1.
    fn varint(&mut self, expected: &'static str) -> Result<u32, Malformation> {
        let start = self.at;
        let mut value: u32 = 0;
        for i in 0..5 {
            let Some(&byte) = self.bytes.get(self.at) else {
                return Err(Malformation::Truncated { offset: self.at, expected });
            };
            self.at += 1;
            if i == 4 && byte > 0x07 {
                // The fifth byte carries bits 28..30; anything more (including a
                // continuation bit) is beyond 2^31-1 or longer than five bytes.
                return Err(Malformation::VarintOutOfRange { offset: start });
            }
            value |= u32::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                if i > 0 && byte == 0 {
                    return Err(Malformation::NonMinimalVarint { offset: start });
                }
                return Ok(value);
            }
        }
        unreachable!("the fifth byte either ends the varint or is refused")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topic(b: u8) -> TopicId {
        let mut bytes = [0u8; 16];
        bytes[0] = b;
        bytes[15] = 1;
        TopicId::from_bytes(bytes)
    }

    fn one_pair(t: TopicId, partition: u32, position: i64) -> Vec<u8> {
        encode(&CausalPast::from_pairs([(ChannelId::new(t, partition), position)]))
    }

    fn undecodable(bytes: &[u8]) -> String {
        match decode(bytes, DEFAULT_METADATA_BUDGET) {
            Err(DecodeError::Undecodable(m)) => m.class().to_string(),
            other => panic!("expected undecodable, got {other:?} for {bytes:02x?}"),
        }
    }

    #[test]
    fn empty_set_is_version_and_zero_count() {
        assert_eq!(encode(&CausalPast::new()), vec![0x01, 0x00]);
        assert_eq!(decode(&[0x01, 0x00], 100).unwrap(), CausalPast::new());
    }

    #[test]
    fn sizes_match_the_documented_costs() {
        let t = topic(1);
        assert_eq!(one_pair(t, 0, 0).len(), 2 + 26);
        let two = CausalPast::from_pairs([(ChannelId::new(t, 0), 1), (ChannelId::new(t, 1), 2)]);
        assert_eq!(encode(&two).len(), 2 + 26 + 9);
        let wide = CausalPast::from_pairs([(ChannelId::new(t, 128), 1)]);
        assert_eq!(encode(&wide).len(), 2 + 27, "a partition >= 128 costs a second varint byte");
    }

    #[test]
    fn exact_bytes_of_one_pair() {
        let t = TopicId::from_halves(0x0102_0304_0506_0708, 0x090a_0b0c_0d0e_0f10);
        let bytes = one_pair(t, 3, 0x0102);
        let mut expected = vec![0x01, 0x01];
        expected.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]);
        expected.extend_from_slice(&[0x01, 0x03, 0, 0, 0, 0, 0, 0, 0x01, 0x02]);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn varint_edges() {
        let t = topic(1);
        for partition in [0u32, 127, 128, 16_383, 16_384, MAX_PARTITION] {
            let bytes = one_pair(t, partition, 5);
            let past = decode(&bytes, DEFAULT_METADATA_BUDGET).unwrap();
            assert_eq!(past.iter().next().unwrap().0.partition, partition);
        }
        let mut v = Vec::new();
        put_varint(&mut v, 127);
        assert_eq!(v, [0x7f]);
        v.clear();
        put_varint(&mut v, 128);
        assert_eq!(v, [0x80, 0x01]);
        v.clear();
        put_varint(&mut v, MAX_PARTITION);
        assert_eq!(v, [0xff, 0xff, 0xff, 0xff, 0x07]);
    }

    /// A one-group value whose partition varint is replaced by `varint`.
    fn with_partition_varint(varint: &[u8]) -> Vec<u8> {
        let mut v = vec![0x01, 0x01];
        v.extend_from_slice(topic(1).as_bytes());
        v.push(0x01);
        v.extend_from_slice(varint);
        v.extend_from_slice(&5i64.to_be_bytes());
        v
    }

    #[test]
    fn malformation_battery() {
        let good = one_pair(topic(1), 2, 7);
        assert!(decode(&good, DEFAULT_METADATA_BUDGET).is_ok());

        assert_eq!(undecodable(&[]), "empty_value");
        assert_eq!(undecodable(&[0x02, 0x00]), "unknown_version");
        assert_eq!(undecodable(&[0x00, 0x00]), "unknown_version");
        assert_eq!(undecodable(&[0x01]), "truncated");
        for cut in 1..good.len() {
            assert_eq!(undecodable(&good[..cut]), "truncated", "cut at {cut}");
        }
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(undecodable(&trailing), "trailing_bytes");
        assert_eq!(undecodable(&[0x01, 0x00, 0x00]), "trailing_bytes");

        // Varints: 2^31 is out of range, a zero continuation byte is non-minimal.
        assert_eq!(undecodable(&with_partition_varint(&[0x80, 0x80, 0x80, 0x80, 0x08])), "varint_out_of_range");
        assert_eq!(undecodable(&with_partition_varint(&[0xff, 0xff, 0xff, 0xff, 0x0f])), "varint_out_of_range");
        assert_eq!(undecodable(&with_partition_varint(&[0x80, 0x80, 0x80, 0x80, 0x80, 0x00])), "varint_out_of_range");
        assert_eq!(undecodable(&with_partition_varint(&[0x85, 0x00])), "non_minimal_varint");
        assert_eq!(undecodable(&with_partition_varint(&[0x80, 0x00])), "non_minimal_varint");
        assert_eq!(undecodable(&[0x01, 0x80, 0x00]), "non_minimal_varint");
        assert!(decode(&with_partition_varint(&[0xff, 0xff, 0xff, 0xff, 0x07]), 1000).is_ok());

        // Zero topic ID.
        let mut zero = vec![0x01, 0x01];
        zero.extend_from_slice(&[0; 16]);
        zero.extend_from_slice(&[0x01, 0x00]);
        zero.extend_from_slice(&0i64.to_be_bytes());
        assert_eq!(undecodable(&zero), "zero_topic_id");

        // Topics not strictly ascending: equal, then descending (unsigned: 0x80 > 0x7f).
        let group = |t: TopicId| {
            let mut g = t.as_bytes().to_vec();
            g.extend_from_slice(&[0x01, 0x00]);
            g.extend_from_slice(&1i64.to_be_bytes());
            g
        };
        for (a, b) in [(topic(3), topic(3)), (topic(0x80), topic(0x7f))] {
            let mut v = vec![0x01, 0x02];
            v.extend(group(a));
            v.extend(group(b));
            assert_eq!(undecodable(&v), "topics_not_ascending");
        }
        let mut ascending = vec![0x01, 0x02];
        ascending.extend(group(topic(0x7f)));
        ascending.extend(group(topic(0x80)));
        assert!(decode(&ascending, 1000).is_ok(), "high bit sorts after, unsigned");

        // Empty group.
        let mut empty = vec![0x01, 0x01];
        empty.extend_from_slice(topic(1).as_bytes());
        empty.push(0x00);
        assert_eq!(undecodable(&empty), "empty_group");

        // Partitions not ascending within a group.
        for (p1, p2) in [(4u8, 4u8), (5, 4)] {
            let mut v = vec![0x01, 0x01];
            v.extend_from_slice(topic(1).as_bytes());
            v.push(0x02);
            v.push(p1);
            v.extend_from_slice(&1i64.to_be_bytes());
            v.push(p2);
            v.extend_from_slice(&1i64.to_be_bytes());
            assert_eq!(undecodable(&v), "partitions_not_ascending");
        }

        // Negative position.
        let mut neg = vec![0x01, 0x01];
        neg.extend_from_slice(topic(1).as_bytes());
        neg.extend_from_slice(&[0x01, 0x00]);
        neg.extend_from_slice(&(-1i64).to_be_bytes());
        assert_eq!(undecodable(&neg), "negative_position");

        // A position no log can hold: refused, not held forever.
        let mut max = vec![0x01, 0x01];
        max.extend_from_slice(topic(1).as_bytes());
        max.extend_from_slice(&[0x01, 0x00]);
        max.extend_from_slice(&i64::MAX.to_be_bytes());
        assert_eq!(undecodable(&max), "position_out_of_range");
        assert!(
            decode(&one_pair(topic(1), 0, i64::MAX - 1), DEFAULT_METADATA_BUDGET).is_ok(),
            "the largest real position decodes"
        );
    }

    #[test]
    fn header_presence_rules() {
        let good = one_pair(topic(1), 0, 1);
        assert_eq!(decode_headers(&[], 100).unwrap(), CausalPast::new());
        assert!(decode_headers(&[Some(&good)], 100).is_ok());
        assert_eq!(decode_headers(&[None], 100), Err(DecodeError::Undecodable(Malformation::NullValue)));
        assert_eq!(decode_headers(&[Some(&[])], 100), Err(DecodeError::Undecodable(Malformation::EmptyValue)));
        assert_eq!(
            decode_headers(&[Some(&good), Some(&good)], 100),
            Err(DecodeError::Undecodable(Malformation::DuplicateHeader { count: 2 }))
        );
    }

    #[test]
    fn budget_is_checked_before_reading_and_when_encoding() {
        let good = one_pair(topic(1), 0, 1);
        assert_eq!(
            decode(&good, good.len() - 1),
            Err(DecodeError::OverBudget { size: good.len(), budget: good.len() - 1 })
        );
        assert!(decode(&good, good.len()).is_ok());
        let past = decode(&good, 100).unwrap();
        assert_eq!(encode_within(&past, good.len()).unwrap(), good);
        assert_eq!(encode_within(&past, 10), Err(BudgetExceeded { size: good.len(), budget: 10 }));
    }

    #[test]
    fn huge_counts_do_not_allocate_ahead_of_the_bytes() {
        // topicCount = 2^31-1 with no groups behind it: refused as truncated, cheaply.
        assert_eq!(undecodable(&[0x01, 0xff, 0xff, 0xff, 0xff, 0x07]), "truncated");
    }
}
