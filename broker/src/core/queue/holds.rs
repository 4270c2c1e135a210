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
//! Holds are the primary's: the ops do not carry them (a backup promoted again computes
//! them afresh from the deliveries it knows of). Every copy keeps the session of each
//! unacked delivery, which the ops do carry ([`crate::core::ops::OpKind::Deliver`]).

use super::{Entry, Queue};
use std::sync::Arc;

/// How long a message stays held for its session at most: well beyond the time a failover
/// client takes to resume and consume again (about a second, `docs/sessions.md`), short
/// enough that the other consumers are not kept waiting for a session that went elsewhere.
pub const HOLD_MS: u64 = 15_000;

/// One held message.
#[derive(Debug, Clone)]
pub(super) struct Hold {
    /// The session it waits for.
    session: Arc<str>,
    /// When the hold began (ms).
    since_ms: u64,
}

impl Queue {
    /// The session unacked message `id` was delivered to, if it went to a session's
    /// consumer.
    pub fn delivered_to(&self, id: u64) -> Option<&Arc<str>> {
        if self.delivered_to.is_empty() {
            return None;
        }
        self.delivered_to.get(&id)
    }

    /// Holds ready message `id` for `session` from `now_ms`: only that session's consumers
    /// get it until the hold ends.
    pub fn hold(&mut self, id: u64, session: Arc<str>, now_ms: u64) {
        self.holds.insert(
            id,
            Hold {
                session,
                since_ms: now_ms,
            },
        );
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
        self.holds.get(&id).map(|h| &h.session)
    }

    /// Ends the holds for `session` (it ended); whether there were any.
    pub fn release_holds_of(&mut self, session: &str) -> bool {
        let before = self.holds.len();
        self.holds.retain(|_, h| &*h.session != session);
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
