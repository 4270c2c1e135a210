//! A replicated queue survives a `kill -9` of its primary (issue #13): its in-sync backup
//! becomes primary on every member, every confirmed message is there exactly once, what the
//! old primary had delivered and not seen acked comes again first, in its original order,
//! marked redelivered, and the new primary confirms new publishes.

use crate::harness::*;
use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use std::time::{Duration, Instant};

/// Confirmed publishes before the crash.
const MESSAGES: usize = 2_000;
/// Delivered to a consumer of the old primary and never acked.
const UNACKED: u16 = 10;
/// Longest wait for a backup to be in sync, and for the election.
const ROLE_LIMIT: Duration = Duration::from_secs(30);

/// Publishes `m0`, `m1`, … persistent to `queue` through `b`, each confirmed.
async fn publish_confirmed(b: &ringmq_tests::Broker, queue: &str, count: usize) {
    let (conn, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::with_capacity(count);
    for i in 0..count {
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("m{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap(),
        );
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack(), "a publish was nacked");
    }
    let _ = conn.close(200, "published".into()).await;
}

/// Takes `count` messages from `queue` through `ch` (no-ack): bodies and redelivered flags.
async fn drain(ch: &lapin::Channel, queue: &str, count: usize) -> Vec<(String, bool)> {
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "audit".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    while got.len() < count {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("only {} of {count} messages", got.len()))
            .unwrap()
            .unwrap();
        got.push((String::from_utf8(d.data.clone()).unwrap(), d.redelivered));
    }
    got
}

#[tokio::test]
async fn a_killed_primary_is_replaced_by_its_in_sync_backup_with_nothing_confirmed_lost() {
    let name = "repl-failover";
    let (mut members, _ports, _secret) = start_cluster(name);
    let queue = "orders";
    let backups = declare_replicated(&members[0], queue, 1, ROLE_LIMIT).await;
    let backup = backups[0].clone();
    let b = member_of(name, N, &backup);
    assert_ne!(b, 0, "the primary is not its own backup");
    publish_confirmed(&members[0], queue, MESSAGES).await;

    // A consumer of the primary takes the first messages and never acks them.
    let (_cconn, cch) = members[0].channel().await;
    cch.basic_qos(UNACKED, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = cch
        .basic_consume(
            queue.into(),
            "slow".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for i in 0..usize::from(UNACKED) {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a delivery")
            .unwrap()
            .unwrap();
        assert_eq!(d.data, format!("m{i}").as_bytes());
    }
    // The deliveries' ops reach the backup before the primary dies: give the stream a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let killed_at = Instant::now();
    members[0].kill();
    wait_queue_view(&members[b], queue, ROLE_LIMIT, "the backup elected", |v| {
        v["node"].as_str() == Some(backup.as_str())
    });
    eprintln!("{name}: elected {:?} after the kill", killed_at.elapsed());

    // The new primary takes a confirmed publish.
    let (_pconn, pch) = members[b].channel().await;
    pch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm = pch
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            b"after",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap();
    assert!(confirm.await.unwrap().is_ack(), "the new primary confirms");
    eprintln!(
        "{name}: first confirmed publish on the new primary {:?} after the kill",
        killed_at.elapsed()
    );

    // Every message once: the unacked ones first, redelivered, in order; then the rest.
    let got = drain(&pch, queue, MESSAGES + 1).await;
    let expected: Vec<(String, bool)> = (0..MESSAGES)
        .map(|i| (format!("m{i}"), i < usize::from(UNACKED)))
        .chain([("after".to_owned(), false)])
        .collect();
    assert_eq!(got, expected, "{name}: the queue after the failover");
}

/// The seed's double failure: on five members a queue with two backups loses its primary and
/// its first backup at once; three members keep the majority, the second backup is elected
/// and serves every confirmed message.
#[tokio::test]
async fn five_members_and_two_backups_survive_the_primary_and_its_first_backup_dying_together() {
    let name = "repl-double";
    let n = 5;
    let (mut members, _ports, _secret) = start_cluster_of(name, n);
    let queue = "ledger";
    let backups = declare_replicated(&members[0], queue, 2, ROLE_LIMIT).await;
    let (first, second) = (
        member_of(name, n, &backups[0]),
        member_of(name, n, &backups[1]),
    );
    publish_confirmed(&members[0], queue, MESSAGES).await;
    members[0].kill();
    members[first].kill();
    wait_queue_view(
        &members[second],
        queue,
        ROLE_LIMIT,
        "the second backup elected",
        |v| v["node"].as_str() == Some(backups[1].as_str()),
    );
    let (_c, ch) = members[second].channel().await;
    let got = drain(&ch, queue, MESSAGES).await;
    let expected: Vec<(String, bool)> = (0..MESSAGES).map(|i| (format!("m{i}"), false)).collect();
    assert_eq!(got, expected, "{name}: the queue after the double failure");
}

/// B4 (docs/reliability.md): a backup that is killed and replaced, then comes back, finds
/// the queue with its `k` backups already and gets no role; the copy it kept on disk serves
/// nobody and no confirm counts on it, so it drops it — once its restart's replay is over —
/// instead of holding the messages in memory and disk for good. Every member's answer is
/// stamped with the configuration its roles belong to, the same on all of them once settled.
#[tokio::test]
async fn a_member_that_comes_back_without_a_role_drops_its_old_copy() {
    let name = "repl-stale-copy";
    let (mut members, _ports, _secret) = start_cluster(name);
    let queue = "stale";
    let backups = declare_replicated(&members[0], queue, 1, ROLE_LIMIT).await;
    let b = member_of(name, N, &backups[0]);
    publish_confirmed(&members[0], queue, 100).await;
    wait_queue_view(&members[b], queue, ROLE_LIMIT, "the backup's copy", |v| {
        v["local_copy"]
            == serde_json::json!({"role": "backup", "messages": 100, "message_bytes_ram": v["local_copy"]["message_bytes_ram"]})
    });

    members[b].kill();
    let other = (1..N).find(|&i| i != b).expect("a third member");
    let other_node = node(name, other);
    wait_queue_view(&members[0], queue, ROLE_LIMIT, "the transfer", |v| {
        v["in_sync_backup_nodes"] == serde_json::json!([other_node])
    });
    restart_member(&mut members, b, name);
    let view = wait_queue_view(
        &members[b],
        queue,
        ROLE_LIMIT,
        "the old copy dropped",
        |v| v["local_copy"]["role"] == "none" && v["local_copy"]["messages"] == 0,
    );
    assert_eq!(
        view["messages"], 100,
        "the primary still holds them: {view}"
    );

    let stamps: Vec<serde_json::Value> = (0..N)
        .map(|i| {
            wait_queue_view(&members[i], queue, ROLE_LIMIT, "a stamped answer", |v| {
                v["cluster"]["quorum"] == true
            })["cluster"]["configuration"]
                .clone()
        })
        .collect();
    assert!(stamps[0].as_u64().is_some_and(|c| c > 0), "{stamps:?}");
    assert!(
        stamps.iter().all(|s| *s == stamps[0]),
        "one configuration on every member: {stamps:?}"
    );
}
