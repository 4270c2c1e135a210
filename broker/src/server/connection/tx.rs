//! Transactions and publisher confirms: the two ways a publisher learns its messages are
//! safe. A transaction holds publishes and acks until tx.commit; confirm mode acks every
//! publish. Either answer is written in the batch that applied the work and leaves only
//! behind that batch's [`crate::server::confirm_gate::ConfirmGate`].

use super::{Connection, Lazy};
use crate::amqp::{AMQPClass, basic, confirm, tx};
use crate::core::{AmqpError, ChannelKey, PublishOutcome};
use crate::server::channel::Transaction;

impl Connection {
    /// confirm.select: from now on every publish on the channel is confirmed.
    pub(super) fn on_confirm_select(
        &mut self,
        id: u16,
        s: confirm::Select,
    ) -> Result<(), AmqpError> {
        let ch = self.channels.get_mut(&id).expect("checked by the caller");
        if ch.tx.is_some() {
            return Err(AmqpError::precondition(
                "cannot switch from tx to confirm mode",
            ));
        }
        let published = ch.publishing.published;
        ch.publishing.confirm_base.get_or_insert(published);
        if !s.nowait {
            self.writer.method(
                id,
                AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
            );
        }
        Ok(())
    }

    /// tx.select, tx.commit and tx.rollback.
    pub(super) fn on_tx(
        &mut self,
        id: u16,
        m: tx::AMQPMethod,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let ch = self.channels.get_mut(&id).expect("checked by the caller");
        let reply = match m {
            tx::AMQPMethod::Select(_) => {
                if ch.publishing.confirming() {
                    return Err(AmqpError::precondition(
                        "cannot switch from confirm to tx mode",
                    ));
                }
                ch.tx.get_or_insert_with(Transaction::default);
                ch.publishing.transactional = true;
                tx::AMQPMethod::SelectOk(tx::SelectOk {})
            }
            tx::AMQPMethod::Commit(_) => {
                let Some(held) = ch.tx.replace(Transaction::default()) else {
                    return Err(AmqpError::precondition("channel is not transactional"));
                };
                let (number, commits_before) = (ch.publishing.published + 1, ch.publishing.commits);
                ch.publishing.published += held.publishes.len() as u64;
                ch.publishing.commits += 1;
                let forwards_before = self.fx.forwards.len();
                self.commit(id, held, v)?;
                // Counted only once its primaries answered (B22).
                self.track_unanswered_forwards(id, forwards_before, number, commits_before);
                if self.commit_remote_settles(id) {
                    return Ok(());
                }
                tx::AMQPMethod::CommitOk(tx::CommitOk {})
            }
            tx::AMQPMethod::Rollback(_) => {
                let Some(discarded) = ch.tx.replace(Transaction::default()) else {
                    return Err(AmqpError::precondition("channel is not transactional"));
                };
                // Rolled back, but processed: a resent copy is still a duplicate.
                ch.publishing.published += discarded.publishes.len() as u64;
                tx::AMQPMethod::RollbackOk(tx::RollbackOk {})
            }
            _ => {
                return Err(AmqpError::new(
                    crate::amqp::codes::COMMAND_INVALID,
                    "unexpected tx method",
                ));
            }
        };
        self.writer.method(id, AMQPClass::Tx(reply));
        Ok(())
    }

    /// Applies a transaction's held publishes, then its held acks, in order. Its commit-ok is
    /// written after, in the same batch, so it waits behind the batch's hold like a confirm.
    pub(super) fn commit(
        &mut self,
        id: u16,
        held: Transaction,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let now = v.now_ms();
        let key = ChannelKey {
            conn: self.id,
            channel: id,
        };
        for p in held.publishes {
            let outcome = v.get().publish_as(
                self.publish_origin.as_deref(),
                &p.exchange,
                &p.routing_key,
                p.message.clone(),
                now,
                &mut self.fx,
            )?;
            match outcome {
                PublishOutcome::Routed => self.stats.routed += 1, // metrics
                PublishOutcome::Unroutable => self.stats.unroutable += 1, // metrics
                // Moving comes only from a forwarded publish, never a committed one.
                PublishOutcome::Rejected | PublishOutcome::Moving => {}
                // A committed publish has no confirm to wait with: as on a refusal.
                PublishOutcome::Unavailable => self.fx.forwards.retain(|f| !f.lost),
            }
            if p.mandatory && outcome == PublishOutcome::Unroutable {
                self.send_return(id, &p.message);
            }
        }
        for settle in held.acks {
            self.apply_settle(key, settle, v)?;
        }
        Ok(())
    }

    /// Decides the confirms of forwarded publishes whose primaries all answered (through
    /// forward `answered`), on every channel, in publish order.
    pub(super) fn decide_awaiting(&mut self, answered: u64) {
        let tracker = &self.forwards;
        let mut waiting = false;
        for ch in self.channels.values_mut() {
            ch.decide_awaiting(answered, |first, last| tracker.fate(first, last));
            waiting |= !ch.awaiting.is_empty();
        }
        self.awaiting_confirms = waiting;
    }

    /// Forgets the forwarded publishes without confirms that their primaries answered
    /// ([`ChannelCtx::unanswered_forwards`]), on a session's channels that have any.
    pub(super) fn prune_unanswered_forwards(&mut self) {
        if self
            .channels
            .values()
            .all(|ch| ch.unanswered_forwards.is_empty())
        {
            return;
        }
        let status = self.forwards.status();
        let failed = status.failure.as_ref().map(|(f, _)| *f);
        for ch in self.channels.values_mut() {
            ch.prune_unanswered_forwards(status.answered_through, failed);
        }
    }

    /// Between batches, when the primaries answered forwards: writes the confirms that were
    /// waiting for them (behind whatever the gate still holds).
    pub(super) fn decide_forwarded_confirms(&mut self, answered: u64) {
        let before: usize = self.channels.values().map(|c| c.confirms.len()).sum();
        self.decide_awaiting(answered);
        let after: usize = self.channels.values().map(|c| c.confirms.len()).sum();
        if after > before {
            self.flush_confirms();
            self.hold_output(None);
        }
    }

    /// Writes the confirms the batch's publishes decided, per channel, runs of acks as one
    /// `multiple` ack. Called by [`Connection::end_batch`] before the batch's hold, so that
    /// they wait for the batch's durability.
    pub(super) fn flush_confirms(&mut self) {
        if self.awaiting_confirms {
            let answered = self.forwards.status().answered_through;
            self.decide_awaiting(answered);
        }
        self.prune_unanswered_forwards();
        for (id, ch) in &mut self.channels {
            if ch.confirms.is_empty() {
                continue;
            }
            self.confirms.clear();
            self.stats.confirmed += ch.confirms.len() as u64; // metrics
            ch.take_confirms(&mut self.confirms);
            for &(tag, multiple, ack) in &self.confirms {
                // A link's nack of a publish that reached a sealed primary says `requeue`:
                // the sending member tries again after the switch (B16).
                let requeue = !ack && ch.moving.remove(&tag);
                let m = if ack {
                    basic::AMQPMethod::Ack(basic::Ack {
                        delivery_tag: tag,
                        multiple,
                    })
                } else {
                    basic::AMQPMethod::Nack(basic::Nack {
                        delivery_tag: tag,
                        multiple,
                        requeue,
                    })
                };
                self.writer.method(*id, AMQPClass::Basic(m));
            }
        }
    }
}
