//! Custom resource types of the `ringmq.io/v1alpha1` API.
//!
//! The Rust types are the source of truth: `crdgen` prints the CRDs from them and a test
//! fails when `crds/` drifts, so the schema users apply is always the one the code reads.

pub mod backup_ring;
pub mod cluster;
pub mod queue;

pub use backup_ring::{
    APPROVE_ANNOTATION, BackupRing, BackupRingSpec, BackupRingStatus, LayoutStatus, Proposal,
    RebalanceMode, RebalancePolicy, RebalanceStatus, RingMember, RingOrderPolicy, RingOrderSpec,
};
pub use cluster::{
    Cluster, ClusterSpec, ClusterStatus, MemberStatus, Operation, OperationKind, OperationStep,
    Persistence, QuorumStatus, RollingRestart, ServiceSpec, ServiceType, TlsSpec,
};
pub use queue::{ClusterRef, DeletionPolicy, Queue, QueueSpec, QueueStatus};

use std::collections::BTreeMap;

/// API group of every ringmq resource.
pub const GROUP: &str = "ringmq.io";

/// Schema of a free-form JSON object (AMQP arguments, broker config overrides).
///
/// Why custom: schemars renders `serde_json::Value` as "anything", which is not a structural
/// schema; Kubernetes wants `x-kubernetes-preserve-unknown-fields` on the values instead.
pub(crate) fn free_form_map(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "additionalProperties": { "x-kubernetes-preserve-unknown-fields": true }
    })
}

/// A free-form JSON map, as stored in `arguments` and `config`.
pub type FreeFormMap = BTreeMap<String, serde_json::Value>;

/// Renders every CRD as one multi-document YAML stream, in a stable order.
///
/// Used by the `crdgen` binary and by the drift test, so both see byte-identical output.
pub fn render_yaml() -> Result<String, serde_saphyr::ser::Error> {
    use kube::CustomResourceExt;
    let mut out = String::new();
    for crd in [Cluster::crd(), Queue::crd(), BackupRing::crd()] {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd)?);
    }
    Ok(out)
}
