//! The feeds reconciler: runs a [`feed`](super::feed) for every binding of a queue whose
//! primary is this broker to a foreign exchange, as the wiring says — whether it changed
//! through a client, the admin API, a cluster op or a restart. Every
//! [`RECONCILE_EVERY`], and at once when a connection changed wiring
//! ([`super::Proxies::feeds_changed`]), it compares the wiring's feeds with the running ones:
//! new bindings start a feed, feeds of bindings that went stop and delete their private
//! queue, feeds of queues whose primary moved to another member stop and leave it to that
//! member.

use super::feed::{self, Stop};
use crate::broker::Broker;
use crate::core::Feed;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::watch;

/// How often the wiring is compared with the running feeds when nothing pokes the
/// reconciler (changes committed by other members, failovers).
pub const RECONCILE_EVERY: Duration = Duration::from_millis(500);

/// How long stopping one feed may take before the reconciler goes on without it.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// A feed by vhost and private queue name.
type Key = (String, String);

/// A running feed: how to stop it, and its task.
struct Running {
    stop: watch::Sender<Stop>,
    task: tokio::task::JoinHandle<()>,
}

/// Keeps the running feeds equal to the wiring's, for as long as the broker lives.
pub async fn run_feeds(broker: Weak<Broker>) {
    // A cluster member's identity (and so its private queues' names) is the cluster's only
    // once it joined: wait until it serves.
    match broker.upgrade() {
        Some(b) => b.serving().await,
        None => return,
    }
    let mut running: HashMap<Key, Running> = HashMap::new();
    loop {
        let Some(b) = broker.upgrade() else {
            return;
        };
        let changed = b.proxies().feeds_changed.clone();
        let poked = changed.notified();
        reconcile(&b, &broker, &mut running).await;
        drop(b);
        tokio::select! {
            _ = poked => {}
            _ = tokio::time::sleep(RECONCILE_EVERY) => {}
        }
    }
}

/// One comparison of the wiring with the running feeds.
async fn reconcile(b: &Arc<Broker>, weak: &Weak<Broker>, running: &mut HashMap<Key, Running>) {
    let identity = b.feed_identity();
    let mut wanted: HashMap<Key, Feed> = HashMap::new();
    let mut bound: HashSet<Key> = HashSet::new();
    for (vhost, v) in b.vhosts() {
        let feeds = v.lock().feeds();
        for (here, f) in feeds
            .here
            .into_iter()
            .map(|f| (true, f))
            .chain(feeds.elsewhere.into_iter().map(|f| (false, f)))
        {
            let key = (vhost.clone(), feed::remote_queue(&identity, &vhost, &f));
            bound.insert(key.clone());
            if here {
                wanted.insert(key, f);
            }
        }
    }
    let ended: Vec<Key> = running
        .keys()
        .filter(|k| !wanted.contains_key(*k))
        .cloned()
        .collect();
    for key in ended {
        let Some(r) = running.remove(&key) else {
            continue;
        };
        let how = if bound.contains(&key) {
            Stop::Detach
        } else {
            Stop::Delete
        };
        let _ = r.stop.send(how);
        let _ = tokio::time::timeout(STOP_TIMEOUT, r.task).await;
    }
    running.retain(|_, r| !r.task.is_finished());
    for (key, f) in wanted {
        if running.contains_key(&key) {
            continue;
        }
        let (stop, stopped) = watch::channel(Stop::Run);
        let task = tokio::spawn(feed::run(
            weak.clone(),
            key.0.clone(),
            f,
            key.1.clone(),
            stopped,
        ));
        running.insert(key, Running { stop, task });
    }
}
