//! What a CPG member tells its application, in agreed order.

use bytes::Bytes;

use super::types::MemberId;

/// A member of a group as a configuration change reports it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Member {
    /// Member id (stable across restarts on the same data directory).
    pub id: MemberId,
    /// Cluster address it was admitted with.
    pub addr: String,
}

/// One event of the ordered stream a member receives. Every member of a group sees the same
/// events of that group in the same order, each tagged with its position in the agreed log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CpgEvent {
    /// A multicast, delivered only once committed on a majority ("safe" delivery).
    Deliver {
        /// Group it was sent to.
        group: String,
        /// Position in the agreed order (strictly increasing across the stream).
        index: u64,
        /// Member that sent it.
        sender: MemberId,
        /// The bytes the sender multicast.
        payload: Bytes,
    },
    /// The group's membership changed. The first one a member sees for a group lists itself in
    /// `joined`; the last one lists itself in `left` (after [`super::Cpg::leave`]).
    ConfChg {
        /// Group whose membership changed.
        group: String,
        /// Position in the agreed order.
        index: u64,
        /// Members after the change, ordered by id.
        members: Vec<Member>,
        /// Members that joined the group.
        joined: Vec<Member>,
        /// Members that left the group of their own will.
        left: Vec<Member>,
        /// Members removed from the cluster (crashed, cut off, too slow).
        failed: Vec<Member>,
    },
    /// This process's incarnation has started: every event before this one was addressed to
    /// an earlier incarnation of the member (a restart replays the ones its application had
    /// not yet made durable), every later one to this one. Lists the groups the member still
    /// belongs to; for the rest it must join again.
    Started {
        /// Position in the agreed order.
        index: u64,
        /// Groups whose membership carries over from the previous incarnation.
        groups: Vec<String>,
    },
}

impl CpgEvent {
    /// Position of the event in the agreed order.
    pub fn index(&self) -> u64 {
        match self {
            CpgEvent::Deliver { index, .. }
            | CpgEvent::ConfChg { index, .. }
            | CpgEvent::Started { index, .. } => *index,
        }
    }

    /// Group the event belongs to (`None` for [`CpgEvent::Started`], which concerns them all).
    pub fn group(&self) -> Option<&str> {
        match self {
            CpgEvent::Deliver { group, .. } | CpgEvent::ConfChg { group, .. } => Some(group),
            CpgEvent::Started { .. } => None,
        }
    }
}
