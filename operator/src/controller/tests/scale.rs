//! Scaling a Cluster: up (waiting for the members to join), down (draining the leaving
//! members first, then one pod at a time while the cluster keeps its quorum and voters),
//! blocked and forced.

use super::*;

#[tokio::test]
async fn scale_up_raises_statefulset_then_waits_for_members_to_join_across_a_restart() {
    // Reconcile 1: 3 -> 5 starts; pods are not ready yet.
    let admin = FakeAdmin::default();
    admin.state().members = members(3);
    let (ctx, verifier) = Context::test(admin.clone());
    let (result, status1) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(fixtures::cluster(5, None)), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, sts_with_replicas(3)).await;
            v.event("ScaleUpStarted").await;
            apply_sts(&mut v, 5, 5, 3).await;
            let s = status(&mut v).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    let op = status1.operation.clone().expect("operation recorded");
    assert_eq!(
        (op.kind, op.from, op.to, op.step),
        (
            OperationKind::ScaleUp,
            3,
            5,
            OperationStep::WaitingForMembers
        )
    );
    assert!(
        op.waiting_for
            .as_deref()
            .is_some_and(|w| w.contains("ringmq-3, ringmq-4")),
        "{op:?}"
    );
    assert_eq!(condition(&status1.conditions, "Reconciled").status, "False");

    // Operator restarts. Reconcile 2 resumes from status: members joined, pods ready.
    let admin = FakeAdmin::default();
    admin.state().members = members(5);
    let (ctx, verifier) = Context::test(admin);
    let c = fixtures::cluster(5, Some(status1));
    let (result, status2) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(c), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, sts_with_replicas(5)).await;
            apply_sts(&mut v, 5, 5, 5).await;
            v.event("ScaledUp").await;
            let s = status(&mut v).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(status2.operation, None);
    assert_eq!(condition(&status2.conditions, "Ready").status, "True");
    assert_eq!(status2.ring.len(), 5);
}

#[tokio::test]
async fn a_scale_up_undrains_the_pods_an_earlier_scale_down_drained_and_no_other() {
    // ringmq-3 comes back with its drain mark from the scale-down that removed it;
    // ringmq-1 was drained by hand and stays drained.
    let admin = FakeAdmin::default();
    admin.state().members = members(4);
    admin.state().draining = vec!["ringmq-1".into(), "ringmq-3".into()];
    let (ctx, verifier) = Context::test(admin.clone());
    let (result, (undrained, status1)) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(fixtures::cluster(4, None)), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, sts_with_replicas(3)).await;
            v.event("ScaleUpStarted").await;
            apply_sts(&mut v, 4, 4, 3).await;
            let undrained = v.event("Undrained").await;
            let s = status(&mut v).await;
            (v, (undrained, s))
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert!(
        undrained.body["note"]
            .as_str()
            .is_some_and(|n| n.starts_with("ringmq-3 came back drained")),
        "{}",
        undrained.body
    );
    assert_eq!(admin.state().calls, vec!["overview", "undrain ringmq-3"]);
    assert_eq!(admin.state().draining, vec!["ringmq-1".to_string()]);
    assert!(
        status1.operation.is_some(),
        "ringmq-3's pod is not ready yet"
    );
}

#[tokio::test]
async fn scale_down_drains_then_removes_one_pod_at_a_time_once_the_last_one_stopped_voting() {
    // Reconcile 1: 5 -> 3; the highest, ringmq-4, still owns queues, so the StatefulSet
    // stays at 5 and only ringmq-4 is drained (a drained broker is not ready, and the
    // StatefulSet removes a pod only while the pods before it are).
    let admin = FakeAdmin::default();
    admin.state().members = members(5);
    admin.state().owned.insert("ringmq-4".to_string(), 2);
    let (ctx, verifier) = Context::test(admin.clone());
    let (result, status1) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(fixtures::cluster(3, None)), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, sts_with_replicas(5)).await;
            v.event("ScaleDownStarted").await;
            let blocked = v.event("ScaleDownBlocked").await;
            assert_eq!(blocked.body["type"], "Warning");
            let note = blocked.body["note"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            assert!(note.contains("ringmq-4 holds 2 queues"), "{note}");
            assert!(note.contains("ringmq.io/force-scale-down=true"), "{note}");
            apply_sts(&mut v, 5, 5, 5).await;
            let s = status(&mut v).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    let blocked = condition(&status1.conditions, "ScaleDownBlocked");
    assert_eq!(
        (blocked.status.as_str(), blocked.reason.as_str()),
        ("True", "MemberOwnsQueues")
    );
    assert!(
        blocked.message.contains("ringmq-4 holds 2 queues"),
        "{blocked:?}"
    );
    assert_eq!(
        admin.state().calls,
        vec!["overview", "member ringmq-4", "drain ringmq-4"]
    );
    let op = status1.operation.clone().expect("operation recorded");
    assert_eq!(
        (op.kind, op.from, op.to, op.step),
        (OperationKind::ScaleDown, 5, 3, OperationStep::Draining)
    );
    assert_eq!(status1.drained_by_scale_down, ["ringmq-4"]);

    // Restart. Reconcile 2: drained now (marked, holding nothing), so the StatefulSet
    // drops ringmq-4, one pod only.
    let admin = FakeAdmin::default();
    admin.state().members = members(5);
    admin.state().owned.insert("ringmq-4".into(), 0);
    admin.state().draining = vec!["ringmq-4".into()];
    let (ctx, verifier) = Context::test(admin.clone());
    let c = fixtures::cluster(3, Some(status1));
    let (result, (removing, status2)) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(c), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, sts_with_replicas(5)).await;
            v.event("Drained").await;
            let removing = v.event("RemovingBroker").await;
            apply_sts(&mut v, 4, 5, 5).await;
            let s = status(&mut v).await;
            (v, (removing, s))
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert!(
        removing.body["note"]
            .as_str()
            .is_some_and(|n| n.contains("removing it (1 more after it)")),
        "{}",
        removing.body
    );
    assert_eq!(admin.state().calls, vec!["overview", "member ringmq-4"]);
    let op = status2.operation.clone().expect("operation recorded");
    assert_eq!(op.step, OperationStep::ShrinkingStatefulSet);
    assert_eq!(
        condition(&status2.conditions, "ScaleDownBlocked").status,
        "False"
    );

    // Restart. Reconcile 3: ringmq-4's pod is still terminating; nothing more goes, and
    // nobody else is drained.
    let admin = FakeAdmin::default();
    admin.state().members = members(4);
    let (ctx, verifier) = Context::test(admin.clone());
    let mut terminating = sts_with_replicas(4);
    terminating["status"]["replicas"] = json!(5);
    let c = fixtures::cluster(3, Some(status2));
    let (result, status3) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(c), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, terminating).await;
            apply_sts(&mut v, 4, 5, 4).await;
            let s = status(&mut v).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(admin.state().calls, vec!["overview"]);
    let waiting = status3.operation.clone().and_then(|op| op.waiting_for);
    assert!(
        waiting
            .as_deref()
            .is_some_and(|w| w.contains("ringmq-4 and up to stop")),
        "{waiting:?}"
    );

    // Reconcile 4: the pod is gone but its broker still votes (its retirement not committed
    // yet): four live voters of five survive only one more failure, so ringmq-3 is not
    // drained yet.
    let admin = FakeAdmin::default();
    admin.state().members = members(4);
    admin.state().stopped_voters = vec!["ringmq-4".into()];
    let (ctx, verifier) = Context::test(admin.clone());
    let c = fixtures::cluster(3, Some(status3));
    let (result, status4) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(c), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, sts_with_replicas(4)).await;
            apply_sts(&mut v, 4, 4, 4).await;
            let s = status(&mut v).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(admin.state().calls, vec!["overview"]);
    let waiting = status4.operation.clone().and_then(|op| op.waiting_for);
    assert!(
        waiting
            .as_deref()
            .is_some_and(|w| w.contains("5 consensus voters for 4 brokers")),
        "{waiting:?}"
    );
    let stale = condition(&status4.conditions, "ScaleDownBlocked");
    assert_eq!(
        (stale.status.as_str(), stale.reason.as_str()),
        ("True", "StaleVoters")
    );

    // Reconcile 5: ringmq-4 left the voters; ringmq-3 holds nothing but has no drain mark
    // yet, without which it would not leave the voters when it stops: it is drained first.
    let admin = FakeAdmin::default();
    admin.state().members = members(4);
    admin.state().owned.insert("ringmq-3".into(), 0);
    let (ctx, verifier) = Context::test(admin.clone());
    let c = fixtures::cluster(3, Some(status4));
    let (result, status5) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(c), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, sts_with_replicas(4)).await;
            apply_sts(&mut v, 4, 4, 4).await;
            let s = status(&mut v).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(
        admin.state().calls,
        vec!["overview", "member ringmq-3", "drain ringmq-3"]
    );
    assert_eq!(status5.drained_by_scale_down, ["ringmq-4", "ringmq-3"]);

    // Reconcile 6: marked and empty, ringmq-3 goes.
    admin.state().calls.clear();
    let (ctx, verifier) = Context::test(admin.clone());
    let c = fixtures::cluster(3, Some(status5));
    let (result, status5) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(c), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, sts_with_replicas(4)).await;
            v.event("Drained").await;
            v.event("RemovingBroker").await;
            apply_sts(&mut v, 3, 4, 4).await;
            let s = status(&mut v).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(admin.state().calls, vec!["overview", "member ringmq-3"]);
    assert!(status5.operation.is_some());

    // Reconcile 6: three pods, three members, three voters: done.
    let admin = FakeAdmin::default();
    admin.state().members = members(3);
    let (ctx, verifier) = Context::test(admin.clone());
    let c = fixtures::cluster(3, Some(status5));
    let (result, status6) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(c), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, sts_with_replicas(3)).await;
            apply_sts(&mut v, 3, 3, 3).await;
            v.event("ScaledDown").await;
            let s = status(&mut v).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(status6.operation, None);
    assert_eq!(status6.replicas, 3);
    assert_eq!(
        status6.drained_by_scale_down,
        ["ringmq-4", "ringmq-3"],
        "gone, and drained should they come back"
    );
}

#[tokio::test]
async fn a_broker_a_scale_down_drained_is_undrained_once_the_cluster_keeps_it_again() {
    // A scale-down to 3 drained ringmq-4 and ringmq-3; the Cluster now wants 4 brokers: the
    // scale-up undrains ringmq-3 (not yet started) before its pod comes, not ringmq-4.
    let admin = FakeAdmin::default();
    admin.state().members = members(3);
    admin.state().draining = vec!["ringmq-3".into(), "ringmq-4".into()];
    let earlier = ClusterStatus {
        drained_by_scale_down: vec!["ringmq-4".into(), "ringmq-3".into()],
        ..ClusterStatus::default()
    };
    let (ctx, verifier) = Context::test(admin.clone());
    let (result, status1) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(fixtures::cluster(4, Some(earlier))), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, sts_with_replicas(3)).await;
            v.event("ScaleUpStarted").await;
            v.event("Undrained").await;
            apply_sts(&mut v, 4, 4, 3).await;
            let s = status(&mut v).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(admin.state().calls, vec!["overview", "undrain ringmq-3"]);
    assert_eq!(admin.state().draining, ["ringmq-4"]);
    assert_eq!(status1.drained_by_scale_down, ["ringmq-4"]);
}

#[tokio::test]
async fn a_blocked_scale_down_warns_once_and_the_force_annotation_removes_the_member_anyway() {
    // Blocked, and already said so in the last reconcile: no second Event for the same cause.
    let admin = FakeAdmin::default();
    admin.state().members = members(4);
    admin.state().owned.insert("ringmq-3".to_string(), 2);
    let blocked = ClusterStatus {
        operation: Some(crate::crd::Operation {
            kind: OperationKind::ScaleDown,
            from: 4,
            to: 3,
            step: OperationStep::Draining,
            waiting_for: Some(
                "leaving members to hand over their queues: ringmq-3 holds 2 queues".into(),
            ),
        }),
        ..ClusterStatus::default()
    };
    let (ctx, verifier) = Context::test(admin.clone());
    let (result, status1) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(fixtures::cluster(3, Some(blocked.clone()))), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, sts_with_replicas(4)).await;
            apply_sts(&mut v, 4, 4, 4).await;
            let s = status(&mut v).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(
        status1.operation.map(|op| op.step),
        Some(OperationStep::Draining)
    );

    // Forced: the member is still asked to drain, then the StatefulSet shrinks.
    let mut forced = fixtures::cluster(3, Some(blocked));
    forced.metadata.annotations = Some(
        [(
            cluster::FORCE_SCALE_DOWN_ANNOTATION.to_string(),
            "true".to_string(),
        )]
        .into(),
    );
    let (ctx, verifier) = Context::test(admin.clone());
    admin.state().calls.clear();
    let (result, (event, status2)) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(forced), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, sts_with_replicas(4)).await;
            let e = v.event("ForcedScaleDown").await;
            v.event("RemovingBroker").await;
            apply_sts(&mut v, 3, 4, 4).await;
            let s = status(&mut v).await;
            (v, (e, s))
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(event.body["type"], "Warning");
    assert!(
        event.body["note"]
            .as_str()
            .is_some_and(|n| n.contains("ringmq-3 holds 2 queues")),
        "{}",
        event.body
    );
    assert_eq!(
        admin.state().calls,
        vec!["overview", "member ringmq-3", "drain ringmq-3"]
    );
    assert_eq!(
        status2.operation.map(|op| op.step),
        Some(OperationStep::ShrinkingStatefulSet)
    );
    assert_eq!(
        condition(&status2.conditions, "ScaleDownBlocked").status,
        "False"
    );
}
