//! When the writer takes a snapshot of the queue indexes, and the thread that writes it.

use super::*;
use crate::store::StoreError;
use crate::store::snapshot::{self, Position, SnapshotError};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// The writer's snapshot bookkeeping.
pub(super) struct Snapshots {
    /// Enqueued and Removed records written since the last snapshot was taken.
    pub(super) records_since: u64,
    pub(super) taken_at: Instant,
    /// Position of the last snapshot taken; the compactor deleting its segment makes it
    /// useless and a new one due.
    pub(super) position: Option<Position>,
    pub(super) stale: bool,
    /// The thread writing the last one, if it may still run.
    pub(super) thread: Option<std::thread::JoinHandle<Result<(), SnapshotError>>>,
    /// Bytes appended to the current segment since its last sync.
    pub(super) unsynced: bool,
}

impl Writer {
    /// How long the writer may wait for work before a snapshot is due by time.
    pub(super) fn until_snapshot_due(&self) -> Duration {
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
    pub(super) fn snapshot_if_due(&mut self, shutdown: bool) -> Result<(), StoreError> {
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
}
