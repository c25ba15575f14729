//! Rebuilding a lost or corrupt index from the segments, oldest first.

use std::collections::BTreeMap;
use std::path::Path;

use crate::config::DiskConfig;
use crate::error::DiskError;
use crate::index::{Index, LiveSegments};
use crate::{INDEX_FILE, INDEX_TMP, format, segment_name};

/// What a rebuild found damaged, and what it dropped because of it.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RebuildReport {
    pub(crate) damaged: u64,
    pub(crate) dropped_keys: u64,
}

/// Builds a new index from the records of every segment, oldest first: a
/// later record of a key wins and a remove record removes it.
///
/// Damage never makes a key load bytes that a later store replaced or a
/// removal removed:
/// - A record whose header (and so its key and extent) is intact but whose
///   payload fails its checksum is the key's newest record, unreadable: the
///   key is left absent, and the scan goes on after the record.
/// - A segment cut short (fewer bytes left than a record header and key, or
///   a record running past the end of the file) ends there: that is the
///   torn tail of a crash, a record that was never acknowledged.
/// - An unreadable record header anywhere else leaves the rest of that
///   segment unordered: it may have replaced or removed any key indexed so
///   far. The rest of the segment is discarded and so is every key indexed
///   so far; later segments (all newer) are kept. A segment missing from the
///   middle of the sequence is handled the same way. Each is logged and
///   counted in the report.
pub(crate) fn rebuild(
    dir: &Path,
    config: &DiskConfig,
    segments: &BTreeMap<u64, u64>,
    live: LiveSegments,
) -> Result<(Index, RebuildReport), DiskError> {
    let tmp = dir.join(INDEX_TMP);
    let mut index = Index::create(&tmp, config.key_len, config.initial_slots)?;
    let mut report = RebuildReport::default();
    let mut previous: Option<u64> = None;
    for &id in segments.keys() {
        let path = dir.join(segment_name(id));
        if previous.is_some_and(|p| p + 1 != id) {
            let dropped = index.len();
            tracing::warn!(
                segment = %path.display(),
                keys = dropped,
                "segments missing before this one; every key of older segments is dropped"
            );
            report.damaged += 1;
            report.dropped_keys += dropped;
            drop(index);
            index = Index::create(&tmp, config.key_len, config.initial_slots)?;
        }
        previous = Some(id);
        let bytes = std::fs::read(&path).map_err(|e| DiskError::io("read segment", &path, e))?;
        let mut offset = 0usize;
        while offset < bytes.len() {
            let rest = &bytes[offset..];
            let (header, key) = match format::parse_record_header(rest) {
                Ok(parsed) => parsed,
                // A torn tail.
                Err(_) if rest.len() < format::RECORD_HEADER_SIZE + config.key_len => break,
                Err(reason) => {
                    let dropped = index.len();
                    tracing::warn!(
                        segment = %path.display(),
                        offset,
                        %reason,
                        discarded_bytes = rest.len(),
                        keys = dropped,
                        "unreadable record: the rest of its segment is discarded, and every key indexed before it (the record may have replaced or removed any of them)"
                    );
                    report.damaged += 1;
                    report.dropped_keys += dropped;
                    drop(index);
                    index = Index::create(&tmp, config.key_len, config.initial_slots)?;
                    break;
                }
            };
            let len = header.record_len();
            let Some(record) = rest.get(..len) else {
                break; // a torn tail: the record runs past the end of the file
            };
            if key.len() == config.key_len {
                match format::parse_record(record) {
                    Ok((h, _, payload)) if h.kind == format::KIND_PUT => {
                        let location = format::Location {
                            segment: id,
                            offset: offset as u64,
                            payload_len: payload.len() as u32,
                            payload_crc: h.payload_crc,
                            record_len: len as u32,
                            gap: h.gap,
                        };
                        index.insert(key, &location, live);
                    }
                    Ok(_) => {
                        index.remove(key, live);
                    }
                    Err(reason) => {
                        tracing::warn!(
                            segment = %path.display(),
                            offset,
                            %reason,
                            "damaged record payload: its key is left absent"
                        );
                        report.damaged += 1;
                        index.remove(key, live);
                    }
                }
            }
            if index.needs_rehash() {
                // The grown index is renamed over the one being built (at `tmp`).
                index = index.rehash(&dir.join("index.kvx.grow"), live, 0)?;
            }
            offset += len;
        }
    }
    index.finish_replace(&dir.join(INDEX_FILE))?;
    Ok((index, report))
}
