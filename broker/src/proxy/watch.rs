//! Foreign proxies check now and then that their queue still exists on the other broker
//! (a passive declare); a proxy whose queue is gone (404) is deleted — through the cluster on
//! a cluster member, so it leaves every member — and its consumers are cancelled.

use crate::broker::Broker;
use crate::clock::now_ms;
use crate::core::{Effects, WiringOp, is_foreign};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often each foreign proxy is checked.
pub const CHECK_EVERY: Duration = Duration::from_secs(10);

/// Checks every foreign proxy of every vhost each [`CHECK_EVERY`], for as long as the broker
/// lives.
pub async fn watch_foreign(broker: Weak<Broker>) {
    loop {
        tokio::time::sleep(CHECK_EVERY).await;
        let Some(broker) = broker.upgrade() else {
            return;
        };
        for (vhost, v) in broker.vhosts() {
            let foreign: Vec<(String, String)> = v
                .lock()
                .queues()
                .filter_map(|q| {
                    let home = q.home.as_deref().filter(|h| is_foreign(h))?;
                    Some((q.name.to_string(), home.to_owned()))
                })
                .collect();
            for (queue, uri) in foreign {
                let exists = broker
                    .proxies()
                    .links
                    .queue_exists(&uri, &vhost, &queue)
                    .await;
                if matches!(exists, Ok(false)) {
                    remove(&broker, &vhost, &queue, &uri).await;
                }
            }
        }
    }
}

/// Deletes the proxy of a queue the other broker no longer has.
async fn remove(broker: &Arc<Broker>, vhost: &str, queue: &str, uri: &str) {
    tracing::warn!(vhost, queue, broker = %super::link::redacted(uri), "the proxied queue is gone from the other broker: deleting the proxy");
    let op = WiringOp::DeleteQueue {
        name: queue.to_owned(),
        if_unused: false,
        if_empty: false,
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
