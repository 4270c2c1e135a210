//! Who is in the cluster, in ring order, with the addresses they announced, and who still
//! waits for the cluster map. Driven only by CPG events, so every member holds the same
//! picture after the same events; no I/O, so the decisions (who sends a joiner its
//! snapshot, what `known-hosts` says) are tested without sockets.

use super::layout::{self, RingLayout};
use crate::cpg::MemberId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Where a member goes in the ring when it is new: a configured order (`ring_order`), or
/// before a member the planner chose, or at the end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Insertion {
    /// Among the members with a configured order, after those with a lower or equal one.
    Order(u32),
    /// Before this member (the planner's choice of gap, or the next member of an explicit
    /// ring order).
    Before(String),
    /// Right after this member (the previous member of an explicit ring order).
    After(String),
    /// After every member.
    End,
}

/// One place on the ring. It outlives the member's stay in the group, so that a member
/// that restarts or comes back after a partition takes its old place, and its neighbours
/// keep backing the same queues.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingSlot {
    /// Node id of the member the place is for.
    pub node: String,
    /// Its configured `ring_order`, if it had one when it was placed.
    #[serde(default)]
    pub order: Option<u32>,
}

/// What a member announces about itself once it has joined.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    /// Node id from the configuration (an operator-given name; the CPG member id is stable
    /// too, but a member whose data directory is lost gets a new one); queues name their
    /// owner by it.
    pub node_id: String,
    /// AMQP address clients reach it at (`host:port`).
    pub amqp: String,
    /// Admin HTTP address (`host:port`).
    pub admin: String,
    /// Failure zone.
    pub zone: String,
    /// Its `default_backups`: the `k` of a queue declared through it without
    /// `qpid.cluster.backups`. Announced, so that every member gives such a queue the same
    /// number of backups whatever its own configuration says (a member that predates it
    /// announces none: [`super::roles::DEFAULT_BACKUPS`]).
    #[serde(default = "default_backups")]
    pub default_backups: u8,
    /// Its configured `ring_order`: where a new member goes on the ring (among the members
    /// with one, after those with a lower or equal order). `None`: the planner picks the gap.
    #[serde(default)]
    pub ring_order: Option<u32>,
    /// It keeps the ring's places ([`RingSlot`]); false from a member that predates them,
    /// which orders the ring by join order. Until every announced member keeps them, nobody
    /// is placed and the ring is join order on every member, so a rolling upgrade never has
    /// two members disagree on it (nor sends a claim an old member cannot read).
    #[serde(default)]
    pub places_ring: bool,
    /// It reads ring layouts ([`super::layout`], `WiringOp::SetRingLayout`): false from a
    /// member that predates them, which could not decode the op and would leave the
    /// cluster. Nobody sets a layout while such a member is announced.
    #[serde(default)]
    pub lays_out_ring: bool,
    /// It reads replicated deliveries that name their session (replication frame kind 8,
    /// `core::queue::holds`): false from a member that predates them, which would refuse
    /// such a frame and fall out of sync. Until every announced member reads them, primaries
    /// leave the sessions out of the stream ([`Membership::every_member_holds_for_sessions`]).
    #[serde(default)]
    pub holds_for_sessions: bool,
    /// A random nonce of the process that announced it: a second hello with the same nonce
    /// is that process retrying a send that timed out, not a restart in place (which hands
    /// its primaries over to in-sync backups while it may still be serving them). 0 from a
    /// member that predates it: every hello of it counts as a restart, as before.
    #[serde(default)]
    pub process: u64,
}

fn default_backups() -> u8 {
    super::roles::DEFAULT_BACKUPS
}

/// One member as the map knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberState {
    /// CPG member id (stable across restarts on the same data directory).
    pub id: MemberId,
    /// What it announced; `None` until its hello is delivered.
    pub info: Option<MemberInfo>,
    /// It holds the cluster map (it founded the cluster or installed a snapshot).
    pub synced: bool,
}

/// The members of the group (in join order) and the ring they sit on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    members: Vec<MemberState>,
    /// Every member ever placed, in ring order, present or not (see [`RingSlot`]). Empty in
    /// a map saved before it existed: [`Membership::ring`] then falls back to join order.
    #[serde(default)]
    ring: Vec<RingSlot>,
    /// Node ids placed on the ring as new members of a cluster that had members already,
    /// whose share of the queues has not been handed to them yet (`RebalanceStep::Join`).
    #[serde(default)]
    newcomers: BTreeSet<String>,
    /// Agreed index of the newest event that changed the ring — a configuration change or a
    /// hello — or switched a queue's primary by a planned move, which is what every queue's
    /// primary follows: two members that name this same index name the same primaries. The fault suite's two-primaries checker compares
    /// members' claims only within one configuration (0 in a map saved before it existed).
    #[serde(default)]
    configuration: u64,
    /// Node ids of the members being drained (`cluster drain`): they take no new roles and
    /// hand over the ones they hold. By node id, so a drained member that restarts or
    /// leaves and comes back is still drained until it is undrained.
    #[serde(default)]
    draining: BTreeSet<String>,
    /// The ring's layout as last set (`PUT /api/cluster/ring`, a `BackupRing`): how new
    /// members are placed and the `k` of queues without their own.
    #[serde(default)]
    layout: RingLayout,
    /// Agreed index of the op that last set `layout` (0: never set). A rebalance started
    /// before it has not put the backups where the layout wants them.
    #[serde(default)]
    layout_changed_at: u64,
}

impl Membership {
    /// Applies a configuration change: `members` is the group after it (any order). Members
    /// that are gone leave the ring; new ones join at its end, not yet synced — unless the
    /// group is the new member alone, which founds the map with what it has.
    pub fn on_conf_change(&mut self, members: &[MemberId]) {
        self.members.retain(|m| members.contains(&m.id));
        let alone = members.len() == 1;
        for &id in members {
            if !self.members.iter().any(|m| m.id == id) {
                self.members.push(MemberState {
                    id,
                    info: None,
                    synced: alone,
                });
            }
        }
    }

    /// A member announced its addresses.
    pub fn on_hello(&mut self, id: MemberId, info: MemberInfo) {
        if let Some(m) = self.members.iter_mut().find(|m| m.id == id) {
            m.info = Some(info);
        }
    }

    /// Whether `node` has a place on the ring (it was placed before, present or not).
    pub fn is_placed(&self, node: &str) -> bool {
        self.ring.iter().any(|s| s.node == node)
    }

    /// Gives `node` its place on the ring, unless it has one: where `at` says (an
    /// [`Insertion::Order`] is kept with the place, for the members placed after it). A node
    /// that joins a ring with members already is a newcomer until its share is handed to it
    /// ([`Membership::take_newcomer`]). Returns whether it is new to the ring.
    pub fn place(&mut self, node: &str, at: Insertion) -> bool {
        if !self.all_place_ring() {
            return false;
        }
        self.adopt_unplaced(node);
        if self.is_placed(node) {
            return false;
        }
        let order = match at {
            Insertion::Order(mine) => Some(mine),
            _ => None,
        };
        let index = match at {
            Insertion::Order(mine) => self
                .ring
                .iter()
                .position(|s| s.order.is_some_and(|o| o > mine))
                .unwrap_or(self.ring.len()),
            Insertion::Before(other) => {
                (self.ring.iter().position(|s| s.node == other)).unwrap_or(self.ring.len())
            }
            Insertion::After(other) => (self.ring.iter().position(|s| s.node == other))
                .map_or(self.ring.len(), |at| at + 1),
            Insertion::End => self.ring.len(),
        };
        let slot = RingSlot {
            node: node.to_owned(),
            order,
        };
        self.ring.insert(index, slot);
        if self.ring().iter().any(|n| n != node) {
            self.newcomers.insert(node.to_owned());
        }
        true
    }

    /// Places the announced members a map from before the ring existed knows only by join
    /// order, at the end in that order (all but `except`, which is being placed).
    fn adopt_unplaced(&mut self, except: &str) {
        for m in &self.members {
            if let Some(info) = &m.info
                && info.node_id != except
                && !self.is_placed(&info.node_id)
            {
                self.ring.push(RingSlot {
                    node: info.node_id.clone(),
                    order: info.ring_order,
                });
            }
        }
    }

    /// Whether every announced member keeps the ring's places (see
    /// [`MemberInfo::places_ring`]).
    fn all_place_ring(&self) -> bool {
        (self.members.iter())
            .filter_map(|m| m.info.as_ref())
            .all(|i| i.places_ring)
    }

    /// Whether `node` was placed as a newcomer and still waits for its share.
    pub fn is_newcomer(&self, node: &str) -> bool {
        self.newcomers.contains(node)
    }

    /// `node` got its share (or will not): it is a newcomer no more. Returns whether it was.
    pub fn take_newcomer(&mut self, node: &str) -> bool {
        self.newcomers.remove(node)
    }

    /// Node ids of the members whose hello arrived, in ring order: who may hold a role now.
    /// Placed members first, in their places; then any announced member not placed (a map
    /// from before the ring existed), in join order. Join order alone while a member that
    /// predates the places is announced.
    pub fn ring(&self) -> Vec<String> {
        let announced: Vec<&str> = (self.members.iter())
            .filter_map(|m| m.info.as_ref().map(|i| i.node_id.as_str()))
            .collect();
        if !self.all_place_ring() {
            return announced.into_iter().map(str::to_owned).collect();
        }
        let mut ring: Vec<String> = (self.ring.iter())
            .filter(|s| announced.contains(&s.node.as_str()))
            .map(|s| s.node.clone())
            .collect();
        for n in announced {
            if !ring.iter().any(|r| r == n) {
                ring.push(n.to_owned());
            }
        }
        ring
    }

    /// The ring changed at agreed `index` (a configuration change or a hello was applied).
    pub fn changed_at(&mut self, index: u64) {
        self.configuration = index;
    }

    /// Agreed index of the newest event that changed the ring (see the field's doc).
    pub fn configuration(&self) -> u64 {
        self.configuration
    }

    /// Node `node` is drained (`on`) or undrained; returns whether that changed anything.
    pub fn set_draining(&mut self, node: &str, on: bool) -> bool {
        if on {
            self.draining.insert(node.to_owned())
        } else {
            self.draining.remove(node)
        }
    }

    /// Node ids of the members being drained.
    pub fn draining(&self) -> &BTreeSet<String> {
        &self.draining
    }

    /// The ring's layout in force: as last set, or none (the brokers place new members,
    /// each member's `default_backups`) while a member that predates layouts is announced,
    /// which decides as if there were none — so that every member decides the same.
    pub fn layout(&self) -> &RingLayout {
        static NONE: RingLayout = RingLayout {
            order: layout::RingOrder::Placement,
            backups: None,
        };
        match self.predating_layouts() {
            Some(_) => &NONE,
            None => &self.layout,
        }
    }

    /// Whether every announced member reads replicated deliveries that name their session
    /// ([`MemberInfo::holds_for_sessions`]).
    pub fn every_member_holds_for_sessions(&self) -> bool {
        (self.members.iter())
            .filter_map(|m| m.info.as_ref())
            .all(|i| i.holds_for_sessions)
    }

    /// Node id of an announced member that predates ring layouts, if there is one.
    pub fn predating_layouts(&self) -> Option<&str> {
        (self.members.iter())
            .filter_map(|m| m.info.as_ref())
            .find(|i| !i.lays_out_ring)
            .map(|i| i.node_id.as_str())
    }

    /// Agreed index of the op that last set the layout (0: never).
    pub fn layout_changed_at(&self) -> u64 {
        self.layout_changed_at
    }

    /// Sets the layout at agreed `index` and orders every place on the ring by it (members
    /// away now too: a member whose zone is not known keeps its turn after the others;
    /// nobody moves while a member that predates the ring's places is announced, as the
    /// ring is join order then). Returns whether the layout or the order changed; only
    /// then is `index` recorded as the change.
    pub fn set_layout(&mut self, layout: RingLayout, index: u64) -> bool {
        let new = self.layout != layout;
        self.layout = layout;
        let reordered = self.order_ring();
        if new || reordered {
            self.layout_changed_at = index;
        }
        new || reordered
    }

    /// Orders every place on the ring by the layout; returns whether anyone moved.
    fn order_ring(&mut self) -> bool {
        if !self.all_place_ring() {
            return false;
        }
        self.adopt_unplaced("");
        let now: Vec<String> = self.ring.iter().map(|s| s.node.clone()).collect();
        let zone_of = |node: &str| {
            (self.members.iter())
                .filter_map(|m| m.info.as_ref())
                .find(|i| i.node_id == node)
                .map(|i| i.zone.clone())
        };
        let wanted = layout::ordered(&now, &self.layout.order, zone_of);
        if wanted == now {
            return false;
        }
        let mut slots = std::mem::take(&mut self.ring);
        for node in wanted {
            if let Some(at) = slots.iter().position(|s| s.node == node) {
                self.ring.push(slots.remove(at));
            }
        }
        true
    }

    /// Every place on the ring, in ring order, present or not: what an explicit layout
    /// places a newcomer between.
    pub fn places(&self) -> Vec<String> {
        self.ring.iter().map(|s| s.node.clone()).collect()
    }

    /// A snapshot addressed to `to` was delivered: from now on it holds the map.
    pub fn on_snapshot(&mut self, to: MemberId) {
        if let Some(m) = self.members.iter_mut().find(|m| m.id == to) {
            m.synced = true;
        }
    }

    /// Replaces the whole picture (a joiner installing a snapshot).
    pub fn install(&mut self, other: Membership) {
        *self = other;
    }

    /// The members a snapshot must be sent to, if `me` is the one whose duty that is: the
    /// first synced member in ring order. Every member computes the same answer, so exactly
    /// one sends (and, if it fails, the next one after the configuration change).
    pub fn snapshot_duty(&self, me: MemberId) -> Vec<MemberId> {
        let sender = self.members.iter().find(|m| m.synced).map(|m| m.id);
        if sender != Some(me) {
            return Vec::new();
        }
        self.members
            .iter()
            .filter(|m| !m.synced)
            .map(|m| m.id)
            .collect()
    }

    /// Whether `id` holds the map.
    pub fn is_synced(&self, id: MemberId) -> bool {
        self.members.iter().any(|m| m.id == id && m.synced)
    }

    /// The node id member `id` announced (`None` before its hello, or for a stranger): who
    /// sent an op, in the terms roles use.
    pub fn node_id_of(&self, id: MemberId) -> Option<&str> {
        self.members
            .iter()
            .find(|m| m.id == id)
            .and_then(|m| m.info.as_ref())
            .map(|i| i.node_id.as_str())
    }

    /// The members in ring order.
    pub fn members(&self) -> &[MemberState] {
        &self.members
    }

    /// AMQP addresses of the live members, in ring order: what `known-hosts` and the
    /// `amq.qpid` notices tell clients.
    pub fn known_hosts(&self) -> Vec<String> {
        self.members
            .iter()
            .filter_map(|m| m.info.as_ref().map(|i| i.amqp.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(n: u8) -> MemberInfo {
        MemberInfo {
            node_id: format!("n{n}"),
            amqp: format!("127.0.0.1:{}", 5670 + u16::from(n)),
            admin: String::new(),
            zone: String::new(),
            default_backups: 1,
            ring_order: None,
            places_ring: true,
            lays_out_ring: true,
            holds_for_sessions: true,
            process: 0,
        }
    }

    #[test]
    fn the_founder_is_synced_and_sends_joiners_their_snapshot() {
        let mut m = Membership::default();
        m.on_conf_change(&[10]);
        assert!(m.is_synced(10));
        m.on_conf_change(&[10, 20]);
        m.on_conf_change(&[10, 20, 30]);
        assert_eq!(m.snapshot_duty(10), vec![20, 30]);
        assert!(m.snapshot_duty(20).is_empty());
        m.on_snapshot(20);
        assert_eq!(m.snapshot_duty(10), vec![30]);
    }

    #[test]
    fn the_duty_passes_on_when_the_sender_fails() {
        let mut m = Membership::default();
        m.on_conf_change(&[10]);
        m.on_conf_change(&[10, 20]);
        m.on_snapshot(20);
        m.on_conf_change(&[10, 20, 30]);
        m.on_conf_change(&[20, 30]);
        assert_eq!(m.snapshot_duty(20), vec![30]);
    }

    #[test]
    fn a_joiner_is_not_synced_and_known_hosts_follow_hellos_in_ring_order() {
        let mut m = Membership::default();
        m.on_conf_change(&[30, 10]);
        assert!(!m.is_synced(10) && !m.is_synced(30));
        m.on_hello(10, info(1));
        m.on_hello(30, info(3));
        assert_eq!(m.known_hosts(), vec!["127.0.0.1:5673", "127.0.0.1:5671"]);
        m.on_conf_change(&[10]);
        assert_eq!(m.known_hosts(), vec!["127.0.0.1:5671"]);
    }

    #[test]
    fn while_a_member_predates_the_places_the_ring_is_join_order_and_nobody_is_placed() {
        let mut m = Membership::default();
        m.on_conf_change(&[10]);
        m.on_hello(10, info(1));
        assert!(m.place("n1", Insertion::End), "alone: placed");
        m.on_conf_change(&[10, 20, 30]);
        m.on_hello(
            20,
            MemberInfo {
                places_ring: false,
                lays_out_ring: false,
                holds_for_sessions: false,
                ..info(2)
            },
        );
        m.on_hello(30, info(3));
        assert!(!m.place("n3", Insertion::Order(0)), "n2 is old");
        assert_eq!(m.ring(), ["n1", "n2", "n3"]);
        assert!(!m.is_newcomer("n3"), "no claim an old member cannot read");
        // n2 upgraded (restarted in place): from its next hello on, places are kept, the
        // members announced before placed in join order.
        m.on_hello(20, info(2));
        m.on_conf_change(&[10, 20, 30, 40]);
        m.on_hello(40, info(4));
        assert!(m.place("n4", Insertion::Before("n2".into())));
        assert_eq!(m.ring(), ["n1", "n4", "n2", "n3"]);
        assert!(m.is_newcomer("n4"));
    }

    #[test]
    fn sessions_are_named_in_the_replication_stream_only_once_every_member_reads_them() {
        let mut m = Membership::default();
        m.on_conf_change(&[10, 20]);
        m.on_hello(10, info(1));
        let old = MemberInfo {
            holds_for_sessions: false,
            ..info(2)
        };
        m.on_hello(20, old);
        assert!(!m.every_member_holds_for_sessions());
        m.on_hello(20, info(2));
        assert!(m.every_member_holds_for_sessions());
    }
}
