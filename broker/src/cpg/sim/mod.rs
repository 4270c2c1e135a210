//! Deterministic simulation of the CPG layer: 3–5 members on a [`net::SimNet`] in paused
//! virtual time, with seeded crashes, restarts, partitions (symmetric, one-way, bridged),
//! paused members, loss, delay and clock-rate skew, checked by [`checker`]. A failing seed
//! replays exactly:
//!
//! ```text
//! CPG_SIM_SEED=1234 cargo test -p ringmq --lib cpg::sim -- --nocapture
//! CPG_SIM_SEEDS=5000 cargo test --release -p ringmq --lib cpg::sim
//! ```
//!
//! The same harness runs an application on top of the members instead of its own traffic
//! ([`App`], [`run_app`]): the cluster map's simulation (`cluster::map::sim_tests`) feeds
//! each member's events into a real `ClusterMap` under the same faults.

mod checker;
mod net;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use rand08::rngs::StdRng;
use rand08::{Rng, SeedableRng};
use tokio::time::Instant;

use super::disk::{Disk, MemDisk};
use super::{Cpg, CpgConfig, CpgEvent, MemberId, seed_thread_rng};
use checker::{Record, Trace};
use net::{BRIDGE, SimNet};

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

/// `config` as a member whose clock runs at `clock_per_mille` ms per 1000 ms of virtual time
/// lives it. The CPG layer times everything (heartbeats, elections, leases, failure
/// detection, exchanges, admission) with durations on the member's own monotonic clock and
/// sends no clock reading to another member, so such a member is one with every duration
/// divided by its rate (rounded, never 0). The one duration that crosses members, a lease
/// grant, is restated in transit by the network ([`SimNet`]).
fn skewed(config: &CpgConfig, clock_per_mille: u64) -> CpgConfig {
    let scale = |ms: u64| {
        (ms.saturating_mul(1000).saturating_add(clock_per_mille / 2) / clock_per_mille).max(1)
    };
    CpgConfig {
        heartbeat_ms: scale(config.heartbeat_ms),
        election_timeout_ms: scale(config.election_timeout_ms),
        lease_ms: scale(config.lease_ms),
        failure_timeout_ms: scale(config.failure_timeout_ms),
        rpc_timeout_ms: scale(config.rpc_timeout_ms),
        join_retry_ms: scale(config.join_retry_ms),
        join_timeout_ms: scale(config.join_timeout_ms),
        ..config.clone()
    }
}

/// How far (per mille) clocks may run from the virtual rate in a skewed run:
/// `CPG_SIM_SKEW`, else 250, i.e. rates 0.75–1.25. The fastest clock is then at most 1.67×
/// the slowest, inside the factor of about 2 the lease margins tolerate (`docs/cpg.md`).
fn max_skew_per_mille() -> u64 {
    env_u64("CPG_SIM_SKEW").unwrap_or(250).min(999)
}

/// Each slot's clock rate, per mille of virtual time. Half the runs skew: each slot draws a
/// rate within [`max_skew_per_mille`] of 1000; the other half run every clock at 1000. The
/// draws come from a generator of their own, seeded from the run's seed, so that they shift
/// none of the harness's other draws: an unskewed run draws the faults its seed drew before
/// skew existed.
fn clock_rates(seed: u64, n: usize) -> Vec<u64> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xc10c_c10c_c10c_c10c);
    let skew = if rng.gen_bool(0.5) {
        max_skew_per_mille()
    } else {
        0
    };
    (0..n)
        .map(|_| rng.gen_range(1000 - skew..=1000 + skew))
        .collect()
}

/// One slot of the cluster: an address and the process living there, if any. Without a disk
/// every process is a new member, and earlier ones that stopped (evicted, overrun) but still
/// vote until the cluster removes them linger, each at its own address: a replacement starts
/// at a fresh address, as a supervisor that keeps the old process until [`Cpg::is_retired`]
/// would. With a disk (what the broker runs) a restart is the same member at the same
/// address, resuming after what its application recorded.
struct Slot {
    addr: String,
    /// The rate of this slot's clock, per mille of virtual time; its processes keep it.
    clock: u64,
    member: Option<Cpg>,
    in_group: bool,
    lingering: Vec<Cpg>,
    incarnation: u32,
    durable: Option<Durable>,
}

/// What survives a crash of a slot's member in durable mode.
struct Durable {
    /// The stable member id.
    id: MemberId,
    /// Its consensus state.
    disk: MemDisk,
    /// The newest index its application (the trace) recorded: a restart resumes after it.
    delivered: Arc<AtomicU64>,
}

struct Sim {
    net: SimNet,
    start: Instant,
    trace: Arc<Mutex<Trace>>,
    slots: Vec<Slot>,
    /// The application running on the members, if not the harness's own traffic.
    app: Option<Arc<dyn App>>,
    /// Processes booted so far: each gets the next number, its [`Proc`].
    procs: u64,
}

/// One process of a slot, as an [`App`] tells them apart: events of a process that has
/// crashed may still drain from its queue, and must not reach its successor.
pub(crate) type Proc = u64;

/// An application running on every simulated member in place of the harness's own traffic
/// (group joins and multicasts of random payloads, checked by [`checker`]). The harness
/// brings the faults (crashes, restarts, partitions, pauses, loss, skew); the application
/// joins its own group, multicasts, and checks its own properties. Its events are not
/// recorded in the trace, which holds the faults (the CPG sweep checks the layer itself);
/// the application keeps its own record.
pub(crate) trait App: Send + Sync + 'static {
    /// Process `proc` of slot `slot` launched as `cpg` (`founder`: it founds the cluster);
    /// its events follow through [`App::event`].
    fn booted(&self, slot: usize, proc: Proc, cpg: &Cpg, founder: bool);
    /// An event for process `proc` of slot `slot`. Returns the index through which the
    /// application has now saved its state, if it saved: a restart on the slot's disk
    /// resumes after it.
    fn event(&self, slot: usize, proc: Proc, ev: CpgEvent) -> Option<u64>;
    /// Slot `slot`'s process is gone: crashed, or stopped and replaced.
    fn gone(&self, slot: usize);
    /// A turn for slot `slot`, whose process is running and not paused: client work on it,
    /// and whatever the application does in the background everywhere.
    fn tick(&self, slot: usize, net: &Links);
    /// The faults are over and healed: from now on no new client work, only what settles.
    fn settle(&self);
    /// After settling, with every process still running: the final checks.
    fn quiesced(&self, net: &Links);
}

/// What an [`App`] may ask of the simulated network.
pub(crate) struct Links<'a> {
    net: &'a SimNet,
}

impl Links<'_> {
    /// Whether `a` and `b` can exchange a message and its answer now: both running (not
    /// paused) and the links both ways up.
    pub(crate) fn talk(&self, a: &str, b: &str) -> bool {
        a == b
            || (!self.net.is_paused(a)
                && !self.net.is_paused(b)
                && self.net.reaches(a, b)
                && self.net.reaches(b, a))
    }

    /// Whether `addr`'s process is paused (it acts on nothing).
    pub(crate) fn is_paused(&self, addr: &str) -> bool {
        self.net.is_paused(addr)
    }
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
        let fresh_id: MemberId = self.net.gen_range(1, u64::MAX);
        let (id, disk, delivered) = match &self.slots[i].durable {
            Some(d) => (
                d.id,
                Some(Arc::new(d.disk.clone()) as Arc<dyn Disk>),
                Some(Arc::clone(&d.delivered)),
            ),
            None => (fresh_id, None, None),
        };
        let clock = self.slots[i].clock;
        let config = CpgConfig {
            resume_after: delivered.as_ref().map_or(0, |d| d.load(Ordering::Acquire)),
            ..skewed(&sim_config(seeds), clock)
        };
        let addr = self.slots[i].addr.clone();
        let transport = self.net.transport(&addr, clock);
        let Ok(l) = Cpg::launch(config, id, addr.clone(), transport, disk).await else {
            return;
        };
        self.net.register(&addr, Arc::clone(&l.service));
        if l.cpg.boot().await.is_err() {
            self.net.unregister(&addr);
            l.cpg.shutdown().await;
            return;
        }
        self.record(Record::Started {
            member: id,
            clock_per_mille: clock,
        });
        self.record(Record::Regrouped);
        let mut events = l.events;
        if let Some(app) = self.app.clone() {
            self.procs += 1;
            let proc = self.procs;
            app.booted(i, proc, &l.cpg, founder);
            let cpg = l.cpg.clone();
            tokio::spawn(async move {
                while let Some(ev) = events.recv().await {
                    if let Some(index) = app.event(i, proc, ev)
                        && let Some(d) = &delivered
                    {
                        d.store(index, Ordering::Release);
                        cpg.checkpointed(index);
                    }
                }
            });
            self.slots[i].member = Some(l.cpg);
            return;
        }
        let (trace, start) = (Arc::clone(&self.trace), self.start);
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let cpg = l.cpg.clone();
        tokio::spawn(async move {
            let mut started_tx = Some(started_tx);
            while let Some(ev) = events.recv().await {
                if let CpgEvent::Started { groups, index } = &ev {
                    let resumed = groups.iter().any(|g| g == GROUP);
                    trace.lock().push(
                        Self::now_ms(start),
                        Record::Incarnated {
                            member: id,
                            index: *index,
                            resumed,
                        },
                    );
                    if let Some(tx) = started_tx.take() {
                        let _ = tx.send(resumed);
                    }
                    continue;
                }
                let index = ev.index();
                trace.lock().push(
                    Self::now_ms(start),
                    Record::Event {
                        member: id,
                        event: ev,
                    },
                );
                // The trace is the application's durable state: recorded is saved.
                if let Some(d) = &delivered {
                    d.store(index, Ordering::Release);
                    cpg.checkpointed(index);
                }
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
        let restarted = l.cpg.is_restart();
        self.slots[i].member = Some(l.cpg);
        // A restarted member may still be in the group (its membership carries over): its
        // incarnation's start says so, once a majority is there to commit it.
        self.slots[i].in_group = restarted
            && tokio::time::timeout(Duration::from_secs(2), started_rx)
                .await
                .is_ok_and(|g| g.unwrap_or(false));
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
            if let Some(app) = &self.app {
                app.gone(i);
            }
            self.net.unregister(&self.slots[i].addr);
            self.record(Record::Crashed { member: m.id() });
            self.record(Record::Regrouped);
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
            fault: format!("partition {minority:?} from the rest"),
            leaseless: members.clone(),
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
            if stopped && self.slots[i].durable.is_some() {
                // The broker exits and its supervisor restarts it: the same member.
                if let Some(m) = &self.slots[i].member {
                    self.record(Record::Note {
                        member: m.id(),
                        text: m.raft_summary(),
                    });
                }
                self.crash(i).await;
            } else if stopped {
                let m = self.slots[i].member.take();
                match m {
                    // Still voting: keep it, and start the replacement at a fresh address.
                    Some(m) if !m.is_retired() => {
                        if let Some(app) = &self.app {
                            app.gone(i);
                        }
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
            // A paused member's application is stopped too: it calls nothing.
            let running = !self.net.is_paused(&self.slots[i].addr);
            if let Some(app) = self.app.clone() {
                if running && self.slots[i].member.is_some() {
                    app.tick(i, &Links { net: &self.net });
                }
            } else if let Some(m) = self.slots[i].member.clone().filter(|_| running) {
                if !self.slots[i].in_group {
                    self.join(i, &m).await;
                } else {
                    let payload = format!("{tag}-{}-{n}", m.id());
                    n += 1;
                    self.spawn_mcast(m, payload);
                }
            }
            tokio::time::sleep(Duration::from_millis(self.net.gen_range(5, 60))).await;
        }
    }
}

impl Sim {
    /// Member `m` of slot `i` joins the group; the index `join` returns goes into the trace.
    async fn join(&mut self, i: usize, m: &Cpg) {
        let joined = m.join(GROUP).await;
        if let Ok(index) = joined {
            self.record(Record::Joined {
                member: m.id(),
                index,
            });
        }
        self.slots[i].in_group = joined.is_ok();
    }

    /// `m` multicasts `payload` in the background; the index `mcast` returns goes into the
    /// trace.
    fn spawn_mcast(&self, m: Cpg, payload: String) {
        let (trace, start) = (Arc::clone(&self.trace), self.start);
        tokio::spawn(async move {
            if let Ok(index) = m.mcast(GROUP, Bytes::from(payload.clone())).await {
                let sent = Record::Sent {
                    member: m.id(),
                    payload,
                    index,
                };
                trace.lock().push(Self::now_ms(start), sent);
            }
        });
    }

    /// Every address of slot `i`: its current one and those of its lingering incarnations.
    fn addrs(&self, i: usize) -> Vec<String> {
        let slot = &self.slots[i];
        std::iter::once(slot.addr.clone())
            .chain(slot.lingering.iter().map(|m| m.addr().to_string()))
            .collect()
    }

    /// Cuts slot `i` off one way: `outbound` loses every message it sends (its requests and
    /// its responses to others' requests), else every message sent to it. The other direction
    /// flows, so it still acts on what reaches it.
    fn cut_one_way(&self, i: usize, outbound: bool) {
        let me = self.addrs(i);
        let others: Vec<String> = (0..self.slots.len())
            .filter(|&j| j != i)
            .flat_map(|j| self.addrs(j))
            .collect();
        let (from, to, way) = if outbound {
            (&me, &others, "from")
        } else {
            (&others, &me, "to")
        };
        self.net.cut_one_way(from, to);
        self.record_links(format!("one-way cut: messages {way} slot {i} lost"));
    }

    /// Splits the slots into two sides that cannot talk, `left` and the rest but `bridge`,
    /// and `bridge`, which talks to both.
    fn bridge(&self, bridge: usize, left: &[usize]) {
        let side = (0..self.slots.len())
            .flat_map(|j| {
                let s = if j == bridge {
                    BRIDGE
                } else if left.contains(&j) {
                    1
                } else {
                    2
                };
                self.addrs(j).into_iter().map(move |a| (a, s))
            })
            .collect();
        self.net.partition(side);
        self.record_links(format!(
            "bridge: slot {bridge} between {left:?} and the rest"
        ));
    }

    /// Records the links now in force and what they cut off, judged from the network itself
    /// (see [`Record::Partitioned`]). A member could lead a majority if it can exchange
    /// messages both ways with at least half of some voter set any member still uses,
    /// itself included; "at least half" rather than "more than half" keeps this on the safe
    /// side of a removal that shrinks an even set during the cut. A member that no such
    /// member can send to delivers nothing appended after the cut; one that can complete no
    /// exchange with any such member (nor is one) loses quorum within a lease.
    fn record_links(&self, fault: String) {
        let live: Vec<&Cpg> = self
            .slots
            .iter()
            .flat_map(|s| s.member.iter().chain(&s.lingering))
            .collect();
        let sets = self.all_voter_sets();
        let reaches = |a: &Cpg, b: &Cpg| a.id() == b.id() || self.net.reaches(a.addr(), b.addr());
        let talks = |a: &Cpg, b: &Cpg| reaches(a, b) && reaches(b, a);
        let capable: BTreeSet<MemberId> = live
            .iter()
            .filter(|y| {
                sets.iter().any(|set| {
                    let n = live
                        .iter()
                        .filter(|z| set.contains(&z.id()) && talks(y, z))
                        .count();
                    2 * n >= set.len()
                })
            })
            .map(|y| y.id())
            .collect();
        let current = self.slots.iter().filter_map(|s| s.member.as_ref());
        let cut_off = |linked: &dyn Fn(&Cpg, &Cpg) -> bool| -> Vec<MemberId> {
            current
                .clone()
                .filter(|x| {
                    !live
                        .iter()
                        .any(|y| capable.contains(&y.id()) && linked(y, x))
                })
                .map(Cpg::id)
                .collect()
        };
        let minority = cut_off(&|y, x| reaches(y, x));
        let leaseless = cut_off(&|y, x| talks(y, x));
        // Entries the cut-off side held at the cut may still commit after it: those of every
        // member whose messages can reach a cut-off member, directly or through others that
        // cannot lead a majority either.
        let mut side: BTreeSet<MemberId> = minority.iter().copied().collect();
        loop {
            let more: Vec<MemberId> = live
                .iter()
                .filter(|y| !side.contains(&y.id()) && !capable.contains(&y.id()))
                .filter(|y| live.iter().any(|x| side.contains(&x.id()) && reaches(y, x)))
                .map(|y| y.id())
                .collect();
            if more.is_empty() {
                break;
            }
            side.extend(more);
        }
        let appended = live
            .iter()
            .filter(|m| side.contains(&m.id()))
            .map(|m| m.last_log_index())
            .max()
            .unwrap_or(0);
        self.record(Record::Partitioned {
            fault,
            minority,
            leaseless,
            appended,
        });
    }

    /// Pauses slot `i`'s member for `pause` (its messages are held both ways, as a SIGSTOP
    /// would hold them, and its background duties stop) while the others go on with traffic,
    /// then resumes it. openraft's own timers keep running: what stays frozen is what
    /// reports quorum, which is what a pause must not leave stale.
    async fn pause(&mut self, i: usize, pause: Duration, tag: &str) {
        let Some(m) = self.slots[i].member.clone() else {
            return;
        };
        self.net.pause(m.addr());
        m.set_paused(true);
        self.record(Record::Paused { member: m.id() });
        self.traffic(pause, tag).await;
        m.set_paused(false);
        self.net.resume(m.addr());
        self.record(Record::Resumed {
            member: m.id(),
            has_quorum_now: m.has_quorum_now(),
        });
    }
}

impl Sim {
    /// Every member crashes at once (a power cut), then they come back one by one in a random
    /// order with random gaps, each on its own disk: nothing a majority committed may be lost,
    /// and until a majority is back nobody may claim quorum.
    async fn restart_all(&mut self) {
        for i in 0..self.slots.len() {
            self.crash(i).await;
        }
        let mut order: Vec<usize> = (0..self.slots.len()).collect();
        for k in (1..order.len()).rev() {
            let j = usize::try_from(self.net.gen_range(0, k as u64 + 1)).unwrap_or(0);
            order.swap(k, j);
        }
        for i in order {
            tokio::time::sleep(Duration::from_millis(self.net.gen_range(0, 1_500))).await;
            self.boot(i).await;
        }
    }
}

/// How long a pause lasts: past the failure timeout, so that the others declare the paused
/// member failed while it cannot hear it, and up to three failure timeouts. `config` is that
/// of the slowest clock, whose failure timeout is the longest.
fn pause_ms(net: &SimNet, config: &CpgConfig) -> u64 {
    let ft = config.failure_timeout_ms;
    net.gen_range(ft + config.heartbeat_ms, 3 * ft + 1)
}

/// Runs one seed and returns its trace (already checked).
fn run_seed(seed: u64) -> Trace {
    run(seed, None, 8)
}

/// Runs one seed with `app` on the members and `steps` fault steps (the CPG sweep has 8),
/// then heals, settles and calls [`App::quiesced`]; returns the trace of the faults, for a
/// failure report.
pub(crate) fn run_app(seed: u64, app: Arc<dyn App>, steps: u32) -> Trace {
    run(seed, Some(app), steps)
}

fn run(seed: u64, app: Option<Arc<dyn App>>, steps: u32) -> Trace {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime builds");
    seed_thread_rng(seed);
    rt.block_on(async move {
        let net = SimNet::new(seed, 20);
        let n = usize::try_from(net.gen_range(3, 6)).unwrap_or(3);
        let clocks = clock_rates(seed, n);
        let slowest = skewed(
            &sim_config(Vec::new()),
            clocks.iter().copied().min().unwrap_or(1000),
        );
        let mut sim = Sim {
            net,
            start: Instant::now(),
            trace: Arc::new(Mutex::new(Trace::default())),
            slots: (0..n)
                .map(|i| Slot {
                    addr: format!("m{i}"),
                    clock: clocks[i],
                    member: None,
                    in_group: false,
                    lingering: Vec::new(),
                    incarnation: 0,
                    durable: None,
                })
                .collect(),
            app,
            procs: 0,
        };
        // Most runs keep consensus state on a disk, as the broker does; the rest check the
        // in-memory model (every process a new member).
        if sim.net.gen_range(0, 4) != 0 {
            for slot in &mut sim.slots {
                slot.durable = Some(Durable {
                    id: sim.net.gen_range(1, u64::MAX),
                    disk: MemDisk::default(),
                    delivered: Arc::new(AtomicU64::new(0)),
                });
            }
        }
        for i in 0..n {
            sim.boot(i).await;
        }
        sim.traffic(Duration::from_secs(1), "warm").await;
        for step in 0..steps {
            match sim.net.gen_range(0, 9) {
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
                4 => {
                    let i = usize::try_from(sim.net.gen_range(0, n as u64)).unwrap_or(0);
                    sim.cut_one_way(i, sim.net.gen_range(0, 2) == 0);
                }
                5 => {
                    let first = usize::try_from(sim.net.gen_range(0, n as u64)).unwrap_or(0);
                    let k = usize::try_from(sim.net.gen_range(1, n as u64 - 1)).unwrap_or(1);
                    let left: Vec<usize> = (1..=k).map(|j| (first + j) % n).collect();
                    sim.bridge(first, &left);
                }
                6 => {
                    let i = usize::try_from(sim.net.gen_range(0, n as u64)).unwrap_or(0);
                    let pause = pause_ms(&sim.net, &slowest);
                    sim.pause(i, Duration::from_millis(pause), &format!("p{step}"))
                        .await;
                }
                7 if sim.slots[0].durable.is_some() => sim.restart_all().await,
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
        if let Some(app) = sim.app.clone() {
            // Heal, restart what stopped, let the application settle and check it.
            sim.heal();
            sim.net.set_loss(0);
            tokio::time::sleep(Duration::from_secs(3)).await;
            sim.supervise().await;
            sim.traffic(Duration::from_secs(3), "heal").await;
            app.settle();
            sim.traffic(Duration::from_secs(4), "settle").await;
            app.quiesced(&Links { net: &sim.net });
            for i in 0..n {
                sim.crash(i).await;
                sim.reap(i, true).await;
            }
            return sim.trace.lock().clone();
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
                    sim.join(i, &m).await;
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
            let sent = m.mcast(GROUP, Bytes::from(payload.clone())).await;
            if let Ok(index) = sent {
                sim.record(Record::Sent {
                    member: m.id(),
                    payload: payload.clone(),
                    index,
                });
            }
            sim.record(Record::FinalSent {
                member: m.id(),
                ok: sent.is_ok(),
            });
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
        // Running members that still could not join: after healing, every member that has
        // not stopped must be able to (one the cluster removed must learn it and stop).
        let stranded: Vec<MemberId> = sim
            .slots
            .iter()
            .filter(|s| !s.in_group)
            .filter_map(|s| s.member.as_ref().filter(|m| m.stop_reason().is_none()))
            .map(Cpg::id)
            .collect();
        sim.record(Record::Quiesced {
            live,
            finals,
            stranded,
        });
        for i in 0..n {
            sim.crash(i).await;
            sim.reap(i, true).await;
        }
        sim.trace.lock().clone()
    })
}

/// Runs and checks one seed: `Err` names the broken property, with the trace's tail.
fn check_seed(seed: u64) -> Result<(), String> {
    let trace = run_seed(seed);
    checker::check(&trace, &sim_config(Vec::new()), 20).map_err(|why| {
        let lines = std::env::var("CPG_SIM_DUMP_LINES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(80);
        format!(
            "seed {seed} failed: {why}\nreplay with CPG_SIM_SEED={seed}\n{}",
            trace.dump_tail(lines)
        )
    })
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

/// Checks every seed of part `part` and fails with all that broke (the trace of the first),
/// so one sweep shows every failing seed rather than stopping at the first.
fn check_part(part: u64) {
    let failures: Vec<(u64, String)> = seeds(part)
        .into_iter()
        .filter_map(|seed| check_seed(seed).err().map(|why| (seed, why)))
        .collect();
    if let Some((_, first)) = failures.first() {
        let summary: Vec<String> = failures
            .iter()
            .map(|(seed, why)| format!("{seed}: {}", why.lines().next().unwrap_or_default()))
            .collect();
        panic!(
            "{} seeds failed:\n{}\n\n{first}",
            failures.len(),
            summary.join("\n")
        );
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

/// Skew reaches about half the runs and no clock leaves the range; every skewed configuration
/// is one `Cpg::launch` accepts (a refused one would silently leave its slot empty).
#[test]
fn clocks_are_skewed_in_half_the_runs_within_the_range() {
    let runs: Vec<Vec<u64>> = (0..200).map(|seed| clock_rates(seed, 5)).collect();
    let skewed_runs = runs.iter().filter(|r| r.iter().any(|c| *c != 1000)).count();
    assert!((60..=140).contains(&skewed_runs), "{skewed_runs} of 200");
    for clock in runs.into_iter().flatten() {
        assert!(
            clock.abs_diff(1000) <= max_skew_per_mille(),
            "clock {clock}"
        );
        skewed(&sim_config(Vec::new()), clock)
            .validate()
            .expect("a skewed configuration validates");
    }
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
