//! The seed's definition of transparent failover, tested literally on one broker: a scripted
//! application on the failover client records every command it sends and receives per
//! channel; run once through a connection that is never cut, and again through one whose
//! every connection is cut (abruptly, both directions) again and again at seeded random
//! moments, the two records are identical.

use super::relay::Cutter;
use super::script::{DELIVERIES, TX_COMMITTED, config, next, script, seeds};
use ringmq_client::{QueueOptions, Table};
use ringmq_tests::Broker;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

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
    let run = |uri: String, queue: String| async move {
        let config = config([uri], Duration::from_secs(20));
        let declare = (QueueOptions::default(), Table::default());
        script(config, &queue, declare, Duration::from_secs(20)).await
    };
    let (clean, clean_failovers) = run(uri_at(direct.addr), "script-clean".into()).await;
    assert_eq!(clean_failovers, 0);
    assert_eq!(clean.consumer.len(), DELIVERIES);
    assert_eq!(
        clean.tx.iter().filter(|l| l.starts_with("deliver")).count(),
        TX_COMMITTED
    );

    // FAILOVER_SEEDS: seeds to run instead (decimal or 0x-hex, comma-separated), or
    // FAILOVER_RUNS: that many seeds from 0x5eed0001 on.
    let seeds = seeds("FAILOVER", 0x5eed_0001, 2);
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
        let run = tokio::spawn(run(uri_at(cutter.addr), format!("script-{seed:x}")));
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
            cut.plain, clean.plain,
            "seed {seed:#x}: the channel without confirms differs from the run without failure"
        );
        assert_eq!(
            cut.consumer, clean.consumer,
            "seed {seed:#x}: the consuming channel differs from the run without failure"
        );
        assert_eq!(
            cut.tx, clean.tx,
            "seed {seed:#x}: the transactional channel differs from the run without failure"
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
