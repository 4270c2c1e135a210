//! The objects a `Cluster` owns, checked against the Kubernetes JSON schemas with the PyPI
//! `kubernetes-validate` tool (strict mode, Kubernetes 1.33, the oldest version supported).
//!
//! No API server runs here, so this is the closest check of what `kubectl apply` would
//! accept. The tool is installed by `pip install kubernetes-validate` (see
//! docs/operator.md); without it the test says so and passes, because the build must not
//! depend on Python.

use std::process::Command;

use kube::Resource;
use ringmq_operator::crd::Cluster;
use ringmq_operator::resources;

fn production_cluster() -> Cluster {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/cluster-production.yaml"
    ))
    .expect("example exists");
    let mut cluster: Cluster = serde_saphyr::from_str(&text).expect("example parses");
    cluster.meta_mut().namespace = Some("messaging".into());
    cluster.meta_mut().uid = Some("0b6f7c8e-1111-2222-3333-444455556666".into());
    cluster
}

#[test]
fn owned_objects_pass_kubernetes_validate_strict() {
    let cluster = production_cluster();
    let owner = cluster.controller_owner_ref(&()).expect("uid set");
    let config =
        serde_saphyr::to_string(&resources::broker_config(&cluster)).expect("config renders");
    let objects = [
        serde_json::to_value(resources::config_map(&cluster, &owner, &config)),
        serde_json::to_value(resources::headless_service(&cluster, &owner)),
        serde_json::to_value(resources::client_service(&cluster, &owner)),
        serde_json::to_value(resources::pod_disruption_budget(&cluster, &owner)),
        serde_json::to_value(resources::stateful_set(&cluster, &owner, 5, &config)),
    ];
    let dir = std::env::temp_dir().join(format!("ringmq-k8s-schemas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut files = Vec::new();
    for (i, object) in objects.into_iter().enumerate() {
        let object = object.expect("object serializes");
        assert!(
            object["apiVersion"].is_string() && object["kind"].is_string(),
            "typed objects carry their kind"
        );
        let path = dir.join(format!("{i}.json"));
        std::fs::write(&path, serde_json::to_vec_pretty(&object).expect("json")).expect("write");
        files.push(path);
    }
    let run = Command::new("kubernetes-validate")
        .args(["--strict", "-k", "1.33.0"])
        .args(&files)
        .output();
    let _ = std::fs::remove_dir_all(&dir);
    match run {
        Err(e) => eprintln!(
            "kubernetes-validate not runnable ({e}); install it with `pip install kubernetes-validate`"
        ),
        Ok(out) => assert!(
            out.status.success(),
            "kubernetes-validate rejected an owned object:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}
