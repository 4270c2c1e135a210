//! A queue declared through any member is one queue: its messages on its primary,
//! published, got, acked, nacked, purged and counted through any member.

use crate::support::*;
use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicQosOptions,
    QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use ringmq_tests::cluster::start_cluster;
use std::time::Duration;

#[tokio::test]
async fn a_queue_declared_on_one_member_is_one_queue_on_every_member() {
    let (members, _secret) = start_cluster("proxy-one", 3);
    declare(&members[0], "orders").await;
    let (_c1, on_1) = members[1].channel().await;
    publish_confirmed(&on_1, "orders", "m", 10).await;
    // The messages are on the primary, and every member counts them there.
    for m in &members {
        assert_eq!(count(m, "orders").await, (10, 0));
    }
    // A consumer on the third member gets them all, in order.
    let (_c2, on_2) = members[2].channel().await;
    let mut consumer = on_2
        .basic_consume(
            "orders".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..10 {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a delivery within 10 s")
            .unwrap()
            .unwrap();
        assert_eq!(d.exchange.as_str(), "");
        assert_eq!(d.routing_key.as_str(), "orders");
        got.push(String::from_utf8(d.data.clone()).unwrap());
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    let want: Vec<String> = (0..10).map(|i| format!("m-{i}")).collect();
    assert_eq!(got, want, "order per producer holds across members");
    // The consumer counts on every member; once acked, nothing is left.
    for m in &members {
        assert_eq!(count(m, "orders").await, (0, 1));
    }
}

#[tokio::test]
async fn get_ack_nack_and_purge_through_a_proxy() {
    let (members, _secret) = start_cluster("proxy-get", 2);
    declare(&members[0], "work").await;
    let (_c0, on_0) = members[0].channel().await;
    publish_confirmed(&on_0, "work", "w", 3).await;

    let (_c1, on_1) = members[1].channel().await;
    let first = on_1
        .basic_get("work".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("a message");
    assert_eq!(first.delivery.data, b"w-0");
    assert!(!first.delivery.redelivered);
    assert_eq!(first.message_count, 2);
    // A nack with requeue puts it back at its place, visible on the primary once the
    // nack's channel has seen its next reply.
    on_1.basic_nack(
        first.delivery.delivery_tag,
        BasicNackOptions {
            requeue: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    // The nack's channel sees its next reply, then the primary has the message back.
    on_1.basic_qos(0, BasicQosOptions::default()).await.unwrap();
    assert_eq!(count(&members[0], "work").await.0, 3);
    let again = on_0
        .basic_get("work".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("the requeued message");
    assert_eq!(again.delivery.data, b"w-0");
    assert!(
        again.delivery.redelivered,
        "redelivered flag from the primary"
    );
    on_0.basic_ack(again.delivery.delivery_tag, BasicAckOptions::default())
        .await
        .unwrap();
    // get + ack through the proxy, then purge through it.
    let second = on_1
        .basic_get("work".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("a message");
    assert_eq!(second.delivery.data, b"w-1");
    on_1.basic_ack(second.delivery.delivery_tag, BasicAckOptions::default())
        .await
        .unwrap();
    let purged = on_1
        .queue_purge("work".into(), QueuePurgeOptions::default())
        .await
        .unwrap();
    assert_eq!(purged, 1);
    assert_eq!(count(&members[0], "work").await, (0, 0));
    let empty = on_1
        .basic_get("work".into(), BasicGetOptions::default())
        .await
        .unwrap();
    assert!(empty.is_none());
}

#[tokio::test]
async fn a_redeclare_through_a_third_member_right_after_the_create_is_answered() {
    // The create goes through member 0 and places the queue on member 2; the redeclare
    // through member 1 comes right after. Member 1 asks member 2 for the counts only once
    // member 2 applied the create (the upstream channel's catch-up), so never a 404.
    let (members, _secret) = start_cluster("proxy-redeclare", 3);
    let (_c0, on_0) = members[0].channel().await;
    let (_c1, on_1) = members[1].channel().await;
    let mut placed = FieldTable::default();
    placed.insert(
        "qpid.cluster.primary".into(),
        lapin::types::AMQPValue::LongString("proxy-redeclare-2".into()),
    );
    for i in 0..50 {
        let name = format!("again-{i}");
        on_0.queue_declare(
            name.as_str().into(),
            QueueDeclareOptions::default(),
            placed.clone(),
        )
        .await
        .unwrap();
        let again = on_1
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::default(),
                placed.clone(),
            )
            .await
            .unwrap_or_else(|e| panic!("redeclare {i}: {e}"));
        assert_eq!((again.message_count(), again.consumer_count()), (0, 0));
    }
}

#[tokio::test]
async fn what_one_member_declared_is_found_at_once_through_another() {
    // A client answered declare-ok by one member tells another client, on a member that has
    // not applied the committed declare yet, to use the queue or exchange. That member
    // catches up before it would answer 404, as one broker never does (CI saw a consume
    // refused 0.5 ms after the declare-ok). The late member is frozen while the others
    // commit the declare, and the use waits in its socket: on SIGCONT it reads the client
    // before its consensus layer has stored and applied the change.
    let (members, _secret) = start_cluster("proxy-found", 3);
    let overview = members[0].admin_client().get("/api/overview").unwrap();
    let leader = overview.body["cluster"]["leader"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    let late = (0..3)
        .rev()
        .find(|&i| format!("proxy-found-{i}") != leader)
        .unwrap();
    let declarer = (late + 1) % 3;
    let (_c, on_declarer) = members[declarer].channel().await;
    let (_c, on_late) = members[late].channel().await;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    for (i, use_) in ["passive declare", "bind", "get", "consume"]
        .iter()
        .enumerate()
    {
        let (queue, exchange) = (format!("found-{i}"), format!("found-x-{i}"));
        members[late].pause();
        on_declarer
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        on_declarer
            .exchange_declare(
                exchange.as_str().into(),
                lapin::ExchangeKind::Fanout,
                lapin::options::ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let ch = on_late.clone();
        let using = tokio::spawn(async move {
            match i {
                0 => ch
                    .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                    .await
                    .map(drop),
                1 => {
                    ch.queue_bind(
                        queue.as_str().into(),
                        exchange.as_str().into(),
                        "".into(),
                        lapin::options::QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                }
                2 => ch
                    .basic_get(queue.as_str().into(), BasicGetOptions::default())
                    .await
                    .map(drop),
                _ => ch
                    .basic_consume(
                        queue.as_str().into(),
                        "c".into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map(drop),
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        members[late].resume();
        using
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{use_} through the member that was late: {e}"));
    }
    // What is not there is still 404, once caught up.
    let missing = on_late
        .queue_declare("never-declared".into(), passive, FieldTable::default())
        .await
        .expect_err("a queue nobody declared");
    assert!(missing.to_string().contains("NOT_FOUND"), "{missing}");
}
