//! The backup's end of a replication link: a frame a queue's primary published to
//! [`REPLICATION_EXCHANGE`] is applied to this member's replica of the queue, in the batch it
//! arrived in, and confirmed like any publish: a frame that enqueues persistent messages on a
//! durable queue once this member's journal has written them (synced within
//! `journal.replica_sync_ms`, see [`crate::store::journal::Job::Replica`]) — so the
//! primary's confirm gate hears "this backup has it" only when no crash of this process can
//! lose it; a frame of settlements alone, like an ack, at once. A frame that
//! does not fit the replica (the stream diverged) is nacked: the primary catches this
//! backup up again instead of counting on it. An image arrives in chunks, each applied as it
//! comes (the first resets the replica), so this side holds no more than the chunks in
//! flight besides the replica.

use super::{Connection, Lazy};
use crate::core::Message;
use crate::replication::REPLICATION_EXCHANGE;
use crate::replication::codec::Frame;

impl Connection {
    /// Whether this link publish is a replication frame (and so not routed).
    pub(super) fn is_replication(&self, exchange: &str) -> bool {
        self.link && exchange == REPLICATION_EXCHANGE
    }

    /// Applies a replication frame; whether it was applied (the publish's confirm is an ack
    /// then, a nack otherwise).
    pub(super) fn apply_replication(&mut self, message: &Message, v: &mut Lazy) -> bool {
        let frame = match Frame::decode(message.body.bytes()) {
            Ok(frame) => frame,
            Err(e) => {
                tracing::warn!(conn = self.id, error = %e, "undecodable replication frame refused");
                return false;
            }
        };
        let outcome = match frame {
            Frame::Ops { queue, ops, .. } => v
                .get()
                .apply_replicated(&queue, &ops, &mut self.fx)
                .map(drop),
            Frame::Image { queue, chunk, .. } => {
                v.get().install_replica(&queue, chunk, &mut self.fx)
            }
        };
        match outcome {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(conn = self.id, error = %e, "replication frame refused: the primary catches this replica up again");
                false
            }
        }
    }
}
