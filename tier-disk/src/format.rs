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
//!               | record_len u32 | gap u32 | key (key_len) | padding to 8
//!               slot_crc = crc32(tag, bytes 8..slot_size)
//! segment     = record*
//! record      = magic "KVR2" u32 | header_crc u32 | kind u32 (0 put, 1 remove)
//!               | key_len u32 | payload_len u32 | payload_crc u32 | gap u32
//!               | reserved u32 | key | gap zero bytes | payload | padding to 8
//!               header_crc = crc32(bytes 8..32, key)
//! ```
//!
//! # Versions
//!
//! - **Index version 2, records "KVR2"** (this build writes them): a put's
//!   payload starts at a multiple of [`PAYLOAD_ALIGN`] bytes in its segment
//!   (the `gap` zero bytes after the key put it there), so the kernel's
//!   copies between the page cache and a caller's page-aligned rows run
//!   aligned on both sides (measured: about 25% faster than a payload 4
//!   bytes off a cache line). The slot's `gap` is the record's.
//! - **Index version 1, records "KVR1"** (earlier builds): no gap (the
//!   slot's `gap` and the record's bytes 24..32 were zero). This build reads
//!   both: a version-1 index is rewritten as version 2 when it is opened
//!   (its slots are valid as they are), and its "KVR1" records are read
//!   with the gap their bytes 24..28 hold, zero (one rule for both magics:
//!   the magic is outside the header checksum, and a damaged one must not
//!   change where a rebuild finds the next record). Earlier builds refuse
//!   a version-2 index ([`FormatError::Version`]) instead of misreading a
//!   gap. So opening a version-1 directory with this build is one-way: its
//!   index is upgraded at open. An earlier build that must rebuild a lost
//!   index over version-2 segments stops at the first "KVR2" record of
//!   each and drops what follows: it serves no wrong bytes, but loses
//!   those blocks.

use crate::error::FormatError;

/// Magic of the index file.
pub const INDEX_MAGIC: [u8; 8] = *b"KVTIERIX";
/// The index format this build writes.
pub const INDEX_VERSION: u32 = 2;
/// The oldest index format this build reads (and upgrades when it opens it).
pub const INDEX_VERSION_MIN: u32 = 1;
/// Bytes before the first slot.
pub const HEADER_SIZE: usize = 4096;
/// Where the unchecksummed counters start in the header.
pub const COUNTERS_AT: usize = 512;
/// Magic of a segment record this build writes (version 2: with a gap).
pub const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"KVR2");
/// Magic of a version-1 record (no gap), still read.
pub const RECORD_MAGIC_V1: u32 = u32::from_le_bytes(*b"KVR1");
/// A put's payload starts at a multiple of this many bytes in its segment.
pub const PAYLOAD_ALIGN: usize = 64;
/// The largest gap a record may declare: room for an alignment of up to
/// 4 KiB (a later build may align to pages; this one reads that too).
pub const MAX_GAP: usize = 4095;
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

/// Bytes of one record on disk: its head, `gap` zero bytes, its payload
/// and the padding to 8.
pub const fn record_size(key_len: usize, gap: usize, payload_len: usize) -> usize {
    align8(RECORD_HEADER_SIZE + key_len + gap + payload_len)
}

/// The gap a put written at `offset` of its segment leaves between its key
/// and its payload: the payload then starts at a multiple of
/// [`PAYLOAD_ALIGN`].
pub const fn payload_gap(offset: u64, key_len: usize) -> usize {
    let head_end = (offset % PAYLOAD_ALIGN as u64) as usize + RECORD_HEADER_SIZE + key_len;
    (PAYLOAD_ALIGN - head_end % PAYLOAD_ALIGN) % PAYLOAD_ALIGN
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
    /// The format version the file was written with
    /// ([`INDEX_VERSION_MIN`]..=[`INDEX_VERSION`]); [`encode`](Self::encode)
    /// always writes [`INDEX_VERSION`].
    pub version: u32,
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
        if !(INDEX_VERSION_MIN..=INDEX_VERSION).contains(&version) {
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
            version,
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
    /// Zero bytes between the record's key and its payload.
    pub gap: u32,
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
                u32_at(buf, 36),
            );
            let (
                Ok(segment),
                Ok(offset),
                Ok(payload_len),
                Ok(payload_crc),
                Ok(record_len),
                Ok(gap),
            ) = fields
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
                    gap,
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
    put_u32(buf, 36, location.gap);
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
    /// Zero bytes between the key and the payload (0 in a version-1
    /// record).
    pub gap: u32,
}

impl RecordHeader {
    /// Bytes of the whole record, gap and padding included.
    pub fn record_len(&self) -> usize {
        record_size(
            self.key_len as usize,
            self.gap as usize,
            self.payload_len as usize,
        )
    }

    /// Where the payload starts, from the start of the record.
    pub fn payload_start(&self) -> usize {
        RECORD_HEADER_SIZE + self.key_len as usize + self.gap as usize
    }
}

/// Encodes a record (header, key, `gap` zero bytes, payload, padding) for
/// `key` and `payload`.
pub fn encode_record(kind: u32, key: &[u8], gap: usize, payload: &[u8]) -> Vec<u8> {
    let len = record_size(key.len(), gap, payload.len());
    let mut buf = vec![0u8; len];
    let at = RECORD_HEADER_SIZE + key.len();
    encode_record_head(
        &mut buf[..at],
        kind,
        key,
        gap as u32,
        payload.len() as u32,
        crc32fast::hash(payload),
    );
    buf[at + gap..at + gap + payload.len()].copy_from_slice(payload);
    buf
}

/// Encodes the head of a record (its header and key) into `buf`, exactly
/// `RECORD_HEADER_SIZE + key.len()` bytes: what precedes `gap` zero bytes
/// ([`GAP_ZEROS`]) and a payload of `payload_len` bytes whose crc32 is
/// `payload_crc`. The payload and [`RECORD_PADDING`] bytes up to
/// [`record_size`] follow it on disk.
pub fn encode_record_head(
    buf: &mut [u8],
    kind: u32,
    key: &[u8],
    gap: u32,
    payload_len: u32,
    payload_crc: u32,
) {
    put_u32(buf, 0, RECORD_MAGIC);
    put_u32(buf, 8, kind);
    put_u32(buf, 12, key.len() as u32);
    put_u32(buf, 16, payload_len);
    put_u32(buf, 20, payload_crc);
    put_u32(buf, 24, gap);
    put_u32(buf, 28, 0);
    buf[RECORD_HEADER_SIZE..RECORD_HEADER_SIZE + key.len()].copy_from_slice(key);
    let crc = record_header_crc(&buf[8..RECORD_HEADER_SIZE], key);
    put_u32(buf, 4, crc);
}

/// The zero bytes that pad a record to a multiple of 8.
pub const RECORD_PADDING: [u8; 8] = [0; 8];

/// The zero bytes of a gap written by this build (less than
/// [`PAYLOAD_ALIGN`]).
pub const GAP_ZEROS: [u8; PAYLOAD_ALIGN] = [0; PAYLOAD_ALIGN];

fn record_header_crc(fields: &[u8], key: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(fields);
    h.update(key);
    h.finalize()
}

/// Parses a record header followed by its key; `buf` starts at the record.
///
/// The gap is read from bytes 24..28 whatever the magic: a version-1
/// record ("KVR1") has zeros there, covered by its header checksum, hence
/// no gap.
///
/// # Errors
/// [`FormatError`] for short input, a wrong magic, an unknown kind, a key
/// longer than [`MAX_KEY_LEN`], a gap larger than [`MAX_GAP`] or a header
/// checksum mismatch.
pub fn parse_record_header(buf: &[u8]) -> Result<(RecordHeader, &[u8]), FormatError> {
    let magic = u32_at(buf, 0)?;
    if magic != RECORD_MAGIC && magic != RECORD_MAGIC_V1 {
        return Err(FormatError::BadMagic);
    }
    let crc = u32_at(buf, 4)?;
    let header = RecordHeader {
        kind: u32_at(buf, 8)?,
        key_len: u32_at(buf, 12)?,
        payload_len: u32_at(buf, 16)?,
        payload_crc: u32_at(buf, 20)?,
        // Version 1 wrote zeros here (under the checksum): one rule for
        // both magics, so a damaged magic cannot change a record's extent.
        gap: u32_at(buf, 24)?,
    };
    if header.kind > KIND_REMOVE
        || header.key_len == 0
        || header.key_len as usize > MAX_KEY_LEN
        || header.gap as usize > MAX_GAP
    {
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
    let start = header.payload_start();
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
            for gap in [0usize, 4, 60] {
                let payload: Vec<u8> = (0..len).map(|i| (i * 31) as u8).collect();
                let mut pieces = vec![0u8; RECORD_HEADER_SIZE + key.len()];
                encode_record_head(
                    &mut pieces,
                    KIND_PUT,
                    &key,
                    gap as u32,
                    len as u32,
                    crc32fast::hash(&payload),
                );
                pieces.extend_from_slice(&GAP_ZEROS[..gap]);
                pieces.extend_from_slice(&payload);
                let pad = record_size(key.len(), gap, len) - pieces.len();
                pieces.extend_from_slice(&RECORD_PADDING[..pad]);
                assert_eq!(
                    pieces,
                    encode_record(KIND_PUT, &key, gap, &payload),
                    "payload of {len}, gap {gap}"
                );
            }
        }
    }

    /// `tests/common` writes damage at these offsets of the format
    /// (version 2): they must not move without a new format version.
    #[test]
    fn the_layout_the_integration_tests_rely_on() {
        assert_eq!(COUNTERS_AT, 512);
        assert_eq!(RECORD_HEADER_SIZE, 32);
        assert_eq!(PAYLOAD_ALIGN, 64);
        assert_eq!(record_size(36, 0, 100), 168);
        assert_eq!(record_size(36, 0, 1), 72);
        assert_eq!(record_size(36, 60, 100), 232);
        assert_eq!(payload_gap(0, 36), 60);
        assert_eq!(payload_gap(232, 36), 20);
    }

    /// Wherever a record starts (records start at multiples of 8), its
    /// payload starts at a multiple of `PAYLOAD_ALIGN`, with a gap shorter
    /// than that.
    #[test]
    fn the_gap_aligns_every_payload() {
        for key_len in [1usize, 8, 32, 36, 64, 100, MAX_KEY_LEN] {
            for offset in (0..4096u64).step_by(8) {
                let gap = payload_gap(offset, key_len);
                assert!(gap < PAYLOAD_ALIGN);
                let start = offset as usize + RECORD_HEADER_SIZE + key_len + gap;
                assert_eq!(start % PAYLOAD_ALIGN, 0, "key {key_len}, offset {offset}");
            }
        }
    }

    /// A version-1 record ("KVR1", zeros at bytes 24..32) reads with no
    /// gap; the gap field is read the same way whatever the magic, so a
    /// magic damaged from "KVR2" to "KVR1" keeps the record's extent.
    #[test]
    fn a_version_1_record_reads_without_a_gap() {
        let key = [3u8; 36];
        let payload = b"version one".to_vec();
        let mut record = encode_record(KIND_PUT, &key, 0, &payload);
        record[0..4].copy_from_slice(&RECORD_MAGIC_V1.to_le_bytes());
        let (header, k, p) = parse_record(&record).unwrap();
        assert_eq!((header.gap, k, p), (0, &key[..], &payload[..]));
        assert_eq!(header.record_len(), record.len());
        let mut damaged = encode_record(KIND_PUT, &key, 60, &payload);
        damaged[0..4].copy_from_slice(&RECORD_MAGIC_V1.to_le_bytes());
        let (header, _, p) = parse_record(&damaged).unwrap();
        assert_eq!((header.gap, header.record_len()), (60, damaged.len()));
        assert_eq!(p, &payload[..]);
        // A version-2 record declaring a gap beyond MAX_GAP is refused.
        let mut bad = encode_record(KIND_PUT, &key, 0, &payload);
        bad[24..28].copy_from_slice(&(MAX_GAP as u32 + 1).to_le_bytes());
        let crc = record_header_crc(&bad[8..RECORD_HEADER_SIZE], &key);
        bad[4..8].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(parse_record_header(&bad), Err(FormatError::Geometry));
    }

    /// A version-1 index header parses (and says so); encoding it again
    /// writes the current version.
    #[test]
    fn a_version_1_index_header_parses_and_encodes_as_current() {
        let header = IndexHeader {
            version: INDEX_VERSION,
            key_len: 36,
            slot_count: 64,
            created_unix: 1_700_000_000,
        };
        let mut buf = vec![0u8; HEADER_SIZE];
        header.encode(&mut buf);
        put_u32(&mut buf, 8, 1);
        let crc = crc32fast::hash(&buf[0..60]);
        put_u32(&mut buf, 60, crc);
        let old = IndexHeader::parse(&buf).unwrap();
        assert_eq!(old.version, 1);
        old.encode(&mut buf);
        assert_eq!(IndexHeader::parse(&buf).unwrap(), header);
        put_u32(&mut buf, 8, INDEX_VERSION + 1);
        let crc = crc32fast::hash(&buf[0..60]);
        put_u32(&mut buf, 60, crc);
        assert!(matches!(
            IndexHeader::parse(&buf),
            Err(FormatError::Version { found, .. }) if found == INDEX_VERSION + 1
        ));
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
            let header = IndexHeader { version: INDEX_VERSION, key_len, slot_count: 1 << shift, created_unix: 1_700_000_000 };
            let mut buf = vec![0u8; HEADER_SIZE];
            header.encode(&mut buf);
            prop_assert_eq!(IndexHeader::parse(&buf), Ok(header));
            buf[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(IndexHeader::parse(&buf).is_err());
        }

        #[test]
        fn slots_round_trip_and_detect_any_flipped_bit(key in proptest::collection::vec(any::<u8>(), 1..64), segment: u64, offset: u64, len: u32, crc: u32, gap in 0u32..64, bit in 8usize..(40 * 8)) {
            let location = Location { segment, offset, payload_len: len, payload_crc: crc, record_len: len / 2, gap };
            let mut buf = vec![0u8; format::slot_size(key.len())];
            encode_live_slot(&mut buf, &key, &location);
            prop_assert_eq!(parse_slot(&buf, key.len()), Slot::Live { key: &key, location });
            buf[bit / 8] ^= 1 << (bit % 8);
            let still_live = matches!(parse_slot(&buf, key.len()), Slot::Live { .. });
            prop_assert!(!still_live, "a flipped bit went unnoticed");
        }

        #[test]
        fn records_round_trip_and_detect_any_flipped_bit(key in proptest::collection::vec(any::<u8>(), 1..64), payload in proptest::collection::vec(any::<u8>(), 0..300), gap in 0usize..64, bit: usize) {
            let record = encode_record(format::KIND_PUT, &key, gap, &payload);
            let (header, k, p) = parse_record(&record).unwrap();
            prop_assert_eq!(header.record_len(), record.len());
            prop_assert_eq!(header.gap as usize, gap);
            prop_assert_eq!(k, &key[..]);
            prop_assert_eq!(p, &payload[..]);
            // Every bit but the gap's zeros (which carry nothing) is checked.
            let head = format::RECORD_HEADER_SIZE + key.len();
            let meaningful = head + payload.len();
            let mut damaged = record.clone();
            let at = bit % (meaningful * 8);
            let byte = if at / 8 < head { at / 8 } else { at / 8 + gap };
            damaged[byte] ^= 1 << (at % 8);
            prop_assert!(parse_record(&damaged).is_err());
        }
    }
}
