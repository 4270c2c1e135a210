//! A queue's primary crashes while a client of another member streams publishes to it: every
//! publish the client had a confirm for is in the queue when the primary is back, none
//! twice; the client hears of the crash (its connection closes with 320) instead of waiting.

use crate::harness::*;
use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Most publishes the client tries: the crash comes long before.
const MAX_PUBLISHES: usize = 200_000;
/// Confirms seen before the primary is killed.
const CONFIRMED_BEFORE_CRASH: usize = 2_000;

#[tokio::test]
async fn confirmed_forwards_survive_a_crash_of_their_primary() {
    let name = "fwd-crash";
    let (mut members, _ports, _secret) = start_cluster(name);
    let queue = "ledger";
    {
        let (_c, ch) = members[0].channel().await;
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare on the primary");
    }

    // A client of member 1 streams persistent publishes; a task collects the confirms.
    let (conn, ch) = members[1].channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let acked_count = Arc::new(AtomicUsize::new(0));
    let (confirms_tx, mut confirms_rx) =
        tokio::sync::mpsc::unbounded_channel::<(usize, lapin::PublisherConfirm)>();
    let counter = acked_count.clone();
    let collector = tokio::spawn(async move {
        let mut acked = BTreeSet::new();
        while let Some((i, confirm)) = confirms_rx.recv().await {
            if confirm.await.is_ok_and(|c| c.is_ack()) {
                acked.insert(i);
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
        acked
    });
    let mut killed = false;
    let mut sent = 0;
    while sent < MAX_PUBLISHES {
        let published = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("m{sent}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await;
        let Ok(confirm) = published else {
            break;
        };
        let _ = confirms_tx.send((sent, confirm));
        sent += 1;
        if !killed && acked_count.load(Ordering::Relaxed) >= CONFIRMED_BEFORE_CRASH {
            members[0].kill();
            killed = true;
        }
        if sent % 256 == 0 {
            tokio::task::yield_now().await;
        }
    }
    drop(confirms_tx);
    assert!(killed, "{name}: all {sent} publishes done before the crash");
    assert!(
        sent < MAX_PUBLISHES,
        "{name}: the client never heard that the primary crashed"
    );
    let acked = tokio::time::timeout(Duration::from_secs(30), collector)
        .await
        .expect("every confirm is decided once the connection closed")
        .unwrap();
    drop(conn);
    assert!(acked.len() >= CONFIRMED_BEFORE_CRASH);

    // The primary comes back on its data directory; the queue holds every confirmed publish.
    members[0].start_again();
    wait_settled(
        &mut members,
        &[0, 1, 2],
        READY_LIMIT,
        &format!("{name}: back"),
    );
    let (_c, ch) = members[0].channel().await;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "audit".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut seen = BTreeSet::new();
    while let Ok(Some(d)) = tokio::time::timeout(Duration::from_secs(2), consumer.next()).await {
        let d = d.unwrap();
        let body = String::from_utf8(d.data.clone()).unwrap();
        let i: usize = body[1..].parse().unwrap();
        assert!(seen.insert(i), "{name}: message {i} twice");
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    eprintln!(
        "{name}: {sent} published, {} confirmed, {} in the queue after the restart",
        acked.len(),
        seen.len()
    );
    let lost: Vec<&usize> = acked.difference(&seen).collect();
    assert!(
        lost.is_empty(),
        "{name}: {} confirmed publishes lost (first {:?}); {} confirmed, {} in the queue",
        lost.len(),
        &lost[..lost.len().min(5)],
        acked.len(),
        seen.len()
    );
}
