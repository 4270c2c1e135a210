//! Where the map keeps what it decides (the [`WiringStore`]) and what a member saves of it
//! so that a restart resumes instead of waiting for a snapshot (the [`Checkpoint`]).

use crate::cluster::membership::Membership;
use crate::cluster::rebalance::Rebalance;
use crate::cluster::roles::Roles;
use crate::core::wiring::Wiring;
use crate::core::{AmqpError, OpReply, WiringOp};
use crate::session::directory::SessionDirectory;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Where a member's wiring lives: the broker's vhosts, or plain vhosts in a test.
pub trait WiringStore {
    /// Applies `op`, agreed at `index`, to `vhost`, and records `index` as applied there (see
    /// [`WiringStore::applied_through`]); the reply carries whatever the caller must wait for
    /// (the broker: the journal sequence number of the change).
    fn apply(
        &mut self,
        index: u64,
        vhost: &str,
        op: &WiringOp,
    ) -> Result<(OpReply, Option<u64>), AmqpError>;
    /// The newest agreed index `vhost`'s saved state reflects: a restart's replay skips the ops
    /// up to it, which the previous process applied and saved.
    fn applied_through(&mut self, vhost: &str) -> Option<u64>;
    /// The shared wiring of every vhost, for a joiner.
    fn export(&mut self) -> BTreeMap<String, Wiring>;
    /// Replaces the shared wiring with a snapshot's, which reflects agreed index `through`.
    fn install(&mut self, vhosts: BTreeMap<String, Wiring>, through: u64);
    /// The shared wiring of every vhost that no disk holds, for the map checkpoint
    /// ([`crate::core::VHost::transient_wiring`]).
    fn export_transient(&mut self) -> BTreeMap<String, Wiring>;
    /// Puts a checkpoint's transient wiring back beside what the disk restored, before a
    /// restart replays the log after the checkpoint
    /// ([`crate::core::VHost::restore_transient_wiring`]).
    fn restore_transient(&mut self, vhosts: BTreeMap<String, Wiring>);
    /// Applies again the transient part of `op`, which `vhost`'s saved state reflects (a
    /// restart's replay between the checkpoint and [`WiringStore::applied_through`]), if it
    /// has one ([`crate::core::VHost::has_transient_part`]); the saved state's index stays.
    fn reapply_transient(&mut self, vhost: &str, op: &WiringOp);
}

/// What a member keeps of its map on disk, so that a restart resumes from it (replaying the
/// agreed log after `through`) instead of needing another member's snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Index of the newest event it reflects.
    pub through: u64,
    /// The members as of then.
    pub membership: Membership,
    /// Every clustered queue's roles as of then (none in a checkpoint written before roles
    /// existed).
    #[serde(default)]
    pub roles: Roles,
    /// Every session of the cluster as of then (none in a checkpoint written before the
    /// session directory existed).
    #[serde(default)]
    pub sessions: SessionDirectory,
    /// The newest rebalance, under way or finished (none in a checkpoint written before
    /// rebalances existed).
    #[serde(default)]
    pub rebalance: Option<Rebalance>,
    /// Every vhost's shared wiring that no disk holds, as of then: non-durable exchanges and
    /// queues, the cluster's exclusive queues, bindings with such an end. The journal keeps
    /// only durable wiring, so without this a member restarted in place would lack, until a
    /// snapshot, the transient wiring the others have (none in a checkpoint written before
    /// it was kept).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub transient: BTreeMap<String, Wiring>,
}
