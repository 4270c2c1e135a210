//! The replication series of `/metrics/detailed` on real members (issue #13): the primary of
//! a queue with two backups shows each backup's lag (ops and bytes sent and not yet
//! acknowledged, back to zero once the publishes are confirmed) and the queue's backup and
//! in-sync counts; the backup elected when the primary is killed counts the election.

use crate::harness::*;
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use std::time::{Duration, Instant};

/// Confirmed publishes before the metrics are read.
const MESSAGES: usize = 500;
/// Longest wait for the backups to be in sync, for the lag to drain, and for the election.
const LIMIT: Duration = Duration::from_secs(30);

/// Polls `b`'s `series` until `done` holds for its value; panics with the last value after
/// [`LIMIT`].
fn wait_metric(b: &ringmq_tests::Broker, series: &str, done: impl Fn(f64) -> bool) -> f64 {
    let deadline = Instant::now() + LIMIT;
    loop {
        let value = detailed_metric(b, series);
        if let Some(v) = value.filter(|v| done(*v)) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{series}: not as expected within {LIMIT:?}; last value {value:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn the_primary_shows_each_backups_lag_and_the_in_sync_count_and_the_elected_backup_counts_its_election()
 {
    let name = "repl-metrics";
    let (mut members, _ports, _secret) = start_cluster(name);
    let queue = "metered";
    let backups = declare_replicated(&members[0], queue, 2, LIMIT).await;
    let primary = &members[0];
    let q = format!("vhost=\"/\",queue=\"{queue}\"");

    let (conn, ch) = primary.channel().await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::with_capacity(MESSAGES);
    for i in 0..MESSAGES {
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("m{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap(),
        );
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack(), "a publish was nacked");
    }
    let _ = conn.close(200, "published".into()).await;

    let configured = wait_metric(
        primary,
        &format!("ringmq_replication_queue_backups{{{q}}}"),
        |v| v == 2.0,
    );
    let in_sync = wait_metric(
        primary,
        &format!("ringmq_replication_queue_backups_in_sync{{{q}}}"),
        |v| v == configured,
    );
    eprintln!("{name}: {in_sync} of {configured} backups in sync");
    for backup in &backups {
        let labels = format!("{q},backup=\"{backup}\"");
        // Every publish was confirmed, so each in-sync backup acknowledged its frames.
        wait_metric(
            primary,
            &format!("ringmq_replication_queue_lag_ops{{{labels}}}"),
            |v| v == 0.0,
        );
        wait_metric(
            primary,
            &format!("ringmq_replication_queue_lag_bytes{{{labels}}}"),
            |v| v == 0.0,
        );
    }
    let sent = detailed_metric(primary, "ringmq_replication_frames_sent_total").unwrap_or(0.0);
    assert!(
        sent >= 2.0,
        "{name}: frames went to both backups ({sent} sent)"
    );
    assert_eq!(
        detailed_metric(primary, "ringmq_replication_elections_won_total"),
        Some(0.0),
        "{name}: the declaring member was made primary, not elected"
    );

    // The primary dies: its first backup is elected and counts it.
    members[0].kill();
    let b = member_of(name, N, &backups[0]);
    wait_queue_view(&members[b], queue, LIMIT, "the first backup elected", |v| {
        v["node"].as_str() == Some(backups[0].as_str())
    });
    wait_metric(&members[b], "ringmq_replication_elections_won_total", |v| {
        v == 1.0
    });
    let other = member_of(name, N, &backups[1]);
    assert_eq!(
        detailed_metric(&members[other], "ringmq_replication_elections_won_total"),
        Some(0.0),
        "{name}: the member not elected counts nothing"
    );
    // The new primary follows the queue's backups from here: its per-queue series appear.
    let backups_now = wait_metric(
        &members[b],
        &format!("ringmq_replication_queue_backups{{{q}}}"),
        |v| v >= 1.0,
    );
    let in_sync_now = wait_metric(
        &members[b],
        &format!("ringmq_replication_queue_backups_in_sync{{{q}}}"),
        |v| v <= backups_now,
    );
    eprintln!("{name}: after the election {in_sync_now} of {backups_now} backups in sync");
}
