//! What the map asks of the node after an event, and why it cannot go on.

use crate::cluster::roles::QueueRoles;
use crate::core::{AmqpError, OpReply};
use crate::cpg::MemberId;
use crate::session::directory::SessionRecord;

/// What the node must do after an event.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Multicast this member's addresses (once, after joining).
    SendHello,
    /// Multicast a snapshot (built from the store right now) to `to`.
    SendSnapshot {
        /// The joiner.
        to: MemberId,
        /// Index of the event the snapshot reflects.
        through: u64,
    },
    /// A session's record changed at this point of the agreed order (every member emits the
    /// same): it started, was attached or detached, moved to another member, or ended
    /// (`now` is `None`). The node keeps its copy for the members' handshakes, and the member
    /// that held it and no longer does lets go of what it kept.
    SessionChanged {
        /// The session id.
        id: String,
        /// Its record before.
        was: Option<SessionRecord>,
        /// Its record now.
        now: Option<SessionRecord>,
    },
    /// Answer this member's client request.
    Answer {
        /// The request number.
        request: u64,
        /// Its outcome.
        outcome: Result<(OpReply, Option<u64>), AmqpError>,
    },
    /// The member list changed: tell clients (`amq.qpid`).
    HostsChanged,
    /// The membership's marks changed without a change of members (a drain, a planned
    /// switch's configuration index): what the admin API reads follows, clients are not
    /// told.
    MembershipChanged,
    /// The rebalance (`cluster rebalance`) started, stopped, or one of its moves started or
    /// ended: what the admin API reads follows.
    RebalanceChanged,
    /// This member now holds the map: let clients in.
    Synced,
    /// Join the cluster group (a new incarnation that is not, or no longer, in it).
    Join,
    /// Leave the cluster group and join it again: this incarnation resumed a membership whose
    /// map it never received, and only a fresh join brings a snapshot.
    Rejoin,
    /// A clustered queue's roles changed at this point of the agreed order (every member
    /// emits the same): it was declared (`was` is `None`) or deleted (`now` is `None`), an
    /// election moved its primary, it became unavailable or available again, a backup was
    /// added, dropped, marked in sync or out of sync. The node points the queue's `home` at
    /// the primary; the replication layer starts a new backup's catch-up, promotes this
    /// member's replica when it became primary, and stops counting a backup that left the
    /// in-sync set.
    RolesChanged {
        /// Vhost of the queue.
        vhost: String,
        /// The queue.
        queue: String,
        /// Its roles before.
        was: Option<QueueRoles>,
        /// Its roles now.
        now: Option<QueueRoles>,
    },
}

/// Most events a joiner buffers while it waits for its snapshot.
pub const MAX_BUFFERED_EVENTS: usize = 100_000;

/// Why the map cannot go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    /// No snapshot came while the buffer filled.
    #[error("no cluster map arrived while {0} events were buffered")]
    NoSnapshot(usize),
    /// A committed message this member cannot read (another version's format, or damage):
    /// applying the ones after it would let this member's map drift from the others', so it
    /// stops instead (and rejoins with a snapshot when restarted).
    #[error("committed cluster message {index} from member {sender} cannot be decoded")]
    Undecodable {
        /// Its index in the group's agreed order.
        index: u64,
        /// The member that multicast it.
        sender: MemberId,
    },
}
