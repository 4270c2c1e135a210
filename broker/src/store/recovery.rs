//! Recovery: the durable wiring from `wiring.json`, then the queue indexes — from the newest
//! valid snapshot plus the journal after its position, or from every segment in order when
//! there is no usable snapshot — keeping the messages that were enqueued and not removed.
//!
//! With them, each durable queue's producer table (B15 in docs/reliability.md): the
//! snapshot's, raised by every Enqueued record's producer and every Producers record read
//! after it — consumed messages included, so that a session's resend is still recognised.
//!
//! Messages listed by the snapshot come back with their bodies on disk (read on delivery);
//! messages of the replayed tail come back with their bodies as read. A damaged record (torn
//! at the tail after a crash, or corrupted) ends the reading of its segment: everything before
//! it is kept, what was dropped is reported, and nothing half-written is ever served.

use super::index::Location;
use super::journal::DiskState;
use super::record::{DecodeError, Record, next_record};
use super::snapshot::{self, Snapshot};
use super::{SEGMENT_MAGIC, StoreError, read_wiring_file};
use crate::core::Message;
use crate::core::producers::producer_of;
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

/// A message to put back: (id, message, expiry).
pub type RecoveredMessage = (u64, Arc<Message>, Option<u64>);

/// Messages found so far: (queue uid, id) → (message, expiry).
type Found = HashMap<(u64, u64), (Arc<Message>, Option<u64>)>;

/// What recovery found.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Disk state for the journal writer to continue.
    pub disk: DiskState,
    /// Messages per queue uid.
    pub messages: HashMap<u64, Vec<RecoveredMessage>>,
    /// The number the next segment gets.
    pub next_segment: u64,
    /// Damage found, one line per damaged segment, for the log.
    pub damage: Vec<String>,
    /// Records read from segments.
    pub records: u64,
    /// Live records taken from the snapshot (0 without one).
    pub snapshot_records: u64,
    /// Why a snapshot present was not used, for the log.
    pub snapshot_ignored: Option<String>,
}

/// How recovery may start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// From the snapshot when there is a valid one.
    Snapshot,
    /// From the first segment, ignoring any snapshot (what the snapshot is checked against).
    FullScan,
}

/// Reads the data directory, from its snapshot when it has a valid one.
pub fn recover(dir: &Path) -> Result<Recovered, StoreError> {
    recover_from(dir, Start::Snapshot)
}

/// Reads the data directory, starting as told.
pub fn recover_from(dir: &Path, start: Start) -> Result<Recovered, StoreError> {
    let mut out = Recovered {
        next_segment: 1,
        ..Default::default()
    };
    out.disk.wiring = read_wiring_file(dir)?;
    let live_uids: HashSet<u64> = out
        .disk
        .wiring
        .values()
        .flat_map(|w| w.queues.iter().map(|q| q.uid))
        .collect();
    let segments = list_segments(dir)?;
    let snapshot = match start {
        Start::FullScan => None,
        Start::Snapshot => match snapshot::load(dir) {
            Ok(None) => None,
            Ok(Some(s)) => match segments.get(&s.position.segment) {
                Some(&size) if size >= s.position.offset_bytes => Some(s),
                _ => {
                    out.snapshot_ignored = Some(format!(
                        "its journal position (segment {}, offset {}) is gone (compacted or damaged)",
                        s.position.segment, s.position.offset_bytes
                    ));
                    None
                }
            },
            Err(e) => {
                out.snapshot_ignored = Some(e.to_string());
                None
            }
        },
    };
    let mut messages: Found = HashMap::new();
    let from = match snapshot {
        Some(s) => {
            let position = s.position;
            load_snapshot(s, &live_uids, &mut out, &mut messages);
            Some(position)
        }
        None => None,
    };
    for (&n, &size) in &segments {
        out.next_segment = n + 1;
        // Snapshot entries may have counted live records in it already. A segment before
        // the snapshot's counts whole: it was full when the journal moved on.
        out.disk.index.segments.entry(n).or_default().bytes = size;
        let start_at = match from {
            Some(p) if n < p.segment => continue,
            Some(p) if n == p.segment => p.offset_bytes as usize,
            _ => SEGMENT_MAGIC.len(),
        };
        let holds = replay_segment(dir, n, start_at, &live_uids, &mut out, &mut messages)?;
        out.disk.index.segments.entry(n).or_default().bytes = holds;
    }
    // A snapshot entry whose segment is gone and that the tail did not move: lost (the
    // compactor syncs a copy before it deletes a segment, so this is damage, not a rule).
    let lost = out
        .disk
        .index
        .retain_segments(|n| segments.contains_key(&n));
    for key in &lost {
        messages.remove(key);
    }
    if !lost.is_empty() {
        out.damage.push(format!(
            "{} messages listed by the snapshot are in no segment any more; dropped",
            lost.len()
        ));
    }
    for ((uid, id), (message, expires)) in messages {
        out.messages
            .entry(uid)
            .or_default()
            .push((id, message, expires));
    }
    Ok(out)
}

/// Segment numbers and sizes in the journal directory.
fn list_segments(dir: &Path) -> Result<BTreeMap<u64, u64>, StoreError> {
    let journal = dir.join("journal");
    let listing = |e| StoreError::Io(format!("listing {}", journal.display()), e);
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(&journal).map_err(listing)? {
        let entry = entry.map_err(listing)?;
        let name = entry.file_name();
        if let Some(n) = name
            .to_str()
            .and_then(|n| n.strip_suffix(".seg"))
            .and_then(|n| n.parse::<u64>().ok())
        {
            let size = entry.metadata().map_err(listing)?.len();
            out.insert(n, size);
        }
    }
    Ok(out)
}

fn load_snapshot(s: Snapshot, live_uids: &HashSet<u64>, out: &mut Recovered, messages: &mut Found) {
    out.disk.producers = s.producers;
    out.disk.producers.retain(|uid, _| live_uids.contains(uid));
    for e in s.entries {
        if !live_uids.contains(&e.key.0) {
            continue;
        }
        match Record::decode_head(&e.head) {
            Ok(Record::Enqueued {
                expires_at_ms,
                message,
                ..
            }) => {
                messages.insert(e.key, (message, expires_at_ms));
                out.disk.index.add(e.key, e.at, Some(e.head.clone()));
                out.snapshot_records += 1;
            }
            Ok(_) | Err(_) => {
                // The checksum held, so the broker that wrote it wrote this: a bug, reported.
                out.damage.push(format!(
                    "snapshot entry for message {} of queue {:x} does not decode; dropped",
                    e.key.1, e.key.0
                ));
            }
        }
    }
}

/// Replays segment `n` from `start_at`; returns the bytes it holds (up to the zeros it was
/// written over, if any).
fn replay_segment(
    dir: &Path,
    n: u64,
    start_at: usize,
    live_uids: &HashSet<u64>,
    out: &mut Recovered,
    messages: &mut Found,
) -> Result<u64, StoreError> {
    let path = super::segment_path(dir, n);
    let data = Bytes::from(
        std::fs::read(&path)
            .map_err(|e| StoreError::Io(format!("reading {}", path.display()), e))?,
    );
    if data.len() < SEGMENT_MAGIC.len() || &data[..SEGMENT_MAGIC.len()] != SEGMENT_MAGIC {
        out.damage.push(format!(
            "{}: no segment header, {} bytes ignored",
            path.display(),
            data.len()
        ));
        return Ok(data.len() as u64);
    }
    let mut at = start_at;
    while at < data.len() {
        let (body, next) = match next_record(&data, at) {
            Ok(r) => r,
            // The zeros a segment was written over (`store::spare`): not damage.
            Err(DecodeError::End) => return Ok(at as u64),
            Err(e) => {
                out.damage.push(damage(&path, at, data.len(), &e));
                break;
            }
        };
        let record = match Record::decode(&body) {
            Ok(r) => r,
            Err(e) => {
                out.damage.push(damage(&path, at, data.len(), &e));
                break;
            }
        };
        out.records += 1;
        match record {
            // A transient body paged out before the restart: never comes back.
            Record::Paged { .. } => {}
            Record::Enqueued {
                uid,
                id,
                expires_at_ms,
                message,
            } => {
                if live_uids.contains(&uid) {
                    if let Some((producer, seq)) = producer_of(&message) {
                        out.disk
                            .producers
                            .entry(uid)
                            .or_default()
                            .note_number(producer, seq);
                    }
                    let head = Bytes::copy_from_slice(&body[..Record::head_len_of(&message)]);
                    messages.insert((uid, id), (message, expires_at_ms));
                    out.disk.index.add(
                        (uid, id),
                        Location {
                            segment: n,
                            offset_bytes: at as u64,
                            len_bytes: (next - at) as u64,
                        },
                        Some(head),
                    );
                }
            }
            Record::Removed { uid, ids } => {
                for id in ids {
                    messages.remove(&(uid, id));
                    out.disk.index.remove((uid, id));
                }
            }
            Record::Producers {
                uid,
                highest,
                replace,
            } => {
                if live_uids.contains(&uid) {
                    let table = out.disk.producers.entry(uid).or_default();
                    if replace {
                        *table = crate::core::producers::Producers::default();
                    }
                    table.note_all(&highest);
                }
            }
        }
        at = next;
    }
    Ok(data.len() as u64)
}

fn damage(path: &Path, at: usize, len: usize, e: &DecodeError) -> String {
    format!(
        "{}: {e} at offset {at}; dropped the last {} bytes of the segment",
        path.display(),
        len - at
    )
}
