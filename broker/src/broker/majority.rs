//! A member that loses the majority stops serving within its lease (DESIGN §4): what it
//! holds may be stale and what it would accept could be lost, so every client connection is
//! closed with 320 CONNECTION_FORCED, the reason and the members to reconnect to, and new
//! ones are refused (`connection.open`, see `server/connection/handshake.rs`) until it is
//! ready again.

use super::Broker;
use crate::amqp::codes;
use crate::cluster::Cluster;
use std::sync::Arc;
use std::time::Duration;

/// How often the member checks that it still holds the majority's lease: well inside the
/// lease (the failure timeout), so clients are gone before the majority may act without it.
const CHECK_EVERY: Duration = Duration::from_millis(100);

/// Watches readiness for as long as the broker lives and closes every client connection
/// when the member stops being ready.
pub fn spawn_guard(broker: Arc<Broker>, cluster: Arc<Cluster>) {
    let broker = Arc::downgrade(&broker);
    tokio::spawn(async move {
        let mut was_ready = false;
        loop {
            tokio::time::sleep(CHECK_EVERY).await;
            let Some(broker) = broker.upgrade() else {
                return;
            };
            let reason = cluster.not_ready_reason();
            if let (true, Some(reason)) = (was_ready, &reason) {
                let others = cluster.known_hosts().join(",");
                tracing::warn!(%reason, "this member is not ready: closing every client connection");
                broker.close_all_connections(
                    codes::CONNECTION_FORCED,
                    &format!(
                        "this cluster member stopped serving: {reason}; known-hosts: {others}"
                    ),
                );
            }
            was_ready = reason.is_none();
        }
    });
}

impl Broker {
    /// Asks every live connection to close with `code` and `text`.
    pub fn close_all_connections(&self, code: u16, text: &str) {
        for outbox in self.outboxes.read().values() {
            outbox.push(|p| p.close = Some((code, text.to_owned())));
        }
    }
}
