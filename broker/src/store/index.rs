//! Where every live record of the journal is: the one map the writer, the compactor and the
//! body reader (flow-to-disk) share.
//!
//! A record is live while a queue holds its message: an `Enqueued` record until its removal,
//! a `Paged` record (a transient body moved out of memory) until its entry leaves. The writer
//! is the only one that changes the index, and never holds its lock during I/O; readers take
//! it for a lookup and read the file after letting go (an open descriptor keeps a segment
//! readable even after the compactor deleted its file).

use bytes::Bytes;
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A record's key: (queue incarnation uid, message id).
pub type RecordKey = (u64, u64);

/// Where a live record is: its segment, the offset of its header in the file, and its
/// framed length (header included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Segment number.
    pub segment: u64,
    /// Offset of the record's header in the segment file, in bytes.
    pub offset_bytes: u64,
    /// Framed record length (header and body), in bytes.
    pub len_bytes: u64,
}

/// What the journal knows about a segment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentInfo {
    /// File size.
    pub bytes: u64,
    /// Live records in it.
    pub live: u64,
}

/// A live record: where it is and, for an Enqueued record, its head (the record without the
/// message body, see [`crate::store::record::Record::head_len`]), which snapshots store.
#[derive(Debug)]
struct Live {
    at: Location,
    head: Option<Bytes>,
}

/// The live records and the segments that hold them.
#[derive(Debug, Default)]
pub struct LiveIndex {
    records: HashMap<RecordKey, Live>,
    /// Segments by number.
    pub segments: BTreeMap<u64, SegmentInfo>,
    live_bytes: u64,
    files: HashMap<u64, Arc<File>>,
}

impl LiveIndex {
    /// Records that `key` now lives at `at`, forgetting an older copy. `head` is the head of
    /// an Enqueued record (None for a page record, which no snapshot holds), in an allocation
    /// of its own (a recovered message's content header may share it).
    pub fn add(&mut self, key: RecordKey, at: Location, head: Option<Bytes>) {
        if let Some(old) = self.records.insert(key, Live { at, head }) {
            self.forget(old.at);
        }
        self.segments.entry(at.segment).or_default().live += 1;
        self.live_bytes += at.len_bytes;
    }

    /// The compactor copied live record `key` to `at`.
    pub fn relocate(&mut self, key: RecordKey, at: Location) {
        let live = self
            .records
            .get_mut(&key)
            .unwrap_or_else(|| panic!("relocating record {key:?}, which is not live"));
        let old = std::mem::replace(&mut live.at, at);
        self.forget(old);
        self.segments.entry(at.segment).or_default().live += 1;
        self.live_bytes += at.len_bytes;
    }

    /// Forgets `key`; returns whether it was live.
    pub fn remove(&mut self, key: RecordKey) -> bool {
        match self.records.remove(&key) {
            Some(old) => {
                self.forget(old.at);
                true
            }
            None => false,
        }
    }

    fn forget(&mut self, old: Location) {
        if let Some(s) = self.segments.get_mut(&old.segment) {
            assert!(s.live > 0, "segment {} live count underflow", old.segment);
            s.live -= 1;
        }
        self.live_bytes -= old.len_bytes;
    }

    /// Forgets every record whose queue uid fails `keep_uid`.
    pub fn retain_uids(&mut self, keep_uid: impl Fn(u64) -> bool) {
        let dead: Vec<RecordKey> = self
            .records
            .keys()
            .filter(|(uid, _)| !keep_uid(*uid))
            .copied()
            .collect();
        for key in dead {
            self.remove(key);
        }
    }

    /// Forgets every record in a segment that fails `exists`, and those segments; returns
    /// the keys forgotten.
    pub fn retain_segments(&mut self, exists: impl Fn(u64) -> bool) -> Vec<RecordKey> {
        let lost: Vec<RecordKey> = self
            .records
            .iter()
            .filter(|(_, l)| !exists(l.at.segment))
            .map(|(k, _)| *k)
            .collect();
        for key in &lost {
            self.remove(*key);
        }
        self.segments.retain(|n, _| exists(*n));
        lost
    }

    /// Where `key` is, when it is live.
    pub fn get(&self, key: RecordKey) -> Option<Location> {
        self.records.get(&key).map(|l| l.at)
    }

    /// Live Enqueued records with their locations and heads: what a snapshot holds.
    pub fn enqueued(&self) -> impl Iterator<Item = (RecordKey, Location, &[u8])> {
        self.records
            .iter()
            .filter_map(|(k, l)| Some((*k, l.at, l.head.as_deref()?)))
    }

    /// Framed bytes of all live records.
    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// Registers the open file of `segment` for readers.
    pub fn add_file(&mut self, segment: u64, file: Arc<File>) {
        self.files.insert(segment, file);
    }

    /// A segment was deleted: readers that hold its file keep reading it; new ones never
    /// find it, because no live record points there any more.
    pub fn remove_segment(&mut self, segment: u64) {
        self.segments.remove(&segment);
        self.files.remove(&segment);
    }

    /// The open file of `segment`.
    pub fn file(&self, segment: u64) -> Option<Arc<File>> {
        self.files.get(&segment).cloned()
    }
}

/// The index shared by the writer and the readers, with the sequence number of the last
/// submission the writer has processed, so that a reader looking for a record submitted but
/// not yet written can wait for it.
#[derive(Debug, Default)]
pub struct SharedIndex {
    /// The live records.
    pub index: Mutex<LiveIndex>,
    processed: Mutex<u64>,
    processed_changed: Condvar,
}

impl SharedIndex {
    /// Wraps a recovered index.
    pub fn new(index: LiveIndex) -> Arc<Self> {
        Arc::new(Self {
            index: Mutex::new(index),
            processed: Mutex::new(0),
            processed_changed: Condvar::new(),
        })
    }

    /// The writer has processed (written or dropped) every submission up to `seq`.
    pub fn set_processed(&self, seq: u64) {
        let mut p = self.processed.lock();
        assert!(
            seq >= *p,
            "processed sequence went back from {} to {seq}",
            *p
        );
        *p = seq;
        self.processed_changed.notify_all();
    }

    /// Waits until the writer has processed submission `seq`, at most `timeout`; returns
    /// whether it has.
    pub fn wait_processed(&self, seq: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut p = self.processed.lock();
        while *p < seq {
            if self
                .processed_changed
                .wait_until(&mut p, deadline)
                .timed_out()
            {
                return *p >= seq;
            }
        }
        true
    }
}
