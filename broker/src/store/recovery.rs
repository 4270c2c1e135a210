//! Recovery: the durable wiring from `wiring.json`, then every segment in order, keeping the
//! messages that were enqueued and not removed. A damaged record (torn at the tail after a
//! crash, or corrupted) ends the reading of its segment: everything before it is kept, what
//! was dropped is reported, and nothing half-written is ever served.

use super::index::{Location, SegmentInfo};
use super::journal::DiskState;
use super::record::{DecodeError, Record, next_record};
use super::{SEGMENT_MAGIC, StoreError, read_wiring_file};
use crate::core::Message;
use bytes::Bytes;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

/// A message to put back: (id, message, expiry).
pub type RecoveredMessage = (u64, Arc<Message>, Option<u64>);

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
    /// Records read.
    pub records: u64,
}

/// Reads the data directory.
pub fn recover(dir: &Path) -> Result<Recovered, StoreError> {
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
    let journal = dir.join("journal");
    let mut numbers = Vec::new();
    for entry in std::fs::read_dir(&journal)
        .map_err(|e| StoreError::Io(format!("listing {}", journal.display()), e))?
    {
        let entry =
            entry.map_err(|e| StoreError::Io(format!("listing {}", journal.display()), e))?;
        let name = entry.file_name();
        if let Some(n) = name
            .to_str()
            .and_then(|n| n.strip_suffix(".seg"))
            .and_then(|n| n.parse::<u64>().ok())
        {
            numbers.push(n);
        }
    }
    numbers.sort_unstable();
    let mut messages: HashMap<(u64, u64), (Arc<Message>, Option<u64>)> = HashMap::new();
    for n in numbers {
        out.next_segment = n + 1;
        let path = super::segment_path(dir, n);
        let data = Bytes::from(
            std::fs::read(&path)
                .map_err(|e| StoreError::Io(format!("reading {}", path.display()), e))?,
        );
        out.disk.index.segments.insert(
            n,
            SegmentInfo {
                bytes: data.len() as u64,
                live: 0,
            },
        );
        if data.len() < SEGMENT_MAGIC.len() || &data[..SEGMENT_MAGIC.len()] != SEGMENT_MAGIC {
            out.damage.push(format!(
                "{}: no segment header, {} bytes ignored",
                path.display(),
                data.len()
            ));
            continue;
        }
        let mut at = SEGMENT_MAGIC.len();
        while at < data.len() {
            let (body, next) = match next_record(&data, at) {
                Ok(r) => r,
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
                        messages.insert((uid, id), (message, expires_at_ms));
                        out.disk.index.add(
                            (uid, id),
                            Location {
                                segment: n,
                                offset_bytes: at as u64,
                                len_bytes: (next - at) as u64,
                            },
                        );
                    }
                }
                Record::Removed { uid, ids } => {
                    for id in ids {
                        messages.remove(&(uid, id));
                        out.disk.index.remove((uid, id));
                    }
                }
            }
            at = next;
        }
    }
    for ((uid, id), (message, expires)) in messages {
        out.messages
            .entry(uid)
            .or_default()
            .push((id, message, expires));
    }
    Ok(out)
}

fn damage(path: &Path, at: usize, len: usize, e: &DecodeError) -> String {
    format!(
        "{}: {e} at offset {at}; dropped the last {} bytes of the segment",
        path.display(),
        len - at
    )
}
