//! Ring order: which member follows which.
//!
//! Backups of a resource are the members that follow its primary on the ring, so the ring
//! order decides how many zones a resource survives. Interleaving zones keeps neighbours in
//! different zones whenever the zone sizes allow it.

use std::collections::BTreeMap;

/// A broker taking part in the ring.
///
/// Only the id and the zone matter to placement; addresses live elsewhere so that the
/// planner stays pure.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Member {
    /// Stable member id (the pod name in Kubernetes, e.g. `ringmq-2`).
    pub id: String,
    /// Failure domain (e.g. `topology.kubernetes.io/zone`); members in one zone can fail together.
    pub zone: String,
}

impl Member {
    /// Builds a member; a convenience for callers and tests.
    pub fn new(id: impl Into<String>, zone: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            zone: zone.into(),
        }
    }
}

/// Computes the zone-interleaved ring order of `members`.
///
/// Why this construction: sorting zones by size (largest first, then by name) and dealing
/// their members onto the even slots and then the odd slots of the ring is the classic
/// arrangement that leaves the minimum possible number of same-zone neighbours on a cycle,
/// `max(0, 2·largest − n)`. Members inside a zone are taken in id order, so the result does
/// not depend on input order. Duplicate ids are kept once.
pub fn ring_order(members: &[Member]) -> Vec<Member> {
    let mut by_zone: BTreeMap<&str, Vec<&Member>> = BTreeMap::new();
    let mut seen = std::collections::BTreeSet::new();
    for m in members {
        if seen.insert(m.id.as_str()) {
            by_zone.entry(m.zone.as_str()).or_default().push(m);
        }
    }
    let mut zones: Vec<(&str, Vec<&Member>)> = by_zone.into_iter().collect();
    for (_, ms) in zones.iter_mut() {
        ms.sort_by(|a, b| a.id.cmp(&b.id));
    }
    // Largest zone first; ties broken by zone name (BTreeMap order is kept by a stable sort).
    zones.sort_by_key(|z| std::cmp::Reverse(z.1.len()));
    let sequence: Vec<&Member> = zones.into_iter().flat_map(|(_, ms)| ms).collect();
    let n = sequence.len();
    let mut slots: Vec<Option<Member>> = vec![None; n];
    let positions = (0..n).step_by(2).chain((1..n).step_by(2));
    for (member, slot) in sequence.into_iter().zip(positions) {
        slots[slot] = Some(member.clone());
    }
    let ring: Vec<Member> = slots.into_iter().flatten().collect();
    assert_eq!(ring.len(), n, "every member is placed exactly once");
    ring
}

/// Counts neighbouring pairs (cyclically) that share a zone.
///
/// This is the measure of zone spread the planner minimises: each such pair is a place where
/// a primary's first backup sits in its own zone.
pub fn same_zone_neighbours(ring: &[Member]) -> usize {
    let n = ring.len();
    if n < 2 {
        return 0;
    }
    (0..n)
        .filter(|&i| ring[i].zone == ring[(i + 1) % n].zone)
        .count()
}

/// The fewest same-zone neighbour pairs any cyclic order of these zone sizes can have.
///
/// Exposed so that callers (and the property tests) can check a ring against the optimum.
pub fn min_same_zone_neighbours(members: &[Member]) -> usize {
    let n = members.len();
    if n < 2 {
        return 0;
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for m in members {
        *counts.entry(m.zone.as_str()).or_default() += 1;
    }
    let largest = counts.values().copied().max().unwrap_or(0);
    if counts.len() == 1 {
        return n;
    }
    (2 * largest).saturating_sub(n)
}
