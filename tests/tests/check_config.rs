//! `ringmq-broker --check-config` (issue #17): it accepts every `Cluster` example's
//! `spec.config` and the configuration the operator writes for it — the ConfigMap's
//! `ringmq.yaml` with the pod's environment, built by the operator's own functions — and
//! refuses a bad key or flag with a message naming it, without starting anything.

use k8s_openapi::api::core::v1::Container;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use ringmq_operator::crd::Cluster;
use ringmq_operator::resources;
use ringmq_tests::binary;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A scratch directory for one test, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("ringmq-check-config-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch dir");
        Self(dir)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("a scratch file");
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `ringmq-broker --check-config` with `args` and exactly the environment `env` (the
/// caller's `RINGMQ_*` variables must not leak in).
fn check_config(args: &[&str], env: &[(String, String)]) -> Output {
    let mut cmd = Command::new(binary("ringmq-broker"));
    cmd.env_clear().arg("--check-config").args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("ringmq-broker runs")
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Every `kind: Cluster` document of `examples/*.yaml`, with its file name.
fn cluster_examples() -> Vec<(String, serde_json::Value)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut found = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    entries.sort();
    for path in entries {
        let yaml = std::fs::read_to_string(&path).expect("an example");
        let doc: serde_json::Value = serde_saphyr::from_str(&yaml)
            .unwrap_or_else(|e| panic!("{} is not YAML: {e}", path.display()));
        if doc["kind"] == "Cluster" {
            let name = path.file_name().expect("a file").to_string_lossy().into();
            found.push((name, doc));
        }
    }
    found
}

/// The pod environment the operator's StatefulSet gives container `c` of pod `pod`: plain
/// values, the pod name for `metadata.name`, a stand-in for each Secret key, and `$(VAR)`
/// references expanded as the kubelet does.
fn pod_env(c: &Container, pod: &str) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = Vec::new();
    for var in c.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(v), _) => v.clone(),
            (None, Some(from))
                if from
                    .field_ref
                    .as_ref()
                    .is_some_and(|f| f.field_path == "metadata.name") =>
            {
                pod.to_owned()
            }
            (None, Some(from)) if from.secret_key_ref.is_some() => format!("secret-{}", var.name),
            _ => panic!("an env var this test cannot resolve: {var:?}"),
        };
        let value = env
            .iter()
            .fold(value, |v, (k, known)| v.replace(&format!("$({k})"), known));
        env.push((var.name.clone(), value));
    }
    env
}

#[test]
fn every_cluster_example_and_the_operators_config_for_it_pass_check_config() {
    let scratch = Scratch::new("examples");
    let examples = cluster_examples();
    assert!(
        examples.iter().any(|(f, _)| f == "cluster-production.yaml") && examples.len() >= 2,
        "the Cluster examples are found: {:?}",
        examples.iter().map(|(f, _)| f).collect::<Vec<_>>()
    );
    for (file, doc) in examples {
        // The example's own `spec.config`, alone, is a broker config.
        let own = serde_saphyr::to_string(&doc["spec"]["config"]).expect("YAML");
        let own = if doc["spec"]["config"].is_null() {
            String::new()
        } else {
            own
        };
        let path = scratch.write(&format!("{file}.own.yaml"), &own);
        let data = scratch.0.join("data");
        let out = check_config(
            &[
                "--config",
                path.to_str().expect("utf-8"),
                "--data-dir",
                data.to_str().expect("utf-8"),
            ],
            &[],
        );
        assert!(
            out.status.success(),
            "{file}: spec.config refused:\n{own}\n{}",
            text(&out)
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("configuration OK"),
            "{}",
            text(&out)
        );
        assert!(!data.exists(), "--check-config created the data dir");

        // What the operator writes for it: the ConfigMap's ringmq.yaml, and the pod's env.
        let mut cluster: Cluster = serde_json::from_value(doc.clone())
            .unwrap_or_else(|e| panic!("{file} is not a Cluster: {e}"));
        cluster.metadata.namespace = Some("default".into());
        let yaml = serde_saphyr::to_string(&resources::broker_config(&cluster)).expect("YAML");
        let config = scratch.write(&format!("{file}.operator.yaml"), &yaml);
        let pod = format!("{}-0", doc["metadata"]["name"].as_str().expect("a name"));
        let owner = OwnerReference {
            api_version: "ringmq.io/v1alpha1".into(),
            kind: "Cluster".into(),
            name: pod.trim_end_matches("-0").into(),
            uid: "uid".into(),
            controller: Some(true),
            ..OwnerReference::default()
        };
        let sts = resources::stateful_set(&cluster, &owner, 3, &yaml);
        let pod_spec = sts.spec.and_then(|s| s.template.spec).expect("a pod spec");
        let container = &pod_spec.containers[0];
        let mut env = pod_env(container, &pod);
        // The ConfigMap is mounted at RINGMQ_CONFIG in the pod; here it is the scratch file.
        let config_var = env
            .iter_mut()
            .find(|(k, _)| k == "RINGMQ_CONFIG")
            .expect("RINGMQ_CONFIG is set");
        config_var.1 = config.to_str().expect("utf-8").to_owned();
        let out = check_config(
            &container
                .args
                .clone()
                .unwrap_or_default()
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
            &env,
        );
        assert!(
            out.status.success(),
            "{file}: the operator's config refused:\n{yaml}\nenv {env:?}\n{}",
            text(&out)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains(&format!("node {pod}"))
                && stdout.contains("cluster: member on 0.0.0.0:25672"),
            "{file}: the pod's node id and the cluster port are taken: {stdout}"
        );
    }
}

#[test]
fn an_unknown_key_is_refused_with_a_message_naming_it_and_nothing_starts() {
    let scratch = Scratch::new("unknown-key");
    // The keys examples/cluster-production.yaml had, which made its pods crash-loop.
    let config = scratch.write("bad.yaml", "max_frame_bytes: 131072\nheartbeat_s: 30\n");
    let data = scratch.0.join("data");
    let out = check_config(
        &[
            "--config",
            config.to_str().expect("utf-8"),
            "--data-dir",
            data.to_str().expect("utf-8"),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("max_frame_bytes")
            && stderr.contains("bad.yaml")
            && stderr.contains("README.md"),
        "the message names the key, the file and where the keys are listed: {stderr}"
    );
    assert!(out.stdout.is_empty(), "{}", text(&out));
    assert!(!data.exists(), "--check-config created the data dir");
}

#[test]
fn flags_and_environment_are_checked_as_a_start_checks_them() {
    // A cluster port without the shared secret: refused, naming the flag and the key.
    let out = check_config(&["--cluster-listen", "127.0.0.1:25672"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--cluster-secret-file") && stderr.contains("cluster_secret_file"),
        "{stderr}"
    );
    // The same through the environment, completed by the secret: accepted (the file is not
    // read: it only exists where the broker runs).
    let env = [
        (
            "RINGMQ_CLUSTER_LISTEN".to_owned(),
            "0.0.0.0:25672".to_owned(),
        ),
        (
            "RINGMQ_CLUSTER_SECRET_FILE".to_owned(),
            "/nonexistent/secret".to_owned(),
        ),
        ("RINGMQ_NODE_ID".to_owned(), "node-a".to_owned()),
    ];
    let out = check_config(&[], &env);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("node node-a") && stdout.contains("member on 0.0.0.0:25672"),
        "{stdout}"
    );
    // A value clap cannot parse is refused by clap with the flag's name.
    let out = check_config(&["--amqp-listen", "not-an-address"], &[]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--amqp-listen"),
        "{}",
        text(&out)
    );
}
