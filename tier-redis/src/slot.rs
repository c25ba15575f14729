//! Redis Cluster key slots: CRC16 (XMODEM) of the key, or of its hash tag,
//! modulo 16384, as the cluster specification defines.

/// Number of slots of a Redis Cluster.
pub const SLOTS: u16 = 16384;

/// CRC16/XMODEM (polynomial 0x1021, initial value 0), one bit at a time:
/// the definition, against which the fast version is tested.
#[cfg(test)]
fn crc16_bitwise(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// `TABLES[k][b]`: the CRC of byte `b` followed by `k` zero bytes.
///
/// The CRC is linear, so the CRC of 8 bytes is the XOR of each byte's
/// contribution, with the running CRC folded into the first two: eight
/// independent table loads per 8 bytes instead of a chain of eight
/// dependent ones (slicing-by-8). A cluster lookup hashes every key, so this
/// is on the hot path.
static TABLES: [[u16; 256]; 8] = crc_tables();

const fn crc_tables() -> [[u16; 256]; 8] {
    let mut tables = [[0u16; 256]; 8];
    let mut b = 0;
    while b < 256 {
        // One byte from a zero state: eight steps of the bitwise definition.
        let mut crc = (b as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        tables[0][b] = crc;
        b += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut b = 0;
        while b < 256 {
            // One more zero byte after the previous table's value.
            let prev = tables[k - 1][b];
            tables[k][b] = (prev << 8) ^ tables[0][(prev >> 8) as usize];
            b += 1;
        }
        k += 1;
    }
    tables
}

/// CRC16/XMODEM (polynomial 0x1021, initial value 0).
pub(crate) fn crc16(bytes: &[u8]) -> u16 {
    crc16_update(0, bytes)
}

/// CRC16/XMODEM of four bytes: four independent table loads (each byte's
/// contribution, the CRC being linear with a zero initial value) instead
/// of four dependent steps. The slot of a tagged name hashes its
/// four-character tag.
#[inline]
pub(crate) fn crc16_of_four(bytes: [u8; 4]) -> u16 {
    let t = &TABLES;
    t[3][usize::from(bytes[0])]
        ^ t[2][usize::from(bytes[1])]
        ^ t[1][usize::from(bytes[2])]
        ^ t[0][usize::from(bytes[3])]
}

/// Continues a CRC16/XMODEM over more bytes: `crc16_update(crc16(a), b)`
/// is `crc16(a ++ b)`.
fn crc16_update(mut crc: u16, bytes: &[u8]) -> u16 {
    let t = &TABLES;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let [hi, lo] = crc.to_be_bytes();
        crc = t[7][usize::from(c[0] ^ hi)]
            ^ t[6][usize::from(c[1] ^ lo)]
            ^ t[5][usize::from(c[2])]
            ^ t[4][usize::from(c[3])]
            ^ t[3][usize::from(c[4])]
            ^ t[2][usize::from(c[5])]
            ^ t[1][usize::from(c[6])]
            ^ t[0][usize::from(c[7])];
    }
    // The last 2 to 7 bytes the same way (a 36-byte key ends with 4):
    // independent loads, not a chain of dependent ones.
    match chunks.remainder() {
        [] => crc,
        &[b] => (crc << 8) ^ t[0][usize::from((crc >> 8) as u8 ^ b)],
        rest => {
            let [hi, lo] = crc.to_be_bytes();
            let last = rest.len() - 1;
            let mut crc =
                t[last][usize::from(rest[0] ^ hi)] ^ t[last - 1][usize::from(rest[1] ^ lo)];
            for (i, &b) in rest.iter().enumerate().skip(2) {
                crc ^= t[last - i][usize::from(b)];
            }
            crc
        }
    }
}

/// The part of `key` that is hashed: the content of the first `{...}` if it
/// is not empty, else the whole key.
fn hash_tag(key: &[u8]) -> &[u8] {
    if let Some(open) = key.iter().position(|&b| b == b'{')
        && let Some(len) = key[open + 1..].iter().position(|&b| b == b'}')
        && len > 0
    {
        return &key[open + 1..open + 1 + len];
    }
    key
}

/// The Redis Cluster slot (0 to 16383) of the full key name `key`, as
/// `CLUSTER KEYSLOT` answers: CRC16/XMODEM of its hash tag (the content of
/// the first non-empty `{...}`), or of the whole name, modulo 16384.
///
/// The tier routes its own keys; this is for callers that group names by
/// master themselves (kvbench's raw-client baseline). Pass the name as
/// stored, `key_prefix` included.
pub fn key_slot(key: &[u8]) -> u16 {
    crc16(hash_tag(key)) % SLOTS
}

/// Slots of keys that all start with one prefix, without building each
/// name: the prefix's CRC is computed once and continued over the key.
#[derive(Debug, Clone)]
pub struct PrefixedSlots {
    prefix: Vec<u8>,
    /// The CRC of the prefix, when the prefix holds no `{` (so any hash
    /// tag lies wholly in the key); `None` otherwise.
    prefix_crc: Option<u16>,
}

impl PrefixedSlots {
    /// For names `prefix` + key.
    pub fn new(prefix: &[u8]) -> Self {
        Self {
            prefix: prefix.to_vec(),
            prefix_crc: (!prefix.contains(&b'{')).then(|| crc16(prefix)),
        }
    }

    /// The prefix.
    pub(crate) fn prefix(&self) -> &[u8] {
        &self.prefix
    }

    /// Whether the prefix holds a `{` (a hash tag there may decide every
    /// name's slot).
    pub(crate) fn prefix_has_brace(&self) -> bool {
        self.prefix_crc.is_none()
    }

    /// The slot of the name `prefix` + `key`; always `key_slot` of it.
    pub fn slot(&self, key: &[u8]) -> u16 {
        let Some(prefix_crc) = self.prefix_crc else {
            let mut name = Vec::with_capacity(self.prefix.len() + key.len());
            name.extend_from_slice(&self.prefix);
            name.extend_from_slice(key);
            return key_slot(&name);
        };
        let tag = hash_tag(key);
        if tag.len() < key.len() {
            // A tag inside the key: only it is hashed.
            crc16(tag) % SLOTS
        } else {
            crc16_update(prefix_crc, key) % SLOTS
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn prefixed_slots_match_the_whole_name(
            prefix in proptest::collection::vec(proptest::sample::select(vec![b'a', b'{', b'}', 0, b':']), 0..12),
            key in proptest::collection::vec(proptest::sample::select(vec![b'x', b'{', b'}', 0, 0xff]), 0..40),
        ) {
            let mut name = prefix.clone();
            name.extend_from_slice(&key);
            proptest::prop_assert_eq!(PrefixedSlots::new(&prefix).slot(&key), key_slot(&name));
        }

        #[test]
        fn crc_of_four_bytes_matches_the_definition(bytes in proptest::array::uniform4(proptest::num::u8::ANY)) {
            proptest::prop_assert_eq!(crc16_of_four(bytes), crc16_bitwise(&bytes));
        }

        #[test]
        fn fast_crc_matches_the_definition(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..100)) {
            proptest::prop_assert_eq!(crc16(&bytes), crc16_bitwise(&bytes));
        }
    }

    #[test]
    fn matches_the_specification() {
        // Test vector of the cluster specification: CRC16("123456789") = 0x31C3.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(crc16_bitwise(b"123456789"), 0x31C3);
        // Values from CLUSTER KEYSLOT on a real server.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_eq!(hash_tag(b"foo{}{bar}"), b"foo{}{bar}");
        assert_eq!(hash_tag(b"foo{{bar}}zap"), b"{bar");
    }
}
