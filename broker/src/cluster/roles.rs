//! Who holds each clustered queue: its primary, its `k` backups in ring order, which of them
//! are in sync, and whether the queue is unavailable. Pure decisions over the ring (the
//! members whose hello gave their node id, in join order), taken by the cluster map on every
//! member at the same point of the agreed order, so every member reaches the same roles
//! without a vote:
//!
//! * **election** — the primary's member is gone: the first backup (in backups order) that
//!   is in sync and still a member becomes primary. A backup that is catching up is never
//!   promoted; with none in sync left the queue is *unavailable* until a member holding its
//!   newest state returns.
//! * **backup-ship transfer** — a backup's member is gone: the primary's next ring members
//!   that are not backups yet take its place, not in sync (they catch up first).
//! * **join** — a member whose hello arrived fills the queues that are short of `k`.
//!
//! The ops that change the in-sync set ([`WiringOp::BackupInSync`] and
//! [`WiringOp::BackupOutOfSync`], committed by the primary) name the queue's incarnation, so
//! a late op never touches a queue of the same name declared again.
//!
//! [`WiringOp::BackupInSync`]: crate::core::WiringOp::BackupInSync
//! [`WiringOp::BackupOutOfSync`]: crate::core::WiringOp::BackupOutOfSync

use crate::core::wiring::{Wiring, WiringRoles};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

pub use crate::core::args::{BACKUPS_ARGUMENT, MAX_BACKUPS};

/// Backups of a queue declared without [`BACKUPS_ARGUMENT`] on a member whose configuration
/// does not say (`default_backups`): one, so one failure loses nothing.
pub const DEFAULT_BACKUPS: u8 = 1;

/// The roles of one clustered queue, the same on every member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueRoles {
    /// Cluster-wide identity of this incarnation of the queue: the agreed index of the
    /// declare that created it (a queue deleted and declared again is another incarnation).
    pub incarnation: u64,
    /// Node id of the primary (the queue's `home`); while unavailable, the lost primary.
    pub primary: String,
    /// Node ids of the backups, in ring order after the primary; never the primary, never
    /// twice, at most `wanted_backups`.
    pub backups: Vec<String>,
    /// The backups that hold every op the primary confirmed (a subset of `backups`, in
    /// backups order). Only these may be promoted.
    pub in_sync: Vec<String>,
    /// `k`: how many backups the queue keeps when enough members are up.
    pub wanted_backups: u8,
    /// The primary is lost and no in-sync backup was left: nobody may serve the queue until
    /// the primary or one of `in_sync` (kept as they were, members or not) returns.
    pub unavailable: bool,
    /// A planned move of the primary to this member is under way (`cluster move-queue`,
    /// a drain): it is a backup — one more than `k` if it was not one before — and once it
    /// is in sync the primary stops the queue's ops, waits for its ack of everything, and
    /// commits the switch ([`QueueRoles::switch`]). Cleared by the switch, a cancel, or an
    /// election or membership change that makes the move moot.
    #[serde(default)]
    pub moving_to: Option<String>,
    /// A backup being replaced by another (`cluster rebalance` puts the backups on the
    /// primary's ring successors): `new` is a backup beside `old` — one more than `k` — and
    /// catches up; once it is in sync `old` goes, so the queue never has fewer in-sync
    /// copies than before. Called off when `new` leaves, restarts or is drained, or the
    /// primary changes; over when `old` leaves (or is drained away) first.
    #[serde(default)]
    pub replacing: Option<Box<Replacement>>,
    /// Its `k` is not its own (declared without `qpid.cluster.backups`): the ring layout's
    /// `backups` sets it ([`QueueRoles::set_wanted_backups`]). False in a map saved before
    /// layouts existed: those queues keep their `k`.
    #[serde(default)]
    pub default_k: bool,
}

/// A backup being replaced by another ([`QueueRoles::replacing`]); boxed there, as it is
/// rare and the roles travel in every role-change action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replacement {
    /// The backup that goes once `new` is in sync.
    pub old: String,
    /// The backup that catches up to take its place.
    pub new: String,
}

impl QueueRoles {
    /// The roles of a queue created at agreed `incarnation` on `primary`, wanting `k` backups,
    /// given the ring now. Its backups start out of sync, like any new backup.
    pub fn new(incarnation: u64, primary: &str, k: u8, ring: &[String]) -> Self {
        let mut roles = Self {
            incarnation,
            primary: primary.to_owned(),
            backups: Vec::new(),
            in_sync: Vec::new(),
            wanted_backups: k.min(MAX_BACKUPS),
            unavailable: false,
            moving_to: None,
            replacing: None,
            default_k: false,
        };
        roles.reconcile(ring);
        roles
    }

    /// The queue keeps `k` backups from now on (the ring layout's `backups`). More: the
    /// ring's next members join, out of sync, and catch up. Fewer: a backup replacement
    /// under way is called off, then the backups out of sync go first, the last in
    /// backups order first, never a planned move's target. An unavailable queue keeps its
    /// `k` (its copies are what may bring it back). Returns whether `k` changed.
    pub fn set_wanted_backups(
        &mut self,
        k: u8,
        ring: &[String],
        draining: &BTreeSet<String>,
    ) -> bool {
        let k = k.min(MAX_BACKUPS);
        if self.wanted_backups == k || self.unavailable {
            return false;
        }
        let fewer = k < self.wanted_backups;
        self.wanted_backups = k;
        if fewer {
            self.end_replace();
            let most = self.most_backups();
            let target = self.moving_to.clone();
            let serving = |b: &String| !draining.contains(b);
            self.drop_backups_beyond(most, serving, |b| serving(b) && target.as_ref() != Some(b));
        }
        self.reconcile_with(ring, draining);
        true
    }

    /// Brings the roles in line with `ring` (node ids of the members, in ring order): an
    /// election if the primary is gone, its end when a holder of the newest state is back,
    /// departed backups dropped, and the ring's next members added up to `k`. Idempotent:
    /// the same roles and ring give the same result however often it runs.
    pub fn reconcile(&mut self, ring: &[String]) {
        self.reconcile_with(ring, &BTreeSet::new());
    }

    /// [`QueueRoles::reconcile`] with some members being drained (`cluster drain`): they
    /// take no new backup roles; a draining primary hands the queue over by a planned move
    /// (to its first in-sync backup that is not draining, else the first such backup, else
    /// the ring's next such member); a draining backup is replaced by the ring's next member
    /// that is not draining, and goes once the backups that stay are all in sync (at once,
    /// if it is not in sync itself) — so the queue never has fewer in-sync copies than it
    /// had while a drain runs.
    pub fn reconcile_with(&mut self, ring: &[String], draining: &BTreeSet<String>) {
        let live = |n: &String| ring.contains(n);
        if !live(&self.primary)
            || (self.moving_to.as_ref()).is_some_and(|to| !live(to) || draining.contains(to))
        {
            self.end_move();
        }
        if let Some(Replacement { old, new }) = self.replacing.as_deref().cloned() {
            if !live(&old) {
                // The old backup goes anyway: the new one stays, as an ordinary backup.
                self.replacing = None;
            } else if !live(&self.primary)
                || draining.contains(&self.primary)
                || !live(&new)
                || draining.contains(&new)
            {
                self.end_replace();
            } else if self.in_sync.contains(&new) {
                // The new backup holds everything: the old one goes.
                self.replacing = None;
                self.backups.retain(|b| *b != old);
                self.in_sync.retain(|b| *b != old);
            }
        }
        if !live(&self.primary) {
            let promoted = self
                .backups
                .iter()
                .position(|b| self.in_sync.contains(b) && live(b));
            let Some(i) = promoted else {
                // Frozen: `primary` and `in_sync` name who holds the newest state.
                self.unavailable = true;
                return;
            };
            let new = self.backups.remove(i);
            self.in_sync.retain(|n| *n != new);
            self.primary = new;
        }
        self.unavailable = false;
        self.backups.retain(live);
        let backups = &self.backups;
        self.in_sync.retain(|n| backups.contains(n));
        let Some(at) = ring.iter().position(|n| *n == self.primary) else {
            return;
        };
        let successors: Vec<&String> = ring[at + 1..].iter().chain(&ring[..at]).collect();
        if draining.contains(&self.primary) && self.moving_to.is_none() {
            let staying = |n: &&String| !draining.contains(*n);
            let target = (self.in_sync.iter().find(staying))
                .or_else(|| self.backups.iter().find(staying))
                .or_else(|| successors.iter().copied().find(staying))
                .cloned();
            if let Some(to) = target {
                if !self.backups.contains(&to) {
                    self.backups.push(to.clone());
                }
                self.moving_to = Some(to);
            }
        }
        let serving =
            |backups: &[String]| backups.iter().filter(|b| !draining.contains(*b)).count();
        for n in successors {
            if serving(&self.backups) >= usize::from(self.wanted_backups) {
                break;
            }
            if !self.backups.contains(n) && !draining.contains(n) {
                self.backups.push(n.clone());
            }
        }
        let staying_in_sync = self
            .backups
            .iter()
            .filter(|b| !draining.contains(*b))
            .all(|b| self.in_sync.contains(b));
        let in_sync = &self.in_sync;
        self.backups
            .retain(|b| !draining.contains(b) || (in_sync.contains(b) && !staying_in_sync));
        let backups = &self.backups;
        self.in_sync.retain(|n| backups.contains(n));
        if (self.replacing.as_deref())
            .is_some_and(|r| !self.backups.contains(&r.old) || !self.backups.contains(&r.new))
        {
            // A drain took one of the two away: what is left is ordinary backups.
            self.replacing = None;
        }
        assert!(
            serving(&self.backups) <= self.most_backups(),
            "more backups than k: {self:?}"
        );
        self.assert_invariants();
    }

    /// Node `node`'s member restarted in place (its hello came again): whatever it held in
    /// memory is gone, so it is no longer in sync, and a primary with an in-sync backup
    /// hands over to it (the restarted one keeps only what its journal had).
    pub fn restarted(&mut self, node: &str, ring: &[String]) {
        if self.unavailable {
            return;
        }
        if self.primary == node || self.moving_to.as_deref() == Some(node) {
            self.end_move();
        }
        if self.primary == node || self.replacing.as_deref().is_some_and(|r| r.new == node) {
            // What it held is gone: it no longer counts as the replacement's in-sync copy.
            self.in_sync.retain(|n| n != node);
            self.end_replace();
        }
        if self.primary == node {
            let promoted = self
                .backups
                .iter()
                .position(|b| self.in_sync.contains(b) && ring.contains(b));
            if let Some(i) = promoted {
                let new = self.backups.remove(i);
                self.in_sync.retain(|n| *n != new);
                self.primary = new;
            }
        }
        self.in_sync.retain(|n| n != node);
        self.reconcile(ring);
    }

    /// A planned move of the primary to `to` is asked: `to` becomes a backup if it is not
    /// one (catching up first, as any new backup), and the move is recorded. `Ok(false)`
    /// when there is nothing to do (`to` is the primary, or the same move is under way);
    /// an error, for the asker, when the move cannot be made now.
    pub fn request_move(&mut self, to: &str, ring: &[String]) -> Result<bool, String> {
        if self.unavailable {
            return Err("the queue is unavailable: its primary is lost".to_owned());
        }
        if self.primary == to || self.moving_to.as_deref() == Some(to) {
            return Ok(false);
        }
        if let Some(other) = &self.moving_to {
            return Err(format!("its primary is already moving to '{other}'"));
        }
        if let Some(Replacement { old, new }) = self.replacing.as_deref() {
            return Err(format!("its backup '{old}' is being replaced by '{new}'"));
        }
        if !ring.iter().any(|n| n == to) {
            return Err(format!("'{to}' is not a member of the cluster"));
        }
        self.moving_to = Some(to.to_owned());
        if !self.backups.iter().any(|b| b == to) {
            self.backups.push(to.to_owned());
        }
        self.assert_invariants();
        Ok(true)
    }

    /// Backup `old` is to be replaced by `new` (`cluster rebalance`): `new` becomes a backup
    /// beside it and catches up; [`QueueRoles::reconcile_with`] drops `old` once `new` is in
    /// sync. `Ok(false)` when that replacement is under way already; an error, for the
    /// rebalance's record, when it cannot be made now.
    pub fn request_replace(
        &mut self,
        old: &str,
        new: &str,
        ring: &[String],
    ) -> Result<bool, String> {
        if (self.replacing.as_deref()).is_some_and(|r| r.old == old && r.new == new) {
            return Ok(false);
        }
        if self.unavailable {
            return Err("the queue is unavailable: its primary is lost".to_owned());
        }
        if let Some(to) = &self.moving_to {
            return Err(format!("its primary is moving to '{to}'"));
        }
        if let Some(r) = self.replacing.as_deref() {
            return Err(format!(
                "its backup '{}' is being replaced by '{}'",
                r.old, r.new
            ));
        }
        if !self.backups.iter().any(|b| b == old) {
            return Err(format!("'{old}' is not one of its backups"));
        }
        if self.primary == new || self.backups.iter().any(|b| b == new) {
            return Err(format!("'{new}' holds a copy already"));
        }
        if !ring.iter().any(|n| n == new) {
            return Err(format!("'{new}' is not a member of the cluster"));
        }
        self.replacing = Some(Box::new(Replacement {
            old: old.to_owned(),
            new: new.to_owned(),
        }));
        self.backups.push(new.to_owned());
        self.assert_invariants();
        Ok(true)
    }

    /// The replacement under way is called off: the new backup goes again unless it is in
    /// sync already (then it is the old one that goes, as if it had finished).
    fn end_replace(&mut self) {
        let Some(Replacement { old, new }) = self.replacing.take().map(|r| *r) else {
            return;
        };
        let gone = if self.in_sync.contains(&new) {
            old
        } else {
            new
        };
        if self.backups.len() > usize::from(self.wanted_backups) {
            self.backups.retain(|b| *b != gone);
            self.in_sync.retain(|b| *b != gone);
        }
    }

    /// The primary stopped the queue's ops and `to` acknowledged every one of them: `to`
    /// is the primary from this point of the agreed order on. The old primary takes `to`'s
    /// place among the backups, out of sync (it catches up from the new primary like any
    /// new backup), unless that would be one backup more than `k`. Returns whether the
    /// roles changed (not when no such move is under way, or `to` is not in sync).
    pub fn switch(&mut self, to: &str, ring: &[String]) -> bool {
        if self.unavailable
            || self.moving_to.as_deref() != Some(to)
            || !self.in_sync.iter().any(|n| n == to)
        {
            return false;
        }
        let old = std::mem::replace(&mut self.primary, to.to_owned());
        let at = self.backups.iter().position(|b| b == to).expect("in sync");
        self.in_sync.retain(|n| n != to);
        self.moving_to = None;
        if self.backups.len() > usize::from(self.wanted_backups) {
            self.backups.remove(at);
        } else {
            self.backups[at] = old;
        }
        self.reconcile(ring);
        true
    }

    /// The move to `to` is called off (it could not be finished): returns whether one was
    /// under way.
    pub fn cancel_move(&mut self, to: &str) -> bool {
        if self.moving_to.as_deref() != Some(to) {
            return false;
        }
        self.end_move();
        true
    }

    /// No move under way any more: a backup taken on for it beyond `k` goes again (the last
    /// one that is not in sync, else the last).
    fn end_move(&mut self) {
        self.moving_to = None;
        self.drop_backups_beyond(usize::from(self.wanted_backups), |_| true, |_| true);
    }

    /// Drops backups while more than `most` of them are `counted`: of those `droppable`, the
    /// ones out of sync first, the last in backups order first.
    fn drop_backups_beyond(
        &mut self,
        most: usize,
        counted: impl Fn(&String) -> bool,
        droppable: impl Fn(&String) -> bool,
    ) {
        while self.backups.iter().filter(|b| counted(b)).count() > most {
            let at = (self.backups.iter())
                .rposition(|b| droppable(b) && !self.in_sync.contains(b))
                .or_else(|| self.backups.iter().rposition(&droppable));
            let Some(at) = at else { return };
            let gone = self.backups.remove(at);
            self.in_sync.retain(|n| *n != gone);
        }
    }

    /// Most backups the queue may have now: `k`, one more for a planned move's target, and
    /// one more for a backup replacing another.
    fn most_backups(&self) -> usize {
        usize::from(self.wanted_backups)
            + usize::from(self.moving_to.is_some())
            + usize::from(self.replacing.is_some())
    }

    /// Whether `node` holds a copy of the queue by these roles: its primary or a backup.
    pub fn holds_copy(&self, node: &str) -> bool {
        self.primary == node || self.backups.iter().any(|b| b == node)
    }

    /// `node` caught up: in sync from now on, if it is still a backup (else nothing changes;
    /// returns whether it did).
    pub fn mark_in_sync(&mut self, node: &str) -> bool {
        if self.unavailable || !self.backups.iter().any(|b| b == node) {
            return false;
        }
        if self.in_sync.iter().any(|b| b == node) {
            return false;
        }
        self.in_sync.push(node.to_owned());
        let backups = &self.backups;
        self.in_sync
            .sort_by_key(|n| backups.iter().position(|b| b == n));
        true
    }

    /// `node` fell behind: no longer in sync (returns whether it was).
    pub fn mark_out_of_sync(&mut self, node: &str) -> bool {
        if self.unavailable {
            return false;
        }
        let before = self.in_sync.len();
        self.in_sync.retain(|n| n != node);
        self.in_sync.len() != before
    }

    /// A broken invariant stops loudly: the primary is never its own backup, a node is a
    /// backup once, there are never more than `k`, and only backups are in sync.
    fn assert_invariants(&self) {
        assert!(
            !self.backups.contains(&self.primary),
            "primary {} is also a backup: {self:?}",
            self.primary
        );
        assert!(
            self.moving_to
                .as_ref()
                .is_none_or(|to| *to != self.primary && self.backups.contains(to)),
            "a move's target is a backup: {self:?}"
        );
        assert!(
            self.replacing.as_deref().is_none_or(|r| r.old != r.new
                && self.backups.contains(&r.old)
                && self.backups.contains(&r.new)),
            "a replacement's two backups are backups: {self:?}"
        );
        for (i, b) in self.backups.iter().enumerate() {
            assert!(!self.backups[..i].contains(b), "backup {b} twice: {self:?}");
        }
        assert!(
            self.in_sync.iter().all(|n| self.backups.contains(n)),
            "{self:?}"
        );
    }
}

/// What one member holds of the cluster's queues, by the roles: what a drain must move off it
/// before it can go without loss, and what a rebalance evens out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Queues it is the primary of (an unavailable queue's frozen primary too: it holds the
    /// newest state, and the queue waits for it).
    pub primaries: u64,
    /// Queues it is a backup of, in sync or catching up.
    pub backups: u64,
    /// Of those, the ones it is in sync for (it may be promoted).
    pub in_sync_backups: u64,
}

/// The roles of every clustered queue, by vhost and name. Exclusive queues, queues of
/// another AMQP broker and queues declared before roles existed have none.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Roles {
    vhosts: BTreeMap<String, BTreeMap<String, QueueRoles>>,
}

impl Roles {
    /// What each member (by node id) holds; a member that holds nothing is absent.
    pub fn held(&self) -> BTreeMap<String, Held> {
        let mut held: BTreeMap<String, Held> = BTreeMap::new();
        for (_, _, r) in self.iter() {
            held.entry(r.primary.clone()).or_default().primaries += 1;
            for b in &r.backups {
                let h = held.entry(b.clone()).or_default();
                h.backups += 1;
                h.in_sync_backups += u64::from(r.in_sync.contains(b));
            }
        }
        held
    }

    /// The roles of queue `queue` in `vhost`.
    pub fn get(&self, vhost: &str, queue: &str) -> Option<&QueueRoles> {
        self.vhosts.get(vhost)?.get(queue)
    }

    /// Sets (or, with `None`, removes) the roles of `queue` in `vhost`; returns what they were.
    pub fn set(
        &mut self,
        vhost: &str,
        queue: &str,
        roles: Option<QueueRoles>,
    ) -> Option<QueueRoles> {
        match roles {
            Some(r) => self
                .vhosts
                .entry(vhost.to_owned())
                .or_default()
                .insert(queue.to_owned(), r),
            None => {
                let queues = self.vhosts.get_mut(vhost)?;
                let was = queues.remove(queue);
                if queues.is_empty() {
                    self.vhosts.remove(vhost);
                }
                was
            }
        }
    }

    /// Every queue's roles: (vhost, queue, roles), sorted.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str, &QueueRoles)> {
        self.vhosts
            .iter()
            .flat_map(|(v, qs)| qs.iter().map(move |(q, r)| (v.as_str(), q.as_str(), r)))
    }

    /// Applies `f` to every queue's roles; returns (vhost, queue, before, after) for each that
    /// changed, in a stable order.
    pub fn update_all(
        &mut self,
        mut f: impl FnMut(&mut QueueRoles),
    ) -> Vec<(String, String, QueueRoles, QueueRoles)> {
        let mut changed = Vec::new();
        for (v, qs) in &mut self.vhosts {
            for (q, r) in qs.iter_mut() {
                let before = r.clone();
                f(r);
                if *r != before {
                    changed.push((v.clone(), q.clone(), before, r.clone()));
                }
            }
        }
        changed
    }

    /// Writes the roles into the shared wiring a snapshot carries (each queue's `home`,
    /// `backups`, `in_sync`, `incarnation`, `wanted_backups`, `unavailable`, `default_k`).
    pub fn fill(&self, vhosts: &mut BTreeMap<String, Wiring>) {
        for (name, w) in vhosts.iter_mut() {
            for q in &mut w.queues {
                if let Some(r) = self.get(name, &q.name) {
                    q.home = Some(r.primary.clone());
                    q.roles = WiringRoles {
                        incarnation: r.incarnation,
                        backups: r.backups.clone(),
                        in_sync: r.in_sync.clone(),
                        wanted_backups: r.wanted_backups,
                        unavailable: r.unavailable,
                        moving_to: r.moving_to.clone(),
                        replacing: r
                            .replacing
                            .as_deref()
                            .map(|r| (r.old.clone(), r.new.clone())),
                        default_k: r.default_k,
                    };
                }
            }
        }
    }

    /// The roles a snapshot's shared wiring carries (queues with an incarnation); a snapshot
    /// from a member that predates roles carries none.
    pub fn from_wiring(vhosts: &BTreeMap<String, Wiring>) -> Self {
        let mut roles = Self::default();
        for (name, w) in vhosts {
            for q in &w.queues {
                let Some(primary) = q.home.as_ref().filter(|_| q.roles.incarnation != 0) else {
                    continue;
                };
                let r = &q.roles;
                roles.set(
                    name,
                    &q.name,
                    Some(QueueRoles {
                        incarnation: r.incarnation,
                        primary: primary.clone(),
                        backups: r.backups.clone(),
                        in_sync: r.in_sync.clone(),
                        wanted_backups: r.wanted_backups,
                        unavailable: r.unavailable,
                        moving_to: r.moving_to.clone(),
                        replacing: r
                            .replacing
                            .clone()
                            .map(|(old, new)| Box::new(Replacement { old, new })),
                        default_k: r.default_k,
                    }),
                );
            }
        }
        roles
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring_of(nodes: &[&str]) -> Vec<String> {
        nodes.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn held_counts_each_members_primaries_and_backups_across_vhosts() {
        let ring = ring_of(&["a", "b", "c"]);
        let mut roles = Roles::default();
        let mut q1 = QueueRoles::new(1, "a", 2, &ring);
        q1.mark_in_sync("b");
        roles.set("/", "q1", Some(q1));
        roles.set("other", "q2", Some(QueueRoles::new(2, "b", 1, &ring)));
        roles.set("/", "q3", Some(QueueRoles::new(3, "a", 0, &ring)));
        let held = roles.held();
        let h = |n: &str| held.get(n).copied().unwrap_or_default();
        assert_eq!(
            h("a"),
            Held {
                primaries: 2,
                backups: 0,
                in_sync_backups: 0
            }
        );
        assert_eq!(
            h("b"),
            Held {
                primaries: 1,
                backups: 1,
                in_sync_backups: 1
            }
        );
        assert_eq!(
            h("c"),
            Held {
                primaries: 0,
                backups: 2,
                in_sync_backups: 0
            }
        );
        assert!(!held.contains_key("d"), "a member that holds nothing");
    }

    #[test]
    fn backups_are_the_primarys_ring_successors_and_start_out_of_sync() {
        let ring = ring_of(&["a", "b", "c", "d", "e"]);
        let r = QueueRoles::new(7, "d", 2, &ring);
        assert_eq!(r.backups, ["e", "a"], "wrapping around the ring");
        assert!(r.in_sync.is_empty());
        assert!(!r.unavailable);
        let r = QueueRoles::new(7, "a", 3, &ring_of(&["a", "b"]));
        assert_eq!(r.backups, ["b"], "as many as there are members");
        let r = QueueRoles::new(7, "a", 0, &ring);
        assert!(r.backups.is_empty());
    }

    #[test]
    fn the_first_in_sync_backup_in_ring_order_is_elected_never_one_catching_up() {
        let ring = ring_of(&["a", "b", "c", "d"]);
        let mut r = QueueRoles::new(1, "a", 2, &ring);
        assert_eq!(r.backups, ["b", "c"]);
        assert!(r.mark_in_sync("c"));
        r.reconcile(&ring_of(&["b", "c", "d"]));
        assert_eq!(r.primary, "c", "b was still catching up");
        assert_eq!(
            r.backups,
            ["b", "d"],
            "c's successors after it, b stays a backup"
        );
        assert!(r.in_sync.is_empty());
    }

    #[test]
    fn other_in_sync_backups_stay_in_sync_across_an_election() {
        let ring = ring_of(&["a", "b", "c", "d", "e"]);
        let mut r = QueueRoles::new(1, "a", 2, &ring);
        r.mark_in_sync("b");
        r.mark_in_sync("c");
        r.reconcile(&ring_of(&["b", "c", "d", "e"]));
        assert_eq!(r.primary, "b");
        assert_eq!(r.backups, ["c", "d"]);
        assert_eq!(r.in_sync, ["c"]);
    }

    #[test]
    fn five_members_with_two_backups_survive_the_primary_and_its_first_backup_at_once() {
        let ring = ring_of(&["a", "b", "c", "d", "e"]);
        let mut r = QueueRoles::new(1, "a", 2, &ring);
        r.mark_in_sync("b");
        r.mark_in_sync("c");
        r.reconcile(&ring_of(&["c", "d", "e"]));
        assert_eq!(r.primary, "c");
        assert_eq!(r.backups, ["d", "e"]);
        assert!(r.in_sync.is_empty(), "the new backups catch up first");
    }

    #[test]
    fn with_no_in_sync_backup_left_the_queue_waits_for_a_holder_of_its_newest_state() {
        let ring = ring_of(&["a", "b", "c"]);
        let mut r = QueueRoles::new(1, "a", 2, &ring);
        r.mark_in_sync("b");
        // a and b fail together; c was catching up.
        r.reconcile(&ring_of(&["c"]));
        assert!(r.unavailable);
        assert_eq!(r.primary, "a", "the lost primary is kept");
        assert!(!r.mark_in_sync("c"), "nothing changes while unavailable");
        // A new member is no holder.
        r.reconcile(&ring_of(&["c", "d"]));
        assert!(r.unavailable);
        // b held the newest state: it serves.
        r.reconcile(&ring_of(&["c", "d", "b"]));
        assert!(!r.unavailable);
        assert_eq!(r.primary, "b");
        assert_eq!(r.backups, ["c", "d"]);
    }

    #[test]
    fn the_lost_primary_returning_ends_the_unavailability_on_itself() {
        let mut r = QueueRoles::new(1, "a", 1, &ring_of(&["a", "b"]));
        r.reconcile(&ring_of(&["b"]));
        assert!(r.unavailable);
        r.reconcile(&ring_of(&["b", "a"]));
        assert!(!r.unavailable);
        assert_eq!(r.primary, "a");
        assert_eq!(r.backups, ["b"]);
    }

    #[test]
    fn a_lost_backup_is_replaced_by_the_next_ring_member_out_of_sync() {
        let ring = ring_of(&["a", "b", "c", "d"]);
        let mut r = QueueRoles::new(1, "a", 2, &ring);
        r.mark_in_sync("b");
        r.mark_in_sync("c");
        r.reconcile(&ring_of(&["a", "c", "d"]));
        assert_eq!(r.primary, "a");
        assert_eq!(r.backups, ["c", "d"]);
        assert_eq!(r.in_sync, ["c"]);
    }

    #[test]
    fn a_joining_member_fills_a_queue_short_of_backups() {
        let mut r = QueueRoles::new(1, "a", 2, &ring_of(&["a"]));
        assert!(r.backups.is_empty());
        r.reconcile(&ring_of(&["a", "b"]));
        assert_eq!(r.backups, ["b"]);
        r.reconcile(&ring_of(&["a", "b", "c", "d"]));
        assert_eq!(r.backups, ["b", "c"]);
        assert!(r.in_sync.is_empty());
    }

    #[test]
    fn a_declare_on_a_member_that_is_gone_is_unavailable_until_it_returns() {
        let mut r = QueueRoles::new(1, "x", 1, &ring_of(&["a", "b"]));
        assert!(r.unavailable);
        r.reconcile(&ring_of(&["a", "b", "x"]));
        assert!(!r.unavailable);
        assert_eq!(r.backups, ["a"]);
    }

    #[test]
    fn a_restarted_primary_hands_over_to_an_in_sync_backup_and_catches_up() {
        let ring = ring_of(&["a", "b", "c"]);
        let mut r = QueueRoles::new(1, "a", 1, &ring);
        r.restarted("a", &ring);
        assert_eq!(
            r.primary, "a",
            "no in-sync backup: its journal is the newest state"
        );
        r.mark_in_sync("b");
        r.restarted("b", &ring);
        assert!(r.in_sync.is_empty(), "a restarted backup catches up again");
        r.mark_in_sync("b");
        r.restarted("a", &ring);
        assert_eq!(r.primary, "b");
        assert_eq!(r.backups, ["c"]);
    }

    #[test]
    fn a_move_to_an_in_sync_backup_switches_and_the_old_primary_catches_up() {
        let ring = ring_of(&["a", "b", "c"]);
        let mut r = QueueRoles::new(1, "a", 1, &ring);
        assert!(!r.switch("b", &ring), "no move asked");
        assert_eq!(r.request_move("b", &ring), Ok(true));
        assert_eq!(r.request_move("b", &ring), Ok(false), "the same move again");
        assert!(!r.switch("b", &ring), "b is still catching up");
        r.mark_in_sync("b");
        assert!(r.switch("b", &ring));
        assert_eq!(r.primary, "b");
        assert_eq!(r.backups, ["a"], "the old primary takes its place");
        assert!(r.in_sync.is_empty(), "and catches up from the new primary");
        assert_eq!(r.moving_to, None);
    }

    #[test]
    fn a_move_to_a_member_that_is_no_backup_takes_it_on_beyond_k_until_the_switch() {
        let ring = ring_of(&["a", "b", "c"]);
        let mut r = QueueRoles::new(1, "a", 1, &ring);
        r.mark_in_sync("b");
        assert_eq!(r.request_move("c", &ring), Ok(true));
        assert_eq!(r.backups, ["b", "c"], "one more than k while it catches up");
        assert_eq!(r.in_sync, ["b"], "b still counts");
        r.reconcile(&ring);
        assert_eq!(r.backups, ["b", "c"], "reconciling keeps the move's backup");
        r.mark_in_sync("c");
        assert!(r.switch("c", &ring));
        assert_eq!(r.primary, "c");
        assert_eq!(r.backups, ["b"], "back to k: the old primary is not kept");
        assert_eq!(r.in_sync, ["b"]);
    }

    #[test]
    fn a_move_is_refused_or_ended_when_it_cannot_be_made() {
        let ring = ring_of(&["a", "b", "c"]);
        let mut r = QueueRoles::new(1, "a", 1, &ring);
        assert!(r.request_move("z", &ring).is_err(), "not a member");
        assert_eq!(r.request_move("a", &ring), Ok(false), "already the primary");
        r.request_move("c", &ring).unwrap();
        assert!(r.request_move("b", &ring).is_err(), "one move at a time");
        assert!(!r.cancel_move("b"));
        assert!(r.cancel_move("c"));
        assert_eq!(
            (r.backups.as_slice(), r.moving_to.as_deref()),
            (["b".to_owned()].as_slice(), None)
        );
        // The target leaves: the move ends with it.
        r.request_move("c", &ring).unwrap();
        r.reconcile(&ring_of(&["a", "b"]));
        assert_eq!(r.moving_to, None);
        assert_eq!(r.backups, ["b"]);
        // The primary is lost mid-move: an election, and the move is moot.
        let mut r = QueueRoles::new(1, "a", 1, &ring);
        r.mark_in_sync("b");
        r.request_move("c", &ring).unwrap();
        r.reconcile(&ring_of(&["b", "c"]));
        assert_eq!(r.primary, "b");
        assert_eq!(r.moving_to, None);
        assert_eq!(r.backups, ["c"]);
        // A restart of the target ends it too.
        let mut r = QueueRoles::new(1, "a", 1, &ring);
        r.request_move("b", &ring).unwrap();
        r.restarted("b", &ring);
        assert_eq!(r.moving_to, None);
    }

    fn set(nodes: &[&str]) -> BTreeSet<String> {
        nodes.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn a_draining_backup_stays_until_its_replacement_is_in_sync() {
        let ring = ring_of(&["a", "b", "c", "d"]);
        let mut r = QueueRoles::new(1, "a", 1, &ring);
        r.mark_in_sync("b");
        let draining = set(&["b"]);
        r.reconcile_with(&ring, &draining);
        assert_eq!(r.backups, ["b", "c"], "c catches up beside b");
        assert_eq!(r.in_sync, ["b"]);
        r.reconcile_with(&ring, &draining);
        assert_eq!(r.backups, ["b", "c"], "idempotent");
        r.mark_in_sync("c");
        r.reconcile_with(&ring, &draining);
        assert_eq!(r.backups, ["c"]);
        assert_eq!(r.in_sync, ["c"]);
        // A draining backup that is not in sync goes at once.
        let mut r = QueueRoles::new(1, "a", 1, &ring);
        r.reconcile_with(&ring, &draining);
        assert_eq!(r.backups, ["c"]);
    }

    #[test]
    fn a_draining_primary_moves_to_its_in_sync_backup_and_holds_nothing_after() {
        let ring = ring_of(&["a", "b", "c"]);
        let draining = set(&["a"]);
        let mut r = QueueRoles::new(1, "a", 1, &ring);
        r.reconcile_with(&ring, &draining);
        assert_eq!(
            r.moving_to.as_deref(),
            Some("b"),
            "to its backup, once in sync"
        );
        r.mark_in_sync("b");
        assert!(r.switch("b", &ring));
        r.reconcile_with(&ring, &draining);
        assert_eq!(r.primary, "b");
        assert_eq!(
            r.backups,
            ["c"],
            "the old primary is no backup: it is draining"
        );
        assert!(!r.holds_copy("a"));
        // Two members: the drained one ends holding nothing, the other everything.
        let two = ring_of(&["a", "b"]);
        let mut r = QueueRoles::new(1, "a", 1, &two);
        r.mark_in_sync("b");
        r.reconcile_with(&two, &draining);
        assert!(r.switch("b", &two));
        r.reconcile_with(&two, &draining);
        assert_eq!((r.primary.as_str(), r.backups.len()), ("b", 0));
    }

    #[test]
    fn a_draining_member_gets_no_new_role_and_undraining_lets_it_take_them_again() {
        let ring = ring_of(&["a", "b", "c"]);
        let mut r = QueueRoles::new(1, "a", 2, &ring);
        r.backups.clear();
        r.reconcile_with(&ring, &set(&["b"]));
        assert_eq!(r.backups, ["c"], "b is skipped");
        r.reconcile_with(&ring, &BTreeSet::new());
        assert_eq!(r.backups, ["c", "b"]);
        // A move to a member that starts draining is called off.
        let mut r = QueueRoles::new(1, "a", 1, &ring);
        r.request_move("c", &ring).unwrap();
        r.reconcile_with(&ring, &set(&["c"]));
        assert_eq!(r.moving_to, None);
        assert_eq!(r.backups, ["b"]);
    }

    #[test]
    fn in_sync_marks_apply_only_to_backups() {
        let mut r = QueueRoles::new(1, "a", 1, &ring_of(&["a", "b", "c"]));
        assert!(!r.mark_in_sync("c"));
        assert!(!r.mark_in_sync("a"));
        assert!(r.mark_in_sync("b"));
        assert!(!r.mark_in_sync("b"), "already");
        assert!(r.mark_out_of_sync("b"));
        assert!(!r.mark_out_of_sync("b"));
    }
}
