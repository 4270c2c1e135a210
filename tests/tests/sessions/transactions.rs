//! The failover client's transactions through a lost connection, at the two moments that
//! matter: a commit the broker applied whose `commit-ok` was lost (not applied twice), and a
//! commit that never reached the broker (sent again, with its transaction). A rollback's
//! settlements are the application's again.

use super::publishing::{dropped_duplicates, message_count};
use super::relay::Cutter;
use super::script::config;
use ringmq_client::{Client, Properties, QueueOptions, Table};
use ringmq_tests::Broker;
use std::time::{Duration, Instant};

/// Waits (at most 10 s) until `queue` holds `n` messages.
async fn until_count(ch: &lapin::Channel, queue: &str, n: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = message_count(ch, queue).await;
        if got == n {
            return;
        }
        assert!(Instant::now() < deadline, "{queue} holds {got}, not {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn publish_all(ch: &ringmq_client::Channel, queue: &str, bodies: std::ops::Range<u32>) {
    for i in bodies {
        drop(
            ch.publish(
                "",
                queue,
                Properties::default(),
                format!("t{i}").into_bytes(),
            )
            .unwrap(),
        );
    }
}

/// `tx.commit` on `ch`, answered in a task of its own (the test cuts the connection under it).
fn commit_in_background(
    ch: &ringmq_client::Channel,
) -> tokio::task::JoinHandle<Result<(), ringmq_client::Error>> {
    let ch = ch.clone();
    tokio::spawn(async move { ch.tx_commit().await })
}

/// Waits for `commit`'s `commit-ok`, which comes after the failover.
async fn answered_after_the_failover(
    commit: tokio::task::JoinHandle<Result<(), ringmq_client::Error>>,
) {
    tokio::time::timeout(Duration::from_secs(20), commit)
        .await
        .expect("the commit is answered after the failover")
        .unwrap()
        .expect("commit-ok");
}

/// A broker behind a relay, the failover client through the relay, and queue `queue`
/// declared on a channel of it.
struct Setup {
    broker: Broker,
    relay: Cutter,
    client: Client,
    channel: ringmq_client::Channel,
}

async fn setup(queue: &str) -> Setup {
    let broker = Broker::start();
    let relay = Cutter::start(broker.addr).await;
    let client = Client::connect(config(
        [format!("amqp://guest:guest@{}/%2f", relay.addr)],
        Duration::from_secs(20),
    ))
    .await
    .unwrap();
    let channel = client.channel().await.unwrap();
    channel
        .queue_declare(queue, QueueOptions::default(), Table::default())
        .await
        .unwrap();
    Setup {
        broker,
        relay,
        client,
        channel,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_answer_was_lost_is_not_applied_twice_and_one_that_never_arrived_is_sent_again()
 {
    // RUST_LOG=ringmq_client=debug shows each failover and what it restored.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let queue = "tx-through-cuts";
    let Setup {
        broker: b,
        relay,
        client,
        channel: ch,
    } = setup(queue).await;
    ch.tx_select().await.unwrap();
    let (_c, direct) = b.channel().await;

    // 1. The broker applies the commit; its commit-ok is lost with the connection.
    publish_all(&ch, queue, 0..5);
    tokio::time::sleep(Duration::from_millis(100)).await;
    relay.mute_down(true);
    let commit = commit_in_background(&ch);
    until_count(&direct, queue, 5).await;
    // The commit-ok follows the applied commit: give it time to be dropped.
    tokio::time::sleep(Duration::from_millis(200)).await;
    relay.cut();
    relay.mute_down(false);
    answered_after_the_failover(commit).await;
    assert_eq!(client.failovers(), 1);
    // Answered from the session's commit count: neither the transaction nor its commit was
    // sent again. (After a takeover the member's publish count is behind the client's
    // numbering, and only this comparison keeps the transaction from being applied twice.)
    assert_eq!(
        dropped_duplicates(&b),
        0.0,
        "the transaction was sent again"
    );

    // 2. The commit never reaches the broker: the transaction is sent again, then the commit.
    publish_all(&ch, queue, 5..10);
    tokio::time::sleep(Duration::from_millis(100)).await;
    relay.mute_up(true);
    let commit = commit_in_background(&ch);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(message_count(&direct, queue).await, 5, "not committed yet");
    relay.cut();
    relay.mute_up(false);
    answered_after_the_failover(commit).await;
    assert_eq!(client.failovers(), 2);
    until_count(&direct, queue, 10).await;

    // 3. A rolled-back transaction's publishes are never sent again, even after a failover.
    publish_all(&ch, queue, 10..13);
    ch.tx_rollback().await.unwrap();
    relay.cut();
    ch.tx_commit().await.unwrap();
    assert_eq!(client.failovers(), 3);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        message_count(&direct, queue).await,
        10,
        "nothing rolled back came"
    );

    // Every message once, in order.
    let consumer_ch = client.channel().await.unwrap();
    let mut consumer = consumer_ch.consume(queue, "", false).await.unwrap();
    for i in 0..10 {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a delivery")
            .expect("the consumer lives");
        assert_eq!(d.body.as_ref(), format!("t{i}").as_bytes());
        consumer_ch.ack(d.delivery_tag, false).unwrap();
    }
    client.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_a_rolled_back_transaction_held_are_the_applications_again_after_a_failover() {
    let queue = "tx-rolled-back-acks";
    let Setup {
        broker: b,
        relay,
        client,
        channel: ch,
    } = setup(queue).await;
    publish_all(&ch, queue, 0..3);
    let (_c, direct) = b.channel().await;
    until_count(&direct, queue, 3).await;
    ch.tx_select().await.unwrap();
    let mut consumer = ch.consume(queue, "c", false).await.unwrap();
    let mut tags = Vec::new();
    for _ in 0..3 {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a delivery")
            .expect("the consumer lives");
        tags.push(d.delivery_tag);
    }
    ch.ack(tags[2], true).unwrap();
    ch.tx_rollback().await.unwrap();
    // The acks were rolled back: a failover must not send them again.
    relay.cut();
    ch.ack(tags[0], false).unwrap();
    ch.tx_commit().await.unwrap();
    assert!(client.failovers() >= 1);
    client.close().await.unwrap();
    // Closed: what was not acknowledged went back to the queue.
    until_count(&direct, queue, 2).await;
}
