//! Broker-wide message and byte counters for `/metrics`.
//!
//! The hot path never touches a lock, a label or a log: each connection counts into plain
//! integers ([`ConnStats`]) while it handles a batch of frames and adds them to the shared
//! atomics ([`BrokerStats`], prometheus-client counters) once per wake-up. Gauges that can be
//! computed from state (connections, channels, consumers, queue depths) are computed when
//! `/metrics` is scraped, not maintained.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

/// Shared counters, one set per broker process.
#[derive(Debug, Default)]
pub struct BrokerStats {
    /// Messages received with basic.publish (complete content).
    pub published: Counter,
    /// Published messages enqueued on at least one queue.
    pub routed: Counter,
    /// Published messages no queue took.
    pub unroutable: Counter,
    /// Messages written to consumers (basic.deliver) or fetched (basic.get-ok).
    pub delivered: Counter,
    /// Of those, the ones delivered before.
    pub redelivered: Counter,
    /// Messages acknowledged by consumers.
    pub acked: Counter,
    /// Publisher confirms (ack or nack) issued, one per message.
    pub confirmed: Counter,
    /// Publishes a session's client resent after a resume that the broker had processed
    /// already, dropped (`docs/sessions.md`).
    pub duplicates_dropped: Counter,
    /// Bytes read from AMQP sockets.
    pub bytes_in: Counter,
    /// Bytes written to AMQP sockets.
    pub bytes_out: Counter,
    /// Connections that completed connection.open.
    pub connections_opened: Counter,
    /// Connections that ended (any reason, opened or not).
    pub connections_closed: Counter,
    /// Connections whose reading is stopped because publishers are blocked (memory alarm).
    pub blocked_publishers: Gauge,
}

/// One connection's counts since its last flush.
#[derive(Debug, Default)]
pub struct ConnStats {
    /// See [`BrokerStats::published`].
    pub published: u64,
    /// See [`BrokerStats::routed`].
    pub routed: u64,
    /// See [`BrokerStats::unroutable`].
    pub unroutable: u64,
    /// See [`BrokerStats::delivered`].
    pub delivered: u64,
    /// See [`BrokerStats::redelivered`].
    pub redelivered: u64,
    /// See [`BrokerStats::acked`].
    pub acked: u64,
    /// See [`BrokerStats::confirmed`].
    pub confirmed: u64,
    /// See [`BrokerStats::duplicates_dropped`].
    pub duplicates_dropped: u64,
    /// See [`BrokerStats::bytes_in`].
    pub bytes_in: u64,
    /// See [`BrokerStats::bytes_out`].
    pub bytes_out: u64,
    /// Whether this connection is counted in [`BrokerStats::blocked_publishers`].
    blocked: bool,
}

impl ConnStats {
    /// Adds what was counted to the broker's totals and starts again from zero.
    pub fn flush(&mut self, to: &BrokerStats) {
        for (n, c) in [
            (&mut self.published, &to.published),
            (&mut self.routed, &to.routed),
            (&mut self.unroutable, &to.unroutable),
            (&mut self.delivered, &to.delivered),
            (&mut self.redelivered, &to.redelivered),
            (&mut self.acked, &to.acked),
            (&mut self.confirmed, &to.confirmed),
            (&mut self.duplicates_dropped, &to.duplicates_dropped),
            (&mut self.bytes_in, &to.bytes_in),
            (&mut self.bytes_out, &to.bytes_out),
        ] {
            if *n > 0 {
                c.inc_by(std::mem::take(n));
            }
        }
    }

    /// Records that this connection's publisher is (or no longer is) held back by the memory
    /// alarm; logs the change once.
    pub fn set_blocked(&mut self, to: &BrokerStats, conn: u64, blocked: bool) {
        if self.blocked == blocked {
            return;
        }
        self.blocked = blocked;
        if blocked {
            to.blocked_publishers.inc();
            tracing::info!(conn, "publisher blocked: memory high watermark");
        } else {
            to.blocked_publishers.dec();
            tracing::info!(conn, "publisher unblocked");
        }
    }

    /// The connection ended: final flush, and it no longer counts as blocked.
    pub fn closed(&mut self, to: &BrokerStats, conn: u64) {
        self.flush(to);
        self.set_blocked(to, conn, false);
        to.connections_closed.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flush_adds_the_batch_once_and_blocked_counts_each_connection_once() {
        let total = BrokerStats::default();
        let mut a = ConnStats {
            published: 3,
            bytes_in: 10,
            ..ConnStats::default()
        };
        a.flush(&total);
        a.flush(&total);
        assert_eq!((total.published.get(), total.bytes_in.get()), (3, 10));
        let mut b = ConnStats::default();
        a.set_blocked(&total, 1, true);
        a.set_blocked(&total, 1, true);
        b.set_blocked(&total, 2, true);
        assert_eq!(total.blocked_publishers.get(), 2);
        a.set_blocked(&total, 1, false);
        b.closed(&total, 2);
        assert_eq!(total.blocked_publishers.get(), 0);
        assert_eq!(total.connections_closed.get(), 1);
    }
}
