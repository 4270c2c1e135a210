//! Proxies: how a cluster member serves a queue whose messages live on another member (its
//! primary). DESIGN §3–§4, `docs/proxies.md`.
//!
//! Members talk to each other over ordinary AMQP 0-9-1 on connections marked as links
//! ([`link`]): one connection per (member, vhost) pair, opened on demand, channels
//! multiplexed, authenticated with a password derived from the cluster secret. Over them:
//!
//! * [`forward`]: a publish routed here to queues owned elsewhere is handed to each owner
//!   once, on a confirm-mode channel; the publisher's confirm waits for every owner's.
//! * [`upstream`]: a client channel that consumes, gets, purges or asks about a proxied
//!   queue gets one upstream channel per primary, in its name: consumers there with the
//!   client's prefetch, acks passed on only after the client's. To a member it is a channel
//!   of the member's [`upstream_link`] (the broker's own codec), to a foreign broker lapin's
//!   ([`upstream_foreign`]).
//!
//! Foreign proxies use the same links to another AMQP broker: a queue's publishes and
//! consumers as above, an exchange's publishes as forwards, and what the other broker's
//! exchange routes to a local queue's binding comes in through a [`feed`] ([`feeds`] keeps
//! them in step with the wiring; [`watch`] removes proxies whose target is gone).

pub mod catch_up;
pub mod feed;
pub mod feeds;
pub mod forward;
pub mod forward_link;
pub mod fragment_pull;
pub mod link;
pub mod stats;
pub mod upstream;
pub mod upstream_foreign;
pub mod upstream_link;
pub mod watch;

use forward::Forwarders;
use link::Links;
use std::sync::Arc;

/// This member's links and forwarders, made once it joined its cluster.
#[derive(Debug)]
pub struct Proxies {
    /// The links to the other members.
    pub links: Arc<Links>,
    /// The forwarding channels over them.
    pub forwarders: Forwarders,
    /// The newest cluster change applied here, which link channels tell the other end.
    pub applied: Arc<catch_up::Applied>,
    /// Poked when a connection changed wiring, so that feeds of foreign exchanges start or
    /// stop at once rather than at the next [`feeds::RECONCILE_EVERY`].
    pub feeds_changed: Arc<tokio::sync::Notify>,
}

impl Default for Proxies {
    /// Proxies with no cluster yet: links to foreign brokers only, until
    /// [`Links::join`].
    fn default() -> Self {
        let links = Arc::new(Links::default());
        Self {
            forwarders: Forwarders::new(links.clone()),
            links,
            applied: Arc::default(),
            feeds_changed: Arc::default(),
        }
    }
}
