//! The cluster map as a pure state machine: CPG events in, the wiring store changed and
//! actions out. No sockets, clocks or locks — the node (`node.rs`) carries the actions out —
//! so every decision (when a joiner holds the map, which events it replays, who sends a
//! snapshot, who answers a client, which member is a queue's primary and which are its
//! backups) is tested without I/O, including by randomised model tests that check every
//! member ends with the same map and that no election ever promotes a backup out of sync.

use super::layout::RingLayout;
use super::membership::Membership;
use super::message::{ClusterMsg, Snapshot};
use super::rebalance::{self, Rebalance};
use super::roles::{self, QueueRoles, Roles};
use crate::core::AmqpError;
use crate::core::args::QueueArgs;
use crate::core::wiring::Wiring;
use crate::core::{MoveStep, OpReply, RebalanceStep, WiringOp, is_foreign};
use crate::cpg::{CpgEvent, MemberId};
use crate::session::directory::{SessionChange, SessionDirectory, SessionRecord};
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
                self.membership.changed_at(index);
                self.reconcile_all(None, actions);
                let lost = self.sessions.members_are(&self.membership.ring());
                push_session_changes(actions, lost);
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
                    // A member that announced itself before: its process restarted in place —
                    // unless the same process says it again (a retried send).
                    let restarted = self
                        .membership
                        .members()
                        .iter()
                        .find(|m| m.id == sender)
                        .and_then(|m| m.info.as_ref())
                        .is_some_and(|old| {
                            old.node_id == info.node_id
                                && (old.process == 0 || old.process != info.process)
                        })
                        .then(|| info.node_id.clone());
                    // Where it goes, if it is new to the ring (the planner's gap costs a
                    // pass over every queue; a restart keeps its place).
                    let node = info.node_id.clone();
                    let at = (!self.membership.is_placed(&node))
                        .then(|| rebalance::insertion(&self.roles, &self.membership, &info));
                    self.membership.on_hello(sender, info);
                    if let Some(at) = at
                        && self.membership.place(&node, at)
                    {
                        tracing::info!(
                            member = %node,
                            ring = ?self.membership.ring(),
                            "a new member took its place on the ring"
                        );
                    }
                    self.membership.changed_at(index);
                    if sender == self.me && self.live {
                        self.announced = true;
                    }
                    self.reconcile_all(restarted.as_deref(), actions);
                    if let Some(node) = restarted {
                        let lost = self.sessions.restarted(&node);
                        push_session_changes(actions, lost);
                    }
                    actions.push(Action::HostsChanged);
                }
                Some(ClusterMsg::Op {
                    origin,
                    request,
                    vhost,
                    op,
                }) => {
                    if let WiringOp::Session(op) = &op {
                        let outcome = self.sessions.apply(op);
                        if let Ok(change) = &outcome {
                            push_session_changes(actions, change.clone());
                        }
                        if origin == self.me {
                            actions.push(Action::Answer {
                                request,
                                outcome: outcome.map(|_| (OpReply::default(), None)),
                            });
                        }
                        return Ok(());
                    }
                    if let Some(outcome) = self.apply_sync_op(index, sender, &vhost, &op, actions) {
                        if origin == self.me {
                            actions.push(Action::Answer {
                                request,
                                outcome: outcome.map(|()| (OpReply::default(), None)),
                            });
                        }
                        return Ok(());
                    }
                    if store.applied_through(&vhost).is_some_and(|t| index <= t) {
                        // Applied and saved by the previous process: a restart's replay.
                        // What no disk holds comes back from the checkpoint and the replay.
                        store.reapply_transient(&vhost, &op);
                        self.track_queue(index, origin, &vhost, &op, None, actions);
                        return Ok(());
                    }
                    let outcome = store.apply(index, &vhost, &op);
                    self.track_queue(index, origin, &vhost, &op, Some(&outcome), actions);
                    if origin == self.me {
                        actions.push(Action::Answer { request, outcome });
                    }
                }
                Some(ClusterMsg::Snapshot(s)) => {
                    // The joiner holds the map from here: the admin API's copy says so too
                    // (it used to wait for the next membership change, which, when the
                    // joiner's hello came first, left it `joining` there for good).
                    self.membership.on_snapshot(s.to);
                    actions.push(Action::MembershipChanged);
                }
                None => return Err(MapError::Undecodable { index, sender }),
            },
            // Handled in `on_event` before any other event.
            CpgEvent::Started { .. } => {}
        }
        Ok(())
    }

    /// Sets one queue's roles, and reports the change.
    fn set_roles(&mut self, vhost: &str, queue: &str, now: QueueRoles, actions: &mut Vec<Action>) {
        let was = self.roles.set(vhost, queue, Some(now.clone()));
        actions.push(Action::RolesChanged {
            vhost: vhost.to_owned(),
            queue: queue.to_owned(),
            was,
            now: Some(now),
        });
    }

    /// Brings every queue's roles in line with the ring (after member `restarted` came back
    /// in place, if one did) and, for the queues whose `k` is the layout's, with the
    /// layout's `backups`: a queue that was unavailable when it was set takes it on once it
    /// is back.
    fn reconcile_all(&mut self, restarted: Option<&str>, actions: &mut Vec<Action>) {
        let ring = self.membership.ring();
        let draining = self.membership.draining().clone();
        let k = self.membership.layout().backups;
        self.update_roles(actions, |r| {
            if let Some(node) = restarted {
                r.restarted(node, &ring);
            }
            r.reconcile_with(&ring, &draining);
            if let Some(k) = k.filter(|_| r.default_k) {
                r.set_wanted_backups(k, &ring, &draining);
            }
        });
    }

    /// Applies `f` to every queue's roles, and reports each change.
    fn update_roles(&mut self, actions: &mut Vec<Action>, f: impl FnMut(&mut QueueRoles)) {
        for (vhost, queue, was, now) in self.roles.update_all(f) {
            actions.push(Action::RolesChanged {
                vhost,
                queue,
                was: Some(was),
                now: Some(now),
            });
        }
    }

    /// [`WiringOp::BackupInSync`] and [`WiringOp::BackupOutOfSync`] change the roles only (the
    /// store never sees them), whatever a restart's store saved: `Some` with the answer for
    /// them, `None` for every other op. Out of sync always succeeds (a no-op when the node is
    /// not in sync, or the incarnation is gone), so a primary that waits for it to commit
    /// never waits for ever; in sync is refused when it changes nothing. In sync counts only when `sender` is the primary of
    /// that incarnation: a deposed primary's late op must not vouch for a backup it no longer
    /// feeds.
    fn apply_sync_op(
        &mut self,
        index: u64,
        sender: MemberId,
        vhost: &str,
        op: &WiringOp,
        actions: &mut Vec<Action>,
    ) -> Option<Result<(), AmqpError>> {
        if let WiringOp::MovePrimary {
            queue,
            incarnation,
            to,
            step,
        } = op
        {
            return Some(self.apply_move_op(
                index,
                sender,
                vhost,
                (queue, *incarnation),
                (to, *step),
                actions,
            ));
        }
        if let WiringOp::DrainMember { node, draining } = op {
            self.apply_drain_op(node, *draining, actions);
            return Some(Ok(()));
        }
        if let WiringOp::Rebalance(step) = op {
            return Some(self.apply_rebalance_op(index, step.clone(), actions));
        }
        if let WiringOp::SetRingLayout(layout) = op {
            return Some(self.apply_layout_op(index, layout, actions));
        }
        let (queue, incarnation, node, in_sync) = match op {
            WiringOp::BackupInSync {
                queue,
                incarnation,
                node,
            } => (queue, *incarnation, node, true),
            WiringOp::BackupOutOfSync {
                queue,
                incarnation,
                node,
            } => (queue, *incarnation, node, false),
            _ => return None,
        };
        let sender_node = self.membership.node_id_of(sender);
        let Some(was) = self
            .roles
            .get(vhost, queue)
            .filter(|r| r.incarnation == incarnation)
        else {
            if !in_sync {
                // Out of sync of a queue that is gone (or declared again) holds already.
                return Some(Ok(()));
            }
            return Some(Err(AmqpError::not_found(format!(
                "no incarnation {incarnation} of queue '{queue}' in vhost '{vhost}'"
            ))));
        };
        let mut now = was.clone();
        let changed = if in_sync {
            sender_node == Some(now.primary.as_str()) && now.mark_in_sync(node)
        } else {
            now.mark_out_of_sync(node)
        };
        if changed {
            // A backup in sync may let a draining one go (`QueueRoles::reconcile_with`).
            now.reconcile_with(&self.membership.ring(), self.membership.draining());
            self.set_roles(vhost, queue, now, actions);
            Some(Ok(()))
        } else if in_sync && !now.in_sync.contains(node) {
            Some(Err(AmqpError::precondition(format!(
                "'{node}' is not a backup that the primary of queue '{queue}' in vhost                  '{vhost}' can mark in sync now"
            ))))
        } else {
            Some(Ok(()))
        }
    }

    /// [`WiringOp::MovePrimary`]: a request is refused (for its asker) when the move
    /// cannot be made now; a switch counts only from the queue's primary (a deposed
    /// primary's late switch changes nothing); a cancel always succeeds.
    fn apply_move_op(
        &mut self,
        index: u64,
        sender: MemberId,
        vhost: &str,
        (queue, incarnation): (&str, u64),
        (to, step): (&str, MoveStep),
        actions: &mut Vec<Action>,
    ) -> Result<(), AmqpError> {
        let sender_node = self.membership.node_id_of(sender).map(str::to_owned);
        let Some(was) = self
            .roles
            .get(vhost, queue)
            .filter(|r| r.incarnation == incarnation)
        else {
            return match step {
                MoveStep::Cancel => Ok(()),
                _ => Err(AmqpError::not_found(format!(
                    "no incarnation {incarnation} of queue '{queue}' in vhost '{vhost}'"
                ))),
            };
        };
        let ring = self.membership.ring();
        let draining = self.membership.draining();
        if step == MoveStep::Request && draining.contains(to) {
            return Err(AmqpError::precondition(format!(
                "cannot move the primary of queue '{queue}' in vhost '{vhost}' to '{to}': it is being drained"
            )));
        }
        let mut now = was.clone();
        let changed = match step {
            MoveStep::Request => now.request_move(to, &ring).map_err(|why| {
                AmqpError::precondition(format!(
                    "cannot move the primary of queue '{queue}' in vhost '{vhost}' to '{to}': {why}"
                ))
            })?,
            MoveStep::Switch => {
                sender_node.as_deref() == Some(now.primary.as_str()) && now.switch(to, &ring)
            }
            MoveStep::Cancel => now.cancel_move(to),
        };
        if changed {
            now.reconcile_with(&ring, draining);
            if now.primary != was.primary {
                // Primaries follow the agreed log up to the newest ring change; a switch is
                // one for its queue (the fault suite's two-primaries checker compares claims
                // within one such index).
                self.membership.changed_at(index);
                actions.push(Action::MembershipChanged);
            }
            self.set_roles(vhost, queue, now, actions);
        }
        Ok(())
    }

    /// [`WiringOp::DrainMember`]: the member's mark changes, and with it every queue's roles
    /// (`QueueRoles::reconcile_with`: its primaries start moving, its backups are replaced).
    fn apply_drain_op(&mut self, node: &str, draining: bool, actions: &mut Vec<Action>) {
        if !self.membership.set_draining(node, draining) {
            return;
        }
        let ring = self.membership.ring();
        let marked = self.membership.draining().clone();
        self.update_roles(actions, |r| {
            // Undrained: a move the drain started, not switched yet, is called off.
            if !draining
                && r.primary == node
                && let Some(to) = r.moving_to.clone()
            {
                r.cancel_move(&to);
            }
            r.reconcile_with(&ring, &marked);
        });
        actions.push(Action::MembershipChanged);
    }

    /// [`WiringOp::SetRingLayout`]: refused when no ring can follow it, or while a member
    /// that predates layouts is announced (it follows the ring and `k` without them); else
    /// the ring is ordered by it — again, if it is the layout in force (a member away when
    /// it was set comes to its place) — without moving any queue's copies (a rebalance puts
    /// the backups on the new successors, catch-up first), and when it sets `backups`,
    /// every queue whose `k` is not its own takes it on.
    fn apply_layout_op(
        &mut self,
        index: u64,
        layout: &RingLayout,
        actions: &mut Vec<Action>,
    ) -> Result<(), AmqpError> {
        layout
            .validate()
            .map_err(|e| AmqpError::precondition(format!("cannot set the ring layout: {e}")))?;
        if let Some(old) = self.membership.predating_layouts() {
            return Err(AmqpError::precondition(format!(
                "cannot set the ring layout: member '{old}' runs a version without ring layouts"
            )));
        }
        if !self.membership.set_layout(layout.clone(), index) {
            return Ok(());
        }
        tracing::info!(ring = ?self.membership.ring(), ?layout, "the ring's layout changed");
        self.reconcile_all(None, actions);
        actions.push(Action::MembershipChanged);
        Ok(())
    }

    /// [`WiringOp::Rebalance`]: a start plans the moves from the roles now and starts the
    /// first ones (refused while another rebalance has moves left); a stop skips the moves
    /// not started yet.
    fn apply_rebalance_op(
        &mut self,
        index: u64,
        step: RebalanceStep,
        actions: &mut Vec<Action>,
    ) -> Result<(), AmqpError> {
        match step {
            RebalanceStep::Start { concurrency } => {
                if let Some(r) = self.rebalance.as_ref().filter(|r| !r.finished()) {
                    return Err(AmqpError::precondition(format!(
                        "a rebalance is under way ({} of its {} moves left): wait for it or \
                         stop it first",
                        r.moves_left(),
                        r.moves.len()
                    )));
                }
                let plan = Rebalance::start(index, concurrency, &self.roles, &self.membership);
                self.rebalance = Some(plan);
                actions.push(Action::RebalanceChanged);
                self.advance_rebalance(actions);
            }
            RebalanceStep::Stop => {
                if self.rebalance.as_mut().is_some_and(Rebalance::stop) {
                    actions.push(Action::RebalanceChanged);
                }
            }
            RebalanceStep::Join { node } => {
                if !self.membership.take_newcomer(&node) {
                    // Its share was handed over already (a retried send).
                    return Ok(());
                }
                actions.push(Action::MembershipChanged);
                if self.roles.iter().next().is_none() {
                    return Ok(());
                }
                if let Some(r) = self.rebalance.as_ref().filter(|r| !r.finished()) {
                    tracing::warn!(
                        member = %node,
                        moves_left = r.moves_left(),
                        "a new member joined during a rebalance: it gets its share from the \
                         next `cluster rebalance --apply`"
                    );
                    return Ok(());
                }
                let plan = Rebalance::join(index, &node, &self.roles, &self.membership);
                tracing::info!(
                    member = %node,
                    between = ?plan.scope,
                    primary_moves = plan.moves.len(),
                    "handing a new member its share of the queues"
                );
                self.rebalance = Some(plan);
                actions.push(Action::RebalanceChanged);
                self.advance_rebalance(actions);
            }
        }
        Ok(())
    }

    /// Moves the rebalance on after an event: records the moves that switched or were
    /// called off, and starts the next ones (their queues' roles change here, as a
    /// [`MoveStep::Request`] would change them).
    fn advance_rebalance(&mut self, actions: &mut Vec<Action>) {
        let Some(r) = self.rebalance.as_mut().filter(|r| !r.finished()) else {
            return;
        };
        let ring = self.membership.ring();
        let (requests, changed) = r.advance(&self.roles, &ring, self.membership.draining());
        for (vhost, queue, now) in requests {
            self.set_roles(&vhost, &queue, now, actions);
        }
        if changed {
            actions.push(Action::RebalanceChanged);
        }
    }

    /// Keeps the roles in step with the queues: a declare that created a clustered queue
    /// gives it roles (incarnation: this op's agreed `index`), a delete takes them away.
    /// `outcome` is the store's answer; `None` for an op a restart's store had already
    /// applied, where the map decides from what it holds (a queue it has no roles for, with
    /// valid arguments, is created).
    fn track_queue(
        &mut self,
        index: u64,
        origin: MemberId,
        vhost: &str,
        op: &WiringOp,
        outcome: Option<&Result<(OpReply, Option<u64>), AmqpError>>,
        actions: &mut Vec<Action>,
    ) {
        match op {
            WiringOp::DeclareQueue {
                name,
                exclusive,
                home: Some(home),
                arguments,
                server_named,
                ..
            } if !is_foreign(home) && (!exclusive || op.declaring_session().is_some()) => {
                let Ok(args) = QueueArgs::parse(arguments, name, vhost) else {
                    return;
                };
                let created = match outcome {
                    Some(Ok((reply, _))) => reply.created,
                    Some(Err(_)) => false,
                    None => {
                        let reserved = name.starts_with("amq.")
                            && !(*server_named && name.starts_with("amq.gen-"));
                        !reserved && self.roles.get(vhost, name).is_none()
                    }
                };
                if !created {
                    return;
                }
                let declared = || {
                    self.membership
                        .members()
                        .iter()
                        .find(|m| m.id == origin)
                        .and_then(|m| m.info.as_ref())
                        .map_or(roles::DEFAULT_BACKUPS, |i| i.default_backups)
                };
                let k = (args.backups)
                    .or(self.membership.layout().backups)
                    .unwrap_or_else(declared);
                let ring = self.membership.ring();
                let mut now = QueueRoles::new(index, home, k, &ring);
                now.default_k = args.backups.is_none();
                now.reconcile_with(&ring, self.membership.draining());
                self.set_roles(vhost, name, now, actions);
            }
            WiringOp::DeleteQueue { name, .. } if !matches!(outcome, Some(Err(_))) => {
                if let Some(was) = self.roles.set(vhost, name, None) {
                    actions.push(Action::RolesChanged {
                        vhost: vhost.to_owned(),
                        queue: name.clone(),
                        was: Some(was),
                        now: None,
                    });
                }
            }
            _ => {}
        }
    }
}

/// Reports each session change as an action, in order.
fn push_session_changes(
    actions: &mut Vec<Action>,
    changes: impl IntoIterator<Item = SessionChange>,
) {
    for (id, was, now) in changes {
        actions.push(Action::SessionChanged { id, was, now });
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
