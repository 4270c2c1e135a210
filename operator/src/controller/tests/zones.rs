//! Broker pods labelled with their node's zone: a scheduled pod gets the label (empty for
//! a node without a zone), a labelled or unscheduled one is left alone.

use super::*;
use k8s_openapi::api::core::v1::Pod;

const POD: &str = "/api/v1/namespaces/default/pods/ringmq-0";

fn pod(node: Option<&str>, zone: Option<&str>) -> Pod {
    let mut labels = json!({"app.kubernetes.io/name": "ringmq"});
    if let Some(z) = zone {
        labels["topology.kubernetes.io/zone"] = json!(z);
    }
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "ringmq-0", "namespace": "default", "labels": labels},
        "spec": {"containers": [{"name": "ringmq"}], "nodeName": node},
    }))
    .expect("fixture pod")
}

fn node(zone: Option<&str>) -> Value {
    let labels = match zone {
        Some(z) => json!({"topology.kubernetes.io/zone": z}),
        None => json!({}),
    };
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": labels}})
}

async fn labelled(node_zone: Option<&str>, pod_zone: Option<&str>) -> Option<Value> {
    let (ctx, verifier) = Context::test(FakeAdmin::default());
    let p = pod(Some("n1"), pod_zone);
    let reply = serde_json::to_value(&p).expect("pod");
    let patched = pod_zone != Some(node_zone.unwrap_or(""));
    let node_object = node(node_zone);
    let (result, seen) = run_scripted(
        verifier,
        zone::reconcile(Arc::new(p), ctx),
        |mut v| async move {
            v.get("/api/v1/nodes/n1", node_object).await;
            let seen = if patched {
                Some(v.expect(Method::PATCH, POD, 200, Some(reply)).await.body)
            } else {
                None
            };
            (v, seen)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    seen
}

#[tokio::test]
async fn a_scheduled_pod_gets_its_nodes_zone_once() {
    let patch = labelled(Some("eu-west-1a"), None).await.expect("labelled");
    assert_eq!(
        patch,
        json!({"metadata": {"labels": {"topology.kubernetes.io/zone": "eu-west-1a"}}})
    );
    assert!(
        labelled(Some("eu-west-1a"), Some("eu-west-1a"))
            .await
            .is_none()
    );
    // A node without a zone: the label is there but empty, so the broker stops waiting.
    let patch = labelled(None, None).await.expect("labelled");
    assert_eq!(
        patch["metadata"]["labels"]["topology.kubernetes.io/zone"],
        ""
    );
}

#[tokio::test]
async fn an_unscheduled_pod_is_left_alone() {
    let (ctx, verifier) = Context::test(FakeAdmin::default());
    let (result, ()) = run_scripted(
        verifier,
        zone::reconcile(Arc::new(pod(None, None)), ctx),
        |v| async move { (v, ()) },
    )
    .await;
    result.expect("reconcile succeeds");
}
