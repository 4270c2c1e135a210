//! The ring layout in the cluster map (`WiringOp::SetRingLayout`, `cluster/layout.rs`): an
//! explicit order reorders every member's ring without moving a copy and places a listed
//! newcomer, and the layout's `backups` sets the `k` of the queues without their own.

use super::roles_tests::{conf, declare_on, hello, op, three_members};
use super::*;
use crate::amqp::{AMQPValue, FieldTable};
use crate::cluster::layout::RingLayout;
use crate::cluster::roles::BACKUPS_ARGUMENT;
use crate::core::WiringOp;

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
