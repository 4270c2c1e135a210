//! A consumer that stops reading its socket: the broker pins no more than its channels' write
//! windows (messages stay in their queues), other clients keep being served, and after
//! `write_stall_timeout_s` without progress the connection is closed.

use ringmq::amqp::{AMQPClass, AMQPValue, FieldTable, basic, queue};
use ringmq::client::{RawClient, Target, encode_publish};
use ringmq_tests::Broker;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// Resident memory of a process, from /proc (Linux).
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

fn declare(name: &str, max_length: Option<i64>) -> AMQPClass {
    let mut arguments = FieldTable::default();
    if let Some(n) = max_length {
        arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(n));
    }
    AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: name.into(),
        arguments,
        ..Default::default()
    }))
}

fn consume(queue: &str) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
        queue: queue.into(),
        no_ack: true,
        ..Default::default()
    }))
}

const BODY_BYTES: usize = 64 * 1024;
const SLOW_MESSAGES: usize = 3_000; // 192 MiB offered to the consumer that does not read
const FAST_MESSAGES: usize = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_stops_reading_pins_bounded_memory_and_is_closed() {
    let b = Broker::start_with_config("write_stall_timeout_s: 3\n");
    let target = Target::parse(&b.uri()).unwrap();
    // The slow consumer: a small receive buffer, a no-ack consumer with no prefetch limit,
    // and then it never reads again.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let stream = socket.connect(b.addr).await.unwrap();
    let mut slow = RawClient::open(stream, &target, "PLAIN", b"\0guest\0guest")
        .await
        .unwrap();
    // The queue is bounded, so what the broker holds for the stuck consumer is what shows.
    slow.call(declare("slow", Some(200)), |_| true, "declare-ok")
        .await
        .unwrap();
    slow.call(consume("slow"), |_| true, "consume-ok")
        .await
        .unwrap();
    // A well-behaved consumer on another connection.
    let mut fast = RawClient::connect(&target).await.unwrap();
    fast.call(declare("fast", None), |_| true, "declare-ok")
        .await
        .unwrap();
    fast.call(consume("fast"), |_| true, "consume-ok")
        .await
        .unwrap();
    let fast_reader = tokio::spawn(async move {
        let mut bodies = 0;
        while bodies < FAST_MESSAGES {
            let f = fast.read_frame().await.unwrap();
            if f.kind == ringmq::amqp::frame::FRAME_BODY {
                bodies += 1;
            }
        }
        fast
    });
    let rss_before = rss_bytes(b.pid());
    let mut producer = RawClient::connect(&target).await.unwrap();
    let body = vec![b'x'; BODY_BYTES];
    let mut rss_max = rss_before;
    let mut out = Vec::new();
    let every = SLOW_MESSAGES / FAST_MESSAGES;
    for i in 0..SLOW_MESSAGES {
        out.clear();
        encode_publish(&mut out, 1, "", "slow", false, &body, producer.frame_max);
        if i % every == 0 {
            encode_publish(&mut out, 1, "", "fast", false, b"f", producer.frame_max);
        }
        producer.stream.write_all(&out).await.unwrap();
        if i % 100 == 0 {
            rss_max = rss_max.max(rss_bytes(b.pid()));
        }
    }
    let fast = tokio::time::timeout(Duration::from_secs(30), fast_reader)
        .await
        .expect("the well-behaved consumer got all its messages")
        .unwrap();
    rss_max = rss_max.max(rss_bytes(b.pid()));
    let growth = rss_max.saturating_sub(rss_before);
    println!(
        "broker RSS before {} MiB, max {} MiB, growth {} MiB for {} MiB offered to a stuck consumer",
        rss_before >> 20,
        rss_max >> 20,
        growth >> 20,
        (SLOW_MESSAGES * BODY_BYTES) >> 20
    );
    // Queue (200 x 64 KiB) + one 4 MiB write window + buffers; without the byte window the
    // broker would hold 4096 deliveries (256 MiB) for the stuck consumer.
    assert!(growth < 96 << 20, "RSS grew {} MiB", growth >> 20);
    // The stuck connection is closed once nothing moved for write_stall_timeout_s.
    assert!(
        b.wait_for_log("the client stopped reading", Duration::from_secs(20)),
        "the stalled connection was not closed"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let closed = loop {
        let conns = b.admin_client().get("/api/connections").unwrap().body;
        let n = conns.as_array().map_or(0, Vec::len);
        if n == 2 {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        closed,
        "producer and fast consumer remain, the stuck one is gone"
    );
    drop((slow, fast, producer));
}
