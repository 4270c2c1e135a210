//! What the roles simulation checks of the world: no two lease holders act as primary of one
//! queue incarnation, every confirmed op is held by the primary, the maps agree at quiescence.

use super::*;

impl World {
    /// Whether slot `i`'s process acts as primary of a queue with roles `r`: its map is live
    /// and holds the map, names it the primary and the queue available, and it holds the lease.
    pub(super) fn acts_as_primary(&self, i: usize, r: &QueueRoles) -> bool {
        let Some(m) = &self.slots[i].member else {
            return false;
        };
        m.map.is_live()
            && m.map.is_synced()
            && m.map.is_announced()
            && !r.unavailable
            && r.primary == self.slots[i].node
            && !sealed(r)
            && m.cpg.has_quorum_now()
    }

    /// The node `primary` holds every op confirmed for queue incarnation `key`.
    /// (A sealed primary — see [`sealed`] — takes no ops and is not counted as acting.)
    pub(super) fn check_holds_confirmed(&mut self, primary: &str, key: &QueueKey, when: &str) {
        let Some(confirmed) = self.confirmed.get(key) else {
            return;
        };
        let held = self
            .slot_of(primary)
            .and_then(|i| self.slots[i].held.get(key));
        let missing: Vec<u64> = confirmed
            .iter()
            .filter(|op| !held.is_some_and(|h| h.contains(op)))
            .copied()
            .collect();
        if !missing.is_empty() {
            self.fail(format!(
                "{when}: primary {primary} of {key:?} lacks confirmed ops {missing:?}"
            ));
        }
    }

    /// Checks 1 and 3 at this instant: of the members holding the lease, at most one acts as
    /// primary of each queue incarnation per view, and it holds every confirmed op.
    pub(super) fn check_primaries(&mut self, net: &Links) {
        let mut acting: BTreeMap<(String, u64), (usize, u64)> = BTreeMap::new();
        let mut checks = Vec::new();
        for i in 0..self.slots.len() {
            let Some(m) = self.running(i, net) else {
                continue;
            };
            let view = self
                .views
                .range(..=m.applied)
                .next_back()
                .copied()
                .unwrap_or(0);
            let roles: Vec<(String, QueueRoles)> = m
                .map
                .roles()
                .iter()
                .map(|(_, q, r)| (q.to_owned(), r.clone()))
                .collect();
            for (queue, r) in roles {
                if !self.acts_as_primary(i, &r) {
                    continue;
                }
                // Stronger than one per view: one at all (nothing legitimate overlaps across
                // views either: a primary is replaced in a later view only once it has lost
                // its lease).
                if let Some((other, other_view)) =
                    acting.insert((queue.clone(), r.incarnation), (i, view))
                {
                    self.fail(format!(
                        "slots {other} (view {other_view}) and {i} (view {view}) both hold the lease and act as primary of {queue} (incarnation {})",
                        r.incarnation
                    ));
                }
                checks.push((r.primary.clone(), (queue, r.incarnation)));
            }
        }
        for (primary, key) in checks {
            self.check_holds_confirmed(&primary, &key, "acting");
        }
    }

    /// Check 3 and 4 once everything healed and settled.
    pub(super) fn quiesced(&mut self, net: &Links) {
        self.check_primaries(net);
        // Members that applied the same events hold the same map (a mark committed a moment
        // ago may not have reached every member yet).
        let running: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.running(i, net).is_some())
            .collect();
        let holders = running
            .iter()
            .filter(|&&i| self.running(i, net).is_some_and(|m| m.map.is_synced()))
            .count();
        if holders == 0 && !running.is_empty() {
            // Every member that held the map was declared failed, one after the other, while
            // the others were still joining: they wait for a holder that never comes (a
            // restarted one forgets its map and joins afresh). A known liveness gap
            // (docs/cluster.md, force boot), not a safety one: counted, not failed.
            self.note("wedged: no running member holds the map".into());
            self.stats.wedged += 1;
            return;
        }
        let mut newest: Option<(u64, usize, Membership, Roles, Option<Rebalance>)> = None;
        for i in running {
            let Some(m) = self.running(i, net) else {
                continue;
            };
            if !m.map.is_synced() {
                self.fail(format!("slot {i} does not hold the map at quiescence"));
                continue;
            }
            let (ms, rs) = (m.map.membership().clone(), m.map.roles().clone());
            let rb = m.map.rebalance().cloned();
            match &newest {
                Some((applied, j, ms0, rs0, rb0)) if *applied == m.applied => {
                    if *ms0 != ms || *rs0 != rs || *rb0 != rb {
                        let why = format!(
                            "at quiescence slots {j} and {i} disagree: {rs0:?} {rb0:?} / {rs:?} {rb:?}"
                        );
                        self.fail(why);
                    }
                }
                Some((applied, ..)) if *applied > m.applied => {}
                _ => newest = Some((m.applied, i, ms, rs, rb)),
            }
        }
        if let Some((_, _, _, _, Some(rb))) = &newest {
            let done = rb.moves.iter().filter(|m| m.state == MoveState::Done);
            self.stats.rebalanced += done.count() as u64;
        }
        if let Some((_, _, _, roles, _)) = newest {
            for (_, queue, r) in roles.iter() {
                if !r.unavailable {
                    let key = (queue.to_owned(), r.incarnation);
                    self.check_holds_confirmed(&r.primary.clone(), &key, "at quiescence");
                }
            }
        }
    }
}

/// The primary of `r` stopped making ops for a planned move (`VHost::seal` on a broker):
/// its target is in sync, and the primary waits for its acknowledgement of everything
/// before it commits the switch.
pub(super) fn sealed(r: &QueueRoles) -> bool {
    r.moving_to
        .as_ref()
        .is_some_and(|to| r.in_sync.contains(to))
}
