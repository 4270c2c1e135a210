//! The cluster map: members, ring order and the shared wiring, replicated through the CPG
//! layer ([`crate::cpg`]) so that every member applies the same changes in the same order.
//!
//! A wiring change a client asks for on any member is multicast as a [`op::WiringOp`];
//! every member applies it when CPG delivers it, and the member whose client asked answers
//! after that (declare-ok follows the commit). A member that joins gets a snapshot of the
//! map from the first synced member, then follows the stream. Queue *content* stays on the
//! member that owns the queue. `docs/cluster.md` has the whole story.

mod applier;
mod host;
pub mod layout;
pub mod map;
pub mod membership;
pub mod message;
pub mod node;
pub mod notice;
pub mod placement;
pub mod rebalance;
pub mod roles;

pub use host::ClusterHost;
pub use membership::{MemberInfo, MemberState, Membership};
pub use node::{Cluster, ClusterError, ClusterSettings, OpOutcome, Retirement};
pub use rebalance::{MoveState, PlannedMove, Rebalance};
pub use roles::{Held, QueueRoles, Roles};
