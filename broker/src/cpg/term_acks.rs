//! When this member last acknowledged a leader of an earlier term: what a newly elected leader
//! needs to know that every lease of the earlier terms has run out, so that it may declare a
//! silent member failed without first waiting a whole failure timeout of its own term.
//!
//! The argument (docs/cpg.md, *A new leader's failure clock*): a lease of term `t` counts from
//! the send time of a heartbeat round of `t`'s leader that a majority acknowledged, and a
//! follower's lease never outlives that leader's. A member that voted for (or follows) a later
//! term `T` never acknowledges `t` again. So if every member of a majority of `T`'s voters says
//! "I last acknowledged a term below `T` at `a`", every round of every earlier term that a
//! majority acknowledged was acknowledged by one of them — it was sent before the latest such
//! `a`, and every lease of the earlier terms ends within a lease of it.

use std::collections::BTreeMap;

use tokio::time::Instant;

/// Terms remembered one by one; older ones are folded into [`TermAcks::floor`].
const REMEMBERED_TERMS: usize = 8;

/// One member's record of the terms it acknowledged, and when it last did for each.
#[derive(Debug)]
pub(crate) struct TermAcks {
    /// Anything not recorded happened before this: the process start (a previous process of
    /// the member acknowledged nothing after it died), or the latest forgotten term's
    /// acknowledgement.
    floor: Instant,
    /// term → the latest moment this member may have acknowledged that term's leader.
    last: BTreeMap<u64, Instant>,
    /// term → appends of that term being handled now (not acknowledged yet, but they may be).
    in_flight: BTreeMap<u64, usize>,
}

impl TermAcks {
    /// A process that started at `started` and has acknowledged nothing yet.
    pub fn new(started: Instant) -> Self {
        Self {
            floor: started,
            last: BTreeMap::new(),
            in_flight: BTreeMap::new(),
        }
    }

    /// An append from the leader of `term` arrived and is being handled.
    pub fn appending(&mut self, term: u64) {
        *self.in_flight.entry(term).or_insert(0) += 1;
    }

    /// The append of `term` announced by [`TermAcks::appending`] was answered (or abandoned)
    /// at `now`: counted as acknowledged then, whatever the answer, which only makes the
    /// record later than the truth.
    pub fn appended(&mut self, term: u64, now: Instant) {
        if let Some(n) = self.in_flight.get_mut(&term) {
            *n -= 1;
            if *n == 0 {
                self.in_flight.remove(&term);
            }
        }
        self.acked(term, now);
    }

    /// This member acknowledged `term` at `at` (as a follower, or as its leader: a leader's
    /// round counts as its own acknowledgement from its send time).
    pub fn acked(&mut self, term: u64, at: Instant) {
        let e = self.last.entry(term).or_insert(at);
        if *e < at {
            *e = at;
        }
        while self.last.len() > REMEMBERED_TERMS {
            if let Some((_, oldest)) = self.last.pop_first() {
                self.floor = self.floor.max(oldest);
            }
        }
    }

    /// The latest moment this member may have acknowledged a leader of a term below `term`,
    /// as of `now` (`now` itself while such an append is still being handled). Once this
    /// member's vote is `term` or later it acknowledges no earlier term again, so the answer
    /// does not move any more.
    pub fn last_below(&self, term: u64, now: Instant) -> Instant {
        if self.in_flight.range(..term).next().is_some() {
            return now;
        }
        self.last
            .range(..term)
            .map(|(_, at)| *at)
            .fold(self.floor, Instant::max)
            .min(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn the_latest_acknowledgement_of_an_earlier_term_counts_and_later_terms_do_not() {
        let start = Instant::now();
        let mut a = TermAcks::new(start);
        // Nothing acknowledged in this process: anything was before it started.
        assert_eq!(a.last_below(3, Instant::now()), start);
        tokio::time::advance(Duration::from_millis(100)).await;
        a.appending(2);
        a.appended(2, Instant::now());
        let acked_2 = Instant::now();
        tokio::time::advance(Duration::from_millis(100)).await;
        a.acked(3, Instant::now());
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(a.last_below(3, Instant::now()), acked_2);
        assert_eq!(
            a.last_below(4, Instant::now()),
            acked_2 + Duration::from_millis(100)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_append_of_an_earlier_term_still_being_handled_counts_as_now() {
        let mut a = TermAcks::new(Instant::now());
        tokio::time::advance(Duration::from_millis(100)).await;
        a.appending(2);
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(a.last_below(3, Instant::now()), Instant::now());
        // An append of the new term in flight says nothing about the earlier ones.
        a.appending(3);
        a.appended(2, Instant::now());
        let done = Instant::now();
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(a.last_below(3, Instant::now()), done);
    }

    #[tokio::test(start_paused = true)]
    async fn forgotten_terms_move_the_floor_up_never_down() {
        let mut a = TermAcks::new(Instant::now());
        let mut at = Vec::new();
        for term in 1..=(REMEMBERED_TERMS as u64 + 2) {
            tokio::time::advance(Duration::from_millis(10)).await;
            a.acked(term, Instant::now());
            at.push(Instant::now());
        }
        // Terms 1 and 2 were folded into the floor: below term 2 is answered with term 2's
        // acknowledgement (later than the truth is safe, earlier would not be).
        assert_eq!(a.last_below(2, Instant::now()), at[1]);
        assert_eq!(a.last_below(5, Instant::now()), at[3]);
    }
}
