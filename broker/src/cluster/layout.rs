//! The ring's layout, as the cluster's administrator (or the operator's `BackupRing`) sets
//! it: the order of the members on the ring and the `k` of the queues declared without
//! their own. Kept in the cluster map, so every member applies the same layout at the same
//! point of the agreed order, and a member that joins later is placed by it.
//!
//! Pure: the orders are functions of the ring and the members' zones, so they are tested
//! without I/O. Changing the order moves no queue by itself: each queue's backups stay
//! where they are, in sync, until a rebalance puts them on their primary's new ring
//! successors (catch-up first), so a layout change never leaves a queue with fewer in-sync
//! copies.

use super::membership::Insertion;
use super::roles::MAX_BACKUPS;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// How the members are ordered on the ring.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RingOrder {
    /// The brokers place each new member themselves: its `ring_order`, else the planner's
    /// gap (zones kept apart, fewest backups to ship); the members already placed stay.
    #[default]
    Placement,
    /// These node ids, in this order. When it is set, the members not listed follow the
    /// listed ones, in the order they had. A listed member that joins later goes to its
    /// place in the list; one not listed, into the planner's gap.
    Explicit(Vec<String>),
    /// The members of different zones take turns around the ring (the largest zone first),
    /// so that a queue's next `k` members are in other zones than its primary wherever the
    /// zones' sizes allow. Members that join later go into the planner's zone-aware gap.
    ZoneAware,
}

/// The ring's layout: its order and the `k` of queues without their own.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingLayout {
    /// Order of the members.
    #[serde(default)]
    pub order: RingOrder,
    /// Backups of a queue declared without `qpid.cluster.backups`: this, for every such
    /// queue whatever member it was declared through (existing ones take it on when it is
    /// set); `None`, the declaring member's `default_backups`.
    #[serde(default)]
    pub backups: Option<u8>,
}

/// Why a layout is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The explicit order names nobody.
    #[error("an explicit ring order names at least one member")]
    EmptyOrder,
    /// A node id is empty.
    #[error("a member's node id in the ring order is empty")]
    EmptyName,
    /// A node id is listed twice.
    #[error("member '{0}' is listed twice in the ring order")]
    Twice(String),
    /// `k` is out of range.
    #[error("backups must be 0 to {MAX_BACKUPS}, not {0}")]
    Backups(u8),
}

impl RingLayout {
    /// Checks what no ring can follow; the members need not be in the cluster yet (a
    /// listed member that joins later goes to its place).
    pub fn validate(&self) -> Result<(), LayoutError> {
        if let RingOrder::Explicit(list) = &self.order {
            if list.is_empty() {
                return Err(LayoutError::EmptyOrder);
            }
            let mut seen = BTreeSet::new();
            for node in list {
                if node.is_empty() {
                    return Err(LayoutError::EmptyName);
                }
                if !seen.insert(node.as_str()) {
                    return Err(LayoutError::Twice(node.clone()));
                }
            }
        }
        match self.backups {
            Some(k) if k > MAX_BACKUPS => Err(LayoutError::Backups(k)),
            _ => Ok(()),
        }
    }
}

/// `ring` (node ids, in ring order, present or not) ordered by `order`; `zone_of` gives a
/// member's zone, `None` for a member whose zone is not known (not announced now). The same
/// result for the same inputs on every member, and a fixed point: ordering the result again
/// changes nothing, so a layout applied twice moves nobody the second time.
pub fn ordered(
    ring: &[String],
    order: &RingOrder,
    zone_of: impl Fn(&str) -> Option<String>,
) -> Vec<String> {
    match order {
        RingOrder::Placement => ring.to_vec(),
        RingOrder::Explicit(list) => {
            let listed = list.iter().filter(|n| ring.contains(n)).cloned();
            let rest = ring.iter().filter(|n| !list.contains(n)).cloned();
            listed.chain(rest).collect()
        }
        RingOrder::ZoneAware => zone_spread(ring, zone_of),
    }
}

/// The members of each zone take turns: zones by size (largest first, ties by where their
/// first member is on the ring), each zone's members in the order they had; members whose
/// zone is unknown follow, in the order they had.
fn zone_spread(ring: &[String], zone_of: impl Fn(&str) -> Option<String>) -> Vec<String> {
    let mut zones: Vec<(String, Vec<String>)> = Vec::new();
    let mut unknown = Vec::new();
    for node in ring {
        match zone_of(node) {
            Some(zone) => match zones.iter_mut().find(|(z, _)| *z == zone) {
                Some((_, members)) => members.push(node.clone()),
                None => zones.push((zone, vec![node.clone()])),
            },
            None => unknown.push(node.clone()),
        }
    }
    // A stable sort keeps ties in the order of their first member on the ring.
    zones.sort_by_key(|(_, members)| std::cmp::Reverse(members.len()));
    let rounds = zones.first().map_or(0, |(_, m)| m.len());
    let mut spread = Vec::with_capacity(ring.len());
    for round in 0..rounds {
        spread.extend(zones.iter().filter_map(|(_, m)| m.get(round).cloned()));
    }
    spread.extend(unknown);
    spread
}

/// Where `node`, new to the ring, goes under an explicit `list`: before the next listed
/// member placed on `ring`, else right after the previous one; `None` when it is not listed
/// or no listed member is placed yet (the brokers then place it as they would anyway).
pub fn listed_insertion(node: &str, list: &[String], ring: &[String]) -> Option<Insertion> {
    let at = list.iter().position(|n| n == node)?;
    let placed = |n: &&String| ring.contains(n);
    if let Some(next) = list[at + 1..].iter().find(placed) {
        return Some(Insertion::Before(next.clone()));
    }
    let previous = list[..at].iter().rev().find(placed)?;
    Some(Insertion::After(previous.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    fn zone(node: &str) -> Option<String> {
        // "a1" is in zone "a"; "x" has no known zone.
        (node.len() > 1).then(|| node[..1].to_owned())
    }

    #[test]
    fn an_explicit_order_puts_the_listed_members_first_and_keeps_the_rest_in_their_order() {
        let ring = nodes(&["m0", "m1", "m2", "m3"]);
        let list = nodes(&["m2", "m9", "m0"]);
        let got = ordered(&ring, &RingOrder::Explicit(list.clone()), zone);
        assert_eq!(got, nodes(&["m2", "m0", "m1", "m3"]));
        assert_eq!(ordered(&got, &RingOrder::Explicit(list), zone), got);
        assert_eq!(ordered(&ring, &RingOrder::Placement, zone), ring);
    }

    #[test]
    fn zone_aware_order_takes_turns_largest_zone_first_and_is_a_fixed_point() {
        let ring = nodes(&["a1", "a2", "b1", "b2", "a3", "c1", "x"]);
        let got = ordered(&ring, &RingOrder::ZoneAware, zone);
        assert_eq!(got, nodes(&["a1", "b1", "c1", "a2", "b2", "a3", "x"]));
        assert_eq!(ordered(&got, &RingOrder::ZoneAware, zone), got);
        // No two neighbours among the members with a zone share one.
        for pair in got[..6].windows(2) {
            assert_ne!(zone(&pair[0]), zone(&pair[1]), "{got:?}");
        }
    }

    #[test]
    fn a_listed_newcomer_goes_to_its_place_between_the_placed_members() {
        let list = nodes(&["m0", "m1", "m2", "m3"]);
        let ring = nodes(&["m0", "m3"]);
        assert_eq!(
            listed_insertion("m1", &list, &ring),
            Some(Insertion::Before("m3".into()))
        );
        let ring = nodes(&["m0", "m1"]);
        assert_eq!(
            listed_insertion("m3", &list, &ring),
            Some(Insertion::After("m1".into()))
        );
        assert_eq!(listed_insertion("m9", &list, &ring), None);
        assert_eq!(listed_insertion("m2", &list, &[]), None);
    }

    #[test]
    fn a_layout_no_ring_can_follow_is_refused_with_the_reason() {
        let explicit = |names: &[&str]| RingLayout {
            order: RingOrder::Explicit(nodes(names)),
            backups: None,
        };
        assert_eq!(explicit(&[]).validate(), Err(LayoutError::EmptyOrder));
        assert_eq!(explicit(&["a", ""]).validate(), Err(LayoutError::EmptyName));
        assert_eq!(
            explicit(&["a", "b", "a"]).validate(),
            Err(LayoutError::Twice("a".into()))
        );
        let too_many = RingLayout {
            backups: Some(MAX_BACKUPS + 1),
            ..RingLayout::default()
        };
        assert_eq!(
            too_many.validate(),
            Err(LayoutError::Backups(MAX_BACKUPS + 1))
        );
        assert_eq!(explicit(&["a", "b"]).validate(), Ok(()));
    }
}
