//! The writer thread: takes the submitted jobs, plans each group commit, writes and syncs it, and
//! publishes how far the journal is durable.

use super::plan::{BatchPlan, Pending, SyncBy, Written};
use super::segments::{open_segment, read_handle};
use super::snapshots::Snapshots;
use super::*;
use crate::core::producers::{Producers, producer_of};
use crate::core::wiring::Wiring;
use crate::store::index::{Location, SegmentInfo, SharedIndex};
use crate::store::record::{RECORD_HEADER, Record};
use crate::store::spare::Spares;
use crate::store::{SEGMENT_MAGIC, StoreError, write_wiring_file};
use bytes::Bytes;
use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

pub(super) struct Writer {
    pub(super) dir: PathBuf,
    pub(super) config: JournalConfig,
    pub(super) wiring: BTreeMap<String, Wiring>,
    pub(super) index: Arc<SharedIndex>,
    pub(super) current: u64,
    /// Size of the current segment file, in bytes.
    pub(super) current_bytes: u64,
    pub(super) file: File,
    pub(super) rx: Receiver<(u64, Job)>,
    pub(super) synced: Arc<tokio::sync::watch::Sender<u64>>,
    pub(super) stats: Arc<JournalStats>,
    pub(super) live_uids: HashSet<u64>,
    /// The producer tables of the live queues, from every Enqueued record planned (written
    /// or cancelled): written whole before a segment is deleted and in every snapshot.
    pub(super) producers: ProducerTables,
    pub(super) buf: Vec<u8>,
    pub(super) snapshots: Snapshots,
    /// Zero-filled files to start segments in (`None` with `preallocate` off, or when the
    /// thread could not be started).
    pub(super) spares: Option<Spares>,
    /// When records written but not synced are due for their sync (`SyncBy::Within`); every
    /// sync clears it.
    pub(super) sync_due: Option<Instant>,
}

impl Writer {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
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
            sync_due: None,
        };
        writer.live_uids = writer.live_uids();
        Ok(writer)
    }

    pub(super) fn run(&mut self) {
        if let Err(e) = self.serve() {
            // The journal cannot keep its promise any more: stop loudly rather than confirm
            // what is not on disk.
            tracing::error!(error = %e, "journal write failed; stopping the broker");
            std::process::exit(70);
        }
    }

    pub(super) fn serve(&mut self) -> Result<(), StoreError> {
        let mut batch: Vec<(u64, Job)> = Vec::new();
        loop {
            let idle = self.until_snapshot_due().min(self.until_sync_due());
            let first = match self.rx.recv_timeout(idle) {
                Ok(job) => job,
                Err(RecvTimeoutError::Timeout) => {
                    self.sync_if_due()?;
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
            self.sync_if_due()?;
            self.compact_oldest()?;
            self.snapshot_if_due(false)?;
        }
        if self.sync_due.is_some() {
            self.sync()?;
        }
        self.snapshot_if_due(true)
    }

    /// How long the writer may wait for work before records written earlier are due for
    /// their sync.
    fn until_sync_due(&self) -> Duration {
        self.sync_due.map_or(Duration::MAX, |due| {
            due.saturating_duration_since(Instant::now())
        })
    }

    /// Syncs records that have waited their `SyncBy::Within` for a commit that syncs anyway.
    fn sync_if_due(&mut self) -> Result<(), StoreError> {
        if self.sync_due.is_some() && self.until_sync_due().is_zero() {
            self.sync()?;
        }
        Ok(())
    }

    pub(super) fn live_uids(&self) -> HashSet<u64> {
        self.wiring
            .values()
            .flat_map(|w| w.queues.iter().map(|q| q.uid))
            .collect()
    }

    /// Writes one batch with one sync when it holds what a confirm, a reply or a wiring
    /// change waits for. Removals and a backup's records alone are written and left to the
    /// next sync (at most `removals_sync_ms` or `replica_sync_ms` later); page records and
    /// releases are never synced for their own sake: nothing in them is promised to survive
    /// a crash.
    pub(super) fn commit(&mut self, batch: &mut Vec<(u64, Job)>) -> Result<(), StoreError> {
        let mut plan = BatchPlan::default();
        let mut last_seq = 0;
        let body_bytes_taken: u64 = batch.iter().map(|(_, job)| body_bytes(job)).sum();
        for (seq, job) in batch.drain(..) {
            last_seq = seq;
            match job {
                Job::Records(rs) => self.plan_records(&mut plan, rs, false),
                Job::Replica(rs) => self.plan_records(&mut plan, rs, true),
                Job::Release { pages, queues } => plan.release(pages, queues),
                Job::Sync => plan.barrier = true,
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
        let (written, urgent, within) = self.encode(plan.records);
        if plan.wiring_changed {
            write_wiring_file(&self.dir, &self.wiring)?;
        }
        let wrote = !self.buf.is_empty();
        if wrote {
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
        }
        // A barrier syncs whatever is written and not synced yet, by this commit or before.
        let unsynced = wrote || self.sync_due.is_some() || self.snapshots.unsynced;
        if (wrote && (plan.wiring_changed || urgent)) || (plan.barrier && unsynced) {
            self.sync()?;
        } else if wrote {
            self.snapshots.unsynced = true;
            if let Some(within) = within {
                let due = Instant::now() + within;
                self.sync_due = Some(self.sync_due.map_or(due, |d| d.min(due)));
            }
        }
        self.index.set_processed(last_seq);
        self.stats
            .body_bytes_in_flight
            .fetch_sub(body_bytes_taken, Ordering::Relaxed);
        self.synced.send_replace(last_seq);
        Ok(())
    }

    /// Adds a job's records to the batch (`replica`: from a backup's replication stream). An
    /// enqueue of a queue that no longer exists is dropped; a removal of a message enqueued
    /// earlier in the same batch cancels both ("no write on fast consume"); a removal of a
    /// written message is kept.
    pub(super) fn plan_records(&mut self, plan: &mut BatchPlan, rs: Vec<Record>, replica: bool) {
        let promised = if replica {
            SyncBy::within_ms(self.config.replica_sync_ms)
        } else {
            SyncBy::Now
        };
        // A removal is confirmed to nobody, on a primary or a backup.
        let removal = SyncBy::within_ms(self.config.removals_sync_ms);
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
                        plan.push((uid, id), r, promised);
                    }
                }
                Record::Paged { uid, id, .. } => plan.push((uid, id), r, SyncBy::Never),
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
                        sync: promised,
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
                        plan.records.push(Some(Pending {
                            record: Record::Removed { uid, ids: keep },
                            sync: removal,
                        }));
                    }
                }
            }
        }
    }

    /// The durable wiring changed: messages of queues deleted by it are garbage now,
    /// written or not.
    pub(super) fn wiring_changed(&mut self, plan: &mut BatchPlan) {
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
    pub(super) fn apply_releases(&self, plan: &BatchPlan) {
        let mut index = self.index.index.lock();
        for &key in &plan.released {
            index.remove(key);
        }
        if !plan.released_queues.is_empty() {
            index.retain_uids(|uid| !plan.released_queues.contains(&uid));
        }
    }

    /// Encodes the batch's surviving records into the write buffer; returns where each
    /// message record lands (for the index), whether any must be synced before the batch
    /// counts as durable (`SyncBy::Now`), and the shortest time within which the others
    /// must be (`SyncBy::Within`).
    pub(super) fn encode(
        &mut self,
        records: Vec<Option<Pending>>,
    ) -> (Vec<Written>, bool, Option<Duration>) {
        let mut written: Vec<Written> = Vec::new();
        let mut urgent = false;
        let mut within: Option<Duration> = None;
        for p in records.into_iter().flatten() {
            let start = self.buf.len();
            p.record.encode(&mut self.buf);
            match p.sync {
                SyncBy::Now => urgent = true,
                SyncBy::Within(d) => within = Some(within.map_or(d, |w| w.min(d))),
                SyncBy::Never => {}
            }
            if !p.durable() {
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
            self.snapshots.records_since += u64::from(p.durable());
        }
        (written, urgent, within)
    }
}
