//! Queue declaration, deletion and the `x-` arguments: the suite that defines single-broker behaviour, run against one broker
//! (`tests/tests/queues.rs`) and again on a three-member cluster (`tests/tests/on_cluster.rs`),
//! where `crate::Broker` spreads connections and queue primaries over the members.

use crate::Broker;
use futures_lite::StreamExt;
use lapin::Confirmation;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use ringmq_tests::{bodies, depth, reply_code};
use std::time::Duration;

fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

async fn declare(ch: &Channel, name: &str, a: FieldTable) -> lapin::Result<lapin::Queue> {
    ch.queue_declare(name.into(), QueueDeclareOptions::default(), a)
        .await
}

async fn publish(ch: &Channel, ex: &str, key: &str, body: &[u8], props: BasicProperties) {
    ch.basic_publish(
        ex.into(),
        key.into(),
        BasicPublishOptions::default(),
        body,
        props,
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn server_named_queues_start_with_amq_gen() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    let q = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert!(q.name().as_str().starts_with("amq.gen-"), "{}", q.name());
    let q2 = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_ne!(q.name(), q2.name());
}

#[tokio::test]
async fn declare_reports_counts_and_passive_checks_existence() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    declare(&ch, "q", FieldTable::default()).await.unwrap();
    publish(&ch, "", "q", b"1", BasicProperties::default()).await;
    publish(&ch, "", "q", b"2", BasicProperties::default()).await;
    let ch2 = c.create_channel().await.unwrap();
    let q = ch2
        .queue_declare(
            "q".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(q.message_count(), 2);
    let e = ch2
        .queue_declare(
            "nope".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(404));
}

#[tokio::test]
async fn redeclare_with_other_properties_fails_with_precondition_failed() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    declare(
        &ch,
        "q",
        args(&[("x-message-ttl", AMQPValue::LongInt(1000))]),
    )
    .await
    .unwrap();
    declare(
        &ch,
        "q",
        args(&[("x-message-ttl", AMQPValue::LongLongInt(1000))]),
    )
    .await
    .unwrap();
    let e = ch
        .queue_declare(
            "q".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args(&[("x-message-ttl", AMQPValue::LongInt(1000))]),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406));
    let ch = c.create_channel().await.unwrap();
    let e = declare(&ch, "q", args(&[("x-message-ttl", AMQPValue::LongInt(5))]))
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406));
    let ch = c.create_channel().await.unwrap();
    let e = declare(
        &ch,
        "bad",
        args(&[("x-max-priority", AMQPValue::LongInt(1000))]),
    )
    .await
    .unwrap_err();
    assert_eq!(reply_code(&e), Some(406));
    let ch = c.create_channel().await.unwrap();
    let e = declare(&ch, "amq.reserved", FieldTable::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(403));
}

#[tokio::test]
async fn exclusive_queue_is_locked_to_its_connection_and_goes_with_it() {
    let b = Broker::start();
    let owner = b.connect().await;
    let och = owner.create_channel().await.unwrap();
    och.queue_declare(
        "ex".into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let other = b.connect().await;
    let ch = other.create_channel().await.unwrap();
    let e = ch
        .queue_declare(
            "ex".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(405));
    let ch = other.create_channel().await.unwrap();
    let e = ch
        .basic_consume(
            "ex".into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(405));
    owner.close(200, "bye".into()).await.unwrap();
    let ch = other.create_channel().await.unwrap();
    let e = ch
        .queue_declare(
            "ex".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        reply_code(&e),
        Some(404),
        "exclusive queue is deleted with its connection"
    );
}

#[tokio::test]
async fn auto_delete_queue_goes_when_its_last_consumer_cancels() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    ch.queue_declare(
        "ad".into(),
        QueueDeclareOptions {
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    // lapin cancels a consumer whose stream is dropped: keep both alive.
    let _c1 = ch
        .basic_consume(
            "ad".into(),
            "c1".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _c2 = ch
        .basic_consume(
            "ad".into(),
            "c2".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    ch.basic_cancel("c1".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    assert_eq!(depth(&ch, "ad").await, 0, "still there with one consumer");
    ch.basic_cancel("c2".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    let e = ch
        .queue_declare(
            "ad".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(404));
}

#[tokio::test]
async fn purge_and_delete_with_if_unused_and_if_empty() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    declare(&ch, "q", FieldTable::default()).await.unwrap();
    for _ in 0..3 {
        publish(&ch, "", "q", b"m", BasicProperties::default()).await;
    }
    let e = ch
        .queue_delete(
            "q".into(),
            QueueDeleteOptions {
                if_empty: true,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406));
    let ch = c.create_channel().await.unwrap();
    assert_eq!(
        ch.queue_purge("q".into(), QueuePurgeOptions::default())
            .await
            .unwrap(),
        3
    );
    let _consumer = ch
        .basic_consume(
            "q".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let e = ch
        .queue_delete(
            "q".into(),
            QueueDeleteOptions {
                if_unused: true,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406));
    let ch = c.create_channel().await.unwrap();
    publish(&ch, "", "q", b"m", BasicProperties::default()).await;
    assert_eq!(
        ch.queue_delete("q".into(), QueueDeleteOptions::default())
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        ch.queue_delete("q".into(), QueueDeleteOptions::default())
            .await
            .unwrap(),
        0,
        "deleting a missing queue succeeds"
    );
}

#[tokio::test]
async fn message_ttl_expires_messages_and_the_shorter_ttl_wins() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(
        &ch,
        "ttl",
        args(&[("x-message-ttl", AMQPValue::LongInt(200))]),
    )
    .await
    .unwrap();
    declare(&ch, "plain", FieldTable::default()).await.unwrap();
    publish(&ch, "", "ttl", b"queue-ttl", BasicProperties::default()).await;
    publish(
        &ch,
        "",
        "plain",
        b"msg-ttl",
        BasicProperties::default().with_expiration("100".into()),
    )
    .await;
    publish(&ch, "", "plain", b"no-ttl", BasicProperties::default()).await;
    assert_eq!(depth(&ch, "ttl").await, 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(depth(&ch, "ttl").await, 0);
    assert_eq!(bodies(&ch, "plain").await, vec!["no-ttl"]);
}

#[tokio::test]
async fn zero_ttl_messages_reach_ready_consumers_or_nobody() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", FieldTable::default()).await.unwrap();
    publish(
        &ch,
        "",
        "q",
        b"now-or-never",
        BasicProperties::default().with_expiration("0".into()),
    )
    .await;
    assert_eq!(depth(&ch, "q").await, 0);
    let mut consumer = ch
        .basic_consume(
            "q".into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish(
        &ch,
        "",
        "q",
        b"delivered",
        BasicProperties::default().with_expiration("0".into()),
    )
    .await;
    let d = tokio::time::timeout(Duration::from_secs(5), consumer.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(d.data, b"delivered");
}

#[tokio::test]
async fn invalid_expiration_closes_the_channel_with_precondition_failed() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", FieldTable::default()).await.unwrap();
    let props = ringmq::amqp::Properties::default().with_expiration("soon".into());
    let frames = ringmq_tests::publish_frames("", "q", &props, b"x");
    assert_eq!(
        ringmq_tests::channel_close_code_after(&b, &frames).await,
        406
    );
}

#[tokio::test]
async fn unused_queue_expires_after_x_expires() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(
        &ch,
        "short-lived",
        args(&[("x-expires", AMQPValue::LongInt(200))]),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let e = ch
        .queue_declare(
            "short-lived".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(404));
}

#[tokio::test]
async fn max_length_drop_head_keeps_the_newest() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "q", args(&[("x-max-length", AMQPValue::LongInt(2))]))
        .await
        .unwrap();
    for m in ["1", "2", "3", "4"] {
        publish(&ch, "", "q", m.as_bytes(), BasicProperties::default()).await;
    }
    assert_eq!(bodies(&ch, "q").await, vec!["3", "4"]);
    declare(
        &ch,
        "bytes",
        args(&[("x-max-length-bytes", AMQPValue::LongInt(10))]),
    )
    .await
    .unwrap();
    for m in ["aaaa", "bbbb", "cccc"] {
        publish(&ch, "", "bytes", m.as_bytes(), BasicProperties::default()).await;
    }
    assert_eq!(bodies(&ch, "bytes").await, vec!["bbbb", "cccc"]);
}

#[tokio::test]
async fn max_length_reject_publish_nacks_the_publisher() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare(
        &ch,
        "q",
        args(&[
            ("x-max-length", AMQPValue::LongInt(1)),
            ("x-overflow", AMQPValue::LongString("reject-publish".into())),
        ]),
    )
    .await
    .unwrap();
    let first = ch
        .basic_publish(
            "".into(),
            "q".into(),
            BasicPublishOptions::default(),
            b"kept",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let second = ch
        .basic_publish(
            "".into(),
            "q".into(),
            BasicPublishOptions::default(),
            b"refused",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(matches!(first, Confirmation::Ack(_)), "{first:?}");
    assert!(matches!(second, Confirmation::Nack(_)), "{second:?}");
    assert_eq!(bodies(&ch, "q").await, vec!["kept"]);
}

#[tokio::test]
async fn dead_letters_carry_x_death_and_go_to_the_dead_letter_exchange() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(&ch, "dead", FieldTable::default()).await.unwrap();
    ch.queue_bind(
        "dead".into(),
        "amq.direct".into(),
        "dlk".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    declare(
        &ch,
        "work",
        args(&[
            (
                "x-dead-letter-exchange",
                AMQPValue::LongString("amq.direct".into()),
            ),
            (
                "x-dead-letter-routing-key",
                AMQPValue::LongString("dlk".into()),
            ),
            ("x-message-ttl", AMQPValue::LongInt(100)),
        ]),
    )
    .await
    .unwrap();
    publish(&ch, "", "work", b"first", BasicProperties::default()).await;
    publish(&ch, "", "work", b"second", BasicProperties::default()).await;
    // The first is rejected by a consumer; the second expires while the first is out.
    let got = ch
        .basic_get("work".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.delivery.data, b"first");
    got.delivery
        .nack(BasicNackOptions {
            requeue: false,
            ..Default::default()
        })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut seen = Vec::new();
    while let Some(m) = ch
        .basic_get("dead".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let headers = m.delivery.properties.headers().clone().unwrap();
        let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else {
            panic!("no x-death: {headers:?}")
        };
        let AMQPValue::FieldTable(death) = &deaths.as_slice()[0] else {
            panic!()
        };
        let reason = match death.inner().get("reason") {
            Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
            other => panic!("reason {other:?}"),
        };
        assert!(
            matches!(death.inner().get("queue"), Some(AMQPValue::LongString(q)) if q.as_bytes() == b"work")
        );
        assert!(matches!(
            death.inner().get("count"),
            Some(AMQPValue::LongLongInt(1))
        ));
        assert_eq!(m.delivery.routing_key.as_str(), "dlk");
        seen.push((String::from_utf8(m.delivery.data.clone()).unwrap(), reason));
    }
    assert_eq!(
        seen,
        vec![
            ("first".to_owned(), "rejected".to_owned()),
            ("second".to_owned(), "expired".to_owned())
        ]
    );
}

#[tokio::test]
async fn priority_queue_delivers_higher_priorities_first() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(
        &ch,
        "pq",
        args(&[("x-max-priority", AMQPValue::ShortShortUInt(5))]),
    )
    .await
    .unwrap();
    for (body, p) in [
        ("low", 1u8),
        ("high", 5),
        ("mid", 3),
        ("over", 9),
        ("none", 0),
    ] {
        publish(
            &ch,
            "",
            "pq",
            body.as_bytes(),
            BasicProperties::default().with_priority(p),
        )
        .await;
    }
    assert_eq!(
        bodies(&ch, "pq").await,
        vec!["high", "over", "mid", "low", "none"]
    );
}

#[tokio::test]
async fn single_active_consumer_gets_everything_until_it_cancels() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    declare(
        &ch,
        "sac",
        args(&[("x-single-active-consumer", AMQPValue::Boolean(true))]),
    )
    .await
    .unwrap();
    let opts = BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    let mut first = ch
        .basic_consume("sac".into(), "first".into(), opts, FieldTable::default())
        .await
        .unwrap();
    let mut second = ch
        .basic_consume("sac".into(), "second".into(), opts, FieldTable::default())
        .await
        .unwrap();
    for m in ["a", "b", "c"] {
        publish(&ch, "", "sac", m.as_bytes(), BasicProperties::default()).await;
    }
    for m in ["a", "b", "c"] {
        let d = tokio::time::timeout(Duration::from_secs(5), first.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(d.data, m.as_bytes());
    }
    ch.basic_cancel("first".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    publish(&ch, "", "sac", b"d", BasicProperties::default()).await;
    let d = tokio::time::timeout(Duration::from_secs(5), second.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(d.data, b"d");
}
