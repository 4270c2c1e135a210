//! Placement: each resource's primary and its backups.
//!
//! Primaries are explicit state (they move only through planned ownership moves, because a
//! move costs a transfer); backups are derived from the ring: the `k` members that follow the
//! primary. Deriving them keeps the two from disagreeing and makes the cost of a ring change
//! easy to compute.

use std::collections::{BTreeMap, BTreeSet};

use crate::ring::{Member, ring_order};

/// The most backups a resource may ask for; matches the `Queue` CRD's `backups` range.
pub const MAX_BACKUPS: usize = 3;

/// Something placed on the ring (a queue, or later a queue fragment).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Resource {
    /// Stable id, e.g. `vhost/queue`.
    pub id: String,
    /// Wanted backups (`k`); fewer are used while the ring has fewer than `k + 1` members.
    pub backups: usize,
}

impl Resource {
    /// Builds a resource; a convenience for callers and tests.
    pub fn new(id: impl Into<String>, backups: usize) -> Self {
        Self {
            id: id.into(),
            backups,
        }
    }
}

/// Why a plan could not be made; each variant says what the caller must fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Resources cannot be placed on an empty ring.
    #[error("the ring has no members: add a member before placing resources")]
    NoMembers,
    /// Member ids must be unique.
    #[error("member {0} appears twice: member ids must be unique")]
    DuplicateMember(String),
    /// A resource asks for more backups than supported.
    #[error("resource {0} asks for more than {MAX_BACKUPS} backups: lower its backups")]
    TooManyBackups(String),
    /// Resource ids must be unique.
    #[error("resource {0} appears twice: resource ids must be unique")]
    DuplicateResource(String),
    /// A resource's primary must be a member of the ring.
    #[error("the primary {primary} of resource {resource} is not on the ring")]
    PrimaryOffRing {
        /// The resource.
        resource: String,
        /// Its primary.
        primary: String,
    },
}

/// Where one resource lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// Member id of the primary.
    pub primary: String,
    /// Wanted backups `k`.
    pub backups: usize,
}

/// The ring plus every resource's primary: the whole placement state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    ring: Vec<Member>,
    resources: BTreeMap<String, Assignment>,
}

impl Placement {
    /// Places `resources` on a fresh ring of `members`.
    ///
    /// Resources are dealt round-robin in id order over the ring, so a fresh placement starts
    /// perfectly even (primaries per member differ by at most one).
    pub fn initial(members: &[Member], resources: &[Resource]) -> Result<Self, PlanError> {
        let ring = ring_order(members);
        if ring.len() != members.len() {
            let mut seen = BTreeSet::new();
            for m in members {
                if !seen.insert(&m.id) {
                    return Err(PlanError::DuplicateMember(m.id.clone()));
                }
            }
        }
        if ring.is_empty() {
            return Err(PlanError::NoMembers);
        }
        let mut sorted: Vec<&Resource> = resources.iter().collect();
        sorted.sort();
        let mut placed = BTreeMap::new();
        for (i, r) in sorted.into_iter().enumerate() {
            if r.backups > MAX_BACKUPS {
                return Err(PlanError::TooManyBackups(r.id.clone()));
            }
            let assignment = Assignment {
                primary: ring[i % ring.len()].id.clone(),
                backups: r.backups,
            };
            if placed.insert(r.id.clone(), assignment).is_some() {
                return Err(PlanError::DuplicateResource(r.id.clone()));
            }
        }
        Ok(Self {
            ring,
            resources: placed,
        })
    }

    /// The placement a running cluster holds: its ring in the order it keeps (a broker's
    /// ring is its join order, not [`ring_order`]'s) and each resource's current primary.
    /// This is what a rebalance starts from; [`Placement::initial`] is for a fresh ring.
    pub fn existing(
        ring: Vec<Member>,
        resources: BTreeMap<String, Assignment>,
    ) -> Result<Self, PlanError> {
        let mut seen = BTreeSet::new();
        for m in &ring {
            if !seen.insert(m.id.as_str()) {
                return Err(PlanError::DuplicateMember(m.id.clone()));
            }
        }
        if ring.is_empty() && !resources.is_empty() {
            return Err(PlanError::NoMembers);
        }
        for (id, a) in &resources {
            if a.backups > MAX_BACKUPS {
                return Err(PlanError::TooManyBackups(id.clone()));
            }
            if !seen.contains(a.primary.as_str()) {
                return Err(PlanError::PrimaryOffRing {
                    resource: id.clone(),
                    primary: a.primary.clone(),
                });
            }
        }
        Ok(Self { ring, resources })
    }

    /// The ring order in force.
    pub fn ring(&self) -> &[Member] {
        &self.ring
    }

    /// Every resource and where its primary is.
    pub fn resources(&self) -> &BTreeMap<String, Assignment> {
        &self.resources
    }

    /// Ring index of a member, if it is on the ring.
    pub fn index_of(&self, member_id: &str) -> Option<usize> {
        self.ring.iter().position(|m| m.id == member_id)
    }

    /// The primary of `resource`, if placed.
    pub fn primary(&self, resource: &str) -> Option<&str> {
        self.resources.get(resource).map(|a| a.primary.as_str())
    }

    /// The backups of `resource`: the `min(k, n − 1)` members after its primary on the ring.
    ///
    /// Never includes the primary and never repeats a member, because a ring of `n` distinct
    /// members has `n − 1` distinct successors.
    pub fn backups(&self, resource: &str) -> Vec<String> {
        let Some(a) = self.resources.get(resource) else {
            return Vec::new();
        };
        backups_on(&self.ring, &a.primary, a.backups)
    }

    /// Primaries per member, every ring member present (zero included), keyed by member id.
    pub fn load(&self) -> BTreeMap<String, usize> {
        let mut load: BTreeMap<String, usize> =
            self.ring.iter().map(|m| (m.id.clone(), 0)).collect();
        for a in self.resources.values() {
            *load.entry(a.primary.clone()).or_default() += 1;
        }
        load
    }

    /// The same placement with `member` entered into the ring before ring index `index`
    /// (`index == n` appends; cyclically that is the same gap as `0`).
    ///
    /// Primaries stay where they are: a new member starts with backups only, and takes
    /// primaries later through a rebalance plan.
    pub fn with_member_at(&self, member: Member, index: usize) -> Result<Self, PlanError> {
        if self.index_of(&member.id).is_some() {
            return Err(PlanError::DuplicateMember(member.id));
        }
        let mut ring = self.ring.clone();
        ring.insert(index.min(ring.len()), member);
        Ok(Self {
            ring,
            resources: self.resources.clone(),
        })
    }

    /// Moves the primary of `resource` to `to` (which must be on the ring).
    pub(crate) fn set_primary(&mut self, resource: &str, to: &str) {
        assert!(
            self.index_of(to).is_some(),
            "a primary must be a ring member"
        );
        if let Some(a) = self.resources.get_mut(resource) {
            a.primary = to.to_string();
        }
    }
}

/// The backups a resource with primary `primary` and `k` wanted backups has on `ring`.
pub(crate) fn backups_on(ring: &[Member], primary: &str, k: usize) -> Vec<String> {
    let n = ring.len();
    let Some(p) = ring.iter().position(|m| m.id == primary) else {
        return Vec::new();
    };
    let k_eff = k.min(n.saturating_sub(1));
    let backups: Vec<String> = (1..=k_eff).map(|d| ring[(p + d) % n].id.clone()).collect();
    debug_assert!(
        !backups.iter().any(|b| b == primary),
        "a primary is never its own backup"
    );
    backups
}
