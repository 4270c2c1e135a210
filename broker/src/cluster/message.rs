//! What members multicast to the cluster group, and its encoding.

use super::membership::{MemberInfo, Membership};
use crate::core::WiringOp;
use crate::core::wiring::Wiring;
use crate::cpg::MemberId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One multicast of the cluster group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ClusterMsg {
    /// A member's addresses, sent once it has joined.
    Hello(MemberInfo),
    /// A wiring change asked for by a client of `origin`.
    Op {
        /// Member whose client waits for the answer.
        origin: MemberId,
        /// The origin's number for the request.
        request: u64,
        /// Vhost it applies to.
        vhost: String,
        /// The change.
        op: WiringOp,
    },
    /// The cluster map for a member that joined.
    Snapshot(Box<Snapshot>),
}

/// The cluster map as one member held it right after applying event `through`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Member it is for.
    pub to: MemberId,
    /// Agreed index of the last event it reflects: the joiner applies what follows.
    pub through: u64,
    /// Members.
    pub membership: Membership,
    /// Shared wiring per vhost.
    pub vhosts: BTreeMap<String, Wiring>,
    /// Every session of the cluster (none from a member before the session directory).
    #[serde(default)]
    pub sessions: crate::session::directory::SessionDirectory,
    /// The newest rebalance, under way or finished (none from a member before rebalances).
    #[serde(default)]
    pub rebalance: Option<super::rebalance::Rebalance>,
}

impl ClusterMsg {
    /// Bytes to multicast.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("cluster messages always serialise")
    }

    /// Decodes a delivered multicast; `None` for bytes no member of this version sends.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        serde_json::from_slice(bytes).ok()
    }
}
