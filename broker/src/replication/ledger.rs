//! Which replicated batches every in-sync backup has acknowledged: the second condition of
//! the confirm gate, as one number.
//!
//! Every batch of commands that changed a replicated queue gets a **stamp** (1, 2, … per
//! broker, in the order batches hand their ops over). Its frames go to each of the queues'
//! backups over that backup's link, in stamp order; the backup acknowledges them in the same
//! order. A batch's confirms may go out once every backup that was **in sync** for one of its
//! queues acknowledged it — so the gate waits for [`Ledger::acked_through`], the highest stamp
//! below the oldest stamp some in-sync backup still owes. A backup that is catching up gets
//! the same frames but owes nothing: it cannot hold confirms back, and is not yet counted on
//! to have them.
//!
//! Pure bookkeeping, no I/O: the links report what they sent and what came back.

use std::collections::{BTreeMap, VecDeque};

/// Acknowledgements owed by the backups, by backup node id.
#[derive(Debug, Default)]
pub struct Ledger {
    /// The newest stamp issued.
    stamp: u64,
    /// Per backup: the stamps it must acknowledge for the gate, oldest first.
    owed: BTreeMap<String, VecDeque<u64>>,
}

impl Ledger {
    /// Issues the stamp of a new batch whose frames go out now; `gating` are the backups
    /// that are in sync for one of its queues (they owe an acknowledgement).
    pub fn issue<'b>(&mut self, gating: impl IntoIterator<Item = &'b str>) -> u64 {
        self.stamp += 1;
        for backup in gating {
            let owed = self.owed.entry(backup.to_owned()).or_default();
            if owed.back() != Some(&self.stamp) {
                owed.push_back(self.stamp);
            }
        }
        self.stamp
    }

    /// `backup` acknowledged every frame up to the batch `stamp`.
    pub fn acked(&mut self, backup: &str, stamp: u64) {
        if let Some(owed) = self.owed.get_mut(backup) {
            while owed.front().is_some_and(|&s| s <= stamp) {
                owed.pop_front();
            }
            if owed.is_empty() {
                self.owed.remove(backup);
            }
        }
    }

    /// `backup` no longer counts (the cluster map committed it out of sync everywhere it
    /// was, or it left): what it owed is forgiven.
    pub fn forgive(&mut self, backup: &str) {
        self.owed.remove(backup);
    }

    /// Every batch up to this stamp is acknowledged by every backup that owed it.
    pub fn acked_through(&self) -> u64 {
        self.owed
            .values()
            .filter_map(|o| o.front())
            .min()
            .map_or(self.stamp, |&oldest| oldest - 1)
    }

    /// The newest stamp issued: every batch handed over so far is at or below it.
    pub fn issued(&self) -> u64 {
        self.stamp
    }

    /// How many batches still wait for an acknowledgement.
    pub fn waiting(&self) -> u64 {
        self.stamp - self.acked_through()
    }

    /// Whether `backup` owes anything.
    pub fn owes(&self, backup: &str) -> bool {
        self.owed.contains_key(backup)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_waits_for_the_slowest_in_sync_backup_only() {
        let mut l = Ledger::default();
        assert_eq!(l.acked_through(), 0);
        let s1 = l.issue(["b", "c"]);
        let s2 = l.issue(["b"]);
        let s3 = l.issue([]);
        assert_eq!((s1, s2, s3), (1, 2, 3));
        assert_eq!(l.acked_through(), 0);
        l.acked("b", 2);
        assert_eq!(l.acked_through(), 0, "c still owes batch 1");
        l.acked("c", 1);
        assert_eq!(l.acked_through(), 3, "batch 3 owed nothing");
        assert!(!l.owes("b") && !l.owes("c"));
    }

    #[test]
    fn a_backup_committed_out_of_sync_no_longer_holds_the_gate() {
        let mut l = Ledger::default();
        l.issue(["b", "c"]);
        l.issue(["b", "c"]);
        l.acked("b", 2);
        assert_eq!(l.acked_through(), 0);
        l.forgive("c");
        assert_eq!(l.acked_through(), 2);
        l.issue(["b"]);
        assert_eq!(l.acked_through(), 2);
    }

    #[test]
    fn acknowledgements_of_unknown_backups_or_old_stamps_change_nothing() {
        let mut l = Ledger::default();
        l.issue(["b"]);
        l.acked("x", 9);
        l.acked("b", 0);
        assert_eq!(l.acked_through(), 0);
        assert!(l.owes("b"));
    }
}
