//! `max_unacked_per_channel`: a broker-side cap on unacked deliveries per channel that the
//! client's prefetch cannot lift. Consumers wait at it (messages stay ready in the queue);
//! basic.get past it is 406.

use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use ringmq::amqp::{AMQPClass, basic, queue};
use ringmq::client::{ClientError, RawClient, Target};
use ringmq_tests::{Broker, depth};
use std::time::Duration;

const CONFIG: &str = "max_unacked_per_channel: 3\n";

#[tokio::test]
async fn a_consumer_without_prefetch_stops_at_the_cap_until_it_acks() {
    let b = Broker::start_with_config(CONFIG);
    let (_conn, ch) = b.channel().await;
    ch.queue_declare("q".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    for i in 0..10 {
        ch.basic_publish(
            "".into(),
            "q".into(),
            Default::default(),
            format!("m{i}").as_bytes(),
            Default::default(),
        )
        .await
        .unwrap();
    }
    let (_c2, consumer_ch) = b.channel().await;
    let mut consumer = consumer_ch
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
        let d = tokio::time::timeout(Duration::from_secs(5), consumer.next())
            .await
            .expect("a delivery below the cap")
            .unwrap()
            .unwrap();
        got.push(d);
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(300), consumer.next())
            .await
            .is_err(),
        "a fourth delivery went past the cap"
    );
    assert_eq!(depth(&ch, "q").await, 7, "the rest stay ready in the queue");
    got[0].ack(BasicAckOptions::default()).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(5), consumer.next())
        .await
        .expect("an ack makes room for one more")
        .unwrap()
        .unwrap();
    assert_eq!(d.data, b"m3");
}

#[tokio::test]
async fn basic_get_past_the_cap_is_precondition_failed() {
    let b = Broker::start_with_config(CONFIG);
    let mut c = RawClient::connect(&Target::parse(&b.uri()).unwrap())
        .await
        .unwrap();
    c.call(
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q".into(),
            ..Default::default()
        })),
        |m| matches!(m, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))),
        "declare-ok",
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    for _ in 0..5 {
        ringmq::client::encode_publish(&mut out, 1, "", "q", false, b"m", c.frame_max);
    }
    tokio::io::AsyncWriteExt::write_all(&mut c.stream, &out)
        .await
        .unwrap();
    let get = || {
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "q".into(),
            no_ack: false,
        }))
    };
    let mut taken = 0;
    for _ in 0..1000 {
        if let AMQPClass::Basic(basic::AMQPMethod::GetOk(_)) =
            c.call(get(), |_| true, "get-ok").await.unwrap()
        {
            taken += 1;
            if taken == 3 {
                break;
            }
        }
    }
    assert_eq!(taken, 3);
    // A no-ack get is not held: nothing is left unacked by it.
    let r = c
        .call(
            AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: "q".into(),
                no_ack: true,
            })),
            |_| true,
            "get-ok",
        )
        .await;
    assert!(r.is_ok(), "{r:?}");
    match c.call(get(), |_| true, "get-ok").await {
        Err(ClientError::Closed {
            scope: "channel",
            code: 406,
            text,
        }) => assert!(text.contains("unacked message limit"), "{text}"),
        r => panic!("expected 406, got {r:?}"),
    }
}
