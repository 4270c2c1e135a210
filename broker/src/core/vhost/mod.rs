//! The virtual host: exchanges, queues, bindings, consumers, routing and delivery, as a pure
//! state machine. Commands come in with the current time; replies come back as return values
//! and everything that must reach other channels comes back as [`Effects`]. No sockets, no
//! tasks, no clock: the same code runs behind the server, in tests and in simulations.
//!
//! This file holds the state itself and what every command leans on: construction, limits,
//! lookups, names, and the lifecycle of channels and connections. Each kind of command has its
//! own file, one `impl VHost` block each, so that a reader finds a command by its job:
//! `declare` (wiring), `routing` (publish), `consume` (deliveries to consumers and
//! basic.get), `settle` (acks, nacks, requeues), `expiry` (time and TTLs),
//! `dead_letter` (messages leaving for a dead-letter exchange), and `effects` (what a
//! batch hands back to the server).

mod consume;
mod dead_letter;
mod declare;
mod effects;
mod expiry;
mod feeds;
mod fragments;
mod replica;
mod routing;
mod sessions;
mod settle;

pub use consume::{Consume, GetOk};
pub use declare::{ExchangeDeclare, QueueDeclare, QueueDeclared};
pub use effects::{
    Cancelled, DeadLetter, Delivery, Effects, Forward, HeldDeadLetter, PageOut, RemoteSettle,
    Settlement,
};
pub use feeds::{Feed, Feeds};
pub use routing::{FLOW_READY_THRESHOLD, PublishOutcome};
pub use sessions::OwnerToken;

use super::channel::{ChannelKey, ChannelState, Consumer};
use super::error::{AmqpError, CoreResult};
use super::exchange::{Exchange, ExchangeKind};
use super::queue::Queue;
use super::{NO_CONNECTION, is_foreign};
use crate::amqp::FieldTable;
use crate::core::FastHashMap;
use std::collections::HashSet;
use std::sync::Arc;

/// One virtual host's state.
#[derive(Debug)]
pub struct VHost {
    pub(super) name: String,
    pub(super) exchanges: FastHashMap<Arc<str>, Exchange>,
    pub(super) queues: FastHashMap<Arc<str>, Queue>,
    channels: FastHashMap<ChannelKey, ChannelState>,
    name_seed: u64,
    names_issued: u64,
    record_ops: bool,
    wiring_dirty: bool,
    /// See [`VHost::cluster_applied`].
    pub(super) cluster_through: Option<u64>,
    pub(super) limits: Limits,
    /// This member's node id on a cluster (see [`VHost::set_node`]); `None` on a single
    /// broker, where every queue is local.
    pub(super) node: Option<Arc<str>>,
    /// Node ids of the live cluster members (see [`VHost::set_live_nodes`]).
    pub(super) live_nodes: Vec<Arc<str>>,
    /// Some queue is (or was) a proxy for a queue on another AMQP broker: routing looks for
    /// remote targets even on a single broker.
    pub(super) has_foreign: bool,
    /// Some queue is (or was) fragmented: routing looks for fragments to put messages in.
    pub(super) has_fragmented: bool,
    /// This member's [`crate::core::fragments::fragment_prefix`], hashed once.
    pub(super) fragment_prefix: Option<String>,
    /// The connections that are other cluster members' links ([`VHost::link_opened`]).
    pub(super) links: HashSet<u64>,
    /// The vector a publish routes into, empty between publishes: kept so that a publish
    /// does not allocate one ([`VHost::publish_as`]).
    pub(super) route_scratch: Vec<Arc<str>>,
}

/// Per-vhost resource limits; 0 means none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// Most queues in the vhost.
    pub max_queues: usize,
    /// Most consumers on one channel.
    pub max_consumers_per_channel: usize,
    /// Most unacked deliveries on one channel, whatever its prefetch (see
    /// [`ChannelState::max_unacked`]).
    pub max_unacked_per_channel: u32,
    /// Bytes of message bodies a queue keeps in memory before new ones go to disk
    /// (flow-to-disk); `None` keeps everything in memory (no store to page to).
    pub queue_memory_budget_bytes: Option<usize>,
}

impl VHost {
    /// A vhost with the predeclared exchanges. `name_seed` makes server-named queues and
    /// consumer tags unique across broker runs without a clock or RNG inside the core.
    pub fn new(name: &str, name_seed: u64) -> Self {
        let mut vhost = Self {
            name: name.to_owned(),
            exchanges: FastHashMap::default(),
            queues: FastHashMap::default(),
            channels: FastHashMap::default(),
            name_seed,
            names_issued: 0,
            record_ops: false,
            wiring_dirty: false,
            cluster_through: None,
            limits: Limits::default(),
            node: None,
            live_nodes: Vec::new(),
            has_foreign: false,
            has_fragmented: false,
            fragment_prefix: None,
            links: HashSet::new(),
            route_scratch: Vec::new(),
        };
        for (n, kind) in [
            ("", ExchangeKind::Direct),
            ("amq.direct", ExchangeKind::Direct),
            ("amq.fanout", ExchangeKind::Fanout),
            ("amq.topic", ExchangeKind::Topic),
            ("amq.headers", ExchangeKind::Headers),
            ("amq.match", ExchangeKind::Headers),
        ] {
            let name: Arc<str> = n.into();
            vhost.exchanges.insert(
                name.clone(),
                Exchange::new(name, kind, true, false, false, FieldTable::default()),
            );
        }
        vhost
    }

    /// The vhost's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Turns recording of queue ops into [`Effects::ops`] on or off. Off by default: a queue
    /// with no journal and no replica has nobody to read them.
    pub fn set_record_ops(&mut self, on: bool) {
        self.record_ops = on;
    }

    /// Sets the vhost's resource limits.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// Makes this vhost a cluster member's: a shared queue whose home (its primary) is
    /// another node holds no messages here — publishes routed to it become
    /// [`Effects::forwards`] to its primary, and its consumers are proxied by the server.
    pub fn set_node(&mut self, node: &str) {
        self.node = Some(node.into());
        self.fragment_prefix = Some(crate::core::fragments::fragment_prefix(node));
    }

    /// The live members of the cluster: a queue whose primary is not among them cannot take
    /// messages, so a publish routed to it is refused (a `basic.nack` under confirms) until
    /// its primary is back (or, with replication, a backup took over).
    pub fn set_live_nodes(&mut self, nodes: &[String]) {
        self.live_nodes = nodes.iter().map(|n| n.as_str().into()).collect();
    }

    /// Deletes a queue that auto-delete, `x-expires` or its exclusive owner's end retired: at
    /// once on a single broker; on a cluster member, a shared queue is only named in
    /// [`Effects::retire`] — the server commits its deletion through the cluster, so every
    /// member drops it at the same point of the agreed order.
    pub(super) fn retire_queue(&mut self, name: &str, fx: &mut Effects) {
        let shared = self.node.is_some() && self.queues.get(name).is_some_and(|q| q.home.is_some());
        if shared {
            if !fx.retire.iter().any(|n| n.as_ref() == name) {
                fx.retire.push(name.into());
            }
        } else {
            self.remove_queue(name, fx);
        }
    }

    /// The primary of queue `name` when it is another member or a foreign broker's URI (the
    /// queue is proxied here); `None` for a local queue or an unknown one.
    pub fn remote_primary(&self, name: &str) -> Option<Arc<str>> {
        self.queues
            .get(name)
            .and_then(|q| self.primary_elsewhere(q))
    }

    /// See [`VHost::remote_primary`].
    pub(super) fn primary_elsewhere(&self, q: &Queue) -> Option<Arc<str>> {
        q.primary_elsewhere(self.node.as_deref()).cloned()
    }

    /// Marks queue `name` replicated or not (see [`Queue::replicated`]): the cluster map
    /// gave it backups, and this member is its primary or one of them.
    pub fn set_replicated(&mut self, name: &str, on: bool) {
        if let Some(q) = self.queues.get_mut(name) {
            q.replicated = on;
        }
    }

    /// Records which cluster member owns queue `name` (a no-op if there is no such queue).
    pub fn set_queue_home(&mut self, name: &str, node: &str) {
        if let Some(q) = self.queues.get_mut(name) {
            q.home = Some(node.into());
            self.has_foreign |= is_foreign(node);
        }
    }

    /// A fresh server-made queue name (`amq.gen-…`). A cluster member makes the name up
    /// before it multicasts the declare, so that every member creates the same queue.
    pub fn fresh_queue_name(&mut self) -> String {
        self.fresh_name("amq.gen-")
    }

    /// A fresh server-made consumer tag (`amq.ctag-…`), for a consumer the server proxies.
    pub fn fresh_consumer_tag(&mut self) -> String {
        self.fresh_name("amq.ctag-")
    }

    /// The per-consumer prefetch count (basic.qos global=false) a consumer registered on the
    /// channel now would get; 0 = unlimited.
    pub fn consumer_prefetch(&self, key: ChannelKey) -> u32 {
        self.channels
            .get(&key)
            .map_or(0, |ch| ch.consumer_prefetch_count)
    }

    /// The channel-wide prefetch count (basic.qos global=true); 0 = unlimited.
    pub fn channel_prefetch(&self, key: ChannelKey) -> u32 {
        self.channels
            .get(&key)
            .map_or(0, |ch| ch.channel_prefetch_count)
    }

    /// Whether channel `key`'s channel-wide prefetch lets one more delivery of `bytes` body
    /// bytes out now (see [`crate::core::channel::ChannelState::channel_window_open`]);
    /// false when the channel is gone.
    pub fn channel_window_open(&self, key: ChannelKey, bytes: u64) -> bool {
        self.channels
            .get(&key)
            .is_some_and(|ch| ch.channel_window_open(bytes))
    }

    /// Makes sure a broker-owned exchange exists (such as `amq.qpid` in a cluster); the
    /// `amq.` prefix keeps clients from declaring or deleting it.
    pub fn ensure_system_exchange(&mut self, name: &str, kind: ExchangeKind) {
        let name: Arc<str> = name.into();
        self.exchanges.entry(name.clone()).or_insert_with(|| {
            Exchange::new(name, kind, true, false, false, FieldTable::default())
        });
    }

    /// Records that the cluster change at agreed `index` has been applied here (whatever it
    /// did): the durable wiring is saved with it as its `cluster_through`, so that a restart
    /// replays the cluster's log from after it and never applies it twice.
    pub fn cluster_applied(&mut self, index: u64) {
        self.cluster_through = Some(index);
        self.mark_wiring_changed();
    }

    /// The agreed index of the newest cluster change applied here (see
    /// [`VHost::cluster_applied`]).
    pub fn cluster_through(&self) -> Option<u64> {
        self.cluster_through
    }

    pub(super) fn mark_wiring_changed(&mut self) {
        self.wiring_dirty = true;
    }

    /// Whether a durable exchange, queue or binding was created or removed since the last
    /// call: the durable wiring must then be saved before the command is answered.
    pub fn take_wiring_changed(&mut self) -> bool {
        std::mem::take(&mut self.wiring_dirty)
    }

    /// A queue by name.
    pub fn queue(&self, name: &str) -> Option<&Queue> {
        self.queues.get(name)
    }

    /// An exchange by name.
    pub fn exchange(&self, name: &str) -> Option<&Exchange> {
        self.exchanges.get(name)
    }

    /// All queues.
    pub fn queues(&self) -> impl Iterator<Item = &Queue> {
        self.queues.values()
    }

    /// All exchanges.
    pub fn exchanges(&self) -> impl Iterator<Item = &Exchange> {
        self.exchanges.values()
    }

    /// All open channels and their consumer state (read-only, for the admin API).
    pub fn channels(&self) -> impl Iterator<Item = (&ChannelKey, &ChannelState)> {
        self.channels.iter()
    }

    fn not_found_queue(&self, name: &str) -> AmqpError {
        AmqpError::not_found(format!("no queue '{name}' in vhost '{}'", self.name))
    }

    fn not_found_exchange(&self, name: &str) -> AmqpError {
        AmqpError::not_found(format!("no exchange '{name}' in vhost '{}'", self.name))
    }

    pub(super) fn locked(&self, name: &str) -> AmqpError {
        AmqpError::resource_locked(format!(
            "cannot obtain exclusive access to locked queue '{name}' in vhost '{}'. It could be \
             originally declared on another connection or the exclusive property value does not \
             match that of the original declaration.",
            self.name
        ))
    }

    /// Looks a queue up for use by connection `conn`, enforcing exclusivity.
    fn usable_queue(&self, name: &str, conn: u64) -> CoreResult<&Queue> {
        let q = self
            .queues
            .get(name)
            .ok_or_else(|| self.not_found_queue(name))?;
        if self.may_use(q, conn) {
            Ok(q)
        } else {
            Err(self.locked(name))
        }
    }

    /// Whether connection `conn` may use queue `q`, exclusive or not. A cluster op
    /// (NO_CONNECTION) was checked by the member that sent it; so was a link's use of a
    /// session's exclusive queue whose primary is here while the session is on the link's
    /// member ([`VHost::check_exclusive`] there).
    pub(super) fn may_use(&self, q: &Queue, conn: u64) -> bool {
        match q.exclusive_owner {
            Some(owner) if owner != conn && conn != NO_CONNECTION => {
                q.session.is_some() && self.links.contains(&conn)
            }
            _ => true,
        }
    }

    /// A 64-bit id no other queue of this broker has had (see
    /// [`QueueOp::uid`](crate::core::QueueOp::uid)).
    pub(super) fn fresh_uid(&mut self) -> u64 {
        self.names_issued += 1;
        let mut z = self.name_seed ^ self.names_issued.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)).max(1)
    }

    fn fresh_name(&mut self, prefix: &str) -> String {
        self.names_issued += 1;
        self.name_at(prefix, self.names_issued)
    }

    /// The name queue.declare with an empty name gives next: permission checks match it
    /// before the queue exists (RabbitMQ checks configure on the generated name too).
    pub fn next_server_queue_name(&self) -> String {
        self.name_at("amq.gen-", self.names_issued + 1)
    }

    fn name_at(&self, prefix: &str, issued: u64) -> String {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        // splitmix64 over (seed, counter): unique per counter, unpredictable enough for names.
        let mut x = self.name_seed ^ issued.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut out = String::from(prefix);
        for _ in 0..2 {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            for i in 0..11 {
                out.push(ALPHABET[((z >> (i * 6)) & 63) as usize] as char);
            }
        }
        out
    }

    /// channel.open.
    pub fn channel_open(&mut self, key: ChannelKey) {
        if let Some(kept) = self.channels.get_mut(&key) {
            // A session's channel, detached when its connection went (see
            // [`VHost::channel_detach`]), resumed by the session's next connection: its
            // unacked deliveries and its tag sequence go on; qos starts afresh (the client
            // sets it again before it consumes).
            *kept = ChannelState {
                last_delivery_tag: kept.last_delivery_tag,
                unacked: std::mem::take(&mut kept.unacked),
                unacked_bytes: kept.unacked_bytes,
                max_unacked: self.limits.max_unacked_per_channel,
                ..ChannelState::default()
            };
            return;
        }
        self.channels.insert(
            key,
            ChannelState {
                max_unacked: self.limits.max_unacked_per_channel,
                ..ChannelState::default()
            },
        );
    }

    /// The connection of a session that is kept went away (`docs/sessions.md`): the
    /// channel's consumers go, as on a close, but its unacked deliveries stay with it, under
    /// their tags, for the session's next connection to acknowledge after it reopens the
    /// channel — or back to their queues when the session ends
    /// ([`VHost::close_channels_of`]). Deliveries proxied from another member go back with
    /// their upstream channels, as on a close.
    pub fn channel_detach(&mut self, key: ChannelKey, now_ms: u64, fx: &mut Effects) {
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        let consumers: Vec<Consumer> = ch.consumers.drain().map(|(_, c)| c).collect();
        ch.unacked.retain(|u| u.upstream.is_none());
        ch.unacked_bytes = ch.unacked.iter().map(|u| u.bytes).sum();
        ch.unwritten = 0;
        ch.unwritten_bytes = 0;
        let mut touched: Vec<Arc<str>> = Vec::new();
        for c in consumers {
            self.detach_consumer(key, &c.queue, &c.tag, fx);
            touched.push(c.queue);
        }
        self.dispatch_all(touched, now_ms, fx);
    }

    /// Closes every channel of connection (or session owner) `conn`, open or detached: the
    /// end of a session, whose detached channels no connection holds.
    pub fn close_channels_of(&mut self, conn: u64, now_ms: u64, fx: &mut Effects) {
        self.close_channels_holding(conn, None, now_ms, fx);
    }

    /// The session whose channels `conn` (its owner) names moved to another member: its
    /// channels close as in [`VHost::close_channels_of`], and what went to its consumers is
    /// held for it (`core::queue::holds`): its client, resuming elsewhere, may have seen it.
    pub fn hand_channels_over(&mut self, conn: u64, now_ms: u64, fx: &mut Effects) {
        self.close_channels_holding(conn, Some(now_ms), now_ms, fx);
    }

    /// Closes every channel of `conn`; with `hold_since`, requeued deliveries of a session's
    /// consumer are held for the session from then.
    fn close_channels_holding(
        &mut self,
        conn: u64,
        hold_since: Option<u64>,
        now_ms: u64,
        fx: &mut Effects,
    ) {
        let keys: Vec<ChannelKey> = self
            .channels
            .keys()
            .filter(|k| k.conn == conn)
            .copied()
            .collect();
        for key in keys {
            self.close_channel(key, hold_since, now_ms, fx);
        }
    }

    /// What a session's status tells about its channels: per channel of `conn`, the next
    /// delivery tag and the tags still unacknowledged, in channel order.
    pub fn channel_summaries(&self, conn: u64) -> Vec<(u16, u64, Vec<u64>)> {
        let mut out: Vec<(u16, u64, Vec<u64>)> = self
            .channels
            .iter()
            .filter(|(k, _)| k.conn == conn)
            .map(|(k, ch)| {
                let unacked = ch.unacked.iter().map(|u| u.tag).collect();
                (k.channel, ch.last_delivery_tag + 1, unacked)
            })
            .collect();
        out.sort_by_key(|(channel, ..)| *channel);
        out
    }

    /// The next delivery tag of channel `key`, for a message the broker makes up and delivers
    /// there without a queue (a session's status, `docs/sessions.md`), so that the channel's
    /// tags stay one increasing sequence. `None` for a channel that is not open.
    pub fn take_delivery_tag(&mut self, key: ChannelKey) -> Option<u64> {
        self.channels.get_mut(&key).map(|ch| ch.next_tag())
    }

    /// channel.close (or the connection went away): unacked messages go back to their
    /// queues in their original places, consumers are removed.
    pub fn channel_close(&mut self, key: ChannelKey, now_ms: u64, fx: &mut Effects) {
        self.close_channel(key, None, now_ms, fx);
    }

    /// A channel of another member's link closed with its link (the member was lost, or
    /// cut off): as [`VHost::channel_close`], but what went to a session's consumer over it
    /// is held for that session, which resumes elsewhere (`core::queue::holds`).
    pub fn link_channel_lost(&mut self, key: ChannelKey, now_ms: u64, fx: &mut Effects) {
        self.close_channel(key, Some(now_ms), now_ms, fx);
    }

    /// Closes channel `key`; with `hold_since`, requeued deliveries of a session's consumer
    /// are held for the session from then.
    fn close_channel(
        &mut self,
        key: ChannelKey,
        hold_since: Option<u64>,
        now_ms: u64,
        fx: &mut Effects,
    ) {
        let Some(mut ch) = self.channels.remove(&key) else {
            return;
        };
        let mut unacked = ch.settle(0, true).unwrap_or_default();
        // Proxied deliveries go back when the server closes the channel's upstream channels.
        unacked.retain(|u| u.upstream.is_none());
        let consumers: Vec<Consumer> = ch.consumers.drain().map(|(_, c)| c).collect();
        let mut touched: Vec<Arc<str>> = Vec::new();
        for c in consumers {
            self.detach_consumer(key, &c.queue, &c.tag, fx);
            touched.push(c.queue);
        }
        self.requeue(unacked, hold_since, &mut touched, fx);
        self.dispatch_all(touched, now_ms, fx);
    }

    /// The connection `conn` closed: its exclusive queues go (its channels are closed by the
    /// caller first). On a cluster they go by a cluster op, every member at once; until then
    /// they belong to no connection, and the tick names them again if the op was not taken.
    pub fn connection_closed(&mut self, conn: u64, fx: &mut Effects) {
        let exclusive: Vec<Arc<str>> = self
            .queues
            .values_mut()
            .filter(|q| q.exclusive_owner == Some(conn) && conn != NO_CONNECTION)
            .map(|q| {
                q.exclusive_owner = Some(NO_CONNECTION);
                q.session = None;
                q.name.clone()
            })
            .collect();
        for name in exclusive {
            self.retire_queue(&name, fx);
        }
    }

    /// Exclusive queue `name` belongs to no connection (its owner went, or it was declared
    /// for a connection of an earlier run): it goes, by a cluster op on a cluster.
    pub fn retire_exclusive(&mut self, name: &str, fx: &mut Effects) {
        if let Some(q) = self.queues.get_mut(name) {
            q.exclusive_owner = Some(NO_CONNECTION);
            q.session = None;
        }
        self.retire_queue(name, fx);
    }

    /// Whether `home` names this cluster member.
    pub fn is_here(&self, home: &str) -> bool {
        self.node.as_deref() == Some(home)
    }

    /// The survivors' view changed: exclusive queues of members that left go (their
    /// connections went with them). Every member applies the same views in the same order.
    pub fn drop_exclusive_queues_of_departed(&mut self, fx: &mut Effects) {
        let departed: Vec<Arc<str>> = self
            .queues
            .values()
            .filter(|q| {
                q.exclusive_owner.is_some()
                    && q.session.is_none()
                    && q.home
                        .as_ref()
                        .is_some_and(|h| !is_foreign(h) && !self.live_nodes.iter().any(|n| n == h))
            })
            .map(|q| q.name.clone())
            .collect();
        for name in departed {
            self.remove_queue(&name, fx);
        }
    }
}
