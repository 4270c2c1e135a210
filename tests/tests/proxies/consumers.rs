//! Consumers across members: a dead proxied consumer's unacked go to another, redelivered
//! and in order; single-active-consumer holds across members.

use crate::support::*;
use futures_lite::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use ringmq_tests::cluster::start_cluster;
use std::time::Duration;

#[tokio::test]
async fn a_proxied_consumer_that_dies_leaves_its_unacked_to_another_redelivered() {
    let (members, _secret) = start_cluster("proxy-kill", 3);
    declare(&members[0], "jobs").await;
    let (_c0, on_0) = members[0].channel().await;
    publish_confirmed(&on_0, "jobs", "j", 20).await;
    {
        let (c1, on_1) = members[1].channel().await;
        on_1.basic_qos(8, BasicQosOptions::default()).await.unwrap();
        let mut consumer = on_1
            .basic_consume(
                "jobs".into(),
                "doomed".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        for _ in 0..8 {
            tokio::time::timeout(Duration::from_secs(10), consumer.next())
                .await
                .expect("a delivery")
                .unwrap()
                .unwrap();
        }
        // The client goes away without acking (its socket closes with the connection).
        drop(consumer);
        c1.close(200, "bye".into()).await.unwrap();
    }
    let (_c2, on_2) = members[2].channel().await;
    let mut consumer = on_2
        .basic_consume(
            "jobs".into(),
            "heir".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..20 {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("every message reaches the heir")
            .unwrap()
            .unwrap();
        got.push((String::from_utf8(d.data.clone()).unwrap(), d.redelivered));
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    let want: Vec<(String, bool)> = (0..20).map(|i| (format!("j-{i}"), i < 8)).collect();
    assert_eq!(
        got, want,
        "none lost, the first eight redelivered in their order"
    );
}

#[tokio::test]
async fn single_active_consumer_holds_across_members() {
    let (members, _secret) = start_cluster("proxy-sac", 3);
    let (_c0, on_0) = members[0].channel().await;
    let mut args = FieldTable::default();
    args.insert(
        "x-single-active-consumer".into(),
        lapin::types::AMQPValue::Boolean(true),
    );
    on_0.queue_declare("single".into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    let (_c1, on_1) = members[1].channel().await;
    let (_c2, on_2) = members[2].channel().await;
    let mut first = on_1
        .basic_consume(
            "single".into(),
            "first".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut second = on_2
        .basic_consume(
            "single".into(),
            "second".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish_confirmed(&on_0, "single", "s", 4).await;
    for i in 0..4 {
        let d = tokio::time::timeout(Duration::from_secs(10), first.next())
            .await
            .expect("the active consumer gets everything")
            .unwrap()
            .unwrap();
        assert_eq!(d.data, format!("s-{i}").as_bytes());
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(300), second.next())
            .await
            .is_err(),
        "the other member's consumer is not active"
    );
    // The active one goes: the one on the other member takes over.
    on_1.basic_cancel("first".into(), Default::default())
        .await
        .unwrap();
    publish_confirmed(&on_0, "single", "t", 1).await;
    let d = tokio::time::timeout(Duration::from_secs(10), second.next())
        .await
        .expect("the next consumer becomes active")
        .unwrap()
        .unwrap();
    assert_eq!(d.data, b"t-0");
}
