//! Rebalancing (`cluster rebalance`): a plan of planned primary moves that evens out how
//! many queues each active member is the primary of, then of backup moves that put every
//! queue's backups on its primary's ring successors (which evens the backups), carried out
//! by the cluster map a bounded number at a time.
//!
//! The plan is made by [`ringmq_planner::rebalance_plan`] from the map's roles when the
//! [`RebalanceStep::Start`](crate::core::RebalanceStep::Start) op is applied — on every
//! member, at the same point of the agreed order, so every member holds the same plan
//! without anyone sending it. Its progress lives in the map too: after every event the map
//! looks at the queues whose moves are under way ([`QueueRoles::moving_to`]), records the
//! ones that switched or were called off, and starts the next ones. A crash of any member
//! (the one whose administrator asked included) changes nothing of that: the survivors hold
//! the same plan and go on; a move whose target is lost is called off by the roles, and the
//! plan records it as failed. Each move is an ordinary planned move (catch-up, then switch),
//! so nothing confirmed is ever at risk.

use super::layout::{RingOrder, listed_insertion};
use super::membership::{Insertion, MemberInfo, Membership};
use super::roles::{QueueRoles, Roles};
use ringmq_planner::{
    Assignment, Member, Placement, RebalanceBounds, insertion_point, rebalance_plan,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Moves under way at once when the caller does not say: each one is a catch-up of the
/// queue on its target, which competes with the clients' traffic.
pub const DEFAULT_CONCURRENCY: u32 = 2;

/// Most moves under way at once a caller may ask for.
pub const MAX_CONCURRENCY: u32 = 64;

/// Where one planned move is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MoveState {
    /// Not started yet.
    Pending,
    /// The queue's roles record the move (`moving_to`): the target catches up, then the
    /// primary switches.
    Running,
    /// The target is the primary.
    Done,
    /// It could not be made, or was called off; the reason says why.
    Failed(String),
    /// The rebalance was stopped before it started.
    Skipped,
}

impl MoveState {
    /// Pending or under way: not over.
    fn is_open(&self) -> bool {
        matches!(self, Self::Pending | Self::Running)
    }
}

/// One queue's primary moving, or one of its backups replaced, as the plan has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedMove {
    /// Vhost of the queue.
    pub vhost: String,
    /// The queue.
    pub queue: String,
    /// The incarnation planned for: a queue deleted and declared again is not moved.
    pub incarnation: u64,
    /// Its primary when planned (a backup move: the backup that goes).
    pub from: String,
    /// The member that takes it over (a backup move: the new backup).
    pub to: String,
    /// A backup move ([`QueueRoles::request_replace`]) rather than a primary move.
    #[serde(default)]
    pub backup: bool,
    /// How far it got.
    pub state: MoveState,
}

/// A rebalance the map carries out (or carried out: the last one stays for its report).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rebalance {
    /// Agreed index of the op that started it.
    pub started_at: u64,
    /// Most moves under way at once.
    pub concurrency: u32,
    /// No more moves start (`cluster rebalance --stop`).
    pub stopped: bool,
    /// The plan, in the order its moves start: the primary moves planned at the start,
    /// then the backup moves, planned once the primaries are where they go.
    pub moves: Vec<PlannedMove>,
    /// The backup moves were planned and appended.
    #[serde(default)]
    pub backups_planned: bool,
    /// The member whose join started it ([`RebalanceStep::Join`]): it and its neighbours
    /// on the ring hand it its share; `None` for `cluster rebalance --apply`.
    ///
    /// [`RebalanceStep::Join`]: crate::core::RebalanceStep::Join
    #[serde(default)]
    pub joined: Option<String>,
    /// The members that take part: a join's new member and its neighbours. Empty: every
    /// active member.
    #[serde(default)]
    pub scope: Vec<String>,
}

impl Rebalance {
    /// A rebalance started at agreed `index` over the roles and members now, not yet
    /// advanced (the map calls [`Rebalance::advance`] next).
    pub fn start(index: u64, concurrency: u32, roles: &Roles, membership: &Membership) -> Self {
        Self {
            started_at: index,
            concurrency: concurrency.clamp(1, MAX_CONCURRENCY),
            stopped: false,
            moves: plan(roles, membership, None),
            backups_planned: false,
            joined: None,
            scope: Vec::new(),
        }
    }

    /// The handover to `node`, new to the ring, started at agreed `index`: it and its ring
    /// neighbours even out their primaries, then every queue whose backups should now be on
    /// it ships it a copy (and the queues of the three get their backups on their ring
    /// successors). `cluster rebalance --apply` evens out the rest of the ring.
    pub fn join(index: u64, node: &str, roles: &Roles, membership: &Membership) -> Self {
        let scope = join_scope(membership, node);
        Self {
            started_at: index,
            concurrency: DEFAULT_CONCURRENCY,
            stopped: false,
            moves: plan(roles, membership, Some(&scope)),
            backups_planned: false,
            joined: Some(node.to_owned()),
            scope,
        }
    }

    /// Whether a planned backup move is this rebalance's to make: any, unless it is a
    /// join's handover, which ships copies to the new member and fixes the backups of the
    /// queues its scope is the primary of.
    fn takes_part(&self, m: &PlannedMove, roles: &Roles) -> bool {
        let Some(joined) = &self.joined else {
            return true;
        };
        m.to == *joined
            || (roles.get(&m.vhost, &m.queue)).is_some_and(|r| self.scope.contains(&r.primary))
    }

    /// Whether no move is pending or under way, and none is left to plan.
    pub fn finished(&self) -> bool {
        (self.backups_planned || self.stopped) && self.moves_left() == 0
    }

    /// The moves pending or under way.
    pub fn moves_left(&self) -> usize {
        self.moves.iter().filter(|m| m.state.is_open()).count()
    }

    /// One word for where it is: `running`, `done` (every move made), `failed` (some could
    /// not be), `stopped`.
    pub fn status(&self) -> &'static str {
        let failed = (self.moves.iter()).any(|m| matches!(m.state, MoveState::Failed(_)));
        match (self.finished(), self.stopped, failed) {
            (false, _, _) => "running",
            (true, _, true) => "failed",
            (true, true, false) => "stopped",
            (true, false, false) => "done",
        }
    }

    /// Stops it: the moves not started yet are skipped (those under way finish). Returns
    /// whether anything changed.
    pub fn stop(&mut self) -> bool {
        if self.stopped {
            return false;
        }
        self.stopped = true;
        for m in &mut self.moves {
            if m.state == MoveState::Pending {
                m.state = MoveState::Skipped;
            }
        }
        true
    }

    /// Records what the roles say of the moves under way, and starts the next ones up to
    /// the concurrency. Returns the queues whose roles must change to start a move
    /// (vhost, queue, new roles), and whether the plan itself changed.
    pub fn advance(
        &mut self,
        roles: &Roles,
        ring: &[String],
        draining: &BTreeSet<String>,
    ) -> (Vec<(String, String, QueueRoles)>, bool) {
        let mut changed = false;
        let current = |m: &PlannedMove| {
            roles
                .get(&m.vhost, &m.queue)
                .filter(|r| r.incarnation == m.incarnation)
        };
        for m in &mut self.moves {
            if m.state == MoveState::Running
                && let Some(ended) = m.ended(current(m))
            {
                m.state = ended;
                changed = true;
            }
        }
        if !self.stopped && !self.backups_planned && self.moves_left() == 0 {
            // The primaries are where the plan put them: now the backups follow the ring.
            let backups = backup_plan(roles, ring, draining);
            let ours: Vec<PlannedMove> = (backups.into_iter())
                .filter(|m| self.takes_part(m, roles))
                .collect();
            self.moves.extend(ours);
            self.backups_planned = true;
            changed = true;
        }
        let mut requests = Vec::new();
        let mut busy: BTreeSet<(String, String)> = (self.moves.iter())
            .filter(|m| m.state == MoveState::Running)
            .map(|m| (m.vhost.clone(), m.queue.clone()))
            .collect();
        for m in &mut self.moves {
            if self.stopped || busy.len() >= self.concurrency as usize {
                break;
            }
            let queue = (m.vhost.clone(), m.queue.clone());
            if m.state != MoveState::Pending || busy.contains(&queue) {
                // One change of a queue's roles at a time.
                continue;
            }
            changed = true;
            m.state = match m.start(current(m), ring, draining) {
                Ok(Start::Made) => MoveState::Done,
                Ok(Start::Running(change)) => {
                    if let Some(now) = change {
                        requests.push((queue.0.clone(), queue.1.clone(), now));
                    }
                    busy.insert(queue);
                    MoveState::Running
                }
                Err(why) => MoveState::Failed(why),
            };
        }
        (requests, changed)
    }
}

/// What starting a pending move came to.
enum Start {
    /// Nothing to do: the target is the primary already.
    Made,
    /// Under way, with the roles to set (`None` when they record it already).
    Running(Option<QueueRoles>),
}

impl PlannedMove {
    /// Where this move, under way, stands by the queue's roles now (`None`: the queue is
    /// gone or another incarnation): `None` while it runs, else done or failed.
    fn ended(&self, roles: Option<&QueueRoles>) -> Option<MoveState> {
        let Some(r) = roles else {
            return Some(MoveState::Failed("the queue was deleted".to_owned()));
        };
        let (running, done, why) = if self.backup {
            (
                (r.replacing.as_deref()).is_some_and(|x| x.old == self.from && x.new == self.to),
                r.backups.contains(&self.to) && !r.backups.contains(&self.from),
                "the backup's replacement was called off (the new backup left, restarted or \
                 was drained, or the primary changed)",
            )
        } else {
            (
                r.moving_to.as_deref() == Some(self.to.as_str()),
                r.primary == self.to,
                "the move was called off (its target left, restarted or was drained, or did \
                 not catch up in time)",
            )
        };
        match (running, done) {
            (true, _) => None,
            (false, true) => Some(MoveState::Done),
            (false, false) => Some(MoveState::Failed(why.to_owned())),
        }
    }

    /// Starts this pending move on the queue's roles now, or says why it cannot be made.
    fn start(
        &self,
        roles: Option<&QueueRoles>,
        ring: &[String],
        draining: &BTreeSet<String>,
    ) -> Result<Start, String> {
        let r = roles.ok_or("the queue was deleted")?;
        if !self.backup && r.primary == self.to {
            return Ok(Start::Made);
        }
        if !self.backup && r.primary != self.from {
            return Err(format!(
                "its primary changed to '{}' since the plan was made",
                r.primary
            ));
        }
        if draining.contains(&self.to) {
            return Err(format!("'{}' is being drained", self.to));
        }
        let mut now = r.clone();
        let started = if self.backup {
            now.request_replace(&self.from, &self.to, ring)?
        } else {
            now.request_move(&self.to, ring)?
        };
        if !started {
            return Ok(Start::Running(None));
        }
        now.reconcile_with(ring, draining);
        Ok(Start::Running(Some(now)))
    }
}

/// The backup moves that put every queue's backups on its primary's successors in the
/// ring of active members (not draining) — with even primaries, that evens the backups
/// too: each member backs its `k` predecessors' queues. A misplaced backup is paired with
/// a missing successor; queues that are unavailable or whose roles are changing now stay
/// out of it.
pub fn backup_plan(
    roles: &Roles,
    ring: &[String],
    draining: &BTreeSet<String>,
) -> Vec<PlannedMove> {
    let active: Vec<&String> = ring.iter().filter(|n| !draining.contains(*n)).collect();
    let mut moves = Vec::new();
    for (vhost, queue, r) in roles.iter() {
        if r.unavailable || r.moving_to.is_some() || r.replacing.is_some() {
            continue;
        }
        let Some(at) = active.iter().position(|n| **n == r.primary) else {
            continue;
        };
        let k = usize::from(r.wanted_backups).min(active.len() - 1);
        let wanted: Vec<&String> = (1..=k).map(|d| active[(at + d) % active.len()]).collect();
        let misplaced = r.backups.iter().filter(|b| !wanted.contains(b));
        let missing = wanted.iter().filter(|w| !r.backups.contains(w));
        for (old, new) in misplaced.zip(missing) {
            moves.push(PlannedMove {
                vhost: vhost.to_owned(),
                queue: queue.to_owned(),
                incarnation: r.incarnation,
                from: old.clone(),
                to: (*new).clone(),
                backup: true,
                state: MoveState::Pending,
            });
        }
    }
    moves
}

/// The members of the ring, in ring order, with their zones, as the planner takes them:
/// those in `scope` if there is one, never the draining ones.
fn planner_ring(membership: &Membership, scope: Option<&[String]>) -> Vec<Member> {
    let draining = membership.draining();
    let zones: BTreeMap<&str, &str> = (membership.members().iter())
        .filter_map(|m| m.info.as_ref())
        .map(|i| (i.node_id.as_str(), i.zone.as_str()))
        .collect();
    membership
        .ring()
        .into_iter()
        .filter(|n| !draining.contains(n) && scope.is_none_or(|s| s.contains(n)))
        .map(|n| {
            let zone = zones.get(n.as_str()).copied().unwrap_or_default();
            Member::new(n, zone)
        })
        .collect()
}

/// Queues a plan may move, by resource id: (vhost, queue, roles).
type Plannable<'r> = BTreeMap<String, (&'r str, &'r str, &'r QueueRoles)>;

/// The queues whose primary is on `ring` and may be planned for (not unavailable, not
/// moving), keyed by resource ids that sort as (vhost, queue) and cannot collide, and the
/// planner's placement of them.
fn placement(roles: &Roles, ring: Vec<Member>) -> (Placement, Plannable<'_>) {
    let on_ring: BTreeSet<String> = ring.iter().map(|m| m.id.clone()).collect();
    let mut queues = BTreeMap::new();
    for (vhost, queue, r) in roles.iter() {
        if r.unavailable || r.moving_to.is_some() || !on_ring.contains(&r.primary) {
            continue;
        }
        queues.insert(format!("{}:{vhost}{queue}", vhost.len()), (vhost, queue, r));
    }
    let assigned = (queues.iter())
        .map(|(id, (_, _, r))| {
            let backups = usize::from(r.wanted_backups).min(ringmq_planner::MAX_BACKUPS);
            let primary = r.primary.clone();
            (id.clone(), Assignment { primary, backups })
        })
        .collect();
    let placement = Placement::existing(ring, assigned)
        .expect("the ring has distinct members and every primary planned is on it");
    (placement, queues)
}

/// Where a member new to the ring goes: under an explicit layout, its place in the list
/// (between the listed members placed already); under the `placement` layout, its
/// configured `ring_order`; else (a member an explicit layout does not list, any member
/// under a zone-aware one, one without `ring_order`) the gap the planner picks (zones kept
/// apart first, then the fewest backups to ship); a gap before the first member is the end
/// of the ring (the ring is a circle, and so the order of a cluster without queues or zones
/// stays its join order).
pub fn insertion(roles: &Roles, membership: &Membership, new: &MemberInfo) -> Insertion {
    match &membership.layout().order {
        RingOrder::Explicit(list) => {
            if let Some(at) = listed_insertion(&new.node_id, list, &membership.places()) {
                return at;
            }
        }
        RingOrder::ZoneAware => {}
        RingOrder::Placement => {
            if let Some(order) = new.ring_order {
                return Insertion::Order(order);
            }
        }
    }
    let ring: Vec<Member> = planner_ring(membership, None)
        .into_iter()
        .filter(|m| m.id != new.node_id)
        .collect();
    let (placement, _) = placement(roles, ring);
    match insertion_point(&placement, &Member::new(&new.node_id, &new.zone)) {
        Ok(point) if point.index > 0 => Insertion::Before(placement.ring()[point.index].id.clone()),
        _ => Insertion::End,
    }
}

/// The members a new member's join hands queues over between: it and its neighbours on
/// the ring of active members (fewer when the ring is smaller).
pub fn join_scope(membership: &Membership, node: &str) -> Vec<String> {
    let draining = membership.draining();
    let active: Vec<String> = (membership.ring().into_iter())
        .filter(|n| !draining.contains(n))
        .collect();
    let Some(at) = active.iter().position(|n| n == node) else {
        return Vec::new();
    };
    let n = active.len();
    let scope: BTreeSet<&String> = [(at + n - 1) % n, at, (at + 1) % n]
        .into_iter()
        .map(|i| &active[i])
        .collect();
    scope.into_iter().cloned().collect()
}

/// The moves that even out the primaries over the active members (in the map's ring,
/// not draining; of those, the ones in `scope` if there is one), all pending. Queues that
/// are unavailable, already moving, or whose primary is draining, gone or out of the scope
/// stay out of it (a drain or an election decides those).
pub fn plan(roles: &Roles, membership: &Membership, scope: Option<&[String]>) -> Vec<PlannedMove> {
    let (placement, queues) = placement(roles, planner_ring(membership, scope));
    let unbounded = RebalanceBounds {
        max_ownership_moves: usize::MAX,
        max_backup_ships: usize::MAX,
    };
    rebalance_plan(&placement, unbounded)
        .ownership_moves
        .into_iter()
        .map(|m| {
            let (vhost, queue, r) = queues[&m.resource];
            PlannedMove {
                vhost: vhost.to_owned(),
                queue: queue.to_owned(),
                incarnation: r.incarnation,
                from: m.from,
                to: m.to,
                backup: false,
                state: MoveState::Pending,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
