//! Dead-lettering: a message that expired, was rejected or overflowed its queue goes, as a
//! copy with its `x-death` history, to the queue's dead-letter exchange. Chains are followed a
//! bounded number of hops and never cycle back to a queue the message expired from.

use super::routing::MAX_ROUTING_HOPS;
use super::{DeadLetter, Effects, VHost};
use crate::amqp::{AMQPValue, FieldArray, FieldTable, ShortString};
use crate::core::message::Message;
use std::sync::Arc;

impl VHost {
    /// Dead-letters messages whose bodies the server read back from disk (see
    /// [`Effects::paged_dead_letters`]): routing and enqueueing as if they had been dead-lettered
    /// in the batch that dropped them.
    pub fn dead_letter_resolved(&mut self, dead: Vec<DeadLetter>, now_ms: u64, fx: &mut Effects) {
        debug_assert!(dead.iter().all(|d| d.message.body.in_memory().is_some()));
        self.dead_letter_all(dead, now_ms, fx);
    }

    /// Dead-letters messages in their order. The first whose body is only on disk defers it
    /// and every later one to [`Effects::paged_dead_letters`], resident or not: dead-lettering
    /// the resident ones at once would put them on the dead-letter queue ahead of older
    /// messages that were merely paged out.
    pub(super) fn dead_letter_all(
        &mut self,
        mut dead: Vec<DeadLetter>,
        now_ms: u64,
        fx: &mut Effects,
    ) {
        let mut hops = 0;
        while !dead.is_empty() && hops < MAX_ROUTING_HOPS {
            hops += 1;
            let mut next = Vec::new();
            let mut deferring = false;
            for d in dead.drain(..) {
                let Some(q) = self.queues.get(&d.queue) else {
                    continue;
                };
                let Some(dlx) = q.args.dead_letter_exchange.clone() else {
                    continue;
                };
                deferring |= d.message.body.on_disk().is_some();
                if deferring {
                    fx.paged_dead_letters.push(d);
                    continue;
                }
                let routing_key = q.args.dead_letter_routing_key.clone();
                let message = Arc::new(dead_lettered(&d, &dlx, routing_key.as_deref(), now_ms));
                let keys: Vec<String> = match &routing_key {
                    Some(k) => vec![k.clone()],
                    None => vec![message.routing_key.as_str().to_owned()],
                };
                let death_queues = death_queues(&message);
                let cycle = |name: &str| {
                    death_queues
                        .iter()
                        .any(|(q, rejected)| q == name && !rejected)
                };
                let mut targets = Vec::new();
                for key in &keys {
                    let mut routed = self.route(&dlx, key, &message, Some(&cycle));
                    let to_record = self.route_to_fragments(&mut routed, None);
                    let origin = match (self.has_fragmented, to_record) {
                        (false, _) => None,
                        (true, true) => Some(super::fragments::RECORD_ORIGIN.into()),
                        (true, false) => self.node.clone(),
                    };
                    self.forward_remote(&mut routed, (&dlx, key, origin), &message, false, fx);
                    for t in routed {
                        if !targets.contains(&t) {
                            targets.push(t);
                        }
                    }
                }
                let refused = self.enqueue_all(&targets, &message, now_ms, fx, &mut next);
                if let Some(id) = d.held {
                    self.hold_or_return(&d.queue, id, refused, fx);
                }
            }
            dead = next;
        }
    }
}

impl VHost {
    /// The copy of the held message `id` of `queue` left (to this member's target queues,
    /// and in forwards): held until the copy's batch is safe — or, when a target queue here
    /// refused it (`x-overflow` = reject-publish), put back in its queue at once, marked
    /// redelivered, for another try.
    fn hold_or_return(&mut self, queue: &Arc<str>, id: u64, refused: bool, fx: &mut Effects) {
        if !refused {
            fx.dead_letters_held.push(super::HeldDeadLetter {
                queue: queue.clone(),
                id,
            });
            return;
        }
        let record = self.record_ops;
        if let Some(q) = self
            .queues
            .get_mut(queue)
            .filter(|q| q.unacked(id).is_some())
        {
            super::effects::apply(q, crate::core::ops::OpKind::Requeue { id }, record, fx);
        }
    }
}

/// (queue, reason was "rejected") of every `x-death` entry.
fn death_queues(message: &Message) -> Vec<(String, bool)> {
    let Some(headers) = message.properties.headers() else {
        return Vec::new();
    };
    let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else {
        return Vec::new();
    };
    deaths
        .as_slice()
        .iter()
        .filter_map(|d| match d {
            AMQPValue::FieldTable(t) => {
                let q = t
                    .inner()
                    .get("queue")
                    .and_then(crate::core::args::str_value)?;
                let r = t
                    .inner()
                    .get("reason")
                    .and_then(crate::core::args::str_value);
                Some((q, r.as_deref() == Some("rejected")))
            }
            _ => None,
        })
        .collect()
}

/// The copy of a dead message that goes to its dead-letter exchange: `x-death` updated (an
/// existing entry for the same queue and reason is counted up and moved first), the
/// `x-first-death-*` headers set once, the expiration removed (kept in `original-expiration`).
fn dead_lettered(d: &DeadLetter, dlx: &str, routing_key: Option<&str>, now_ms: u64) -> Message {
    let old = &d.message;
    let mut headers = old.properties.headers().clone().unwrap_or_default();
    let mut deaths: Vec<AMQPValue> = match headers.inner().get("x-death") {
        Some(AMQPValue::FieldArray(a)) => a.as_slice().to_vec(),
        _ => Vec::new(),
    };
    let same = |v: &AMQPValue| match v {
        AMQPValue::FieldTable(t) => {
            t.inner()
                .get("queue")
                .and_then(crate::core::args::str_value)
                .as_deref()
                == Some(&*d.queue)
                && t.inner()
                    .get("reason")
                    .and_then(crate::core::args::str_value)
                    .as_deref()
                    == Some(d.reason.as_str())
        }
        _ => false,
    };
    let mut entry = match deaths.iter().position(same) {
        Some(at) => match deaths.remove(at) {
            AMQPValue::FieldTable(t) => t,
            _ => FieldTable::default(),
        },
        None => {
            let mut t = FieldTable::default();
            t.insert(
                "queue".into(),
                AMQPValue::LongString(d.queue.as_bytes().into()),
            );
            t.insert(
                "reason".into(),
                AMQPValue::LongString(d.reason.as_str().into()),
            );
            t.insert(
                "exchange".into(),
                AMQPValue::LongString(old.exchange.as_str().into()),
            );
            let mut keys = FieldArray::default();
            keys.push(AMQPValue::LongString(old.routing_key.as_str().into()));
            t.insert("routing-keys".into(), AMQPValue::FieldArray(keys));
            if let Some(exp) = old.properties.expiration() {
                t.insert(
                    "original-expiration".into(),
                    AMQPValue::LongString(exp.as_str().into()),
                );
            }
            t
        }
    };
    let count = entry
        .inner()
        .get("count")
        .and_then(crate::core::args::int_value)
        .unwrap_or(0);
    entry.insert("count".into(), AMQPValue::LongLongInt(count + 1));
    entry.insert("time".into(), AMQPValue::Timestamp(now_ms / 1000));
    deaths.insert(0, AMQPValue::FieldTable(entry));
    headers.insert("x-death".into(), AMQPValue::FieldArray(deaths.into()));
    if !headers.contains_key("x-first-death-reason") {
        headers.insert(
            "x-first-death-reason".into(),
            AMQPValue::LongString(d.reason.as_str().into()),
        );
        headers.insert(
            "x-first-death-queue".into(),
            AMQPValue::LongString(d.queue.as_bytes().into()),
        );
        headers.insert(
            "x-first-death-exchange".into(),
            AMQPValue::LongString(old.exchange.as_str().into()),
        );
    }
    headers.insert(
        "x-last-death-reason".into(),
        AMQPValue::LongString(d.reason.as_str().into()),
    );
    headers.insert(
        "x-last-death-queue".into(),
        AMQPValue::LongString(d.queue.as_bytes().into()),
    );
    headers.insert(
        "x-last-death-exchange".into(),
        AMQPValue::LongString(old.exchange.as_str().into()),
    );
    let mut properties = old.properties.clone().with_headers(headers);
    properties = without_expiration(properties);
    properties = crate::core::producers::without_producer(properties);
    let routing_key: ShortString = routing_key
        .map(Into::into)
        .unwrap_or_else(|| old.routing_key.clone());
    Message::authored(dlx.into(), routing_key, properties, old.body.clone())
}

fn without_expiration(p: crate::amqp::Properties) -> crate::amqp::Properties {
    // amq-protocol offers setters only; rebuild with every field but expiration.
    let mut out = crate::amqp::Properties::default();
    macro_rules! copy {
        ($get:ident, $set:ident) => {
            if let Some(v) = p.$get().clone() {
                out = out.$set(v);
            }
        };
    }
    copy!(content_type, with_content_type);
    copy!(content_encoding, with_content_encoding);
    copy!(headers, with_headers);
    copy!(delivery_mode, with_delivery_mode);
    copy!(priority, with_priority);
    copy!(correlation_id, with_correlation_id);
    copy!(reply_to, with_reply_to);
    copy!(message_id, with_message_id);
    copy!(timestamp, with_timestamp);
    copy!(kind, with_type);
    copy!(user_id, with_user_id);
    copy!(app_id, with_app_id);
    copy!(cluster_id, with_cluster_id);
    out
}
