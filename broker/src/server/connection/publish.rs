//! The publish path: a content header and body frames after basic.publish become one
//! [`Message`], routed by the vhost at once (or held by a transaction until commit). Under
//! confirms the channel decides the message's confirm here; it leaves behind the batch's
//! [`crate::server::confirm_gate::ConfirmGate`].

use super::frames::ConnError;
use super::{Connection, Lazy};
use crate::amqp::frame::FRAME_HEADER;
use crate::amqp::frame::RawFrame;
use crate::amqp::table_depth::header_within_depth;
use crate::amqp::{AMQPClass, basic, codes};
use crate::core::{AmqpError, Message, PublishOutcome};
use crate::server::channel::{HeldPublish, PendingPublish, UnansweredForward};
use crate::session::PUBLISH_SEQ_HEADER;
use std::sync::Arc;

impl Connection {
    pub(super) fn on_content(&mut self, frame: RawFrame, v: &mut Lazy) -> Result<(), ConnError> {
        let id = frame.channel;
        let class_id = 60;
        let method_id = 40;
        let unexpected = |what: &str| ConnError {
            code: codes::UNEXPECTED_FRAME,
            text: format!("{what} on channel {id} without a preceding basic.publish"),
            class_id,
            method_id,
        };
        let Some(ch) = self.channels.get_mut(&id) else {
            return Err(ConnError::new(
                codes::CHANNEL_ERROR,
                format!("content on channel {id}, which is not open"),
            ));
        };
        if ch.closing {
            return Ok(());
        }
        let Some(pending) = ch.pending.as_mut() else {
            return Err(unexpected(if frame.kind == FRAME_HEADER {
                "content header"
            } else {
                "content body"
            }));
        };
        if frame.kind == FRAME_HEADER {
            if pending.header.is_some() {
                return Err(ConnError {
                    code: codes::UNEXPECTED_FRAME,
                    text: "second content header for one message".into(),
                    class_id,
                    method_id,
                });
            }
            let max_depth = self.broker.config.max_table_depth;
            if !header_within_depth(&frame.payload, max_depth) {
                return Err(ConnError {
                    code: codes::SYNTAX_ERROR,
                    text: format!("message headers nested deeper than {max_depth} levels"),
                    class_id,
                    method_id,
                });
            }
            let header =
                match amq_protocol::frame::parsing::parse_content_header(&frame.payload[..]) {
                    Ok(([], h)) => h,
                    _ => {
                        return Err(ConnError {
                            code: codes::FRAME_ERROR,
                            text: "could not decode the content header".into(),
                            class_id,
                            method_id,
                        });
                    }
                };
            if header.class_id != 60 {
                return Err(ConnError {
                    code: codes::FRAME_ERROR,
                    text: format!("content header of class {}", header.class_id),
                    class_id,
                    method_id,
                });
            }
            // A link's publish may be a replication frame: one message of up to the limit
            // plus the frame's own fields (ids, names, its content header, which fit one
            // AMQP frame).
            let headroom = if self.link {
                u64::from(self.broker.config.frame_max) + crate::replication::FRAME_FIELDS_BYTES
            } else {
                0
            };
            if header.body_size > self.broker.config.max_message_size + headroom {
                let max = self.broker.config.max_message_size;
                let text = format!(
                    "message size {} is larger than configured max size {max}",
                    header.body_size
                );
                self.channel_error(id, AmqpError::precondition(text), class_id, method_id, v);
                return Ok(());
            }
            pending.header = Some((Box::new(header.properties), frame.payload, header.body_size));
        } else {
            let Some((_, _, size)) = &pending.header else {
                return Err(ConnError {
                    code: codes::UNEXPECTED_FRAME,
                    text: "content body before its header".into(),
                    class_id,
                    method_id,
                });
            };
            let size = *size as usize;
            if pending.body.len() + frame.payload.len() > size {
                return Err(ConnError {
                    code: codes::FRAME_ERROR,
                    text: format!("content body longer than the {size} bytes its header announced"),
                    class_id,
                    method_id,
                });
            }
            pending.body.push(frame.payload, size);
        }
        let complete =
            matches!(&pending.header, Some((_, _, size)) if pending.body.len() as u64 == *size);
        if complete {
            let p = ch.pending.take().expect("checked above");
            self.on_publish(id, p, v);
        }
        Ok(())
    }

    pub(super) fn on_publish(&mut self, id: u16, p: PendingPublish, v: &mut Lazy) {
        let (class_id, method_id) = (60, 40);
        let PendingPublish {
            exchange,
            routing_key,
            mandatory,
            header,
            body,
        } = p;
        let (properties, header_payload, _) = header.expect("complete publish has a header");
        // The names came in as short strings: they move into the message, which the rest of
        // the path reads them from.
        let message = match Message::new(
            exchange,
            routing_key,
            properties,
            header_payload,
            body.finish(),
        ) {
            Ok(m) => Arc::new(m),
            Err(e) => {
                self.channel_error(
                    id,
                    AmqpError::precondition(format!("invalid expiration '{}'", e.0)),
                    class_id,
                    method_id,
                    v,
                );
                return;
            }
        };
        let resent = match self.session {
            Some(_) => self.resent(id, &message),
            None => Resent::New,
        };
        if resent == Resent::Dropped {
            // Its confirm leaves through the end of the batch, which flushes and holds
            // output only for a batch that took the vhost lock.
            v.get();
            return;
        }
        self.stats.published += 1; // metrics
        if self.broker.publishers_blocked() && self.caps.connection_blocked {
            // Stop reading this publisher's socket until the watermark clears.
            self.publish_waits_for_unblock = true;
            self.stats.set_blocked(&self.broker.stats, self.id, true); // metrics
        }
        let ch = self
            .channels
            .get_mut(&id)
            .expect("publishing channel is open");
        if let Some(tx) = &mut ch.tx {
            if v.get().exchange(message.exchange.as_str()).is_none() {
                let text = format!(
                    "no exchange '{}' in vhost '{}'",
                    message.exchange, self.vhost_name
                );
                self.channel_error(id, AmqpError::not_found(text), class_id, method_id, v);
                return;
            }
            tx.publishes.push(HeldPublish {
                exchange: message.exchange.to_string(),
                routing_key: message.routing_key.to_string(),
                mandatory,
                message,
            });
            return;
        }
        let confirm_number = match resent {
            // Decided anew under the number the client waits on.
            Resent::Again(n) => Some(n),
            _ => ch.publishing.count_publish(),
        };
        let (exchange, routing_key) = (message.exchange.as_str(), message.routing_key.as_str());
        if self.is_replication(exchange) {
            let applied = self.apply_replication(&message, v);
            if let Some(n) = confirm_number {
                self.channels
                    .get_mut(&id)
                    .expect("publishing channel is open")
                    .confirm_publish(n, applied, None);
            }
            return;
        }
        let forwards_before = self.fx.forwards.len();
        let origin = self.publish_origin.as_deref();
        let now = v.now_ms();
        let outcome = if self.link {
            Ok(v.get().publish_forwarded_as(
                origin,
                exchange,
                routing_key,
                message.clone(),
                now,
                &mut self.fx,
            ))
        } else {
            v.get().publish_as(
                origin,
                exchange,
                routing_key,
                message.clone(),
                now,
                &mut self.fx,
            )
        };
        match outcome {
            Err(e) => self.channel_error(id, e, class_id, method_id, v),
            Ok(outcome) => {
                let accepted = match outcome {
                    PublishOutcome::Routed => {
                        self.stats.routed += 1; // metrics
                        true
                    }
                    PublishOutcome::Unroutable => {
                        self.stats.unroutable += 1; // metrics
                        true
                    }
                    PublishOutcome::Moving => {
                        tracing::debug!(conn = self.id, exchange = %message.exchange, routing_key = %message.routing_key, "forwarded publish nacked with requeue: a matched queue is sealed for its move");
                        if let Some(n) = confirm_number {
                            self.channels
                                .get_mut(&id)
                                .expect("publishing channel is open")
                                .moving
                                .insert(n);
                        }
                        false
                    }
                    PublishOutcome::Rejected => {
                        tracing::debug!(conn = self.id, link = self.link, exchange = %message.exchange, routing_key = %message.routing_key, "publish refused: a queue refused it, or (a forward) none of the matched queues is this member's");
                        false
                    }
                    // A session's publish waits for the election through its lost forwards'
                    // failure, and its client sends it again; a plain client gets a nack.
                    PublishOutcome::Unavailable if self.session.is_some() => true,
                    PublishOutcome::Unavailable => {
                        tracing::debug!(conn = self.id, exchange = %message.exchange, routing_key = %message.routing_key, "publish nacked: a matched queue's primary is not a live member");
                        let mut added = self.fx.forwards.split_off(forwards_before);
                        added.retain(|f| !f.lost);
                        self.fx.forwards.extend(added);
                        false
                    }
                };
                if mandatory && outcome == PublishOutcome::Unroutable {
                    self.send_return(id, &message);
                }
                if let Some(n) = confirm_number {
                    // Forwards are numbered in the tracker in the order the batch hands
                    // them over: this publish's are the ones it added to the effects.
                    let issued = self.forwards.issued();
                    let added = self.fx.forwards.len() - forwards_before;
                    let forwards = (added > 0).then(|| {
                        let first = issued + forwards_before as u64 + 1;
                        (first, first + added as u64 - 1)
                    });
                    self.channels
                        .get_mut(&id)
                        .expect("publishing channel is open")
                        .confirm_publish(n, accepted, forwards);
                    self.awaiting_confirms |= forwards.is_some();
                } else if self.session.is_some() && self.fx.forwards.len() > forwards_before {
                    let ch = &self.channels[&id];
                    let (number, commits) = (ch.publishing.published, ch.publishing.commits);
                    self.track_unanswered_forwards(id, forwards_before, number, commits);
                }
            }
        }
    }

    /// A session's publish that names its number on the channel ([`PUBLISH_SEQ_HEADER`]) and
    /// that the channel processed already — a client resending what it had no confirm for
    /// after a resume: dropped, and in confirm mode confirmed again with the outcome it first
    /// had, once what that confirm waited for holds (the session's barrier); or, when its
    /// first forward failed before its primary answered (its fate unknown), routed again
    /// under its confirm number — the queues that took the first copy drop this one by its
    /// producer and number. A publish held by a transaction is compared with what the
    /// channel committed.
    fn resent(&mut self, id: u16, message: &Message) -> Resent {
        let Some(seq) = message
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(PUBLISH_SEQ_HEADER))
            .and_then(crate::session::integer)
        else {
            return Resent::New;
        };
        let ch = self
            .channels
            .get_mut(&id)
            .expect("publishing channel is open");
        if !ch.publishing.is_duplicate(seq) {
            ch.publishing.number_from(seq);
            return Resent::New;
        }
        let confirm = ch.publishing.confirm_of(seq);
        if let Some((n, _)) = confirm
            && ch.tx.is_none()
            && ch.publishing.retry_unknown(n)
        {
            return Resent::Again(n);
        }
        self.stats.duplicates_dropped += 1; // metrics
        tracing::debug!(conn = self.id, channel = id, seq, confirm = ?confirm, "a resent publish dropped");
        if let Some((n, ack)) = confirm {
            ch.confirm_publish(n, ack, None);
            self.resent_confirmed = true;
        }
        Resent::Dropped
    }

    /// On a session's channel without confirms: when the work just done (a publish, or a
    /// commit's publishes, first numbered `number` on the channel, its commit count before
    /// it `commits_before`) added forwards past `forwards_before`, remembers them as
    /// unanswered ([`crate::server::channel::ChannelCtx::unanswered_forwards`]).
    pub(super) fn track_unanswered_forwards(
        &mut self,
        id: u16,
        forwards_before: usize,
        number: u64,
        commits_before: u64,
    ) {
        if self.session.is_none() || self.fx.forwards.len() <= forwards_before {
            return;
        }
        // Forwards are numbered in the tracker in the order the batch hands them over.
        let last = self.forwards.issued() + self.fx.forwards.len() as u64;
        self.channels
            .get_mut(&id)
            .expect("the channel is open")
            .unanswered_forwards
            .push_back(UnansweredForward {
                number,
                last,
                commits_before,
            });
    }

    pub(super) fn send_return(&mut self, id: u16, message: &Message) {
        self.writer.method(
            id,
            AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                reply_code: codes::NO_ROUTE,
                reply_text: "NO_ROUTE".into(),
                exchange: message.exchange.clone(),
                routing_key: message.routing_key.clone(),
            })),
        );
        self.writer.header_payload(id, &message.header_payload);
        self.writer.body(id, message.body.bytes(), self.frame_max);
    }
}

/// What a session's publish is, by its number ([`Connection::resent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resent {
    /// Not processed before: counted and routed as usual.
    New,
    /// Processed before: dropped (and confirmed again).
    Dropped,
    /// Processed before with an unknown fate: routed again, confirmed under this number.
    Again(u64),
}
