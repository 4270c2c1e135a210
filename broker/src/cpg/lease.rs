//! Quorum leases and failure detection, the timing half of the guarantees.
//!
//! * The leader's own lease runs `lease_ms` from the last heartbeat a majority acknowledged.
//! * A follower has quorum until the leader's lease ends, measured conservatively: the leader
//!   answers a ping with what is left of its lease, and the follower counts that from when it
//!   *sent* the ping. So a member cut off with (or from) the leader loses quorum within
//!   `lease_ms` of the cut.
//! * The leader declares a member failed only after `failure_timeout_ms` without a ping from it.
//!   For a member it has not heard from in its term the silence counts from when it became
//!   leader, or earlier by what a majority proves: every member but that one reported when it
//!   last acknowledged an earlier term ([`TermAcks`]), and no lease of an earlier term outlives
//!   the latest such acknowledgement by more than a lease; that credit is capped at one
//!   failure timeout, which keeps the rule's tolerance of clock-rate differences
//!   (docs/cpg.md, *A new leader's failure clock*). Any lease the member
//!   still holds was granted at most `lease_ms` after a ping this or an earlier leader received,
//!   so with `failure_timeout_ms > 2 * lease_ms + heartbeat_ms` it has expired first.
//! * A follower whose log lags by more than `max_lag_entries` for `failure_timeout_ms` is also
//!   declared failed: a slow member never holds the group back. Since it still pings, it is
//!   first granted no more lease, and declared failed a `failure_timeout_ms` later, as if it
//!   had gone silent then, so its last grant has run out first.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

use super::term_acks::TermAcks;
use super::types::MemberId;

/// Lease and failure-detector state of one member.
#[derive(Debug)]
pub(crate) struct Lease {
    lease: Duration,
    failure_timeout: Duration,
    fresh: Duration,
    granted_until: Option<Instant>,
    /// Recent grants: (until, the index the follower must have applied for it to count). A
    /// follower under steady traffic is always a little behind the newest grant's index, so
    /// an older grant it has caught up with keeps its lease running.
    grants: Vec<(Instant, u64)>,
    /// Recent confirmations of the leader's lease: (until, its read index).
    confirms: Vec<(Instant, u64)>,
    leader_until: Option<Instant>,
    leading_term: Option<u64>,
    /// When each voter was last heard in this term; a voter never heard counts from this
    /// leader's first look for failed members (its first tick with quorum).
    last_heard: BTreeMap<MemberId, Instant>,
    /// Voters that did ping in this term (the others are in `last_heard` from that first
    /// look only).
    pinged: BTreeSet<MemberId>,
    /// The voters at this leader's first look for failed members in this term (`None`
    /// before it): only they may be credited with silence from before it — a voter added
    /// since has had no chance to ping yet.
    first_voters: Option<BTreeSet<MemberId>>,
    /// Members' reports in this term (this leader's own included): the latest moment each
    /// may have acknowledged a leader of an earlier term, on this leader's clock.
    older_acks: BTreeMap<MemberId, Instant>,
    /// This member's own acknowledgements of each term.
    pub(crate) acks: TermAcks,
    lagging_since: BTreeMap<MemberId, Instant>,
    /// Lagging members no longer granted a lease, and since when.
    withheld: BTreeMap<MemberId, Instant>,
    removing: BTreeSet<MemberId>,
}

impl Lease {
    /// Fresh state: no lease, not leading.
    pub fn new(lease_ms: u64, failure_timeout_ms: u64, heartbeat_ms: u64) -> Self {
        Self {
            lease: Duration::from_millis(lease_ms),
            failure_timeout: Duration::from_millis(failure_timeout_ms),
            fresh: Duration::from_millis(heartbeat_ms.saturating_mul(3)),
            granted_until: None,
            grants: Vec::new(),
            confirms: Vec::new(),
            leader_until: None,
            leading_term: None,
            last_heard: BTreeMap::new(),
            pinged: BTreeSet::new(),
            first_voters: None,
            older_acks: BTreeMap::new(),
            acks: TermAcks::new(Instant::now()),
            lagging_since: BTreeMap::new(),
            withheld: BTreeMap::new(),
            removing: BTreeSet::new(),
        }
    }

    /// The leader granted `granted_ms` to the ping sent at `sent_at`, having applied up to
    /// `committed` when it answered.
    pub fn granted(&mut self, sent_at: Instant, granted_ms: u64, committed: u64) {
        let until = sent_at + self.lease.min(Duration::from_millis(granted_ms));
        if self.granted_until.is_none_or(|u| u < until) {
            self.granted_until = Some(until);
        }
        remember(&mut self.grants, until, committed);
    }

    /// Whether a follower's lease still runs at `now` (whatever it has applied).
    #[cfg(test)]
    pub fn follower_has_quorum(&self, now: Instant) -> bool {
        self.granted_until.is_some_and(|u| now < u)
    }

    /// A round of heartbeats this leader sent at `sent_at`, in `term`, was acknowledged by a
    /// majority: its lease runs `lease_ms` from the *send* time, so neither a slow answer nor
    /// a pause of this process between sending and hearing back can lengthen it. An answer
    /// for an earlier term counts for nothing.
    ///
    /// `read_index` is what the round confirmed as committed: a new leader may not have
    /// applied entries of earlier terms yet, and claims nothing until it has.
    pub fn leader_confirmed(&mut self, term: u64, sent_at: Instant, read_index: u64) {
        if self.leading_term != Some(term) {
            return;
        }
        let until = sent_at + self.lease;
        if self.leader_until.is_none_or(|u| u < until) {
            self.leader_until = Some(until);
        }
        remember(&mut self.confirms, until, read_index);
        // A leader's round is its own acknowledgement of its term, from when it was sent.
        self.acks.acked(term, sent_at);
    }

    /// When this member's lease ends, for a member that has applied up to `applied`: the
    /// leader's own, or a follower's grant once it has applied what the leader had when it
    /// granted it. Compared with the clock when asked ([`super::Cpg::has_quorum_now`]), never
    /// cached.
    pub fn deadline_at(&self, applied: u64) -> Option<Instant> {
        if self.leading_term.is_some() {
            latest_caught_up(&self.confirms, applied)
        } else {
            latest_caught_up(&self.grants, applied)
        }
    }

    /// Whether this leader's own lease runs at `now` (whatever it has applied).
    #[cfg(test)]
    pub fn leader_has_quorum(&self, now: Instant) -> bool {
        self.leader_until.is_some_and(|u| now < u)
    }

    /// What is left of this leader's lease for `member` at `now` (0: no grant).
    pub fn grant_ms(&self, member: MemberId, now: Instant) -> u64 {
        if self.removing.contains(&member) || self.withheld.contains_key(&member) {
            return 0;
        }
        self.leader_until
            .map(|u| u.saturating_duration_since(now))
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    /// A ping from `member` reached the leader at `now`.
    pub fn heard(&mut self, member: MemberId, now: Instant) {
        self.last_heard.insert(member, now);
        self.pinged.insert(member);
    }

    /// How many of `voters` this member heard from within `within` of `now`, itself included:
    /// a leader counts the followers whose pings reached it in its term; a follower counts
    /// the leader once a ping of its was answered lately. What `/readyz` reports as
    /// "reachable" — a cut-off member says 1, whatever it still remembers of the others.
    pub fn reachable(
        &self,
        me: MemberId,
        voters: &[MemberId],
        now: Instant,
        within: Duration,
    ) -> usize {
        let lately = |t: Instant| now.saturating_duration_since(t) <= within;
        let others = if self.leading_term.is_some() {
            voters
                .iter()
                .filter(|v| **v != me && self.pinged.contains(v))
                .filter(|v| self.last_heard.get(v).is_some_and(|t| lately(*t)))
                .count()
        } else {
            usize::from(self.granted_until.is_some_and(lately))
        };
        1 + others
    }

    /// `member`, whose vote is this leader's `term`, reported that it last acknowledged a leader
    /// of an earlier term `since_ms` of its clock before `now` (or this leader's own record,
    /// with `member` = itself). Ignored unless this member leads `term`; never moves a report
    /// earlier.
    pub fn reported(&mut self, member: MemberId, term: u64, since_ms: u64, now: Instant) {
        if self.leading_term != Some(term) {
            return;
        }
        let at = now
            .checked_sub(Duration::from_millis(since_ms))
            .unwrap_or(now);
        let e = self.older_acks.entry(member).or_insert(at);
        if *e < at {
            *e = at;
        }
    }

    /// Since when `member`, not heard from in this term, counts as silent: the start of this
    /// term, or earlier when every other voter reported when it last acknowledged an earlier
    /// term (`settled`: the membership is committed and not joint, so that they are a
    /// majority of every configuration an earlier leader used — CPG changes one voter at a
    /// time). The credit is capped at one failure timeout: the reports are durations on the
    /// reporters' clocks, and with the cap a fast reporter clock costs no more margin than
    /// the rule `failure_timeout > 2 × lease + heartbeat` already holds for clock rates
    /// (docs/cpg.md).
    fn silent_since(
        &self,
        member: MemberId,
        voters: &BTreeSet<MemberId>,
        settled: bool,
        start: Instant,
    ) -> Instant {
        let was_voter = self
            .first_voters
            .as_ref()
            .is_some_and(|v| v.contains(&member));
        if !settled || voters.len() < 3 || !was_voter {
            return start;
        }
        let mut latest: Option<Instant> = None;
        for v in voters.iter().filter(|&&v| v != member) {
            match self.older_acks.get(v) {
                Some(&at) => latest = latest.max(Some(at)),
                None => return start,
            }
        }
        // Never declared before `fresh` (three heartbeats) after the first look: a live
        // member that knows the new leader has pinged it by then.
        let earliest = (start + self.fresh)
            .checked_sub(self.failure_timeout)
            .unwrap_or(start);
        latest.map_or(start, |l| l.clamp(earliest, start))
    }

    /// Called on every leader tick; starts the failure clocks afresh in a new term,
    /// because a new leader cannot know when the previous one last heard from anybody — only,
    /// from the members' reports, when the earlier terms' leases ran out
    /// ([`Lease::reported`]).
    pub fn leading(&mut self, term: u64) {
        if self.leading_term != Some(term) {
            self.leading_term = Some(term);
            self.pinged.clear();
            self.first_voters = None;
            self.leader_until = None;
            self.confirms.clear();
            self.last_heard.clear();
            self.older_acks.clear();
            self.lagging_since.clear();
            self.withheld.clear();
            self.removing.clear();
        }
        self.granted_until = None;
        self.grants.clear();
    }

    /// The leader proposed declaring `members` failed: from now on in this term it grants
    /// them no lease, since the declaration may commit at any later moment.
    pub fn removing(&mut self, members: &BTreeSet<MemberId>) {
        self.removing.extend(members);
    }

    /// Declarations this leader proposed that are now applied (`failed`): from here on the
    /// applied set denies those members a lease, until their next incarnation starts — which
    /// a member that restarts on its own data does, as the same member.
    pub fn removals_applied(&mut self, failed: &BTreeSet<MemberId>) {
        self.removing.retain(|m| !failed.contains(m));
    }

    /// The declaration of `members` this leader proposed is applied here (its write
    /// answered). The applied set alone cannot say so: a member restarted on its data may
    /// have started again right after the declaration, and its start cleared the mark before
    /// the monitor looked — it would then have been denied a lease for the rest of the term.
    /// Ignored unless this member still leads `term`, the term of the proposal.
    pub fn removal_done(&mut self, term: u64, members: &BTreeSet<MemberId>) {
        if self.leading_term == Some(term) {
            self.removing.retain(|m| !members.contains(m));
        }
    }

    /// Members this leader proposed declaring failed in this term.
    pub fn being_removed(&self) -> &BTreeSet<MemberId> {
        &self.removing
    }

    /// Not leading (any more).
    pub fn following(&mut self) {
        self.leading_term = None;
        self.leader_until = None;
        self.confirms.clear();
    }

    /// Members of `voters` (other than the leader) to declare failed at `now`: silent for
    /// `failure_timeout_ms`, or lagging more than `max_lag_entries` for as long. `settled`:
    /// the membership is committed and not joint (see [`Lease::silent_since`]).
    pub fn suspects(
        &mut self,
        now: Instant,
        leader: MemberId,
        voters: &BTreeSet<MemberId>,
        settled: bool,
        lag_entries: &BTreeMap<MemberId, u64>,
        max_lag_entries: u64,
    ) -> BTreeSet<MemberId> {
        let mut out = BTreeSet::new();
        self.first_voters.get_or_insert_with(|| voters.clone());
        for &id in voters.iter().filter(|&&id| id != leader) {
            let first = *self.last_heard.entry(id).or_insert(now);
            let heard = if self.pinged.contains(&id) {
                first
            } else {
                self.silent_since(id, voters, settled, first)
            };
            if now.duration_since(heard) > self.failure_timeout {
                out.insert(id);
            }
            let lag = lag_entries.get(&id).copied().unwrap_or(0);
            if lag > max_lag_entries {
                let since = *self.lagging_since.entry(id).or_insert(now);
                if now.duration_since(since) > self.failure_timeout {
                    // It still pings, so it may hold a lease: grant it no more, and declare
                    // it failed only once the last grant has run out. That grant ends a lease
                    // after its ping *on its own clock*: waiting a failure timeout, as for a
                    // silent member, leaves the same margin against a clock slower than ours.
                    let withheld = *self.withheld.entry(id).or_insert(now);
                    if now.duration_since(withheld) > self.failure_timeout {
                        out.insert(id);
                    }
                }
            } else {
                self.lagging_since.remove(&id);
                self.withheld.remove(&id);
            }
        }
        self.last_heard.retain(|id, _| voters.contains(id));
        self.pinged.retain(|id| voters.contains(id));
        out
    }

    /// Whether every one of `members` (other than the leader) was heard within three
    /// heartbeats.
    pub fn all_fresh<'a>(
        &self,
        now: Instant,
        leader: MemberId,
        members: impl IntoIterator<Item = &'a MemberId>,
    ) -> bool {
        members.into_iter().filter(|id| **id != leader).all(|id| {
            self.last_heard
                .get(id)
                .is_some_and(|h| now.duration_since(*h) <= self.fresh)
        })
    }

    /// How many of `members` were heard from lately, `leader` (this member) counted as heard.
    pub fn fresh_count<'a>(
        &self,
        now: Instant,
        leader: MemberId,
        members: impl IntoIterator<Item = &'a MemberId>,
    ) -> usize {
        members
            .into_iter()
            .filter(|id| {
                **id == leader
                    || self
                        .last_heard
                        .get(id)
                        .is_some_and(|h| now.duration_since(*h) <= self.fresh)
            })
            .count()
    }

    /// Of `candidates`, the one heard from longest ago (never heard in this term first).
    pub fn stalest(&self, candidates: &BTreeSet<MemberId>) -> Option<MemberId> {
        candidates
            .iter()
            .min_by_key(|id| self.last_heard.get(id).copied())
            .copied()
    }
}

/// How many recent grants (or confirmations) a member keeps: a heartbeat apart, more than a
/// lease's worth.
const REMEMBERED: usize = 16;

/// Records a lease running `until`, counting once `needs` is applied; keeps the newest ones.
fn remember(list: &mut Vec<(Instant, u64)>, until: Instant, needs: u64) {
    list.push((until, needs));
    if list.len() > REMEMBERED {
        list.remove(0);
    }
}

/// The latest end among the leases of `list` that count for a member that applied `applied`.
fn latest_caught_up(list: &[(Instant, u64)], applied: u64) -> Option<Instant> {
    list.iter()
        .filter(|(_, needs)| *needs <= applied)
        .map(|(until, _)| *until)
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn lease_runs_from_the_send_time_of_the_granted_ping() {
        let mut l = Lease::new(500, 1_200, 50);
        let sent = Instant::now();
        tokio::time::advance(Duration::from_millis(100)).await;
        l.granted(sent, 10_000, 0);
        assert!(l.follower_has_quorum(Instant::now()));
        tokio::time::advance(Duration::from_millis(401)).await;
        assert!(!l.follower_has_quorum(Instant::now()));
    }

    #[tokio::test(start_paused = true)]
    async fn follower_lease_never_outlives_the_leaders() {
        let mut leader = Lease::new(500, 1_200, 50);
        leader.leading(3);
        let sent = Instant::now();
        tokio::time::advance(Duration::from_millis(350)).await;
        leader.leader_confirmed(3, sent, 0);
        let grant = leader.grant_ms(2, Instant::now());
        assert_eq!(grant, 150);
        let mut follower = Lease::new(500, 1_200, 50);
        follower.granted(Instant::now(), grant, 0);
        tokio::time::advance(Duration::from_millis(151)).await;
        assert!(!leader.leader_has_quorum(Instant::now()));
        assert!(!follower.follower_has_quorum(Instant::now()));
    }

    #[tokio::test(start_paused = true)]
    async fn reachable_counts_only_the_members_heard_from_lately() {
        let within = Duration::from_millis(1_200);
        let mut leader = Lease::new(500, 1_200, 50);
        leader.leading(3);
        assert_eq!(leader.reachable(1, &[1, 2, 3], Instant::now(), within), 1);
        leader.heard(2, Instant::now());
        leader.heard(3, Instant::now());
        assert_eq!(leader.reachable(1, &[1, 2, 3], Instant::now(), within), 3);
        tokio::time::advance(Duration::from_millis(1_000)).await;
        leader.heard(2, Instant::now());
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(
            leader.reachable(1, &[1, 2, 3], Instant::now(), within),
            2,
            "3 went silent 1.5 s ago"
        );

        let mut follower = Lease::new(500, 1_200, 50);
        assert_eq!(follower.reachable(2, &[1, 2, 3], Instant::now(), within), 1);
        follower.granted(Instant::now(), 500, 0);
        assert_eq!(follower.reachable(2, &[1, 2, 3], Instant::now(), within), 2);
        tokio::time::advance(Duration::from_millis(2_000)).await;
        assert_eq!(
            follower.reachable(2, &[1, 2, 3], Instant::now(), within),
            1,
            "no answer from the leader for 2 s: cut off"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn member_being_removed_gets_no_grant() {
        let mut leader = Lease::new(500, 1_200, 50);
        leader.leading(3);
        leader.leader_confirmed(3, Instant::now(), 0);
        leader.removing(&BTreeSet::from([2]));
        assert_eq!(leader.grant_ms(2, Instant::now()), 0);
        assert!(leader.grant_ms(4, Instant::now()) > 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_member_restarted_right_after_its_declaration_gets_a_lease_again() {
        let mut leader = Lease::new(500, 1_200, 50);
        leader.leading(3);
        leader.leader_confirmed(3, Instant::now(), 0);
        leader.removing(&BTreeSet::from([2]));
        // Its restart's start cleared the applied mark before the monitor saw it set.
        leader.removals_applied(&BTreeSet::new());
        assert_eq!(
            leader.grant_ms(2, Instant::now()),
            0,
            "the entry may commit"
        );
        leader.removal_done(2, &BTreeSet::from([2]));
        assert_eq!(
            leader.grant_ms(2, Instant::now()),
            0,
            "another term's answer"
        );
        leader.removal_done(3, &BTreeSet::from([2]));
        assert!(leader.grant_ms(2, Instant::now()) > 0);
    }

    #[tokio::test(start_paused = true)]
    async fn new_leader_waits_a_full_failure_timeout_before_removing_anyone() {
        let mut l = Lease::new(500, 1_200, 50);
        let voters = BTreeSet::from([1, 2, 3]);
        l.leading(7);
        let none = BTreeMap::new();
        assert!(
            l.suspects(Instant::now(), 1, &voters, true, &none, 10)
                .is_empty()
        );
        l.heard(2, Instant::now());
        tokio::time::advance(Duration::from_millis(1_000)).await;
        l.heard(2, Instant::now());
        tokio::time::advance(Duration::from_millis(199)).await;
        assert!(
            l.suspects(Instant::now(), 1, &voters, true, &none, 10)
                .is_empty()
        );
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(!l.all_fresh(Instant::now(), 1, &BTreeSet::from([2])));
        l.heard(2, Instant::now());
        assert!(l.all_fresh(Instant::now(), 1, &BTreeSet::from([1, 2])));
        assert_eq!(
            l.suspects(Instant::now(), 1, &voters, true, &none, 10),
            BTreeSet::from([3])
        );
        assert_eq!(l.stalest(&BTreeSet::from([2, 3])), Some(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_leader_counts_a_silent_member_from_the_majoritys_last_acknowledgement_of_earlier_terms()
     {
        // Failure timeout 1200, lease 500, heartbeat 50.
        let voters = BTreeSet::from([1, 2, 3]);
        let none = BTreeMap::new();
        // Members 1 and 2 last acknowledged the old leader 3 900 ms before 1 leads term 8;
        // 2 reports its silence in its first ping.
        let mut l = Lease::new(500, 1_200, 50);
        let start = Instant::now();
        l.leading(8);
        l.reported(1, 8, 900, start);
        // A report for another term, or before this member leads it, counts for nothing.
        l.reported(2, 7, 900, start);
        assert!(l.suspects(start, 1, &voters, true, &none, 10).is_empty());
        l.reported(2, 8, 900, start);
        l.heard(2, start);
        // 3's leases ended within a lease of that acknowledgement; it is declared failed a
        // failure timeout after it: start + 300.
        tokio::time::advance(Duration::from_millis(299)).await;
        l.heard(2, Instant::now());
        assert!(
            l.suspects(Instant::now(), 1, &voters, true, &none, 10)
                .is_empty()
        );
        tokio::time::advance(Duration::from_millis(2)).await;
        l.heard(2, Instant::now());
        assert_eq!(
            l.suspects(Instant::now(), 1, &voters, true, &none, 10),
            BTreeSet::from([3])
        );
        // Not while the membership may be changing: then the term's start counts.
        assert!(
            l.suspects(Instant::now(), 1, &voters, false, &none, 10)
                .is_empty()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_silence_report_is_credited_as_is_and_a_missing_one_gives_no_credit() {
        let voters = BTreeSet::from([1, 2, 3, 4, 5]);
        let none = BTreeMap::new();
        let mut l = Lease::new(500, 1_200, 50);
        let start = Instant::now();
        l.leading(3);
        // The latest acknowledgement of the old term among the others was 150 ms before the
        // term began: 3 is declared failed 1050 ms into the term.
        l.reported(1, 3, 200, start);
        l.reported(2, 3, 150, start);
        l.reported(4, 3, 250, start);
        l.reported(5, 3, 400, start);
        for id in [2, 4, 5] {
            l.heard(id, start);
        }
        // The leader's first look for failed members (its first tick with quorum).
        assert!(l.suspects(start, 1, &voters, true, &none, 10).is_empty());
        tokio::time::advance(Duration::from_millis(1_049)).await;
        for id in [2, 4, 5] {
            l.heard(id, Instant::now());
        }
        assert!(
            l.suspects(Instant::now(), 1, &voters, true, &none, 10)
                .is_empty()
        );
        tokio::time::advance(Duration::from_millis(2)).await;
        for id in [2, 4, 5] {
            l.heard(id, Instant::now());
        }
        assert_eq!(
            l.suspects(Instant::now(), 1, &voters, true, &none, 10),
            BTreeSet::from([3])
        );
        // A member still handling an append of the old term reports 0: no credit at all. And
        // no credit beyond a failure timeout (a report of 5 s): declared at the term's start,
        // not before it.
        let mut l = Lease::new(500, 1_200, 50);
        let start = Instant::now();
        l.leading(5);
        for id in [1, 2, 4, 5] {
            l.reported(id, 5, if id == 4 { 0 } else { 1_000 }, start);
            l.heard(id, start);
        }
        assert!(l.suspects(start, 1, &voters, true, &none, 10).is_empty());
        tokio::time::advance(Duration::from_millis(1_199)).await;
        for id in [2, 4, 5] {
            l.heard(id, Instant::now());
        }
        assert!(
            l.suspects(Instant::now(), 1, &voters, true, &none, 10)
                .is_empty()
        );
        let mut l = Lease::new(500, 1_200, 50);
        let start = Instant::now();
        l.leading(9);
        for id in [1, 2, 4, 5] {
            l.reported(id, 9, 5_000, start);
            l.heard(id, start);
        }
        assert!(l.suspects(start, 1, &voters, true, &none, 10).is_empty());
        // Three heartbeats after the first look at the earliest: a live member would have
        // pinged by then.
        tokio::time::advance(Duration::from_millis(149)).await;
        for id in [2, 4, 5] {
            l.heard(id, Instant::now());
        }
        assert!(
            l.suspects(Instant::now(), 1, &voters, true, &none, 10)
                .is_empty()
        );
        tokio::time::advance(Duration::from_millis(2)).await;
        for id in [2, 4, 5] {
            l.heard(id, Instant::now());
        }
        // A voter added after the first look (6) gets no credit, having had no chance to
        // ping; and while it has not reported, nobody else gets any either.
        let grown = BTreeSet::from([1, 2, 3, 4, 5, 6]);
        assert!(
            l.suspects(Instant::now(), 1, &grown, true, &none, 10)
                .is_empty()
        );
        l.reported(6, 9, 5_000, Instant::now());
        assert!(
            l.suspects(Instant::now(), 1, &grown, true, &none, 10)
                .contains(&3)
        );
        assert!(
            !l.suspects(Instant::now(), 1, &grown, true, &none, 10)
                .contains(&6)
        );
        // Two silent members: neither has a report from every other voter, so each waits a
        // full failure timeout from the term's start.
        let mut l = Lease::new(500, 1_200, 50);
        let start = Instant::now();
        l.leading(6);
        for id in [1, 2, 5] {
            l.reported(id, 6, 1_000, start);
            l.heard(id, start);
        }
        assert!(l.suspects(start, 1, &voters, true, &none, 10).is_empty());
        tokio::time::advance(Duration::from_millis(1_199)).await;
        for id in [2, 5] {
            l.heard(id, Instant::now());
        }
        assert!(
            l.suspects(Instant::now(), 1, &voters, true, &none, 10)
                .is_empty()
        );
        tokio::time::advance(Duration::from_millis(2)).await;
        for id in [2, 5] {
            l.heard(id, Instant::now());
        }
        assert_eq!(
            l.suspects(Instant::now(), 1, &voters, true, &none, 10),
            BTreeSet::from([3, 4])
        );
    }

    #[tokio::test(start_paused = true)]
    async fn lagging_member_is_removed_only_after_lagging_for_the_failure_timeout() {
        let mut l = Lease::new(500, 1_200, 50);
        let voters = BTreeSet::from([1, 2]);
        l.leading(1);
        let lag = BTreeMap::from([(2, 100)]);
        for _ in 0..11 {
            l.heard(2, Instant::now());
            assert!(
                l.suspects(Instant::now(), 1, &voters, true, &lag, 10)
                    .is_empty()
            );
            tokio::time::advance(Duration::from_millis(100)).await;
        }
        l.heard(2, Instant::now());
        tokio::time::advance(Duration::from_millis(150)).await;
        l.heard(2, Instant::now());
        l.leader_confirmed(1, Instant::now(), 0);
        // Lagging for the failure timeout: no more lease, but it may still hold one.
        assert!(
            l.suspects(Instant::now(), 1, &voters, true, &lag, 10)
                .is_empty()
        );
        assert_eq!(l.grant_ms(2, Instant::now()), 0);
        // Declared failed a failure timeout after its grants stopped, not before.
        for _ in 0..12 {
            tokio::time::advance(Duration::from_millis(100)).await;
            l.heard(2, Instant::now());
            assert!(
                l.suspects(Instant::now(), 1, &voters, true, &lag, 10)
                    .is_empty()
            );
        }
        tokio::time::advance(Duration::from_millis(1)).await;
        l.heard(2, Instant::now());
        assert_eq!(
            l.suspects(Instant::now(), 1, &voters, true, &lag, 10),
            BTreeSet::from([2])
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_lease_is_checked_against_the_clock_and_ignores_old_terms() {
        let mut l = Lease::new(500, 1_200, 50);
        l.leading(4);
        let sent = Instant::now();
        l.leader_confirmed(3, sent, 0);
        assert_eq!(l.deadline_at(0), None);
        l.leader_confirmed(4, sent, 7);
        assert_eq!(l.deadline_at(6), None);
        assert_eq!(l.deadline_at(7), Some(sent + Duration::from_millis(500)));
        // A pause: nothing ran, but the deadline is in the past when the clock is read.
        tokio::time::advance(Duration::from_millis(3_600)).await;
        assert!(l.deadline_at(7).is_some_and(|d| d <= Instant::now()));
        // A new term starts with no lease at all.
        l.leading(5);
        assert_eq!(l.deadline_at(0), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_counts_only_once_the_follower_applied_what_the_leader_had() {
        let mut l = Lease::new(500, 1_200, 50);
        let first = Instant::now();
        l.granted(first, 400, 90);
        assert_eq!(l.deadline_at(89), None);
        assert!(l.deadline_at(90).is_some_and(|d| Instant::now() < d));
        // Under steady traffic the newest grant is a little ahead of what the follower applied;
        // the older grant it has caught up with keeps the lease running.
        tokio::time::advance(Duration::from_millis(50)).await;
        l.granted(Instant::now(), 450, 95);
        assert_eq!(l.deadline_at(92), Some(first + Duration::from_millis(400)));
        assert_eq!(l.deadline_at(95), Some(first + Duration::from_millis(500)));
    }
}
