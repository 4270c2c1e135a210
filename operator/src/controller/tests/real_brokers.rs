//! The reconcilers and the status collector against running `ringmq-broker`s.

use super::*;
use crate::admin::AdminApi;

// The reconcilers and the status collector talk to a running `ringmq-broker`'s admin API;
// only the Kubernetes API server is scripted (none can run on these machines). Every
// cluster's admin endpoint names a Kubernetes Service that does not exist here, so the
// connector sends the calls to the test's broker, keeping the credentials the reconciler
// read from the cluster's Secret.

pub(super) struct RealBroker {
    pub(super) base_url: String,
    pub(super) http: crate::admin::HttpConnectorFactory,
}

impl AdminConnector for RealBroker {
    fn connect(&self, endpoint: crate::admin::AdminEndpoint) -> Arc<dyn crate::admin::AdminApi> {
        self.http.connect(crate::admin::AdminEndpoint {
            base_url: self.base_url.clone(),
            ..endpoint
        })
    }
}

/// A broker whose administrator is the fixture's default user (admin / s3cret).
fn real_broker() -> (ringmq_tests::Broker, Arc<RealBroker>) {
    let broker = ringmq_tests::Broker::start_with_config(
        "users:\n  - name: admin\n    password: s3cret\n    tags: [administrator]\n  - name: guest\n    password: guest\n    loopback_only: true\n    tags: [administrator]\n",
    );
    let connector = Arc::new(RealBroker {
        base_url: broker.admin_url(),
        http: Default::default(),
    });
    (broker, connector)
}

#[tokio::test]
async fn queue_reconciler_declares_on_a_real_broker_and_repairs_drift() {
    let (broker, connector) = real_broker();
    let (ctx, verifier) = Context::test_with(connector.clone());
    let q = fixtures::queue(
        json!({"vhost": "/", "arguments": {"x-max-length": 1000}}),
        true,
        None,
    );
    let (result, status) = reconcile_declared(ctx, verifier, q).await;
    result.expect("reconcile succeeds against the real broker");
    assert!(status.declared);
    assert!(
        status.primary.is_some(),
        "the broker names the queue's owner"
    );
    let api = connector.connect(crate::admin::AdminEndpoint {
        base_url: String::new(),
        username: "admin".into(),
        password: "s3cret".into(),
    });
    assert!(
        api.queue("/", "orders").await.unwrap().is_some(),
        "the queue exists on the broker"
    );
    let seen = broker
        .admin_client()
        .get("/api/queues/%2F/orders")
        .unwrap()
        .body;
    assert_eq!(seen["durable"], true, "{seen}");
    assert_eq!(seen["arguments"]["x-max-length"], 1000, "{seen}");

    // Deleted behind the operator's back: the next reconcile declares it again and says so.
    assert!(api.delete_queue("/", "orders").await.unwrap());
    let (ctx, verifier) = Context::test_with(connector.clone());
    let previous = QueueStatus {
        declared: true,
        ..QueueStatus::default()
    };
    let q = fixtures::queue(
        json!({"vhost": "/", "arguments": {"x-max-length": 1000}}),
        true,
        Some(previous),
    );
    let (result, event) = run_scripted(
        verifier,
        queue::reconcile(Arc::new(q), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            let e = v.event("DriftRepaired").await;
            let _ = queue_status(&mut v).await;
            (v, e)
        },
    )
    .await;
    result.expect("drift repair succeeds");
    assert_eq!(event.body["type"], "Warning");
    assert!(
        api.queue("/", "orders").await.unwrap().is_some(),
        "the queue is back on the broker"
    );
}

#[tokio::test]
async fn the_status_collector_reads_members_and_depth_from_a_real_broker() {
    let (broker, connector) = real_broker();
    let api = connector.connect(crate::admin::AdminEndpoint {
        base_url: String::new(),
        username: "admin".into(),
        password: "s3cret".into(),
    });
    let overview = api.overview().await.expect("overview");
    assert_eq!(overview.members.len(), 1);
    let me = overview.members[0].id.clone();
    let decl = crate::admin::QueueDeclaration {
        durable: true,
        auto_delete: false,
        arguments: Default::default(),
    };
    assert_eq!(
        api.declare_queue("/", "depth", &decl).await.unwrap(),
        crate::admin::Declared::Created
    );
    assert_eq!(
        api.declare_queue("/", "depth", &decl).await.unwrap(),
        crate::admin::Declared::AlreadyThere
    );
    let other = crate::admin::QueueDeclaration {
        durable: false,
        ..decl.clone()
    };
    assert!(matches!(
        api.declare_queue("/", "depth", &other).await,
        Err(crate::admin::AdminError::Conflict(_))
    ));
    let conn = lapin::Connection::connect(&broker.uri(), Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    for _ in 0..5 {
        ch.basic_publish(
            "".into(),
            "depth".into(),
            Default::default(),
            b"m",
            Default::default(),
        )
        .await
        .unwrap();
    }
    ch.basic_qos(0, Default::default()).await.unwrap();
    let info = api.queue("/", "depth").await.unwrap().unwrap();
    assert_eq!(info.messages, 5);
    assert_eq!(info.owner.as_deref(), Some(me.as_str()));
    let member = api.member(&me).await.unwrap().expect("the member is known");
    assert!(member.owned_queues >= 1, "{member:?}");
    assert!(api.member("no-such-member").await.unwrap().is_none());
    // A single broker has nobody to drain to: an error, never read as "drained".
    let refused = api.drain(&me).await.expect_err("nothing to drain to");
    assert!(refused.to_string().contains("400"), "{refused}");
    assert!(api.delete_queue("/", "depth").await.unwrap());
    assert!(!api.delete_queue("/", "depth").await.unwrap());
}

#[tokio::test]
async fn queue_backups_and_pinned_primary_reach_a_real_broker_as_declare_arguments() {
    let (broker, connector) = real_broker();
    let api = connector.connect(crate::admin::AdminEndpoint {
        base_url: String::new(),
        username: "admin".into(),
        password: "s3cret".into(),
    });
    let me = api.overview().await.expect("overview").node;
    assert!(!me.is_empty(), "the broker names itself");
    let (ctx, verifier) = Context::test_with(connector.clone());
    let q = fixtures::queue(
        json!({"backups": 2, "pinnedPrimary": me, "arguments": {"x-max-length": 10}}),
        true,
        None,
    );
    let (result, status) = reconcile_declared(ctx, verifier, q).await;
    result.expect("reconcile succeeds against the real broker");
    assert!(status.declared);
    assert_eq!(status.primary.as_deref(), Some(me.as_str()));
    let seen = broker
        .admin_client()
        .get("/api/queues/%2F/orders")
        .unwrap()
        .body;
    assert_eq!(seen["arguments"]["qpid.cluster.backups"], 2, "{seen}");
    assert_eq!(seen["arguments"]["qpid.cluster.primary"], me, "{seen}");
    assert_eq!(seen["arguments"]["x-max-length"], 10, "{seen}");

    // `fragmented` is the broker's fragmented-queue argument (on a single broker one queue).
    let (ctx, verifier) = Context::test_with(connector.clone());
    let q = fixtures::queue(json!({"name": "spread", "fragmented": true}), true, None);
    let (result, _) = reconcile_declared(ctx, verifier, q).await;
    result.expect("a fragmented queue is declared");
    let seen = broker
        .admin_client()
        .get("/api/queues/%2F/spread")
        .unwrap()
        .body;
    assert_eq!(seen["arguments"]["qpid.cluster.fragmented"], true, "{seen}");
    assert_eq!(seen["fragmented"], true, "{seen}");

    // Declared again with the same spec: the broker finds it equivalent (no conflict).
    let (ctx, verifier) = Context::test_with(connector.clone());
    let q = fixtures::queue(
        json!({"backups": 2, "pinnedPrimary": me, "arguments": {"x-max-length": 10}}),
        true,
        Some(status),
    );
    let (result, again) = run_scripted(
        verifier,
        queue::reconcile(Arc::new(q), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            let s = queue_status(&mut v).await;
            (v, s)
        },
    )
    .await;
    result.expect("the second declare is equivalent");
    assert_eq!(condition(&again.conditions, "Ready").status, "True");

    // A primary the cluster does not know: the broker refuses the declare and the reconcile
    // fails with its reason (retried with back-off; the queue is not created elsewhere).
    let (ctx, verifier) = Context::test_with(connector.clone());
    let q = fixtures::queue(
        json!({"name": "pinned-elsewhere", "pinnedPrimary": "ringmq-9"}),
        true,
        None,
    );
    let (result, ()) = run_scripted(
        verifier,
        queue::reconcile(Arc::new(q), ctx),
        |mut v| async move {
            cluster_and_secret(&mut v).await;
            (v, ())
        },
    )
    .await;
    let err = result.expect_err("an unknown member is refused");
    assert!(err.to_string().contains("ringmq-9"), "{err}");
    assert!(
        api.queue("/", "pinned-elsewhere").await.unwrap().is_none(),
        "nothing declared"
    );
}

#[tokio::test]
async fn the_rollout_gate_reads_quorum_and_members_from_a_real_three_member_cluster() {
    // Node ids ringmq-0..2, the pod names of a Cluster named ringmq; fixed ports, as a pod
    // keeps its DNS name across a restart.
    let secret = ringmq_tests::cluster::secret("operator-rollout");
    let mut members: Vec<ringmq_tests::Broker> = Vec::new();
    for i in 0..3 {
        let ports = ringmq_tests::Ports::allocate();
        let seeds: Vec<String> = members.iter().filter_map(|m| m.cluster.clone()).collect();
        let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
        let yaml = ringmq_tests::cluster::member_yaml(&format!("ringmq-{i}"), &seeds, &secret);
        let member = ringmq_tests::Broker::start_on_ports(&yaml, ports);
        member.wait_ready(std::time::Duration::from_secs(30));
        members.push(member);
    }
    let admin_of = |m: &ringmq_tests::Broker| real_admin(m, "guest", "guest");
    let api = admin_of(&members[0]);
    // A ready member may still be `joining` in the others' view (its snapshot of the cluster
    // map not delivered yet), or the group between leaders: a bounded wait for the settled
    // view.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut overview = api.overview().await;
    while std::time::Instant::now() < deadline {
        let settled = overview.as_ref().is_ok_and(|o| {
            o.cluster.as_ref().is_some_and(|c| c.leader.is_some())
                && crate::rollout::cluster_health(&Ok(o.clone()), "ringmq", 3).is_ok()
        });
        if settled {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        overview = api.overview().await;
    }
    let whole = overview.as_ref().expect("overview");
    let cluster = whole
        .cluster
        .clone()
        .expect("a clustered broker reports its group");
    assert!(cluster.quorum, "{whole:?}");
    assert_eq!(cluster.voters, 3, "{whole:?}");
    assert!(cluster.leader.is_some(), "{whole:?}");
    assert_eq!(whole.members.len(), 3, "{whole:?}");
    // The gate's verdict follows the member states the broker reports: open when all are
    // `running`. On a loaded machine a ready member can stay `joining` in the others' view
    // for over a minute (docs/operator.md): then the gate must name it.
    let joining: Vec<&str> = whole
        .members
        .iter()
        .filter(|m| m.state != "running")
        .map(|m| m.id.as_str())
        .collect();
    match crate::rollout::cluster_health(&overview, "ringmq", 3) {
        Ok(()) => assert!(joining.is_empty(), "{whole:?}"),
        Err(why) => {
            assert!(!joining.is_empty(), "{why}: {whole:?}");
            for id in &joining {
                assert!(why.contains(id), "{why}");
            }
            eprintln!("not every member running after 30 s; the gate holds: {why}");
        }
    }

    // ringmq-2 goes (a pod being replaced): the survivors keep quorum (2 of 3), and the gate
    // holds the next restart until ringmq-2 is back. Bounded wait for the failure detector.
    members[2].kill();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut last = None;
    while std::time::Instant::now() < deadline {
        let overview = api.overview().await;
        let health = crate::rollout::cluster_health(&overview, "ringmq", 3);
        if let Err(why) = &health {
            let o = overview.expect("the survivor answers");
            assert!(
                o.cluster.as_ref().is_some_and(|c| c.quorum),
                "two of three keep quorum: {o:?}"
            );
            assert!(why.contains("ringmq-2"), "{why}");
            // Killed, not drained: it still votes (its restart is the same voter), as the
            // fake's stopped voters do.
            let voters = o.cluster.as_ref().map(|c| c.voters);
            assert_eq!(voters, Some(3), "{o:?}");
            let fake = crate::fixtures::FakeAdmin::default();
            fake.state().members = vec!["ringmq-0".into(), "ringmq-1".into()];
            fake.state().stopped_voters = vec!["ringmq-2".into()];
            let faked = fake.overview().await.expect("the fake answers");
            assert_eq!(faked.cluster.map(|c| c.voters), voters);
            last = Some(health);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(
        last.is_some(),
        "the survivors still list ringmq-2 as running 20 s after it was killed"
    );

    // Not asserted here: the gate opening again once ringmq-2 is back. In about one loaded
    // run in eight, the survivors kept listing the restarted ringmq-2 as `joining` for over
    // 60 s while it listed itself `running` (the broker's membership, not the operator; see
    // docs/operator.md). The gate then holds the rollout and says which member it waits for.
    let _ = std::fs::remove_file(secret);
}

#[tokio::test]
async fn the_drain_call_empties_a_member_of_a_real_three_member_cluster() {
    // Node ids ringmq-0..2, the pod names of a Cluster named ringmq.
    let (mut members, _secret) = ringmq_tests::cluster::start_cluster("ringmq", 3);
    let admin_of = |m: &ringmq_tests::Broker| real_admin(m, "guest", "guest");
    let api = admin_of(&members[0]);
    for q in ["drain-a", "drain-b"] {
        let mut arguments = serde_json::Map::new();
        arguments.insert("qpid.cluster.primary".into(), "ringmq-2".into());
        arguments.insert("qpid.cluster.backups".into(), 1.into());
        let declaration = crate::admin::QueueDeclaration {
            durable: true,
            auto_delete: false,
            arguments,
        };
        api.declare_queue("/", q, &declaration)
            .await
            .expect("declared on ringmq-2");
    }
    let before = api.member("ringmq-2").await.unwrap().expect("a member");
    assert_eq!(before.primaries, 2, "{before:?}");
    assert!(before.holds() >= 2, "{before:?}");
    // Asked through another member than the one drained, and answered the same by all.
    admin_of(&members[1])
        .drain("ringmq-2")
        .await
        .expect("the drain is accepted");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let m = api
            .member("ringmq-2")
            .await
            .unwrap()
            .expect("still a member");
        if m.holds() == 0 {
            assert_eq!(m.state, "draining", "{m:?}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never drained: {m:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let seen_by_2 = admin_of(&members[2]).member("ringmq-2").await.unwrap();
    assert_eq!(seen_by_2.map(|m| m.holds()), Some(0));
    let moved = api.queue("/", "drain-a").await.unwrap().expect("the queue");
    assert_ne!(moved.owner.as_deref(), Some("ringmq-2"), "{moved:?}");
    assert!(
        admin_of(&members[0]).drain("no-such-member").await.is_err(),
        "an unknown member is an error, not a drain"
    );

    // Drained, it is still a live voter: the scale-down may remove its pod.
    let drained = api.overview().await;
    assert_eq!(
        crate::scale::settled("ringmq", 3, 3, &drained, false, true),
        Ok(()),
        "{drained:?}"
    );

    // Its pod goes (the shrink's one step): drained and holding nothing, it leaves the
    // voters on its way out, and the shrink sees the cluster whole at its new size — as
    // the fake answers for a member that left.
    members[2].terminate();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut overview = api.overview().await;
    while std::time::Instant::now() < deadline
        && crate::scale::settled("ringmq", 2, 2, &overview, false, false).is_err()
    {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        overview = api.overview().await;
    }
    let o = overview.expect("the survivors answer");
    let cluster = o.cluster.clone().expect("a clustered broker");
    assert_eq!((cluster.quorum, cluster.voters), (true, 2), "{o:?}");
    let fake = crate::fixtures::FakeAdmin::default();
    fake.state().members = vec!["ringmq-0".into(), "ringmq-1".into()];
    let faked = fake.overview().await.expect("the fake answers");
    assert_eq!(
        faked.cluster.map(|c| c.voters),
        Some(cluster.voters),
        "{o:?}"
    );

    // A scale-up brings the pod back on its data: it is admitted again, still drained, as
    // the fake lists a marked member; the undrain call makes it a running member.
    members[2].crash_and_restart();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let back = loop {
        let o = api.overview().await.expect("the survivors answer");
        if let Some(m) = o
            .members
            .iter()
            .find(|m| m.id == "ringmq-2" && m.state != "joining")
        {
            break m.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "ringmq-2 not back: {o:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(
        (back.state.as_str(), back.draining),
        ("draining", true),
        "{back:?}"
    );
    fake.state().members.push("ringmq-2".into());
    fake.state().draining = vec!["ringmq-2".into()];
    let faked = fake.overview().await.expect("the fake answers");
    let faked = faked.members.iter().find(|m| m.id == "ringmq-2").cloned();
    assert_eq!(
        faked.map(|m| (m.state, m.draining)),
        Some((back.state.clone(), back.draining))
    );
    api.undrain("ringmq-2").await.expect("undrained");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let m = api.member("ringmq-2").await.unwrap().expect("a member");
        if m.state == "running" && !m.draining {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "still drained: {m:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
