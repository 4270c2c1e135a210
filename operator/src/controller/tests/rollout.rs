//! Rolling restarts: one broker at a time, each after quorum and every member is back.

use super::*;

/// One reconcile of the 3-broker fixture cluster against `existing` (the StatefulSet the API
/// server holds) and brokers `admin`; expects the Events named in `before` (ahead of the
/// StatefulSet apply) and `after` (behind it). Returns the applied partition and the status.
async fn reconcile_rollout(
    admin: FakeAdmin,
    previous: Option<ClusterStatus>,
    existing: Value,
    before: &'static [&'static str],
    after: &'static [&'static str],
) -> (i64, Value, ClusterStatus) {
    let (ctx, verifier) = Context::test(admin);
    let (result, out) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(fixtures::cluster(3, previous)), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            v.get(STS, existing).await;
            for reason in before {
                v.event(reason).await;
            }
            let sts = apply_sts(&mut v, 3, 3, 3).await;
            for reason in after {
                v.event(reason).await;
            }
            let s = status(&mut v).await;
            (v, (sts, s))
        },
    )
    .await;
    result.expect("reconcile succeeds");
    let (sts, status) = out;
    let partition = sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"]
        .as_i64()
        .expect("partition applied");
    (partition, sts, status)
}

fn healthy_brokers() -> FakeAdmin {
    let admin = FakeAdmin::default();
    admin.state().members = members(3);
    admin
}

#[tokio::test]
async fn a_template_change_restarts_one_broker_at_a_time_each_after_quorum_and_all_members_are_back()
 {
    // 1. The config changed: every pod is held (partition 3), minReadySeconds set.
    let mut old = sts_with_replicas(3);
    old["spec"]["template"] =
        json!({"metadata": {"annotations": {"ringmq.io/config-hash": "0000000000000000"}}});
    let (partition, sts, status1) =
        reconcile_rollout(healthy_brokers(), None, old, &[], &["ConfigChanged"]).await;
    assert_eq!(
        partition, 3,
        "no pod replaced by the StatefulSet on its own"
    );
    assert_eq!(sts["spec"]["minReadySeconds"], 10);
    assert_eq!(sts["spec"]["podManagementPolicy"], "OrderedReady");
    assert_eq!(sts["spec"]["updateStrategy"]["type"], "RollingUpdate");
    let rolling = status1
        .rolling_restart
        .clone()
        .expect("rolling restart recorded");
    assert_eq!(rolling.partition, 3);
    let reconciled = condition(&status1.conditions, "Reconciled");
    assert_eq!(
        (reconciled.status.as_str(), reconciled.reason.as_str()),
        ("False", "RollingRestart")
    );
    assert_eq!(condition(&status1.conditions, "Ready").status, "False");

    // 2. Whole cluster: the highest pod goes first.
    let (partition, _, status2) = reconcile_rollout(
        healthy_brokers(),
        Some(status1),
        sts_rolling(3, 0, 3),
        &["RestartingBroker"],
        &[],
    )
    .await;
    assert_eq!(partition, 2);
    let quorum = status2.quorum.clone().expect("quorum reported");
    assert!(quorum.has_quorum);
    assert_eq!(
        (quorum.voters, quorum.reported_by.as_str()),
        (3, "ringmq-0")
    );

    // 3. ringmq-2 is back on the new template, but the answering member lost quorum: hold.
    let no_quorum = healthy_brokers();
    no_quorum.state().no_quorum = true;
    let (partition, _, status3) = reconcile_rollout(
        no_quorum,
        Some(status2.clone()),
        sts_rolling(2, 1, 3),
        &[],
        &[],
    )
    .await;
    assert_eq!(partition, 2, "no restart without quorum");
    let waiting = status3
        .rolling_restart
        .clone()
        .expect("still rolling")
        .waiting_for;
    assert!(waiting.contains("no quorum"), "{waiting}");
    assert_eq!(
        condition(&status3.conditions, "Degraded").reason,
        "NoQuorum"
    );
    assert_eq!(status3.quorum.map(|q| q.has_quorum), Some(false));

    // 4. Quorum, but ringmq-2 has not caught up (joining): hold.
    let catching_up = healthy_brokers();
    catching_up.state().joining = vec!["ringmq-2".into()];
    let (partition, _, status4) = reconcile_rollout(
        catching_up,
        Some(status2.clone()),
        sts_rolling(2, 1, 3),
        &[],
        &[],
    )
    .await;
    assert_eq!(partition, 2, "no restart while a member is not running");
    let waiting = status4.rolling_restart.expect("still rolling").waiting_for;
    assert!(waiting.contains("ringmq-2"), "{waiting}");

    // 5. ringmq-2 back and running: ringmq-1 next.
    let (partition, _, _) = reconcile_rollout(
        healthy_brokers(),
        Some(status2.clone()),
        sts_rolling(2, 1, 3),
        &["RestartingBroker"],
        &[],
    )
    .await;
    assert_eq!(partition, 1);

    // 6. The StatefulSet recorded the new revision everywhere: done.
    let (partition, _, status6) = reconcile_rollout(
        healthy_brokers(),
        Some(status2),
        sts_with_replicas(3),
        &[],
        &["RollingRestartDone"],
    )
    .await;
    assert_eq!(partition, 0);
    assert_eq!(status6.rolling_restart, None);
    assert_eq!(condition(&status6.conditions, "Ready").status, "True");
}
