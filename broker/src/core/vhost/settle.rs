//! What becomes of a delivered message once its consumer answers: basic.ack settles it,
//! basic.nack and basic.reject requeue or drop it (dead-lettering), basic.recover and a closed
//! channel put every unacked delivery back at its original place.

use super::consume::consumer_queues;
use super::effects::apply;
use super::{DeadLetter, Delivery, Effects, HeldDeadLetter, RemoteSettle, Settlement, VHost};
use crate::amqp::codes;
use crate::core::channel::{ChannelKey, Unacked};
use crate::core::error::{AmqpError, CoreResult};
use crate::core::ops::{DropReason, OpKind};
use crate::core::queue::Queue;
use std::sync::Arc;

impl VHost {
    /// How many unacknowledged messages an ack of `tag` (with `multiple`) on this channel
    /// settles; read-only, for the acked-messages metric. An unknown tag settles none.
    pub fn ackable(&self, key: ChannelKey, tag: u64, multiple: bool) -> usize {
        let Some(ch) = self.channels.get(&key) else {
            return 0;
        };
        match (multiple, tag) {
            (true, 0) => ch.unacked.len(),
            (true, _) => ch.unacked.partition_point(|u| u.tag <= tag),
            (false, _) => usize::from(ch.unacked.binary_search_by_key(&tag, |u| u.tag).is_ok()),
        }
    }

    /// basic.ack.
    pub fn basic_ack(
        &mut self,
        key: ChannelKey,
        tag: u64,
        multiple: bool,
        now_ms: u64,
        fx: &mut Effects,
    ) -> CoreResult<()> {
        let mut settled = self.settle(key, tag, multiple)?;
        settle_remote(key, &mut settled, Settlement::Ack, fx);
        let record = self.record_ops;
        let mut touched: Vec<Arc<str>> = Vec::new();
        let Self { queues, node, .. } = self;
        // An ack with `multiple` settles a run of deliveries that mostly came from one
        // queue: it is found once per run, not by name for every message.
        let mut run: Option<(Arc<str>, Option<&mut Queue>)> = None;
        for u in settled {
            if !run
                .as_ref()
                .is_some_and(|(name, _)| Arc::ptr_eq(name, &u.queue))
            {
                let q = queues
                    .get_mut(&u.queue)
                    .filter(|q| q.served_here(node.as_deref()));
                run = Some((u.queue.clone(), q));
            }
            if let Some((_, Some(q))) = &mut run
                && q.unacked(u.id).is_some()
            {
                apply(q, OpKind::Settle { id: u.id }, record, fx);
            }
            if !touched.contains(&u.queue) {
                touched.push(u.queue);
            }
        }
        if let Some(ch) = self.channels.get(&key) {
            for q in consumer_queues(ch) {
                if !touched.contains(&q) {
                    touched.push(q);
                }
            }
        }
        self.dispatch_all(touched, now_ms, fx);
        Ok(())
    }

    /// basic.nack and basic.reject (`multiple` = false): requeue at the original place or
    /// drop (dead-lettering where the queue has a dead-letter exchange).
    pub fn basic_nack(
        &mut self,
        key: ChannelKey,
        tag: u64,
        multiple: bool,
        requeue: bool,
        now_ms: u64,
        fx: &mut Effects,
    ) -> CoreResult<()> {
        let mut settled = self.settle(key, tag, multiple)?;
        let settlement = if requeue {
            Settlement::Requeue
        } else {
            Settlement::Reject
        };
        settle_remote(key, &mut settled, settlement, fx);
        let mut touched = Vec::new();
        if requeue {
            self.requeue(settled, None, &mut touched, fx);
        } else {
            let record = self.record_ops;
            let mut dead = Vec::new();
            for u in settled {
                if let Some(q) = self.served_unacked(&u) {
                    if q.args.dead_letter_at_least_once && q.args.dead_letter_exchange.is_some() {
                        // Stays until its copy is safe: no channel holds it any more, the
                        // connection that rejected it does (`HeldDeadLetter`).
                        let message = q.unacked(u.id).expect("unacked exists").message.clone();
                        dead.push(DeadLetter {
                            message,
                            queue: q.name.clone(),
                            reason: DropReason::Rejected,
                            held: Some(u.id),
                        });
                    } else {
                        let entry = apply(q, OpKind::Settle { id: u.id }, record, fx)
                            .expect("unacked exists");
                        dead.push(DeadLetter {
                            message: entry.message,
                            queue: q.name.clone(),
                            reason: DropReason::Rejected,
                            held: None,
                        });
                    }
                }
                if !touched.contains(&u.queue) {
                    touched.push(u.queue);
                }
            }
            self.dead_letter_all(dead, now_ms, fx);
        }
        if let Some(ch) = self.channels.get(&key) {
            touched.extend(consumer_queues(ch));
        }
        self.dispatch_all(touched, now_ms, fx);
        Ok(())
    }

    /// Rejected messages of `at-least-once` queues whose dead-lettered copies were made in a
    /// batch that is now durable, replicated and confirmed (`safe`: every forward of it taken
    /// by its primary) — removed from their queues — or whose copies may be missing (a
    /// forward refused, or the connection that held them went before it knew): put back at
    /// their place, marked redelivered, for another try. A queue that moved to another
    /// member meanwhile is left alone: its new primary requeued the message already.
    pub fn dead_letters_settled(
        &mut self,
        held: &[HeldDeadLetter],
        safe: bool,
        now_ms: u64,
        fx: &mut Effects,
    ) {
        let record = self.record_ops;
        let mut touched: Vec<Arc<str>> = Vec::new();
        for h in held {
            let Self { queues, node, .. } = self;
            let Some(q) = queues
                .get_mut(&h.queue)
                .filter(|q| q.served_here(node.as_deref()) && q.unacked(h.id).is_some())
            else {
                continue;
            };
            let kind = if safe {
                OpKind::Settle { id: h.id }
            } else {
                OpKind::Requeue { id: h.id }
            };
            apply(q, kind, record, fx);
            if !touched.contains(&h.queue) {
                touched.push(h.queue.clone());
            }
        }
        if !safe {
            self.dispatch_all(touched, now_ms, fx);
        }
    }

    /// basic.recover (requeue = true): every unacked delivery of the channel goes back.
    pub fn basic_recover(&mut self, key: ChannelKey, now_ms: u64, fx: &mut Effects) {
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        let mut unacked = ch.settle(0, true).unwrap_or_default();
        settle_remote(key, &mut unacked, Settlement::Requeue, fx);
        let mut touched = consumer_queues(ch);
        self.requeue(unacked, None, &mut touched, fx);
        self.dispatch_all(touched, now_ms, fx);
    }

    /// basic.recover with requeue=false (the spec's "redeliver to the original recipient"):
    /// the channel's unacknowledged deliveries that went to a consumer the channel has now
    /// (by its tag) are sent again, in tag order, under the tags they had — a resumed
    /// session's client gets what its lost connection never received, and drops by tag what
    /// it had (`docs/sessions.md`). On a session's channel (`as_sent`) they go with the
    /// `redelivered` flag they first had, being the same deliveries; elsewhere flagged
    /// redelivered, as the spec says of a recover. Deliveries from basic.get, to consumers
    /// gone, or proxied from another member stay unacknowledged as they are.
    pub fn basic_resend(&mut self, key: ChannelKey, as_sent: bool, fx: &mut Effects) {
        self.resend(key, None, as_sent, fx);
    }

    /// [`VHost::basic_resend`] for the consumer `only` (all of the channel's when `None`).
    pub(super) fn resend(
        &mut self,
        key: ChannelKey,
        only: Option<&str>,
        as_sent: bool,
        fx: &mut Effects,
    ) {
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        for u in &ch.unacked {
            let Some(consumer) = u
                .consumer
                .as_ref()
                .filter(|t| ch.consumers.contains_key(*t) && only.is_none_or(|o| o == &***t))
            else {
                continue;
            };
            if u.upstream.is_some() {
                continue;
            }
            let Some(entry) = self
                .queues
                .get(&u.queue)
                .filter(|q| q.served_here(self.node.as_deref()))
                .and_then(|q| q.unacked(u.id))
            else {
                continue;
            };
            ch.unwritten += 1;
            ch.unwritten_bytes += u.bytes;
            fx.deliveries.push(Delivery {
                channel: key,
                consumer_tag: consumer.clone(),
                delivery_tag: u.tag,
                redelivered: !as_sent || u.redelivered,
                message: entry.message.clone(),
            });
        }
    }

    /// The queue local delivery `u` came from, while this member serves it and the message
    /// is still out. A queue whose primary moved to another member (or is moving, sealed)
    /// leaves the delivery to the new primary, which requeued it: an ack or requeue here
    /// would change a copy that is now a replica of the new primary's.
    fn served_unacked(&mut self, u: &Unacked) -> Option<&mut Queue> {
        // Borrowed apart (no clone of the node id per ack).
        let Self { queues, node, .. } = self;
        queues
            .get_mut(&u.queue)
            .filter(|q| q.served_here(node.as_deref()) && q.unacked(u.id).is_some())
    }

    fn settle(&mut self, key: ChannelKey, tag: u64, multiple: bool) -> CoreResult<Vec<Unacked>> {
        let ch = self
            .channels
            .get_mut(&key)
            .ok_or_else(|| AmqpError::new(codes::CHANNEL_ERROR, "channel not open"))?;
        ch.settle(tag, multiple)
            .ok_or_else(|| AmqpError::precondition(format!("unknown delivery tag {tag}")))
    }

    /// Puts `unacked` back into their queues; with `hold_since`, each that went to a
    /// session's consumer is held for the session from then (`core::queue::holds`).
    pub(super) fn requeue(
        &mut self,
        unacked: Vec<Unacked>,
        hold_since: Option<u64>,
        touched: &mut Vec<Arc<str>>,
        fx: &mut Effects,
    ) {
        let record = self.record_ops;
        for u in unacked {
            if let Some(q) = self.served_unacked(&u) {
                let lost = hold_since.and_then(|_| q.lost_delivery(u.id));
                apply(q, OpKind::Requeue { id: u.id }, record, fx);
                if let Some(since) = hold_since {
                    q.hold_lost(u.id, lost, since);
                }
            }
            if !touched.contains(&u.queue) {
                touched.push(u.queue);
            }
        }
    }
}

/// Takes the proxied deliveries out of `settled` and hands their acknowledgement to the
/// server for their primaries ([`Effects::remote_settles`]).
fn settle_remote(
    key: ChannelKey,
    settled: &mut Vec<Unacked>,
    settlement: Settlement,
    fx: &mut Effects,
) {
    settled.retain(|u| match &u.upstream {
        Some(primary) => {
            fx.remote_settles.push(RemoteSettle {
                channel: key,
                primary: primary.clone(),
                upstream_tag: u.id,
                settlement,
            });
            false
        }
        None => true,
    });
}
