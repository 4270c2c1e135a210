//! A Cluster's children, settings and watches: secrets, services, the ServiceMonitor, the
//! StatefulSet, config changes, a missing Secret, the watched namespace.

use super::*;

#[tokio::test]
async fn new_cluster_creates_secrets_children_and_statefulset_then_reports_status() {
    let admin = FakeAdmin::default();
    admin.state().members = members(3);
    let (ctx, verifier) = Context::test(admin.clone());
    let c = fixtures::cluster(3, None);
    let (result, status) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(c), ctx),
        |mut v| async move {
            v.not_found(&format!("{NS}/secrets/ringmq-cluster")).await;
            let created = v
                .expect(Method::POST, &format!("{NS}/secrets"), 201, None)
                .await;
            assert_eq!(
                created.body["metadata"]["ownerReferences"][0]["uid"],
                "cluster-uid"
            );
            assert_eq!(
                created.body["stringData"]["cluster-secret"]
                    .as_str()
                    .map(str::len),
                Some(64)
            );
            v.event("SecretCreated").await;
            v.not_found(&format!("{NS}/secrets/ringmq-default-user"))
                .await;
            let user = v
                .expect(Method::POST, &format!("{NS}/secrets"), 201, None)
                .await;
            assert_eq!(user.body["stringData"]["username"], "ringmq-admin");
            v.event_repeated("SecretCreated").await;
            let cm = v.apply(&format!("{NS}/configmaps/ringmq-config")).await;
            let yaml = cm.body["data"]["ringmq.yaml"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            assert!(
                yaml.contains("ringmq-nodes.default.svc:25672"),
                "seeds are the headless Service: {yaml}"
            );
            let headless = v.apply(&format!("{NS}/services/ringmq-nodes")).await;
            assert_eq!(headless.body["spec"]["clusterIP"], "None");
            assert_eq!(headless.body["spec"]["publishNotReadyAddresses"], true);
            let client = v.apply(&format!("{NS}/services/ringmq")).await;
            assert_eq!(client.body["spec"]["type"], "ClusterIP");
            assert_eq!(
                client.body["metadata"]["labels"]["ringmq.io/service"],
                "client"
            );
            let admin_svc = v.apply(&format!("{NS}/services/ringmq-admin")).await;
            assert_eq!(admin_svc.body["spec"]["type"], "ClusterIP");
            assert_eq!(admin_svc.body["spec"]["ports"][0]["port"], 15672);
            let pdb = v
                .apply("/apis/policy/v1/namespaces/default/poddisruptionbudgets/ringmq")
                .await;
            assert_eq!(pdb.body["spec"]["maxUnavailable"], 1);
            v.not_found(SM_CRD).await;
            v.not_found(STS).await;
            let sts = apply_sts(&mut v, 3, 3, 3).await;
            assert_eq!(sts["metadata"]["ownerReferences"][0]["controller"], true);
            let container = &sts["spec"]["template"]["spec"]["containers"][0];
            assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
            assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
            // The image has no shell: no exec hook; the broker leaves on SIGTERM.
            assert!(container["lifecycle"].is_null(), "{container}");
            assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
            let pod = &sts["spec"]["template"]["spec"];
            assert_eq!(pod["securityContext"]["runAsUser"], 10001);
            assert_eq!(pod["securityContext"]["fsGroup"], 10001);
            let ports: Vec<i64> = container["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["containerPort"].as_i64())
                .collect();
            assert_eq!(ports, vec![5672, 25672, 15672]);
            v.event("Created").await;
            let status = status(&mut v).await;
            (v, status)
        },
    )
    .await;
    result.expect("reconcile succeeds");
    assert_eq!(status.operation, None);
    assert_eq!(status.observed_generation, Some(2));
    assert_eq!(
        status.selector,
        "app.kubernetes.io/instance=ringmq,app.kubernetes.io/name=ringmq"
    );
    assert_eq!(condition(&status.conditions, "Ready").status, "True");
    assert_eq!(condition(&status.conditions, "Degraded").status, "False");
    assert_eq!(status.members.len(), 3);
    assert_eq!(status.ring.len(), 3);
    assert_eq!(
        admin.state().endpoints[0].base_url,
        "http://ringmq-admin.default.svc:15672",
        "the operator calls the admin Service, never the client Service"
    );
    assert_eq!(admin.state().endpoints[0].username, "ringmq-admin");
}

#[tokio::test]
async fn service_monitor_is_applied_only_when_its_crd_exists() {
    let admin = FakeAdmin::default();
    admin.state().members = members(3);
    let (ctx, verifier) = Context::test(admin);
    let c = fixtures::cluster(3, None);
    let (result, ()) = run_scripted(verifier, cluster::reconcile(Arc::new(c), ctx), |mut v| async move {
        v.get(&format!("{NS}/secrets/ringmq-cluster"), cluster_secret()).await;
        v.get(&format!("{NS}/secrets/ringmq-default-user"), user_secret()).await;
        v.apply(&format!("{NS}/configmaps/ringmq-config")).await;
        v.apply(&format!("{NS}/services/ringmq-nodes")).await;
        v.apply(&format!("{NS}/services/ringmq")).await;
        v.apply(&format!("{NS}/services/ringmq-admin")).await;
        v.apply("/apis/policy/v1/namespaces/default/poddisruptionbudgets/ringmq").await;
        v.get(SM_CRD, json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
            "spec": {"group": "monitoring.coreos.com", "names": {"kind": "ServiceMonitor", "plural": "servicemonitors"},
                     "scope": "Namespaced", "versions": []}}))
            .await;
        let sm = v.apply("/apis/monitoring.coreos.com/v1/namespaces/default/servicemonitors/ringmq").await;
        assert_eq!(sm.body["kind"], "ServiceMonitor");
        assert_eq!(sm.body["spec"]["endpoints"][0]["port"], "admin");
        // Only the headless Service carries this label: each broker is scraped once.
        assert_eq!(sm.body["spec"]["selector"]["matchLabels"]["ringmq.io/service"], "nodes");
        assert_eq!(sm.body["metadata"]["ownerReferences"][0]["uid"], "cluster-uid");
        v.get(STS, sts_with_replicas(3)).await;
        apply_sts(&mut v, 3, 3, 3).await;
        status(&mut v).await;
        (v, ())
    })
    .await;
    result.expect("reconcile succeeds");
}

#[tokio::test]
async fn a_config_change_is_announced_in_an_event() {
    let admin = FakeAdmin::default();
    admin.state().members = members(3);
    let (ctx, verifier) = Context::test(admin);
    let c = fixtures::cluster(3, None);
    let (result, ()) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(c), ctx),
        |mut v| async move {
            existing_children(&mut v).await;
            let mut old = sts_with_replicas(3);
            old["spec"]["template"] =
                json!({"metadata": {"annotations": {"ringmq.io/config-hash": "0000000000000000"}}});
            v.get(STS, old).await;
            apply_sts(&mut v, 3, 3, 3).await;
            v.event("ConfigChanged").await;
            status(&mut v).await;
            (v, ())
        },
    )
    .await;
    result.expect("reconcile succeeds");
}

#[tokio::test]
async fn a_missing_user_supplied_secret_fails_with_what_to_create() {
    let (ctx, verifier) = Context::test(FakeAdmin::default());
    let mut c = fixtures::cluster(3, None);
    c.spec.default_user_secret = Some("my-admin".into());
    let (result, ()) = run_scripted(
        verifier,
        cluster::reconcile(Arc::new(c), ctx),
        |mut v| async move {
            v.get(&format!("{NS}/secrets/ringmq-cluster"), cluster_secret())
                .await;
            v.not_found(&format!("{NS}/secrets/my-admin")).await;
            (v, ())
        },
    )
    .await;
    let err = result.expect_err("no secret, no cluster");
    assert_eq!(
        err.to_string(),
        "secret my-admin not found; create it with the keys username and password"
    );
    assert_eq!(err.metric_label(), "missing_secret");
}

#[tokio::test]
async fn watch_namespace_restricts_every_watch_to_that_namespace() {
    let (ctx, mut verifier) = Context::test(FakeAdmin::default());
    let controllers =
        tokio::spawn(async move { crate::controller::run(ctx, Some("team-a")).await });
    let want = [
        "/apis/ringmq.io/v1alpha1/namespaces/team-a/clusters",
        "/apis/ringmq.io/v1alpha1/namespaces/team-a/queues",
        "/apis/apps/v1/namespaces/team-a/statefulsets",
        "/api/v1/namespaces/team-a/services",
        "/api/v1/namespaces/team-a/configmaps",
        "/api/v1/namespaces/team-a/secrets",
        "/apis/policy/v1/namespaces/team-a/poddisruptionbudgets",
    ];
    let mut seen = std::collections::BTreeSet::new();
    // Bounded: the seven watchers list once each, then watch; a few retries at most.
    for _ in 0..40 {
        if want.iter().all(|p| seen.contains(*p)) {
            break;
        }
        let Some((method, path)) = verifier.next_any().await else {
            break;
        };
        assert_eq!(method, Method::GET, "{path}");
        assert!(
            path.contains("/namespaces/team-a/"),
            "a watch outside the namespace: {path}"
        );
        seen.insert(path);
    }
    controllers.abort();
    for path in want {
        assert!(seen.contains(path), "no watch on {path}; saw {seen:?}");
    }
}
