//! The mailbox of a connection: deliveries and notices that other connections' commands
//! produced for it. Filled under the vhost lock (so a channel that closes can purge what was
//! meant for it), drained by the connection's own task in one swap.

use crate::core::vhost::{Cancelled, Delivery};
use crate::proxy::upstream::{ProxiedDelivery, ProxiedEnd};
use parking_lot::Mutex;
use tokio::sync::Notify;

/// Items waiting for one connection.
#[derive(Debug, Default)]
pub struct Pending {
    /// Deliveries to write.
    pub deliveries: Vec<Delivery>,
    /// Consumers the broker cancelled.
    pub cancelled: Vec<Cancelled>,
    /// The broker asks the connection to close (code, text).
    pub close: Option<(u16, String)>,
    /// The broker asks the connection to close these channels (number, reason).
    pub close_channels: Vec<(u16, String)>,
    /// Deliveries from other members for this connection's proxied consumers.
    pub proxied: Vec<ProxiedDelivery>,
    /// Proxied consumers that ended without the client asking.
    pub proxied_ended: Vec<ProxiedEnd>,
    /// Publishers are blocked (Some(true)) or unblocked (Some(false)) since the last drain.
    pub blocked: Option<bool>,
}

/// One connection's mailbox.
#[derive(Debug, Default)]
pub struct Outbox {
    pending: Mutex<Pending>,
    notify: Notify,
}

impl Outbox {
    /// Adds items with `fill` and wakes the connection.
    pub fn push(&self, fill: impl FnOnce(&mut Pending)) {
        fill(&mut self.pending.lock());
        self.notify.notify_one();
    }

    /// Takes everything waiting, leaving `spare` (an emptied vector from the last drain) in its
    /// place so that the steady state allocates nothing.
    pub fn take(&self, spare: &mut Pending) {
        std::mem::swap(&mut *self.pending.lock(), spare);
    }

    /// Takes only the deliveries waiting, appending them to `into`. A connection whose own
    /// batch dispatched deliveries takes these before it lets go of the vhost lock: they were
    /// dispatched earlier (other connections push under that lock), so they carry the
    /// channel's lower delivery tags and must be written first — a client acking the higher
    /// tag with `multiple` would otherwise ack messages it has not been sent.
    pub fn take_deliveries(&self, into: &mut Vec<Delivery>) {
        into.append(&mut self.pending.lock().deliveries);
    }

    /// Drops deliveries and notices for `channel` (it closed; the vhost requeued its unacked).
    pub fn purge_channel(&self, channel: u16) {
        let mut p = self.pending.lock();
        p.deliveries.retain(|d| d.channel.channel != channel);
        p.cancelled.retain(|c| c.channel.channel != channel);
        p.proxied.retain(|d| d.channel != channel);
        p.proxied_ended.retain(|e| e.channel != channel);
    }

    /// Resolves when something was pushed since the last call.
    pub async fn notified(&self) {
        self.notify.notified().await
    }
}
