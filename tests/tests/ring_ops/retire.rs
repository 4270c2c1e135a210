//! A drained member that stops leaves the cluster for good: the others stop counting its
//! vote, so the cluster survives the next failure as a cluster of the members that stay. A
//! member that stops without a drain stays a voter (its stop is a restart), and a retired
//! member started again on its data is admitted again.

use crate::{ctl, get};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use ringmq_tests::Broker;
use ringmq_tests::cluster::start_cluster;
use serde_json::Value;
use std::time::{Duration, Instant};

/// Polls `b`'s `/api/overview` until `check` holds (at most `limit`); the last overview.
async fn overview_until(b: &Broker, limit: Duration, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + limit;
    loop {
        let o = get(b, "/api/overview").await;
        if check(&o) || Instant::now() >= deadline {
            return o;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn voters(o: &Value) -> u64 {
    o["cluster"]["voters"].as_u64().unwrap_or(0)
}

fn state_of<'a>(o: &'a Value, node: &str) -> Option<&'a str> {
    o["members"].as_array()?.iter().find(|m| m["id"] == node)?["state"].as_str()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_member_that_stops_is_no_longer_a_voter_and_the_rest_survive_the_next_failure() {
    let (mut m, _secret) = start_cluster("retire", 4);
    let before = get(&m[0], "/api/overview").await;
    assert_eq!(voters(&before), 4, "{before}");

    // A member stopped without a drain stays a voter: its stop is a restart.
    m[1].stop_and_restart();
    m[1].wait_ready(Duration::from_secs(30));
    let o = overview_until(&m[0], Duration::from_secs(10), |o| {
        state_of(o, "retire-1") == Some("running")
    })
    .await;
    assert_eq!(voters(&o), 4, "a restart is not a retirement: {o}");

    // Drained and stopped: it leaves for good, with a clean exit.
    let (ok, out) = ctl(&m[0], &["cluster", "drain", "retire-3", "--wait"]).await;
    assert!(ok, "{out}");
    m[3].signal(libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = m[3].exit_status() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "retire-3 did not exit on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}: {}", m[3].log_tail(20));
    assert!(
        m[3].log_tail(40).contains("left the cluster for good"),
        "{}",
        m[3].log_tail(40)
    );
    let o = overview_until(&m[0], Duration::from_secs(10), |o| voters(o) == 3).await;
    assert_eq!(voters(&o), 3, "{o}");
    assert_eq!(state_of(&o, "retire-3"), None, "{o}");

    // Another member crashes: two of three voters remain, a majority. Had retire-3 stayed a
    // voter, two of four would not be one, and the cluster would stop.
    m[2].kill();
    let o = overview_until(&m[0], Duration::from_secs(15), |o| {
        state_of(o, "retire-2").is_none() && o["cluster"]["quorum"] == true
    })
    .await;
    assert_eq!(o["cluster"]["quorum"], true, "{o}");
    let (_conn, ch) = m[1].channel().await;
    ch.queue_declare(
        "after-two-left".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("the two members that stay still agree on a declare");

    // Started again on its data, the retired member is admitted again (still drained).
    m[3].crash_and_restart();
    let o = overview_until(&m[0], Duration::from_secs(30), |o| {
        state_of(o, "retire-3") == Some("draining") && voters(o) == 4
    })
    .await;
    assert_eq!(
        state_of(&o, "retire-3"),
        Some("draining"),
        "{o}\nretire-3:\n{}",
        m[3].log_tail(60)
    );
    assert_eq!(
        voters(&o),
        4,
        "retire-0, 1, 3 and the crashed retire-2: {o}"
    );
}
