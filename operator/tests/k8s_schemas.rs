//! The objects a `Cluster` owns, checked against the Kubernetes JSON schemas with the PyPI
//! `kubernetes-validate` tool (strict mode, Kubernetes 1.33, the oldest version supported).
//!
//! No API server runs here, so this is the closest check of what `kubectl apply` would
//! accept. The tool runs as `$RINGMQ_PYTHON -m kubernetes_validate` (`python3` when the
//! variable is unset); `scripts/test` installs it into a venv and sets the variable. Without
//! it the test fails saying what to install: a schema check that passes when it cannot check
//! anything would hide a broken StatefulSet.

use std::process::Command;

use kube::Resource;
use ringmq_operator::crd::Cluster;
use ringmq_operator::resources;

/// The Python interpreter that has `kubernetes_validate`: `$RINGMQ_PYTHON`, else `python3`.
/// Panics naming what to install when it cannot import it. (The same rule as
/// `ringmq_tests::prereq::python_with`, which this crate does not depend on.)
fn python_with_kubernetes_validate() -> String {
    let python = std::env::var("RINGMQ_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".into());
    let out = Command::new(&python)
        .args(["-c", "import kubernetes_validate"])
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "this test needs Python with kubernetes-validate, but `{python}` does not run \
                 ({e}): run the tests with `scripts/test`, which makes a venv with it and sets \
                 RINGMQ_PYTHON, or point RINGMQ_PYTHON at a python3 that has it"
            )
        });
    assert!(
        out.status.success(),
        "this test needs the Python package kubernetes-validate, which `{python}` cannot import: \
         run the tests with `scripts/test`, which installs it into a venv and sets RINGMQ_PYTHON, \
         or `{python} -m pip install kubernetes-validate` (see tests/clients/requirements.txt)\n{}",
        String::from_utf8_lossy(&out.stderr).trim_end()
    );
    python
}

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
    let python = python_with_kubernetes_validate();
    let cluster = production_cluster();
    let owner = cluster.controller_owner_ref(&()).expect("uid set");
    let config =
        serde_saphyr::to_string(&resources::broker_config(&cluster)).expect("config renders");
    let objects = [
        serde_json::to_value(resources::config_map(&cluster, &owner, &config)),
        serde_json::to_value(resources::headless_service(&cluster, &owner)),
        serde_json::to_value(resources::client_service(&cluster, &owner)),
        serde_json::to_value(resources::admin_service(&cluster, &owner)),
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
    let run = Command::new(&python)
        .args(["-m", "kubernetes_validate", "--strict", "-k", "1.33.0"])
        .args(&files)
        .output();
    let _ = std::fs::remove_dir_all(&dir);
    let out = run.unwrap_or_else(|e| panic!("{python} -m kubernetes_validate: {e}"));
    assert!(
        out.status.success(),
        "kubernetes-validate rejected an owned object:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
