//! The `Queue` resource: a queue declared on a ringmq cluster through its admin API.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::FreeFormMap;

/// Desired queue.
///
/// Identity fields (cluster, vhost, name) and the AMQP properties that a broker refuses to
/// change (durable, auto-delete) are immutable: changing them would mean a different queue.
#[derive(CustomResource, KubeSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[kube(
    group = "ringmq.io",
    version = "v1alpha1",
    kind = "Queue",
    namespaced,
    status = "QueueStatus",
    shortname = "rmqq",
    category = "ringmq",
    derive = "PartialEq",
    doc = "A queue on a ringmq Cluster, declared and kept in place by the operator.",
    printcolumn = r#"{"name":"Cluster","type":"string","jsonPath":".spec.clusterRef.name"}"#,
    printcolumn = r#"{"name":"Vhost","type":"string","jsonPath":".spec.vhost"}"#,
    printcolumn = r#"{"name":"Declared","type":"boolean","jsonPath":".status.declared"}"#,
    printcolumn = r#"{"name":"Primary","type":"string","jsonPath":".status.primary"}"#,
    printcolumn = r#"{"name":"Depth","type":"integer","jsonPath":".status.messages"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = kube::core::Rule::new(
    "has(self.name) == has(oldSelf.name) && (!has(self.name) || self.name == oldSelf.name)"
).message("name is immutable: create a new Queue instead"))]
#[serde(rename_all = "camelCase")]
pub struct QueueSpec {
    /// The Cluster (same namespace) the queue lives on.
    #[x_kube(validation = kube::core::Rule::new("self == oldSelf").message("clusterRef is immutable"))]
    pub cluster_ref: ClusterRef,
    /// Virtual host.
    #[serde(default = "default_vhost")]
    #[x_kube(validation = kube::core::Rule::new("self == oldSelf").message("vhost is immutable"))]
    pub vhost: String,
    /// Queue name on the broker; `metadata.name` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Survives a broker restart.
    #[serde(default = "default_true")]
    #[x_kube(validation = kube::core::Rule::new("self == oldSelf").message("durable is immutable"))]
    pub durable: bool,
    /// Deleted by the broker when its last consumer goes.
    #[serde(default)]
    #[x_kube(validation = kube::core::Rule::new("self == oldSelf").message("autoDelete is immutable"))]
    pub auto_delete: bool,
    /// AMQP queue arguments (`x-max-length`, ...), passed through as given.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    #[schemars(schema_with = "super::free_form_map")]
    pub arguments: FreeFormMap,
    /// Backups (k) for this queue: how many members after its primary hold a copy. Declared
    /// as the argument `qpid.cluster.backups`; when unset, the Cluster's `queueBackups`
    /// applies (the brokers' `default_backups`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3))]
    pub backups: Option<i32>,
    /// One fragment per member: each member stores what is published through it and serves
    /// its own consumers, pulling from the others when they run dry. Declared as the
    /// argument `qpid.cluster.fragmented`; not with `autoDelete`, `x-expires` or
    /// `x-single-active-consumer`.
    #[serde(default)]
    pub fragmented: bool,
    /// Member (pod name) that should be the queue's primary. Declared as the argument
    /// `qpid.cluster.primary`; the broker refuses a member it does not know.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_primary: Option<String>,
    /// What deleting this resource does to the queue on the broker.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
}

fn default_vhost() -> String {
    "/".to_string()
}

fn default_true() -> bool {
    true
}

/// Reference to a Cluster in the Queue's namespace.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct ClusterRef {
    /// Cluster name.
    #[schemars(length(min = 1))]
    pub name: String,
}

/// What happens to the broker's queue when the `Queue` resource is deleted.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeletionPolicy {
    /// Delete the queue (and its messages) on the broker.
    #[default]
    Delete,
    /// Leave the queue on the broker.
    Retain,
}

/// Observed queue state.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QueueStatus {
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Whether the queue exists on the broker as specified.
    #[serde(default)]
    pub declared: bool,
    /// Member owning the queue, as the admin API reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<String>,
    /// Messages in the queue (ready + unacknowledged).
    #[serde(default)]
    pub messages: i64,
    /// `Ready` (declared as specified), with reasons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The declare argument for [`QueueSpec::backups`] (the broker's `core/args.rs`).
pub const BACKUPS_ARGUMENT: &str = "qpid.cluster.backups";
/// The declare argument for [`QueueSpec::pinned_primary`] (the broker's `broker/mod.rs`).
pub const PRIMARY_ARGUMENT: &str = "qpid.cluster.primary";
/// The declare argument for [`QueueSpec::fragmented`] (the broker's `core/fragments.rs`).
pub const FRAGMENTED_ARGUMENT: &str = "qpid.cluster.fragmented";

impl Queue {
    /// The declare arguments: `spec.arguments`, with `backups`, `pinnedPrimary` and
    /// `fragmented` as the broker's cluster arguments on top (the typed fields win over the
    /// same key there).
    pub fn declare_arguments(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut arguments: serde_json::Map<String, serde_json::Value> =
            self.spec.arguments.clone().into_iter().collect();
        if let Some(backups) = self.spec.backups {
            arguments.insert(BACKUPS_ARGUMENT.to_string(), backups.into());
        }
        if let Some(primary) = &self.spec.pinned_primary {
            arguments.insert(PRIMARY_ARGUMENT.to_string(), primary.clone().into());
        }
        if self.spec.fragmented {
            arguments.insert(FRAGMENTED_ARGUMENT.to_string(), true.into());
        }
        arguments
    }

    /// The queue name on the broker.
    pub fn queue_name(&self) -> String {
        self.spec
            .name
            .clone()
            .unwrap_or_else(|| kube::ResourceExt::name_any(self))
    }
}
