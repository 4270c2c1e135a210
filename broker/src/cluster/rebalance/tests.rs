//! The rebalance's plan and its progress, driven by hand-made roles: no map, no I/O.

use super::*;
use crate::cluster::MemberInfo;

/// Members n1..=n`count` in ring order, all announced.
fn membership(count: u64) -> Membership {
    let mut m = Membership::default();
    let ids: Vec<u64> = (1..=count).collect();
    m.on_conf_change(&ids);
    for id in ids {
        m.on_hello(
            id,
            MemberInfo {
                node_id: format!("n{id}"),
                amqp: String::new(),
                admin: String::new(),
                zone: String::new(),
                default_backups: 1,
                ring_order: None,
                places_ring: true,
                lays_out_ring: true,
                holds_for_sessions: true,
                process: 0,
            },
        );
    }
    m
}

/// `count` queues q0.. with their primary on n1 and one backup, every backup in sync.
fn all_on_n1(count: usize, ring: &[String]) -> Roles {
    let mut roles = Roles::default();
    for i in 0..count {
        let mut r = QueueRoles::new(i as u64 + 1, "n1", 1, ring);
        for b in r.backups.clone() {
            r.mark_in_sync(&b);
        }
        roles.set("/", &format!("q{i}"), Some(r));
    }
    roles
}

fn states(r: &Rebalance) -> Vec<&MoveState> {
    r.moves.iter().map(|m| &m.state).collect()
}

/// Applies the requests `advance` returned, as the map does.
fn apply(roles: &mut Roles, requests: Vec<(String, String, QueueRoles)>) {
    for (vhost, queue, now) in requests {
        roles.set(&vhost, &queue, Some(now));
    }
}

/// Finishes every change under way, as the primaries would once the new copies caught up:
/// moves switch, replacements drop the old backup.
fn switch_all(roles: &mut Roles, ring: &[String]) {
    let changing: Vec<(String, String)> = roles
        .iter()
        .filter(|(_, _, r)| r.moving_to.is_some() || r.replacing.is_some())
        .map(|(v, q, _)| (v.to_owned(), q.to_owned()))
        .collect();
    for (v, q) in changing {
        let mut r = roles.get(&v, &q).unwrap().clone();
        if let Some(to) = r.moving_to.clone() {
            r.mark_in_sync(&to);
            assert!(r.switch(&to, ring));
        } else if let Some(new) = r.replacing.as_deref().map(|x| x.new.clone()) {
            r.mark_in_sync(&new);
            r.reconcile(ring);
            assert!(r.replacing.is_none(), "{r:?}");
        }
        roles.set(&v, &q, Some(r));
    }
}

#[test]
fn the_plan_evens_primaries_over_the_active_members_and_leaves_moving_queues_alone() {
    let m = membership(3);
    let ring = m.ring();
    let mut roles = all_on_n1(9, &ring);
    let mut busy = roles.get("/", "q0").unwrap().clone();
    busy.request_move("n2", &ring).unwrap();
    roles.set("/", "q0", Some(busy));
    let moves = plan(&roles, &m, None);
    assert_eq!(moves.len(), 5, "8 plannable queues on n1: 3 stay, 5 move");
    assert!(moves.iter().all(|p| p.from == "n1" && p.queue != "q0"));
    let to = |n: &str| moves.iter().filter(|p| p.to == n).count();
    // q0 counts for nobody while it moves: n1 keeps 3, n2 and n3 get 3 and 2 (or 2 and 3).
    assert_eq!(to("n2") + to("n3"), 5);
    assert!(to("n2").abs_diff(to("n3")) <= 1);
    // Deterministic: every member plans the same.
    assert_eq!(moves, plan(&roles, &m, None));
}

#[test]
fn a_draining_member_gets_nothing_and_its_queues_are_not_planned() {
    let mut m = membership(3);
    let ring = m.ring();
    let roles = all_on_n1(6, &ring);
    m.set_draining("n3", true);
    let moves = plan(&roles, &m, None);
    assert_eq!(moves.len(), 3);
    assert!(moves.iter().all(|p| p.to == "n2"));
    m.set_draining("n1", true);
    assert!(
        plan(&roles, &m, None).is_empty(),
        "the drain moves n1's queues"
    );
}

#[test]
fn moves_start_within_the_concurrency_and_the_plan_ends_done() {
    let m = membership(3);
    let ring = m.ring();
    let mut roles = all_on_n1(6, &ring);
    let mut r = Rebalance::start(10, 2, &roles, &m);
    assert_eq!(r.moves.len(), 4);
    let none = BTreeSet::new();
    let mut rounds = 0;
    while !r.finished() {
        rounds += 1;
        assert!(rounds < 10, "{r:?}");
        let (requests, _) = r.advance(&roles, &ring, &none);
        let running = states(&r)
            .iter()
            .filter(|s| ***s == MoveState::Running)
            .count();
        assert!(running <= 2, "{r:?}");
        apply(&mut roles, requests);
        switch_all(&mut roles, &ring);
    }
    assert_eq!(r.status(), "done");
    let held = roles.held();
    let primaries: Vec<u64> = ring.iter().map(|n| held[n].primaries).collect();
    assert_eq!(primaries, [2, 2, 2]);
    // Then the backups followed the ring: each member backs its predecessor's two queues.
    let backups: Vec<u64> = ring.iter().map(|n| held[n].backups).collect();
    assert_eq!(backups, [2, 2, 2]);
    assert!(r.moves.iter().any(|m| m.backup), "{r:?}");
    assert!(backup_plan(&roles, &ring, &none).is_empty());
    for (_, _, q) in roles.iter() {
        let at = ring.iter().position(|n| *n == q.primary).unwrap();
        assert_eq!(q.backups, [ring[(at + 1) % 3].clone()], "{q:?}");
    }
}

#[test]
fn a_replaced_backup_goes_only_once_the_new_one_is_in_sync() {
    let m = membership(3);
    let ring = m.ring();
    let mut r = QueueRoles::new(1, "n1", 1, &ring);
    r.mark_in_sync("n2");
    assert_eq!(r.request_replace("n2", "n3", &ring), Ok(true));
    assert_eq!(r.request_replace("n2", "n3", &ring), Ok(false));
    assert!(r.request_move("n3", &ring).is_err(), "one change at a time");
    r.reconcile(&ring);
    assert_eq!(r.backups, ["n2", "n3"], "both while the new one catches up");
    assert_eq!(r.in_sync, ["n2"]);
    r.mark_in_sync("n3");
    r.reconcile(&ring);
    assert_eq!(
        (r.backups.clone(), r.in_sync.clone()),
        (vec!["n3".to_owned()], vec!["n3".to_owned()])
    );
    assert_eq!(r.replacing, None);
    // Called off when the new backup restarts: it goes, the old one stays.
    let mut r = QueueRoles::new(1, "n1", 1, &ring);
    r.mark_in_sync("n2");
    r.request_replace("n2", "n3", &ring).unwrap();
    r.mark_in_sync("n3");
    r.restarted("n3", &ring);
    assert_eq!(
        (r.backups.clone(), r.replacing.clone()),
        (vec!["n2".to_owned()], None)
    );
    assert_eq!(r.in_sync, ["n2"]);
    assert!(
        r.request_replace("n1", "n3", &ring).is_err(),
        "the primary is no backup"
    );
    assert!(
        r.request_replace("n2", "n2", &ring).is_err(),
        "a copy already"
    );
}

#[test]
fn a_move_called_off_fails_a_deleted_queue_fails_and_a_stop_skips_the_rest() {
    let m = membership(3);
    let ring = m.ring();
    let mut roles = all_on_n1(9, &ring);
    let mut r = Rebalance::start(10, 2, &roles, &m);
    assert_eq!(r.moves.len(), 6);
    let none = BTreeSet::new();
    let (requests, changed) = r.advance(&roles, &ring, &none);
    assert!(changed);
    assert_eq!(requests.len(), 2);
    apply(&mut roles, requests);
    // The first move's target restarted: the roles call it off.
    let first = r.moves[0].clone();
    let mut q = roles.get("/", &first.queue).unwrap().clone();
    q.restarted(&first.to, &ring);
    roles.set("/", &first.queue, Some(q));
    // The second one's queue is deleted.
    roles.set("/", &r.moves[1].queue.clone(), None);
    let (requests, _) = r.advance(&roles, &ring, &none);
    assert!(matches!(r.moves[0].state, MoveState::Failed(_)), "{r:?}");
    assert!(matches!(r.moves[1].state, MoveState::Failed(_)), "{r:?}");
    assert_eq!(requests.len(), 2, "two more start in their place");
    apply(&mut roles, requests);
    assert!(r.stop());
    assert!(!r.stop(), "stopping twice changes nothing");
    assert_eq!(r.status(), "running", "the two under way finish");
    switch_all(&mut roles, &ring);
    let (requests, _) = r.advance(&roles, &ring, &none);
    assert!(requests.is_empty());
    assert_eq!(
        states(&r)
            .iter()
            .filter(|s| ***s == MoveState::Skipped)
            .count(),
        2
    );
    assert_eq!(r.status(), "failed");
}

#[test]
fn a_queue_whose_primary_changed_since_the_plan_is_not_moved() {
    let m = membership(3);
    let ring = m.ring();
    let mut roles = all_on_n1(3, &ring);
    let mut r = Rebalance::start(10, 1, &roles, &m);
    let planned = r.moves[0].clone();
    // An election (or another move) put the queue elsewhere before its turn.
    let mut q = roles.get("/", &planned.queue).unwrap().clone();
    let other = ring
        .iter()
        .find(|n| **n != planned.to && **n != "n1")
        .unwrap();
    q.request_move(other, &ring).unwrap();
    q.mark_in_sync(other);
    assert!(q.switch(other, &ring));
    roles.set("/", &planned.queue, Some(q));
    let (requests, _) = r.advance(&roles, &ring, &BTreeSet::new());
    assert!(
        matches!(&r.moves[0].state, MoveState::Failed(why) if why.contains("primary changed")),
        "{r:?}"
    );
    assert_eq!(requests.len(), 1, "the next one starts instead");
}

/// Member `id` (node `n{id}`, in `zone`) joins: its conf change and hello, then its place
/// on the ring, as the map gives it.
fn join(m: &mut Membership, roles: &Roles, id: u64, zone: &str, order: Option<u32>) -> bool {
    let mut ids: Vec<u64> = m.members().iter().map(|s| s.id).collect();
    ids.push(id);
    m.on_conf_change(&ids);
    let info = MemberInfo {
        node_id: format!("n{id}"),
        amqp: String::new(),
        admin: String::new(),
        zone: zone.to_owned(),
        default_backups: 1,
        ring_order: order,
        places_ring: true,
        lays_out_ring: true,
        holds_for_sessions: true,
        process: 0,
    };
    let at = insertion(roles, m, &info);
    m.on_hello(id, info);
    m.place(&format!("n{id}"), at)
}

#[test]
fn a_new_member_goes_where_it_keeps_zones_apart() {
    let mut m = Membership::default();
    let roles = Roles::default();
    for (id, zone) in [(1, "a"), (2, "a"), (3, "b")] {
        assert!(join(&mut m, &roles, id, zone, None));
    }
    assert_eq!(m.ring(), ["n1", "n2", "n3"], "no better gap: the end");
    assert!(join(&mut m, &roles, 4, "b", None));
    assert_eq!(
        m.ring(),
        ["n1", "n4", "n2", "n3"],
        "between the two of zone a"
    );
    assert!(!m.is_newcomer("n1"), "the founder joined nobody");
    assert!(m.is_newcomer("n2") && m.is_newcomer("n4"));
    assert!(m.take_newcomer("n4"));
    assert!(!m.take_newcomer("n4"), "handed its share once");
}

#[test]
fn a_configured_order_places_a_member_and_it_comes_back_to_its_place() {
    let mut m = Membership::default();
    let roles = Roles::default();
    join(&mut m, &roles, 1, "", Some(0));
    join(&mut m, &roles, 2, "", Some(4));
    join(&mut m, &roles, 3, "", Some(2));
    assert_eq!(m.ring(), ["n1", "n3", "n2"]);
    m.on_conf_change(&[1, 2]);
    assert_eq!(
        m.ring(),
        ["n1", "n2"],
        "only members in the group hold a place"
    );
    assert!(
        !join(&mut m, &roles, 3, "", Some(9)),
        "not new: a changed order moves nobody"
    );
    assert_eq!(m.ring(), ["n1", "n3", "n2"], "back in its old place");
}

#[test]
fn a_joiner_takes_its_share_from_its_neighbours_and_ships_backups_to_itself() {
    let mut m = Membership::default();
    let mut roles = Roles::default();
    for id in 1..=3 {
        join(&mut m, &roles, id, "", None);
    }
    let ring = m.ring();
    for i in 0..30 {
        let primary = &ring[i % 3];
        let mut r = QueueRoles::new(i as u64 + 1, primary, 1, &ring);
        for b in r.backups.clone() {
            r.mark_in_sync(&b);
        }
        roles.set("/", &format!("q{i}"), Some(r));
    }
    assert!(join(&mut m, &roles, 4, "", None));
    let ring = m.ring();
    assert_eq!(ring, ["n1", "n2", "n3", "n4"]);
    let mut r = Rebalance::join(40, "n4", &roles, &m);
    assert_eq!(r.scope, ["n1", "n3", "n4"], "its neighbours on the ring");
    assert!(
        r.moves.iter().all(|p| p.to == "n4" && p.from != "n2"),
        "{r:?}"
    );
    let none = BTreeSet::new();
    let mut rounds = 0;
    while !r.finished() {
        rounds += 1;
        assert!(rounds < 40, "{r:?}");
        let (requests, _) = r.advance(&roles, &ring, &none);
        apply(&mut roles, requests);
        switch_all(&mut roles, &ring);
    }
    assert_eq!(r.status(), "done", "{r:?}");
    let held = roles.held();
    let primaries: Vec<u64> = ring.iter().map(|n| held[n].primaries).collect();
    assert_eq!(primaries[1], 10, "n2 is no neighbour: {primaries:?}");
    assert!((6..=7).contains(&primaries[3]), "{primaries:?}");
    assert!(r.moves.iter().any(|p| p.backup && p.to == "n4"), "{r:?}");
    for (_, q, qr) in roles.iter() {
        let at = ring.iter().position(|n| *n == qr.primary).unwrap();
        assert_eq!(qr.backups, [ring[(at + 1) % 4].clone()], "{q}: {qr:?}");
    }
}
