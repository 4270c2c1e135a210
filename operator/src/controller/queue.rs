//! `Queue` reconcile: declare through the admin API, repair drift, delete on finalize.
//!
//! The finalizer deletes the broker's queue (unless the deletion policy retains it) and is
//! released without waiting when the Cluster is gone or being deleted, because there is
//! nothing left to delete from and a stuck finalizer would block namespace deletion.

use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{Event as Finalizer, finalizer};

use super::{Context, Error, write_status};
use crate::admin::{AdminApi, AdminError, Declared, QueueDeclaration};
use crate::conditions::condition;
use crate::crd::{DeletionPolicy, Queue, QueueStatus};

/// Finalizer that deletes the broker's queue before the `Queue` object goes.
pub const QUEUE_FINALIZER: &str = "ringmq.io/queue";
/// Drift-repair period: how soon a queue deleted behind the operator's back comes back.
pub const DRIFT_CHECK: Duration = Duration::from_secs(60);
/// Retry period while the Cluster does not exist yet.
pub const CLUSTER_WAIT: Duration = Duration::from_secs(30);
/// Retry period after a conflicting declaration (a person has to act first).
pub const CONFLICT_WAIT: Duration = Duration::from_secs(300);

/// Reconciles one `Queue` through the finalizer helper.
pub async fn reconcile(queue: Arc<Queue>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile("Queue");
    let ns = queue
        .namespace()
        .ok_or(Error::MissingObjectKey("namespace"))?;
    let queues: Api<Queue> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&queues, QUEUE_FINALIZER, queue, |event| async {
        match event {
            Finalizer::Apply(q) => apply(&q, &ctx, &ns).await,
            Finalizer::Cleanup(q) => cleanup(&q, &ctx, &ns).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// Admin client for the queue's cluster, or `None` when the cluster is absent or deleting.
async fn admin_for(
    ctx: &Context,
    ns: &str,
    queue: &Queue,
) -> Result<Option<Arc<dyn AdminApi>>, Error> {
    super::admin_for_cluster(ctx, ns, &queue.spec.cluster_ref.name).await
}

async fn apply(queue: &Queue, ctx: &Context, ns: &str) -> Result<Action, Error> {
    let name = queue.queue_name();
    let vhost = queue.spec.vhost.clone();
    let previous = queue.status.clone().unwrap_or_default();
    let generation = queue.metadata.generation;
    let Some(admin) = admin_for(ctx, ns, queue).await? else {
        let status = QueueStatus {
            observed_generation: generation,
            declared: false,
            conditions: vec![condition(
                &previous.conditions,
                "Ready",
                false,
                "ClusterNotFound",
                format!(
                    "Cluster {} not found (or its default-user Secret is missing); create it",
                    queue.spec.cluster_ref.name
                ),
                generation,
            )],
            ..QueueStatus::default()
        };
        write_status(ctx, ns, queue, &status).await?;
        return Ok(Action::requeue(CLUSTER_WAIT));
    };
    let declaration = QueueDeclaration {
        durable: queue.spec.durable,
        auto_delete: queue.spec.auto_delete,
        arguments: queue.declare_arguments(),
    };
    let (declared, reason, message, requeue) =
        match admin.declare_queue(&vhost, &name, &declaration).await {
            Ok(Declared::Created) if previous.declared => {
                ctx.event(
                    queue,
                    EventType::Warning,
                    "DriftRepaired",
                    format!("queue {name} in vhost {vhost} was missing on the broker; re-declared"),
                )
                .await;
                (
                    true,
                    "Declared",
                    "re-declared after it went missing".to_string(),
                    DRIFT_CHECK,
                )
            }
            Ok(Declared::Created) => {
                ctx.event(
                    queue,
                    EventType::Normal,
                    "Declared",
                    format!("declared queue {name} in vhost {vhost}"),
                )
                .await;
                (
                    true,
                    "Declared",
                    "declared on the broker".to_string(),
                    DRIFT_CHECK,
                )
            }
            Ok(Declared::AlreadyThere) => (
                true,
                "Declared",
                "present on the broker as specified".to_string(),
                DRIFT_CHECK,
            ),
            Err(AdminError::Conflict(reason)) => {
                ctx.event(
                    queue,
                    EventType::Warning,
                    "Conflict",
                    format!("broker refused queue {name}: {reason}"),
                )
                .await;
                (
                    false,
                    "Conflict",
                    format!("{reason}; delete the broker's queue or match its properties"),
                    CONFLICT_WAIT,
                )
            }
            Err(e) => return Err(e.into()),
        };
    let info = if declared {
        admin.queue(&vhost, &name).await?
    } else {
        None
    };
    let status = QueueStatus {
        observed_generation: generation,
        declared,
        primary: info.as_ref().and_then(|i| i.owner.clone()),
        messages: info.map(|i| i.messages).unwrap_or(0),
        conditions: vec![condition(
            &previous.conditions,
            "Ready",
            declared,
            reason,
            message,
            generation,
        )],
    };
    write_status(ctx, ns, queue, &status).await?;
    Ok(Action::requeue(requeue))
}

async fn cleanup(queue: &Queue, ctx: &Context, ns: &str) -> Result<Action, Error> {
    let name = queue.queue_name();
    let vhost = &queue.spec.vhost;
    if queue.spec.deletion_policy == DeletionPolicy::Retain {
        ctx.event(
            queue,
            EventType::Normal,
            "Retained",
            format!("deletion policy retain: queue {name} left on the broker"),
        )
        .await;
        return Ok(Action::await_change());
    }
    let Some(admin) = admin_for(ctx, ns, queue).await? else {
        ctx.event(
            queue,
            EventType::Normal,
            "ClusterGone",
            format!("cluster absent or deleting; nothing to delete for {name}"),
        )
        .await;
        return Ok(Action::await_change());
    };
    let existed = admin.delete_queue(vhost, &name).await?;
    let note = if existed {
        format!("deleted queue {name} in vhost {vhost}")
    } else {
        format!("queue {name} was already gone")
    };
    ctx.event(queue, EventType::Normal, "Deleted", note).await;
    Ok(Action::await_change())
}
