//! Deleting a Queue: its finalizer deletes it on the broker or retains it, and never hangs
//! on a Cluster that is gone or going.

use super::*;

fn deleting(extra: Value) -> crate::crd::Queue {
    let mut q = fixtures::queue(extra, true, None);
    q.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
    ));
    q
}

async fn finalizer_removed(v: &mut ApiServerVerifier) {
    let seen = v
        .expect(
            Method::PATCH,
            QUEUE,
            200,
            Some(serde_json::to_value(fixtures::queue(json!({}), false, None)).expect("queue")),
        )
        .await;
    assert!(
        seen.body.to_string().contains("remove"),
        "finalizer removed by JSON patch: {}",
        seen.body
    );
}

#[tokio::test]
async fn finalizer_deletes_the_queue_on_the_broker_then_releases() {
    let admin = FakeAdmin::default();
    admin.state().queues.insert(
        ("/".into(), "orders".into()),
        crate::admin::QueueDeclaration {
            durable: true,
            auto_delete: false,
            arguments: Default::default(),
        },
    );
    let (ctx, verifier) = Context::test(admin.clone());
    let (result, ()) = run_scripted(
        verifier,
        queue::reconcile(Arc::new(deleting(json!({}))), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            v.event("Deleted").await;
            finalizer_removed(&mut v).await;
            (v, ())
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert!(admin.state().queues.is_empty());
    assert_eq!(admin.state().calls, vec!["delete / orders"]);
}

#[tokio::test]
async fn finalizer_retains_the_queue_when_the_policy_says_retain() {
    let admin = FakeAdmin::default();
    let (ctx, verifier) = Context::test(admin.clone());
    let q = deleting(json!({"deletionPolicy": "retain"}));
    let (result, ()) = run_scripted(
        verifier,
        queue::reconcile(Arc::new(q), ctx),
        |mut v| async move {
            v.event("Retained").await;
            finalizer_removed(&mut v).await;
            (v, ())
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert!(admin.state().calls.is_empty(), "no admin call with retain");
}

#[tokio::test]
async fn finalizer_does_not_hang_when_the_cluster_is_gone() {
    let admin = FakeAdmin::default();
    let (ctx, verifier) = Context::test(admin.clone());
    let (result, ()) = run_scripted(
        verifier,
        queue::reconcile(Arc::new(deleting(json!({}))), ctx),
        |mut v| async move {
            v.not_found(CLUSTER).await;
            v.event("ClusterGone").await;
            finalizer_removed(&mut v).await;
            (v, ())
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert!(admin.state().calls.is_empty());
}

#[tokio::test]
async fn finalizer_does_not_hang_when_the_cluster_is_being_deleted() {
    let admin = FakeAdmin::default();
    let (ctx, verifier) = Context::test(admin.clone());
    let (result, ()) = run_scripted(
        verifier,
        queue::reconcile(Arc::new(deleting(json!({}))), ctx),
        |mut v| async move {
            let mut c = fixtures::cluster(3, None);
            c.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                ));
            v.get(CLUSTER, serde_json::to_value(c).expect("cluster"))
                .await;
            v.event("ClusterGone").await;
            finalizer_removed(&mut v).await;
            (v, ())
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert!(admin.state().calls.is_empty());
}
