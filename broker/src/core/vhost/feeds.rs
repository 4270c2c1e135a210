//! Feeds: what foreign exchanges bring into local queues. A local queue bound to a foreign
//! exchange (an exchange declared with `qpid.cluster.proxy: amqp://…`) receives what is
//! published to the other broker's exchange of the same name and matches the binding. The
//! core only says which feeds the wiring asks for; `proxy/feed.rs` runs them (a private
//! queue on the other broker, bound the same way, consumed into the local queue).

use super::VHost;
use crate::amqp::FieldTable;
use crate::core::exchange::Destination;
use std::sync::Arc;

/// One binding of a local queue to a foreign exchange: the other broker's exchange feeds
/// the local queue with what matches `routing_key` and `arguments`.
#[derive(Debug, Clone, PartialEq)]
pub struct Feed {
    /// The exchange's name, here and on the other broker.
    pub exchange: Arc<str>,
    /// The other broker's URI (the exchange's `qpid.cluster.proxy`).
    pub home: Arc<str>,
    /// The local queue fed.
    pub queue: Arc<str>,
    /// Binding key.
    pub routing_key: String,
    /// Binding arguments (a headers exchange's match table).
    pub arguments: FieldTable,
}

/// The feeds a vhost's wiring asks for, split by who runs them.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Feeds {
    /// Feeds of queues whose messages live here (this broker is their primary): this broker
    /// consumes them.
    pub here: Vec<Feed>,
    /// Feeds of queues whose primary is another member: that member consumes them, but the
    /// binding (and so the other broker's private queue) still exists.
    pub elsewhere: Vec<Feed>,
}

impl Feeds {
    /// Whether the wiring still has this binding, whoever runs its feed.
    pub fn contains(&self, feed: &Feed) -> bool {
        self.here.contains(feed) || self.elsewhere.contains(feed)
    }
}

impl VHost {
    /// Every binding of a queue to a foreign exchange. Bindings to foreign queues are
    /// refused when made ([`VHost::queue_bind`]), so every fed queue is a local or a
    /// member's queue.
    pub fn feeds(&self) -> Feeds {
        let mut feeds = Feeds::default();
        for ex in self.exchanges.values() {
            let Some(home) = &ex.home else {
                continue;
            };
            for b in ex.bindings() {
                let Destination::Queue(name) = &b.destination else {
                    continue;
                };
                let Some(q) = self.queues.get(name) else {
                    continue;
                };
                let feed = Feed {
                    exchange: ex.name.clone(),
                    home: home.clone(),
                    queue: q.name.clone(),
                    routing_key: b.routing_key.clone(),
                    arguments: b.arguments.clone(),
                };
                if self.primary_elsewhere(q).is_some() {
                    feeds.elsewhere.push(feed);
                } else {
                    feeds.here.push(feed);
                }
            }
        }
        feeds
    }
}
