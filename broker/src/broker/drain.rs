//! A drained member's clients go elsewhere (`cluster drain`, `docs/cluster.md`): while the
//! cluster map marks this member draining, its client connections are closed with 320
//! CONNECTION_FORCED — a failover client resumes its session on another member from the
//! `known-hosts` it has, a plain client reconnects through its list or load balancer —
//! and new ones are refused at `connection.open` (`/readyz` answers 503 meanwhile). Links
//! from other members stay: the queues it holds move off over them.

use super::Broker;
use crate::cluster::Cluster;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

/// How often the member looks whether it is being drained.
const CHECK_EVERY: Duration = Duration::from_millis(100);

/// Closes this member's client connections for as long as the map marks it draining.
pub fn spawn_guard(broker: Arc<Broker>, cluster: Arc<Cluster>) {
    let broker = Arc::downgrade(&broker);
    tokio::spawn(async move {
        // Connections already asked to close (they take a moment to go).
        let mut asked: HashSet<u64> = HashSet::new();
        loop {
            tokio::time::sleep(CHECK_EVERY).await;
            let Some(broker) = broker.upgrade() else {
                return;
            };
            if !cluster.is_draining(cluster.node_id()) {
                asked.clear();
                continue;
            }
            let clients: Vec<u64> = (broker.registry.connections().into_iter())
                .filter(|c| !c.link && !asked.contains(&c.id))
                .map(|c| c.id)
                .collect();
            if clients.is_empty() {
                continue;
            }
            let others = cluster.known_hosts().join(",");
            let reason = format!(
                "this cluster member is being drained: connect to another (known-hosts: {others})"
            );
            for id in &clients {
                broker.force_close(*id, &reason);
            }
            tracing::warn!(
                connections = clients.len(),
                "this member is being drained: its client connections are closed"
            );
            asked.extend(clients);
        }
    });
}
