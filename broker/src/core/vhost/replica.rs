//! A backup's side of a replicated queue, in the same core that serves it on its primary.
//!
//! On a member that is not a queue's primary, the queue's local copy serves nobody (clients
//! here reach the primary through the proxy), so it is free to be the **replica**: the
//! primary's queue ops, applied through [`Queue::apply`] exactly as the primary applied them,
//! rebuild its content here — and the member's journal records them as it records its own
//! queues' ops, so a durable replica survives a restart of this process too. When the
//! cluster map makes this member the primary (an election), [`VHost::promote_replica`]
//! requeues what the old primary had delivered and not seen acked, in its original order and
//! marked redelivered, and the queue serves from where the old primary stopped. A planned
//! move runs the other way too: the primary [`VHost::seal`]s the queue (no more ops) until
//! the target has them all, and [`VHost::hand_over`] ends its consumers at the switch.
//!
//! A replica obeys the vhost's memory budget as its primary does (flow-to-disk): after each
//! replicated enqueue, and for each message an image installs, a body that takes the
//! queue's resident bytes over the budget leaves memory — for the `Enqueued` record this
//! member journals, or a page record of its own (a transient message, a queue that is not
//! durable) — through the same [`page_out`] decision and the same page records as the
//! primary's. The entry keeps the key of this member's record, so when the replica is
//! promoted its deliveries, and the images it sends as a catch-up source, read the bodies
//! back from this member's journal like any primary's.

use super::VHost;
use super::effects::{Cancelled, Effects, PageOut, apply, journals_persistent, page_out, purge};
use crate::core::ops::{OpKind, QueueOp};
use crate::core::queue::{ImageChunk, Queue, QueueImage, ReplicaError};

impl VHost {
    /// Applies `ops`, which the primary of `queue` replicated, in order. Stops at the first op
    /// that does not fit (the stream diverged: the backup must be caught up again) and
    /// returns why; the ops before it stay applied. Returns the sequence number reached.
    pub fn apply_replicated(
        &mut self,
        queue: &str,
        ops: &[QueueOp],
        fx: &mut Effects,
    ) -> Result<u64, ReplicaError> {
        let record = self.record_ops;
        let budget = self.limits.queue_memory_budget_bytes;
        let q = self.replica_mut(queue)?;
        for op in ops {
            q.fits(op)?;
            match &op.kind {
                OpKind::Enqueue { id, message, .. } => {
                    apply(q, op.kind.clone(), record, fx);
                    page_out(q, *id, message, budget, record, fx);
                }
                OpKind::Purge { ids } => purge(q, ids.clone(), record, fx),
                kind => {
                    apply(q, kind.clone(), record, fx);
                }
            }
        }
        Ok(q.last_seq())
    }

    /// Installs one chunk of an image into the replica of `queue` (a catch-up); the ops
    /// after the image's `last_seq` follow its last chunk through
    /// [`VHost::apply_replicated`]. The first chunk drops what a stale replica held (from
    /// before this member lost its place in the stream, or a catch-up that was abandoned
    /// half way) first, as removals; every chunk's messages are recorded as enqueues, so that
    /// this member's journal holds exactly what the replica holds. Bodies beyond the memory
    /// budget stay only on disk ([`Queue::install_chunk`]).
    pub fn install_replica(
        &mut self,
        queue: &str,
        chunk: ImageChunk,
        fx: &mut Effects,
    ) -> Result<(), ReplicaError> {
        let record = self.record_ops;
        let budget = self.limits.queue_memory_budget_bytes;
        let q = self.replica_mut(queue)?;
        if chunk.first {
            empty(q, record, fx);
        }
        let enqueues: Vec<QueueOp> = chunk
            .entries
            .iter()
            .map(|e| QueueOp {
                queue: q.name.clone(),
                uid: q.uid,
                seq: chunk.last_seq,
                durable: q.journaled(),
                kind: OpKind::Enqueue {
                    id: e.id,
                    message: e.message.clone(),
                    expires_at_ms: e.expires_at_ms,
                },
            })
            .collect();
        let journals = journals_persistent(q, record);
        let replaced = (chunk.first && journals).then(|| chunk.producers.clone());
        let own_pages = q.install_chunk(chunk, budget, journals)?;
        let uid = q.uid;
        if let Some(highest) = replaced {
            fx.producers_replaced
                .push(super::effects::ProducersReplaced {
                    after_ops: fx.ops.len(),
                    uid,
                    highest,
                });
        }
        fx.page_out.extend(
            own_pages
                .into_iter()
                .map(|(id, message)| PageOut { uid, id, message }),
        );
        if journals {
            fx.ops.extend(enqueues);
        }
        Ok(())
    }

    /// This member is no longer a backup of `queue` (nor its primary): the copy it held
    /// serves nobody and no confirm counts on it, so it goes — from memory, and as removals
    /// from this member's journal (and page records). Returns how many messages it dropped
    /// (0 for a queue this member serves, or does not hold). The caller decides when that
    /// is safe: never while a restart replays the agreed log, whose intermediate roles are
    /// not the last (docs/reliability.md, B4).
    pub fn drop_replica(&mut self, queue: &str, fx: &mut Effects) -> usize {
        let record = self.record_ops;
        let Ok(q) = self.replica_mut(queue) else {
            return 0;
        };
        let held = q.ready_count() + q.unacked_count();
        empty(q, record, fx);
        held
    }

    /// The content of `queue` as a catch-up starts from (on its primary).
    pub fn queue_image(&self, queue: &str) -> Option<QueueImage> {
        self.queues.get(queue).map(Queue::image)
    }

    /// This member became the primary of `queue`, whose replica it held: what the old primary
    /// had delivered and not seen acked goes back to the ready list in its original order,
    /// marked redelivered — held for its session when a session's consumer had it — and the
    /// queue's consumers are served. Returns how many messages
    /// were requeued.
    pub fn promote_replica(
        &mut self,
        queue: &str,
        now_ms: u64,
        fx: &mut Effects,
    ) -> Result<usize, ReplicaError> {
        let record = self.record_ops;
        let node = self.node.clone();
        let q = self
            .queues
            .get_mut(queue)
            .filter(|q| q.primary_elsewhere(node.as_deref()).is_none())
            .ok_or_else(|| ReplicaError::NoReplica(queue.to_owned()))?;
        let unacked = q.unacked_in_order();
        for &id in &unacked {
            // What went to a session's consumer may have been seen there: it waits for that
            // session a while (`core::queue::holds`).
            let lost = q.lost_delivery(id);
            apply(q, OpKind::Requeue { id }, record, fx);
            q.hold_lost(id, lost, now_ms);
        }
        self.dispatch(queue, now_ms, fx);
        Ok(unacked.len())
    }

    /// This member, `queue`'s primary, stops making ops on it (`on`) while its primary
    /// moves to another member, or goes on serving it when the move was called off; see
    /// [`crate::core::queue::Queue::sealed`]. Returns whether it changed.
    pub fn seal(&mut self, queue: &str, on: bool, now_ms: u64, fx: &mut Effects) -> bool {
        let Some(q) = self.queues.get_mut(queue).filter(|q| q.sealed != on) else {
            return false;
        };
        q.sealed = on;
        if !on {
            self.dispatch(queue, now_ms, fx);
        }
        true
    }

    /// On a member that is not `queue`'s primary: its primary is sealed for a planned move
    /// (`on`) or not — publishes to it wait for the switch rather than reach a primary that
    /// refuses them ([`crate::core::queue::Queue::sealed`]).
    pub fn mark_moving(&mut self, queue: &str, on: bool) {
        if let Some(q) = self.queues.get_mut(queue) {
            q.sealed = on;
        }
    }

    /// `queue`'s primary moved from this member to another (a planned move's switch): the
    /// consumers here end, told with basic.cancel — their clients consume again through
    /// the new primary, which requeued what they had not acked (their acks here change
    /// nothing any more) — and the copy stays as a replica for the new primary to catch up.
    /// Returns how many consumers ended.
    pub fn hand_over(&mut self, queue: &str, fx: &mut Effects) -> usize {
        let Some(q) = self.queues.get_mut(queue) else {
            return 0;
        };
        q.sealed = false;
        let consumers = std::mem::take(&mut q.consumers);
        q.next_consumer = 0;
        for c in &consumers {
            if let Some(ch) = self.channels.get_mut(&c.channel) {
                ch.consumers.remove(&c.tag);
            }
            fx.cancelled.push(Cancelled {
                channel: c.channel,
                tag: c.tag.clone(),
            });
        }
        consumers.len()
    }

    /// Whether this member's copy of `queue` is a replica (its primary is another member):
    /// what this member journals for it came from the replication stream (a foreign
    /// proxy's copy also counts, and journals nothing).
    pub fn is_replica(&self, queue: &str) -> bool {
        let node = self.node.as_deref();
        self.queues
            .get(queue)
            .is_some_and(|q| replica_here(q, node))
    }

    /// The replica of `queue`: a queue held here whose primary is another member.
    fn replica_mut(&mut self, queue: &str) -> Result<&mut Queue, ReplicaError> {
        let node = self.node.as_deref();
        self.queues
            .get_mut(queue)
            .filter(|q| replica_here(q, node))
            .ok_or_else(|| ReplicaError::NoReplica(queue.to_owned()))
    }
}

/// Whether `q` is a replica on cluster member `node`: a queue whose primary is another member.
fn replica_here(q: &Queue, node: Option<&str>) -> bool {
    node.is_some() && q.primary_elsewhere(node).is_some()
}

/// Removes everything a replica holds, as ops the journal records: unacked entries settled,
/// ready ones purged.
fn empty(q: &mut Queue, record: bool, fx: &mut Effects) {
    for id in q.unacked_in_order() {
        apply(q, OpKind::Settle { id }, record, fx);
    }
    if q.ready_count() > 0 {
        let ids = q.ready().map(|e| e.id).collect();
        purge(q, ids, record, fx);
    }
}

#[cfg(test)]
mod tests {
    mod holds;
    mod paging;

    use crate::amqp::Properties;
    use crate::core::vhost::{Consume, Effects, PublishOutcome, QueueDeclare, VHost};
    use crate::core::{ChannelKey, Message, OpKind, QueueOp};
    use bytes::Bytes;
    use std::sync::Arc;

    const CH: ChannelKey = ChannelKey {
        conn: 1,
        channel: 1,
    };

    /// Member `node`'s vhost holding the shared durable queue `q`, whose primary is `a`.
    fn member(node: &str) -> VHost {
        let mut v = VHost::new("/", 7);
        v.set_record_ops(true);
        v.set_node(node);
        v.channel_open(CH);
        v.queue_declare(
            1,
            QueueDeclare {
                name: "q".into(),
                durable: true,
                ..Default::default()
            },
            0,
        )
        .unwrap();
        v.set_queue_home("q", "a");
        v
    }

    fn publish(v: &mut VHost, body: &'static str, fx: &mut Effects) {
        let m = Arc::new(Message::authored(
            "".into(),
            "q".into(),
            Properties::default().with_delivery_mode(2),
            Bytes::from_static(body.as_bytes()),
        ));
        v.publish("", "q", m, 0, fx).unwrap();
    }

    fn consume(v: &mut VHost, prefetch: u16, fx: &mut Effects) {
        v.basic_qos(CH, 0, prefetch, false, 0, fx);
        v.basic_consume(
            CH,
            Consume {
                queue: "q".into(),
                tag: "c".into(),
                ..Default::default()
            },
            0,
            fx,
        )
        .unwrap();
    }

    fn bodies(fx: &Effects) -> Vec<(String, bool)> {
        fx.deliveries
            .iter()
            .map(|d| {
                let body = d.message.body.in_memory().expect("in memory");
                (String::from_utf8(body.to_vec()).unwrap(), d.redelivered)
            })
            .collect()
    }

    #[test]
    fn a_promoted_replica_redelivers_what_the_primary_had_delivered_in_order_then_the_rest() {
        let mut a = member("a");
        let mut b = member("b");
        let mut fx = Effects::default();
        for body in ["m1", "m2", "m3", "m4", "m5"] {
            publish(&mut a, body, &mut fx);
        }
        consume(&mut a, 3, &mut fx);
        assert_eq!(bodies(&fx).len(), 3);
        let first = fx.deliveries[0].delivery_tag;
        a.basic_ack(CH, first, false, 0, &mut fx).unwrap();
        let ops = std::mem::take(&mut fx.ops);

        let mut bfx = Effects::default();
        let reached = b.apply_replicated("q", &ops, &mut bfx).unwrap();
        assert_eq!(reached, ops.last().unwrap().seq);
        let replica_uid = b.queue("q").unwrap().uid;
        assert!(bfx.ops.iter().all(|op| op.uid == replica_uid));
        assert_eq!(
            bfx.ops.len(),
            ops.len(),
            "the backup journals what it applied"
        );
        // The ack made room for m4: m2, m3 and m4 are out.
        assert_eq!(b.queue("q").unwrap().unacked_count(), 3);

        // a is lost; the map makes b the primary.
        b.set_queue_home("q", "b");
        let mut pfx = Effects::default();
        assert_eq!(b.promote_replica("q", 0, &mut pfx).unwrap(), 3);
        consume(&mut b, 10, &mut pfx);
        assert_eq!(
            bodies(&pfx),
            [("m2", true), ("m3", true), ("m4", true), ("m5", false)]
                .map(|(b, r)| (b.to_owned(), r))
        );
    }

    #[test]
    fn a_sealed_primary_makes_no_ops_and_its_hand_over_leaves_the_rest_to_the_new_one() {
        let mut a = member("a");
        let mut b = member("b");
        let mut fx = Effects::default();
        for body in ["m1", "m2", "m3"] {
            publish(&mut a, body, &mut fx);
        }
        consume(&mut a, 2, &mut fx);
        assert_eq!(bodies(&fx).len(), 2);
        let (first, second) = (fx.deliveries[0].delivery_tag, fx.deliveries[1].delivery_tag);
        b.apply_replicated("q", &std::mem::take(&mut fx.ops), &mut Effects::default())
            .unwrap();

        // The move's target caught up: a stops making ops on q.
        assert!(a.seal("q", true, 0, &mut fx));
        assert!(!a.seal("q", true, 0, &mut fx), "once");
        let m = Arc::new(Message::authored(
            "".into(),
            "q".into(),
            Properties::default(),
            Bytes::from_static(b"late"),
        ));
        assert!(
            matches!(
                a.publish("", "q", m, 0, &mut fx),
                Ok(PublishOutcome::Unavailable)
            ),
            "a publish is not taken: its publisher sends it again to the new primary"
        );
        let held = std::mem::take(&mut fx.forwards);
        assert!(
            held.len() == 1 && held[0].lost && &*held[0].primary == "a",
            "held as a lost forward, for the connection to decide"
        );
        a.basic_ack(CH, first, false, 0, &mut fx).unwrap();
        assert!(fx.ops.is_empty(), "nothing to replicate: {:?}", fx.ops);
        assert!(fx.deliveries.len() == 2, "nothing delivered either");

        // The switch: b is the primary, a's consumer ends; its ack of the second
        // delivery changes a's copy no more (b requeued it).
        a.set_queue_home("q", "b");
        assert_eq!(a.hand_over("q", &mut fx), 1);
        assert_eq!(fx.cancelled.len(), 1);
        a.basic_ack(CH, second, false, 0, &mut fx).unwrap();
        assert!(fx.ops.is_empty(), "{:?}", fx.ops);
        b.set_queue_home("q", "b");
        let mut bfx = Effects::default();
        assert_eq!(b.promote_replica("q", 0, &mut bfx).unwrap(), 2);
        consume(&mut b, 10, &mut bfx);
        assert_eq!(
            bodies(&bfx),
            [("m1", true), ("m2", true), ("m3", false)].map(|(b, r)| (b.to_owned(), r)),
            "the ack made while sealed is redone by the client, not lost: m1 comes again"
        );
    }

    #[test]
    fn a_diverged_stream_stops_at_the_first_op_that_does_not_fit() {
        let mut a = member("a");
        let mut b = member("b");
        let mut fx = Effects::default();
        publish(&mut a, "m1", &mut fx);
        publish(&mut a, "m2", &mut fx);
        let mut ops = std::mem::take(&mut fx.ops);
        ops.push(QueueOp {
            kind: OpKind::Settle { id: 1 },
            seq: 3,
            ..ops[0].clone()
        });
        let mut bfx = Effects::default();
        let err = b.apply_replicated("q", &ops, &mut bfx).unwrap_err();
        assert!(err.to_string().contains("message 1"), "{err}");
        assert_eq!(b.queue("q").unwrap().ready_count(), 2);
        assert_eq!(b.queue("q").unwrap().last_seq(), 2);
    }

    #[test]
    fn a_replica_leaves_expiry_to_its_primary() {
        let mut b = member("b");
        let mut fx = Effects::default();
        let m = Arc::new(Message::authored(
            "".into(),
            "q".into(),
            Properties::default(),
            Bytes::from_static(b"short-lived"),
        ));
        let op = QueueOp {
            queue: "q".into(),
            uid: 0,
            seq: 1,
            durable: true,
            kind: OpKind::Enqueue {
                id: 1,
                message: m,
                expires_at_ms: Some(5),
            },
        };
        b.apply_replicated("q", &[op], &mut fx).unwrap();
        b.tick(1_000, &mut fx);
        assert_eq!(
            b.queue("q").unwrap().ready_count(),
            1,
            "the primary's drop op removes it"
        );
    }

    #[test]
    fn only_a_member_that_is_not_the_primary_holds_a_replica() {
        let mut a = member("a");
        let mut fx = Effects::default();
        publish(&mut a, "m1", &mut fx);
        let ops = std::mem::take(&mut fx.ops);
        assert!(a.apply_replicated("q", &ops, &mut fx).is_err());
        assert!(member("b").promote_replica("q", 0, &mut fx).is_err());
        assert!(member("b").apply_replicated("nope", &ops, &mut fx).is_err());
    }

    #[test]
    fn a_dropped_replica_holds_nothing_and_its_journal_records_the_removals() {
        let mut a = member("a");
        let mut fx = Effects::default();
        for body in ["m1", "m2", "m3"] {
            publish(&mut a, body, &mut fx);
        }
        consume(&mut a, 1, &mut fx);
        let ops = std::mem::take(&mut fx.ops);
        let mut b = member("b");
        let mut bfx = Effects::default();
        b.apply_replicated("q", &ops, &mut bfx).unwrap();
        bfx.ops.clear();

        assert_eq!(b.drop_replica("q", &mut bfx), 3);
        let q = b.queue("q").unwrap();
        assert_eq!((q.ready_count(), q.unacked_count()), (0, 0));
        let kinds: Vec<_> = bfx.ops.iter().map(|op| format!("{:?}", op.kind)).collect();
        assert!(
            kinds[0].starts_with("Settle") && kinds[1].starts_with("Purge"),
            "the unacked one is settled, the ready ones purged, in the journal: {kinds:?}"
        );
        assert_eq!(
            a.drop_replica("q", &mut fx),
            0,
            "the primary's queue is no replica"
        );
        assert_eq!(a.queue("q").unwrap().ready_count(), 2);
    }

    #[test]
    fn a_publish_forwarded_for_a_queue_that_moved_away_is_moving_not_acked_as_unroutable() {
        use crate::core::vhost::PublishOutcome;
        let message = || {
            Arc::new(Message::authored(
                "".into(),
                "q".into(),
                Properties::default().with_delivery_mode(2),
                Bytes::from_static(b"m"),
            ))
        };
        let mut fx = Effects::default();
        // The sender still takes `b` for the primary; `b` applied the election (or the
        // planned move's switch) that made `a` the primary: the publish is sent again at
        // `a`, as one that reached a sealed queue (B23) — a session's client resends it, a
        // plain publisher gets a nack.
        let mut b = member("b");
        assert_eq!(
            b.publish_forwarded("", "q", message(), 0, &mut fx),
            PublishOutcome::Moving
        );
        assert_eq!(b.queue("q").unwrap().ready_count(), 0);
        assert_eq!(
            b.publish_forwarded("", "no-such-queue", message(), 0, &mut fx),
            PublishOutcome::Unroutable,
            "a publish that matches no queue is unroutable, as on one broker"
        );
        let mut a = member("a");
        assert_eq!(
            a.publish_forwarded("", "q", message(), 0, &mut fx),
            PublishOutcome::Routed
        );
        assert_eq!(a.queue("q").unwrap().ready_count(), 1);
    }

    #[test]
    fn a_publish_forwarded_to_a_sealed_primary_is_moving_and_enqueued_nowhere() {
        let message = || {
            Arc::new(Message::authored(
                "amq.fanout".into(),
                "".into(),
                Properties::default().with_delivery_mode(2),
                Bytes::from_static(b"m"),
            ))
        };
        let mut a = member("a");
        let mut fx = Effects::default();
        let r = QueueDeclare {
            name: "r".into(),
            durable: true,
            ..Default::default()
        };
        a.queue_declare(1, r, 0).unwrap();
        a.set_queue_home("r", "a");
        for queue in ["q", "r"] {
            a.queue_bind(
                1,
                queue,
                "amq.fanout",
                "",
                crate::amqp::FieldTable::default(),
            )
            .unwrap();
        }
        a.seal("q", true, 0, &mut fx);
        fx.ops.clear();
        assert_eq!(
            a.publish_forwarded("amq.fanout", "", message(), 0, &mut fx),
            PublishOutcome::Moving,
            "not a refusal: the sender publishes it again at the new primary"
        );
        assert_eq!(a.queue("r").unwrap().ready_count(), 0, "nor half taken");
        assert!(fx.ops.is_empty());
        a.seal("q", false, 0, &mut fx);
        assert_eq!(
            a.publish_forwarded("amq.fanout", "", message(), 0, &mut fx),
            PublishOutcome::Routed
        );
    }

    #[test]
    fn a_replica_caught_up_from_an_image_forgets_the_publishes_only_it_took() {
        use crate::core::producers::numbered;
        // `b` was the primary, cut off: it took the session's publish 5, which nobody
        // confirmed and no other copy has.
        let mut b = member("b");
        b.set_queue_home("q", "b");
        let mut fx = Effects::default();
        let own = Arc::new(numbered("only-b", "s:1", 5));
        b.publish("", "q", own.clone(), 0, &mut fx).unwrap();
        // `a` is the primary now, with the session's publishes 1..=3; `b` catches up from it.
        let mut a = member("a");
        for seq in 1..=3 {
            let m = Arc::new(numbered("m", "s:1", seq));
            a.publish("", "q", m, 0, &mut Effects::default()).unwrap();
        }
        b.set_queue_home("q", "a");
        let mut fx = Effects::default();
        b.drop_replica("q", &mut fx);
        for chunk in a.queue_image("q").unwrap().into_chunks(2) {
            b.install_replica("q", chunk, &mut fx).unwrap();
        }
        let q = b.queue("q").unwrap();
        assert!(
            !q.holds_resent(&own),
            "5 was never confirmed: its resend must be taken, not dropped"
        );
        assert!(q.holds_resent(&numbered("m", "s:1", 3)));
        let replaced = &fx.producers_replaced;
        assert_eq!(replaced.len(), 1, "the journal replaces its table too");
        assert_eq!(replaced[0].highest, vec![(Arc::from("s:1"), 3)]);
    }

    /// Gives `b`'s replica of `q` a stale message of its own, as a replica that fell out of
    /// the stream holds.
    fn publish_to_replica(b: &mut VHost, fx: &mut Effects) {
        let mut other = member("a");
        let mut ofx = Effects::default();
        publish(&mut other, "stale", &mut ofx);
        b.apply_replicated("q", &ofx.ops, fx).unwrap();
    }

    #[test]
    fn a_late_backup_installs_the_image_then_follows_the_stream() {
        let mut a = member("a");
        let mut fx = Effects::default();
        publish(&mut a, "m1", &mut fx);
        publish(&mut a, "m2", &mut fx);
        consume(&mut a, 1, &mut fx);
        let image = a.queue_image("q").unwrap();
        fx.ops.clear();
        publish(&mut a, "m3", &mut fx);
        let tag = fx.deliveries[0].delivery_tag;
        a.basic_ack(CH, tag, false, 0, &mut fx).unwrap();
        let after = std::mem::take(&mut fx.ops);

        let mut b = member("b");
        let mut bfx = Effects::default();
        publish_to_replica(&mut b, &mut bfx);
        bfx.ops.clear();
        for chunk in image.into_chunks(1) {
            b.install_replica("q", chunk, &mut bfx).unwrap();
        }
        let kinds: Vec<_> = bfx.ops.iter().map(|op| format!("{:?}", op.kind)).collect();
        assert!(
            kinds[0].starts_with("Purge"),
            "the stale copy goes first: {kinds:?}"
        );
        assert_eq!(bfx.ops.len(), 3, "then the image's messages are journalled");
        b.apply_replicated("q", &after, &mut bfx).unwrap();
        let (qa, qb) = (a.queue("q").unwrap(), b.queue("q").unwrap());
        assert_eq!(qb.last_seq(), qa.last_seq());
        let ids = |q: &crate::core::queue::Queue| q.ready().map(|e| e.id).collect::<Vec<_>>();
        assert_eq!(ids(qb), ids(qa));
        assert_eq!(qb.unacked_count(), qa.unacked_count());
    }

    #[test]
    fn an_abandoned_catch_up_is_reset_by_the_next_attempts_first_chunk() {
        let mut a = member("a");
        let mut fx = Effects::default();
        for body in ["m1", "m2", "m3"] {
            publish(&mut a, body, &mut fx);
        }
        let first_try = a.queue_image("q").unwrap().into_chunks(1);
        let mut b = member("b");
        let mut bfx = Effects::default();
        b.install_replica("q", first_try[0].clone(), &mut bfx)
            .unwrap();
        b.install_replica("q", first_try[1].clone(), &mut bfx)
            .unwrap();
        assert!(b.queue("q").unwrap().is_installing());
        let err = b.apply_replicated("q", &fx.ops, &mut bfx).unwrap_err();
        assert!(
            matches!(err, crate::core::queue::ReplicaError::Installing(_)),
            "no op applies before the last chunk: {err}"
        );

        // The first try is abandoned (its last chunk never comes); the primary moves on
        // and a second image replaces what the first left.
        fx.ops.clear();
        consume(&mut a, 1, &mut fx);
        publish(&mut a, "m4", &mut fx);
        let image = a.queue_image("q").unwrap();
        fx.ops.clear();
        publish(&mut a, "m5", &mut fx);
        let tag = fx.deliveries[0].delivery_tag;
        a.basic_ack(CH, tag, false, 0, &mut fx).unwrap();
        let after = std::mem::take(&mut fx.ops);

        bfx.ops.clear();
        for chunk in image.into_chunks(3) {
            b.install_replica("q", chunk, &mut bfx).unwrap();
        }
        let kinds: Vec<String> = bfx.ops.iter().map(|op| format!("{:?}", op.kind)).collect();
        assert!(
            kinds[0].starts_with("Purge { ids: [1, 2] }"),
            "the half-installed first try goes first: {kinds:?}"
        );
        assert_eq!(
            kinds.iter().filter(|k| k.starts_with("Enqueue")).count(),
            4,
            "then the new image's messages are journalled: {kinds:?}"
        );
        b.apply_replicated("q", &after, &mut bfx).unwrap();
        let (qa, qb) = (a.queue("q").unwrap(), b.queue("q").unwrap());
        assert_eq!(qb.last_seq(), qa.last_seq());
        let ids = |q: &crate::core::queue::Queue| q.ready().map(|e| e.id).collect::<Vec<_>>();
        // The ack made room for m2: it is out with the consumer.
        assert_eq!(ids(qb), vec![3, 4, 5]);
        assert_eq!(ids(qb), ids(qa));
        assert_eq!(qb.unacked_in_order(), vec![2]);
        assert_eq!(qb.unacked_in_order(), qa.unacked_in_order());
    }
}
