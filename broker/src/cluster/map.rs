//! The cluster map as a pure state machine: CPG events in, the wiring store changed and
//! actions out. No sockets, clocks or locks — the node (`node.rs`) carries the actions out —
//! so every decision (when a joiner holds the map, which events it replays, who sends a
//! snapshot, who answers a client) is tested without I/O, including by a randomised model
//! test that checks every member ends with the same map.

use super::membership::Membership;
use super::message::{ClusterMsg, Snapshot};
use crate::core::AmqpError;
use crate::core::wiring::Wiring;
use crate::core::{OpReply, WiringOp};
use crate::cpg::{CpgEvent, MemberId};
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
}

/// What a member keeps of its map on disk, so that a restart resumes from it (replaying the
/// agreed log after `through`) instead of needing another member's snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Index of the newest event it reflects.
    pub through: u64,
    /// The members as of then.
    pub membership: Membership,
}

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
    /// Answer this member's client request.
    Answer {
        /// The request number.
        request: u64,
        /// Its outcome.
        outcome: Result<(OpReply, Option<u64>), AmqpError>,
    },
    /// The member list changed: tell clients (`amq.qpid`).
    HostsChanged,
    /// This member now holds the map: let clients in.
    Synced,
    /// Join the cluster group (a new incarnation that is not, or no longer, in it).
    Join,
    /// Leave the cluster group and join it again: this incarnation resumed a membership whose
    /// map it never received, and only a fresh join brings a snapshot.
    Rejoin,
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

/// One member's cluster map.
#[derive(Debug)]
pub struct ClusterMap {
    me: MemberId,
    membership: Membership,
    synced: bool,
    joined: bool,
    buffered: Vec<CpgEvent>,
    /// This process's incarnation has started: events now are new, not a restart's replay
    /// (which changes the map but asks nothing of the others).
    live: bool,
    /// This member founded the cluster on an empty data directory: alone in the group, it
    /// founds the map. Nobody else ever does — a restarted member alone in the group holds
    /// a map that may be stale, so it waits for one that holds the newest.
    may_found: bool,
    through: u64,
}

impl ClusterMap {
    /// The map of member `me`, before it joined; `may_found` if it founded a new cluster.
    pub fn new(me: MemberId, may_found: bool) -> Self {
        Self {
            me,
            membership: Membership::default(),
            synced: false,
            joined: false,
            buffered: Vec::new(),
            live: false,
            may_found,
            through: 0,
        }
    }

    /// The map of restarted member `me` as it saved it: resumes with the events after
    /// `checkpoint.through`.
    pub fn resume(me: MemberId, checkpoint: Checkpoint) -> Self {
        Self {
            me,
            membership: checkpoint.membership,
            synced: true,
            joined: true,
            buffered: Vec::new(),
            live: false,
            may_found: false,
            through: checkpoint.through,
        }
    }

    /// What to save so that a restart resumes from here (nothing until this member holds the
    /// map: a restart then starts afresh).
    pub fn checkpoint(&self) -> Option<Checkpoint> {
        self.synced.then(|| Checkpoint {
            through: self.through,
            membership: self.membership.clone(),
        })
    }

    /// Whether this member holds the map.
    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// Whether this process's incarnation has started (see [`CpgEvent::Started`]).
    pub fn is_live(&self) -> bool {
        self.live
    }

    /// The members as this member sees them.
    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// Handles one event of the cluster group.
    pub fn on_event(
        &mut self,
        ev: CpgEvent,
        store: &mut impl WiringStore,
    ) -> Result<Vec<Action>, MapError> {
        let mut actions = Vec::new();
        if let CpgEvent::Started { groups, .. } = &ev {
            self.start(groups.iter().any(|g| g == super::node::GROUP), &mut actions);
            return Ok(actions);
        }
        self.through = self.through.max(ev.index());
        if self.synced {
            if self.failed_me(&ev) {
                // Out of the group: the node exits (a live member) or joins again after its
                // start (a replay), as a new member that needs a snapshot.
                self.forget();
                return Ok(actions);
            }
            self.handle(ev, store, &mut actions)?;
            return Ok(self.live_only(actions));
        }
        match &ev {
            CpgEvent::ConfChg {
                members, joined, ..
            } if !self.joined && joined.iter().any(|m| m.id == self.me) => {
                self.joined = true;
                let ids: Vec<MemberId> = members.iter().map(|m| m.id).collect();
                self.membership.on_conf_change(&ids);
                actions.push(Action::SendHello);
                if ids == [self.me] && self.may_found {
                    // A new cluster's first index: whatever the data directory's wiring says it
                    // applied of an earlier cluster (a force boot) must not hide the new ops.
                    let own = store.export();
                    store.install(own, 0);
                    self.synced = true;
                    actions.push(Action::HostsChanged);
                    actions.push(Action::Synced);
                } else if ids == [self.me] {
                    tracing::error!(
                        "the cluster group is empty and this member restarted on its own data: \
                         it holds a map that may be stale and waits for a member holding the \
                         newest (start the others; if the majority is lost for good, see \
                         `--cluster-force-boot` in docs/cluster.md)"
                    );
                }
            }
            CpgEvent::Deliver { payload, .. } if self.joined => match ClusterMsg::decode(payload) {
                Some(ClusterMsg::Snapshot(s)) if s.to == self.me => {
                    self.install(*s, store, &mut actions)?;
                }
                _ => self.buffered.push(ev),
            },
            _ if self.joined => self.buffered.push(ev),
            _ => {}
        }
        if self.buffered.len() > MAX_BUFFERED_EVENTS {
            return Err(MapError::NoSnapshot(MAX_BUFFERED_EVENTS));
        }
        Ok(self.live_only(actions))
    }

    /// This incarnation started; `in_group`: its membership of the cluster group carries over.
    fn start(&mut self, in_group: bool, actions: &mut Vec<Action>) {
        self.live = true;
        if in_group && self.synced {
            // Resumed: announce the (maybe new) addresses, and take up any snapshot duty the
            // previous process may have left undone.
            actions.push(Action::SendHello);
            for to in self.membership.snapshot_duty(self.me) {
                actions.push(Action::SendSnapshot {
                    to,
                    through: self.through,
                });
            }
            actions.push(Action::HostsChanged);
            actions.push(Action::Synced);
        } else if in_group {
            self.forget();
            actions.push(Action::Rejoin);
        } else {
            self.forget();
            actions.push(Action::Join);
        }
    }

    /// Back to a member that is not in the group and holds no map.
    fn forget(&mut self) {
        self.synced = false;
        self.joined = false;
        self.buffered.clear();
        self.membership = Membership::default();
    }

    /// Whether `ev` ends this member's membership of the group (a failure the others declared).
    fn failed_me(&self, ev: &CpgEvent) -> bool {
        matches!(ev, CpgEvent::ConfChg { failed, .. } if failed.iter().any(|m| m.id == self.me))
    }

    /// A replay (before this incarnation started) changes the map but sends nothing: the
    /// previous process already did, or its successor does once started.
    fn live_only(&self, actions: Vec<Action>) -> Vec<Action> {
        if self.live {
            return actions;
        }
        actions
            .into_iter()
            .filter(|a| {
                !matches!(
                    a,
                    Action::SendHello | Action::SendSnapshot { .. } | Action::Answer { .. }
                )
            })
            .collect()
    }

    /// Builds the snapshot `SendSnapshot` asks for.
    pub fn snapshot(&self, to: MemberId, through: u64, store: &mut impl WiringStore) -> ClusterMsg {
        ClusterMsg::Snapshot(Box::new(Snapshot {
            to,
            through,
            membership: self.membership.clone(),
            vhosts: store.export(),
        }))
    }

    fn install(
        &mut self,
        s: Snapshot,
        store: &mut impl WiringStore,
        actions: &mut Vec<Action>,
    ) -> Result<(), MapError> {
        store.install(s.vhosts, s.through);
        self.membership.install(s.membership);
        self.membership.on_snapshot(self.me);
        self.synced = true;
        for ev in std::mem::take(&mut self.buffered) {
            if ev.index() > s.through {
                self.handle(ev, store, actions)?;
            }
        }
        actions.push(Action::HostsChanged);
        actions.push(Action::Synced);
        Ok(())
    }

    fn handle(
        &mut self,
        ev: CpgEvent,
        store: &mut impl WiringStore,
        actions: &mut Vec<Action>,
    ) -> Result<(), MapError> {
        match ev {
            CpgEvent::ConfChg { index, members, .. } => {
                let ids: Vec<MemberId> = members.iter().map(|m| m.id).collect();
                self.membership.on_conf_change(&ids);
                for to in self.membership.snapshot_duty(self.me) {
                    actions.push(Action::SendSnapshot { to, through: index });
                }
                actions.push(Action::HostsChanged);
            }
            CpgEvent::Deliver {
                index,
                sender,
                payload,
                ..
            } => match ClusterMsg::decode(&payload) {
                Some(ClusterMsg::Hello(info)) => {
                    self.membership.on_hello(sender, info);
                    actions.push(Action::HostsChanged);
                }
                Some(ClusterMsg::Op {
                    origin,
                    request,
                    vhost,
                    op,
                }) => {
                    if store.applied_through(&vhost).is_some_and(|t| index <= t) {
                        // Applied and saved by the previous process: a restart's replay.
                        return Ok(());
                    }
                    let outcome = store.apply(index, &vhost, &op);
                    if origin == self.me {
                        actions.push(Action::Answer { request, outcome });
                    }
                }
                Some(ClusterMsg::Snapshot(s)) => self.membership.on_snapshot(s.to),
                None => return Err(MapError::Undecodable { index, sender }),
            },
            // Handled in `on_event` before any other event.
            CpgEvent::Started { .. } => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
