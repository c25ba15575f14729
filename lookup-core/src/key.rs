//! Keys and request contexts: the two values every lookup carries.

use std::fmt;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
use std::mem::MaybeUninit;
use std::sync::{Arc, OnceLock};

/// Bytes stored inline, without a heap allocation.
///
/// vLLM's keys are a 32-byte block hash plus a 4-byte group index (36 bytes),
/// so the common key never allocates and cloning it is a plain copy.
pub const INLINE_KEY_CAPACITY: usize = 38;

/// The name of one KV-cache block in a tier: opaque bytes, cheap to clone and hash.
///
/// Keys up to [`INLINE_KEY_CAPACITY`] bytes live inline (no allocation, clone
/// is a copy); longer keys share one reference-counted buffer. Equality,
/// ordering and hashing look only at the bytes, so two keys built from the
/// same bytes are interchangeable whatever their representation.
///
/// A key carries a 64-bit hash of its bytes, computed once when it is built
/// with a seed chosen at random per process: a key is built once per block
/// and looked up many times, and the manager's maps use that hash as is
/// instead of hashing the bytes again at every step. The hash is not stable
/// across processes; a persistent index must hash the bytes itself.
///
/// Length limits are a property of the manager or the tier, not of the key:
/// [`AsyncLookupManager`](crate::AsyncLookupManager) rejects keys outside its
/// configured `min_key_len ..= max_key_len` with
/// [`LookupError::InvalidKey`](crate::LookupError::InvalidKey).
pub struct OffloadKey {
    hash: u64,
    repr: Repr,
}

impl Clone for OffloadKey {
    /// A bitwise copy for an inline key (48 bytes, no reference to count),
    /// a reference-count increment for a long one.
    #[inline]
    fn clone(&self) -> Self {
        match &self.repr {
            // SAFETY: a typed copy of a valid value; an inline key owns
            // nothing (no heap, no count) and has no drop work, so the copy
            // and the original are independent, as with a `Copy` type.
            // (Copying the two fields, as the derive did, compiles to a
            // round trip through the stack in odd-sized pieces.)
            Repr::Inline { .. } => unsafe { std::ptr::read(self) },
            Repr::Shared(bytes) => Self {
                hash: self.hash,
                repr: Repr::Shared(Arc::clone(bytes)),
            },
        }
    }
}

fn process_hasher() -> &'static foldhash::quality::FixedState {
    static STATE: OnceLock<foldhash::quality::FixedState> = OnceLock::new();
    STATE.get_or_init(|| {
        let seed = foldhash::quality::RandomState::default().hash_one(0x6b76_7469_6572_u64);
        foldhash::quality::FixedState::with_seed(seed)
    })
}

/// Copies `bytes` (at most [`INLINE_KEY_CAPACITY`] long) to the start of
/// `dst`, whose other bytes are zero and stay so.
///
/// Keys of 17 to 38 bytes (vLLM's 36 among them) go in a few fixed-size
/// loads, overlapping where the length is not a multiple of their size,
/// shifted into place in registers and stored straight into `dst`: no call
/// to `memcpy` for a variable length, and no temporary array that the
/// key's construction would read back at other offsets than it was written
/// (such a load waits for the stores to reach the cache). Shorter keys are
/// copied by `copy_from_slice`.
#[inline(always)]
fn fill_zeroed(dst: &mut [u8; INLINE_KEY_CAPACITY], bytes: &[u8]) {
    const WIDE: usize = 16;
    const _: () = assert!(INLINE_KEY_CAPACITY > 2 * WIDE && INLINE_KEY_CAPACITY <= 3 * WIDE);
    let n = bytes.len();
    debug_assert!(n <= INLINE_KEY_CAPACITY);
    let word = |at: usize| -> u128 {
        let mut w = [0u8; WIDE];
        w.copy_from_slice(&bytes[at..at + WIDE]);
        u128::from_le_bytes(w)
    };
    if n > WIDE {
        // 17..=38 bytes: the first 16, the last 16 (overlapping the first
        // when n < 32), and for n > 32 the last 16 again, shifted so that
        // only bytes past 32 remain.
        let last = word(n - WIDE);
        dst[..WIDE].copy_from_slice(&word(0).to_le_bytes());
        if n <= 2 * WIDE {
            // Bytes 16..n are the top n - 16 bytes of `last`.
            let mid = last >> (8 * (2 * WIDE - n));
            dst[WIDE..2 * WIDE].copy_from_slice(&mid.to_le_bytes());
        } else {
            dst[WIDE..2 * WIDE].copy_from_slice(&word(WIDE).to_le_bytes());
            // Bytes 32..n (1 to 6 of them) are the top n - 32 bytes of `last`.
            let tail = (last >> (8 * (3 * WIDE - n))).to_le_bytes();
            dst[2 * WIDE..].copy_from_slice(&tail[..INLINE_KEY_CAPACITY - 2 * WIDE]);
        }
    } else {
        dst[..n].copy_from_slice(bytes);
    }
}

#[derive(Clone)]
enum Repr {
    Inline {
        len: u8,
        bytes: [u8; INLINE_KEY_CAPACITY],
    },
    Shared(Arc<[u8]>),
}

impl OffloadKey {
    /// Builds a key from its bytes.
    #[inline]
    pub fn new(bytes: &[u8]) -> Self {
        let mut key = MaybeUninit::uninit();
        Self::write_new(&mut key, bytes);
        // SAFETY: `write_new` initialised it.
        unsafe { key.assume_init() }
    }

    /// Builds the key of `bytes` in `slot` and returns it: [`new`](Self::new)
    /// where the key is to be kept, without a move from a temporary. A
    /// caller building many keys into a buffer (a batch) saves the move of
    /// each, which the compiler does in pieces of other sizes than the
    /// construction's and so with loads that wait for its stores.
    ///
    /// As with [`MaybeUninit::write`], whatever `slot` held is overwritten
    /// without being dropped, and the key written is dropped only if the
    /// caller takes it out (`assume_init`, or a `Vec`'s `set_len` over it):
    /// otherwise a long key's shared bytes leak.
    #[inline(always)]
    pub fn write_new<'a>(slot: &'a mut MaybeUninit<Self>, bytes: &[u8]) -> &'a mut Self {
        if bytes.len() > INLINE_KEY_CAPACITY {
            return slot.write(Self::new_shared(bytes));
        }
        let key = slot.write(Self {
            hash: process_hasher().hash_one(bytes),
            // The cast cannot truncate: len <= INLINE_KEY_CAPACITY < 256.
            repr: Repr::Inline {
                len: bytes.len() as u8,
                bytes: [0; INLINE_KEY_CAPACITY],
            },
        });
        if let Repr::Inline { bytes: dst, .. } = &mut key.repr {
            fill_zeroed(dst, bytes);
        }
        key
    }

    /// A key longer than [`INLINE_KEY_CAPACITY`]: its bytes on the heap.
    #[inline(never)]
    fn new_shared(bytes: &[u8]) -> Self {
        Self {
            hash: process_hasher().hash_one(bytes),
            repr: Repr::Shared(Arc::from(bytes)),
        }
    }

    /// vLLM's layout: a block hash followed by the 4-byte big-endian group index.
    pub fn from_block_hash(block_hash: &[u8], group_idx: u32) -> Self {
        let mut buf = Vec::with_capacity(block_hash.len() + 4);
        buf.extend_from_slice(block_hash);
        buf.extend_from_slice(&group_idx.to_be_bytes());
        Self::new(&buf)
    }

    /// The hash computed when the key was built (seeded per process).
    #[inline]
    pub(crate) fn prehash(&self) -> u64 {
        self.hash
    }

    /// The key's bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        match &self.repr {
            Repr::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Repr::Shared(bytes) => bytes,
        }
    }

    /// Number of bytes in the key.
    #[inline]
    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }

    /// Whether the key has no bytes (the manager rejects such keys).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lower-case hexadecimal form of the key, as object stores name it.
    pub fn to_hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(self.len() * 2);
        for byte in self.as_bytes() {
            out.push(char::from(DIGITS[usize::from(byte >> 4)]));
            out.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
        }
        out
    }
}

impl PartialEq for OffloadKey {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        if self.hash != other.hash {
            return false;
        }
        match (&self.repr, &other.repr) {
            // Inline bytes past `len` are always zero (see `write_new`), so the
            // whole fixed-size arrays compare: no call to memcmp.
            (Repr::Inline { len: a, bytes: x }, Repr::Inline { len: b, bytes: y }) => {
                // OR of XORs: branch-free and vectorised.
                let diff = x.iter().zip(y).fold(0u8, |acc, (p, q)| acc | (p ^ q));
                a == b && diff == 0
            }
            _ => self.eq_bytes(other),
        }
    }
}

impl OffloadKey {
    /// Equality of keys not both inline: out of line and cold, so a lookup's
    /// compare of inline keys saves no registers for a call.
    #[cold]
    #[inline(never)]
    fn eq_bytes(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for OffloadKey {}

impl PartialOrd for OffloadKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for OffloadKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_bytes().cmp(other.as_bytes())
    }
}

impl Hash for OffloadKey {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// A hasher for maps keyed by [`OffloadKey`]: passes the key's precomputed
/// hash through instead of hashing again.
///
/// Other types written to it are folded in with FNV-1a, so it stays correct
/// (if slower) for any key type.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrehashedHasher(u64);

impl Hasher for PrehashedHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write_u64(&mut self, hash: u64) {
        self.0 = if self.0 == 0 {
            hash
        } else {
            (self.0 ^ hash).wrapping_mul(0x100_0000_01b3)
        };
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut h = self.0 ^ 0xcbf2_9ce4_8422_2325;
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        self.0 = h;
    }
}

/// Builds [`PrehashedHasher`]s; the hasher of the manager's key maps.
pub type BuildPrehashed = BuildHasherDefault<PrehashedHasher>;

impl AsRef<[u8]> for OffloadKey {
    fn as_ref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl From<&[u8]> for OffloadKey {
    fn from(bytes: &[u8]) -> Self {
        Self::new(bytes)
    }
}

impl<const N: usize> From<[u8; N]> for OffloadKey {
    fn from(bytes: [u8; N]) -> Self {
        Self::new(&bytes)
    }
}

impl<const N: usize> From<&[u8; N]> for OffloadKey {
    fn from(bytes: &[u8; N]) -> Self {
        Self::new(bytes)
    }
}

impl From<Vec<u8>> for OffloadKey {
    fn from(bytes: Vec<u8>) -> Self {
        Self::new(&bytes)
    }
}

impl fmt::Debug for OffloadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OffloadKey({})", self.to_hex())
    }
}

impl fmt::Display for OffloadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Who is asking: the request id.
///
/// Cloning is one reference-count increment. The manager groups keys by
/// `req_id` and hands the tier the context of the request that first asked
/// for a key; a key shared by several requests is probed once.
///
/// # Tenants
///
/// A context does not scope keys. The manager identifies a block by its
/// key bytes alone: when two requests ask for the same bytes, one probe
/// answers both, whoever made it. A tier must therefore answer from the key
/// alone, and blocks that must not be shared need different keys. Two ways:
///
/// - **Salt the block hash per tenant**, as vLLM's `cache_salt` does: the
///   salt enters the hash of the first block, so every key of the prompt
///   differs between tenants while one tenant's requests still share.
/// - **One tier instance per tenant**, each with its own key prefix or
///   directory (a Redis or S3 prefix, a disk directory) and its own manager
///   (a `TierStack` per tenant).
///
/// Scoping keys inside the tier by something other than the key (a
/// namespace in the context) would let one tenant receive another's verdict,
/// so the context has no such field:
///
/// ```compile_fail,E0599
/// let ctx = kvtier_core::ReqContext::new("req-1").with_namespace("tenant-a");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ReqContext {
    req_id: Arc<str>,
}

impl ReqContext {
    /// A context for request `req_id`.
    pub fn new(req_id: impl Into<Arc<str>>) -> Self {
        Self {
            req_id: req_id.into(),
        }
    }

    /// The request id.
    #[inline]
    pub fn req_id(&self) -> &str {
        &self.req_id
    }

    /// The shared request id, for cheap identity checks.
    #[inline]
    pub(crate) fn req_id_arc(&self) -> &Arc<str> {
        &self.req_id
    }
}

impl fmt::Debug for ReqContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReqContext")
            .field("req_id", &&*self.req_id)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn inline_and_shared_keys_compare_by_bytes() {
        let short = OffloadKey::new(&[7u8; 36]);
        let long = OffloadKey::new(&[7u8; 100]);
        assert_eq!(short.len(), 36);
        assert_eq!(long.len(), 100);
        assert_eq!(short, OffloadKey::from([7u8; 36]));
        assert_ne!(short, long);
        let mut map: HashMap<OffloadKey, i32, BuildPrehashed> = HashMap::default();
        map.insert(long.clone(), 1);
        map.insert(short.clone(), 2);
        assert_eq!(map.get(&OffloadKey::new(&[7u8; 100])), Some(&1));
        assert_eq!(map.get(&OffloadKey::new(short.as_bytes())), Some(&2));
        assert_eq!(map.get(&OffloadKey::new(&[8u8; 36])), None);
    }

    #[test]
    fn block_hash_layout_matches_vllm() {
        let key = OffloadKey::from_block_hash(&[0xab; 32], 0x0102_0304);
        assert_eq!(key.len(), 36);
        assert_eq!(&key.as_bytes()[32..], &[1, 2, 3, 4]);
        assert!(key.to_hex().starts_with("abab"));
        assert!(key.to_hex().ends_with("01020304"));
    }

    #[test]
    fn inline_keys_of_different_lengths_differ() {
        // Same leading bytes, one key a zero-padded prefix of the other.
        let short = OffloadKey::new(&[1, 2, 3]);
        let long = OffloadKey::new(&[1, 2, 3, 0]);
        assert_ne!(short, long);
        assert_eq!(short, OffloadKey::new(&[1, 2, 3]));
        // The comparison also holds with the hash forced equal.
        let forged = OffloadKey {
            hash: short.hash,
            repr: long.repr.clone(),
        };
        assert_ne!(short, forged);
    }

    #[test]
    fn a_clone_is_the_same_key_and_outlives_the_original() {
        for bytes in [
            vec![3u8; 36],
            vec![0u8; 1],
            vec![9u8; INLINE_KEY_CAPACITY],
            vec![4u8; 100],
        ] {
            let key = OffloadKey::new(&bytes);
            let copy = key.clone();
            assert_eq!(copy, key);
            assert_eq!(copy.prehash(), key.prehash());
            drop(key);
            assert_eq!(copy.as_bytes(), &bytes[..]);
            assert_eq!(copy, OffloadKey::new(&bytes));
        }
    }

    #[test]
    fn inline_bytes_are_the_key_then_zeros_at_every_length() {
        for n in 0..=INLINE_KEY_CAPACITY {
            let bytes: Vec<u8> = (0..n).map(|i| 0xa0 ^ (i as u8).wrapping_mul(37)).collect();
            let mut padded = [0; INLINE_KEY_CAPACITY];
            fill_zeroed(&mut padded, &bytes);
            assert_eq!(&padded[..n], &bytes[..], "length {n}");
            assert!(padded[n..].iter().all(|&b| b == 0), "length {n}");
            let key = OffloadKey::new(&bytes);
            assert_eq!(key.as_bytes(), &bytes[..], "length {n}");
            assert_eq!(key, OffloadKey::new(&bytes));
            let mut slot = MaybeUninit::uninit();
            assert_eq!(*OffloadKey::write_new(&mut slot, &bytes), key, "length {n}");
        }
        // A long key: shared, through `write_new` too.
        let long = vec![7u8; INLINE_KEY_CAPACITY + 1];
        let mut slot = MaybeUninit::uninit();
        OffloadKey::write_new(&mut slot, &long);
        // SAFETY: initialised by `write_new`; dropped once.
        let key = unsafe { slot.assume_init() };
        assert_eq!(key.as_bytes(), &long[..]);
    }

    #[test]
    fn key_is_small() {
        assert!(std::mem::size_of::<OffloadKey>() <= 48);
    }
}
