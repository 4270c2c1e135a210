//! Deliveries of proxied consumers: each takes its client channel's next delivery tag from
//! the vhost, waits (held) while the client's window is full, and goes back to its queue on
//! the primary when its consumer is gone.

use super::{Admitted, RemoteConsumer};
use crate::core::ChannelKey;
use crate::core::vhost::Settlement;
use crate::proxy::upstream::{ProxiedDelivery, ProxiedEnd};
use crate::server::connection::{Connection, Lazy};
use std::collections::VecDeque;

impl Connection {
    /// Writes deliveries of proxied consumers that came through the mailbox. A delivery for
    /// a consumer that is gone (cancelled, or its channel closed) goes back to its queue.
    ///
    /// Local deliveries other connections dispatched to this one are written first: they
    /// took their tags before, and from the moment this takes the vhost lock no more arrive
    /// until the proxied ones have theirs.
    pub(in crate::server::connection) fn write_proxied(
        &mut self,
        deliveries: &mut Vec<ProxiedDelivery>,
        v: &mut Lazy,
    ) {
        if deliveries.is_empty() {
            return;
        }
        v.get();
        let mut earlier = Vec::new();
        self.outbox.take_deliveries(&mut earlier);
        for d in &earlier {
            self.write_delivery(d);
        }
        let admitted = self.admit_proxied(deliveries, v);
        self.write_admitted(admitted);
    }

    /// Gives each proxied delivery its client channel's next delivery tag (see
    /// [`Connection::admit_one`]).
    fn admit_proxied(
        &mut self,
        deliveries: &mut Vec<ProxiedDelivery>,
        v: &mut Lazy,
    ) -> Vec<Admitted> {
        let mut admitted = Vec::new();
        for d in deliveries.drain(..) {
            admitted.extend(self.admit_one(d, v));
        }
        admitted
    }

    /// Gives a proxied delivery its client channel's next delivery tag (under the vhost lock
    /// in `v`), unless it waits: for consume-ok, or for room in the channel-wide prefetch
    /// (behind any of the channel's deliveries that already wait). One for a consumer that
    /// is gone goes back to its queue.
    fn admit_one(&mut self, d: ProxiedDelivery, v: &mut Lazy) -> Option<Admitted> {
        let open = self.channels.get(&d.channel).is_some_and(|ch| !ch.closing);
        let consumer = self
            .remote_consumers
            .get_mut(&(d.channel, d.consumer_tag.clone()))
            .filter(|rc| rc.serial == d.serial && open);
        match consumer {
            Some(RemoteConsumer {
                early: Some(early), ..
            }) => {
                // consume-ok has not gone out yet: this delivery waits for it.
                early.push(d);
                return None;
            }
            Some(_) => {}
            None => {
                self.settle_upstream(d.channel, &d.primary, d.upstream_tag, Settlement::Requeue);
                return None;
            }
        }
        let key = ChannelKey {
            conn: self.id,
            channel: d.channel,
        };
        let bytes = d.message.body_len() as u64;
        if !d.no_ack
            && (self.held.contains_key(&d.channel) || !v.get().channel_window_open(key, bytes))
        {
            self.held.entry(d.channel).or_default().push_back(d);
            return None;
        }
        let tag =
            v.get()
                .track_remote(key, &d.queue, &d.primary, d.upstream_tag, bytes, d.no_ack)?;
        Some(Admitted { delivery: d, tag })
    }

    /// Writes proxied deliveries that have their tags, in tag order.
    pub(in crate::server::connection) fn write_admitted(&mut self, admitted: Vec<Admitted>) {
        let mut taken = Vec::new();
        for Admitted { delivery: d, tag } in admitted {
            let m = &d.message;
            self.writer.deliver(
                d.channel,
                &d.consumer_tag,
                tag,
                d.redelivered,
                m.exchange.as_str(),
                m.routing_key.as_str(),
            );
            self.writer.header_payload(d.channel, &m.header_payload);
            self.writer.body(d.channel, m.body.bytes(), self.frame_max);
            self.stats.delivered += 1; // metrics
            self.stats.redelivered += u64::from(d.redelivered); // metrics
            if d.no_ack {
                // The client takes it as it is written: settled upstream now.
                taken.push((d.channel, d.primary, d.upstream_tag, Settlement::Ack));
            }
        }
        self.settle_upstream_all(taken);
    }

    /// Admits the deliveries channel-wide prefetch held back, in the order they came, as far
    /// as the channels' windows (opened by the client's acks, or by a larger basic.qos) now
    /// allow: they are written after the batch's other deliveries, whose tags are lower.
    ///
    /// A primary sees only its own part of a channel's consumers, so it cannot keep a window
    /// shared with consumers on other members (or on this one): each proxied consumer gets
    /// the whole window as upstream credit, and the proxy holds what arrives past the
    /// window. What it holds is bounded by that credit, stays unacked on the primary, and
    /// goes back to its queue there if the consumer is cancelled or the channel closes.
    pub(in crate::server::connection) fn release_held(&mut self, v: &mut Lazy) -> Vec<Admitted> {
        let mut admitted = Vec::new();
        let channels: Vec<u16> = self.held.keys().copied().collect();
        for channel in channels {
            let Some(mut waiting) = self.held.remove(&channel) else {
                continue;
            };
            // In order, until one has to wait again: it goes back in front of the rest.
            while let Some(d) = waiting.pop_front() {
                admitted.extend(self.admit_one(d, v));
                if let Some(again) = self.held.remove(&channel) {
                    for d in again.into_iter().rev() {
                        waiting.push_front(d);
                    }
                    self.held.insert(channel, waiting);
                    break;
                }
            }
        }
        admitted
    }

    /// Takes the held deliveries of the proxied consumer `tag` (serial `serial`) of
    /// `channel` out of the channel's wait: it ended, so nobody here will take them.
    pub(in crate::server::connection) fn take_held(
        &mut self,
        channel: u16,
        tag: &str,
        serial: u64,
    ) -> VecDeque<ProxiedDelivery> {
        let Some(waiting) = self.held.get_mut(&channel) else {
            return VecDeque::new();
        };
        let (theirs, others): (VecDeque<_>, VecDeque<_>) = waiting
            .drain(..)
            .partition(|d| d.serial == serial && &*d.consumer_tag == tag);
        *waiting = others;
        if waiting.is_empty() {
            self.held.remove(&channel);
        }
        theirs
    }

    /// Proxied consumers the primary ended (their queue was deleted, or the link failed):
    /// the client hears of it as of a local consumer the broker cancelled.
    pub(in crate::server::connection) fn end_proxied(&mut self, ended: &mut Vec<ProxiedEnd>) {
        for e in ended.drain(..) {
            let k = (e.channel, e.consumer_tag.clone());
            if self
                .remote_consumers
                .get(&k)
                .is_none_or(|rc| rc.serial != e.serial)
            {
                continue;
            }
            self.remote_consumers.remove(&k);
            for d in self.take_held(e.channel, &e.consumer_tag, e.serial) {
                self.settle_upstream(e.channel, &d.primary, d.upstream_tag, Settlement::Requeue);
            }
            self.write_cancel(&crate::core::vhost::Cancelled {
                channel: ChannelKey {
                    conn: self.id,
                    channel: e.channel,
                },
                tag: e.consumer_tag,
            });
        }
    }
}
