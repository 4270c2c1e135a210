//! Insertion point: where a new member enters the ring.
//!
//! A new member becomes a backup of every resource whose backup window now reaches it, and
//! each of those needs a copy shipped. Where it enters decides how many, so the planner picks
//! the gap that keeps zone spread best and, among those, ships the fewest backups.

use crate::placement::{Placement, PlanError};
use crate::ring::{Member, same_zone_neighbours};

/// The chosen gap and what entering there costs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InsertionPoint {
    /// Ring index the new member takes (it goes before the member now at this index).
    pub index: usize,
    /// Backup copies that must be shipped to the new member.
    pub backup_moves: usize,
    /// Same-zone neighbour pairs on the ring after the insertion.
    pub same_zone_neighbours: usize,
}

/// Backup ships caused by inserting a member before ring index `index`.
///
/// A resource with primary at `p` and `k` wanted backups gains the new member as a backup
/// exactly when the new member lands within `min(k, n)` steps after `p` on the new ring; every
/// other backup keeps its copy (the member that falls out of the window just drops one).
pub fn insertion_cost(placement: &Placement, index: usize) -> usize {
    let n = placement.ring().len();
    if n == 0 {
        return 0;
    }
    let gap = index % n;
    placement
        .resources()
        .values()
        .filter(|a| {
            let Some(p) = placement.index_of(&a.primary) else {
                return false;
            };
            // Distance from the primary to the new member on the new ring (1..=n).
            let distance = (gap + n - 1 - p) % n + 1;
            distance <= a.backups.min(n)
        })
        .count()
}

/// Picks the insertion point for `member`: maximal zone spread first, then fewest backup
/// ships, then the lowest index (so the choice is deterministic).
pub fn insertion_point(
    placement: &Placement,
    member: &Member,
) -> Result<InsertionPoint, PlanError> {
    if placement.index_of(&member.id).is_some() {
        return Err(PlanError::DuplicateMember(member.id.clone()));
    }
    let ring = placement.ring();
    let n = ring.len();
    if n == 0 {
        return Ok(InsertionPoint {
            index: 0,
            backup_moves: 0,
            same_zone_neighbours: 0,
        });
    }
    let before = same_zone_neighbours(ring);
    (0..n)
        .map(|index| {
            let left = &ring[(index + n - 1) % n];
            let right = &ring[index];
            let after = if n == 1 {
                2 * usize::from(left.zone == member.zone)
            } else {
                before - usize::from(left.zone == right.zone)
                    + usize::from(left.zone == member.zone)
                    + usize::from(right.zone == member.zone)
            };
            InsertionPoint {
                index,
                backup_moves: insertion_cost(placement, index),
                same_zone_neighbours: after,
            }
        })
        .min_by_key(|p| (p.same_zone_neighbours, p.backup_moves, p.index))
        .ok_or(PlanError::NoMembers)
}
