//! The nemeses: what each schedule does to the cluster while the clients run, each bounded
//! in time and count, and how it puts the cluster back (heal, resume, let the supervisor
//! restart) before the checkers count.

use crate::cluster::{Cluster, Member};
use crate::workload::Rng;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One schedule: a name (the table's row), the nemesis, and the queue's backups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nemesis {
    /// kill -9 of a random member, again and again; the supervisor restarts it.
    KillOne,
    /// kill -9 of the queue's primary, again and again.
    KillPrimary,
    /// kill -9 of a minority (1 of 3, 2 of 5) at once.
    KillMinority,
    /// SIGSTOP of the queue's primary for longer than the lease, then SIGCONT.
    PausePrimary,
    /// One member cut off from the others (a minority), then healed.
    IsolateOne,
    /// The queue's primary cut off from the others, then healed.
    IsolatePrimary,
    /// Two members cannot reach each other; a third reaches both.
    Bridge,
    /// kill -9 of every member, then all started again (a whole-cluster restart).
    KillAll,
}

impl Nemesis {
    /// Every schedule, in the order the suite runs them.
    pub const ALL: [Nemesis; 8] = [
        Nemesis::KillOne,
        Nemesis::KillPrimary,
        Nemesis::KillMinority,
        Nemesis::PausePrimary,
        Nemesis::IsolateOne,
        Nemesis::IsolatePrimary,
        Nemesis::Bridge,
        Nemesis::KillAll,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Nemesis::KillOne => "kill-one",
            Nemesis::KillPrimary => "kill-primary",
            Nemesis::KillMinority => "kill-minority",
            Nemesis::PausePrimary => "pause-primary",
            Nemesis::IsolateOne => "isolate-one",
            Nemesis::IsolatePrimary => "isolate-primary",
            Nemesis::Bridge => "bridge",
            Nemesis::KillAll => "kill-all",
        }
    }

    /// Runs the nemesis for `length`: fault after fault (a pause or a partition lasting 2 to
    /// 4 s), each followed by the cluster's recovery — every member serving again — and a
    /// quiet 1 to 2 s, so the cluster is whole at the end.
    pub fn run(self, cluster: &Arc<Cluster>, queue: &str, length: Duration, rng: &mut Rng) -> u32 {
        let deadline = Instant::now() + length;
        let mut faults = 0;
        while Instant::now() + Duration::from_secs(4) < deadline {
            faults += 1;
            let fault_for = Duration::from_millis(2_000 + rng.next() % 2_000);
            self.once(cluster, queue, fault_for, rng);
            // A killed member still answers for a moment; a restarted one needs a moment.
            std::thread::sleep(Duration::from_secs(1));
            // Back to whole before the next fault: every member serving again.
            if !cluster.all_ready(Duration::from_secs(45)) {
                eprintln!(
                    "faults: {}: the cluster did not recover within 45 s",
                    self.name()
                );
            }
            std::thread::sleep(Duration::from_millis(1_000 + rng.next() % 1_000));
        }
        faults
    }

    fn once(self, cluster: &Arc<Cluster>, queue: &str, fault_for: Duration, rng: &mut Rng) {
        let members = &cluster.members;
        let n = members.len();
        let random = |rng: &mut Rng| Arc::clone(&members[rng.below(n)]);
        let primary = |rng: &mut Rng| primary_of(cluster, queue).unwrap_or_else(|| random(rng));
        match self {
            Nemesis::KillOne => random(rng).kill(),
            Nemesis::KillPrimary => primary(rng).kill(),
            Nemesis::KillMinority => {
                let first = rng.below(n);
                for i in 0..(n - 1) / 2 {
                    members[(first + i) % n].kill();
                }
            }
            Nemesis::PausePrimary => {
                let p = primary(rng);
                p.pause();
                std::thread::sleep(fault_for);
                p.resume();
            }
            Nemesis::IsolateOne | Nemesis::IsolatePrimary => {
                let m = if self == Nemesis::IsolateOne {
                    random(rng)
                } else {
                    primary(rng)
                };
                cluster.net.isolate(m.index);
                std::thread::sleep(fault_for);
                cluster.net.heal();
            }
            Nemesis::Bridge => {
                let a = rng.below(n);
                let b = (a + 1 + rng.below(n - 1)) % n;
                cluster.net.cut(a, b);
                std::thread::sleep(fault_for);
                cluster.net.heal();
            }
            Nemesis::KillAll => {
                for m in members {
                    cluster.hold_down(m, true);
                    m.kill();
                }
                std::thread::sleep(fault_for);
                for m in members {
                    cluster.hold_down(m, false);
                }
            }
        }
    }
}

/// The member the serving members name as `queue`'s primary (the first answer).
pub fn primary_of(cluster: &Cluster, queue: &str) -> Option<Arc<Member>> {
    let node = cluster
        .primaries(queue)
        .into_iter()
        .find_map(|(_, primary, serving)| primary.filter(|_| serving))?;
    cluster.members.iter().find(|m| m.node_id == node).cloned()
}
