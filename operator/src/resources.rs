//! Builders for the Kubernetes objects a `Cluster` owns.
//!
//! Pure functions from the `Cluster` to the desired objects, so they can be checked without
//! an API server; the reconciler applies them with server-side apply.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    RollingUpdateStatefulSetStrategy, StatefulSet, StatefulSetSpec, StatefulSetUpdateStrategy,
};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort,
    DownwardAPIVolumeFile, DownwardAPIVolumeSource, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    HTTPGetAction, ObjectFieldSelector, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PodSecurityContext, PodSpec, PodTemplateSpec, Probe, SeccompProfile, SecretKeySelector,
    SecretVolumeSource, SecurityContext, Service, ServicePort, ServiceSpec as K8sServiceSpec,
    TopologySpreadConstraint, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};

use crate::crd::{Cluster, ServiceType};

/// AMQP port.
pub const AMQP_PORT: i32 = 5672;
/// AMQPS port (TLS).
pub const AMQPS_PORT: i32 = 5671;
/// Inter-broker port.
pub const CLUSTER_PORT: i32 = 25672;
/// Admin HTTP API port (health, readiness, management).
pub const ADMIN_PORT: i32 = 15672;
/// Seconds a pod gets between SIGTERM (on which the broker leaves: `/readyz` answers 503,
/// then it writes its journal's snapshot) and SIGKILL.
pub const TERMINATION_GRACE_SECONDS: i64 = 60;
/// The uid and gid the broker image runs as (`scripts/build-images.sh`,
/// `docker/broker.Dockerfile`); the pod's `fsGroup`, so that a volume is writable by it.
pub const BROKER_UID: i64 = 10001;
/// Where the broker config is mounted.
pub const CONFIG_DIR: &str = "/etc/ringmq";
/// Where broker data lives.
pub const DATA_DIR: &str = "/var/lib/ringmq";
/// Pod-template annotation carrying the config hash; a new value rolls the pods.
pub const CONFIG_HASH_ANNOTATION: &str = "ringmq.io/config-hash";
/// Pod-template annotation carrying the hash of the whole template (image, resources,
/// config hash, ...): how the operator sees that an apply starts a rolling restart.
pub const TEMPLATE_HASH_ANNOTATION: &str = "ringmq.io/template-hash";
/// Key of the peer-authentication secret in the cluster Secret.
pub const CLUSTER_SECRET_KEY: &str = "cluster-secret";
/// Directory under [`CONFIG_DIR`] where the cluster secret is mounted as a file.
pub const CLUSTER_SECRET_DIR: &str = "cluster";

/// Directory under [`CONFIG_DIR`] of the pod's downward API files: `labels`, the broker's
/// `zone_file` (the operator copies the node's zone onto the pod, see `controller::zone`).
pub const PODINFO_DIR: &str = "podinfo";

/// Label telling a cluster's Services apart: `nodes` (headless), `client`, `admin`.
///
/// Why: all three select the same pods, and a ServiceMonitor that matched them by the common
/// labels scraped every broker once per Service; it selects `nodes` only.
pub const SERVICE_ROLE_LABEL: &str = "ringmq.io/service";

/// Labels selecting the brokers of one cluster; stable, because a StatefulSet's selector is
/// immutable.
pub fn selector_labels(cluster: &Cluster) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), "ringmq".to_string()),
        ("app.kubernetes.io/instance".to_string(), cluster.name_any()),
    ])
}

/// The selector as the scale subresource wants it (`key=value,...`).
pub fn selector_string(cluster: &Cluster) -> String {
    selector_labels(cluster)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn labels(cluster: &Cluster) -> BTreeMap<String, String> {
    let mut l = selector_labels(cluster);
    l.insert(
        "app.kubernetes.io/managed-by".to_string(),
        "ringmq-operator".to_string(),
    );
    l
}

fn service_meta(cluster: &Cluster, name: String, owner: &OwnerReference, role: &str) -> ObjectMeta {
    let mut metadata = meta(cluster, name, owner);
    metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(SERVICE_ROLE_LABEL.to_string(), role.to_string());
    metadata
}

fn meta(cluster: &Cluster, name: String, owner: &OwnerReference) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: cluster.namespace(),
        labels: Some(labels(cluster)),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    }
}

/// DNS name of the headless Service: the seed every broker resolves to find its peers.
pub fn seed_host(cluster: &Cluster) -> String {
    format!(
        "{}.{}.svc",
        cluster.headless_service_name(),
        cluster.namespace().unwrap_or_default()
    )
}

/// Base URL of the admin API through the admin Service (cluster-internal, ready pods only).
pub fn admin_base_url(cluster: &Cluster) -> String {
    format!(
        "http://{}.{}.svc:{ADMIN_PORT}",
        cluster.admin_service_name(),
        cluster.namespace().unwrap_or_default()
    )
}

/// The broker configuration (`ringmq.yaml`): operator defaults, then `spec.config` on top.
///
/// Why no replica count or member list here: a scale must not change the config, or every
/// pod would roll. Peers are found through the headless Service's DNS instead.
pub fn broker_config(cluster: &Cluster) -> serde_json::Value {
    let mut config = serde_json::json!({
        "amqp_listen": format!("0.0.0.0:{AMQP_PORT}"),
        "admin_listen": format!("0.0.0.0:{ADMIN_PORT}"),
        "cluster_listen": format!("0.0.0.0:{CLUSTER_PORT}"),
        "data_dir": DATA_DIR,
        "cluster_name": cluster.name_any(),
        "cluster_seeds": [format!("{}:{CLUSTER_PORT}", seed_host(cluster))],
        "cluster_secret_file": format!("{CONFIG_DIR}/{CLUSTER_SECRET_DIR}/{CLUSTER_SECRET_KEY}"),
        // Pod 0 finds nobody behind the headless Service on the first start: it founds.
        "cluster_founder": format!("{}-0", cluster.name_any()),
        "cluster_join_timeout_ms": 15_000,
        // Backups of a queue declared without `qpid.cluster.backups` (a Queue without
        // `backups`, or a client's declare).
        "default_backups": cluster.spec.queue_backups,
    });
    if cluster.spec.tls.is_some() {
        config["amqps_listen"] = serde_json::json!(format!("0.0.0.0:{AMQPS_PORT}"));
        config["tls_cert_file"] = serde_json::json!(format!("{CONFIG_DIR}/tls/tls.crt"));
        config["tls_key_file"] = serde_json::json!(format!("{CONFIG_DIR}/tls/tls.key"));
    }
    if let Some(map) = config.as_object_mut() {
        for (k, v) in &cluster.spec.config {
            map.insert(k.clone(), v.clone());
        }
    }
    config
}

/// Stable 64-bit FNV-1a hash, used to roll pods when the config changes.
///
/// Why not `DefaultHasher`: its output may change between Rust releases, which would roll
/// every cluster on an operator upgrade.
pub fn config_hash(text: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// The ConfigMap holding `ringmq.yaml`.
pub fn config_map(cluster: &Cluster, owner: &OwnerReference, config_yaml: &str) -> ConfigMap {
    ConfigMap {
        metadata: meta(cluster, format!("{}-config", cluster.name_any()), owner),
        data: Some(BTreeMap::from([(
            "ringmq.yaml".to_string(),
            config_yaml.to_string(),
        )])),
        ..ConfigMap::default()
    }
}

fn port(name: &str, port: i32) -> ServicePort {
    ServicePort {
        name: Some(name.to_string()),
        port,
        target_port: Some(IntOrString::String(name.to_string())),
        ..ServicePort::default()
    }
}

/// Headless Service: stable DNS for every pod (`<pod>.<name>-nodes`), including pods not
/// ready yet, so a joining broker can be reached by its peers before it serves clients.
pub fn headless_service(cluster: &Cluster, owner: &OwnerReference) -> Service {
    Service {
        metadata: service_meta(cluster, cluster.headless_service_name(), owner, "nodes"),
        spec: Some(K8sServiceSpec {
            cluster_ip: Some("None".to_string()),
            publish_not_ready_addresses: Some(true),
            selector: Some(selector_labels(cluster)),
            ports: Some(vec![
                port("cluster", CLUSTER_PORT),
                port("admin", ADMIN_PORT),
            ]),
            ..K8sServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// Client Service: AMQP(S), of the type and with the annotations the spec asks for.
///
/// The admin port is on it only while it is a `ClusterIP` Service: a `LoadBalancer` or
/// `NodePort` Service would publish the management API (user and queue administration)
/// outside the cluster. The operator itself uses the [`admin_service`].
pub fn client_service(cluster: &Cluster, owner: &OwnerReference) -> Service {
    let mut metadata = service_meta(cluster, cluster.name_any(), owner, "client");
    if !cluster.spec.service.annotations.is_empty() {
        metadata.annotations = Some(cluster.spec.service.annotations.clone());
    }
    let mut ports = vec![port("amqp", AMQP_PORT)];
    if cluster.spec.service.type_ == ServiceType::ClusterIP {
        ports.push(port("admin", ADMIN_PORT));
    }
    if cluster.spec.tls.is_some() {
        ports.push(port("amqps", AMQPS_PORT));
    }
    Service {
        metadata,
        spec: Some(K8sServiceSpec {
            type_: Some(cluster.spec.service.type_.as_str().to_string()),
            selector: Some(selector_labels(cluster)),
            ports: Some(ports),
            ..K8sServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// Admin Service: the admin API of the ready brokers, inside the cluster only (`ClusterIP`,
/// whatever `spec.service.type` says). The operator's admin calls go through it.
pub fn admin_service(cluster: &Cluster, owner: &OwnerReference) -> Service {
    Service {
        metadata: service_meta(cluster, cluster.admin_service_name(), owner, "admin"),
        spec: Some(K8sServiceSpec {
            type_: Some("ClusterIP".to_string()),
            selector: Some(selector_labels(cluster)),
            ports: Some(vec![port("admin", ADMIN_PORT)]),
            ..K8sServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// PodDisruptionBudget: voluntary evictions take one broker at a time.
pub fn pod_disruption_budget(cluster: &Cluster, owner: &OwnerReference) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: meta(cluster, cluster.name_any(), owner),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector_labels(cluster)),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    }
}

/// The ServiceMonitor kind (Prometheus operator); applied only when its CRD exists.
pub fn service_monitor_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        "monitoring.coreos.com",
        "v1",
        "ServiceMonitor",
    ))
}

/// ServiceMonitor scraping the brokers' admin port, each broker once.
///
/// It selects the headless Service only: its endpoints are every pod exactly once, not-ready
/// ones included (a broker that is starting or stuck is the one whose metrics you want).
pub fn service_monitor(cluster: &Cluster, owner: &OwnerReference) -> DynamicObject {
    let mut obj = DynamicObject::new(&cluster.name_any(), &service_monitor_resource())
        .within(&cluster.namespace().unwrap_or_default());
    obj.metadata = meta(cluster, cluster.name_any(), owner);
    let mut selector = selector_labels(cluster);
    selector.insert(SERVICE_ROLE_LABEL.to_string(), "nodes".to_string());
    obj.data = serde_json::json!({
        "spec": {
            "selector": { "matchLabels": selector },
            "endpoints": [{ "port": "admin", "path": "/metrics" }],
        }
    });
    obj
}

fn env_from_secret(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.to_string(),
                key: key.to_string(),
                optional: None,
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn http_probe(path: &str, period_seconds: i32, failure_threshold: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_string()),
            port: IntOrString::String("admin".to_string()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period_seconds),
        failure_threshold: Some(failure_threshold),
        timeout_seconds: Some(3),
        ..Probe::default()
    }
}

/// The StatefulSet running the brokers, with `replicas` chosen by the scale state machine;
/// its partition is 0 until [`set_partition`] sets what `rollout.rs` decides.
///
/// `replicas` lives only in the StatefulSet spec, never in the pod template, so scaling does
/// not roll existing pods; the template changes only with the image, resources or config.
pub fn stateful_set(
    cluster: &Cluster,
    owner: &OwnerReference,
    replicas: i32,
    config_yaml: &str,
) -> StatefulSet {
    let name = cluster.name_any();
    let user_secret = cluster.default_user_secret_name();
    let container_port = |n: &str, p: i32| ContainerPort {
        name: Some(n.to_string()),
        container_port: p,
        ..ContainerPort::default()
    };
    let mut ports = vec![
        container_port("amqp", AMQP_PORT),
        container_port("cluster", CLUSTER_PORT),
        container_port("admin", ADMIN_PORT),
    ];
    let mut mounts = vec![
        VolumeMount {
            name: "config".into(),
            mount_path: CONFIG_DIR.into(),
            read_only: Some(true),
            ..Default::default()
        },
        VolumeMount {
            name: "data".into(),
            mount_path: DATA_DIR.into(),
            ..Default::default()
        },
    ];
    mounts.push(VolumeMount {
        name: "cluster-secret".into(),
        mount_path: format!("{CONFIG_DIR}/{CLUSTER_SECRET_DIR}"),
        read_only: Some(true),
        ..Default::default()
    });
    mounts.push(VolumeMount {
        name: "podinfo".into(),
        mount_path: format!("{CONFIG_DIR}/{PODINFO_DIR}"),
        read_only: Some(true),
        ..Default::default()
    });
    let mut volumes = vec![
        // The pod's labels as a file the kubelet keeps current: the zone label the operator
        // adds once the pod is scheduled reaches the broker without a restart of the pod.
        Volume {
            name: "podinfo".into(),
            downward_api: Some(DownwardAPIVolumeSource {
                items: Some(vec![DownwardAPIVolumeFile {
                    path: "labels".into(),
                    field_ref: Some(ObjectFieldSelector {
                        field_path: "metadata.labels".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        },
        Volume {
            name: "config".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: format!("{name}-config"),
                ..Default::default()
            }),
            ..Default::default()
        },
        Volume {
            name: "cluster-secret".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(cluster.cluster_secret_name()),
                ..Default::default()
            }),
            ..Default::default()
        },
    ];
    if let Some(tls) = &cluster.spec.tls {
        ports.push(container_port("amqps", AMQPS_PORT));
        mounts.push(VolumeMount {
            name: "tls".into(),
            mount_path: format!("{CONFIG_DIR}/tls"),
            read_only: Some(true),
            ..Default::default()
        });
        volumes.push(Volume {
            name: "tls".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(tls.secret_name.clone()),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    let mut claims = None;
    match &cluster.spec.persistence {
        Some(p) => {
            claims = Some(vec![PersistentVolumeClaim {
                metadata: ObjectMeta {
                    name: Some("data".into()),
                    ..ObjectMeta::default()
                },
                spec: Some(PersistentVolumeClaimSpec {
                    access_modes: Some(vec!["ReadWriteOnce".into()]),
                    storage_class_name: p.storage_class.clone(),
                    resources: Some(VolumeResourceRequirements {
                        requests: Some(BTreeMap::from([("storage".to_string(), p.size.clone())])),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }]);
        }
        None => volumes.push(Volume {
            name: "data".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Default::default()
        }),
    }
    let container = Container {
        name: "ringmq".into(),
        image: Some(cluster.spec.image.clone()),
        ports: Some(ports),
        env: Some(vec![
            EnvVar {
                name: "RINGMQ_NODE_ID".into(),
                value_from: Some(EnvVarSource {
                    field_ref: Some(ObjectFieldSelector {
                        field_path: "metadata.name".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            },
            EnvVar {
                name: "RINGMQ_CONFIG".into(),
                value: Some(format!("{CONFIG_DIR}/ringmq.yaml")),
                ..Default::default()
            },
            EnvVar {
                name: "RINGMQ_ZONE_FILE".into(),
                value: Some(format!("{CONFIG_DIR}/{PODINFO_DIR}/labels")),
                ..Default::default()
            },
            // Other members and clients reach this pod by its stable DNS name.
            EnvVar {
                name: "RINGMQ_ADVERTISE_HOST".into(),
                value: Some(format!("$(RINGMQ_NODE_ID).{}", seed_host(cluster))),
                ..Default::default()
            },
            env_from_secret("RINGMQ_DEFAULT_USER", &user_secret, "username"),
            env_from_secret("RINGMQ_DEFAULT_PASS", &user_secret, "password"),
        ]),
        resources: cluster.spec.resources.clone(),
        readiness_probe: Some(http_probe("/readyz", 5, 3)),
        liveness_probe: Some(http_probe("/healthz", 10, 6)),
        // No pre-stop hook: the image has no shell, and the broker leaves on the SIGTERM
        // that stops the pod (what `POST /api/members/{id}/leave` did from the old hook).
        // Everything it writes is under the data volume: the root file system is read-only.
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        volume_mounts: Some(mounts),
        ..Container::default()
    };
    let mut template_labels = selector_labels(cluster);
    template_labels.insert(
        "app.kubernetes.io/managed-by".into(),
        "ringmq-operator".into(),
    );
    let mut template = PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(template_labels),
            annotations: Some(BTreeMap::from([(
                CONFIG_HASH_ANNOTATION.to_string(),
                config_hash(config_yaml),
            )])),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            containers: vec![container],
            volumes: Some(volumes),
            affinity: cluster.spec.affinity.clone(),
            tolerations: (!cluster.spec.tolerations.is_empty())
                .then(|| cluster.spec.tolerations.clone()),
            topology_spread_constraints: Some(topology_spread(cluster)),
            termination_grace_period_seconds: Some(TERMINATION_GRACE_SECONDS),
            // The image's non-root user; fsGroup makes a volume claim writable by it.
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(BROKER_UID),
                run_as_group: Some(BROKER_UID),
                fs_group: Some(BROKER_UID),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..PodSpec::default()
        }),
    };
    let template_hash = config_hash(&serde_json::to_string(&template).unwrap_or_default());
    if let Some(annotations) = template
        .metadata
        .as_mut()
        .and_then(|m| m.annotations.as_mut())
    {
        annotations.insert(TEMPLATE_HASH_ANNOTATION.to_string(), template_hash);
    }
    StatefulSet {
        metadata: meta(cluster, name.clone(), owner),
        spec: Some(StatefulSetSpec {
            replicas: Some(replicas),
            service_name: Some(cluster.headless_service_name()),
            selector: LabelSelector {
                match_labels: Some(selector_labels(cluster)),
                ..LabelSelector::default()
            },
            template,
            // A restarted broker counts as available only after this long ready; the
            // operator releases the next pod only when all are available (rollout.rs).
            min_ready_seconds: Some(crate::rollout::MIN_READY_SECONDS),
            // One broker at a time: a new pod only once the one before is ready, a removed
            // one only once the one after it is gone (Kubernetes' default, stated because
            // the scale and restart steps rely on it).
            pod_management_policy: Some("OrderedReady".into()),
            update_strategy: Some(StatefulSetUpdateStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateStatefulSetStrategy {
                    partition: Some(0),
                    ..Default::default()
                }),
            }),
            volume_claim_templates: claims,
            ..StatefulSetSpec::default()
        }),
        ..StatefulSet::default()
    }
}

/// Topology spread of the broker pods: `spec.topologySpreadConstraints` when given, else the
/// operator's default, one broker more at most in any zone and on any node than in another
/// (`maxSkew: 1` over `topology.kubernetes.io/zone` and `kubernetes.io/hostname`).
///
/// Why `ScheduleAnyway`: a cluster in one zone, or with more brokers than nodes, must still
/// schedule; the planner interleaves the ring by zone, so an even spread is what lets a
/// queue's backups sit in other zones than its primary. For a hard rule, set the constraints
/// with `DoNotSchedule` in the spec (examples/cluster-production.yaml).
pub fn topology_spread(cluster: &Cluster) -> Vec<TopologySpreadConstraint> {
    if !cluster.spec.topology_spread_constraints.is_empty() {
        return cluster.spec.topology_spread_constraints.clone();
    }
    ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
        .into_iter()
        .map(|key| TopologySpreadConstraint {
            max_skew: 1,
            topology_key: key.to_string(),
            when_unsatisfiable: "ScheduleAnyway".to_string(),
            label_selector: Some(LabelSelector {
                match_labels: Some(selector_labels(cluster)),
                ..LabelSelector::default()
            }),
            ..TopologySpreadConstraint::default()
        })
        .collect()
}

/// Sets the StatefulSet's rolling-update partition: pods from that ordinal up may be
/// replaced by the new template.
pub fn set_partition(sts: &mut StatefulSet, partition: i32) {
    if let Some(rolling) = sts
        .spec
        .as_mut()
        .and_then(|s| s.update_strategy.as_mut())
        .and_then(|u| u.rolling_update.as_mut())
    {
        rolling.partition = Some(partition);
    }
}

/// The pod-template hash annotation of a StatefulSet, if any.
pub fn template_hash_of(sts: &StatefulSet) -> Option<&str> {
    sts.spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(TEMPLATE_HASH_ANNOTATION)
        .map(String::as_str)
}

#[cfg(test)]
mod tests {
    use kube::Resource;

    use super::*;
    use crate::crd::ClusterSpec;

    fn cluster(spec: serde_json::Value) -> Cluster {
        let spec: ClusterSpec = serde_json::from_value(spec).expect("spec");
        let mut c = Cluster::new("ringmq", spec);
        c.meta_mut().namespace = Some("ns".into());
        c.meta_mut().uid = Some("uid".into());
        c
    }

    fn sts(c: &Cluster, replicas: i32) -> StatefulSet {
        let owner = c.controller_owner_ref(&()).expect("uid");
        let config = serde_saphyr::to_string(&broker_config(c)).expect("config");
        stateful_set(c, &owner, replicas, &config)
    }

    #[test]
    fn scaling_changes_only_replicas_never_the_pod_template() {
        let c = cluster(serde_json::json!({"image": "ringmq:1", "replicas": 3}));
        let (three, five) = (sts(&c, 3), sts(&c, 5));
        let (three, five) = (three.spec.expect("spec"), five.spec.expect("spec"));
        assert_eq!((three.replicas, five.replicas), (Some(3), Some(5)));
        assert_eq!(three.template, five.template, "a scale must not roll pods");
        let mut bigger = c.clone();
        bigger.spec.replicas = 7;
        assert_eq!(
            broker_config(&c),
            broker_config(&bigger),
            "the config does not carry the replica count"
        );
    }

    #[test]
    fn config_change_rolls_pods_through_the_hash_annotation() {
        let c = cluster(serde_json::json!({"image": "ringmq:1"}));
        let tuned =
            cluster(serde_json::json!({"image": "ringmq:1", "config": {"heartbeat_s": 10}}));
        let hash = |s: StatefulSet| {
            s.spec
                .and_then(|s| s.template.metadata)
                .and_then(|m| m.annotations)
                .expect("annotations")[CONFIG_HASH_ANNOTATION]
                .clone()
        };
        assert_ne!(hash(sts(&c, 3)), hash(sts(&tuned, 3)));
        assert_eq!(
            broker_config(&tuned)["heartbeat_s"],
            10,
            "overrides win over defaults"
        );
    }

    #[test]
    fn the_broker_accepts_the_config_the_operator_writes() {
        let c = cluster(
            serde_json::json!({"image": "ringmq:1", "queueBackups": 2, "config": {"heartbeat_s": 10}}),
        );
        let yaml = serde_saphyr::to_string(&broker_config(&c)).expect("config");
        let parsed = ringmq::config::Config::from_yaml(&yaml)
            .unwrap_or_else(|e| panic!("the broker refuses the operator's config: {e}\n{yaml}"));
        parsed.validate().expect("valid");
        assert_eq!(parsed.heartbeat_s, 10);
        assert_eq!(
            parsed.default_backups, 2,
            "spec.queueBackups reaches the broker"
        );
        let default = cluster(serde_json::json!({"image": "ringmq:1"}));
        let yaml = serde_saphyr::to_string(&broker_config(&default)).expect("config");
        let parsed = ringmq::config::Config::from_yaml(&yaml).expect("parses");
        assert_eq!(
            parsed.default_backups,
            ringmq::config::Config::default().default_backups,
            "the CRD's default is the broker's"
        );
        assert_eq!(parsed.cluster_founder.as_deref(), Some("ringmq-0"));
        assert_eq!(parsed.cluster_seeds, ["ringmq-nodes.ns.svc:25672"]);
    }

    #[test]
    fn brokers_spread_over_zones_and_nodes_unless_the_spec_says_otherwise() {
        let c = cluster(serde_json::json!({"image": "ringmq:1"}));
        let pod = sts(&c, 3).spec.expect("spec").template.spec.expect("pod");
        let spread = pod.topology_spread_constraints.expect("a default spread");
        let keys: Vec<(&str, i32, &str)> = spread
            .iter()
            .map(|t| {
                (
                    t.topology_key.as_str(),
                    t.max_skew,
                    t.when_unsatisfiable.as_str(),
                )
            })
            .collect();
        assert_eq!(
            keys,
            [
                ("topology.kubernetes.io/zone", 1, "ScheduleAnyway"),
                ("kubernetes.io/hostname", 1, "ScheduleAnyway")
            ]
        );
        assert_eq!(
            spread[0]
                .label_selector
                .as_ref()
                .and_then(|s| s.match_labels.clone()),
            Some(selector_labels(&c)),
            "counts this cluster's brokers only"
        );
        let own = cluster(
            serde_json::json!({"image": "ringmq:1", "topologySpreadConstraints": [
            {"maxSkew": 2, "topologyKey": "rack", "whenUnsatisfiable": "DoNotSchedule"}]}),
        );
        let pod = sts(&own, 3).spec.expect("spec").template.spec.expect("pod");
        let spread = pod.topology_spread_constraints.expect("the spec's");
        assert_eq!(
            (spread.len(), spread[0].topology_key.as_str()),
            (1, "rack"),
            "the spec replaces the default"
        );
    }

    fn port_names(svc: &Service) -> Vec<String> {
        svc.spec
            .iter()
            .flat_map(|s| s.ports.iter().flatten())
            .filter_map(|p| p.name.clone())
            .collect()
    }

    #[test]
    fn the_admin_port_is_never_published_outside_the_cluster() {
        for (type_, admin_on_client) in [
            ("ClusterIP", true),
            ("NodePort", false),
            ("LoadBalancer", false),
        ] {
            let c = cluster(serde_json::json!({"image": "ringmq:1", "service": {"type": type_}}));
            let owner = c.controller_owner_ref(&()).expect("uid");
            let client = client_service(&c, &owner);
            assert_eq!(
                port_names(&client).contains(&"admin".to_string()),
                admin_on_client,
                "{type_}: {:?}",
                port_names(&client)
            );
            let admin = admin_service(&c, &owner);
            assert_eq!(
                admin.spec.as_ref().and_then(|s| s.type_.as_deref()),
                Some("ClusterIP"),
                "the operator's own way in stays internal"
            );
            assert_eq!(port_names(&admin), ["admin"]);
        }
        let c = cluster(serde_json::json!({"image": "ringmq:1"}));
        assert_eq!(admin_base_url(&c), "http://ringmq-admin.ns.svc:15672");
    }

    #[test]
    fn the_service_monitor_selects_exactly_one_service_per_cluster() {
        let c =
            cluster(serde_json::json!({"image": "ringmq:1", "service": {"type": "LoadBalancer"}}));
        let owner = c.controller_owner_ref(&()).expect("uid");
        let monitor = service_monitor(&c, &owner);
        let selector: BTreeMap<String, String> =
            serde_json::from_value(monitor.data["spec"]["selector"]["matchLabels"].clone())
                .expect("matchLabels");
        let services = [
            headless_service(&c, &owner),
            client_service(&c, &owner),
            admin_service(&c, &owner),
        ];
        let matched: Vec<String> = services
            .iter()
            .filter(|svc| {
                let labels = svc.metadata.labels.clone().unwrap_or_default();
                selector.iter().all(|(k, v)| labels.get(k) == Some(v))
            })
            .filter_map(|svc| svc.metadata.name.clone())
            .collect();
        assert_eq!(matched, ["ringmq-nodes"], "each broker scraped once");
        assert_eq!(
            headless_service(&c, &owner)
                .spec
                .and_then(|s| s.publish_not_ready_addresses),
            Some(true),
            "not-ready brokers are scraped too"
        );
    }

    #[test]
    fn tls_and_persistence_add_amqps_and_volume_claims() {
        let c = cluster(serde_json::json!({
            "image": "ringmq:1",
            "tls": {"secretName": "tls"},
            "persistence": {"storageClass": "fast", "size": "10Gi"},
            "service": {"type": "LoadBalancer", "annotations": {"a": "b"}}
        }));
        let spec = sts(&c, 3).spec.expect("spec");
        let claims = spec.volume_claim_templates.expect("claims");
        assert_eq!(
            claims[0]
                .spec
                .as_ref()
                .and_then(|s| s.storage_class_name.as_deref()),
            Some("fast")
        );
        let pod = spec.template.spec.expect("pod");
        assert!(
            pod.volumes.iter().flatten().all(|v| v.name != "data"),
            "no emptyDir when persistent"
        );
        let ports: Vec<i32> = pod.containers[0]
            .ports
            .iter()
            .flatten()
            .map(|p| p.container_port)
            .collect();
        assert!(ports.contains(&AMQPS_PORT));
        let owner = c.controller_owner_ref(&()).expect("uid");
        let svc = client_service(&c, &owner);
        assert_eq!(
            svc.spec.as_ref().and_then(|s| s.type_.as_deref()),
            Some("LoadBalancer")
        );
        assert_eq!(svc.metadata.annotations.expect("annotations")["a"], "b");
        assert!(
            broker_config(&c)["tls_cert_file"]
                .as_str()
                .is_some_and(|f| f.ends_with("tls.crt"))
        );
        let yaml = serde_saphyr::to_string(&broker_config(&c)).expect("config");
        let parsed = ringmq::config::Config::from_yaml(&yaml).unwrap_or_else(|e| {
            panic!("the broker refuses the operator's TLS config: {e}\n{yaml}")
        });
        parsed.validate().expect("valid");
        assert!(parsed.amqps_listen.is_some());
    }
}
