//! Links: the AMQP connections a cluster member opens to the others, one per (member,
//! vhost) — AMQP binds a connection to one vhost — shared by every client of this member,
//! opened on demand and opened again after a failure.
//!
//! A link logs in as [`LINK_USER`] with [`link_password`], an HMAC of the cluster secret:
//! the member at the other end recognises it, gives it every permission (the member that
//! opened it checked its own client's), and routes what it publishes only into queues it
//! owns ([`crate::core::VHost::publish_forwarded`]).

use hmac::{Hmac, KeyInit, Mac};
use lapin::{Connection, ConnectionProperties};
use parking_lot::Mutex;
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use sha2::Sha256;
use std::collections::HashMap;
use std::sync::Arc;
use thiserror::Error;

/// The user name links log in with. Reserved: a configured user of that name cannot log in
/// with its own password while the broker is a cluster member.
pub const LINK_USER: &str = "ringmq-cluster-link";

/// The client property that marks a link connection (for logs and the admin API).
pub const LINK_PROPERTY: &str = "ringmq.cluster.link";

/// The password of [`LINK_USER`]: HMAC-SHA256 of a fixed label under the cluster secret, in
/// hex. Every member derives the same one; the secret itself never crosses the wire.
pub fn link_password(secret: &[u8]) -> String {
    let mut mac =
        <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC accepts any key length");
    mac.update(b"ringmq amqp link v1");
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Why a link could not be used.
#[derive(Debug, Clone, Error)]
pub enum LinkError {
    /// The member is not (or no longer) in the cluster, or announced no AMQP address.
    #[error("cluster member '{0}' is not in the cluster")]
    UnknownMember(String),
    /// Connecting or talking to it failed.
    #[error("link to cluster member '{node}' ({addr}): {reason}")]
    Failed {
        /// Node id.
        node: String,
        /// Its AMQP address.
        addr: String,
        /// What went wrong.
        reason: String,
    },
}

/// Finds a member's AMQP address by node id.
type Resolve = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// One (member, vhost) link: connected at most once at a time by whoever needs it first.
type Slot = Arc<tokio::sync::Mutex<Option<Arc<Connection>>>>;

/// The open links of this member, by (node id, vhost).
pub struct Links {
    password: String,
    /// Finds a member's AMQP address by node id (the cluster map's membership).
    resolve: Resolve,
    open: Mutex<HashMap<(String, String), Slot>>,
}

impl std::fmt::Debug for Links {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Links").finish_non_exhaustive()
    }
}

impl Links {
    /// Links that log in with `password` and find members with `resolve`.
    pub fn new(
        password: String,
        resolve: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        Self {
            password,
            resolve: Box::new(resolve),
            open: Mutex::new(HashMap::new()),
        }
    }

    /// The link to `node` for `vhost`: the open one, or a new one when there is none or it
    /// failed. Concurrent callers for the same pair wait for one connection attempt.
    pub async fn connection(&self, node: &str, vhost: &str) -> Result<Arc<Connection>, LinkError> {
        let slot = self
            .open
            .lock()
            .entry((node.to_owned(), vhost.to_owned()))
            .or_default()
            .clone();
        let mut slot = slot.lock().await;
        if let Some(c) = slot.as_ref()
            && c.status().connected()
        {
            return Ok(c.clone());
        }
        let addr = (self.resolve)(node).ok_or_else(|| LinkError::UnknownMember(node.into()))?;
        let uri = format!(
            "amqp://{LINK_USER}:{}@{addr}/{}?heartbeat=10",
            self.password,
            utf8_percent_encode(vhost, NON_ALPHANUMERIC)
        );
        let props = ConnectionProperties::default()
            .with_connection_name(format!("ringmq link to {node}").into())
            .with_client_property(LINK_PROPERTY.into(), "true".into());
        let connection = Connection::connect(&uri, props)
            .await
            .map_err(|e| LinkError::Failed {
                node: node.into(),
                addr: addr.clone(),
                reason: e.to_string(),
            })?;
        tracing::info!(node, %addr, vhost, "link opened");
        let connection = Arc::new(connection);
        *slot = Some(connection.clone());
        Ok(connection)
    }

    /// Opens a channel on the link to `node` for `vhost`.
    pub async fn channel(&self, node: &str, vhost: &str) -> Result<lapin::Channel, LinkError> {
        let connection = self.connection(node, vhost).await?;
        connection
            .create_channel()
            .await
            .map_err(|e| LinkError::Failed {
                node: node.into(),
                addr: (self.resolve)(node).unwrap_or_default(),
                reason: e.to_string(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_link_password_depends_on_the_secret_only() {
        assert_eq!(link_password(b"s"), link_password(b"s"));
        assert_ne!(link_password(b"s"), link_password(b"t"));
        assert_eq!(link_password(b"s").len(), 64);
    }
}
