//! At-least-once dead-lettering on the connection that rejected the messages
//! (`x-dead-letter-strategy: at-least-once`).
//!
//! A rejected message of such a queue stays there, unacknowledged by no channel, while its
//! dead-lettered copy is on its way ([`crate::core::HeldDeadLetter`]). The copy is made in
//! the rejecting batch like any dead letter — enqueued on this member's target queues,
//! forwarded to the primaries of the others — and is safe when that batch's output would
//! be: its journal records fsynced, its in-sync backups caught up, its forwards confirmed,
//! the lease held (the batch's [`Conditions`]). Then the original is removed; if a forward
//! of the batch was refused or failed, or the connection went before it knew, the original
//! goes back to its queue (marked redelivered) and is dead-lettered again when it is
//! rejected again. A copy may so arrive twice; none is lost.

use super::{Connection, Lazy};
use crate::clock::now_ms;
use crate::core::HeldDeadLetter;
use crate::server::confirm_gate::{Conditions, Progress};

/// The held dead letters of one batch and what their copies wait for.
#[derive(Debug)]
pub(super) struct PendingDeadLetters {
    /// The batch's conditions (`None`: it made nothing that must become durable).
    conditions: Option<Conditions>,
    /// The batch's forwards (first, last), watched in the connection's tracker.
    forwards: Option<(u64, u64)>,
    held: Vec<HeldDeadLetter>,
}

impl Connection {
    /// Before the batch's forwards are issued: when it holds dead letters, the tracker keeps
    /// the refusals of the forwards from the next number on. Returns that number.
    pub(super) fn watch_dead_letter_forwards(&self) -> Option<u64> {
        if self.fx.dead_letters_held.is_empty() {
            return None;
        }
        let first = self.forwards.issued() + 1;
        self.forwards.watch(first);
        Some(first)
    }

    /// After the batch's output was held behind `conditions`: its held dead letters wait
    /// for the same (`watched`: the first forward number [`Self::watch_dead_letter_forwards`]
    /// returned).
    pub(super) fn keep_dead_letters(
        &mut self,
        watched: Option<u64>,
        conditions: Option<Conditions>,
    ) {
        let Some(first) = watched else {
            return;
        };
        let last = self.forwards.issued();
        let forwards = if last >= first {
            Some((first, last))
        } else {
            // No forward after all: end the watch at once.
            self.forwards.unwatch(first);
            None
        };
        self.dead_letters.push_back(PendingDeadLetters {
            conditions,
            forwards,
            held: std::mem::take(&mut self.fx.dead_letters_held),
        });
    }

    /// Whether held dead letters wait for the journal, the backups, the forwards or the lease.
    pub(super) fn dead_letters_wait(&self) -> bool {
        !self.dead_letters.is_empty()
    }

    /// Settles, in batch order, the held dead letters whose batches' conditions hold at
    /// `progress`: in one vhost batch of their own.
    pub(super) fn settle_dead_letters(&mut self, progress: Progress) {
        let Some(vhost) = self.vhost.clone() else {
            return;
        };
        let mut v = Lazy::new(&vhost);
        let now = now_ms();
        while self
            .dead_letters
            .front()
            .is_some_and(|p| p.conditions.is_none_or(|c| c.hold_at(progress)))
        {
            let p = self.dead_letters.pop_front().expect("checked");
            let safe = p
                .forwards
                .is_none_or(|(first, last)| self.forwards.all_taken(first, last));
            v.get()
                .dead_letters_settled(&p.held, safe, now, &mut self.fx);
        }
        self.end_batch(v);
    }

    /// The connection goes: held dead letters whose batches are safe now are settled, the
    /// others go back to their queues (their copies may be missing).
    pub(super) fn abandon_dead_letters(&mut self, v: &mut crate::core::VHost) {
        if self.dead_letters.is_empty() {
            return;
        }
        // The watches are read into locals, not borrowed across the lease check (see
        // `Connection::run`'s progress).
        let journal_synced = *self.broker.journal.synced().borrow();
        let replicas_acked = *self.broker.replicator().acked().borrow();
        let progress = Progress {
            journal_synced,
            forwards_confirmed: self.forwards.status().answered_through,
            replicas_acked,
            lease_held: self.lease_held_now(),
        };
        let now = now_ms();
        for p in std::mem::take(&mut self.dead_letters) {
            let answered = p.conditions.is_none_or(|c| c.hold_at(progress));
            let safe = answered
                && p.forwards
                    .is_none_or(|(first, last)| self.forwards.all_taken(first, last));
            v.dead_letters_settled(&p.held, safe, now, &mut self.fx);
        }
    }
}
