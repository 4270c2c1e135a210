//! The Queue reconciler: finalizer first, declare through the admin API, drift repaired,
//! conflicts reported, a missing Cluster waited for.

use super::*;

#[tokio::test]
async fn queue_without_finalizer_gets_one_first() {
    let (ctx, verifier) = Context::test(FakeAdmin::default());
    let q = fixtures::queue(json!({}), false, None);
    let (result, ()) = run_scripted(
        verifier,
        queue::reconcile(Arc::new(q), ctx),
        |mut v| async move {
            let seen = v
                .expect(
                    Method::PATCH,
                    QUEUE,
                    200,
                    Some(
                        serde_json::to_value(fixtures::queue(json!({}), true, None))
                            .expect("queue"),
                    ),
                )
                .await;
            assert!(
                seen.body.to_string().contains("ringmq.io/queue"),
                "finalizer added: {}",
                seen.body
            );
            (v, ())
        },
    )
    .await;
    result.expect("reconcile succeeds");
}

#[tokio::test]
async fn queue_is_declared_through_the_admin_api_and_status_reports_primary_and_depth() {
    let admin = FakeAdmin::default();
    let (ctx, verifier) = Context::test(admin.clone());
    let q = fixtures::queue(
        json!({"vhost": "/", "arguments": {"x-max-length": 1000}}),
        true,
        None,
    );
    let (result, status) = reconcile_declared(ctx, verifier, q).await;
    result.expect("reconcile succeeds");
    assert!(status.declared);
    assert_eq!(status.primary.as_deref(), Some("ringmq-1"));
    assert_eq!(status.messages, 7);
    let state = admin.state();
    assert_eq!(state.calls, vec!["declare / orders", "get / orders"]);
    let declared = &state.queues[&("/".to_string(), "orders".to_string())];
    assert!(declared.durable);
    assert_eq!(declared.arguments["x-max-length"], 1000);
    assert_eq!(state.endpoints[0].username, "admin");
}

#[tokio::test]
async fn queue_deleted_behind_the_operators_back_is_redeclared_with_a_warning_event() {
    let admin = FakeAdmin::default(); // the broker has no such queue any more
    let (ctx, verifier) = Context::test(admin.clone());
    let previous = QueueStatus {
        declared: true,
        ..QueueStatus::default()
    };
    let q = fixtures::queue(json!({}), true, Some(previous));
    let (result, (event, status)) = run_scripted(
        verifier,
        queue::reconcile(Arc::new(q), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            let e = v.event("DriftRepaired").await;
            let s = queue_status(&mut v).await;
            (v, (e, s))
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(event.body["type"], "Warning");
    assert!(status.declared);
    assert_eq!(admin.state().queues.len(), 1);
}

#[tokio::test]
async fn queue_already_present_is_left_alone_without_events() {
    let admin = FakeAdmin::default();
    let q = fixtures::queue(
        json!({}),
        true,
        Some(QueueStatus {
            declared: true,
            ..QueueStatus::default()
        }),
    );
    admin.state().queues.insert(
        ("/".into(), "orders".into()),
        crate::admin::QueueDeclaration {
            durable: true,
            auto_delete: false,
            arguments: Default::default(),
        },
    );
    let (ctx, verifier) = Context::test(admin);
    let (result, status) = run_scripted(
        verifier,
        queue::reconcile(Arc::new(q), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            let s = queue_status(&mut v).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert!(status.declared);
}

#[tokio::test]
async fn conflicting_queue_is_reported_not_retried_hot() {
    let admin = FakeAdmin::default();
    admin.state().queues.insert(
        ("/".into(), "orders".into()),
        crate::admin::QueueDeclaration {
            durable: false,
            auto_delete: false,
            arguments: Default::default(),
        },
    );
    let (ctx, verifier) = Context::test(admin);
    let q = fixtures::queue(json!({}), true, None);
    let (result, status) = run_scripted(
        verifier,
        queue::reconcile(Arc::new(q), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            v.event("Conflict").await;
            let s = queue_status(&mut v).await;
            (v, s)
        },
    )
    .await;
    let action = result.expect("a conflict is a status, not an error");
    assert_eq!(
        action,
        kube::runtime::controller::Action::requeue(queue::CONFLICT_WAIT)
    );
    assert!(!status.declared);
    assert_eq!(condition(&status.conditions, "Ready").reason, "Conflict");
}

#[tokio::test]
async fn queue_waits_for_a_missing_cluster() {
    let (ctx, verifier) = Context::test(FakeAdmin::default());
    let q = fixtures::queue(json!({}), true, None);
    let (result, status) = run_scripted(
        verifier,
        queue::reconcile(Arc::new(q), ctx),
        |mut v| async move {
            v.not_found(CLUSTER).await;
            let s = queue_status(&mut v).await;
            (v, s)
        },
    )
    .await;
    assert_eq!(
        result.expect("ok"),
        kube::runtime::controller::Action::requeue(queue::CLUSTER_WAIT)
    );
    assert_eq!(
        condition(&status.conditions, "Ready").reason,
        "ClusterNotFound"
    );
}
