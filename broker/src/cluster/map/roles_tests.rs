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
use crate::cluster::roles::BACKUPS_ARGUMENT;
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
                if let Some(c) = node.map.checkpoint() {
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

fn conf(index: u64, members: &[MemberId], joined: &[MemberId], failed: &[MemberId]) -> CpgEvent {
    CpgEvent::ConfChg {
        group: "ringmq".into(),
        index,
        members: members.iter().copied().map(member).collect(),
        joined: joined.iter().copied().map(member).collect(),
        left: Vec::new(),
        failed: failed.iter().copied().map(member).collect(),
    }
}

fn deliver(index: u64, sender: MemberId, msg: ClusterMsg) -> CpgEvent {
    CpgEvent::Deliver {
        group: "ringmq".into(),
        index,
        sender,
        payload: Bytes::from(msg.encode()),
    }
}

fn hello(index: u64, id: MemberId) -> CpgEvent {
    let info = MemberInfo {
        node_id: format!("n{id}"),
        amqp: String::new(),
        admin: String::new(),
        zone: String::new(),
        default_backups: 2,
        ring_order: None,
        places_ring: true,
        lays_out_ring: true,
        process: 0,
    };
    deliver(index, id, ClusterMsg::Hello(info))
}

fn op(index: u64, origin: MemberId, op: WiringOp) -> CpgEvent {
    deliver(
        index,
        origin,
        ClusterMsg::Op {
            origin,
            request: index,
            vhost: "/".into(),
            op,
        },
    )
}

fn declare_on(index: u64, origin: MemberId, name: &str, home: &str) -> CpgEvent {
    op(
        index,
        origin,
        WiringOp::DeclareQueue {
            name: name.into(),
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: FieldTable::default(),
            home: Some(home.into()),
            server_named: false,
        },
    )
}

/// Member 1 founds, 2 and 3 join and announce themselves: the map of member 1.
fn three_members() -> (ClusterMap, Store) {
    let mut map = ClusterMap::new(1, true);
    let mut store = Store::new(1);
    for ev in [
        conf(1, &[1], &[1], &[]),
        hello(2, 1),
        conf(3, &[1, 2], &[2], &[]),
        hello(4, 2),
        conf(5, &[1, 2, 3], &[3], &[]),
        hello(6, 3),
    ] {
        map.on_event(ev, &mut store).unwrap();
    }
    (map, store)
}

#[test]
fn a_declare_gets_the_origins_default_backups_out_of_sync_and_an_incarnation() {
    let (mut map, mut store) = three_members();
    let actions = map
        .on_event(declare_on(7, 1, "q", "n1"), &mut store)
        .unwrap();
    let r = map.roles().get("/", "q").unwrap().clone();
    assert_eq!(r.incarnation, 7);
    assert_eq!(r.primary, "n1");
    assert_eq!(
        r.backups,
        ["n2", "n3"],
        "member 1 announced default_backups 2"
    );
    assert!(r.in_sync.is_empty());
    assert!(actions.contains(&Action::RolesChanged {
        vhost: "/".into(),
        queue: "q".into(),
        was: None,
        now: Some(r),
    }));
}

fn layout_op(
    index: u64,
    order: crate::cluster::layout::RingOrder,
    backups: Option<u8>,
) -> CpgEvent {
    op(
        index,
        1,
        WiringOp::SetRingLayout(RingLayout { order, backups }),
    )
}

#[test]
fn an_explicit_layout_orders_the_ring_moves_no_copy_and_places_a_listed_newcomer() {
    use crate::cluster::layout::RingOrder;
    let (mut map, mut store) = three_members();
    map.on_event(declare_on(7, 1, "q", "n1"), &mut store)
        .unwrap();
    let before = map.roles().get("/", "q").unwrap().clone();
    let order = RingOrder::Explicit(["n3", "n9", "n1", "n2"].map(String::from).to_vec());
    let actions = map
        .on_event(layout_op(8, order.clone(), None), &mut store)
        .unwrap();
    assert!(actions.contains(&Action::MembershipChanged));
    assert_eq!(map.membership().ring(), ["n3", "n1", "n2"]);
    assert_eq!(map.membership().layout_changed_at(), 8);
    assert_eq!(
        map.roles().get("/", "q"),
        Some(&before),
        "no copy moves by itself"
    );
    // The same layout again changes nothing, not even when it was set.
    let again = map.on_event(layout_op(9, order, None), &mut store).unwrap();
    assert!(again.is_empty(), "{again:?}");
    assert_eq!(map.membership().layout_changed_at(), 8);
    // n9 joins: it goes where the list puts it, between n3 and n1.
    map.on_event(conf(10, &[1, 2, 3, 9], &[9], &[]), &mut store)
        .unwrap();
    map.on_event(hello(11, 9), &mut store).unwrap();
    assert_eq!(map.membership().ring(), ["n3", "n9", "n1", "n2"]);
    // A layout no ring can follow is refused, and changes nothing.
    let twice = RingOrder::Explicit(["n1", "n1"].map(String::from).to_vec());
    map.on_event(layout_op(12, twice, None), &mut store)
        .unwrap();
    assert_eq!(map.membership().layout_changed_at(), 8);
    assert_eq!(map.membership().ring(), ["n3", "n9", "n1", "n2"]);
}

#[test]
fn the_layouts_backups_set_the_k_of_queues_without_their_own_and_of_new_ones() {
    use crate::cluster::layout::RingOrder;
    let (mut map, mut store) = three_members();
    map.on_event(declare_on(7, 1, "plain", "n1"), &mut store)
        .unwrap();
    let mut own = FieldTable::default();
    own.insert(BACKUPS_ARGUMENT.into(), AMQPValue::ShortShortUInt(2));
    let declare_own = op(
        8,
        1,
        WiringOp::DeclareQueue {
            name: "own".into(),
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: own,
            home: Some("n1".into()),
            server_named: false,
        },
    );
    map.on_event(declare_own, &mut store).unwrap();
    let marked = op(
        9,
        1,
        WiringOp::BackupInSync {
            queue: "plain".into(),
            incarnation: 7,
            node: "n2".into(),
        },
    );
    map.on_event(marked, &mut store).unwrap();
    // Fewer: the backup out of sync goes first; the queue with its own k keeps it.
    map.on_event(layout_op(10, RingOrder::Placement, Some(1)), &mut store)
        .unwrap();
    let plain = map.roles().get("/", "plain").unwrap();
    assert_eq!(
        (plain.wanted_backups, &plain.backups[..]),
        (1, &["n2".to_owned()][..])
    );
    assert_eq!(plain.in_sync, ["n2"]);
    let own = map.roles().get("/", "own").unwrap();
    assert_eq!((own.wanted_backups, own.backups.len()), (2, 2));
    // A queue declared now takes the layout's k, whatever its member's default.
    map.on_event(declare_on(11, 1, "new", "n2"), &mut store)
        .unwrap();
    assert_eq!(map.roles().get("/", "new").unwrap().backups, ["n3"]);
    // More: the ring's next member joins, out of sync.
    map.on_event(layout_op(12, RingOrder::Placement, Some(2)), &mut store)
        .unwrap();
    let plain = map.roles().get("/", "plain").unwrap();
    assert_eq!(plain.backups, ["n2", "n3"]);
    assert_eq!(plain.in_sync, ["n2"]);
}

#[test]
fn in_sync_counts_only_from_the_primary_for_its_incarnation_and_promotes_on_failure() {
    let (mut map, mut store) = three_members();
    map.on_event(declare_on(7, 2, "q", "n2"), &mut store)
        .unwrap();
    assert_eq!(map.roles().get("/", "q").unwrap().backups, ["n3", "n1"]);
    let mark = |incarnation, node: &str| WiringOp::BackupInSync {
        queue: "q".into(),
        incarnation,
        node: node.into(),
    };
    // Another member than the primary, or another incarnation: nothing.
    map.on_event(op(8, 3, mark(7, "n1")), &mut store).unwrap();
    map.on_event(op(9, 2, mark(6, "n1")), &mut store).unwrap();
    assert!(map.roles().get("/", "q").unwrap().in_sync.is_empty());
    let actions = map.on_event(op(10, 2, mark(7, "n1")), &mut store).unwrap();
    assert!(
        matches!(&actions[0], Action::RolesChanged { now: Some(r), .. } if r.in_sync == ["n1"])
    );
    // The primary's member fails: n1, in sync, is elected over n3, which was not.
    let actions = map
        .on_event(conf(11, &[1, 3], &[], &[2]), &mut store)
        .unwrap();
    let r = map.roles().get("/", "q").unwrap();
    assert_eq!(r.primary, "n1");
    assert_eq!(r.backups, ["n3"]);
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::RolesChanged { now: Some(r), .. } if r.primary == "n1"))
    );
    // A late in-sync mark from the old primary's member is ignored; out of sync is not.
    map.on_event(op(12, 2, mark(7, "n3")), &mut store).unwrap();
    assert!(map.roles().get("/", "q").unwrap().in_sync.is_empty());
    map.on_event(op(13, 1, mark(7, "n3")), &mut store).unwrap();
    assert_eq!(map.roles().get("/", "q").unwrap().in_sync, ["n3"]);
    let out = WiringOp::BackupOutOfSync {
        queue: "q".into(),
        incarnation: 7,
        node: "n3".into(),
    };
    map.on_event(op(14, 3, out), &mut store).unwrap();
    assert!(map.roles().get("/", "q").unwrap().in_sync.is_empty());
}

#[test]
fn a_restart_replaying_ops_its_store_saved_rebuilds_the_same_roles() {
    let (mut map, mut store) = three_members();
    let checkpoint = map.checkpoint().unwrap();
    map.on_event(declare_on(7, 1, "a", "n2"), &mut store)
        .unwrap();
    map.on_event(declare_on(8, 1, "b", "n3"), &mut store)
        .unwrap();
    let delete = WiringOp::DeleteQueue {
        name: "a".into(),
        if_unused: false,
        if_empty: false,
    };
    map.on_event(op(9, 1, delete.clone()), &mut store).unwrap();
    map.on_event(declare_on(10, 1, "a", "n3"), &mut store)
        .unwrap();
    let want = map.roles().clone();
    // The store saved through 10, the checkpoint says 6: the replay skips the store but not
    // the roles.
    let mut resumed = ClusterMap::resume(1, checkpoint);
    for ev in [
        declare_on(7, 1, "a", "n2"),
        declare_on(8, 1, "b", "n3"),
        op(9, 1, delete),
        declare_on(10, 1, "a", "n3"),
    ] {
        resumed.on_event(ev, &mut store).unwrap();
    }
    assert_eq!(resumed.roles(), &want);
    assert_eq!(want.get("/", "a").unwrap().incarnation, 10);
    let actions = resumed.on_event(
        CpgEvent::Started {
            index: 11,
            groups: vec!["ringmq".into()],
        },
        &mut store,
    );
    let homes = actions
        .unwrap()
        .into_iter()
        .filter(|a| matches!(a, Action::RolesChanged { was: None, .. }))
        .count();
    assert_eq!(
        homes, 2,
        "a started member points every queue at its primary again"
    );
}

#[test]
fn roles_travel_in_snapshots_and_checkpoints_and_old_ones_still_read() {
    let (mut map, mut store) = three_members();
    map.on_event(declare_on(7, 1, "q", "n1"), &mut store)
        .unwrap();
    let ClusterMsg::Snapshot(s) = map.snapshot(4, 7, &mut store) else {
        panic!("a snapshot");
    };
    let q = &s.vhosts["/"].queues[0];
    assert_eq!(q.roles.incarnation, 7);
    assert_eq!(q.roles.backups, ["n2", "n3"]);
    assert_eq!(&Roles::from_wiring(&s.vhosts), map.roles());
    let json = serde_json::to_string(&map.checkpoint().unwrap()).unwrap();
    let back: Checkpoint = serde_json::from_str(&json).unwrap();
    assert_eq!(&back.roles, map.roles());
    // A checkpoint written before roles existed.
    let old: Checkpoint =
        serde_json::from_str(r#"{"through":3,"membership":{"members":[]}}"#).unwrap();
    assert_eq!(old.roles, Roles::default());
    // The durable view, what wiring files hold, has no roles.
    let durable = serde_json::to_string(&store.vhosts["/"].durable_wiring()).unwrap();
    assert!(
        !durable.contains("incarnation") && !durable.contains("backups"),
        "{durable}"
    );
}

/// Found by `sim_tests` (seed 10): a member restarted in place resumed a map naming it the
/// primary of a queue and served it until its own hello was applied, while the members that
/// had applied that hello (a restart, to them) had already handed the queue to its in-sync
/// backup — two primaries of one queue in one configuration. It serves only once its own
/// hello of this incarnation is applied, which hands the queue over on its map too.
#[test]
fn a_member_restarted_in_place_is_announced_only_once_its_own_hello_applies() {
    let (mut map, mut store) = three_members();
    map.on_event(declare_on(7, 1, "q", "n1"), &mut store)
        .unwrap();
    let mark = WiringOp::BackupInSync {
        queue: "q".into(),
        incarnation: 7,
        node: "n2".into(),
    };
    map.on_event(op(8, 1, mark), &mut store).unwrap();
    assert_eq!(map.roles().get("/", "q").unwrap().in_sync, ["n2"]);
    // Member 1's process restarts in place: its map resumes and starts.
    let mut resumed = ClusterMap::resume(1, map.checkpoint().unwrap());
    assert!(!resumed.is_announced());
    resumed
        .on_event(
            CpgEvent::Started {
                index: 10,
                groups: vec!["ringmq".into()],
            },
            &mut store,
        )
        .unwrap();
    assert!(resumed.is_synced() && resumed.is_live());
    assert_eq!(resumed.roles().get("/", "q").unwrap().primary, "n1");
    assert!(
        !resumed.is_announced(),
        "it names itself the primary, and must not serve"
    );
    resumed.on_event(hello(11, 1), &mut store).unwrap();
    assert!(resumed.is_announced());
    assert_eq!(
        resumed.roles().get("/", "q").unwrap().primary,
        "n2",
        "its own hello handed the queue to the in-sync backup"
    );
}

#[test]
fn a_joiner_is_announced_once_its_hello_is_applied_or_in_its_snapshot() {
    let (mut map, mut store) = three_members();
    map.on_event(conf(7, &[1, 2, 3, 4], &[4], &[]), &mut store)
        .unwrap();
    let mut joiner = ClusterMap::new(4, false);
    let mut joiner_store = Store::new(4);
    joiner
        .on_event(
            CpgEvent::Started {
                index: 7,
                groups: Vec::new(),
            },
            &mut joiner_store,
        )
        .unwrap();
    joiner
        .on_event(conf(7, &[1, 2, 3, 4], &[4], &[]), &mut joiner_store)
        .unwrap();
    // Its hello commits before the snapshot, which reflects it.
    map.on_event(hello(8, 4), &mut store).unwrap();
    joiner.on_event(hello(8, 4), &mut joiner_store).unwrap();
    assert!(!joiner.is_announced(), "buffered: it holds no map yet");
    let snapshot = map.snapshot(4, 8, &mut store);
    joiner
        .on_event(deliver(9, 1, snapshot), &mut joiner_store)
        .unwrap();
    assert!(joiner.is_synced());
    assert!(joiner.is_announced());
}

/// A hello its process sent again (a send that timed out and committed late, then the retry)
/// is not a restart: the process still serves its queues, and handing them to a backup then
/// would make two primaries (found by `sim_tests`, seed 121, once the failover timing changed).
/// A hello of a new process of the same member still is.
#[test]
fn a_hello_retried_by_the_same_process_is_not_a_restart() {
    let (mut map, mut store) = three_members();
    let with_process = |index: u64, process: u64| {
        let info = MemberInfo {
            node_id: "n1".into(),
            amqp: String::new(),
            admin: String::new(),
            zone: String::new(),
            default_backups: 2,
            ring_order: None,
            places_ring: true,
            lays_out_ring: true,
            process,
        };
        deliver(index, 1, ClusterMsg::Hello(info))
    };
    map.on_event(with_process(7, 41), &mut store).unwrap();
    map.on_event(declare_on(8, 1, "q", "n1"), &mut store)
        .unwrap();
    let mark = WiringOp::BackupInSync {
        queue: "q".into(),
        incarnation: 8,
        node: "n2".into(),
    };
    map.on_event(op(9, 1, mark), &mut store).unwrap();
    map.on_event(with_process(10, 41), &mut store).unwrap();
    let r = map.roles().get("/", "q").unwrap();
    assert_eq!(r.primary, "n1", "a retried hello hands nothing over");
    assert_eq!(r.in_sync, ["n2"]);
    map.on_event(with_process(11, 42), &mut store).unwrap();
    assert_eq!(
        map.roles().get("/", "q").unwrap().primary,
        "n2",
        "a new process's hello is a restart in place"
    );
}
