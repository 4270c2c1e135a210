//! `ringmqctl cluster layout` (`PUT /api/cluster/ring`): the ring of a live three-member
//! cluster is put in another order — every member reports the same order at once and no
//! copy moves until a rebalance puts every backup on its primary's new ring successor — and
//! the layout's `backups` gives every queue declared without its own one more backup, which
//! catches up. Every confirmed message is still there; a layout no ring can follow is
//! refused with the reason.

use crate::{ctl, get, publish_confirmed};
use lapin::options::{ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use ringmq_tests::cluster::start_cluster;
use ringmq_tests::{Broker, queue_counts};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// Queues declared through each member (their primaries are there).
const PER_MEMBER: usize = 2;
/// Persistent messages in each.
const MESSAGES: usize = 5;

/// Declares `PER_MEMBER` queues through `b` without `qpid.cluster.backups` and fills them,
/// every message confirmed.
async fn fill(b: &Broker, tag: usize) -> Vec<String> {
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut names = Vec::new();
    for i in 0..PER_MEMBER {
        let name = format!("layout-{tag}-{i}");
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.queue_declare(name.as_str().into(), durable, FieldTable::default())
            .await
            .unwrap();
        publish_confirmed(&ch, &name, (0..MESSAGES).map(|m| format!("{name}-m{m}"))).await;
        names.push(name);
    }
    names
}

/// Each queue's (primary, backups, in-sync backups) by `b`'s answer.
async fn roles(b: &Broker) -> Vec<(String, String, Vec<String>, Vec<String>)> {
    let nodes = |v: &Value| -> Vec<String> {
        (v.as_array().into_iter().flatten())
            .map(|n| n.as_str().unwrap().to_owned())
            .collect()
    };
    let queues = get(b, "/api/queues/%2F").await;
    (queues.as_array().into_iter().flatten())
        .map(|q| {
            (
                q["name"].as_str().unwrap().to_owned(),
                q["node"].as_str().unwrap().to_owned(),
                nodes(&q["backup_nodes"]),
                nodes(&q["in_sync_backup_nodes"]),
            )
        })
        .collect()
}

/// The `n` members after `node` on `ring`.
fn successors(ring: &[String], node: &str, n: usize) -> Vec<String> {
    let at = ring.iter().position(|r| r == node).unwrap();
    (1..=n)
        .map(|i| ring[(at + i) % ring.len()].clone())
        .collect()
}

/// Waits (60 s at most) until every queue has `k` backups, the primary's next ring members,
/// all in sync.
async fn wait_for_ring_backups(b: &Broker, ring: &[String], k: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = roles(b).await;
        let off: Vec<_> = (now.iter())
            .filter(|(_, primary, backups, in_sync)| {
                let want = successors(ring, primary, k);
                *backups != want || *in_sync != want
            })
            .collect();
        if off.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "backups not on the ring successors (k={k}, ring {ring:?}): {off:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn assert_all_there(b: &Broker, names: &[String]) {
    for name in names {
        let (_c, ch) = b.channel().await;
        let (n, _) = queue_counts(&ch, name).await.unwrap();
        assert_eq!(n as usize, MESSAGES, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_ring_order_and_k_are_followed_by_every_backup_after_a_rebalance() {
    let (members, _secret) = start_cluster("ring-layout", 3);
    let mut names = Vec::new();
    for (i, m) in members.iter().enumerate() {
        names.extend(fill(m, i).await);
    }
    let joined: Vec<String> = (0..3).map(|i| format!("ring-layout-{i}")).collect();
    let layout = get(&members[1], "/api/cluster/ring").await;
    assert_eq!(layout["order"], "placement", "{layout}");
    assert_eq!(layout["backups"], Value::Null, "{layout}");
    assert_eq!(layout["ring"], json!(joined), "{layout}");
    wait_for_ring_backups(&members[0], &joined, 1).await;
    let before = roles(&members[0]).await;

    // Reversed: every member orders its ring the same, and nothing moves by itself.
    let reversed: Vec<String> = joined.iter().rev().cloned().collect();
    let (ok, out) = ctl(
        &members[0],
        &["cluster", "layout", "--order", &reversed.join(",")],
    )
    .await;
    assert!(ok, "{out}");
    assert!(out.contains("order: explicit"), "{out}");
    for m in &members {
        let now = get(m, "/api/cluster/ring").await;
        assert_eq!(now["ring"], json!(reversed), "{now}");
        assert_eq!(now["order"], json!(reversed), "{now}");
        assert!(now["changed_at"].as_u64().unwrap() > 0, "{now}");
    }
    assert_eq!(roles(&members[2]).await, before, "no copy moved by itself");
    let view = get(&members[1], "/api/cluster/rebalance").await;
    assert_eq!(view["balanced"], false, "{view}");
    assert_eq!(
        view["backup_plan"].as_array().map(Vec::len),
        Some(names.len()),
        "every backup is off its primary's new successor: {view}"
    );

    let (ok, out) = ctl(&members[2], &["cluster", "rebalance", "--apply", "--wait"]).await;
    assert!(ok, "{out}");
    wait_for_ring_backups(&members[1], &reversed, 1).await;
    assert_all_there(&members[0], &names).await;

    // k = 2 for the queues without their own: each gets the next member too, caught up.
    let (ok, out) = ctl(&members[1], &["cluster", "layout", "--backups", "2"]).await;
    assert!(ok, "{out}");
    assert!(out.contains("backups: 2"), "{out}");
    let now = get(&members[2], "/api/cluster/ring").await;
    assert_eq!(now["order"], json!(reversed), "the order stays: {now}");
    wait_for_ring_backups(&members[2], &reversed, 2).await;
    assert_all_there(&members[1], &names).await;

    // Refused, with what to fix, and nothing changes.
    let (ok, out) = ctl(
        &members[0],
        &[
            "cluster",
            "layout",
            "--order",
            "ring-layout-0,ring-layout-0",
        ],
    )
    .await;
    assert!(!ok, "{out}");
    assert!(out.contains("listed twice"), "{out}");
    let admin = members[0].admin_client();
    let refused = tokio::task::spawn_blocking(move || {
        let body = json!({"order": "zone-aware", "backups": 7});
        admin.call("PUT", "/api/cluster/ring", Some(&body))
    })
    .await
    .unwrap()
    .expect("the admin API answers");
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(refused.reason().contains("0 to 3"), "{}", refused.body);
    let now = get(&members[0], "/api/cluster/ring").await;
    assert_eq!(
        (&now["order"], &now["backups"]),
        (&json!(reversed), &json!(2)),
        "{now}"
    );
}
