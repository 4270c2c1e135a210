//! Declares and bindings that reach past this broker with `qpid.cluster.proxy`
//! (`docs/proxies.md`). Naming another AMQP broker, a new proxy queue or exchange is created
//! only if that broker has the queue or exchange (a passive declare there), and a binding of
//! a local queue to a proxy exchange is made there first (its private queue, bound the same
//! way), then here; an unbind is undone there first, so nothing published there after
//! unbind-ok arrives. Naming a cluster member, nothing is created: the declare answers
//! whether that member has the queue (as its primary) or the cluster the exchange.

use super::wiring::Pending;
use super::{Connection, Lazy};
use crate::amqp::{AMQPClass, exchange, queue};
use crate::broker::{PROXY_ARGUMENT, ProxyTarget};
use crate::core::{AmqpError, Feed, VHost, WiringOp, is_foreign};
use crate::proxy::feed::{self, FeedError};
use crate::proxy::link::redacted;
use std::future::Future;
use std::pin::Pin;

/// A check on the other broker that must pass before a wiring op is carried out.
type Check = Pin<Box<dyn Future<Output = Result<(), AmqpError>> + Send>>;

impl Connection {
    /// A non-passive exchange.declare or queue.declare whose `qpid.cluster.proxy` names a
    /// cluster member: answered like a passive declare once the member (as the queue's
    /// primary) or the cluster (for an exchange) has it, else 404 naming it. Returns whether
    /// `method` was such a declare.
    pub(super) fn declare_naming_member(
        &mut self,
        id: u16,
        method: &AMQPClass,
        v: &mut Lazy,
    ) -> Result<bool, AmqpError> {
        match method {
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(d)) if !d.passive => {
                let Some(ProxyTarget::Member(_)) = self.broker.proxy_target(&d.arguments)? else {
                    return Ok(false);
                };
                self.exchange_declare_passive(id, d, v)?;
            }
            AMQPClass::Queue(queue::AMQPMethod::Declare(d)) if !d.passive && !d.exclusive => {
                let Some(ProxyTarget::Member(node)) = self.broker.proxy_target(&d.arguments)?
                else {
                    return Ok(false);
                };
                let name = d.queue.as_str();
                let me = self.broker.cluster().map(|c| c.node_id().to_owned());
                let primary = v
                    .get()
                    .queue(name)
                    .filter(|q| q.exclusive_owner.is_none())
                    .map(|q| q.home.as_deref().map(str::to_owned).or_else(|| me.clone()));
                let on_member = match primary {
                    Some(Some(p)) => p == node,
                    // A single broker's queue: its own node id names it.
                    Some(None) => node == self.broker.config.node_id,
                    None => false,
                };
                if !on_member {
                    return Err(AmqpError::not_found(format!(
                        "{PROXY_ARGUMENT}: no queue '{name}' in vhost '{}' whose primary is \
                         cluster member '{node}'",
                        self.vhost_name
                    )));
                }
                self.queue_declare_passive(id, d, v)?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Carries out `pending` at once, or after the check on another broker it needs (see
    /// the module doc).
    pub(super) fn carry_out_foreign(
        &mut self,
        id: u16,
        pending: Pending,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        match self.foreign_check(&pending.op, v.get())? {
            Some(check) => {
                self.check_then_carry_out(id, pending, check);
                Ok(())
            }
            None => self.carry_out(id, pending, v),
        }
    }

    /// The check `op` needs on another broker, if any.
    fn foreign_check(&self, op: &WiringOp, v: &mut VHost) -> Result<Option<Check>, AmqpError> {
        let links = self.broker.proxies().links.clone();
        let vhost = self.vhost_name.clone();
        Ok(match op {
            WiringOp::DeclareQueue {
                name,
                home: Some(home),
                exclusive: false,
                ..
            } if is_foreign(home) && v.queue(name).is_none() => {
                let (queue, uri) = (name.clone(), home.clone());
                Some(Box::pin(async move {
                    match links.queue_exists(&uri, &vhost, &queue).await {
                        Ok(true) => Ok(()),
                        Ok(false) => Err(AmqpError::not_found(format!(
                            "{PROXY_ARGUMENT}: no queue '{queue}' on {}",
                            redacted(&uri)
                        ))),
                        Err(e) => Err(AmqpError::not_found(format!("{PROXY_ARGUMENT}: {e}"))),
                    }
                }))
            }
            WiringOp::DeclareExchange {
                name, arguments, ..
            } if v.exchange(name).is_none() => {
                let Some(ProxyTarget::Foreign(uri)) = self.broker.proxy_target(arguments)? else {
                    return Ok(None);
                };
                let exchange = name.clone();
                Some(Box::pin(async move {
                    match links.exchange_exists(&uri, &vhost, &exchange).await {
                        Ok(true) => Ok(()),
                        Ok(false) => Err(AmqpError::not_found(format!(
                            "{PROXY_ARGUMENT}: no exchange '{exchange}' on {}",
                            redacted(&uri)
                        ))),
                        Err(e) => Err(AmqpError::not_found(format!("{PROXY_ARGUMENT}: {e}"))),
                    }
                }))
            }
            WiringOp::BindQueue {
                queue,
                exchange,
                routing_key,
                arguments,
            } => self
                .feed(v, queue, exchange, routing_key, arguments)
                .map(|(f, remote)| {
                    Box::pin(async move {
                        feed::bind_remote(&links, &vhost, &remote, &f)
                            .await
                            .map_err(refused)
                    }) as Check
                }),
            WiringOp::UnbindQueue {
                queue,
                exchange,
                routing_key,
                arguments,
            } => self
                .feed(v, queue, exchange, routing_key, arguments)
                .map(|(f, remote)| {
                    Box::pin(async move {
                        feed::unbind_remote(&links, &vhost, &remote, &f)
                            .await
                            .map_err(refused)
                    }) as Check
                }),
            _ => None,
        })
    }

    /// The feed a binding of `queue` to `exchange` is, with its private queue's name, when
    /// `exchange` is a foreign proxy and the binding can be made (else the op's own
    /// error, or success, is the answer).
    fn feed(
        &self,
        v: &VHost,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        arguments: &crate::amqp::FieldTable,
    ) -> Option<(Feed, String)> {
        let home = v.exchange(exchange)?.home.clone()?;
        let q = v.queue(queue)?;
        if q.home.as_deref().is_some_and(is_foreign)
            || q.exclusive_owner.is_some_and(|owner| owner != self.id)
        {
            return None;
        }
        let f = Feed {
            exchange: exchange.into(),
            home,
            queue: q.name.clone(),
            routing_key: routing_key.to_owned(),
            arguments: arguments.clone(),
        };
        let remote = feed::remote_queue(&self.broker.feed_identity(), v.name(), &f);
        Some((f, remote))
    }
}

/// A feed that could not be bound or unbound on the other broker, as the client's error:
/// 404 NOT_FOUND with the reason (that broker lacks the exchange, refused, or cannot be
/// reached), as for a proxy whose queue the other broker lacks.
fn refused(e: FeedError) -> AmqpError {
    AmqpError::not_found(format!("{PROXY_ARGUMENT}: {e}"))
}
