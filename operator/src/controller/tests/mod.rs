//! Reconciler tests against kube's mocked API service: every request asserted, every
//! response scripted. Each reconcile gets a fresh context, as after an operator restart, so
//! the only memory between reconciles is the status the previous one wrote. One file per
//! job: the Cluster's children and settings (`children`), scaling (`scale`), rolling restarts
//! (`rollout`), Queues (`queues`) and their finalizer (`finalizer`), and the admin calls
//! against real brokers (`real_brokers`); the fixtures they share are here.

mod children;
mod finalizer;
mod queues;
mod real_brokers;
mod rings;
mod rollout;
mod scale;
mod zones;

use std::sync::Arc;

use http::Method;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use serde_json::{Value, json};

use super::{backup_ring, cluster, queue, zone};
use crate::admin::AdminConnector;
use crate::controller::Context;
use crate::crd::{ClusterStatus, OperationKind, OperationStep, QueueStatus};
use crate::fixtures::{
    self, ApiServerVerifier, FakeAdmin, cluster_secret, run_scripted, user_secret,
};

const NS: &str = "/api/v1/namespaces/default";
const STS: &str = "/apis/apps/v1/namespaces/default/statefulsets/ringmq";
const CLUSTER_STATUS: &str = "/apis/ringmq.io/v1alpha1/namespaces/default/clusters/ringmq/status";
const SM_CRD: &str =
    "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/servicemonitors.monitoring.coreos.com";
const QUEUE: &str = "/apis/ringmq.io/v1alpha1/namespaces/default/queues/orders";
const QUEUE_STATUS: &str = "/apis/ringmq.io/v1alpha1/namespaces/default/queues/orders/status";
const CLUSTER: &str = "/apis/ringmq.io/v1alpha1/namespaces/default/clusters/ringmq";

/// The operator's admin client for real broker `m`, as `user` with `password`.
fn real_admin(
    m: &ringmq_tests::Broker,
    user: &str,
    password: &str,
) -> Arc<dyn crate::admin::AdminApi> {
    crate::admin::HttpConnectorFactory::default().connect(crate::admin::AdminEndpoint {
        base_url: m.admin_url(),
        username: user.into(),
        password: password.into(),
    })
}

/// Secrets exist; ConfigMap, Services, PDB applied; no ServiceMonitor CRD.
async fn existing_children(v: &mut ApiServerVerifier) {
    v.get(&format!("{NS}/secrets/ringmq-cluster"), cluster_secret())
        .await;
    v.get(&format!("{NS}/secrets/ringmq-default-user"), user_secret())
        .await;
    v.apply(&format!("{NS}/configmaps/ringmq-config")).await;
    v.apply(&format!("{NS}/services/ringmq-nodes")).await;
    v.apply(&format!("{NS}/services/ringmq")).await;
    v.apply(&format!("{NS}/services/ringmq-admin")).await;
    v.apply("/apis/policy/v1/namespaces/default/poddisruptionbudgets/ringmq")
        .await;
    v.not_found(SM_CRD).await;
}

/// The pod template the operator applies for the fixture cluster (replicas do not change
/// it): an existing StatefulSet with it has no rollout to do.
fn current_template() -> Value {
    use kube::Resource;
    let c = fixtures::cluster(3, None);
    let owner = c.controller_owner_ref(&()).expect("uid");
    let config = serde_saphyr::to_string(&crate::resources::broker_config(&c)).expect("config");
    let sts = crate::resources::stateful_set(&c, &owner, 3, &config);
    serde_json::to_value(sts.spec.expect("spec").template).expect("template")
}

/// A settled StatefulSet: the current template, every pod updated, ready and available.
fn sts_with_replicas(replicas: i32) -> Value {
    json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "ringmq", "namespace": "default"},
           "spec": {"replicas": replicas, "serviceName": "ringmq-nodes", "selector": {}, "template": current_template(),
                    "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}},
           "status": {"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas,
                      "updatedReplicas": replicas, "currentRevision": "ringmq-1", "updateRevision": "ringmq-1"}})
}

/// A StatefulSet in a rollout: the current template applied at `partition`, `updated` pods
/// on the new revision, `available` pods ready for minReadySeconds, 3 pods.
fn sts_rolling(partition: i32, updated: i32, available: i32) -> Value {
    let mut sts = sts_with_replicas(3);
    sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"] = json!(partition);
    sts["status"]["updatedReplicas"] = json!(updated);
    sts["status"]["availableReplicas"] = json!(available);
    sts["status"]["readyReplicas"] = json!(available);
    sts["status"]["updateRevision"] = json!("ringmq-2");
    sts
}

/// Expects the StatefulSet apply, asserts its replicas, answers with the given pod counts.
async fn apply_sts(v: &mut ApiServerVerifier, want_replicas: i32, pods: i32, ready: i32) -> Value {
    let seen = v
        .expect_reply(Method::PATCH, STS, 200, |body| {
            let mut reply = body.clone();
            reply["status"] = json!({"replicas": pods, "readyReplicas": ready});
            reply
        })
        .await;
    assert!(seen.uri.contains("fieldManager=ringmq-operator"));
    assert_eq!(
        seen.body["spec"]["replicas"], want_replicas,
        "StatefulSet replicas"
    );
    assert!(
        seen.body["spec"]["template"]["spec"]
            .get("replicas")
            .is_none(),
        "replicas not in the pod template"
    );
    seen.body
}

/// Expects the status apply and answers with the whole object, as the API server does.
async fn status(v: &mut ApiServerVerifier) -> ClusterStatus {
    let seen = v
        .expect_reply(Method::PATCH, CLUSTER_STATUS, 200, |body| {
            let mut full =
                serde_json::to_value(fixtures::cluster(3, None)).expect("cluster serializes");
            full["status"] = body["status"].clone();
            full
        })
        .await;
    assert!(seen.uri.contains("fieldManager=ringmq-operator") && seen.uri.contains("force=true"));
    assert_eq!(seen.body["kind"], "Cluster");
    serde_json::from_value(seen.body["status"].clone()).expect("status parses")
}

fn condition<'a>(conditions: &'a [Condition], type_: &str) -> &'a Condition {
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .expect("condition present")
}

fn members(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("ringmq-{i}")).collect()
}

async fn cluster_and_secret(v: &mut ApiServerVerifier) {
    let c = serde_json::to_value(fixtures::cluster(3, None)).expect("cluster serializes");
    v.get(CLUSTER, c).await;
    v.get(&format!("{NS}/secrets/ringmq-default-user"), user_secret())
        .await;
}

async fn queue_status(v: &mut ApiServerVerifier) -> QueueStatus {
    let seen = v
        .expect_reply(Method::PATCH, QUEUE_STATUS, 200, |body| {
            let mut full = serde_json::to_value(fixtures::queue(json!({}), true, None))
                .expect("queue serializes");
            full["status"] = body["status"].clone();
            full
        })
        .await;
    assert!(seen.uri.contains("fieldManager=ringmq-operator") && seen.uri.contains("force=true"));
    assert_eq!(seen.body["kind"], "Queue");
    serde_json::from_value(seen.body["status"].clone()).expect("status parses")
}

/// One reconcile of Queue `q` that declares it: the Cluster and its Secret are read, the Event
/// `Declared` recorded and the status written. The reconcile's result, and that status.
async fn reconcile_declared(
    ctx: Arc<Context>,
    verifier: ApiServerVerifier,
    q: crate::crd::Queue,
) -> (
    Result<kube::runtime::controller::Action, super::Error>,
    QueueStatus,
) {
    run_scripted(
        verifier,
        queue::reconcile(Arc::new(q), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            v.event("Declared").await;
            let s = queue_status(&mut v).await;
            (v, s)
        },
    )
    .await
}
