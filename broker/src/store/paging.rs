//! Flow-to-disk, the read side: bodies a queue dropped from memory are read back from their
//! journal records when they are delivered or dead-lettered.
//!
//! One call reads a batch: it looks every key up in the live-record index (one lock), lets
//! go of the lock, sorts the records by place and reads each run of adjacent records with one
//! positioned read (at most [`MAX_READ_BYTES`]). A consumer draining a paged-out queue asks
//! for its messages in queue order, which is journal order, so a batch is a few large
//! sequential reads that the kernel's read-ahead keeps ahead of.

use super::index::{Location, SharedIndex};
use super::record::{DecodeError, Record, next_record};
use crate::core::DiskBody;
use bytes::Bytes;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// Most bytes one positioned read covers: bounds the buffer a batch of adjacent records
/// allocates.
pub const MAX_READ_BYTES: u64 = 1024 * 1024;

/// How long a reader waits for the writer to write a record submitted before it (a body
/// paged out a moment ago): a group commit takes milliseconds; this much means a stuck disk.
pub const WRITER_WAIT: Duration = Duration::from_secs(10);

/// Why a body could not be read back. Each means the journal lost something it promised to
/// hold; the broker stops rather than deliver something else.
#[derive(Debug, Error)]
pub enum ReadError {
    /// No live record holds the body.
    #[error(
        "body of message {id} of queue {uid:x} is not in the journal; the data dir is damaged, restart the broker to recover what is on disk"
    )]
    Missing {
        /// Queue incarnation.
        uid: u64,
        /// Message id.
        id: u64,
    },
    /// Reading the segment failed.
    #[error("reading journal segment {segment}: {source}")]
    Io {
        /// Segment number.
        segment: u64,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The record read back is not the one the index points to, or is damaged.
    #[error(
        "record of message {id} of queue {uid:x} in segment {segment} is damaged ({reason}); check the disk, then restart the broker"
    )]
    Damaged {
        /// Queue incarnation.
        uid: u64,
        /// Message id.
        id: u64,
        /// Segment number.
        segment: u64,
        /// What is wrong.
        reason: String,
    },
}

/// Reads the bodies of `keys`, in their order. `submitted_seq` is the journal's last
/// submission when the caller asks: a record not in the index yet is waited for until the
/// writer has processed that far.
pub fn read_bodies(
    index: &SharedIndex,
    keys: &[DiskBody],
    submitted_seq: u64,
) -> Result<Vec<Bytes>, ReadError> {
    read_present(index, keys, submitted_seq)?
        .into_iter()
        .zip(keys)
        .map(|(body, k)| {
            body.ok_or(ReadError::Missing {
                uid: k.uid,
                id: k.id,
            })
        })
        .collect()
}

/// [`read_bodies`] for a reader that expects some records to be gone (a catch-up's image
/// taken a while ago, whose messages may have left their queue since): `None` for a key no
/// live record holds, after waiting for the writer as `read_bodies` does.
pub fn read_present(
    index: &SharedIndex,
    keys: &[DiskBody],
    submitted_seq: u64,
) -> Result<Vec<Option<Bytes>>, ReadError> {
    let mut places = look_up(index, keys);
    if places.iter().any(Option::is_none) && index.wait_processed(submitted_seq, WRITER_WAIT) {
        places = look_up(index, keys);
    }
    let mut wanted: Vec<(usize, Location, Arc<File>)> = Vec::with_capacity(keys.len());
    for (i, place) in places.into_iter().enumerate() {
        if let Some((at, file)) = place {
            wanted.push((i, at, file));
        }
    }
    wanted.sort_unstable_by_key(|(_, at, _)| (at.segment, at.offset_bytes));
    let mut out = vec![None; keys.len()];
    let mut run_start = 0;
    while run_start < wanted.len() {
        let first = wanted[run_start].1;
        let mut run_end = run_start + 1;
        let mut end = first.offset_bytes + first.len_bytes;
        while run_end < wanted.len() {
            let next = wanted[run_end].1;
            if next.segment != first.segment
                || next.offset_bytes != end
                || next.offset_bytes + next.len_bytes - first.offset_bytes > MAX_READ_BYTES
            {
                break;
            }
            end = next.offset_bytes + next.len_bytes;
            run_end += 1;
        }
        let len = usize::try_from(end - first.offset_bytes).expect("a run fits in memory");
        let mut buf = vec![0u8; len];
        wanted[run_start]
            .2
            .read_exact_at(&mut buf, first.offset_bytes)
            .map_err(|source| ReadError::Io {
                segment: first.segment,
                source,
            })?;
        let buf = Bytes::from(buf);
        for (i, at, _) in &wanted[run_start..run_end] {
            let key = keys[*i];
            let offset = usize::try_from(at.offset_bytes - first.offset_bytes).expect("in run");
            let damaged = |reason: String| ReadError::Damaged {
                uid: key.uid,
                id: key.id,
                segment: at.segment,
                reason,
            };
            let (record, _) =
                next_record(&buf, offset).map_err(|e: DecodeError| damaged(e.to_string()))?;
            if Record::enqueued_key(&record) != Some((key.uid, key.id)) {
                return Err(damaged("another message's record".into()));
            }
            let body = Record::message_body(&record).map_err(|e| damaged(e.to_string()))?;
            if body.len() != key.len {
                return Err(damaged(format!(
                    "body of {} bytes, expected {}",
                    body.len(),
                    key.len
                )));
            }
            // A slice would pin the whole run; a body outlives its batch in socket buffers
            // only briefly, but requeued and dead-lettered ones may stay.
            out[*i] = Some(Bytes::copy_from_slice(&body));
        }
        run_start = run_end;
    }
    Ok(out)
}

type Place = Option<(Location, Arc<File>)>;

fn look_up(index: &SharedIndex, keys: &[DiskBody]) -> Vec<Place> {
    let index = index.index.lock();
    keys.iter()
        .map(|k| {
            let at = index.get((k.uid, k.id))?;
            Some((at, index.file(at.segment)?))
        })
        .collect()
}
