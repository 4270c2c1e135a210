//! ringmq Kubernetes operator: `Cluster` and `Queue` controllers.
//!
//! Layout follows kube-rs controller-rs: [`crd`] holds the resource types (the CRDs are
//! generated from them), [`controller`] the reconcilers, [`resources`] the objects a Cluster
//! owns, [`admin`] the broker admin API client, [`leader`] the leader election, [`metrics`] and [`telemetry`] the operability.

pub mod admin;
pub mod conditions;
pub mod controller;
pub mod crd;
pub mod leader;
pub mod metrics;
pub mod resources;
pub mod rollout;
pub mod scale;
pub mod telemetry;

#[cfg(test)]
mod fixtures;
