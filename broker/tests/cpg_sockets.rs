//! CPG members on real loopback sockets: multicast from each, kill one, see it fail on the
//! survivors, restart it and see it rejoin and catch up; a peer with the wrong secret is refused.

use std::time::Duration;

use bytes::Bytes;
use ringmq::cpg::{Cpg, CpgConfig, CpgError, CpgEvent, CpgEvents};
use tokio::time::{Instant, timeout};

const GROUP: &str = "wiring";
const SECRET: &[u8] = b"test-cluster-secret";

fn config(seeds: Vec<String>, secret: &[u8]) -> CpgConfig {
    CpgConfig {
        seeds,
        secret: secret.to_vec(),
        join_timeout_ms: 5_000,
        ..CpgConfig::default()
    }
}

/// Reads events until one matches, within `limit`.
async fn wait_for(
    events: &mut CpgEvents,
    limit: Duration,
    mut pred: impl FnMut(&CpgEvent) -> bool,
) -> Vec<CpgEvent> {
    let mut seen = Vec::new();
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match timeout(left, events.recv()).await {
            Ok(Some(ev)) => {
                let done = pred(&ev);
                seen.push(ev);
                if done {
                    return seen;
                }
            }
            Ok(None) => panic!("event stream ended; seen {seen:?}"),
            Err(_) => panic!("no matching event within {limit:?}; seen {seen:?}"),
        }
    }
}

fn is_delivery_of(ev: &CpgEvent, payload: &[u8]) -> bool {
    matches!(ev, CpgEvent::Deliver { payload: p, .. } if p.as_ref() == payload)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_member_fails_on_survivors_and_restarted_one_rejoins_and_catches_up() {
    let (a, mut ea) = Cpg::start(config(vec![], SECRET))
        .await
        .expect("found cluster");
    let seeds = vec![a.addr().to_string()];
    let (b, mut eb) = Cpg::start(config(seeds.clone(), SECRET))
        .await
        .expect("b joins");
    let (c, mut ec) = Cpg::start(config(seeds.clone(), SECRET))
        .await
        .expect("c joins");
    for m in [&a, &b, &c] {
        m.join(GROUP).await.expect("join group");
    }
    for (i, m) in [&a, &b, &c].into_iter().enumerate() {
        m.mcast(GROUP, Bytes::from(vec![i as u8]))
            .await
            .expect("mcast");
    }
    let limit = Duration::from_secs(10);
    let mut logs = Vec::new();
    for e in [&mut ea, &mut eb, &mut ec] {
        let seen = wait_for(e, limit, |ev| is_delivery_of(ev, &[2])).await;
        let deliveries: Vec<_> = seen
            .into_iter()
            .filter(|ev| matches!(ev, CpgEvent::Deliver { .. }))
            .collect();
        logs.push(deliveries);
    }
    assert_eq!(logs[0], logs[1], "a and b delivered differently");
    assert_eq!(logs[1], logs[2], "b and c delivered differently");
    assert_eq!(logs[0].len(), 3);

    let dead = c.id();
    drop(c);
    drop(ec);
    for e in [&mut ea, &mut eb] {
        wait_for(e, limit, |ev| {
            matches!(ev, CpgEvent::ConfChg { failed, .. } if failed.iter().any(|m| m.id == dead))
        })
        .await;
    }

    let (c2, mut ec2) = Cpg::start(config(seeds, SECRET)).await.expect("c rejoins");
    assert_ne!(c2.id(), dead, "a restarted member is a new incarnation");
    c2.join(GROUP).await.expect("rejoin group");
    wait_for(&mut ec2, limit, |ev| {
        matches!(ev, CpgEvent::ConfChg { joined, members, .. }
            if joined.iter().any(|m| m.id == c2.id()) && members.len() == 3)
    })
    .await;
    a.mcast(GROUP, Bytes::from_static(b"after"))
        .await
        .expect("mcast after rejoin");
    for e in [&mut ea, &mut eb, &mut ec2] {
        wait_for(e, limit, |ev| is_delivery_of(ev, b"after")).await;
    }
    for m in [a, b, c2] {
        m.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_with_wrong_secret_is_refused() {
    let (a, _ea) = Cpg::start(config(vec![], SECRET))
        .await
        .expect("found cluster");
    let mut bad = config(vec![a.addr().to_string()], b"not-the-secret");
    bad.join_timeout_ms = 1_000;
    match Cpg::start(bad).await {
        Err(CpgError::JoinTimeout { .. }) => {}
        Err(e) => panic!("expected a join timeout, got {e}"),
        Ok(_) => panic!("a peer with the wrong secret was admitted"),
    }
    a.shutdown().await;
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// Measures, on loopback with default timings, the time from killing a member to the ConfChg
/// on a survivor, and the commit latency of a multicast in a 3-member cluster.
/// `CPG_BENCH_RUNS=50 cargo test --release -p ringmq --test cpg_sockets -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement, takes minutes"]
async fn measure_failure_detection_and_commit_latency() {
    let runs: usize = std::env::var("CPG_BENCH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let mut detect = Vec::new();
    let mut commit = Vec::new();
    for _ in 0..runs {
        let (a, mut ea) = Cpg::start(config(vec![], SECRET)).await.expect("found");
        let seeds = vec![a.addr().to_string()];
        let (b, _eb) = Cpg::start(config(seeds.clone(), SECRET)).await.expect("b");
        let (c, _ec) = Cpg::start(config(seeds, SECRET)).await.expect("c");
        a.join(GROUP).await.expect("join");
        b.join(GROUP).await.expect("join");
        c.join(GROUP).await.expect("join");
        for i in 0..20u8 {
            let t = Instant::now();
            b.mcast(GROUP, Bytes::from(vec![i])).await.expect("mcast");
            commit.push(t.elapsed());
        }
        let dead = c.id();
        let t = Instant::now();
        drop(c);
        drop(_ec);
        wait_for(&mut ea, Duration::from_secs(10), |ev| {
            matches!(ev, CpgEvent::ConfChg { failed, .. } if failed.iter().any(|m| m.id == dead))
        })
        .await;
        detect.push(t.elapsed());
        a.shutdown().await;
        b.shutdown().await;
    }
    detect.sort();
    commit.sort();
    println!(
        "kill -> ConfChg over {} runs: median {:?}, p99 {:?}, max {:?}",
        detect.len(),
        percentile(&detect, 0.5),
        percentile(&detect, 0.99),
        detect[detect.len() - 1]
    );
    println!(
        "mcast commit (follower-sent, 3 members) over {} samples: median {:?}, p99 {:?}",
        commit.len(),
        percentile(&commit, 0.5),
        percentile(&commit, 0.99)
    );
}
