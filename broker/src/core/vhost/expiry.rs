//! Time as an input: messages past their TTL leave the head of their queue, queues unused
//! past their `x-expires` are deleted. The core has no clock; the server calls [`VHost::tick`]
//! and passes `now_ms` with every command, so tests and simulations control time.

use super::effects::apply;
use super::{DeadLetter, Effects, VHost};
use crate::core::ops::{DropReason, OpKind};
use crate::core::queue::Queue;

impl VHost {
    /// Advances time: expires messages at queue heads and deletes queues unused past their
    /// `x-expires`. The server calls it periodically. On a cluster member it also names
    /// again the auto-delete queues still waiting for their deletion to be committed (a
    /// cluster op that could not be committed is asked for again), and ends the holds
    /// for sessions that did not come back for their messages in time
    /// (`core::queue::holds`).
    pub fn tick(&mut self, now_ms: u64, fx: &mut Effects) {
        let record = self.record_ops;
        let mut dead = Vec::new();
        let mut expired_queues = Vec::new();
        let mut released = Vec::new();
        let node = self.node.clone();
        for q in self.queues.values_mut() {
            if q.has_holds() && q.release_stale_holds(now_ms) {
                released.push(q.name.clone());
            }
            // A proxied queue's use is seen by its primary, which decides its expiry — and its
            // messages' (a replica here drops a message when the primary's op says so). A
            // sealed one is moving: its new primary decides.
            let proxied = q.primary_elsewhere(node.as_deref()).is_some() || q.sealed;
            if !proxied {
                expire_head(q, now_ms, true, record, fx, &mut dead);
            }
            if let Some(expires) = q.args.expires_ms
                && !proxied
                && q.consumers.is_empty()
                && now_ms.saturating_sub(q.last_used_ms) >= expires
            {
                expired_queues.push(q.name.clone());
            }
            // An exclusive queue whose owner went: its cluster delete was not taken yet. (A
            // session's waits for its session: held on another member, or detached.)
            if node.is_some()
                && !proxied
                && q.home.is_some()
                && q.session.is_none()
                && q.exclusive_owner == Some(crate::core::NO_CONNECTION)
            {
                expired_queues.push(q.name.clone());
            }
            if node.is_some()
                && !proxied
                && q.auto_delete
                && q.had_consumer
                && q.consumers.is_empty()
            {
                expired_queues.push(q.name.clone());
            }
        }
        for name in expired_queues {
            self.retire_queue(&name, fx);
        }
        self.dead_letter_all(dead, now_ms, fx);
        self.dispatch_all(released, now_ms, fx);
    }
}

/// Drops expired messages from the head of `q`. `inclusive` also drops those expiring right
/// now (a TTL of 0 means "deliver now or never"); dispatch passes false so that such a
/// message still reaches a consumer that is ready in the same instant.
pub(super) fn expire_head(
    q: &mut Queue,
    now_ms: u64,
    inclusive: bool,
    record: bool,
    fx: &mut Effects,
    dead: &mut Vec<DeadLetter>,
) {
    while let Some(head) = q.peek() {
        let expired = head
            .expires_at_ms
            .is_some_and(|t| if inclusive { t <= now_ms } else { t < now_ms });
        if !expired {
            return;
        }
        let id = head.id;
        let entry = apply(
            q,
            OpKind::Drop {
                id,
                reason: DropReason::Expired,
            },
            record,
            fx,
        )
        .expect("head exists");
        dead.push(DeadLetter {
            message: entry.message,
            queue: q.name.clone(),
            reason: DropReason::Expired,
            held: None,
        });
    }
}
