//! How messages reach consumers: basic.consume and basic.cancel, the windows that hold
//! deliveries back (qos prefetch, unwritten bytes), dispatch round-robin or to a
//! single active consumer, and basic.get for clients that pull.

use super::effects::apply;
use super::expiry::expire_head;
use super::{DeadLetter, Delivery, Effects, VHost};
use crate::amqp::codes;
use crate::core::FastHashMap;
use crate::core::channel::{ChannelKey, ChannelState, Consumer, Unacked};
use crate::core::error::{AmqpError, CoreResult};
use crate::core::message::Message;
use crate::core::ops::{OpKind, SessionDelivery};
use crate::core::producers::producer_of;
use crate::core::queue::{ConsumerRef, Entry, Queue};
use std::sync::Arc;

/// basic.consume, decoded.
#[derive(Debug, Clone, Default)]
pub struct Consume {
    /// Queue name.
    pub queue: String,
    /// Tag; empty asks the server to make one up.
    pub tag: String,
    /// No acks expected.
    pub no_ack: bool,
    /// No other consumer may use the queue meanwhile.
    pub exclusive: bool,
    /// A resumed session's consumer, created again under its tag: the deliveries its
    /// predecessor left unacknowledged on the channel go to it again first, under their tags
    /// and as first sent, before anything new — so that its client gets what the lost
    /// connection never delivered, in tag order (`docs/sessions.md`).
    pub resend_unacked: bool,
    /// Its priority (`x-priority`, RabbitMQ's consumer priorities): a queue hands its
    /// messages to the highest-priority consumers that have room, round-robin among them;
    /// lower ones get messages only while every higher one is full. 0 by default.
    pub priority: i32,
    /// Another member's pull of a fragmented queue's messages
    /// ([`crate::core::fragments::PULL_ARGUMENT`]): not a consumer of the queue's own, so
    /// left out of its consumer counts.
    pub pull: bool,
    /// The resumable session whose consumer this is (its own connection's, or the one a
    /// proxying member names, [`crate::core::SESSION_ARGUMENT`]): what it is delivered is
    /// held for it should the delivery come back unsettled with a lost member
    /// (`core::queue::holds`).
    pub session: Option<Arc<str>>,
    /// Its client recognises, by their identity, deliveries its application already had
    /// (the failover client, capability `ringmq.recognises_redeliveries`; over a link,
    /// [`crate::core::RECOGNISES_ARGUMENT`]): a message held for its session comes back
    /// under the flag of the delivery that was lost (`core::queue::holds`).
    pub recognises_redeliveries: bool,
}

/// Reply to basic.get with a message.
#[derive(Debug, Clone)]
pub struct GetOk {
    /// Delivery tag.
    pub delivery_tag: u64,
    /// Delivered before.
    pub redelivered: bool,
    /// Ready messages left.
    pub message_count: u32,
    /// The message.
    pub message: Arc<Message>,
}

impl VHost {
    /// basic.qos. `global` = false sets the window of consumers created from now on;
    /// true sets one window shared by the whole channel (RabbitMQ's reading of the flag).
    pub fn basic_qos(
        &mut self,
        key: ChannelKey,
        prefetch_bytes: u32,
        prefetch_count: u16,
        global: bool,
        now_ms: u64,
        fx: &mut Effects,
    ) {
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        if global {
            ch.channel_prefetch_count = prefetch_count.into();
            ch.channel_prefetch_bytes = prefetch_bytes.into();
        } else {
            ch.consumer_prefetch_count = prefetch_count.into();
            ch.consumer_prefetch_bytes = prefetch_bytes.into();
        }
        let queues = consumer_queues(ch);
        self.dispatch_all(queues, now_ms, fx);
    }

    /// The connection wrote `count` deliveries (`bytes` body bytes) of channel `key` to its
    /// socket: they no longer count against the channel's write window.
    pub fn delivered_written(
        &mut self,
        key: ChannelKey,
        count: u32,
        bytes: u64,
        now_ms: u64,
        fx: &mut Effects,
    ) {
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        let was_full = ch.write_window_full();
        ch.unwritten = ch.unwritten.saturating_sub(count);
        ch.unwritten_bytes = ch.unwritten_bytes.saturating_sub(bytes);
        if was_full {
            let queues = consumer_queues(ch);
            self.dispatch_all(queues, now_ms, fx);
        }
    }

    /// basic.consume: returns the consumer tag.
    pub fn basic_consume(
        &mut self,
        key: ChannelKey,
        c: Consume,
        now_ms: u64,
        fx: &mut Effects,
    ) -> CoreResult<Arc<str>> {
        let vhost = self.name.clone();
        let ch = self
            .channels
            .get(&key)
            .ok_or_else(|| AmqpError::new(codes::CHANNEL_ERROR, "channel not open"))?;
        // The tag is checked first, as RabbitMQ does: a reused tag is a connection error.
        if !c.tag.is_empty() && ch.consumers.contains_key(c.tag.as_str()) {
            return Err(AmqpError::new(
                codes::NOT_ALLOWED,
                format!("attempt to reuse consumer tag '{}'", c.tag),
            ));
        }
        let q = self.usable_queue(&c.queue, key.conn)?;
        let exclusive_in_use = || {
            AmqpError::access_refused(format!(
                "queue '{}' in vhost '{vhost}' in exclusive use",
                c.queue
            ))
        };
        // Another member's pulls of a fragmented queue are no consumers of the queue's own:
        // they neither make it in use nor are kept off by an exclusive consumer.
        if c.exclusive && !c.pull && q.consumer_count() > 0 {
            return Err(exclusive_in_use());
        }
        let has_exclusive = q.consumers.iter().filter(|r| !r.pull).any(|r| {
            self.channels
                .get(&r.channel)
                .and_then(|ch| ch.consumers.get(&r.tag))
                .is_some_and(|x| x.exclusive)
        });
        if has_exclusive {
            return Err(exclusive_in_use());
        }
        let qname = q.name.clone();
        let max = self.limits.max_consumers_per_channel;
        if max > 0
            && self
                .channels
                .get(&key)
                .is_some_and(|ch| ch.consumers.len() >= max)
        {
            return Err(AmqpError::precondition(format!(
                "reached maximum ({max}) of consumers per channel"
            )));
        }
        let tag: Arc<str> = if c.tag.is_empty() {
            self.fresh_name("amq.ctag-").into()
        } else {
            c.tag.into()
        };
        let ch = self.channels.get_mut(&key).expect("checked above");
        // A session's consumer created again after a resume, with its tag: the deliveries its
        // predecessor left unacked on the channel are its own again — they count against its
        // prefetch, and their acks against its count.
        let (unacked, unacked_bytes) = ch
            .unacked
            .iter()
            .filter(|u| u.consumer.as_deref() == Some(&*tag))
            .fold((0u32, 0u64), |(n, b), u| (n + 1, b + u.bytes));
        ch.consumers.insert(
            crate::core::own_key(&tag),
            Consumer {
                tag: tag.clone(),
                queue: qname.clone(),
                no_ack: c.no_ack,
                exclusive: c.exclusive,
                prefetch_count: ch.consumer_prefetch_count,
                prefetch_bytes: ch.consumer_prefetch_bytes,
                unacked,
                unacked_bytes,
            },
        );
        let q = self.queues.get_mut(&qname).expect("checked above");
        let serial = q.next_consumer_serial(now_ms);
        q.consumers.push(ConsumerRef {
            channel: key,
            tag: tag.clone(),
            priority: c.priority,
            pull: c.pull,
            session: c.session,
            recognises_redeliveries: c.recognises_redeliveries,
            serial,
        });
        q.had_consumer = true;
        q.last_used_ms = now_ms;
        if c.resend_unacked {
            self.resend(key, Some(&tag), true, fx);
        }
        self.dispatch(&qname, now_ms, fx);
        Ok(tag)
    }

    /// basic.cancel. Cancelling an unknown tag succeeds, as the spec allows.
    pub fn basic_cancel(&mut self, key: ChannelKey, tag: &str, now_ms: u64, fx: &mut Effects) {
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        let Some(c) = ch.consumers.remove(tag) else {
            return;
        };
        self.detach_consumer(key, &c.queue, &c.tag, fx);
        self.dispatch(&c.queue, now_ms, fx);
    }

    pub(super) fn detach_consumer(
        &mut self,
        key: ChannelKey,
        queue: &str,
        tag: &Arc<str>,
        fx: &mut Effects,
    ) {
        let Some(q) = self.queues.get_mut(queue) else {
            return;
        };
        q.consumers.retain(|r| !(r.channel == key && &r.tag == tag));
        if q.auto_delete && q.consumers.is_empty() && q.had_consumer {
            self.retire_queue(queue, fx);
        }
    }

    /// A delivery that came from `queue`'s primary through this channel's upstream channel
    /// to it: takes the next delivery tag of the channel, so that proxied and local
    /// deliveries share one tag sequence, and tracks it for the client's ack unless
    /// `no_ack`. `None` when the channel is gone (the upstream channel's close requeues it).
    pub fn track_remote(
        &mut self,
        key: ChannelKey,
        queue: &str,
        primary: &Arc<str>,
        upstream_tag: u64,
        bytes: u64,
        no_ack: bool,
    ) -> Option<u64> {
        let ch = self.channels.get_mut(&key)?;
        let tag = ch.next_tag();
        if !no_ack {
            ch.track(Unacked {
                tag,
                queue: queue.into(),
                id: upstream_tag,
                consumer: None,
                redelivered: false,
                bytes,
                upstream: Some(primary.clone()),
            });
        }
        Some(tag)
    }

    /// Whether the channel has a (local) consumer with this tag: a proxied consumer must not
    /// take a tag a local one has, nor the other way round.
    pub fn has_consumer(&self, key: ChannelKey, tag: &str) -> bool {
        self.channels
            .get(&key)
            .is_some_and(|ch| ch.consumers.contains_key(tag))
    }

    /// basic.get.
    pub fn basic_get(
        &mut self,
        key: ChannelKey,
        queue: &str,
        no_ack: bool,
        now_ms: u64,
        fx: &mut Effects,
    ) -> CoreResult<Option<GetOk>> {
        self.usable_queue(queue, key.conn)?;
        if let Some(ch) = self.channels.get(&key)
            && !no_ack
            && ch.unacked_limit_reached()
        {
            return Err(AmqpError::precondition(format!(
                "unacked message limit of the channel ({}) is reached: ack before basic.get",
                ch.max_unacked
            )));
        }
        let record = self.record_ops;
        let mut dead = Vec::new();
        let q = self.queues.get_mut(queue).expect("checked above");
        if q.sealed {
            // Moving to another member: empty for now, the new primary serves the next get.
            return Ok(None);
        }
        q.last_used_ms = now_ms;
        expire_head(q, now_ms, true, record, fx, &mut dead);
        // A get is no session's: it skips what is held for one.
        let got = match q.first_unheld().map(|e| e.id) {
            None => None,
            Some(id) => {
                let qname = q.name.clone();
                let entry = apply(
                    q,
                    if no_ack {
                        OpKind::Take { id }
                    } else {
                        OpKind::Deliver { id, session: None }
                    },
                    record,
                    fx,
                )
                .expect("head exists");
                let message_count = q.ready_count() as u32;
                let ch = self
                    .channels
                    .get_mut(&key)
                    .ok_or_else(|| AmqpError::new(codes::CHANNEL_ERROR, "channel not open"))?;
                let tag = ch.next_tag();
                if !no_ack {
                    ch.track(Unacked {
                        tag,
                        queue: qname,
                        id,
                        consumer: None,
                        redelivered: entry.redelivered,
                        bytes: entry.message.body_len() as u64,
                        upstream: None,
                    });
                }
                Some(GetOk {
                    delivery_tag: tag,
                    redelivered: entry.redelivered,
                    message_count,
                    message: entry.message,
                })
            }
        };
        self.dead_letter_all(dead, now_ms, fx);
        Ok(got)
    }

    pub(super) fn dispatch_all(
        &mut self,
        mut queues: Vec<Arc<str>>,
        now_ms: u64,
        fx: &mut Effects,
    ) {
        queues.sort_unstable();
        queues.dedup();
        let mut dead = Vec::new();
        for q in queues {
            self.dispatch_collect(&q, now_ms, fx, &mut dead);
        }
        self.dead_letter_all(dead, now_ms, fx);
    }

    pub(super) fn dispatch(&mut self, queue: &str, now_ms: u64, fx: &mut Effects) {
        let mut dead = Vec::new();
        self.dispatch_collect(queue, now_ms, fx, &mut dead);
        self.dead_letter_all(dead, now_ms, fx);
    }

    /// Hands ready messages of `queue` to consumers that have room, round-robin (or to the
    /// single active consumer), until either runs out.
    pub(super) fn dispatch_collect(
        &mut self,
        queue: &str,
        now_ms: u64,
        fx: &mut Effects,
        dead: &mut Vec<DeadLetter>,
    ) {
        let record = self.record_ops;
        if let Some(q) = self.queues.get_mut(queue) {
            dispatch_queue(q, &mut self.channels, record, now_ms, fx, dead);
        }
    }
}

/// [`VHost::dispatch_collect`] of a queue the caller holds already — a publish's enqueue,
/// which found it once and does not look it up by name again. Each delivery finds its
/// channel and its consumer once.
pub(super) fn dispatch_queue(
    q: &mut Queue,
    channels: &mut FastHashMap<ChannelKey, ChannelState>,
    record: bool,
    now_ms: u64,
    fx: &mut Effects,
    dead: &mut Vec<DeadLetter>,
) {
    if q.consumers.is_empty() || q.sealed {
        return;
    }
    // The consumers do not change while this call hands messages out.
    let top = q.consumers.iter().map(|r| r.priority).max().unwrap_or(0);
    loop {
        expire_head(q, now_ms, false, record, fx, dead);
        let Some(Next {
            id,
            bytes,
            redelivered,
            consumer: at,
        }) = next_delivery(q, channels, top)
        else {
            return;
        };
        q.next_consumer = (at + 1) % q.consumers.len();
        let r = &q.consumers[at];
        let ch = channels
            .get_mut(&r.channel)
            .expect("checked by can_deliver");
        let consumer = ch
            .consumers
            .get_mut(&r.tag)
            .expect("checked by can_deliver");
        let no_ack = consumer.no_ack;
        if !no_ack {
            consumer.unacked += 1;
            consumer.unacked_bytes += bytes;
        }
        let restored = restored_flag(q, id, r);
        let redelivered = restored.unwrap_or(redelivered);
        let (channel, tag) = (r.channel, r.tag.clone());
        let kind = match &r.session {
            _ if no_ack => OpKind::Take { id },
            None => OpKind::Deliver { id, session: None },
            Some(session) => OpKind::Deliver {
                id,
                session: Some(SessionDelivery {
                    session: session.clone(),
                    consumer: r.serial,
                    redelivered,
                }),
            },
        };
        let entry = apply(q, kind, record, fx).expect("chosen from the ready list");
        let delivery_tag = ch.next_tag();
        if !no_ack {
            ch.track_counted(Unacked {
                tag: delivery_tag,
                queue: q.name.clone(),
                id,
                consumer: Some(tag.clone()),
                redelivered,
                bytes,
                upstream: None,
            });
        }
        ch.unwritten += 1;
        ch.unwritten_bytes += bytes;
        fx.deliveries.push(Delivery {
            channel,
            consumer_tag: tag,
            delivery_tag,
            redelivered,
            message: entry.message,
        });
    }
}

/// The `redelivered` flag ready message `id` goes back with to consumer `r` if it is held
/// for `r`'s session, whose delivery of it was lost, the client recognises what its
/// application had and the message has an identity to recognise it by: that delivery's
/// flag, unless a later message overtook it (`core::queue::holds`).
fn restored_flag(q: &Queue, id: u64, r: &ConsumerRef) -> Option<bool> {
    if !q.has_holds() || !r.recognises_redeliveries {
        return None;
    }
    let flag = q.restored_flag(id, r.session.as_deref()?)?;
    let entry = q.ready_entry(id)?;
    producer_of(&entry.message).is_some().then_some(flag)
}

/// The next message `q` hands out and the consumer (its index) that takes it: the head, to
/// the first consumer with room in round-robin order among those of the highest priority
/// that have room. A message held for a session goes only to that session's consumers,
/// and the others pass over it to the first message they may take
/// (`core::queue::holds`); with a single active consumer nothing is passed over, as that
/// would break the one consumer's order.
fn next_delivery(
    q: &Queue,
    channels: &FastHashMap<ChannelKey, ChannelState>,
    top: i32,
) -> Option<Next> {
    let next = |e: &Entry, bytes, consumer| Next {
        id: e.id,
        bytes,
        redelivered: e.redelivered,
        consumer,
    };
    if !q.has_holds() || q.args.single_active_consumer {
        let head = q.peek()?;
        let bytes = head.message.body_len() as u64;
        return choose_consumer(q, channels, head.id, bytes, None, top)
            .map(|at| next(head, bytes, at));
    }
    for e in q.ready() {
        let held_for = q.held_for(e.id);
        let bytes = e.message.body_len() as u64;
        if let Some(at) = choose_consumer(q, channels, e.id, bytes, held_for, top) {
            return Some(next(e, bytes, at));
        }
        // Anyone may take a message held for nobody: no room for it, no room for any.
        held_for?;
    }
    None
}

/// What [`next_delivery`] picked: the message (its id, body bytes and own `redelivered`
/// flag) and the consumer (its index) that takes it.
struct Next {
    id: u64,
    bytes: u64,
    redelivered: bool,
    consumer: usize,
}

/// The consumer (its index) that takes message `id` of `bytes` body bytes: the first with
/// room in round-robin order among those of the highest priority that have room — of
/// session `only`'s consumers, if given.
fn choose_consumer(
    q: &Queue,
    channels: &FastHashMap<ChannelKey, ChannelState>,
    id: u64,
    bytes: u64,
    only: Option<&Arc<str>>,
    top: i32,
) -> Option<usize> {
    // A message pulled in from another fragment stays for this member's consumers (while
    // it has any: else nothing would ever take it). Only a fragment with pulled-in messages
    // looks at its consumers for it.
    let pulled = q.is_pulled(id) && q.consumers.iter().any(|r| !r.pull);
    let candidates = if q.args.single_active_consumer {
        1
    } else {
        q.consumers.len()
    };
    let mut chosen: Option<(usize, i32)> = None;
    for i in 0..candidates {
        let at = if q.args.single_active_consumer {
            0
        } else {
            (q.next_consumer + i) % q.consumers.len()
        };
        let r = &q.consumers[at];
        if chosen.is_some_and(|(_, p)| r.priority <= p)
            || (pulled && r.pull)
            || only.is_some_and(|s| r.session.as_ref() != Some(s))
        {
            continue;
        }
        if channels
            .get(&r.channel)
            .is_some_and(|ch| ch.can_deliver(&r.tag, bytes))
        {
            chosen = Some((at, r.priority));
            if r.priority == top {
                break;
            }
        }
    }
    chosen.map(|(at, _)| at)
}

pub(super) fn consumer_queues(ch: &ChannelState) -> Vec<Arc<str>> {
    let mut qs: Vec<Arc<str>> = ch.consumers.values().map(|c| c.queue.clone()).collect();
    qs.sort_unstable();
    qs.dedup();
    qs
}
