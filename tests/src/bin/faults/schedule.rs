//! The nemeses: what each schedule does to the cluster while the clients run, each bounded
//! in time and count, and how it puts the cluster back (heal, resume, let the supervisor
//! restart) before the checkers count.

use crate::cluster::{Cluster, Member};
use crate::workload::Rng;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How far into a cut the member in the minority is probed: past its lease (300 ms) with
/// room for a loaded machine.
const PROBE_AFTER: Duration = Duration::from_secs(1);

/// What one schedule's faults came to.
#[derive(Debug, Default, Clone, Copy)]
pub struct Outcome {
    /// Faults injected.
    pub faults: u32,
    /// Probes a member cut off from the majority served (confirmed or delivered).
    pub minority_served: u64,
    /// The probe never saw a healthy member serve it: it could not have seen a cut-off one
    /// serve either, so the schedule fails rather than pass on a blind checker.
    pub probe_blind: bool,
}

/// Whether the probe, aimed at a member of the whole cluster before any fault, sees it
/// serve (a confirmed publish): the check that it can tell serving from refusing. Tried
/// for up to 10 s, in case that member is not ready yet.
fn probe_sees_serving(
    cluster: &Cluster,
    probe: &mut dyn FnMut(&Member) -> Result<String, String>,
) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        match probe(&cluster.members[0]) {
            Err(served) => {
                crate::workload::debug(&format!("the probe sees a healthy member serve: {served}"));
                return true;
            }
            Ok(refused) => {
                eprintln!("faults: a healthy member refused the probe ({refused}); again");
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    }
    false
}

/// One schedule: a name (the table's row), the nemesis, and the queue's backups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nemesis {
    /// kill -9 of a random member, again and again; the supervisor restarts it.
    KillOne,
    /// kill -9 of the queue's primary, again and again.
    KillPrimary,
    /// kill -9 of a minority (1 of 3, 2 of 5) at once.
    KillMinority,
    /// SIGSTOP of a random member for longer than the lease, then SIGCONT.
    PauseOne,
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
    /// The cluster split in two: a minority (1 of 3, 2 of 5) holding the queue's primary,
    /// and the majority, then healed.
    Split,
    /// The queue's primary moved to another member on request (`POST …/move`: catch-up,
    /// seal, switch) — a planned change, not a failure.
    MovePrimary,
    /// A member drained (`POST /api/members/{id}/drain`: its primaries and backups move
    /// off, its clients are closed and sent elsewhere), held drained, then undrained. In
    /// one run of two, while drained, it is stopped (SIGTERM: it leaves the voters, as a
    /// scale-down's pod does) and started again on its data (admitted again, as a scale-up
    /// brings the pod back).
    Drain,
    /// Every queue's primary gathered on one member (planned moves), then a rebalance
    /// (`POST /api/cluster/rebalance`, one move at a time) and, a moment into it, a random
    /// member killed with -9 — the one that asked, one giving or one receiving: the others
    /// carry the cluster map's plan on, a move to the lost member fails, nothing confirmed
    /// is lost.
    Rebalance,
}

impl Nemesis {
    /// Every schedule, in the order the suite runs them.
    pub const ALL: [Nemesis; 13] = [
        Nemesis::KillOne,
        Nemesis::KillPrimary,
        Nemesis::KillMinority,
        Nemesis::PausePrimary,
        Nemesis::IsolateOne,
        Nemesis::IsolatePrimary,
        Nemesis::Bridge,
        Nemesis::KillAll,
        // Last, so that the seeds recorded for the others rerun the same choices.
        Nemesis::PauseOne,
        Nemesis::Split,
        Nemesis::MovePrimary,
        Nemesis::Drain,
        Nemesis::Rebalance,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Nemesis::KillOne => "kill-one",
            Nemesis::KillPrimary => "kill-primary",
            Nemesis::KillMinority => "kill-minority",
            Nemesis::PauseOne => "pause-one",
            Nemesis::PausePrimary => "pause-primary",
            Nemesis::IsolateOne => "isolate-one",
            Nemesis::IsolatePrimary => "isolate-primary",
            Nemesis::Bridge => "bridge",
            Nemesis::KillAll => "kill-all",
            Nemesis::Split => "split",
            Nemesis::MovePrimary => "move-primary",
            Nemesis::Drain => "drain",
            Nemesis::Rebalance => "rebalance",
        }
    }

    /// Runs the nemesis for `length`: fault after fault (a pause or a partition lasting 2 to
    /// 4 s), each followed by the cluster's recovery — every member serving again — and a
    /// quiet 1 to 2 s, so the cluster is whole at the end. A member cut off from the
    /// majority is probed (`probe`: `Ok` it refused, `Err` what it served) a second into
    /// the cut, once its lease has run out. The nemeses aimed at a primary aim at the first
    /// of `queues`'s; a move moves every one of them.
    pub fn run(
        self,
        cluster: &Arc<Cluster>,
        queues: &[String],
        length: Duration,
        rng: &mut Rng,
        probe: &mut dyn FnMut(&Member) -> Result<String, String>,
    ) -> Outcome {
        let deadline = Instant::now() + length;
        let mut outcome = Outcome::default();
        if matches!(
            self,
            Nemesis::IsolateOne | Nemesis::IsolatePrimary | Nemesis::Split
        ) {
            outcome.probe_blind = !probe_sees_serving(cluster, probe);
        }
        while Instant::now() + Duration::from_secs(4) < deadline {
            outcome.faults += 1;
            let fault_for = Duration::from_millis(2_000 + rng.next() % 2_000);
            if let Some(m) = self.once(cluster, queues, fault_for, rng) {
                match probe(&m) {
                    Ok(how) => crate::workload::debug(&format!(
                        "cut-off {} served nobody: {how}",
                        m.node_id
                    )),
                    Err(what) => {
                        eprintln!("faults: cut-off {} served a client: {what}", m.node_id);
                        outcome.minority_served += 1;
                    }
                }
                std::thread::sleep(fault_for.saturating_sub(PROBE_AFTER));
                cluster.net.heal();
            }
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
        outcome
    }

    /// One fault. A partition that leaves one member in a minority returns that member
    /// with the cut still in place, [`PROBE_AFTER`] into it: the caller probes it, waits
    /// out the rest and heals.
    fn once(
        self,
        cluster: &Arc<Cluster>,
        queues: &[String],
        fault_for: Duration,
        rng: &mut Rng,
    ) -> Option<Arc<Member>> {
        let queue = &queues[0];
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
            Nemesis::PauseOne | Nemesis::PausePrimary => {
                let p = if self == Nemesis::PauseOne {
                    random(rng)
                } else {
                    primary(rng)
                };
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
                std::thread::sleep(PROBE_AFTER);
                return Some(m);
            }
            Nemesis::Split => {
                // The primary and the members after it in index order, up to a minority.
                let p = primary(rng).index;
                let side: Vec<usize> = (0..(n - 1) / 2).map(|i| (p + i) % n).collect();
                cluster.net.split(&side);
                std::thread::sleep(PROBE_AFTER);
                return Some(Arc::clone(&members[p]));
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
            Nemesis::MovePrimary => {
                // Every queue at once, each to another member than its primary.
                let mut asked = Vec::new();
                for queue in queues {
                    let from = primary_of(cluster, queue).unwrap_or_else(|| random(rng));
                    let others: Vec<&Arc<Member>> = members
                        .iter()
                        .filter(|m| m.node_id != from.node_id)
                        .collect();
                    let to = others[rng.below(others.len())].node_id.clone();
                    let path = format!("/api/queues/%2f/{queue}/move");
                    match random(rng)
                        .admin()
                        .call("POST", &path, Some(&json!({"to": to})))
                    {
                        Ok(a) if a.status == 202 => asked.push((queue, to)),
                        Ok(a) => eprintln!(
                            "faults: move-primary of {queue} to {to} refused: {} {}",
                            a.status, a.body
                        ),
                        Err(e) => eprintln!("faults: move-primary: {e}"),
                    }
                }
                for (queue, to) in asked {
                    let moved = wait_for(OPERATION_LIMIT, || {
                        primary_of(cluster, queue).is_some_and(|p| p.node_id == to)
                    });
                    if !moved {
                        eprintln!(
                            "faults: move-primary: {queue} not on {to} after {OPERATION_LIMIT:?}"
                        );
                    }
                }
            }
            Nemesis::Drain => {
                let m = random(rng);
                let path = format!("/api/members/{}", m.node_id);
                let asked = random(rng);
                match asked.admin().call("POST", &format!("{path}/drain"), None) {
                    Ok(a) if a.status == 202 => {
                        let drained = wait_for(OPERATION_LIMIT, || {
                            asked
                                .admin()
                                .get(&path)
                                .is_ok_and(|a| a.body["primaries"] == 0 && a.body["backups"] == 0)
                        });
                        if !drained {
                            eprintln!(
                                "faults: drain: {} still holds queues after {OPERATION_LIMIT:?}",
                                m.node_id
                            );
                        }
                        // Drawn whether or not the drain finished, so that a seed's
                        // later choices do not depend on its timing.
                        let stop = rng.below(2) == 0;
                        if drained && stop {
                            stop_drained_and_start_again(cluster, &m, fault_for);
                        } else {
                            std::thread::sleep(fault_for);
                        }
                    }
                    Ok(a) => eprintln!(
                        "faults: drain of {} refused: {} {}",
                        m.node_id, a.status, a.body
                    ),
                    Err(e) => eprintln!("faults: drain: {e}"),
                }
                // Undrained through whichever member answers, until one does.
                let undrained = wait_for(OPERATION_LIMIT, || {
                    random(rng)
                        .admin()
                        .call("POST", &format!("{path}/undrain"), None)
                        .is_ok_and(|a| a.status == 202)
                });
                if !undrained {
                    eprintln!("faults: undrain of {} not accepted", m.node_id);
                }
            }
            Nemesis::Rebalance => {
                let gather = random(rng);
                for queue in queues {
                    if primary_of(cluster, queue).is_some_and(|p| p.node_id == gather.node_id) {
                        continue;
                    }
                    let path = format!("/api/queues/%2f/{queue}/move");
                    let body = json!({"to": gather.node_id});
                    match random(rng).admin().call("POST", &path, Some(&body)) {
                        Ok(a) if a.status == 202 => {}
                        Ok(a) => eprintln!(
                            "faults: rebalance: gathering {queue} on {} refused: {} {}",
                            gather.node_id, a.status, a.body
                        ),
                        Err(e) => eprintln!("faults: rebalance: gathering {queue}: {e}"),
                    }
                }
                let gathered = wait_for(OPERATION_LIMIT, || {
                    (queues.iter()).all(|q| {
                        primary_of(cluster, q).is_some_and(|p| p.node_id == gather.node_id)
                    })
                });
                if !gathered {
                    eprintln!(
                        "faults: rebalance: the queues not all on {} after {OPERATION_LIMIT:?}",
                        gather.node_id
                    );
                }
                let body = json!({"concurrency": 1});
                match (random(rng).admin()).call("POST", "/api/cluster/rebalance", Some(&body)) {
                    Ok(a) if a.status == 202 => {
                        std::thread::sleep(Duration::from_millis(rng.next() % 300));
                        random(rng).kill();
                        let ended = wait_for(OPERATION_LIMIT, || {
                            random(rng)
                                .admin()
                                .get("/api/cluster/rebalance")
                                .is_ok_and(|a| {
                                    a.body["current"]["status"]
                                        .as_str()
                                        .is_some_and(|s| s != "running")
                                })
                        });
                        if !ended {
                            eprintln!("faults: rebalance still running after {OPERATION_LIMIT:?}");
                        }
                    }
                    Ok(a) => eprintln!("faults: rebalance refused: {} {}", a.status, a.body),
                    Err(e) => eprintln!("faults: rebalance: {e}"),
                }
            }
        }
        None
    }
}

/// Longest wait for a planned operation (a move, a drain) to finish.
const OPERATION_LIMIT: Duration = Duration::from_secs(30);

/// A drained member `m` stopped gracefully, held down for `down`, then started again on its
/// data: the others must stop counting its vote while it is gone (a scale-down), and admit
/// it again when it is back (a scale-up). What does not happen is said on stderr; the
/// suite's checks judge what the clients saw.
fn stop_drained_and_start_again(cluster: &Cluster, m: &Member, down: Duration) {
    let n = cluster.members.len() as u64;
    let voters_seen = |want: u64| {
        cluster
            .members
            .iter()
            .filter(|o| o.index != m.index)
            .all(|o| {
                o.admin()
                    .get("/api/overview")
                    .is_ok_and(|a| a.body["cluster"]["voters"] == want)
            })
    };
    cluster.hold_down(m, true);
    m.terminate();
    if !wait_for(OPERATION_LIMIT, || voters_seen(n - 1)) {
        eprintln!(
            "faults: drain: {} stopped drained but the others still count its vote",
            m.node_id
        );
    }
    std::thread::sleep(down);
    // Still drained, it answers /readyz 503 once back: its vote is the sign.
    cluster.hold_down(m, false);
    if !wait_for(OPERATION_LIMIT, || voters_seen(n)) {
        eprintln!(
            "faults: drain: {} back, but not a voter again after {OPERATION_LIMIT:?}",
            m.node_id
        );
    }
}

/// Polls `done` every 100 ms for at most `limit`; whether it became true.
fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// The member that serves as `queue`'s primary now (the first that claims it).
pub fn primary_of(cluster: &Cluster, queue: &str) -> Option<Arc<Member>> {
    let claim = cluster.primary_claims(queue).into_iter().next()?;
    cluster
        .members
        .iter()
        .find(|m| m.node_id == claim.member)
        .cloned()
}
