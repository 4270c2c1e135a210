//! Upstream channels to foreign brokers (a `qpid.cluster.proxy` URI naming another AMQP
//! broker): the same [`Command`]s as on a cluster member's upstream link, through lapin, a
//! general client that any AMQP 0-9-1 broker understands. One task per proxied consumer
//! (its pump) hands the consumer's deliveries to the client connection's mailbox.

use super::upstream::{
    Command, ProxiedDelivery, ProxiedGet, Target, Upstreamed, answer, settle_plan,
};
use crate::amqp::writer::FrameWriter;
use crate::amqp::{FieldTable, codes};
use crate::broker::outbox::Outbox;
use crate::core::vhost::Settlement;
use crate::core::{AmqpError, Message};
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions,
    BasicQosOptions, QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
};
use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;

/// Most deliveries a consumer's pump hands to the connection in one mailbox push.
const PUMP_BATCH: usize = super::upstream_link::PUMP_BATCH;

/// Upstream delivery tags not yet settled, shared by the channel's task and its consumers'
/// pumps: an ack may be sent as `multiple` only when no unsettled tag below it remains.
type Unsettled = Arc<parking_lot::Mutex<BTreeSet<u64>>>;

/// An upstream channel on a foreign broker.
pub struct ForeignChannel {
    ch: lapin::Channel,
    unsettled: Unsettled,
}

/// A lapin error as the AMQP error the client gets: the other broker's own reply code and
/// text, or 404 naming the broker when it could not be reached.
fn amqp_error(primary: &str, e: &lapin::Error) -> AmqpError {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => {
            AmqpError::new(amqp.get_id(), amqp.get_message().to_string())
        }
        _ => super::upstream::unreachable(&super::link::redacted(primary), e),
    }
}

impl ForeignChannel {
    /// Opens a channel on the link to the foreign broker of `t`.
    pub async fn open(t: &Target) -> Result<Self, super::link::LinkError> {
        Ok(Self {
            ch: t.links.channel(&t.primary, &t.vhost).await?,
            unsettled: Unsettled::default(),
        })
    }

    /// Sends a batch of settlements in order, without waiting for the socket: their frames
    /// are queued on the first poll (in order), and the link writes them with what follows.
    pub async fn settle(&self, batch: Vec<(u64, Settlement)>) {
        let frames = settle_plan(&mut self.unsettled.lock(), batch);
        for frame in frames {
            match frame {
                Upstreamed::Ack { tag, multiple } => {
                    queue_frames(self.ch.basic_ack(tag, BasicAckOptions { multiple })).await;
                }
                Upstreamed::Nack { tag, requeue } => {
                    let options = BasicNackOptions {
                        multiple: false,
                        requeue,
                    };
                    queue_frames(self.ch.basic_nack(tag, options)).await;
                }
            }
        }
    }

    /// Closes the channel: the other broker requeues what the client had not acked.
    pub async fn close(self) {
        let _ = self
            .ch
            .close(codes::REPLY_SUCCESS, "client channel closed".into())
            .await;
    }

    /// Runs one command; an error that broke the upstream channel is returned (after it was
    /// given to the command's reply).
    pub async fn execute(
        &self,
        t: &Target,
        last_credit: &mut u16,
        c: Command,
    ) -> Result<(), AmqpError> {
        let ch = &self.ch;
        let err = |e: lapin::Error| amqp_error(&t.primary, &e);
        match c {
            Command::Consume {
                queue,
                tag,
                no_ack,
                exclusive,
                arguments,
                credit,
                serial,
                reply,
            } => {
                *last_credit = credit;
                let started = async {
                    ch.basic_qos(credit, BasicQosOptions { global: false })
                        .await
                        .map_err(err)?;
                    ch.basic_consume(
                        queue.as_str().into(),
                        tag.as_str().into(),
                        BasicConsumeOptions {
                            exclusive,
                            ..BasicConsumeOptions::default()
                        },
                        arguments,
                    )
                    .await
                    .map_err(err)
                }
                .await;
                match started {
                    Ok(consumer) => {
                        let _ = reply.send(Ok(()));
                        tokio::spawn(pump(
                            consumer,
                            ch.clone(),
                            self.unsettled.clone(),
                            t.outbox.clone(),
                            Pumped {
                                channel: t.channel,
                                tag: tag.into(),
                                serial,
                                queue: queue.into(),
                                primary: t.primary.clone(),
                                no_ack,
                            },
                        ));
                        Ok(())
                    }
                    Err(e) => answer(reply, Err(e)),
                }
            }
            Command::Cancel {
                tag,
                requeue,
                reply,
            } => {
                let cancelled = ch
                    .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
                    .await;
                let processed = match cancelled {
                    Ok(()) if !requeue.is_empty() => {
                        let batch = requeue.into_iter().map(|t| (t, Settlement::Requeue));
                        self.settle(batch.collect()).await;
                        // A round trip after the nacks: the broker has processed them.
                        ch.basic_qos(*last_credit, BasicQosOptions { global: false })
                            .await
                    }
                    other => other,
                };
                answer(reply, processed.map_err(err))
            }
            Command::Get {
                queue,
                no_ack,
                reply,
            } => {
                let got = ch
                    .basic_get(queue.as_str().into(), BasicGetOptions { no_ack })
                    .await
                    .map_err(err)
                    .and_then(|got| {
                        got.map(|g| {
                            let d = g.delivery;
                            if !no_ack {
                                self.unsettled.lock().insert(d.delivery_tag);
                            }
                            Ok(ProxiedGet {
                                upstream_tag: d.delivery_tag,
                                redelivered: d.redelivered,
                                message_count: g.message_count,
                                message: Arc::new(message(
                                    d.exchange,
                                    d.routing_key,
                                    d.properties,
                                    d.data,
                                )?),
                            })
                        })
                        .transpose()
                    });
                answer(reply, got)
            }
            Command::Purge { queue, reply } => answer(
                reply,
                ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
                    .await
                    .map_err(err),
            ),
            Command::Delete {
                queue,
                if_unused,
                if_empty,
                reply,
            } => answer(
                reply,
                ch.queue_delete(
                    queue.as_str().into(),
                    QueueDeleteOptions {
                        if_unused,
                        if_empty,
                        nowait: false,
                    },
                )
                .await
                .map_err(err),
            ),
            Command::Counts { queue, reply } => answer(
                reply,
                ch.queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map(|q| (q.message_count(), q.consumer_count()))
                .map_err(err),
            ),
            Command::Settle { settlements } => {
                self.settle(settlements).await;
                Ok(())
            }
            Command::Barrier { reply } => answer(
                reply,
                ch.basic_qos(*last_credit, BasicQosOptions { global: false })
                    .await
                    .map_err(err),
            ),
        }
    }
}

/// Polls a lapin send once — which queues its frames — and lets it go: a failure shows as
/// the channel's state on the next command.
async fn queue_frames(send: impl Future<Output = lapin::Result<()>>) {
    let mut send = std::pin::pin!(send);
    let _ = futures::poll!(send.as_mut());
}

/// A message as a foreign broker (or a foreign exchange's feed) delivered it, with its
/// content header encoded once for the client's delivery.
pub(crate) fn message(
    exchange: lapin::types::ShortString,
    routing_key: lapin::types::ShortString,
    properties: crate::amqp::Properties,
    body: Vec<u8>,
) -> Result<Message, AmqpError> {
    let header = FrameWriter::encode_header_payload(body.len() as u64, &properties);
    Message::new(exchange, routing_key, properties, header, Bytes::from(body))
        .map_err(|e| AmqpError::precondition(e.0))
}

/// Whose deliveries a pump hands on.
struct Pumped {
    channel: u16,
    tag: Arc<str>,
    serial: u64,
    queue: Arc<str>,
    primary: Arc<str>,
    no_ack: bool,
}

/// Hands one proxied consumer's deliveries to the client connection, until the consumer
/// ends (cancelled by either side, or the channel closed).
async fn pump(
    mut consumer: lapin::Consumer,
    ch: lapin::Channel,
    unsettled: Unsettled,
    outbox: Arc<Outbox>,
    c: Pumped,
) {
    let Pumped {
        channel,
        tag,
        serial,
        queue,
        primary,
        no_ack,
    } = c;
    let foreign = ForeignChannel { ch, unsettled };
    while let Some(Ok(first)) = consumer.next().await {
        // What else already arrived goes to the connection in the same mailbox push.
        let mut arrived = vec![first];
        while arrived.len() < PUMP_BATCH {
            match consumer.next().now_or_never() {
                Some(Some(Ok(d))) => arrived.push(d),
                _ => break,
            }
        }
        let mut batch = Vec::with_capacity(arrived.len());
        for d in arrived {
            let upstream_tag = d.delivery_tag;
            foreign.unsettled.lock().insert(upstream_tag);
            match message(d.exchange, d.routing_key, d.properties, d.data) {
                Ok(m) => batch.push(ProxiedDelivery {
                    channel,
                    consumer_tag: tag.clone(),
                    serial,
                    queue: queue.clone(),
                    primary: primary.clone(),
                    upstream_tag,
                    redelivered: d.redelivered,
                    message: Arc::new(m),
                    no_ack,
                }),
                Err(e) => {
                    tracing::warn!(primary = %super::link::redacted(&primary), %queue, error = %e.text, "dropping a proxied delivery the broker cannot take");
                    foreign.settle(vec![(upstream_tag, Settlement::Ack)]).await;
                }
            }
        }
        outbox.push(|p| p.proxied.append(&mut batch));
    }
    outbox.push(|p| {
        p.proxied_ended.push(super::upstream::ProxiedEnd {
            channel,
            consumer_tag: tag,
            serial,
        })
    });
}
