//! One group commit being planned: its records in order, and the cancelling of a message's
//! enqueue by its removal in the same batch ("no write on fast consume").

use crate::core::producers::producer_of;
use crate::store::index::RecordKey;
use crate::store::record::Record;
use bytes::Bytes;
use std::collections::HashMap;
use std::time::Duration;

/// A record appended by a commit: its key, offset in the batch, length and head (see
/// [`LiveIndex::add`]).
pub(super) type Written = (RecordKey, u64, u64, Option<Bytes>);

/// When a written record must be synced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SyncBy {
    /// By the commit that writes it: a confirm, a reply or a wiring change waits for it.
    Now,
    /// Within this long (`removals_sync_ms`, `replica_sync_ms`): it is written at once, which
    /// a crash of the broker cannot undo, and nothing waits for its sync.
    Within(Duration),
    /// Never for its own sake: a page record, nothing in it must survive a crash.
    Never,
}

impl SyncBy {
    /// `Within(ms)`, or `Now` for 0 (the setting that turns the delay off).
    pub(super) fn within_ms(ms: u64) -> Self {
        if ms == 0 {
            Self::Now
        } else {
            Self::Within(Duration::from_millis(ms))
        }
    }
}

/// One record of a batch, kept until the batch is written (or cancelled by a removal in the
/// same batch).
pub(super) struct Pending {
    pub(super) record: Record,
    /// When it must be synced once written.
    pub(super) sync: SyncBy,
}

impl Pending {
    /// Whether it must survive a crash (an Enqueued, Producers or Removed); a Paged record
    /// need not.
    pub(super) fn durable(&self) -> bool {
        self.sync != SyncBy::Never
    }
}

/// One group commit being assembled: the records to write, in order (a record cancelled
/// later in the same batch becomes `None`), where each message's record sits, and what else
/// the batch changes.
#[derive(Default)]
pub(super) struct BatchPlan {
    pub(super) records: Vec<Option<Pending>>,
    pub(super) pending: HashMap<RecordKey, usize>,
    pub(super) wiring_changed: bool,
    /// A [`super::Job::Sync`] is in the batch: it syncs whatever is written.
    pub(super) barrier: bool,
    pub(super) released: Vec<RecordKey>,
    pub(super) released_queues: Vec<u64>,
}

impl BatchPlan {
    /// Adds a message's record.
    pub(super) fn push(&mut self, key: RecordKey, record: Record, sync: SyncBy) {
        self.pending.insert(key, self.records.len());
        self.records.push(Some(Pending { record, sync }));
    }

    /// Cancels the record of a message this batch would write; false if it has none. An
    /// enqueue numbered by a session producer leaves a Producers record in its place, so
    /// that its number outlives it exactly where the enqueue stood (before or after a
    /// replaced table, B18), synced as the enqueue would have been.
    pub(super) fn cancel(&mut self, key: RecordKey) -> bool {
        match self.pending.remove(&key) {
            Some(at) => {
                let kept = match self.records[at].take() {
                    Some(Pending {
                        record: Record::Enqueued { uid, message, .. },
                        sync,
                    }) => producer_of(&message).map(|(producer, seq)| Pending {
                        record: Record::Producers {
                            uid,
                            highest: vec![(producer.into(), seq)],
                            replace: false,
                        },
                        sync,
                    }),
                    _ => None,
                };
                self.records[at] = kept;
                true
            }
            None => false,
        }
    }

    /// Drops every record this batch holds for the queues `dead` picks.
    pub(super) fn drop_queues(&mut self, dead: impl Fn(u64) -> bool) {
        let records = &mut self.records;
        self.pending.retain(|&(uid, _), at| {
            let drop = dead(uid);
            if drop {
                records[*at] = None;
            }
            !drop
        });
    }

    /// Released pages and queues: their records in this batch go unwritten, the index forgets
    /// what was written before.
    pub(super) fn release(&mut self, pages: Vec<RecordKey>, queues: Vec<u64>) {
        for key in pages {
            if !self.cancel(key) {
                self.released.push(key);
            }
        }
        for uid in queues {
            self.drop_queues(|u| u == uid);
            self.released_queues.push(uid);
        }
    }
}
