//! A member that loses the majority stops serving (DESIGN §4): what it holds may be stale
//! and what it would accept could be lost, so every client connection is closed with 320
//! CONNECTION_FORCED, the reason and the members to reconnect to, and new ones are refused
//! (`connection.open`, see `server/connection/handshake.rs`) until it is ready again.
//!
//! A lapse shorter than [`Cluster::serving_grace`] is ridden out: on a loaded machine a
//! lease renewal can miss its deadline with every member up, and the followers' leases lapse
//! while they elect a new consensus leader after the old one's loss; closing every client
//! for that would turn a stall, or the loss of one member, into a reconnect storm. Nothing is confirmed meanwhile — the
//! confirm gate asks for the lease — so the grace costs latency, not safety; it ends well
//! before the others may declare this member failed.

use super::Broker;
use crate::amqp::codes;
use crate::cluster::Cluster;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// How often the member checks that it is ready: a heartbeat, so that with the grace the
/// clients are gone well inside the failure timeout.
const CHECK_EVERY: Duration = Duration::from_millis(50);

/// Watches readiness for as long as the broker lives and closes every client connection
/// once the member has not been ready for a whole grace.
pub fn spawn_guard(broker: Arc<Broker>, cluster: Arc<Cluster>) {
    let broker = Arc::downgrade(&broker);
    tokio::spawn(async move {
        let grace = cluster.serving_grace();
        // Clients may be connected: the member was ready since it last closed them.
        let mut serving = false;
        let mut lapsed_since: Option<Instant> = None;
        loop {
            tokio::time::sleep(CHECK_EVERY).await;
            let Some(broker) = broker.upgrade() else {
                return;
            };
            let Some(reason) = cluster.not_ready_reason() else {
                if lapsed_since.take().is_some() {
                    tracing::info!("this member is ready again: its clients were kept");
                }
                serving = true;
                continue;
            };
            if !serving {
                continue;
            }
            // Counted from when the lease ran out, not from this look: after a pause of the
            // process the grace may be over already.
            let since = *lapsed_since.get_or_insert_with(|| {
                tracing::warn!(%reason, grace_ms = grace.as_millis() as u64, "this member is not ready: holding confirms, closing its clients if it lasts");
                cluster.lease_ended_at().unwrap_or_else(Instant::now)
            });
            // A member that voted for another's candidacy is in contact with the others,
            // who are electing a leader after the old one's loss: it is not the one cut off,
            // and nobody will declare it failed. It waits longer for the new leader's lease
            // (bounded: an election that keeps failing closes its clients all the same).
            let grace = if cluster.voted_for_a_candidate() {
                grace.max(cluster.election_grace())
            } else {
                grace
            };
            if since.elapsed() >= grace {
                let others = cluster.known_hosts().join(",");
                tracing::warn!(%reason, "this member is not ready: closing every client connection");
                broker.close_all_connections(
                    codes::CONNECTION_FORCED,
                    &format!(
                        "this cluster member stopped serving: {reason}; known-hosts: {others}"
                    ),
                );
                serving = false;
                lapsed_since = None;
            }
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
