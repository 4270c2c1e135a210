//! Journal records: the queue ops of durable queues as they are written to disk.
//!
//! On disk a record is `[len u32][crc32 u32][body]`, the checksum over the body, so that a
//! torn or flipped record is recognised and never served. Bodies:
//!
//! * `1` Enqueued: uid u64, id u64, expires-at ms u64 (0 = none), exchange (u8 len + bytes),
//!   routing key (u8 len + bytes), content header payload (u32 len + bytes), body (u32 len + bytes)
//! * `2` Removed: uid u64, count u32, ids u64 × count
//! * `3` Paged: laid out as Enqueued. The body of a message that is not persistent (or not on
//!   a durable queue), written only so that flow-to-disk can drop it from memory. Recovery
//!   skips it: a transient message never comes back after a restart.
//! * `4` Producers: uid u64, flags u8 (1 = replace), count u32, count × (producer name
//!   (u32 len + bytes), number u64). The highest number each session producer reached the
//!   queue with, where no Enqueued record says it: a publish whose enqueue was cancelled by
//!   its ack in the same batch, and every table before the compactor deletes a segment (B15
//!   in docs/reliability.md). Recovery takes the highest of these and of every Enqueued
//!   record's producer, so that a session's resend after a restart is still recognised —
//!   except after a record that *replaces* the table: a replica that installed its
//!   primary's image took the primary's table in place of its own (B18).

use crate::core::ops::{OpKind, QueueOp};
use crate::core::{Body, DiskBody, Message};
use bytes::Bytes;
use std::sync::Arc;
use thiserror::Error;

/// Bytes before a record body: length and checksum.
pub const RECORD_HEADER: usize = 8;
/// The largest record body accepted when reading: a message of the broker's maximum size plus
/// its header. Guards recovery against a corrupt length field.
pub const MAX_RECORD_BODY: usize = 512 * 1024 * 1024;

const ENQUEUED: u8 = 1;
const REMOVED: u8 = 2;
const PAGED: u8 = 3;
const PRODUCERS: u8 = 4;

/// A change to a durable queue's persistent content.
#[derive(Debug, Clone)]
pub enum Record {
    /// A persistent message joined the queue `uid` with this id.
    Enqueued {
        /// Queue incarnation.
        uid: u64,
        /// Message id within the queue.
        id: u64,
        /// Absolute expiry time.
        expires_at_ms: Option<u64>,
        /// The message.
        message: Arc<Message>,
    },
    /// The body of a message that does not survive a restart, written so that its queue
    /// can drop it from memory (flow-to-disk).
    Paged {
        /// Queue incarnation.
        uid: u64,
        /// Message id within the queue.
        id: u64,
        /// The message, body in memory.
        message: Arc<Message>,
    },
    /// Messages left the queue `uid` (acked, expired, purged, dropped).
    Removed {
        /// Queue incarnation.
        uid: u64,
        /// Their ids.
        ids: Vec<u64>,
    },
    /// Session producers reached the queue `uid` up to these numbers.
    Producers {
        /// Queue incarnation.
        uid: u64,
        /// Producer and highest number.
        highest: crate::core::producers::Highest,
        /// The table is this one from here on (a replica took its primary's), rather than
        /// raised by it.
        replace: bool,
    },
}

/// Why bytes on disk are not a record.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    /// The data ends inside a record (a torn write at the tail).
    #[error("record truncated")]
    Truncated,
    /// The checksum does not match (corruption).
    #[error("record checksum mismatch")]
    Checksum,
    /// The body does not parse (unknown type, bad lengths).
    #[error("malformed record: {0}")]
    Malformed(&'static str),
    /// Zeros where the next record would start: the part of a segment written ahead of time
    /// (`store::spare`) that no record reached yet. No record has an empty body.
    #[error("end of the records")]
    End,
}

/// The records of one batch of queue ops of durable queues (a transient replicated queue's
/// ops are for its backups only): persistent enqueues and every removal. Removals of
/// messages that were never written are dropped later by the journal, which knows.
pub fn records_from_ops(ops: &[QueueOp], out: &mut Vec<Record>) {
    for op in ops.iter().filter(|op| op.durable) {
        match &op.kind {
            OpKind::Enqueue {
                id,
                message,
                expires_at_ms,
            } if message.persistent => out.push(Record::Enqueued {
                uid: op.uid,
                id: *id,
                expires_at_ms: *expires_at_ms,
                message: message.clone(),
            }),
            OpKind::Take { id } | OpKind::Settle { id } | OpKind::Drop { id, .. } => {
                match out.last_mut() {
                    Some(Record::Removed { uid, ids }) if *uid == op.uid => ids.push(*id),
                    _ => out.push(Record::Removed {
                        uid: op.uid,
                        ids: vec![*id],
                    }),
                }
            }
            OpKind::Purge { ids } if !ids.is_empty() => out.push(Record::Removed {
                uid: op.uid,
                ids: ids.clone(),
            }),
            _ => {}
        }
    }
}

/// Appends a short string (u8 length, bytes): exchange and routing key names fit in 255 bytes.
pub(crate) fn put_str(out: &mut Vec<u8>, s: &str) {
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

/// Appends a byte string (u32 length, bytes).
pub(crate) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

fn put_message(
    out: &mut Vec<u8>,
    kind: u8,
    uid: u64,
    id: u64,
    expires_at_ms: Option<u64>,
    message: &Message,
) {
    out.push(kind);
    out.extend_from_slice(&uid.to_be_bytes());
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&expires_at_ms.unwrap_or(0).to_be_bytes());
    put_message_content(out, message);
}

/// Appends what a message is made of — exchange, routing key, the content header as the
/// publisher sent it, the body — in the layout [`Reader::message`] reads: the journal and
/// the replication stream carry a message the same way.
pub(crate) fn put_message_content(out: &mut Vec<u8>, message: &Message) {
    put_str(out, message.exchange.as_str());
    put_str(out, message.routing_key.as_str());
    put_bytes(out, &message.header_payload);
    put_bytes(out, message.body.bytes());
}

impl Record {
    /// Appends the record, framed and checksummed, to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0u8; RECORD_HEADER]);
        match self {
            Record::Enqueued {
                uid,
                id,
                expires_at_ms,
                message,
            } => put_message(out, ENQUEUED, *uid, *id, *expires_at_ms, message),
            Record::Paged { uid, id, message } => put_message(out, PAGED, *uid, *id, None, message),
            Record::Removed { uid, ids } => {
                out.push(REMOVED);
                out.extend_from_slice(&uid.to_be_bytes());
                out.extend_from_slice(&(ids.len() as u32).to_be_bytes());
                for id in ids {
                    out.extend_from_slice(&id.to_be_bytes());
                }
            }
            Record::Producers {
                uid,
                highest,
                replace,
            } => {
                out.push(PRODUCERS);
                out.extend_from_slice(&uid.to_be_bytes());
                out.push(u8::from(*replace));
                out.extend_from_slice(&(highest.len() as u32).to_be_bytes());
                for (producer, seq) in highest {
                    put_bytes(out, producer.as_bytes());
                    out.extend_from_slice(&seq.to_be_bytes());
                }
            }
        }
        let body_len = out.len() - start - RECORD_HEADER;
        let crc = crc32fast::hash(&out[start + RECORD_HEADER..]);
        out[start..start + 4].copy_from_slice(&(body_len as u32).to_be_bytes());
        out[start + 4..start + 8].copy_from_slice(&crc.to_be_bytes());
    }

    /// The (queue uid, message id) an Enqueued or Paged record stores, read without
    /// decoding the message: what the compactor needs to decide whether to keep it.
    pub fn enqueued_key(body: &[u8]) -> Option<(u64, u64)> {
        if !matches!(body.first(), Some(&ENQUEUED | &PAGED)) || body.len() < 17 {
            return None;
        }
        Some((
            u64::from_be_bytes(body[1..9].try_into().ok()?),
            u64::from_be_bytes(body[9..17].try_into().ok()?),
        ))
    }

    /// The message body an Enqueued or Paged record holds, a slice of `body` (the record
    /// body, checksum verified), read without decoding the properties: what flow-to-disk
    /// reads back on delivery.
    pub fn message_body(body: &Bytes) -> Result<Bytes, DecodeError> {
        let mut r = Reader { buf: body, at: 0 };
        if !matches!(r.u8()?, ENQUEUED | PAGED) {
            return Err(DecodeError::Malformed("record type"));
        }
        r.take(24)?;
        r.short_str()?;
        r.short_str()?;
        r.bytes()?;
        r.bytes()
    }

    /// Length of the head of an Enqueued record body: everything but the message body
    /// (type, key, expiry, exchange, routing key, content header and the body's length). A
    /// snapshot stores heads so that recovery rebuilds queues without reading bodies.
    pub fn head_len(body: &Bytes) -> Result<usize, DecodeError> {
        let mut r = Reader { buf: body, at: 0 };
        if r.u8()? != ENQUEUED {
            return Err(DecodeError::Malformed("record type"));
        }
        r.take(24)?;
        r.short_str()?;
        r.short_str()?;
        r.bytes()?;
        r.u32()?;
        Ok(r.at)
    }

    /// [`Record::head_len`] of the Enqueued record of `message`, computed without encoding.
    pub fn head_len_of(message: &Message) -> usize {
        1 + 3 * 8
            + 1
            + message.exchange.as_str().len()
            + 1
            + message.routing_key.as_str().len()
            + 4
            + message.header_payload.len()
            + 4
    }

    /// Decodes the head of an Enqueued record (see [`Record::head_len`]) into the record it
    /// stands for, its message's body left on disk under the record's key.
    pub fn decode_head(head: &Bytes) -> Result<Record, DecodeError> {
        let mut r = Reader { buf: head, at: 0 };
        if r.u8()? != ENQUEUED {
            return Err(DecodeError::Malformed("record type"));
        }
        let uid = r.u64()?;
        let id = r.u64()?;
        let expires = r.u64()?;
        let exchange = r.short_str()?;
        let routing_key = r.short_str()?;
        let header_payload = r.bytes()?;
        let len = r.u32()? as usize;
        let mut message = message(exchange, routing_key, header_payload, Bytes::new())?;
        message.body = Body::Disk(DiskBody { uid, id, len });
        Ok(Record::Enqueued {
            uid,
            id,
            expires_at_ms: (expires != 0).then_some(expires),
            message: Arc::new(message),
        })
    }

    /// Decodes one record body (after its header was checked).
    pub fn decode(body: &Bytes) -> Result<Record, DecodeError> {
        let mut r = Reader { buf: body, at: 0 };
        match r.u8()? {
            kind @ (ENQUEUED | PAGED) => {
                let uid = r.u64()?;
                let id = r.u64()?;
                let expires = r.u64()?;
                let message = Arc::new(r.message()?);
                Ok(if kind == PAGED {
                    Record::Paged { uid, id, message }
                } else {
                    Record::Enqueued {
                        uid,
                        id,
                        expires_at_ms: (expires != 0).then_some(expires),
                        message,
                    }
                })
            }
            REMOVED => {
                let uid = r.u64()?;
                let n = r.u32()? as usize;
                if n > body.len() / 8 {
                    return Err(DecodeError::Malformed("id count"));
                }
                let ids = (0..n).map(|_| r.u64()).collect::<Result<_, _>>()?;
                Ok(Record::Removed { uid, ids })
            }
            PRODUCERS => {
                let uid = r.u64()?;
                let replace = match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(DecodeError::Malformed("producers flags")),
                };
                let n = r.u32()? as usize;
                if n > body.len() / 12 {
                    return Err(DecodeError::Malformed("producer count"));
                }
                let mut highest = Vec::with_capacity(n);
                for _ in 0..n {
                    let name = std::str::from_utf8(&r.bytes()?)
                        .map_err(|_| DecodeError::Malformed("producer name"))?
                        .into();
                    highest.push((name, r.u64()?));
                }
                Ok(Record::Producers {
                    uid,
                    highest,
                    replace,
                })
            }
            _ => Err(DecodeError::Malformed("record type")),
        }
    }
}

/// Splits the next record off `data` at `at`: returns its body (checksum verified) and the
/// offset after it, or [`DecodeError::End`] where only zeros follow the last record.
pub fn next_record(data: &Bytes, at: usize) -> Result<(Bytes, usize), DecodeError> {
    if data.len() < at + RECORD_HEADER {
        return Err(if data[at.min(data.len())..].iter().all(|b| *b == 0) {
            DecodeError::End
        } else {
            DecodeError::Truncated
        });
    }
    let len = u32::from_be_bytes(data[at..at + 4].try_into().expect("4 bytes")) as usize;
    if len == 0 {
        return Err(DecodeError::End);
    }
    let crc = u32::from_be_bytes(data[at + 4..at + 8].try_into().expect("4 bytes"));
    if len > MAX_RECORD_BODY {
        return Err(DecodeError::Checksum);
    }
    let end = at + RECORD_HEADER + len;
    if data.len() < end {
        return Err(DecodeError::Truncated);
    }
    let body = data.slice(at + RECORD_HEADER..end);
    if crc32fast::hash(&body) != crc {
        return Err(DecodeError::Checksum);
    }
    Ok((body, end))
}

fn message(
    exchange: String,
    routing_key: String,
    header_payload: Bytes,
    content: Bytes,
) -> Result<Message, DecodeError> {
    let header = match amq_protocol::frame::parsing::parse_content_header(&header_payload[..]) {
        Ok(([], h)) => h,
        _ => return Err(DecodeError::Malformed("content header")),
    };
    Message::new(
        exchange.into(),
        routing_key.into(),
        header.properties,
        header_payload,
        content,
    )
    .map_err(|_| DecodeError::Malformed("expiration"))
}

/// Reads the fields of a record (or of a replication frame) in order, failing on short
/// input instead of panicking: both come from outside this process's memory.
pub(crate) struct Reader<'a> {
    buf: &'a Bytes,
    at: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `buf`.
    pub(crate) fn new(buf: &'a Bytes) -> Self {
        Self { buf, at: 0 }
    }
    /// Whether every byte was read.
    pub(crate) fn is_done(&self) -> bool {
        self.at == self.buf.len()
    }
    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.at
    }
    /// A message written by [`put_message_content`].
    pub(crate) fn message(&mut self) -> Result<Message, DecodeError> {
        let exchange = self.short_str()?;
        let routing_key = self.short_str()?;
        let header_payload = self.bytes()?;
        let content = self.bytes()?;
        message(exchange, routing_key, header_payload, content)
    }
    pub(crate) fn take(&mut self, n: usize) -> Result<Bytes, DecodeError> {
        if self.buf.len() < self.at + n {
            return Err(DecodeError::Malformed("short body"));
        }
        let b = self.buf.slice(self.at..self.at + n);
        self.at += n;
        Ok(b)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(
            self.take(4)?[..].try_into().expect("4 bytes"),
        ))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(
            self.take(8)?[..].try_into().expect("8 bytes"),
        ))
    }
    pub(crate) fn short_str(&mut self) -> Result<String, DecodeError> {
        let n = usize::from(self.u8()?);
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| DecodeError::Malformed("string"))
    }
    pub(crate) fn bytes(&mut self) -> Result<Bytes, DecodeError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::Properties;

    fn message() -> Arc<Message> {
        Arc::new(Message::authored(
            "ex".into(),
            "rk".into(),
            Properties::default().with_delivery_mode(2),
            Bytes::from_static(b"payload"),
        ))
    }

    #[test]
    fn records_round_trip_and_detect_damage() {
        let mut out = Vec::new();
        Record::Enqueued {
            uid: 7,
            id: 3,
            expires_at_ms: Some(99),
            message: message(),
        }
        .encode(&mut out);
        Record::Removed {
            uid: 7,
            ids: vec![1, 3],
        }
        .encode(&mut out);
        let data = Bytes::from(out.clone());
        let (body, next) = next_record(&data, 0).unwrap();
        assert_eq!(Record::enqueued_key(&body), Some((7, 3)));
        let Record::Enqueued {
            uid,
            id,
            expires_at_ms,
            message,
        } = Record::decode(&body).unwrap()
        else {
            panic!()
        };
        assert_eq!(
            (
                uid,
                id,
                expires_at_ms,
                &message.body.bytes()[..],
                message.persistent
            ),
            (7, 3, Some(99), &b"payload"[..], true)
        );
        let (body, end) = next_record(&data, next).unwrap();
        assert!(
            matches!(Record::decode(&body).unwrap(), Record::Removed { uid: 7, ref ids } if ids == &[1, 3])
        );
        assert_eq!(end, data.len());
        assert_eq!(
            next_record(&data.slice(..end - 1), next),
            Err(DecodeError::Truncated)
        );
        let mut flipped = out;
        flipped[20] ^= 0x40;
        assert_eq!(
            next_record(&Bytes::from(flipped), 0),
            Err(DecodeError::Checksum)
        );
    }

    #[test]
    fn a_producers_record_round_trips_and_a_bad_count_is_malformed() {
        let highest = vec![(Arc::from("session-a:1"), 41), (Arc::from("b:2"), 7)];
        let mut out = Vec::new();
        Record::Producers {
            uid: 9,
            highest: highest.clone(),
            replace: true,
        }
        .encode(&mut out);
        let data = Bytes::from(out);
        let (body, _) = next_record(&data, 0).unwrap();
        assert_eq!(Record::enqueued_key(&body), None, "no message in it");
        let Record::Producers {
            uid,
            highest: back,
            replace,
        } = Record::decode(&body).unwrap()
        else {
            panic!()
        };
        assert_eq!((uid, back, replace), (9, highest, true));
        let mut lying = body.to_vec();
        lying[10..14].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(Record::decode(&Bytes::from(lying)).is_err());
    }

    #[test]
    fn zeros_after_the_last_record_end_the_records_and_other_bytes_are_damage() {
        let mut data = Vec::new();
        Record::Removed {
            uid: 1,
            ids: vec![2],
        }
        .encode(&mut data);
        let after = data.len();
        data.extend_from_slice(&[0; 20]);
        let data = Bytes::from(data);
        let (body, next) = next_record(&data, 0).unwrap();
        assert!(matches!(
            Record::decode(&body),
            Ok(Record::Removed { uid: 1, .. })
        ));
        assert_eq!(next, after);
        assert!(matches!(next_record(&data, next), Err(DecodeError::End)));
        assert!(matches!(
            next_record(&data, data.len() - 5),
            Err(DecodeError::End)
        ));
        let torn = Bytes::from_static(&[0, 0, 0, 9, 1]);
        assert!(matches!(next_record(&torn, 0), Err(DecodeError::Truncated)));
    }
}
