//! Controllers for `Cluster` and `Queue`: shared context, errors and error policy.
//!
//! Layout follows kube-rs controller-rs: one reconcile function per kind, an error policy
//! that counts failures by reason and backs off, and a `run` that wires the watchers.

pub mod backup_ring;
pub mod cluster;
pub mod queue;
pub mod zone;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Api, Client, Resource};

use crate::admin::{AdminApi, AdminConnector, AdminEndpoint, AdminError};
use crate::crd::{BackupRing, Cluster, Queue};
use crate::metrics::Metrics;

/// Field manager for every server-side apply, so ownership of fields is clear in `managedFields`.
pub const FIELD_MANAGER: &str = "ringmq-operator";

/// Why a reconcile failed; the message says what to do next.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("Kubernetes API call failed: {0}; check the operator's RBAC and the API server")]
    Kube(#[from] kube::Error),
    /// A broker admin API call failed.
    #[error(transparent)]
    Admin(#[from] AdminError),
    /// The object lacks a field the API server always sets (namespace, uid).
    #[error("object has no {0}; it was not read from the API server")]
    MissingObjectKey(&'static str),
    /// The Secret named in `spec.defaultUserSecret` does not exist.
    #[error("secret {0} not found; create it with the keys username and password")]
    MissingSecret(String),
    /// A Secret the cluster needs lacks a key.
    #[error("secret {secret} has no key {key}; create it with that key")]
    MissingSecretKey {
        /// Secret name.
        secret: String,
        /// Missing key.
        key: String,
    },
    /// The broker config could not be rendered as YAML.
    #[error("cannot render broker config: {0}; check spec.config")]
    Config(String),
    /// Random bytes for generated secrets could not be read.
    #[error("cannot read random bytes for a generated secret: {0}")]
    Random(#[from] std::io::Error),
    /// The finalizer helper failed.
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
}

impl Error {
    /// Short, bounded label for the failures metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Admin(AdminError::Unreachable { .. }) => "admin_unreachable",
            Error::Admin(AdminError::Conflict(_)) => "admin_conflict",
            Error::Admin(AdminError::Busy(_)) => "admin_busy",
            Error::Admin(_) => "admin",
            Error::MissingObjectKey(_) => "missing_object_key",
            Error::MissingSecret(_) | Error::MissingSecretKey { .. } => "missing_secret",
            Error::Config(_) => "config",
            Error::Random(_) => "random",
            Error::Finalizer(_) => "finalizer",
        }
    }
}

/// Everything a reconcile needs; shared by both controllers.
pub struct Context {
    /// Kubernetes client.
    pub client: Client,
    /// Publishes Events on the reconciled objects.
    pub recorder: Recorder,
    /// Reconcile metrics.
    pub metrics: Arc<Metrics>,
    /// Makes admin API clients (a fake in tests).
    pub admin: Arc<dyn AdminConnector>,
}

impl Context {
    /// Builds the context; `reporter` names this operator instance in Events.
    pub fn new(client: Client, metrics: Arc<Metrics>, admin: Arc<dyn AdminConnector>) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            metrics,
            admin,
        }
    }

    /// Publishes an Event on `obj`; failures are logged, never fatal (an Event is a courtesy).
    pub async fn event<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        type_: EventType,
        reason: &str,
        note: String,
    ) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: reason.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &obj.object_ref(&())).await {
            tracing::warn!(error = %e, reason, "could not publish event");
        }
    }
}

/// Admin client for Cluster `name` (as its default user), or `None` when the cluster or its
/// default-user Secret is absent, or the cluster is being deleted.
pub async fn admin_for_cluster(
    ctx: &Context,
    ns: &str,
    name: &str,
) -> Result<Option<Arc<dyn AdminApi>>, Error> {
    let cluster = Api::<Cluster>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await?;
    let Some(cluster) = cluster.filter(|c| c.meta().deletion_timestamp.is_none()) else {
        return Ok(None);
    };
    let secret_name = cluster.default_user_secret_name();
    let Some(secret) = Api::<Secret>::namespaced(ctx.client.clone(), ns)
        .get_opt(&secret_name)
        .await?
    else {
        return Ok(None);
    };
    Ok(Some(ctx.admin.connect(AdminEndpoint {
        base_url: crate::resources::admin_base_url(&cluster),
        username: cluster::secret_value(&secret, &secret_name, "username")?,
        password: cluster::secret_value(&secret, &secret_name, "password")?,
    })))
}

/// Writes `status` as the status of `obj`, a namespaced resource of ours, by server-side
/// apply (forced: the operator alone owns the status), as every reconciler ends.
pub async fn write_status<K>(
    ctx: &Context,
    ns: &str,
    obj: &K,
    status: &impl serde::Serialize,
) -> Result<(), Error>
where
    K: Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let patch = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    Api::<K>::namespaced(ctx.client.clone(), ns)
        .patch_status(
            &kube::ResourceExt::name_any(obj),
            &kube::api::PatchParams::apply(FIELD_MANAGER).force(),
            &kube::api::Patch::Apply(&patch),
        )
        .await?;
    Ok(())
}

/// Requeue delay after a failure; bounded so a broken cluster is retried but not hammered.
pub const RETRY_AFTER: Duration = Duration::from_secs(15);

/// Error policy shared by the controllers: count the failure by reason and retry later.
pub fn error_policy<K>(_obj: Arc<K>, error: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(error = %error, "reconcile failed");
    ctx.metrics.failure(
        std::any::type_name::<K>()
            .rsplit("::")
            .next()
            .unwrap_or("unknown"),
        error,
    );
    Action::requeue(RETRY_AFTER)
}

/// An `Api` over every namespace, or over `namespace` alone when one is given.
pub fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = kube::core::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Runs the controllers (Clusters, Queues, BackupRings, and the zone labels of broker
/// pods) until shutdown.
///
/// With `watch_namespace`, every watch (Clusters, Queues and the objects they own) is
/// restricted to that namespace, so the operator needs rights there only (the chart's
/// `watchNamespace`); without it, it watches all namespaces.
pub async fn run(ctx: Arc<Context>, watch_namespace: Option<&str>) {
    let client = ctx.client.clone();
    let ns = watch_namespace;
    let clusters = scoped::<Cluster>(&client, ns);
    let queues = scoped::<Queue>(&client, ns);
    let rings = scoped::<BackupRing>(&client, ns);
    let pods = scoped::<Pod>(&client, ns);
    let config = watcher::Config::default().any_semantic();
    // Owned objects all carry our name label; watching only those keeps the operator from
    // caching every Secret and ConfigMap in the cluster.
    let owned = watcher::Config::default().labels("app.kubernetes.io/name=ringmq");
    let cluster_controller = Controller::new(clusters, config.clone())
        .owns(scoped::<StatefulSet>(&client, ns), owned.clone())
        .owns(scoped::<Service>(&client, ns), owned.clone())
        .owns(scoped::<ConfigMap>(&client, ns), owned.clone())
        .owns(scoped::<Secret>(&client, ns), owned.clone())
        .owns(scoped::<PodDisruptionBudget>(&client, ns), owned.clone())
        .shutdown_on_signal()
        .run(cluster::reconcile, error_policy, ctx.clone())
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "cluster controller event");
            }
        });
    let queue_controller = Controller::new(queues, config.clone())
        .shutdown_on_signal()
        .run(queue::reconcile, error_policy, ctx.clone())
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "queue controller event");
            }
        });
    // Every change of a ring is reconciled, not only of its spec: the approval is an
    // annotation.
    let zone_controller = Controller::new(pods, owned.clone())
        .shutdown_on_signal()
        .run(zone::reconcile, error_policy, ctx.clone())
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "zone controller event");
            }
        });
    let ring_controller = Controller::new(rings, config)
        .shutdown_on_signal()
        .run(backup_ring::reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "backup ring controller event");
            }
        });
    futures::join!(
        cluster_controller,
        queue_controller,
        ring_controller,
        zone_controller
    );
}

#[cfg(test)]
mod tests;
