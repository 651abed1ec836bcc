//! Channels and positions: a channel is one Kafka topic-partition named by the topic's ID
//! (the broker's UUID), never by its name; a position is a Kafka offset.

use std::fmt;
use std::str::FromStr;

/// A Kafka offset. Always `>= 0` when it names a record; `-1` appears only as a
/// `fed_up_to` baseline meaning "nothing on this channel has been fed yet".
pub type Position = i64;

/// The highest partition number the wire format can carry (a varint is bounded to 2³¹−1).
pub const MAX_PARTITION: u32 = i32::MAX as u32;

/// A topic's identity: the 16 bytes of the broker's topic UUID, most significant first.
///
/// Ordered as unsigned bytes, lexicographically — the order the wire format sorts groups
/// in. The all-zero ID is never a real topic and is refused by the codec.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TopicId([u8; 16]);

/// Unsigned lexicographic order of the 16 bytes, compared as one big-endian integer: the
/// same order as comparing the bytes one by one, without a `memcmp` call on every
/// comparison (channel lookups in the engine's maps and pasts compare topic IDs per record).
impl Ord for TopicId {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        u128::from_be_bytes(self.0).cmp(&u128::from_be_bytes(other.0))
    }
}

impl PartialOrd for TopicId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl TopicId {
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        TopicId(bytes)
    }

    /// From the two halves Kafka's `Uuid` exposes (most and least significant bits).
    pub const fn from_halves(most: u64, least: u64) -> Self {
        let m = most.to_be_bytes();
        let l = least.to_be_bytes();
        TopicId([m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7], l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7]])
    }

    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Display for TopicId {
    /// The canonical hyphenated lowercase UUID form, e.g. `0b2d1c4e-...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for TopicId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TopicId({self})")
    }
}

/// Why a string is not a topic ID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a topic UUID (expected 32 hex digits, optionally hyphenated 8-4-4-4-12): {0:?}")]
pub struct TopicIdParseError(pub String);

impl FromStr for TopicId {
    type Err = TopicIdParseError;

    /// Accepts the hyphenated UUID form or 32 bare hex digits, either case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || TopicIdParseError(s.to_string());
        let hex: Vec<u8> = if s.len() == 36 {
            let bytes = s.as_bytes();
            for i in [8, 13, 18, 23] {
                if bytes[i] != b'-' {
                    return Err(err());
                }
            }
            bytes.iter().copied().filter(|&b| b != b'-').collect()
        } else {
            s.as_bytes().to_vec()
        };
        if hex.len() != 32 {
            return Err(err());
        }
        let mut out = [0u8; 16];
        for (i, pair) in hex.chunks_exact(2).enumerate() {
            let hi = hex_digit(pair[0]).ok_or_else(err)?;
            let lo = hex_digit(pair[1]).ok_or_else(err)?;
            out[i] = (hi << 4) | lo;
        }
        Ok(TopicId(out))
    }
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// One Kafka topic-partition. Ordered by topic ID (unsigned bytes), then partition: the
/// wire format's order, and the fixed order the engine drains channels in.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChannelId {
    pub topic: TopicId,
    pub partition: u32,
}

impl ChannelId {
    pub const fn new(topic: TopicId, partition: u32) -> Self {
        ChannelId { topic, partition }
    }
}

impl fmt::Display for ChannelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.topic, self.partition)
    }
}

impl fmt::Debug for ChannelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_and_parse_round_trip() {
        let id = TopicId::from_halves(0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210);
        let text = id.to_string();
        assert_eq!(text, "01234567-89ab-cdef-fedc-ba9876543210");
        assert_eq!(text.parse::<TopicId>().unwrap(), id);
        assert_eq!("0123456789ABCDEFFEDCBA9876543210".parse::<TopicId>().unwrap(), id);
    }

    #[test]
    fn parse_refuses_garbage() {
        for bad in [
            "",
            "xyz",
            "01234567-89ab-cdef-fedc-ba987654321",
            "0123456789abcdeffedcba987654321g",
            "01234567089ab-cdef-fedc-ba9876543210",
        ] {
            assert!(bad.parse::<TopicId>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn order_is_unsigned_lexicographic() {
        let low = TopicId::from_bytes([0x7f; 16]);
        let high = TopicId::from_bytes([0x80; 16]);
        assert!(low < high, "a set high bit sorts after, as unsigned bytes do");
        let a = ChannelId::new(low, 9);
        let b = ChannelId::new(high, 0);
        assert!(a < b);
        assert!(ChannelId::new(low, 1) < ChannelId::new(low, 2));
    }

    #[test]
    fn order_agrees_with_the_bytes_compared_one_by_one() {
        let ids: Vec<TopicId> = (0..16)
            .flat_map(|at| [0x00u8, 0x01, 0x7f, 0x80, 0xff].map(|b| (at, b)))
            .map(|(at, b)| {
                let mut bytes = [0x80u8; 16];
                bytes[at] = b;
                TopicId::from_bytes(bytes)
            })
            .collect();
        for a in &ids {
            for b in &ids {
                assert_eq!(a.cmp(b), a.as_bytes().cmp(b.as_bytes()), "{a} against {b}");
            }
        }
    }
}
