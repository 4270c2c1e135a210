//! A queue's content as one value, and the check a replicated op passes before it is applied.
//!
//! A backup that joins a queue late (a new member, or one that lost its copy) cannot replay
//! the queue's history from sequence 1: the primary hands it an [`QueueImage`] — every ready
//! and unacked message with its id, expiry and redelivered flag, and the sequence number the
//! image reflects — and then the ops after that number. Installing the image and applying
//! those ops yields the primary's queue exactly, so a backup promoted later serves what the
//! primary would have.
//!
//! An image travels in [`ImageChunk`]s of bounded size, installed one at a time
//! ([`Queue::install_chunk`]): the first starts from an empty queue, each later one appends
//! messages with higher ids, and the last sets the sequence number and next id, after which
//! ops apply again. Until the last chunk the queue is *installing* and refuses every op.
//!
//! Ops that arrive over a link are input from another process: [`Queue::fits`] checks that
//! an op continues this queue's sequence and names messages where the op expects them, so a
//! stream that diverged is refused (and the backup caught up again) instead of tripping
//! [`Queue::apply`]'s assertions.

use super::{Entry, Queue};
use crate::core::message::{DiskBody, Message};
use crate::core::ops::{OpKind, QueueOp};
use crate::core::producers::Producers;
use std::sync::Arc;
use thiserror::Error;

/// One message of a [`QueueImage`].
#[derive(Debug, Clone)]
pub struct ImageEntry {
    /// Its id in the queue.
    pub id: u64,
    /// The message.
    pub message: Arc<Message>,
    /// Absolute expiry time in ms.
    pub expires_at_ms: Option<u64>,
    /// Its next delivery is a redelivery.
    pub redelivered: bool,
    /// Delivered and not yet acked on the primary (else ready).
    pub unacked: bool,
}

/// A queue's whole content at one sequence number: what a new backup starts from.
#[derive(Debug, Clone, Default)]
pub struct QueueImage {
    /// The sequence number of the last op the image reflects; the ops after it follow.
    pub last_seq: u64,
    /// The id the next enqueued message gets (ids are never reused, even after the
    /// message with the highest id left).
    pub next_id: u64,
    /// Ready and unacked messages, in id order.
    pub entries: Vec<ImageEntry>,
    /// The queue's producer table (`core::producers`): what a session's resend is checked
    /// against. A copy that installs the image takes it in place of its own, which may
    /// hold numbers of publishes only that copy ever took (B18 in docs/reliability.md).
    pub producers: crate::core::producers::Highest,
}

/// One piece of a [`QueueImage`], as a catch-up sends it: the entries of one id range, and
/// the image's sequence number and next id (every chunk of one image carries the same, so a
/// chunk of another image is refused).
#[derive(Debug, Clone, Default)]
pub struct ImageChunk {
    /// The image's first chunk: the queue must be empty (what a stale replica held was
    /// removed first).
    pub first: bool,
    /// The image's last chunk: the queue holds the whole image after it, and the ops after
    /// `last_seq` apply next.
    pub last: bool,
    /// The sequence number of the last op the image reflects.
    pub last_seq: u64,
    /// The id the next enqueued message gets.
    pub next_id: u64,
    /// Ready and unacked messages, in id order, all above the previous chunk's.
    pub entries: Vec<ImageEntry>,
    /// On the first chunk: the image's producer table ([`QueueImage::producers`]).
    pub producers: crate::core::producers::Highest,
}

impl QueueImage {
    /// The image as chunks of at most `max_entries` entries each (at least one chunk, even
    /// for an empty image).
    pub fn into_chunks(self, max_entries: usize) -> Vec<ImageChunk> {
        let max_entries = max_entries.max(1);
        let mut chunks: Vec<ImageChunk> = Vec::new();
        let mut entries = self.entries.into_iter().peekable();
        let mut producers = self.producers;
        loop {
            let part: Vec<ImageEntry> = entries.by_ref().take(max_entries).collect();
            chunks.push(ImageChunk {
                first: chunks.is_empty(),
                last: entries.peek().is_none(),
                last_seq: self.last_seq,
                next_id: self.next_id,
                entries: part,
                producers: std::mem::take(&mut producers),
            });
            if entries.peek().is_none() {
                return chunks;
            }
        }
    }
}

/// Where a queue stands in the installation of an image: the chunks so far came from the
/// image of `last_seq` / `next_id` and ended at message `last_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Installing {
    last_seq: u64,
    next_id: u64,
    last_id: u64,
}

/// Why a replicated op or image does not fit a queue.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ReplicaError {
    /// The op is not the next in the queue's sequence.
    #[error("queue '{queue}': op {got} arrived where op {expected} was due")]
    Sequence {
        /// The queue.
        queue: String,
        /// The sequence number the queue expected.
        expected: u64,
        /// The one that came.
        got: u64,
    },
    /// The op names a message that is not where the op expects it (or reuses an id).
    #[error("queue '{queue}': op {seq} names message {id}, which is not where the op expects it")]
    Message {
        /// The queue.
        queue: String,
        /// The op's sequence number.
        seq: u64,
        /// The message id.
        id: u64,
    },
    /// An image arrived for a queue that already holds messages or serves consumers.
    #[error("queue '{0}': an image can only be installed into an empty queue with no consumers")]
    NotEmpty(String),
    /// A later chunk of an image arrived without the chunks before it (or of another image).
    #[error("queue '{0}': an image chunk arrived that does not continue the image being installed")]
    Chunk(String),
    /// An op arrived while an image is still being installed (its last chunk is due first).
    #[error("queue '{0}': an op arrived before the last chunk of the image being installed")]
    Installing(String),
    /// The queue is not on this member (or not a replica here).
    #[error("queue '{0}' has no replica on this member")]
    NoReplica(String),
}

impl Queue {
    /// Everything the queue holds, with the sequence number it reflects.
    pub fn image(&self) -> QueueImage {
        let entry = |e: &Entry, unacked: bool| ImageEntry {
            id: e.id,
            message: e.message.clone(),
            expires_at_ms: e.expires_at_ms,
            redelivered: e.redelivered,
            unacked,
        };
        let mut entries: Vec<ImageEntry> = self
            .ready()
            .map(|e| entry(e, false))
            .chain(self.unacked.values().map(|e| entry(e, true)))
            .collect();
        entries.sort_unstable_by_key(|e| e.id);
        QueueImage {
            last_seq: self.last_seq,
            next_id: self.next_id,
            entries,
            producers: self.producers.highest(),
        }
    }

    /// Installs one chunk of an image: the first into this empty queue, each later one after
    /// the chunk before it (same image, higher ids). After the last chunk the queue holds the
    /// image and the ops after `chunk.last_seq` apply next; before it, [`Queue::fits`]
    /// refuses every op. A chunk that does not fit changes nothing.
    ///
    /// Flow-to-disk holds for an image as for enqueues: with a `budget_bytes`, a message
    /// whose body would take the queue's resident bytes over it keeps only its key, so a
    /// backup catching up with a long queue holds the first budget's worth of bodies (the
    /// head, in id order), not all of them. Its body is in its `Enqueued` record when the
    /// message is persistent and `journals_persistent` (this member journals the queue's
    /// persistent messages); otherwise the entry owns a page record, and the message, body
    /// included, is returned with its id for the caller to write that record.
    pub fn install_chunk(
        &mut self,
        chunk: ImageChunk,
        budget_bytes: Option<usize>,
        journals_persistent: bool,
    ) -> Result<Vec<(u64, Arc<Message>)>, ReplicaError> {
        let mut last_id = if chunk.first {
            if self.ready_count > 0 || !self.unacked.is_empty() || !self.consumers.is_empty() {
                return Err(ReplicaError::NotEmpty(self.name.to_string()));
            }
            0
        } else {
            match self.installing {
                Some(i) if i.last_seq == chunk.last_seq && i.next_id == chunk.next_id => i.last_id,
                _ => return Err(ReplicaError::Chunk(self.name.to_string())),
            }
        };
        for e in &chunk.entries {
            if e.id <= last_id || e.id >= chunk.next_id {
                return Err(ReplicaError::Message {
                    queue: self.name.to_string(),
                    seq: chunk.last_seq,
                    id: e.id,
                });
            }
            last_id = e.id;
        }
        if chunk.first {
            // What this copy took on its own (as a primary cut off from the others, say)
            // and the image does not hold must not pass for taken: a resend of it would
            // be dropped as a duplicate here once this copy is promoted (B18).
            self.producers = Producers::default();
            self.producers.note_all(&chunk.producers);
        }
        let mut own_pages = Vec::new();
        for e in chunk.entries {
            self.producers.note(&e.message);
            let len = e.message.body_len();
            let over = budget_bytes.is_some_and(|budget| self.resident_bytes + len > budget);
            let mut message = e.message;
            let mut owns_page = false;
            if over && message.body.in_memory().is_some() {
                let key = DiskBody {
                    uid: self.uid,
                    id: e.id,
                    len,
                };
                let paged = Arc::new(message.paged(key));
                let full = std::mem::replace(&mut message, paged);
                owns_page = !(journals_persistent && full.persistent);
                if owns_page {
                    own_pages.push((e.id, full));
                }
            }
            self.add_resident(&message);
            self.owned_pages += usize::from(owns_page);
            let entry = Entry {
                id: e.id,
                message,
                expires_at_ms: e.expires_at_ms,
                redelivered: e.redelivered,
                owns_page,
            };
            if e.unacked {
                self.unacked.insert(entry.id, entry);
            } else {
                self.insert_ready(entry);
            }
        }
        if chunk.last {
            self.last_seq = chunk.last_seq;
            self.next_id = chunk.next_id;
            self.installing = None;
        } else {
            self.installing = Some(Installing {
                last_seq: chunk.last_seq,
                next_id: chunk.next_id,
                last_id,
            });
        }
        Ok(own_pages)
    }

    /// Makes this empty queue hold `image` at once (one chunk), every body in memory.
    pub fn install_image(&mut self, image: QueueImage) -> Result<(), ReplicaError> {
        for chunk in image.into_chunks(usize::MAX) {
            self.install_chunk(chunk, None, false)?;
        }
        Ok(())
    }

    /// An image is being installed: its last chunk has not arrived.
    pub fn is_installing(&self) -> bool {
        self.installing.is_some()
    }

    /// Whether `op` can be applied next: the next sequence number, and its message where
    /// the op kind expects it.
    pub fn fits(&self, op: &QueueOp) -> Result<(), ReplicaError> {
        if self.installing.is_some() {
            return Err(ReplicaError::Installing(self.name.to_string()));
        }
        if op.seq != self.last_seq + 1 {
            return Err(ReplicaError::Sequence {
                queue: self.name.to_string(),
                expected: self.last_seq + 1,
                got: op.seq,
            });
        }
        let misplaced = |id: u64| ReplicaError::Message {
            queue: self.name.to_string(),
            seq: op.seq,
            id,
        };
        match &op.kind {
            OpKind::Enqueue { id, .. } if *id < self.next_id => Err(misplaced(*id)),
            OpKind::Deliver { id, .. } | OpKind::Take { id } | OpKind::Drop { id, .. }
                if !self.is_ready(*id) =>
            {
                Err(misplaced(*id))
            }
            OpKind::Settle { id } | OpKind::Requeue { id } if !self.unacked.contains_key(id) => {
                Err(misplaced(*id))
            }
            OpKind::Purge { ids } => match ids.iter().find(|&&id| !self.is_ready(id)) {
                Some(&id) => Err(misplaced(id)),
                None if ids.len() != self.ready_count => Err(misplaced(0)),
                None => Ok(()),
            },
            _ => Ok(()),
        }
    }

    /// Ids of the unacked messages in id order: the order a promoted backup requeues them in,
    /// which is the order the old primary delivered them.
    pub fn unacked_in_order(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.unacked.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    fn is_ready(&self, id: u64) -> bool {
        self.levels
            .iter()
            .any(|l| l.binary_search_by_key(&id, |e| e.id).is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::{FieldTable, Properties};
    use crate::core::args::QueueArgs;
    use bytes::Bytes;
    use proptest::prelude::*;

    fn queue() -> Queue {
        let args = QueueArgs {
            max_priority: Some(3),
            ..QueueArgs::default()
        };
        Queue::new(
            "q".into(),
            true,
            None,
            false,
            FieldTable::default(),
            args,
            0,
        )
    }

    fn message(priority: u8) -> Arc<Message> {
        Arc::new(Message::authored(
            "".into(),
            "k".into(),
            Properties::default().with_priority(priority),
            Bytes::from_static(b"body"),
        ))
    }

    /// A random step a primary could take, as an op that fits its queue now (or `None` when
    /// the step has nothing to act on).
    fn next_op(q: &Queue, step: u8, pick: usize, priority: u8) -> Option<QueueOp> {
        let ready: Vec<u64> = q.ready().map(|e| e.id).collect();
        let unacked = q.unacked_in_order();
        let pick_of = |ids: &[u64]| (!ids.is_empty()).then(|| ids[pick % ids.len()]);
        let kind = match step % 7 {
            0 | 1 => OpKind::Enqueue {
                id: q.next_id(),
                message: message(priority),
                expires_at_ms: None,
            },
            2 => OpKind::Deliver {
                id: pick_of(&ready)?,
                session: None,
            },
            3 => OpKind::Settle {
                id: pick_of(&unacked)?,
            },
            4 => OpKind::Requeue {
                id: pick_of(&unacked)?,
            },
            5 => OpKind::Take {
                id: pick_of(&ready)?,
            },
            _ if pick.is_multiple_of(5) => OpKind::Purge { ids: ready },
            _ => OpKind::Drop {
                id: pick_of(&ready)?,
                reason: crate::core::ops::DropReason::Expired,
            },
        };
        Some(q.op(kind))
    }

    fn content(q: &Queue) -> Vec<(u64, bool, bool, u8)> {
        q.image()
            .entries
            .iter()
            .map(|e| (e.id, e.redelivered, e.unacked, e.message.priority))
            .collect()
    }

    proptest! {
        /// A backup that installs the primary's image at any point and applies the ops after
        /// it holds exactly what the primary holds, in the same delivery order.
        #[test]
        fn image_then_later_ops_rebuild_the_primary(
            steps in prop::collection::vec((any::<u8>(), any::<usize>(), 0u8..4), 1..120),
            cut in any::<prop::sample::Index>(),
            chunk_entries in 1usize..8,
        ) {
            let mut primary = queue();
            let cut = cut.index(steps.len());
            let mut backup = None;
            for (i, &(step, pick, priority)) in steps.iter().enumerate() {
                if i == cut {
                    // In chunks: every op is refused until the last one is in.
                    let mut b = queue();
                    let probe = primary.op(OpKind::Deliver {
                        id: 0,
                        session: None,
                    });
                    for chunk in primary.image().into_chunks(chunk_entries) {
                        let last = chunk.last;
                        b.install_chunk(chunk, None, false).unwrap();
                        prop_assert_eq!(b.is_installing(), !last);
                        if !last {
                            prop_assert_eq!(b.fits(&probe), Err(ReplicaError::Installing("q".into())));
                        }
                    }
                    backup = Some(b);
                }
                let Some(op) = next_op(&primary, step, pick, priority) else { continue };
                primary.fits(&op).unwrap();
                primary.apply(&op);
                if let Some(b) = backup.as_mut() {
                    b.fits(&op).unwrap();
                    b.apply(&op);
                }
            }
            let backup = backup.unwrap();
            prop_assert_eq!(content(&backup), content(&primary));
            prop_assert_eq!(backup.last_seq(), primary.last_seq());
            prop_assert_eq!(backup.next_id(), primary.next_id());
            prop_assert_eq!(backup.ready_count(), primary.ready_count());
            prop_assert_eq!(backup.resident_bytes(), primary.resident_bytes());
            let order = |q: &Queue| q.ready().map(|e| e.id).collect::<Vec<_>>();
            prop_assert_eq!(order(&backup), order(&primary));
        }
    }

    #[test]
    fn ops_that_do_not_continue_the_queue_are_refused() {
        let mut q = queue();
        let enqueue = q.op(OpKind::Enqueue {
            id: 1,
            message: message(0),
            expires_at_ms: None,
        });
        q.apply(&enqueue);
        assert!(matches!(
            q.fits(&enqueue),
            Err(ReplicaError::Sequence {
                expected: 2,
                got: 1,
                ..
            })
        ));
        let reused = q.op(OpKind::Enqueue {
            id: 1,
            message: message(0),
            expires_at_ms: None,
        });
        assert!(matches!(
            q.fits(&reused),
            Err(ReplicaError::Message { id: 1, .. })
        ));
        for kind in [
            OpKind::Settle { id: 1 },
            OpKind::Requeue { id: 1 },
            OpKind::Deliver {
                id: 9,
                session: None,
            },
            OpKind::Purge { ids: vec![] },
        ] {
            assert!(q.fits(&q.op(kind.clone())).is_err(), "{kind:?}");
        }
        assert!(
            q.fits(&q.op(OpKind::Deliver {
                id: 1,
                session: None
            }))
            .is_ok()
        );
        assert!(q.fits(&q.op(OpKind::Purge { ids: vec![1] })).is_ok());
    }

    #[test]
    fn an_image_goes_only_into_an_empty_queue_and_must_be_in_id_order() {
        let mut q = queue();
        let e = |id| ImageEntry {
            id,
            message: message(0),
            expires_at_ms: None,
            redelivered: false,
            unacked: false,
        };
        let disordered = QueueImage {
            producers: Vec::new(),
            last_seq: 4,
            next_id: 5,
            entries: vec![e(2), e(1)],
        };
        assert!(q.install_image(disordered).is_err());
        let beyond_next_id = QueueImage {
            producers: Vec::new(),
            last_seq: 4,
            next_id: 2,
            entries: vec![e(3)],
        };
        assert!(q.install_image(beyond_next_id).is_err());
        let good = QueueImage {
            producers: Vec::new(),
            last_seq: 4,
            next_id: 5,
            entries: vec![e(1), e(3)],
        };
        q.install_image(good.clone()).unwrap();
        assert_eq!(q.ready_count(), 2);
        assert!(matches!(
            q.install_image(good),
            Err(ReplicaError::NotEmpty(_))
        ));
    }

    #[test]
    fn a_chunk_must_continue_the_image_being_installed() {
        let e = |id| ImageEntry {
            id,
            message: message(0),
            expires_at_ms: None,
            redelivered: false,
            unacked: id == 4,
        };
        let image = QueueImage {
            producers: Vec::new(),
            last_seq: 9,
            next_id: 7,
            entries: vec![e(1), e(2), e(4), e(6)],
        };
        let chunks = image.clone().into_chunks(2);
        assert_eq!(chunks.len(), 2);
        assert!(chunks[0].first && !chunks[0].last && !chunks[1].first && chunks[1].last);

        let mut q = queue();
        assert_eq!(
            q.install_chunk(chunks[1].clone(), None, false).map(drop),
            Err(ReplicaError::Chunk("q".into())),
            "a later chunk without the first"
        );
        q.install_chunk(chunks[0].clone(), None, false).unwrap();
        let other_image = ImageChunk {
            last_seq: 10,
            ..chunks[1].clone()
        };
        assert_eq!(
            q.install_chunk(other_image, None, false).map(drop),
            Err(ReplicaError::Chunk("q".into())),
            "a chunk of another image"
        );
        let going_back = ImageChunk {
            entries: vec![e(2)],
            ..chunks[1].clone()
        };
        assert!(matches!(
            q.install_chunk(going_back, None, false),
            Err(ReplicaError::Message { id: 2, .. })
        ));
        assert_eq!(q.ready_count(), 2, "refused chunks changed nothing");
        q.install_chunk(chunks[1].clone(), None, false).unwrap();
        assert!(!q.is_installing());
        assert_eq!((q.last_seq(), q.next_id()), (9, 7));
        assert_eq!((q.ready_count(), q.unacked_count()), (3, 1));
        assert!(q.fits(&q.op(OpKind::Settle { id: 4 })).is_ok());
        assert_eq!(q.op(OpKind::Settle { id: 4 }).seq, 10);

        // A first chunk again (a retried catch-up) needs the queue emptied first.
        assert_eq!(
            q.install_chunk(chunks[0].clone(), None, false).map(drop),
            Err(ReplicaError::NotEmpty("q".into()))
        );
        let empty = QueueImage::default().into_chunks(3);
        assert_eq!(empty.len(), 1);
        assert!(empty[0].first && empty[0].last);
    }
}
