//! A member's side of fragmented queues ([`crate::core::fragments`], `docs/proxies.md`):
//!
//! * **Its fragment.** Every active (present, not draining) member has one fragment of every
//!   fragmented queue. The declare that makes the queue makes the fragments of the members
//!   active then ([`ensure_all`]); a member that joins later, or is undrained, makes its
//!   own ([`spawn`]); fragments whose queue is gone are deleted.
//! * **Pulls.** When a fragment served here (this member's own, or another member's after a
//!   failover or a move) has consumers and no ready message, this member pulls into it from
//!   the other queues holding the queue's messages; the fragments of members that are gone
//!   or draining, and the queue's own record, an active member pulls into its own fragment
//!   always, so they empty into the active members' fragments
//!   ([`crate::proxy::fragment_pull`]). A draining member pulls nothing in.
//! * **The whole queue.** Declare-ok's counts, purge and delete of a fragmented queue cover
//!   every queue holding its messages, wherever their primaries are ([`totals`], [`purge`],
//!   [`delete`]).

use super::Broker;
use crate::amqp::{AMQPClass, codes, queue};
use crate::cluster::Cluster;
use crate::core::fragments::{fragment_arguments, fragment_name};
use crate::core::{AmqpError, Effects, NO_CONNECTION, WiringOp};
use crate::proxy::fragment_pull::{self, CREDIT, Pull};
use crate::proxy::upstream_link::Replied;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How often a member looks at its fragments and pulls.
const RECONCILE_EVERY: Duration = Duration::from_millis(100);

/// How long a member waits for the commit of its own fragment's declare (or of a left-over
/// fragment's delete) before it asks again.
const DECLARE_RETRY: Duration = Duration::from_secs(5);

/// A running pull: how to stop it, and its task.
struct Running {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

/// Keeps this member's fragments and pulls in step with the wiring and the ring, for as
/// long as the broker lives.
pub fn spawn(broker: &Arc<Broker>, cluster: Arc<Cluster>) {
    let broker = Arc::downgrade(broker);
    tokio::spawn(run(broker, cluster));
}

async fn run(broker: Weak<Broker>, cluster: Arc<Cluster>) {
    match broker.upgrade() {
        Some(b) => b.serving().await,
        None => return,
    }
    let mut pulls: HashMap<Pull, Running> = HashMap::new();
    let mut declared: HashMap<(String, String), Instant> = HashMap::new();
    loop {
        tokio::time::sleep(RECONCILE_EVERY).await;
        let Some(b) = broker.upgrade() else {
            return;
        };
        let active = active_members(&cluster);
        let me = cluster.node_id().to_owned();
        let mut wanted: Vec<Pull> = Vec::new();
        for (vhost, v) in b.vhosts() {
            let v = v.lock();
            for orphan in v.orphan_fragments() {
                let key = (vhost.clone(), orphan.to_string());
                if v.remote_primary(&orphan).is_none()
                    && declared
                        .get(&key)
                        .is_none_or(|at| at.elapsed() > DECLARE_RETRY)
                {
                    declared.insert(key, Instant::now());
                    let op = WiringOp::DeleteQueue {
                        name: orphan.to_string(),
                        if_unused: false,
                        if_empty: false,
                    };
                    drop(cluster.submit(&vhost, op));
                    tracing::info!(vhost, fragment = %orphan, "deleting a fragment whose queue is gone");
                }
            }
            for queue in v.fragmented_queues() {
                let own = fragment_name(&me, &queue);
                if active.contains(&me) && v.queue(&own).is_none() {
                    let key = (vhost.clone(), own.clone());
                    if declared
                        .get(&key)
                        .is_none_or(|at| at.elapsed() > DECLARE_RETRY)
                        && let Some(op) = fragment_op(&v, &queue, &me)
                    {
                        declared.insert(key, Instant::now());
                        drop(cluster.submit(&vhost, op));
                        tracing::info!(vhost, queue = %queue, fragment = own, "declaring this member's fragment");
                    }
                }
                if !active.contains(&me) {
                    // A draining member takes nothing in: what it holds goes to the others.
                    continue;
                }
                let parts = v.fragments(&queue);
                let orphan = |member: &Option<Arc<str>>| {
                    member
                        .as_ref()
                        .is_none_or(|m| !active.iter().any(|a| **a == **m))
                };
                // Every fragment served here — this member's own, or another's after a
                // failover or a move — pulls for its consumers when it runs dry; this
                // member's own also empties the fragments of members gone or draining.
                for (member, into) in parts.iter().filter(|(m, _)| m.is_some()) {
                    let Some(fragment) = v.queue(into).filter(|_| v.remote_primary(into).is_none())
                    else {
                        continue;
                    };
                    let pulling = pulls
                        .iter()
                        .any(|(p, r)| p.vhost == vhost && *p.into == **into && !*r.stop.borrow());
                    let ready = fragment.ready_count();
                    let hungry = fragment.consumer_count() > 0
                        && (ready == 0 || (pulling && ready < usize::from(CREDIT)));
                    let mine = member.as_deref() == Some(me.as_str());
                    for (source_member, source) in &parts {
                        if source == into || !(hungry || (mine && orphan(source_member))) {
                            continue;
                        }
                        let primary = v
                            .remote_primary(source)
                            .unwrap_or_else(|| me.as_str().into());
                        wanted.push(Pull {
                            vhost: vhost.clone(),
                            source: source.to_string(),
                            primary: primary.to_string(),
                            into: into.to_string(),
                        });
                    }
                }
            }
        }
        declared.retain(|_, at| at.elapsed() <= DECLARE_RETRY);
        // Nothing is pulled from a source whose primary is moving (a drain, a rebalance):
        // its pull stops and acks what it took to the primary that delivered it, before the
        // switch, so the new primary does not deliver those again.
        wanted.retain(|p| {
            (cluster.queue_roles(&p.vhost, &p.source)).is_none_or(|r| r.moving_to.is_none())
        });
        // A stopped pull stays listed until it has put away what it had taken.
        pulls.retain(|pull, running| {
            if !wanted.contains(pull) {
                let _ = running.stop.send(true);
            }
            !running.task.is_finished()
        });
        for pull in wanted {
            // One pull at a time from a source into a fragment: two would put its
            // messages away side by side, out of their order.
            let busy = pulls
                .keys()
                .any(|p| (&p.vhost, &p.source, &p.into) == (&pull.vhost, &pull.source, &pull.into));
            if busy {
                continue;
            }
            let (stop, stopped) = watch::channel(false);
            let task = tokio::spawn(fragment_pull::run(broker.clone(), pull.clone(), stopped));
            pulls.insert(pull, Running { stop, task });
        }
    }
}

/// The members that hold a fragment: present and not draining, in ring order.
fn active_members(cluster: &Cluster) -> Vec<String> {
    let mut ring = cluster.ring();
    ring.retain(|m| !cluster.is_draining(m));
    ring
}

/// The declare of `member`'s fragment of fragmented queue `queue`, as the queue is now.
fn fragment_op(v: &crate::core::VHost, queue: &str, member: &str) -> Option<WiringOp> {
    let q = v.queue(queue).filter(|q| q.args.fragmented)?;
    Some(WiringOp::DeclareQueue {
        name: fragment_name(member, queue),
        durable: q.durable,
        exclusive: false,
        auto_delete: false,
        arguments: fragment_arguments(&q.arguments, queue, member),
        home: Some(member.to_owned()),
        server_named: false,
    })
}

/// Commits `op` through the cluster and waits for it to be applied here.
async fn commit(cluster: &Arc<Cluster>, vhost: &str, op: WiringOp) -> Result<(), AmqpError> {
    match cluster.submit(vhost, op).await {
        Ok(outcome) => outcome.map(drop),
        Err(_) => Err(AmqpError::new(
            codes::INTERNAL_ERROR,
            "the cluster layer stopped before the change was committed",
        )),
    }
}

/// Makes the fragment of every active member that has none, and waits for the commits:
/// what a client's declare of a fragmented queue does before its declare-ok.
pub async fn ensure_all(broker: &Broker, vhost: &str, queue: &str) -> Result<(), AmqpError> {
    let Some(cluster) = broker.cluster().cloned() else {
        return Ok(());
    };
    let ops: Vec<WiringOp> = {
        let Some(v) = broker.vhost(vhost) else {
            return Ok(());
        };
        let v = v.lock();
        active_members(&cluster)
            .iter()
            .filter(|m| v.queue(&fragment_name(m, queue)).is_none())
            .filter_map(|m| fragment_op(&v, queue, m))
            .collect()
    };
    let commits: Vec<_> = ops
        .into_iter()
        .map(|op| commit(&cluster, vhost, op))
        .collect();
    for result in futures::future::join_all(commits).await {
        result?;
    }
    Ok(())
}

/// The numbers of a whole fragmented queue: the sums over every queue holding its
/// messages. A part whose primary could not be asked counts nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Ready messages.
    pub ready: u32,
    /// Delivered, not yet acknowledged.
    pub unacked: u32,
    /// Consumers (each member's consumers are on its own fragment).
    pub consumers: u32,
}

/// The queues holding fragmented queue `queue`'s messages, by primary (`None`: here).
fn parts_by_primary(
    broker: &Broker,
    vhost: &str,
    queue: &str,
) -> Result<HashMap<Option<String>, Vec<String>>, AmqpError> {
    let v = broker
        .vhost(vhost)
        .ok_or_else(|| AmqpError::not_found(format!("no vhost '{vhost}'")))?;
    let v = v.lock();
    if v.queue(queue).is_none() {
        return Err(AmqpError::not_found(format!(
            "no queue '{queue}' in vhost '{vhost}'"
        )));
    }
    let mut by_primary: HashMap<Option<String>, Vec<String>> = HashMap::new();
    for (_, name) in v.fragments(queue) {
        let primary = v.remote_primary(&name).map(|p| p.to_string());
        by_primary
            .entry(primary)
            .or_default()
            .push(name.to_string());
    }
    Ok(by_primary)
}

/// The numbers of fragmented queue `queue`, summed over its parts.
pub async fn totals(broker: &Broker, vhost: &str, queue: &str) -> Result<Totals, AmqpError> {
    let mut totals = Totals::default();
    for (primary, names) in parts_by_primary(broker, vhost, queue)? {
        match primary {
            None => {
                let Some(v) = broker.vhost(vhost) else {
                    continue;
                };
                let v = v.lock();
                for q in names.iter().filter_map(|n| v.queue(n)) {
                    totals.ready += q.ready_count() as u32;
                    totals.unacked += q.unacked_count() as u32;
                    totals.consumers += q.consumer_count() as u32;
                }
            }
            Some(primary) => {
                let links = &broker.proxies().links;
                let stats = crate::proxy::stats::queue_stats(links, &primary, vhost, &names).await;
                for s in stats.values() {
                    totals.ready += s.ready;
                    totals.unacked += s.unacked;
                    totals.consumers += s.consumers;
                }
            }
        }
    }
    Ok(totals)
}

/// queue.purge of fragmented queue `queue`: every part purged on its primary; the number
/// of messages dropped.
pub async fn purge(broker: &Broker, vhost: &str, queue: &str) -> Result<u32, AmqpError> {
    let mut purged = 0;
    for (primary, names) in parts_by_primary(broker, vhost, queue)? {
        match primary {
            None => {
                let Some(v) = broker.vhost(vhost) else {
                    continue;
                };
                let mut v = v.lock();
                let mut fx = Effects::default();
                for name in &names {
                    purged += v.queue_purge(NO_CONNECTION, name, &mut fx).unwrap_or(0);
                }
                broker.finish_batch(NO_CONNECTION, &mut v, &mut fx);
            }
            Some(primary) => {
                let link = broker
                    .proxies()
                    .links
                    .upstream_link(&primary, vhost)
                    .await
                    .map_err(|e| AmqpError::new(codes::INTERNAL_ERROR, e.to_string()))?;
                let ch = link.open_channel().await?;
                for name in names {
                    let asked = AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
                        queue: name.as_str().into(),
                        nowait: false,
                    }));
                    match ch.call(asked).await? {
                        Replied::Method(AMQPClass::Queue(queue::AMQPMethod::PurgeOk(ok))) => {
                            purged += ok.message_count;
                        }
                        other => {
                            ch.close();
                            return Err(AmqpError::new(
                                codes::INTERNAL_ERROR,
                                format!("purging '{name}' on {primary}: unexpected {other:?}"),
                            ));
                        }
                    }
                }
                ch.close();
            }
        }
    }
    Ok(purged)
}

/// queue.delete of fragmented queue `queue`: `if_unused` and `if_empty` checked against
/// the whole queue, then every fragment and the queue itself deleted through the cluster;
/// the number of messages deleted with it.
pub async fn delete(
    broker: &Broker,
    vhost: &str,
    queue: &str,
    (if_unused, if_empty): (bool, bool),
) -> Result<u32, AmqpError> {
    let Some(cluster) = broker.cluster().cloned() else {
        return Err(AmqpError::new(
            codes::INTERNAL_ERROR,
            "not a cluster member",
        ));
    };
    let totals = totals(broker, vhost, queue).await?;
    if if_unused && totals.consumers > 0 {
        return Err(AmqpError::precondition(format!(
            "queue '{queue}' in vhost '{vhost}' in use"
        )));
    }
    if if_empty && totals.ready + totals.unacked > 0 {
        return Err(AmqpError::precondition(format!(
            "queue '{queue}' in vhost '{vhost}' is not empty"
        )));
    }
    let fragments: Vec<String> = match broker.vhost(vhost) {
        Some(v) => (v.lock().fragments(queue).into_iter())
            .filter(|(member, _)| member.is_some())
            .map(|(_, name)| name.to_string())
            .collect(),
        None => Vec::new(),
    };
    // The queue first: from then on no member makes a fragment of it again, and a member
    // finds any fragment left over (this member stopped half-way) and deletes it.
    for name in [queue.to_owned()].into_iter().chain(fragments) {
        let op = WiringOp::DeleteQueue {
            name,
            if_unused: false,
            if_empty: false,
        };
        commit(&cluster, vhost, op).await?;
    }
    tracing::info!(
        vhost,
        queue,
        messages = totals.ready,
        "fragmented queue deleted with its fragments"
    );
    Ok(totals.ready)
}
