//! The exchange and queue classes. Every change — declare, delete, bind, unbind — takes one
//! path: the method becomes a [`crate::core::WiringOp`] ([`crate::server::wiring::op_for`]),
//! the user's permissions are checked against the op, and then a single broker (or a cluster
//! member, for an exclusive queue) applies it at once, while a cluster member sends it
//! through the cluster and answers when it is committed ([`ClusterWait`]). Passive declares
//! (questions) and purge (content) are not wiring changes and are answered here.

use super::frames::{ConnError, permit, short};
use super::proxied::Answer;
use super::{Connection, Lazy};
use crate::amqp::AMQPValue;
use crate::amqp::{AMQPClass, codes, exchange, queue};
use crate::auth::permissions::{Access, Resource};
use crate::cluster::OpOutcome;
use crate::core::{AmqpError, ExchangeDeclare, OpReply, QueueDeclare, WiringOp, is_foreign};
use crate::proxy::stats::STATS_ARGUMENT;
use crate::server::wiring::{self, Awaited, Waiting};

/// A wiring op waiting for a check before it is carried out.
pub(super) struct Pending {
    pub(super) op: WiringOp,
    pub(super) waiting: Waiting,
    pub(super) class_id: u16,
    pub(super) method_id: u16,
}

/// A method whose wiring op is in flight through the cluster: the connection reads no
/// further frames until it is committed, so later methods see its effect (as on one broker).
pub(super) struct ClusterWait {
    channel: u16,
    class_id: u16,
    method_id: u16,
    waiting: Waiting,
    outcome: tokio::sync::oneshot::Receiver<OpOutcome>,
}

impl Connection {
    /// Every exchange and queue method on an open channel.
    pub(super) fn on_wiring_method(
        &mut self,
        id: u16,
        method: AMQPClass,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        match &method {
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(d)) if d.passive => {
                return self.exchange_declare_passive(id, d, v);
            }
            AMQPClass::Queue(queue::AMQPMethod::Declare(d))
                if d.passive && Self::is_session_status(d.queue.as_str()) =>
            {
                return self.declare_session_status(id, d.nowait);
            }
            AMQPClass::Queue(queue::AMQPMethod::Declare(d)) if d.passive => {
                return self.queue_declare_passive(id, d, v);
            }
            AMQPClass::Queue(queue::AMQPMethod::Purge(p)) => return self.queue_purge(id, p, v),
            _ => {}
        }
        if self.declare_naming_member(id, &method, v)? {
            return Ok(());
        }
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
        let cluster = self.broker.cluster().cloned();
        let home = match &method {
            AMQPClass::Queue(queue::AMQPMethod::Declare(d)) if !d.exclusive => {
                let primaries = v.get().queues().filter_map(|q| q.home.as_deref());
                self.broker.queue_home(&d.arguments, primaries)?
            }
            _ => cluster.as_ref().map(|c| c.node_id().to_owned()),
        };
        let ch = self.channels.get(&id).expect("checked by the caller");
        let Some((op, waiting)) = wiring::op_for(&method, ch, v.get(), home)? else {
            let what = if class_id == 40 { "exchange" } else { "queue" };
            return Err(AmqpError::new(
                codes::COMMAND_INVALID,
                format!("unexpected {what} method"),
            ));
        };
        for (access, resource) in wiring::required_access(&op) {
            permit(&self.perms, access, resource)?;
        }
        let op = match &cluster {
            Some(_) => {
                // A session's exclusive queue is the session's (`docs/sessions.md` §4).
                let session = self.session.as_ref().map(|s| s.id.to_string());
                op.with_exclusive_owner(v.get().exclusive_owner_token(self.id, session.as_deref()))
            }
            None => op,
        };
        if let WiringOp::DeleteQueue {
            name,
            if_unused,
            if_empty,
        } = &op
            && self.is_fragmented(name, v)
        {
            let (name, flags) = (name.clone(), (*if_unused, *if_empty));
            self.fragmented_delete(id, name, flags, waiting.nowait);
            return Ok(());
        }
        if let WiringOp::DeleteQueue {
            name,
            if_unused,
            if_empty,
        } = &op
            && let Some(primary) = v.get().remote_primary(name)
            && !is_foreign(&primary)
        {
            // Only the primary knows whether the queue is unused or empty, and how many
            // messages go with it: it decides, and commits the delete. (Deleting a foreign
            // proxy deletes the proxy, never the other broker's queue.)
            let (name, if_unused, if_empty) = (name.clone(), *if_unused, *if_empty);
            return self.delete_remote(id, name, (if_unused, if_empty), waiting.nowait, primary);
        }
        self.carry_out_foreign(
            id,
            Pending {
                op,
                waiting,
                class_id,
                method_id,
            },
            v,
        )
    }

    /// Applies a wiring op here (a single broker, or a member's own exclusive queue), or
    /// sends it through the cluster and answers once it is committed.
    pub(super) fn carry_out(
        &mut self,
        id: u16,
        pending: Pending,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let Pending {
            op,
            waiting,
            class_id,
            method_id,
        } = pending;
        match self.broker.cluster().cloned() {
            Some(cluster) if op.is_shared(v.get(), self.id) => {
                let op = op.for_cluster(v.get())?;
                self.cluster_wait = Some(ClusterWait {
                    channel: id,
                    class_id,
                    method_id,
                    waiting,
                    outcome: cluster.submit(&self.vhost_name, op),
                });
            }
            _ => {
                let now = v.now_ms();
                let reply = op.apply(v.get(), self.id, now, &mut self.fx)?;
                self.answer_wiring(id, &waiting, &reply);
            }
        }
        Ok(())
    }

    /// Answers an applied wiring change: the channel's last queue, the -ok unless nowait,
    /// and a log line for queues created or deleted.
    pub(super) fn answer_wiring(&mut self, id: u16, waiting: &Waiting, reply: &OpReply) {
        // A binding to (or a queue or exchange of) a foreign exchange may have come or gone.
        self.broker.proxies().feeds_changed.notify_one();
        let Some(ch) = self.channels.get_mut(&id) else {
            return;
        };
        match &waiting.awaited {
            Awaited::QueueDeclared(name) => {
                ch.last_queue = Some(name.clone());
                if reply.created {
                    tracing::info!(conn = self.id, channel = id, vhost = %self.vhost_name, queue = %name, "queue declared");
                }
            }
            Awaited::QueueDeleted(name) => {
                tracing::info!(conn = self.id, channel = id, vhost = %self.vhost_name, queue = %name, "queue deleted");
            }
            _ => {}
        }
        if !waiting.nowait {
            self.writer
                .method(id, wiring::reply_method(&waiting.awaited, reply));
        }
    }

    /// Answers the method whose wiring op the cluster committed (or could not).
    pub(super) fn on_committed(&mut self, outcome: Option<OpOutcome>) {
        let Some(wait) = self.cluster_wait.take() else {
            return;
        };
        let Some(vhost) = self.vhost.clone() else {
            return;
        };
        let mut v = Lazy::new(&vhost);
        let outcome = outcome.unwrap_or_else(|| {
            Err(AmqpError::new(
                codes::INTERNAL_ERROR,
                "the cluster layer stopped before the change was committed",
            ))
        });
        let open = self
            .channels
            .get(&wait.channel)
            .is_some_and(|ch| !ch.closing);
        if let (Awaited::QueueDeclared(name), Ok((_, journal_seq)), true) =
            (&wait.waiting.awaited, &outcome, open)
            && self.is_fragmented(name, &mut v)
        {
            // declare-ok waits for every active member's fragment and counts them all.
            self.hold_output(*journal_seq);
            let (name, nowait) = (name.clone(), wait.waiting.nowait);
            self.fragmented_declare_ok(wait.channel, name, nowait, true);
            return;
        }
        let proxied_declare = match &wait.waiting.awaited {
            Awaited::QueueDeclared(name) if !wait.waiting.nowait => v
                .get()
                .remote_primary(name)
                .map(|primary| (name.clone(), primary)),
            _ => None,
        };
        match outcome {
            Ok((reply, journal_seq)) if open && proxied_declare.is_some() && !reply.created => {
                // declare-ok counts the queue's messages and consumers: its primary's. (A
                // queue this declare created has none: answered here, without asking a
                // primary that may not have applied the declare yet.)
                self.hold_output(journal_seq);
                let (name, primary) = proxied_declare.expect("checked");
                if let Err(e) = self.count_remote(wait.channel, name, false, primary) {
                    self.channel_error(wait.channel, e, wait.class_id, wait.method_id, &mut v);
                }
            }
            Ok((reply, journal_seq)) if open => {
                self.answer_wiring(wait.channel, &wait.waiting, &reply);
                self.hold_output(journal_seq);
            }
            Ok(_) => {}
            Err(e) if e.is_connection_error() => self.connection_error(ConnError {
                code: e.code,
                text: e.text,
                class_id: wait.class_id,
                method_id: wait.method_id,
            }),
            Err(e) => self.channel_error(wait.channel, e, wait.class_id, wait.method_id, &mut v),
        }
        self.end_batch(v);
    }

    /// exchange.declare with passive set: does it exist (404 if not)?
    pub(super) fn exchange_declare_passive(
        &mut self,
        id: u16,
        d: &exchange::Declare,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        if self.link
            && let Some(origin) = crate::proxy::catch_up::origin(&d.arguments)
        {
            // Another member's forwarding link: the publishes after this were made on
            // behalf of `origin`.
            self.publish_origin = Some(origin.into());
            if !d.nowait {
                self.writer.method(
                    id,
                    AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
                );
            }
            return Ok(());
        }
        if self.link
            && let Some(index) = crate::proxy::catch_up::after_index(&d.arguments)
            && self.broker.proxies().applied.index() < index
        {
            // Another member's link: what follows on this channel needs the cluster change
            // `index`, which that member applied and this one is about to.
            let reached = self.broker.proxies().applied.reached(index);
            let nowait = d.nowait;
            self.wait_remote(id, (40, 10), async move {
                if !reached.await {
                    tracing::warn!(
                        index,
                        "a cluster change another member applied is still not applied here"
                    );
                }
                Answer::CaughtUp { nowait }
            });
            return Ok(());
        }
        v.get().exchange_declare(ExchangeDeclare {
            name: d.exchange.to_string(),
            kind: d.kind.to_string(),
            passive: true,
            durable: d.durable,
            auto_delete: d.auto_delete,
            internal: d.internal,
            arguments: d.arguments.clone(),
        })?;
        if !d.nowait {
            self.writer.method(
                id,
                AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
            );
        }
        Ok(())
    }

    /// queue.declare with passive set: its counts (404 if it does not exist, 405 if another
    /// connection's exclusive queue). It becomes the channel's last queue.
    pub(super) fn queue_declare_passive(
        &mut self,
        id: u16,
        d: &queue::Declare,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let name = d.queue.to_string();
        if self.link
            && let Some(which) = d.arguments.inner().get(STATS_ARGUMENT)
        {
            return self.queue_stats(id, &name, which, d.nowait, v);
        }
        if self.is_fragmented(&name, v) {
            self.fragmented_declare_ok(id, name, d.nowait, false);
            return Ok(());
        }
        if let Some(primary) = v.get().remote_primary(&name)
            && !d.exclusive
        {
            let locked = v.get().check_exclusive(&name, self.id).err();
            return self.count_remote_unless(id, name, d.nowait, primary, locked);
        }
        let now = v.now_ms();
        let declared = v.get().queue_declare(
            self.id,
            QueueDeclare {
                name: d.queue.to_string(),
                passive: true,
                durable: d.durable,
                exclusive: d.exclusive,
                auto_delete: d.auto_delete,
                arguments: d.arguments.clone(),
            },
            now,
        )?;
        let message_count = declared.message_count;
        let ch = self.channels.get_mut(&id).expect("checked by the caller");
        ch.last_queue = Some(declared.name.to_string());
        if !d.nowait {
            self.writer.method(
                id,
                AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                    queue: short(&declared.name),
                    message_count,
                    consumer_count: declared.consumer_count,
                })),
            );
        }
        Ok(())
    }

    /// Another member's admin API asking, over its link, for a queue's numbers
    /// ([`STATS_ARGUMENT`]): a passive declare that is not a use of the queue.
    fn queue_stats(
        &mut self,
        id: u16,
        name: &str,
        which: &AMQPValue,
        nowait: bool,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let vhost = self.vhost_name.clone();
        let q = v
            .get()
            .queue(name)
            .ok_or_else(|| AmqpError::not_found(format!("no queue '{name}' in vhost '{vhost}'")))?;
        let unacked = matches!(which, AMQPValue::LongString(s) if s.as_bytes() == b"unacked");
        let message_count = if unacked {
            q.unacked_count()
        } else {
            q.ready_count()
        } as u32;
        let consumer_count = q.consumer_count() as u32;
        if !nowait {
            self.writer.method(
                id,
                AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                    queue: short(name),
                    message_count,
                    consumer_count,
                })),
            );
        }
        Ok(())
    }

    /// queue.purge: drops the queue's ready messages on the queue's broker.
    pub(super) fn queue_purge(
        &mut self,
        id: u16,
        p: &queue::Purge,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let ch = self.channels.get(&id).expect("checked by the caller");
        let q = ch
            .queue_name(p.queue.as_str())
            .ok_or_else(|| AmqpError::not_found("no previously declared queue"))?;
        permit(&self.perms, Access::Read, Resource::Queue(&q))?;
        if self.is_fragmented(&q, v) {
            self.fragmented_purge(id, q, p.nowait);
            return Ok(());
        }
        if let Some(primary) = v.get().remote_primary(&q) {
            v.get().check_exclusive(&q, self.id)?;
            return self.purge_remote(id, q, p.nowait, primary);
        }
        let message_count = v.get().queue_purge(self.id, &q, &mut self.fx)?;
        if !p.nowait {
            self.writer.method(
                id,
                AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk { message_count })),
            );
        }
        Ok(())
    }
}

/// The outcome of the in-flight cluster op, if there is one (pending forever otherwise, so
/// `select!` can always poll it). `None` means the cluster layer dropped the request.
pub(super) async fn committed(wait: &mut Option<ClusterWait>) -> Option<OpOutcome> {
    match wait {
        Some(w) => (&mut w.outcome).await.ok(),
        None => std::future::pending().await,
    }
}
