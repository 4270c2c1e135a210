//! The upstream link (`proxy/upstream_link.rs`, the broker's own codec): messages larger
//! than a frame cross it whole, a cancel from the primary while deliveries stream ends that
//! consumer alone, and acks it coalesces settle exactly the messages the client acked.

use crate::support::*;
use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use ringmq_tests::cluster::start_cluster;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn messages_larger_than_a_frame_cross_the_link_whole_with_their_properties() {
    let (members, _secret) = start_cluster("link-big", 3);
    declare(&members[0], "big").await;
    let (_c0, on_0) = members[0].channel().await;
    on_0.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    // Over two frame-maxes, empty, and small: body frames 3, 0 and 1.
    let bodies: Vec<Vec<u8>> = vec![
        (0..300_000u32).map(|i| (i % 251) as u8).collect(),
        Vec::new(),
        b"small".to_vec(),
    ];
    let mut headers = FieldTable::default();
    headers.insert("x-n".into(), AMQPValue::LongInt(7));
    for round in 0..2 {
        for (i, body) in bodies.iter().enumerate() {
            let properties = BasicProperties::default()
                .with_message_id(format!("{round}-{i}").into())
                .with_headers(headers.clone());
            let confirm = on_0
                .basic_publish(
                    "".into(),
                    "big".into(),
                    BasicPublishOptions::default(),
                    body,
                    properties,
                )
                .await
                .unwrap();
            assert!(confirm.await.unwrap().is_ack());
        }
    }
    // The first round through a proxied get, the second through a proxied consumer.
    let (_c2, on_2) = members[2].channel().await;
    for (i, body) in bodies.iter().enumerate() {
        let got = on_2
            .basic_get("big".into(), BasicGetOptions::default())
            .await
            .unwrap()
            .expect("a message");
        assert_eq!(&got.delivery.data, body, "got body {i} whole");
        assert_eq!(
            got.delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str()),
            Some(format!("0-{i}").as_str())
        );
        got.delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .unwrap();
    }
    let (_c1, on_1) = members[1].channel().await;
    let mut consumer = on_1
        .basic_consume(
            "big".into(),
            "whole".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for (i, body) in bodies.iter().enumerate() {
        let d = tokio::time::timeout(WAIT, consumer.next())
            .await
            .expect("a delivery")
            .unwrap()
            .unwrap();
        assert_eq!(&d.data, body, "body {i} arrives whole");
        assert_eq!(
            d.properties.message_id().as_ref().map(|s| s.as_str()),
            Some(format!("1-{i}").as_str())
        );
        assert_eq!(d.properties.headers(), &Some(headers.clone()));
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(count(&members[0], "big").await, (0, 1));
}

#[tokio::test]
async fn a_cancel_from_the_primary_mid_stream_ends_that_consumer_and_spares_the_link() {
    let (members, _secret) = start_cluster("link-cancel", 2);
    declare(&members[0], "doomed").await;
    declare(&members[0], "spared").await;
    let (_c0, on_0) = members[0].channel().await;
    publish_confirmed(&on_0, "doomed", "d", 2000).await;
    // Both consumers share the member's upstream link (same client channel even).
    let (c1, on_1) = members[1].channel().await;
    on_1.basic_qos(100, BasicQosOptions::default())
        .await
        .unwrap();
    let mut doomed = on_1
        .basic_consume(
            "doomed".into(),
            "doomed".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut spared = on_1
        .basic_consume(
            "spared".into(),
            "spared".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    // Deliveries are streaming (acked as they come) when the queue is deleted on its
    // primary.
    let mut seen = 0;
    let ended = loop {
        match tokio::time::timeout(WAIT, doomed.next()).await {
            Ok(Some(Ok(d))) => {
                seen += 1;
                assert_eq!(d.data, format!("d-{}", seen - 1).as_bytes(), "in order");
                d.acker.ack(BasicAckOptions::default()).await.unwrap();
                if seen == 150 {
                    let (_c, del) = members[0].channel().await;
                    del.queue_delete("doomed".into(), QueueDeleteOptions::default())
                        .await
                        .unwrap();
                }
            }
            Ok(end) => break end,
            Err(_) => panic!("the consumer neither got a delivery nor ended"),
        }
    };
    assert!(seen >= 150, "{seen} deliveries before the cancel");
    assert!(ended.is_none(), "the consumer ended cleanly: {ended:?}");
    // The other consumer on the same link and channel goes on.
    publish_confirmed(&on_0, "spared", "s", 3).await;
    for i in 0..3 {
        let d = tokio::time::timeout(WAIT, spared.next())
            .await
            .expect("the other consumer still gets deliveries")
            .unwrap()
            .unwrap();
        assert_eq!(d.data, format!("s-{i}").as_bytes());
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert!(c1.status().connected(), "the client connection stays open");
    assert_eq!(count(&members[0], "spared").await, (0, 1));
}

#[tokio::test]
async fn acks_through_a_proxy_settle_exactly_the_messages_the_client_acked() {
    let (members, _secret) = start_cluster("link-acks", 2);
    declare(&members[0], "picky").await;
    let (_c0, on_0) = members[0].channel().await;
    publish_confirmed(&on_0, "picky", "p", 12).await;
    {
        let (c1, on_1) = members[1].channel().await;
        on_1.basic_qos(12, BasicQosOptions::default())
            .await
            .unwrap();
        let mut consumer = on_1
            .basic_consume(
                "picky".into(),
                "picky".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut deliveries = Vec::new();
        for _ in 0..12 {
            deliveries.push(
                tokio::time::timeout(WAIT, consumer.next())
                    .await
                    .expect("a delivery")
                    .unwrap()
                    .unwrap(),
            );
        }
        // Acked one by one, out of order and around holes (p-0, p-4, p-6, p-9): the proxy
        // may coalesce none of these into a `multiple` ack, since p-0 is unacked below.
        for i in [3, 1, 2, 7, 8, 10, 11, 5] {
            deliveries[i]
                .acker
                .ack(BasicAckOptions::default())
                .await
                .unwrap();
        }
        deliveries[6]
            .acker
            .ack(BasicAckOptions { multiple: true })
            .await
            .unwrap();
        // Every ack above reached the primary before the next reply on the channel.
        on_1.basic_qos(12, BasicQosOptions::default())
            .await
            .unwrap();
        drop(consumer);
        c1.close(200, "bye".into()).await.unwrap();
    }
    // The client's multiple ack of p-6 covered p-0 and p-4 as well (every unacked tag up
    // to it): only p-9 goes back to the queue, redelivered.
    let (_c2, on_2) = members[0].channel().await;
    let mut left = Vec::new();
    while let Some(got) = on_2
        .basic_get("picky".into(), BasicGetOptions::default())
        .await
        .unwrap()
    {
        left.push((
            String::from_utf8(got.delivery.data.clone()).unwrap(),
            got.delivery.redelivered,
        ));
        got.delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .unwrap();
    }
    assert_eq!(left, vec![("p-9".to_owned(), true)]);
}
