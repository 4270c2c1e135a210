//! Configured limits: a client over one gets the reply code the spec names, and nobody else
//! notices.

use lapin::options::*;
use lapin::types::FieldTable;
use ringmq_tests::{Broker, reply_code};

#[tokio::test]
async fn connections_beyond_the_limits_are_refused_with_not_allowed() {
    let b = Broker::start_with_config(
        "max_connections: 3\nmax_connections_per_user: 2\nusers:\n  - name: guest\n    password: guest\n    loopback_only: true\n    tags: [administrator]\n  - name: other\n    password: other\n",
    );
    let first = b.connect().await;
    let _second = b.connect().await;
    let e = lapin::Connection::connect(&b.uri(), Default::default())
        .await
        .unwrap_err();
    assert_eq!(
        reply_code(&e),
        Some(530),
        "a third connection for guest: {e:?}"
    );
    let other = format!("amqp://other:other@{}/%2f", b.addr);
    let _third = lapin::Connection::connect(&other, Default::default())
        .await
        .expect("another user still fits");
    let e = lapin::Connection::connect(&other, Default::default())
        .await
        .unwrap_err();
    assert_eq!(
        reply_code(&e),
        Some(530),
        "a fourth connection overall: {e:?}"
    );
    // Those already in keep working, and a freed slot can be taken again.
    let ch = first.create_channel().await.unwrap();
    ch.queue_declare("q".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    drop(ch);
    drop(first);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match lapin::Connection::connect(&b.uri(), Default::default()).await {
            Ok(c) => {
                c.create_channel().await.unwrap();
                break;
            }
            // The broker notices the dropped socket asynchronously.
            Err(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
            Err(e) => panic!("the freed slot was never given back: {e:?}"),
        }
    }
}

#[tokio::test]
async fn queues_beyond_the_vhost_limit_are_refused_with_precondition_failed() {
    let b = Broker::start_with_config("max_queues_per_vhost: 2\n");
    let conn = b.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare("a".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    ch.queue_declare("b".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    // Redeclaring an existing queue is not a new queue.
    ch.queue_declare("a".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    let e = ch
        .queue_declare("c".into(), Default::default(), FieldTable::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406));
    let ch = conn.create_channel().await.unwrap();
    ch.queue_delete("b".into(), Default::default())
        .await
        .unwrap();
    ch.queue_declare("c".into(), Default::default(), FieldTable::default())
        .await
        .expect("room again after a delete");
}

#[tokio::test]
async fn consumers_beyond_the_channel_limit_are_refused_with_precondition_failed() {
    let b = Broker::start_with_config("max_consumers_per_channel: 2\n");
    let conn = b.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare("q".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    let _c1 = ch
        .basic_consume(
            "q".into(),
            "c1".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _c2 = ch
        .basic_consume(
            "q".into(),
            "c2".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let e = ch
        .basic_consume(
            "q".into(),
            "c3".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&e), Some(406));
    let other = conn.create_channel().await.unwrap();
    let _c3 = other
        .basic_consume(
            "q".into(),
            "c3".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("the limit is per channel");
}
