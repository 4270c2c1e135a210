//! Wiring commands: exchange and queue declare, delete, bind, unbind and purge. They change
//! what exists and how it is connected, never where a message is; each marks the durable wiring
//! changed when it touches a durable object, so that the server saves it before it answers.

use super::effects::purge;
use super::{Cancelled, Effects, VHost};
use crate::amqp::{FieldTable, codes};
use crate::core::args::QueueArgs;
use crate::core::error::{AmqpError, CoreResult};
use crate::core::exchange::{Binding, Destination, Exchange, ExchangeKind};
use crate::core::is_foreign;
use crate::core::queue::Queue;
use std::sync::Arc;

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

fn truthy(b: bool) -> &'static str {
    if b { "true" } else { "false" }
}

impl VHost {
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

    /// Refuses exchange-to-exchange bindings that involve a foreign exchange: its routing
    /// happens on the other broker, where this broker's exchanges do not exist.
    fn not_foreign_exchanges(&self, names: &[&str]) -> CoreResult<()> {
        match names
            .iter()
            .find(|n| self.exchanges.get(**n).is_some_and(|e| e.home.is_some()))
        {
            Some(name) => Err(AmqpError::new(
                codes::NOT_IMPLEMENTED,
                format!(
                    "exchange '{name}' in vhost '{}' is a foreign proxy: exchange-to-exchange \
                     bindings with it are not supported (bind queues to it instead)",
                    self.name
                ),
            )),
            None => Ok(()),
        }
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
        self.not_foreign_exchanges(&[source, destination])?;
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
        if self
            .queues
            .get(d.name.as_str())
            .is_some_and(|q| !self.may_use(q, conn))
        {
            return Err(self.locked(&d.name));
        }
        if let Some(q) = self.queues.get_mut(d.name.as_str()) {
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
                consumer_count: q.consumer_count() as u32,
            });
        }
        if d.passive {
            return Err(self.not_found_queue(&d.name));
        }
        let fragment = crate::core::fragments::fragment_of(&d.name, &d.arguments).is_some();
        if d.name.starts_with("amq.")
            && !(server_named && d.name.starts_with("amq.gen-"))
            && !fragment
        {
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
        if args.fragmented && (d.exclusive || d.auto_delete) {
            return Err(AmqpError::precondition(format!(
                "queue '{name}' in vhost '{vhost}': a fragmented queue is shared by every \
                 member, so it can be neither exclusive nor auto-delete"
            )));
        }
        self.has_fragmented |= args.fragmented;
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
        self.queues.insert(crate::core::own_key(&name), queue);
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
        let q = self.usable_queue(queue, conn)?;
        let (qname, foreign_queue) = (q.name.clone(), q.home.as_deref().is_some_and(is_foreign));
        self.bindable_source(exchange)?;
        if foreign_queue
            && self
                .exchanges
                .get(exchange)
                .is_some_and(|e| e.home.is_some())
        {
            return Err(AmqpError::new(
                codes::NOT_IMPLEMENTED,
                format!(
                    "cannot bind queue '{queue}' to exchange '{exchange}' in vhost '{}': both \
                     are foreign proxies (bind the queue to the exchange on the other broker)",
                    self.name
                ),
            ));
        }
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
        purge(q, ids, record, fx);
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
        if if_unused && q.consumer_count() > 0 {
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

    pub(in crate::core) fn remove_queue(&mut self, name: &str, fx: &mut Effects) -> u32 {
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
