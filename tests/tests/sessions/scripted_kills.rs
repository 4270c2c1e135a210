//! The seed's definition of transparent failover tested literally on a cluster: the scripted
//! application (`script.rs`) runs once without failure, then again and again while the
//! member it is connected to, its queues' primary, or both are killed with -9 at seeded
//! random moments (and started again). Every run's record, per channel, must be identical
//! to the record of the run without failure.
//!
//! `CLUSTER_FAILOVER_RUNS=100` (or `CLUSTER_FAILOVER_SEEDS=...`) runs that many; the default
//! is three, one of each kind.

use super::script::{DELIVERIES, Record, TX_COMMITTED, config, next, script, seeds};
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use ringmq_client::QueueOptions;
use ringmq_tests::Broker;
use ringmq_tests::cluster::{start_cluster_on_fixed_ports, wait_voters};
use std::time::{Duration, Instant};

/// What a run kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Victim {
    /// The member the client is connected to (the queues' primary is another).
    Connected,
    /// The queues' primary (the client is connected to another member).
    Primary,
    /// The member the client is connected to, then — once it is back — the queues' primary.
    Both,
}

/// Each queue is durable — a member killed and started again gets its wiring back from its
/// disk (a transient queue's it would not, `docs/cluster.md`) — and has two backups: a copy
/// survives two kills one after the other, even when the second comes before the first
/// member has caught up again.
fn queue_arguments() -> FieldTable {
    let mut t = FieldTable::default();
    t.insert("qpid.cluster.backups".into(), AMQPValue::LongInt(2));
    t
}

/// How the script declares the queues: as [`declare_on`] did.
fn durable() -> QueueOptions {
    QueueOptions {
        durable: true,
        ..QueueOptions::default()
    }
}

/// Declares `<queue>`, `<queue>-plain` and `<queue>-tx` on `primary` with a plain client, so that their
/// primary is that member whichever member the scripted client uses.
async fn declare_on(primary: &Broker, queue: &str) {
    let (_c, ch) = primary.channel().await;
    for name in [
        queue.to_owned(),
        format!("{queue}-plain"),
        format!("{queue}-tx"),
    ] {
        ch.queue_declare(
            name.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            queue_arguments(),
        )
        .await
        .expect("queue declared on its primary");
    }
}

/// Starts every member that is not running again and waits until each is ready.
fn restart_killed(m: &mut [Broker]) {
    for b in m.iter_mut() {
        if !b.is_running() {
            b.start_again();
        }
    }
    for b in m.iter() {
        b.wait_ready(Duration::from_secs(60));
    }
}

/// Runs the script on member `connected` while `victim` is done at seeded moments; the
/// record, the failover count, and how many kills landed before the script ended.
async fn run_with_kills(
    m: &mut [Broker],
    seed: u64,
    victim: Victim,
    connected: usize,
    primary: usize,
) -> (Record, u64, usize) {
    let mut state = seed | 1;
    let queue = format!("scripted-{seed:x}");
    declare_on(&m[primary], &queue).await;
    let mut uris = vec![m[connected].uri()];
    uris.extend((0..m.len()).filter(|&i| i != connected).map(|i| m[i].uri()));
    let patience = Duration::from_secs(60);
    let arguments = ringmq_client::Table::from(queue_arguments().inner().clone());
    let run = tokio::spawn(async move {
        script(
            config(uris, patience),
            &queue,
            (durable(), arguments),
            patience,
        )
        .await
    });
    let targets: Vec<usize> = match victim {
        Victim::Connected => vec![connected],
        Victim::Primary => vec![primary],
        Victim::Both => vec![connected, primary],
    };
    let mut landed = 0;
    let mut run = run;
    for target in targets {
        let pause = Duration::from_millis(30 + next(&mut state) % 900);
        tokio::select! {
            done = &mut run => {
                let (record, failovers) = done.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
                restart_killed(m);
                return (record, failovers, landed);
            }
            () = tokio::time::sleep(pause) => {
                m[target].kill();
                landed += 1;
                // Back before the next kill: a majority must stay up.
                restart_killed(m);
            }
        }
    }
    let (record, failovers) = match run.await {
        Ok(done) => done,
        Err(e) => {
            for (i, b) in m.iter().enumerate() {
                eprintln!("member {i}:\n{}", b.log_tail(60));
            }
            std::panic::resume_unwind(e.into_panic());
        }
    };
    restart_killed(m);
    (record, failovers, landed)
}

/// Whether the consuming channel's record `got` is `clean`'s, line by line, but for
/// deliveries marked redelivered where the run without failure has them unmarked — a
/// message a killed member had sent on, which the application never received, comes back
/// so when a later one overtook it (`docs/sessions.md` §2). Returns those deliveries (the
/// caller fails on any), or the first line that differs otherwise.
fn same_but_redelivered<'a>(clean: &[String], got: &'a [String]) -> Result<Vec<&'a str>, usize> {
    let mut flagged = Vec::new();
    for (i, (c, g)) in clean.iter().zip(got).enumerate() {
        if c == g {
            continue;
        }
        let (cw, gw): (Vec<&str>, Vec<&str>) = (c.split(' ').collect(), g.split(' ').collect());
        let only_the_flag = cw.len() == 5
            && gw.len() == 5
            && (0..5).all(|k| k == 3 || cw[k] == gw[k])
            && cw[3] == "false"
            && gw[3] == "true";
        if !only_the_flag {
            return Err(i);
        }
        flagged.push(g.as_str());
    }
    if clean.len() == got.len() {
        Ok(flagged)
    } else {
        Err(clean.len().min(got.len()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_sees_the_same_commands_while_its_member_and_primary_are_killed() {
    // RUST_LOG=ringmq_client=debug shows each failover and what it restored.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let (mut m, _secret) = start_cluster_on_fixed_ports("scripted", 3);
    wait_voters(&m, Duration::from_secs(30));
    // The run without failure: connected to member 0, the queues' primary member 1.
    declare_on(&m[1], "scripted-clean").await;
    let uris: Vec<String> = m.iter().map(Broker::uri).collect();
    let patience = Duration::from_secs(60);
    let arguments = ringmq_client::Table::from(queue_arguments().inner().clone());
    let (clean, failovers) = script(
        config(uris, patience),
        "scripted-clean",
        (durable(), arguments),
        patience,
    )
    .await;
    assert_eq!(failovers, 0);
    assert_eq!(clean.consumer.len(), DELIVERIES);
    assert_eq!(
        clean.tx.iter().filter(|l| l.starts_with("deliver")).count(),
        TX_COMMITTED
    );
    let started = Instant::now();
    let (mut landed_runs, mut failover_total, mut flagged_total) = (0, 0, 0);
    let all = seeds("CLUSTER_FAILOVER", 0xc1a5_0001, 3);
    for &seed in &all {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let victim = [Victim::Connected, Victim::Primary, Victim::Both][(seed % 3) as usize];
        let connected = (next(&mut state) % 3) as usize;
        let primary = match victim {
            Victim::Connected if next(&mut state).is_multiple_of(2) => connected,
            _ => (connected + 1 + (next(&mut state) % 2) as usize) % 3,
        };
        let (record, failovers, landed) =
            run_with_kills(&mut m, seed, victim, connected, primary).await;
        assert_eq!(
            record.publisher, clean.publisher,
            "seed {seed:#x} ({victim:?}): the publishing channel differs from the run without failure"
        );
        assert_eq!(
            record.plain, clean.plain,
            "seed {seed:#x} ({victim:?}): the channel without confirms differs"
        );
        let flagged = same_but_redelivered(&clean.consumer, &record.consumer).unwrap_or_else(|line| {
            panic!(
                "seed {seed:#x} ({victim:?}): the consuming channel differs from the run without failure at delivery {line}:\n  clean: {:?}\n  this:  {:?}",
                clean.consumer.get(line),
                record.consumer.get(line)
            )
        });
        let tx_flagged = same_but_redelivered(&clean.tx, &record.tx).unwrap_or_else(|line| {
            panic!(
                "seed {seed:#x} ({victim:?}): the transactional channel differs from the run without failure at line {line}:\n  clean: {:?}\n  this:  {:?}",
                clean.tx.get(line),
                record.tx.get(line)
            )
        });
        let flagged: Vec<&str> = flagged.into_iter().chain(tx_flagged).collect();
        flagged_total += flagged.len();
        landed_runs += usize::from(landed > 0);
        failover_total += failovers;
        eprintln!(
            "seed {seed:#x}: {victim:?}, connected to {connected}, primary {primary}: {landed} kills during the run, {failovers} failovers, same commands ({} deliveries marked redelivered: {flagged:?})",
            flagged.len()
        );
    }
    eprintln!(
        "{} runs ({landed_runs} with a kill during the script, {failover_total} failovers) in {:?}: every record identical to the run without failure, but for {flagged_total} deliveries marked redelivered",
        all.len(),
        started.elapsed()
    );
    assert!(landed_runs > 0, "no kill landed during a run");
    // A held message goes back under the flag of its lost delivery (`core::queue::holds`):
    // one marked where the run without failure has it unmarked came out of order, or from a
    // copy that could not tell — each seed's line above names it.
    assert_eq!(
        flagged_total, 0,
        "deliveries marked redelivered that the run without failure has unmarked"
    );
}
