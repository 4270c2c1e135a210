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
use std::collections::BTreeMap;

/// Where a member's wiring lives: the broker's vhosts, or plain vhosts in a test.
pub trait WiringStore {
    /// Applies `op` to `vhost`; the reply carries whatever the caller must wait for (the
    /// broker: the journal sequence number of a durable change).
    fn apply(&mut self, vhost: &str, op: &WiringOp) -> Result<(OpReply, Option<u64>), AmqpError>;
    /// The shared wiring of every vhost, for a joiner.
    fn export(&mut self) -> BTreeMap<String, Wiring>;
    /// Replaces the shared wiring with a snapshot's.
    fn install(&mut self, vhosts: BTreeMap<String, Wiring>);
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
}

impl ClusterMap {
    /// The map of member `me`, before it joined.
    pub fn new(me: MemberId) -> Self {
        Self {
            me,
            membership: Membership::default(),
            synced: false,
            joined: false,
            buffered: Vec::new(),
        }
    }

    /// Whether this member holds the map.
    pub fn is_synced(&self) -> bool {
        self.synced
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
        if self.synced {
            self.handle(ev, store, &mut actions)?;
            return Ok(actions);
        }
        match &ev {
            CpgEvent::ConfChg {
                members, joined, ..
            } if !self.joined && joined.iter().any(|m| m.id == self.me) => {
                self.joined = true;
                let ids: Vec<MemberId> = members.iter().map(|m| m.id).collect();
                self.membership.on_conf_change(&ids);
                actions.push(Action::SendHello);
                if ids == [self.me] {
                    self.synced = true;
                    actions.push(Action::HostsChanged);
                    actions.push(Action::Synced);
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
        Ok(actions)
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
        store.install(s.vhosts);
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
                    let outcome = store.apply(&vhost, &op);
                    if origin == self.me {
                        actions.push(Action::Answer { request, outcome });
                    }
                }
                Some(ClusterMsg::Snapshot(s)) => self.membership.on_snapshot(s.to),
                None => return Err(MapError::Undecodable { index, sender }),
            },
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
