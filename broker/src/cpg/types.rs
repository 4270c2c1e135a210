//! The openraft type configuration of the CPG layer and what its log entries carry.

use std::io::Cursor;

use serde::{Deserialize, Serialize};

use super::runtime::CpgRuntime;

/// Identity of one CPG member *incarnation*. A restarted process gets a new id (like Corosync's
/// node id + pid), so a member that lost its state can never vote twice under one identity.
pub type MemberId = u64;

openraft::declare_raft_types!(
    /// Raft types of the CPG layer: one log of [`Command`]s, members addressed by
    /// [`openraft::BasicNode`] (`host:port` of their cluster port).
    pub CpgTypes:
        D = Command,
        R = Outcome,
        NodeId = MemberId,
        Node = openraft::BasicNode,
        AsyncRuntime = CpgRuntime,
);

/// One entry of the agreed log. Group joins, leaves and multicasts share one log so that they
/// are totally ordered against each other and against member failures.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// `member` joins `group`.
    Join {
        /// Group name.
        group: String,
        /// Member joining.
        member: MemberId,
    },
    /// `member` leaves `group` of its own will.
    Leave {
        /// Group name.
        group: String,
        /// Member leaving.
        member: MemberId,
    },
    /// `sender` multicasts `payload` to `group`.
    Mcast {
        /// Group name.
        group: String,
        /// Member that sent it.
        sender: MemberId,
        /// Application bytes, encoded as one byte string: as a sequence of `u8`, a 1 MiB
        /// payload costs a million encoder calls, which made appends outlast openraft's
        /// heartbeat-long append timeout in debug builds, so a follower never caught up.
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
    /// The leader declared `members` failed (silent or too slow for the failure timeout): they
    /// leave every group. Decided by the current voters, so it never wedges a configuration;
    /// whether they stay voters is a separate membership change.
    Fail {
        /// Members declared failed.
        members: Vec<MemberId>,
    },
}

/// What applying a [`Command`] did; returned to the member that proposed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Applied at this log index.
    Applied {
        /// Position in the agreed order.
        index: u64,
    },
    /// The proposer is not (or no longer) a member of the group or the cluster, so the command
    /// changed nothing.
    NotMember,
}
