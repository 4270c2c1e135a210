//! Deterministic simulation of the CPG layer: 3–5 members on a [`net::SimNet`] in paused
//! virtual time, with seeded crashes, restarts, partitions, loss and delay, checked by
//! [`checker`]. A failing seed replays exactly:
//!
//! ```text
//! CPG_SIM_SEED=1234 cargo test -p ringmq --lib cpg::sim -- --nocapture
//! CPG_SIM_SEEDS=5000 cargo test --release -p ringmq --lib cpg::sim
//! ```

mod checker;
mod net;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::{Cpg, CpgConfig, CpgEvent, MemberId, seed_thread_rng};
use checker::{Record, Trace};
use net::SimNet;

const GROUP: &str = "g";

fn sim_config(seeds: Vec<String>) -> CpgConfig {
    CpgConfig {
        seeds,
        heartbeat_ms: 50,
        election_timeout_ms: 300,
        lease_ms: 500,
        failure_timeout_ms: 1_200,
        rpc_timeout_ms: 250,
        join_timeout_ms: 3_000,
        log_keep_entries: 200,
        ..CpgConfig::default()
    }
}

/// One slot of the cluster: an address and the incarnation living there, if any, plus earlier
/// incarnations that stopped (evicted, overrun) but still vote until the cluster removes them,
/// each at its own address. A replacement starts at a fresh address, as a supervisor that
/// keeps the old process until [`Cpg::is_retired`] would.
struct Slot {
    addr: String,
    member: Option<Cpg>,
    in_group: bool,
    lingering: Vec<Cpg>,
    incarnation: u32,
}

struct Sim {
    net: SimNet,
    start: Instant,
    trace: Arc<Mutex<Trace>>,
    slots: Vec<Slot>,
}

impl Sim {
    fn now_ms(start: Instant) -> u64 {
        u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn record(&self, r: Record) {
        self.trace.lock().push(Self::now_ms(self.start), r);
    }

    async fn boot(&mut self, i: usize) {
        let founder =
            self.slots.iter().all(|s| s.member.is_none()) && i == 0 && self.trace.lock().is_empty();
        let seeds = if founder {
            Vec::new()
        } else {
            (0..self.slots.len())
                .filter(|&j| j != i)
                .map(|j| self.slots[j].addr.clone())
                .chain(
                    self.slots
                        .iter()
                        .flat_map(|s| s.lingering.iter())
                        .map(|m| m.addr().to_string()),
                )
                .collect()
        };
        let id: MemberId = self.net.gen_range(1, u64::MAX);
        let addr = self.slots[i].addr.clone();
        let Ok(l) = Cpg::launch(
            sim_config(seeds),
            id,
            addr.clone(),
            self.net.transport(&addr),
            None,
        )
        .await
        else {
            return;
        };
        self.net.register(&addr, Arc::clone(&l.service));
        if l.cpg.boot().await.is_err() {
            self.net.unregister(&addr);
            l.cpg.shutdown().await;
            return;
        }
        self.record(Record::Started { member: id });
        let (trace, start) = (Arc::clone(&self.trace), self.start);
        let mut events = l.events;
        tokio::spawn(async move {
            while let Some(ev) = events.recv().await {
                if matches!(ev, CpgEvent::Started { .. }) {
                    continue;
                }
                trace.lock().push(
                    Self::now_ms(start),
                    Record::Event {
                        member: id,
                        event: ev,
                    },
                );
            }
        });
        let mut quorum = l.cpg.quorum();
        let (trace, start) = (Arc::clone(&self.trace), self.start);
        tokio::spawn(async move {
            while quorum.changed().await.is_ok() {
                let q = *quorum.borrow();
                trace.lock().push(
                    Self::now_ms(start),
                    Record::Quorum {
                        member: id,
                        has_quorum: q,
                    },
                );
            }
        });
        self.slots[i].member = Some(l.cpg);
        self.slots[i].in_group = false;
    }

    /// The voter sets (two during a joint change) as the member with the newest membership
    /// sees them.
    fn voter_sets(&self) -> Vec<BTreeSet<MemberId>> {
        self.slots
            .iter()
            .filter_map(|s| s.member.as_ref().map(Cpg::voters))
            .max_by_key(|(index, _)| *index)
            .map(|(_, v)| v)
            .unwrap_or_default()
    }

    /// Every voter set some member may still be counting on: those of each member's own
    /// membership. The newest alone is not enough: a leader may have appended the final
    /// configuration of a change whose joint one the others still use (seed 3645).
    fn all_voter_sets(&self) -> BTreeSet<BTreeSet<MemberId>> {
        self.slots
            .iter()
            .flat_map(|s| s.member.iter().chain(&s.lingering))
            .flat_map(|m| m.voters().1)
            .collect()
    }

    /// All voters of the newest membership.
    fn voters(&self) -> BTreeSet<MemberId> {
        self.voter_sets().into_iter().flatten().collect()
    }

    /// Crashes slot `i` unless that would leave fewer than a majority alive in any voter set
    /// some member still counts on (its own membership, joint or not): no consensus protocol
    /// progresses past that, so it is outside the fault model.
    async fn crash_if_majority_survives(&mut self, i: usize) {
        let live: BTreeSet<MemberId> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .filter_map(|(_, s)| s.member.as_ref().map(Cpg::id))
            .chain(
                self.slots
                    .iter()
                    .flat_map(|s| s.lingering.iter())
                    .map(Cpg::id),
            )
            .collect();
        let survives = self
            .all_voter_sets()
            .iter()
            .all(|set| set.intersection(&live).count() * 2 > set.len());
        if survives {
            self.crash(i).await;
        }
    }

    async fn crash(&mut self, i: usize) {
        if let Some(m) = self.slots[i].member.take() {
            self.net.unregister(&self.slots[i].addr);
            self.record(Record::Crashed { member: m.id() });
            m.shutdown().await;
        }
    }

    /// Drops the lingering incarnations of slot `i` that have retired (or all of them).
    async fn reap(&mut self, i: usize, all: bool) {
        let (gone, keep): (Vec<Cpg>, Vec<Cpg>) = std::mem::take(&mut self.slots[i].lingering)
            .into_iter()
            .partition(|m| all || m.is_retired());
        self.slots[i].lingering = keep;
        for m in gone {
            self.net.unregister(m.addr());
            self.record(Record::Crashed { member: m.id() });
            m.shutdown().await;
        }
    }

    /// Cuts `minority` off from the rest. The record names only the members whose side holds
    /// fewer than a majority of the voters (with crashed members, a "minority" of slots can be
    /// the majority of voters).
    fn partition(&self, minority: &[usize]) {
        let side = minority
            .iter()
            .flat_map(|&i| {
                let slot = &self.slots[i];
                std::iter::once(slot.addr.clone())
                    .chain(slot.lingering.iter().map(|m| m.addr().to_string()))
            })
            .map(|a| (a, 1u8))
            .collect();
        self.net.partition(side);
        let voters = self.voters();
        let cut: Vec<MemberId> = minority
            .iter()
            .filter_map(|&i| self.slots[i].member.as_ref().map(Cpg::id))
            .collect();
        let lingering = minority
            .iter()
            .flat_map(|&i| self.slots[i].lingering.iter().map(Cpg::id));
        let cut_voters = cut
            .iter()
            .copied()
            .chain(lingering)
            .filter(|m| voters.contains(m))
            .count();
        let members = if (voters.len() - cut_voters) * 2 > voters.len() {
            cut
        } else {
            Vec::new()
        };
        // The newest entry the cut-off side holds: entries up to it were appended before the
        // cut and may still commit after it (see `checker::check_minorities`).
        let appended = minority
            .iter()
            .flat_map(|&i| {
                let slot = &self.slots[i];
                slot.member.iter().chain(&slot.lingering)
            })
            .map(Cpg::last_log_index)
            .max()
            .unwrap_or(0);
        self.record(Record::Partitioned {
            minority: members,
            appended,
        });
    }

    fn heal(&self) {
        self.net.partition(BTreeMap::new());
        self.record(Record::Healed);
    }

    /// Restarts members that stopped on their own (evicted, fell behind), as a supervisor would.
    async fn supervise(&mut self) {
        for i in 0..self.slots.len() {
            self.reap(i, false).await;
            let stopped = self.slots[i]
                .member
                .as_ref()
                .is_some_and(|m| m.stop_reason().is_some());
            if stopped {
                let m = self.slots[i].member.take();
                match m {
                    // Still voting: keep it, and start the replacement at a fresh address.
                    Some(m) if !m.is_retired() => {
                        self.slots[i].lingering.push(m);
                        self.slots[i].incarnation += 1;
                        self.slots[i].addr = format!("m{i}.{}", self.slots[i].incarnation);
                    }
                    m => {
                        if let Some(m) = &m {
                            self.record(Record::Note {
                                member: m.id(),
                                text: m.raft_summary(),
                            });
                        }
                        self.slots[i].member = m;
                        self.crash(i).await;
                    }
                }
            }
            if self.slots[i].member.is_none() {
                self.boot(i).await;
            }
        }
    }

    /// Live members join the group and multicast for `duration`.
    async fn traffic(&mut self, duration: Duration, tag: &str) {
        let deadline = Instant::now() + duration;
        let mut n = 0u64;
        while Instant::now() < deadline {
            let i = usize::try_from(self.net.gen_range(0, self.slots.len() as u64)).unwrap_or(0);
            if let Some(m) = self.slots[i].member.clone() {
                if !self.slots[i].in_group {
                    self.slots[i].in_group = m.join(GROUP).await.is_ok();
                } else {
                    let payload = Bytes::from(format!("{tag}-{}-{n}", m.id()));
                    n += 1;
                    tokio::spawn(async move { m.mcast(GROUP, payload).await });
                }
            }
            tokio::time::sleep(Duration::from_millis(self.net.gen_range(5, 60))).await;
        }
    }
}

/// Runs one seed and returns its trace (already checked).
fn run_seed(seed: u64) -> Trace {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime builds");
    seed_thread_rng(seed);
    rt.block_on(async move {
        let net = SimNet::new(seed, 20);
        let n = usize::try_from(net.gen_range(3, 6)).unwrap_or(3);
        let mut sim = Sim {
            net,
            start: Instant::now(),
            trace: Arc::new(Mutex::new(Trace::default())),
            slots: (0..n)
                .map(|i| Slot {
                    addr: format!("m{i}"),
                    member: None,
                    in_group: false,
                    lingering: Vec::new(),
                    incarnation: 0,
                })
                .collect(),
        };
        for i in 0..n {
            sim.boot(i).await;
        }
        sim.traffic(Duration::from_secs(1), "warm").await;
        for step in 0..8 {
            match sim.net.gen_range(0, 5) {
                0 => {
                    let i = usize::try_from(sim.net.gen_range(0, n as u64)).unwrap_or(0);
                    sim.crash_if_majority_survives(i).await;
                }
                1 => {
                    let i = usize::try_from(sim.net.gen_range(0, n as u64)).unwrap_or(0);
                    sim.partition(&[i]);
                }
                2 => {
                    let k = (n - 1) / 2;
                    let first = usize::try_from(sim.net.gen_range(0, n as u64)).unwrap_or(0);
                    let minority: Vec<usize> = (0..k.max(1)).map(|j| (first + j) % n).collect();
                    sim.partition(&minority);
                }
                3 => sim
                    .net
                    .set_loss(u32::try_from(sim.net.gen_range(0, 60)).unwrap_or(0)),
                _ => sim.heal(),
            }
            let tag = format!("s{step}");
            let secs = sim.net.gen_range(1, 4);
            sim.traffic(Duration::from_secs(secs), &tag).await;
            if sim.net.gen_range(0, 2) == 0 {
                sim.heal();
                sim.net.set_loss(0);
                sim.supervise().await;
            }
        }
        // Quiescence: heal everything, restart what stopped, let it settle, then require
        // progress from every live member.
        sim.heal();
        sim.net.set_loss(0);
        tokio::time::sleep(Duration::from_secs(3)).await;
        sim.supervise().await;
        for _ in 0..3 {
            for i in 0..n {
                if let Some(m) = sim.slots[i].member.clone()
                    && !sim.slots[i].in_group
                {
                    sim.slots[i].in_group = m.join(GROUP).await.is_ok();
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        for slot in &sim.slots {
            for m in slot.member.iter().chain(&slot.lingering) {
                sim.record(Record::Note {
                    member: m.id(),
                    text: m.raft_summary(),
                });
            }
        }
        let mut finals = Vec::new();
        for slot in &sim.slots {
            let m = slot
                .member
                .clone()
                .filter(|m| slot.in_group && m.stop_reason().is_none());
            let Some(m) = m else { continue };
            let payload = format!("final-{}", m.id());
            let ok = m.mcast(GROUP, Bytes::from(payload.clone())).await.is_ok();
            sim.record(Record::FinalSent { member: m.id(), ok });
            finals.push(payload);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let live: Vec<MemberId> = sim
            .slots
            .iter()
            .filter(|s| s.in_group)
            .filter_map(|s| {
                s.member
                    .as_ref()
                    .filter(|m| m.stop_reason().is_none())
                    .map(Cpg::id)
            })
            .collect();
        sim.record(Record::Quiesced { live, finals });
        for i in 0..n {
            sim.crash(i).await;
            sim.reap(i, true).await;
        }
        sim.trace.lock().clone()
    })
}

fn check_seed(seed: u64) {
    let trace = run_seed(seed);
    if let Err(why) = checker::check(&trace, &sim_config(Vec::new()), 20) {
        let lines = std::env::var("CPG_SIM_DUMP_LINES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(80);
        panic!(
            "seed {seed} failed: {why}\nreplay with CPG_SIM_SEED={seed}\n{}",
            trace.dump_tail(lines)
        );
    }
}

/// How many tests the seed sweep is split into, so that a test runner that runs tests in
/// parallel (nextest, `cargo test`'s threads) spreads it over the cores.
const PARTS: u64 = 4;

/// Seeds a plain `cargo test` / CI run checks (debug build); `CPG_SIM_SEEDS` overrides.
const DEFAULT_SEEDS: u64 = 256;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

/// The seeds of part `part` of the sweep: `CPG_SIM_SEED` alone (in part 0), or part `part` of
/// `CPG_SIM_SEED_BASE .. CPG_SIM_SEED_BASE + CPG_SIM_SEEDS` cut into [`PARTS`] contiguous
/// ranges.
fn seeds(part: u64) -> Vec<u64> {
    if let Some(seed) = env_u64("CPG_SIM_SEED") {
        return if part == 0 { vec![seed] } else { Vec::new() };
    }
    let count = env_u64("CPG_SIM_SEEDS").unwrap_or(DEFAULT_SEEDS);
    let base = env_u64("CPG_SIM_SEED_BASE").unwrap_or(0);
    let from = base + count * part / PARTS;
    let to = base + count * (part + 1) / PARTS;
    (from..to).collect()
}

fn check_part(part: u64) {
    for seed in seeds(part) {
        check_seed(seed);
    }
}

#[test]
fn virtual_synchrony_leases_and_progress_hold_under_crashes_partitions_and_loss_0() {
    check_part(0);
}

#[test]
fn virtual_synchrony_leases_and_progress_hold_under_crashes_partitions_and_loss_1() {
    check_part(1);
}

#[test]
fn virtual_synchrony_leases_and_progress_hold_under_crashes_partitions_and_loss_2() {
    check_part(2);
}

#[test]
fn virtual_synchrony_leases_and_progress_hold_under_crashes_partitions_and_loss_3() {
    check_part(3);
}

#[test]
fn a_seed_replays_exactly() {
    let seed = seeds(0).first().copied().unwrap_or(0);
    let a = run_seed(seed);
    let b = run_seed(seed);
    assert_eq!(
        a.dump_tail(usize::MAX),
        b.dump_tail(usize::MAX),
        "seed {seed} did not replay"
    );
    assert!(a.deliveries() > 0, "seed {seed} delivered nothing");
}

impl CpgEvent {
    fn is_delivery(&self) -> bool {
        matches!(self, CpgEvent::Deliver { .. })
    }
}
