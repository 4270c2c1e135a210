//! Messages held for the session that had them (`docs/sessions.md` §5, "Held for its
//! session").
//!
//! A delivery to a resumable session's consumer that comes back unsettled because a member
//! was lost — the queue's primary (its promoted backup requeues what was out) or the member
//! the consumer was on (its link's channels close) — may have been seen, and even acked, by
//! the session's application: the ack was lost with the member. Handed to a competing
//! consumer of another session, it would reach a second application. Held for its session
//! instead, it goes to that session's consumer once the session resumes, and its failover
//! client settles it again or hands it on under the tag the application already has. A hold
//! ends when the message goes to that session, when the session ends, or after
//! [`HOLD_MS`], whichever comes first: a session that never comes back for the queue
//! does not keep its messages from everybody else.
//!
//! **The flag it comes back with.** A held message goes back to its session under the
//! `redelivered` flag of the delivery that was lost — when the session's client recognises
//! what its application already had (the failover client), the message has an identity to
//! recognise it by, and nothing later in the queue has gone to another consumer of the
//! session since that delivery ([`Queue::restored_flag`]). Then the application either had
//! the message, and its client hides it, or never got it, and gets it where a run without
//! the failure has it: what went out after it on the same consumer was lost with it. A
//! later message that went to another consumer of the session (the one the client created
//! where it resumed, before this copy learnt that the first one was lost: a member cut off
//! hands its deliveries back only when it rejoins) may have reached the application first,
//! and then this one comes out of order and must be marked. So every copy keeps, per
//! session, the recent deliveries to its consumers ([`SessionLog`]); when it cannot tell
//! (the log no longer reaches back that far, a priority queue whose order is not the ids'),
//! the message is marked. Any other client gets it marked, as 0-9-1 asks.
//!
//! Holds are the primary's: the ops do not carry them (a backup promoted again computes
//! them afresh from the deliveries it knows of). Every copy keeps each unacked delivery to a
//! session's consumer and the session logs, from what the ops carry
//! ([`crate::core::ops::OpKind::Deliver`]).

use super::{Entry, Queue};
use crate::core::ops::SessionDelivery;
use std::collections::VecDeque;
use std::sync::Arc;

/// How long a message stays held for its session at most: well beyond the time a failover
/// client takes to resume and consume again (about a second, `docs/sessions.md`), short
/// enough that the other consumers are not kept waiting for a session that went elsewhere.
pub const HOLD_MS: u64 = 15_000;

/// How many deliveries a session's log keeps per queue: far more than go out between a
/// delivery's loss and its return (a consumer's prefetch on each side of a failover).
/// Older ones are forgotten, and a held message delivered before them comes back marked.
const SESSION_LOG: usize = 1_024;

/// Consumer serials a queue gives out per millisecond of the clock before it runs ahead of
/// it (see [`Queue::next_consumer_serial`]).
const SERIALS_PER_MS: u64 = 1_024;

/// An unacked delivery to a session's consumer, as every copy records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    /// What its op said.
    pub(super) to: SessionDelivery,
    /// Its place among the queue's deliveries to sessions ([`Queue::session_deliveries`]).
    pub(super) at: u64,
}

/// One held message.
#[derive(Debug, Clone)]
pub(super) struct Hold {
    /// The delivery that was lost.
    lost: Delivered,
    /// When the hold began (ms).
    since_ms: u64,
}

/// The recent deliveries of a queue to one session's consumers.
#[derive(Debug, Default)]
pub(super) struct SessionLog {
    /// `(at, message id, consumer serial)`, oldest first.
    recent: VecDeque<(u64, u64, u64)>,
    /// The place of the newest delivery forgotten (0: none).
    forgotten_through: u64,
}

impl Queue {
    /// Every copy records a delivery of message `id` to a session's consumer.
    pub(super) fn record_session_delivery(&mut self, id: u64, to: &SessionDelivery) {
        self.session_deliveries += 1;
        let at = self.session_deliveries;
        self.consumer_serials = self.consumer_serials.max(to.consumer);
        let log = self.session_logs.entry(to.session.clone()).or_default();
        if log.recent.len() == SESSION_LOG
            && let Some((forgotten, _, _)) = log.recent.pop_front()
        {
            log.forgotten_through = forgotten;
        }
        log.recent.push_back((at, id, to.consumer));
        self.delivered_to
            .insert(id, Delivered { to: to.clone(), at });
    }

    /// A serial for a new consumer registered at `now_ms`: above every consumer's this copy
    /// has seen deliver, so that a promoted copy never reuses one, and above every serial
    /// given before a restart of this process (which forgets the ops that carried them): the
    /// serials follow the clock, [`SERIALS_PER_MS`] to a millisecond.
    pub fn next_consumer_serial(&mut self, now_ms: u64) -> u64 {
        self.consumer_serials =
            (self.consumer_serials + 1).max(now_ms.saturating_mul(SERIALS_PER_MS));
        self.consumer_serials
    }

    /// Holds ready message `id`, back from its lost delivery to a session's consumer (the
    /// one this copy recorded), for that session from `now_ms`: only the session's consumers
    /// get it until the hold ends. Nothing happens if the delivery went to no session.
    pub fn hold_lost(&mut self, id: u64, lost: Option<Delivered>, now_ms: u64) {
        if let Some(lost) = lost {
            self.holds.insert(
                id,
                Hold {
                    lost,
                    since_ms: now_ms,
                },
            );
        }
    }

    /// What this copy recorded of the delivery of unacked message `id` to a session's
    /// consumer: what [`Queue::hold_lost`] takes once the delivery is requeued.
    pub fn lost_delivery(&self, id: u64) -> Option<Delivered> {
        if self.delivered_to.is_empty() {
            return None;
        }
        self.delivered_to.get(&id).cloned()
    }

    /// The `redelivered` flag message `id` goes back with to `session`'s consumer, if it is
    /// held for that session: the flag of the delivery that was lost, unless a later
    /// message went to another consumer of the session since (see the module).
    pub fn restored_flag(&self, id: u64, session: &str) -> Option<bool> {
        if self.holds.is_empty() {
            return None;
        }
        let hold = self.holds.get(&id)?;
        let lost = &hold.lost;
        if *lost.to.session != *session {
            return None;
        }
        Some(lost.to.redelivered || self.overtaken(id, lost))
    }

    /// Whether a message later in the queue than `id` may have reached the session of its
    /// lost delivery `lost` ahead of it: one that went to another of the session's
    /// consumers after it (or this copy cannot tell).
    fn overtaken(&self, id: u64, lost: &Delivered) -> bool {
        if self.levels.len() > 1 {
            return true;
        }
        let Some(log) = self.session_logs.get(&lost.to.session) else {
            return true;
        };
        log.forgotten_through > lost.at
            || log
                .recent
                .iter()
                .rev()
                .take_while(|(at, _, _)| *at > lost.at)
                .any(|&(_, later, consumer)| later > id && consumer != lost.to.consumer)
    }

    /// Whether any message is held.
    pub fn has_holds(&self) -> bool {
        !self.holds.is_empty()
    }

    /// The session ready message `id` is held for.
    pub fn held_for(&self, id: u64) -> Option<&Arc<str>> {
        if self.holds.is_empty() {
            return None;
        }
        self.holds.get(&id).map(|h| &h.lost.to.session)
    }

    /// `session` ended: its holds end and its log goes; whether it held anything.
    pub fn forget_session(&mut self, session: &str) -> bool {
        self.session_logs.remove(session);
        if self.holds.is_empty() {
            return false;
        }
        let before = self.holds.len();
        self.holds.retain(|_, h| &*h.lost.to.session != session);
        self.holds.len() != before
    }

    /// Ends the holds that began [`HOLD_MS`] or more before `now_ms`; whether there were any.
    pub fn release_stale_holds(&mut self, now_ms: u64) -> bool {
        let before = self.holds.len();
        self.holds
            .retain(|_, h| now_ms.saturating_sub(h.since_ms) < HOLD_MS);
        self.holds.len() != before
    }

    /// The first ready message, in delivery order, that is held for nobody: the head, unless
    /// held messages come first (what a `basic.get`, no session's, may take).
    pub fn first_unheld(&self) -> Option<&Entry> {
        if self.holds.is_empty() {
            return self.peek();
        }
        self.ready().find(|e| !self.holds.contains_key(&e.id))
    }

    /// Message `id` left the ready list: no hold for it is left.
    pub(super) fn unhold(&mut self, id: u64) {
        if !self.holds.is_empty() {
            self.holds.remove(&id);
        }
    }

    /// Message `id` is no longer unacked: the session it went to is forgotten.
    pub(super) fn forget_delivered_to(&mut self, id: u64) {
        if !self.delivered_to.is_empty() {
            self.delivered_to.remove(&id);
        }
    }
}
