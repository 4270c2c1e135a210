//! The Raft log of one member, kept in memory. CPG state is deliberately not persistent: a
//! restarted process is a new member (new [`super::MemberId`]) and catches up from the others,
//! so it never needs its old log and can never vote twice in one term.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::RangeBounds;
use std::sync::Arc;

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{Entry, LogId, LogState, RaftLogReader, StorageError, Vote};
use parking_lot::Mutex;

use super::types::{CpgTypes, MemberId};

#[derive(Default)]
struct Inner {
    last_purged: Option<LogId<MemberId>>,
    entries: BTreeMap<u64, Entry<CpgTypes>>,
    vote: Option<Vote<MemberId>>,
    committed: Option<LogId<MemberId>>,
}

/// In-memory log; clones share the same log (openraft reads it from its replication tasks).
#[derive(Clone, Default)]
pub(crate) struct LogStore {
    inner: Arc<Mutex<Inner>>,
}

impl RaftLogReader<CpgTypes> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<CpgTypes>>, StorageError<MemberId>> {
        let inner = self.inner.lock();
        Ok(inner.entries.range(range).map(|(_, e)| e.clone()).collect())
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
        let mut inner = self.inner.lock();
        inner.entries.split_off(&log_id.index);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<MemberId>) -> Result<(), StorageError<MemberId>> {
        let mut inner = self.inner.lock();
        assert!(
            inner.last_purged.map(|p| p.index) <= Some(log_id.index),
            "purge must only move forward"
        );
        inner.last_purged = Some(log_id);
        let keep = inner.entries.split_off(&(log_id.index + 1));
        inner.entries = keep;
        Ok(())
    }
}
