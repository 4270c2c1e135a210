//! Replication's series: totals, catch-ups and the lag of this member's primaries, and per
//! queue (with `/metrics/detailed`) each backup's lag and catch-up and the in-sync count.
//! Everything is read at scrape time from the replicator
//! ([`crate::replication::replicator::Replicator::stats`] and `queue_stats`).

use super::gauge;
use crate::broker::Broker;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// Replication of this member's primaries: totals, catch-ups, and the lag now.
pub(super) fn register(reg: &mut Registry, broker: &Broker) {
    let r = broker.replicator().stats();
    for (name, help, value) in [
        (
            "replication_frames_sent",
            "Replication frames (a queue's ops of one batch, or a catch-up image) sent to backups",
            r.frames_sent,
        ),
        (
            "replication_sent_bytes",
            "Bytes of replication frames sent to backups",
            r.bytes_sent,
        ),
        (
            "replication_catch_ups_started",
            "Catch-ups begun: an image of a queue sent to a backup new to it or after a failure",
            r.catch_ups_started,
        ),
        (
            "replication_catch_ups_completed",
            "Catch-ups that ended with the backup committed in sync",
            r.catch_ups_completed,
        ),
        (
            "replication_catch_ups_abandoned",
            "Catch-ups given up (not done within replication_catch_up_timeout_ms, too many ops held back, a link failure) and retried from a new image",
            r.catch_ups_abandoned,
        ),
        (
            "replication_link_failures",
            "Links to backups that failed or refused a frame (each starts a catch-up)",
            r.links_failed,
        ),
        (
            "replication_elections_won",
            "Queues whose replica on this member was promoted to primary by an election",
            broker.elections_won(),
        ),
    ] {
        let c: prometheus_client::metrics::counter::Counter = Default::default();
        c.inc_by(value);
        reg.register(name, help, c);
    }
    gauge(
        reg,
        "replication_frames_unacked",
        "Replication frames sent and not yet acknowledged by their backups (the lag)",
        r.frames_unacked,
    );
    gauge(
        reg,
        "replication_batches_waiting",
        "Batches whose confirms wait for an in-sync backup's acknowledgement",
        r.batches_waiting,
    );
    gauge(
        reg,
        "replicated_queues",
        "Replicated queues this member is the primary of",
        r.queues,
    );
    gauge(
        reg,
        "replication_backups_in_sync",
        "Backups (per queue this member is primary of) that are in sync",
        r.in_sync_backups,
    );
    gauge(
        reg,
        "replication_backups_catching_up",
        "Backups (per queue this member is primary of) that are catching up",
        r.catching_up_backups,
    );
    for (name, help, value) in [
        (
            "replication_catch_ups_running",
            "Catch-ups under way (a backup receiving a queue's image in chunks, or confirming it)",
            r.catch_ups_running,
        ),
        (
            "replication_catch_up_messages",
            "Messages in the images of the catch-ups under way",
            r.catch_up_messages_total,
        ),
        (
            "replication_catch_up_messages_sent",
            "Of the messages in the images of the catch-ups under way, those sent so far",
            r.catch_up_messages_sent,
        ),
        (
            "replication_catch_up_sent_bytes",
            "Image chunk bytes the catch-ups under way sent so far",
            r.catch_up_bytes_sent,
        ),
        (
            "replication_catch_up_held_bytes",
            "Bytes of ops held back by catch-ups under way until their image's last chunk is out",
            r.catch_up_held_bytes,
        ),
    ] {
        gauge(reg, name, help, value);
    }
    reg.register(
        "replication_catch_up_duration_seconds",
        "Duration of completed catch-ups, from the queue's image to the backup's in-sync commit",
        broker.replicator().catch_up_seconds(),
    );
}

/// Labels of a per-queue series.
type QueueLabels = Vec<(String, String)>;

/// Per replicated queue this member is primary of (at most `metrics_max_queues`): its backup
/// and in-sync counts, and per backup (label `backup`, its node id) the lag and, while one
/// runs, its catch-up's progress.
pub(super) fn register_per_queue(reg: &mut Registry, broker: &Broker) {
    let backups: Family<QueueLabels, Gauge> = Family::default();
    let in_sync: Family<QueueLabels, Gauge> = Family::default();
    let lag_ops: Family<QueueLabels, Gauge> = Family::default();
    let lag_bytes: Family<QueueLabels, Gauge> = Family::default();
    let catch_up_messages: Family<QueueLabels, Gauge> = Family::default();
    let catch_up_sent: Family<QueueLabels, Gauge> = Family::default();
    let catch_up_seconds: Family<QueueLabels, Gauge<f64, AtomicU64>> = Family::default();
    let count = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    for q in broker
        .replicator()
        .queue_stats(broker.config.metrics_max_queues)
    {
        let queue = vec![
            ("vhost".to_owned(), q.vhost.clone()),
            ("queue".to_owned(), q.queue.to_string()),
        ];
        backups.get_or_create(&queue).set(count(q.backups));
        in_sync.get_or_create(&queue).set(count(q.in_sync));
        for b in q.per_backup {
            let mut labels = queue.clone();
            labels.push(("backup".to_owned(), b.backup));
            lag_ops.get_or_create(&labels).set(count(b.lag_ops));
            lag_bytes.get_or_create(&labels).set(count(b.lag_bytes));
            if let Some(c) = b.catch_up {
                catch_up_messages
                    .get_or_create(&labels)
                    .set(count(c.messages));
                catch_up_sent
                    .get_or_create(&labels)
                    .set(count(c.messages_sent));
                catch_up_seconds.get_or_create(&labels).set(c.seconds);
            }
        }
    }
    reg.register(
        "replication_queue_backups",
        "Backups the cluster map gives a replicated queue this member is primary of",
        backups,
    );
    reg.register(
        "replication_queue_backups_in_sync",
        "Of a replicated queue's backups, those in sync (counted by the confirm gate, electable)",
        in_sync,
    );
    reg.register(
        "replication_queue_lag_ops",
        "Queue ops sent to a backup and not yet acknowledged by it (an image chunk counts its messages)",
        lag_ops,
    );
    reg.register(
        "replication_queue_lag_bytes",
        "Bytes of replication frames sent to a backup and not yet acknowledged by it",
        lag_bytes,
    );
    reg.register(
        "replication_queue_catch_up_messages",
        "Messages in the image of a backup's catch-up under way",
        catch_up_messages,
    );
    reg.register(
        "replication_queue_catch_up_messages_sent",
        "Of the messages in the image of a backup's catch-up under way, those sent so far",
        catch_up_sent,
    );
    reg.register(
        "replication_queue_catch_up_seconds",
        "Age of a backup's catch-up under way, since its image was taken",
        catch_up_seconds,
    );
}
