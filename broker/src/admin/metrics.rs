//! `/metrics` and `/metrics/detailed` in the Prometheus (OpenMetrics) text format.
//!
//! Counters are the connections' atomics ([`crate::broker::stats::BrokerStats`]); every gauge
//! is computed here, at scrape time, from the vhosts and the process: nothing is maintained
//! per message for them. Per-queue series carry the labels `vhost` and `queue` and are capped
//! at `metrics_max_queues` queues.

use crate::broker::Broker;
use crate::broker::resources::{disk_free_bytes, rss_bytes};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

mod replication;

/// The content type of the exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Totals over every vhost, computed under each vhost's lock in turn.
#[derive(Debug, Default, Clone, Copy)]
pub struct Totals {
    /// Vhosts.
    pub vhosts: u64,
    /// Exchanges (predeclared ones included).
    pub exchanges: u64,
    /// Queues.
    pub queues: u64,
    /// Open channels.
    pub channels: u64,
    /// Consumers.
    pub consumers: u64,
    /// Ready messages.
    pub ready: u64,
    /// Delivered, unacknowledged messages.
    pub unacked: u64,
}

/// Counts what the vhosts hold now.
pub fn totals(broker: &Broker) -> Totals {
    let mut t = Totals::default();
    for (_, vhost) in broker.vhosts() {
        let v = vhost.lock();
        t.vhosts += 1;
        t.exchanges += v.exchanges().count() as u64;
        t.channels += v.channels().count() as u64;
        for q in v.queues() {
            t.queues += 1;
            t.consumers += q.consumer_count() as u64;
            t.ready += q.ready_count() as u64;
            t.unacked += q.unacked_count() as u64;
        }
    }
    t
}

fn gauge(reg: &mut Registry, name: &str, help: &str, value: u64) {
    let g: Gauge = Gauge::default();
    g.set(i64::try_from(value).unwrap_or(i64::MAX));
    reg.register(name, help, g);
}

/// The exposition text. `per_queue` adds the labelled per-queue gauges. Series appear in the
/// order they are registered: counters, the journal's, gauges, replication's, then per-queue
/// gauges (replication's last).
pub fn render(broker: &Broker, per_queue: bool) -> String {
    let mut reg = Registry::with_prefix("ringmq");
    register_client_counters(&mut reg, broker);
    register_journal(&mut reg, broker);
    register_gauges(&mut reg, broker);
    replication::register(&mut reg, broker);
    if per_queue {
        register_per_queue(&mut reg, broker);
        replication::register_per_queue(&mut reg, broker);
    }
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, &reg);
    out
}

/// The counters the connections add to once per wake-up.
fn register_client_counters(reg: &mut Registry, broker: &Broker) {
    let s = &broker.stats;
    for (name, help, c) in [
        (
            "messages_published",
            "Messages published by clients",
            &s.published,
        ),
        (
            "messages_routed",
            "Published messages enqueued on at least one queue",
            &s.routed,
        ),
        (
            "messages_unroutable",
            "Published messages no queue took",
            &s.unroutable,
        ),
        (
            "messages_delivered",
            "Messages delivered to consumers or fetched with basic.get",
            &s.delivered,
        ),
        (
            "messages_redelivered",
            "Deliveries of messages delivered before",
            &s.redelivered,
        ),
        (
            "messages_acked",
            "Messages acknowledged by consumers",
            &s.acked,
        ),
        (
            "messages_confirmed",
            "Publisher confirms issued (one per message)",
            &s.confirmed,
        ),
        (
            "session_duplicates_dropped",
            "Publishes resent after a session resume that had been processed already, dropped",
            &s.duplicates_dropped,
        ),
        (
            "received_bytes",
            "Bytes read from AMQP clients",
            &s.bytes_in,
        ),
        ("sent_bytes", "Bytes written to AMQP clients", &s.bytes_out),
        (
            "connections_opened",
            "Connections opened",
            &s.connections_opened,
        ),
        (
            "connections_closed",
            "Connections closed",
            &s.connections_closed,
        ),
    ] {
        reg.register(name, help, c.clone());
    }
}

/// The journal writer's counters and fsync histogram, updated once per sync.
fn register_journal(reg: &mut Registry, broker: &Broker) {
    let j = &broker.journal.stats;
    for (name, help, value) in [
        (
            "journal_fsyncs",
            "fdatasync calls of the journal (one per group commit)",
            &j.fsyncs,
        ),
        (
            "journal_records_written",
            "Journal records written",
            &j.records_written,
        ),
        (
            "journal_records_cancelled",
            "Enqueue records never written because the message was consumed first",
            &j.records_cancelled,
        ),
        (
            "journal_written_bytes",
            "Bytes written to the journal, compaction included",
            &j.bytes_written,
        ),
        (
            "journal_segments_compacted",
            "Journal segments compacted and deleted",
            &j.segments_compacted,
        ),
        (
            "journal_pages_written",
            "Bodies of transient messages written to the journal so that their queue could drop them from memory (flow-to-disk)",
            &j.pages_written,
        ),
        (
            "journal_bodies_read",
            "Message bodies read back from the journal for delivery or dead-lettering (flow-to-disk)",
            &j.bodies_read,
        ),
        (
            "journal_snapshots_written",
            "Snapshots of the queue indexes written",
            &j.snapshots_written,
        ),
    ] {
        let c: prometheus_client::metrics::counter::Counter = Default::default();
        c.inc_by(value.load(std::sync::atomic::Ordering::Relaxed));
        reg.register(name, help, c);
    }
    reg.register(
        "journal_fsync_seconds",
        "Duration of the journal's fdatasync calls",
        j.fsync_seconds.clone(),
    );
}

/// Gauges of what the broker holds now, computed at scrape time.
fn register_gauges(reg: &mut Registry, broker: &Broker) {
    let s = &broker.stats;
    reg.register(
        "blocked_publishers",
        "Publishing connections held back by the memory alarm",
        s.blocked_publishers.clone(),
    );
    let t = totals(broker);
    let c = &broker.config;
    gauge(
        reg,
        "connections",
        "Open AMQP connections",
        broker.registry.connection_count() as u64,
    );
    gauge(reg, "channels", "Open channels", t.channels);
    gauge(reg, "consumers", "Consumers", t.consumers);
    gauge(reg, "queues", "Queues", t.queues);
    gauge(reg, "exchanges", "Exchanges", t.exchanges);
    gauge(reg, "vhosts", "Virtual hosts", t.vhosts);
    gauge(
        reg,
        "messages_ready",
        "Ready messages in all queues",
        t.ready,
    );
    gauge(
        reg,
        "messages_unacked",
        "Delivered, unacknowledged messages in all queues",
        t.unacked,
    );
    gauge(
        reg,
        "memory_used_bytes",
        "Resident memory of the broker process",
        rss_bytes().unwrap_or(0),
    );
    gauge(
        reg,
        "memory_high_watermark_bytes",
        "Resident memory above which publishers are blocked",
        c.memory_high_watermark_bytes,
    );
    gauge(
        reg,
        "memory_alarm",
        "1 while a resource alarm (memory or disk) blocks publishers",
        u64::from(broker.publishers_blocked()),
    );
    gauge(
        reg,
        "disk_free_bytes",
        "Free bytes on the data directory's file system",
        disk_free_bytes(&c.data_dir).unwrap_or(0),
    );
}

/// Ready, unacked and consumers per queue, for at most `metrics_max_queues` queues so that
/// label cardinality stays bounded.
fn register_per_queue(reg: &mut Registry, broker: &Broker) {
    let c = &broker.config;
    let ready: Family<Vec<(String, String)>, Gauge> = Family::default();
    let unacked: Family<Vec<(String, String)>, Gauge> = Family::default();
    let consumers: Family<Vec<(String, String)>, Gauge> = Family::default();
    let mut left = c.metrics_max_queues;
    'vhosts: for (name, vhost) in broker.vhosts() {
        let v = vhost.lock();
        for q in v.queues() {
            if left == 0 {
                break 'vhosts;
            }
            left -= 1;
            let labels = vec![
                ("vhost".to_owned(), name.clone()),
                ("queue".to_owned(), q.name.to_string()),
            ];
            ready.get_or_create(&labels).set(q.ready_count() as i64);
            unacked.get_or_create(&labels).set(q.unacked_count() as i64);
            consumers
                .get_or_create(&labels)
                .set(q.consumer_count() as i64);
        }
    }
    reg.register("queue_messages_ready", "Ready messages per queue", ready);
    reg.register(
        "queue_messages_unacked",
        "Unacknowledged messages per queue",
        unacked,
    );
    reg.register("queue_consumers", "Consumers per queue", consumers);
}
