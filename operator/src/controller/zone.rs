//! Broker pods learn their zone: once a pod is scheduled, the operator copies its node's
//! `topology.kubernetes.io/zone` label onto the pod (an empty value when the node has
//! none), and the broker reads it from its downward API `labels` file (`zone_file`, which
//! the kubelet keeps current). Strimzi's rack awareness does the lookup in an init
//! container; the broker image has no shell or Kubernetes client for that.
//!
//! Why a label on the pod and not an environment variable: the downward API exposes the
//! pod's own labels, never its node's, and a variable is fixed at container start, before
//! the scheduler's choice can be copied.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;

use super::{Context, Error};

/// The zone label of nodes, copied onto broker pods (the broker's `ZONE_LABEL`).
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Labels one broker pod with its node's zone, if it is scheduled and not labelled so yet.
pub async fn reconcile(pod: Arc<Pod>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile("Pod");
    let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
        // Not scheduled yet: its next change (the binding) brings it back.
        return Ok(Action::await_change());
    };
    let ns = pod
        .namespace()
        .ok_or(Error::MissingObjectKey("namespace"))?;
    let Some(node) = Api::<Node>::all(ctx.client.clone()).get_opt(&node).await? else {
        return Ok(Action::await_change());
    };
    let zone = node.labels().get(ZONE_LABEL).cloned().unwrap_or_default();
    if pod.labels().get(ZONE_LABEL) == Some(&zone) {
        return Ok(Action::await_change());
    }
    let patch = serde_json::json!({"metadata": {"labels": {ZONE_LABEL: zone}}});
    Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .patch(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    tracing::info!(pod = %pod.name_any(), zone, "broker pod labelled with its node's zone");
    Ok(Action::await_change())
}
