//! Where a queue's primary is: the member the declare names, or the one the locator picks.

use crate::support::*;
use lapin::options::{BasicGetOptions, BasicNackOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use ringmq_tests::cluster::start_cluster;
use ringmq_tests::reply_code;

#[tokio::test]
async fn the_primary_is_the_member_the_declare_names() {
    let (members, _secret) = start_cluster("proxy-place", 3);
    let (_c0, on_0) = members[0].channel().await;
    let placed = |primary: &str| {
        let mut args = FieldTable::default();
        args.insert(
            "qpid.cluster.primary".into(),
            lapin::types::AMQPValue::LongString(primary.into()),
        );
        args
    };
    // Declared through member 0, placed on member 2 by its node id.
    on_0.queue_declare(
        "placed".into(),
        QueueDeclareOptions::default(),
        placed("proxy-place-2"),
    )
    .await
    .unwrap();
    let admin = members[1].admin_client();
    let q = applied_there(&admin, "placed");
    assert_eq!(q["node"], "proxy-place-2", "{q}");
    // A publish through member 0 lands there; a delete through member 1 is decided there.
    publish_confirmed(&on_0, "placed", "p", 2).await;
    assert_eq!(count(&members[2], "placed").await, (2, 0));
    // The admin API of any member answers with the primary's numbers.
    let (_cg, on_g) = members[2].channel().await;
    let held = on_g
        .basic_get("placed".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("a message");
    let q = admin.get("/api/queues/%2f/placed").unwrap();
    assert_eq!(
        (
            &q.body["messages_ready"],
            &q.body["messages_unacknowledged"],
            &q.body["messages"]
        ),
        (&1.into(), &1.into(), &2.into()),
        "{}",
        q.body
    );
    let listed = admin.get("/api/queues/%2f").unwrap().body;
    let listed: Vec<&serde_json::Value> = listed
        .as_array()
        .unwrap()
        .iter()
        .filter(|q| q["name"] == "placed")
        .collect();
    assert_eq!(listed.len(), 1, "each queue once");
    assert_eq!(listed[0]["messages"], 2);
    on_g.basic_nack(
        held.delivery.delivery_tag,
        BasicNackOptions {
            requeue: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (_c1, on_1) = members[1].channel().await;
    let refused = on_1
        .queue_delete(
            "placed".into(),
            lapin::options::QueueDeleteOptions {
                if_empty: true,
                ..Default::default()
            },
        )
        .await
        .expect_err("the primary knows the queue is not empty");
    assert_eq!(reply_code(&refused), Some(406));
    let (_c1, on_1) = members[1].channel().await;
    let deleted = on_1
        .queue_delete("placed".into(), Default::default())
        .await
        .unwrap();
    assert_eq!(deleted, 2, "delete-ok counts the primary's messages");

    // By AMQP address too; an unknown member is 404 naming it.
    let addr = members[1].uri();
    let addr = addr.split('@').nth(1).unwrap().split('/').next().unwrap();
    on_0.queue_declare(
        "by-address".into(),
        QueueDeclareOptions::default(),
        placed(addr),
    )
    .await
    .unwrap();
    let q = applied_there(&admin, "by-address");
    assert_eq!(q["node"], "proxy-place-1", "{q}");
    let refused = on_0
        .queue_declare(
            "nowhere".into(),
            QueueDeclareOptions::default(),
            placed("no-such-node"),
        )
        .await
        .expect_err("an unknown member");
    assert_eq!(reply_code(&refused), Some(404));
}

#[tokio::test]
async fn a_balanced_locator_spreads_primaries_over_the_members() {
    let (members, _secret) = start_cluster("proxy-balanced", 3);
    let (_c0, on_0) = members[0].channel().await;
    let locator = |name: &str| {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-leader-locator".into(),
            lapin::types::AMQPValue::LongString(name.into()),
        );
        args
    };
    for q in ["b-1", "b-2", "b-3"] {
        on_0.queue_declare(
            q.into(),
            QueueDeclareOptions::default(),
            locator("balanced"),
        )
        .await
        .unwrap();
    }
    let admin = members[1].admin_client();
    let mut nodes: Vec<String> = ["b-1", "b-2", "b-3"]
        .iter()
        .map(|q| {
            applied_there(&admin, q)["node"]
                .as_str()
                .expect("a node")
                .to_owned()
        })
        .collect();
    nodes.sort();
    assert_eq!(
        nodes,
        ["proxy-balanced-0", "proxy-balanced-1", "proxy-balanced-2"],
        "one primary on each member"
    );
    // client-local (the default) stays on the member the declare arrived at.
    on_0.queue_declare(
        "local".into(),
        QueueDeclareOptions::default(),
        locator("client-local"),
    )
    .await
    .unwrap();
    let q = applied_there(&admin, "local");
    assert_eq!(q["node"], "proxy-balanced-0", "{q}");
    let e = on_0
        .queue_declare(
            "odd".into(),
            QueueDeclareOptions::default(),
            locator("random"),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406), "{e}");
}

#[tokio::test]
async fn a_queue_lists_its_backups_in_ring_order_and_a_lost_backup_is_replaced() {
    let (mut members, _secret) = start_cluster("proxy-backups", 4);
    let (_c0, on_0) = members[0].channel().await;
    let args = |backups: lapin::types::AMQPValue| {
        let mut args = FieldTable::default();
        args.insert(
            "qpid.cluster.primary".into(),
            lapin::types::AMQPValue::LongString("proxy-backups-2".into()),
        );
        args.insert("qpid.cluster.backups".into(), backups);
        args
    };
    on_0.queue_declare(
        "two".into(),
        QueueDeclareOptions::default(),
        args(lapin::types::AMQPValue::ShortShortUInt(2)),
    )
    .await
    .unwrap();
    // Without the argument: the member's `default_backups`, 1.
    on_0.queue_declare(
        "one".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let backups = |b: &ringmq_tests::Broker, name: &str| {
        let q = b
            .admin_client()
            .get(&format!("/api/queues/%2f/{name}"))
            .unwrap()
            .body;
        assert_eq!(q["unavailable"], false, "{q}");
        q["backup_nodes"].clone()
    };
    // New backups start out of sync and are marked in sync once their catch-up (an image of
    // the queue) is confirmed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    for name in ["two", "one"] {
        loop {
            let q = members[0]
                .admin_client()
                .get(&format!("/api/queues/%2f/{name}"))
                .unwrap()
                .body;
            if q["in_sync_backup_nodes"] == q["backup_nodes"] {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{name} in sync: {q}");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    for m in &members {
        // The primary's successors in join order, wrapping around; the same on every member.
        assert_eq!(
            backups(m, "two"),
            serde_json::json!(["proxy-backups-3", "proxy-backups-0"])
        );
        assert_eq!(backups(m, "one"), serde_json::json!(["proxy-backups-1"]));
    }
    let listed = members[1].admin_client().get("/api/queues").unwrap().body;
    let two = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["name"] == "two")
        .expect("listed");
    assert_eq!(
        two["backup_nodes"].as_array().map(Vec::len),
        Some(2),
        "{two}"
    );

    // More than three backups: 406 naming the argument and the range.
    let (_c, ch) = members[1].channel().await;
    let refused = ch
        .queue_declare(
            "four".into(),
            QueueDeclareOptions::default(),
            args(lapin::types::AMQPValue::LongInt(4)),
        )
        .await
        .expect_err("at most three backups");
    assert_eq!(reply_code(&refused), Some(406));
    assert!(
        refused.to_string().contains("qpid.cluster.backups"),
        "{refused}"
    );

    // Any member answers for any member, from the cluster map: "two" is 2's with backups 3
    // and 0, "one" is 0's with backup 1, all in sync.
    let held = |n: u64, primaries: u64, backups: u64| {
        serde_json::json!({"id": format!("proxy-backups-{n}"), "owned_queues": primaries,
            "primaries": primaries, "backups": backups, "in_sync_backups": backups})
    };
    let want = [held(0, 1, 1), held(1, 0, 1), held(2, 1, 0), held(3, 0, 1)];
    for m in &members {
        for w in &want {
            let id = w["id"].as_str().unwrap();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let got = m.admin_client().get(&format!("/api/members/{id}")).unwrap();
                assert_eq!(got.status, 200, "{id}: {}", got.reason());
                let seen = serde_json::json!({
                    "id": got.body["id"], "owned_queues": got.body["owned_queues"],
                    "primaries": got.body["primaries"], "backups": got.body["backups"],
                    "in_sync_backups": got.body["in_sync_backups"]});
                if seen == *w {
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "{seen} != {w}");
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
        let unknown = m.admin_client().get("/api/members/nope").unwrap();
        assert_eq!(unknown.status, 404, "{}", unknown.reason());
        assert!(
            unknown.reason().contains("proxy-backups-3"),
            "{}",
            unknown.reason()
        );
    }
    // `ringmqctl cluster ring` shows the same, in ring order.
    let out = std::process::Command::new(ringmq_tests::binary("ringmqctl"))
        .args(["--admin", &members[1].admin_url(), "cluster", "ring"])
        .output()
        .expect("ringmqctl runs");
    assert!(out.status.success(), "{out:?}");
    let table = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<Vec<&str>> = table
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    let expected: Vec<Vec<String>> = (0..4)
        .map(|n| {
            let w = &want[n];
            vec![
                n.to_string(),
                format!("proxy-backups-{n}"),
                w["primaries"].to_string(),
                w["backups"].to_string(),
                w["in_sync_backups"].to_string(),
            ]
        })
        .collect();
    let shown: Vec<Vec<String>> = rows
        .iter()
        .map(|r| [0, 1, 4, 5, 6].iter().map(|&i| r[i].to_owned()).collect())
        .collect();
    assert_eq!(shown, expected, "{table}");

    // Backup 3 is killed: the next member in the ring takes its place.
    members[3].kill();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let now = backups(&members[0], "two");
        if now == serde_json::json!(["proxy-backups-0", "proxy-backups-1"]) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no transfer after the kill: {now}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        backups(&members[1], "two"),
        serde_json::json!(["proxy-backups-0", "proxy-backups-1"])
    );
}

/// The queue as another member's admin API shows it, once that member applied its declare
/// (the declare-ok came from the member that took it; the others apply the committed change
/// a moment later).
fn applied_there(admin: &ringmq::admin_client::AdminClient, queue: &str) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let q = admin.get(&format!("/api/queues/%2f/{queue}")).unwrap();
        if q.status == 200 {
            return q.body;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "queue {queue} not applied on the other member: {}",
            q.reason()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
