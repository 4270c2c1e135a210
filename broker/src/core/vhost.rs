//! The virtual host: exchanges, queues, bindings, consumers, routing and delivery, as a pure
//! state machine. Commands come in with the current time; replies come back as return values
//! and everything that must reach other channels comes back as [`Effects`]. No sockets, no
//! tasks, no clock: the same code runs behind the server, in tests and in simulations.

use super::args::{Overflow, QueueArgs};
use super::channel::{ChannelKey, ChannelState, Consumer, Unacked};
use super::error::{AmqpError, CoreResult};
use super::exchange::{Binding, Destination, Exchange, ExchangeKind};
use super::message::Message;
use super::ops::{DropReason, OpKind, QueueOp};
use super::queue::{ConsumerRef, Entry, Queue};
use crate::amqp::{AMQPValue, FieldArray, FieldTable, ShortString, codes};
use std::collections::HashMap;
use std::sync::Arc;

/// A message handed to a consumer, to be written by the connection that owns `channel`.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Target channel.
    pub channel: ChannelKey,
    /// Consumer tag.
    pub consumer_tag: Arc<str>,
    /// Delivery tag on that channel.
    pub delivery_tag: u64,
    /// Delivered before.
    pub redelivered: bool,
    /// The message.
    pub message: Arc<Message>,
}

/// A consumer the broker cancelled (its queue was deleted): the client is told with
/// basic.cancel when it announced `consumer_cancel_notify`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancelled {
    /// Channel of the consumer.
    pub channel: ChannelKey,
    /// Its tag.
    pub tag: Arc<str>,
}

/// What a command caused beyond its reply. The caller drains it after each batch of commands.
#[derive(Debug, Default)]
pub struct Effects {
    /// Deliveries to write, grouped by nothing; the caller routes them to their connections.
    pub deliveries: Vec<Delivery>,
    /// Consumers cancelled by the broker.
    pub cancelled: Vec<Cancelled>,
    /// Queue ops of durable queues, in order, when the vhost records them (see
    /// [`VHost::set_record_ops`]).
    pub ops: Vec<QueueOp>,
    /// Bodies paged out that need a page record of their own (flow-to-disk).
    pub page_out: Vec<PageOut>,
    /// Page records (uid, id) whose entries left their queue: the store may forget them.
    pub page_released: Vec<(u64, u64)>,
    /// Queues (uid) deleted while holding page records: the store forgets all of them.
    pub queues_released: Vec<u64>,
    /// Dead letters whose body is only on disk: the server reads the bodies, before it
    /// hands this batch's removals to the journal, and passes them back with
    /// [`VHost::dead_letter_resolved`].
    pub paged_dead_letters: Vec<DeadLetter>,

    /// A publish landed on a queue whose consumers cannot keep up (see
    /// [`FLOW_READY_THRESHOLD`]): the publisher should pause before reading more.
    pub backlogged: bool,
}

/// exchange.declare, decoded.
#[derive(Debug, Clone, Default)]
pub struct ExchangeDeclare {
    /// Name.
    pub name: String,
    /// Type as sent (`direct`, ...).
    pub kind: String,
    /// Only check that it exists.
    pub passive: bool,
    /// Durable flag.
    pub durable: bool,
    /// Auto-delete flag.
    pub auto_delete: bool,
    /// Internal flag.
    pub internal: bool,
    /// Arguments.
    pub arguments: FieldTable,
}

/// queue.declare, decoded.
#[derive(Debug, Clone, Default)]
pub struct QueueDeclare {
    /// Name; empty asks the server to make one up.
    pub name: String,
    /// Only check that it exists.
    pub passive: bool,
    /// Durable flag.
    pub durable: bool,
    /// Owned by the declaring connection.
    pub exclusive: bool,
    /// Auto-delete flag.
    pub auto_delete: bool,
    /// Arguments.
    pub arguments: FieldTable,
}

/// Reply to queue.declare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueDeclared {
    /// The queue's name (server-made when the request had none).
    pub name: Arc<str>,
    /// Ready messages.
    pub message_count: u32,
    /// Consumers.
    pub consumer_count: u32,
}

/// basic.consume, decoded.
#[derive(Debug, Clone, Default)]
pub struct Consume {
    /// Queue name.
    pub queue: String,
    /// Tag; empty asks the server to make one up.
    pub tag: String,
    /// No acks expected.
    pub no_ack: bool,
    /// No other consumer may use the queue meanwhile.
    pub exclusive: bool,
}

/// What became of a published message, for confirms and basic.return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishOutcome {
    /// Enqueued on at least one queue.
    Routed,
    /// No queue matched (basic.return if mandatory; confirms ack it).
    Unroutable,
    /// A queue refused it (`x-overflow` = reject-publish): confirms nack it.
    Rejected,
}

/// Reply to basic.get with a message.
#[derive(Debug, Clone)]
pub struct GetOk {
    /// Delivery tag.
    pub delivery_tag: u64,
    /// Delivered before.
    pub redelivered: bool,
    /// Ready messages left.
    pub message_count: u32,
    /// The message.
    pub message: Arc<Message>,
}

/// Ready messages above which a queue that has consumers counts as backlogged: its consumers
/// are all saturated and more publishes only add latency. Publishers to it are paced (the
/// broker's flow control, like RabbitMQ's credit flow); a queue with no consumer is not a
/// reason to slow anyone down.
pub const FLOW_READY_THRESHOLD: usize = 16384;

/// How deep exchange-to-exchange bindings and dead-letter chains are followed; beyond this a
/// message is not routed further (a guard against cycles and runaway fan-out).
const MAX_ROUTING_HOPS: usize = 64;

/// A message on its way to its queue's dead-letter exchange.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// The message as it left the queue.
    pub message: Arc<Message>,
    /// The queue it left.
    pub queue: Arc<str>,
    /// Why it left.
    pub reason: DropReason,
}

/// A body that flow-to-disk moved out of memory and that no journal record holds: the server
/// writes `message` to a page record under the key (`uid`, `id`).
#[derive(Debug, Clone)]
pub struct PageOut {
    /// Queue incarnation.
    pub uid: u64,
    /// Message id in that queue.
    pub id: u64,
    /// The message, body included.
    pub message: Arc<Message>,
}

/// One virtual host's state.
#[derive(Debug)]
pub struct VHost {
    pub(super) name: String,
    pub(super) exchanges: HashMap<Arc<str>, Exchange>,
    pub(super) queues: HashMap<Arc<str>, Queue>,
    channels: HashMap<ChannelKey, ChannelState>,
    name_seed: u64,
    names_issued: u64,
    record_ops: bool,
    wiring_dirty: bool,
    pub(super) limits: Limits,
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

fn truthy(b: bool) -> &'static str {
    if b { "true" } else { "false" }
}

impl VHost {
    /// A vhost with the predeclared exchanges. `name_seed` makes server-named queues and
    /// consumer tags unique across broker runs without a clock or RNG inside the core.
    pub fn new(name: &str, name_seed: u64) -> Self {
        let mut vhost = Self {
            name: name.to_owned(),
            exchanges: HashMap::new(),
            queues: HashMap::new(),
            channels: HashMap::new(),
            name_seed,
            names_issued: 0,
            record_ops: false,
            wiring_dirty: false,
            limits: Limits::default(),
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

    /// Records which cluster member owns queue `name` (a no-op if there is no such queue).
    pub fn set_queue_home(&mut self, name: &str, node: &str) {
        if let Some(q) = self.queues.get_mut(name) {
            q.home = Some(node.into());
        }
    }

    /// A fresh server-made queue name (`amq.gen-…`). A cluster member makes the name up
    /// before it multicasts the declare, so that every member creates the same queue.
    pub fn fresh_queue_name(&mut self) -> String {
        self.fresh_name("amq.gen-")
    }

    /// Makes sure a broker-owned exchange exists (such as `amq.qpid` in a cluster); the
    /// `amq.` prefix keeps clients from declaring or deleting it.
    pub fn ensure_system_exchange(&mut self, name: &str, kind: ExchangeKind) {
        let name: Arc<str> = name.into();
        self.exchanges.entry(name.clone()).or_insert_with(|| {
            Exchange::new(name, kind, true, false, false, FieldTable::default())
        });
    }

    pub(super) fn mark_wiring_changed(&mut self) {
        self.wiring_dirty = true;
    }

    /// Whether a durable exchange, queue or binding was created or removed since the last
    /// call: the durable wiring must then be saved before the command is answered.
    pub fn take_wiring_changed(&mut self) -> bool {
        std::mem::take(&mut self.wiring_dirty)
    }

    /// Whether a binding from `source` to `destination` survives a restart: both ends must.
    fn binding_is_durable(&self, source: &str, destination: &Destination) -> bool {
        let source_durable = self.exchanges.get(source).is_some_and(|e| e.durable);
        source_durable
            && match destination {
                Destination::Queue(q) => self
                    .queues
                    .get(q)
                    .is_some_and(|q| q.durable && q.exclusive_owner.is_none()),
                Destination::Exchange(e) => self.exchanges.get(e).is_some_and(|e| e.durable),
            }
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

    fn not_found_queue(&self, name: &str) -> AmqpError {
        AmqpError::not_found(format!("no queue '{name}' in vhost '{}'", self.name))
    }

    fn not_found_exchange(&self, name: &str) -> AmqpError {
        AmqpError::not_found(format!("no exchange '{name}' in vhost '{}'", self.name))
    }

    fn locked(&self, name: &str) -> AmqpError {
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
        match q.exclusive_owner {
            Some(owner) if owner != conn => Err(self.locked(name)),
            _ => Ok(q),
        }
    }

    /// A 64-bit id no other queue of this broker has had (see [`QueueOp::uid`]).
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

    // ---- exchanges -------------------------------------------------------------------------

    /// exchange.declare.
    pub fn exchange_declare(&mut self, d: ExchangeDeclare) -> CoreResult<()> {
        if let Some(existing) = self.exchanges.get(d.name.as_str()) {
            if d.passive {
                return Ok(());
            }
            if d.name.is_empty() || d.name.starts_with("amq.") {
                return Err(reserved_exchange(&d.name, &self.name));
            }
            let inequivalent = |arg: &str, got: &str, cur: &str| {
                AmqpError::precondition(format!(
                    "inequivalent arg '{arg}' for exchange '{}' in vhost '{}': received '{got}' but current is '{cur}'",
                    d.name, self.name
                ))
            };
            if existing.kind.as_str() != d.kind {
                return Err(inequivalent("type", &d.kind, existing.kind.as_str()));
            }
            if existing.durable != d.durable {
                return Err(inequivalent(
                    "durable",
                    truthy(d.durable),
                    truthy(existing.durable),
                ));
            }
            if existing.auto_delete != d.auto_delete {
                return Err(inequivalent(
                    "auto_delete",
                    truthy(d.auto_delete),
                    truthy(existing.auto_delete),
                ));
            }
            if existing.internal != d.internal {
                return Err(inequivalent(
                    "internal",
                    truthy(d.internal),
                    truthy(existing.internal),
                ));
            }
            if existing.arguments != d.arguments {
                return Err(AmqpError::precondition(format!(
                    "inequivalent arguments for exchange '{}' in vhost '{}'",
                    d.name, self.name
                )));
            }
            return Ok(());
        }
        if d.passive {
            return Err(self.not_found_exchange(&d.name));
        }
        let kind = ExchangeKind::parse(&d.kind).ok_or_else(|| {
            AmqpError::new(
                codes::COMMAND_INVALID,
                format!("invalid exchange type '{}'", d.kind),
            )
        })?;
        if d.name.is_empty() || d.name.starts_with("amq.") {
            return Err(reserved_exchange(&d.name, &self.name));
        }
        let name: Arc<str> = d.name.into();
        self.wiring_dirty |= d.durable;
        self.exchanges.insert(
            name.clone(),
            Exchange::new(
                name,
                kind,
                d.durable,
                d.auto_delete,
                d.internal,
                d.arguments,
            ),
        );
        Ok(())
    }

    /// exchange.delete. Deleting an exchange that does not exist succeeds, as in RabbitMQ.
    pub fn exchange_delete(&mut self, name: &str, if_unused: bool) -> CoreResult<()> {
        if name.is_empty() || name.starts_with("amq.") {
            return Err(reserved_exchange(name, &self.name));
        }
        let Some(ex) = self.exchanges.get(name) else {
            return Ok(());
        };
        if if_unused && !ex.bindings().is_empty() {
            return Err(AmqpError::precondition(format!(
                "exchange '{name}' in vhost '{}' in use",
                self.name
            )));
        }
        self.remove_exchange(name);
        Ok(())
    }

    fn remove_exchange(&mut self, name: &str) {
        let Some(ex) = self.exchanges.remove(name) else {
            return;
        };
        self.wiring_dirty |= ex.durable;
        self.unbind_everywhere(&Destination::Exchange(ex.name));
    }

    /// Removes every binding to `dest` and auto-deletes the exchanges that lost their last one.
    fn unbind_everywhere(&mut self, dest: &Destination) {
        let mut emptied = Vec::new();
        for ex in self.exchanges.values_mut() {
            if ex.unbind_destination(dest) > 0 && ex.auto_delete && ex.bindings().is_empty() {
                emptied.push(ex.name.clone());
            }
        }
        for name in emptied {
            self.remove_exchange(&name);
        }
    }

    fn bindable_source(&self, source: &str) -> CoreResult<()> {
        if source.is_empty() {
            return Err(AmqpError::access_refused(format!(
                "operation not permitted on the default exchange in vhost '{}'",
                self.name
            )));
        }
        self.exchanges
            .get(source)
            .map(|_| ())
            .ok_or_else(|| self.not_found_exchange(source))
    }

    /// exchange.bind (`destination` receives what `source` routes with this key).
    pub fn exchange_bind(
        &mut self,
        destination: &str,
        source: &str,
        routing_key: &str,
        arguments: FieldTable,
    ) -> CoreResult<()> {
        self.bindable_source(source)?;
        if destination.is_empty() {
            return Err(AmqpError::access_refused(
                "operation not permitted on the default exchange",
            ));
        }
        let dest = self
            .exchanges
            .get(destination)
            .ok_or_else(|| self.not_found_exchange(destination))?
            .name
            .clone();
        let binding = Binding {
            destination: Destination::Exchange(dest),
            routing_key: routing_key.to_owned(),
            arguments,
        };
        self.add_binding(source, binding);
        Ok(())
    }

    /// exchange.unbind. Unbinding what is not bound succeeds.
    pub fn exchange_unbind(
        &mut self,
        destination: &str,
        source: &str,
        routing_key: &str,
        arguments: FieldTable,
    ) -> CoreResult<()> {
        self.bindable_source(source)?;
        let dest = self
            .exchanges
            .get(destination)
            .ok_or_else(|| self.not_found_exchange(destination))?
            .name
            .clone();
        let binding = Binding {
            destination: Destination::Exchange(dest),
            routing_key: routing_key.to_owned(),
            arguments,
        };
        self.unbind(source, &binding);
        Ok(())
    }

    fn add_binding(&mut self, source: &str, binding: Binding) {
        let durable = self.binding_is_durable(source, &binding.destination);
        let ex = self
            .exchanges
            .get_mut(source)
            .expect("callers checked the source");
        self.wiring_dirty |= ex.bind(binding) && durable;
    }

    fn unbind(&mut self, source: &str, binding: &Binding) {
        let durable = self.binding_is_durable(source, &binding.destination);
        let Some(ex) = self.exchanges.get_mut(source) else {
            return;
        };
        if ex.unbind(binding) {
            self.wiring_dirty |= durable;
            if ex.auto_delete && ex.bindings().is_empty() {
                self.remove_exchange(source);
            }
        }
    }

    // ---- queues ----------------------------------------------------------------------------

    /// queue.declare on behalf of connection `conn`.
    pub fn queue_declare(
        &mut self,
        conn: u64,
        d: QueueDeclare,
        now_ms: u64,
    ) -> CoreResult<QueueDeclared> {
        self.declare_queue(conn, d, now_ms, false)
    }

    /// queue.declare (on behalf of connection `conn`) of a queue whose `amq.gen-` name the
    /// broker made up for a client that sent an empty name: the reserved prefix is the
    /// server's own here.
    pub fn queue_declare_server_named(
        &mut self,
        conn: u64,
        d: QueueDeclare,
        now_ms: u64,
    ) -> CoreResult<QueueDeclared> {
        self.declare_queue(conn, d, now_ms, true)
    }

    fn declare_queue(
        &mut self,
        conn: u64,
        d: QueueDeclare,
        now_ms: u64,
        server_named: bool,
    ) -> CoreResult<QueueDeclared> {
        let vhost = self.name.clone();
        if let Some(q) = self.queues.get_mut(d.name.as_str()) {
            if let Some(owner) = q.exclusive_owner
                && owner != conn
            {
                return Err(self.locked(&d.name));
            }
            if !d.passive {
                if d.exclusive && q.exclusive_owner.is_none() {
                    return Err(self.locked(&d.name));
                }
                let inequivalent = |arg: &str, got: bool, cur: bool| {
                    AmqpError::precondition(format!(
                        "inequivalent arg '{arg}' for queue '{}' in vhost '{vhost}': received '{}' but current is '{}'",
                        d.name,
                        truthy(got),
                        truthy(cur)
                    ))
                };
                if q.durable != d.durable {
                    return Err(inequivalent("durable", d.durable, q.durable));
                }
                if q.auto_delete != d.auto_delete {
                    return Err(inequivalent("auto_delete", d.auto_delete, q.auto_delete));
                }
                let args = QueueArgs::parse(&d.arguments, &d.name, &vhost)?;
                if args != q.args {
                    let key = differing_key(&d.arguments, &q.arguments);
                    return Err(AmqpError::precondition(format!(
                        "inequivalent arg '{key}' for queue '{}' in vhost '{vhost}'",
                        d.name
                    )));
                }
            }
            q.last_used_ms = now_ms;
            return Ok(QueueDeclared {
                name: q.name.clone(),
                message_count: q.ready_count() as u32,
                consumer_count: q.consumers.len() as u32,
            });
        }
        if d.passive {
            return Err(self.not_found_queue(&d.name));
        }
        if d.name.starts_with("amq.") && !(server_named && d.name.starts_with("amq.gen-")) {
            return Err(AmqpError::access_refused(format!(
                "queue name '{}' contains reserved prefix 'amq.*'",
                d.name
            )));
        }
        if self.limits.max_queues > 0 && self.queues.len() >= self.limits.max_queues {
            return Err(AmqpError::precondition(format!(
                "queue limit in vhost '{}' ({}) is reached",
                self.name, self.limits.max_queues
            )));
        }
        let name: Arc<str> = if d.name.is_empty() {
            self.fresh_name("amq.gen-").into()
        } else {
            d.name.into()
        };
        let args = QueueArgs::parse(&d.arguments, &name, &vhost)?;
        let owner = d.exclusive.then_some(conn);
        let mut queue = Queue::new(
            name.clone(),
            d.durable,
            owner,
            d.auto_delete,
            d.arguments,
            args,
            now_ms,
        );
        queue.uid = self.fresh_uid();
        self.wiring_dirty |= queue.durable && queue.exclusive_owner.is_none();
        self.queues.insert(name.clone(), queue);
        Ok(QueueDeclared {
            name,
            message_count: 0,
            consumer_count: 0,
        })
    }

    /// queue.bind.
    pub fn queue_bind(
        &mut self,
        conn: u64,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        arguments: FieldTable,
    ) -> CoreResult<()> {
        let qname = self.usable_queue(queue, conn)?.name.clone();
        self.bindable_source(exchange)?;
        let binding = Binding {
            destination: Destination::Queue(qname),
            routing_key: routing_key.to_owned(),
            arguments,
        };
        self.add_binding(exchange, binding);
        Ok(())
    }

    /// queue.unbind. Unbinding what is not bound succeeds.
    pub fn queue_unbind(
        &mut self,
        conn: u64,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        arguments: FieldTable,
    ) -> CoreResult<()> {
        let qname = self.usable_queue(queue, conn)?.name.clone();
        self.bindable_source(exchange)?;
        let binding = Binding {
            destination: Destination::Queue(qname),
            routing_key: routing_key.to_owned(),
            arguments,
        };
        self.unbind(exchange, &binding);
        Ok(())
    }

    /// queue.purge: removes the ready messages; returns how many.
    pub fn queue_purge(&mut self, conn: u64, queue: &str, fx: &mut Effects) -> CoreResult<u32> {
        self.usable_queue(queue, conn)?;
        let record = self.record_ops;
        let q = self.queues.get_mut(queue).expect("checked above");
        let count = q.ready_count() as u32;
        let ids = q.ready().map(|e| e.id).collect();
        if q.owned_pages() > 0 {
            let uid = q.uid;
            fx.page_released
                .extend(q.ready().filter(|e| e.owns_page).map(|e| (uid, e.id)));
        }
        apply(q, OpKind::Purge { ids }, record, fx);
        Ok(count)
    }

    /// queue.delete: returns the ready messages it held. Deleting a queue that does not
    /// exist succeeds with 0, as in RabbitMQ.
    pub fn queue_delete(
        &mut self,
        conn: u64,
        queue: &str,
        if_unused: bool,
        if_empty: bool,
        fx: &mut Effects,
    ) -> CoreResult<u32> {
        let q = match self.usable_queue(queue, conn) {
            Ok(q) => q,
            Err(e) if e.code == codes::NOT_FOUND => return Ok(0),
            Err(e) => return Err(e),
        };
        if if_unused && !q.consumers.is_empty() {
            return Err(AmqpError::precondition(format!(
                "queue '{queue}' in vhost '{}' in use",
                self.name
            )));
        }
        if if_empty && q.ready_count() > 0 {
            return Err(AmqpError::precondition(format!(
                "queue '{queue}' in vhost '{}' is not empty",
                self.name
            )));
        }
        Ok(self.remove_queue(queue, fx))
    }

    pub(super) fn remove_queue(&mut self, name: &str, fx: &mut Effects) -> u32 {
        let Some(q) = self.queues.remove(name) else {
            return 0;
        };
        self.wiring_dirty |= q.durable && q.exclusive_owner.is_none();
        if q.owned_pages() > 0 {
            fx.queues_released.push(q.uid);
        }
        for c in &q.consumers {
            if let Some(ch) = self.channels.get_mut(&c.channel) {
                ch.consumers.remove(&c.tag);
            }
            fx.cancelled.push(Cancelled {
                channel: c.channel,
                tag: c.tag.clone(),
            });
        }
        self.unbind_everywhere(&Destination::Queue(q.name.clone()));
        q.ready_count() as u32
    }

    // ---- channels and consumers ------------------------------------------------------------

    /// channel.open.
    pub fn channel_open(&mut self, key: ChannelKey) {
        self.channels.insert(
            key,
            ChannelState {
                max_unacked: self.limits.max_unacked_per_channel,
                ..ChannelState::default()
            },
        );
    }

    /// channel.close (or the connection went away): unacked messages go back to their
    /// queues in their original places, consumers are removed.
    pub fn channel_close(&mut self, key: ChannelKey, now_ms: u64, fx: &mut Effects) {
        let Some(mut ch) = self.channels.remove(&key) else {
            return;
        };
        let unacked = ch.settle(0, true).unwrap_or_default();
        let consumers: Vec<Consumer> = ch.consumers.drain().map(|(_, c)| c).collect();
        let mut touched: Vec<Arc<str>> = Vec::new();
        for c in consumers {
            self.detach_consumer(key, &c.queue, &c.tag, fx);
            touched.push(c.queue);
        }
        self.requeue(unacked, &mut touched, fx);
        self.dispatch_all(touched, now_ms, fx);
    }

    /// The connection `conn` closed: its exclusive queues go (its channels are closed by the
    /// caller first).
    pub fn connection_closed(&mut self, conn: u64, fx: &mut Effects) {
        let exclusive: Vec<Arc<str>> = self
            .queues
            .values()
            .filter(|q| q.exclusive_owner == Some(conn))
            .map(|q| q.name.clone())
            .collect();
        for name in exclusive {
            self.remove_queue(&name, fx);
        }
    }

    /// basic.qos. `global` = false sets the window of consumers created from now on;
    /// true sets one window shared by the whole channel (RabbitMQ's reading of the flag).
    pub fn basic_qos(
        &mut self,
        key: ChannelKey,
        prefetch_bytes: u32,
        prefetch_count: u16,
        global: bool,
        now_ms: u64,
        fx: &mut Effects,
    ) {
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        if global {
            ch.channel_prefetch_count = prefetch_count.into();
            ch.channel_prefetch_bytes = prefetch_bytes.into();
        } else {
            ch.consumer_prefetch_count = prefetch_count.into();
            ch.consumer_prefetch_bytes = prefetch_bytes.into();
        }
        let queues = consumer_queues(ch);
        self.dispatch_all(queues, now_ms, fx);
    }

    /// channel.flow: pause or resume deliveries to the channel.
    pub fn channel_flow(&mut self, key: ChannelKey, active: bool, now_ms: u64, fx: &mut Effects) {
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        ch.flow_paused = !active;
        let queues = consumer_queues(ch);
        if active {
            self.dispatch_all(queues, now_ms, fx);
        }
    }

    /// The connection wrote `count` deliveries (`bytes` body bytes) of channel `key` to its
    /// socket: they no longer count against the channel's write window.
    pub fn delivered_written(
        &mut self,
        key: ChannelKey,
        count: u32,
        bytes: u64,
        now_ms: u64,
        fx: &mut Effects,
    ) {
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        let was_full = ch.write_window_full();
        ch.unwritten = ch.unwritten.saturating_sub(count);
        ch.unwritten_bytes = ch.unwritten_bytes.saturating_sub(bytes);
        if was_full {
            let queues = consumer_queues(ch);
            self.dispatch_all(queues, now_ms, fx);
        }
    }

    /// basic.consume: returns the consumer tag.
    pub fn basic_consume(
        &mut self,
        key: ChannelKey,
        c: Consume,
        now_ms: u64,
        fx: &mut Effects,
    ) -> CoreResult<Arc<str>> {
        let vhost = self.name.clone();
        let ch = self
            .channels
            .get(&key)
            .ok_or_else(|| AmqpError::new(codes::CHANNEL_ERROR, "channel not open"))?;
        // The tag is checked first, as RabbitMQ does: a reused tag is a connection error.
        if !c.tag.is_empty() && ch.consumers.contains_key(c.tag.as_str()) {
            return Err(AmqpError::new(
                codes::NOT_ALLOWED,
                format!("attempt to reuse consumer tag '{}'", c.tag),
            ));
        }
        let q = self.usable_queue(&c.queue, key.conn)?;
        let exclusive_in_use = || {
            AmqpError::access_refused(format!(
                "queue '{}' in vhost '{vhost}' in exclusive use",
                c.queue
            ))
        };
        if c.exclusive && !q.consumers.is_empty() {
            return Err(exclusive_in_use());
        }
        let has_exclusive = q.consumers.iter().any(|r| {
            self.channels
                .get(&r.channel)
                .and_then(|ch| ch.consumers.get(&r.tag))
                .is_some_and(|x| x.exclusive)
        });
        if has_exclusive {
            return Err(exclusive_in_use());
        }
        let qname = q.name.clone();
        let max = self.limits.max_consumers_per_channel;
        if max > 0
            && self
                .channels
                .get(&key)
                .is_some_and(|ch| ch.consumers.len() >= max)
        {
            return Err(AmqpError::precondition(format!(
                "reached maximum ({max}) of consumers per channel"
            )));
        }
        let tag: Arc<str> = if c.tag.is_empty() {
            self.fresh_name("amq.ctag-").into()
        } else {
            c.tag.into()
        };
        let ch = self.channels.get_mut(&key).expect("checked above");
        ch.consumers.insert(
            tag.clone(),
            Consumer {
                tag: tag.clone(),
                queue: qname.clone(),
                no_ack: c.no_ack,
                exclusive: c.exclusive,
                prefetch_count: ch.consumer_prefetch_count,
                prefetch_bytes: ch.consumer_prefetch_bytes,
                unacked: 0,
                unacked_bytes: 0,
            },
        );
        let q = self.queues.get_mut(&qname).expect("checked above");
        q.consumers.push(ConsumerRef {
            channel: key,
            tag: tag.clone(),
        });
        q.had_consumer = true;
        q.last_used_ms = now_ms;
        self.dispatch(&qname, now_ms, fx);
        Ok(tag)
    }

    /// basic.cancel. Cancelling an unknown tag succeeds, as the spec allows.
    pub fn basic_cancel(&mut self, key: ChannelKey, tag: &str, now_ms: u64, fx: &mut Effects) {
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        let Some(c) = ch.consumers.remove(tag) else {
            return;
        };
        self.detach_consumer(key, &c.queue, &c.tag, fx);
        self.dispatch(&c.queue, now_ms, fx);
    }

    fn detach_consumer(&mut self, key: ChannelKey, queue: &str, tag: &Arc<str>, fx: &mut Effects) {
        let Some(q) = self.queues.get_mut(queue) else {
            return;
        };
        q.consumers.retain(|r| !(r.channel == key && &r.tag == tag));
        if q.auto_delete && q.consumers.is_empty() && q.had_consumer {
            self.remove_queue(queue, fx);
        }
    }

    // ---- publish, get, acks ----------------------------------------------------------------

    /// basic.publish of a complete message.
    pub fn publish(
        &mut self,
        exchange: &str,
        routing_key: &str,
        message: Arc<Message>,
        now_ms: u64,
        fx: &mut Effects,
    ) -> CoreResult<PublishOutcome> {
        let ex = self
            .exchanges
            .get(exchange)
            .ok_or_else(|| self.not_found_exchange(exchange))?;
        if ex.internal {
            return Err(AmqpError::access_refused(format!(
                "cannot publish to internal exchange '{exchange}' in vhost '{}'",
                self.name
            )));
        }
        let targets = self.route(exchange, routing_key, &message, None);
        if targets.is_empty() {
            return Ok(PublishOutcome::Unroutable);
        }
        let mut dead = Vec::new();
        let rejected = self.enqueue_all(&targets, &message, now_ms, fx, &mut dead);
        self.dead_letter_all(dead, now_ms, fx);
        Ok(if rejected {
            PublishOutcome::Rejected
        } else {
            PublishOutcome::Routed
        })
    }

    /// The queues a message published to `exchange` reaches, following exchange-to-exchange
    /// bindings and alternate exchanges, each queue once. `skip` drops queues a dead letter
    /// must not cycle back to.
    fn route(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Message,
        skip: Option<&dyn Fn(&str) -> bool>,
    ) -> Vec<Arc<str>> {
        let mut queues: Vec<Arc<str>> = Vec::new();
        if exchange.is_empty() {
            if let Some(q) = self.queues.get(routing_key) {
                queues.push(q.name.clone());
            }
        } else {
            let headers = message.properties.headers().as_ref();
            let mut visited: Vec<&str> = vec![exchange];
            let mut frontier: Vec<&str> = vec![exchange];
            let mut dests = Vec::new();
            while let Some(name) = frontier.pop() {
                let Some(ex) = self.exchanges.get(name) else {
                    continue;
                };
                dests.clear();
                ex.matches(routing_key, headers, &mut dests);
                if dests.is_empty()
                    && let Some(ae) = ex.alternate_exchange.as_deref()
                    && !visited.contains(&ae)
                    && visited.len() < MAX_ROUTING_HOPS
                    && let Some(ae) = self.exchanges.get(ae)
                {
                    visited.push(&ae.name);
                    frontier.push(&ae.name);
                }
                for d in &dests {
                    match d {
                        Destination::Queue(q) => {
                            if !queues.contains(q) {
                                queues.push(q.clone());
                            }
                        }
                        Destination::Exchange(e) => {
                            if let Some(e) = self.exchanges.get(e.as_ref())
                                && !visited.contains(&e.name.as_ref())
                                && visited.len() < MAX_ROUTING_HOPS
                            {
                                visited.push(&e.name);
                                frontier.push(&e.name);
                            }
                        }
                    }
                }
            }
        }
        if let Some(skip) = skip {
            queues.retain(|q| !skip(q));
        }
        queues
    }

    /// Enqueues on every target; returns true when any refused the message.
    fn enqueue_all(
        &mut self,
        targets: &[Arc<str>],
        message: &Arc<Message>,
        now_ms: u64,
        fx: &mut Effects,
        dead: &mut Vec<DeadLetter>,
    ) -> bool {
        let mut rejected = false;
        for name in targets {
            let record = self.record_ops;
            let Some(q) = self.queues.get_mut(name) else {
                continue;
            };
            let size = message.body_len() as u64;
            let full = q
                .args
                .max_length
                .is_some_and(|m| q.ready_count() as u64 >= m)
                || q.args
                    .max_length_bytes
                    .is_some_and(|m| q.ready_bytes() as u64 + size > m);
            if full && q.args.overflow != Overflow::DropHead {
                rejected = true;
                if q.args.overflow == Overflow::RejectPublishDlx {
                    dead.push(DeadLetter {
                        message: message.clone(),
                        queue: q.name.clone(),
                        reason: DropReason::MaxLength,
                    });
                }
                continue;
            }
            let ttl = match (q.args.message_ttl_ms, message.expiration_ms) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let id = q.next_id();
            apply(
                q,
                OpKind::Enqueue {
                    id,
                    message: message.clone(),
                    expires_at_ms: ttl.map(|t| now_ms.saturating_add(t)),
                },
                record,
                fx,
            );
            self.dispatch_collect(name, now_ms, fx, dead);
            let q = self.queues.get_mut(name).expect("dispatch keeps the queue");
            if let Some(budget) = self.limits.queue_memory_budget_bytes {
                let journaled =
                    record && q.durable && q.exclusive_owner.is_none() && message.persistent;
                if let Some(full) = q.page_out(id, budget, journaled)
                    && !journaled
                {
                    fx.page_out.push(PageOut {
                        uid: q.uid,
                        id,
                        message: full,
                    });
                }
            }
            while q
                .args
                .max_length
                .is_some_and(|m| q.ready_count() as u64 > m)
                || q.args
                    .max_length_bytes
                    .is_some_and(|m| q.ready_bytes() as u64 > m)
            {
                let Some(id) = q.oldest().map(|e| e.id) else {
                    break;
                };
                let entry = apply(
                    q,
                    OpKind::Drop {
                        id,
                        reason: DropReason::MaxLength,
                    },
                    record,
                    fx,
                )
                .expect("oldest exists");
                dead.push(DeadLetter {
                    message: entry.message,
                    queue: q.name.clone(),
                    reason: DropReason::MaxLength,
                });
            }
            expire_head(q, now_ms, true, record, fx, dead);
            if !q.consumers.is_empty() && q.ready_count() > FLOW_READY_THRESHOLD {
                fx.backlogged = true;
            }
        }
        rejected
    }

    /// basic.get.
    pub fn basic_get(
        &mut self,
        key: ChannelKey,
        queue: &str,
        no_ack: bool,
        now_ms: u64,
        fx: &mut Effects,
    ) -> CoreResult<Option<GetOk>> {
        self.usable_queue(queue, key.conn)?;
        if let Some(ch) = self.channels.get(&key)
            && !no_ack
            && ch.unacked_limit_reached()
        {
            return Err(AmqpError::precondition(format!(
                "unacked message limit of the channel ({}) is reached: ack before basic.get",
                ch.max_unacked
            )));
        }
        let record = self.record_ops;
        let mut dead = Vec::new();
        let q = self.queues.get_mut(queue).expect("checked above");
        q.last_used_ms = now_ms;
        expire_head(q, now_ms, true, record, fx, &mut dead);
        let got = match q.peek().map(|e| e.id) {
            None => None,
            Some(id) => {
                let qname = q.name.clone();
                let entry = apply(
                    q,
                    if no_ack {
                        OpKind::Take { id }
                    } else {
                        OpKind::Deliver { id }
                    },
                    record,
                    fx,
                )
                .expect("head exists");
                let message_count = q.ready_count() as u32;
                let ch = self
                    .channels
                    .get_mut(&key)
                    .ok_or_else(|| AmqpError::new(codes::CHANNEL_ERROR, "channel not open"))?;
                let tag = ch.next_tag();
                if !no_ack {
                    ch.track(Unacked {
                        tag,
                        queue: qname,
                        id,
                        consumer: None,
                        bytes: entry.message.body_len() as u64,
                    });
                }
                Some(GetOk {
                    delivery_tag: tag,
                    redelivered: entry.redelivered,
                    message_count,
                    message: entry.message,
                })
            }
        };
        self.dead_letter_all(dead, now_ms, fx);
        Ok(got)
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
        let settled = self.settle(key, tag, multiple)?;
        let record = self.record_ops;
        let mut touched = Vec::new();
        for u in settled {
            if let Some(q) = self.queues.get_mut(&u.queue)
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
        let settled = self.settle(key, tag, multiple)?;
        let mut touched = Vec::new();
        if requeue {
            self.requeue(settled, &mut touched, fx);
        } else {
            let record = self.record_ops;
            let mut dead = Vec::new();
            for u in settled {
                if let Some(q) = self.queues.get_mut(&u.queue)
                    && q.unacked(u.id).is_some()
                {
                    let entry =
                        apply(q, OpKind::Settle { id: u.id }, record, fx).expect("unacked exists");
                    dead.push(DeadLetter {
                        message: entry.message,
                        queue: q.name.clone(),
                        reason: DropReason::Rejected,
                    });
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

    /// basic.recover (requeue = true): every unacked delivery of the channel goes back.
    pub fn basic_recover(&mut self, key: ChannelKey, now_ms: u64, fx: &mut Effects) {
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        let unacked = ch.settle(0, true).unwrap_or_default();
        let mut touched = consumer_queues(ch);
        self.requeue(unacked, &mut touched, fx);
        self.dispatch_all(touched, now_ms, fx);
    }

    fn settle(&mut self, key: ChannelKey, tag: u64, multiple: bool) -> CoreResult<Vec<Unacked>> {
        let ch = self
            .channels
            .get_mut(&key)
            .ok_or_else(|| AmqpError::new(codes::CHANNEL_ERROR, "channel not open"))?;
        ch.settle(tag, multiple)
            .ok_or_else(|| AmqpError::precondition(format!("unknown delivery tag {tag}")))
    }

    fn requeue(&mut self, unacked: Vec<Unacked>, touched: &mut Vec<Arc<str>>, fx: &mut Effects) {
        let record = self.record_ops;
        for u in unacked {
            if let Some(q) = self.queues.get_mut(&u.queue)
                && q.unacked(u.id).is_some()
            {
                apply(q, OpKind::Requeue { id: u.id }, record, fx);
            }
            if !touched.contains(&u.queue) {
                touched.push(u.queue);
            }
        }
    }

    // ---- time ------------------------------------------------------------------------------

    /// Advances time: expires messages at queue heads and deletes queues unused past their
    /// `x-expires`. The server calls it periodically.
    pub fn tick(&mut self, now_ms: u64, fx: &mut Effects) {
        let record = self.record_ops;
        let mut dead = Vec::new();
        let mut expired_queues = Vec::new();
        for q in self.queues.values_mut() {
            expire_head(q, now_ms, true, record, fx, &mut dead);
            if let Some(expires) = q.args.expires_ms
                && q.consumers.is_empty()
                && now_ms.saturating_sub(q.last_used_ms) >= expires
            {
                expired_queues.push(q.name.clone());
            }
        }
        for name in expired_queues {
            self.remove_queue(&name, fx);
        }
        self.dead_letter_all(dead, now_ms, fx);
    }

    /// Dead-letters messages whose bodies the server read back from disk (see
    /// [`Effects::paged_dead_letters`]): routing and enqueueing as if they had been dead-lettered
    /// in the batch that dropped them.
    pub fn dead_letter_resolved(&mut self, dead: Vec<DeadLetter>, now_ms: u64, fx: &mut Effects) {
        debug_assert!(dead.iter().all(|d| d.message.body.in_memory().is_some()));
        self.dead_letter_all(dead, now_ms, fx);
    }

    // ---- delivery --------------------------------------------------------------------------

    fn dispatch_all(&mut self, mut queues: Vec<Arc<str>>, now_ms: u64, fx: &mut Effects) {
        queues.sort_unstable();
        queues.dedup();
        let mut dead = Vec::new();
        for q in queues {
            self.dispatch_collect(&q, now_ms, fx, &mut dead);
        }
        self.dead_letter_all(dead, now_ms, fx);
    }

    fn dispatch(&mut self, queue: &str, now_ms: u64, fx: &mut Effects) {
        let mut dead = Vec::new();
        self.dispatch_collect(queue, now_ms, fx, &mut dead);
        self.dead_letter_all(dead, now_ms, fx);
    }

    /// Hands ready messages of `queue` to consumers that have room, round-robin (or to the
    /// single active consumer), until either runs out.
    fn dispatch_collect(
        &mut self,
        queue: &str,
        now_ms: u64,
        fx: &mut Effects,
        dead: &mut Vec<DeadLetter>,
    ) {
        let record = self.record_ops;
        let Some(q) = self.queues.get_mut(queue) else {
            return;
        };
        if q.consumers.is_empty() {
            return;
        }
        loop {
            expire_head(q, now_ms, false, record, fx, dead);
            let Some((id, bytes)) = q.peek().map(|h| (h.id, h.message.body_len() as u64)) else {
                return;
            };
            let candidates = if q.args.single_active_consumer {
                1
            } else {
                q.consumers.len()
            };
            let mut chosen = None;
            for i in 0..candidates {
                let at = if q.args.single_active_consumer {
                    0
                } else {
                    (q.next_consumer + i) % q.consumers.len()
                };
                let r = &q.consumers[at];
                if self
                    .channels
                    .get(&r.channel)
                    .is_some_and(|ch| ch.can_deliver(&r.tag, bytes))
                {
                    chosen = Some(at);
                    break;
                }
            }
            let Some(at) = chosen else { return };
            q.next_consumer = (at + 1) % q.consumers.len();
            let r = q.consumers[at].clone();
            let ch = self
                .channels
                .get_mut(&r.channel)
                .expect("checked by can_deliver");
            let no_ack = ch.consumers[&r.tag].no_ack;
            let entry = apply(
                q,
                if no_ack {
                    OpKind::Take { id }
                } else {
                    OpKind::Deliver { id }
                },
                record,
                fx,
            )
            .expect("head exists");
            let delivery_tag = ch.next_tag();
            if !no_ack {
                ch.track(Unacked {
                    tag: delivery_tag,
                    queue: q.name.clone(),
                    id,
                    consumer: Some(r.tag.clone()),
                    bytes,
                });
            }
            ch.unwritten += 1;
            ch.unwritten_bytes += bytes;
            fx.deliveries.push(Delivery {
                channel: r.channel,
                consumer_tag: r.tag,
                delivery_tag,
                redelivered: entry.redelivered,
                message: entry.message,
            });
        }
    }

    fn dead_letter_all(&mut self, mut dead: Vec<DeadLetter>, now_ms: u64, fx: &mut Effects) {
        let mut hops = 0;
        while !dead.is_empty() && hops < MAX_ROUTING_HOPS {
            hops += 1;
            let mut next = Vec::new();
            for d in dead.drain(..) {
                let Some(q) = self.queues.get(&d.queue) else {
                    continue;
                };
                let Some(dlx) = q.args.dead_letter_exchange.clone() else {
                    continue;
                };
                if d.message.body.on_disk().is_some() {
                    fx.paged_dead_letters.push(d);
                    continue;
                }
                let routing_key = q.args.dead_letter_routing_key.clone();
                let message = Arc::new(dead_lettered(&d, &dlx, routing_key.as_deref(), now_ms));
                let keys: Vec<String> = match &routing_key {
                    Some(k) => vec![k.clone()],
                    None => vec![message.routing_key.as_str().to_owned()],
                };
                let death_queues = death_queues(&message);
                let cycle = |name: &str| {
                    death_queues
                        .iter()
                        .any(|(q, rejected)| q == name && !rejected)
                };
                let mut targets = Vec::new();
                for key in &keys {
                    for t in self.route(&dlx, key, &message, Some(&cycle)) {
                        if !targets.contains(&t) {
                            targets.push(t);
                        }
                    }
                }
                self.enqueue_all(&targets, &message, now_ms, fx, &mut next);
            }
            dead = next;
        }
    }
}

/// Applies `kind` to `q` as its next op, recording the op when asked and the queue is
/// durable (only durable queues have anyone to read their ops: the journal). An entry that
/// leaves with a page record of its own has that record released.
fn apply(q: &mut Queue, kind: OpKind, record: bool, fx: &mut Effects) -> Option<Entry> {
    let leaves = matches!(
        kind,
        OpKind::Take { .. } | OpKind::Settle { .. } | OpKind::Drop { .. }
    );
    let op = q.op(kind);
    let out = q.apply(&op);
    if leaves && let Some(e) = out.as_ref().filter(|e| e.owns_page) {
        fx.page_released.push((q.uid, e.id));
    }
    if record && q.durable && q.exclusive_owner.is_none() {
        fx.ops.push(op);
    }
    out
}

/// Drops expired messages from the head of `q`. `inclusive` also drops those expiring right
/// now (a TTL of 0 means "deliver now or never"); dispatch passes false so that such a
/// message still reaches a consumer that is ready in the same instant.
fn expire_head(
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
        });
    }
}

fn consumer_queues(ch: &ChannelState) -> Vec<Arc<str>> {
    let mut qs: Vec<Arc<str>> = ch.consumers.values().map(|c| c.queue.clone()).collect();
    qs.sort_unstable();
    qs.dedup();
    qs
}

fn reserved_exchange(name: &str, vhost: &str) -> AmqpError {
    if name.is_empty() {
        AmqpError::access_refused(format!(
            "operation not permitted on the default exchange in vhost '{vhost}'"
        ))
    } else {
        AmqpError::access_refused(format!(
            "exchange name '{name}' contains reserved prefix 'amq.*'"
        ))
    }
}

fn differing_key(a: &FieldTable, b: &FieldTable) -> String {
    a.inner()
        .keys()
        .chain(b.inner().keys())
        .find(|k| a.inner().get(*k) != b.inner().get(*k))
        .map(|k| k.as_str().to_owned())
        .unwrap_or_else(|| "arguments".to_owned())
}

/// (queue, reason was "rejected") of every `x-death` entry.
fn death_queues(message: &Message) -> Vec<(String, bool)> {
    let Some(headers) = message.properties.headers() else {
        return Vec::new();
    };
    let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else {
        return Vec::new();
    };
    deaths
        .as_slice()
        .iter()
        .filter_map(|d| match d {
            AMQPValue::FieldTable(t) => {
                let q = t.inner().get("queue").and_then(super::args::str_value)?;
                let r = t.inner().get("reason").and_then(super::args::str_value);
                Some((q, r.as_deref() == Some("rejected")))
            }
            _ => None,
        })
        .collect()
}

/// The copy of a dead message that goes to its dead-letter exchange: `x-death` updated (an
/// existing entry for the same queue and reason is counted up and moved first), the
/// `x-first-death-*` headers set once, the expiration removed (kept in `original-expiration`).
fn dead_lettered(d: &DeadLetter, dlx: &str, routing_key: Option<&str>, now_ms: u64) -> Message {
    let old = &d.message;
    let mut headers = old.properties.headers().clone().unwrap_or_default();
    let mut deaths: Vec<AMQPValue> = match headers.inner().get("x-death") {
        Some(AMQPValue::FieldArray(a)) => a.as_slice().to_vec(),
        _ => Vec::new(),
    };
    let same = |v: &AMQPValue| match v {
        AMQPValue::FieldTable(t) => {
            t.inner()
                .get("queue")
                .and_then(super::args::str_value)
                .as_deref()
                == Some(&*d.queue)
                && t.inner()
                    .get("reason")
                    .and_then(super::args::str_value)
                    .as_deref()
                    == Some(d.reason.as_str())
        }
        _ => false,
    };
    let mut entry = match deaths.iter().position(same) {
        Some(at) => match deaths.remove(at) {
            AMQPValue::FieldTable(t) => t,
            _ => FieldTable::default(),
        },
        None => {
            let mut t = FieldTable::default();
            t.insert(
                "queue".into(),
                AMQPValue::LongString(d.queue.as_bytes().into()),
            );
            t.insert(
                "reason".into(),
                AMQPValue::LongString(d.reason.as_str().into()),
            );
            t.insert(
                "exchange".into(),
                AMQPValue::LongString(old.exchange.as_str().into()),
            );
            let mut keys = FieldArray::default();
            keys.push(AMQPValue::LongString(old.routing_key.as_str().into()));
            t.insert("routing-keys".into(), AMQPValue::FieldArray(keys));
            if let Some(exp) = old.properties.expiration() {
                t.insert(
                    "original-expiration".into(),
                    AMQPValue::LongString(exp.as_str().into()),
                );
            }
            t
        }
    };
    let count = entry
        .inner()
        .get("count")
        .and_then(super::args::int_value)
        .unwrap_or(0);
    entry.insert("count".into(), AMQPValue::LongLongInt(count + 1));
    entry.insert("time".into(), AMQPValue::Timestamp(now_ms / 1000));
    deaths.insert(0, AMQPValue::FieldTable(entry));
    headers.insert("x-death".into(), AMQPValue::FieldArray(deaths.into()));
    if !headers.contains_key("x-first-death-reason") {
        headers.insert(
            "x-first-death-reason".into(),
            AMQPValue::LongString(d.reason.as_str().into()),
        );
        headers.insert(
            "x-first-death-queue".into(),
            AMQPValue::LongString(d.queue.as_bytes().into()),
        );
        headers.insert(
            "x-first-death-exchange".into(),
            AMQPValue::LongString(old.exchange.as_str().into()),
        );
    }
    headers.insert(
        "x-last-death-reason".into(),
        AMQPValue::LongString(d.reason.as_str().into()),
    );
    headers.insert(
        "x-last-death-queue".into(),
        AMQPValue::LongString(d.queue.as_bytes().into()),
    );
    headers.insert(
        "x-last-death-exchange".into(),
        AMQPValue::LongString(old.exchange.as_str().into()),
    );
    let mut properties = old.properties.clone().with_headers(headers);
    properties = without_expiration(properties);
    let routing_key: ShortString = routing_key
        .map(Into::into)
        .unwrap_or_else(|| old.routing_key.clone());
    Message::authored(dlx.into(), routing_key, properties, old.body.clone())
}

fn without_expiration(p: crate::amqp::Properties) -> crate::amqp::Properties {
    // amq-protocol offers setters only; rebuild with every field but expiration.
    let mut out = crate::amqp::Properties::default();
    macro_rules! copy {
        ($get:ident, $set:ident) => {
            if let Some(v) = p.$get().clone() {
                out = out.$set(v);
            }
        };
    }
    copy!(content_type, with_content_type);
    copy!(content_encoding, with_content_encoding);
    copy!(headers, with_headers);
    copy!(delivery_mode, with_delivery_mode);
    copy!(priority, with_priority);
    copy!(correlation_id, with_correlation_id);
    copy!(reply_to, with_reply_to);
    copy!(message_id, with_message_id);
    copy!(timestamp, with_timestamp);
    copy!(kind, with_type);
    copy!(user_id, with_user_id);
    copy!(app_id, with_app_id);
    copy!(cluster_id, with_cluster_id);
    out
}
