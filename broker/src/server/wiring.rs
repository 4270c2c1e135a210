//! Which client methods change wiring, how they become [`WiringOp`]s and back into replies,
//! and the permissions each op needs. A single broker applies the op at once; a cluster
//! member sends a shared one through CPG and answers once it is committed and applied here.

use super::channel::ChannelCtx;
use crate::amqp::{AMQPClass, AMQPValue, FieldTable, exchange, queue};
use crate::auth::permissions::{Access, Resource};
use crate::core::{AmqpError, OpReply, VHost, WiringOp};

/// The reply a committed op turns into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Awaited {
    /// exchange.declare-ok.
    ExchangeDeclared,
    /// exchange.delete-ok.
    ExchangeDeleted,
    /// exchange.bind-ok.
    ExchangeBound,
    /// exchange.unbind-ok.
    ExchangeUnbound,
    /// queue.declare-ok for this queue (it also becomes the channel's last queue).
    QueueDeclared(String),
    /// queue.bind-ok.
    QueueBound,
    /// queue.unbind-ok.
    QueueUnbound,
    /// queue.delete-ok for this queue.
    QueueDeleted(String),
}

/// A method waiting for its op to be committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    /// What to answer.
    pub awaited: Awaited,
    /// The client asked for no answer (the op is still awaited, so later methods see it).
    pub nowait: bool,
}

/// The op for `method` if it changes wiring; `None` for everything else (passive declares,
/// purge, other classes). Names are resolved here — the channel's last queue for an empty
/// name, a fresh `amq.gen-` name for a server-named queue — so that every member of a
/// cluster applies the same op. `home` is this member's node id on a cluster.
pub fn op_for(
    method: &AMQPClass,
    ch: &ChannelCtx,
    v: &mut VHost,
    home: Option<String>,
) -> Result<Option<(WiringOp, Waiting)>, AmqpError> {
    let need_queue = |name: &str| {
        ch.queue_name(name)
            .ok_or_else(|| AmqpError::not_found("no previously declared queue"))
    };
    let waiting = |awaited, nowait| Waiting { awaited, nowait };
    Ok(Some(match method {
        AMQPClass::Exchange(m) => match m {
            exchange::AMQPMethod::Declare(d) if !d.passive => (
                WiringOp::DeclareExchange {
                    name: d.exchange.to_string(),
                    kind: d.kind.to_string(),
                    durable: d.durable,
                    auto_delete: d.auto_delete,
                    internal: d.internal,
                    arguments: d.arguments.clone(),
                },
                waiting(Awaited::ExchangeDeclared, d.nowait),
            ),
            exchange::AMQPMethod::Delete(d) => (
                WiringOp::DeleteExchange {
                    name: d.exchange.to_string(),
                    if_unused: d.if_unused,
                },
                waiting(Awaited::ExchangeDeleted, d.nowait),
            ),
            exchange::AMQPMethod::Bind(b) => (
                WiringOp::BindExchange {
                    destination: b.destination.to_string(),
                    source: b.source.to_string(),
                    routing_key: b.routing_key.to_string(),
                    arguments: b.arguments.clone(),
                },
                waiting(Awaited::ExchangeBound, b.nowait),
            ),
            exchange::AMQPMethod::Unbind(b) => (
                WiringOp::UnbindExchange {
                    destination: b.destination.to_string(),
                    source: b.source.to_string(),
                    routing_key: b.routing_key.to_string(),
                    arguments: b.arguments.clone(),
                },
                waiting(Awaited::ExchangeUnbound, b.nowait),
            ),
            _ => return Ok(None),
        },
        AMQPClass::Queue(m) => match m {
            queue::AMQPMethod::Declare(d) if !d.passive => {
                let server_named = d.queue.as_str().is_empty();
                let name = if server_named {
                    v.fresh_queue_name()
                } else {
                    d.queue.to_string()
                };
                crate::core::fragments::refuse_reserved(&d.arguments, &name)?;
                (
                    WiringOp::DeclareQueue {
                        name: name.clone(),
                        durable: d.durable,
                        exclusive: d.exclusive,
                        auto_delete: d.auto_delete,
                        arguments: d.arguments.clone(),
                        home,
                        server_named,
                    },
                    waiting(Awaited::QueueDeclared(name), d.nowait),
                )
            }
            queue::AMQPMethod::Bind(b) => {
                let q = need_queue(b.queue.as_str())?;
                let routing_key =
                    if b.routing_key.as_str().is_empty() && b.queue.as_str().is_empty() {
                        q.clone()
                    } else {
                        b.routing_key.to_string()
                    };
                (
                    WiringOp::BindQueue {
                        queue: q,
                        exchange: b.exchange.to_string(),
                        routing_key,
                        arguments: b.arguments.clone(),
                    },
                    waiting(Awaited::QueueBound, b.nowait),
                )
            }
            queue::AMQPMethod::Unbind(b) => (
                WiringOp::UnbindQueue {
                    queue: need_queue(b.queue.as_str())?,
                    exchange: b.exchange.to_string(),
                    routing_key: b.routing_key.to_string(),
                    arguments: b.arguments.clone(),
                },
                waiting(Awaited::QueueUnbound, false),
            ),
            queue::AMQPMethod::Delete(d) => {
                let q = need_queue(d.queue.as_str())?;
                (
                    WiringOp::DeleteQueue {
                        name: q.clone(),
                        if_unused: d.if_unused,
                        if_empty: d.if_empty,
                    },
                    waiting(Awaited::QueueDeleted(q), d.nowait),
                )
            }
            _ => return Ok(None),
        },
        _ => return Ok(None),
    }))
}

/// The -ok method for a committed op.
pub fn reply_method(awaited: &Awaited, reply: &OpReply) -> AMQPClass {
    match awaited {
        Awaited::ExchangeDeclared => {
            AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {}))
        }
        Awaited::ExchangeDeleted => {
            AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {}))
        }
        Awaited::ExchangeBound => {
            AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {}))
        }
        Awaited::ExchangeUnbound => {
            AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {}))
        }
        Awaited::QueueDeclared(name) => {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                queue: name.as_str().into(),
                message_count: reply.message_count,
                consumer_count: reply.consumer_count,
            }))
        }
        Awaited::QueueBound => AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
        Awaited::QueueUnbound => AMQPClass::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {})),
        Awaited::QueueDeleted(_) => {
            AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                message_count: reply.message_count,
            }))
        }
    }
}

/// The permissions a user needs for `op`: the same rules the single broker applies to the
/// method (RabbitMQ's), read off the op, whose names are resolved (a server-made queue name
/// included).
pub fn required_access(op: &WiringOp) -> Vec<(Access, Resource<'_>)> {
    match op {
        WiringOp::DeclareExchange {
            name, arguments, ..
        } => {
            let mut needs = vec![(Access::Configure, Resource::Exchange(name))];
            if let Some(ae) = string_arg(arguments, "alternate-exchange") {
                needs.push((Access::Read, Resource::Exchange(name)));
                needs.push((Access::Write, Resource::Exchange(ae)));
            }
            needs
        }
        WiringOp::DeleteExchange { name, .. } => {
            vec![(Access::Configure, Resource::Exchange(name))]
        }
        WiringOp::BindExchange {
            destination,
            source,
            ..
        }
        | WiringOp::UnbindExchange {
            destination,
            source,
            ..
        } => vec![
            (Access::Write, Resource::Exchange(destination)),
            (Access::Read, Resource::Exchange(source)),
        ],
        WiringOp::DeclareQueue {
            name, arguments, ..
        } => {
            let mut needs = vec![(Access::Configure, Resource::Queue(name))];
            if let Some(dlx) = string_arg(arguments, "x-dead-letter-exchange") {
                needs.push((Access::Read, Resource::Queue(name)));
                needs.push((Access::Write, Resource::Exchange(dlx)));
            }
            needs
        }
        WiringOp::DeleteQueue { name, .. } => vec![(Access::Configure, Resource::Queue(name))],
        WiringOp::BindQueue {
            queue, exchange, ..
        }
        | WiringOp::UnbindQueue {
            queue, exchange, ..
        } => vec![
            (Access::Write, Resource::Queue(queue)),
            (Access::Read, Resource::Exchange(exchange)),
        ],
        // A queue's primary sends these itself; no client method makes them.
        WiringOp::BackupInSync { queue, .. }
        | WiringOp::BackupOutOfSync { queue, .. }
        | WiringOp::MovePrimary { queue, .. } => {
            vec![(Access::Configure, Resource::Queue(queue))]
        }
        // A member sends these for its clients' sessions, which need no resource; a drain
        // only the admin API makes, for an administrator.
        WiringOp::Session(_)
        | WiringOp::DrainMember { .. }
        | WiringOp::Rebalance(_)
        | WiringOp::SetRingLayout(_) => Vec::new(),
    }
}

/// A string argument (`alternate-exchange`, `x-dead-letter-exchange`), short or long.
fn string_arg<'a>(args: &'a FieldTable, key: &str) -> Option<&'a str> {
    match args.inner().get(key)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str()),
        _ => None,
    }
}
