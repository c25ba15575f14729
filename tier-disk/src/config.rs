//! Disk tier configuration.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::DiskError;
use crate::format::{MAX_KEY_LEN, RECORD_HEADER_SIZE, payload_gap};

/// How durable a store is when it returns (and so when its key becomes visible).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsyncPolicy {
    /// The payload is fsynced before its key is published, and the index
    /// slot is flushed before `store` returns: an acknowledged store
    /// survives a power loss. The default.
    #[default]
    Always,
    /// Written to the operating system before its key is published: an
    /// acknowledged store survives the process being killed, not a power
    /// loss (after which a lost payload fails its checksum on load and
    /// turns into a miss).
    Never,
}

/// Where and how a [`DiskTier`](crate::DiskTier) stores blocks.
///
/// ```toml
/// path = "/var/cache/kvtier"
/// key_len = 36
/// capacity_bytes = 17179869184   # 16 GiB of payloads
/// segment_bytes = 67108864       # 64 MiB segments
/// fsync = "always"
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiskConfig {
    /// The directory (created if missing). Required.
    pub path: PathBuf,
    /// Length of every key, in bytes. Default 36 (vLLM: 32-byte hash + 4-byte group).
    pub key_len: usize,
    /// Most bytes of segment files kept; past it, whole oldest segments are
    /// evicted. Default 1 GiB. At least twice `segment_bytes`.
    pub capacity_bytes: u64,
    /// Size at which a segment is closed and a new one started. Default 64 MiB.
    pub segment_bytes: u64,
    /// Slots of a new index (rounded up to a power of two). Default 65536.
    pub initial_slots: u64,
    /// Durability of a store; see [`FsyncPolicy`]. Default `always`.
    pub fsync: FsyncPolicy,
    /// Rebuild a missing or corrupt index from the segments (true), or fail
    /// with [`DiskError::CorruptIndex`] (false). An index of another format
    /// version is never rebuilt over. Default true.
    pub rebuild_corrupt_index: bool,
}

impl Default for DiskConfig {
    fn default() -> Self {
        Self {
            path: PathBuf::new(),
            key_len: 36,
            capacity_bytes: 1 << 30,
            segment_bytes: 64 << 20,
            initial_slots: 1 << 16,
            fsync: FsyncPolicy::Always,
            rebuild_corrupt_index: true,
        }
    }
}

impl DiskConfig {
    /// The defaults, in directory `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            ..Self::default()
        }
    }

    /// The largest payload one segment takes.
    pub fn max_payload(&self) -> usize {
        usize::try_from(self.segment_bytes)
            .unwrap_or(usize::MAX)
            .saturating_sub(RECORD_HEADER_SIZE + self.key_len + payload_gap(0, self.key_len) + 8)
            .min(u32::MAX as usize)
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`DiskError::InvalidConfig`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), DiskError> {
        let bad = |field, reason: &str| {
            Err(DiskError::InvalidConfig {
                field,
                reason: reason.to_owned(),
            })
        };
        if self.path.as_os_str().is_empty() {
            return bad("path", "must name a directory");
        }
        if self.key_len == 0 || self.key_len > MAX_KEY_LEN {
            return bad("key_len", &format!("must be 1 to {MAX_KEY_LEN}"));
        }
        if self.segment_bytes < 4096 || self.segment_bytes > u64::from(u32::MAX) {
            return bad("segment_bytes", "must be 4 KiB to 4 GiB");
        }
        if self.capacity_bytes < 2 * self.segment_bytes {
            return bad("capacity_bytes", "must be at least twice segment_bytes");
        }
        if self.initial_slots == 0 || self.initial_slots > 1 << 40 {
            return bad("initial_slots", "must be 1 to 2^40");
        }
        Ok(())
    }
}
