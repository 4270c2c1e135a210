//! The replication stream's frames: a primary's queue ops and catch-up images, as bytes.
//!
//! The journal keeps a lossy projection of a queue's ops (what must survive a restart:
//! persistent enqueues and removals). A backup needs every op — deliveries, requeues,
//! transient enqueues, each with its sequence number — to be the primary's queue at every
//! point, so the stream carries [`QueueOp`]s whole. A message is laid out as in a journal
//! record ([`put_message_content`]): one message format on disk and on the wire.
//!
//! A frame is the body of one message on the link to a backup:
//!
//! * `1` Ops: incarnation u64, queue (u8 len + bytes), count u32, then per op: seq u64, kind
//!   u8, and the kind's fields — Enqueue: id u64, expires-at ms u64 (0 = none), message;
//!   Deliver, Take, Settle, Requeue: id u64; Drop: id u64, reason u8; Purge: count u32,
//!   ids u64 × count; a delivery to a session's consumer is kind `8`: id u64, session (u8
//!   len + bytes), the consumer's serial u64, redelivered u8 (0 or 1). (Kind 8 is new: a
//!   member of an earlier release refuses it as malformed, so in a rolling upgrade the
//!   queues that session clients consume are replicated to old members only once they are
//!   upgraded too.)
//! * `2` Image chunk: incarnation u64, queue, flags u8 (1 first, 2 last), the image's last
//!   seq u64 and next id u64, count u32, then per entry: id u64, expires-at ms u64, flags u8
//!   (1 redelivered, 2 unacked), message; with flag 4 (the first chunk, when the queue has
//!   any), then its producer table: count u32, per producer its name (u32 len + bytes) and
//!   number u64. A catch-up sends an image as a run of these, each bounded in bytes and
//!   entries ([`ChunkLimits`]). (Flag 4 is new: a member of an earlier release refuses such
//!   a chunk as malformed, so a rolling upgrade's catch-ups to old members fail until they
//!   are upgraded too.)
//!
//! The incarnation is the queue's cluster-wide identity: a queue deleted and declared again
//! under the same name is another queue, and a backup must not apply one's ops to the other.

use crate::core::ops::{DropReason, OpKind, QueueOp, SessionDelivery};
use crate::core::queue::{ImageChunk, ImageEntry};
use crate::store::record::{DecodeError, Reader, put_message_content, put_str};
use bytes::Bytes;
use std::sync::Arc;
use thiserror::Error;

const OPS: u8 = 1;
const IMAGE: u8 = 2;

const ENQUEUE: u8 = 1;
const DELIVER: u8 = 2;
const TAKE: u8 = 3;
const SETTLE: u8 = 4;
const REQUEUE: u8 = 5;
const DROP: u8 = 6;
const PURGE: u8 = 7;
const DELIVER_TO: u8 = 8;

const REDELIVERED: u8 = 1;
const UNACKED: u8 = 2;

const FIRST: u8 = 1;
const LAST: u8 = 2;
const PRODUCERS: u8 = 4;

/// Bytes of an image chunk frame before its entries, besides the queue name: kind,
/// incarnation, name length, flags, last seq, next id, count.
const IMAGE_HEAD_BYTES: usize = 1 + 8 + 1 + 1 + 8 + 8 + 4;
/// Bytes of an ops frame before its ops, besides the queue name: kind, incarnation, name
/// length, count.
const OPS_HEAD_BYTES: usize = 1 + 8 + 1 + 4;

/// Bounds of one image chunk: a catch-up sends an image as chunks no larger than these (a
/// chunk holds one entry at least, so a message larger than `max_bytes` goes alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkLimits {
    /// Encoded bytes of a chunk frame.
    pub max_bytes: usize,
    /// Entries of a chunk.
    pub max_entries: usize,
}

impl ChunkLimits {
    /// The default: 1 MiB and 4096 entries, or less when the members' `max_message_size`
    /// (a chunk is the body of one message on the link) is smaller.
    pub fn for_max_message_size(max_message_size: u64) -> Self {
        let max_message_size = usize::try_from(max_message_size).unwrap_or(usize::MAX);
        Self {
            max_bytes: DEFAULT_CHUNK_BYTES.min(max_message_size),
            max_entries: DEFAULT_CHUNK_ENTRIES,
        }
    }

    /// How many of `entries` (their encoded lengths, from the front) the next chunk of
    /// `queue`'s image takes, besides `extra` bytes of producer table: at least one, then as
    /// many as fit.
    pub fn take(
        &self,
        queue: &str,
        extra: usize,
        entries: impl IntoIterator<Item = usize>,
    ) -> usize {
        fit(
            IMAGE_HEAD_BYTES + queue.len() + extra,
            self.max_bytes,
            self.max_entries,
            entries,
        )
    }

    /// How many of `ops` (their encoded lengths, from the front) the next ops frame of
    /// `queue` takes: at least one, then as many as fit in `max_bytes` (a batch's ops of
    /// one queue go out in as many frames as that needs).
    pub fn take_ops(&self, queue: &str, ops: impl IntoIterator<Item = usize>) -> usize {
        fit(
            OPS_HEAD_BYTES + queue.len(),
            self.max_bytes,
            usize::MAX,
            ops,
        )
    }
}

fn fit(
    head: usize,
    max_bytes: usize,
    max_items: usize,
    lens: impl IntoIterator<Item = usize>,
) -> usize {
    let mut bytes = head;
    let mut n = 0;
    for len in lens.into_iter().take(max_items.max(1)) {
        if n > 0 && bytes + len > max_bytes {
            break;
        }
        bytes += len;
        n += 1;
    }
    n
}

/// Encoded bytes of one op in an ops frame (body included).
pub fn op_len(op: &QueueOp) -> usize {
    8 + 1
        + match &op.kind {
            OpKind::Enqueue { message, .. } => 8 + 8 + message_len(message),
            OpKind::Deliver {
                session: Some(to), ..
            } => 8 + 1 + to.session.len() + 8 + 1,
            OpKind::Deliver { .. }
            | OpKind::Take { .. }
            | OpKind::Settle { .. }
            | OpKind::Requeue { .. } => 8,
            OpKind::Drop { .. } => 9,
            OpKind::Purge { ids } => 4 + 8 * ids.len(),
        }
}

/// Encoded bytes of a message's content (as [`put_message_content`] lays it out).
fn message_len(m: &crate::core::message::Message) -> usize {
    1 + m.exchange.as_str().len()
        + 1
        + m.routing_key.as_str().len()
        + 4
        + m.header_payload.len()
        + 4
        + m.body_len()
}

/// Default bound of an image chunk's bytes.
pub const DEFAULT_CHUNK_BYTES: usize = 1024 * 1024;
/// Default bound of an image chunk's entries.
pub const DEFAULT_CHUNK_ENTRIES: usize = 4096;

/// Encoded bytes of an image chunk's producer table (0 when there is none).
pub fn producers_len(producers: &[(Arc<str>, u64)]) -> usize {
    if producers.is_empty() {
        return 0;
    }
    4 + producers
        .iter()
        .map(|(p, _)| 4 + p.len() + 8)
        .sum::<usize>()
}

/// Encoded bytes of one image entry (body included, wherever it is now).
pub fn image_entry_len(e: &ImageEntry) -> usize {
    8 + 8 + 1 + message_len(&e.message)
}

/// One frame of the replication stream.
#[derive(Debug, Clone)]
pub enum Frame {
    /// Ops of one queue, in sequence order.
    Ops {
        /// The queue's cluster-wide identity.
        incarnation: u64,
        /// Its name.
        queue: Arc<str>,
        /// The ops.
        ops: Vec<QueueOp>,
    },
    /// A piece of a queue's whole content: a catch-up starts from the image these make up.
    Image {
        /// The queue's cluster-wide identity.
        incarnation: u64,
        /// Its name.
        queue: Arc<str>,
        /// The piece.
        chunk: ImageChunk,
    },
}

/// Why a frame could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EncodeError {
    /// A message body is on disk only (flow-to-disk): the caller reads it back first.
    #[error("message {id} of queue '{queue}' has its body on disk only")]
    BodyOnDisk {
        /// The queue.
        queue: String,
        /// The message id.
        id: u64,
    },
}

impl Frame {
    /// Appends the frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        match self {
            Frame::Ops {
                incarnation,
                queue,
                ops,
            } => {
                head(out, OPS, *incarnation, queue, ops.len());
                for op in ops {
                    put_op(out, op)?;
                }
            }
            Frame::Image {
                incarnation,
                queue,
                chunk,
            } => {
                out.push(IMAGE);
                out.extend_from_slice(&incarnation.to_be_bytes());
                put_str(out, queue);
                out.push(
                    if chunk.first { FIRST } else { 0 }
                        | if chunk.last { LAST } else { 0 }
                        | if chunk.producers.is_empty() {
                            0
                        } else {
                            PRODUCERS
                        },
                );
                out.extend_from_slice(&chunk.last_seq.to_be_bytes());
                out.extend_from_slice(&chunk.next_id.to_be_bytes());
                out.extend_from_slice(&(chunk.entries.len() as u32).to_be_bytes());
                for e in &chunk.entries {
                    on_disk(queue, e.id, e.message.body.in_memory().is_none())?;
                    out.extend_from_slice(&e.id.to_be_bytes());
                    out.extend_from_slice(&e.expires_at_ms.unwrap_or(0).to_be_bytes());
                    let flags = if e.redelivered { REDELIVERED } else { 0 }
                        | if e.unacked { UNACKED } else { 0 };
                    out.push(flags);
                    put_message_content(out, &e.message);
                }
                if !chunk.producers.is_empty() {
                    out.extend_from_slice(&(chunk.producers.len() as u32).to_be_bytes());
                    for (producer, seq) in &chunk.producers {
                        out.extend_from_slice(&(producer.len() as u32).to_be_bytes());
                        out.extend_from_slice(producer.as_bytes());
                        out.extend_from_slice(&seq.to_be_bytes());
                    }
                }
            }
        }
        Ok(())
    }

    /// Decodes one frame (the whole of `data`).
    pub fn decode(data: &Bytes) -> Result<Frame, DecodeError> {
        let mut r = Reader::new(data);
        let frame = match r.u8()? {
            OPS => {
                let incarnation = r.u64()?;
                let queue: Arc<str> = r.short_str()?.into();
                let n = count(&mut r, 9)?;
                let ops = (0..n)
                    .map(|_| read_op(&mut r, &queue))
                    .collect::<Result<_, _>>()?;
                Frame::Ops {
                    incarnation,
                    queue,
                    ops,
                }
            }
            IMAGE => {
                let incarnation = r.u64()?;
                let queue = r.short_str()?.into();
                let chunk_flags = r.u8()?;
                if chunk_flags & !(FIRST | LAST | PRODUCERS) != 0 {
                    return Err(DecodeError::Malformed("image chunk flags"));
                }
                let last_seq = r.u64()?;
                let next_id = r.u64()?;
                let n = count(&mut r, 17)?;
                let entries = (0..n)
                    .map(|_| {
                        let id = r.u64()?;
                        let expires = r.u64()?;
                        let flags = r.u8()?;
                        Ok(ImageEntry {
                            id,
                            expires_at_ms: (expires != 0).then_some(expires),
                            redelivered: flags & REDELIVERED != 0,
                            unacked: flags & UNACKED != 0,
                            message: Arc::new(r.message()?),
                        })
                    })
                    .collect::<Result<_, DecodeError>>()?;
                let producers = if chunk_flags & PRODUCERS != 0 {
                    let n = count(&mut r, 12)?;
                    (0..n)
                        .map(|_| {
                            let name = std::str::from_utf8(&r.bytes()?)
                                .map_err(|_| DecodeError::Malformed("producer name"))?
                                .into();
                            Ok((name, r.u64()?))
                        })
                        .collect::<Result<_, DecodeError>>()?
                } else {
                    Vec::new()
                };
                Frame::Image {
                    incarnation,
                    queue,
                    chunk: ImageChunk {
                        first: chunk_flags & FIRST != 0,
                        last: chunk_flags & LAST != 0,
                        last_seq,
                        next_id,
                        entries,
                        producers,
                    },
                }
            }
            _ => return Err(DecodeError::Malformed("replication frame type")),
        };
        if !r.is_done() {
            return Err(DecodeError::Malformed("bytes after the replication frame"));
        }
        Ok(frame)
    }
}

fn head(out: &mut Vec<u8>, kind: u8, incarnation: u64, queue: &str, n: usize) {
    out.push(kind);
    out.extend_from_slice(&incarnation.to_be_bytes());
    put_str(out, queue);
    out.extend_from_slice(&(n as u32).to_be_bytes());
}

fn on_disk(queue: &str, id: u64, disk: bool) -> Result<(), EncodeError> {
    if disk {
        return Err(EncodeError::BodyOnDisk {
            queue: queue.to_owned(),
            id,
        });
    }
    Ok(())
}

/// A count of items of at least `min_size` bytes each, refused when the rest cannot hold
/// that many (a corrupt count must not make the decoder allocate for it).
fn count(r: &mut Reader<'_>, min_size: usize) -> Result<usize, DecodeError> {
    let n = r.u32()? as usize;
    if n > r.remaining() / min_size {
        return Err(DecodeError::Malformed("item count"));
    }
    Ok(n)
}

fn put_op(out: &mut Vec<u8>, op: &QueueOp) -> Result<(), EncodeError> {
    out.extend_from_slice(&op.seq.to_be_bytes());
    let id_only = |out: &mut Vec<u8>, kind: u8, id: u64| {
        out.push(kind);
        out.extend_from_slice(&id.to_be_bytes());
    };
    match &op.kind {
        OpKind::Enqueue {
            id,
            message,
            expires_at_ms,
        } => {
            on_disk(&op.queue, *id, message.body.in_memory().is_none())?;
            out.push(ENQUEUE);
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&expires_at_ms.unwrap_or(0).to_be_bytes());
            put_message_content(out, message);
        }
        OpKind::Deliver { id, session: None } => id_only(out, DELIVER, *id),
        OpKind::Deliver {
            id,
            session: Some(to),
        } => {
            id_only(out, DELIVER_TO, *id);
            put_str(out, &to.session);
            out.extend_from_slice(&to.consumer.to_be_bytes());
            out.push(u8::from(to.redelivered));
        }
        OpKind::Take { id } => id_only(out, TAKE, *id),
        OpKind::Settle { id } => id_only(out, SETTLE, *id),
        OpKind::Requeue { id } => id_only(out, REQUEUE, *id),
        OpKind::Drop { id, reason } => {
            id_only(out, DROP, *id);
            out.push(match reason {
                DropReason::Expired => 1,
                DropReason::MaxLength => 2,
                DropReason::Rejected => 3,
            });
        }
        OpKind::Purge { ids } => {
            out.push(PURGE);
            out.extend_from_slice(&(ids.len() as u32).to_be_bytes());
            for id in ids {
                out.extend_from_slice(&id.to_be_bytes());
            }
        }
    }
    Ok(())
}

fn read_op(r: &mut Reader<'_>, queue: &Arc<str>) -> Result<QueueOp, DecodeError> {
    let seq = r.u64()?;
    let kind = match r.u8()? {
        ENQUEUE => {
            let id = r.u64()?;
            let expires = r.u64()?;
            OpKind::Enqueue {
                id,
                expires_at_ms: (expires != 0).then_some(expires),
                message: Arc::new(r.message()?),
            }
        }
        DELIVER => OpKind::Deliver {
            id: r.u64()?,
            session: None,
        },
        DELIVER_TO => OpKind::Deliver {
            id: r.u64()?,
            session: Some(SessionDelivery {
                session: r.short_str()?.into(),
                consumer: r.u64()?,
                redelivered: match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(DecodeError::Malformed("redelivered flag")),
                },
            }),
        },
        TAKE => OpKind::Take { id: r.u64()? },
        SETTLE => OpKind::Settle { id: r.u64()? },
        REQUEUE => OpKind::Requeue { id: r.u64()? },
        DROP => OpKind::Drop {
            id: r.u64()?,
            reason: match r.u8()? {
                1 => DropReason::Expired,
                2 => DropReason::MaxLength,
                3 => DropReason::Rejected,
                _ => return Err(DecodeError::Malformed("drop reason")),
            },
        },
        PURGE => {
            let n = count(r, 8)?;
            let ids = (0..n).map(|_| r.u64()).collect::<Result<_, _>>()?;
            OpKind::Purge { ids }
        }
        _ => return Err(DecodeError::Malformed("op kind")),
    };
    // The backup applies the kind to its own copy, under its own uid and durability.
    Ok(QueueOp {
        queue: queue.clone(),
        uid: 0,
        seq,
        durable: false,
        kind,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::Properties;
    use crate::core::message::{Body, DiskBody, Message};
    use proptest::prelude::*;

    fn message(body: &[u8], persistent: bool) -> Arc<Message> {
        let props = if persistent {
            Properties::default().with_delivery_mode(2)
        } else {
            Properties::default()
        };
        Arc::new(Message::authored(
            "ex".into(),
            "rk".into(),
            props.with_priority(3),
            Bytes::copy_from_slice(body),
        ))
    }

    fn kind() -> impl Strategy<Value = OpKind> {
        prop_oneof![
            (
                any::<u64>(),
                any::<Option<u64>>(),
                prop::collection::vec(any::<u8>(), 0..64),
                any::<bool>()
            )
                .prop_map(|(id, expires, body, persistent)| OpKind::Enqueue {
                    id,
                    expires_at_ms: expires.filter(|&e| e != 0),
                    message: message(&body, persistent),
                }),
            any::<u64>().prop_map(|id| OpKind::Deliver { id, session: None }),
            (any::<u64>(), "[a-f0-9-]{1,36}", any::<u64>(), any::<bool>()).prop_map(
                |(id, s, consumer, redelivered)| OpKind::Deliver {
                    id,
                    session: Some(SessionDelivery {
                        session: s.into(),
                        consumer,
                        redelivered,
                    }),
                }
            ),
            any::<u64>().prop_map(|id| OpKind::Take { id }),
            any::<u64>().prop_map(|id| OpKind::Settle { id }),
            any::<u64>().prop_map(|id| OpKind::Requeue { id }),
            (any::<u64>(), 0..3u8).prop_map(|(id, r)| OpKind::Drop {
                id,
                reason: [
                    DropReason::Expired,
                    DropReason::MaxLength,
                    DropReason::Rejected
                ][usize::from(r)],
            }),
            prop::collection::vec(any::<u64>(), 0..8).prop_map(|ids| OpKind::Purge { ids }),
        ]
    }

    /// Ops compare by their debug form: messages have no `PartialEq`, and the debug form
    /// shows every field the backup applies.
    fn shown(ops: &[QueueOp]) -> String {
        format!("{ops:?}")
    }

    proptest! {
        #[test]
        fn ops_round_trip(kinds in prop::collection::vec(kind(), 0..20), incarnation in any::<u64>()) {
            let queue: Arc<str> = "orders".into();
            let ops: Vec<QueueOp> = kinds
                .into_iter()
                .enumerate()
                .map(|(i, kind)| QueueOp { queue: queue.clone(), uid: 0, seq: i as u64 + 1, durable: false, kind })
                .collect();
            let frame = Frame::Ops { incarnation, queue, ops: ops.clone() };
            let mut out = Vec::new();
            frame.encode(&mut out).unwrap();
            let expected_len = OPS_HEAD_BYTES + "orders".len() + ops.iter().map(op_len).sum::<usize>();
            prop_assert_eq!(out.len(), expected_len, "op_len is exact");
            let data = Bytes::from(out);
            let Frame::Ops { incarnation: got, queue, ops: back } = Frame::decode(&data).unwrap() else {
                panic!("an ops frame decodes as ops");
            };
            prop_assert_eq!(got, incarnation);
            prop_assert_eq!(&*queue, "orders");
            prop_assert_eq!(shown(&back), shown(&ops));
            // Every strict prefix is refused, never misread.
            for cut in 0..data.len() {
                prop_assert!(Frame::decode(&data.slice(..cut)).is_err());
            }
        }
    }

    #[test]
    fn an_image_chunk_round_trips_with_its_flags_and_its_size_is_known_in_advance() {
        let entry = |id, redelivered, unacked| ImageEntry {
            id,
            message: message(b"m", true),
            expires_at_ms: (id == 2).then_some(77),
            redelivered,
            unacked,
        };
        for (first, last) in [(true, false), (false, false), (false, true), (true, true)] {
            let producers = if first {
                vec![(Arc::from("session:1"), 12), (Arc::from("s:2"), 3)]
            } else {
                Vec::new()
            };
            let chunk = ImageChunk {
                first,
                last,
                last_seq: 40,
                next_id: 9,
                entries: vec![
                    entry(2, true, true),
                    entry(5, true, false),
                    entry(8, false, false),
                ],
                producers,
            };
            let mut out = Vec::new();
            Frame::Image {
                incarnation: 3,
                queue: "q".into(),
                chunk: chunk.clone(),
            }
            .encode(&mut out)
            .unwrap();
            let expected_len = IMAGE_HEAD_BYTES
                + 1
                + producers_len(&chunk.producers)
                + chunk.entries.iter().map(image_entry_len).sum::<usize>();
            assert_eq!(out.len(), expected_len, "image_entry_len is exact");
            let data = Bytes::from(out);
            let Frame::Image {
                incarnation,
                queue,
                chunk: back,
            } = Frame::decode(&data).unwrap()
            else {
                panic!("an image frame decodes as an image");
            };
            assert_eq!((incarnation, &*queue), (3, "q"));
            assert_eq!(format!("{back:?}"), format!("{chunk:?}"));
            for cut in 0..data.len() {
                assert!(Frame::decode(&data.slice(..cut)).is_err());
            }
        }
    }

    #[test]
    fn chunk_limits_bound_bytes_and_entries_but_take_one_entry_at_least() {
        let limits = ChunkLimits {
            max_bytes: 1000,
            max_entries: 3,
        };
        let head = IMAGE_HEAD_BYTES + "q".len();
        assert_eq!(
            limits.take("q", 0, [100, 100, 100, 100]),
            3,
            "entries bound"
        );
        assert_eq!(limits.take("q", 0, [400, 400, 400]), 2, "bytes bound");
        assert_eq!(limits.take("q", 0, [1000 - head, 1]), 1, "exactly full");
        assert_eq!(
            limits.take("q", 0, [5000, 1]),
            1,
            "a large message goes alone"
        );
        assert_eq!(
            limits.take("q", 400, [400, 400]),
            1,
            "a producer table counts too"
        );
        assert_eq!(limits.take("q", 0, []), 0);
        assert_eq!(
            limits.take_ops("q", [10; 500]),
            (1000 - OPS_HEAD_BYTES - 1) / 10,
            "ops are bounded by bytes only"
        );
        assert_eq!(limits.take_ops("q", [5000, 1]), 1);
        let small = ChunkLimits::for_max_message_size(64 * 1024);
        assert_eq!(small.max_bytes, 64 * 1024);
        let default = ChunkLimits::for_max_message_size(128 * 1024 * 1024);
        assert_eq!(default.max_bytes, DEFAULT_CHUNK_BYTES);
    }

    #[test]
    fn bodies_on_disk_are_refused_and_garbage_is_malformed() {
        let mut paged = (*message(b"abc", true)).clone();
        paged.body = Body::Disk(DiskBody {
            uid: 1,
            id: 4,
            len: 3,
        });
        let op = QueueOp {
            queue: "q".into(),
            uid: 0,
            seq: 1,
            durable: true,
            kind: OpKind::Enqueue {
                id: 4,
                message: Arc::new(paged),
                expires_at_ms: None,
            },
        };
        let frame = Frame::Ops {
            incarnation: 1,
            queue: "q".into(),
            ops: vec![op],
        };
        assert_eq!(
            frame.encode(&mut Vec::new()),
            Err(EncodeError::BodyOnDisk {
                queue: "q".into(),
                id: 4
            })
        );
        for junk in [
            &b""[..],
            b"\x09",
            b"\x01\0\0\0\0\0\0\0\x01\x01q\xff\xff\xff\xff",
        ] {
            assert!(Frame::decode(&Bytes::copy_from_slice(junk)).is_err());
        }
    }
}
