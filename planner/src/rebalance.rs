//! Rebalance: a bounded plan that evens primaries per member.
//!
//! Every ownership move costs a transfer and may ship backups, so a plan is capped: the
//! operator or broker applies one bounded plan, lets it settle, and asks again. Each move
//! strictly lowers the imbalance, so repeated plans converge.

use std::collections::BTreeSet;

use crate::placement::{Placement, backups_on};

/// A primary changing member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnershipMove {
    /// Resource id.
    pub resource: String,
    /// Member giving up the primary.
    pub from: String,
    /// Member taking the primary.
    pub to: String,
}

/// A copy shipped to a member that becomes a backup and holds no copy yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupShip {
    /// Resource id.
    pub resource: String,
    /// Member receiving the copy.
    pub to: String,
}

/// Limits on one plan; a plan never exceeds either.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RebalanceBounds {
    /// Most ownership moves in one plan.
    pub max_ownership_moves: usize,
    /// Most backup ships in one plan.
    pub max_backup_ships: usize,
}

/// The moves to apply, in order, and the placement they lead to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RebalancePlan {
    /// Ownership moves, in application order.
    pub ownership_moves: Vec<OwnershipMove>,
    /// Backup ships implied by the ownership moves.
    pub backup_ships: Vec<BackupShip>,
    /// The placement after every move is applied.
    pub result: Placement,
}

/// Ships needed if `resource`'s primary moves from `from` to `to`: members in the new
/// backup window that had no copy (neither old primary nor old backup).
fn ships_for(placement: &Placement, resource: &str, to: &str) -> Vec<BackupShip> {
    let Some(a) = placement.resources().get(resource) else {
        return Vec::new();
    };
    let mut had: BTreeSet<String> = placement.backups(resource).into_iter().collect();
    had.insert(a.primary.clone());
    backups_on(placement.ring(), to, a.backups)
        .into_iter()
        .filter(|m| !had.contains(m))
        .map(|m| BackupShip {
            resource: resource.to_string(),
            to: m,
        })
        .collect()
}

/// Plans moves from the most-loaded member to the least-loaded one until primaries per
/// member differ by at most one, or a bound would be exceeded.
///
/// Among the resources the most-loaded member could give away, the one needing the fewest
/// backup ships goes first (ties: lowest id); ties between members go to the lowest ring
/// index. That makes the plan deterministic and cheap.
pub fn rebalance_plan(placement: &Placement, bounds: RebalanceBounds) -> RebalancePlan {
    let mut current = placement.clone();
    let mut ownership_moves = Vec::new();
    let mut backup_ships = Vec::new();
    while ownership_moves.len() < bounds.max_ownership_moves {
        let load = current.load();
        let by_ring = |id: &String| current.index_of(id).unwrap_or(usize::MAX);
        let Some((most, most_n)) = load
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(by_ring(b.0).cmp(&by_ring(a.0))))
        else {
            break;
        };
        let Some((least, least_n)) = load
            .iter()
            .min_by(|a, b| a.1.cmp(b.1).then(by_ring(a.0).cmp(&by_ring(b.0))))
        else {
            break;
        };
        if most_n - least_n <= 1 {
            break;
        }
        let (most, least) = (most.clone(), least.clone());
        let candidate = current
            .resources()
            .iter()
            .filter(|(_, a)| a.primary == most)
            .map(|(id, _)| (ships_for(&current, id, &least), id.clone()))
            .min_by(|a, b| a.0.len().cmp(&b.0.len()).then(a.1.cmp(&b.1)));
        let Some((ships, resource)) = candidate else {
            break;
        };
        if backup_ships.len() + ships.len() > bounds.max_backup_ships {
            break;
        }
        current.set_primary(&resource, &least);
        ownership_moves.push(OwnershipMove {
            resource,
            from: most,
            to: least,
        });
        backup_ships.extend(ships);
    }
    assert!(
        ownership_moves.len() <= bounds.max_ownership_moves,
        "plan respects its move bound"
    );
    assert!(
        backup_ships.len() <= bounds.max_backup_ships,
        "plan respects its ship bound"
    );
    RebalancePlan {
        ownership_moves,
        backup_ships,
        result: current,
    }
}
