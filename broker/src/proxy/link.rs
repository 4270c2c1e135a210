//! Links: the AMQP connections a cluster member opens to the others, per (member, vhost) —
//! AMQP binds a connection to one vhost — shared by every client of this member, opened on
//! demand and opened again after a failure. To a member they speak the broker's own codec:
//! a forwarding link for publishes ([`super::forward_link`]) and an upstream link for
//! everything else ([`super::upstream_link`]). To a foreign broker (a `qpid.cluster.proxy`
//! URI) they are lapin's, a general client any AMQP 0-9-1 broker understands.
//!
//! A link logs in as [`LINK_USER`] with [`link_password`], an HMAC of the cluster secret:
//! the member at the other end recognises it, gives it every permission (the member that
//! opened it checked its own client's), and routes what it publishes only into queues it
//! owns ([`crate::core::VHost::publish_forwarded`]).

use super::upstream_link::UpstreamLink;
use crate::amqp::{AMQPValue, FieldTable, LongString};
use crate::client::{ClientError, Presentation, RawClient, Target};
use hmac::{Hmac, KeyInit, Mac};
use lapin::{Connection, ConnectionProperties};
use parking_lot::Mutex;
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

/// One (member or foreign broker, vhost) link: connected at most once at a time by whoever
/// needs it first.
type Slot<C> = Arc<tokio::sync::Mutex<Option<Arc<C>>>>;

/// The open links of this broker, by (node id or foreign URI, vhost).
#[derive(Default)]
pub struct Links {
    /// The cluster this broker joined: the links' password and how to find a member's AMQP
    /// address by node id (the cluster map's membership).
    cluster: std::sync::OnceLock<(String, Resolve)>,
    /// The lapin links to foreign brokers.
    open: Mutex<HashMap<(String, String), Slot<Connection>>>,
    /// The upstream links to members, on the broker's own codec ([`super::upstream_link`]).
    upstream: Mutex<HashMap<(String, String), Slot<UpstreamLink>>>,
}

/// Whether a queue's home names another AMQP broker (a foreign proxy) rather than a
/// cluster member.
pub use crate::core::is_foreign;

impl std::fmt::Debug for Links {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Links").finish_non_exhaustive()
    }
}

impl Links {
    /// Links to the members of the cluster this broker joined: they log in with `password`
    /// and find members with `resolve`.
    pub fn join(
        &self,
        password: String,
        resolve: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) {
        let _ = self.cluster.set((password, Box::new(resolve)));
    }

    /// Where a lapin link to foreign broker `uri` connects (host:port, for errors and logs).
    /// Cluster members get the broker's own codec ([`Links::upstream_link`],
    /// [`Links::forward_link`]), never lapin.
    fn foreign_addr(uri: &str) -> Result<String, LinkError> {
        if !is_foreign(uri) {
            return Err(LinkError::UnknownMember(uri.into()));
        }
        Ok(uri
            .split('@')
            .next_back()
            .and_then(|rest| rest.split('/').next())
            .unwrap_or(uri)
            .to_owned())
    }

    /// The lapin link to the foreign broker at URI `node` (its vhost is in the URI; `vhost`
    /// keys the slot): the open one, or a new one when there is none or it failed.
    /// Concurrent callers for the same pair wait for one connection attempt.
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
        let addr = Self::foreign_addr(node)?;
        let props = ConnectionProperties::default()
            .with_connection_name(format!("ringmq link to {node}").into())
            .with_client_property(LINK_PROPERTY.into(), "true".into());
        let connection = Connection::connect(node, props)
            .await
            .map_err(|e| LinkError::Failed {
                node: redacted(node),
                addr: addr.clone(),
                reason: e.to_string(),
            })?;
        tracing::info!(node = %redacted(node), %addr, vhost, "link opened");
        let connection = Arc::new(connection);
        *slot = Some(connection.clone());
        Ok(connection)
    }

    /// A new forwarding connection to cluster member `node` for `vhost`
    /// ([`super::forward_link`]).
    pub async fn forward_link(
        &self,
        node: &str,
        vhost: &str,
    ) -> Result<super::forward_link::ForwardLink, LinkError> {
        let (password, resolve) = self
            .cluster
            .get()
            .ok_or_else(|| LinkError::UnknownMember(node.into()))?;
        let addr = resolve(node).ok_or_else(|| LinkError::UnknownMember(node.into()))?;
        super::forward_link::ForwardLink::open(node, &addr, vhost, password).await
    }

    /// The upstream link to cluster member `node` for `vhost` ([`super::upstream_link`]):
    /// the open one, or a new one when there is none or it failed. Concurrent callers for
    /// the same pair wait for one connection attempt.
    pub async fn upstream_link(
        &self,
        node: &str,
        vhost: &str,
    ) -> Result<Arc<UpstreamLink>, LinkError> {
        let slot = self
            .upstream
            .lock()
            .entry((node.to_owned(), vhost.to_owned()))
            .or_default()
            .clone();
        let mut slot = slot.lock().await;
        if let Some(l) = slot.as_ref()
            && l.is_open()
        {
            return Ok(l.clone());
        }
        let (password, resolve) = self
            .cluster
            .get()
            .ok_or_else(|| LinkError::UnknownMember(node.into()))?;
        let addr = resolve(node).ok_or_else(|| LinkError::UnknownMember(node.into()))?;
        let link = Arc::new(UpstreamLink::open(node, &addr, vhost, password).await?);
        *slot = Some(link.clone());
        Ok(link)
    }

    /// The `amqp://` URI of cluster member `node`'s `vhost` as a link logs in there: for
    /// the few lapin links a member opens to another member (a fragmented queue's pulls,
    /// `fragment_pull.rs`), which take a URI like a foreign broker's.
    pub fn member_uri(&self, node: &str, vhost: &str) -> Result<String, LinkError> {
        let (password, resolve) = self
            .cluster
            .get()
            .ok_or_else(|| LinkError::UnknownMember(node.into()))?;
        let addr = resolve(node).ok_or_else(|| LinkError::UnknownMember(node.into()))?;
        let vhost =
            percent_encoding::utf8_percent_encode(vhost, percent_encoding::NON_ALPHANUMERIC);
        Ok(format!("amqp://{LINK_USER}:{password}@{addr}/{vhost}"))
    }

    /// Opens a channel on the lapin link to the foreign broker at URI `node`.
    pub async fn channel(&self, node: &str, vhost: &str) -> Result<lapin::Channel, LinkError> {
        let connection = self.connection(node, vhost).await?;
        connection
            .create_channel()
            .await
            .map_err(|e| LinkError::Failed {
                node: redacted(node),
                addr: Self::foreign_addr(node).unwrap_or_default(),
                reason: e.to_string(),
            })
    }
}

impl Links {
    /// Whether `node` has `queue` in `vhost` (a passive declare on a channel of its own):
    /// `Ok(false)` only for its 404; a link that fails is an error, never "gone".
    pub async fn queue_exists(
        &self,
        node: &str,
        vhost: &str,
        queue: &str,
    ) -> Result<bool, LinkError> {
        let ch = self.channel(node, vhost).await?;
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let found = ch
            .queue_declare(queue.into(), passive, Default::default())
            .await
            .map(drop);
        let _ = ch.close(200, "checked".into()).await;
        self.found(node, found)
    }

    /// Whether `node` has `exchange` in `vhost` (a passive declare on a channel of its
    /// own), with the same answers as [`Links::queue_exists`].
    pub async fn exchange_exists(
        &self,
        node: &str,
        vhost: &str,
        exchange: &str,
    ) -> Result<bool, LinkError> {
        let ch = self.channel(node, vhost).await?;
        let passive = lapin::options::ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let found = ch
            .exchange_declare(
                exchange.into(),
                lapin::ExchangeKind::Direct,
                passive,
                Default::default(),
            )
            .await;
        let _ = ch.close(200, "checked".into()).await;
        self.found(node, found)
    }

    /// A passive declare's outcome: found, 404 (not found), or a failure of the link.
    fn found(&self, node: &str, asked: lapin::Result<()>) -> Result<bool, LinkError> {
        match asked {
            Ok(()) => Ok(true),
            Err(e) if not_found(&e) => Ok(false),
            Err(e) => Err(LinkError::Failed {
                node: redacted(node),
                addr: Self::foreign_addr(node).unwrap_or_default(),
                reason: e.to_string(),
            }),
        }
    }
}

/// Connects to cluster member `addr` on the broker's own codec ([`RawClient`]) and logs in
/// as a link for `vhost`: [`LINK_USER`] with the link `password`, the [`LINK_PROPERTY`]
/// client property, `name` as its connection name, asking for `heartbeat_s`, announcing
/// `consumer_cancel_notify`. Channel 1 is open when it returns.
pub(super) async fn open_raw(
    addr: &str,
    vhost: &str,
    password: &str,
    name: &str,
    heartbeat_s: u16,
) -> Result<RawClient, ClientError> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let target = Target {
        addr: addr.to_owned(),
        user: LINK_USER.to_owned(),
        password: password.to_owned(),
        vhost: vhost.to_owned(),
    };
    let mut properties = FieldTable::default();
    properties.insert(
        "connection_name".into(),
        AMQPValue::LongString(LongString::from(name)),
    );
    properties.insert(
        LINK_PROPERTY.into(),
        AMQPValue::LongString(LongString::from("true")),
    );
    let presentation = Presentation {
        properties,
        heartbeat_s,
        // The member tells an upstream channel when it cancels a consumer (its queue went).
        capabilities: &["consumer_cancel_notify"],
    };
    let response = format!("\0{LINK_USER}\0{password}");
    RawClient::open_presenting(stream, &target, "PLAIN", response.as_bytes(), &presentation).await
}

/// Whether the other broker answered 404 NOT_FOUND.
pub fn not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp)
        if amqp.get_id() == crate::amqp::codes::NOT_FOUND)
}

/// `node` for logs and errors: a foreign URI without its password.
pub fn redacted(node: &str) -> String {
    match (
        is_foreign(node),
        node.split_once("://"),
        node.rsplit_once('@'),
    ) {
        (true, Some((scheme, rest)), Some((_, host))) => {
            let user = rest.split([':', '@']).next().unwrap_or("");
            format!("{scheme}://{user}:***@{host}")
        }
        _ => node.to_owned(),
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

    #[test]
    fn foreign_uris_lose_their_password_in_logs() {
        assert_eq!(
            redacted("amqp://app:s3cret@rabbit:5672/%2f"),
            "amqp://app:***@rabbit:5672/%2f"
        );
        assert_eq!(redacted("node-1"), "node-1");
    }
}
