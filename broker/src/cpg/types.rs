//! The openraft type configuration of the CPG layer and what its log entries carry.

use std::io::Cursor;

use serde::{Deserialize, Serialize};

use super::runtime::CpgRuntime;

/// Identity of one CPG member. With a data directory it is stable: the member's consensus
/// state (vote, log) is on disk, so a restarted process is the same voter and can never vote
/// twice in a term. Without one, every process is a new member (like Corosync's node id +
/// pid).
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
        /// The view (index of the group's newest configuration change) the sender meant it
        /// for: delivered only if the group is still in that view. `None`: any view.
        view: Option<u64>,
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
    /// A new process of voter `member` started (on its own data: the same voter). It is no
    /// longer failed, and is told which groups it still belongs to.
    Start {
        /// The member.
        member: MemberId,
        /// The process's incarnation (random per start), so that it recognises its own start
        /// among its predecessors' when its log is replayed.
        incarnation: u64,
        /// It cannot resume its groups (its application's state is older than what its log
        /// still holds): end its memberships, as a failure would.
        reset: bool,
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
    /// A multicast for an older view of its group: not delivered.
    ViewChanged {
        /// The group's view when it was applied.
        view: u64,
    },
}
