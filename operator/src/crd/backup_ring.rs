//! The `BackupRing` resource: a Cluster's ring as the operator shows it (members in ring
//! order, what each holds, whether the backups are in sync), its layout (the order of the
//! members, explicit or zone-aware, and the `k` of queues without their own) and its
//! rebalance policy —
//! automatic within a threshold, or held for approval (Strimzi's `KafkaRebalance` flow:
//! the proposal in the status, an annotation to approve, progress, done).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::ClusterRef;

/// The annotation that approves the proposal of a `Manual` ring: set it to `approve`; the
/// operator starts the rebalance and removes it.
pub const APPROVE_ANNOTATION: &str = "ringmq.io/rebalance";

/// Desired ring policy.
#[derive(CustomResource, KubeSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[kube(
    group = "ringmq.io",
    version = "v1alpha1",
    kind = "BackupRing",
    namespaced,
    status = "BackupRingStatus",
    shortname = "rmqring",
    category = "ringmq",
    derive = "PartialEq",
    doc = "The ring of a ringmq Cluster: its members in ring order, what each holds, and when the primaries and backups are rebalanced.",
    printcolumn = r#"{"name":"Cluster","type":"string","jsonPath":".spec.clusterRef.name"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.rebalance.mode"}"#,
    printcolumn = r#"{"name":"Order","type":"string","jsonPath":".status.layout.policy"}"#,
    printcolumn = r#"{"name":"Balanced","type":"boolean","jsonPath":".status.balanced"}"#,
    printcolumn = r#"{"name":"Proposed","type":"integer","jsonPath":".status.proposal.moves"}"#,
    printcolumn = r#"{"name":"Rebalance","type":"string","jsonPath":".status.rebalance.status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct BackupRingSpec {
    /// The Cluster (same namespace) whose ring this is.
    #[x_kube(validation = kube::core::Rule::new("self == oldSelf").message("clusterRef is immutable"))]
    pub cluster_ref: ClusterRef,
    /// How the members are ordered on the ring. Unset: the operator leaves the order as
    /// the brokers have it (`ringmqctl cluster layout` may set it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self.policy == 'Explicit' ? (has(self.members) && size(self.members) > 0) : !has(self.members)").message("members lists the ring order of policy Explicit, and only of it"))]
    pub order: Option<RingOrderSpec>,
    /// Backups (`k`, 0 to 3) of every queue declared without its own (`Queue` `backups`,
    /// `qpid.cluster.backups`), the queues there are included: they gain copies, which catch
    /// up, or lose the ones out of sync first. It overrides the Cluster's `queueBackups`
    /// for those queues. Unset: the operator leaves it as the brokers have it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3))]
    pub backups: Option<u8>,
    /// When the ring is rebalanced.
    #[serde(default)]
    pub rebalance: RebalancePolicy,
}

/// The order of the members on the ring. A queue's backups are its primary's next members,
/// so the order decides which members back up which: a changed order moves no copy by
/// itself; the next rebalance puts the backups on their new successors (catch-up first).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RingOrderSpec {
    /// `Placement`: each new member goes where the brokers place it (the gap that keeps
    /// zones apart). `ZoneAware`: the zones take turns around the ring (largest first), so a
    /// queue's backups sit in other zones than its primary; new members go into the
    /// zone-aware gap. `Explicit`: `members` in that order; members not listed follow, and
    /// a listed pod that joins later (a scale-up) goes to its place.
    pub policy: RingOrderPolicy,
    /// `Explicit`: the pods (member ids) in ring order, each once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<String>,
}

/// See [`RingOrderSpec::policy`].
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum RingOrderPolicy {
    /// The brokers place new members.
    Placement,
    /// The zones take turns.
    ZoneAware,
    /// The listed order.
    Explicit,
}

/// When and how fast the ring is rebalanced.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RebalancePolicy {
    /// `Manual`: the proposal waits in the status for the annotation
    /// `ringmq.io/rebalance: approve`. `Automatic`: started as soon as the primaries per
    /// member differ by more than `threshold`.
    #[serde(default)]
    pub mode: RebalanceMode,
    /// Most moves under way at once (each a catch-up of one queue on its new member).
    #[serde(default = "default_concurrency")]
    #[schemars(range(min = 1, max = 64))]
    pub concurrency: u32,
    /// `Automatic`: the spread of primaries per member (most minus fewest) it tolerates.
    #[serde(default = "default_threshold")]
    #[schemars(range(min = 1))]
    pub threshold: u64,
}

impl Default for RebalancePolicy {
    fn default() -> Self {
        Self {
            mode: RebalanceMode::default(),
            concurrency: default_concurrency(),
            threshold: default_threshold(),
        }
    }
}

fn default_concurrency() -> u32 {
    2
}

fn default_threshold() -> u64 {
    1
}

/// See [`RebalancePolicy::mode`].
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum RebalanceMode {
    /// Proposed, then approved by a person.
    #[default]
    Manual,
    /// Started by the operator within the threshold.
    Automatic,
}

/// Observed ring.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupRingStatus {
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The members in ring order, as the cluster map has them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ring: Vec<RingMember>,
    /// Nothing to move: primaries and backups even over the active members.
    #[serde(default)]
    pub balanced: bool,
    /// Backup copies not in sync yet, over all members (0 when every backup can take over).
    #[serde(default)]
    pub out_of_sync_backups: u64,
    /// What a rebalance started now would move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proposal: Option<Proposal>,
    /// The newest rebalance, as the brokers report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance: Option<RebalanceStatus>,
    /// The ring's layout as the brokers hold it, while the spec sets `order` or `backups`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<LayoutStatus>,
    /// `Ready` (the ring was read), `Balanced`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The ring's layout the brokers applied.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LayoutStatus {
    /// `Placement`, `ZoneAware` or `Explicit`.
    pub policy: String,
    /// `Explicit`: the listed order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<String>,
    /// `k` of the queues without their own; unset: each member's `default_backups`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backups: Option<u8>,
    /// Backups follow the layout: a rebalance over the whole ring started after it was set
    /// is done, or there is nothing to move.
    pub followed: bool,
}

/// One member on the ring.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RingMember {
    /// Member id (the pod name).
    pub member: String,
    /// Zone.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub zone: String,
    /// `running`, `joining`, `draining`.
    pub state: String,
    /// Queues it is the primary of.
    pub primaries: u64,
    /// Queues it is a backup of.
    pub backups: u64,
    /// Of those, the ones it is in sync for.
    pub in_sync_backups: u64,
}

/// A rebalance's plan, not started.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Proposal {
    /// Moves in all.
    pub moves: u64,
    /// Primary moves.
    pub primary_moves: u64,
    /// Backup moves (planned once the primaries moved; these are for the primaries as
    /// they are now).
    pub backup_moves: u64,
    /// The first primary moves, `vhost/queue: from -> to`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sample: Vec<String>,
}

/// The newest rebalance.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RebalanceStatus {
    /// `running`, `done`, `failed`, `stopped`.
    pub status: String,
    /// Moves planned.
    pub total: u64,
    /// Moves made.
    pub done: u64,
    /// Moves that could not be made.
    pub failed: u64,
    /// Moves pending or under way.
    pub left: u64,
    /// The new member whose join started it (the brokers hand a new member its share by
    /// themselves).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub joined: Option<String>,
}
