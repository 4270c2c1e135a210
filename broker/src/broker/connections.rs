//! What the admin API sees of the running broker: live connections (who, from where, which
//! vhost), this node's addresses and readiness, and the requests to close a connection or a
//! channel that reach a connection through its mailbox.
//!
//! Connections register here on connection.open and leave when their task ends; nothing here
//! is touched per message.

use super::Broker;
use crate::amqp::codes;
use crate::clock::now_ms;
use parking_lot::RwLock;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// An open connection, as listed by `GET /api/connections`.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    /// The broker's id for it (also the `conn` field of its log lines).
    pub id: u64,
    /// RabbitMQ-style name: `PEER -> LOCAL`.
    pub name: String,
    /// Client address.
    pub peer: SocketAddr,
    /// Logged-in user.
    pub user: String,
    /// Open vhost.
    pub vhost: String,
    /// When connection.open succeeded (ms since the epoch).
    pub connected_at_ms: u64,
    /// Another cluster member's link (proxying, replication), not a client: a drain
    /// closes clients only.
    pub link: bool,
}

/// Live connections and this node's state.
#[derive(Debug, Default)]
pub struct Registry {
    conns: RwLock<HashMap<u64, ConnInfo>>,
    /// Where the AMQP listener is bound.
    pub amqp_addr: OnceLock<SocketAddr>,
    /// Where the admin listener is bound.
    pub admin_addr: OnceLock<SocketAddr>,
    /// Both listeners are up.
    pub ready: AtomicBool,
    /// The node was asked to leave (`POST /api/members/{id}/leave`): not ready any more.
    pub leaving: AtomicBool,
}

impl Registry {
    /// Open connections, oldest first.
    pub fn connections(&self) -> Vec<ConnInfo> {
        let mut v: Vec<ConnInfo> = self.conns.read().values().cloned().collect();
        v.sort_by_key(|c| c.id);
        v
    }

    /// The number of open connections.
    pub fn connection_count(&self) -> usize {
        self.conns.read().len()
    }

    /// A connection by id.
    pub fn connection(&self, id: u64) -> Option<ConnInfo> {
        self.conns.read().get(&id).cloned()
    }

    /// Forgets a connection (its task ended).
    pub(super) fn remove(&self, id: u64) {
        self.conns.write().remove(&id);
    }

    /// Whether the node accepts clients: listeners up and not leaving.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed) && !self.leaving.load(Ordering::Relaxed)
    }
}

impl Broker {
    /// A connection finished connection.open: it shows in the admin API from now on.
    /// Records an opened connection, unless it would exceed `max_connections` or
    /// `max_connections_per_user` (checked and recorded under one lock, so concurrent opens
    /// cannot overshoot); the error says which limit.
    pub fn connection_opened(
        &self,
        id: u64,
        peer: SocketAddr,
        user: &str,
        vhost: &str,
        link: bool,
    ) -> Result<(), String> {
        let local = self
            .registry
            .amqp_addr
            .get()
            .copied()
            .unwrap_or(self.config.amqp_listen);
        let mut conns = self.registry.conns.write();
        let c = &self.config;
        if c.max_connections > 0 && conns.len() >= c.max_connections {
            return Err(format!(
                "connection limit ({}) is reached",
                c.max_connections
            ));
        }
        if c.max_connections_per_user > 0
            && conns.values().filter(|x| x.user == user).count() >= c.max_connections_per_user
        {
            return Err(format!(
                "connection limit ({}) for user '{user}' is reached",
                c.max_connections_per_user
            ));
        }
        conns.insert(
            id,
            ConnInfo {
                id,
                name: format!("{peer} -> {local}"),
                peer,
                user: user.to_owned(),
                vhost: vhost.to_owned(),
                connected_at_ms: now_ms(),
                link,
            },
        );
        self.stats.connections_opened.inc();
        Ok(())
    }

    /// Asks connection `id` to close with 320 CONNECTION_FORCED; returns whether it exists.
    /// The connection sends connection.close from its own task (its outbox's `close` slot).
    pub fn force_close(&self, id: u64, reason: &str) -> bool {
        if self.registry.connection(id).is_none() {
            return false;
        }
        let Some(outbox) = self.outboxes.read().get(&id).cloned() else {
            return false;
        };
        tracing::info!(conn = id, reason, "closing connection on request");
        outbox.push(|p| p.close = Some((codes::CONNECTION_FORCED, reason.to_owned())));
        true
    }

    /// Asks connection `id` to close its channel `channel` with 320 CONNECTION_FORCED;
    /// returns false when there is no such connection.
    pub fn force_close_channel(&self, id: u64, channel: u16, reason: &str) -> bool {
        if self.registry.connection(id).is_none() {
            return false;
        }
        let Some(outbox) = self.outboxes.read().get(&id).cloned() else {
            return false;
        };
        tracing::info!(conn = id, channel, reason, "closing channel on request");
        outbox.push(|p| p.close_channels.push((channel, reason.to_owned())));
        true
    }
}
