//! Kafka's default key partitioner: murmur2 of the key bytes, made positive, modulo the
//! partition count. The Java client and librdkafka's `murmur2_random` compute the same
//! function; the gateway uses it to find the task that owns a key.

/// Kafka's 32-bit murmur2 (seed `0x9747b28c`), bit for bit as the Java client computes it.
pub fn murmur2(data: &[u8]) -> i32 {
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = 0x9747_b28c ^ (len as u32);
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if tail.len() >= 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if !tail.is_empty() {
        h ^= u32::from(tail[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition Kafka's default partitioner assigns to `key` among `partitions` partitions.
///
/// # Panics
/// If `partitions` is zero (a topic always has at least one partition).
pub fn partition_for_key(key: &[u8], partitions: u32) -> u32 {
    assert!(partitions > 0, "a topic has at least one partition");
    ((murmur2(key) & 0x7fff_ffff) as u32) % partitions
}

#[cfg(test)]
mod tests {
    use super::*;

    // Vectors from the Java client's own unit tests of `Utils.murmur2`.
    #[test]
    fn matches_java_client_vectors() {
        let cases: &[(&[u8], i32)] = &[
            (b"21", -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58_897_971),
            (b"abc", 479_470_107),
        ];
        for (key, expected) in cases {
            assert_eq!(murmur2(key), *expected, "key {:?}", String::from_utf8_lossy(key));
        }
    }

    #[test]
    fn partition_is_positive_modulo() {
        assert_eq!(partition_for_key(b"21", 1), 0);
        let p = partition_for_key(b"foobar", 4);
        assert_eq!(p, ((-790_332_482i32 & 0x7fff_ffff) as u32) % 4);
    }
}
