//! Prefetch through a proxy: a slow consumer holds only its prefetch, and a channel-wide
//! prefetch (`basic.qos` global) holds across members, in delivery-tag order.

use crate::support::*;
use futures_lite::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use ringmq_tests::cluster::start_cluster;
use std::time::Duration;

#[tokio::test]
async fn a_slow_consumer_on_a_proxy_holds_only_its_prefetch() {
    let (members, _secret) = start_cluster("proxy-slow", 2);
    declare(&members[0], "slow").await;
    let (_c0, on_0) = members[0].channel().await;
    publish_confirmed(&on_0, "slow", "s", 50).await;

    let (_c1, on_1) = members[1].channel().await;
    on_1.basic_qos(5, BasicQosOptions::default()).await.unwrap();
    let mut consumer = on_1
        .basic_consume(
            "slow".into(),
            "slow-c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(
            tokio::time::timeout(Duration::from_secs(10), consumer.next())
                .await
                .expect("a delivery")
                .unwrap()
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The other 45 stay ready on the primary, where another consumer could take them.
    assert_eq!(count(&members[0], "slow").await, (45, 1));
    // Acking one lets exactly one more through.
    held.remove(0)
        .acker
        .ack(BasicAckOptions::default())
        .await
        .unwrap();
    let next = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("one more after an ack")
        .unwrap()
        .unwrap();
    assert_eq!(next.data, b"s-5");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&members[0], "slow").await, (44, 1));
}

/// Deliveries that reach the consumers within `quiet_ms` of each other, in arrival order.
async fn drain(
    consumers: &mut [&mut lapin::Consumer],
    quiet_ms: u64,
) -> Vec<lapin::message::Delivery> {
    let mut got = Vec::new();
    loop {
        let mut any = false;
        for c in consumers.iter_mut() {
            if let Ok(Some(d)) =
                tokio::time::timeout(Duration::from_millis(quiet_ms), c.next()).await
            {
                got.push(d.unwrap());
                any = true;
            }
        }
        if !any {
            return got;
        }
    }
}

#[tokio::test]
async fn a_channel_wide_prefetch_holds_across_members() {
    let (members, _secret) = start_cluster("proxy-global-qos", 3);
    declare(&members[0], "wide-a").await;
    declare(&members[1], "wide-b").await;
    let (_c0, on_0) = members[0].channel().await;
    publish_confirmed(&on_0, "wide-a", "a", 5).await;
    publish_confirmed(&on_0, "wide-b", "b", 5).await;

    // A client of the third member consumes from both primaries under one window of 4.
    let (_c2, on_2) = members[2].channel().await;
    on_2.basic_qos(4, BasicQosOptions { global: true })
        .await
        .unwrap();
    let mut a = on_2
        .basic_consume(
            "wide-a".into(),
            "ca".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut b = on_2
        .basic_consume(
            "wide-b".into(),
            "cb".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut got = drain(&mut [&mut a, &mut b], 400).await;
    assert_eq!(got.len(), 4, "the channel's window, not one per member");

    // Two acks let exactly two more through.
    for d in got.drain(..2) {
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    let more = drain(&mut [&mut a, &mut b], 400).await;
    assert_eq!(more.len(), 2, "as many as were acked");
    got.extend(more);

    // Cancelled, the consumers' held deliveries go back to their queues: ready there are the
    // ten, less the two acked, less the four the client still holds.
    on_2.basic_cancel("ca".into(), Default::default())
        .await
        .unwrap();
    on_2.basic_cancel("cb".into(), Default::default())
        .await
        .unwrap();
    let (ready_a, consumers_a) = count(&members[1], "wide-a").await;
    let (ready_b, consumers_b) = count(&members[1], "wide-b").await;
    assert_eq!((consumers_a, consumers_b), (0, 0));
    assert_eq!(ready_a + ready_b, 4, "none held back at the proxy");
}

#[tokio::test]
async fn under_a_channel_wide_prefetch_local_and_proxied_deliveries_keep_tag_order() {
    // Held proxied deliveries are let out by the same acks that let local ones out: both
    // must reach the client in delivery-tag order (read off the wire: a client library
    // hands each consumer its own stream).
    use ringmq::amqp::frame::FRAME_METHOD;
    use ringmq::amqp::{AMQPClass, basic};
    use ringmq::client::{RawClient, Target, deliver_tag, encode_ack};
    use tokio::io::AsyncWriteExt;
    let (members, _secret) = start_cluster("proxy-mixed-qos", 2);
    declare(&members[0], "far").await;
    declare(&members[1], "near").await;
    let (_c1, on_1) = members[1].channel().await;
    publish_confirmed(&on_1, "far", "f", 200).await;
    publish_confirmed(&on_1, "near", "n", 200).await;
    let mut c = RawClient::connect(&Target::parse(&members[1].uri()).unwrap())
        .await
        .unwrap();
    c.call(
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: 4,
            global: true,
        })),
        |m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_))),
        "basic.qos-ok",
    )
    .await
    .unwrap();
    for queue in ["far", "near"] {
        // consume-ok may come after the first deliveries of the other consumer: the read
        // loop below skips it.
        c.send(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: queue.into(),
                consumer_tag: queue.into(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        )
        .await
        .unwrap();
    }
    let (mut last, mut seen) = (0, 0);
    while seen < 400 {
        let f = tokio::time::timeout(Duration::from_secs(10), c.read_frame())
            .await
            .unwrap_or_else(|_| panic!("delivery {seen} within 10 s"))
            .unwrap();
        let Some(tag) = (f.kind == FRAME_METHOD)
            .then(|| deliver_tag(&f.payload))
            .flatten()
        else {
            continue;
        };
        assert!(tag > last, "tag {tag} after {last} (delivery {seen})");
        last = tag;
        seen += 1;
        let mut ack = Vec::new();
        encode_ack(&mut ack, 1, tag, false);
        c.stream.write_all(&ack).await.unwrap();
    }
}
