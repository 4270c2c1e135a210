//! The session's status pseudo-queue, `amq.session` (`docs/sessions.md`): where a client
//! library that knows nothing of sessions reads what the broker granted — a passive
//! `queue.declare` shows one message, `basic.get` with `no-ack` reads it. Like RabbitMQ's
//! `amq.rabbitmq.reply-to`, it is not a queue in the vhost: each connection answers from its
//! own session, so it needs no wiring, on one broker or a cluster.

use super::{Connection, Lazy};
use crate::amqp::{AMQPClass, basic, queue};
use crate::core::AmqpError;
use crate::session::{ChannelStatus, PublishState, STATUS_QUEUE};

impl Connection {
    /// Whether `name` is the status pseudo-queue: answered here, not by the vhost.
    pub(super) fn is_session_status(name: &str) -> bool {
        name == STATUS_QUEUE
    }

    fn attached_session(&self) -> Result<crate::session::Attached, AmqpError> {
        self.session.ok_or_else(|| {
            AmqpError::not_found(format!(
                "{STATUS_QUEUE} exists only on a connection attached to a session \
                 (qpid.session.start or qpid.session.resume in start-ok's client-properties)"
            ))
        })
    }

    /// A passive `queue.declare` of the status pseudo-queue: one message, no consumer.
    pub(super) fn declare_session_status(
        &mut self,
        id: u16,
        nowait: bool,
    ) -> Result<(), AmqpError> {
        self.attached_session()?;
        if !nowait {
            self.writer.method(
                id,
                AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                    queue: STATUS_QUEUE.into(),
                    message_count: 1,
                    consumer_count: 0,
                })),
            );
        }
        Ok(())
    }

    /// `basic.get` from the status pseudo-queue: the status, with the channel's next delivery
    /// tag. Only with `no-ack` — nothing to acknowledge, it stays for the next read.
    pub(super) fn get_session_status(
        &mut self,
        id: u16,
        no_ack: bool,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let session = self.attached_session()?;
        if !no_ack {
            return Err(AmqpError::precondition(format!(
                "read {STATUS_QUEUE} with no-ack: the status is not consumed"
            )));
        }
        let key = self.channels.get(&id).expect("checked by the caller").key;
        let delivery_tag = v
            .get()
            .take_delivery_tag(key)
            .expect("the channel is open in the vhost");
        let kept: std::collections::HashMap<u16, PublishState> = self
            .broker
            .sessions()
            .kept_channels(session.id)
            .into_iter()
            .collect();
        let channels: Vec<ChannelStatus> = v
            .get()
            .channel_summaries(self.id)
            .into_iter()
            .map(|(channel, next_delivery_tag, unacked)| ChannelStatus {
                channel,
                next_delivery_tag,
                unacked,
                publishing: match self.channels.get(&channel) {
                    Some(open) => open.publishing.clone(),
                    None => kept.get(&channel).cloned().unwrap_or_default(),
                },
            })
            .collect();
        let message = session.status_message(&channels);
        self.writer.method(
            id,
            AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
                delivery_tag,
                redelivered: false,
                exchange: message.exchange.clone(),
                routing_key: message.routing_key.clone(),
                message_count: 0,
            })),
        );
        self.writer.header_payload(id, &message.header_payload);
        self.writer.body(id, message.body.bytes(), self.frame_max);
        Ok(())
    }
}
