//! The CRDs in `crds/` match the Rust types, and the examples validate against them.
//!
//! No API server runs here, so validation is done locally: a structural check of the
//! generated openAPIV3Schema (types, required, enums, ranges, unknown fields) and the CEL
//! rules evaluated with kube's client-side CEL validator.

use std::path::PathBuf;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use ringmq_operator::crd::{BackupRing, Cluster, Queue, render_yaml};
use serde_json::{Value, json};

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

fn schema_of(crd: &CustomResourceDefinition) -> Value {
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("schema");
    serde_json::to_value(schema).expect("schema serializes")
}

/// Structural validation of `value` against an OpenAPI v3 schema; returns every violation.
fn validate(schema: &Value, value: &Value, path: &str, errors: &mut Vec<String>) {
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&json!(true))
        && schema.get("type").is_none()
    {
        return;
    }
    if value.is_null() {
        if schema.get("nullable") != Some(&json!(true)) {
            errors.push(format!("{path}: null not allowed"));
        }
        return;
    }
    if schema.get("x-kubernetes-int-or-string") == Some(&json!(true)) {
        if !(value.is_i64() || value.is_u64() || value.is_string()) {
            errors.push(format!("{path}: want int or string"));
        }
        return;
    }
    let ok = match schema.get("type").and_then(Value::as_str) {
        Some("object") => value.is_object(),
        Some("array") => value.is_array(),
        Some("string") => value.is_string(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("number") => value.is_number(),
        Some("boolean") => value.is_boolean(),
        _ => true,
    };
    if !ok {
        errors.push(format!("{path}: want {}, got {value}", schema["type"]));
        return;
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        errors.push(format!("{path}: {value} not in {allowed:?}"));
    }
    if let Some(n) = value.as_f64() {
        if schema
            .get("minimum")
            .and_then(Value::as_f64)
            .is_some_and(|min| n < min)
        {
            errors.push(format!("{path}: {n} below minimum {}", schema["minimum"]));
        }
        if schema
            .get("maximum")
            .and_then(Value::as_f64)
            .is_some_and(|max| n > max)
        {
            errors.push(format!("{path}: {n} above maximum {}", schema["maximum"]));
        }
    }
    if let (Some(s), Some(min)) = (
        value.as_str(),
        schema.get("minLength").and_then(Value::as_u64),
    ) && (s.chars().count() as u64) < min
    {
        errors.push(format!("{path}: shorter than {min}"));
    }
    if let Some(obj) = value.as_object() {
        for key in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            if !obj.contains_key(key) {
                errors.push(format!("{path}: missing required {key}"));
            }
        }
        let properties = schema.get("properties").and_then(Value::as_object);
        for (key, child) in obj {
            let child_path = format!("{path}.{key}");
            match (
                properties.and_then(|p| p.get(key)),
                schema.get("additionalProperties"),
            ) {
                (Some(s), _) => validate(s, child, &child_path, errors),
                (None, Some(s)) if s.is_object() => validate(s, child, &child_path, errors),
                (None, _)
                    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&json!(true)) => {
                }
                (None, _)
                    if path.is_empty()
                        && matches!(key.as_str(), "apiVersion" | "kind" | "metadata") => {}
                (None, _) => errors.push(format!("{child_path}: unknown field")),
            }
        }
    }
    if let (Some(items), Some(array)) = (schema.get("items"), value.as_array()) {
        for (i, item) in array.iter().enumerate() {
            validate(items, item, &format!("{path}[{i}]"), errors);
        }
    }
}

fn check(crd: &CustomResourceDefinition, object: &Value, old: Option<&Value>) -> Vec<String> {
    let schema = schema_of(crd);
    let mut errors = Vec::new();
    validate(&schema, object, "", &mut errors);
    if let Err(e) = kube::core::cel::Validator::new().validate(&schema, object, old) {
        errors.push(format!("CEL: {e}"));
    }
    errors
}

fn load(path: &str) -> Value {
    let text = std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("read {path}: {e}"));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("parse {path}: {e}"))
}

#[test]
fn crds_directory_matches_the_generated_crds() {
    let generated = render_yaml().expect("CRDs render");
    let on_disk =
        std::fs::read_to_string(repo("crds/ringmq.yaml")).expect("crds/ringmq.yaml exists");
    assert!(
        generated == on_disk,
        "crds/ringmq.yaml is stale: run `cargo run -p ringmq-operator --bin crdgen > crds/ringmq.yaml` \
         and copy it to charts/ringmq-operator/crds/"
    );
    let chart = std::fs::read_to_string(repo("charts/ringmq-operator/crds/ringmq.yaml"))
        .expect("chart CRDs exist");
    assert!(
        generated == chart,
        "charts/ringmq-operator/crds/ringmq.yaml is stale: copy crds/ringmq.yaml there"
    );
}

#[test]
fn generated_crds_parse_back_and_carry_scale_and_printer_columns() {
    let text = render_yaml().expect("CRDs render");
    let docs: Vec<CustomResourceDefinition> = text
        .split("---\n")
        .filter(|d| !d.trim().is_empty())
        .map(|d| serde_saphyr::from_str(d).expect("each document is a CRD"))
        .collect();
    assert_eq!(docs.len(), 3);
    let cluster = &docs[0].spec.versions[0];
    let scale = cluster
        .subresources
        .as_ref()
        .and_then(|s| s.scale.as_ref())
        .expect("scale subresource");
    assert_eq!(scale.spec_replicas_path, ".spec.replicas");
    assert_eq!(
        scale.label_selector_path.as_deref(),
        Some(".status.selector")
    );
    assert!(
        cluster
            .additional_printer_columns
            .as_ref()
            .is_some_and(|c| c.iter().any(|c| c.name == "Ready"))
    );
    assert!(
        docs[1].spec.versions[0]
            .additional_printer_columns
            .as_ref()
            .is_some_and(|c| c.iter().any(|c| c.name == "Primary"))
    );
    assert!(
        docs[2].spec.versions[0]
            .additional_printer_columns
            .as_ref()
            .is_some_and(|c| c.iter().any(|c| c.name == "Balanced"))
    );
}

#[test]
fn every_example_validates_against_the_generated_schema_and_deserializes() {
    let examples = [
        ("examples/cluster.yaml", Cluster::crd()),
        ("examples/cluster-production.yaml", Cluster::crd()),
        ("examples/queue.yaml", Queue::crd()),
        ("examples/queue-retain.yaml", Queue::crd()),
        ("examples/backupring.yaml", BackupRing::crd()),
    ];
    for (path, crd) in examples {
        let object = load(path);
        assert_eq!(object["apiVersion"], "ringmq.io/v1alpha1", "{path}");
        assert_eq!(object["kind"], crd.spec.names.kind, "{path}");
        let errors = check(&crd, &object, None);
        assert!(errors.is_empty(), "{path}: {errors:#?}");
    }
    let _: Cluster =
        serde_json::from_value(load("examples/cluster-production.yaml")).expect("typed Cluster");
    let _: Queue = serde_json::from_value(load("examples/queue.yaml")).expect("typed Queue");
    let ring: BackupRing =
        serde_json::from_value(load("examples/backupring.yaml")).expect("typed BackupRing");
    assert_eq!(ring.spec.rebalance.concurrency, 2);
}

#[test]
fn schema_rejects_out_of_range_and_unknown_values() {
    let mut cluster = load("examples/cluster.yaml");
    cluster["spec"]["replicas"] = json!(0);
    cluster["spec"]["queueBackups"] = json!(4);
    cluster["spec"]["service"] = json!({"type": "ExternalName"});
    cluster["spec"]["replcas"] = json!(3);
    let errors = check(&Cluster::crd(), &cluster, None);
    for want in [
        "replicas: 0 below minimum",
        "queueBackups: 4 above maximum",
        "not in",
        "replcas: unknown field",
    ] {
        assert!(
            errors.iter().any(|e| e.contains(want)),
            "{want} missing in {errors:#?}"
        );
    }
    let mut queue = load("examples/queue.yaml");
    queue["spec"]["deletionPolicy"] = json!("sometimes");
    queue["spec"]
        .as_object_mut()
        .map(|s| s.remove("clusterRef"));
    let errors = check(&Queue::crd(), &queue, None);
    assert!(
        errors.iter().any(|e| e.contains("sometimes")),
        "{errors:#?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("missing required clusterRef")),
        "{errors:#?}"
    );
}

#[test]
fn cel_rules_make_queue_identity_and_cluster_persistence_immutable() {
    let old = load("examples/queue.yaml");
    let errors = check(&Queue::crd(), &old, Some(&old));
    assert!(
        errors.is_empty(),
        "an unchanged queue is accepted: {errors:#?}"
    );
    let mut moved = old.clone();
    moved["spec"]["vhost"] = json!("/other");
    let errors = check(&Queue::crd(), &moved, Some(&old));
    assert!(
        errors.iter().any(|e| e.contains("vhost is immutable")),
        "{errors:#?}"
    );
    let mut renamed = old.clone();
    renamed["spec"]["name"] = json!("orders-2");
    let errors = check(&Queue::crd(), &renamed, Some(&old));
    assert!(
        errors.iter().any(|e| e.contains("name is immutable")),
        "{errors:#?}"
    );
    let mut rebacked = old.clone();
    rebacked["spec"]["backups"] = json!(3);
    assert!(
        check(&Queue::crd(), &rebacked, Some(&old)).is_empty(),
        "backups may change"
    );

    let old = load("examples/cluster-production.yaml");
    let mut resized = old.clone();
    resized["spec"]["persistence"]["size"] = json!("50Gi");
    let errors = check(&Cluster::crd(), &resized, Some(&old));
    assert!(
        errors
            .iter()
            .any(|e| e.contains("persistence is immutable")),
        "{errors:#?}"
    );
    let mut scaled = old.clone();
    scaled["spec"]["replicas"] = json!(7);
    assert!(
        check(&Cluster::crd(), &scaled, Some(&old)).is_empty(),
        "replicas may change"
    );
}

#[test]
fn the_chart_ships_the_same_dashboard_the_broker_tests_check() {
    let tested =
        std::fs::read_to_string(repo("dashboards/ringmq-overview.json")).expect("dashboard exists");
    let shipped = std::fs::read_to_string(repo(
        "charts/ringmq-operator/dashboards/ringmq-overview.json",
    ))
    .expect("the chart holds the dashboard");
    assert!(
        tested == shipped,
        "charts/ringmq-operator/dashboards/ringmq-overview.json is stale: copy dashboards/ringmq-overview.json there"
    );
}

/// Helm cannot be installed here, so the chart is not rendered; this reads its values and
/// templates as text for what leader election needs: more than one replica, election on,
/// the identity and namespace the binary reads, and the Lease verbs the Lease manager uses
/// (`leader::tests` records them against a Lease store: get, create, patch).
#[test]
fn the_chart_runs_replicas_under_leader_election_with_the_lease_rights_it_needs() {
    let values: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(repo("charts/ringmq-operator/values.yaml")).expect("values"),
    )
    .expect("values.yaml parses");
    assert_eq!(values["replicaCount"], json!(2));
    assert_eq!(values["leaderElection"], json!(true));
    assert_eq!(values["watchNamespace"], json!(""));
    let deployment =
        std::fs::read_to_string(repo("charts/ringmq-operator/templates/deployment.yaml"))
            .expect("deployment template");
    for needle in [
        "replicas: {{ .Values.replicaCount }}",
        "name: POD_NAME",
        "name: POD_NAMESPACE",
        "fieldPath: metadata.namespace",
        "name: LEADER_ELECTION",
        "name: WATCH_NAMESPACE",
    ] {
        assert!(
            deployment.contains(needle),
            "deployment.yaml lacks {needle}"
        );
    }
    let rbac = std::fs::read_to_string(repo("charts/ringmq-operator/templates/rbac.yaml"))
        .expect("rbac template");
    let leases = rbac
        .split("---")
        .find(|doc| doc.contains("kind: Role\n") && doc.contains("leases"))
        .expect("a Role on leases");
    assert!(
        leases.contains(r#"resources: ["leases"]"#)
            && leases.contains(r#"verbs: ["get", "create", "patch"]"#)
            && leases.contains("namespace: {{ .Release.Namespace }}"),
        "{leases}"
    );
}
