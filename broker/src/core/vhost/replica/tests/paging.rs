//! Flow-to-disk on a backup: a replica obeys the memory budget its primary obeys, pages the
//! same messages out under its own keys, releases their page records on the replicated
//! removals, and after a promotion hands its on-disk bodies to the server to read back.

use super::*;
use crate::core::DiskBody;
use crate::core::queue::{Queue, QueueImage};
use crate::core::vhost::Limits;

/// Bytes of bodies a queue keeps in memory here: two of the two-byte bodies below.
const BUDGET_BYTES: usize = 4;

/// [`member`] with the memory budget, and a name seed of its own so that its queue's uid,
/// the first half of every page key, differs from the other members'.
fn paged_member(node: &str) -> VHost {
    let mut v = VHost::new("/", u64::from(node.as_bytes()[0]));
    v.set_limits(Limits {
        queue_memory_budget_bytes: Some(BUDGET_BYTES),
        ..Default::default()
    });
    v.set_record_ops(true);
    v.set_node(node);
    v.channel_open(CH);
    v.queue_declare(
        1,
        QueueDeclare {
            name: "q".into(),
            durable: true,
            ..Default::default()
        },
        0,
    )
    .unwrap();
    v.set_queue_home("q", "a");
    v
}

fn publish_transient(v: &mut VHost, body: &'static str, fx: &mut Effects) {
    let m = Arc::new(Message::authored(
        "".into(),
        "q".into(),
        Properties::default().with_delivery_mode(1),
        Bytes::from_static(body.as_bytes()),
    ));
    v.publish("", "q", m, 0, fx).unwrap();
}

/// `m1`, `m2` persistent (in memory), `t3`, `t4` transient and `m5` persistent (over the
/// budget) on `a`; returns the ops.
fn five_messages(a: &mut VHost) -> Vec<QueueOp> {
    let mut fx = Effects::default();
    publish(a, "m1", &mut fx);
    publish(a, "m2", &mut fx);
    publish_transient(a, "t3", &mut fx);
    publish_transient(a, "t4", &mut fx);
    publish(a, "m5", &mut fx);
    fx.ops
}

/// A body's page key as (queue uid, message id); `None` for a body in memory.
type Key = Option<(u64, u64)>;

/// Each ready message's page key.
fn keys(q: &Queue) -> Vec<Key> {
    q.ready()
        .map(|e| e.message.body.on_disk().map(|k| (k.uid, k.id)))
        .collect()
}

fn page_out_ids(fx: &Effects) -> Vec<u64> {
    fx.page_out.iter().map(|p| p.id).collect()
}

#[test]
fn a_backup_pages_out_what_its_primary_pages_out_under_its_own_keys() {
    let mut a = paged_member("a");
    let mut b = paged_member("b");
    let ops = five_messages(&mut a);
    let mut bfx = Effects::default();
    b.apply_replicated("q", &ops, &mut bfx).unwrap();

    let (qa, qb) = (a.queue("q").unwrap(), b.queue("q").unwrap());
    let ub = qb.uid;
    assert_ne!(ub, qa.uid, "each member keys its own records");
    assert_eq!(qb.resident_bytes(), BUDGET_BYTES);
    assert_eq!(qb.resident_bytes(), qa.resident_bytes());
    assert_eq!(
        keys(qb),
        [None, None, Some((ub, 3)), Some((ub, 4)), Some((ub, 5))]
    );
    // The transient ones need page records of their own, written with their bodies; the
    // persistent one's body is in the Enqueued record the backup journals.
    assert_eq!(page_out_ids(&bfx), [3, 4]);
    assert!(
        bfx.page_out
            .iter()
            .all(|p| p.uid == ub && p.message.body.in_memory().is_some())
    );
    let journaled = bfx
        .ops
        .iter()
        .find_map(|op| match &op.kind {
            OpKind::Enqueue { id: 5, message, .. } => Some(message.clone()),
            _ => None,
        })
        .expect("m5 is journalled");
    assert_eq!(journaled.body.in_memory().map(|b| &b[..]), Some(&b"m5"[..]));
    assert_eq!(qb.owned_pages(), 2);

    // The primary's consumer takes everything and acks it: the replicated acks release
    // the backup's page records.
    let mut fx = Effects::default();
    consume(&mut a, 10, &mut fx);
    let last = fx.deliveries.last().unwrap().delivery_tag;
    a.basic_ack(CH, last, true, 0, &mut fx).unwrap();
    let mut bfx = Effects::default();
    b.apply_replicated("q", &fx.ops, &mut bfx).unwrap();
    bfx.page_released.sort_unstable();
    assert_eq!(bfx.page_released, [(ub, 3), (ub, 4)]);
    let qb = b.queue("q").unwrap();
    assert_eq!((qb.resident_bytes(), qb.owned_pages()), (0, 0));
}

#[test]
fn a_promoted_backup_hands_its_paged_bodies_to_the_server_and_to_catch_up_images() {
    let mut a = paged_member("a");
    let mut b = paged_member("b");
    let mut ops = five_messages(&mut a);
    let mut fx = Effects::default();
    consume(&mut a, 1, &mut fx);
    ops.append(&mut fx.ops);
    let mut bfx = Effects::default();
    b.apply_replicated("q", &ops, &mut bfx).unwrap();
    let ub = b.queue("q").unwrap().uid;

    // What a catch-up from this member would send: the paged bodies by this member's keys,
    // which its replicator reads back from this member's journal.
    b.set_queue_home("q", "b");
    let image = b.queue_image("q").unwrap();
    let image_keys: Vec<Option<DiskBody>> = image
        .entries
        .iter()
        .map(|e| e.message.body.on_disk())
        .collect();
    assert_eq!(
        image_keys,
        [None, None, Some(3), Some(4), Some(5)].map(|id: Option<u64>| id.map(|id| DiskBody {
            uid: ub,
            id,
            len: 2
        }))
    );

    let mut pfx = Effects::default();
    assert_eq!(b.promote_replica("q", 0, &mut pfx).unwrap(), 1);
    consume(&mut b, 10, &mut pfx);
    let delivered: Vec<(u64, Key, bool)> = pfx
        .deliveries
        .iter()
        .map(|d| {
            let key = d.message.body.on_disk().map(|k| (k.uid, k.id));
            (d.delivery_tag, key, d.redelivered)
        })
        .collect();
    assert_eq!(
        delivered,
        [
            (1, None, true),
            (2, None, false),
            (3, Some((ub, 3)), false),
            (4, Some((ub, 4)), false),
            (5, Some((ub, 5)), false),
        ],
        "in order; the server reads the on-disk bodies back before it writes them"
    );
}

#[test]
fn a_backup_installing_an_image_keeps_only_the_budget_in_memory() {
    // The primary's image, its bodies in memory as a catch-up sends them; m1 to t3 are out
    // with a consumer.
    let mut a = member("a");
    let mut fx = Effects::default();
    five_messages(&mut a);
    consume(&mut a, 3, &mut fx);
    let image = a.queue_image("q").unwrap();

    let mut b = paged_member("b");
    let mut bfx = Effects::default();
    for chunk in image.into_chunks(2) {
        b.install_replica("q", chunk, &mut bfx).unwrap();
    }
    let qb = b.queue("q").unwrap();
    let ub = qb.uid;
    assert_eq!(qb.resident_bytes(), BUDGET_BYTES);
    assert_eq!(
        page_out_ids(&bfx),
        [3, 4],
        "the transient ones, delivered or not"
    );
    assert_eq!(qb.owned_pages(), 2);
    assert_eq!(keys(qb), [Some((ub, 4)), Some((ub, 5))]);
    assert!(
        bfx.ops.iter().all(|op| match &op.kind {
            OpKind::Enqueue { message, .. } => message.body.in_memory().is_some(),
            _ => true,
        }),
        "the journal gets every body"
    );

    b.set_queue_home("q", "b");
    let mut pfx = Effects::default();
    assert_eq!(b.promote_replica("q", 0, &mut pfx).unwrap(), 3);
    consume(&mut b, 10, &mut pfx);
    let delivered: Vec<(Option<u64>, bool)> = pfx
        .deliveries
        .iter()
        .map(|d| (d.message.body.on_disk().map(|k| k.id), d.redelivered))
        .collect();
    assert_eq!(
        delivered,
        [
            (None, true),
            (None, true),
            (Some(3), true),
            (Some(4), false),
            (Some(5), false)
        ]
    );
}

#[test]
fn a_purge_or_a_reset_of_a_replica_releases_its_page_records() {
    let mut a = paged_member("a");
    let mut b = paged_member("b");
    let mut fx = Effects::default();
    for body in ["t1", "t2", "t3", "t4"] {
        publish_transient(&mut a, body, &mut fx);
    }
    a.queue_purge(0, "q", &mut fx).unwrap();
    let ua = a.queue("q").unwrap().uid;
    fx.page_released.sort_unstable();
    assert_eq!(fx.page_released, [(ua, 3), (ua, 4)], "the primary's purge");
    let mut bfx = Effects::default();
    b.apply_replicated("q", &fx.ops, &mut bfx).unwrap();
    let ub = b.queue("q").unwrap().uid;
    assert_eq!(page_out_ids(&bfx), [3, 4]);
    bfx.page_released.sort_unstable();
    assert_eq!(bfx.page_released, [(ub, 3), (ub, 4)]);

    // A stale replica holding page records is emptied by a catch-up's first chunk.
    fx.ops.clear();
    for body in ["t5", "t6", "t7"] {
        publish_transient(&mut a, body, &mut fx);
    }
    let mut bfx = Effects::default();
    b.apply_replicated("q", &fx.ops, &mut bfx).unwrap();
    assert_eq!(page_out_ids(&bfx), [7]);
    for chunk in QueueImage::default().into_chunks(1) {
        b.install_replica("q", chunk, &mut bfx).unwrap();
    }
    assert_eq!(bfx.page_released, [(ub, 7)]);
    assert_eq!(b.queue("q").unwrap().owned_pages(), 0);
}
