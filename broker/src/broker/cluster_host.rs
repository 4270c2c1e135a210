//! The broker as the cluster layer sees it: committed wiring ops applied to the vhosts (and
//! journalled when durable), snapshots for joiners, membership notices to clients.

use super::Broker;
use crate::clock::now_ms;
use crate::cluster::map::WiringStore;
use crate::cluster::{ClusterHost, OpOutcome, notice};
use crate::core::wiring::Wiring;
use crate::core::{AmqpError, Effects, NO_CONNECTION, WiringOp};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The broker's vhosts as the cluster map's wiring store, and the broker as the cluster
/// layer's host.
pub struct BrokerHost {
    broker: Arc<Broker>,
}

impl BrokerHost {
    /// The host for `broker`'s cluster membership.
    pub fn new(broker: Arc<Broker>) -> Self {
        Self { broker }
    }
}

impl WiringStore for BrokerHost {
    fn apply(&mut self, index: u64, vhost: &str, op: &WiringOp) -> OpOutcome {
        let outcome = self.apply_to_vhost(Some(index), vhost, op);
        // Links wait for it (`proxy::catch_up`), whatever the op's outcome.
        self.broker.proxies().applied.advance(index);
        outcome
    }

    fn applied_through(&mut self, vhost: &str) -> Option<u64> {
        let through = self.broker.vhost(vhost)?.lock().cluster_through()?;
        // A restart's replay skips what the previous process applied: it counts as applied.
        self.broker.proxies().applied.advance(through);
        Some(through)
    }

    fn export(&mut self) -> BTreeMap<String, Wiring> {
        self.broker
            .vhosts()
            .into_iter()
            .map(|(name, vhost)| (name, vhost.lock().shared_wiring()))
            .collect()
    }

    fn install(&mut self, vhosts: BTreeMap<String, Wiring>, through: u64) {
        let now = now_ms();
        let mut fx = Effects::default();
        for (name, mut wiring) in vhosts {
            wiring.cluster_through = Some(through);
            self.broker.add_vhost(&name);
            let Some(vhost) = self.broker.vhost(&name) else {
                continue;
            };
            let mut v = vhost.lock();
            for skipped in v.install_shared_wiring(wiring, now, &mut fx) {
                tracing::warn!(vhost = %name, %skipped, "cluster wiring not installed");
            }
            self.broker.finish_batch(0, &mut v, &mut fx);
        }
        self.broker.proxies().applied.advance(through);
        tracing::info!("cluster map installed");
    }

    fn export_transient(&mut self) -> BTreeMap<String, Wiring> {
        self.broker
            .vhosts()
            .into_iter()
            .map(|(name, vhost)| (name, vhost.lock().transient_wiring()))
            .filter(|(_, wiring)| *wiring != Wiring::default())
            .collect()
    }

    fn restore_transient(&mut self, vhosts: BTreeMap<String, Wiring>) {
        let now = now_ms();
        let mut fx = Effects::default();
        for (name, wiring) in vhosts {
            self.broker.add_vhost(&name);
            let Some(vhost) = self.broker.vhost(&name) else {
                continue;
            };
            let mut v = vhost.lock();
            let (queues, exchanges) = (wiring.queues.len(), wiring.exchanges.len());
            for skipped in v.restore_transient_wiring(wiring, now, &mut fx) {
                tracing::info!(vhost = %name, %skipped, "transient cluster wiring not restored");
            }
            self.broker.finish_batch(0, &mut v, &mut fx);
            tracing::info!(vhost = %name, queues, exchanges, "transient cluster wiring restored from the map checkpoint");
        }
    }

    fn reapply_transient(&mut self, vhost: &str, op: &WiringOp) {
        let Some(vhost_ref) = self.broker.vhost(vhost) else {
            return;
        };
        if vhost_ref.lock().has_transient_part(op) {
            // Its outcome was answered by the previous process; only the state matters.
            let _ = self.apply_to_vhost(None, vhost, op);
        }
    }
}

impl BrokerHost {
    /// Applies `op` to `vhost`, and records agreed index `index` as applied there (none: a
    /// replay of an op the saved state already reflects).
    fn apply_to_vhost(&mut self, index: Option<u64>, vhost: &str, op: &WiringOp) -> OpOutcome {
        let Some(vhost_ref) = self.broker.vhost(vhost) else {
            return Err(AmqpError::not_found(format!("no vhost '{vhost}'")));
        };
        let mut v = vhost_ref.lock();
        let mut fx = Effects::default();
        let result = op.apply(&mut v, NO_CONNECTION, now_ms(), &mut fx);
        if let WiringOp::DeclareQueue {
            name,
            exclusive: true,
            ..
        } = op
            && let Some(owner) = v.queue(name).and_then(|q| q.exclusive_owner)
            && owner != NO_CONNECTION
            && !self.broker.has_connection(owner)
        {
            match v.queue(name).and_then(|q| q.session.clone()) {
                // Its session's connection went while the declare was on its way: the
                // session keeps it, and a resume adopts it.
                Some(session) => v.release_session_queues(&session),
                // Its connection closed while the declare was on its way: nobody owns it.
                None => v.retire_exclusive(name, &mut fx),
            }
        }
        // Saved with the wiring, in the same journal job: a restart then never applies this
        // op twice, whatever it did (a purge replayed would drop later messages).
        if let Some(index) = index {
            v.cluster_applied(index);
        }
        let gate = self.broker.finish_batch(0, &mut v, &mut fx);
        result.map(|reply| (reply, gate))
    }
}

impl ClusterHost for BrokerHost {
    fn members_changed(&mut self, hosts: &[String], nodes: &[String]) {
        let now = now_ms();
        let mut fx = Effects::default();
        for (_, vhost) in self.broker.vhosts() {
            let mut v = vhost.lock();
            v.set_live_nodes(nodes);
            v.drop_exclusive_queues_of_departed(&mut fx);
            notice::publish(&mut v, hosts, now, &mut fx);
            self.broker.finish_batch(0, &mut v, &mut fx);
        }
    }

    fn roles_changed(
        &mut self,
        vhost: &str,
        queue: &str,
        roles: Option<&crate::cluster::QueueRoles>,
    ) {
        self.broker.apply_roles(vhost, queue, roles);
    }

    fn started(&mut self, roles: &crate::cluster::Roles) {
        self.broker.drop_stale_replicas(roles);
    }

    fn event_applied(&mut self, index: u64) {
        self.broker.proxies().applied.advance(index);
    }

    fn session_left(&mut self, id: &str) {
        self.broker.session_left(id);
    }

    fn session_ended(&mut self, id: &str) {
        self.broker.session_ended(id);
    }

    fn shutdown(&mut self) {
        self.broker.journal.shutdown();
    }

    fn journal(&self) -> (u64, tokio::sync::watch::Receiver<u64>) {
        (
            self.broker.journal.last_submitted(),
            self.broker.journal.synced(),
        )
    }
}
