//! Exchanges and bindings: the suite that defines single-broker behaviour, run against one broker
//! (`tests/tests/routing.rs`) and again on a three-member cluster (`tests/tests/on_cluster.rs`),
//! where `crate::Broker` spreads connections and queue primaries over the members.

use crate::Broker;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ExchangeKind};
use ringmq_tests::{bodies, reply_code};
use std::time::Duration;

async fn queue(ch: &Channel, name: &str) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
}

async fn bind(ch: &Channel, q: &str, ex: &str, key: &str) {
    ch.queue_bind(
        q.into(),
        ex.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
}

async fn publish(ch: &Channel, ex: &str, key: &str, body: &[u8]) {
    ch.basic_publish(
        ex.into(),
        key.into(),
        BasicPublishOptions::default(),
        body,
        BasicProperties::default(),
    )
    .await
    .unwrap();
}

async fn count(ch: &Channel, q: &str) -> u32 {
    ch.queue_declare(
        q.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap()
    .message_count()
}

/// A round trip on the channel: the broker handles a channel's frames in order, so every
/// publish sent before it has been routed when this returns.
async fn settle(ch: &Channel) {
    ch.basic_qos(0, BasicQosOptions::default()).await.unwrap();
}

#[tokio::test]
async fn default_exchange_routes_by_queue_name() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    queue(&ch, "q1").await;
    publish(&ch, "", "q1", b"a").await;
    publish(&ch, "", "nope", b"b").await;
    settle(&ch).await;
    assert_eq!(bodies(&ch, "q1").await, vec!["a"]);
}

#[tokio::test]
async fn direct_fanout_and_topic_route_like_rabbitmq() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    for q in ["d", "f1", "f2", "t1", "t2"] {
        queue(&ch, q).await;
    }
    ch.exchange_declare(
        "x.direct".into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.exchange_declare(
        "x.fanout".into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.exchange_declare(
        "x.topic".into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    bind(&ch, "d", "x.direct", "red").await;
    bind(&ch, "f1", "x.fanout", "ignored").await;
    bind(&ch, "f2", "x.fanout", "").await;
    bind(&ch, "t1", "x.topic", "stock.*.nyse").await;
    bind(&ch, "t2", "x.topic", "stock.#").await;
    publish(&ch, "x.direct", "red", b"r").await;
    publish(&ch, "x.direct", "blue", b"b").await;
    publish(&ch, "x.fanout", "any", b"f").await;
    publish(&ch, "x.topic", "stock.ibm.nyse", b"t-ibm").await;
    publish(&ch, "x.topic", "stock.eu.lse.x", b"t-lse").await;
    publish(&ch, "x.topic", "bond.x", b"t-bond").await;
    settle(&ch).await;
    assert_eq!(bodies(&ch, "d").await, vec!["r"]);
    assert_eq!(bodies(&ch, "f1").await, vec!["f"]);
    assert_eq!(bodies(&ch, "f2").await, vec!["f"]);
    assert_eq!(bodies(&ch, "t1").await, vec!["t-ibm"]);
    assert_eq!(bodies(&ch, "t2").await, vec!["t-ibm", "t-lse"]);
}

#[tokio::test]
async fn headers_exchange_matches_all_and_any() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    queue(&ch, "all").await;
    queue(&ch, "any").await;
    let table = |pairs: &[(&str, AMQPValue)]| {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    };
    let s = |v: &str| AMQPValue::LongString(v.into());
    ch.queue_bind(
        "all".into(),
        "amq.headers".into(),
        "".into(),
        QueueBindOptions::default(),
        table(&[
            ("x-match", s("all")),
            ("format", s("pdf")),
            ("type", s("report")),
        ]),
    )
    .await
    .unwrap();
    ch.queue_bind(
        "any".into(),
        "amq.headers".into(),
        "".into(),
        QueueBindOptions::default(),
        table(&[
            ("x-match", s("any")),
            ("format", s("pdf")),
            ("type", s("log")),
        ]),
    )
    .await
    .unwrap();
    for (body, headers) in [
        (
            "both",
            table(&[("format", s("pdf")), ("type", s("report"))]),
        ),
        ("one", table(&[("format", s("pdf"))])),
        ("none", table(&[("format", s("zip"))])),
    ] {
        ch.basic_publish(
            "amq.headers".into(),
            "".into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            BasicProperties::default().with_headers(headers),
        )
        .await
        .unwrap();
    }
    settle(&ch).await;
    assert_eq!(bodies(&ch, "all").await, vec!["both"]);
    assert_eq!(bodies(&ch, "any").await, vec!["both", "one"]);
}

#[tokio::test]
async fn exchange_to_exchange_bindings_route_once_per_queue() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    queue(&ch, "q").await;
    for ex in ["a", "b"] {
        ch.exchange_declare(
            ex.into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    ch.exchange_bind(
        "b".into(),
        "a".into(),
        "".into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    // A cycle back to a, and two paths to q: the message still arrives once.
    ch.exchange_bind(
        "a".into(),
        "b".into(),
        "".into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    bind(&ch, "q", "a", "").await;
    bind(&ch, "q", "b", "").await;
    publish(&ch, "a", "", b"once").await;
    settle(&ch).await;
    assert_eq!(bodies(&ch, "q").await, vec!["once"]);
    ch.exchange_unbind(
        "b".into(),
        "a".into(),
        "".into(),
        ExchangeUnbindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_unbind("q".into(), "a".into(), "".into(), FieldTable::default())
        .await
        .unwrap();
    publish(&ch, "a", "", b"gone").await;
    settle(&ch).await;
    assert_eq!(count(&ch, "q").await, 0);
}

#[tokio::test]
async fn amq_prefix_and_default_exchange_are_reserved() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    let e = ch
        .exchange_declare(
            "amq.mine".into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(403));
    let ch = c.create_channel().await.unwrap();
    queue(&ch, "q").await;
    let e = ch
        .queue_bind(
            "q".into(),
            "".into(),
            "q".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(403));
    let ch = c.create_channel().await.unwrap();
    let e = ch
        .exchange_delete("amq.direct".into(), ExchangeDeleteOptions::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(403));
    // Passive declares of the predeclared exchanges succeed.
    let ch = c.create_channel().await.unwrap();
    for ex in [
        "amq.direct",
        "amq.fanout",
        "amq.topic",
        "amq.headers",
        "amq.match",
    ] {
        ch.exchange_declare(
            ex.into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
}

#[tokio::test]
async fn exchange_declare_checks_type_equivalence_and_passive() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    ch.exchange_declare(
        "e".into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.exchange_declare(
        "e".into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let e = ch
        .exchange_declare(
            "e".into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406));
    let ch = c.create_channel().await.unwrap();
    let e = ch
        .exchange_declare(
            "missing".into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(404));
    // The connection survived those channel errors.
    let ch = c.create_channel().await.unwrap();
    ch.exchange_declare(
        "e".into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn unknown_exchange_type_closes_the_connection_with_command_invalid() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    let e = ch
        .exchange_declare(
            "e".into(),
            ExchangeKind::Custom("x-nope".into()),
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(503));
}

#[tokio::test]
async fn exchange_delete_if_unused_and_auto_delete() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    queue(&ch, "q").await;
    ch.exchange_declare(
        "used".into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    bind(&ch, "q", "used", "k").await;
    let e = ch
        .exchange_delete(
            "used".into(),
            ExchangeDeleteOptions {
                if_unused: true,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406));
    let ch = c.create_channel().await.unwrap();
    ch.exchange_delete("used".into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    ch.exchange_declare(
        "ad".into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions {
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    bind(&ch, "q", "ad", "k").await;
    ch.queue_unbind("q".into(), "ad".into(), "k".into(), FieldTable::default())
        .await
        .unwrap();
    let e = ch
        .exchange_declare(
            "ad".into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
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
        "auto-delete exchange goes with its last binding"
    );
}

#[tokio::test]
async fn internal_exchange_refuses_direct_publishes() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    ch.exchange_declare(
        "int".into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            internal: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let frames = ringmq_tests::publish_frames("int", "", &Default::default(), b"x");
    assert_eq!(
        ringmq_tests::channel_close_code_after(&b, &frames).await,
        403
    );
}

#[tokio::test]
async fn publishing_to_a_missing_exchange_closes_the_channel_with_404() {
    let b = Broker::start();
    let c = b.connect().await;
    let ch = c.create_channel().await.unwrap();
    let frames = ringmq_tests::publish_frames("missing", "", &Default::default(), b"x");
    assert_eq!(
        ringmq_tests::channel_close_code_after(&b, &frames).await,
        404
    );
    queue(&ch, "still-works").await;
}

#[tokio::test]
async fn alternate_exchange_receives_unroutable_messages() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    queue(&ch, "unrouted").await;
    ch.exchange_declare(
        "ae".into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    bind(&ch, "unrouted", "ae", "").await;
    let mut args = FieldTable::default();
    args.insert(
        "alternate-exchange".into(),
        AMQPValue::LongString("ae".into()),
    );
    ch.exchange_declare(
        "main".into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        args,
    )
    .await
    .unwrap();
    publish(&ch, "main", "nobody", b"lost?").await;
    settle(&ch).await;
    assert_eq!(bodies(&ch, "unrouted").await, vec!["lost?"]);
}

#[tokio::test]
async fn consumers_on_two_queues_each_get_a_fanout_copy() {
    let b = Broker::start();
    let (_c, ch) = b.channel().await;
    queue(&ch, "c1").await;
    queue(&ch, "c2").await;
    bind(&ch, "c1", "amq.fanout", "").await;
    bind(&ch, "c2", "amq.fanout", "").await;
    let mut s1 = ch
        .basic_consume(
            "c1".into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut s2 = ch
        .basic_consume(
            "c2".into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish(&ch, "amq.fanout", "", b"copy").await;
    for s in [&mut s1, &mut s2] {
        let d = tokio::time::timeout(Duration::from_secs(5), s.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(d.data, b"copy");
    }
}
