//! The upstream channel of a proxied client channel: for each primary a client channel
//! uses, one channel on the link to that member, opened on first use, acting in the
//! client's name — consumers there with the client's prefetch as credit, basic.get,
//! purge, passive declares — and closed with the client's channel, so that what the client
//! had not acked goes back to its queue on the primary in its original order.
//!
//! One task per upstream channel runs its [`Command`]s in order (an ack never overtakes
//! the delivery it answers, a get is answered in its turn); one task per proxied consumer
//! hands its deliveries to the client connection's mailbox.

use super::link::Links;
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
use tokio::sync::{mpsc, oneshot};

/// The upstream prefetch of a proxied consumer whose client set none (or consumes with
/// no-ack): the proxy must never hold more than a bounded number of messages that its
/// client has not taken (DESIGN §4: no "stuck messages"), so credit is always finite.
pub const DEFAULT_CREDIT: u16 = 4096;

/// Most deliveries a consumer's pump hands to the connection in one mailbox push.
const PUMP_BATCH: usize = 256;

/// A delivery from a primary for a proxied consumer of the client channel `channel`.
#[derive(Debug)]
pub struct ProxiedDelivery {
    /// Client channel number.
    pub channel: u16,
    /// Consumer tag (the same upstream and to the client).
    pub consumer_tag: Arc<str>,
    /// The consumer's serial number on its connection (a tag may be used again).
    pub serial: u64,
    /// The queue.
    pub queue: Arc<str>,
    /// The member it came from.
    pub primary: Arc<str>,
    /// Delivery tag on the upstream channel.
    pub upstream_tag: u64,
    /// Delivered before (as the primary says).
    pub redelivered: bool,
    /// The message as the primary delivered it.
    pub message: Arc<Message>,
    /// The client consumes with no-ack: the proxy acks upstream once it wrote the delivery.
    pub no_ack: bool,
}

/// A message basic.get took from a primary.
#[derive(Debug)]
pub struct ProxiedGet {
    /// Delivery tag on the upstream channel.
    pub upstream_tag: u64,
    /// Delivered before.
    pub redelivered: bool,
    /// Messages left in the queue.
    pub message_count: u32,
    /// The message.
    pub message: Arc<Message>,
}

/// A proxied consumer ended without its client asking: the primary cancelled it (its queue
/// was deleted) or the upstream channel failed.
#[derive(Debug)]
pub struct ProxiedEnd {
    /// Client channel number.
    pub channel: u16,
    /// Consumer tag.
    pub consumer_tag: Arc<str>,
    /// The consumer's serial number on its connection.
    pub serial: u64,
}

/// A reply the client channel waits for.
pub type Reply<T> = oneshot::Sender<Result<T, AmqpError>>;

/// What a client channel asks of its upstream channel, in order.
#[derive(Debug)]
pub enum Command {
    /// basic.qos with the client's prefetch, then basic.consume.
    Consume {
        /// Queue.
        queue: String,
        /// Consumer tag (made by the proxy when the client left it empty).
        tag: String,
        /// The client's no-ack (upstream always acks, see [`DEFAULT_CREDIT`]).
        no_ack: bool,
        /// Exclusive consumer.
        exclusive: bool,
        /// Consumer arguments (priority, single-active-consumer …).
        arguments: FieldTable,
        /// Upstream prefetch.
        credit: u16,
        /// The consumer's serial number on its connection, carried by its deliveries.
        serial: u64,
        /// consume-ok or the primary's error.
        reply: Reply<()>,
    },
    /// basic.cancel, then the requeue of `requeue` (deliveries the proxy held for the
    /// consumer, see `Connection::release_held`) processed before the reply: once the
    /// client has cancel-ok they are ready in their queue again, and the cancelled consumer
    /// cannot be handed them back meanwhile.
    Cancel {
        /// Consumer tag.
        tag: String,
        /// Upstream delivery tags to requeue.
        requeue: Vec<u64>,
        /// cancel-ok.
        reply: Reply<()>,
    },
    /// basic.get.
    Get {
        /// Queue.
        queue: String,
        /// No-ack.
        no_ack: bool,
        /// The message, or none.
        reply: Reply<Option<ProxiedGet>>,
    },
    /// queue.purge: messages purged.
    Purge {
        /// Queue.
        queue: String,
        /// purge-ok's count.
        reply: Reply<u32>,
    },
    /// queue.delete, decided by the primary (it alone knows whether the queue is unused or
    /// empty) and carried out there as a cluster op: the messages deleted.
    Delete {
        /// Queue.
        queue: String,
        /// Refuse if the queue has consumers.
        if_unused: bool,
        /// Refuse if the queue holds messages.
        if_empty: bool,
        /// delete-ok's count.
        reply: Reply<u32>,
    },
    /// Passive queue.declare: (messages, consumers).
    Counts {
        /// Queue.
        queue: String,
        /// declare-ok's counts.
        reply: Reply<(u32, u32)>,
    },
    /// A round trip after the settlements sent before it: answered once the primary has
    /// processed them (a `basic.qos` repeating the channel's last one).
    Barrier {
        /// Answered after the round trip.
        reply: Reply<()>,
    },
    /// The client settled a delivery that came through this channel.
    Settle {
        /// Upstream delivery tag.
        tag: u64,
        /// How.
        settlement: Settlement,
    },
}

/// The handle of one upstream channel; dropping it closes the channel on the primary.
#[derive(Debug, Clone)]
pub struct Upstream {
    commands: mpsc::UnboundedSender<Command>,
}

/// Where an upstream channel is and whom it serves.
pub struct Target {
    /// The links of this member.
    pub links: Arc<Links>,
    /// Node id of the primary.
    pub primary: Arc<str>,
    /// Vhost.
    pub vhost: String,
    /// Client channel number.
    pub channel: u16,
    /// The client connection's mailbox.
    pub outbox: Arc<Outbox>,
    /// The newest cluster change applied on this member, which the primary applies before
    /// the channel's next command ([`super::catch_up`]).
    pub applied: Arc<super::catch_up::Applied>,
}

impl Upstream {
    /// Starts the task of a new upstream channel (it connects on its first command).
    pub fn spawn(target: Target) -> Self {
        let (commands, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(target, rx));
        Self { commands }
    }

    /// Queues a command; a command sent after the channel failed is answered with the
    /// failure by the dropped reply (see [`gone`]).
    pub fn send(&self, command: Command) {
        let _ = self.commands.send(command);
    }
}

/// The error a reply that never came stands for: the upstream channel failed.
pub fn gone(primary: &str) -> AmqpError {
    AmqpError::new(
        codes::CONNECTION_FORCED,
        format!(
            "the link to cluster member '{}' failed",
            super::link::redacted(primary)
        ),
    )
}

/// A lapin error as the AMQP error the client gets: the other broker's own reply code and
/// text, or 404 naming the primary when it could not be reached.
fn amqp_error(primary: &str, e: &lapin::Error) -> AmqpError {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => {
            AmqpError::new(amqp.get_id(), amqp.get_message().to_string())
        }
        _ => AmqpError::new(
            codes::NOT_FOUND,
            format!(
                "the queue's primary, '{}', cannot be reached: {e}",
                super::link::redacted(primary)
            ),
        ),
    }
}

async fn run(t: Target, mut commands: mpsc::UnboundedReceiver<Command>) {
    let ch = match t.links.channel(&t.primary, &t.vhost).await {
        Ok(ch) => ch,
        Err(e) => {
            let err = AmqpError::new(
                codes::NOT_FOUND,
                format!("the queue's primary is unavailable: {e}"),
            );
            while let Some(c) = commands.recv().await {
                fail(c, &err);
            }
            return;
        }
    };
    let unsettled = Unsettled::default();
    // The prefetch of the channel's latest consumer, which a barrier repeats.
    let mut last_credit: u16 = 0;
    let mut failed: Option<AmqpError> = None;
    let mut next: Option<Command> = None;
    // The newest cluster change this channel told the primary about.
    let mut told = 0;
    loop {
        let c = match next.take() {
            Some(c) => c,
            None => match commands.recv().await {
                Some(c) => c,
                None => break,
            },
        };
        if let Some(err) = &failed {
            fail(c, err);
            continue;
        }
        if let Command::Settle { tag, settlement } = c {
            // Settlements queued together go out together: runs of acks as one
            // `multiple` ack where that names exactly them.
            let mut batch = vec![(tag, settlement)];
            while let Ok(c) = commands.try_recv() {
                match c {
                    Command::Settle { tag, settlement } => batch.push((tag, settlement)),
                    other => {
                        next = Some(other);
                        break;
                    }
                }
            }
            settle(&ch, &unsettled, batch).await;
            continue;
        }
        let needed = t.applied.index();
        if needed > told && !super::link::is_foreign(&t.primary) {
            if let Err(e) = super::catch_up::catch_up(&ch, needed).await {
                let err = amqp_error(&t.primary, &e);
                fail(c, &err);
                failed = Some(err);
                continue;
            }
            told = needed;
        }
        if let Err(e) = execute(&t, &ch, &unsettled, &mut last_credit, c).await {
            failed = Some(e);
        }
    }
    // The client channel closed: close ours, so the primary requeues what it delivered.
    let _ = ch
        .close(codes::REPLY_SUCCESS, "client channel closed".into())
        .await;
}

/// Upstream delivery tags not yet settled, shared by the channel's task and its consumers'
/// pumps: an ack may be sent as `multiple` only when no unsettled tag below it remains.
type Unsettled = Arc<parking_lot::Mutex<BTreeSet<u64>>>;

/// Sends a batch of settlements in order, without waiting for the socket: their frames are
/// queued on the first poll (in order), and the link writes them with what follows.
async fn settle(ch: &lapin::Channel, unsettled: &Unsettled, batch: Vec<(u64, Settlement)>) {
    let mut acks: Vec<u64> = Vec::new();
    for (tag, settlement) in batch {
        unsettled.lock().remove(&tag);
        if settlement == Settlement::Ack {
            acks.push(tag);
            continue;
        }
        send_acks(ch, unsettled, &mut acks).await;
        let nack = ch.basic_nack(
            tag,
            BasicNackOptions {
                multiple: false,
                requeue: settlement == Settlement::Requeue,
            },
        );
        queue_frames(nack).await;
    }
    send_acks(ch, unsettled, &mut acks).await;
}

async fn send_acks(ch: &lapin::Channel, unsettled: &Unsettled, acks: &mut Vec<u64>) {
    let Some(&last) = acks.iter().max() else {
        return;
    };
    let covers_all = unsettled.lock().range(..last).next().is_none();
    if covers_all && acks.len() > 1 {
        queue_frames(ch.basic_ack(last, BasicAckOptions { multiple: true })).await;
    } else {
        for &tag in acks.iter() {
            queue_frames(ch.basic_ack(tag, BasicAckOptions::default())).await;
        }
    }
    acks.clear();
}

/// Polls a lapin send once — which queues its frames — and lets it go: a failure shows as
/// the channel's state on the next command.
async fn queue_frames(send: impl Future<Output = lapin::Result<()>>) {
    let mut send = std::pin::pin!(send);
    let _ = futures::poll!(send.as_mut());
}

/// Runs one command; an error that broke the upstream channel is returned (after it was
/// given to the command's reply).
async fn execute(
    t: &Target,
    ch: &lapin::Channel,
    unsettled: &Unsettled,
    last_credit: &mut u16,
    c: Command,
) -> Result<(), AmqpError> {
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
                        unsettled.clone(),
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
                    settle(ch, unsettled, batch.collect()).await;
                    // A round trip after the nacks: the primary has processed them.
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
                            unsettled.lock().insert(d.delivery_tag);
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
        Command::Settle { tag, settlement } => {
            settle(ch, unsettled, vec![(tag, settlement)]).await;
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

/// Gives `result` to `reply`; a failure is also the channel's (AMQP closes a channel on
/// every error its peer reports).
fn answer<T>(reply: Reply<T>, result: Result<T, AmqpError>) -> Result<(), AmqpError> {
    let failure = result.as_ref().err().cloned();
    let _ = reply.send(result);
    failure.map_or(Ok(()), Err)
}

fn fail(c: Command, err: &AmqpError) {
    match c {
        Command::Consume { reply, .. } | Command::Cancel { reply, .. } => {
            let _ = reply.send(Err(err.clone()));
        }
        Command::Get { reply, .. } => {
            let _ = reply.send(Err(err.clone()));
        }
        Command::Purge { reply, .. } | Command::Delete { reply, .. } => {
            let _ = reply.send(Err(err.clone()));
        }
        Command::Counts { reply, .. } => {
            let _ = reply.send(Err(err.clone()));
        }
        Command::Barrier { reply } => {
            let _ = reply.send(Err(err.clone()));
        }
        Command::Settle { .. } => {}
    }
}

/// A message as a primary (or a foreign exchange's feed) delivered it, with its content
/// header encoded once for the client's delivery.
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
            unsettled.lock().insert(upstream_tag);
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
                    tracing::warn!(%primary, %queue, error = %e.text, "dropping a proxied delivery the broker cannot take");
                    settle(&ch, &unsettled, vec![(upstream_tag, Settlement::Ack)]).await;
                }
            }
        }
        outbox.push(|p| p.proxied.append(&mut batch));
    }
    outbox.push(|p| {
        p.proxied_ended.push(ProxiedEnd {
            channel,
            consumer_tag: tag,
            serial,
        })
    });
}
