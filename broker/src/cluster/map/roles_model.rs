//! A randomised model of a cluster's queue roles: members join (new nodes and nodes coming
//! back), fail, restart in place (resuming from a checkpoint older than their store, so the
//! replay skips ops the store already saved); clients declare and delete queues with random
//! `k` on random primaries (some on members that are gone); primaries — and impostors —
//! multicast `BackupInSync` and `BackupOutOfSync` that commit late, after elections. After
//! every event it checks, on every member that holds the map:
//!
//! * every member holds the same roles, and its store routes each queue to the roles' primary;
//! * a primary changes only to a backup that was in sync just before (an election), and an
//!   unavailable queue comes back only on its lost primary or a node that was in sync;
//! * the primary is never a backup, no backup twice, never more than `k`, in sync ⊆ backups;
//! * an available queue's primary and backups are live, and it has as many backups as the
//!   live members allow (the transfer and join rules leave no queue short).

use super::tests::{Store, member};
use super::*;
use crate::amqp::{AMQPValue, FieldTable};
use crate::cluster::MemberInfo;
use crate::cluster::layout::RingLayout;
use crate::cluster::roles::BACKUPS_ARGUMENT;
use crate::cluster::roles::QueueRoles;
use crate::core::WiringOp;
use bytes::Bytes;
use rand08::rngs::StdRng;
use rand08::{Rng, SeedableRng};

/// Node ids a member may have: a member that fails may come back later under the same one
/// (a new CPG member on the same configuration, or a restart on a lost data directory).
const NODES: usize = 6;

struct Node {
    id: MemberId,
    node: usize,
    map: ClusterMap,
    store: Store,
    /// The events this member was given, for a restart's replay.
    log: Vec<CpgEvent>,
    /// The newest checkpoint it saved (the real one saves at most every 200 ms, behind its
    /// store).
    saved: Option<Checkpoint>,
}

struct Model {
    seed: u64,
    rng: StdRng,
    nodes: Vec<Node>,
    group: Vec<MemberId>,
    index: u64,
    pending: Vec<(MemberId, u32, ClusterMsg)>,
    next_id: MemberId,
    elections: usize,
    unavailable_seen: usize,
    in_sync_marks: usize,
}

fn node_name(n: usize) -> String {
    format!("n{n}")
}

/// Each node's configured `default_backups`, fixed per node id.
fn default_backups(n: usize) -> u8 {
    (n % 4) as u8
}

impl Model {
    fn new(seed: u64) -> Self {
        Self {
            seed,
            rng: StdRng::seed_from_u64(seed),
            nodes: Vec::new(),
            group: Vec::new(),
            index: 0,
            pending: Vec::new(),
            next_id: 1,
            elections: 0,
            unavailable_seen: 0,
            in_sync_marks: 0,
        }
    }

    fn next_index(&mut self) -> u64 {
        self.index += 1;
        self.index
    }

    /// Carries out what a member's map asked for, as the node would.
    fn act(&mut self, at: usize, actions: Vec<Action>) {
        for a in actions {
            let node = &mut self.nodes[at];
            match a {
                // The session directory has its own tests (`session::directory`).
                Action::SessionChanged { .. } => {}
                // Only the admin API's copies of the membership and the rebalance follow them.
                Action::MembershipChanged | Action::RebalanceChanged => {}
                Action::SendHello => {
                    let info = MemberInfo {
                        node_id: node_name(node.node),
                        amqp: format!("a{}", node.id),
                        admin: String::new(),
                        zone: format!("z{}", node.node % 3),
                        default_backups: default_backups(node.node),
                        ring_order: None,
                        places_ring: true,
                        lays_out_ring: true,
                        holds_for_sessions: true,
                        process: 0,
                    };
                    let delay = self.rng.gen_range(0..3);
                    self.pending.push((node.id, delay, ClusterMsg::Hello(info)));
                }
                Action::SendSnapshot { to, through } => {
                    let msg = node.map.snapshot(to, through, &mut node.store);
                    let delay = self.rng.gen_range(0..3);
                    self.pending.push((node.id, delay, msg));
                }
                Action::RolesChanged {
                    vhost, queue, now, ..
                } => {
                    if let Some(r) = now {
                        node.store
                            .vhosts
                            .get_mut(&vhost)
                            .expect("test vhost")
                            .set_queue_home(&queue, &r.primary);
                    }
                }
                Action::Answer { .. }
                | Action::HostsChanged
                | Action::Synced
                | Action::Join
                | Action::Rejoin => {}
            }
        }
    }

    /// Delivers `ev` to every member of the group and checks the roles before and after.
    fn emit(&mut self, ev: CpgEvent) {
        let before = self.agreed_roles();
        let group = self.group.clone();
        for at in 0..self.nodes.len() {
            if !group.contains(&self.nodes[at].id) {
                continue;
            }
            let node = &mut self.nodes[at];
            node.log.push(ev.clone());
            let actions = node
                .map
                .on_event(ev.clone(), &mut node.store)
                .expect("bounded buffer");
            self.act(at, actions);
            if self.rng.gen_bool(0.3) {
                let node = &mut self.nodes[at];
                if let Some(c) = node.map.checkpoint(&mut node.store) {
                    node.saved = Some(c);
                }
            }
        }
        self.check(before.as_ref());
    }

    /// The roles every member holding the map agrees on (checked to be the same).
    fn agreed_roles(&self) -> Option<Roles> {
        let mut agreed: Option<(MemberId, &Roles)> = None;
        for n in self.nodes.iter().filter(|n| n.map.is_synced()) {
            match agreed {
                None => agreed = Some((n.id, n.map.roles())),
                Some((first, roles)) => assert_eq!(
                    n.map.roles(),
                    roles,
                    "seed {}: members {first} and {} disagree on the roles",
                    self.seed,
                    n.id
                ),
            }
        }
        agreed.map(|(_, r)| r.clone())
    }

    fn check(&mut self, before: Option<&Roles>) {
        let seed = self.seed;
        let Some(now) = self.agreed_roles() else {
            return;
        };
        let synced = self.nodes.iter().find(|n| n.map.is_synced()).expect("one");
        let live = synced.map.membership().ring();
        for (vhost, queue, r) in now.iter() {
            let what = format!("seed {seed}: queue {queue} {r:?}");
            assert!(
                !r.backups.contains(&r.primary),
                "{what}: primary is a backup"
            );
            for (i, b) in r.backups.iter().enumerate() {
                assert!(!r.backups[..i].contains(b), "{what}: duplicate backup");
            }
            assert!(
                r.backups.len() <= usize::from(r.wanted_backups),
                "{what}: > k"
            );
            assert!(r.in_sync.iter().all(|n| r.backups.contains(n)), "{what}");
            if r.unavailable {
                assert!(
                    !live.contains(&r.primary),
                    "{what}: unavailable, primary live"
                );
                assert!(
                    !r.in_sync.iter().any(|n| live.contains(n)),
                    "{what}: unavailable with an in-sync node live"
                );
            } else {
                assert!(live.contains(&r.primary), "{what}: primary not live");
                assert!(r.backups.iter().all(|b| live.contains(b)), "{what}");
                let want = usize::from(r.wanted_backups).min(live.len() - 1);
                assert_eq!(
                    r.backups.len(),
                    want,
                    "{what}: short of backups, live {live:?}"
                );
            }
            if let Some(was) = before.and_then(|b| b.get(vhost, queue))
                && was.incarnation == r.incarnation
            {
                if was.primary != r.primary {
                    assert!(
                        was.in_sync.contains(&r.primary),
                        "{what}: promoted {} which was not in sync in {was:?}",
                        r.primary
                    );
                    self.elections += 1;
                }
                if r.unavailable && !was.unavailable {
                    self.unavailable_seen += 1;
                }
                if r.in_sync.len() > was.in_sync.len() {
                    self.in_sync_marks += 1;
                }
            }
        }
        // Every member routes each queue to the same primary: the roles'.
        for n in self.nodes.iter().filter(|n| n.map.is_synced()) {
            let v = &n.store.vhosts["/"];
            for (vhost, queue, r) in now.iter() {
                assert_eq!(vhost, "/");
                let q = v.queue(queue).unwrap_or_else(|| {
                    panic!(
                        "seed {seed}: member {} has roles for {queue} but no queue",
                        n.id
                    )
                });
                assert_eq!(
                    q.home.as_deref(),
                    Some(r.primary.as_str()),
                    "seed {seed}: member {} routes {queue} elsewhere",
                    n.id
                );
            }
            for q in v.queues() {
                assert!(
                    now.get("/", &q.name).is_some(),
                    "seed {seed}: member {} has queue {} without roles",
                    n.id,
                    q.name
                );
            }
        }
    }

    fn conf_change(
        &mut self,
        members: Vec<MemberId>,
        joined: Vec<MemberId>,
        failed: Vec<MemberId>,
    ) {
        self.group = members.clone();
        let index = self.next_index();
        self.emit(CpgEvent::ConfChg {
            group: "ringmq".into(),
            index,
            members: members.iter().copied().map(member).collect(),
            joined: joined.into_iter().map(member).collect(),
            left: Vec::new(),
            failed: failed.into_iter().map(member).collect(),
        });
    }

    fn tick(&mut self, flush: bool) {
        let mut due = Vec::new();
        self.pending.retain_mut(|(sender, delay, msg)| {
            if flush || *delay == 0 {
                due.push((*sender, msg.clone()));
                false
            } else {
                *delay -= 1;
                true
            }
        });
        for (sender, msg) in due {
            if !self.group.contains(&sender) {
                continue;
            }
            let index = self.next_index();
            self.emit(CpgEvent::Deliver {
                group: "ringmq".into(),
                index,
                sender,
                payload: Bytes::from(msg.encode()),
            });
        }
    }

    fn live_nodes(&self) -> Vec<usize> {
        self.nodes.iter().map(|n| n.node).collect()
    }

    /// A member joins as node `node` (new, or back after it failed).
    fn join(&mut self, node: usize) {
        let id = self.next_id;
        self.next_id += 1;
        let mut map = ClusterMap::new(id, self.group.is_empty());
        let mut store = Store::new(id);
        let started = CpgEvent::Started {
            index: self.next_index(),
            groups: Vec::new(),
        };
        assert_eq!(
            map.on_event(started, &mut store).unwrap(),
            vec![Action::Join]
        );
        self.nodes.push(Node {
            id,
            node,
            map,
            store,
            log: Vec::new(),
            saved: None,
        });
        let mut members = self.group.clone();
        members.push(id);
        self.conf_change(members, vec![id], Vec::new());
    }

    fn fail(&mut self, victim: MemberId) {
        let members: Vec<MemberId> = self
            .group
            .iter()
            .copied()
            .filter(|id| *id != victim)
            .collect();
        self.nodes.retain(|n| n.id != victim);
        self.conf_change(members, Vec::new(), vec![victim]);
    }

    /// Member `at`'s process restarts on its data directory before anyone noticed: its map
    /// resumes from its last checkpoint (behind its store, which saved every op), replays
    /// what it was given since, then starts (and announces itself again).
    fn restart(&mut self, at: usize) {
        let Some(checkpoint) = self.nodes[at].saved.clone() else {
            return;
        };
        let node = &mut self.nodes[at];
        let mut map = ClusterMap::resume(node.id, checkpoint.clone());
        let replay: Vec<CpgEvent> = node
            .log
            .iter()
            .filter(|e| e.index() > checkpoint.through)
            .cloned()
            .collect();
        let mut replay_actions = Vec::new();
        for ev in replay {
            replay_actions.extend(map.on_event(ev, &mut node.store).expect("replay"));
        }
        assert!(
            !replay_actions.iter().any(|a| matches!(
                a,
                Action::SendHello | Action::SendSnapshot { .. } | Action::Answer { .. }
            )),
            "seed {}: a replay sent something",
            self.seed
        );
        let started = CpgEvent::Started {
            index: self.index,
            groups: vec!["ringmq".into()],
        };
        let actions = map.on_event(started, &mut node.store).expect("start");
        node.map = map;
        self.act(at, replay_actions);
        self.act(at, actions);
        // `check` finds a resumed member whose roles differ from the others'.
        self.check(None);
    }

    fn declare(&mut self, origin: MemberId) {
        let name = format!("q{}", self.rng.gen_range(0..6));
        let home = if self.rng.gen_bool(0.1) {
            node_name(self.rng.gen_range(0..NODES))
        } else {
            let live = self.live_nodes();
            node_name(live[self.rng.gen_range(0..live.len())])
        };
        let mut arguments = FieldTable::default();
        if self.rng.gen_bool(0.6) {
            arguments.insert(
                BACKUPS_ARGUMENT.into(),
                AMQPValue::ShortShortUInt(self.rng.gen_range(0..=3)),
            );
        }
        let op = WiringOp::DeclareQueue {
            name,
            durable: self.rng.gen_bool(0.8),
            exclusive: false,
            auto_delete: false,
            arguments,
            home: Some(home),
            server_named: false,
        };
        self.submit(origin, op);
    }

    fn submit(&mut self, origin: MemberId, op: WiringOp) {
        let delay = self.rng.gen_range(0..4);
        self.pending.push((
            origin,
            delay,
            ClusterMsg::Op {
                origin,
                request: 1,
                vhost: "/".into(),
                op,
            },
        ));
    }

    /// A primary (mostly; sometimes another member) says one of its backups is in sync, or
    /// out of sync; it commits after a random number of events, maybe after an election.
    fn sync_op(&mut self, origin_at: usize) {
        let Some(roles) = self.agreed_roles() else {
            return;
        };
        let all: Vec<(String, QueueRoles)> = roles
            .iter()
            .map(|(_, q, r)| (q.to_owned(), r.clone()))
            .collect();
        if all.is_empty() {
            return;
        }
        let (queue, r) = all[self.rng.gen_range(0..all.len())].clone();
        let node = match r.backups.len() {
            0 => node_name(self.rng.gen_range(0..NODES)),
            n => r.backups[self.rng.gen_range(0..n)].clone(),
        };
        let incarnation = if self.rng.gen_bool(0.9) {
            r.incarnation
        } else {
            r.incarnation + 1
        };
        let primary_member = self
            .nodes
            .iter()
            .find(|n| node_name(n.node) == r.primary && n.map.is_synced())
            .map(|n| n.id);
        let origin = match primary_member {
            Some(id) if self.rng.gen_bool(0.9) => id,
            _ => self.nodes[origin_at].id,
        };
        let op = if self.rng.gen_bool(0.75) {
            WiringOp::BackupInSync {
                queue,
                incarnation,
                node,
            }
        } else {
            WiringOp::BackupOutOfSync {
                queue,
                incarnation,
                node,
            }
        };
        self.submit(origin, op);
    }

    /// A random ring layout: any order (an explicit one may name nodes that are away or
    /// never joined) and any `k`.
    fn layout(&mut self) -> RingLayout {
        use crate::cluster::layout::RingOrder;
        use rand08::seq::SliceRandom;
        let order = match self.rng.gen_range(0..3) {
            0 => RingOrder::Placement,
            1 => RingOrder::ZoneAware,
            _ => {
                let mut names: Vec<String> = (0..NODES).map(node_name).collect();
                names.shuffle(&mut self.rng);
                names.truncate(self.rng.gen_range(1..=NODES));
                RingOrder::Explicit(names)
            }
        };
        let backups = self.rng.gen_bool(0.7).then(|| self.rng.gen_range(0..=3));
        RingLayout { order, backups }
    }

    fn step(&mut self) {
        let synced: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].map.is_synced())
            .collect();
        match self.rng.gen_range(0..20) {
            0 | 1 if self.nodes.len() < NODES => {
                let free: Vec<usize> = (0..NODES)
                    .filter(|n| !self.live_nodes().contains(n))
                    .collect();
                let node = free[self.rng.gen_range(0..free.len())];
                self.join(node);
            }
            2 | 3 if self.nodes.len() > 1 => {
                let at = self.rng.gen_range(0..self.nodes.len());
                let victim = self.nodes[at].id;
                let holders = synced.len();
                if !(self.nodes[at].map.is_synced() && holders == 1) {
                    self.fail(victim);
                }
            }
            4 if !synced.is_empty() => {
                let at = synced[self.rng.gen_range(0..synced.len())];
                self.restart(at);
            }
            5..=9 if !synced.is_empty() => {
                let at = synced[self.rng.gen_range(0..synced.len())];
                self.sync_op(at);
            }
            10 if !synced.is_empty() => {
                let at = synced[self.rng.gen_range(0..synced.len())];
                let op = WiringOp::DeleteQueue {
                    name: format!("q{}", self.rng.gen_range(0..6)),
                    if_unused: false,
                    if_empty: false,
                };
                self.submit(self.nodes[at].id, op);
            }
            11 if !synced.is_empty() => {
                let at = synced[self.rng.gen_range(0..synced.len())];
                let op = WiringOp::SetRingLayout(self.layout());
                self.submit(self.nodes[at].id, op);
            }
            _ if !synced.is_empty() => {
                let at = synced[self.rng.gen_range(0..synced.len())];
                self.declare(self.nodes[at].id);
            }
            _ => {}
        }
        self.tick(false);
    }
}

fn run(seed: u64) -> (usize, usize, usize) {
    let mut m = Model::new(seed);
    m.join(0);
    for _ in 0..300 {
        m.step();
    }
    for _ in 0..10 {
        m.tick(true);
    }
    assert!(m.pending.is_empty(), "seed {seed}: multicasts left over");
    for n in &m.nodes {
        assert!(
            n.map.is_synced(),
            "seed {seed}: member {} never got the map",
            n.id
        );
    }
    m.agreed_roles();
    (m.elections, m.unavailable_seen, m.in_sync_marks)
}

#[test]
fn every_member_takes_the_same_role_decisions_and_promotes_only_in_sync_backups() {
    let default = if cfg!(debug_assertions) { 300 } else { 5_000 };
    let seeds: u64 = std::env::var("CLUSTER_ROLES_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    let (mut elections, mut unavailable, mut marks) = (0, 0, 0);
    for seed in 0..seeds {
        let (e, u, s) = run(seed);
        elections += e;
        unavailable += u;
        marks += s;
    }
    eprintln!(
        "{seeds} seeds: {elections} elections, {unavailable} unavailable, {marks} in-sync marks"
    );
    // The model must reach the decisions it checks, not only quiet clusters.
    assert!(elections > 0, "no election");
    assert!(unavailable > 0, "no queue ever became unavailable");
    assert!(marks > 0, "no backup ever marked in sync");
}
