//! basic.*, confirms and transactions: the suite that defines single-broker behaviour, run against one broker
//! (`tests/tests/basic.rs`) and again on a three-member cluster (`tests/tests/on_cluster.rs`),
//! where `crate::Broker` spreads connections and queue primaries over the members.

use crate::Broker;
use futures_lite::StreamExt;
use lapin::message::Delivery;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldArray, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Consumer};
use ringmq_tests::{depth, reply_code};
use std::time::Duration;

async fn declare(ch: &Channel, name: &str) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
}

async fn publish(ch: &Channel, key: &str, body: &[u8]) {
    ch.basic_publish(
        "".into(),
        key.into(),
        BasicPublishOptions::default(),
        body,
        BasicProperties::default(),
    )
    .await
    .unwrap();
}

async fn next(c: &mut Consumer) -> Delivery {
    tokio::time::timeout(Duration::from_secs(5), c.next())
        .await
        .expect("a delivery within 5 s")
        .expect("stream open")
        .expect("no error")
}

async fn nothing_within(c: &mut Consumer, ms: u64) -> bool {
    tokio::time::timeout(Duration::from_millis(ms), c.next())
        .await
        .is_err()
}

#[tokio::test]
async fn mandatory_unroutable_message_comes_back_with_no_route() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm = ch
        .basic_publish(
            "amq.direct".into(),
            "nobody".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"back",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let Confirmation::Ack(Some(returned)) = confirm else {
        panic!("expected an ack carrying the return: {confirm:?}")
    };
    assert_eq!(returned.reply_code, 312);
    assert_eq!(returned.delivery.data, b"back");
}

#[tokio::test]
async fn get_reports_remaining_count_and_get_empty() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q").await;
    assert!(
        ch.basic_get("q".into(), BasicGetOptions::default())
            .await
            .unwrap()
            .is_none()
    );
    publish(&ch, "q", b"1").await;
    publish(&ch, "q", b"2").await;
    let m = ch
        .basic_get("q".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            m.delivery.data.as_slice(),
            m.message_count,
            m.delivery.redelivered
        ),
        (&b"1"[..], 1, false)
    );
    m.delivery.ack(BasicAckOptions::default()).await.unwrap();
}

#[tokio::test]
async fn nack_with_requeue_puts_messages_back_in_original_order_marked_redelivered() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q").await;
    for m in ["a", "b", "c", "d"] {
        publish(&ch, "q", m.as_bytes()).await;
    }
    let mut consumer = ch
        .basic_consume(
            "q".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let got: Vec<Delivery> = vec![
        next(&mut consumer).await,
        next(&mut consumer).await,
        next(&mut consumer).await,
    ];
    // Requeue b alone, then a and c: everything goes back to where it was.
    got[1]
        .nack(BasicNackOptions {
            requeue: true,
            multiple: false,
        })
        .await
        .unwrap();
    ch.basic_nack(
        got[2].delivery_tag,
        BasicNackOptions {
            requeue: true,
            multiple: true,
        },
    )
    .await
    .unwrap();
    let mut again = Vec::new();
    for _ in 0..4 {
        let d = next(&mut consumer).await;
        again.push((String::from_utf8(d.data.clone()).unwrap(), d.redelivered));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    let mut a_b_c: Vec<_> = again
        .iter()
        .filter(|(_, r)| *r)
        .map(|(m, _)| m.clone())
        .collect();
    a_b_c.sort();
    assert_eq!(a_b_c, vec!["a", "b", "c"], "{again:?}");
    assert_eq!(again.iter().find(|(_, r)| !r).unwrap().0, "d");
    // Order within the requeued run is the original one.
    let requeued: Vec<_> = again
        .iter()
        .filter(|(_, r)| *r)
        .map(|(m, _)| m.as_str())
        .collect();
    assert!(
        requeued == ["a", "b", "c"] || requeued == ["b", "a", "c"],
        "{requeued:?}"
    );
}

#[tokio::test]
async fn channel_close_requeues_unacked_in_original_order() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    declare(&ch, "q").await;
    for m in ["1", "2", "3"] {
        publish(&ch, "q", m.as_bytes()).await;
    }
    let consumer_ch = c.create_channel().await.unwrap();
    let mut consumer = consumer_ch
        .basic_consume(
            "q".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for _ in 0..3 {
        next(&mut consumer).await;
    }
    consumer_ch.close(200, "done".into()).await.unwrap();
    let mut order = Vec::new();
    while let Some(m) = ch
        .basic_get("q".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        assert!(m.delivery.redelivered);
        order.push(String::from_utf8(m.delivery.data.clone()).unwrap());
    }
    assert_eq!(order, vec!["1", "2", "3"]);
}

#[tokio::test]
async fn reject_without_requeue_drops_and_unknown_tags_fail_with_406() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    declare(&ch, "q").await;
    publish(&ch, "q", b"x").await;
    let m = ch
        .basic_get("q".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .unwrap();
    m.delivery
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    assert_eq!(depth(&ch, "q").await, 0);
    let mut ack = Vec::new();
    ringmq::client::encode_ack(&mut ack, 1, 999, false);
    assert_eq!(ringmq_tests::channel_close_code_after(&b, &ack).await, 406);
}

#[tokio::test]
async fn ack_multiple_settles_everything_up_to_the_tag() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q").await;
    for _ in 0..5 {
        publish(&ch, "q", b"m").await;
    }
    let mut consumer = ch
        .basic_consume(
            "q".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut last = 0;
    for _ in 0..5 {
        last = next(&mut consumer).await.delivery_tag;
    }
    ch.basic_ack(last - 1, BasicAckOptions { multiple: true })
        .await
        .unwrap();
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await
        .unwrap();
    let d = next(&mut consumer).await;
    assert!(d.redelivered, "only the last one was still unacked");
    d.ack(BasicAckOptions::default()).await.unwrap();
    assert!(nothing_within(&mut consumer, 200).await);
}

#[tokio::test]
async fn prefetch_limits_unacked_deliveries_per_consumer() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q").await;
    for _ in 0..10 {
        publish(&ch, "q", b"m").await;
    }
    ch.basic_qos(3, BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            "q".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(next(&mut consumer).await);
    }
    assert!(
        nothing_within(&mut consumer, 200).await,
        "a fourth delivery exceeded prefetch 3"
    );
    got[0].ack(BasicAckOptions::default()).await.unwrap();
    next(&mut consumer).await;
    assert!(nothing_within(&mut consumer, 200).await);
}

#[tokio::test]
async fn global_prefetch_is_shared_by_the_channels_consumers() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q1").await;
    declare(&ch, "q2").await;
    for _ in 0..5 {
        publish(&ch, "q1", b"m").await;
        publish(&ch, "q2", b"m").await;
    }
    ch.basic_qos(4, BasicQosOptions { global: true })
        .await
        .unwrap();
    let mut c1 = ch
        .basic_consume(
            "q1".into(),
            "c1".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut c2 = ch
        .basic_consume(
            "q2".into(),
            "c2".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut n = 0;
    while !nothing_within(&mut c1, 50).await {
        n += 1;
    }
    while !nothing_within(&mut c2, 50).await {
        n += 1;
    }
    assert_eq!(n, 4);
}

#[tokio::test]
async fn exclusive_consumer_locks_out_others_and_tags_cannot_be_reused() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    declare(&ch, "q").await;
    let _mine = ch
        .basic_consume(
            "q".into(),
            "solo".into(),
            BasicConsumeOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let other = c.create_channel().await.unwrap();
    let e = other
        .basic_consume(
            "q".into(),
            "x".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(403));
    let e = ch
        .basic_consume(
            "q".into(),
            "solo".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        reply_code(&e),
        Some(530),
        "a reused consumer tag is a connection error"
    );
}

#[tokio::test]
async fn deleting_a_queue_cancels_its_consumers() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    declare(&ch, "q").await;
    let mut consumer = ch
        .basic_consume(
            "q".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let admin = c.create_channel().await.unwrap();
    admin
        .queue_delete("q".into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let end = tokio::time::timeout(Duration::from_secs(5), consumer.next())
        .await
        .expect("the stream ends when the broker cancels");
    assert!(end.is_none(), "{end:?}");
}

#[tokio::test]
async fn no_ack_consumer_receives_everything_without_acking() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q").await;
    ch.basic_qos(1, BasicQosOptions::default()).await.unwrap();
    for i in 0..100u32 {
        publish(&ch, "q", &i.to_be_bytes()).await;
    }
    let mut consumer = ch
        .basic_consume(
            "q".into(),
            "c".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    for i in 0..100u32 {
        assert_eq!(next(&mut consumer).await.data, i.to_be_bytes());
    }
    assert_eq!(depth(&ch, "q").await, 0);
}

#[tokio::test]
async fn every_property_and_field_type_round_trips() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q").await;
    let mut nested = FieldTable::default();
    nested.insert("inner".into(), AMQPValue::LongString("deep".into()));
    let mut array = FieldArray::default();
    array.push(AMQPValue::LongInt(1));
    array.push(AMQPValue::LongString("two".into()));
    let mut headers = FieldTable::default();
    for (k, v) in [
        ("bool", AMQPValue::Boolean(true)),
        ("i8", AMQPValue::ShortShortInt(-8)),
        ("u8", AMQPValue::ShortShortUInt(8)),
        ("i16", AMQPValue::ShortInt(-16)),
        ("i32", AMQPValue::LongInt(-32)),
        ("i64", AMQPValue::LongLongInt(-64)),
        ("f32", AMQPValue::Float(1.5)),
        ("f64", AMQPValue::Double(2.25)),
        (
            "dec",
            AMQPValue::DecimalValue(lapin::types::DecimalValue {
                scale: 2,
                value: 12345,
            }),
        ),
        ("str", AMQPValue::LongString("text".into())),
        ("ts", AMQPValue::Timestamp(1_700_000_000)),
        ("table", AMQPValue::FieldTable(nested)),
        ("array", AMQPValue::FieldArray(array)),
        ("bytes", AMQPValue::ByteArray(vec![0u8, 1, 2].into())),
        ("void", AMQPValue::Void),
    ] {
        headers.insert(k.into(), v);
    }
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_content_encoding("gzip".into())
        .with_headers(headers)
        .with_delivery_mode(2)
        .with_priority(3)
        .with_correlation_id("corr".into())
        .with_reply_to("replies".into())
        .with_expiration("60000".into())
        .with_message_id("id-1".into())
        .with_timestamp(1_700_000_001)
        .with_type("kind".into())
        .with_user_id("guest".into())
        .with_app_id("app".into())
        .with_cluster_id("cluster".into());
    ch.basic_publish(
        "".into(),
        "q".into(),
        BasicPublishOptions::default(),
        b"{}",
        props.clone(),
    )
    .await
    .unwrap();
    let m = ch
        .basic_get("q".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m.delivery.properties, props);
}

#[tokio::test]
async fn multi_mebibyte_messages_are_split_over_frames_and_arrive_whole() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "big").await;
    let body: Vec<u8> = (0..5 * 1024 * 1024 + 17).map(|i| (i % 251) as u8).collect();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let ok = ch
        .basic_publish(
            "".into(),
            "big".into(),
            BasicPublishOptions::default(),
            &body,
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(ok.is_ack());
    let mut consumer = ch
        .basic_consume(
            "big".into(),
            "c".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert!(next(&mut consumer).await.data == body);
}

#[tokio::test]
async fn publisher_confirms_ack_every_publish() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q").await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::new();
    for i in 0..500u32 {
        confirms.push(
            ch.basic_publish(
                "".into(),
                "q".into(),
                BasicPublishOptions::default(),
                &i.to_be_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap(),
        );
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack());
    }
    // Unroutable messages are confirmed too.
    let c = ch
        .basic_publish(
            "".into(),
            "nowhere".into(),
            BasicPublishOptions::default(),
            b"x",
            BasicProperties::default(),
        )
        .await
        .unwrap();
    assert!(c.await.unwrap().is_ack());
    assert_eq!(depth(&ch, "q").await, 500);
}

#[tokio::test]
async fn transactions_commit_and_roll_back_publishes_and_acks() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q").await;
    ch.tx_select().await.unwrap();
    publish(&ch, "q", b"rolled-back").await;
    ch.tx_rollback().await.unwrap();
    assert_eq!(depth(&ch, "q").await, 0);
    publish(&ch, "q", b"committed").await;
    assert_eq!(depth(&ch, "q").await, 0, "not visible before commit");
    ch.tx_commit().await.unwrap();
    assert_eq!(depth(&ch, "q").await, 1);
    let m = ch
        .basic_get("q".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .unwrap();
    m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    ch.tx_rollback().await.unwrap();
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await
        .unwrap();
    assert_eq!(
        depth(&ch, "q").await,
        1,
        "a rolled-back ack leaves the message unacked"
    );
    let m = ch
        .basic_get("q".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .unwrap();
    m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    ch.tx_commit().await.unwrap();
    assert_eq!(depth(&ch, "q").await, 0);
}

#[tokio::test]
async fn tx_commit_without_select_fails_with_precondition_failed() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    let e = ch.tx_commit().await.unwrap_err();
    assert_eq!(reply_code(&e), Some(406));
}

#[tokio::test]
async fn channel_flow_keeps_deliveries_flowing_and_refuses_to_stop_them_as_rabbitmq_does() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q").await;
    let mut consumer = ch
        .basic_consume(
            "q".into(),
            "c".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert!(
        ch.channel_flow(ChannelFlowOptions { active: true })
            .await
            .unwrap()
    );
    publish(&ch, "q", b"flowing").await;
    assert_eq!(next(&mut consumer).await.data, b"flowing");
    // Prefetch and cancel are how a consumer stops the broker; RabbitMQ closes the
    // connection with 540 NOT_IMPLEMENTED on active=false, and clients expect that.
    let e = ch
        .channel_flow(ChannelFlowOptions { active: false })
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(540), "{e}");
}

#[tokio::test]
async fn many_channels_on_one_connection_work_independently() {
    let b = Broker::start();
    let c = b.connect().await;
    let mut channels = Vec::new();
    for i in 0..50 {
        let ch = c.create_channel().await.unwrap();
        declare(&ch, &format!("q{i}")).await;
        publish(&ch, &format!("q{i}"), format!("m{i}").as_bytes()).await;
        channels.push(ch);
    }
    // An error on one channel closes only that channel.
    let e = channels[7]
        .queue_declare(
            "missing".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(404));
    for (i, ch) in channels.iter().enumerate().filter(|(i, _)| *i != 7) {
        let m = ch
            .basic_get(
                format!("q{i}").as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
            .unwrap();
        assert_eq!(m.delivery.data, format!("m{i}").as_bytes());
    }
}

#[tokio::test]
async fn round_robin_between_consumers_of_one_queue() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q").await;
    let opts = BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    let mut a = ch
        .basic_consume("q".into(), "a".into(), opts, FieldTable::default())
        .await
        .unwrap();
    let mut bb = ch
        .basic_consume("q".into(), "b".into(), opts, FieldTable::default())
        .await
        .unwrap();
    for i in 0..4u8 {
        publish(&ch, "q", &[i]).await;
    }
    let got_a = [next(&mut a).await.data[0], next(&mut a).await.data[0]];
    let got_b = [next(&mut bb).await.data[0], next(&mut bb).await.data[0]];
    assert_eq!((got_a, got_b), ([0, 2], [1, 3]));
}

#[tokio::test]
async fn delivery_tags_rise_while_another_connection_publishes_and_multiple_acks_flow() {
    // Deliveries reach a consumer two ways: dispatched by the publisher's connection (through
    // the consumer's mailbox) and by the consumer's own acks. If the second overtook the
    // first, the client would see a tag below one it had acked with `multiple`, which acks
    // messages it was never sent.
    const MESSAGES: u32 = 30_000;
    let b = Broker::start();
    let (_pc, publisher) = b.channel().await;
    let (_cc, consumer_ch) = b.channel().await;
    declare(&publisher, "tags").await;
    consumer_ch
        .basic_qos(500, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = consumer_ch
        .basic_consume(
            "tags".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let publishing = tokio::spawn(async move {
        for i in 0..MESSAGES {
            publish(&publisher, "tags", &i.to_be_bytes()).await;
        }
        publisher
    });
    let mut last = 0;
    for n in 1..=MESSAGES {
        let d = next(&mut consumer).await;
        assert!(
            d.delivery_tag > last,
            "delivery tag {} after {last} (message {n})",
            d.delivery_tag
        );
        last = d.delivery_tag;
        if n % 50 == 0 {
            d.acker
                .ack(BasicAckOptions { multiple: true })
                .await
                .unwrap();
        }
    }
    let _publisher = publishing.await.unwrap();
}

/// Consumer priorities, as RabbitMQ has them: `x-priority` on basic.consume; the
/// higher-priority consumer gets the messages while it has room, the lower one the rest;
/// a priority that is not an integer is 406.
#[tokio::test]
async fn a_higher_priority_consumer_gets_messages_first_and_a_bad_priority_is_406() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "prio").await;
    let mut consumers = Vec::new();
    for (tag, priority) in [("low", 0), ("high", 10)] {
        let (c, consumer_ch) = b.channel().await;
        consumer_ch
            .basic_qos(2, BasicQosOptions::default())
            .await
            .unwrap();
        let mut args = FieldTable::default();
        args.insert("x-priority".into(), AMQPValue::LongInt(priority));
        let consumer = consumer_ch
            .basic_consume(
                "prio".into(),
                tag.into(),
                BasicConsumeOptions::default(),
                args,
            )
            .await
            .unwrap();
        consumers.push((c, consumer_ch, consumer));
    }
    for m in ["1", "2", "3"] {
        publish(&ch, "prio", m.as_bytes()).await;
    }
    let body = |d: Delivery| String::from_utf8(d.data).unwrap();
    let high = &mut consumers[1].2;
    assert_eq!([body(next(high).await), body(next(high).await)], ["1", "2"]);
    let low = &mut consumers[0].2;
    assert_eq!(
        body(next(low).await),
        "3",
        "the low one once the high one is full"
    );

    let (_c2, bad) = b.channel().await;
    let mut args = FieldTable::default();
    args.insert("x-priority".into(), AMQPValue::LongString("high".into()));
    let e = bad
        .basic_consume(
            "prio".into(),
            "bad".into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406));
}
