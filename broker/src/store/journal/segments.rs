//! The segment files: appending to the current one, syncing it, starting the next.

use super::*;
use crate::store::index::SegmentInfo;
use crate::store::spare::Spares;
use crate::store::{SEGMENT_MAGIC, StoreError, segment_path};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

impl Writer {
    /// Appends `bytes` to the current segment (rolling to a new one first when they do not
    /// fit); returns the segment and the offset they were written at.
    pub(super) fn append(&mut self, bytes: &[u8]) -> Result<(u64, u64), StoreError> {
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

    pub(super) fn sync(&mut self) -> Result<(), StoreError> {
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
        self.snapshots.unsynced = false;
        self.sync_due = None;
        self.stats.fsyncs.fetch_add(1, Ordering::Relaxed);
        self.stats
            .fsync_micros
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
        self.stats.fsync_seconds.observe(elapsed.as_secs_f64());
        Ok(())
    }
}

/// A second descriptor on a segment for readers (positioned reads do not disturb the
/// writer's appends).
pub(super) fn read_handle(dir: &std::path::Path, number: u64) -> Result<File, StoreError> {
    let path = segment_path(dir, number);
    File::open(&path).map_err(|e| StoreError::Io(format!("opening {}", path.display()), e))
}

/// Starts segment `number`: a spare renamed when one is ready, else a new empty file. Written
/// at offsets (never opened to append, which would ignore them).
pub(super) fn open_segment(
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
    crate::store::sync_journal_dir(dir)?;
    Ok(file)
}
