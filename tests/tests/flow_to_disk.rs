//! Flow-to-disk: a queue over its memory budget keeps bodies only in the journal and reads
//! them back on delivery; transient bodies paged out never come back after a restart.

use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use ringmq_tests::Broker;
use std::time::{Duration, Instant};

const BUDGET_BYTES: usize = 1024 * 1024;
const BODY_BYTES: usize = 16 * 1024;
/// 40 MiB of bodies: forty times the budget.
const MESSAGES: u32 = 2560;

fn config() -> String {
    format!("queue_memory_budget_bytes: {BUDGET_BYTES}\n")
}

/// Message `n`'s body: its number, then a pattern that differs per message and per byte.
fn body(n: u32) -> Vec<u8> {
    let mut b: Vec<u8> = (0..BODY_BYTES)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(n) as u8)
        .collect();
    b[..4].copy_from_slice(&n.to_be_bytes());
    b
}

fn number(body: &[u8]) -> u32 {
    u32::from_be_bytes(body[..4].try_into().expect("4 bytes"))
}

/// Even numbers are persistent, odd ones transient.
fn properties(n: u32) -> BasicProperties {
    BasicProperties::default().with_delivery_mode(if n.is_multiple_of(2) { 2 } else { 1 })
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS line");
    kib * 1024
}

async fn declare(ch: &Channel, name: &str, durable: bool, arguments: FieldTable) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable,
            ..Default::default()
        },
        arguments,
    )
    .await
    .unwrap();
}

/// Publishes `numbers` to `queue` with confirms, 64 in flight at most.
async fn publish(ch: &Channel, queue: &str, numbers: impl Iterator<Item = u32>) {
    let mut window = Vec::new();
    for n in numbers {
        window.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &body(n),
                properties(n),
            )
            .await
            .unwrap(),
        );
        if window.len() == 64 {
            for c in window.drain(..) {
                assert!(c.await.unwrap().is_ack());
            }
        }
    }
    for c in window {
        assert!(c.await.unwrap().is_ack());
    }
}

/// Consumes `count` messages from `queue` (acking them) and returns their numbers, checking
/// every body byte for byte.
async fn consume(ch: &Channel, queue: &str, count: usize) -> Vec<u32> {
    ch.basic_qos(100, BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "ftd".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut got = Vec::with_capacity(count);
    while got.len() < count {
        let d = tokio::time::timeout(Duration::from_secs(20), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("only {} of {count} messages arrived", got.len()))
            .expect("consumer open")
            .expect("delivery");
        let n = number(&d.data);
        assert!(d.data == body(n), "body of message {n} differs");
        got.push(n);
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    ch.basic_cancel("ftd".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    got
}

#[tokio::test]
async fn a_queue_over_its_budget_keeps_bodies_on_disk_and_delivers_them_in_order() {
    let mut b = Broker::start_with_config(&config());
    let rss_before = rss_bytes(b.pid());
    let data_bytes = u64::from(MESSAGES) * BODY_BYTES as u64;
    {
        let (_c, ch) = b.channel().await;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        declare(&ch, "ftd", true, FieldTable::default()).await;
        publish(&ch, "ftd", 0..MESSAGES).await;
        let rss_published = rss_bytes(b.pid());
        eprintln!("RSS at start {rss_before} B, with {data_bytes} B queued {rss_published} B");
        let grown = rss_published.saturating_sub(rss_before);
        assert!(
            grown < data_bytes / 3,
            "RSS grew by {grown} bytes holding {data_bytes} bytes of bodies with a budget of {BUDGET_BYTES}"
        );
        // The first half, persistent and transient alike, read back from disk in order.
        let got = consume(&ch, "ftd", MESSAGES as usize / 2).await;
        assert_eq!(got, (0..MESSAGES / 2).collect::<Vec<_>>());
    }
    b.stop_and_restart();
    let rss_restarted = rss_bytes(b.pid());
    eprintln!("RSS after recovery {rss_restarted} B");
    assert!(
        rss_restarted < rss_before + data_bytes / 3,
        "RSS {rss_restarted} after recovering a queue of {} bytes of bodies",
        data_bytes / 2
    );
    let (_c, ch) = b.channel().await;
    // The second half: persistent ones survived, transient ones paged out did not.
    let survivors: Vec<u32> = (MESSAGES / 2..MESSAGES)
        .filter(|n| n.is_multiple_of(2))
        .collect();
    let got = consume(&ch, "ftd", survivors.len()).await;
    assert_eq!(got, survivors);
    let left = ch
        .queue_declare(
            "ftd".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(left.message_count(), 0, "a transient message came back");
}

#[tokio::test]
async fn paged_messages_that_expire_are_dead_lettered_with_their_bodies() {
    let b = Broker::start_with_config(&config());
    let (_c, ch) = b.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(300));
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString("dead".into()),
    );
    declare(&ch, "dead", false, FieldTable::default()).await;
    declare(&ch, "expiring", false, args).await;
    let count = 256u32; // 4 MiB: most of them paged out before they expire
    publish(&ch, "expiring", 0..count).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let dead = ch
            .queue_declare(
                "dead".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count();
        if dead == count {
            break;
        }
        assert!(Instant::now() < deadline, "{dead} of {count} dead-lettered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let got = consume(&ch, "dead", count as usize).await;
    assert_eq!(got, (0..count).collect::<Vec<_>>());
}
