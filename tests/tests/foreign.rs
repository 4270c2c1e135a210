//! Foreign proxies: `queue.declare` with `qpid.cluster.proxy: amqp://…` makes a local proxy
//! for a queue on another AMQP 0-9-1 broker — here a real RabbitMQ started by the test.

use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use ringmq_tests::rabbitmq::RabbitMq;
use ringmq_tests::{Broker, queue_counts, reply_code, wait_queue_gone};
use std::time::Duration;

fn proxy_to(uri: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "qpid.cluster.proxy".into(),
        AMQPValue::LongString(uri.into()),
    );
    args
}

#[tokio::test]
async fn a_proxy_for_a_rabbitmq_queue_publishes_consumes_and_follows_its_deletion() {
    let rabbit = RabbitMq::start();
    let rconn = lapin::Connection::connect(&rabbit.uri(), Default::default())
        .await
        .expect("RabbitMQ accepts guest on loopback");
    let rch = rconn.create_channel().await.unwrap();
    rch.queue_declare(
        "upstream".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();

    let broker = Broker::start();
    let (_c, ch) = broker.channel().await;
    // The other broker must have the queue.
    let refused = ch
        .queue_declare(
            "missing".into(),
            QueueDeclareOptions::default(),
            proxy_to(&rabbit.uri()),
        )
        .await
        .expect_err("no such queue on RabbitMQ");
    assert_eq!(reply_code(&refused), Some(404));
    let (_c, ch) = broker.channel().await;
    ch.queue_declare(
        "upstream".into(),
        QueueDeclareOptions::default(),
        proxy_to(&rabbit.uri()),
    )
    .await
    .unwrap();

    // Publishes reach RabbitMQ's queue, confirmed once RabbitMQ confirmed them.
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for i in 0..5 {
        let confirm = ch
            .basic_publish(
                "".into(),
                "upstream".into(),
                BasicPublishOptions::default(),
                format!("f-{i}").as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap();
        assert!(confirm.await.unwrap().is_ack());
    }
    assert_eq!(
        queue_counts(&rch, "upstream").await.map(|(ready, _)| ready),
        Ok(5)
    );

    // A get and a consumer through the proxy take them from RabbitMQ, in order.
    let first = ch
        .basic_get("upstream".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("a message from RabbitMQ");
    assert_eq!(first.delivery.data, b"f-0");
    let mut consumer = ch
        .basic_consume(
            "upstream".into(),
            "from-rabbit".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for i in 1..5 {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a delivery")
            .unwrap()
            .unwrap();
        assert_eq!(d.data, format!("f-{i}").as_bytes());
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        queue_counts(&rch, "upstream").await.map(|(ready, _)| ready),
        Ok(0)
    );

    // The queue goes on RabbitMQ: the proxy's consumer is cancelled and the proxy goes.
    rch.queue_delete("upstream".into(), Default::default())
        .await
        .unwrap();
    let end = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("the consumer ends");
    assert!(!matches!(end, Some(Ok(_))), "no more deliveries: {end:?}");
    wait_queue_gone(&broker, "upstream", Duration::from_secs(30)).await;
}
