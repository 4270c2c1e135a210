//! Benchmark-style (ignored; `scripts/test --run-ignored only -E 'test(kill_the_primary)'`):
//! the primary of a replicated queue is killed with -9 again and again under confirmed load,
//! through a proxy member, and started again each time: nothing confirmed is lost, nothing
//! acked comes back, and the failover time (kill → the new primary confirms a publish) is
//! printed as median and p99. `REPL_CYCLES` sets the number of kills (default 50).

use crate::harness::*;
use futures_lite::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// Publishes per cycle; half of them are consumed and acked in the same cycle.
const PER_CYCLE: usize = 100;
/// Longest wait for an election, a restart or a catch-up.
const LIMIT: Duration = Duration::from_secs(60);

async fn cycles(name: &str, backups: i32) {
    let cycles: usize = std::env::var("REPL_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let (mut members, _ports, _secret) = start_cluster(name);
    let queue = "cycled";
    {
        let mut args = FieldTable::default();
        args.insert("qpid.cluster.backups".into(), AMQPValue::LongInt(backups));
        let (_c, ch) = members[0].channel().await;
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap();
    }
    let in_sync = |v: &Value| {
        v["in_sync_backup_nodes"]
            .as_array()
            .is_some_and(|a| a.len() == backups as usize)
    };
    let mut confirmed = BTreeSet::new();
    let mut acked = BTreeSet::new();
    let mut failover = Vec::new();
    let mut next = 0;
    for cycle in 0..cycles {
        let view = wait_queue_view(
            &members[0],
            queue,
            LIMIT,
            "in sync before the kill",
            in_sync,
        );
        let primary_node = view["node"].as_str().unwrap().to_owned();
        let primary = (0..N).find(|&i| node(name, i) == primary_node).unwrap();
        let proxy = (primary + 1) % N;
        confirmed.extend(publish_range(&members[proxy], queue, next..next + PER_CYCLE).await);
        next += PER_CYCLE;
        acked.extend(consume_and_ack(&members[proxy], queue, PER_CYCLE / 2).await);
        // Settles are not confirmed to anyone: give the stream a moment to carry them.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let killed = Instant::now();
        members[primary].kill();
        let survivor = (primary + 1) % N;
        wait_queue_view(
            &members[survivor],
            queue,
            LIMIT,
            &format!("{name} cycle {cycle}: election"),
            |v| v["node"].as_str().is_some_and(|n| n != primary_node),
        );
        let first = loop {
            let got = publish_range(&members[survivor], queue, next..next + 1).await;
            next += 1;
            if let Some(&i) = got.first() {
                break i;
            }
            assert!(
                killed.elapsed() < LIMIT,
                "{name} cycle {cycle}: no confirm from the new primary"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        confirmed.insert(first);
        failover.push(killed.elapsed());
        restart_member(&mut members, primary, &format!("{name} cycle {cycle}"));
    }
    // Drain through the last primary's neighbour.
    let view = wait_queue_view(&members[0], queue, LIMIT, "in sync at the end", in_sync);
    let primary = (0..N)
        .find(|&i| Some(node(name, i).as_str()) == view["node"].as_str())
        .unwrap();
    let (_c, ch) = members[(primary + 1) % N].channel().await;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "drain".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut seen = BTreeSet::new();
    let mut twice = 0;
    while let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_secs(3), consumer.next()).await
    {
        let i: usize = String::from_utf8(d.data.clone()).unwrap()[1..]
            .parse()
            .unwrap();
        twice += usize::from(!seen.insert(i));
    }
    let lost: Vec<&usize> = confirmed
        .difference(&acked)
        .filter(|i| !seen.contains(i))
        .collect();
    let resurrected: Vec<&usize> = acked.intersection(&seen).collect();
    failover.sort();
    let median = failover[failover.len() / 2];
    let p99 = failover[(failover.len() * 99).div_ceil(100) - 1];
    eprintln!(
        "{name}: k={backups}, {cycles} kills: {} confirmed, {} acked, {} in the queue at the end; lost {}, resurrected {}, duplicates {twice}; failover median {median:?} p99 {p99:?} max {:?}",
        confirmed.len(),
        acked.len(),
        seen.len(),
        lost.len(),
        resurrected.len(),
        failover.last().unwrap()
    );
    assert!(lost.is_empty(), "{name}: confirmed and lost: {lost:?}");
    assert!(
        resurrected.is_empty(),
        "{name}: acked and back: {resurrected:?}"
    );
    assert_eq!(twice, 0, "{name}: a message twice in the queue");
}

#[tokio::test]
#[ignore = "benchmark: 50 kills of a primary, minutes"]
async fn kill_the_primary_again_and_again_one_backup() {
    cycles("repl-cycles-k1", 1).await;
}

#[tokio::test]
#[ignore = "benchmark: 50 kills of a primary, minutes"]
async fn kill_the_primary_again_and_again_two_backups() {
    cycles("repl-cycles-k2", 2).await;
}
