//! The broker's side of replication: the batch hand-off to the [`Replicator`], the cluster
//! map's roles carried out on the vhosts (which member's copy serves, which is a replica, a
//! replica promoted after an election), and the [`ReplicationHost`] the replicator uses to
//! take images and commit in-sync changes.

use super::Broker;
use crate::amqp::{AMQPClass, exchange};
use crate::clock::now_ms;
use crate::cluster::QueueRoles;
use crate::core::{DiskBody, Effects, MoveStep, VHost, WiringOp};
use crate::proxy::link::Links;
use crate::proxy::upstream_link::Replied;
use crate::replication::replicator::{ReplicaSet, ReplicationHost, Replicator};
use crate::store::journal::Job;
use futures::future::BoxFuture;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

/// How long a primary that sealed a queue for a planned move waits for the target's
/// acknowledgement of the queue's last ops before it calls the move off (the target's link
/// failed, or it is overloaded): the queue refuses publishes meanwhile.
const MOVE_ACK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

/// The broker as its replicator sees it.
#[derive(Debug)]
struct Host {
    broker: Weak<Broker>,
}

impl ReplicationHost for Host {
    fn with_vhost(&self, vhost: &str, f: &mut dyn FnMut(&mut VHost)) {
        if let Some(v) = self.broker.upgrade().and_then(|b| b.vhost(vhost)) {
            f(&mut v.lock());
        }
    }

    fn commit_sync(
        &self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
        backup: &str,
        in_sync: bool,
    ) -> BoxFuture<'static, Result<(), String>> {
        let (queue, node) = (queue.to_owned(), backup.to_owned());
        let op = if in_sync {
            WiringOp::BackupInSync {
                queue,
                incarnation,
                node,
            }
        } else {
            WiringOp::BackupOutOfSync {
                queue,
                incarnation,
                node,
            }
        };
        let cluster = self.broker.upgrade().and_then(|b| b.cluster().cloned());
        let vhost = vhost.to_owned();
        Box::pin(async move {
            let cluster = cluster.ok_or("this broker is not a cluster member")?;
            match cluster.submit(&vhost, op).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.text),
                Err(_) => Err("the cluster stopped".to_owned()),
            }
        })
    }

    fn names_sessions(&self) -> bool {
        self.broker
            .upgrade()
            .and_then(|b| b.cluster().cloned())
            .is_some_and(|c| c.every_member_holds_for_sessions())
    }

    fn applied_index(&self) -> u64 {
        self.broker
            .upgrade()
            .map_or(0, |b| b.proxies().applied.index())
    }

    fn read_paged(&self, keys: &[DiskBody]) -> Result<Vec<Option<bytes::Bytes>>, String> {
        let broker = self.broker.upgrade().ok_or("the broker stopped")?;
        broker.read_paged_for_image(keys)
    }
}

impl Broker {
    /// The replicator of this member's primaries.
    pub fn replicator(&self) -> &Arc<Replicator> {
        &self.replicator
    }

    /// How many queues' replicas on this member were promoted to primary (`/metrics`).
    pub fn elections_won(&self) -> u64 {
        self.elections_won.load(Ordering::Relaxed)
    }

    /// How often the map moved a queue's primary to another member, as this member applied
    /// it: a connection whose forward to a lost primary failed waits for this to change
    /// (the election) before it closes, so that its client's resend finds the new primary.
    pub fn primaries_moved(&self) -> u64 {
        self.primaries_moved.load(Ordering::Relaxed)
    }

    /// Lets the replicator reach this broker (once it joined a cluster).
    pub(super) fn start_replication(self: &Arc<Self>) {
        let host: Arc<dyn ReplicationHost> = Arc::new(Host {
            broker: Arc::downgrade(self),
        });
        let _ = self.replication_host.set(host);
    }

    /// Hands the batch's ops of replicated queues to their backups; the stamp the batch's
    /// confirms wait for goes into `fx`. Under the vhost lock, in batch order.
    pub(super) fn replicate(&self, vhost: &VHost, fx: &mut Effects) {
        if let Some(host) = self.replication_host.get()
            && let Some(stamp) = self.replicator.replicate(host, vhost.name(), &fx.ops)
        {
            fx.replica_stamp = Some(stamp);
        }
    }

    /// Carries out new roles of `queue` in `vhost`: its primary serves it (a replica here
    /// that the map just made primary is promoted: what the old primary had delivered goes
    /// back to the queue, redelivered), its ops are recorded while it has backups, and the
    /// replicator follows its backups from here when this member is the primary.
    pub fn apply_roles(&self, vhost: &str, queue: &str, roles: Option<&QueueRoles>) {
        let Some(vhost_ref) = self.vhost(vhost) else {
            return;
        };
        let me = self.cluster().map(|c| c.node_id().to_owned());
        let mut v = vhost_ref.lock();
        let mut fx = Effects::default();
        let Some(q) = v.queue(queue) else {
            // Deleted: nothing of it is replicated from here any more.
            if let Some(host) = self.replication_host.get() {
                self.replicator.set_roles(host, &v, queue, None);
            }
            return;
        };
        let was_primary = q.home.as_deref() == me.as_deref();
        let serving = roles.filter(|r| !r.unavailable);
        if let Some(roles) = serving
            && q.home.as_deref() != Some(roles.primary.as_str())
        {
            v.set_queue_home(queue, &roles.primary);
            self.primaries_moved.fetch_add(1, Ordering::Relaxed);
        }
        let primary_here = serving.is_some_and(|r| Some(r.primary.as_str()) == me.as_deref());
        let replicated = serving.is_some_and(|r| !r.backups.is_empty());
        v.set_replicated(queue, primary_here && replicated);
        let set = serving
            .filter(|_| primary_here && replicated)
            .map(|r| ReplicaSet {
                incarnation: r.incarnation,
                backups: r.backups.clone(),
                in_sync: r.in_sync.clone(),
            });
        if let Some(host) = self.replication_host.get() {
            self.replicator.set_roles(host, &v, queue, set);
        }
        // The switch of a planned move took the queue away: its consumers here end.
        if was_primary && serving.is_some() && !primary_here {
            let ended = v.hand_over(queue, &mut fx);
            tracing::info!(
                vhost,
                queue,
                consumers_cancelled = ended,
                "the queue's primary moved to another member"
            );
        }
        // A planned move whose target is in sync: no more ops here until it has them all.
        let live = self.cluster().is_some_and(|c| c.is_live());
        let moving = serving.filter(|_| live).and_then(|r| {
            let to = r.moving_to.as_ref().filter(|to| r.in_sync.contains(to))?;
            Some((to.clone(), r.incarnation))
        });
        if !primary_here {
            // Its primary takes nothing until the switch: publishes here wait for it.
            v.mark_moving(queue, moving.is_some());
        } else if let Some((to, incarnation)) = moving {
            if v.seal(queue, true, now_ms(), &mut fx) {
                let stamp = self.replicator.issued();
                self.switch_when_acked(vhost, queue, incarnation, to, stamp);
            }
        } else if primary_here {
            v.seal(queue, false, now_ms(), &mut fx);
        }
        // After the images (which reflect the replica as it was) and before the batch is
        // replicated: the requeues are ops every backup applies after what it holds.
        if primary_here && !was_primary {
            match v.promote_replica(queue, now_ms(), &mut fx) {
                Ok(requeued) => {
                    // What this member wrote as the backup is synced within
                    // `replica_sync_ms`; as the primary its copy is the one that counts.
                    self.journal.submit(Job::Sync);
                    self.elections_won.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(
                        vhost,
                        queue,
                        requeued,
                        "this member is the queue's primary now: its replica serves"
                    );
                }
                Err(e) => tracing::warn!(vhost, queue, error = %e, "promotion"),
            }
        }
        // Neither primary nor backup (B4): the copy serves nobody and no confirm counts on
        // it. Only once this incarnation is live — see `ClusterHost::started`.
        if serving.is_some_and(|r| me.as_deref().is_some_and(|me| !r.holds_copy(me)))
            && self.cluster().is_some_and(|c| c.is_live())
        {
            let dropped = v.drop_replica(queue, &mut fx);
            if dropped > 0 {
                tracing::info!(
                    vhost,
                    queue,
                    dropped,
                    "this member is no longer a backup of the queue: its copy is dropped"
                );
            }
        }
        self.finish_batch(0, &mut v, &mut fx);
    }

    /// The second half of a planned move of `queue`'s primary to `to`, once this member
    /// sealed the queue: when every in-sync backup acknowledged the batches up to `stamp`
    /// (the queue's last ops among them), `to` holds every op there is, and once `to`
    /// answers a round trip on its link (it still serves) the switch is committed; if
    /// either takes longer than [`MOVE_ACK_PATIENCE`], the move is called off and the
    /// queue served here again.
    fn switch_when_acked(
        &self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
        to: String,
        stamp: u64,
    ) {
        let Some(cluster) = self.cluster().cloned() else {
            return;
        };
        let mut acked = self.replicator.acked();
        let links = self.proxies().links.clone();
        let (vhost, queue) = (vhost.to_owned(), queue.to_owned());
        tokio::spawn(async move {
            let caught_up = matches!(
                tokio::time::timeout(MOVE_ACK_PATIENCE, acked.wait_for(|&a| a >= stamp)).await,
                Ok(Ok(_))
            );
            // An idle queue's target acknowledged everything long ago: a round trip on its
            // link shows it still serves, so a primary never moves to a member that stopped
            // (it would only be elected away again, to a backup that may not be in sync).
            let answers = caught_up
                && matches!(
                    tokio::time::timeout(MOVE_ACK_PATIENCE, answers(&links, &to, &vhost)).await,
                    Ok(true)
                );
            let step = if answers {
                MoveStep::Switch
            } else if caught_up {
                tracing::warn!(%vhost, %queue, %to, "the move's target did not answer on its link in time: the move is called off");
                MoveStep::Cancel
            } else {
                tracing::warn!(%vhost, %queue, %to, "the move's target did not acknowledge the queue's last ops in time: the move is called off");
                MoveStep::Cancel
            };
            let op = WiringOp::MovePrimary {
                queue: queue.clone(),
                incarnation,
                to: to.clone(),
                step,
            };
            match cluster.submit(&vhost, op).await {
                Ok(Ok(_)) => {
                    tracing::info!(%vhost, %queue, %to, ?step, "planned primary move committed")
                }
                Ok(Err(e)) => {
                    tracing::warn!(%vhost, %queue, %to, ?step, error = %e, "planned primary move refused")
                }
                Err(_) => {
                    tracing::warn!(%vhost, %queue, %to, ?step, "planned primary move: the cluster stopped")
                }
            }
        });
    }

    /// The roles this member's incarnation started with (see `ClusterHost::started`): the
    /// copies it holds of queues it is neither primary nor backup of go.
    pub fn drop_stale_replicas(&self, roles: &crate::cluster::Roles) {
        let Some(me) = self.cluster().map(|c| c.node_id().to_owned()) else {
            return;
        };
        for (vhost, queue, r) in roles.iter() {
            // A move under way goes on from here too.
            if !r.holds_copy(&me) || r.moving_to.is_some() {
                self.apply_roles(vhost, queue, Some(r));
            }
        }
    }
}

/// Whether cluster member `node` answers a round trip on its upstream link for `vhost`:
/// the catch-up declare of the proxies (a passive default-exchange declare) for index 0,
/// which every member has applied, so the member answers it at once, itself.
async fn answers(links: &Links, node: &str, vhost: &str) -> bool {
    let Ok(link) = links.upstream_link(node, vhost).await else {
        return false;
    };
    let Ok(ch) = link.open_channel().await else {
        return false;
    };
    let answered = matches!(
        ch.call(crate::proxy::catch_up::declare(0)).await,
        Ok(Replied::Method(AMQPClass::Exchange(
            exchange::AMQPMethod::DeclareOk(_)
        )))
    );
    ch.close();
    answered
}
