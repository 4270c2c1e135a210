//! One catch-up of one backup for one queue, as the primary keeps it: the image being sent in
//! chunks, the window of chunks the backup has not acknowledged yet, the queue's ops that
//! arrive meanwhile, and the limits in time and memory that end it.
//!
//! **Why ops are held back.** The image is the queue at sequence number `last_seq`, taken
//! under the vhost lock as refcounted handles (no body is copied there). Its chunks are built
//! and sent afterwards, while the primary keeps serving, so ops after `last_seq` are produced
//! meanwhile. The backup cannot apply them before the last chunk (an op may name a message
//! the backup has not received yet: [`crate::core::queue::Queue::fits`] refuses every op while
//! an image is installing), so the primary holds them here, already encoded, and sends them
//! right after the last chunk, in order: the backup's stream continues at `last_seq + 1`
//! without a gap. What is held is bounded ([`CatchUpLimits::held_bytes`]): a catch-up whose
//! queue changes faster than its image drains is abandoned and retried from a new image.
//!
//! **Bounds.** The primary keeps at most [`CatchUpLimits::window`] chunks unacknowledged per
//! catch-up, so the bytes in flight are bounded by the window times the chunk size; the
//! backup holds no more than those chunks besides its replica. A catch-up that is not done
//! (its last frame confirmed) by its deadline is abandoned and retried from scratch.
//!
//! Pure state, no I/O: the replicator ([`super::replicator`]) does the locking and sending.

use super::codec::{ChunkLimits, image_entry_len, producers_len};
use crate::core::message::Message;
use crate::core::queue::{ImageEntry, QueueImage};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Limits of every catch-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatchUpLimits {
    /// The size of one chunk.
    pub chunk: ChunkLimits,
    /// Chunks sent and not yet acknowledged, per catch-up.
    pub window: usize,
    /// Encoded bytes of the ops held back until the last chunk is out.
    pub held_bytes: usize,
    /// From the image to the backup's confirmation of its last frame.
    pub timeout: Duration,
    /// Between an abandoned attempt and the next.
    pub retry_delay: Duration,
}

impl Default for CatchUpLimits {
    fn default() -> Self {
        Self {
            chunk: ChunkLimits::for_max_message_size(u64::MAX),
            window: 4,
            held_bytes: 64 * 1024 * 1024,
            timeout: Duration::from_secs(120),
            retry_delay: Duration::from_millis(500),
        }
    }
}

/// Where a catch-up stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Chunks are being sent; the queue's ops are held back.
    Sending,
    /// The last chunk and the held ops are out; the backup's confirmation of the last of
    /// them makes it in sync. The queue's ops go straight to the backup.
    Confirming,
    /// Given up (why): the queue's ops are dropped for this backup until the next attempt,
    /// whose first chunk resets the replica.
    Abandoned(&'static str),
}

/// The next chunk to build: its entries (bodies possibly still on disk) and its place.
#[derive(Debug)]
pub struct ChunkWork {
    /// Which attempt it belongs to.
    pub attempt: u64,
    /// The entries, in id order.
    pub entries: Vec<ImageEntry>,
    /// The image's first chunk.
    pub first: bool,
    /// The image's last chunk.
    pub last: bool,
    /// The image's sequence number.
    pub last_seq: u64,
    /// The image's next id.
    pub next_id: u64,
    /// The image's producer table, on its first chunk (empty on the others).
    pub producers: crate::core::producers::Highest,
}

/// An encoded ops frame of one queue, as a catch-up holds it back until the image's last
/// chunk is out.
#[derive(Debug, Clone)]
pub struct OpsFrame {
    /// The frame, encoded once for every backup.
    pub message: Arc<Message>,
    /// How many queue ops it carries: the primary reports each backup's lag in ops.
    pub ops: u32,
}

/// One backup's catch-up of one queue, on its primary.
#[derive(Debug)]
pub struct CatchUp {
    /// The queue's cluster-wide identity.
    pub incarnation: u64,
    /// Tells this attempt from earlier, abandoned ones (whose frames may still be answered).
    pub attempt: u64,
    /// When it started.
    pub started: Instant,
    /// Done by then, or abandoned.
    pub deadline: Instant,
    /// Where it stands.
    pub phase: Phase,
    last_seq: u64,
    next_id: u64,
    /// Entries not yet put in a chunk.
    pending: VecDeque<ImageEntry>,
    /// The image's producer table, until the first chunk takes it.
    producers: crate::core::producers::Highest,
    first_sent: bool,
    /// A chunk is being built (its entries taken, not yet sent).
    building: bool,
    /// Tracker ids of chunks sent and not yet answered.
    in_flight: VecDeque<u64>,
    /// Ops frames of the queue produced since the image, to send after its last chunk.
    held: Vec<OpsFrame>,
    held_bytes: usize,
    /// Messages in the image.
    pub messages_total: u64,
    /// Messages sent so far.
    pub messages_sent: u64,
    /// Encoded chunk bytes sent so far.
    pub bytes_sent: u64,
    /// Entries sent as stand-ins: their paged-out body was gone (the message had left the
    /// queue after the image was taken).
    pub stand_ins: u64,
    /// When an abandoned attempt is retried.
    pub retry_at: Option<Instant>,
}

impl CatchUp {
    /// A catch-up from `image`, starting `now`.
    pub fn new(
        incarnation: u64,
        attempt: u64,
        image: QueueImage,
        now: Instant,
        limits: &CatchUpLimits,
    ) -> Self {
        Self {
            incarnation,
            attempt,
            started: now,
            deadline: now + limits.timeout,
            phase: Phase::Sending,
            last_seq: image.last_seq,
            next_id: image.next_id,
            messages_total: image.entries.len() as u64,
            pending: image.entries.into(),
            producers: image.producers,
            first_sent: false,
            building: false,
            in_flight: VecDeque::new(),
            held: Vec::new(),
            held_bytes: 0,
            messages_sent: 0,
            bytes_sent: 0,
            stand_ins: 0,
            retry_at: None,
        }
    }

    /// Whether the queue's ops for this backup must not go out now (held, or dropped when
    /// abandoned).
    pub fn diverts_ops(&self) -> bool {
        self.phase != Phase::Confirming
    }

    /// Holds an ops frame until the last chunk is out. Returns false (and abandons the
    /// catch-up) when that would take what is held over the limit; an abandoned catch-up
    /// drops the frame.
    pub fn hold(&mut self, frame: &OpsFrame, limits: &CatchUpLimits, now: Instant) -> bool {
        if self.phase != Phase::Sending {
            return false;
        }
        let len = frame.message.body_len();
        if self.held_bytes + len > limits.held_bytes {
            self.abandon(
                "the ops held back during the image outgrew their limit",
                now,
                limits,
            );
            return false;
        }
        self.held_bytes += len;
        self.held.push(frame.clone());
        true
    }

    /// Gives up this attempt: what it holds goes; it is retried after the retry delay.
    pub fn abandon(&mut self, why: &'static str, now: Instant, limits: &CatchUpLimits) {
        self.phase = Phase::Abandoned(why);
        self.pending = VecDeque::new();
        self.held = Vec::new();
        self.held_bytes = 0;
        self.in_flight.clear();
        self.building = false;
        self.retry_at = Some(now + limits.retry_delay);
    }

    /// The backup answered every frame of the link up to tracker id `through`.
    pub fn answered(&mut self, through: u64) {
        while self.in_flight.front().is_some_and(|&id| id <= through) {
            self.in_flight.pop_front();
        }
    }

    /// The entries of the next chunk, when one may be built now (sending, nothing being
    /// built, room in the window, and something left to send — an empty image is one empty
    /// chunk). Marks the chunk as being built.
    pub fn next_chunk(&mut self, queue: &str, limits: &CatchUpLimits) -> Option<ChunkWork> {
        let done = self.first_sent && self.pending.is_empty();
        if self.phase != Phase::Sending
            || self.building
            || done
            || self.in_flight.len() >= limits.window.max(1)
        {
            return None;
        }
        let producers = std::mem::take(&mut self.producers);
        let n = limits.chunk.take(
            queue,
            producers_len(&producers),
            self.pending.iter().map(image_entry_len),
        );
        let entries: Vec<ImageEntry> = self.pending.drain(..n).collect();
        self.building = true;
        let first = !self.first_sent;
        self.first_sent = true;
        Some(ChunkWork {
            attempt: self.attempt,
            entries,
            first,
            last: self.pending.is_empty(),
            last_seq: self.last_seq,
            next_id: self.next_id,
            producers,
        })
    }

    /// The chunk built from [`Self::next_chunk`] went out as tracker id `id` with `messages`
    /// entries (`stand_ins` of them stand-ins) in `bytes`. After the last chunk, returns the
    /// held ops frames, to go out right behind it; the catch-up then waits for the backup's
    /// confirmation.
    pub fn chunk_sent(
        &mut self,
        id: u64,
        (messages, stand_ins): (usize, usize),
        bytes: usize,
        last: bool,
    ) -> Vec<OpsFrame> {
        self.building = false;
        self.stand_ins += stand_ins as u64;
        self.in_flight.push_back(id);
        self.messages_sent += messages as u64;
        self.bytes_sent += bytes as u64;
        if !last {
            return Vec::new();
        }
        self.phase = Phase::Confirming;
        self.held_bytes = 0;
        std::mem::take(&mut self.held)
    }

    /// The chunk being built could not be (its bodies could not be read): give up.
    pub fn chunk_failed(&mut self, now: Instant, limits: &CatchUpLimits) {
        self.abandon("a paged-out body could not be read back", now, limits);
    }

    /// Whether its deadline passed before it was done.
    pub fn expired(&self, now: Instant) -> bool {
        !matches!(self.phase, Phase::Abandoned(_)) && now >= self.deadline
    }

    /// Whether it should be retried now.
    pub fn due_for_retry(&self, now: Instant) -> bool {
        matches!(self.phase, Phase::Abandoned(_)) && self.retry_at.is_some_and(|t| now >= t)
    }

    /// When the replicator must look at it again at the latest (deadline or retry).
    pub fn next_wake(&self) -> Instant {
        match self.phase {
            Phase::Abandoned(_) => self.retry_at.unwrap_or(self.deadline),
            _ => self.deadline,
        }
    }

    /// Bytes of ops frames held now.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::Properties;
    use crate::replication::codec::ChunkLimits;
    use bytes::Bytes;

    fn image(n: u64, body: usize) -> QueueImage {
        QueueImage {
            producers: Vec::new(),
            last_seq: 100,
            next_id: n + 1,
            entries: (1..=n)
                .map(|id| ImageEntry {
                    id,
                    message: Arc::new(Message::authored(
                        "".into(),
                        "q".into(),
                        Properties::default(),
                        Bytes::from(vec![0u8; body]),
                    )),
                    expires_at_ms: None,
                    redelivered: false,
                    unacked: false,
                })
                .collect(),
        }
    }

    fn limits() -> CatchUpLimits {
        CatchUpLimits {
            chunk: ChunkLimits {
                max_bytes: 10_000,
                max_entries: 100,
            },
            window: 2,
            held_bytes: 1_000,
            timeout: Duration::from_secs(5),
            retry_delay: Duration::from_millis(100),
        }
    }

    fn frame(len: usize) -> OpsFrame {
        OpsFrame {
            message: Arc::new(Message::authored(
                "".into(),
                "".into(),
                Properties::default(),
                Bytes::from(vec![1u8; len]),
            )),
            ops: 1,
        }
    }

    #[test]
    fn chunks_are_windowed_by_answers_and_the_held_ops_follow_the_last() {
        let l = limits();
        let now = Instant::now();
        // 50 messages of ~1 KiB: about 9 per chunk by bytes.
        let mut c = CatchUp::new(7, 1, image(50, 1000), now, &l);
        assert!(c.hold(&frame(100), &l, now));
        let mut ids = 0;
        let mut sent = Vec::new();
        let mut held_out = Vec::new();
        loop {
            let Some(w) = c.next_chunk("q", &l) else {
                if c.phase == Phase::Confirming {
                    break;
                }
                // The window is full: the oldest chunk is answered.
                assert_eq!(c.in_flight.len(), l.window);
                c.answered(ids - 1);
                continue;
            };
            assert!(c.next_chunk("q", &l).is_none(), "one chunk built at a time");
            assert!(!w.entries.is_empty());
            let bytes: usize = w.entries.iter().map(image_entry_len).sum();
            assert!(bytes <= l.chunk.max_bytes);
            assert_eq!(w.first, sent.is_empty());
            sent.extend(w.entries.iter().map(|e| e.id));
            ids += 1;
            let out = c.chunk_sent(ids, (w.entries.len(), 0), bytes, w.last);
            assert_eq!(out.is_empty(), !w.last);
            if !w.last {
                assert!(c.hold(&frame(100), &l, now), "held while sending");
            }
            held_out = out;
        }
        assert_eq!(
            sent,
            (1..=50).collect::<Vec<_>>(),
            "every entry once, in order"
        );
        assert!(
            held_out.len() >= 2,
            "the ops held back follow the last chunk"
        );
        assert_eq!(c.messages_sent, 50);
        assert!(!c.diverts_ops(), "once confirming, ops go straight out");
        assert!(!c.hold(&frame(1), &l, now));
    }

    #[test]
    fn an_empty_image_is_one_chunk_that_is_first_and_last() {
        let l = limits();
        let mut c = CatchUp::new(7, 1, image(0, 0), Instant::now(), &l);
        let w = c.next_chunk("q", &l).unwrap();
        assert!(w.first && w.last && w.entries.is_empty());
        assert!(c.chunk_sent(1, (0, 0), 0, true).is_empty());
        assert!(c.next_chunk("q", &l).is_none());
    }

    #[test]
    fn too_much_held_or_too_late_abandons_and_a_retry_is_due_after_the_delay() {
        let l = limits();
        let now = Instant::now();
        let mut c = CatchUp::new(7, 1, image(5, 10), now, &l);
        assert!(c.hold(&frame(600), &l, now));
        assert!(!c.hold(&frame(600), &l, now), "over the held-bytes limit");
        assert!(matches!(c.phase, Phase::Abandoned(_)));
        assert_eq!(c.held_bytes(), 0, "what was held is gone");
        assert!(
            c.diverts_ops(),
            "an abandoned catch-up drops the queue's ops"
        );
        assert!(c.next_chunk("q", &l).is_none());
        assert!(!c.due_for_retry(now));
        assert!(c.due_for_retry(now + l.retry_delay));

        let mut late = CatchUp::new(7, 2, image(5, 10), now, &l);
        assert!(!late.expired(now + l.timeout - Duration::from_millis(1)));
        assert!(late.expired(now + l.timeout));
        assert_eq!(late.next_wake(), now + l.timeout);
        late.abandon("timeout", now + l.timeout, &l);
        assert!(
            !late.expired(now + l.timeout * 2),
            "abandoned, not expired again"
        );
    }
}
