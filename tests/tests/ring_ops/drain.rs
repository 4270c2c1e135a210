//! `ringmqctl cluster drain NODE --wait` under confirmed load: the drained member's primaries
//! move to other members and its backups are replaced, its clients are closed with 320 and
//! new ones refused, `/readyz` answers 503, and it ends holding nothing — with every
//! confirmed message still there. `cluster undrain` makes it a serving member again.

use crate::ctl;
use lapin::BasicProperties;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use ringmq_tests::cluster::start_cluster;
use ringmq_tests::{Broker, reply_code};
use serde_json::Value;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Queues, two with their primary on each member.
const QUEUES: usize = 6;

/// `GET path` on `b`'s admin API: status and body.
async fn get(b: &Broker, path: &str) -> (u16, Value) {
    let admin = b.admin_client();
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || {
        let a = admin.get(&path).expect("admin API answers");
        (a.status, a.body)
    })
    .await
    .unwrap()
}

/// Publishes round-robin to the queues through `b` until `stop`, each publish confirmed
/// (nacked ones sent again); returns every confirmed body.
async fn publish_until(b: &Broker, stop: Arc<AtomicBool>) -> BTreeSet<String> {
    let (_conn, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirmed = BTreeSet::new();
    let mut next = 0usize;
    let mut again: Vec<String> = Vec::new();
    while !stop.load(Ordering::Relaxed) || !again.is_empty() {
        let bodies: Vec<String> = if again.is_empty() {
            (0..QUEUES * 10)
                .map(|_| {
                    next += 1;
                    format!("q{}-m{next}", next % QUEUES)
                })
                .collect()
        } else {
            std::mem::take(&mut again)
        };
        let mut confirms = Vec::new();
        for body in &bodies {
            let queue = body.split('-').next().unwrap().to_owned();
            confirms.push(
                ch.basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap(),
            );
        }
        for (body, c) in bodies.into_iter().zip(confirms) {
            if c.await.unwrap().is_ack() {
                confirmed.insert(body);
            } else {
                again.push(body);
            }
        }
    }
    confirmed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_member_ends_holding_nothing_with_every_confirmed_message_kept() {
    let name = "ring-drain";
    let (members, _secret) = start_cluster(name, 3);
    let node = |i: usize| format!("{name}-{i}");
    let drained = node(2);
    let (_c, ch) = members[0].channel().await;
    for q in 0..QUEUES {
        let mut args = FieldTable::default();
        args.insert("qpid.cluster.backups".into(), AMQPValue::LongInt(1));
        args.insert(
            "qpid.cluster.primary".into(),
            AMQPValue::LongString(node(q % 3).into()),
        );
        ch.queue_declare(
            format!("q{q}").as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap();
    }
    let (_, m) = get(&members[0], &format!("/api/members/{drained}")).await;
    assert!(
        m["primaries"].as_u64() == Some(2) && m["backups"].as_u64() >= Some(1),
        "{m}"
    );
    // A client of the member to be drained.
    let client = members[2].connect().await;

    let stop = Arc::new(AtomicBool::new(false));
    let members = Arc::new(members);
    let publisher = {
        let (members, stop) = (members.clone(), stop.clone());
        tokio::spawn(async move { publish_until(&members[0], stop).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let (ok, out) = ctl(
        &members[1],
        &["cluster", "drain", &drained, "--wait", "--timeout", "60"],
    )
    .await;
    assert!(ok, "{out}");
    assert!(out.contains("drained"), "{out}");
    eprintln!("drained in {:?}", started.elapsed());
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let confirmed = publisher.await.unwrap();

    // Every member says the same: it holds nothing and is draining.
    for b in members.iter() {
        let (status, m) = get(b, &format!("/api/members/{drained}")).await;
        assert_eq!(status, 200, "{m}");
        assert_eq!(
            (m["primaries"].as_u64(), m["backups"].as_u64()),
            (Some(0), Some(0)),
            "{m}"
        );
        assert_eq!(m["state"], "draining", "{m}");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.status().connected() {
        assert!(
            Instant::now() < deadline,
            "the drained member's client was not closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, _) = get(&members[2], "/readyz").await;
    assert_eq!(status, 503);
    let refused = lapin::Connection::connect(&members[2].uri(), Default::default())
        .await
        .expect_err("a drained member refuses clients");
    assert_eq!(reply_code(&refused), Some(320), "{refused:?}");

    // Every confirmed message is there, read through a member that stays.
    let (_c, ch) = members[1].channel().await;
    let mut found = BTreeSet::new();
    for q in 0..QUEUES {
        while let Some(m) = ch
            .basic_get(
                format!("q{q}").as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
        {
            found.insert(String::from_utf8(m.delivery.data.clone()).unwrap());
        }
    }
    let lost: Vec<&String> = confirmed.difference(&found).collect();
    eprintln!("{} confirmed, {} found", confirmed.len(), found.len());
    assert!(
        confirmed.len() > QUEUES * 10,
        "the load ran: {}",
        confirmed.len()
    );
    assert!(
        lost.is_empty(),
        "{} confirmed messages lost: {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );

    // Undrained, it serves again.
    let (ok, out) = ctl(&members[0], &["cluster", "undrain", &drained]).await;
    assert!(ok, "{out}");
    let (_, m) = get(&members[0], &format!("/api/members/{drained}")).await;
    assert_eq!(m["state"], "running", "{m}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&members[2], "/readyz").await.0 != 200 {
        assert!(Instant::now() < deadline, "never ready again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    members[2].connect().await;
}
