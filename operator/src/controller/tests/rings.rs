//! The BackupRing reconciler: the ring and the proposal in the status, a rebalance started
//! only when approved (the annotation then removed) or, `Automatic`, beyond the threshold
//! or after a layout change; the spec's layout set on the brokers once, a refusal reported.

use super::*;
use crate::admin::{LayoutOrder, PlannedMove, RebalanceProgress, RebalanceView};
use crate::crd::{APPROVE_ANNOTATION, BackupRing, BackupRingSpec, BackupRingStatus};
use kube::Resource;

const RING: &str = "/apis/ringmq.io/v1alpha1/namespaces/default/backuprings/ringmq";
const RING_STATUS: &str = "/apis/ringmq.io/v1alpha1/namespaces/default/backuprings/ringmq/status";

fn ring(spec: Value, approved: bool) -> BackupRing {
    let mut spec_json = json!({"clusterRef": {"name": "ringmq"}});
    if let (Some(base), Some(extra)) = (spec_json.as_object_mut(), spec.as_object()) {
        base.extend(extra.clone());
    }
    let spec: BackupRingSpec = serde_json::from_value(spec_json).expect("fixture spec");
    let mut r = BackupRing::new("ringmq", spec);
    r.meta_mut().namespace = Some("default".into());
    r.meta_mut().generation = Some(1);
    if approved {
        r.meta_mut().annotations = Some([(APPROVE_ANNOTATION.into(), "approve".into())].into());
    }
    r
}

/// A broker whose cluster has its thirty queues' primaries on `primaries` per member.
fn admin_with(primaries: [u64; 3], current: Option<&str>) -> FakeAdmin {
    let admin = FakeAdmin::default();
    {
        let mut s = admin.state();
        s.members = members(3);
        let fewest = *primaries.iter().min().unwrap();
        let plan: Vec<PlannedMove> = (0..(primaries[0] - fewest))
            .map(|i| PlannedMove {
                vhost: "/".into(),
                queue: format!("q{i}"),
                kind: "primary".into(),
                from: "ringmq-0".into(),
                to: "ringmq-1".into(),
            })
            .collect();
        s.rebalance = RebalanceView {
            balanced: plan.is_empty(),
            primaries: members(3).into_iter().zip(primaries).collect(),
            plan,
            current: current.map(|status| RebalanceProgress {
                status: status.into(),
                total: 4,
                done: 1,
                running: 2,
                pending: 1,
                ..RebalanceProgress::default()
            }),
            ..RebalanceView::default()
        };
    }
    admin
}

async fn ring_status(v: &mut ApiServerVerifier, r: &BackupRing) -> BackupRingStatus {
    let object = serde_json::to_value(r).expect("ring serializes");
    let seen = v
        .expect_reply(Method::PATCH, RING_STATUS, 200, |body| {
            let mut full = object.clone();
            full["status"] = body["status"].clone();
            full
        })
        .await;
    assert!(seen.uri.contains("fieldManager=ringmq-operator") && seen.uri.contains("force=true"));
    assert_eq!(seen.body["kind"], "BackupRing");
    serde_json::from_value(seen.body["status"].clone()).expect("status parses")
}

/// The approval annotation removed by a merge patch.
async fn approval_removed(v: &mut ApiServerVerifier, r: &BackupRing) {
    let object = serde_json::to_value(r).expect("ring serializes");
    let seen = v.expect(Method::PATCH, RING, 200, Some(object)).await;
    assert_eq!(
        seen.body,
        json!({"metadata": {"annotations": {APPROVE_ANNOTATION: null}}})
    );
}

#[tokio::test]
async fn a_manual_ring_shows_its_proposal_and_starts_nothing_unapproved() {
    let admin = admin_with([30, 0, 0], None);
    let (ctx, verifier) = Context::test(admin.clone());
    let r = ring(json!({}), false);
    let (result, status) = run_scripted(
        verifier,
        backup_ring::reconcile(Arc::new(r.clone()), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            let s = ring_status(&mut v, &r).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(admin.state().calls, ["overview", "rebalance"]);
    assert!(!status.balanced);
    let proposal = status.proposal.expect("a proposal");
    assert_eq!((proposal.moves, proposal.primary_moves), (30, 30));
    assert_eq!(proposal.sample.len(), 10);
    assert_eq!(proposal.sample[0], "//q0: ringmq-0 -> ringmq-1");
    assert_eq!(status.ring.len(), 3);
    let balanced = condition(&status.conditions, "Balanced");
    assert_eq!(
        (balanced.status.as_str(), balanced.reason.as_str()),
        ("False", "Proposed")
    );
    assert!(balanced.message.contains("ringmq.io/rebalance=approve"));
}

#[tokio::test]
async fn an_approved_proposal_is_started_and_the_approval_consumed() {
    let admin = admin_with([30, 0, 0], Some("done"));
    let (ctx, verifier) = Context::test(admin.clone());
    let r = ring(json!({"rebalance": {"concurrency": 4}}), true);
    let (result, (event, status)) = run_scripted(
        verifier,
        backup_ring::reconcile(Arc::new(r.clone()), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            let e = v.event("RebalanceStarted").await;
            approval_removed(&mut v, &r).await;
            let s = ring_status(&mut v, &r).await;
            (v, (e, s))
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(
        admin.state().calls,
        ["overview", "rebalance", "start-rebalance 4", "rebalance"]
    );
    assert!(event.body["note"].as_str().unwrap().contains("approved"));
    assert_eq!(status.rebalance.expect("the new one").status, "running");
    let balanced = condition(&status.conditions, "Balanced");
    assert_eq!(balanced.reason, "Rebalancing");
}

#[tokio::test]
async fn an_approval_while_one_runs_starts_nothing_and_is_consumed() {
    let admin = admin_with([30, 0, 0], Some("running"));
    let (ctx, verifier) = Context::test(admin.clone());
    let r = ring(json!({}), true);
    let (result, status) = run_scripted(
        verifier,
        backup_ring::reconcile(Arc::new(r.clone()), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            v.event("NothingApproved").await;
            approval_removed(&mut v, &r).await;
            let s = ring_status(&mut v, &r).await;
            (v, s)
        },
    )
    .await;
    let action = result.expect("reconcile succeeds");
    assert_eq!(admin.state().calls, ["overview", "rebalance"]);
    let progress = status.rebalance.expect("the one under way");
    assert_eq!((progress.done, progress.left), (1, 3));
    assert_eq!(
        action,
        kube::runtime::controller::Action::requeue(backup_ring::RUNNING_CHECK)
    );
}

#[tokio::test]
async fn an_automatic_ring_rebalances_only_beyond_its_threshold() {
    // 11 / 9 / 10: a spread of 2, within a threshold of 2.
    let admin = admin_with([11, 9, 10], None);
    let (ctx, verifier) = Context::test(admin.clone());
    let r = ring(
        json!({"rebalance": {"mode": "Automatic", "threshold": 2}}),
        false,
    );
    let first = r.clone();
    let (result, status) = run_scripted(
        verifier,
        backup_ring::reconcile(Arc::new(r.clone()), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            let s = ring_status(&mut v, &first).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(admin.state().calls, ["overview", "rebalance"]);
    assert_eq!(
        condition(&status.conditions, "Balanced").reason,
        "WithinThreshold"
    );

    // 30 / 0 / 0: started without any approval, nothing to remove.
    let admin = admin_with([30, 0, 0], None);
    let (ctx, verifier) = Context::test(admin.clone());
    let (result, status) = run_scripted(
        verifier,
        backup_ring::reconcile(Arc::new(r.clone()), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            let e = v.event("RebalanceStarted").await;
            assert!(e.body["note"].as_str().unwrap().contains("automatic"));
            let s = ring_status(&mut v, &r).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(
        admin.state().calls,
        ["overview", "rebalance", "start-rebalance 2", "rebalance"]
    );
    assert_eq!(status.rebalance.expect("started").status, "running");
}

/// Three real brokers with node ids `ringmq-0..2` (the pods of a Cluster named ringmq), each
/// with the fixtures' administrator (admin / s3cret), their cluster secret named `secret`.
fn ringmq_cluster(secret: &str) -> (Vec<ringmq_tests::Broker>, std::path::PathBuf) {
    let secret = ringmq_tests::cluster::secret(secret);
    let users = "users:\n  - name: admin\n    password: s3cret\n    tags: [administrator]\n";
    let mut members: Vec<ringmq_tests::Broker> = Vec::new();
    for i in 0..3 {
        let seeds: Vec<String> = members.iter().filter_map(|m| m.cluster.clone()).collect();
        let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
        let yaml = ringmq_tests::cluster::member_yaml(&format!("ringmq-{i}"), &seeds, &secret);
        members.push(ringmq_tests::Broker::start_with_config(&(yaml + users)));
    }
    for m in &members {
        m.wait_ready(std::time::Duration::from_secs(30));
    }
    (members, secret)
}

/// The reconciler and the admin client against a real three-member cluster: thirty queues
/// declared through one member, an approved proposal started through another, and the
/// brokers carry it out to even primaries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approved_rebalance_evens_a_real_three_member_cluster() {
    let (members, secret) = ringmq_cluster("operator-ring");
    let admin_of = |m: &ringmq_tests::Broker| real_admin(m, "admin", "s3cret");
    let first = admin_of(&members[0]);
    let decl = crate::admin::QueueDeclaration {
        durable: true,
        auto_delete: false,
        arguments: Default::default(),
    };
    for i in 0..30 {
        first
            .declare_queue("/", &format!("ring-{i:02}"), &decl)
            .await
            .unwrap();
    }
    let view = first.rebalance().await.expect("the view");
    assert!(!view.balanced, "{view:?}");
    assert_eq!(view.primaries["ringmq-0"], 30, "{view:?}");
    assert_eq!(view.plan.len(), 20, "{view:?}");

    let connector = Arc::new(super::real_brokers::RealBroker {
        base_url: members[1].admin_url(),
        http: crate::admin::HttpConnectorFactory::default(),
    });
    let (ctx, verifier) = Context::test_with(connector);
    let r = ring(json!({"rebalance": {"concurrency": 4}}), true);
    let (result, status) = run_scripted(
        verifier,
        backup_ring::reconcile(Arc::new(r.clone()), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            v.event("RebalanceStarted").await;
            approval_removed(&mut v, &r).await;
            let s = ring_status(&mut v, &r).await;
            (v, s)
        },
    )
    .await;
    result.expect("reconcile succeeds against the real cluster");
    let ids: Vec<&str> = status.ring.iter().map(|m| m.member.as_str()).collect();
    assert_eq!(ids, ["ringmq-0", "ringmq-1", "ringmq-2"], "ring order");
    assert!(status.rebalance.is_some(), "{status:?}");

    // A second start while the first has moves left is refused as busy, or, if the first
    // is over already, has nothing to do.
    match admin_of(&members[2]).start_rebalance(2).await {
        Ok(()) | Err(crate::admin::AdminError::Busy(_)) => {}
        Err(e) => panic!("{e}"),
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let view = loop {
        let view = admin_of(&members[2]).rebalance().await.expect("the view");
        if view.balanced && view.current.as_ref().is_some_and(|c| c.status == "done") {
            break view;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not balanced after 30 s: {view:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert!(view.primaries.values().all(|n| *n == 10), "{view:?}");
    let _ = std::fs::remove_file(&secret);
}

/// A fake cluster whose primaries are even (10 / 10 / 10); `backup_moves` backups off
/// their primaries' ring successors make it unbalanced.
fn even_admin(backup_moves: usize) -> FakeAdmin {
    let admin = admin_with([10, 10, 10], None);
    {
        let mut s = admin.state();
        s.rebalance.backup_plan = (0..backup_moves)
            .map(|i| PlannedMove {
                vhost: "/".into(),
                queue: format!("q{i}"),
                kind: "backup".into(),
                from: "ringmq-0".into(),
                to: "ringmq-2".into(),
            })
            .collect();
        s.rebalance.balanced = backup_moves == 0;
    }
    admin
}

#[tokio::test]
async fn a_rings_order_and_backups_reach_the_brokers_once_and_a_refusal_is_reported() {
    let admin = even_admin(0);
    let order = json!({"policy": "Explicit", "members": ["ringmq-2", "ringmq-0", "ringmq-1"]});
    let r = ring(json!({"order": order, "backups": 2}), false);
    for round in 0..2 {
        let (ctx, verifier) = Context::test(admin.clone());
        let seen = r.clone();
        let (result, status) = run_scripted(
            verifier,
            backup_ring::reconcile(Arc::new(r.clone()), ctx),
            |mut v| async move {
                cluster_and_secret(&mut v).await;
                if round == 0 {
                    let e = v.event("LayoutApplied").await;
                    let note = e.body["note"].as_str().unwrap().to_owned();
                    assert!(
                        note.contains(r#"["ringmq-2","ringmq-0","ringmq-1"]"#),
                        "{note}"
                    );
                }
                let s = ring_status(&mut v, &seen).await;
                (v, s)
            },
        )
        .await;
        result.expect("reconcile succeeds");
        let layout = status.layout.expect("the layout in the status");
        assert_eq!(layout.policy, "Explicit");
        assert_eq!(layout.members, ["ringmq-2", "ringmq-0", "ringmq-1"]);
        assert_eq!(layout.backups, Some(2));
        assert!(layout.followed, "balanced: nothing to move");
        let applied = condition(&status.conditions, "LayoutApplied");
        assert_eq!(
            (applied.status.as_str(), applied.reason.as_str()),
            ("True", "Applied")
        );
    }
    // Set once; the second round found it in place.
    let calls = admin.state().calls.clone();
    assert_eq!(
        calls,
        [
            "overview",
            "ring-layout",
            r#"set-ring-layout ["ringmq-2","ringmq-0","ringmq-1"] Some(2)"#,
            "rebalance",
            "overview",
            "ring-layout",
            "rebalance"
        ]
    );
    assert_eq!(admin.state().members, ["ringmq-2", "ringmq-0", "ringmq-1"]);

    // A member twice: the brokers refuse it, the operator says why and keeps going.
    let twice = json!({"policy": "Explicit", "members": ["ringmq-0", "ringmq-0"]});
    let r = ring(json!({"order": twice}), false);
    let (ctx, verifier) = Context::test(admin.clone());
    let (result, status) = run_scripted(
        verifier,
        backup_ring::reconcile(Arc::new(r.clone()), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            let e = v.event("LayoutRefused").await;
            assert_eq!(e.body["type"], "Warning");
            let s = ring_status(&mut v, &r).await;
            (v, s)
        },
    )
    .await;
    result.expect("a refused layout is reported, not retried as an error");
    let refused = condition(&status.conditions, "LayoutApplied");
    assert_eq!(
        (refused.status.as_str(), refused.reason.as_str()),
        ("False", "Refused")
    );
    assert!(
        refused.message.contains("listed twice"),
        "{}",
        refused.message
    );
    assert_eq!(
        status.layout.expect("as the brokers hold it").policy,
        "Explicit"
    );
}

#[tokio::test]
async fn an_automatic_ring_rebalances_once_after_its_layout_changed() {
    // Even primaries, well within the threshold, but a new order leaves three backups off
    // their primaries' successors: the rebalance starts anyway, once.
    let admin = even_admin(3);
    let r = ring(
        json!({"order": {"policy": "ZoneAware"}, "rebalance": {"mode": "Automatic", "threshold": 5}}),
        false,
    );
    for round in 0..2 {
        let (ctx, verifier) = Context::test(admin.clone());
        let seen = r.clone();
        let (result, status) = run_scripted(
            verifier,
            backup_ring::reconcile(Arc::new(r.clone()), ctx),
            |mut v| async move {
                cluster_and_secret(&mut v).await;
                if round == 0 {
                    v.event("LayoutApplied").await;
                    let e = v.event("RebalanceStarted").await;
                    assert!(e.body["note"].as_str().unwrap().contains("automatic"));
                }
                let s = ring_status(&mut v, &seen).await;
                (v, s)
            },
        )
        .await;
        result.expect("reconcile succeeds");
        let layout = status.layout.expect("the layout");
        assert_eq!(layout.policy, "ZoneAware");
        assert!(
            !layout.followed,
            "the rebalance under way has not put the backups there yet"
        );
    }
    assert_eq!(
        admin.state().calls,
        [
            "overview",
            "ring-layout",
            r#"set-ring-layout "zone-aware" None"#,
            "rebalance",
            "start-rebalance 2",
            "rebalance",
            "overview",
            "ring-layout",
            "rebalance"
        ]
    );
}

/// The admin client's layout calls against a real three-member cluster, and the fake's
/// answers to the same calls: the same order, ring and `k`, and the same refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layout_calls_behave_on_a_real_cluster_as_the_fake_answers_them() {
    let (brokers, secret) = ringmq_cluster("operator-layout");
    let admin_of = |m: &ringmq_tests::Broker| real_admin(m, "admin", "s3cret");
    let fake = FakeAdmin::default();
    fake.state().members = members(3);
    let real = admin_of(&brokers[1]);
    let apis: [&dyn crate::admin::AdminApi; 2] = [real.as_ref(), &fake];
    let explicit = LayoutOrder::Explicit(vec!["ringmq-2".into(), "ringmq-1".into()]);
    let twice = LayoutOrder::Explicit(vec!["ringmq-0".into(), "ringmq-0".into()]);
    let mut answers = Vec::new();
    for api in apis {
        let first = api.ring_layout().await.expect("the layout");
        let set = api.set_ring_layout(&explicit, Some(2)).await.expect("set");
        let zone = LayoutOrder::Named("zone-aware".into());
        let zoned = api.set_ring_layout(&zone, None).await.expect("zone-aware");
        let sideways = LayoutOrder::Named("sideways".into());
        let nameless = LayoutOrder::Explicit(vec!["ringmq-0".into(), String::new()]);
        let refusals: Vec<String> = [
            api.set_ring_layout(&twice, None).await,
            api.set_ring_layout(&explicit, Some(7)).await,
            api.set_ring_layout(&sideways, None).await,
            api.set_ring_layout(&nameless, None).await,
            // Both wrong: each names the same one first.
            api.set_ring_layout(&sideways, Some(9)).await,
            api.set_ring_layout(&twice, Some(9)).await,
        ]
        .into_iter()
        .map(|r| match r {
            Err(crate::admin::AdminError::Unexpected {
                status: 400, body, ..
            }) => serde_json::from_str::<Value>(&body).unwrap()["reason"]
                .as_str()
                .unwrap()
                .to_owned(),
            other => panic!("not a 400: {other:?}"),
        })
        .collect();
        let last = api.ring_layout().await.expect("the layout");
        assert!(set.changed_at > first.changed_at && zoned.changed_at > set.changed_at);
        assert_eq!(
            last.changed_at, zoned.changed_at,
            "a refusal changes nothing"
        );
        let strip = |l: crate::admin::RingLayout| (l.order, l.backups, l.ring);
        answers.push((
            strip(first),
            strip(set),
            strip(zoned),
            refusals,
            strip(last),
        ));
    }
    assert_eq!(answers[0], answers[1], "the real cluster, then the fake");
    let (_, set, ..) = &answers[0];
    assert_eq!(set.2, ["ringmq-2", "ringmq-1", "ringmq-0"]);
    // Any member answers the same.
    let other = admin_of(&brokers[0]).ring_layout().await.unwrap();
    assert_eq!(
        (other.order, other.ring),
        (LayoutOrder::Named("zone-aware".into()), set.2.clone())
    );
    let _ = std::fs::remove_file(&secret);
}
