//! The Raft log of one member: kept in memory for reads, and written through to its
//! [`Disk`] (when it has one) before openraft is told a write is done, so that a restarted
//! member is the same voter with the same log. Without a disk (tests of the old model) a
//! restart is a new member.
//!
//! Purging is held back to the member's durable snapshot (`purge_below`: one past its last
//! index, 0 without one): the entries after it are what a restart replays to the
//! application, so they stay until a newer snapshot the application has caught up with
//! replaces it (see `state_machine.rs`).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::RangeBounds;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{Entry, LogId, LogState, RaftLogReader, StorageError, StorageIOError, Vote};
use parking_lot::Mutex;

use super::disk::{Disk, LogOp, Recovered};
use super::types::{CpgTypes, MemberId};

#[derive(Default)]
struct Inner {
    last_purged: Option<LogId<MemberId>>,
    entries: BTreeMap<u64, Entry<CpgTypes>>,
    vote: Option<Vote<MemberId>>,
    committed: Option<LogId<MemberId>>,
}

/// The log; clones share it (openraft reads it from its replication tasks).
#[derive(Clone)]
pub(crate) struct LogStore {
    inner: Arc<Mutex<Inner>>,
    disk: Option<Arc<dyn Disk>>,
    /// One past the last index of the durable snapshot a restart would start from (0: none):
    /// only entries below it may be purged.
    purge_below: Arc<AtomicU64>,
}

impl LogStore {
    /// A log with nothing in it and no disk: a restart is a new member.
    pub fn in_memory() -> Self {
        Self {
            inner: Arc::default(),
            disk: None,
            purge_below: Arc::new(AtomicU64::new(u64::MAX)),
        }
    }

    /// The log `recovered` from `disk`, written through to it from now on; never purged past
    /// `purge_below`.
    pub fn durable(
        disk: Arc<dyn Disk>,
        recovered: &Recovered,
        purge_below: Arc<AtomicU64>,
    ) -> Self {
        let inner = Inner {
            last_purged: recovered.last_purged,
            entries: recovered.entries.clone(),
            vote: recovered.vote,
            committed: recovered.committed,
        };
        Self {
            inner: Arc::new(Mutex::new(inner)),
            disk: Some(disk),
            purge_below,
        }
    }

    /// The entries with indexes in `range`, for a restart's replay and the simulation.
    pub fn entries(&self, range: impl RangeBounds<u64>) -> Vec<Entry<CpgTypes>> {
        self.inner
            .lock()
            .entries
            .range(range)
            .map(|(_, e)| e.clone())
            .collect()
    }

    fn persist(&self, ops: &[LogOp]) -> Result<(), std::io::Error> {
        match &self.disk {
            Some(disk) => disk.write(ops),
            None => Ok(()),
        }
    }
}

impl RaftLogReader<CpgTypes> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<CpgTypes>>, StorageError<MemberId>> {
        Ok(self.entries(range))
    }
}

impl RaftLogStorage<CpgTypes> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<CpgTypes>, StorageError<MemberId>> {
        let inner = self.inner.lock();
        let last = inner.entries.values().next_back().map(|e| e.log_id);
        Ok(LogState {
            last_purged_log_id: inner.last_purged,
            last_log_id: last.or(inner.last_purged),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<MemberId>) -> Result<(), StorageError<MemberId>> {
        self.persist(&[LogOp::Vote(*vote)])
            .map_err(|e| StorageIOError::write_vote(&e))?;
        self.inner.lock().vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<MemberId>>, StorageError<MemberId>> {
        Ok(self.inner.lock().vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<MemberId>>,
    ) -> Result<(), StorageError<MemberId>> {
        self.persist(&[LogOp::Committed(committed)])
            .map_err(|e| StorageIOError::write(&e))?;
        self.inner.lock().committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<MemberId>>, StorageError<MemberId>> {
        Ok(self.inner.lock().committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<CpgTypes>,
    ) -> Result<(), StorageError<MemberId>>
    where
        I: IntoIterator<Item = Entry<CpgTypes>> + Send,
        I::IntoIter: Send,
    {
        let entries: Vec<Entry<CpgTypes>> = entries.into_iter().collect();
        let written = self.persist(&[LogOp::Append(entries.clone())]);
        if let Err(e) = written {
            let err = std::io::Error::new(e.kind(), e.to_string());
            callback.log_io_completed(Err(e));
            return Err(StorageIOError::write_logs(&err).into());
        }
        {
            let mut inner = self.inner.lock();
            for entry in entries {
                inner.entries.insert(entry.log_id.index, entry);
            }
        }
        callback.log_io_completed(Ok(()));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<MemberId>) -> Result<(), StorageError<MemberId>> {
        self.persist(&[LogOp::Truncate(log_id.index)])
            .map_err(|e| StorageIOError::write_logs(&e))?;
        let mut inner = self.inner.lock();
        inner.entries.split_off(&log_id.index);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<MemberId>) -> Result<(), StorageError<MemberId>> {
        let purge_below = self.purge_below.load(Ordering::Acquire);
        let upto = {
            let inner = self.inner.lock();
            if log_id.index < purge_below {
                Some(log_id)
            } else {
                // Only as far as the durable snapshot: the rest is a restart's replay.
                purge_below
                    .checked_sub(1)
                    .and_then(|last| inner.entries.get(&last))
                    .map(|e| e.log_id)
            }
            .filter(|upto| inner.last_purged.is_none_or(|p| p.index < upto.index))
        };
        let Some(upto) = upto else {
            return Ok(());
        };
        self.persist(&[LogOp::Purge(upto)])
            .map_err(|e| StorageIOError::write_logs(&e))?;
        let mut inner = self.inner.lock();
        inner.last_purged = Some(upto);
        let keep = inner.entries.split_off(&(upto.index + 1));
        inner.entries = keep;
        Ok(())
    }
}
