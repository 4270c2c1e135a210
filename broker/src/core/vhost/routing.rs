//! Publishing: which queues a message reaches (exchange-to-exchange bindings and alternate
//! exchanges followed, each queue once) and putting it on them, with their length limits,
//! TTLs and flow-to-disk applied on the way in. Dead-lettering routes through here too.

use super::consume::dispatch_queue;
use super::effects::{apply, page_out};
use super::expiry::expire_head;
use super::{DeadLetter, Effects, VHost};
use crate::core::args::Overflow;
use crate::core::error::{AmqpError, CoreResult};
use crate::core::exchange::Destination;
use crate::core::is_foreign;
use crate::core::message::Message;
use crate::core::ops::{DropReason, OpKind};
use std::sync::Arc;

/// What became of a published message, for confirms and basic.return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishOutcome {
    /// Enqueued on at least one queue.
    Routed,
    /// No queue matched (basic.return if mandatory; confirms ack it).
    Unroutable,
    /// A queue refused it (`x-overflow` = reject-publish): confirms nack it.
    Rejected,
    /// No queue refused it, but a matched queue's primary is not a live member: the
    /// forwards to such primaries are in the effects, marked [`super::Forward::lost`]. A
    /// plain client's confirm nacks it; a session's waits for the election (the connection
    /// decides).
    Unavailable,
    /// A forwarded publish ([`VHost::publish_forwarded`]) matched a queue this member is
    /// primary of but has sealed for a planned move: enqueued nowhere. Not a refusal — the
    /// queue takes it again in a moment at its new primary — so the link's nack says
    /// `requeue` and the sending member treats the forward as moving, not refused (B16 in
    /// docs/reliability.md).
    Moving,
}

/// Ready messages above which a queue that has consumers counts as backlogged: its consumers
/// are all saturated and more publishes only add latency. Publishers to it are paced (the
/// broker's flow control, like RabbitMQ's credit flow); a queue with no consumer is not a
/// reason to slow anyone down.
pub const FLOW_READY_THRESHOLD: usize = 16384;

/// How deep exchange-to-exchange bindings and dead-letter chains are followed; beyond this a
/// message is not routed further (a guard against cycles and runaway fan-out).
pub(super) const MAX_ROUTING_HOPS: usize = 64;

impl VHost {
    /// basic.publish of a complete message, on behalf of this member.
    pub fn publish(
        &mut self,
        exchange: &str,
        routing_key: &str,
        message: Arc<Message>,
        now_ms: u64,
        fx: &mut Effects,
    ) -> CoreResult<PublishOutcome> {
        self.publish_as(None, exchange, routing_key, message, now_ms, fx)
    }

    /// basic.publish of a complete message on behalf of member `origin` (this one when
    /// `None`): a fragmented queue takes it in that member's fragment — a resumed session
    /// publishes as the member it started on, so its messages stay in one fragment.
    pub fn publish_as(
        &mut self,
        origin: Option<&str>,
        exchange: &str,
        routing_key: &str,
        message: Arc<Message>,
        now_ms: u64,
        fx: &mut Effects,
    ) -> CoreResult<PublishOutcome> {
        // The default exchange is predeclared and can be neither deleted nor redeclared: it
        // is always there, routes by queue name and is neither internal nor foreign. It is
        // not looked up: comparing the empty name took a microcode assist per publish (an
        // empty name's pointer is dangling, and libc's AVX-512 `memcmp` loads through it
        // under a zero mask), 3.6% of the broker's CPU on small messages.
        if !exchange.is_empty() {
            let ex = self
                .exchanges
                .get(exchange)
                .ok_or_else(|| self.not_found_exchange(exchange))?;
            if ex.internal {
                return Err(AmqpError::access_refused(format!(
                    "cannot publish to internal exchange '{exchange}' in vhost '{}'",
                    self.name
                )));
            }
            if let Some(home) = ex.home.clone() {
                // A foreign exchange: the other broker routes it, with the client's exchange
                // and routing key; the publisher's confirm waits for that broker's.
                fx.forwards.push(super::Forward {
                    primary: home,
                    exchange: ex.name.clone(),
                    routing_key: routing_key.into(),
                    message,
                    origin: None,
                    lost: false,
                });
                return Ok(PublishOutcome::Routed);
            }
        }
        // The route's vector is the vhost's, kept between publishes: one allocation less
        // per message.
        let mut targets = std::mem::take(&mut self.route_scratch);
        self.route_into(exchange, routing_key, &message, None, &mut targets);
        let outcome = self.publish_routed(
            &mut targets,
            origin,
            exchange,
            routing_key,
            &message,
            now_ms,
            fx,
        );
        targets.clear();
        self.route_scratch = targets;
        Ok(outcome)
    }

    /// The rest of [`VHost::publish_as`] once the message is routed to `targets`.
    #[allow(clippy::too_many_arguments)]
    fn publish_routed(
        &mut self,
        targets: &mut Vec<Arc<str>>,
        origin: Option<&str>,
        exchange: &str,
        routing_key: &str,
        message: &Arc<Message>,
        now_ms: u64,
        fx: &mut Effects,
    ) -> PublishOutcome {
        if targets.is_empty() {
            return PublishOutcome::Unroutable;
        }
        let to_record = self.route_to_fragments(targets, origin);
        let origin = match (self.has_fragmented, to_record) {
            (false, _) => None,
            (true, true) => Some(super::fragments::RECORD_ORIGIN.into()),
            (true, false) => origin.map(Arc::from).or_else(|| self.node.clone()),
        };
        let sealed = self.hold_sealed(
            targets,
            (exchange, routing_key, origin.clone()),
            message,
            fx,
        );
        let unavailable =
            self.forward_remote(targets, (exchange, routing_key, origin), message, true, fx)
                || sealed;
        let mut dead = Vec::new();
        let rejected = self.enqueue_all(targets, message, now_ms, fx, &mut dead);
        self.dead_letter_all(dead, now_ms, fx);
        if rejected {
            PublishOutcome::Rejected
        } else if unavailable {
            PublishOutcome::Unavailable
        } else {
            PublishOutcome::Routed
        }
    }

    /// A message another member routed here because queues this member owns matched it:
    /// routed again over the same (replicated) bindings, and enqueued only on the shared
    /// queues whose primary this member is (its connections' exclusive queues included).
    /// Queues owned elsewhere are the receiving member's business, so a publish reaches
    /// every queue exactly once. An
    /// exchange deleted meanwhile routes nowhere (as a publish arriving after the delete).
    ///
    /// The sender forwarded it because, in its view, one of the matched queues is this
    /// member's. When this member owns none of the queues the message matches, its view is
    /// newer: the queue moved (an election, a restart's hand-over) after the sender routed.
    /// That is `Rejected` — the sender's publisher gets a nack and sends again — never
    /// `Unroutable`, whose confirm is an ack: a confirm for a message no queue holds (found
    /// by the fault suite, B7 in docs/reliability.md).
    pub fn publish_forwarded(
        &mut self,
        exchange: &str,
        routing_key: &str,
        message: Arc<Message>,
        now_ms: u64,
        fx: &mut Effects,
    ) -> PublishOutcome {
        self.publish_forwarded_as(None, exchange, routing_key, message, now_ms, fx)
    }

    /// [`VHost::publish_forwarded`] of a message the sender published on behalf of member
    /// `origin` (see [`VHost::publish_as`]): a fragmented queue takes it in the fragment
    /// the sender picked, which must be one whose primary this member is.
    pub fn publish_forwarded_as(
        &mut self,
        origin: Option<&str>,
        exchange: &str,
        routing_key: &str,
        message: Arc<Message>,
        now_ms: u64,
        fx: &mut Effects,
    ) -> PublishOutcome {
        let mut targets = self.route(exchange, routing_key, &message, None);
        let matched = !targets.is_empty();
        self.route_to_fragments(&mut targets, origin);
        targets.retain(|name| {
            self.queues
                .get(name)
                .is_some_and(|q| self.primary_elsewhere(q).is_none())
        });
        if targets.is_empty() {
            // Matched, but none of the queues is this member's any more: the sender routed
            // it on a map older than this member's — the queue moved (a planned move's
            // switch, an election) while the forward was on its way. Not a refusal: like a
            // sealed queue's, it is sent again at the new primary (a session's client sends
            // it again; a plain publisher gets a nack, B23).
            return if matched {
                PublishOutcome::Moving
            } else {
                PublishOutcome::Unroutable
            };
        }
        // All or nothing: a copy in the other matched queues and none in the sealed one
        // would be duplicated when the sender publishes it again after the switch.
        if targets
            .iter()
            .any(|name| self.queues.get(name).is_some_and(|q| q.sealed))
        {
            return PublishOutcome::Moving;
        }
        let mut dead = Vec::new();
        let rejected = self.enqueue_all(&targets, &message, now_ms, fx, &mut dead);
        self.dead_letter_all(dead, now_ms, fx);
        if rejected {
            PublishOutcome::Rejected
        } else {
            PublishOutcome::Routed
        }
    }

    /// A message a foreign exchange's feed brought for `queue` (see [`super::Feed`]): enqueued
    /// on that queue only, if it is still here and this broker is its primary. `Unroutable`
    /// when it is not (the binding went with it); `Rejected` when the queue refused it.
    pub fn publish_feed(
        &mut self,
        queue: &str,
        message: Arc<Message>,
        now_ms: u64,
        fx: &mut Effects,
    ) -> PublishOutcome {
        let Some(q) = self.queues.get(queue) else {
            return PublishOutcome::Unroutable;
        };
        if self.primary_elsewhere(q).is_some() {
            return PublishOutcome::Unroutable;
        }
        let target = [q.name.clone()];
        let mut dead = Vec::new();
        let rejected = self.enqueue_all(&target, &message, now_ms, fx, &mut dead);
        self.dead_letter_all(dead, now_ms, fx);
        if rejected {
            PublishOutcome::Rejected
        } else {
            PublishOutcome::Routed
        }
    }

    /// A message this member's pull took from another of a fragmented queue's parts, for
    /// this member's fragment `queue` (`proxy/fragment_pull.rs`): enqueued as
    /// [`VHost::publish_feed`] does, and marked so that no pull takes it on again — and as
    /// redelivered when the source delivered it `redelivered` (it may have reached a
    /// consumer before: a pull that died before its ack).
    pub fn publish_pulled(
        &mut self,
        queue: &str,
        message: Arc<Message>,
        redelivered: bool,
        now_ms: u64,
        fx: &mut Effects,
    ) -> PublishOutcome {
        let Some(q) = self.queues.get_mut(queue) else {
            return PublishOutcome::Unroutable;
        };
        // Marked before it is enqueued: the enqueue hands it out at once if it can.
        let id = q.next_id();
        q.mark_pulled(id, redelivered);
        let outcome = self.publish_feed(queue, message, now_ms, fx);
        if outcome != PublishOutcome::Routed
            && let Some(q) = self.queues.get_mut(queue)
        {
            q.forget_pulled(id);
        }
        outcome
    }

    /// Takes the queues owned by other members out of `targets` and hands the message to
    /// each of those members once ([`Effects::forwards`]). Returns true when a queue's
    /// primary is not a live member: that queue does not get the message — its forward is
    /// in the effects marked [`super::Forward::lost`] if `keep_lost` (a client's publish,
    /// whose connection decides), and dropped otherwise.
    pub(super) fn forward_remote(
        &self,
        targets: &mut Vec<Arc<str>>,
        (exchange, routing_key, origin): (&str, &str, Option<Arc<str>>),
        message: &Arc<Message>,
        keep_lost: bool,
        fx: &mut Effects,
    ) -> bool {
        if self.node.is_none() && !self.has_foreign {
            return false;
        }
        let mut primaries: Vec<Arc<str>> = Vec::new();
        targets.retain(|name| {
            match self
                .queues
                .get(name)
                .and_then(|q| self.primary_elsewhere(q))
            {
                // A foreign broker knows nothing of this broker's bindings: the message goes
                // to its queue of the same name through its default exchange.
                Some(primary) if is_foreign(&primary) => {
                    fx.forwards.push(super::Forward {
                        primary,
                        exchange: "".into(),
                        routing_key: name.clone(),
                        message: message.clone(),
                        origin: None,
                        lost: false,
                    });
                    false
                }
                Some(primary) => {
                    if !primaries.contains(&primary) {
                        primaries.push(primary);
                    }
                    false
                }
                None => true,
            }
        });
        let mut unavailable = false;
        for primary in primaries {
            let lost = !self.live_nodes.contains(&primary);
            unavailable |= lost;
            if lost && !keep_lost {
                continue;
            }
            fx.forwards.push(super::Forward {
                primary,
                exchange: exchange.into(),
                routing_key: routing_key.into(),
                message: message.clone(),
                origin: origin.clone(),
                lost,
            });
        }
        unavailable
    }

    /// Takes the queues sealed for a planned move out of `targets` — here as their primary
    /// until the switch, or as a member that knows their primary is
    /// ([`crate::core::queue::Queue::sealed`]): the message is handed to one lost forward
    /// ([`super::Forward::lost`]), as for a primary that is not live — a session's publish
    /// waits for the switch and is sent again by its client, a plain client's is nacked.
    /// Returns whether any was.
    fn hold_sealed(
        &self,
        targets: &mut Vec<Arc<str>>,
        (exchange, routing_key, origin): (&str, &str, Option<Arc<str>>),
        message: &Arc<Message>,
        fx: &mut Effects,
    ) -> bool {
        let before = targets.len();
        targets.retain(|name| !self.queues.get(name).is_some_and(|q| q.sealed));
        let sealed = targets.len() < before;
        if sealed && let Some(node) = &self.node {
            fx.forwards.push(super::Forward {
                primary: node.clone(),
                exchange: exchange.into(),
                routing_key: routing_key.into(),
                message: message.clone(),
                origin,
                lost: true,
            });
        }
        sealed
    }

    /// The queues a message published to `exchange` reaches, following exchange-to-exchange
    /// bindings and alternate exchanges, each queue once. `skip` drops queues a dead letter
    /// must not cycle back to.
    pub(super) fn route(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Message,
        skip: Option<&dyn Fn(&str) -> bool>,
    ) -> Vec<Arc<str>> {
        let mut queues = Vec::new();
        self.route_into(exchange, routing_key, message, skip, &mut queues);
        queues
    }

    /// [`VHost::route`] into `queues`, which must be empty.
    pub(super) fn route_into(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Message,
        skip: Option<&dyn Fn(&str) -> bool>,
        queues: &mut Vec<Arc<str>>,
    ) {
        debug_assert!(queues.is_empty());
        if exchange.is_empty() {
            if let Some(q) = self.queues.get(routing_key) {
                queues.push(q.name.clone());
            }
        } else {
            let headers = message.properties.headers().as_ref();
            let mut visited: Vec<&str> = vec![exchange];
            let mut frontier: Vec<&str> = vec![exchange];
            let mut dests = Vec::new();
            while let Some(name) = frontier.pop() {
                // A foreign exchange's bindings are fed by the other broker, never by
                // this broker's routing (see `docs/proxies.md`).
                let Some(ex) = self.exchanges.get(name).filter(|e| e.home.is_none()) else {
                    continue;
                };
                dests.clear();
                ex.matches(routing_key, headers, &mut dests);
                if dests.is_empty()
                    && let Some(ae) = ex.alternate_exchange.as_deref()
                    && !visited.contains(&ae)
                    && visited.len() < MAX_ROUTING_HOPS
                    && let Some(ae) = self.exchanges.get(ae)
                {
                    visited.push(&ae.name);
                    frontier.push(&ae.name);
                }
                for d in &dests {
                    match d {
                        Destination::Queue(q) => {
                            if !queues.contains(q) {
                                queues.push(q.clone());
                            }
                        }
                        Destination::Exchange(e) => {
                            if let Some(e) = self.exchanges.get(e.as_ref())
                                && !visited.contains(&e.name.as_ref())
                                && visited.len() < MAX_ROUTING_HOPS
                            {
                                visited.push(&e.name);
                                frontier.push(&e.name);
                            }
                        }
                    }
                }
            }
        }
        if let Some(skip) = skip {
            queues.retain(|q| !skip(q));
        }
    }

    /// Enqueues on every target; returns true when any refused the message.
    pub(super) fn enqueue_all(
        &mut self,
        targets: &[Arc<str>],
        message: &Arc<Message>,
        now_ms: u64,
        fx: &mut Effects,
        dead: &mut Vec<DeadLetter>,
    ) -> bool {
        let mut rejected = false;
        let record = self.record_ops;
        let budget = self.limits.queue_memory_budget_bytes;
        for name in targets {
            let Some(q) = self.queues.get_mut(name) else {
                continue;
            };
            if q.holds_resent(message) {
                // A resend of what the queue took from a session's member that was lost:
                // confirmed once what the first one waited for holds.
                fx.resent_held = true;
                continue;
            }
            if q.sealed {
                // Moving to another member: the publisher sends again (a nack), and the
                // new primary takes it.
                rejected = true;
                continue;
            }
            let size = message.body_len() as u64;
            let full = q
                .args
                .max_length
                .is_some_and(|m| q.ready_count() as u64 >= m)
                || q.args
                    .max_length_bytes
                    .is_some_and(|m| q.ready_bytes() as u64 + size > m);
            if full && q.args.overflow != Overflow::DropHead {
                rejected = true;
                if q.args.overflow == Overflow::RejectPublishDlx {
                    dead.push(DeadLetter {
                        message: message.clone(),
                        queue: q.name.clone(),
                        reason: DropReason::MaxLength,
                        held: None,
                    });
                }
                continue;
            }
            let ttl = match (q.args.message_ttl_ms, message.expiration_ms) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let id = q.next_id();
            apply(
                q,
                OpKind::Enqueue {
                    id,
                    message: message.clone(),
                    expires_at_ms: ttl.map(|t| now_ms.saturating_add(t)),
                },
                record,
                fx,
            );
            dispatch_queue(q, &mut self.channels, record, now_ms, fx, dead);
            page_out(q, id, message, budget, record, fx);
            while q
                .args
                .max_length
                .is_some_and(|m| q.ready_count() as u64 > m)
                || q.args
                    .max_length_bytes
                    .is_some_and(|m| q.ready_bytes() as u64 > m)
            {
                let Some(id) = q.oldest().map(|e| e.id) else {
                    break;
                };
                let entry = apply(
                    q,
                    OpKind::Drop {
                        id,
                        reason: DropReason::MaxLength,
                    },
                    record,
                    fx,
                )
                .expect("oldest exists");
                dead.push(DeadLetter {
                    message: entry.message,
                    queue: q.name.clone(),
                    reason: DropReason::MaxLength,
                    held: None,
                });
            }
            expire_head(q, now_ms, true, record, fx, dead);
            if !q.consumers.is_empty() && q.ready_count() > FLOW_READY_THRESHOLD {
                fx.backlogged = true;
            }
        }
        rejected
    }
}
