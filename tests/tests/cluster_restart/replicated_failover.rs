//! A replicated queue survives a `kill -9` of its primary (issue #13): its in-sync backup
//! becomes primary on every member, every confirmed message is there exactly once, what the
//! old primary had delivered and not seen acked comes again first, in its original order,
//! marked redelivered, and the new primary confirms new publishes.

use crate::harness::*;
use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::Value;
use std::time::{Duration, Instant};

/// Confirmed publishes before the crash.
const MESSAGES: usize = 2_000;
/// Delivered to a consumer of the old primary and never acked.
const UNACKED: u16 = 10;
/// Longest wait for a backup to be in sync, and for the election.
const ROLE_LIMIT: Duration = Duration::from_secs(30);

/// The queue as `b`'s admin API shows it (`None` while it answers anything but 200).
fn queue_view(b: &ringmq_tests::Broker, queue: &str) -> Option<Value> {
    let a = b
        .admin_client()
        .get(&format!("/api/queues/%2f/{queue}"))
        .ok()?;
    (a.status == 200).then_some(a.body)
}

/// Waits until `b` shows `queue` satisfying `done`; panics with the last view after `limit`.
fn wait_view(
    b: &ringmq_tests::Broker,
    queue: &str,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + ROLE_LIMIT;
    loop {
        let view = queue_view(b, queue);
        if let Some(v) = view.as_ref().filter(|v| done(v)) {
            return v.clone();
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {ROLE_LIMIT:?}; last view {view:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test]
async fn a_killed_primary_is_replaced_by_its_in_sync_backup_with_nothing_confirmed_lost() {
    let name = "repl-failover";
    let (mut members, _ports, _secret) = start_cluster(name);
    let queue = "orders";
    let mut args = FieldTable::default();
    args.insert("qpid.cluster.backups".into(), AMQPValue::LongInt(1));
    let (conn, ch) = members[0].channel().await;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .expect("declare on member 0, its primary");
    let view = wait_view(&members[0], queue, "a backup in sync", |v| {
        v["in_sync_backup_nodes"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
    });
    let backup = view["in_sync_backup_nodes"][0].as_str().unwrap().to_owned();
    let b = (0..N)
        .find(|&i| node(name, i) == backup)
        .expect("the backup is a member");
    assert_ne!(b, 0, "the primary is not its own backup");

    // Confirmed publishes, all of them acked by the primary (so on the backup too).
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::with_capacity(MESSAGES);
    for i in 0..MESSAGES {
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
        assert!(c.await.unwrap().is_ack(), "{name}: a publish was nacked");
    }

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
    drop(conn);

    let killed_at = Instant::now();
    members[0].kill();
    wait_view(&members[b], queue, "the backup elected", |v| {
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
    let mut consumer = pch
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
    while got.len() < MESSAGES + 1 {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("{name}: only {} of {} messages", got.len(), MESSAGES + 1))
            .unwrap()
            .unwrap();
        got.push((String::from_utf8(d.data.clone()).unwrap(), d.redelivered));
    }
    let expected: Vec<(String, bool)> = (0..MESSAGES)
        .map(|i| (format!("m{i}"), i < usize::from(UNACKED)))
        .chain([("after".to_owned(), false)])
        .collect();
    assert_eq!(got, expected, "{name}: the queue after the failover");
    drop(consumer);
}
