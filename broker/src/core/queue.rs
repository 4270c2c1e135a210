//! A queue's content: ready messages in order (per priority level), unacked messages by id,
//! and the one function, [`Queue::apply`], through which every change passes.

use super::args::QueueArgs;
use super::channel::ChannelKey;
use super::message::{DiskBody, Message};
use super::ops::{OpKind, QueueOp};
use super::producers::Producers;
use crate::amqp::FieldTable;
use crate::core::{FastHashMap, FastHashSet};
use std::collections::VecDeque;
use std::sync::Arc;

mod holds;
mod image;

pub use holds::{Delivered, HOLD_MS};
pub use image::{ImageChunk, ImageEntry, QueueImage, ReplicaError};

/// A message held by a queue.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The queue's id for it (its place in the queue's order).
    pub id: u64,
    /// The shared message.
    pub message: Arc<Message>,
    /// Absolute expiry time in ms, if a TTL applies.
    pub expires_at_ms: Option<u64>,
    /// It has been delivered before (the `redelivered` flag of its next delivery).
    pub redelivered: bool,
    /// Its body was paged out to a record of its own (a transient message, or one on a
    /// queue without a journal): that record must be released when the entry leaves. A
    /// persistent message of a durable queue pages out to its `Enqueued` record instead,
    /// which its removal record already retires.
    pub owns_page: bool,
}

/// A consumer as the queue sees it: where it lives.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ConsumerRef {
    /// Channel the consumer was registered on.
    pub channel: ChannelKey,
    /// Its tag on that channel.
    pub tag: Arc<str>,
    /// Its priority ([`Consume::priority`](crate::core::Consume::priority)).
    pub priority: i32,
    /// Another member's pull ([`Consume::pull`](crate::core::Consume::pull)).
    pub pull: bool,
    /// The session whose consumer it is ([`Consume::session`](crate::core::Consume::session)).
    pub session: Option<Arc<str>>,
    /// Its client recognises deliveries its application had
    /// ([`Consume::recognises_redeliveries`](crate::core::Consume::recognises_redeliveries)).
    pub recognises_redeliveries: bool,
    /// Its serial in the queue ([`Queue::next_consumer_serial`]), which a delivery to a
    /// session's consumer names (`core::queue::holds`).
    pub serial: u64,
}

/// A queue: its declaration and its content.
#[derive(Debug)]
pub struct Queue {
    /// Name.
    pub name: Arc<str>,
    /// Unique id of this incarnation of the queue (see [`QueueOp::uid`]).
    pub uid: u64,
    /// Survives a broker restart (with persistence).
    pub durable: bool,
    /// The connection that owns an exclusive queue.
    pub exclusive_owner: Option<u64>,
    /// The resumable session that owns an exclusive queue on a cluster (its id): such a
    /// queue lives as long as the session, wherever the session goes, and is replicated as
    /// a shared queue is (`docs/sessions.md` §4). `exclusive_owner` names the connection
    /// holding the session on this member, if one does.
    pub session: Option<Arc<str>>,
    /// Deleted when its last consumer goes.
    pub auto_delete: bool,
    /// Arguments as declared, for the equivalence check of a redeclare.
    pub arguments: FieldTable,
    /// Arguments the broker acts on.
    pub args: QueueArgs,
    /// Consumers in registration order; the first is the active one under single-active-consumer.
    pub consumers: Vec<ConsumerRef>,
    /// Round-robin position among `consumers`.
    pub next_consumer: usize,
    /// Last time (ms) the queue was used, for `x-expires`.
    pub last_used_ms: u64,
    /// The queue has had a consumer (auto-delete only deletes a queue that had one).
    pub had_consumer: bool,
    /// Node id of the cluster member that owns the queue (where it was declared); `None`
    /// outside a cluster, where the one broker owns everything.
    pub home: Option<Arc<str>>,
    /// Its ops are replicated (this member is the primary of a queue with backups, or holds
    /// a backup's copy): they are recorded even when the queue is not durable.
    pub replicated: bool,
    /// Its primary is moving to another member (`docs/cluster.md`, "Moving a primary"):
    /// this member, still its primary, makes no more ops on it — publishes to it are
    /// refused, nothing is delivered, acks and requeues of its deliveries are left to the
    /// new primary (which requeues what was out) — so the target can hold every op there is.
    /// On the other members it says the same of the primary: a publish to the queue is
    /// held for the switch (a session's: its client sends it again to the new primary) or
    /// nacked (a plain client's), not forwarded to a primary that refuses it.
    pub sealed: bool,
    levels: Vec<VecDeque<Entry>>,
    unacked: FastHashMap<u64, Entry>,
    ready_count: usize,
    ready_bytes: usize,
    /// Bytes of bodies held in memory, ready and unacked: what the memory budget limits.
    resident_bytes: usize,
    /// Entries whose body is in a page record of their own ([`Entry::owns_page`]).
    owned_pages: usize,
    next_id: u64,
    last_seq: u64,
    /// A replica installing an image chunk by chunk: where it stands.
    installing: Option<image::Installing>,
    /// Ids of the messages, ready or unacked, that this member pulled in from another of a
    /// fragmented queue's parts (`VHost::publish_pulled`): never handed to a pull again,
    /// since a message moved twice lands behind later messages of its producer. Kept by
    /// the primary only: after a failover they count as the new primary's own.
    pulled_in: FastHashSet<u64>,
    /// The id of the message a pull is enqueueing whose source had delivered it before
    /// (`VHost::publish_pulled`): it is enqueued marked redelivered, as the source would
    /// have delivered it — a consumer may have seen it.
    pulled_redelivered: Option<u64>,
    /// The highest number each numbering producer's messages reached the queue with, kept
    /// by every copy alike (they apply the same enqueues): a resend after a failover is
    /// dropped by the number (`core::producers`).
    producers: Producers,
    /// Each unacked delivery to a session's consumer ([`OpKind::Deliver`]'s `session`),
    /// kept by every copy alike: a promoted backup holds what comes back for the session
    /// that had it ([`Queue::hold_lost`]).
    delivered_to: FastHashMap<u64, holds::Delivered>,
    /// Deliveries to sessions' consumers so far, by every copy alike: their order.
    session_deliveries: u64,
    /// The recent deliveries to each session's consumers (`core::queue::holds`).
    session_logs: FastHashMap<Arc<str>, holds::SessionLog>,
    /// The highest consumer serial given or seen in a delivery.
    consumer_serials: u64,
    /// Ready messages held for a session ([`Queue::hold`]): the primary's alone, as the ops
    /// do not carry them.
    holds: FastHashMap<u64, holds::Hold>,
}

impl Queue {
    /// The queue's primary when its messages live elsewhere — another cluster member than
    /// `node` (this member's node id; `None` on a single broker), or another AMQP broker
    /// (a foreign proxy) — so that this broker only proxies it; `None` for a local queue.
    pub fn primary_elsewhere(&self, node: Option<&str>) -> Option<&Arc<str>> {
        let home = self.home.as_ref()?;
        let elsewhere = match node {
            Some(node) => home.as_ref() != node,
            None => super::is_foreign(home),
        };
        elsewhere.then_some(home)
    }

    /// Whether this member serves the queue's deliveries now: its primary, and not sealed
    /// for a move (`node` as for [`Queue::primary_elsewhere`]).
    pub fn served_here(&self, node: Option<&str>) -> bool {
        !self.sealed && self.primary_elsewhere(node).is_none()
    }

    /// Whether its content is the cluster's, not one connection's: its ops are replicated
    /// and the other members may use it over their links. Every queue but an exclusive
    /// queue a connection owns (a session's exclusive queue outlives its connections).
    pub fn shares_content(&self) -> bool {
        self.exclusive_owner.is_none() || self.session.is_some()
    }

    /// Whether its persistent messages go to this member's journal: durable, and not
    /// exclusive (an exclusive queue dies with its owner, so no restart finds it).
    pub fn journaled(&self) -> bool {
        self.durable && self.exclusive_owner.is_none()
    }

    /// A new, empty queue.
    pub fn new(
        name: Arc<str>,
        durable: bool,
        exclusive_owner: Option<u64>,
        auto_delete: bool,
        arguments: FieldTable,
        args: QueueArgs,
        now_ms: u64,
    ) -> Self {
        let levels = usize::from(args.max_priority.unwrap_or(0)) + 1;
        Self {
            name,
            uid: 0,
            durable,
            exclusive_owner,
            session: None,
            auto_delete,
            arguments,
            args,
            consumers: Vec::new(),
            next_consumer: 0,
            last_used_ms: now_ms,
            had_consumer: false,
            home: None,
            replicated: false,
            sealed: false,
            levels: (0..levels).map(|_| VecDeque::new()).collect(),
            unacked: FastHashMap::default(),
            ready_count: 0,
            ready_bytes: 0,
            resident_bytes: 0,
            owned_pages: 0,
            next_id: 1,
            last_seq: 0,
            installing: None,
            pulled_in: FastHashSet::default(),
            pulled_redelivered: None,
            producers: Producers::default(),
            delivered_to: FastHashMap::default(),
            session_deliveries: 0,
            session_logs: FastHashMap::default(),
            consumer_serials: 0,
            holds: FastHashMap::default(),
        }
    }

    /// Consumers of the queue's own: its clients' (on every member), not other members'
    /// pulls of a fragmented queue's messages ([`ConsumerRef::pull`]).
    pub fn consumer_count(&self) -> usize {
        self.consumers.iter().filter(|c| !c.pull).count()
    }

    /// Messages ready for delivery.
    pub fn ready_count(&self) -> usize {
        self.ready_count
    }

    /// Body bytes of ready messages.
    pub fn ready_bytes(&self) -> usize {
        self.ready_bytes
    }

    /// Bytes of message bodies this queue holds in memory (ready and unacked).
    pub fn resident_bytes(&self) -> usize {
        self.resident_bytes
    }

    /// Entries whose body is in a page record of their own, to release when the queue goes.
    pub fn owned_pages(&self) -> usize {
        self.owned_pages
    }

    /// Messages delivered and not yet acked.
    pub fn unacked_count(&self) -> usize {
        self.unacked.len()
    }

    /// Sequence number of the last op applied.
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// The id the next enqueued message gets.
    pub fn next_id(&self) -> u64 {
        self.next_id
    }

    /// Marks message `id`, about to be enqueued, as pulled in from another fragment (see the
    /// field) and, when its source had delivered it before, as redelivered.
    pub(crate) fn mark_pulled(&mut self, id: u64, redelivered: bool) {
        self.pulled_in.insert(id);
        self.pulled_redelivered = redelivered.then_some(id);
    }

    /// Whether message `id` was pulled in from another fragment.
    pub(crate) fn is_pulled(&self, id: u64) -> bool {
        !self.pulled_in.is_empty() && self.pulled_in.contains(&id)
    }

    /// Message `id` left the queue: it is no pulled-in message any more.
    pub(crate) fn forget_pulled(&mut self, id: u64) {
        if self.pulled_redelivered == Some(id) {
            self.pulled_redelivered = None;
        }
        if !self.pulled_in.is_empty() {
            self.pulled_in.remove(&id);
        }
    }

    /// Puts back a message recovered from disk, with its original id, before the queue serves
    /// anyone. Recovered messages count as redelivered: they may have been delivered before
    /// the broker stopped.
    ///
    /// With a `memory_budget_bytes`, a message whose body would take the queue's resident
    /// bytes over it keeps only its journal key: recovery of a huge queue holds the first
    /// budget's worth of bodies, not all of them. The bodies kept are copied out of the
    /// buffer they were decoded from, so that buffer can go. Call it in id order.
    pub fn restore(
        &mut self,
        id: u64,
        message: Arc<Message>,
        expires_at_ms: Option<u64>,
        memory_budget_bytes: Option<usize>,
    ) {
        assert!(
            self.last_seq == 0 && self.unacked.is_empty(),
            "queue '{}': restore after it started serving",
            self.name
        );
        self.next_id = self.next_id.max(id + 1);
        self.producers.note(&message);
        let len = message.body_len();
        let message = match (memory_budget_bytes, message.body.in_memory()) {
            (Some(budget), Some(_)) if self.resident_bytes + len > budget => {
                Arc::new(message.paged(DiskBody {
                    uid: self.uid,
                    id,
                    len,
                }))
            }
            (_, Some(_)) => Arc::new(message.detached()),
            (_, None) => message,
        };
        self.add_resident(&message);
        self.insert_ready(Entry {
            id,
            message,
            expires_at_ms,
            redelivered: true,
            owns_page: false,
        });
    }

    /// Flow-to-disk: when the bodies this queue holds in memory exceed `budget_bytes`, the
    /// ready message `id` (just enqueued, so the newest) keeps only its journal key. Returns
    /// the message as it was, body included, when it was paged out: the caller writes it to
    /// a page record if `journaled` is false (no `Enqueued` record holds the body).
    ///
    /// Paging the newest and never the oldest keeps the head of the queue in memory while
    /// the budget allows, so a consumer that keeps up never waits for the disk.
    pub fn page_out(
        &mut self,
        id: u64,
        budget_bytes: usize,
        journaled: bool,
    ) -> Option<Arc<Message>> {
        if self.resident_bytes <= budget_bytes {
            return None;
        }
        let uid = self.uid;
        let entry = self
            .levels
            .iter_mut()
            .find_map(|l| l.back_mut().filter(|e| e.id == id))?;
        let len = entry.message.body_len();
        entry.message.body.in_memory()?;
        let paged = Arc::new(entry.message.paged(DiskBody { uid, id, len }));
        let full = std::mem::replace(&mut entry.message, paged);
        entry.owns_page = !journaled;
        self.owned_pages += usize::from(!journaled);
        self.resident_bytes -= len;
        Some(full)
    }

    fn add_resident(&mut self, message: &Message) {
        if message.body.in_memory().is_some() {
            self.resident_bytes += message.body_len();
        }
    }

    /// Accounts for an entry that left the queue for good.
    fn gone(&mut self, entry: &Entry) {
        if entry.message.body.in_memory().is_some() {
            self.resident_bytes -= entry.message.body_len();
        }
        self.owned_pages -= usize::from(entry.owns_page);
    }

    /// The ready message that would be delivered next.
    pub fn peek(&self) -> Option<&Entry> {
        self.levels.iter().rev().find_map(|l| l.front())
    }

    /// The oldest ready message of the lowest priority level (what drop-head removes first).
    pub fn oldest(&self) -> Option<&Entry> {
        self.levels.iter().find_map(|l| l.front())
    }

    /// Ready messages in delivery order.
    pub fn ready(&self) -> impl Iterator<Item = &Entry> {
        self.levels.iter().rev().flat_map(|l| l.iter())
    }

    /// An unacked message by id.
    pub fn unacked(&self, id: u64) -> Option<&Entry> {
        self.unacked.get(&id)
    }

    /// Ids of unacked messages (unordered).
    pub fn unacked_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.unacked.keys().copied()
    }

    /// Builds the next op of this queue (the caller applies it and passes it on).
    pub fn op(&self, kind: OpKind) -> QueueOp {
        QueueOp {
            queue: self.name.clone(),
            uid: self.uid,
            seq: self.last_seq + 1,
            durable: self.journaled(),
            kind,
        }
    }

    fn level_of(&self, message: &Message) -> usize {
        usize::from(message.priority).min(self.levels.len() - 1)
    }

    fn insert_ready(&mut self, entry: Entry) {
        self.ready_count += 1;
        self.ready_bytes += entry.message.body_len();
        let level = self.level_of(&entry.message);
        let deque = &mut self.levels[level];
        match deque.back() {
            Some(last) if last.id > entry.id => {
                let at = deque.partition_point(|e| e.id < entry.id);
                deque.insert(at, entry);
            }
            _ => deque.push_back(entry),
        }
    }

    /// Ready message `id`.
    pub fn ready_entry(&self, id: u64) -> Option<&Entry> {
        let (level, at) = self.locate_ready(id)?;
        self.levels[level].get(at)
    }

    fn remove_ready(&mut self, id: u64) -> Option<Entry> {
        let (level, at) = self.locate_ready(id)?;
        let entry = self.levels[level].remove(at)?;
        self.ready_count -= 1;
        self.ready_bytes -= entry.message.body_len();
        Some(entry)
    }

    /// Where ready message `id` is: its level and its place there (the head first, as
    /// messages mostly leave from it).
    fn locate_ready(&self, id: u64) -> Option<(usize, usize)> {
        self.levels
            .iter()
            .enumerate()
            .rev()
            .find_map(|(level, deque)| {
                let at = match deque.front() {
                    Some(front) if front.id == id => Some(0),
                    _ => deque.binary_search_by_key(&id, |e| e.id).ok(),
                };
                at.map(|at| (level, at))
            })
    }

    /// The producers' highest numbers a journal kept for this queue (recovery).
    pub fn note_producers(&mut self, highest: &[(Arc<str>, u64)]) {
        self.producers.note_all(highest);
    }

    /// Whether the queue took `message` already: a session's publish that a member which
    /// took the session over sends again (`core::producers`).
    pub fn holds_resent(&self, message: &Message) -> bool {
        self.producers.holds(message)
    }

    /// Applies one op: the only way a queue's content changes, on a primary and on a replica
    /// alike. Returns the entry the op removed from the ready list or the unacked set, if any.
    ///
    /// Panics when the op does not fit the queue (a sequence gap, an unknown message id): a
    /// replica that diverged must stop loudly, not serve wrong data.
    pub fn apply(&mut self, op: &QueueOp) -> Option<Entry> {
        assert_eq!(
            op.seq,
            self.last_seq + 1,
            "queue '{}': op sequence gap",
            self.name
        );
        let kind = match &op.kind {
            // The purged ids are for the op's readers (the journal, the backups): applying
            // needs none of them, so a large purge is not copied.
            OpKind::Purge { .. } => OpKind::Purge { ids: Vec::new() },
            kind => kind.clone(),
        };
        self.apply_next(kind)
    }

    /// Applies the next op of this queue, given by its kind alone: what [`Queue::apply`]
    /// does with an op nobody reads (a transient queue without backups), without building
    /// the op — on the hot path that saves the op's reference counts (its queue name, its
    /// message) and the message's, which moves into the queue.
    pub fn apply_next(&mut self, kind: OpKind) -> Option<Entry> {
        self.last_seq += 1;
        match kind {
            OpKind::Enqueue {
                id,
                message,
                expires_at_ms,
            } => {
                assert!(
                    id >= self.next_id,
                    "queue '{}': enqueue id {id} reused",
                    self.name
                );
                self.next_id = id + 1;
                self.producers.note(&message);
                self.add_resident(&message);
                let redelivered = self.pulled_redelivered.take() == Some(id);
                self.insert_ready(Entry {
                    id,
                    message,
                    expires_at_ms,
                    redelivered,
                    owns_page: false,
                });
                None
            }
            OpKind::Deliver { id, session } => {
                let mut entry = self.remove_ready(id).unwrap_or_else(|| self.missing(id));
                self.unhold(id);
                if let Some(to) = &session {
                    self.record_session_delivery(id, to);
                }
                let returned = entry.clone();
                entry.redelivered = true;
                self.unacked.insert(id, entry);
                Some(returned)
            }
            OpKind::Take { id } | OpKind::Drop { id, .. } => {
                let entry = self.remove_ready(id).unwrap_or_else(|| self.missing(id));
                self.unhold(id);
                self.gone(&entry);
                Some(entry)
            }
            OpKind::Settle { id } => {
                let entry = self.unacked.remove(&id).unwrap_or_else(|| self.missing(id));
                self.forget_delivered_to(id);
                self.gone(&entry);
                Some(entry)
            }
            OpKind::Requeue { id } => {
                let entry = self.unacked.remove(&id).unwrap_or_else(|| self.missing(id));
                self.forget_delivered_to(id);
                self.insert_ready(entry);
                None
            }
            OpKind::Purge { .. } => {
                self.holds.clear();
                for deque in &mut self.levels {
                    for entry in deque.drain(..) {
                        if entry.message.body.in_memory().is_some() {
                            self.resident_bytes -= entry.message.body_len();
                        }
                        self.owned_pages -= usize::from(entry.owns_page);
                    }
                }
                self.ready_count = 0;
                self.ready_bytes = 0;
                None
            }
        }
    }

    fn missing(&self, id: u64) -> ! {
        panic!(
            "queue '{}': op names message {id}, which is not where the op expects it",
            self.name
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::Properties;
    use bytes::Bytes;
    use proptest::prelude::*;

    fn message(priority: u8) -> Arc<Message> {
        Arc::new(Message::authored(
            "".into(),
            "k".into(),
            Properties::default().with_priority(priority),
            Bytes::from_static(b"body"),
        ))
    }

    fn queue(max_priority: Option<u8>) -> Queue {
        let args = QueueArgs {
            max_priority,
            ..QueueArgs::default()
        };
        Queue::new(
            "q".into(),
            false,
            None,
            false,
            FieldTable::default(),
            args,
            0,
        )
    }

    fn step(q: &mut Queue, kind: OpKind) -> QueueOp {
        let op = q.op(kind);
        q.apply(&op);
        op
    }

    #[test]
    fn requeue_puts_a_message_back_at_its_original_place() {
        let mut q = queue(None);
        for id in 1..=3 {
            step(
                &mut q,
                OpKind::Enqueue {
                    id,
                    message: message(0),
                    expires_at_ms: None,
                },
            );
        }
        step(
            &mut q,
            OpKind::Deliver {
                id: 1,
                session: None,
            },
        );
        step(
            &mut q,
            OpKind::Deliver {
                id: 2,
                session: None,
            },
        );
        step(&mut q, OpKind::Requeue { id: 2 });
        step(&mut q, OpKind::Requeue { id: 1 });
        let order: Vec<_> = q.ready().map(|e| (e.id, e.redelivered)).collect();
        assert_eq!(order, vec![(1, true), (2, true), (3, false)]);
    }

    #[test]
    fn higher_priority_is_delivered_first_and_priority_is_capped() {
        let mut q = queue(Some(5));
        step(
            &mut q,
            OpKind::Enqueue {
                id: 1,
                message: message(1),
                expires_at_ms: None,
            },
        );
        step(
            &mut q,
            OpKind::Enqueue {
                id: 2,
                message: message(200),
                expires_at_ms: None,
            },
        );
        step(
            &mut q,
            OpKind::Enqueue {
                id: 3,
                message: message(5),
                expires_at_ms: None,
            },
        );
        let order: Vec<_> = q.ready().map(|e| e.id).collect();
        assert_eq!(order, vec![2, 3, 1]);
    }

    #[derive(Debug, Clone)]
    enum Action {
        Enqueue(u8),
        DeliverHead,
        TakeHead,
        SettleSome(usize),
        RequeueSome(usize),
        DropHead,
        Purge,
    }

    fn action() -> impl Strategy<Value = Action> {
        prop_oneof![
            4 => (0u8..4).prop_map(Action::Enqueue),
            3 => Just(Action::DeliverHead),
            1 => Just(Action::TakeHead),
            2 => any::<usize>().prop_map(Action::SettleSome),
            2 => any::<usize>().prop_map(Action::RequeueSome),
            1 => Just(Action::DropHead),
            1 => Just(Action::Purge),
        ]
    }

    proptest! {
        /// The seam replication and the journal stand on: a replica that applies the op stream
        /// of a primary holds exactly the primary's content, in the same order.
        #[test]
        fn a_replica_fed_the_op_stream_equals_the_primary(actions in prop::collection::vec(action(), 0..200)) {
            let mut primary = queue(Some(3));
            let mut stream = Vec::new();
            for a in actions {
                let mut unacked: Vec<u64> = primary.unacked_ids().collect();
                unacked.sort_unstable();
                let kind = match a {
                    Action::Enqueue(p) => Some(OpKind::Enqueue { id: primary.next_id(), message: message(p), expires_at_ms: None }),
                    Action::DeliverHead => primary.peek().map(|e| OpKind::Deliver {
                        id: e.id,
                        session: None,
                    }),
                    Action::TakeHead => primary.peek().map(|e| OpKind::Take { id: e.id }),
                    Action::DropHead => primary.oldest().map(|e| OpKind::Drop { id: e.id, reason: crate::core::ops::DropReason::MaxLength }),
                    Action::SettleSome(i) => (!unacked.is_empty()).then(|| OpKind::Settle { id: unacked[i % unacked.len()] }),
                    Action::RequeueSome(i) => (!unacked.is_empty()).then(|| OpKind::Requeue { id: unacked[i % unacked.len()] }),
                    Action::Purge => Some(OpKind::Purge { ids: primary.ready().map(|e| e.id).collect() }),
                };
                if let Some(kind) = kind {
                    stream.push(step(&mut primary, kind));
                }
            }
            let mut replica = queue(Some(3));
            for op in &stream {
                replica.apply(op);
            }
            let ready = |q: &Queue| q.ready().map(|e| (e.id, e.redelivered)).collect::<Vec<_>>();
            prop_assert_eq!(ready(&primary), ready(&replica));
            let mut a: Vec<u64> = primary.unacked_ids().collect();
            let mut b: Vec<u64> = replica.unacked_ids().collect();
            a.sort_unstable();
            b.sort_unstable();
            prop_assert_eq!(a, b);
            prop_assert_eq!(primary.ready_bytes(), replica.ready_bytes());
            // Ready ids within one priority level stay in enqueue order.
            for level in &primary.levels {
                prop_assert!(level.iter().zip(level.iter().skip(1)).all(|(x, y)| x.id < y.id));
            }
        }
    }
}
