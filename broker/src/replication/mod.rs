//! Replication of clustered queues to their backups (DESIGN §3–§4): the primary's queue ops,
//! the same ops its journal consumes, carried whole to every backup, which applies them
//! through the same core ([`crate::core::vhost::VHost::apply_replicated`]).
//!
//! [`codec`] is the stream's format; the links that carry it, the acknowledgements the
//! confirm gate waits for, and catch-up of a new backup build on it (docs/replication.md).

pub mod catch_up;
pub mod codec;
pub mod ledger;
pub mod replicator;

/// The exchange a primary publishes replication frames to on its link to a backup. Only a
/// link connection's publishes to it are taken as frames (a client's are routed, and find no
/// such exchange); it never exists in a vhost.
pub const REPLICATION_EXCHANGE: &str = "amq.ringmq.replication";

/// Bytes a replication frame may add to the largest message it carries besides that
/// message's content header (which a link accepts up to a frame's size on top of
/// `max_message_size`): kind, incarnation, queue name, counts, ids, expiry, flags, exchange
/// and routing key. A frame of one message of `max_message_size` stays within what a link
/// accepts, so a queue never holds a message its backups cannot take.
pub const FRAME_FIELDS_BYTES: u64 = 4096;
