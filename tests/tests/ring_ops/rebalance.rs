//! `ringmqctl cluster rebalance`: thirty queues made on one member, with messages, are
//! rebalanced over three — primaries even, every message still there. The plan is the
//! cluster map's: the member that asked for it can be killed with -9 and the others carry
//! it out; a receiving member lost half-way fails only the moves to it. Nothing is lost. A
//! fourth member that joins gets its share.

use crate::{ctl, get, publish_confirmed};
use lapin::options::{ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use ringmq_tests::cluster::{member_yaml, start_cluster};
use ringmq_tests::{Broker, bodies, queue_counts};
use serde_json::Value;
use std::time::{Duration, Instant};

/// Queues, all declared through the first member (so all its primaries).
const QUEUES: usize = 30;
/// Persistent messages in each.
const MESSAGES: usize = 10;

fn queue(i: usize) -> String {
    format!("rb-{i:02}")
}

/// Declares the queues through `b` (one backup each) and publishes their messages,
/// every one confirmed.
async fn fill(b: &Broker) {
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut args = FieldTable::default();
    args.insert("qpid.cluster.backups".into(), AMQPValue::LongInt(1));
    for i in 0..QUEUES {
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.queue_declare(queue(i).as_str().into(), durable, args.clone())
            .await
            .unwrap();
        let bodies = (0..MESSAGES).map(|m| format!("{}-m{m}", queue(i)));
        publish_confirmed(&ch, &queue(i), bodies).await;
    }
}

/// Primaries per member by `b`'s answer, in ring order.
async fn primaries(b: &Broker) -> Vec<(String, u64)> {
    let members = get(b, "/api/members").await;
    (members.as_array().into_iter().flatten())
        .map(|m| {
            let id = m["id"].as_str().unwrap().to_owned();
            (id, m["primaries"].as_u64().unwrap())
        })
        .collect()
}

/// Every queue still holds every one of its messages, read through `b` (most of them
/// proxied to primaries elsewhere); a queue whose primary cannot be reached yet (an
/// election under way) is asked again, for at most 30 s.
async fn assert_all_there(b: &Broker) {
    for i in 0..QUEUES {
        let t = Instant::now();
        loop {
            let (_c, ch) = b.channel().await;
            match queue_counts(&ch, &queue(i)).await {
                Ok((n, _)) => {
                    assert_eq!(n as usize, MESSAGES, "{}", queue(i));
                    break;
                }
                Err(e) => eprintln!("{} {:?} after {:?}", queue(i), e, t.elapsed()),
            }
            assert!(t.elapsed() < Duration::from_secs(30));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_queues_made_on_one_member_are_rebalanced_over_three_with_every_message() {
    let name = "ring-rebalance";
    let (members, _secret) = start_cluster(name, 3);
    fill(&members[0]).await;
    let before = primaries(&members[2]).await;
    assert_eq!(before.iter().map(|(_, n)| n).sum::<u64>(), QUEUES as u64);
    assert_eq!(before[0].1, QUEUES as u64, "{before:?}");

    // The plan alone, from any member: twenty moves off the first member, none applied.
    let (ok, out) = ctl(&members[1], &["cluster", "rebalance"]).await;
    assert!(ok, "{out}");
    assert!(out.contains("not applied"), "{out}");
    let view = get(&members[2], "/api/cluster/rebalance").await;
    assert_eq!(view["balanced"], false, "{view}");
    assert_eq!(view["plan"].as_array().map(Vec::len), Some(20), "{view}");
    assert_eq!(view["current"], Value::Null, "{view}");

    let started = Instant::now();
    let (ok, out) = ctl(
        &members[1],
        &[
            "cluster",
            "rebalance",
            "--apply",
            "--concurrency",
            "4",
            "--wait",
        ],
    )
    .await;
    assert!(ok, "{out}");
    // Twenty primaries move off the first member; then the twenty backups that are not
    // on their primary's ring successor move there.
    assert!(out.contains("rebalance done: 40 moves: 40 done"), "{out}");
    eprintln!(
        "20 primaries and 20 backups moved in {:?}",
        started.elapsed()
    );
    let after = primaries(&members[0]).await;
    assert!(after.iter().all(|(_, n)| *n == 10), "{after:?}");
    let members_json = get(&members[1], "/api/members").await;
    let backups: Vec<u64> = (members_json.as_array().into_iter().flatten())
        .map(|m| m["backups"].as_u64().unwrap())
        .collect();
    assert_eq!(backups, [10, 10, 10], "{members_json}");
    assert_backups_in_sync(&members[2]).await;
    let view = get(&members[0], "/api/cluster/rebalance").await;
    assert_eq!(view["balanced"], true, "{view}");
    assert_eq!(view["current"]["status"], "done", "{view}");
    assert_all_there(&members[2]).await;
    let (_c, ch) = members[1].channel().await;
    let mut got = bodies(&ch, &queue(7)).await;
    got.sort();
    let mut want: Vec<String> = (0..MESSAGES)
        .map(|m| format!("{}-m{m}", queue(7)))
        .collect();
    want.sort();
    assert_eq!(got, want);

    // Balanced: a second rebalance has nothing to do and is done at once.
    let (ok, out) = ctl(&members[2], &["cluster", "rebalance", "--apply", "--wait"]).await;
    assert!(ok, "{out}");
    assert!(out.contains("rebalance done: 0 moves"), "{out}");
}

/// Starts member `i` again after its kill, with the others as seeds, and waits until it
/// serves.
fn restart(members: &mut [Broker], i: usize, name: &str, secret: &std::path::Path) {
    let seeds: Vec<String> = (members.iter().enumerate())
        .filter(|(j, _)| *j != i)
        .filter_map(|(_, m)| m.cluster.clone())
        .collect();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    members[i].restart_with_config(&member_yaml(&format!("{name}-{i}"), &seeds, secret));
    members[i].wait_ready(Duration::from_secs(30));
}

/// The rebalance as `b` reports it.
async fn current(b: &Broker) -> Value {
    get(b, "/api/cluster/rebalance").await["current"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_goes_on_when_the_member_that_asked_for_it_is_killed() {
    let name = "ring-rebalance-asker";
    let (mut members, secret) = start_cluster(name, 3);
    fill(&members[0]).await;
    let admin = members[1].admin_client();
    let answer = tokio::task::spawn_blocking(move || {
        let body = serde_json::json!({"concurrency": 1});
        admin
            .call("POST", "/api/cluster/rebalance", Some(&body))
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(answer.status, 202, "{}", answer.body);
    assert_eq!(answer.body["total"], 20, "{}", answer.body);
    members[1].kill();

    // Every member planned the same when the op committed: the survivors carry it to its
    // end. Moves to the killed member made before its kill stand, the others fail.
    let (ok, out) = ctl(&members[2], &["cluster", "rebalance", "--wait"]).await;
    let now = current(&members[0]).await;
    eprintln!("{out}\n{now}");
    assert_eq!(now, current(&members[2]).await);
    assert_eq!(
        (now["pending"].as_u64(), now["running"].as_u64()),
        (Some(0), Some(0))
    );
    match now["status"].as_str() {
        Some("done") => assert!(ok, "{out}"),
        Some("failed") => assert!(!ok && out.contains("rebalance failed"), "{out}"),
        other => panic!("ended {other:?}: {now}"),
    }
    let (done, failed) = (
        now["done"].as_u64().unwrap(),
        now["failed"].as_u64().unwrap(),
    );
    assert_eq!(done + failed, now["total"].as_u64().unwrap(), "{now}");

    // A queue whose primary had just moved to the killed member may wait for it (its old
    // primary had not caught up as a backup yet): restarted, it brings them all back, and
    // catches up again as a backup wherever it is one — idle queues included, whose links
    // never saw it fail.
    restart(&mut members, 1, name, &secret);
    assert_all_there(&members[2]).await;
    assert_backups_in_sync(&members[0]).await;
    let (ok, out) = ctl(&members[0], &["cluster", "rebalance", "--apply", "--wait"]).await;
    assert!(ok, "{out}");
    let after = primaries(&members[1]).await;
    assert!(after.iter().all(|(_, n)| *n == 10), "{after:?}");
    assert_all_there(&members[1]).await;
}

/// Waits (30 s at most) until every queue's backups are all in sync, by `b`'s answer.
async fn assert_backups_in_sync(b: &Broker) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let queues = get(b, "/api/queues/%2F").await;
        let behind: Vec<String> = (queues.as_array().into_iter().flatten())
            .filter(|q| q["backup_nodes"] != q["in_sync_backup_nodes"])
            .map(|q| {
                format!(
                    "{} {} {}",
                    q["name"], q["backup_nodes"], q["in_sync_backup_nodes"]
                )
            })
            .collect();
        if behind.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "backups not in sync: {behind:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiving_member_lost_half_way_fails_its_moves_and_the_others_are_made() {
    let name = "ring-rebalance-lost";
    let (mut members, secret) = start_cluster(name, 3);
    fill(&members[0]).await;
    // The second member stops before the plan is made, and is declared failed a moment
    // after: the move to it under way stalls until then and is called off, the later ones
    // to it are refused, the ones to the third member are made.
    members[1].pause();
    let (ok, out) = ctl(
        &members[2],
        &[
            "cluster",
            "rebalance",
            "--apply",
            "--concurrency",
            "1",
            "--wait",
        ],
    )
    .await;
    let now = current(&members[0]).await;
    eprintln!("{out}\n{now}");
    assert!(!ok && out.contains("rebalance failed"), "{out}");
    assert_eq!(now, current(&members[2]).await);
    assert_eq!(now["status"], "failed", "{now}");
    let primary_moves = |state: &str| {
        (now["moves"].as_array().into_iter().flatten())
            .filter(|m| m["kind"] == "primary" && m["state"] == state)
            .count()
    };
    assert_eq!(
        primary_moves("done"),
        10,
        "every move to the third member: {now}"
    );
    assert_eq!(
        primary_moves("failed"),
        10,
        "every move to the lost one: {now}"
    );
    members[1].kill();
    assert_all_there(&members[2]).await;

    // Back, it catches up as a backup again and takes its share with the next rebalance.
    restart(&mut members, 1, name, &secret);
    assert_backups_in_sync(&members[2]).await;
    let (ok, out) = ctl(&members[2], &["cluster", "rebalance", "--apply", "--wait"]).await;
    assert!(ok, "{out}");
    let after = primaries(&members[0]).await;
    assert!(after.iter().all(|(_, n)| *n == 10), "{after:?}");
    assert_all_there(&members[1]).await;
}

/// Starts member `i` of cluster `name` with `ring_order: order`, the members before it as
/// seeds.
fn start_ordered(
    members: &[Broker],
    name: &str,
    i: usize,
    order: u32,
    secret: &std::path::Path,
) -> Broker {
    let seeds: Vec<String> = members.iter().filter_map(|m| m.cluster.clone()).collect();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let yaml =
        member_yaml(&format!("{name}-{i}"), &seeds, secret) + &format!("ring_order: {order}\n");
    Broker::start_with_config(&yaml)
}

/// Member ids and primaries, backups by `b`'s `/api/members`, in ring order.
async fn held(b: &Broker) -> Vec<(String, u64, u64)> {
    let members = get(b, "/api/members").await;
    (members.as_array().into_iter().flatten())
        .map(|m| {
            (
                m["id"].as_str().unwrap().to_owned(),
                m["primaries"].as_u64().unwrap(),
                m["backups"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fourth_member_that_joins_takes_its_place_and_its_neighbours_hand_it_its_share() {
    let name = "ring-rebalance-join";
    let secret = ringmq_tests::cluster::secret(name);
    let mut members: Vec<Broker> = Vec::new();
    for (i, order) in [0, 10, 20].into_iter().enumerate() {
        let m = start_ordered(&members, name, i, order, &secret);
        members.push(m);
    }
    for m in &members {
        m.wait_ready(Duration::from_secs(30));
    }
    fill(&members[0]).await;
    let (ok, out) = ctl(&members[1], &["cluster", "rebalance", "--apply", "--wait"]).await;
    assert!(ok, "{out}");

    // A new member with ring order 15 goes between the second and the third, and once it
    // holds the map those two hand it its share; the first, no neighbour, keeps its own.
    members.push(start_ordered(&members, name, 3, 15, &secret));
    members[3].wait_ready(Duration::from_secs(30));
    let ids = |h: &[(String, u64, u64)]| h.iter().map(|m| m.0.clone()).collect::<Vec<_>>();
    let want: Vec<String> = [0, 1, 3, 2].iter().map(|i| format!("{name}-{i}")).collect();
    assert_eq!(ids(&held(&members[0]).await), want, "ring order");
    let deadline = Instant::now() + Duration::from_secs(30);
    let handover = loop {
        let r = current(&members[2]).await;
        if r["joined"] == format!("{name}-3") && r["status"] != "running" {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "no handover to the new member: {r}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(handover["status"], "done", "{handover}");
    let scope: Vec<String> = [1, 2, 3].iter().map(|i| format!("{name}-{i}")).collect();
    assert_eq!(handover["scope"], serde_json::json!(scope), "{handover}");
    let h = held(&members[1]).await;
    assert_eq!(h[0].1, 10, "the first member is no neighbour: {h:?}");
    assert!((6..=7).contains(&h[2].1), "the new member's share: {h:?}");
    assert_eq!(h[2].2, h[1].1, "it backs its predecessor's queues: {h:?}");
    assert_backups_in_sync(&members[3]).await;
    assert_all_there(&members[3]).await;

    // `cluster rebalance --apply` evens out the rest of the ring.
    let (ok, out) = ctl(&members[3], &["cluster", "rebalance", "--apply", "--wait"]).await;
    assert!(ok, "{out}");
    let h = held(&members[0]).await;
    // 30 over 4: 8, 8, 7, 7 in some order; each member backs its predecessor's queues.
    let mut primaries: Vec<u64> = h.iter().map(|m| m.1).collect();
    primaries.sort_unstable();
    assert_eq!(primaries, [7, 7, 8, 8], "{h:?}");
    assert!(h.iter().all(|m| (7..=8).contains(&m.2)), "{h:?}");
    assert_eq!(
        get(&members[2], "/api/cluster/rebalance").await["balanced"],
        true
    );
    assert_backups_in_sync(&members[1]).await;
    assert_all_there(&members[3]).await;
    let _ = std::fs::remove_file(&secret);
}
