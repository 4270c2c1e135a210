//! Quorum leases and failure detection, the timing half of the guarantees.
//!
//! * A follower has quorum until `lease_ms` after it *sent* a ping that the leader answered
//!   with a grant; the leader grants only while a majority acknowledged it within `lease_ms`.
//! * The leader removes a member only after `failure_timeout_ms` without a ping from it
//!   (counted from when it became leader, since it knows nothing older). Any lease the member
//!   still holds was granted at most `lease_ms` after a ping this or an earlier leader received,
//!   so with `failure_timeout_ms > 2 * lease_ms + heartbeat_ms` it has expired first.
//! * A follower whose log lags by more than `max_lag_entries` for `failure_timeout_ms` is also
//!   removed: a slow member never holds the group back.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

use super::types::MemberId;

/// Lease and failure-detector state of one member.
#[derive(Debug)]
pub(crate) struct Lease {
    lease: Duration,
    failure_timeout: Duration,
    granted_until: Option<Instant>,
    leading_term: Option<u64>,
    last_heard: BTreeMap<MemberId, Instant>,
    lagging_since: BTreeMap<MemberId, Instant>,
}

impl Lease {
    /// Fresh state: no lease, not leading.
    pub fn new(lease_ms: u64, failure_timeout_ms: u64) -> Self {
        Self {
            lease: Duration::from_millis(lease_ms),
            failure_timeout: Duration::from_millis(failure_timeout_ms),
            granted_until: None,
            leading_term: None,
            last_heard: BTreeMap::new(),
            lagging_since: BTreeMap::new(),
        }
    }

    /// The leader granted the ping sent at `sent_at`.
    pub fn granted(&mut self, sent_at: Instant) {
        let until = sent_at + self.lease;
        if self.granted_until.is_none_or(|u| u < until) {
            self.granted_until = Some(until);
        }
    }

    /// Whether a follower's lease still runs at `now`.
    pub fn follower_has_quorum(&self, now: Instant) -> bool {
        self.granted_until.is_some_and(|u| now < u)
    }

    /// Whether a leader whose last majority acknowledgement is `millis_since_quorum_ack` old
    /// (as of a report up to `staleness_ms` old) may still claim quorum.
    pub fn leader_has_quorum(&self, millis_since_quorum_ack: Option<u64>, staleness_ms: u64) -> bool {
        let lease_ms = u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX);
        millis_since_quorum_ack.is_some_and(|ms| ms.saturating_add(staleness_ms) < lease_ms)
    }

    /// A ping from `member` reached the leader at `now`.
    pub fn heard(&mut self, member: MemberId, now: Instant) {
        self.last_heard.insert(member, now);
    }

    /// Called on every leader tick; starts the failure clocks afresh in a new term, because a
    /// new leader cannot know when the previous one last heard from anybody.
    pub fn leading(&mut self, term: u64) {
        if self.leading_term != Some(term) {
            self.leading_term = Some(term);
            self.last_heard.clear();
            self.lagging_since.clear();
        }
        self.granted_until = None;
    }

    /// Not leading (any more).
    pub fn following(&mut self) {
        self.leading_term = None;
    }

    /// Members of `voters` (other than the leader) to remove at `now`: silent for
    /// `failure_timeout_ms`, or lagging more than `max_lag_entries` for as long.
    pub fn failed(
        &mut self,
        now: Instant,
        leader: MemberId,
        voters: &BTreeSet<MemberId>,
        lag_entries: &BTreeMap<MemberId, u64>,
        max_lag_entries: u64,
    ) -> BTreeSet<MemberId> {
        let mut out = BTreeSet::new();
        for &id in voters.iter().filter(|&&id| id != leader) {
            let heard = *self.last_heard.entry(id).or_insert(now);
            if now.duration_since(heard) > self.failure_timeout {
                out.insert(id);
            }
            let lag = lag_entries.get(&id).copied().unwrap_or(0);
            if lag > max_lag_entries {
                let since = *self.lagging_since.entry(id).or_insert(now);
                if now.duration_since(since) > self.failure_timeout {
                    out.insert(id);
                }
            } else {
                self.lagging_since.remove(&id);
            }
        }
        self.last_heard.retain(|id, _| voters.contains(id));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn lease_runs_from_the_send_time_of_the_granted_ping() {
        let mut l = Lease::new(500, 1_200);
        let sent = Instant::now();
        tokio::time::advance(Duration::from_millis(100)).await;
        l.granted(sent);
        assert!(l.follower_has_quorum(Instant::now()));
        tokio::time::advance(Duration::from_millis(401)).await;
        assert!(!l.follower_has_quorum(Instant::now()));
    }

    #[tokio::test(start_paused = true)]
    async fn new_leader_waits_a_full_failure_timeout_before_removing_anyone() {
        let mut l = Lease::new(500, 1_200);
        let voters = BTreeSet::from([1, 2, 3]);
        l.leading(7);
        let none = BTreeMap::new();
        assert!(l.failed(Instant::now(), 1, &voters, &none, 10).is_empty());
        l.heard(2, Instant::now());
        tokio::time::advance(Duration::from_millis(1_000)).await;
        l.heard(2, Instant::now());
        tokio::time::advance(Duration::from_millis(201)).await;
        assert_eq!(l.failed(Instant::now(), 1, &voters, &none, 10), BTreeSet::from([3]));
    }

    #[tokio::test(start_paused = true)]
    async fn lagging_member_is_removed_only_after_lagging_for_the_failure_timeout() {
        let mut l = Lease::new(500, 1_200);
        let voters = BTreeSet::from([1, 2]);
        l.leading(1);
        let lag = BTreeMap::from([(2, 100)]);
        for _ in 0..11 {
            l.heard(2, Instant::now());
            assert!(l.failed(Instant::now(), 1, &voters, &lag, 10).is_empty());
            tokio::time::advance(Duration::from_millis(100)).await;
        }
        l.heard(2, Instant::now());
        tokio::time::advance(Duration::from_millis(150)).await;
        l.heard(2, Instant::now());
        assert_eq!(l.failed(Instant::now(), 1, &voters, &lag, 10), BTreeSet::from([2]));
    }
}
