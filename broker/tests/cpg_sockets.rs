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
    let (a, mut ea) = Cpg::start(config(vec![], SECRET)).await.expect("found cluster");
    let seeds = vec![a.addr().to_string()];
    let (b, mut eb) = Cpg::start(config(seeds.clone(), SECRET)).await.expect("b joins");
    let (c, mut ec) = Cpg::start(config(seeds.clone(), SECRET)).await.expect("c joins");
    for m in [&a, &b, &c] {
        m.join(GROUP).await.expect("join group");
    }
    for (i, m) in [&a, &b, &c].into_iter().enumerate() {
        m.mcast(GROUP, Bytes::from(vec![i as u8])).await.expect("mcast");
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
    a.mcast(GROUP, Bytes::from_static(b"after")).await.expect("mcast after rejoin");
    for e in [&mut ea, &mut eb, &mut ec2] {
        wait_for(e, limit, |ev| is_delivery_of(ev, b"after")).await;
    }
    for m in [a, b, c2] {
        m.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_with_wrong_secret_is_refused() {
    let (a, _ea) = Cpg::start(config(vec![], SECRET)).await.expect("found cluster");
    let mut bad = config(vec![a.addr().to_string()], b"not-the-secret");
    bad.join_timeout_ms = 1_000;
    match Cpg::start(bad).await {
        Err(CpgError::JoinTimeout { .. }) => {}
        Err(e) => panic!("expected a join timeout, got {e}"),
        Ok(_) => panic!("a peer with the wrong secret was admitted"),
    }
    a.shutdown().await;
}
