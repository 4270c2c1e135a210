//! `POST /api/queues/{vhost}/{name}/move` and `ringmqctl cluster move-queue`: the primary of
//! a replicated queue moves — to a member that first catches up as a backup, then to an
//! in-sync backup — while a publisher on a third member keeps publishing with confirms and a
//! consumer keeps consuming. Nothing confirmed is lost, a message comes twice only marked
//! redelivered, and the consumer goes on after each cancel notification.

use crate::ctl;
use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use ringmq_tests::Broker;
use ringmq_tests::cluster::start_cluster;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Messages published (each confirmed, nacked ones sent again).
const MESSAGES: usize = 3_000;
/// Publishes in flight before the publisher waits for their confirms.
const WINDOW: usize = 100;
/// Longest wait for a move, and for the consumer to see everything.
const LIMIT: Duration = Duration::from_secs(60);
const QUEUE: &str = "moving";

/// The queue as the admin API of `b` shows it.
async fn queue_json(b: &Broker) -> Value {
    let admin = b.admin_client();
    tokio::task::spawn_blocking(move || {
        admin
            .call("GET", &format!("/api/queues/%2F/{QUEUE}"), None)
            .expect("admin API answers")
            .body
    })
    .await
    .unwrap()
}

/// Waits until `b` names `node` the queue's primary.
async fn wait_primary(b: &Broker, node: &str) {
    let deadline = Instant::now() + LIMIT;
    loop {
        let q = queue_json(b).await;
        if q["node"] == node {
            return;
        }
        assert!(Instant::now() < deadline, "never moved to {node}: {q}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Publishes `m0`…`m{MESSAGES-1}` persistent through `b` in confirmed windows, sending the
/// nacked ones again until every one is confirmed.
async fn publish_all(b: &Broker, confirmed: Arc<AtomicUsize>) {
    let (_conn, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut todo: Vec<usize> = (0..MESSAGES).rev().collect();
    let mut nacked = 0;
    while !todo.is_empty() {
        let window: Vec<usize> = (0..WINDOW).filter_map(|_| todo.pop()).collect();
        let mut confirms = Vec::new();
        for &i in &window {
            confirms.push(
                ch.basic_publish(
                    "".into(),
                    QUEUE.into(),
                    BasicPublishOptions::default(),
                    format!("m{i}").as_bytes(),
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap(),
            );
        }
        for (i, c) in window.into_iter().zip(confirms) {
            if c.await.unwrap().is_ack() {
                confirmed.fetch_add(1, Ordering::Relaxed);
            } else {
                nacked += 1;
                todo.push(i);
            }
        }
    }
    eprintln!("publisher: {MESSAGES} confirmed, {nacked} nacks sent again");
}

/// Consumes through `b` (prefetch 50, each delivery acked), consuming again after every
/// cancel notification, until it saw every message; returns each body's deliveries
/// (redelivered flags) and how many consumers the broker cancelled.
async fn consume_all(b: &Broker) -> (BTreeMap<String, Vec<bool>>, usize) {
    let (_conn, ch) = b.channel().await;
    ch.basic_qos(50, BasicQosOptions::default()).await.unwrap();
    let mut seen: BTreeMap<String, Vec<bool>> = BTreeMap::new();
    let mut cancels = 0;
    let deadline = Instant::now() + LIMIT * 2;
    while seen.len() < MESSAGES {
        let mut consumer = ch
            .basic_consume(
                QUEUE.into(),
                format!("c{cancels}").as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        while seen.len() < MESSAGES {
            let left = deadline.saturating_duration_since(Instant::now());
            let next = tokio::time::timeout(left, consumer.next())
                .await
                .unwrap_or_else(|_| panic!("only {} of {MESSAGES} consumed", seen.len()));
            let Some(d) = next else {
                cancels += 1;
                break;
            };
            let d = d.unwrap();
            seen.entry(String::from_utf8(d.data.clone()).unwrap())
                .or_default()
                .push(d.redelivered);
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    }
    (seen, cancels)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_moved_twice_under_confirmed_load_loses_nothing() {
    let name = "ring-move";
    let (members, _secret) = start_cluster(name, 3);
    let node = |i: usize| format!("{name}-{i}");
    let (_c, ch) = members[0].channel().await;
    let mut args = FieldTable::default();
    args.insert("qpid.cluster.backups".into(), AMQPValue::LongInt(1));
    ch.queue_declare(
        QUEUE.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    let q = queue_json(&members[2]).await;
    assert_eq!(q["node"], node(0), "{q}");
    assert_eq!(q["backup_nodes"], json!([node(1)]), "{q}");

    let confirmed = Arc::new(AtomicUsize::new(0));
    let members = Arc::new(members);
    let publisher = {
        let (members, confirmed) = (members.clone(), confirmed.clone());
        tokio::spawn(async move { publish_all(&members[2], confirmed).await })
    };
    let consumer = {
        let members = members.clone();
        tokio::spawn(async move { consume_all(&members[1]).await })
    };
    let halfway = |n: usize| {
        let confirmed = confirmed.clone();
        async move {
            while confirmed.load(Ordering::Relaxed) < n {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };

    // To a member that holds no copy: it catches up as a third copy, then takes over.
    halfway(MESSAGES / 4).await;
    let admin = members[1].admin_client();
    let to = node(2);
    let answer = tokio::task::spawn_blocking(move || {
        admin
            .call(
                "POST",
                &format!("/api/queues/%2F/{QUEUE}/move"),
                Some(&json!({"to": to})),
            )
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(answer.status, 202, "{:?}", answer.body);
    wait_primary(&members[0], &node(2)).await;
    let q = queue_json(&members[0]).await;
    assert_eq!(
        q["backup_nodes"],
        json!([node(1)]),
        "back to one backup: {q}"
    );
    assert_eq!(q["moving_to"], Value::Null, "{q}");

    // To its in-sync backup, the consumer's member, by ringmqctl.
    halfway(MESSAGES / 2).await;
    let to = node(1);
    let (ok, out) = ctl(
        &members[0],
        &["cluster", "move-queue", "/", QUEUE, "--to", &to, "--wait"],
    )
    .await;
    assert!(ok, "{out}");
    assert!(out.contains(&format!("its primary is {to}")), "{out}");

    publisher.await.unwrap();
    let (seen, cancels) = consumer.await.unwrap();
    let twice: Vec<_> = seen.iter().filter(|(_, flags)| flags.len() > 1).collect();
    let unmarked: Vec<_> = twice
        .iter()
        .filter(|(_, flags)| flags[1..].iter().any(|r| !r))
        .collect();
    eprintln!(
        "{} delivered, {} twice or more, {cancels} cancel notifications",
        seen.len(),
        twice.len()
    );
    assert_eq!(seen.len(), MESSAGES, "every confirmed message is consumed");
    assert!(
        unmarked.is_empty(),
        "repeated without redelivered: {unmarked:?}"
    );
    assert!(
        cancels >= 1,
        "the consumer's primary moved away at least once"
    );
    let q = queue_json(&members[2]).await;
    assert_eq!(q["node"], node(1), "{q}");
    // A move to a node that is not a member is refused, with the reason.
    let admin = members[2].admin_client();
    let refused = tokio::task::spawn_blocking(move || {
        admin
            .call(
                "POST",
                &format!("/api/queues/%2F/{QUEUE}/move"),
                Some(&json!({"to": "nobody"})),
            )
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(refused.status, 409, "{:?}", refused.body);
    assert!(
        refused.body.to_string().contains("not a member"),
        "{}",
        refused.body
    );
}
