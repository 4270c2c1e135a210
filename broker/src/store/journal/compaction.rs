//! The compactor: one segment per cycle, its live records copied forward, then the file deleted.

use super::*;
use crate::store::index::{Location, RecordKey};
use crate::store::record::{Record, next_record};
use crate::store::{SEGMENT_MAGIC, StoreError, segment_path};
use bytes::Bytes;
use std::sync::atomic::Ordering;

impl Writer {
    /// Compacts the oldest segment when the journal holds more than twice its live bytes.
    /// Live records (Enqueued and Paged) are copied to the head and their locations updated
    /// in the index before the old file is deleted, so a reader always finds a body: at the
    /// new place, or at the old one through a descriptor it already holds.
    pub(super) fn compact_oldest(&mut self) -> Result<(), StoreError> {
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
        crate::store::sync_journal_dir(&self.dir)?;
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
