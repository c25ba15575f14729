//! The names blocks are stored under ([`KeyLayout`]), and their cluster
//! slots.
//!
//! A name is persistent: what one version of the tier stores, the next must
//! find. The layouts below are fixed; a test pins a name of each.

use serde::{Deserialize, Serialize};

use crate::slot::{PrefixedSlots, SLOTS, crc16, crc16_of_four, key_slot};

/// How a block's key becomes the name of its Redis key
/// ([`RedisConfig::key_layout`](crate::RedisConfig::key_layout)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyLayout {
    /// `<key_prefix><key's bytes>`. A cluster server hashes the whole name
    /// (prefix included; or a `{...}` hash tag in it) into a slot, byte by
    /// byte, for every command.
    Plain,
    /// `<key_prefix>{tttt}<key's bytes>`: `tttt` is the CRC16/XMODEM of the
    /// key's bytes, four bits per character from its high bits down, each
    /// written as the byte `0x40 | bits` (`@`, `A` to `O`). Python:
    /// `bytes(0x40 | (c >> s) & 15 for s in (12, 8, 4, 0))` with
    /// `c = binascii.crc_hqx(key, 0)`. A cluster server hashes the four
    /// characters only (the hash tag), so on a cluster the servers spend
    /// less CPU per key; and the CRC16 of those tags, taken modulo 16,384,
    /// reaches every slot exactly four times in 65,536, so keys spread over
    /// all slots as evenly as their CRC does. The prefix must hold no `{`
    /// (its own tag would be the one hashed).
    Tagged,
}

/// The names of one tier's keys: prefix, layout, and their slots.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    layout: KeyLayout,
    /// The prefix, and the slots of plain names.
    slots: PrefixedSlots,
}

/// Bytes the tagged layout adds to a name: `{`, four characters, `}`.
const TAG_LEN: usize = 6;

impl Names {
    /// Names `prefix` + key under `layout`.
    pub(crate) fn new(prefix: &[u8], layout: KeyLayout) -> Self {
        Self {
            layout,
            slots: PrefixedSlots::new(prefix),
        }
    }

    /// The layout.
    pub(crate) fn layout(&self) -> KeyLayout {
        self.layout
    }

    /// The length of the name of a key of `key_len` bytes.
    #[inline]
    pub(crate) fn len(&self, key_len: usize) -> usize {
        self.slots.prefix().len()
            + key_len
            + match self.layout {
                KeyLayout::Plain => 0,
                KeyLayout::Tagged => TAG_LEN,
            }
    }

    /// Appends the name of `key` to `out`.
    #[inline]
    pub(crate) fn write(&self, out: &mut Vec<u8>, key: &[u8]) {
        out.extend_from_slice(self.slots.prefix());
        self.write_unprefixed(out, key);
    }

    /// The prefix every name starts with.
    #[inline]
    pub(crate) fn prefix(&self) -> &[u8] {
        self.slots.prefix()
    }

    /// Appends the name of `key` without its prefix (the tag, if any, and
    /// the key): [`write`](Self::write) for a caller that wrote the prefix.
    #[inline]
    pub(crate) fn write_unprefixed(&self, out: &mut Vec<u8>, key: &[u8]) {
        self.write_unprefixed_with(out, key, None);
    }

    /// [`write_unprefixed`](Self::write_unprefixed), with the tag's CRC
    /// if [`slot_and_tag`](Self::slot_and_tag) gave it for `key` (not
    /// computed again); `None` computes it where the layout needs one.
    #[inline]
    pub(crate) fn write_unprefixed_with(&self, out: &mut Vec<u8>, key: &[u8], tag: Option<u16>) {
        if self.layout == KeyLayout::Tagged {
            out.extend_from_slice(&tag_of_crc(tag.unwrap_or_else(|| crc16(key))));
        }
        out.extend_from_slice(key);
    }

    /// The name of `key`.
    pub(crate) fn name(&self, key: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len(key.len()));
        self.write(&mut out, key);
        out
    }

    /// The cluster slot of `key`'s name, without building it: always
    /// [`key_slot`] of the name.
    #[cfg(test)]
    pub(crate) fn slot(&self, key: &[u8]) -> u16 {
        self.slot_and_tag(key).0
    }

    /// The cluster slot of `key`'s name, and on the tagged layout (with a
    /// prefix without `{`; else `None`) the CRC its tag is made of, for
    /// [`write_unprefixed_with`](Self::write_unprefixed_with), which must
    /// get it with the same key:
    /// a cluster lookup places each key, then writes its name, and the
    /// key's CRC, computed for both, was a quarter of the lookup worker's
    /// time (perf, `kvbench redis` on a 3-master cluster).
    #[inline]
    pub(crate) fn slot_and_tag(&self, key: &[u8]) -> (u16, Option<u16>) {
        match self.layout {
            KeyLayout::Plain => (self.slots.slot(key), None),
            KeyLayout::Tagged if !self.slots.prefix_has_brace() => {
                let crc = crc16(key);
                let [_, a, b, c, d, _] = tag_of_crc(crc);
                (crc16_of_four([a, b, c, d]) % SLOTS, Some(crc))
            }
            // Refused by the configuration's check; right all the same.
            KeyLayout::Tagged => (key_slot(&self.name(key)), None),
        }
    }
}

/// `{tttt}` of a CRC: four bits a character, high bits first, each the byte
/// `0x40 | bits`. The characters differ from each other in their low four
/// bits only, so the CRC16 of the tags is affine in `crc`: its values
/// modulo 16,384 cover every slot equally (hex digits reach 13,152 of them).
#[inline]
fn tag_of_crc(crc: u16) -> [u8; TAG_LEN] {
    let char = |shift: u32| 0x40 | ((crc >> shift) & 0xf) as u8;
    [b'{', char(12), char(8), char(4), char(0), b'}']
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_pinned() {
        // A change of layout orphans every block stored: these must not move.
        let key = b"\x00\x01block-hash\xff{}";
        let plain = Names::new(b"kvtier:", KeyLayout::Plain);
        assert_eq!(plain.name(key), b"kvtier:\x00\x01block-hash\xff{}");
        let tagged = Names::new(b"kvtier:", KeyLayout::Tagged);
        // CRC16/XMODEM of "123456789" is 0x31c3 (the cluster specification's
        // test vector): 3, 1, 12, 3 are C, A, L, C.
        assert_eq!(tagged.name(b"123456789"), b"kvtier:{CALC}123456789");
        assert_eq!(tagged.name(b""), b"kvtier:{@@@@}");
        assert_eq!(tag_of_crc(0xffff), *b"{OOOO}");
        assert_eq!(tagged.len(9), "kvtier:{CALC}123456789".len());
        assert_eq!(plain.len(9), "kvtier:123456789".len());
    }

    #[test]
    fn the_tags_cover_every_slot_equally() {
        let mut per_slot = vec![0u32; usize::from(SLOTS)];
        for crc in 0..=u16::MAX {
            let tag = tag_of_crc(crc);
            per_slot[usize::from(key_slot(&tag))] += 1;
        }
        let (min, max) = (per_slot.iter().min(), per_slot.iter().max());
        assert_eq!((min, max), (Some(&4), Some(&4)));
    }

    #[test]
    fn tagged_names_spread_evenly_over_masters() {
        // Consecutive ids, big-endian, as kvbench's keys start: the CRC
        // spreads them over the slot ranges of three masters.
        let names = Names::new(b"kvtier:", KeyLayout::Tagged);
        let mut thirds = [0u32; 3];
        let n = 1u64 << 18;
        for id in 0..n {
            let mut key = [0u8; 36];
            key[..8].copy_from_slice(&id.to_be_bytes());
            let slot = u32::from(names.slot(&key));
            thirds[(slot * 3 / u32::from(SLOTS)) as usize] += 1;
        }
        for count in thirds {
            let share = f64::from(count) / n as f64;
            assert!((share - 1.0 / 3.0).abs() < 0.01, "{thirds:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn slots_are_those_of_the_names(
            prefix in proptest::collection::vec(proptest::sample::select(vec![b'a', b'{', b'}', 0, b':']), 0..12),
            key in proptest::collection::vec(proptest::sample::select(vec![b'x', b'{', b'}', 0, 0xff]), 0..40),
        ) {
            for layout in [KeyLayout::Plain, KeyLayout::Tagged] {
                let names = Names::new(&prefix, layout);
                let name = names.name(&key);
                proptest::prop_assert_eq!(name.len(), names.len(key.len()));
                proptest::prop_assert_eq!(names.slot(&key), key_slot(&name));
                // The tag's CRC from placing the key writes the same name.
                let (_, tag) = names.slot_and_tag(&key);
                let mut with = names.prefix().to_vec();
                names.write_unprefixed_with(&mut with, &key, tag);
                proptest::prop_assert_eq!(with, name);
            }
        }
    }
}
