//! A 404 on a cluster member is answered only once the member has caught up with the
//! cluster. A client that member A answered declare-ok may at once tell another client, on
//! member B, to consume from the queue; B applies the same committed declare a moment
//! later, and answering 404 meanwhile is an answer one broker never gives (CI saw it:
//! `on_cluster::basic::delivery_tags_rise_…` consumed on B 0.5 ms after A's declare-ok).
//! So a method naming a queue or exchange this member does not know waits for a read index
//! ([`crate::cluster::Cluster::catch_up`]) and is carried out again; its second 404 stands.
//! One round trip to the leader, on a path that ends in an error anyway.

use super::Connection;
use super::proxied::Answer;
use crate::amqp::{AMQPClass, basic, exchange, queue};

impl Connection {
    /// A copy of `method` to carry out again after catching up, should it fail with 404:
    /// for a client's method that names a queue or an exchange, on a cluster member.
    /// Publishes are not copied (they are the hot path, and a publish's unknown exchange
    /// is found once its content is in).
    pub(super) fn retry_if_not_found(&self, method: &AMQPClass) -> Option<AMQPClass> {
        if self.link || self.broker.cluster().is_none() {
            return None;
        }
        let names_wiring = match method {
            AMQPClass::Queue(m) => !matches!(m, queue::AMQPMethod::Delete(_)),
            AMQPClass::Exchange(m) => !matches!(m, exchange::AMQPMethod::Delete(_)),
            AMQPClass::Basic(m) => {
                matches!(m, basic::AMQPMethod::Consume(_) | basic::AMQPMethod::Get(_))
            }
            _ => false,
        };
        names_wiring.then(|| method.clone())
    }

    /// Reads nothing more until this member has caught up with the cluster, then carries
    /// `method` out again on channel `id` (a copy [`Connection::retry_if_not_found`] made, so
    /// on a cluster member).
    pub(super) fn catch_up_then_retry(&mut self, id: u16, method: AMQPClass) {
        let Some(cluster) = self.broker.cluster().cloned() else {
            return;
        };
        let ids = (method.get_amqp_class_id(), method.get_amqp_method_id());
        self.wait_remote(id, ids, async move {
            if !cluster.catch_up().await {
                tracing::debug!("could not confirm this member caught up before a 404");
            }
            Answer::Retry { method }
        });
    }
}
