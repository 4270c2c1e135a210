//! The basic class but for the content of a publish: qos, consume and cancel, get, the
//! acknowledgements (ack, nack, reject — held by a transaction until commit) and recover.
//! basic.publish only opens a pending publish here; its content is [`super::publish`]'s.

use super::frames::{permit, short};
use super::{Connection, Lazy};
use crate::amqp::{AMQPClass, basic, codes};
use crate::amqp::{AMQPValue, FieldTable};
use crate::auth::permissions::{Access, Resource};
use crate::core::args::consumer_priority;
use crate::core::fragments::PULL_ARGUMENT;
use crate::core::{AmqpError, ChannelKey, Consume, RECOGNISES_ARGUMENT, SESSION_ARGUMENT};
use crate::server::channel::{BodyParts, HeldAck, PendingPublish};
use std::sync::Arc;

impl Connection {
    /// Every basic method on an open channel.
    pub(super) fn on_basic(
        &mut self,
        id: u16,
        m: basic::AMQPMethod,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let now = v.now_ms();
        let ch = self.channels.get_mut(&id).expect("checked by the caller");
        let key = ch.key;
        let need_queue = |name: &str| {
            ch.queue_name(name)
                .ok_or_else(|| AmqpError::not_found("no previously declared queue"))
        };
        match m {
            basic::AMQPMethod::Publish(p) => {
                if p.immediate {
                    return Err(AmqpError::new(codes::NOT_IMPLEMENTED, "immediate=true"));
                }
                permit(
                    &self.perms,
                    Access::Write,
                    Resource::Exchange(p.exchange.as_str()),
                )?;
                ch.pending = Some(PendingPublish {
                    exchange: p.exchange,
                    routing_key: p.routing_key,
                    mandatory: p.mandatory,
                    header: None,
                    body: BodyParts::Empty,
                });
            }
            basic::AMQPMethod::Qos(q) => {
                v.get().basic_qos(
                    key,
                    self.qos_prefetch_size,
                    q.prefetch_count,
                    q.global,
                    now,
                    &mut self.fx,
                );
                self.writer.method(
                    id,
                    AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
                );
            }
            basic::AMQPMethod::Consume(c) => {
                let q = need_queue(c.queue.as_str())?;
                permit(&self.perms, Access::Read, Resource::Queue(&q))?;
                // Checked here for a proxied consumer too: the primary would refuse it the
                // same way, later.
                let priority = consumer_priority(&c.arguments, &q, v.get().name())?;
                let q = self.read_target(q, v);
                if let Some(primary) = v.get().remote_primary(&q) {
                    v.get().check_exclusive(&q, self.id)?;
                    return self.consume_remote(id, c, q, primary, v);
                }
                if self
                    .remote_consumers
                    .contains_key(&(id, c.consumer_tag.as_str().into()))
                {
                    return Err(AmqpError::new(
                        codes::NOT_ALLOWED,
                        format!(
                            "consumer tag '{}' is already in use on this channel",
                            c.consumer_tag
                        ),
                    ));
                }
                let nowait = c.nowait;
                let consume = Consume {
                    queue: q,
                    tag: c.consumer_tag.to_string(),
                    no_ack: c.no_ack,
                    exclusive: c.exclusive,
                    resend_unacked: self.session.is_some_and(|s| s.resumed),
                    priority,
                    pull: self.link && c.arguments.inner().contains_key(PULL_ARGUMENT),
                    session: self.consumer_session(&c.arguments),
                    recognises_redeliveries: self.recognises_redeliveries(&c.arguments),
                };
                let tag = v.get().basic_consume(key, consume, now, &mut self.fx)?;
                if !nowait {
                    // consume-ok must precede the first delivery: it is written now, the
                    // deliveries at the end of the batch.
                    self.writer.method(
                        id,
                        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                            consumer_tag: short(&tag),
                        })),
                    );
                }
            }
            basic::AMQPMethod::Cancel(c) => {
                if self.cancel_remote(id, &c)? {
                    return Ok(());
                }
                v.get()
                    .basic_cancel(key, c.consumer_tag.as_str(), now, &mut self.fx);
                self.flush_deliveries(v);
                if !c.nowait {
                    self.writer.method(
                        id,
                        AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                            consumer_tag: c.consumer_tag,
                        })),
                    );
                }
            }
            basic::AMQPMethod::Get(g) if Self::is_session_status(g.queue.as_str()) => {
                self.get_session_status(id, g.no_ack, v)?;
            }
            basic::AMQPMethod::Get(g) => {
                let q = need_queue(g.queue.as_str())?;
                permit(&self.perms, Access::Read, Resource::Queue(&q))?;
                let q = self.read_target(q, v);
                match v.get().remote_primary(&q) {
                    Some(primary) => {
                        v.get().check_exclusive(&q, self.id)?;
                        self.get_remote(id, q, g.no_ack, primary)?
                    }
                    None => self.basic_get(id, &q, g.no_ack, v)?,
                }
            }
            basic::AMQPMethod::Ack(a) => self.settle(
                id,
                HeldAck::Ack {
                    tag: a.delivery_tag,
                    multiple: a.multiple,
                },
                v,
            )?,
            basic::AMQPMethod::Nack(n) => self.settle(
                id,
                HeldAck::Nack {
                    tag: n.delivery_tag,
                    multiple: n.multiple,
                    requeue: n.requeue,
                },
                v,
            )?,
            basic::AMQPMethod::Reject(r) => self.settle(
                id,
                HeldAck::Nack {
                    tag: r.delivery_tag,
                    multiple: false,
                    requeue: r.requeue,
                },
                v,
            )?,
            basic::AMQPMethod::Recover(r) => {
                if r.requeue {
                    v.get().basic_recover(key, now, &mut self.fx);
                    self.send_remote_settles();
                } else {
                    v.get()
                        .basic_resend(key, self.session.is_some(), &mut self.fx);
                }
                self.writer.method(
                    id,
                    AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
                );
            }
            basic::AMQPMethod::RecoverAsync(r) => {
                if r.requeue {
                    v.get().basic_recover(key, now, &mut self.fx);
                } else {
                    v.get()
                        .basic_resend(key, self.session.is_some(), &mut self.fx);
                }
            }
            _ => {
                return Err(AmqpError::new(
                    codes::COMMAND_INVALID,
                    "unexpected basic method",
                ));
            }
        }
        Ok(())
    }

    /// The resumable session a consume on this connection is for: the connection's own,
    /// or, on another member's link, the one that member names ([`SESSION_ARGUMENT`]).
    fn consumer_session(&self, arguments: &FieldTable) -> Option<Arc<str>> {
        if !self.link {
            return self.session.map(|s| s.id.to_string().into());
        }
        match arguments.inner().get(SESSION_ARGUMENT) {
            Some(AMQPValue::LongString(s)) => {
                std::str::from_utf8(s.as_bytes()).ok().map(Into::into)
            }
            _ => None,
        }
    }

    /// Whether the client a consume on this connection is for recognises deliveries its
    /// application already had: the connection's session client says so in its
    /// capabilities; on another member's link, the consume does ([`RECOGNISES_ARGUMENT`]).
    fn recognises_redeliveries(&self, arguments: &FieldTable) -> bool {
        if !self.link {
            return self.session.is_some() && self.caps.recognises_redeliveries;
        }
        matches!(
            arguments.inner().get(RECOGNISES_ARGUMENT),
            Some(AMQPValue::Boolean(true))
        )
    }

    /// basic.get: get-ok with the message (its body read back if it was paged out), or
    /// get-empty.
    pub(super) fn basic_get(
        &mut self,
        id: u16,
        queue: &str,
        no_ack: bool,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let key = self.channels.get(&id).expect("checked by the caller").key;
        let w = &mut self.writer;
        let now = v.now_ms();
        match v.get().basic_get(key, queue, no_ack, now, &mut self.fx)? {
            None => w.method(
                id,
                AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
            ),
            Some(mut got) => {
                got.message = self.broker.resolve_message(got.message);
                self.stats.delivered += 1; // metrics
                self.stats.redelivered += u64::from(got.redelivered); // metrics
                w.method(
                    id,
                    AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
                        delivery_tag: got.delivery_tag,
                        redelivered: got.redelivered,
                        exchange: got.message.exchange.clone(),
                        routing_key: got.message.routing_key.clone(),
                        message_count: got.message_count,
                    })),
                );
                w.header_payload(id, &got.message.header_payload);
                w.body(id, got.message.body.bytes(), self.frame_max);
            }
        }
        Ok(())
    }

    /// basic.ack, basic.nack and basic.reject: applied now, or held until tx.commit on a
    /// transactional channel.
    pub(super) fn settle(
        &mut self,
        id: u16,
        settle: HeldAck,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let ch = self.channels.get_mut(&id).expect("checked by the caller");
        if let Some(tx) = &mut ch.tx {
            tx.acks.push(settle);
            return Ok(());
        }
        let key = ch.key;
        self.apply_settle(key, settle, v)
    }

    /// Applies one acknowledgement to the vhost (at once, or at tx.commit).
    pub(super) fn apply_settle(
        &mut self,
        key: ChannelKey,
        settle: HeldAck,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let now = v.now_ms();
        match settle {
            HeldAck::Ack { tag, multiple } => {
                let acked = v.get().ackable(key, tag, multiple); // metrics
                v.get().basic_ack(key, tag, multiple, now, &mut self.fx)?;
                self.stats.acked += acked as u64; // metrics
            }
            HeldAck::Nack {
                tag,
                multiple,
                requeue,
            } => {
                v.get()
                    .basic_nack(key, tag, multiple, requeue, now, &mut self.fx)?;
                // Proxied deliveries go back to their primaries now, and nothing more is
                // read until they are processed there (see `send_remote_settles`).
                self.send_remote_settles();
            }
        }
        Ok(())
    }
}
