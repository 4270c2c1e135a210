//! Queue ops: every change to a queue's content, as data.
//!
//! The primary computes an op, applies it to its own queue with [`crate::core::queue::Queue::apply`]
//! and hands it on; a journal (persistence) and a backup replica (clustering) consume the same
//! stream and rebuild the same queue by applying it. One format, written once.

use super::message::Message;
use std::sync::Arc;

/// One change to one queue, numbered by the queue's own sequence.
#[derive(Debug, Clone)]
pub struct QueueOp {
    /// The queue changed.
    pub queue: Arc<str>,
    /// The queue's unique id: a queue deleted and declared again under the same name is a
    /// different queue, and a journal must not mix their messages.
    pub uid: u64,
    /// Per-queue sequence number: strictly increasing, without gaps, from 1.
    pub seq: u64,
    /// The queue survives a restart: only such queues' ops go to the journal (a replicated
    /// transient queue's ops go to its backups only).
    pub durable: bool,
    /// What changed.
    pub kind: OpKind,
}

/// A delivery to a resumable session's consumer, as its op names it: every copy of the
/// queue records it, so that whichever copy is primary when the delivery is lost holds the
/// message for the session and knows how to give it back (`core::queue::holds`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionDelivery {
    /// The session.
    pub session: Arc<str>,
    /// The consumer that took it, by its serial in the queue
    /// ([`crate::core::queue::ConsumerRef::serial`]): what went to another consumer of the
    /// session since may have reached its application ahead of this one.
    pub consumer: u64,
    /// The `redelivered` flag it went out with.
    pub redelivered: bool,
}

/// The kinds of change a queue knows. Message ids are the queue's own offsets: they grow with
/// every enqueue and order the queue (a requeued message goes back to its place by id).
#[derive(Debug, Clone)]
pub enum OpKind {
    /// A message joins the ready list.
    Enqueue {
        /// Its id in this queue.
        id: u64,
        /// The message.
        message: Arc<Message>,
        /// Absolute expiry time (ms) from the queue's or the message's TTL.
        expires_at_ms: Option<u64>,
    },
    /// A ready message was handed to a consumer that must ack it: ready → unacked.
    Deliver {
        /// Message id.
        id: u64,
        /// The resumable session whose consumer took it, if one did: should the delivery
        /// come back unsettled because a member was lost (a promotion, a proxy's link), the
        /// queue holds it for that session a while rather than hand it to a competing
        /// consumer, whose application would see a message the session's had already seen
        /// (`docs/sessions.md` §5, "Held for its session").
        session: Option<SessionDelivery>,
    },
    /// A ready message was handed out with no ack expected (no-ack consume or get): it is gone.
    Take {
        /// Message id.
        id: u64,
    },
    /// An unacked message was acked, or rejected without requeue: it is gone.
    Settle {
        /// Message id.
        id: u64,
    },
    /// An unacked message goes back to the ready list at its original place, marked redelivered.
    Requeue {
        /// Message id.
        id: u64,
    },
    /// A ready message left without delivery: expired or pushed out by a length limit.
    Drop {
        /// Message id.
        id: u64,
        /// Why.
        reason: DropReason,
    },
    /// Every ready message was removed (queue.purge); `ids` names them, so that a journal
    /// or replica removes exactly those and not the unacked ones.
    Purge {
        /// Ids of the ready messages removed.
        ids: Vec<u64>,
    },
}

/// Why a message left a queue without being consumed; also the `reason` of its `x-death`
/// entry when it is dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Its TTL ran out.
    Expired,
    /// `x-max-length` / `x-max-length-bytes` with `drop-head` pushed it out.
    MaxLength,
    /// A consumer rejected or nacked it without requeue.
    Rejected,
}

impl DropReason {
    /// The name RabbitMQ writes in `x-death` and `x-first-death-reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Expired => "expired",
            DropReason::MaxLength => "maxlen",
            DropReason::Rejected => "rejected",
        }
    }
}
