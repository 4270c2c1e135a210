//! The upstream channel of a proxied client channel: for each primary a client channel
//! uses, one channel on the link to that member, opened on first use, acting in the
//! client's name — consumers there with the client's prefetch as credit, basic.get,
//! purge, passive declares — and closed with the client's channel, so that what the client
//! had not acked goes back to its queue on the primary in its original order.
//!
//! One task per upstream channel runs its [`Command`]s in order (an ack never overtakes
//! the delivery it answers, a get is answered in its turn). To a cluster member the channel
//! is one of the member's upstream link ([`super::upstream_link`], the broker's own codec),
//! whose reader hands deliveries straight to the client connection's mailbox; to a foreign
//! broker it is lapin's ([`super::upstream_foreign`]).

use super::link::{Links, is_foreign};
use super::upstream_foreign::ForeignChannel;
use super::upstream_link::{ClientConsumer, Replied, UpstreamChannel};
use crate::amqp::{AMQPClass, FieldTable, basic, codes, queue};
use crate::broker::outbox::Outbox;
use crate::core::vhost::Settlement;
use crate::core::{AmqpError, Message};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::{mpsc, oneshot};

/// The upstream prefetch of a proxied consumer whose client set none (or consumes with
/// no-ack): the proxy must never hold more than a bounded number of messages that its
/// client has not taken (DESIGN §4: no "stuck messages"), so credit is always finite.
pub const DEFAULT_CREDIT: u16 = 4096;

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
    /// The client settled deliveries that came through this channel.
    Settle {
        /// Upstream delivery tags and how, in the client's order.
        settlements: Vec<(u64, Settlement)>,
    },
}

/// The handle of one upstream channel; dropping it closes the channel on the primary.
#[derive(Debug, Clone)]
pub struct Upstream {
    commands: mpsc::UnboundedSender<Command>,
    /// Set by [`Upstream::detach`].
    detached: Arc<AtomicBool>,
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
        let detached = Arc::new(AtomicBool::new(false));
        tokio::spawn(run(target, rx, detached.clone()));
        Self { commands, detached }
    }

    /// The client's connection was lost and its session is kept: when the handle is
    /// dropped, the channel closes telling the primary so (reply code 330, KEEP_SESSION),
    /// and the primary holds for the session what it had delivered here — the client,
    /// resuming elsewhere, may have seen it (`core::queue::holds`).
    pub fn detach(&self) {
        self.detached.store(true, Ordering::Release);
    }

    /// Queues a command; a command sent after the channel failed is answered with the
    /// failure by the dropped reply (see [`gone`]).
    pub fn send(&self, command: Command) {
        let _ = self.commands.send(command);
    }
}

/// How the refusal of a command whose primary could not be reached begins.
const UNREACHABLE: &str = "the queue's primary, '";

/// What follows the primary's name in that refusal.
const CANNOT_BE_REACHED: &str = "', cannot be reached: ";

/// The refusal (404) of a command whose primary, `member`, could not be reached — the link
/// would not open, or closed — for `reason`. Clients read it: the failover client asks for
/// the queue again while it gets it (`client/src/recovery.rs`).
pub fn unreachable(member: &str, reason: impl std::fmt::Display) -> AmqpError {
    AmqpError::new(
        codes::NOT_FOUND,
        format!("{UNREACHABLE}{member}{CANNOT_BE_REACHED}{reason}"),
    )
}

/// Whether `e` is an [`unreachable`] refusal: the cluster may name another primary a moment
/// later.
pub fn is_unreachable(e: &AmqpError) -> bool {
    e.code == codes::NOT_FOUND
        && e.text.starts_with(UNREACHABLE)
        && e.text.contains(CANNOT_BE_REACHED)
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

/// An upstream channel: on a member's upstream link, or lapin's to a foreign broker.
enum Channel {
    Member(UpstreamChannel),
    Foreign(ForeignChannel),
}

async fn run(t: Target, mut commands: mpsc::UnboundedReceiver<Command>, detached: Arc<AtomicBool>) {
    let opened = if is_foreign(&t.primary) {
        ForeignChannel::open(&t)
            .await
            .map(Channel::Foreign)
            .map_err(|e| e.to_string())
    } else {
        match t.links.upstream_link(&t.primary, &t.vhost).await {
            Ok(link) => link
                .open_channel()
                .await
                .map(Channel::Member)
                .map_err(|e| e.text),
            Err(e) => Err(e.to_string()),
        }
    };
    let ch = match opened {
        Ok(ch) => ch,
        Err(e) => {
            let err = unreachable(&super::link::redacted(&t.primary), e);
            while let Some(c) = commands.recv().await {
                fail(c, &err);
            }
            return;
        }
    };
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
        if let Command::Settle { settlements } = c {
            // Settlements queued together go out together: runs of acks as one
            // `multiple` ack where that names exactly them.
            let mut batch = settlements;
            while let Ok(c) = commands.try_recv() {
                match c {
                    Command::Settle { settlements } => batch.extend(settlements),
                    other => {
                        next = Some(other);
                        break;
                    }
                }
            }
            match &ch {
                Channel::Member(m) => m.settle(batch),
                Channel::Foreign(f) => f.settle(batch).await,
            }
            continue;
        }
        let result = match &ch {
            Channel::Member(m) => {
                // No catch-up to a foreign broker: it has no cluster changes to apply.
                let needed = t.applied.index();
                if needed > told {
                    if let Err(err) = catch_up(m, needed).await {
                        fail(c, &err);
                        failed = Some(err);
                        continue;
                    }
                    told = needed;
                }
                execute(&t, m, &mut last_credit, c).await
            }
            Channel::Foreign(f) => f.execute(&t, &mut last_credit, c).await,
        };
        if let Err(e) = result {
            failed = Some(e);
        }
    }
    // The client channel closed: close ours, so the primary requeues what it delivered.
    match ch {
        Channel::Member(m) if detached.load(Ordering::Acquire) => m.close_for_kept_session(),
        Channel::Member(m) => m.close(),
        Channel::Foreign(f) => f.close().await,
    }
}

/// Tells the member that what follows on the channel needs the cluster change `index`
/// applied ([`super::catch_up`]), and waits until it is.
async fn catch_up(ch: &UpstreamChannel, index: u64) -> Result<(), AmqpError> {
    ch.call(super::catch_up::declare(index)).await.map(drop)
}

/// basic.qos with `credit` as a per-consumer prefetch.
fn qos(credit: u16) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
        prefetch_count: credit,
        global: false,
    }))
}

/// Runs one command on a member's upstream channel; an error that broke the upstream
/// channel is returned (after it was given to the command's reply).
async fn execute(
    t: &Target,
    ch: &UpstreamChannel,
    last_credit: &mut u16,
    c: Command,
) -> Result<(), AmqpError> {
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
            let consume = basic::Consume {
                queue: queue.as_str().into(),
                consumer_tag: tag.as_str().into(),
                no_local: false,
                no_ack: false,
                exclusive,
                nowait: false,
                arguments,
            };
            let to = ClientConsumer {
                outbox: t.outbox.clone(),
                channel: t.channel,
                tag: tag.into(),
                serial,
                queue: queue.into(),
                primary: t.primary.clone(),
                no_ack,
            };
            let started = match ch.call(qos(credit)).await {
                Ok(_) => ch.consume(consume, to).await,
                Err(e) => Err(e),
            };
            answer(reply, started)
        }
        Command::Cancel {
            tag,
            requeue,
            reply,
        } => {
            let cancel = AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                consumer_tag: tag.as_str().into(),
                nowait: false,
            }));
            let processed = match ch.call(cancel).await {
                Ok(_) if !requeue.is_empty() => {
                    ch.settle(
                        requeue
                            .into_iter()
                            .map(|t| (t, Settlement::Requeue))
                            .collect(),
                    );
                    // A round trip after the nacks: the primary has processed them.
                    ch.call(qos(*last_credit)).await.map(drop)
                }
                other => other.map(drop),
            };
            answer(reply, processed)
        }
        Command::Get {
            queue,
            no_ack,
            reply,
        } => {
            let get = AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: queue.as_str().into(),
                no_ack,
            }));
            let got = ch.call(get).await.map(|r| match r {
                Replied::Got(g) => {
                    if !no_ack {
                        ch.track(g.upstream_tag);
                    }
                    Some(g)
                }
                Replied::Method(_) => None,
            });
            answer(reply, got)
        }
        Command::Purge { queue, reply } => {
            let purge = AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
                queue: queue.as_str().into(),
                nowait: false,
            }));
            let purged = ch.call(purge).await.and_then(|r| match r {
                Replied::Method(AMQPClass::Queue(queue::AMQPMethod::PurgeOk(ok))) => {
                    Ok(ok.message_count)
                }
                other => Err(ch.unexpected("queue.purge-ok", &other)),
            });
            answer(reply, purged)
        }
        Command::Delete {
            queue,
            if_unused,
            if_empty,
            reply,
        } => {
            let delete = AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
                queue: queue.as_str().into(),
                if_unused,
                if_empty,
                nowait: false,
            }));
            let deleted = ch.call(delete).await.and_then(|r| match r {
                Replied::Method(AMQPClass::Queue(queue::AMQPMethod::DeleteOk(ok))) => {
                    Ok(ok.message_count)
                }
                other => Err(ch.unexpected("queue.delete-ok", &other)),
            });
            answer(reply, deleted)
        }
        Command::Counts { queue, reply } => {
            let declare = AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: queue.as_str().into(),
                passive: true,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::default(),
            }));
            let counted = ch.call(declare).await.and_then(|r| match r {
                Replied::Method(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok))) => {
                    Ok((ok.message_count, ok.consumer_count))
                }
                other => Err(ch.unexpected("queue.declare-ok", &other)),
            });
            answer(reply, counted)
        }
        Command::Settle { settlements } => {
            ch.settle(settlements);
            Ok(())
        }
        Command::Barrier { reply } => answer(reply, ch.call(qos(*last_credit)).await.map(drop)),
    }
}

/// Gives `result` to `reply`; a failure is also the channel's (AMQP closes a channel on
/// every error its peer reports).
pub(super) fn answer<T>(reply: Reply<T>, result: Result<T, AmqpError>) -> Result<(), AmqpError> {
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

/// A settlement as it goes upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upstreamed {
    /// basic.ack of `tag`, and with `multiple` of every unsettled tag below it.
    Ack {
        /// Upstream delivery tag.
        tag: u64,
        /// Every unsettled tag up to `tag`.
        multiple: bool,
    },
    /// basic.nack of `tag` alone.
    Nack {
        /// Upstream delivery tag.
        tag: u64,
        /// Back to its queue (else dropped or dead-lettered).
        requeue: bool,
    },
}

/// The frames that carry a batch of settlements upstream, in the batch's order, taking
/// their tags out of `unsettled` (the channel's delivered and not yet settled tags). Acks
/// between two nacks go together: those below the lowest tag still unsettled as one
/// `multiple` ack — it names exactly them, since nothing below it is left to name — the
/// rest one by one. A nack's tag leaves `unsettled` only after the acks before it went, so
/// a `multiple` ack never covers a tag that a later nack names.
pub fn settle_plan(
    unsettled: &mut BTreeSet<u64>,
    batch: Vec<(u64, Settlement)>,
) -> Vec<Upstreamed> {
    let mut frames = Vec::new();
    let mut acks: Vec<u64> = Vec::new();
    for (tag, settlement) in batch {
        if settlement == Settlement::Ack {
            unsettled.remove(&tag);
            acks.push(tag);
            continue;
        }
        plan_acks(unsettled, &mut acks, &mut frames);
        unsettled.remove(&tag);
        frames.push(Upstreamed::Nack {
            tag,
            requeue: settlement == Settlement::Requeue,
        });
    }
    plan_acks(unsettled, &mut acks, &mut frames);
    frames
}

fn plan_acks(unsettled: &BTreeSet<u64>, acks: &mut Vec<u64>, frames: &mut Vec<Upstreamed>) {
    acks.sort_unstable();
    let floor = unsettled.first().copied().unwrap_or(u64::MAX);
    let below = acks.partition_point(|&t| t < floor);
    match below {
        0 => {}
        1 => frames.push(Upstreamed::Ack {
            tag: acks[0],
            multiple: false,
        }),
        n => frames.push(Upstreamed::Ack {
            tag: acks[n - 1],
            multiple: true,
        }),
    }
    for &tag in &acks[below..] {
        frames.push(Upstreamed::Ack {
            tag,
            multiple: false,
        });
    }
    acks.clear();
}

#[cfg(test)]
mod tests {
    use super::*;
    use Settlement::{Ack, Reject, Requeue};

    fn plan(unsettled: &[u64], batch: &[(u64, Settlement)]) -> (Vec<Upstreamed>, Vec<u64>) {
        let mut u: BTreeSet<u64> = unsettled.iter().copied().collect();
        let frames = settle_plan(&mut u, batch.to_vec());
        (frames, u.into_iter().collect())
    }

    fn ack(tag: u64, multiple: bool) -> Upstreamed {
        Upstreamed::Ack { tag, multiple }
    }

    #[test]
    fn a_run_of_acks_with_nothing_unsettled_below_is_one_multiple_ack() {
        let (frames, left) = plan(&[1, 2, 3, 4, 5], &[(3, Ack), (1, Ack), (2, Ack)]);
        assert_eq!(frames, vec![ack(3, true)]);
        assert_eq!(left, vec![4, 5]);
    }

    #[test]
    fn acks_above_an_unsettled_tag_go_one_by_one() {
        // 3 is still with the client: a multiple ack of 5 would ack it too.
        let (frames, left) = plan(&[1, 2, 3, 4, 5], &[(1, Ack), (2, Ack), (4, Ack), (5, Ack)]);
        assert_eq!(frames, vec![ack(2, true), ack(4, false), ack(5, false)]);
        assert_eq!(left, vec![3]);
        let (frames, _) = plan(&[7], &[(7, Ack)]);
        assert_eq!(frames, vec![ack(7, false)], "one ack is never multiple");
    }

    #[test]
    fn a_multiple_ack_never_covers_a_tag_a_later_nack_names() {
        // The client acked 2 and 3, then rejected 1: 1 must reach the primary as a nack.
        let (frames, left) = plan(&[1, 2, 3], &[(2, Ack), (3, Ack), (1, Requeue)]);
        assert_eq!(
            frames,
            vec![
                ack(2, false),
                ack(3, false),
                Upstreamed::Nack {
                    tag: 1,
                    requeue: true
                }
            ]
        );
        assert!(left.is_empty());
        // Acks after the nack may use it: 1 is settled by then.
        let (frames, _) = plan(&[1, 2, 3, 4], &[(1, Reject), (2, Ack), (3, Ack)]);
        assert_eq!(
            frames,
            vec![
                Upstreamed::Nack {
                    tag: 1,
                    requeue: false
                },
                ack(3, true)
            ]
        );
    }
}
