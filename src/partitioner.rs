//! Key partitioners: the function a producer uses to place a keyed record on a partition.
//!
//! A model's tasks are its partitions, so a key belongs to a task only if every producer of
//! its topics places the key by the same function. Two are in use:
//!
//! - [`Partitioner::Murmur2`]: murmur2 of the key bytes, made positive, modulo the partition
//!   count — the Java client's default, librdkafka's `murmur2_random`, franz-go's default
//!   ([`crate::murmur2`]).
//! - [`Partitioner::Crc32`]: CRC-32 (IEEE 802.3, as zlib and librdkafka's `rd_crc32`) of the
//!   key bytes modulo the partition count — librdkafka's `consistent` and
//!   `consistent_random` (the default of the C, Python, Go and .NET clients built on it). An
//!   empty key is placed at random by `consistent_random`, so it belongs to no partition.
//!
//! [`Partitioner::None`] says a topic's key is not the document key: its records are placed
//! as the producer likes, and no key of it is routed to one task.

use std::fmt;

/// How the producers of a topic place keyed records on partitions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Partitioner {
    /// Kafka's default: murmur2 of the key bytes (Java client, librdkafka `murmur2_random`).
    #[default]
    Murmur2,
    /// librdkafka's `consistent` / `consistent_random`: CRC-32 of the key bytes.
    Crc32,
    /// The key is not the document key: no placement is assumed or checked.
    None,
}

impl Partitioner {
    /// Every partitioner, in the order configuration lists them.
    pub const ALL: [Partitioner; 3] = [Partitioner::Murmur2, Partitioner::Crc32, Partitioner::None];

    /// The name configuration spells it with.
    pub fn as_str(self) -> &'static str {
        match self {
            Partitioner::Murmur2 => "murmur2",
            Partitioner::Crc32 => "crc32",
            Partitioner::None => "none",
        }
    }

    /// The partitioner named `name` (exactly as configuration spells it).
    pub fn parse(name: &str) -> Option<Partitioner> {
        Partitioner::ALL.into_iter().find(|p| p.as_str() == name)
    }

    /// `"murmur2", "crc32" or "none"`: the choices, for messages refusing another name.
    pub fn choices() -> String {
        let names: Vec<String> = Partitioner::ALL.iter().map(|p| format!("{:?}", p.as_str())).collect();
        let (last, rest) = names.split_last().expect("there are partitioners");
        format!("{} or {last}", rest.join(", "))
    }

    /// Whether keys are placed by a function of their bytes (everything but `none`).
    pub fn routes_keys(self) -> bool {
        self != Partitioner::None
    }

    /// The partition this partitioner places `key` on among `partitions`; `None` when it
    /// places no key (`none`), or places this one at random (an empty key under `crc32`).
    ///
    /// # Panics
    /// If `partitions` is zero (a topic always has at least one partition).
    pub fn partition_for_key(self, key: &[u8], partitions: u32) -> Option<u32> {
        assert!(partitions > 0, "a topic has at least one partition");
        match self {
            Partitioner::Murmur2 => Some(crate::murmur2::partition_for_key(key, partitions)),
            Partitioner::Crc32 if key.is_empty() => None,
            Partitioner::Crc32 => Some(crc32(key) % partitions),
            Partitioner::None => None,
        }
    }
}

impl fmt::Display for Partitioner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// CRC-32 as zlib, IEEE 802.3 and librdkafka's `rd_crc32` compute it: reflected polynomial
/// `0xEDB88320`, initial value and final XOR `0xFFFFFFFF`.
pub fn crc32(data: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &byte in data {
        crc = CRC32_TABLE[((crc ^ u32::from(byte)) & 0xFF) as usize] ^ (crc >> 8);
    }
    crc ^ 0xFFFF_FFFF
}

/// The byte-wise table of [`crc32`], computed at compile time.
const CRC32_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut bit = 0;
        while bit < 8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
            bit += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    /// The standard check values of CRC-32/ISO-HDLC (zlib's `crc32`, Python's
    /// `zlib.crc32`, Go's `crc32.ChecksumIEEE`).
    #[test]
    fn crc32_matches_known_vectors() {
        let cases: &[(&[u8], u32)] = &[
            (b"", 0),
            (b"a", 0xE8B7_BE43),
            (b"abc", 0x3524_41C2),
            (b"123456789", 0xCBF4_3926),
            (b"message digest", 0x2015_9D7F),
            (b"abcdefghijklmnopqrstuvwxyz", 0x4C27_50BD),
            (b"The quick brown fox jumps over the lazy dog", 0x414F_A339),
        ];
        for (data, expected) in cases {
            assert_eq!(crc32(data), *expected, "{:?}", String::from_utf8_lossy(data));
        }
    }

    #[test]
    fn crc32_places_keys_unsigned_modulo() {
        // 0xCBF43926 is above i32::MAX: the modulo is of the unsigned value, as librdkafka's.
        assert_eq!(Partitioner::Crc32.partition_for_key(b"123456789", 7), Some(0xCBF4_3926 % 7));
        assert_eq!(Partitioner::Crc32.partition_for_key(b"123456789", 1), Some(0));
        assert_eq!(Partitioner::Crc32.partition_for_key(b"", 4), None, "an empty key goes anywhere");
    }

    #[test]
    fn murmur2_is_the_default_and_kafkas() {
        assert_eq!(Partitioner::default(), Partitioner::Murmur2);
        for key in [&b"foobar"[..], b"", b"o-17"] {
            assert_eq!(
                Partitioner::Murmur2.partition_for_key(key, 6),
                Some(crate::murmur2::partition_for_key(key, 6)),
                "an empty key is a key for murmur2"
            );
        }
        assert_eq!(Partitioner::None.partition_for_key(b"foobar", 6), None);
    }

    #[test]
    fn names_round_trip() {
        for p in Partitioner::ALL {
            assert_eq!(Partitioner::parse(p.as_str()), Some(p));
        }
        assert_eq!(Partitioner::parse("consistent_random"), None);
        assert_eq!(Partitioner::choices(), r#""murmur2", "crc32" or "none""#);
    }

    /// The two partitioners disagree on most keys: the failure this setting exists for.
    #[test]
    fn the_partitioners_disagree() {
        let keys: Vec<String> = (0..100).map(|i| format!("o-{i}")).collect();
        let differ = keys
            .iter()
            .filter(|k| {
                Partitioner::Murmur2.partition_for_key(k.as_bytes(), 4)
                    != Partitioner::Crc32.partition_for_key(k.as_bytes(), 4)
            })
            .count();
        assert!(differ > 50, "{differ} of 100 keys differ");
    }
}
