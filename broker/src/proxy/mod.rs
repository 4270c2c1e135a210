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
//!   client's prefetch, acks passed on only after the client's.

pub mod catch_up;
pub mod forward;
pub mod link;
pub mod stats;
pub mod upstream;
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
        }
    }
}
