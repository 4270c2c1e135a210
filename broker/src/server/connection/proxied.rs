//! Proxied queues on a cluster member: consume, cancel, get, purge and passive declares of
//! a queue whose primary is another member go to the client channel's upstream channel to
//! that member ([`crate::proxy::upstream`]), and the connection reads nothing more until the
//! answer is in — as with a cluster op — so the client sees replies in the order it asked.
//! Deliveries come back through the mailbox and take the channel's next delivery tag from
//! the vhost, so proxied and local deliveries share one tag sequence; the client's acks of
//! them go back upstream ([`crate::core::vhost::RemoteSettle`]).

use super::frames::short;
use super::wiring::Pending;
use super::{Connection, Lazy};
use crate::amqp::{AMQPClass, basic, codes, exchange, queue, tx};
use crate::core::vhost::{RemoteSettle, Settlement};
use crate::core::{AmqpError, ChannelKey, VHost};
use crate::proxy::forward::ForwardTracker;
use crate::proxy::upstream::{
    self, Command, DEFAULT_CREDIT, ProxiedDelivery, ProxiedEnd, ProxiedGet, Target, Upstream,
};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// How long a proxied consume, get or passive declare whose primary could not be reached
/// waits for the cluster to name another (detecting a lost member and the election take about a second)
/// before it is refused with 404. The connection reads nothing more meanwhile, as for any
/// proxied method.
const PRIMARY_PATIENCE: Duration = Duration::from_secs(5);

/// How often the wait looks at the queue's primary again.
const PRIMARY_POLL: Duration = Duration::from_millis(50);

/// A proxied method to carry out again, on the queue's new primary, if its primary could
/// not be reached.
pub(super) struct Again {
    queue: String,
    method: AMQPClass,
    /// The tag under which the first try registered a proxied consumer.
    consumer_tag: Option<String>,
}

/// A consumer of this connection on a queue owned by another member.
#[derive(Debug)]
pub(super) struct RemoteConsumer {
    primary: Arc<str>,
    /// Distinguishes it from an earlier consumer with the same tag on a reopened channel.
    serial: u64,
    /// Deliveries that came before the client was sent consume-ok (the primary may deliver
    /// before its consume-ok reaches this member's connection): written right after it.
    /// `None` once consume-ok went out.
    early: Option<Vec<ProxiedDelivery>>,
}

/// A proxied delivery that took its client channel's next delivery tag.
pub(super) struct Admitted {
    delivery: ProxiedDelivery,
    tag: u64,
}

/// What a proxied method waits for.
pub(super) enum Answer {
    Consumed {
        tag: String,
        nowait: bool,
        result: Result<(), AmqpError>,
    },
    Cancelled {
        tag: String,
        nowait: bool,
        result: Result<(), AmqpError>,
    },
    Got {
        queue: String,
        primary: Arc<str>,
        no_ack: bool,
        result: Result<Option<ProxiedGet>, AmqpError>,
    },
    Purged {
        nowait: bool,
        result: Result<u32, AmqpError>,
    },
    Counted {
        queue: String,
        nowait: bool,
        result: Result<(u32, u32), AmqpError>,
    },
    Deleted {
        queue: String,
        nowait: bool,
        result: Result<u32, AmqpError>,
    },
    Settled {
        result: Result<(), AmqpError>,
    },
    /// On a link: this member applied the cluster change the other member named
    /// (`proxy::catch_up`), or gave up waiting: exchange.declare-ok.
    CaughtUp {
        nowait: bool,
    },
    /// A transaction's proxied acks were processed by their primaries: commit-ok.
    Committed {
        result: Result<(), AmqpError>,
    },
    ForeignChecked {
        pending: Pending,
        result: Result<(), AmqpError>,
    },
    /// The primary could not be reached and the cluster has named another since: the
    /// method is carried out again.
    Again {
        primary: Arc<str>,
        again: Again,
    },
}

/// A proxied method in flight: the connection reads no further frames until it is answered.
pub(super) struct RemoteWait {
    channel: u16,
    class_id: u16,
    method_id: u16,
    answer: Pin<Box<dyn Future<Output = Answer> + Send>>,
}

/// The answer of the method in flight, if there is one (pending forever otherwise, so
/// `select!` can always poll it).
pub(super) async fn answered(wait: &mut Option<RemoteWait>) -> (u16, u16, u16, Answer) {
    match wait {
        Some(w) => {
            let answer = w.answer.as_mut().await;
            (w.channel, w.class_id, w.method_id, answer)
        }
        None => std::future::pending().await,
    }
}

/// Waits, for at most [`PRIMARY_PATIENCE`], until this member names another primary of
/// `queue` than `primary` (another member, or this one): whether it did.
async fn primary_moved(vhost: &Mutex<VHost>, queue: &str, primary: &Arc<str>) -> bool {
    let deadline = tokio::time::Instant::now() + PRIMARY_PATIENCE;
    loop {
        let now = vhost.lock().remote_primary(queue);
        if now.as_ref() != Some(primary) {
            return true;
        }
        if tokio::time::Instant::now() + PRIMARY_POLL > deadline {
            return false;
        }
        tokio::time::sleep(PRIMARY_POLL).await;
    }
}

/// Waits for `reply`; a reply dropped unanswered means the upstream channel is gone.
async fn reply<T>(
    rx: tokio::sync::oneshot::Receiver<Result<T, AmqpError>>,
    primary: &str,
) -> Result<T, AmqpError> {
    rx.await.unwrap_or_else(|_| Err(upstream::gone(primary)))
}

impl Connection {
    /// The upstream channel of client channel `id` to `primary`, started on first use.
    fn upstream(&mut self, id: u16, primary: &Arc<str>) -> Result<&Upstream, AmqpError> {
        let proxies = self.broker.proxies();
        let target = Target {
            links: proxies.links.clone(),
            primary: primary.clone(),
            vhost: self.vhost_name.clone(),
            channel: id,
            outbox: self.outbox.clone(),
            applied: proxies.applied.clone(),
        };
        Ok(self
            .upstreams
            .entry((id, primary.clone()))
            .or_insert_with(|| Upstream::spawn(target)))
    }

    /// Sends the command `command` builds around its reply to the upstream channel of client
    /// channel `id` to `primary`, and waits — reading nothing more — for the reply, which
    /// `answer` turns into what the client is answered.
    fn ask<T: Send + 'static>(
        &mut self,
        id: u16,
        method: (u16, u16),
        primary: Arc<str>,
        command: impl FnOnce(upstream::Reply<T>) -> Command + Send + 'static,
        answer: impl FnOnce(Result<T, AmqpError>) -> Answer + Send + 'static,
    ) -> Result<(), AmqpError> {
        self.ask_again_if_moved(id, method, primary, command, answer, None)
    }

    /// [`Connection::ask`], and when the primary cannot be reached and the cluster names
    /// another within [`PRIMARY_PATIENCE`], `again` is carried out anew (on the new primary,
    /// or here if this member took the queue over) instead of refusing the channel.
    fn ask_again_if_moved<T: Send + 'static>(
        &mut self,
        id: u16,
        method: (u16, u16),
        primary: Arc<str>,
        command: impl FnOnce(upstream::Reply<T>) -> Command + Send + 'static,
        answer: impl FnOnce(Result<T, AmqpError>) -> Answer + Send + 'static,
        again: Option<Again>,
    ) -> Result<(), AmqpError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let upstream = self.upstream(id, &primary)?.clone();
        let forwarded = self.forwarded_so_far();
        let vhost = self.vhost.clone();
        self.wait_remote(id, method, async move {
            if let Some((tracker, upto)) = forwarded {
                tracker.answered_through(upto).await;
            }
            upstream.send(command(tx));
            let result = reply(rx, &primary).await;
            let unreachable = result.as_ref().err().is_some_and(upstream::is_unreachable);
            if unreachable
                && let (Some(again), Some(vhost)) = (again, vhost)
                && primary_moved(&vhost, &again.queue, &primary).await
            {
                return Answer::Again { primary, again };
            }
            answer(result)
        });
        Ok(())
    }

    /// The forwards of this connection so far (this batch's included, handed to their links
    /// now), if any is still unanswered: what a proxied method must not overtake.
    fn forwarded_so_far(&mut self) -> Option<(Arc<ForwardTracker>, u64)> {
        self.broker
            .forward(&self.vhost_name, &mut self.fx, Some(&self.forwards));
        let upto = self.forwards.issued();
        (self.forwards.status().answered_through < upto).then(|| (self.forwards.clone(), upto))
    }

    pub(super) fn wait_remote(
        &mut self,
        channel: u16,
        (class_id, method_id): (u16, u16),
        answer: impl Future<Output = Answer> + Send + 'static,
    ) {
        self.remote_wait = Some(RemoteWait {
            channel,
            class_id,
            method_id,
            answer: Box::pin(answer),
        });
    }

    /// basic.consume on a proxied queue: a consumer on the primary, with the channel's
    /// prefetch as its credit.
    pub(super) fn consume_remote(
        &mut self,
        id: u16,
        c: basic::Consume,
        queue: String,
        primary: Arc<str>,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let key = ChannelKey {
            conn: self.id,
            channel: id,
        };
        let tag = match c.consumer_tag.as_str() {
            "" => v.get().fresh_consumer_tag(),
            t => t.to_owned(),
        };
        if v.get().has_consumer(key, &tag)
            || self
                .remote_consumers
                .contains_key(&(id, tag.as_str().into()))
        {
            return Err(AmqpError::new(
                codes::NOT_ALLOWED,
                format!("consumer tag '{tag}' is already in use on this channel"),
            ));
        }
        let credit = upstream_credit(
            v.get().consumer_prefetch(key),
            v.get().channel_prefetch(key),
            c.no_ack,
        );
        self.next_serial += 1;
        let serial = self.next_serial;
        self.remote_consumers.insert(
            (id, tag.as_str().into()),
            RemoteConsumer {
                primary: primary.clone(),
                serial,
                early: Some(Vec::new()),
            },
        );
        let (no_ack, exclusive, nowait) = (c.no_ack, c.exclusive, c.nowait);
        let upstream_tag = tag.clone();
        let again = Again {
            queue: queue.clone(),
            consumer_tag: Some(tag.clone()),
            method: AMQPClass::Basic(basic::AMQPMethod::Consume(c.clone())),
        };
        self.ask_again_if_moved(
            id,
            (60, 20),
            primary,
            move |reply| Command::Consume {
                queue,
                tag: upstream_tag,
                no_ack,
                exclusive,
                arguments: c.arguments,
                credit,
                serial,
                reply,
            },
            move |result| Answer::Consumed {
                tag,
                nowait,
                result,
            },
            Some(again),
        )
    }

    /// basic.cancel of a proxied consumer; false when `tag` is not one.
    pub(super) fn cancel_remote(&mut self, id: u16, c: &basic::Cancel) -> Result<bool, AmqpError> {
        let Some(rc) = self
            .remote_consumers
            .remove(&(id, c.consumer_tag.as_str().into()))
        else {
            return Ok(false);
        };
        let (tag, nowait) = (c.consumer_tag.to_string(), c.nowait);
        let requeue = self
            .take_held(id, &tag, rc.serial)
            .into_iter()
            .map(|d| d.upstream_tag)
            .collect();
        let upstream_tag = tag.clone();
        self.ask(
            id,
            (60, 30),
            rc.primary,
            move |reply| Command::Cancel {
                tag: upstream_tag,
                requeue,
                reply,
            },
            move |result| Answer::Cancelled {
                tag,
                nowait,
                result,
            },
        )?;
        Ok(true)
    }

    /// basic.get on a proxied queue.
    pub(super) fn get_remote(
        &mut self,
        id: u16,
        queue: String,
        no_ack: bool,
        primary: Arc<str>,
    ) -> Result<(), AmqpError> {
        let (upstream_queue, from) = (queue.clone(), primary.clone());
        let again = Again {
            queue: queue.clone(),
            consumer_tag: None,
            method: AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: queue.as_str().into(),
                no_ack,
            })),
        };
        self.ask_again_if_moved(
            id,
            (60, 70),
            primary,
            move |reply| Command::Get {
                queue: upstream_queue,
                no_ack,
                reply,
            },
            move |result| Answer::Got {
                queue,
                primary: from,
                no_ack,
                result,
            },
            Some(again),
        )
    }

    /// queue.purge of a proxied queue.
    pub(super) fn purge_remote(
        &mut self,
        id: u16,
        queue: String,
        nowait: bool,
        primary: Arc<str>,
    ) -> Result<(), AmqpError> {
        self.ask(
            id,
            (50, 30),
            primary,
            move |reply| Command::Purge { queue, reply },
            move |result| Answer::Purged { nowait, result },
        )
    }

    /// Carries out `pending` once `check` (on another broker, see `foreign.rs`) passed; the
    /// connection reads nothing more meanwhile, as for any proxied method.
    pub(super) fn check_then_carry_out(
        &mut self,
        id: u16,
        pending: Pending,
        check: impl Future<Output = Result<(), AmqpError>> + Send + 'static,
    ) {
        let ids = (pending.class_id, pending.method_id);
        self.wait_remote(id, ids, async move {
            let result = check.await;
            Answer::ForeignChecked { pending, result }
        });
    }

    /// queue.delete of a proxied queue: decided and committed by its primary.
    pub(super) fn delete_remote(
        &mut self,
        id: u16,
        queue: String,
        (if_unused, if_empty): (bool, bool),
        nowait: bool,
        primary: Arc<str>,
    ) -> Result<(), AmqpError> {
        let upstream_queue = queue.clone();
        self.ask(
            id,
            (50, 40),
            primary,
            move |reply| Command::Delete {
                queue: upstream_queue,
                if_unused,
                if_empty,
                reply,
            },
            move |result| Answer::Deleted {
                queue,
                nowait,
                result,
            },
        )
    }

    /// A passive queue.declare of a proxied queue (or the counts of a redeclare, whose
    /// change is committed already): the counts are the primary's.
    pub(super) fn count_remote(
        &mut self,
        id: u16,
        queue: String,
        nowait: bool,
        primary: Arc<str>,
    ) -> Result<(), AmqpError> {
        let upstream_queue = queue.clone();
        let again = Again {
            queue: queue.clone(),
            consumer_tag: None,
            method: AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: queue.as_str().into(),
                passive: true,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait,
                arguments: Default::default(),
            })),
        };
        self.ask_again_if_moved(
            id,
            (50, 10),
            primary,
            move |reply| Command::Counts {
                queue: upstream_queue,
                reply,
            },
            move |result| Answer::Counted {
                queue,
                nowait,
                result,
            },
            Some(again),
        )
    }

    /// Answers the proxied method that was in flight, then goes on with the input.
    pub(super) fn on_remote_answer(
        &mut self,
        (id, class_id, method_id, answer): (u16, u16, u16, Answer),
    ) {
        self.remote_wait = None;
        let Some(vhost) = self.vhost.clone() else {
            return;
        };
        let mut v = Lazy {
            vhost: &vhost,
            guard: None,
        };
        if self.channels.get(&id).is_none_or(|ch| ch.closing) {
            self.end_batch(v);
            return;
        }
        if let Err(e) = self.answer_remote(id, answer, &mut v) {
            if e.is_connection_error() {
                self.connection_error(super::frames::ConnError {
                    code: e.code,
                    text: e.text,
                    class_id,
                    method_id,
                });
            } else {
                self.channel_error(id, e, class_id, method_id, &mut v);
            }
        }
        self.end_batch(v);
    }

    fn answer_remote(&mut self, id: u16, answer: Answer, v: &mut Lazy) -> Result<(), AmqpError> {
        let w = &mut self.writer;
        match answer {
            Answer::Consumed {
                tag,
                nowait,
                result,
            } => {
                let key = (id, Arc::<str>::from(tag.as_str()));
                if let Err(e) = result {
                    self.remote_consumers.remove(&key);
                    return Err(e);
                }
                if !nowait {
                    w.method(
                        id,
                        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                            consumer_tag: short(&tag),
                        })),
                    );
                }
                let mut early = self
                    .remote_consumers
                    .get_mut(&key)
                    .and_then(|rc| rc.early.take())
                    .unwrap_or_default();
                self.write_proxied(&mut early, v);
            }
            Answer::Cancelled {
                tag,
                nowait,
                result,
            } => {
                result?;
                if !nowait {
                    w.method(
                        id,
                        AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                            consumer_tag: short(&tag),
                        })),
                    );
                }
            }
            Answer::Got {
                queue,
                primary,
                no_ack,
                result,
            } => match result? {
                None => w.method(
                    id,
                    AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
                ),
                Some(got) => {
                    let key = ChannelKey {
                        conn: self.id,
                        channel: id,
                    };
                    let bytes = got.message.body_len() as u64;
                    let Some(tag) = v.get().track_remote(
                        key,
                        &queue,
                        &primary,
                        got.upstream_tag,
                        bytes,
                        no_ack,
                    ) else {
                        return Ok(());
                    };
                    self.stats.delivered += 1; // metrics
                    self.stats.redelivered += u64::from(got.redelivered); // metrics
                    let w = &mut self.writer;
                    w.method(
                        id,
                        AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
                            delivery_tag: tag,
                            redelivered: got.redelivered,
                            exchange: got.message.exchange.clone(),
                            routing_key: got.message.routing_key.clone(),
                            message_count: got.message_count,
                        })),
                    );
                    w.header_payload(id, &got.message.header_payload);
                    w.body(id, got.message.body.bytes(), self.frame_max);
                }
            },
            Answer::Again { primary, again } => {
                // The failed upstream channel goes: a primary that comes back at the same
                // name gets a new one.
                self.upstreams.remove(&(id, primary));
                if let Some(tag) = again.consumer_tag {
                    self.remote_consumers
                        .remove(&(id, Arc::<str>::from(tag.as_str())));
                }
                return self.handle(id, again.method, v);
            }
            Answer::Settled { result } => result?,
            Answer::CaughtUp { nowait } => {
                if !nowait {
                    w.method(
                        id,
                        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(
                            exchange::DeclareOk {},
                        )),
                    );
                }
            }
            Answer::Committed { result } => {
                result?;
                w.method(id, AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})));
            }
            Answer::ForeignChecked { pending, result } => {
                result?;
                self.carry_out(id, pending, v)?;
            }
            Answer::Purged { nowait, result } => {
                let message_count = result?;
                if !nowait {
                    w.method(
                        id,
                        AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk {
                            message_count,
                        })),
                    );
                }
            }
            Answer::Deleted {
                queue,
                nowait,
                result,
            } => {
                let message_count = result?;
                tracing::info!(conn = self.id, channel = id, vhost = %self.vhost_name, %queue, "queue deleted (by its primary)");
                if !nowait {
                    w.method(
                        id,
                        AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                            message_count,
                        })),
                    );
                }
            }
            Answer::Counted {
                queue,
                nowait,
                result,
            } => {
                let (message_count, consumer_count) = result?;
                if let Some(ch) = self.channels.get_mut(&id) {
                    ch.last_queue = Some(queue.clone());
                }
                if !nowait {
                    self.writer.method(
                        id,
                        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                            queue: short(&queue),
                            message_count,
                            consumer_count,
                        })),
                    );
                }
            }
        }
        Ok(())
    }

    /// Writes deliveries of proxied consumers that came through the mailbox. A delivery for
    /// a consumer that is gone (cancelled, or its channel closed) goes back to its queue.
    ///
    /// Local deliveries other connections dispatched to this one are written first: they
    /// took their tags before, and from the moment this takes the vhost lock no more arrive
    /// until the proxied ones have theirs.
    pub(super) fn write_proxied(&mut self, deliveries: &mut Vec<ProxiedDelivery>, v: &mut Lazy) {
        if deliveries.is_empty() {
            return;
        }
        v.get();
        let mut earlier = Vec::new();
        self.outbox.take_deliveries(&mut earlier);
        for d in &earlier {
            self.write_delivery(d);
        }
        let admitted = self.admit_proxied(deliveries, v);
        self.write_admitted(admitted);
    }

    /// Gives each proxied delivery its client channel's next delivery tag (see
    /// [`Connection::admit_one`]).
    fn admit_proxied(
        &mut self,
        deliveries: &mut Vec<ProxiedDelivery>,
        v: &mut Lazy,
    ) -> Vec<Admitted> {
        let mut admitted = Vec::new();
        for d in deliveries.drain(..) {
            admitted.extend(self.admit_one(d, v));
        }
        admitted
    }

    /// Gives a proxied delivery its client channel's next delivery tag (under the vhost lock
    /// in `v`), unless it waits: for consume-ok, or for room in the channel-wide prefetch
    /// (behind any of the channel's deliveries that already wait). One for a consumer that
    /// is gone goes back to its queue.
    fn admit_one(&mut self, d: ProxiedDelivery, v: &mut Lazy) -> Option<Admitted> {
        let open = self.channels.get(&d.channel).is_some_and(|ch| !ch.closing);
        let consumer = self
            .remote_consumers
            .get_mut(&(d.channel, d.consumer_tag.clone()))
            .filter(|rc| rc.serial == d.serial && open);
        match consumer {
            Some(RemoteConsumer {
                early: Some(early), ..
            }) => {
                // consume-ok has not gone out yet: this delivery waits for it.
                early.push(d);
                return None;
            }
            Some(_) => {}
            None => {
                self.settle_upstream(d.channel, &d.primary, d.upstream_tag, Settlement::Requeue);
                return None;
            }
        }
        let key = ChannelKey {
            conn: self.id,
            channel: d.channel,
        };
        let bytes = d.message.body_len() as u64;
        if !d.no_ack
            && (self.held.contains_key(&d.channel) || !v.get().channel_window_open(key, bytes))
        {
            self.held.entry(d.channel).or_default().push_back(d);
            return None;
        }
        let tag =
            v.get()
                .track_remote(key, &d.queue, &d.primary, d.upstream_tag, bytes, d.no_ack)?;
        Some(Admitted { delivery: d, tag })
    }

    /// Writes proxied deliveries that have their tags, in tag order.
    pub(super) fn write_admitted(&mut self, admitted: Vec<Admitted>) {
        let mut taken = Vec::new();
        for Admitted { delivery: d, tag } in admitted {
            let m = &d.message;
            self.writer.deliver(
                d.channel,
                &d.consumer_tag,
                tag,
                d.redelivered,
                m.exchange.as_str(),
                m.routing_key.as_str(),
            );
            self.writer.header_payload(d.channel, &m.header_payload);
            self.writer.body(d.channel, m.body.bytes(), self.frame_max);
            self.stats.delivered += 1; // metrics
            self.stats.redelivered += u64::from(d.redelivered); // metrics
            if d.no_ack {
                // The client takes it as it is written: settled upstream now.
                taken.push((d.channel, d.primary, d.upstream_tag, Settlement::Ack));
            }
        }
        self.settle_upstream_all(taken);
    }

    /// Admits the deliveries channel-wide prefetch held back, in the order they came, as far
    /// as the channels' windows (opened by the client's acks, or by a larger basic.qos) now
    /// allow: they are written after the batch's other deliveries, whose tags are lower.
    ///
    /// A primary sees only its own part of a channel's consumers, so it cannot keep a window
    /// shared with consumers on other members (or on this one): each proxied consumer gets
    /// the whole window as upstream credit, and the proxy holds what arrives past the
    /// window. What it holds is bounded by that credit, stays unacked on the primary, and
    /// goes back to its queue there if the consumer is cancelled or the channel closes.
    pub(super) fn release_held(&mut self, v: &mut Lazy) -> Vec<Admitted> {
        let mut admitted = Vec::new();
        let channels: Vec<u16> = self.held.keys().copied().collect();
        for channel in channels {
            let Some(mut waiting) = self.held.remove(&channel) else {
                continue;
            };
            // In order, until one has to wait again: it goes back in front of the rest.
            while let Some(d) = waiting.pop_front() {
                admitted.extend(self.admit_one(d, v));
                if let Some(again) = self.held.remove(&channel) {
                    for d in again.into_iter().rev() {
                        waiting.push_front(d);
                    }
                    self.held.insert(channel, waiting);
                    break;
                }
            }
        }
        admitted
    }

    /// Takes the held deliveries of the proxied consumer `tag` (serial `serial`) of
    /// `channel` out of the channel's wait: it ended, so nobody here will take them.
    fn take_held(&mut self, channel: u16, tag: &str, serial: u64) -> VecDeque<ProxiedDelivery> {
        let Some(waiting) = self.held.get_mut(&channel) else {
            return VecDeque::new();
        };
        let (theirs, others): (VecDeque<_>, VecDeque<_>) = waiting
            .drain(..)
            .partition(|d| d.serial == serial && &*d.consumer_tag == tag);
        *waiting = others;
        if waiting.is_empty() {
            self.held.remove(&channel);
        }
        theirs
    }

    /// Proxied consumers the primary ended (their queue was deleted, or the link failed):
    /// the client hears of it as of a local consumer the broker cancelled.
    pub(super) fn end_proxied(&mut self, ended: &mut Vec<ProxiedEnd>) {
        for e in ended.drain(..) {
            let k = (e.channel, e.consumer_tag.clone());
            if self
                .remote_consumers
                .get(&k)
                .is_none_or(|rc| rc.serial != e.serial)
            {
                continue;
            }
            self.remote_consumers.remove(&k);
            for d in self.take_held(e.channel, &e.consumer_tag, e.serial) {
                self.settle_upstream(e.channel, &d.primary, d.upstream_tag, Settlement::Requeue);
            }
            self.write_cancel(&crate::core::vhost::Cancelled {
                channel: ChannelKey {
                    conn: self.id,
                    channel: e.channel,
                },
                tag: e.consumer_tag,
            });
        }
    }

    /// Passes the client's settlements of proxied deliveries to their upstream channels.
    ///
    /// A message a nack or reject put back (or dropped) must be seen so by every member once
    /// the client's channel has its next reply: after a batch with such settlements the
    /// connection reads nothing more until each primary involved has processed them (a
    /// barrier round trip on its upstream channel).
    pub(super) fn send_remote_settles(&mut self) {
        let settles = std::mem::take(&mut self.fx.remote_settles);
        self.settle_upstream_all(settles.iter().map(upstream_settle));
        let mut barriers: Vec<(u16, Arc<str>)> = Vec::new();
        for s in &settles {
            let channel = s.channel.channel;
            if s.settlement != Settlement::Ack
                && !barriers
                    .iter()
                    .any(|(c, p)| *c == channel && *p == s.primary)
            {
                barriers.push((channel, s.primary.clone()));
            }
        }
        self.fx.remote_settles = settles;
        self.fx.remote_settles.clear();
        if barriers.is_empty() || self.remote_wait.is_some() {
            return;
        }
        let channel = barriers[0].0;
        let processed = self.barriers(&barriers);
        self.wait_remote(channel, (60, 120), async move {
            Answer::Settled {
                result: processed.await,
            }
        });
    }

    /// tx.commit of a transaction that settled proxied deliveries: the settlements go to
    /// their upstream channels now, and commit-ok waits — reading nothing more — until every
    /// primary involved has processed them, so a committed ack is an applied ack. Returns
    /// whether commit-ok is left to that wait.
    pub(super) fn commit_remote_settles(&mut self, id: u16) -> bool {
        let settles = std::mem::take(&mut self.fx.remote_settles);
        let (mine, others): (Vec<_>, Vec<_>) =
            settles.into_iter().partition(|s| s.channel.channel == id);
        self.fx.remote_settles = others;
        if mine.is_empty() {
            return false;
        }
        self.settle_upstream_all(mine.iter().map(upstream_settle));
        let mut barriers: Vec<(u16, Arc<str>)> = Vec::new();
        for s in &mine {
            if !barriers.iter().any(|(_, p)| *p == s.primary) {
                barriers.push((id, s.primary.clone()));
            }
        }
        let processed = self.barriers(&barriers);
        self.wait_remote(id, (90, 20), async move {
            Answer::Committed {
                result: processed.await,
            }
        });
        true
    }

    /// A barrier round trip on each of these upstream channels: resolves once every one has
    /// processed what was sent before it (the first failure, if any).
    fn barriers(
        &self,
        barriers: &[(u16, Arc<str>)],
    ) -> impl Future<Output = Result<(), AmqpError>> + Send + 'static {
        let mut waits = Vec::new();
        for (channel, primary) in barriers {
            if let Some(u) = self.upstreams.get(&(*channel, primary.clone())) {
                let (tx, rx) = tokio::sync::oneshot::channel();
                u.send(Command::Barrier { reply: tx });
                waits.push((rx, primary.clone()));
            }
        }
        async move {
            let mut result = Ok(());
            for (rx, primary) in waits {
                if let Err(e) = reply(rx, &primary).await {
                    result = Err(e);
                }
            }
            result
        }
    }

    fn settle_upstream(&self, channel: u16, primary: &Arc<str>, tag: u64, settlement: Settlement) {
        if let Some(u) = self.upstreams.get(&(channel, primary.clone())) {
            u.send(Command::Settle {
                settlements: vec![(tag, settlement)],
            });
        }
    }

    /// Passes settlements to their upstream channels in order, one command per run of
    /// settlements for the same upstream channel (usually the whole batch: one lookup and
    /// one queue push instead of one per message).
    fn settle_upstream_all(&self, settles: impl IntoIterator<Item = UpstreamSettle>) {
        let mut run: Option<SettleRun> = None;
        for (channel, primary, tag, settlement) in settles {
            if let Some((c, p, batch)) = &mut run
                && *c == channel
                && *p == primary
            {
                batch.push((tag, settlement));
                continue;
            }
            if let Some(run) = run.take() {
                self.send_settles(run);
            }
            run = Some((channel, primary, vec![(tag, settlement)]));
        }
        if let Some(run) = run {
            self.send_settles(run);
        }
    }

    fn send_settles(
        &self,
        (channel, primary, settlements): (u16, Arc<str>, Vec<(u64, Settlement)>),
    ) {
        if let Some(u) = self.upstreams.get(&(channel, primary)) {
            u.send(Command::Settle { settlements });
        }
    }

    /// Closes the upstream channels of client channel `id` (its proxied consumers end; what
    /// they had not acked goes back to its queue on the primary).
    pub(super) fn drop_upstreams(&mut self, id: u16) {
        self.upstreams.retain(|(ch, _), _| *ch != id);
        self.remote_consumers.retain(|(ch, _), _| *ch != id);
        self.held.remove(&id);
    }
}

/// A settlement for an upstream channel: client channel, primary, upstream tag, how.
type UpstreamSettle = (u16, Arc<str>, u64, Settlement);

/// Settlements for one upstream channel: client channel, primary, (upstream tag, how).
type SettleRun = (u16, Arc<str>, Vec<(u64, Settlement)>);

fn upstream_settle(s: &RemoteSettle) -> UpstreamSettle {
    (
        s.channel.channel,
        s.primary.clone(),
        s.upstream_tag,
        s.settlement,
    )
}

/// The credit of a proxied consumer on its primary: the client's per-consumer prefetch,
/// capped by the channel-wide one (the proxy holds back what a full channel window cannot
/// take, so it asks for no more than one window), and [`DEFAULT_CREDIT`] where neither
/// limits it or the client takes deliveries without acking.
fn upstream_credit(consumer_prefetch: u32, channel_prefetch: u32, no_ack: bool) -> u16 {
    let limit = match (consumer_prefetch, channel_prefetch) {
        _ if no_ack => 0,
        (0, g) => g,
        (p, 0) => p,
        (p, g) => p.min(g),
    };
    match limit {
        0 => DEFAULT_CREDIT,
        n => u16::try_from(n).unwrap_or(u16::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_credit_is_the_tighter_prefetch_and_always_finite() {
        assert_eq!(upstream_credit(0, 0, false), DEFAULT_CREDIT);
        assert_eq!(upstream_credit(10, 0, false), 10);
        assert_eq!(upstream_credit(0, 4, false), 4);
        assert_eq!(upstream_credit(10, 4, false), 4);
        assert_eq!(upstream_credit(3, 4, false), 3);
        assert_eq!(
            upstream_credit(3, 4, true),
            DEFAULT_CREDIT,
            "no-ack ignores prefetch"
        );
        assert_eq!(upstream_credit(100_000, 0, false), u16::MAX);
    }
}
