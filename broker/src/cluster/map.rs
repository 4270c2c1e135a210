//! The cluster map as a pure state machine: CPG events in, the wiring store changed and
//! actions out. No sockets, clocks or locks — the node (`node.rs`) carries the actions out —
//! so every decision (when a joiner holds the map, which events it replays, who sends a
//! snapshot, who answers a client, which member is a queue's primary and which are its
//! backups) is tested without I/O, including by randomised model tests that check every
//! member ends with the same map and that no election ever promotes a backup out of sync.

mod action;
mod control_ops;
mod events;
mod rebalancing;
mod store;

pub use action::{Action, MAX_BUFFERED_EVENTS, MapError};
pub use store::{Checkpoint, WiringStore};

use super::membership::Membership;
use super::message::{ClusterMsg, Snapshot};
use super::rebalance::Rebalance;
use super::roles::Roles;
use crate::core::wiring::Wiring;
use crate::cpg::{CpgEvent, MemberId};
use crate::session::directory::SessionDirectory;
use std::collections::BTreeMap;

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
    /// Every clustered queue's primary, backups and in-sync set.
    roles: Roles,
    /// Every resumable session: where it lives, whether attached.
    sessions: SessionDirectory,
    /// The newest rebalance of the primaries, under way or finished.
    rebalance: Option<Rebalance>,
    /// This process's own hello has been applied: the others know it is back (for a member
    /// restarted in place, that hello is what hands its primaries over to in-sync backups;
    /// see [`ClusterMap::is_announced`]).
    announced: bool,
    /// A resumed checkpoint's transient wiring, put back into the store before the first
    /// event (the store is not at hand when the map is made).
    transient: Option<BTreeMap<String, Wiring>>,
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
            roles: Roles::default(),
            sessions: SessionDirectory::default(),
            rebalance: None,
            announced: false,
            transient: None,
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
            roles: checkpoint.roles,
            sessions: checkpoint.sessions,
            rebalance: checkpoint.rebalance,
            announced: false,
            transient: Some(checkpoint.transient),
        }
    }

    /// What to save so that a restart resumes from here (nothing until this member holds the
    /// map: a restart then starts afresh), with `store`'s transient wiring as of now.
    pub fn checkpoint(&self, store: &mut impl WiringStore) -> Option<Checkpoint> {
        self.synced.then(|| Checkpoint {
            through: self.through,
            membership: self.membership.clone(),
            roles: self.roles.clone(),
            sessions: self.sessions.clone(),
            rebalance: self.rebalance.clone(),
            transient: store.export_transient(),
        })
    }

    /// The agreed index of the newest event applied.
    pub fn through(&self) -> u64 {
        self.through
    }

    /// Whether this member holds the map.
    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// Whether this process's incarnation has started (see [`CpgEvent::Started`]).
    pub fn is_live(&self) -> bool {
        self.live
    }

    /// Whether this process's own hello has been applied here. Until then the member must
    /// not serve: a member restarted in place resumes a map that still names it the primary
    /// of its queues, and its hello — a restart to every other member — hands those with an
    /// in-sync backup over to that backup. The others apply the hello before this member
    /// does, so serving before it would make two primaries of one queue in one
    /// configuration (found by `sim_tests`).
    pub fn is_announced(&self) -> bool {
        self.announced
    }

    /// The members as this member sees them.
    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// Every clustered queue's roles as this member sees them.
    pub fn roles(&self) -> &Roles {
        &self.roles
    }

    /// Every session of the cluster as this member sees them.
    pub fn sessions(&self) -> &SessionDirectory {
        &self.sessions
    }

    /// The newest rebalance as this member sees it.
    pub fn rebalance(&self) -> Option<&Rebalance> {
        self.rebalance.as_ref()
    }

    /// Handles one event of the cluster group.
    pub fn on_event(
        &mut self,
        ev: CpgEvent,
        store: &mut impl WiringStore,
    ) -> Result<Vec<Action>, MapError> {
        let mut actions = Vec::new();
        if let Some(transient) = self.transient.take() {
            store.restore_transient(transient);
        }
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
            self.advance_rebalance(&mut actions);
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
        self.announced = false;
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
            // The store restored its queues from disk, which knows no primaries: every queue
            // learns its roles again.
            for (vhost, queue, r) in self.roles.iter() {
                actions.push(Action::RolesChanged {
                    vhost: vhost.to_owned(),
                    queue: queue.to_owned(),
                    was: None,
                    now: Some(r.clone()),
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
        self.announced = false;
        self.buffered.clear();
        self.membership = Membership::default();
        self.roles = Roles::default();
        self.sessions = SessionDirectory::default();
        self.rebalance = None;
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
        let mut vhosts = store.export();
        self.roles.fill(&mut vhosts);
        ClusterMsg::Snapshot(Box::new(Snapshot {
            to,
            through,
            membership: self.membership.clone(),
            vhosts,
            sessions: self.sessions.clone(),
            rebalance: self.rebalance.clone(),
        }))
    }

    fn install(
        &mut self,
        s: Snapshot,
        store: &mut impl WiringStore,
        actions: &mut Vec<Action>,
    ) -> Result<(), MapError> {
        let roles = Roles::from_wiring(&s.vhosts);
        let old = std::mem::replace(&mut self.roles, roles);
        for (vhost, queue, was) in old.iter() {
            if self.roles.get(vhost, queue).is_none() {
                actions.push(Action::RolesChanged {
                    vhost: vhost.to_owned(),
                    queue: queue.to_owned(),
                    was: Some(was.clone()),
                    now: None,
                });
            }
        }
        for (vhost, queue, now) in self.roles.iter() {
            let was = old.get(vhost, queue);
            if was != Some(now) {
                actions.push(Action::RolesChanged {
                    vhost: vhost.to_owned(),
                    queue: queue.to_owned(),
                    was: was.cloned(),
                    now: Some(now.clone()),
                });
            }
        }
        self.sessions = s.sessions;
        self.rebalance = s.rebalance;
        actions.push(Action::RebalanceChanged);
        store.install(s.vhosts, s.through);
        self.membership.install(s.membership);
        self.membership.on_snapshot(self.me);
        // A joiner's entry is new since its join: if the snapshot already has its info, the
        // snapshot reflects this process's hello.
        self.announced = self.live
            && self
                .membership
                .members()
                .iter()
                .any(|m| m.id == self.me && m.info.is_some());
        self.synced = true;
        for ev in std::mem::take(&mut self.buffered) {
            if ev.index() > s.through {
                self.handle(ev, store, actions)?;
                self.advance_rebalance(actions);
            }
        }
        actions.push(Action::HostsChanged);
        actions.push(Action::Synced);
        Ok(())
    }
}

#[cfg(test)]
mod layout_tests;
#[cfg(test)]
mod roles_model;
#[cfg(test)]
mod roles_tests;
#[cfg(test)]
mod sim_tests;
#[cfg(test)]
mod tests;
