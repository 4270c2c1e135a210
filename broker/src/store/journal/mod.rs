//! The journal: one per broker, in segment files, written by one thread with group commit.
//!
//! Connections submit records (and durable-wiring changes) in the order their vhost produced
//! them; the writer thread takes everything queued, drops pairs that cancel out ("no write
//! on fast consume": a message acked before its enqueue reached disk is never written),
//! writes the rest with one `write`, calls `fdatasync` once when the batch holds what a
//! confirm waits for, and publishes the sequence number up to which everything is as durable
//! as promised (a removal, or what a backup applied, is written and synced soon after).
//! Connections hold confirms (and replies to durable declarations) until that number covers
//! them.
//!
//! Space: every persistent message on disk is tracked as live until removed. When the
//! journal holds more than twice the live bytes (plus two segments), the oldest segment is
//! compacted: its live records are copied to the head and the file is deleted — one segment
//! per cycle, so the I/O it adds is bounded and a slow consumer's few messages never pin
//! old segments.
//!
//! This file is the handle connections use; the writer is `writer.rs` (its loop and group
//! commit), `plan.rs` (one commit's records and their cancelling), `segments.rs` (the files),
//! `snapshots.rs` and `compaction.rs`.

mod compaction;
mod plan;
mod segments;
mod snapshots;
mod writer;

use writer::Writer;

use super::index::{LiveIndex, RecordKey, SharedIndex};
use super::record::Record;
use super::{StoreError, segment_path};
use crate::core::producers::Producers;
use crate::core::wiring::Wiring;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};

/// Journal tuning (config keys `journal_*`).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JournalConfig {
    /// Size at which the writer starts a new segment file.
    pub segment_bytes: u64,
    /// Most bytes written per group commit.
    pub max_batch_bytes: usize,
    /// How long the writer waits for more records after the first of a batch, in µs. 0 =
    /// write as soon as records arrive; batches still form while a sync is in progress.
    pub max_delay_us: u64,
    /// A snapshot of the queue indexes is written after this many Enqueued and Removed
    /// records (0 = not by count). Bounds how much journal recovery replays.
    pub snapshot_every_records: u64,
    /// A snapshot is written when this much time passed since the last one and records were
    /// written since, in ms (0 = not by time). One is always written at a clean shutdown.
    pub snapshot_interval_ms: u64,
    /// Write segments over zeros prepared ahead by a thread of their own, which halves the
    /// time of each sync on ext4 (`store::spare`); off, segments grow as they are written
    /// (for storage where writing zeros ahead costs, such as thin-provisioned volumes).
    pub preallocate: bool,
    /// How long a removal (an ack) may stay written but not synced, in ms. It is written at
    /// once, which a crash of the broker cannot undo, and synced by the next commit that
    /// syncs anyway or after this long: only a failure of the machine within that time can
    /// bring an acked message back, marked redelivered. An ack gets no answer in AMQP, so no
    /// client waits for this sync; a commit of acks alone no longer takes one (0 = sync
    /// every commit of removals at once).
    pub removals_sync_ms: u64,
    /// How long what a backup applied from its primary's replication stream may stay written
    /// but not synced, in ms. The backup acknowledges a frame once its records are written
    /// (in the kernel: a crash of any set of broker processes cannot undo them) and syncs
    /// them by the next commit that syncs anyway or after this long; the primary syncs
    /// before it confirms either way. A confirm then waits for one sync instead of the
    /// primary's and every backup's one after another (`docs/replication.md` says what a
    /// failure of machines, not processes, can cost inside this window; 0 = a backup syncs
    /// before it acknowledges).
    pub replica_sync_ms: u64,
}

impl Default for JournalConfig {
    fn default() -> Self {
        Self {
            segment_bytes: 16 * 1024 * 1024,
            max_batch_bytes: 4 * 1024 * 1024,
            max_delay_us: 0,
            snapshot_every_records: 250_000,
            snapshot_interval_ms: 60_000,
            preallocate: true,
            removals_sync_ms: 25,
            replica_sync_ms: 25,
        }
    }
}

/// Work for the writer.
#[derive(Debug)]
pub enum Job {
    /// Records of durable queues, in the order the vhost produced them.
    Records(Vec<Record>),
    /// Records of durable queues this member is a backup of, from the replication stream:
    /// synced within `replica_sync_ms` rather than by the commit that writes them.
    Replica(Vec<Record>),
    /// The durable wiring of one vhost changed; this is all of it now.
    Wiring {
        /// Vhost name.
        vhost: String,
        /// Its durable wiring.
        wiring: Wiring,
    },
    /// Syncs everything written before it, whatever its records promised: a member that
    /// became a queue's primary syncs what it wrote as the queue's backup (synced within
    /// `replica_sync_ms` until then) before its copy is the one every later confirm, and a
    /// catch-up of the old primary, counts on.
    Sync,
    /// A vhost was deleted with everything in it.
    VhostDeleted {
        /// Vhost name.
        vhost: String,
    },
    /// Page records whose messages left their queues, and queues (by uid) whose page records
    /// all go: forgotten, never written (recovery ignores page records anyway).
    Release {
        /// (queue uid, message id) of page records.
        pages: Vec<RecordKey>,
        /// Queue uids.
        queues: Vec<u64>,
    },
}

/// Counters of the journal's work, read by metrics and benchmarks.
#[derive(Debug)]
pub struct JournalStats {
    /// Distribution of fdatasync durations, in seconds (one observation per sync).
    pub fsync_seconds: prometheus_client::metrics::histogram::Histogram,
    /// fdatasync calls.
    pub fsyncs: AtomicU64,
    /// Total µs spent in fdatasync.
    pub fsync_micros: AtomicU64,
    /// Records written (copies by the compactor not included).
    pub records_written: AtomicU64,
    /// Enqueue records never written because the message was gone before its batch.
    pub records_cancelled: AtomicU64,
    /// Bytes written, compaction included.
    pub bytes_written: AtomicU64,
    /// Segments compacted and deleted.
    pub segments_compacted: AtomicU64,
    /// Page records written (flow-to-disk of transient bodies), included in `records_written`.
    pub pages_written: AtomicU64,
    /// Bodies read back for delivery or dead-lettering (flow-to-disk).
    pub bodies_read: AtomicU64,
    /// Snapshots of the queue indexes written.
    pub snapshots_written: AtomicU64,
    /// Body bytes of Enqueued and Paged records submitted and not yet written: what tells a
    /// publisher that outruns the writer to slow down (see [`Journal::body_bytes_in_flight`]).
    pub body_bytes_in_flight: AtomicU64,
}

impl Default for JournalStats {
    fn default() -> Self {
        Self {
            // 50 µs .. ~1.6 s: a fast NVMe sync to a disk in trouble.
            fsync_seconds: prometheus_client::metrics::histogram::Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.000_05, 2.0, 16),
            ),
            fsyncs: AtomicU64::new(0),
            fsync_micros: AtomicU64::new(0),
            records_written: AtomicU64::new(0),
            records_cancelled: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            segments_compacted: AtomicU64::new(0),
            pages_written: AtomicU64::new(0),
            bodies_read: AtomicU64::new(0),
            snapshots_written: AtomicU64::new(0),
            body_bytes_in_flight: AtomicU64::new(0),
        }
    }
}

/// The journal's state on disk, as recovery found it and the writer continues it.
#[derive(Debug, Default)]
pub struct DiskState {
    /// Live records and segments.
    pub index: LiveIndex,
    /// Durable wiring per vhost.
    pub wiring: BTreeMap<String, Wiring>,
    /// Per durable queue uid, the session producers' highest numbers.
    pub producers: ProducerTables,
}

/// Per durable queue uid, the highest number each session producer reached it with, as the
/// journal keeps it beyond the messages themselves: a session's client resends what it had
/// no confirm for after a restart of the whole cluster, and a queue that lost the table with
/// the consumed messages would enqueue the resend a second time (B15 in
/// docs/reliability.md).
pub type ProducerTables = HashMap<u64, Producers>;

struct Submitter {
    next_seq: u64,
    tx: Option<Sender<(u64, Job)>>,
}

/// Handle to the journal: submit work, learn what is durable.
pub struct Journal {
    submitter: Mutex<Submitter>,
    synced: Arc<tokio::sync::watch::Sender<u64>>,
    index: Arc<SharedIndex>,
    /// Counters.
    pub stats: Arc<JournalStats>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("synced", &*self.synced.borrow())
            .finish()
    }
}

impl Journal {
    /// Starts the writer thread on a recovered disk state; new records go to segment
    /// `next_segment` and later.
    pub fn start(
        dir: PathBuf,
        config: JournalConfig,
        state: DiskState,
        next_segment: u64,
    ) -> Result<Self, StoreError> {
        let (tx, rx) = channel();
        let synced = Arc::new(tokio::sync::watch::Sender::new(0));
        let stats = Arc::new(JournalStats::default());
        let DiskState {
            mut index,
            wiring,
            producers,
        } = state;
        let segments: Vec<u64> = index.segments.keys().copied().collect();
        for number in segments {
            let path = segment_path(&dir, number);
            let file = File::open(&path)
                .map_err(|e| StoreError::Io(format!("opening {}", path.display()), e))?;
            index.add_file(number, Arc::new(file));
        }
        let index = SharedIndex::new(index);
        let mut writer = Writer::new(
            dir,
            config,
            (wiring, producers),
            index.clone(),
            next_segment,
            rx,
            synced.clone(),
            stats.clone(),
        )?;
        let thread = std::thread::Builder::new()
            .name("ringmq-journal".into())
            .spawn(move || writer.run())
            .map_err(|e| StoreError::Io("starting the journal thread".into(), e))?;
        Ok(Self {
            submitter: Mutex::new(Submitter {
                next_seq: 1,
                tx: Some(tx),
            }),
            synced,
            index,
            stats,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The live-record index, for reading bodies back (flow-to-disk).
    pub fn index(&self) -> &Arc<SharedIndex> {
        &self.index
    }

    /// Queues work for the writer and returns its sequence number: it is as durable as its
    /// records promise once [`Journal::synced`] reaches it. Call it in the order the vhost produced the work.
    pub fn submit(&self, job: Job) -> u64 {
        let bytes = body_bytes(&job);
        if bytes > 0 {
            self.stats
                .body_bytes_in_flight
                .fetch_add(bytes, Ordering::Relaxed);
        }
        let mut s = self.submitter.lock();
        let seq = s.next_seq;
        s.next_seq += 1;
        if let Some(tx) = &s.tx {
            // A closed channel means the writer died, which already ended the process.
            let _ = tx.send((seq, job));
        }
        seq
    }

    /// Body bytes of Enqueued and Paged records submitted and not yet written. Flow-to-disk
    /// frees a body only once its record is written, and transient messages are confirmed
    /// without waiting for the journal: a publisher is paced while this is high, so the
    /// writer's queue cannot become the memory the budget was meant to save.
    pub fn body_bytes_in_flight(&self) -> u64 {
        self.stats.body_bytes_in_flight.load(Ordering::Relaxed)
    }

    /// The sequence number of the last submission (0 before the first).
    pub fn last_submitted(&self) -> u64 {
        self.submitter.lock().next_seq - 1
    }

    /// Watches the sequence number up to which everything submitted is as durable as it is
    /// promised to be: enqueues and wiring synced, removals written (synced within
    /// `removals_sync_ms`), a backup's records written (synced within `replica_sync_ms`),
    /// page records written.
    pub fn synced(&self) -> tokio::sync::watch::Receiver<u64> {
        self.synced.subscribe()
    }

    /// Writes what is queued and stops the writer (clean shutdown), logging what the journal
    /// did over its life.
    pub fn shutdown(&self) {
        self.submitter.lock().tx = None;
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
            let s = &self.stats;
            let fsyncs = s.fsyncs.load(Ordering::Relaxed);
            let written = s.records_written.load(Ordering::Relaxed);
            tracing::info!(
                fsyncs,
                records_written = written,
                records_cancelled = s.records_cancelled.load(Ordering::Relaxed),
                records_per_fsync = if fsyncs == 0 {
                    0.0
                } else {
                    written as f64 / fsyncs as f64
                },
                mean_fsync_us = s
                    .fsync_micros
                    .load(Ordering::Relaxed)
                    .checked_div(fsyncs)
                    .unwrap_or(0),
                bytes_written = s.bytes_written.load(Ordering::Relaxed),
                segments_compacted = s.segments_compacted.load(Ordering::Relaxed),
                pages_written = s.pages_written.load(Ordering::Relaxed),
                bodies_read = s.bodies_read.load(Ordering::Relaxed),
                snapshots_written = s.snapshots_written.load(Ordering::Relaxed),
                "journal closed"
            );
        }
    }
}

/// Body bytes of the Enqueued and Paged records in `job`.
fn body_bytes(job: &Job) -> u64 {
    match job {
        Job::Records(records) | Job::Replica(records) => records
            .iter()
            .map(|r| match r {
                Record::Paged { message, .. } | Record::Enqueued { message, .. } => {
                    message.body_len() as u64
                }
                Record::Removed { .. } | Record::Producers { .. } => 0,
            })
            .sum(),
        _ => 0,
    }
}
