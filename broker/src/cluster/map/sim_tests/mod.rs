//! The queue-role decisions of the cluster map, simulated over the real CPG layer.
//!
//! `roles_model` drives maps with a hand-written model of CPG (one total order, failures as
//! configuration changes). Here every member is a real [`Cpg`] of the CPG simulation
//! (`cpg::sim`: openraft members on a simulated network in paused tokio time, with crashes,
//! restarts on their disks, whole-cluster restarts, partitions, one-way cuts, bridges,
//! pauses past the failure timeout, loss, delay and clock-rate skew), and each member's
//! events go into a real [`ClusterMap`] the way `cluster::node` feeds the broker's: the
//! actions it returns are carried out (hellos, snapshots, joins and rejoins, answers), its
//! checkpoint is saved now and then behind a store that keeps everything (a restart resumes
//! from it and replays), and the queue's home follows its roles. The harness lives in
//! `cpg::sim` (the [`App`] hook); the application — this module — lives beside the map it tests.
//!
//! Clients declare replicated queues (random `k` = 0..3, on the member they talk to) and
//! publish; the data path is modelled abstractly, as `replication::replicator` implements it:
//!
//! * an op is an id; a member *holds* the ops of each queue incarnation it has received, in
//!   its journal (held ops survive its crashes: queues are durable, messages persistent);
//! * a member **acts as primary** of a queue when its own map says so (live, holding the map,
//!   the queue available) and it holds the lease (`has_quorum_now`);
//! * the primary sends its ops to each backup of its map over a link that works while both
//!   processes run and the network carries both ways; a backup takes them only while its own
//!   map names the sender as the primary of that incarnation and itself a backup. A link
//!   that failed is caught up by an image (the backup's copy replaced by the primary's) before
//!   the stream goes on; a link is slow now and then (a turn's ops arrive a turn later), and
//!   fails on its own now and then (a reset, a refused frame) for 0.1–1.5 s; a backup
//!   acknowledges what it holds;
//! * the primary **confirms** an op only while it acts as primary and every backup it counts
//!   acknowledged it: the in-sync set of its map, plus any backup whose in-sync mark it has
//!   submitted and not seen refused (a backup counts from the moment its mark is sent, not
//!   from when it commits — see `docs/replication.md`);
//! * it submits `BackupInSync` only once the backup holds every op it holds, and
//!   `BackupOutOfSync` for an in-sync backup whose link failed; until that commits, the ops
//!   that backup has not acknowledged stay unconfirmed.
//!
//! Checked, over every seed:
//!
//! 1. at every turn of the harness, no two members that both hold the lease act as primary
//!    of one queue incarnation — in the same configuration (the newest configuration change
//!    each applied: its view), nor in different ones;
//! 2. every promotion (on every member, as it applies the event) is of a backup that was in
//!    the in-sync set just before;
//! 3. every confirmed op is held by the queue's primary: whenever a member acts as primary
//!    (every turn), after every election as the first member applies it, and at quiescence;
//! 4. the maps agree: every member that holds the map holds the same members and roles after
//!    the same event, and at quiescence every running member holds the map.
//!
//! ```text
//! cargo nextest run -p ringmq --lib -E 'test(cluster::map::sim_tests)'      # 128 seeds, debug
//! CLUSTER_SIM_SEEDS=2000 cargo test --release -p ringmq --lib cluster::map::sim_tests
//! CLUSTER_SIM_SEED=1234 cargo test -p ringmq --lib cluster::map::sim_tests -- --nocapture
//! ```

use super::tests::Store;
use super::*;
use crate::amqp::{AMQPValue, FieldTable};
use crate::cluster::MemberInfo;
use crate::cluster::node::GROUP;
use crate::cluster::rebalance::{MoveState, Rebalance};
use crate::cluster::roles::BACKUPS_ARGUMENT;
use crate::cluster::roles::QueueRoles;
use crate::core::{MoveStep, RebalanceStep, WiringOp};
use crate::cpg::sim::{App, Links, Proc, run_app};
use crate::cpg::{Cpg, CpgError};
use bytes::Bytes;
use parking_lot::Mutex;
use rand08::rngs::StdRng;
use rand08::{Rng, SeedableRng};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

mod checks;
mod data_path;
mod feed;

use feed::spawn_mcast;

/// A queue incarnation: its name and the agreed index of the declare that created it.
type QueueKey = (String, u64);

/// Queue names clients use (few, so that declares collide and deletes hit).
const QUEUES: u64 = 4;

/// One running process of a slot.
struct Member {
    proc: Proc,
    cpg: Cpg,
    map: ClusterMap,
    /// The index of the newest event of the cluster group it applied.
    applied: u64,
    next_request: u64,
    /// Its in-sync and out-of-sync marks in flight, by request number.
    marks: BTreeMap<u64, Mark>,
    /// As a primary: its link to each backup of each queue.
    links: BTreeMap<(QueueKey, String), Link>,
}

struct Mark {
    queue: QueueKey,
    node: String,
    in_sync: bool,
}

#[derive(Default)]
struct Link {
    /// Nothing sent on it was lost since its last image: the backup holds every op the
    /// primary held since.
    streaming: bool,
    /// The link failed on its own (a connection reset, a refused frame): nothing gets
    /// through until then, and then it is caught up with an image.
    down_until: Option<tokio::time::Instant>,
    /// The ops the backup acknowledged.
    acked: BTreeSet<u64>,
}

/// A slot of the cluster: its node id, its running process, and what outlives the process.
struct Slot {
    node: String,
    member: Option<Member>,
    /// The member's wiring (kept across restarts, as its journal and wiring file keep it).
    store: Store,
    /// Its newest saved map checkpoint.
    checkpoint: Option<Checkpoint>,
    /// The ops it holds of each queue incarnation (journaled: a crash keeps them).
    held: BTreeMap<QueueKey, BTreeSet<u64>>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Stats {
    elections: u64,
    /// Of those, planned moves' switches.
    moves: u64,
    /// Moves a rebalance made, as the newest map at quiescence reports them.
    rebalanced: u64,
    unavailable: u64,
    in_sync_marks: u64,
    out_of_sync_marks: u64,
    confirmed: u64,
    queues: u64,
    /// Runs that ended with no member holding the map (see [`World::quiesced`]).
    wedged: u64,
}

impl std::ops::AddAssign for Stats {
    fn add_assign(&mut self, o: Stats) {
        self.elections += o.elections;
        self.moves += o.moves;
        self.rebalanced += o.rebalanced;
        self.unavailable += o.unavailable;
        self.in_sync_marks += o.in_sync_marks;
        self.out_of_sync_marks += o.out_of_sync_marks;
        self.confirmed += o.confirmed;
        self.queues += o.queues;
        self.wedged += o.wedged;
    }
}

struct World {
    rng: StdRng,
    /// When the first member booted (virtual time).
    start: Option<tokio::time::Instant>,
    slots: Vec<Slot>,
    /// Every op some primary confirmed, by queue incarnation.
    confirmed: BTreeMap<QueueKey, BTreeSet<u64>>,
    /// The members and roles after each agreed index, as the first member that held the map
    /// then had them.
    agreed: BTreeMap<u64, (MemberId, Membership, Roles)>,
    /// The indices of the cluster group's configuration changes: the views.
    views: BTreeSet<u64>,
    /// The newest agreed index any member applied.
    newest: u64,
    /// The event being applied is applied here first (no member applied it before): an
    /// election in it is checked against what is confirmed now. (A member applying it
    /// later, or a restart replaying it, sees ops confirmed since by later primaries.)
    first: bool,
    next_op: u64,
    settling: bool,
    stats: Stats,
    failure: Option<String>,
    notes: Vec<String>,
}

fn node_name(slot: usize) -> String {
    format!("n{slot}")
}

impl World {
    pub(super) fn now_ms(&self) -> u128 {
        self.start.map_or(0, |s| s.elapsed().as_millis())
    }

    pub(super) fn note(&mut self, text: String) {
        let line = format!("{:>8} ms {text}", self.now_ms());
        self.notes.push(line);
    }

    pub(super) fn fail(&mut self, why: String) {
        if self.failure.is_none() {
            self.note(format!("FAILED: {why}"));
            self.failure = Some(format!("at {} ms: {why}", self.now_ms()));
        }
    }

    pub(super) fn slot_of(&self, node: &str) -> Option<usize> {
        self.slots.iter().position(|s| s.node == node)
    }

    /// The member of slot `i` if it is running (not stopped by CPG, not paused).
    pub(super) fn running(&self, i: usize, net: &Links) -> Option<&Member> {
        self.slots[i]
            .member
            .as_ref()
            .filter(|m| m.cpg.stop_reason().is_none() && !net.is_paused(m.cpg.addr()))
    }
}

/// The [`App`] the CPG simulation runs: one [`World`] behind a lock (the simulation runs on
/// one thread; the lock is never held across an await).
struct MapApp {
    world: Arc<Mutex<World>>,
}

impl App for MapApp {
    fn booted(&self, slot: usize, proc: Proc, cpg: &Cpg, founder: bool) {
        self.world.lock().booted(slot, proc, cpg, founder);
    }

    fn event(&self, slot: usize, proc: Proc, ev: CpgEvent) -> Option<u64> {
        self.world.lock().event(slot, proc, ev)
    }

    fn gone(&self, slot: usize) {
        self.world.lock().gone(slot);
    }

    fn tick(&self, slot: usize, net: &Links) {
        self.world.lock().tick(&self.world, slot, net);
    }

    fn settle(&self) {
        self.world.lock().settling = true;
    }

    fn quiesced(&self, net: &Links) {
        self.world.lock().quiesced(net);
    }
}

/// Most fault steps a run takes (the CPG sweep takes 8): fewer keep a debug run of a few
/// hundred seeds near a minute.
fn steps() -> u32 {
    env_u64("CLUSTER_SIM_STEPS").map_or(5, |s| u32::try_from(s).unwrap_or(5))
}

/// Runs seed `seed`: its stats, or why it failed with the tails of the trace and notes.
fn check_seed(seed: u64) -> Result<Stats, String> {
    run_seed(seed).0
}

/// Runs seed `seed`: its stats or failure report, and the maps' decisions as noted.
fn run_seed(seed: u64) -> (Result<Stats, String>, Vec<String>) {
    let world = Arc::new(Mutex::new(World {
        rng: StdRng::seed_from_u64(seed ^ 0x5eed_c1a5_7e70_0000),
        start: None,
        slots: (0..5)
            .map(|i| Slot {
                node: node_name(i),
                member: None,
                store: Store::new(i as u64),
                checkpoint: None,
                held: BTreeMap::new(),
            })
            .collect(),
        confirmed: BTreeMap::new(),
        agreed: BTreeMap::new(),
        views: BTreeSet::new(),
        newest: 0,
        first: false,
        next_op: 0,
        settling: false,
        stats: Stats::default(),
        failure: None,
        notes: Vec::new(),
    }));
    let app = Arc::new(MapApp {
        world: Arc::clone(&world),
    });
    let trace = run_app(seed, app, steps());
    let w = world.lock();
    let outcome = match &w.failure {
        None => Ok(w.stats),
        Some(why) => {
            let lines = env_u64("CLUSTER_SIM_DUMP_LINES").map_or(60, |n| n as usize);
            let skip = w.notes.len().saturating_sub(lines);
            let mut notes = String::new();
            for n in &w.notes[skip..] {
                let _ = writeln!(notes, "{n}");
            }
            Err(format!(
                "seed {seed} failed: {why}\nreplay with CLUSTER_SIM_SEED={seed}\n-- faults --\n{}-- map --\n{notes}",
                trace.dump_tail(lines)
            ))
        }
    };
    (outcome, w.notes.clone())
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

/// How many tests the sweep is split into (nextest runs them on both cores).
const PARTS: u64 = 4;

/// Seeds a plain run (CI, debug) checks; `CLUSTER_SIM_SEEDS` overrides.
const DEFAULT_SEEDS: u64 = 128;

/// The seeds of part `part`: `CLUSTER_SIM_SEED` alone (in part 0), or that part of
/// `CLUSTER_SIM_SEED_BASE .. + CLUSTER_SIM_SEEDS`.
fn seeds(part: u64) -> Vec<u64> {
    if let Some(seed) = env_u64("CLUSTER_SIM_SEED") {
        return if part == 0 { vec![seed] } else { Vec::new() };
    }
    let count = env_u64("CLUSTER_SIM_SEEDS").unwrap_or(DEFAULT_SEEDS);
    let base = env_u64("CLUSTER_SIM_SEED_BASE").unwrap_or(0);
    (base + count * part / PARTS..base + count * (part + 1) / PARTS).collect()
}

/// Runs part `part`, failing with every seed that broke (the report of the first), and
/// requires the runs to have reached the decisions they check.
fn check_part(part: u64) {
    let seeds = seeds(part);
    let mut stats = Stats::default();
    let mut failures = Vec::new();
    for &seed in &seeds {
        match check_seed(seed) {
            Ok(s) => stats += s,
            Err(why) => failures.push((seed, why)),
        }
    }
    eprintln!("{} seeds: {stats:?}", seeds.len());
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
    if seeds.len() >= 20 {
        assert!(stats.elections > 0, "no election in {stats:?}");
        assert!(stats.moves > 0, "no planned move in {stats:?}");
        assert!(
            stats.rebalanced > 0,
            "no rebalance moved a primary in {stats:?}"
        );
        assert!(stats.in_sync_marks > 0, "no in-sync mark in {stats:?}");
        assert!(
            stats.out_of_sync_marks > 0,
            "no out-of-sync mark in {stats:?}"
        );
        assert!(stats.confirmed > 0, "nothing confirmed in {stats:?}");
    }
}

#[test]
fn queue_roles_hold_over_the_cpg_simulation_0() {
    check_part(0);
}

#[test]
fn queue_roles_hold_over_the_cpg_simulation_1() {
    check_part(1);
}

#[test]
fn queue_roles_hold_over_the_cpg_simulation_2() {
    check_part(2);
}

#[test]
fn queue_roles_hold_over_the_cpg_simulation_3() {
    check_part(3);
}

/// A seed replays: the same decisions, at the same virtual times, in the same order.
#[test]
fn a_seed_of_the_roles_simulation_replays_exactly() {
    let seed = seeds(0).first().copied().unwrap_or(0);
    let (a, notes_a) = run_seed(seed);
    let (b, notes_b) = run_seed(seed);
    assert_eq!(notes_a, notes_b, "seed {seed} did not replay");
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
    assert!(notes_a.len() > 3, "seed {seed} booted nothing");
}
