//! The disk tier's errors, and their classification into [`TierError`].

use std::path::PathBuf;

use kvtier_core::{TierError, TierErrorKind};

/// What is wrong with bytes read from disk.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// Fewer bytes than the format needs.
    #[error("truncated: need {need} bytes, have {got}")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        got: usize,
    },
    /// Not a kvtier file or record.
    #[error("bad magic")]
    BadMagic,
    /// A format version this build does not read.
    #[error("format version {found}, this build reads {supported}")]
    Version {
        /// Version in the file.
        found: u32,
        /// Version this build reads.
        supported: u32,
    },
    /// A checksum mismatch.
    #[error("{what} checksum mismatch")]
    Checksum {
        /// What was checked.
        what: &'static str,
    },
    /// Sizes or counts that cannot be right.
    #[error("impossible geometry")]
    Geometry,
}

/// An error of the disk tier.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiskError {
    /// A configuration value is out of range.
    #[error("invalid disk tier configuration: {field} {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A key of another length than the tier's.
    #[error("key of {got} bytes, this disk tier stores keys of {expected} bytes")]
    WrongKeySize {
        /// The tier's key length.
        expected: usize,
        /// The key's length.
        got: usize,
    },
    /// A payload that cannot fit in one segment.
    #[error("payload of {len} bytes does not fit in a segment (at most {max} bytes)")]
    PayloadTooLarge {
        /// The payload's length.
        len: usize,
        /// The largest payload a segment takes.
        max: usize,
    },
    /// Another process (or another `DiskTier` in this one) has the directory open for writing.
    #[error("{path} is locked by another writer")]
    Locked {
        /// The lock file.
        path: PathBuf,
    },
    /// A change (store, removal, close) asked of a tier in a process forked
    /// from the one that opened it. The tier's files belong to the process
    /// that opened them: a child's appends would land where its parent
    /// writes next, and be lost. Open the directory in the child (after the
    /// parent closes it) or send the blocks to the parent.
    #[error(
        "this disk tier was opened by process {owner}; process {pid}, forked from it, may read but not change it"
    )]
    Forked {
        /// The process that opened the tier.
        owner: u32,
        /// This process.
        pid: u32,
    },
    /// The index was written by another format version; it is left untouched.
    #[error("index {path} has format version {found}; this build reads versions 1 to {supported}")]
    IndexVersion {
        /// The index file.
        path: PathBuf,
        /// Its version.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// The index is unusable and rebuilding it was not allowed.
    #[error(
        "index {path} is corrupt ({reason}); open with rebuild_corrupt_index to rebuild it from the segments"
    )]
    CorruptIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        reason: FormatError,
    },
    /// The index was built for another key length.
    #[error("index {path} stores keys of {found} bytes, the configuration says {configured}")]
    KeyLenMismatch {
        /// The index file.
        path: PathBuf,
        /// Key length in the index.
        found: usize,
        /// Key length configured.
        configured: usize,
    },
    /// A segment file whose id is too large to append after (a crafted or
    /// foreign file); the directory is left untouched.
    #[error("segment {path} has id {id}, above the largest this tier uses ({max})")]
    SegmentIdOutOfRange {
        /// The segment file.
        path: PathBuf,
        /// Its id.
        id: u64,
        /// The largest id accepted.
        max: u64,
    },
    /// The device is full.
    #[error("disk full writing {path}")]
    DiskFull {
        /// The file being written.
        path: PathBuf,
    },
    /// Any other I/O error, with the operation and the path.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

impl DiskError {
    /// Wraps an I/O error with its operation and path, recognising a full disk.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::StorageFull {
            return Self::DiskFull { path };
        }
        Self::Io { op, path, source }
    }
}

impl From<DiskError> for TierError {
    fn from(err: DiskError) -> Self {
        let kind = match &err {
            DiskError::WrongKeySize { .. } | DiskError::PayloadTooLarge { .. } => {
                TierErrorKind::InvalidInput
            }
            DiskError::InvalidConfig { .. }
            | DiskError::Locked { .. }
            | DiskError::IndexVersion { .. }
            | DiskError::KeyLenMismatch { .. }
            | DiskError::Forked { .. } => TierErrorKind::Config,
            DiskError::CorruptIndex { .. } | DiskError::SegmentIdOutOfRange { .. } => {
                TierErrorKind::Corrupt
            }
            // A directory this process may not write, or a path that is
            // not a directory: retrying will not help.
            DiskError::Io { source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem
                ) =>
            {
                TierErrorKind::PermissionDenied
            }
            DiskError::Io { source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::NotADirectory
                        | std::io::ErrorKind::IsADirectory
                        | std::io::ErrorKind::AlreadyExists
                ) =>
            {
                TierErrorKind::Config
            }
            DiskError::DiskFull { .. } | DiskError::Io { .. } => TierErrorKind::Unavailable,
        };
        TierError::new(kind, err.to_string()).with_source(err)
    }
}
