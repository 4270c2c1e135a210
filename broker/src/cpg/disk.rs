//! Where a member's consensus state survives a crash: its vote, its log, what it knows is
//! committed, and its newest snapshot. With it a restarted process is the *same* voter (it
//! cannot vote twice in a term, and the entries it acknowledged are still there), so a crash
//! is no longer a membership change.
//!
//! Two images of the same contract: [`DirDisk`] (files in the member's data directory, every
//! write fsynced before it returns) and, for the simulation, an in-memory image that outlives
//! the member that wrote it.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
#[cfg(test)]
use std::sync::Arc;

use openraft::{Entry, LogId, SnapshotMeta, Vote};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::types::{CpgTypes, MemberId};
use crate::atomic_file::write_atomically;

/// One durable change to the log state, in the order it happened.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum LogOp {
    /// The vote this member granted or holds.
    Vote(Vote<MemberId>),
    /// The newest index this member knows to be committed.
    Committed(Option<LogId<MemberId>>),
    /// Entries appended (replacing any at the same indexes).
    Append(Vec<Entry<CpgTypes>>),
    /// Entries from this index on are gone (a new leader overwrote them).
    Truncate(u64),
    /// Entries up to and including this one are gone (covered by the snapshot).
    Purge(LogId<MemberId>),
}

/// A snapshot as it is kept: openraft's metadata and the state machine bytes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct StoredSnapshot {
    /// What it covers.
    pub meta: SnapshotMeta<MemberId, openraft::BasicNode>,
    /// The encoded state machine.
    pub data: Vec<u8>,
}

/// Everything a member finds on its disk when it starts.
#[derive(Clone, Debug, Default)]
pub(crate) struct Recovered {
    /// The vote it last held.
    pub vote: Option<Vote<MemberId>>,
    /// The newest index it knew to be committed.
    pub committed: Option<LogId<MemberId>>,
    /// The newest entry it purged.
    pub last_purged: Option<LogId<MemberId>>,
    /// The entries after that.
    pub entries: BTreeMap<u64, Entry<CpgTypes>>,
    /// Its newest durable snapshot.
    pub snapshot: Option<StoredSnapshot>,
}

impl Recovered {
    /// Whether this member never took part in a cluster (nothing was ever written).
    pub fn is_empty(&self) -> bool {
        self.vote.is_none()
            && self.entries.is_empty()
            && self.last_purged.is_none()
            && self.snapshot.is_none()
    }

    /// Applies one change, as a restart replays the file.
    pub fn apply(&mut self, op: LogOp) {
        match op {
            LogOp::Vote(v) => self.vote = Some(v),
            LogOp::Committed(c) => self.committed = c,
            LogOp::Append(entries) => {
                for e in entries {
                    self.entries.insert(e.log_id.index, e);
                }
            }
            LogOp::Truncate(from) => {
                self.entries.split_off(&from);
            }
            LogOp::Purge(upto) => {
                self.entries = self.entries.split_off(&(upto.index + 1));
                self.last_purged = Some(upto);
            }
        }
    }

    /// The ops that rebuild this state from nothing (what a compaction writes).
    fn as_ops(&self) -> Vec<LogOp> {
        let mut ops = Vec::new();
        if let Some(v) = self.vote {
            ops.push(LogOp::Vote(v));
        }
        if let Some(p) = self.last_purged {
            ops.push(LogOp::Purge(p));
        }
        ops.push(LogOp::Committed(self.committed));
        if !self.entries.is_empty() {
            ops.push(LogOp::Append(self.entries.values().cloned().collect()));
        }
        ops
    }
}

/// Durable storage of one member's consensus state. Every method returns only once what it
/// was given would survive a crash of the process (and, for [`DirDisk`], of the machine).
pub(crate) trait Disk: Send + Sync + 'static {
    /// What is stored now.
    fn load(&self) -> io::Result<Recovered>;
    /// Records `ops` after everything recorded before.
    fn write(&self, ops: &[LogOp]) -> io::Result<()>;
    /// Replaces the stored snapshot.
    fn save_snapshot(&self, snapshot: &StoredSnapshot) -> io::Result<()>;
}

/// The simulation's disk: survives the member that wrote it, so a restarted member finds its
/// state as a real one would (everything written is "synced" the moment it is written).
#[cfg(test)]
#[derive(Clone, Default)]
pub(crate) struct MemDisk {
    image: Arc<Mutex<Recovered>>,
}

#[cfg(test)]
impl Disk for MemDisk {
    fn load(&self) -> io::Result<Recovered> {
        Ok(self.image.lock().clone())
    }

    fn write(&self, ops: &[LogOp]) -> io::Result<()> {
        let mut image = self.image.lock();
        for op in ops {
            image.apply(op.clone());
        }
        Ok(())
    }

    fn save_snapshot(&self, snapshot: &StoredSnapshot) -> io::Result<()> {
        self.image.lock().snapshot = Some(snapshot.clone());
        Ok(())
    }
}

/// File names inside the member's directory.
const LOG_FILE: &str = "raft.log";
const SNAPSHOT_FILE: &str = "snapshot";

/// A log file larger than this is rewritten with only the live state at the next purge.
const COMPACT_AT_BYTES: u64 = 16 << 20;

/// The member's consensus state in a directory: `raft.log`, an append-only file of
/// length- and checksum-framed [`LogOp`]s (a torn last record, from a crash mid-write, is
/// dropped on load), and `snapshot`, replaced atomically.
pub(crate) struct DirDisk {
    dir: PathBuf,
    log: Mutex<LogFile>,
}

struct LogFile {
    file: File,
    len: u64,
    /// What the file holds, kept to rewrite it compactly.
    state: Recovered,
}

impl DirDisk {
    /// Opens (creating if needed) the state in `dir`.
    pub fn open(dir: &Path) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(LOG_FILE);
        let (state, good_len) = read_log(&path)?;
        let file = OpenOptions::new()
            .create(true)
            .read(true)
            .write(true)
            .truncate(false)
            .open(&path)?;
        // Drops a torn tail so that new records follow the last whole one.
        file.set_len(good_len)?;
        file.sync_all()?;
        let mut file = file;
        std::io::Seek::seek(&mut file, io::SeekFrom::End(0))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            log: Mutex::new(LogFile {
                file,
                len: good_len,
                state,
            }),
        })
    }

    /// Rewrites the log file with only the live state, atomically.
    fn compact(&self, log: &mut LogFile) -> io::Result<()> {
        let mut bytes = Vec::new();
        for op in log.state.as_ops() {
            frame(&op, &mut bytes)?;
        }
        write_atomically(&self.dir, LOG_FILE, &bytes)?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.dir.join(LOG_FILE))?;
        std::io::Seek::seek(&mut file, io::SeekFrom::End(0))?;
        log.file = file;
        log.len = bytes.len() as u64;
        Ok(())
    }
}

impl Disk for DirDisk {
    fn load(&self) -> io::Result<Recovered> {
        let mut state = self.log.lock().state.clone();
        let path = self.dir.join(SNAPSHOT_FILE);
        state.snapshot = match std::fs::read(&path) {
            Ok(bytes) => Some(postcard::from_bytes(&bytes).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{} is damaged: {e}", path.display()),
                )
            })?),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        Ok(state)
    }

    fn write(&self, ops: &[LogOp]) -> io::Result<()> {
        let mut bytes = Vec::new();
        for op in ops {
            frame(op, &mut bytes)?;
        }
        let mut log = self.log.lock();
        log.file.write_all(&bytes)?;
        log.file.sync_data()?;
        log.len += bytes.len() as u64;
        let mut purged = false;
        for op in ops {
            purged |= matches!(op, LogOp::Purge(_));
            log.state.apply(op.clone());
        }
        if purged && log.len > COMPACT_AT_BYTES {
            self.compact(&mut log)?;
        }
        Ok(())
    }

    fn save_snapshot(&self, snapshot: &StoredSnapshot) -> io::Result<()> {
        let bytes = postcard::to_stdvec(snapshot).map_err(io::Error::other)?;
        write_atomically(&self.dir, SNAPSHOT_FILE, &bytes)
    }
}

/// Appends `op` to `out` as `[len u32 le][crc32 u32 le][postcard bytes]`.
fn frame(op: &LogOp, out: &mut Vec<u8>) -> io::Result<()> {
    let body = postcard::to_stdvec(op).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(())
}

/// Replays the log file; returns the state and the length of its whole-record prefix.
fn read_log(path: &Path) -> io::Result<(Recovered, u64)> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut state = Recovered::default();
    let mut at = 0usize;
    while let Some((op, next)) = unframe(&bytes, at) {
        state.apply(op);
        at = next;
    }
    if at < bytes.len() {
        tracing::warn!(
            path = %path.display(),
            dropped_bytes = bytes.len() - at,
            "consensus log ends in a torn record (a crash mid-write); dropping it"
        );
    }
    Ok((state, at as u64))
}

/// The record at `at`, if a whole, intact one starts there.
fn unframe(bytes: &[u8], at: usize) -> Option<(LogOp, usize)> {
    let header = bytes.get(at..at + 8)?;
    let len = u32::from_le_bytes(header[..4].try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(header[4..].try_into().ok()?);
    let body = bytes.get(at + 8..at + 8 + len)?;
    if crc32fast::hash(body) != crc {
        return None;
    }
    let op = postcard::from_bytes(body).ok()?;
    Some((op, at + 8 + len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, EntryPayload};

    /// A fresh directory of this test's own (removed at the start, left for inspection).
    fn test_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("ringmq-cpg-disk-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn entry(index: u64) -> Entry<CpgTypes> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 7), index),
            payload: EntryPayload::Blank,
        }
    }

    #[test]
    fn a_reopened_directory_holds_what_was_written_and_drops_a_torn_tail() {
        let dir = test_dir("torn");
        {
            let disk = DirDisk::open(&dir).unwrap();
            disk.write(&[
                LogOp::Vote(Vote::new(3, 7)),
                LogOp::Append((1..=5).map(entry).collect()),
            ])
            .unwrap();
            disk.write(&[LogOp::Truncate(5), LogOp::Purge(entry(2).log_id)])
                .unwrap();
        }
        let path = dir.join(LOG_FILE);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&[9, 0, 0, 0, 1, 2]).unwrap();
        drop(f);
        let disk = DirDisk::open(&dir).unwrap();
        let got = disk.load().unwrap();
        assert_eq!(got.vote, Some(Vote::new(3, 7)));
        assert_eq!(got.entries.keys().copied().collect::<Vec<_>>(), vec![3, 4]);
        assert_eq!(got.last_purged.map(|l| l.index), Some(2));
        // Writing after the torn tail was dropped is read back too.
        disk.write(&[LogOp::Append(vec![entry(5)])]).unwrap();
        drop(disk);
        let got = DirDisk::open(&dir).unwrap().load().unwrap();
        assert_eq!(
            got.entries.keys().copied().collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
    }

    #[test]
    fn compaction_keeps_the_live_state() {
        let dir = test_dir("compact");
        let disk = DirDisk::open(&dir).unwrap();
        disk.write(&[LogOp::Append((1..=10).map(entry).collect())])
            .unwrap();
        let mut log = disk.log.lock();
        log.state.apply(LogOp::Purge(entry(8).log_id));
        disk.compact(&mut log).unwrap();
        drop(log);
        drop(disk);
        let got = DirDisk::open(&dir).unwrap().load().unwrap();
        assert_eq!(got.entries.keys().copied().collect::<Vec<_>>(), vec![9, 10]);
        assert_eq!(got.last_purged.map(|l| l.index), Some(8));
    }
}
