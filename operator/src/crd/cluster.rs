//! The `Cluster` resource: one ringmq broker cluster.

use k8s_openapi::api::core::v1::{
    Affinity, ResourceRequirements, Toleration, TopologySpreadConstraint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::FreeFormMap;

/// Desired state of a ringmq cluster.
///
/// `replicas` is exposed through the scale subresource so `kubectl scale` and a
/// HorizontalPodAutoscaler can drive it; the operator turns a change into a multi-step scale
/// operation recorded in `status.operation`.
#[derive(CustomResource, KubeSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[kube(
    group = "ringmq.io",
    version = "v1alpha1",
    kind = "Cluster",
    namespaced,
    status = "ClusterStatus",
    shortname = "rmq",
    category = "ringmq",
    derive = "PartialEq",
    doc = "A ringmq broker cluster: a StatefulSet of brokers forming one ring.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Status","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Quorum","type":"boolean","jsonPath":".status.quorum.hasQuorum"}"#,
    printcolumn = r#"{"name":"Step","type":"string","jsonPath":".status.operation.step"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = kube::core::Rule::new(
    "has(self.persistence) == has(oldSelf.persistence) && (!has(self.persistence) || self.persistence == oldSelf.persistence)"
).message("persistence is immutable: volume claim templates cannot change; create a new Cluster"))]
#[serde(rename_all = "camelCase")]
pub struct ClusterSpec {
    /// Number of brokers. Scaling down drains the leaving brokers before their pods go.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 1, max = 32))]
    pub replicas: i32,
    /// Broker container image.
    #[schemars(length(min = 1))]
    pub image: String,
    /// CPU and memory for each broker container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Persistent storage per broker; without it brokers use an emptyDir (data lost with the pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistence: Option<Persistence>,
    /// TLS for AMQPS (port 5671).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,
    /// Name of an existing Secret with `username` and `password` for the default user; when
    /// unset the operator creates `<name>-default-user` with a random password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_user_secret: Option<String>,
    /// Backups per queue (k): how many brokers after a queue's primary hold a copy, for
    /// queues declared without their own (the brokers' `default_backups`).
    #[serde(default = "default_backups")]
    #[schemars(range(min = 1, max = 3))]
    pub queue_backups: i32,
    /// Client Service type and annotations.
    #[serde(default)]
    pub service: ServiceSpec,
    /// Pod affinity rules for the brokers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Tolerations for the broker pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Topology spread constraints for the broker pods (e.g. across zones).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// Broker configuration overrides, merged over the operator's defaults in `ringmq.yaml`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "super::free_form_map")]
    pub config: FreeFormMap,
}

fn default_replicas() -> i32 {
    3
}

fn default_backups() -> i32 {
    1
}

/// Persistent volume per broker.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Persistence {
    /// StorageClass of the volume claims; the cluster default when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class: Option<String>,
    /// Size of each broker's volume, e.g. `10Gi`.
    pub size: Quantity,
}

/// TLS material for AMQPS.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TlsSpec {
    /// Name of a `kubernetes.io/tls` Secret (`tls.crt`, `tls.key`, optional `ca.crt`).
    #[schemars(length(min = 1))]
    pub secret_name: String,
}

/// How clients reach the cluster.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceSpec {
    /// Kubernetes Service type of the client Service.
    #[serde(default, rename = "type")]
    pub type_: ServiceType,
    /// Annotations on the client Service (e.g. for a cloud load balancer).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// The client Service types the operator supports.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ServiceType {
    /// Reachable inside the cluster only.
    #[default]
    ClusterIP,
    /// Exposed on every node's port.
    NodePort,
    /// Exposed through a cloud load balancer.
    LoadBalancer,
}

impl ServiceType {
    /// The Kubernetes spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ClusterIP => "ClusterIP",
            Self::NodePort => "NodePort",
            Self::LoadBalancer => "LoadBalancer",
        }
    }
}

/// Observed state, written by the operator with server-side apply.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Broker pods the StatefulSet runs (the scale subresource reads it).
    #[serde(default)]
    pub replicas: i32,
    /// Broker pods passing `/readyz`.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Label selector of the broker pods, for the scale subresource (HPA).
    #[serde(default)]
    pub selector: String,
    /// Members as the brokers' admin API reports them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<MemberStatus>,
    /// Ring order computed by the planner from the members and their zones.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ring: Vec<String>,
    /// `Ready`, `Reconciled` and `Degraded`, with reasons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The multi-step operation in progress, if any; it survives operator restarts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<Operation>,
    /// The consensus group as the member that answered the admin API sees it; absent when
    /// the admin API does not answer or the broker runs alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quorum: Option<QuorumStatus>,
    /// The rolling restart in progress (after a pod template change), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolling_restart: Option<RollingRestart>,
    /// Brokers a scale-down drained that are not undrained yet (gone, going, or kept by a
    /// scale-down that was called off). One the Cluster keeps again (`replicas` above its
    /// ordinal) is undrained, so that it serves; a broker you drained by hand is never here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drained_by_scale_down: Vec<String>,
}

/// Quorum of the brokers' consensus group, from `GET /api/overview`'s `cluster` object.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuorumStatus {
    /// Whether the answering member holds the majority's lease.
    pub has_quorum: bool,
    /// Voters of the consensus group (dead ones count until they are removed).
    pub voters: i64,
    /// The consensus leader's member id; absent during an election or without quorum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader: Option<String>,
    /// The member that answered.
    pub reported_by: String,
}

/// A rolling restart: pods from `partition` up run the new template; the operator lowers
/// the partition one pod at a time, each only when the cluster is whole again.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RollingRestart {
    /// The StatefulSet's `updateStrategy.rollingUpdate.partition`.
    pub partition: i32,
    /// What the next restart waits for, in words a person can act on.
    pub waiting_for: String,
}

/// One broker as the admin API reports it.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct MemberStatus {
    /// Member id (the pod name).
    pub id: String,
    /// Zone the member reports.
    #[serde(default)]
    pub zone: String,
    /// Member state (e.g. `up`, `leaving`).
    #[serde(default)]
    pub state: String,
}

/// A multi-step operation and the step it is in.
///
/// Why in status: the operator may restart at any point; the next reconcile reads the step
/// here and resumes it. Every step is idempotent, so repeating one is harmless.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Operation {
    /// What is being done.
    pub kind: OperationKind,
    /// Replicas when the operation started.
    pub from: i32,
    /// Replicas the operation leads to.
    pub to: i32,
    /// Current step.
    pub step: OperationStep,
    /// What the step waits for, in words a person can act on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
}

/// Kinds of multi-step operations.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum OperationKind {
    /// Adding brokers: grow the StatefulSet, then wait for the new members to join.
    ScaleUp,
    /// Removing brokers: drain the leaving members, then shrink the StatefulSet.
    ScaleDown,
}

/// Steps of the scale operations, in order.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum OperationStep {
    /// ScaleUp: StatefulSet replicas raised; waiting for the new members to be ready and joined.
    WaitingForMembers,
    /// ScaleDown: the highest pod's broker is drained; waiting until it holds no queues.
    Draining,
    /// ScaleDown: a drained pod removed (StatefulSet replicas one lower); waiting for it to
    /// go and leave the consensus voters, and for the cluster to be whole at its size
    /// before the next pod is drained.
    ShrinkingStatefulSet,
}

impl Cluster {
    /// Name of the operator-managed Secret holding the peer-authentication secret.
    pub fn cluster_secret_name(&self) -> String {
        format!("{}-cluster", kube::ResourceExt::name_any(self))
    }

    /// Name of the Secret holding the default user's credentials.
    pub fn default_user_secret_name(&self) -> String {
        self.spec
            .default_user_secret
            .clone()
            .unwrap_or_else(|| format!("{}-default-user", kube::ResourceExt::name_any(self)))
    }

    /// Name of the cluster-internal Service of the admin API, which the operator calls.
    pub fn admin_service_name(&self) -> String {
        format!("{}-admin", kube::ResourceExt::name_any(self))
    }

    /// Name of the headless Service used for peer discovery.
    pub fn headless_service_name(&self) -> String {
        format!("{}-nodes", kube::ResourceExt::name_any(self))
    }
}
