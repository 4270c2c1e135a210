//! The vhost core: exchanges route, queues hold, consumers take. Pure and deterministic —
//! commands in, effects out, time an input — so that the same code serves a primary, a
//! replica fed by queue ops, and tests without I/O.

pub mod args;
pub mod channel;
pub mod error;
pub mod exchange;
pub mod fragments;
pub mod message;
pub mod ops;
pub mod producers;
pub mod queue;
pub mod vhost;
pub mod wiring;
pub mod wiring_op;

#[cfg(test)]
mod tests;

pub use channel::ChannelKey;
pub use error::{AmqpError, CoreResult};
pub use message::{Body, DiskBody, Message};
pub use ops::{OpKind, QueueOp};
pub use vhost::{
    Consume, DeadLetter, Delivery, Effects, ExchangeDeclare, Feed, Feeds, GetOk, HeldDeadLetter,
    PageOut, PublishOutcome, QueueDeclare, QueueDeclared, VHost,
};
pub use wiring_op::{MoveStep, NO_CONNECTION, OWNER_ARGUMENT, OpReply, RebalanceStep, WiringOp};

/// A hash map for what the hot path looks up once or more per message (queue and exchange
/// names, message ids, consumer tags, channel numbers, connection ids): std's map with
/// foldhash's hasher, seeded per process as SipHash is, and several times cheaper on short
/// keys. SipHash was about a tenth of the broker's CPU in a 16 B publish-to-consume run
/// (`docs/performance.md`, "The hot path").
pub type FastHashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// The set of [`FastHashMap`]'s kind.
pub type FastHashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;

/// A copy of `name` in an allocation of its own, for the key of a map the hot path looks it
/// up in. The name's own `Arc` is cloned and dropped for every message (a delivery names
/// its queue and consumer tag) on whichever thread holds the vhost, and an `Arc`'s counts
/// share a cache line with its bytes: a key that is that `Arc` would make every lookup's
/// comparison wait for the line to come back from the other core.
pub fn own_key(name: &str) -> std::sync::Arc<str> {
    std::sync::Arc::from(name)
}

/// The declare argument that makes a queue or an exchange a proxy for the one of the same
/// name elsewhere: another AMQP broker (`amqp://user:pass@host:port/vhost`, a foreign proxy)
/// or a cluster member (its node id or AMQP `host:port`). The core reads it from an
/// exchange's arguments because a foreign exchange routes nothing itself (see
/// [`exchange::Exchange::home`]).
pub const PROXY_ARGUMENT: &str = "qpid.cluster.proxy";

/// The consume argument (honoured on links only) by which a member consuming for its
/// client's channel names that client's resumable session to the queue's primary: what the
/// consumer is delivered is then held for the session should the link be lost with it
/// unsettled (`core::queue::holds`). A client's own use of it is dropped by the member it
/// is connected to.
pub const SESSION_ARGUMENT: &str = "x-ringmq-session";

/// The consume argument (honoured on links only, beside [`SESSION_ARGUMENT`]) by which a
/// member says that its client recognises, by their identity, deliveries its application
/// already had (the failover client): a message held for the session comes back to it under
/// the flag of the delivery that was lost (`core::queue::holds`).
pub const RECOGNISES_ARGUMENT: &str = "x-ringmq-recognises-redeliveries";

/// Whether a queue's home (its primary) names another AMQP broker — a foreign proxy, whose
/// home is that broker's `amqp://` or `amqps://` URI — rather than a cluster member.
pub fn is_foreign(home: &str) -> bool {
    home.starts_with("amqp://") || home.starts_with("amqps://")
}
