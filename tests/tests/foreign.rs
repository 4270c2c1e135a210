//! Foreign proxies: `queue.declare` or `exchange.declare` with `qpid.cluster.proxy: amqp://…`
//! makes a local proxy for a queue or exchange on another AMQP 0-9-1 broker — here a real
//! RabbitMQ started by the test.

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, ExchangeKind};
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

/// Whether RabbitMQ has `queue` (a passive declare on a channel of its own).
async fn rabbit_has_queue(rconn: &lapin::Connection, queue: &str) -> bool {
    let ch = rconn.create_channel().await.unwrap();
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
    {
        Ok(_) => true,
        Err(e) => {
            assert_eq!(reply_code(&e), Some(404), "{e}");
            false
        }
    }
}

/// Publishes `body` with `key` to `exchange` and waits for the confirm.
async fn publish_confirmed(ch: &lapin::Channel, exchange: &str, key: &str, body: &str) {
    let confirm = ch
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap();
    assert!(confirm.await.unwrap().is_ack(), "{body} confirmed");
}

#[tokio::test]
async fn publishes_through_a_foreign_exchange_proxy_reach_rabbitmq_and_are_confirmed_after_it() {
    let rabbit = RabbitMq::start();
    let rconn = lapin::Connection::connect(&rabbit.uri(), Default::default())
        .await
        .expect("RabbitMQ accepts guest on loopback");
    let rch = rconn.create_channel().await.unwrap();
    rch.exchange_declare(
        "orders".into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    for (queue, key) in [("eu-orders", "eu.*"), ("us-orders", "us.*")] {
        rch.queue_declare(
            queue.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        rch.queue_bind(
            queue.into(),
            "orders".into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    }

    let broker = Broker::start();
    let (_c, ch) = broker.channel().await;
    // The other broker must have the exchange.
    let refused = ch
        .exchange_declare(
            "no-such-exchange".into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions::default(),
            proxy_to(&rabbit.uri()),
        )
        .await
        .expect_err("no such exchange on RabbitMQ");
    assert_eq!(reply_code(&refused), Some(404));
    let (_c, ch) = broker.channel().await;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let nothing = ch
        .exchange_declare(
            "no-such-exchange".into(),
            ExchangeKind::Topic,
            passive,
            FieldTable::default(),
        )
        .await
        .expect_err("the refused declare created nothing");
    assert_eq!(reply_code(&nothing), Some(404));
    let (_c, ch) = broker.channel().await;
    ch.exchange_declare(
        "orders".into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        proxy_to(&rabbit.uri()),
    )
    .await
    .unwrap();

    // RabbitMQ routes them with the client's routing key; confirms come after its own.
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for i in 0..3 {
        publish_confirmed(&ch, "orders", "eu.paris", &format!("eu-{i}")).await;
    }
    publish_confirmed(&ch, "orders", "us.boston", "us-0").await;
    publish_confirmed(&ch, "orders", "asia.tokyo", "nowhere").await;
    assert_eq!(
        queue_counts(&rch, "eu-orders")
            .await
            .map(|(ready, _)| ready),
        Ok(3)
    );
    assert_eq!(
        queue_counts(&rch, "us-orders")
            .await
            .map(|(ready, _)| ready),
        Ok(1)
    );
    // The message as the client sent it: exchange, routing key, properties, body.
    let got = rch
        .basic_get("eu-orders".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("a message on RabbitMQ");
    assert_eq!(got.delivery.exchange.as_str(), "orders");
    assert_eq!(got.delivery.routing_key.as_str(), "eu.paris");
    assert_eq!(*got.delivery.properties.delivery_mode(), Some(2));
    assert_eq!(got.delivery.data, b"eu-0");

    // The exchange goes on RabbitMQ: the proxy goes too (the 10 s check).
    rch.exchange_delete("orders".into(), Default::default())
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_c, ch) = broker.channel().await;
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let found = ch
            .exchange_declare(
                "orders".into(),
                ExchangeKind::Topic,
                passive,
                FieldTable::default(),
            )
            .await;
        match found {
            Err(e) if reply_code(&e) == Some(404) => break,
            _ => {}
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the proxy of a deleted exchange is removed"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let log = broker.log.lock().unwrap().join("\n");
    assert!(!log.contains("guest:guest@"), "no password in the log");
}

#[tokio::test]
async fn a_queue_bound_to_a_foreign_exchange_gets_what_rabbitmq_routes_to_the_binding() {
    let rabbit = RabbitMq::start();
    // A vhost whose name must be percent-encoded in the URI.
    rabbit.add_vhost("ringmq/feeds");
    let uri = rabbit.uri_for("ringmq/feeds");
    assert!(uri.ends_with("/ringmq%2ffeeds"), "{uri}");
    let rconn = lapin::Connection::connect(&uri, Default::default())
        .await
        .expect("RabbitMQ accepts guest in its new vhost");
    let rch = rconn.create_channel().await.unwrap();
    rch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    rch.exchange_declare(
        "events".into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();

    let broker = Broker::start();
    let (_c, ch) = broker.channel().await;
    ch.exchange_declare(
        "events".into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        proxy_to(&uri),
    )
    .await
    .unwrap();
    ch.queue_declare(
        "local".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        "local".into(),
        "events".into(),
        "wanted".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    // bind-ok means bound on RabbitMQ: a private queue there, bound the same way.
    let private: Vec<String> = rabbit
        .queues("ringmq/feeds")
        .into_iter()
        .map(|(name, _)| name)
        .filter(|q| q.starts_with("ringmq.feed.local."))
        .collect();
    assert_eq!(private.len(), 1, "one private queue: {private:?}");
    let private = private[0].clone();

    // Published on RabbitMQ: what matches the binding arrives here, in order; the rest not.
    for (key, body) in [("wanted", "w-0"), ("other", "o-0"), ("wanted", "w-1")] {
        publish_confirmed(&rch, "events", key, body).await;
    }
    let mut consumer = ch
        .basic_consume(
            "local".into(),
            "local-consumer".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for expected in ["w-0", "w-1"] {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a message fed from RabbitMQ")
            .unwrap()
            .unwrap();
        assert_eq!(d.data, expected.as_bytes());
        assert_eq!(d.exchange.as_str(), "events");
        assert_eq!(d.routing_key.as_str(), "wanted");
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(500), consumer.next())
            .await
            .is_err(),
        "what did not match the binding stays away"
    );
    // Acked on RabbitMQ once enqueued here: nothing left in the private queue.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let left = || {
        rabbit
            .queues("ringmq/feeds")
            .into_iter()
            .find(|(name, _)| *name == private)
            .map(|(_, messages)| messages)
    };
    while left() != Some(0) {
        assert!(
            std::time::Instant::now() < deadline,
            "the private queue is drained and acked"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Unbound: nothing published afterwards arrives, and the private queue goes.
    ch.queue_unbind(
        "local".into(),
        "events".into(),
        "wanted".into(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    publish_confirmed(&rch, "events", "wanted", "late").await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while rabbit_has_queue(&rconn, &private).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the private queue is deleted on RabbitMQ"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(500), consumer.next())
            .await
            .is_err(),
        "nothing arrives after the unbind"
    );

    // Bound again and the queue deleted here: the private queue goes with the binding.
    ch.queue_bind(
        "local".into(),
        "events".into(),
        "wanted".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    assert!(rabbit_has_queue(&rconn, &private).await);
    ch.queue_delete("local".into(), Default::default())
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while rabbit_has_queue(&rconn, &private).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the private queue goes with the local queue"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
