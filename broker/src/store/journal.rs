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

use super::record::{Record, next_record};
use super::{SEGMENT_MAGIC, StoreError, segment_path, write_wiring_file};
use crate::core::wiring::DurableWiring;
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
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
}

impl Default for JournalConfig {
    fn default() -> Self {
        Self {
            segment_bytes: 16 * 1024 * 1024,
            max_batch_bytes: 4 * 1024 * 1024,
            max_delay_us: 0,
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
        wiring: DurableWiring,
    },
    /// A vhost was deleted with everything in it.
    VhostDeleted {
        /// Vhost name.
        vhost: String,
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
        }
    }
}

/// What the writer knows about a segment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentInfo {
    /// File size.
    pub bytes: u64,
    /// Live enqueue records in it.
    pub live: u64,
}

/// The journal's state on disk, as recovery found it and the writer continues it.
#[derive(Debug, Default)]
pub struct DiskState {
    /// Segments by number.
    pub segments: BTreeMap<u64, SegmentInfo>,
    /// Live messages: (queue uid, id) → (segment, record bytes).
    pub live: HashMap<(u64, u64), (u64, u64)>,
    /// Durable wiring per vhost.
    pub wiring: BTreeMap<String, DurableWiring>,
}

impl DiskState {
    /// Records that message `key` now lives in `segment`, forgetting an older copy.
    pub fn add_live(&mut self, key: (u64, u64), segment: u64, bytes: u64) {
        if let Some((old, _)) = self.live.insert(key, (segment, bytes))
            && let Some(s) = self.segments.get_mut(&old)
        {
            s.live -= 1;
        }
        self.segments.entry(segment).or_default().live += 1;
    }

    /// Forgets message `key`; returns whether it was live.
    pub fn remove_live(&mut self, key: (u64, u64)) -> bool {
        match self.live.remove(&key) {
            Some((segment, _)) => {
                if let Some(s) = self.segments.get_mut(&segment) {
                    s.live -= 1;
                }
                true
            }
            None => false,
        }
    }

    fn live_uids(&self) -> HashSet<u64> {
        self.wiring
            .values()
            .flat_map(|w| w.queues.iter().map(|q| q.uid))
            .collect()
    }
}

struct Submitter {
    next_seq: u64,
    tx: Option<Sender<(u64, Job)>>,
}

/// Handle to the journal: submit work, learn what is durable.
pub struct Journal {
    submitter: Mutex<Submitter>,
    synced: Arc<tokio::sync::watch::Sender<u64>>,
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
        let mut writer = Writer::new(
            dir,
            config,
            state,
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
            stats,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues work for the writer and returns its sequence number: it is durable once
    /// [`Journal::synced`] reaches it. Call it in the order the vhost produced the work.
    pub fn submit(&self, job: Job) -> u64 {
        let mut s = self.submitter.lock();
        let seq = s.next_seq;
        s.next_seq += 1;
        if let Some(tx) = &s.tx {
            // A closed channel means the writer died, which already ended the process.
            let _ = tx.send((seq, job));
        }
        seq
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
                "journal closed"
            );
        }
    }
}

struct Writer {
    dir: PathBuf,
    config: JournalConfig,
    state: DiskState,
    current: u64,
    file: File,
    rx: Receiver<(u64, Job)>,
    synced: Arc<tokio::sync::watch::Sender<u64>>,
    stats: Arc<JournalStats>,
    live_uids: HashSet<u64>,
    buf: Vec<u8>,
}

impl Writer {
    fn new(
        dir: PathBuf,
        config: JournalConfig,
        mut state: DiskState,
        next_segment: u64,
        rx: Receiver<(u64, Job)>,
        synced: Arc<tokio::sync::watch::Sender<u64>>,
        stats: Arc<JournalStats>,
    ) -> Result<Self, StoreError> {
        let file = new_segment(&dir, next_segment)?;
        state.segments.insert(
            next_segment,
            SegmentInfo {
                bytes: SEGMENT_MAGIC.len() as u64,
                live: 0,
            },
        );
        let live_uids = state.live_uids();
        Ok(Self {
            dir,
            config,
            state,
            current: next_segment,
            file,
            rx,
            synced,
            stats,
            live_uids,
            buf: Vec::new(),
        })
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
        while let Ok(first) = self.rx.recv() {
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
        }
        Ok(())
    }

    /// Writes one batch with one sync.
    fn commit(&mut self, batch: &mut Vec<(u64, Job)>) -> Result<(), StoreError> {
        let mut records: Vec<Option<Record>> = Vec::new();
        let mut pending: HashMap<(u64, u64), usize> = HashMap::new();
        let mut wiring_changed = false;
        let mut last_seq = 0;
        for (seq, job) in batch.drain(..) {
            last_seq = seq;
            match job {
                Job::Records(rs) => {
                    for r in rs {
                        match r {
                            Record::Enqueued { uid, id, .. } => {
                                if self.live_uids.contains(&uid) {
                                    pending.insert((uid, id), records.len());
                                    records.push(Some(r));
                                }
                            }
                            Record::Removed { uid, ids } => {
                                let mut keep = Vec::new();
                                for id in ids {
                                    if let Some(at) = pending.remove(&(uid, id)) {
                                        records[at] = None;
                                        self.stats
                                            .records_cancelled
                                            .fetch_add(1, Ordering::Relaxed);
                                    } else if self.state.remove_live((uid, id)) {
                                        keep.push(id);
                                    }
                                }
                                if !keep.is_empty() {
                                    records.push(Some(Record::Removed { uid, ids: keep }));
                                }
                            }
                        }
                    }
                }
                Job::Wiring { .. } | Job::VhostDeleted { .. } => {
                    match job {
                        Job::Wiring { vhost, wiring } => {
                            self.state.wiring.insert(vhost, wiring);
                        }
                        Job::VhostDeleted { vhost } => {
                            self.state.wiring.remove(&vhost);
                        }
                        Job::Records(_) => unreachable!("matched above"),
                    }
                    self.live_uids = self.state.live_uids();
                    wiring_changed = true;
                    // Messages of deleted queues are garbage now, written or not.
                    pending.retain(|(uid, _), at| {
                        let alive = self.live_uids.contains(uid);
                        if !alive {
                            records[*at] = None;
                        }
                        alive
                    });
                    let dead: Vec<(u64, u64)> = self
                        .state
                        .live
                        .keys()
                        .filter(|(uid, _)| !self.live_uids.contains(uid))
                        .copied()
                        .collect();
                    for key in dead {
                        self.state.remove_live(key);
                    }
                }
            }
        }
        self.buf.clear();
        let mut written = Vec::new();
        for r in records.into_iter().flatten() {
            let start = self.buf.len();
            r.encode(&mut self.buf);
            if let Record::Enqueued { uid, id, .. } = r {
                written.push(((uid, id), (self.buf.len() - start) as u64));
            }
            self.stats.records_written.fetch_add(1, Ordering::Relaxed);
        }
        if wiring_changed {
            write_wiring_file(&self.dir, &self.state.wiring)?;
        }
        if !self.buf.is_empty() {
            let buf = std::mem::take(&mut self.buf);
            self.append(&buf)?;
            for (key, bytes) in written {
                self.state.add_live(key, self.current, bytes);
            }
            self.buf = buf;
            self.sync()?;
        }
        self.synced.send_replace(last_seq);
        Ok(())
    }

    fn append(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        let size = self
            .state
            .segments
            .get(&self.current)
            .map_or(0, |s| s.bytes);
        if size > SEGMENT_MAGIC.len() as u64
            && size + bytes.len() as u64 > self.config.segment_bytes
        {
            self.sync()?;
            self.current += 1;
            self.file = new_segment(&self.dir, self.current)?;
            self.state.segments.insert(
                self.current,
                SegmentInfo {
                    bytes: SEGMENT_MAGIC.len() as u64,
                    live: 0,
                },
            );
        }
        self.file.write_all(bytes).map_err(|e| {
            StoreError::Io(
                format!(
                    "writing {}",
                    segment_path(&self.dir, self.current).display()
                ),
                e,
            )
        })?;
        self.state.segments.entry(self.current).or_default().bytes += bytes.len() as u64;
        self.stats
            .bytes_written
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(())
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
    fn compact_oldest(&mut self) -> Result<(), StoreError> {
        let total: u64 = self.state.segments.values().map(|s| s.bytes).sum();
        let live: u64 = self.state.live.values().map(|(_, b)| b).sum();
        if total <= 2 * live + 2 * self.config.segment_bytes {
            return Ok(());
        }
        let Some((&oldest, _)) = self.state.segments.iter().next() else {
            return Ok(());
        };
        if oldest == self.current {
            return Ok(());
        }
        let path = segment_path(&self.dir, oldest);
        let data = Bytes::from(
            std::fs::read(&path)
                .map_err(|e| StoreError::Io(format!("reading {}", path.display()), e))?,
        );
        let mut copy = Vec::new();
        let mut keys = Vec::new();
        let mut at = SEGMENT_MAGIC.len().min(data.len());
        while let Ok((body, next)) = next_record(&data, at) {
            if let Some(key) = Record::enqueued_key(&body)
                && self
                    .state
                    .live
                    .get(&key)
                    .is_some_and(|(seg, _)| *seg == oldest)
            {
                keys.push((key, (next - at) as u64));
                copy.extend_from_slice(&data[at..next]);
            }
            at = next;
        }
        if !copy.is_empty() {
            self.append(&copy)?;
            self.sync()?;
            for (key, bytes) in keys {
                self.state.add_live(key, self.current, bytes);
            }
        }
        std::fs::remove_file(&path)
            .map_err(|e| StoreError::Io(format!("deleting {}", path.display()), e))?;
        super::sync_journal_dir(&self.dir)?;
        self.state.segments.remove(&oldest);
        self.stats
            .segments_compacted
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn new_segment(dir: &std::path::Path, number: u64) -> Result<File, StoreError> {
    let path = segment_path(dir, number);
    let mut file = OpenOptions::new()
        .create_new(true)
        .append(true)
        .open(&path)
        .map_err(|e| StoreError::Io(format!("creating {}", path.display()), e))?;
    file.write_all(SEGMENT_MAGIC)
        .map_err(|e| StoreError::Io(format!("writing {}", path.display()), e))?;
    super::sync_journal_dir(dir)?;
    Ok(file)
}
