//! Foreign proxies check now and then that what they stand for still exists on the other
//! broker (a passive declare): a proxy queue whose queue is gone, or a proxy exchange whose
//! exchange is gone (404), is deleted — through the cluster on a cluster member, so it
//! leaves every member. A deleted queue's consumers are cancelled; a deleted exchange's
//! feeds stop and their private queues go ([`super::feed`]).

use crate::broker::Broker;
use crate::clock::now_ms;
use crate::core::{Effects, WiringOp, is_foreign};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often each foreign proxy is checked.
pub const CHECK_EVERY: Duration = Duration::from_secs(10);

/// What a foreign proxy stands for on the other broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A queue of the same name.
    Queue,
    /// An exchange of the same name.
    Exchange,
}

/// Checks every foreign proxy of every vhost each [`CHECK_EVERY`], for as long as the broker
/// lives.
pub async fn watch_foreign(broker: Weak<Broker>) {
    loop {
        tokio::time::sleep(CHECK_EVERY).await;
        let Some(broker) = broker.upgrade() else {
            return;
        };
        for (vhost, v) in broker.vhosts() {
            let foreign: Vec<(Kind, String, String)> = {
                let v = v.lock();
                let queues = v.queues().filter_map(|q| {
                    let home = q.home.as_deref().filter(|h| is_foreign(h))?;
                    Some((Kind::Queue, q.name.to_string(), home.to_owned()))
                });
                let exchanges = v.exchanges().filter_map(|e| {
                    let home = e.home.as_deref()?;
                    Some((Kind::Exchange, e.name.to_string(), home.to_owned()))
                });
                queues.chain(exchanges).collect()
            };
            for (kind, name, uri) in foreign {
                let links = &broker.proxies().links;
                let exists = match kind {
                    Kind::Queue => links.queue_exists(&uri, &vhost, &name).await,
                    Kind::Exchange => links.exchange_exists(&uri, &vhost, &name).await,
                };
                if matches!(exists, Ok(false)) {
                    remove(&broker, &vhost, kind, &name, &uri).await;
                }
            }
        }
    }
}

/// Deletes the proxy of a queue or exchange the other broker no longer has (the watcher
/// found it gone, or a feed's binding there was refused with 404).
pub async fn remove(broker: &Arc<Broker>, vhost: &str, kind: Kind, name: &str, uri: &str) {
    let uri = super::link::redacted(uri);
    let op = match kind {
        Kind::Queue => {
            tracing::warn!(vhost, queue = name, broker = %uri, "the proxied queue is gone from the other broker: deleting the proxy");
            WiringOp::DeleteQueue {
                name: name.to_owned(),
                if_unused: false,
                if_empty: false,
            }
        }
        Kind::Exchange => {
            tracing::warn!(vhost, exchange = name, broker = %uri, "the proxied exchange is gone from the other broker: deleting the proxy");
            WiringOp::DeleteExchange {
                name: name.to_owned(),
                if_unused: false,
            }
        }
    };
    if let Some(cluster) = broker.cluster() {
        let _ = cluster.submit(vhost, op).await;
        return;
    }
    let Some(v) = broker.vhost(vhost) else {
        return;
    };
    let mut v = v.lock();
    let mut fx = Effects::default();
    let _ = op.apply(&mut v, crate::core::NO_CONNECTION, now_ms(), &mut fx);
    broker.finish_batch(0, &mut v, &mut fx);
}
