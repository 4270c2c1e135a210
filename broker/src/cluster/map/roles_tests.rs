//! The queue roles the cluster map keeps, scenario by scenario: a declare's roles, in-sync
//! marks from the primary only, a restart's replay, roles in snapshots and checkpoints, and
//! when a member counts as announced. The randomised model is `roles_model.rs`; the ring
//! layout's effect on roles is `layout_tests.rs`. The event builders here are theirs too.

use super::tests::{Store, member};
use super::*;
use crate::amqp::FieldTable;
use crate::cluster::MemberInfo;
use crate::core::WiringOp;
use bytes::Bytes;

pub(super) fn conf(
    index: u64,
    members: &[MemberId],
    joined: &[MemberId],
    failed: &[MemberId],
) -> CpgEvent {
    CpgEvent::ConfChg {
        group: "ringmq".into(),
        index,
        members: members.iter().copied().map(member).collect(),
        joined: joined.iter().copied().map(member).collect(),
        left: Vec::new(),
        failed: failed.iter().copied().map(member).collect(),
    }
}

pub(super) fn deliver(index: u64, sender: MemberId, msg: ClusterMsg) -> CpgEvent {
    CpgEvent::Deliver {
        group: "ringmq".into(),
        index,
        sender,
        payload: Bytes::from(msg.encode()),
    }
}

pub(super) fn hello(index: u64, id: MemberId) -> CpgEvent {
    let info = MemberInfo {
        node_id: format!("n{id}"),
        amqp: String::new(),
        admin: String::new(),
        zone: String::new(),
        default_backups: 2,
        ring_order: None,
        places_ring: true,
        lays_out_ring: true,
        holds_for_sessions: true,
        process: 0,
    };
    deliver(index, id, ClusterMsg::Hello(info))
}

pub(super) fn op(index: u64, origin: MemberId, op: WiringOp) -> CpgEvent {
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

pub(super) fn declare_on(index: u64, origin: MemberId, name: &str, home: &str) -> CpgEvent {
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
pub(super) fn three_members() -> (ClusterMap, Store) {
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
    let checkpoint = map.checkpoint(&mut store).unwrap();
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
    let json = serde_json::to_string(&map.checkpoint(&mut store).unwrap()).unwrap();
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
    let mut resumed = ClusterMap::resume(1, map.checkpoint(&mut store).unwrap());
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
            holds_for_sessions: true,
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
