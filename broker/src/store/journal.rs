//! The journal: one per broker, in segment files, written by one thread with group commit.
//!
//! Connections submit records (and durable-wiring changes) in the order their vhost produced
//! them; the writer thread takes everything queued, drops pairs that cancel out ("no write
//! on fast consume": a message acked before its enqueue reached disk is never written),
//! writes the rest with one `write`, calls `fdatasync` once, and publishes the sequence
//! number up to which everything is durable. Connections hold confirms (and replies to
//! durable declarations) until that number covers them.
//!
//! Space: every persistent message on disk is tracked as live until removed. When the
//! journal holds more than twice the live bytes (plus two segments), the oldest segment is
//! compacted: its live records are copied to the head and the file is deleted — one segment
//! per cycle, so the I/O it adds is bounded and a slow consumer's few messages never pin
//! old segments.

use super::index::{LiveIndex, Location, RecordKey, SegmentInfo, SharedIndex};
use super::record::{RECORD_HEADER, Record, next_record};
use super::snapshot::{self, Position, SnapshotError};
use super::spare::Spares;
use super::{SEGMENT_MAGIC, StoreError, segment_path, write_wiring_file};
use crate::core::producers::{Producers, producer_of};
use crate::core::wiring::Wiring;
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError, channel};
use std::time::{Duration, Instant};

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
        }
    }
}

/// Work for the writer.
#[derive(Debug)]
pub enum Job {
    /// Records of durable queues, in the order the vhost produced them.
    Records(Vec<Record>),
    /// The durable wiring of one vhost changed; this is all of it now.
    Wiring {
        /// Vhost name.
        vhost: String,
        /// Its durable wiring.
        wiring: Wiring,
    },
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

    /// Queues work for the writer and returns its sequence number: it is durable once
    /// [`Journal::synced`] reaches it. Call it in the order the vhost produced the work.
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

    /// Watches the sequence number up to which everything submitted is durable.
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

struct Writer {
    dir: PathBuf,
    config: JournalConfig,
    wiring: BTreeMap<String, Wiring>,
    index: Arc<SharedIndex>,
    current: u64,
    /// Size of the current segment file, in bytes.
    current_bytes: u64,
    file: File,
    rx: Receiver<(u64, Job)>,
    synced: Arc<tokio::sync::watch::Sender<u64>>,
    stats: Arc<JournalStats>,
    live_uids: HashSet<u64>,
    /// The producer tables of the live queues, from every Enqueued record planned (written
    /// or cancelled): written whole before a segment is deleted and in every snapshot.
    producers: ProducerTables,
    buf: Vec<u8>,
    snapshots: Snapshots,
    /// Zero-filled files to start segments in (`None` with `preallocate` off, or when the
    /// thread could not be started).
    spares: Option<Spares>,
}

/// The writer's snapshot bookkeeping.
struct Snapshots {
    /// Enqueued and Removed records written since the last snapshot was taken.
    records_since: u64,
    taken_at: Instant,
    /// Position of the last snapshot taken; the compactor deleting its segment makes it
    /// useless and a new one due.
    position: Option<Position>,
    stale: bool,
    /// The thread writing the last one, if it may still run.
    thread: Option<std::thread::JoinHandle<Result<(), SnapshotError>>>,
    /// Bytes appended to the current segment since its last sync.
    unsynced: bool,
}

/// A record appended by a commit: its key, offset in the batch, length and head (see
/// [`LiveIndex::add`]).
type Written = (RecordKey, u64, u64, Option<Bytes>);

/// One record of a batch, kept until the batch is written (or cancelled by a removal in the
/// same batch).
struct Pending {
    record: Record,
    /// Whether it must reach disk before a confirm (an Enqueued); a Paged record need not.
    durable: bool,
}

/// One group commit being assembled: the records to write, in order (a record cancelled
/// later in the same batch becomes `None`), where each message's record sits, and what else
/// the batch changes.
#[derive(Default)]
struct BatchPlan {
    records: Vec<Option<Pending>>,
    pending: HashMap<RecordKey, usize>,
    wiring_changed: bool,
    removals: bool,
    released: Vec<RecordKey>,
    released_queues: Vec<u64>,
}

impl BatchPlan {
    /// Adds a message's record.
    fn push(&mut self, key: RecordKey, record: Record, durable: bool) {
        self.pending.insert(key, self.records.len());
        self.records.push(Some(Pending { record, durable }));
    }

    /// Cancels the record of a message this batch would write; false if it has none. An
    /// enqueue numbered by a session producer leaves a Producers record in its place, so
    /// that its number outlives it exactly where the enqueue stood (before or after a
    /// replaced table, B18).
    fn cancel(&mut self, key: RecordKey) -> bool {
        match self.pending.remove(&key) {
            Some(at) => {
                let kept = match self.records[at].take() {
                    Some(Pending {
                        record: Record::Enqueued { uid, message, .. },
                        ..
                    }) => producer_of(&message).map(|(producer, seq)| Pending {
                        record: Record::Producers {
                            uid,
                            highest: vec![(producer.into(), seq)],
                            replace: false,
                        },
                        durable: true,
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
    fn drop_queues(&mut self, dead: impl Fn(u64) -> bool) {
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
    fn release(&mut self, pages: Vec<RecordKey>, queues: Vec<u64>) {
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

impl Writer {
    #[allow(clippy::too_many_arguments)]
    fn new(
        dir: PathBuf,
        config: JournalConfig,
        (wiring, producers): (BTreeMap<String, Wiring>, ProducerTables),
        index: Arc<SharedIndex>,
        next_segment: u64,
        rx: Receiver<(u64, Job)>,
        synced: Arc<tokio::sync::watch::Sender<u64>>,
        stats: Arc<JournalStats>,
    ) -> Result<Self, StoreError> {
        let spares = if config.preallocate {
            Spares::start(dir.join("journal"), config.segment_bytes)
                .map_err(|e| {
                    tracing::warn!(error = %e,
                        "cannot prepare spare journal segments; segments grow as they are written")
                })
                .ok()
        } else {
            None
        };
        let file = open_segment(&dir, next_segment, spares.as_ref())?;
        {
            let mut locked = index.index.lock();
            locked.add_file(next_segment, Arc::new(read_handle(&dir, next_segment)?));
            locked.segments.insert(
                next_segment,
                SegmentInfo {
                    bytes: SEGMENT_MAGIC.len() as u64,
                    live: 0,
                },
            );
        }
        let mut writer = Self {
            dir,
            config,
            wiring,
            index,
            current: next_segment,
            current_bytes: SEGMENT_MAGIC.len() as u64,
            file,
            rx,
            synced,
            stats,
            live_uids: HashSet::new(),
            producers,
            buf: Vec::new(),
            snapshots: Snapshots {
                records_since: 0,
                taken_at: Instant::now(),
                position: None,
                stale: false,
                thread: None,
                unsynced: false,
            },
            spares,
        };
        writer.live_uids = writer.live_uids();
        Ok(writer)
    }

    fn run(&mut self) {
        if let Err(e) = self.serve() {
            // The journal cannot keep its promise any more: stop loudly rather than confirm
            // what is not on disk.
            tracing::error!(error = %e, "journal write failed; stopping the broker");
            std::process::exit(70);
        }
    }

    fn serve(&mut self) -> Result<(), StoreError> {
        let mut batch: Vec<(u64, Job)> = Vec::new();
        loop {
            let first = match self.rx.recv_timeout(self.until_snapshot_due()) {
                Ok(job) => job,
                Err(RecvTimeoutError::Timeout) => {
                    self.snapshot_if_due(false)?;
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => break,
            };
            batch.push(first);
            let started = Instant::now();
            loop {
                match self.rx.try_recv() {
                    Ok(job) => batch.push(job),
                    Err(TryRecvError::Empty) => {
                        let waited = started.elapsed();
                        let delay = Duration::from_micros(self.config.max_delay_us);
                        if waited >= delay {
                            break;
                        }
                        match self.rx.recv_timeout(delay - waited) {
                            Ok(job) => batch.push(job),
                            Err(_) => break,
                        }
                    }
                    Err(TryRecvError::Disconnected) => break,
                }
                if batch.len() >= 4096 {
                    break;
                }
            }
            self.commit(&mut batch)?;
            self.compact_oldest()?;
            self.snapshot_if_due(false)?;
        }
        self.snapshot_if_due(true)
    }

    /// How long the writer may wait for work before a snapshot is due by time.
    fn until_snapshot_due(&self) -> Duration {
        let interval = Duration::from_millis(self.config.snapshot_interval_ms);
        if self.snapshots.thread.is_some() {
            // One is being written: look again soon to collect it.
            return Duration::from_millis(100);
        }
        if self.config.snapshot_interval_ms == 0 || self.snapshots.records_since == 0 {
            // Nothing to snapshot yet: wake up now and then all the same (a bounded wait).
            return Duration::from_secs(1);
        }
        interval.saturating_sub(self.snapshots.taken_at.elapsed())
    }

    /// Takes a snapshot of the index when one is due (or, at `shutdown`, when anything changed
    /// since the last): encodes it here, where the index matches the journal's head exactly,
    /// and writes it on a thread of its own so that commits go on. At shutdown it is written
    /// before returning. A failed snapshot is logged, not fatal: recovery falls back to the
    /// full scan.
    fn snapshot_if_due(&mut self, shutdown: bool) -> Result<(), StoreError> {
        let s = &mut self.snapshots;
        if (shutdown || s.thread.as_ref().is_some_and(|t| t.is_finished()))
            && let Some(t) = s.thread.take()
        {
            match t.join() {
                Ok(Ok(())) => {
                    self.stats.snapshots_written.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "writing a snapshot failed"),
                Err(_) => tracing::warn!("the snapshot thread panicked"),
            }
        }
        let s = &mut self.snapshots;
        let by_count = self.config.snapshot_every_records > 0
            && s.records_since >= self.config.snapshot_every_records;
        let by_time = self.config.snapshot_interval_ms > 0
            && s.records_since > 0
            && s.taken_at.elapsed() >= Duration::from_millis(self.config.snapshot_interval_ms);
        let due = by_count || by_time || s.stale || (shutdown && s.records_since > 0);
        if s.thread.is_some() || !due {
            return Ok(());
        }
        if s.unsynced {
            // The position must not run ahead of what is on disk.
            self.sync()?;
            self.snapshots.unsynced = false;
        }
        let position = Position {
            segment: self.current,
            offset_bytes: self.current_bytes,
        };
        let bytes = snapshot::encode(position, &self.index.index.lock(), &self.producers);
        let s = &mut self.snapshots;
        s.records_since = 0;
        s.taken_at = Instant::now();
        s.position = Some(position);
        s.stale = false;
        let dir = self.dir.clone();
        if shutdown {
            match snapshot::write(&dir, &bytes) {
                Ok(()) => {
                    self.stats.snapshots_written.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => tracing::warn!(error = %e, "writing a snapshot failed"),
            }
            return Ok(());
        }
        s.thread = Some(
            std::thread::Builder::new()
                .name("ringmq-snapshot".into())
                .spawn(move || snapshot::write(&dir, &bytes))
                .map_err(|e| StoreError::Io("starting the snapshot thread".into(), e))?,
        );
        Ok(())
    }

    fn live_uids(&self) -> HashSet<u64> {
        self.wiring
            .values()
            .flat_map(|w| w.queues.iter().map(|q| q.uid))
            .collect()
    }

    /// Writes one batch with one sync (none when it holds only page records and releases:
    /// nothing in it is promised to survive a crash).
    fn commit(&mut self, batch: &mut Vec<(u64, Job)>) -> Result<(), StoreError> {
        let mut plan = BatchPlan::default();
        let mut last_seq = 0;
        let body_bytes_taken: u64 = batch.iter().map(|(_, job)| body_bytes(job)).sum();
        for (seq, job) in batch.drain(..) {
            last_seq = seq;
            match job {
                Job::Records(rs) => self.plan_records(&mut plan, rs),
                Job::Release { pages, queues } => plan.release(pages, queues),
                Job::Wiring { vhost, wiring } => {
                    self.wiring.insert(vhost, wiring);
                    self.wiring_changed(&mut plan);
                }
                Job::VhostDeleted { vhost } => {
                    self.wiring.remove(&vhost);
                    self.wiring_changed(&mut plan);
                }
            }
        }
        self.apply_releases(&plan);
        self.buf.clear();
        let mut must_sync = plan.wiring_changed || plan.removals;
        let (written, durable) = self.encode(plan.records);
        must_sync |= durable;
        if plan.wiring_changed {
            write_wiring_file(&self.dir, &self.wiring)?;
        }
        if !self.buf.is_empty() {
            let buf = std::mem::take(&mut self.buf);
            let (segment, base) = self.append(&buf)?;
            {
                let mut index = self.index.index.lock();
                for (key, offset, len, head) in written {
                    index.add(
                        key,
                        Location {
                            segment,
                            offset_bytes: base + offset,
                            len_bytes: len,
                        },
                        head,
                    );
                }
            }
            self.buf = buf;
            if must_sync {
                self.sync()?;
            }
            self.snapshots.unsynced = !must_sync;
        }
        self.index.set_processed(last_seq);
        self.stats
            .body_bytes_in_flight
            .fetch_sub(body_bytes_taken, Ordering::Relaxed);
        self.synced.send_replace(last_seq);
        Ok(())
    }

    /// Adds a job's records to the batch. An enqueue of a queue that no longer exists is
    /// dropped; a removal of a message enqueued earlier in the same batch cancels both ("no
    /// write on fast consume"); a removal of a written message is kept.
    fn plan_records(&mut self, plan: &mut BatchPlan, rs: Vec<Record>) {
        for r in rs {
            match r {
                Record::Enqueued {
                    uid,
                    id,
                    ref message,
                    ..
                } => {
                    if self.live_uids.contains(&uid) {
                        if let Some((producer, seq)) = producer_of(message) {
                            self.producers
                                .entry(uid)
                                .or_default()
                                .note_number(producer, seq);
                        }
                        plan.push((uid, id), r, true);
                    }
                }
                Record::Paged { uid, id, .. } => plan.push((uid, id), r, false),
                Record::Producers {
                    uid,
                    ref highest,
                    replace,
                } => {
                    if self.live_uids.contains(&uid) {
                        let table = self.producers.entry(uid).or_default();
                        if replace {
                            *table = Producers::default();
                        }
                        table.note_all(highest);
                    }
                    plan.records.push(Some(Pending {
                        record: r,
                        durable: true,
                    }))
                }
                Record::Removed { uid, ids } => {
                    let mut keep = Vec::new();
                    let mut index = self.index.index.lock();
                    for id in ids {
                        if plan.cancel((uid, id)) {
                            self.stats.records_cancelled.fetch_add(1, Ordering::Relaxed);
                        } else if index.remove((uid, id)) {
                            keep.push(id);
                        }
                    }
                    if !keep.is_empty() {
                        plan.removals = true;
                        plan.records.push(Some(Pending {
                            record: Record::Removed { uid, ids: keep },
                            durable: true,
                        }));
                    }
                }
            }
        }
    }

    /// The durable wiring changed: messages of queues deleted by it are garbage now,
    /// written or not.
    fn wiring_changed(&mut self, plan: &mut BatchPlan) {
        let new_uids = self.live_uids();
        let old_uids = std::mem::replace(&mut self.live_uids, new_uids);
        let live = &self.live_uids;
        self.producers.retain(|uid, _| live.contains(uid));
        plan.wiring_changed = true;
        let gone: HashSet<u64> = old_uids.difference(&self.live_uids).copied().collect();
        if !gone.is_empty() {
            plan.drop_queues(|uid| gone.contains(&uid));
            self.index
                .index
                .lock()
                .retain_uids(|uid| !gone.contains(&uid));
        }
    }

    /// Forgets the index entries of released pages and queues.
    fn apply_releases(&self, plan: &BatchPlan) {
        let mut index = self.index.index.lock();
        for &key in &plan.released {
            index.remove(key);
        }
        if !plan.released_queues.is_empty() {
            index.retain_uids(|uid| !plan.released_queues.contains(&uid));
        }
    }

    /// Encodes the batch's surviving records into the write buffer; returns where each
    /// message record lands (for the index) and whether any must survive a crash.
    fn encode(&mut self, records: Vec<Option<Pending>>) -> (Vec<Written>, bool) {
        let mut written: Vec<Written> = Vec::new();
        let mut durable = false;
        for p in records.into_iter().flatten() {
            let start = self.buf.len();
            p.record.encode(&mut self.buf);
            durable |= p.durable;
            if !p.durable {
                self.stats.pages_written.fetch_add(1, Ordering::Relaxed);
            }
            let len = (self.buf.len() - start) as u64;
            match &p.record {
                Record::Enqueued {
                    uid, id, message, ..
                } => {
                    let body = start + RECORD_HEADER;
                    let head = Bytes::copy_from_slice(
                        &self.buf[body..body + Record::head_len_of(message)],
                    );
                    written.push(((*uid, *id), start as u64, len, Some(head)));
                }
                Record::Paged { uid, id, .. } => {
                    written.push(((*uid, *id), start as u64, len, None));
                }
                Record::Removed { .. } | Record::Producers { .. } => {}
            }
            self.stats.records_written.fetch_add(1, Ordering::Relaxed);
            self.snapshots.records_since += u64::from(p.durable);
        }
        (written, durable)
    }

    /// Appends `bytes` to the current segment (rolling to a new one first when they do not
    /// fit); returns the segment and the offset they were written at.
    fn append(&mut self, bytes: &[u8]) -> Result<(u64, u64), StoreError> {
        if self.current_bytes > SEGMENT_MAGIC.len() as u64
            && self.current_bytes + bytes.len() as u64 > self.config.segment_bytes
        {
            self.sync()?;
            self.current += 1;
            self.file = open_segment(&self.dir, self.current, self.spares.as_ref())?;
            self.current_bytes = SEGMENT_MAGIC.len() as u64;
            let reader = Arc::new(read_handle(&self.dir, self.current)?);
            let mut index = self.index.index.lock();
            index.add_file(self.current, reader);
            index.segments.insert(
                self.current,
                SegmentInfo {
                    bytes: self.current_bytes,
                    live: 0,
                },
            );
        }
        self.file
            .write_all_at(bytes, self.current_bytes)
            .map_err(|e| {
                StoreError::Io(
                    format!(
                        "writing {}",
                        segment_path(&self.dir, self.current).display()
                    ),
                    e,
                )
            })?;
        let at = self.current_bytes;
        self.current_bytes += bytes.len() as u64;
        self.index
            .index
            .lock()
            .segments
            .entry(self.current)
            .or_default()
            .bytes = self.current_bytes;
        self.stats
            .bytes_written
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok((self.current, at))
    }

    fn sync(&mut self) -> Result<(), StoreError> {
        let started = Instant::now();
        self.file.sync_data().map_err(|e| {
            StoreError::Io(
                format!(
                    "syncing {}",
                    segment_path(&self.dir, self.current).display()
                ),
                e,
            )
        })?;
        let elapsed = started.elapsed();
        self.stats.fsyncs.fetch_add(1, Ordering::Relaxed);
        self.stats
            .fsync_micros
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
        self.stats.fsync_seconds.observe(elapsed.as_secs_f64());
        Ok(())
    }

    /// Compacts the oldest segment when the journal holds more than twice its live bytes.
    /// Live records (Enqueued and Paged) are copied to the head and their locations updated
    /// in the index before the old file is deleted, so a reader always finds a body: at the
    /// new place, or at the old one through a descriptor it already holds.
    fn compact_oldest(&mut self) -> Result<(), StoreError> {
        let (oldest, total, live) = {
            let index = self.index.index.lock();
            let total: u64 = index.segments.values().map(|s| s.bytes).sum();
            let Some((&oldest, _)) = index.segments.iter().next() else {
                return Ok(());
            };
            (oldest, total, index.live_bytes())
        };
        if total <= 2 * live + 2 * self.config.segment_bytes || oldest == self.current {
            return Ok(());
        }
        let path = segment_path(&self.dir, oldest);
        let data = Bytes::from(
            std::fs::read(&path)
                .map_err(|e| StoreError::Io(format!("reading {}", path.display()), e))?,
        );
        let mut copy = Vec::new();
        let mut keys: Vec<(RecordKey, u64, u64)> = Vec::new();
        {
            let index = self.index.index.lock();
            let mut at = SEGMENT_MAGIC.len().min(data.len());
            while let Ok((body, next)) = next_record(&data, at) {
                if let Some(key) = Record::enqueued_key(&body)
                    && index
                        .get(key)
                        .is_some_and(|l| l.segment == oldest && l.offset_bytes == at as u64)
                {
                    keys.push((key, copy.len() as u64, (next - at) as u64));
                    copy.extend_from_slice(&data[at..next]);
                }
                at = next;
            }
        }
        // The producers the deleted segment's Enqueued records named live on in whole
        // tables written ahead of it. Each replaces what a scan has read by then: the live
        // Enqueued records just copied name their numbers again, which a replaced table may
        // have lowered since — a full scan then read a higher number than the table held
        // (B24). Every live record that names a producer has its queue's table here: each
        // Enqueued record noted its number when it was planned or recovered.
        for (&uid, table) in &self.producers {
            Record::Producers {
                uid,
                highest: table.highest(),
                replace: true,
            }
            .encode(&mut copy);
        }
        if !copy.is_empty() {
            let (segment, base) = self.append(&copy)?;
            self.sync()?;
            // Only this thread changes the index, so every key copied is still live here.
            let mut index = self.index.index.lock();
            for (key, offset, len) in keys {
                index.relocate(
                    key,
                    Location {
                        segment,
                        offset_bytes: base + offset,
                        len_bytes: len,
                    },
                );
            }
        }
        std::fs::remove_file(&path)
            .map_err(|e| StoreError::Io(format!("deleting {}", path.display()), e))?;
        super::sync_journal_dir(&self.dir)?;
        self.index.index.lock().remove_segment(oldest);
        if self.snapshots.position.is_some_and(|p| p.segment == oldest) {
            self.snapshots.stale = true;
        }
        self.stats
            .segments_compacted
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Body bytes of the Enqueued and Paged records in `job`.
fn body_bytes(job: &Job) -> u64 {
    match job {
        Job::Records(records) => records
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

/// A second descriptor on a segment for readers (positioned reads do not disturb the
/// writer's appends).
fn read_handle(dir: &std::path::Path, number: u64) -> Result<File, StoreError> {
    let path = segment_path(dir, number);
    File::open(&path).map_err(|e| StoreError::Io(format!("opening {}", path.display()), e))
}

/// Starts segment `number`: a spare renamed when one is ready, else a new empty file. Written
/// at offsets (never opened to append, which would ignore them).
fn open_segment(
    dir: &std::path::Path,
    number: u64,
    spares: Option<&Spares>,
) -> Result<File, StoreError> {
    let path = segment_path(dir, number);
    let file = match spares.and_then(Spares::take) {
        Some(spare) => {
            spare
                .file
                .write_all_at(SEGMENT_MAGIC, 0)
                .map_err(|e| StoreError::Io(format!("writing {}", spare.path.display()), e))?;
            std::fs::rename(&spare.path, &path).map_err(|e| {
                StoreError::Io(
                    format!("renaming {} to {}", spare.path.display(), path.display()),
                    e,
                )
            })?;
            spare.file
        }
        None => {
            let file = OpenOptions::new()
                .create_new(true)
                .write(true)
                .open(&path)
                .map_err(|e| StoreError::Io(format!("creating {}", path.display()), e))?;
            file.write_all_at(SEGMENT_MAGIC, 0)
                .map_err(|e| StoreError::Io(format!("writing {}", path.display()), e))?;
            file
        }
    };
    super::sync_journal_dir(dir)?;
    Ok(file)
}
