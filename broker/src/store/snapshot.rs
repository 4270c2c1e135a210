//! Snapshots of the queue indexes: bounded recovery time.
//!
//! A snapshot lists every live Enqueued record of the journal — its key, its location and
//! its head (the record without the message body: expiry, exchange, routing key, content
//! header, body length) — as of a journal position. Recovery loads the newest snapshot and
//! replays only the journal after that position; the bodies stay on disk until a consumer
//! asks for them (flow-to-disk). The file is `snapshot` in the data dir:
//!
//! `magic [8] | crc32 u32 | segment u64 | offset u64 | count u64 | entries | tables u64 |
//! producer tables`, each entry `uid u64 | id u64 | segment u64 | offset u64 | len u64 | head
//! len u32 | head`, each producer table `uid u64 | count u32 | count × (name len u32 | name |
//! number u64)` (the journal's [`super::journal::ProducerTables`] at the position: the
//! producers of messages consumed before it), the checksum over everything after it.
//! Format 1 had no producer tables; such a file is not used (the full scan reads them from
//! the journal).
//!
//! It is replaced atomically (temp file, fsync, rename, fsync directory). A snapshot is used
//! only while the segment of its position exists: the compactor deletes the oldest segment
//! first, and dropping the removal records of a segment at or after the position would make
//! the snapshot's list wrong. Anything wrong with it — missing, damaged, stale — means the
//! full scan, never a wrong recovery.

use super::index::{LiveIndex, Location, RecordKey};
use super::journal::ProducerTables;
use crate::core::producers::Producers;
use bytes::Bytes;
use std::fs::File;
use std::io::Write;
use std::path::Path;
use thiserror::Error;

/// The first bytes of a snapshot file.
pub const SNAPSHOT_MAGIC: &[u8; 8] = b"RMQS\x00\x00\x00\x02";
/// The first bytes of a format-1 snapshot (no producer tables).
const SNAPSHOT_MAGIC_V1: &[u8; 8] = b"RMQS\x00\x00\x00\x01";
/// Snapshot file name in the data dir.
pub const SNAPSHOT_FILE: &str = "snapshot";
const SNAPSHOT_TMP: &str = "snapshot.tmp";
/// Bytes of one entry before its head.
const ENTRY_FIXED_BYTES: usize = 5 * 8 + 4;

/// A place in the journal: everything before it is in the snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    /// Segment number.
    pub segment: u64,
    /// Offset in that segment, in bytes.
    pub offset_bytes: u64,
}

/// One live record of a snapshot.
#[derive(Debug, Clone)]
pub struct SnapshotEntry {
    /// Its key.
    pub key: RecordKey,
    /// Where it is (as of the snapshot).
    pub at: Location,
    /// Its head, in an allocation of its own.
    pub head: Bytes,
}

/// A snapshot read back.
#[derive(Debug)]
pub struct Snapshot {
    /// What it covers.
    pub position: Position,
    /// The live records.
    pub entries: Vec<SnapshotEntry>,
    /// The producer tables at the position.
    pub producers: ProducerTables,
}

/// Why a snapshot cannot be used (recovery then scans the whole journal).
#[derive(Debug, Error)]
pub enum SnapshotError {
    /// Reading or writing failed.
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    /// The file is not a whole, intact snapshot.
    #[error("snapshot is damaged: {0}")]
    Damaged(&'static str),
}

/// Encodes the live Enqueued records of `index` and the producer tables as of `position`.
pub fn encode(position: Position, index: &LiveIndex, producers: &ProducerTables) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(SNAPSHOT_MAGIC);
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(&position.segment.to_be_bytes());
    out.extend_from_slice(&position.offset_bytes.to_be_bytes());
    let count_at = out.len();
    out.extend_from_slice(&[0u8; 8]);
    let mut count = 0u64;
    for ((uid, id), at, head) in index.enqueued() {
        for v in [uid, id, at.segment, at.offset_bytes, at.len_bytes] {
            out.extend_from_slice(&v.to_be_bytes());
        }
        out.extend_from_slice(&(head.len() as u32).to_be_bytes());
        out.extend_from_slice(head);
        count += 1;
    }
    out[count_at..count_at + 8].copy_from_slice(&count.to_be_bytes());
    out.extend_from_slice(&(producers.len() as u64).to_be_bytes());
    for (uid, table) in producers {
        let highest = table.highest();
        out.extend_from_slice(&uid.to_be_bytes());
        out.extend_from_slice(&(highest.len() as u32).to_be_bytes());
        for (producer, seq) in highest {
            out.extend_from_slice(&(producer.len() as u32).to_be_bytes());
            out.extend_from_slice(producer.as_bytes());
            out.extend_from_slice(&seq.to_be_bytes());
        }
    }
    let crc = crc32fast::hash(&out[SNAPSHOT_MAGIC.len() + 4..]);
    out[SNAPSHOT_MAGIC.len()..SNAPSHOT_MAGIC.len() + 4].copy_from_slice(&crc.to_be_bytes());
    out
}

/// Replaces the snapshot of `dir` with `bytes` atomically: a crash at any point leaves the
/// old snapshot or the new one, whole.
pub fn write(dir: &Path, bytes: &[u8]) -> Result<(), SnapshotError> {
    let tmp = dir.join(SNAPSHOT_TMP);
    let io = |what: &str, e| SnapshotError::Io(format!("{what} {}", tmp.display()), e);
    let mut f = File::create(&tmp).map_err(|e| io("creating", e))?;
    f.write_all(bytes).map_err(|e| io("writing", e))?;
    f.sync_all().map_err(|e| io("syncing", e))?;
    std::fs::rename(&tmp, dir.join(SNAPSHOT_FILE)).map_err(|e| io("renaming", e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| SnapshotError::Io(format!("syncing directory {}", dir.display()), e))
}

/// Deletes the snapshot of `dir`, so that the next start scans the whole journal: what the
/// broker does when a body the snapshot vouched for turns out damaged on disk (the scan then
/// drops the damaged record instead of serving it again and again).
pub fn discard(dir: &Path) -> Result<(), SnapshotError> {
    let path = dir.join(SNAPSHOT_FILE);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(SnapshotError::Io(format!("deleting {}", path.display()), e));
        }
        _ => {}
    }
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| SnapshotError::Io(format!("syncing directory {}", dir.display()), e))
}

/// Reads the snapshot of `dir`: None when there is none.
pub fn load(dir: &Path) -> Result<Option<Snapshot>, SnapshotError> {
    let path = dir.join(SNAPSHOT_FILE);
    let data = match std::fs::read(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(SnapshotError::Io(format!("reading {}", path.display()), e)),
        Ok(d) => d,
    };
    decode(&data).map(Some)
}

fn decode(data: &[u8]) -> Result<Snapshot, SnapshotError> {
    let fixed = SNAPSHOT_MAGIC.len() + 4 + 3 * 8;
    if data.starts_with(SNAPSHOT_MAGIC_V1) {
        return Err(SnapshotError::Damaged(
            "format 1, without producer tables (written before an upgrade)",
        ));
    }
    if data.len() < fixed || &data[..SNAPSHOT_MAGIC.len()] != SNAPSHOT_MAGIC {
        return Err(SnapshotError::Damaged("no snapshot header"));
    }
    let u64_at = |at: usize| u64::from_be_bytes(data[at..at + 8].try_into().expect("8 bytes"));
    let crc = u32::from_be_bytes(data[8..12].try_into().expect("4 bytes"));
    if crc32fast::hash(&data[12..]) != crc {
        return Err(SnapshotError::Damaged("checksum mismatch"));
    }
    let position = Position {
        segment: u64_at(12),
        offset_bytes: u64_at(20),
    };
    let count = u64_at(28);
    if count > (data.len() / ENTRY_FIXED_BYTES) as u64 {
        return Err(SnapshotError::Damaged("entry count"));
    }
    let mut entries = Vec::with_capacity(count as usize);
    let mut at = fixed;
    for _ in 0..count {
        if data.len() < at + ENTRY_FIXED_BYTES {
            return Err(SnapshotError::Damaged("truncated entry"));
        }
        let head_len =
            u32::from_be_bytes(data[at + 40..at + 44].try_into().expect("4 bytes")) as usize;
        let head_at = at + ENTRY_FIXED_BYTES;
        if data.len() < head_at + head_len {
            return Err(SnapshotError::Damaged("truncated head"));
        }
        entries.push(SnapshotEntry {
            key: (u64_at(at), u64_at(at + 8)),
            at: Location {
                segment: u64_at(at + 16),
                offset_bytes: u64_at(at + 24),
                len_bytes: u64_at(at + 32),
            },
            head: Bytes::copy_from_slice(&data[head_at..head_at + head_len]),
        });
        at = head_at + head_len;
    }
    let producers = decode_producers(data, at)?;
    Ok(Snapshot {
        position,
        entries,
        producers,
    })
}

/// The producer tables from `at` to the end of `data`.
fn decode_producers(data: &[u8], mut at: usize) -> Result<ProducerTables, SnapshotError> {
    let mut take = |n: usize| -> Result<&[u8], SnapshotError> {
        let got = data
            .get(at..at + n)
            .ok_or(SnapshotError::Damaged("truncated producer table"))?;
        at += n;
        Ok(got)
    };
    let u64_of = |b: &[u8]| u64::from_be_bytes(b.try_into().expect("8 bytes"));
    let u32_of = |b: &[u8]| u32::from_be_bytes(b.try_into().expect("4 bytes")) as usize;
    let tables = u64_of(take(8)?);
    if tables > (data.len() / 12) as u64 {
        return Err(SnapshotError::Damaged("producer table count"));
    }
    let mut out = ProducerTables::with_capacity(tables as usize);
    for _ in 0..tables {
        let uid = u64_of(take(8)?);
        let count = u32_of(take(4)?);
        let mut table = Producers::default();
        for _ in 0..count {
            let len = u32_of(take(4)?);
            let name = std::str::from_utf8(take(len)?)
                .map_err(|_| SnapshotError::Damaged("producer name"))?
                .to_owned();
            table.note_number(&name, u64_of(take(8)?));
        }
        out.insert(uid, table);
    }
    if at != data.len() {
        return Err(SnapshotError::Damaged("trailing bytes"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_round_trips_and_any_flipped_bit_is_refused() {
        let mut index = LiveIndex::default();
        for id in 1..=3u64 {
            index.add(
                (7, id),
                Location {
                    segment: 2,
                    offset_bytes: 8 + 100 * id,
                    len_bytes: 100,
                },
                Some(Bytes::from(vec![id as u8; 10 + id as usize])),
            );
        }
        index.add(
            (9, 1),
            Location {
                segment: 3,
                offset_bytes: 8,
                len_bytes: 50,
            },
            None,
        );
        let position = Position {
            segment: 3,
            offset_bytes: 58,
        };
        let mut producers = ProducerTables::new();
        producers.entry(7).or_default().note_number("session:1", 12);
        let bytes = encode(position, &index, &producers);
        let s = decode(&bytes).unwrap();
        assert_eq!(s.position, position);
        assert_eq!(
            s.producers.get(&7).map(Producers::highest),
            Some(vec![(std::sync::Arc::from("session:1"), 12)])
        );
        let mut got: Vec<(RecordKey, u64, usize)> = s
            .entries
            .iter()
            .map(|e| (e.key, e.at.offset_bytes, e.head.len()))
            .collect();
        got.sort_unstable();
        // Page records (no head) are not in a snapshot.
        assert_eq!(
            got,
            vec![((7, 1), 108, 11), ((7, 2), 208, 12), ((7, 3), 308, 13)]
        );
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x10;
            assert!(decode(&bad).is_err(), "flipped byte {i} accepted");
        }
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
        let mut v1 = bytes.clone();
        v1[..8].copy_from_slice(SNAPSHOT_MAGIC_V1);
        assert!(
            matches!(decode(&v1), Err(SnapshotError::Damaged(why)) if why.starts_with("format 1"))
        );
    }
}
