//! A queue's end and its messages' end, decided by the primary and seen everywhere: delete,
//! auto-delete, `x-expires`, dead-lettering and TTL.

use crate::support::*;
use futures_lite::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use ringmq_tests::cluster::start_cluster;
use ringmq_tests::{reply_code, wait_queue_gone};
use std::time::Duration;

#[tokio::test]
async fn deleting_a_queue_cancels_its_consumers_on_every_member() {
    let (members, _secret) = start_cluster("proxy-del", 2);
    declare(&members[0], "gone").await;
    let (_c1, on_1) = members[1].channel().await;
    let mut consumer = on_1
        .basic_consume(
            "gone".into(),
            "watcher".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(count(&members[0], "gone").await, (0, 1));
    let (_c0, on_0) = members[0].channel().await;
    on_0.queue_delete("gone".into(), Default::default())
        .await
        .unwrap();
    let end = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("the proxy passes the primary's basic.cancel on");
    assert!(end.is_none(), "the consumer ended: {end:?}");
    // The channel stayed open: a later error on it is its own (404), not a closed channel.
    assert!(
        on_1.basic_get("nonexistent".into(), BasicGetOptions::default())
            .await
            .is_err_and(|e| reply_code(&e) == Some(404))
    );
}

#[tokio::test]
async fn auto_delete_counts_consumers_on_every_member_and_deletes_everywhere() {
    let (members, _secret) = start_cluster("proxy-auto", 3);
    let (_c0, on_0) = members[0].channel().await;
    on_0.queue_declare(
        "transient".into(),
        QueueDeclareOptions {
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let consume = |ch: lapin::Channel, tag: &'static str| async move {
        // The consumer stream is kept: lapin cancels a consumer whose stream is dropped.
        let consumer = ch
            .basic_consume(
                "transient".into(),
                tag.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        (ch, consumer)
    };
    let (_c1, on_1) = members[1].channel().await;
    let (_c2, on_2) = members[2].channel().await;
    let (on_1, _one) = consume(on_1, "one").await;
    let (on_2, _two) = consume(on_2, "two").await;
    assert_eq!(count(&members[0], "transient").await, (0, 2));
    // One consumer left: the queue stays.
    on_1.basic_cancel("one".into(), Default::default())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&members[1], "transient").await, (0, 1));
    // The last one goes: the queue goes from every member.
    on_2.basic_cancel("two".into(), Default::default())
        .await
        .unwrap();
    for m in &members {
        wait_queue_gone(m, "transient", Duration::from_secs(10)).await;
    }
}

#[tokio::test]
async fn x_expires_is_decided_by_the_primary_and_deletes_everywhere() {
    let (members, _secret) = start_cluster("proxy-expire", 2);
    let (_c0, on_0) = members[0].channel().await;
    let mut args = FieldTable::default();
    args.insert("x-expires".into(), lapin::types::AMQPValue::LongUInt(1500));
    on_0.queue_declare("fleeting".into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    // Watched through the admin API of the proxy: a passive declare is a use of the queue
    // and would keep it alive.
    let admin = members[1].admin_client();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let status = admin.get("/api/queues/%2f/fleeting").unwrap().status;
        if status == 404 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the expired queue leaves the proxy too (still {status})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn dead_letters_and_ttl_cross_members() {
    let (members, _secret) = start_cluster("proxy-dlx", 3);
    // The dead-letter queue lives on member 2, the work queue on member 0.
    declare(&members[2], "dead").await;
    let (_c0, on_0) = members[0].channel().await;
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        lapin::types::AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        lapin::types::AMQPValue::LongString("dead".into()),
    );
    args.insert(
        "x-message-ttl".into(),
        lapin::types::AMQPValue::LongUInt(60_000),
    );
    on_0.queue_declare("work-dlx".into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    let (_c1, on_1) = members[1].channel().await;
    publish_confirmed(&on_1, "work-dlx", "d", 2).await;
    // A reject through a proxy: the primary dead-letters to the queue on member 2.
    let got = on_1
        .basic_get("work-dlx".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("a message");
    on_1.basic_reject(
        got.delivery.delivery_tag,
        lapin::options::BasicRejectOptions { requeue: false },
    )
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while count(&members[2], "dead").await.0 != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the dead letter reaches the queue on another member"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dead = on_1
        .basic_get("dead".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the dead letter");
    assert_eq!(dead.delivery.data, b"d-0");
    let deaths = dead
        .delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-death").cloned());
    assert!(deaths.is_some(), "x-death is set by the primary");

    // Per-message TTL, applied where the queue lives.
    let (_c0, on_0) = members[0].channel().await;
    let mut args = FieldTable::default();
    args.insert(
        "x-message-ttl".into(),
        lapin::types::AMQPValue::LongUInt(200),
    );
    on_0.queue_declare("short-lived".into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    publish_confirmed(&on_1, "short-lived", "ttl", 3).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let gone = on_1
        .basic_get("short-lived".into(), BasicGetOptions::default())
        .await
        .unwrap();
    assert!(gone.is_none(), "expired on the primary");
}
