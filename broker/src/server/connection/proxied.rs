//! Proxied queues on a cluster member: consume, cancel, get, purge and passive declares of
//! a queue whose primary is another member go to the client channel's upstream channel to
//! that member ([`crate::proxy::upstream`]), and the connection reads nothing more until the
//! answer is in — as with a cluster op — so the client sees replies in the order it asked.
//! Deliveries come back through the mailbox and take the channel's next delivery tag from
//! the vhost, so proxied and local deliveries share one tag sequence; the client's acks of
//! them go back upstream ([`crate::core::vhost::RemoteSettle`]).

mod deliveries;
mod settles;

use super::frames::short;
use super::wiring::Pending;
use super::{Connection, Lazy};
use crate::amqp::{AMQPClass, AMQPValue, basic, codes, exchange, queue, tx};
use crate::core::fragments::PULL_ARGUMENT;
use crate::core::{
    AmqpError, ChannelKey, RECOGNISES_ARGUMENT, SESSION_ARGUMENT, VHost, is_foreign,
};
use crate::proxy::forward::ForwardTracker;
use crate::proxy::upstream::{
    self, Command, DEFAULT_CREDIT, ProxiedDelivery, ProxiedGet, Target, Upstream,
};
use parking_lot::Mutex;
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
    /// The method failed with 404 and this member has since caught up with the cluster
    /// (`not_found`): it is carried out again, and a second 404 stands.
    Retry {
        method: AMQPClass,
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

/// `Ok` for an error that says the queue's primary went while a command was on its way to
/// it (it cannot be reached, or the link to it failed), else the error: for a command whose
/// purpose the primary's loss fulfils anyway.
fn unless_link_ended(e: AmqpError) -> Result<(), AmqpError> {
    if upstream::is_unreachable(&e) || e.code == codes::CONNECTION_FORCED {
        Ok(())
    } else {
        Err(e)
    }
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
        // Only a member's pull may say it is one (`x-ringmq-pull`, honoured on links): a
        // client's consume passed on over a link must not. The session is this member's
        // to name (`x-ringmq-session`): the client's own, to a member (a foreign broker
        // knows no sessions).
        let mut c = c;
        let mut arguments = c.arguments.inner().clone();
        let mut changed = arguments.remove(PULL_ARGUMENT).is_some();
        changed |= arguments.remove(SESSION_ARGUMENT).is_some();
        changed |= arguments.remove(RECOGNISES_ARGUMENT).is_some();
        if let Some(session) = self.session.filter(|_| !is_foreign(&primary)) {
            arguments.insert(
                SESSION_ARGUMENT.into(),
                AMQPValue::LongString(session.id.to_string().as_str().into()),
            );
            if self.caps.recognises_redeliveries {
                arguments.insert(RECOGNISES_ARGUMENT.into(), AMQPValue::Boolean(true));
            }
            changed = true;
        }
        if changed {
            c.arguments = arguments.into();
        }
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
                // The primary went while the cancel was on its way (killed, or its link
                // cut): the consumer ended with its upstream channel, which is all the
                // cancel asked for — a channel error here would take the client's channel
                // down for a consumer that is gone anyway (found by the scripted kill runs,
                // `docs/sessions.md` §6).
                result: result.or_else(unless_link_ended),
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

    /// queue.purge of a proxied queue; while its primary is being replaced, on the new one.
    pub(super) fn purge_remote(
        &mut self,
        id: u16,
        queue: String,
        nowait: bool,
        primary: Arc<str>,
    ) -> Result<(), AmqpError> {
        let again = Again {
            queue: queue.clone(),
            consumer_tag: None,
            method: AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
                queue: queue.as_str().into(),
                nowait,
            })),
        };
        self.ask_again_if_moved(
            id,
            (50, 30),
            primary,
            move |reply| Command::Purge { queue, reply },
            move |result| Answer::Purged { nowait, result },
            Some(again),
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

    /// queue.delete of a proxied queue: decided and committed by its primary (while the
    /// primary is being replaced, by the new one).
    pub(super) fn delete_remote(
        &mut self,
        id: u16,
        queue: String,
        (if_unused, if_empty): (bool, bool),
        nowait: bool,
        primary: Arc<str>,
    ) -> Result<(), AmqpError> {
        let upstream_queue = queue.clone();
        let again = Again {
            queue: queue.clone(),
            consumer_tag: None,
            method: AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
                queue: queue.as_str().into(),
                if_unused,
                if_empty,
                nowait,
            })),
        };
        self.ask_again_if_moved(
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
            Some(again),
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
        self.count_remote_unless(id, queue, nowait, primary, None)
    }

    /// [`Connection::count_remote`], but should the primary still hold the queue, the answer
    /// is `locked` (405), if given: another member's exclusive queue, which this member
    /// refuses this connection — unless its owner's close already retired it on the primary,
    /// its home, which applies the retirement before the owner's close-ok, and this member
    /// has not applied it yet (then the primary's 404 is the answer, as one broker would
    /// give it).
    pub(super) fn count_remote_unless(
        &mut self,
        id: u16,
        queue: String,
        nowait: bool,
        primary: Arc<str>,
        locked: Option<AmqpError>,
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
            move |result: Result<(u32, u32), AmqpError>| Answer::Counted {
                queue,
                nowait,
                result: result.and_then(|counts| locked.map_or(Ok(counts), Err)),
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
        let mut v = Lazy::new(&vhost);
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
            // A nack's or reject's barrier whose primary went (killed, or its link cut):
            // that primary's deliveries go back to the queue with it — this one too — so the
            // order the barrier keeps holds (found by the scripted kill runs).
            Answer::Settled { result } => result.or_else(unless_link_ended)?,
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
            Answer::Retry { method } => return self.handle(id, method, v),
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

    /// [`Connection::drop_upstreams`] for a channel whose connection was lost with its session
    /// kept: the primaries hold for the session what they had delivered
    /// ([`crate::proxy::upstream::Upstream::detach`]).
    pub(super) fn detach_upstreams(&mut self, id: u16) {
        for ((_, _), upstream) in self.upstreams.iter().filter(|((ch, _), _)| *ch == id) {
            upstream.detach();
        }
        self.drop_upstreams(id);
    }

    /// Closes the upstream channels of client channel `id` (its proxied consumers end; what
    /// they had not acked goes back to its queue on the primary).
    pub(super) fn drop_upstreams(&mut self, id: u16) {
        self.upstreams.retain(|(ch, _), _| *ch != id);
        self.remote_consumers.retain(|(ch, _), _| *ch != id);
        self.held.remove(&id);
    }
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
