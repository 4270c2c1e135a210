//! A bounded soak under abuse (about 15 s): thousands of half-open sockets, slowloris clients
//! trickling their handshake a byte at a time, and logged-in clients flooding tiny frames
//! (heartbeats, channel.flow) — while a well-behaved lapin publisher/consumer pair measures
//! its throughput. It must keep at least a quarter of the rate it had, in the same test,
//! before the abuse began (the factor leaves room for a 2-core machine shared with builds).

use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use ringmq::amqp::frame::PROTOCOL_HEADER;
use ringmq::amqp::writer::FrameWriter;
use ringmq::amqp::{AMQPClass, channel};
use ringmq::client::{RawClient, Target};
use ringmq_tests::Broker;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const HALF_OPEN: usize = 2_000;
const SLOWLORIS: usize = 200;
const FLOODERS: usize = 2;
const MEASURE: Duration = Duration::from_secs(4);
/// Most messages the producer may be ahead of the consumer.
const IN_FLIGHT: u64 = 1_000;

/// Messages per second a lapin publisher/consumer pair moves through `queue` in `MEASURE`.
async fn pair_throughput(b: &Broker, queue: &str) -> f64 {
    let (_pc, pch) = b.channel().await;
    let (_cc, cch) = b.channel().await;
    pch.queue_declare(queue.into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    let mut consumer = cch
        .basic_consume(
            queue.into(),
            "pair".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let consumed = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (consumed, stop, queue) = (consumed.clone(), stop.clone(), queue.to_owned());
        tokio::spawn(async move {
            let mut published = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if published - consumed.load(Ordering::Relaxed) >= IN_FLIGHT {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                pch.basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    Default::default(),
                    b"soak message of about a hundred bytes, like a small event ..................",
                    Default::default(),
                )
                .await
                .unwrap();
                published += 1;
            }
        })
    };
    let start = Instant::now();
    while start.elapsed() < MEASURE {
        match tokio::time::timeout(Duration::from_millis(100), consumer.next()).await {
            Ok(Some(d)) => {
                d.unwrap();
                consumed.fetch_add(1, Ordering::Relaxed);
            }
            Ok(None) => panic!("the consumer stream ended"),
            Err(_) => {}
        }
    }
    let rate = consumed.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    producer.await.unwrap();
    rate
}

/// The bytes a client sends up to connection.open, for the slowloris clients to trickle.
fn handshake_bytes() -> Vec<u8> {
    use ringmq::amqp::{FieldTable, connection};
    let mut w = FrameWriter::default();
    w.method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: "PLAIN".into(),
            response: "\0guest\0guest".into(),
            locale: "en_US".into(),
        })),
    );
    let mut bytes = PROTOCOL_HEADER.to_vec();
    bytes.extend_from_slice(w.as_slice());
    bytes
}

/// Raises this process's open-file soft limit to the hard one (both ends of every socket
/// are in the test machine's limit; the broker raises its own).
fn raise_fd_limit() -> u64 {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write only the struct passed.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        l.rlim_cur = l.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &l);
    }
    l.rlim_cur
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_well_behaved_pair_keeps_a_quarter_of_its_throughput_under_abuse() {
    let began = Instant::now();
    let fd_limit = raise_fd_limit();
    assert!(
        fd_limit as usize > HALF_OPEN + SLOWLORIS + 100,
        "open-file limit {fd_limit} is too low for this test: raise the hard limit to 65536 (`ulimit -n 65536` as root; scripts/test and .ci/run try)"
    );
    let b = Broker::start();
    let target = Target::parse(&b.uri()).unwrap();
    let baseline = pair_throughput(&b, "before").await;

    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(30);
    // Half-open sockets: connected, then silent or stopped inside the protocol header.
    let mut idle = Vec::with_capacity(HALF_OPEN);
    for i in 0..HALF_OPEN {
        let mut s = TcpStream::connect(b.addr).await.unwrap();
        if i % 2 == 0 {
            s.write_all(b"AMQP").await.unwrap();
        }
        idle.push(s);
    }
    // Slowloris: one byte per client every 100 ms.
    let mut slow = Vec::with_capacity(SLOWLORIS);
    for _ in 0..SLOWLORIS {
        slow.push(TcpStream::connect(b.addr).await.unwrap());
    }
    let slowloris = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let bytes = handshake_bytes();
            let mut at = 0;
            while !stop.load(Ordering::Relaxed) && at < bytes.len() && Instant::now() < deadline {
                for s in &mut slow {
                    // A refused or closed socket is the broker defending itself: fine.
                    let _ = s.write_all(&bytes[at..=at]).await;
                }
                at += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            slow.len()
        })
    };
    // Floods of tiny frames from logged-in clients, their replies drained.
    let mut flooders = Vec::new();
    let frames_sent = Arc::new(AtomicU64::new(0));
    for _ in 0..FLOODERS {
        let c = RawClient::connect(&target).await.unwrap();
        let (mut rd, mut wr) = c.stream.into_split();
        let (stop, sent) = (stop.clone(), frames_sent.clone());
        flooders.push(tokio::spawn(async move {
            let drain = tokio::spawn(async move {
                let mut sink = vec![0u8; 64 * 1024];
                while let Ok(n @ 1..) = rd.read(&mut sink).await {
                    let _ = n;
                }
            });
            let mut batch = FrameWriter::default();
            for _ in 0..500 {
                batch.heartbeat();
                batch.method(
                    1,
                    AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active: true })),
                );
            }
            // Ended by the deadline, an error, or abort() once the measurement is done (a
            // write may wait while the broker reads slower than it is flooded).
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                if wr.write_all(batch.as_slice()).await.is_err() {
                    break;
                }
                sent.fetch_add(1_000, Ordering::Relaxed);
            }
            drain.abort();
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    // A new client still gets through the handshake promptly: a flooding connection yields
    // every 1,024 frames instead of holding a worker for a whole read buffer (before that
    // change a handshake here took up to 18 s).
    let connect_started = Instant::now();
    let newcomer = RawClient::connect(&target).await.unwrap();
    let connect_time = connect_started.elapsed();
    let under_abuse = pair_throughput(&b, "during").await;
    stop.store(true, Ordering::Relaxed);
    let trickled = slowloris.await.unwrap();
    for f in flooders {
        f.abort();
    }
    println!(
        "pair throughput: {baseline:.0} msg/s before, {under_abuse:.0} msg/s under abuse \
         ({:.0}%); abuse: {HALF_OPEN} half-open sockets, {trickled} slowloris clients, \
         {FLOODERS} clients sent {} tiny frames",
        100.0 * under_abuse / baseline,
        frames_sent.load(Ordering::Relaxed)
    );
    println!("a new connection's handshake under abuse took {connect_time:?}");
    assert!(
        connect_time < Duration::from_secs(2),
        "a handshake under abuse took {connect_time:?}"
    );
    println!("the soak took {:?}", began.elapsed());
    assert!(
        under_abuse * 4.0 >= baseline,
        "throughput fell from {baseline:.0} to {under_abuse:.0} msg/s (below a quarter)"
    );
    drop((idle, newcomer));
    // The broker is still whole: a fresh connection works.
    let (_c, ch) = b.channel().await;
    ch.queue_declare("after".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
}
