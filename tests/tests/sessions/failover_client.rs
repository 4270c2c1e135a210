//! The seed's definition of transparent failover, tested literally on one broker: a scripted
//! application on the failover client records every command it sends and receives per
//! channel; run once through a connection that is never cut, and again through one whose
//! every connection is cut (abruptly, both directions) again and again at seeded random
//! moments, the two records are identical.

use ringmq_client::{Client, Config, Properties, QueueOptions, Table};
use ringmq_tests::Broker;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A TCP relay in front of the broker whose connections the test can cut: every relayed
/// connection ends at once, without a close, as when a member dies or the network drops.
struct Cutter {
    addr: std::net::SocketAddr,
    cuts: watch::Sender<u64>,
    relayed: Arc<AtomicU64>,
}

impl Cutter {
    async fn start(upstream: std::net::SocketAddr) -> Cutter {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cuts, _) = watch::channel(0u64);
        let relayed = Arc::new(AtomicU64::new(0));
        let (cut_rx, count) = (cuts.subscribe(), relayed.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                count.fetch_add(1, Ordering::Relaxed);
                let mut cut = cut_rx.clone();
                cut.borrow_and_update();
                tokio::spawn(async move {
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    tokio::select! {
                        _ = tokio::io::copy(&mut cr, &mut sw) => {}
                        _ = tokio::io::copy(&mut sr, &mut cw) => {}
                        _ = cut.changed() => {}
                    }
                    // Dropped without a shutdown: both peers see the connection end abruptly.
                    let _ = (cw.flush().await, sw.flush().await);
                });
            }
        });
        Cutter {
            addr,
            cuts,
            relayed,
        }
    }

    fn cut(&self) {
        self.cuts.send_modify(|n| *n += 1);
    }
}

/// What the application saw, per channel, in order.
#[derive(Debug, Default, PartialEq, Eq)]
struct Record {
    /// Publishing channel: each publish and its confirm.
    publisher: Vec<String>,
    /// Consuming channel: each delivery (tag, body, redelivered) and what the app did.
    consumer: Vec<String>,
}

const MESSAGES: usize = 300;

/// `what` within 20 s, or a failure naming it.
async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within 20 s"))
}

/// The scripted application: publishes `MESSAGES` in confirm mode (confirms awaited in
/// windows of 25), then consumes them one at a time (prefetch 1), rejecting every 7th
/// delivery once with requeue and acknowledging everything else.
async fn script(uri: String, queue: String) -> (Record, u64) {
    let (uri, queue) = (uri.as_str(), queue.as_str());
    let mut config = Config::new([uri]);
    config.heartbeat_s = 1;
    config.failover_timeout = Duration::from_secs(20);
    let client = within("connect", Client::connect(config))
        .await
        .expect("connect");
    let mut record = Record::default();
    let publisher = within("channel 1", client.channel()).await.unwrap();
    within("confirm.select", publisher.confirm_select())
        .await
        .unwrap();
    let declared = within(
        "queue.declare",
        publisher.queue_declare(queue, QueueOptions::default(), Table::default()),
    )
    .await
    .unwrap();
    record
        .publisher
        .push(format!("declare-ok {}", declared.message_count));
    let mut window = Vec::new();
    for i in 0..MESSAGES {
        let body = format!("m{i}");
        window.push((
            body.clone(),
            publisher
                .publish("", queue, Properties::default(), body.into_bytes())
                .unwrap(),
        ));
        record.publisher.push(format!("publish m{i}"));
        if window.len() == 25 || i + 1 == MESSAGES {
            for (body, confirmation) in window.drain(..) {
                let ack = within(&format!("the confirm of {body}"), confirmation.wait())
                    .await
                    .expect("a confirm");
                record.publisher.push(format!("confirm {body} {ack}"));
            }
        }
    }
    let consumer_channel = within("channel 2", client.channel()).await.unwrap();
    within("basic.qos", consumer_channel.qos(1)).await.unwrap();
    let mut consumer = within(
        "basic.consume",
        consumer_channel.consume(queue, "c1", false),
    )
    .await
    .unwrap();
    let mut acked = 0;
    let mut rejected = std::collections::HashSet::new();
    while acked < MESSAGES {
        let d = within(
            &format!("delivery {}", record.consumer.len()),
            consumer.next(),
        )
        .await
        .expect("the consumer lives");
        let body = String::from_utf8(d.body.to_vec()).unwrap();
        let n: usize = body[1..].parse().unwrap();
        let action = if n.is_multiple_of(7) && rejected.insert(n) {
            consumer_channel.nack(d.delivery_tag, false, true).unwrap();
            "nack-requeue"
        } else {
            consumer_channel.ack(d.delivery_tag, false).unwrap();
            acked += 1;
            "ack"
        };
        record.consumer.push(format!(
            "deliver {} {body} {} {action}",
            d.delivery_tag, d.redelivered
        ));
    }
    let failovers = client.failovers();
    within("close", client.close()).await.unwrap();
    (record, failovers)
}

/// A seeded xorshift: the cut moments of a run are reproducible from its seed.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_sees_the_same_commands_with_its_connection_cut_again_and_again() {
    // RUST_LOG=ringmq_client=debug shows each failover and what it restored.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let b = Broker::start();
    let uri_at = |addr: std::net::SocketAddr| format!("amqp://guest:guest@{addr}/%2f");
    let direct = Cutter::start(b.addr).await;
    let (clean, clean_failovers) = script(uri_at(direct.addr), "script-clean".into()).await;
    assert_eq!(clean_failovers, 0);
    assert_eq!(clean.consumer.len(), MESSAGES + MESSAGES.div_ceil(7));

    // FAILOVER_SEEDS: seeds to run instead (decimal or 0x-hex, comma-separated), or
    // FAILOVER_RUNS: that many seeds from 0x5eed0001 on.
    let seeds: Vec<u64> = match (
        std::env::var("FAILOVER_SEEDS"),
        std::env::var("FAILOVER_RUNS"),
    ) {
        (Ok(list), _) => list
            .split(',')
            .map(|x| {
                let x = x.trim();
                x.strip_prefix("0x")
                    .map_or_else(|| x.parse(), |h| u64::from_str_radix(h, 16))
                    .unwrap_or_else(|e| panic!("FAILOVER_SEEDS: '{x}' is not a seed: {e}"))
            })
            .collect(),
        (_, Ok(n)) => (0..n.parse::<u64>().expect("FAILOVER_RUNS is a count"))
            .map(|i| 0x5eed_0001 + i)
            .collect(),
        _ => vec![0x5eed_0001, 0x5eed_0002],
    };
    for seed in seeds {
        let cutter = Arc::new(Cutter::start(b.addr).await);
        let cuts = cutter.clone();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = done.clone();
        let cutting = tokio::spawn(async move {
            let mut state = seed | 1;
            let mut n = 0u32;
            // Bounded: at most 40 cuts, each 20–120 ms after the last.
            while n < 40 && !stop.load(Ordering::Acquire) {
                tokio::time::sleep(Duration::from_millis(20 + next(&mut state) % 100)).await;
                cuts.cut();
                n += 1;
            }
            n
        });
        let run = tokio::spawn(script(uri_at(cutter.addr), format!("script-{seed:x}")));
        let (cut, failovers) = match run.await {
            Ok(done) => done,
            Err(e) => {
                eprintln!(
                    "seed {seed:#x} failed; the broker's log:\n{}",
                    b.log_tail(80)
                );
                std::panic::resume_unwind(e.into_panic());
            }
        };
        done.store(true, Ordering::Release);
        let cuts_made = cutting.await.unwrap();
        assert!(
            failovers >= 1,
            "seed {seed:#x}: {cuts_made} cuts, yet no failover: the cuts missed the run"
        );
        assert_eq!(
            cut.publisher, clean.publisher,
            "seed {seed:#x}: the publishing channel differs from the run without failure"
        );
        assert_eq!(
            cut.consumer, clean.consumer,
            "seed {seed:#x}: the consuming channel differs from the run without failure"
        );
        eprintln!(
            "seed {seed:#x}: {cuts_made} cuts, {failovers} failovers, {} connections, same commands",
            cutter.relayed.load(Ordering::Relaxed)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_failover_counts_failovers_and_loses_or_repeats_nothing_through_cuts() {
    let b = Broker::start();
    let cutter = Arc::new(Cutter::start(b.addr).await);
    let uri = format!("amqp://guest:guest@{}/%2f", cutter.addr);
    let bench = tokio::task::spawn_blocking(move || {
        std::process::Command::new(ringmq_tests::binary("ringmqctl"))
            .args([
                "bench",
                "--failover",
                "--uri",
                &uri,
                "--seconds",
                "3",
                "--size",
                "64",
                "--confirm",
                "64",
                "--prefetch",
                "100",
                "--json",
            ])
            .output()
            .unwrap()
    });
    // Cut every connection four times during the load (bounded).
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(600)).await;
        cutter.cut();
    }
    let out = bench.await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    eprintln!("{v}");
    assert!(v["published"].as_u64().unwrap() > 0, "{v}");
    assert!(
        v["failovers"].as_u64().unwrap() >= 4,
        "every client failed over: {v}"
    );
    assert_eq!(v["lost"], 0, "{v}");
    assert_eq!(v["duplicates"], 0, "{v}");
    assert_eq!(v["out_of_order"], 0, "{v}");
    assert_eq!(v["consumed"], v["published"], "{v}");
}
