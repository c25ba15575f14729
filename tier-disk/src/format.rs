//! The on-disk formats: index header, index slot, segment record.
//!
//! Everything is little-endian. Every parser takes untrusted bytes and
//! returns a typed error; none panics (the proptests below feed them
//! arbitrary bytes).
//!
//! ```text
//! index file  = header (4096 bytes) + slot_count × slot
//! header      = magic "KVTIERIX" | version u32 | header_size u32 | key_len u32
//!               | slot_size u32 | slot_count u64 | created_unix u64 | reserved
//!               | header_crc u32 at byte 60 (crc32 of bytes 0..60)
//!               | counters at 512: clean u32, pad u32, len u64, used u64 (no crc:
//!                 recounted after an unclean shutdown)
//! slot        = tag u32 (0 empty, 1 live, 2 tombstone) | slot_crc u32
//!               | segment u64 | offset u64 | payload_len u32 | payload_crc u32
//!               | record_len u32 | reserved u32 | key (key_len) | padding to 8
//!               slot_crc = crc32(tag, bytes 8..slot_size)
//! segment     = record*
//! record      = magic "KVR1" u32 | header_crc u32 | kind u32 (0 put, 1 remove)
//!               | key_len u32 | payload_len u32 | payload_crc u32 | reserved u64
//!               | key | payload | padding to 8
//!               header_crc = crc32(bytes 8..32, key)
//! ```

use crate::error::FormatError;

/// Magic of the index file.
pub const INDEX_MAGIC: [u8; 8] = *b"KVTIERIX";
/// The index format this build reads and writes.
pub const INDEX_VERSION: u32 = 1;
/// Bytes before the first slot.
pub const HEADER_SIZE: usize = 4096;
/// Where the unchecksummed counters start in the header.
pub const COUNTERS_AT: usize = 512;
/// Magic of a segment record.
pub const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"KVR1");
/// Bytes of a record before its key.
pub const RECORD_HEADER_SIZE: usize = 32;
/// Bytes of a slot before its key.
pub const SLOT_HEADER_SIZE: usize = 40;
/// Longest key the formats accept.
pub const MAX_KEY_LEN: usize = 1024;

/// Slot tags.
pub const TAG_EMPTY: u32 = 0;
/// A slot holding a key.
pub const TAG_LIVE: u32 = 1;
/// A slot whose key was removed (keeps probe chains intact).
pub const TAG_TOMBSTONE: u32 = 2;

/// Record kinds.
pub const KIND_PUT: u32 = 0;
/// A record that removes its key.
pub const KIND_REMOVE: u32 = 1;

fn u32_at(b: &[u8], at: usize) -> Result<u32, FormatError> {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or(FormatError::Truncated {
            need: at + 4,
            got: b.len(),
        })
}

fn u64_at(b: &[u8], at: usize) -> Result<u64, FormatError> {
    b.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .map(u64::from_le_bytes)
        .ok_or(FormatError::Truncated {
            need: at + 8,
            got: b.len(),
        })
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Rounds `n` up to a multiple of 8.
pub const fn align8(n: usize) -> usize {
    (n + 7) & !7
}

/// Bytes of one slot for keys of `key_len` bytes.
pub const fn slot_size(key_len: usize) -> usize {
    align8(SLOT_HEADER_SIZE + key_len)
}

/// Bytes of one record on disk.
pub const fn record_size(key_len: usize, payload_len: usize) -> usize {
    align8(RECORD_HEADER_SIZE + key_len + payload_len)
}

/// A hash of key bytes that never changes between builds or processes (the
/// slot position depends on it). Keys are usually content hashes already;
/// this still mixes every byte so structured keys spread well.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = 0x243F_6A88_85A3_08D3u64 ^ (bytes.len() as u64).wrapping_mul(K);
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        h = (h ^ u64::from_le_bytes(word)).wrapping_mul(K);
        h ^= h >> 29;
    }
    let mut tail = [0u8; 8];
    tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    h = (h ^ u64::from_le_bytes(tail)).wrapping_mul(K);
    // SplitMix64 finalizer.
    h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

/// The immutable part of the index header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexHeader {
    /// Key length of every slot.
    pub key_len: u32,
    /// Number of slots (a power of two).
    pub slot_count: u64,
    /// When the file was created (seconds since the Unix epoch).
    pub created_unix: u64,
}

impl IndexHeader {
    /// Bytes of one slot.
    pub fn slot_size(&self) -> usize {
        slot_size(self.key_len as usize)
    }

    /// Total file size.
    pub fn file_size(&self) -> Option<u64> {
        (self.slot_size() as u64)
            .checked_mul(self.slot_count)?
            .checked_add(HEADER_SIZE as u64)
    }

    /// Writes the header into `buf` (at least [`HEADER_SIZE`] bytes).
    pub fn encode(&self, buf: &mut [u8]) {
        buf[..COUNTERS_AT].fill(0);
        buf[0..8].copy_from_slice(&INDEX_MAGIC);
        put_u32(buf, 8, INDEX_VERSION);
        put_u32(buf, 12, HEADER_SIZE as u32);
        put_u32(buf, 16, self.key_len);
        put_u32(buf, 20, self.slot_size() as u32);
        put_u64(buf, 24, self.slot_count);
        put_u64(buf, 32, self.created_unix);
        let crc = crc32fast::hash(&buf[0..60]);
        put_u32(buf, 60, crc);
    }

    /// Parses and checks a header.
    ///
    /// # Errors
    /// A [`FormatError`] naming what is wrong: short input, magic, version,
    /// checksum, or geometry.
    pub fn parse(buf: &[u8]) -> Result<Self, FormatError> {
        if buf.len() < HEADER_SIZE {
            return Err(FormatError::Truncated {
                need: HEADER_SIZE,
                got: buf.len(),
            });
        }
        if buf[0..8] != INDEX_MAGIC {
            return Err(FormatError::BadMagic);
        }
        let version = u32_at(buf, 8)?;
        if version != INDEX_VERSION {
            return Err(FormatError::Version {
                found: version,
                supported: INDEX_VERSION,
            });
        }
        let crc = u32_at(buf, 60)?;
        if crc != crc32fast::hash(&buf[0..60]) {
            return Err(FormatError::Checksum {
                what: "index header",
            });
        }
        let header_size = u32_at(buf, 12)?;
        let key_len = u32_at(buf, 16)?;
        let slot = u32_at(buf, 20)?;
        let slot_count = u64_at(buf, 24)?;
        let created_unix = u64_at(buf, 32)?;
        if header_size as usize != HEADER_SIZE
            || key_len == 0
            || key_len as usize > MAX_KEY_LEN
            || slot as usize != slot_size(key_len as usize)
            || !slot_count.is_power_of_two()
        {
            return Err(FormatError::Geometry);
        }
        let header = Self {
            key_len,
            slot_count,
            created_unix,
        };
        if header.file_size().is_none() {
            return Err(FormatError::Geometry);
        }
        Ok(header)
    }
}

/// The counters after the header: not checksummed, recounted when `clean` is 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// 1 when the file was closed cleanly.
    pub clean: u32,
    /// Live keys.
    pub len: u64,
    /// Slots not empty (live or tombstone).
    pub used: u64,
}

impl Counters {
    /// Reads the counters (any bytes are accepted; they are checked by use).
    ///
    /// # Errors
    /// [`FormatError::Truncated`] if `buf` is shorter than the header.
    pub fn parse(buf: &[u8]) -> Result<Self, FormatError> {
        Ok(Self {
            clean: u32_at(buf, COUNTERS_AT)?,
            len: u64_at(buf, COUNTERS_AT + 8)?,
            used: u64_at(buf, COUNTERS_AT + 16)?,
        })
    }

    /// Writes the counters.
    pub fn encode(&self, buf: &mut [u8]) {
        put_u32(buf, COUNTERS_AT, self.clean);
        put_u32(buf, COUNTERS_AT + 4, 0);
        put_u64(buf, COUNTERS_AT + 8, self.len);
        put_u64(buf, COUNTERS_AT + 16, self.used);
    }
}

/// Where a key's payload lives, as stored in a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Segment id.
    pub segment: u64,
    /// Offset of the record in the segment.
    pub offset: u64,
    /// Payload bytes.
    pub payload_len: u32,
    /// crc32 of the payload.
    pub payload_crc: u32,
    /// Bytes of the whole record.
    pub record_len: u32,
}

/// A slot as read from the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot<'a> {
    /// Never used: ends a probe chain.
    Empty,
    /// Removed: probing continues past it.
    Tombstone,
    /// A key and where its payload lives; `valid` is false when the slot's
    /// checksum does not match (a torn write): treat it as a tombstone.
    Live {
        /// The stored key.
        key: &'a [u8],
        /// Where the payload lives.
        location: Location,
    },
    /// Bytes that are no valid slot (unknown tag or checksum mismatch).
    Invalid,
}

/// Parses one slot of `slot_size(key_len)` bytes.
pub fn parse_slot(buf: &[u8], key_len: usize) -> Slot<'_> {
    let size = slot_size(key_len);
    if buf.len() < size {
        return Slot::Invalid;
    }
    let (Ok(tag), Ok(crc)) = (u32_at(buf, 0), u32_at(buf, 4)) else {
        return Slot::Invalid;
    };
    match tag {
        TAG_EMPTY => Slot::Empty,
        TAG_TOMBSTONE => Slot::Tombstone,
        TAG_LIVE => {
            if crc != slot_crc(tag, &buf[8..size]) {
                return Slot::Invalid;
            }
            let fields = (
                u64_at(buf, 8),
                u64_at(buf, 16),
                u32_at(buf, 24),
                u32_at(buf, 28),
                u32_at(buf, 32),
            );
            let (Ok(segment), Ok(offset), Ok(payload_len), Ok(payload_crc), Ok(record_len)) =
                fields
            else {
                return Slot::Invalid;
            };
            Slot::Live {
                key: &buf[SLOT_HEADER_SIZE..SLOT_HEADER_SIZE + key_len],
                location: Location {
                    segment,
                    offset,
                    payload_len,
                    payload_crc,
                    record_len,
                },
            }
        }
        _ => Slot::Invalid,
    }
}

/// The key bytes of a live slot, without checking its checksum (the
/// caller checks it only when the key matches).
pub fn slot_tag_and_key(buf: &[u8], key_len: usize) -> Option<(u32, &[u8])> {
    let tag = u32_at(buf, 0).ok()?;
    Some((tag, buf.get(SLOT_HEADER_SIZE..SLOT_HEADER_SIZE + key_len)?))
}

/// crc32 of [`TAG_LIVE`]'s 4 bytes: where a live slot's checksum starts
/// (saves hashing the tag on every hit; a test checks the value).
const LIVE_TAG_CRC: u32 = 0x99F8_B879;

fn slot_crc(tag: u32, body: &[u8]) -> u32 {
    let tag_crc = if tag == TAG_LIVE {
        LIVE_TAG_CRC
    } else {
        crc32fast::hash(&tag.to_le_bytes())
    };
    // crc32(tag ++ body), continued from the tag's crc.
    let mut h = crc32fast::Hasher::new_with_initial(tag_crc);
    h.update(body);
    h.finalize()
}

/// Writes a live slot into `buf` (exactly `slot_size(key.len())` bytes).
pub fn encode_live_slot(buf: &mut [u8], key: &[u8], location: &Location) {
    let size = slot_size(key.len());
    let buf = &mut buf[..size];
    put_u64(buf, 8, location.segment);
    put_u64(buf, 16, location.offset);
    put_u32(buf, 24, location.payload_len);
    put_u32(buf, 28, location.payload_crc);
    put_u32(buf, 32, location.record_len);
    put_u32(buf, 36, 0);
    buf[SLOT_HEADER_SIZE..SLOT_HEADER_SIZE + key.len()].copy_from_slice(key);
    buf[SLOT_HEADER_SIZE + key.len()..].fill(0);
    let crc = slot_crc(TAG_LIVE, &buf[8..]);
    put_u32(buf, 4, crc);
    // The tag last: a slot torn before this point is still empty or keeps
    // its old tag with a checksum that no longer matches.
    put_u32(buf, 0, TAG_LIVE);
}

/// Marks a slot removed.
pub fn encode_tombstone(buf: &mut [u8]) {
    put_u32(buf, 0, TAG_TOMBSTONE);
}

/// A parsed record header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// [`KIND_PUT`] or [`KIND_REMOVE`].
    pub kind: u32,
    /// Key bytes after the header.
    pub key_len: u32,
    /// Payload bytes after the key.
    pub payload_len: u32,
    /// crc32 of the payload.
    pub payload_crc: u32,
}

impl RecordHeader {
    /// Bytes of the whole record, padding included.
    pub fn record_len(&self) -> usize {
        record_size(self.key_len as usize, self.payload_len as usize)
    }
}

/// Encodes a record (header, key, payload, padding) for `key` and `payload`.
pub fn encode_record(kind: u32, key: &[u8], payload: &[u8]) -> Vec<u8> {
    let len = record_size(key.len(), payload.len());
    let mut buf = vec![0u8; len];
    let at = RECORD_HEADER_SIZE + key.len();
    encode_record_head(
        &mut buf[..at],
        kind,
        key,
        payload.len() as u32,
        crc32fast::hash(payload),
    );
    buf[at..at + payload.len()].copy_from_slice(payload);
    buf
}

/// Encodes the head of a record (its header and key) into `buf`, exactly
/// `RECORD_HEADER_SIZE + key.len()` bytes: what precedes a payload of
/// `payload_len` bytes whose crc32 is `payload_crc`. The payload and
/// [`RECORD_PADDING`] bytes up to [`record_size`] follow it on disk.
pub fn encode_record_head(
    buf: &mut [u8],
    kind: u32,
    key: &[u8],
    payload_len: u32,
    payload_crc: u32,
) {
    put_u32(buf, 0, RECORD_MAGIC);
    put_u32(buf, 8, kind);
    put_u32(buf, 12, key.len() as u32);
    put_u32(buf, 16, payload_len);
    put_u32(buf, 20, payload_crc);
    put_u64(buf, 24, 0);
    buf[RECORD_HEADER_SIZE..RECORD_HEADER_SIZE + key.len()].copy_from_slice(key);
    let crc = record_header_crc(&buf[8..RECORD_HEADER_SIZE], key);
    put_u32(buf, 4, crc);
}

/// The zero bytes that pad a record to a multiple of 8.
pub const RECORD_PADDING: [u8; 8] = [0; 8];

fn record_header_crc(fields: &[u8], key: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(fields);
    h.update(key);
    h.finalize()
}

/// Parses a record header followed by its key; `buf` starts at the record.
///
/// # Errors
/// [`FormatError`] for short input, a wrong magic, an unknown kind, a key
/// longer than [`MAX_KEY_LEN`] or a header checksum mismatch.
pub fn parse_record_header(buf: &[u8]) -> Result<(RecordHeader, &[u8]), FormatError> {
    if u32_at(buf, 0)? != RECORD_MAGIC {
        return Err(FormatError::BadMagic);
    }
    let crc = u32_at(buf, 4)?;
    let header = RecordHeader {
        kind: u32_at(buf, 8)?,
        key_len: u32_at(buf, 12)?,
        payload_len: u32_at(buf, 16)?,
        payload_crc: u32_at(buf, 20)?,
    };
    if header.kind > KIND_REMOVE || header.key_len == 0 || header.key_len as usize > MAX_KEY_LEN {
        return Err(FormatError::Geometry);
    }
    let key_end = RECORD_HEADER_SIZE + header.key_len as usize;
    let key = buf
        .get(RECORD_HEADER_SIZE..key_end)
        .ok_or(FormatError::Truncated {
            need: key_end,
            got: buf.len(),
        })?;
    if crc != record_header_crc(&buf[8..RECORD_HEADER_SIZE], key) {
        return Err(FormatError::Checksum {
            what: "record header",
        });
    }
    Ok((header, key))
}

/// Checks a whole record (header, key and payload) and returns its payload.
///
/// # Errors
/// As [`parse_record_header`], plus a payload checksum mismatch or a short payload.
pub fn parse_record(buf: &[u8]) -> Result<(RecordHeader, &[u8], &[u8]), FormatError> {
    let (header, key) = parse_record_header(buf)?;
    let start = RECORD_HEADER_SIZE + header.key_len as usize;
    let end = start + header.payload_len as usize;
    let payload = buf.get(start..end).ok_or(FormatError::Truncated {
        need: end,
        got: buf.len(),
    })?;
    if crc32fast::hash(payload) != header.payload_crc {
        return Err(FormatError::Checksum { what: "payload" });
    }
    Ok((header, key, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_crc_is_the_crc_of_tag_then_body() {
        assert_eq!(LIVE_TAG_CRC, crc32fast::hash(&TAG_LIVE.to_le_bytes()));
        let body: Vec<u8> = (0..72u8).collect();
        for tag in [TAG_EMPTY, TAG_LIVE, TAG_TOMBSTONE, 7] {
            let mut whole = tag.to_le_bytes().to_vec();
            whole.extend_from_slice(&body);
            assert_eq!(slot_crc(tag, &body), crc32fast::hash(&whole), "tag {tag}");
        }
    }

    #[test]
    fn a_record_written_in_pieces_is_the_encoded_record() {
        let key = [7u8; 36];
        for len in [0usize, 1, 5, 100, 4099] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 31) as u8).collect();
            let mut pieces = vec![0u8; RECORD_HEADER_SIZE + key.len()];
            encode_record_head(
                &mut pieces,
                KIND_PUT,
                &key,
                len as u32,
                crc32fast::hash(&payload),
            );
            pieces.extend_from_slice(&payload);
            let pad = record_size(key.len(), len) - pieces.len();
            pieces.extend_from_slice(&RECORD_PADDING[..pad]);
            assert_eq!(
                pieces,
                encode_record(KIND_PUT, &key, &payload),
                "payload of {len}"
            );
        }
    }

    /// `tests/common` writes damage at these offsets of the format
    /// (version 1): they must not move without a new format version.
    #[test]
    fn the_layout_the_integration_tests_rely_on() {
        assert_eq!(COUNTERS_AT, 512);
        assert_eq!(RECORD_HEADER_SIZE, 32);
        assert_eq!(record_size(36, 100), 168);
        assert_eq!(record_size(36, 1), 72);
    }
}

/// Fuzzing the parsers with proptest: arbitrary bytes never panic, and
/// every encoded value parses back to itself. (cargo-fuzz targets would
/// need a nightly toolchain, which this project's CI does not have; this
/// runs a bounded number of cases on stable in every CI run.)
#[cfg(test)]
mod proptests {
    use super::*;
    use crate::format;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn parsers_never_panic_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..6000), key_len in 1usize..80) {
            let _ = IndexHeader::parse(&bytes);
            let _ = Counters::parse(&bytes);
            let _ = parse_slot(&bytes, key_len);
            let _ = format::slot_tag_and_key(&bytes, key_len);
            let _ = parse_record_header(&bytes);
            let _ = parse_record(&bytes);
            let _ = format::stable_hash(&bytes);
        }

        #[test]
        fn a_valid_header_with_one_flipped_bit_is_rejected_or_equal(key_len in 1u32..200, shift in 4u32..30, bit in 0usize..(64 * 8)) {
            let header = IndexHeader { key_len, slot_count: 1 << shift, created_unix: 1_700_000_000 };
            let mut buf = vec![0u8; HEADER_SIZE];
            header.encode(&mut buf);
            prop_assert_eq!(IndexHeader::parse(&buf), Ok(header));
            buf[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(IndexHeader::parse(&buf).is_err());
        }

        #[test]
        fn slots_round_trip_and_detect_any_flipped_bit(key in proptest::collection::vec(any::<u8>(), 1..64), segment: u64, offset: u64, len: u32, crc: u32, bit in 8usize..(40 * 8)) {
            let location = Location { segment, offset, payload_len: len, payload_crc: crc, record_len: len / 2 };
            let mut buf = vec![0u8; format::slot_size(key.len())];
            encode_live_slot(&mut buf, &key, &location);
            prop_assert_eq!(parse_slot(&buf, key.len()), Slot::Live { key: &key, location });
            buf[bit / 8] ^= 1 << (bit % 8);
            let still_live = matches!(parse_slot(&buf, key.len()), Slot::Live { .. });
            prop_assert!(!still_live, "a flipped bit went unnoticed");
        }

        #[test]
        fn records_round_trip_and_detect_any_flipped_bit(key in proptest::collection::vec(any::<u8>(), 1..64), payload in proptest::collection::vec(any::<u8>(), 0..300), bit: usize) {
            let record = encode_record(format::KIND_PUT, &key, &payload);
            let (header, k, p) = parse_record(&record).unwrap();
            prop_assert_eq!(header.record_len(), record.len());
            prop_assert_eq!(k, &key[..]);
            prop_assert_eq!(p, &payload[..]);
            let meaningful = format::RECORD_HEADER_SIZE + key.len() + payload.len();
            let mut damaged = record.clone();
            let at = bit % (meaningful * 8);
            damaged[at / 8] ^= 1 << (at % 8);
            prop_assert!(parse_record(&damaged).is_err());
        }
    }
}
