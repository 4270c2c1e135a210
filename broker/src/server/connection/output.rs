//! Output: deliveries, cancel notices and mailbox items onto the write buffer, and the end
//! of every batch of vhost commands, where output that promises durability is held behind
//! the connection's [`crate::server::confirm_gate::ConfirmGate`].

use super::frames::{ConnError, short};
use super::{Connection, Lazy, Phase};
use crate::amqp::{AMQPClass, basic, codes, connection};
use crate::clock::now_ms;
use crate::core::vhost::{Cancelled, Delivery};
use crate::core::{AmqpError, ChannelKey};
use crate::server::confirm_gate::Conditions;
use std::time::Duration;

impl Connection {
    pub(super) fn write_delivery(&mut self, d: &Delivery) {
        let id = d.channel.channel;
        match self.channels.get(&id) {
            Some(ch) if !ch.closing && ch.key == d.channel => {}
            _ => return,
        }
        let m = &d.message;
        self.writer.deliver(
            id,
            &d.consumer_tag,
            d.delivery_tag,
            d.redelivered,
            m.exchange.as_str(),
            m.routing_key.as_str(),
        );
        self.writer.header_payload(id, &m.header_payload);
        self.writer.body(id, m.body.bytes(), self.frame_max);
        let written = self.written.entry(id).or_insert((0, 0));
        written.0 += 1;
        written.1 += m.body.bytes().len() as u64;
        self.stats.delivered += 1; // metrics
        self.stats.redelivered += u64::from(d.redelivered); // metrics
    }

    pub(super) fn write_cancel(&mut self, c: &Cancelled) {
        if self.caps.consumer_cancel_notify
            && self
                .channels
                .get(&c.channel.channel)
                .is_some_and(|ch| !ch.closing)
        {
            self.writer.method(
                c.channel.channel,
                AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                    consumer_tag: short(&c.tag),
                    nowait: true,
                })),
            );
        }
    }

    /// Writes the deliveries and notices the last batch produced for this connection itself,
    /// after `earlier`: what other connections had dispatched to it before (see
    /// [`crate::broker::outbox::Outbox::take_deliveries`]), in delivery-tag order.
    pub(super) fn write_own_effects(&mut self, earlier: &mut Vec<Delivery>) {
        for d in earlier.drain(..) {
            self.write_delivery(&d);
        }
        let deliveries = std::mem::take(&mut self.fx.deliveries);
        for d in &deliveries {
            self.write_delivery(d);
        }
        self.fx.deliveries = deliveries;
        self.fx.deliveries.clear();
        let cancelled = std::mem::take(&mut self.fx.cancelled);
        for c in &cancelled {
            self.write_cancel(c);
        }
        self.fx.cancelled = cancelled;
        self.fx.cancelled.clear();
        self.fx.ops.clear();
    }

    pub(super) fn drain_outbox(&mut self) {
        self.outbox.take(&mut self.spare);
        let mut pending = std::mem::take(&mut self.spare);
        // These were dispatched before anything the batch below may dispatch: written first.
        for d in pending.deliveries.drain(..) {
            self.write_delivery(&d);
        }
        if (!pending.proxied.is_empty() || !pending.proxied_ended.is_empty())
            && let Some(vhost) = self.vhost.clone()
        {
            let mut v = Lazy::new(&vhost);
            self.write_proxied(&mut pending.proxied, &mut v);
            self.end_proxied(&mut pending.proxied_ended);
            self.end_batch(v);
        }
        for c in pending.cancelled.drain(..) {
            self.write_cancel(&c);
        }
        if let Some(blocked) = pending.blocked.take() {
            self.send_blocked(blocked);
        }
        if !pending.close_channels.is_empty() {
            let closing: Vec<(u16, String)> = pending.close_channels.drain(..).collect();
            self.force_close_channels(closing);
        }
        if let Some((code, text)) = pending.close.take()
            && self.phase == Phase::Running
        {
            self.connection_error(ConnError::new(code, text));
        }
        self.spare = pending;
    }

    /// Closes channels an operator asked to close (admin API), as a channel error 320.
    pub(super) fn force_close_channels(&mut self, channels: Vec<(u16, String)>) {
        let Some(vhost) = self.vhost.clone() else {
            return;
        };
        let mut v = Lazy::new(&vhost);
        for (id, reason) in channels {
            if self.channels.get(&id).is_some_and(|ch| !ch.closing) {
                self.channel_error(
                    id,
                    AmqpError::new(codes::CONNECTION_FORCED, reason),
                    0,
                    0,
                    &mut v,
                );
            }
        }
        self.end_batch(v);
    }

    pub(super) fn send_blocked(&mut self, blocked: bool) {
        if !blocked {
            self.publish_waits_for_unblock = false;
            self.stats.set_blocked(&self.broker.stats, self.id, false); // metrics
        }
        if !self.caps.connection_blocked
            || self.blocked_sent == blocked
            || self.phase != Phase::Running
        {
            return;
        }
        self.blocked_sent = blocked;
        let m = if blocked {
            connection::AMQPMethod::Blocked(connection::Blocked {
                reason: self.broker.blocked_reason().into(),
            })
        } else {
            connection::AMQPMethod::Unblocked(connection::Unblocked {})
        };
        self.writer.method(0, AMQPClass::Connection(m));
    }

    /// After a socket write: tells the vhost which deliveries left, so that consumers held
    /// back by the write window get more.
    pub(super) fn report_written(&mut self) {
        if self.written.is_empty() {
            return;
        }
        let Some(vhost) = self.vhost.clone() else {
            return;
        };
        let now = now_ms();
        let mut v = Lazy::new(&vhost);
        v.get();
        for (channel, (count, bytes)) in self.written.drain() {
            v.get().delivered_written(
                ChannelKey {
                    conn: self.id,
                    channel,
                },
                count,
                bytes,
                now,
                &mut self.fx,
            );
        }
        self.end_batch(v);
    }

    /// Ends the batch and writes every delivery dispatched to this connection so far, its
    /// own and other connections': what must go out before a basic.cancel-ok, after which
    /// the client gets nothing more for that consumer (AMQP 0-9-1). Written after it, they
    /// reached a client that no longer knew the consumer, and went back to the queue only
    /// when the channel closed — behind later messages (a fragmented queue's pulls, which
    /// cancel and go on, saw their producers' order broken).
    pub(super) fn flush_deliveries(&mut self, v: &mut Lazy) {
        let batch = Lazy {
            vhost: v.vhost,
            guard: v.guard.take(),
            now_ms: v.now_ms,
        };
        self.end_batch(batch);
        let mut earlier = std::mem::take(&mut self.spare.deliveries);
        self.outbox.take_deliveries(&mut earlier);
        self.write_own_effects(&mut earlier);
        self.spare.deliveries = earlier;
    }

    /// Ends a batch of vhost commands that took the vhost lock: this batch's publisher
    /// confirms go onto the write buffer, the broker finishes the batch (paged bodies read
    /// back, other connections' effects routed, durable changes handed to the journal), the
    /// lock is released, and everything written so far is held behind the batch's
    /// [`Conditions`] — so no confirm leaves before what it confirms is durable. Then this
    /// connection's own deliveries are written, after the hold: they promise nothing.
    pub(super) fn end_batch(&mut self, mut v: Lazy) {
        if v.guard.is_none() {
            return;
        }
        self.flush_confirms();
        if let Some(guard) = v.guard.as_mut() {
            // Before the forwards: a paged dead letter's forward is the connection's too.
            self.broker.resolve_paged_dead_letters(guard, &mut self.fx);
        }
        let watched = self.watch_dead_letter_forwards();
        self.broker
            .forward(&self.vhost_name, &mut self.fx, Some(&self.forwards));
        self.send_remote_settles();
        // The client's close-ok waits for its exclusive queues to go, as on one broker (a
        // broker-initiated close, waiting for the client's close-ok, does not wait).
        let awaited = matches!(self.phase, Phase::Running | Phase::Done).then_some(&self.forwards);
        self.broker
            .retire_awaited(&self.vhost_name, &mut self.fx, awaited);
        let Some(guard) = v.guard.as_mut() else {
            return;
        };
        let journal_seq = self.broker.finish_batch(self.id, guard, &mut self.fx);
        let mut earlier = std::mem::take(&mut self.spare.deliveries);
        if !self.fx.deliveries.is_empty() || !self.held.is_empty() {
            self.outbox.take_deliveries(&mut earlier);
        }
        // Held proxied deliveries take their tags last, so they are written last.
        let released = self.release_held(&mut v);
        drop(v.guard.take());
        let conditions = self.hold_output(journal_seq);
        self.keep_dead_letters(watched, conditions);
        self.write_own_effects(&mut earlier);
        self.write_admitted(released);
        self.spare.deliveries = earlier;
    }

    /// Holds everything written so far until the journal is durable up to `journal_seq`,
    /// every publish forwarded so far is confirmed by its primary, and the in-sync backups
    /// acknowledged the batch's replication stamp (taken from the effects).
    /// Returns the conditions it held them behind.
    pub(super) fn hold_output(&mut self, journal_seq: Option<u64>) -> Option<Conditions> {
        let forwards = self.forwards.issued();
        let replicated = self.fx.replica_stamp.take();
        let mut conditions =
            if journal_seq.is_some() || forwards > self.forwards_held || replicated.is_some() {
                Some(Conditions {
                    journal_seq: journal_seq.unwrap_or(0),
                    forwards,
                    replicated: replicated.unwrap_or(0),
                    lease: self.broker.cluster().is_some(),
                })
            } else {
                None
            };
        if std::mem::take(&mut self.resent_confirmed)
            && let Some(session) = self.session
        {
            // A resent duplicate's confirm stands for the first one, which waited for this.
            let b = session.barrier;
            let c = conditions.get_or_insert(Conditions {
                journal_seq: 0,
                forwards,
                replicated: 0,
                lease: self.broker.cluster().is_some(),
            });
            c.journal_seq = c.journal_seq.max(b.journal_seq);
            c.replicated = c.replicated.max(b.replicated);
        }
        self.forwards_held = forwards;
        self.gate.hold(self.writer.len(), conditions);
        conditions
    }

    /// Whether this broker may release output that waits for the lease now: it holds the
    /// majority's lease, or it is no cluster member.
    pub(super) fn lease_held_now(&self) -> bool {
        self.broker.cluster().is_none_or(|c| c.has_quorum())
    }

    /// How long at most a connection whose forwarded publish failed goes on before it closes
    /// (reading nothing meanwhile), unless a queue's primary moves first (the election it
    /// waits for): the cluster's failure timeout and half a second. Closed at once, a
    /// publisher resuming on another member had its resent publishes forwarded to the same
    /// dead primary and was closed again, twenty times a second until the election; closed
    /// after it, its resend goes to the new primary.
    pub(super) fn forward_failure_grace(&self) -> Duration {
        Duration::from_millis(self.broker.config.cluster_failure_timeout_ms + 500)
    }

    /// A forwarded publish was not confirmed by its primary (`failed` is its number): what
    /// the output held for it and after it never leaves — no confirm for a message that
    /// may be lost — and the connection closes with 320 and the reason, so the publisher
    /// knows its unconfirmed publishes need sending again. What was held before it still
    /// waits for its own conditions (it used to be let go at once, a confirm before its
    /// fsync or its backups).
    pub(super) fn abandon_unconfirmed(&mut self, failed: u64, reason: &str) {
        if let Some(keep) = self.gate.abandon_from(failed) {
            self.writer.truncate(keep);
        }
        self.connection_error(ConnError::new(
            codes::CONNECTION_FORCED,
            format!("a publish could not be handed to its queue's primary: {reason}"),
        ));
    }
}
