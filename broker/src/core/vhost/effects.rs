//! What a batch of commands hands back beyond its replies: deliveries, cancelled consumers,
//! queue ops for the journal and replicas, page records, dead letters whose bodies are on disk.
//! The core never does I/O itself; everything the server must write or read comes out here, and
//! [`apply`] is the one place a queue op is both applied and recorded, so that the journal and
//! the replication stream see exactly the changes the queue went through.

use crate::core::channel::ChannelKey;
use crate::core::message::Message;
use crate::core::ops::{DropReason, OpKind, QueueOp};
use crate::core::queue::{Entry, Queue};
use std::sync::Arc;

/// A message handed to a consumer, to be written by the connection that owns `channel`.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Target channel.
    pub channel: ChannelKey,
    /// Consumer tag.
    pub consumer_tag: Arc<str>,
    /// Delivery tag on that channel.
    pub delivery_tag: u64,
    /// Delivered before.
    pub redelivered: bool,
    /// The message.
    pub message: Arc<Message>,
}

/// A consumer the broker cancelled (its queue was deleted): the client is told with
/// basic.cancel when it announced `consumer_cancel_notify`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancelled {
    /// Channel of the consumer.
    pub channel: ChannelKey,
    /// Its tag.
    pub tag: Arc<str>,
}

/// What a command caused beyond its reply. The caller drains it after each batch of commands.
#[derive(Debug, Default)]
pub struct Effects {
    /// Deliveries to write, grouped by nothing; the caller routes them to their connections.
    pub deliveries: Vec<Delivery>,
    /// Consumers cancelled by the broker.
    pub cancelled: Vec<Cancelled>,
    /// Queue ops of durable and replicated queues, in order, when the vhost records them (see
    /// [`VHost::set_record_ops`](super::VHost::set_record_ops)).
    pub ops: Vec<QueueOp>,
    /// Producer tables a replica took from its primary's image in place of its own, each
    /// with the number of [`Self::ops`] before it: the journal replaces its table for the
    /// queue there, between the ops before and after (B18 in docs/reliability.md).
    pub producers_replaced: Vec<ProducersReplaced>,
    /// Bodies paged out that need a page record of their own (flow-to-disk).
    pub page_out: Vec<PageOut>,
    /// Page records (uid, id) whose entries left their queue: the store may forget them.
    pub page_released: Vec<(u64, u64)>,
    /// Queues (uid) deleted while holding page records: the store forgets all of them.
    pub queues_released: Vec<u64>,
    /// Dead letters whose body is only on disk, with every later one of their pass so that
    /// they keep their order: the server reads the paged bodies, before it
    /// hands this batch's removals to the journal, and passes them back with
    /// [`VHost::dead_letter_resolved`](super::VHost::dead_letter_resolved).
    pub paged_dead_letters: Vec<DeadLetter>,
    /// Rejected messages of `at-least-once` queues whose dead-lettered copies this batch
    /// made: the connection that rejected them keeps them until the batch's conditions hold.
    pub dead_letters_held: Vec<HeldDeadLetter>,

    /// Messages for queues whose primary is another cluster member: the server hands each to
    /// that member, which routes it again over the same replicated bindings into the queues
    /// it owns ([`VHost::publish_forwarded`](super::VHost::publish_forwarded)).
    pub forwards: Vec<Forward>,
    /// Acknowledgements of proxied deliveries, for the server to pass to their primaries.
    pub remote_settles: Vec<RemoteSettle>,
    /// Shared queues this member owns that auto-delete or `x-expires` says must go: on a
    /// cluster the deletion is a cluster op (see [`VHost::retire_queue`](super::VHost)),
    /// so the queue leaves every member at once.
    pub retire: Vec<Arc<str>>,

    /// The replication stamp this batch's confirms wait for: every in-sync backup of the
    /// queues it changed must acknowledge it. Set by the broker when it hands the batch's
    /// ops to the backups, not by the core.
    pub replica_stamp: Option<u64>,

    /// A queue held a publish of this batch already (a session's resend after the member it
    /// lived on was lost, `core::producers`): the batch's confirms wait for everything
    /// handed to the journal and to the backups so far, which covers the first one.
    pub resent_held: bool,

    /// A publish landed on a queue whose consumers cannot keep up (see
    /// [`FLOW_READY_THRESHOLD`](super::FLOW_READY_THRESHOLD)): the publisher should pause
    /// before reading more.
    pub backlogged: bool,
}

/// A routed message some of whose queues live on another member.
#[derive(Debug, Clone)]
pub struct Forward {
    /// Node id of the member that owns those queues.
    pub primary: Arc<str>,
    /// The exchange it was routed through (for a dead letter: the dead-letter exchange).
    pub exchange: Arc<str>,
    /// The routing key it was routed with.
    pub routing_key: Arc<str>,
    /// The message.
    pub message: Arc<Message>,
    /// On whose behalf it was published, when it went to a fragmented queue's fragment:
    /// the primary picks the same fragment ([`VHost::publish_forwarded_as`]).
    pub origin: Option<Arc<str>>,
    /// Its primary is not a live member (lost, its successor not elected yet): it cannot be
    /// taken. The connection whose publish it is decides — a session's publish waits for the
    /// election and is sent again by its client (the forward fails, its fate unknown), a
    /// plain client's is nacked — and the broker never sends it.
    pub lost: bool,
}

/// What became of a proxied delivery at its consumer's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// basic.ack.
    Ack,
    /// basic.nack/reject with requeue, or basic.recover: back to its place on the primary.
    Requeue,
    /// basic.nack/reject without requeue: dropped (dead-lettered) on the primary.
    Reject,
}

/// An acknowledgement of a delivery that came from another member through this channel's
/// upstream channel to that member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteSettle {
    /// The client's channel.
    pub channel: ChannelKey,
    /// Node id of the member the delivery came from.
    pub primary: Arc<str>,
    /// Its delivery tag on the upstream channel.
    pub upstream_tag: u64,
    /// What the client said.
    pub settlement: Settlement,
}

/// A message on its way to its queue's dead-letter exchange.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// The message as it left the queue.
    pub message: Arc<Message>,
    /// The queue it left.
    pub queue: Arc<str>,
    /// Why it left.
    pub reason: DropReason,
    /// Its id in that queue when it has not left yet: a rejected message of an
    /// `at-least-once` queue stays unacknowledged there until its copy is safe
    /// ([`HeldDeadLetter`]).
    pub held: Option<u64>,
}

/// A rejected message kept in its `at-least-once` queue (as an unacknowledged entry that
/// no channel holds) while its dead-lettered copy is on its way: the connection that
/// rejected it settles it with
/// [`VHost::dead_letters_settled`](super::VHost::dead_letters_settled) once the batch that
/// made the copy is durable, replicated and confirmed by the primaries it was forwarded to —
/// removed then, or put back for another try when a forward was refused or the connection
/// went first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldDeadLetter {
    /// The queue it was rejected from.
    pub queue: Arc<str>,
    /// Its id there.
    pub id: u64,
}

/// A replica's producer table replaced by its primary's ([`Effects::producers_replaced`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducersReplaced {
    /// How many of the batch's ops come before it.
    pub after_ops: usize,
    /// The queue's uid.
    pub uid: u64,
    /// The table it has now.
    pub highest: crate::core::producers::Highest,
}

/// A body that flow-to-disk moved out of memory and that no journal record holds: the server
/// writes `message` to a page record under the key (`uid`, `id`).
#[derive(Debug, Clone)]
pub struct PageOut {
    /// Queue incarnation.
    pub uid: u64,
    /// Message id in that queue.
    pub id: u64,
    /// The message, body included.
    pub message: Arc<Message>,
}

/// Applies `kind` to `q` as its next op, recording the op when asked and the queue is
/// durable or replicated (only those have anyone to read their ops: the journal, the
/// backups). An entry that leaves with a page record of its own has that record released
/// — whoever sent the op (a client, the expiry tick, a primary's replication stream), so a
/// replica releases its page records exactly as its primary does. A purge is the exception:
/// use [`purge`], which releases the page records of everything it removes.
pub(super) fn apply(q: &mut Queue, kind: OpKind, record: bool, fx: &mut Effects) -> Option<Entry> {
    let leaves = matches!(
        kind,
        OpKind::Take { .. } | OpKind::Settle { .. } | OpKind::Drop { .. }
    );
    let out = if record && (q.durable || q.replicated) && q.shares_content() {
        let op = q.op(kind);
        let out = q.apply(&op);
        fx.ops.push(op);
        out
    } else {
        q.apply_next(kind)
    };
    if leaves && let Some(e) = out.as_ref() {
        q.forget_pulled(e.id);
        if e.owns_page {
            fx.page_released.push((q.uid, e.id));
        }
    }
    out
}

/// Applies a purge of every ready message of `q` (`ids`, as [`apply`] would), releasing the
/// page records the purged entries own: on a primary (queue.purge) and on a replica (a
/// replicated purge, or a catch-up resetting a stale copy) alike.
pub(super) fn purge(q: &mut Queue, ids: Vec<u64>, record: bool, fx: &mut Effects) {
    if q.owned_pages() > 0 {
        let uid = q.uid;
        fx.page_released
            .extend(q.ready().filter(|e| e.owns_page).map(|e| (uid, e.id)));
    }
    for id in &ids {
        q.forget_pulled(*id);
    }
    apply(q, OpKind::Purge { ids }, record, fx);
}

/// Whether this member's journal holds the `Enqueued` record of a persistent message of `q`
/// (its ops are recorded, it is durable and not exclusive): a body paged out of such a
/// message needs no record of its own.
pub(super) fn journals_persistent(q: &Queue, record: bool) -> bool {
    record && q.journaled()
}

/// Flow-to-disk after message `id` entered `q` (its newest): when the bodies `q` holds in
/// memory exceed `budget_bytes`, this one leaves memory — to its `Enqueued` record when the
/// journal has one, else to a page record of its own that `fx` asks the server to write.
/// The one decision for a primary's enqueue and a replica's replicated enqueue alike, so a
/// backup holds no more in memory than its primary would.
pub(super) fn page_out(
    q: &mut Queue,
    id: u64,
    message: &Message,
    budget_bytes: Option<usize>,
    record: bool,
    fx: &mut Effects,
) {
    let Some(budget) = budget_bytes else {
        return;
    };
    let journaled = journals_persistent(q, record) && message.persistent;
    if let Some(full) = q.page_out(id, budget, journaled)
        && !journaled
    {
        fx.page_out.push(PageOut {
            uid: q.uid,
            id,
            message: full,
        });
    }
}
