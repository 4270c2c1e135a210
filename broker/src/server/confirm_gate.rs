//! The confirm gate: output a connection has written but may not send yet.
//!
//! **The rule.** A publisher confirm (`basic.ack`/`basic.nack` for a published message), a
//! `tx.commit-ok`, and the reply to a durable wiring change leave the broker only when every
//! guarantee they promise holds. Today that is one condition: the journal's fsynced prefix
//! covers the batch that produced them (a persistent message on a durable queue, a durable
//! exchange, queue or binding); every in-sync backup acknowledged the batch's queue ops
//! (replication); every primary the batch forwarded to confirmed (proxies). Each is a field
//! of [`Conditions`] and of [`Progress`].
//!
//! **Why a prefix of the byte stream.** Replies on a connection are ordered, and a confirm
//! must not overtake what the client was told before it; so the gate holds everything written
//! up to the end of a batch whose conditions are unmet, and what was written before goes out
//! at once. A batch is many frames (a read buffer's worth), so the gate costs one entry per
//! batch, not per message, and a window of confirms goes out in one write once the journal's
//! group commit covers it.

use std::collections::VecDeque;

/// What a held stretch of output waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conditions {
    /// The journal sequence number that must be durable (fsynced).
    pub journal_seq: u64,
    /// The connection's forwards (numbered 1, 2, … in its
    /// [`crate::proxy::forward::ForwardTracker`]) that must be confirmed by their primaries.
    pub forwards: u64,
    /// The replication stamp every in-sync backup must have acknowledged
    /// ([`crate::replication::ledger`]).
    pub replicated: u64,
    /// The member must hold the majority's lease when the output leaves (a cluster member).
    pub lease: bool,
}

/// How far the guarantees have come, as the connection last heard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// The journal is durable up to this sequence number.
    pub journal_synced: u64,
    /// Every forward of the connection up to this number is confirmed.
    pub forwards_confirmed: u64,
    /// Every replicated batch up to this stamp is acknowledged by its in-sync backups.
    pub replicas_acked: u64,
    /// The member holds the majority's lease now (asked only while output waits for it:
    /// see [`ConfirmGate::waits_for_lease`]).
    pub lease_held: bool,
}

impl Conditions {
    /// Whether everything the held output promises is true at `progress`.
    pub fn hold_at(&self, progress: Progress) -> bool {
        progress.journal_synced >= self.journal_seq
            && progress.forwards_confirmed >= self.forwards
            && progress.replicas_acked >= self.replicated
            && (progress.lease_held || !self.lease)
    }
}

/// Held output of one connection: (end offset in the write buffer, conditions) per batch
/// whose conditions did not hold when last asked, in buffer order. Bounded: a stretch leaves
/// as soon as its conditions hold, whether or not the connection has anything to write.
#[derive(Debug, Default)]
pub struct ConfirmGate {
    held: VecDeque<(usize, Conditions)>,
    /// What [`ConfirmGate::release`] last allowed: [`ConfirmGate::written`] checks against it.
    releasable: usize,
}

impl ConfirmGate {
    /// Holds the first `end` bytes of the write buffer until `conditions` hold (nothing to
    /// hold when a batch promised nothing durable).
    pub fn hold(&mut self, end: usize, conditions: Option<Conditions>) {
        let Some(conditions) = conditions else {
            return;
        };
        if let Some(&(last_end, _)) = self.held.back() {
            assert!(end >= last_end, "held stretches go in buffer order");
        }
        self.held.push_back((end, conditions));
    }

    /// How many of the `buffered` bytes may be written at `progress`: all of them when no
    /// held stretch waits, else those up to the end of the last stretch (from the front)
    /// whose conditions hold. Forgets the stretches whose conditions hold.
    pub fn release(&mut self, buffered: usize, progress: Progress) -> usize {
        let mut released = 0;
        self.releasable = loop {
            match self.held.front() {
                None => break buffered,
                Some(&(_, conditions)) if !conditions.hold_at(progress) => break released,
                Some(&(end, _)) => {
                    released = end;
                    self.held.pop_front();
                }
            }
        };
        self.releasable
    }

    /// The conditions of the last held stretch: what everything held waits for (conditions
    /// only grow along a connection's output). What a session remembers when its connection
    /// goes with output still held.
    pub fn last_held(&self) -> Option<Conditions> {
        self.held.back().map(|&(_, c)| c)
    }

    /// Whether some held output needs the lease: only then is it worth asking for.
    pub fn waits_for_lease(&self) -> bool {
        self.held.iter().any(|(_, c)| c.lease)
    }

    /// Forward `failed` of the connection failed: the held stretches that wait for it (or a
    /// later one) are dropped, with everything written after the first of them — returns
    /// how many bytes of the buffer stay (`None`: none waits for it, all stay). The
    /// stretches before it stay held for their own conditions: a confirm that waits for its
    /// fsync, its backups or the lease still waits (see `Connection::abandon_unconfirmed`).
    pub fn abandon_from(&mut self, failed: u64) -> Option<usize> {
        let first = self.held.iter().position(|(_, c)| c.forwards >= failed)?;
        let keep = first.checked_sub(1).map_or(0, |i| self.held[i].0);
        self.held.truncate(first);
        self.releasable = self.releasable.min(keep);
        Some(keep)
    }

    /// `written` bytes from the front of the buffer went out: shifts the held stretches.
    /// Asserts the invariant the gate exists for: nothing went out that the last
    /// [`ConfirmGate::release`] did not allow, so nothing before its conditions held.
    pub fn written(&mut self, written: usize) {
        assert!(
            written <= self.releasable,
            "output released before its conditions hold: a confirm would precede its fsync"
        );
        self.releasable -= written;
        for (end, _) in self.held.iter_mut() {
            *end -= written;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(journal_synced: u64) -> Progress {
        Progress {
            journal_synced,
            forwards_confirmed: 0,
            replicas_acked: 0,
            lease_held: true,
        }
    }

    fn seq(journal_seq: u64) -> Option<Conditions> {
        Some(Conditions {
            journal_seq,
            forwards: 0,
            replicated: 0,
            lease: false,
        })
    }

    #[test]
    fn a_failed_forward_drops_what_waits_for_it_and_keeps_the_rest_held() {
        let mut gate = ConfirmGate::default();
        let cond = |journal_seq, forwards| {
            Some(Conditions {
                journal_seq,
                forwards,
                replicated: 0,
                lease: false,
            })
        };
        gate.hold(10, cond(5, 1));
        gate.hold(20, cond(5, 2));
        gate.hold(30, cond(6, 3));
        assert_eq!(gate.abandon_from(2), Some(10), "from the second stretch on");
        let progress = |journal_synced| Progress {
            journal_synced,
            forwards_confirmed: 1,
            replicas_acked: 0,
            lease_held: true,
        };
        assert_eq!(
            gate.release(10, progress(4)),
            0,
            "the first still waits for its fsync"
        );
        assert_eq!(gate.release(10, progress(5)), 10);
        assert_eq!(gate.abandon_from(9), None, "nothing waits for it");
    }

    #[test]
    fn a_batch_that_forwarded_waits_for_its_primaries_as_well() {
        let mut gate = ConfirmGate::default();
        gate.hold(
            10,
            Some(Conditions {
                journal_seq: 1,
                forwards: 3,
                replicated: 0,
                lease: false,
            }),
        );
        let progress = |forwards_confirmed| Progress {
            journal_synced: 1,
            forwards_confirmed,
            replicas_acked: 0,
            lease_held: true,
        };
        assert_eq!(gate.release(10, progress(2)), 0);
        assert_eq!(gate.release(10, progress(3)), 10);
    }

    #[test]
    fn a_replicated_batch_waits_for_its_backups_after_its_fsync() {
        let mut gate = ConfirmGate::default();
        gate.hold(
            10,
            Some(Conditions {
                journal_seq: 4,
                forwards: 0,
                replicated: 7,
                lease: true,
            }),
        );
        let progress = |journal_synced, replicas_acked| Progress {
            journal_synced,
            forwards_confirmed: 0,
            replicas_acked,
            lease_held: true,
        };
        assert_eq!(
            gate.release(10, progress(4, 6)),
            0,
            "a backup still owes it"
        );
        assert_eq!(gate.release(10, progress(3, 7)), 0, "not yet on this disk");
        assert_eq!(gate.release(10, progress(4, 7)), 10);
    }

    #[test]
    fn a_cluster_member_confirms_only_while_it_holds_the_lease() {
        let mut gate = ConfirmGate::default();
        let conditions = Conditions {
            journal_seq: 4,
            forwards: 0,
            replicated: 7,
            lease: true,
        };
        gate.hold(10, Some(conditions));
        assert!(gate.waits_for_lease());
        let lapsed = Progress {
            journal_synced: 4,
            forwards_confirmed: 0,
            replicas_acked: 7,
            lease_held: false,
        };
        assert_eq!(gate.release(10, lapsed), 0, "everything durable, no lease");
        let renewed = Progress {
            lease_held: true,
            ..lapsed
        };
        assert_eq!(gate.release(10, renewed), 10);
        assert!(!gate.waits_for_lease());
    }

    #[test]
    fn output_before_a_held_batch_goes_and_the_batch_waits_for_its_fsync() {
        let mut gate = ConfirmGate::default();
        gate.hold(10, seq(5));
        assert_eq!(gate.release(25, at(4)), 0);
        assert_eq!(gate.release(25, at(5)), 25);
        gate.written(25);
        assert_eq!(gate.release(0, at(5)), 0);
    }

    #[test]
    fn a_later_batch_waits_while_an_earlier_one_is_released() {
        let mut gate = ConfirmGate::default();
        gate.hold(10, seq(5));
        gate.hold(20, seq(9));
        assert_eq!(gate.release(30, at(6)), 10);
        gate.written(10);
        assert_eq!(gate.release(20, at(6)), 0);
        assert_eq!(gate.release(20, at(9)), 20);
    }

    #[test]
    fn batches_that_promise_nothing_durable_are_not_held() {
        let mut gate = ConfirmGate::default();
        gate.hold(10, None);
        assert_eq!(gate.release(10, at(0)), 10);
    }

    #[test]
    fn satisfied_stretches_are_forgotten_even_when_nothing_is_written() {
        let mut gate = ConfirmGate::default();
        for n in 1..=10_000u64 {
            gate.hold(0, seq(n));
            assert_eq!(gate.release(0, at(n)), 0);
        }
        assert!(
            gate.held.is_empty(),
            "a publisher with no output holds nothing"
        );
    }

    #[test]
    #[should_panic(expected = "before its conditions hold")]
    fn writing_past_an_unmet_batch_stops_loudly() {
        let mut gate = ConfirmGate::default();
        gate.hold(10, seq(5));
        gate.release(10, at(4));
        gate.written(10);
    }
}
