//! `Cluster` reconcile: secrets, config, services, PDB, ServiceMonitor, StatefulSet, scaling
//! and status.
//!
//! Every step is idempotent (server-side apply, create-if-missing), and the multi-step scale
//! operation keeps its step in `status.operation`, so a reconcile interrupted anywhere (an
//! operator restart included) is finished by the next one.

use std::collections::BTreeMap;
use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use ringmq_planner::{Member, ring_order};

use super::{Context, Error, FIELD_MANAGER};
use crate::admin::{AdminApi, AdminEndpoint, Overview};
use crate::conditions::condition;
use crate::crd::{
    Cluster, ClusterStatus, MemberStatus, Operation, OperationKind, OperationStep, QuorumStatus,
    RollingRestart,
};
use crate::resources::{self, CLUSTER_SECRET_KEY};
use crate::{rollout, scale};

/// How often a settled cluster is re-checked (members, drift of owned objects).
pub const RESYNC: Duration = Duration::from_secs(300);
/// How often a cluster in a multi-step operation is re-checked.
pub const OPERATION_POLL: Duration = Duration::from_secs(10);
/// Cluster annotation that lets a scale-down remove members that still hold queues (as
/// Strimzi's `strimzi.io/skip-broker-scaledown-check`): `"true"` skips the wait of the
/// `Draining` step. It stays in force while set; remove it once the scale-down is done.
pub const FORCE_SCALE_DOWN_ANNOTATION: &str = "ringmq.io/force-scale-down";
/// CRD whose presence enables the ServiceMonitor.
pub const SERVICE_MONITOR_CRD: &str = "servicemonitors.monitoring.coreos.com";

/// Reconciles one `Cluster`.
pub async fn reconcile(cluster: Arc<Cluster>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile("Cluster");
    let ns = cluster
        .namespace()
        .ok_or(Error::MissingObjectKey("namespace"))?;
    let name = cluster.name_any();
    let owner = cluster
        .controller_owner_ref(&())
        .ok_or(Error::MissingObjectKey("uid"))?;
    let client = ctx.client.clone();
    let apply = PatchParams::apply(FIELD_MANAGER).force();

    // Secrets: created once, never regenerated (a new peer secret would split the cluster).
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    ensure_secret(
        &ctx,
        &cluster,
        &secrets,
        &cluster.cluster_secret_name(),
        &owner,
        |s| {
            Ok(BTreeMap::from([(
                CLUSTER_SECRET_KEY.to_string(),
                random_token(s)?,
            )]))
        },
    )
    .await?;
    let user_secret_name = cluster.default_user_secret_name();
    let user_secret = if cluster.spec.default_user_secret.is_some() {
        secrets
            .get_opt(&user_secret_name)
            .await?
            .ok_or_else(|| Error::MissingSecret(user_secret_name.clone()))?
    } else {
        ensure_secret(&ctx, &cluster, &secrets, &user_secret_name, &owner, |s| {
            Ok(BTreeMap::from([
                ("username".to_string(), "ringmq-admin".to_string()),
                ("password".to_string(), random_token(s)?),
            ]))
        })
        .await?
    };
    let endpoint = AdminEndpoint {
        base_url: resources::admin_base_url(&cluster),
        username: secret_value(&user_secret, &user_secret_name, "username")?,
        password: secret_value(&user_secret, &user_secret_name, "password")?,
    };
    let admin = ctx.admin.connect(endpoint);

    // Config, services, PDB: server-side apply is idempotent.
    let config = resources::broker_config(&cluster);
    let config_yaml = serde_saphyr::to_string(&config).map_err(|e| Error::Config(e.to_string()))?;
    let cm = resources::config_map(&cluster, &owner, &config_yaml);
    Api::<ConfigMap>::namespaced(client.clone(), &ns)
        .patch(&format!("{name}-config"), &apply, &Patch::Apply(&cm))
        .await?;
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let headless = resources::headless_service(&cluster, &owner);
    services
        .patch(
            &cluster.headless_service_name(),
            &apply,
            &Patch::Apply(&headless),
        )
        .await?;
    services
        .patch(
            &name,
            &apply,
            &Patch::Apply(&resources::client_service(&cluster, &owner)),
        )
        .await?;
    services
        .patch(
            &cluster.admin_service_name(),
            &apply,
            &Patch::Apply(&resources::admin_service(&cluster, &owner)),
        )
        .await?;
    Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns)
        .patch(
            &name,
            &apply,
            &Patch::Apply(&resources::pod_disruption_budget(&cluster, &owner)),
        )
        .await?;
    if Api::<CustomResourceDefinition>::all(client.clone())
        .get_opt(SERVICE_MONITOR_CRD)
        .await?
        .is_some()
    {
        let monitors: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), &ns, &resources::service_monitor_resource());
        monitors
            .patch(
                &name,
                &apply,
                &Patch::Apply(&resources::service_monitor(&cluster, &owner)),
            )
            .await?;
    }

    // Scale: decide the operation, run its step, then apply the StatefulSet.
    let stateful_sets: Api<StatefulSet> = Api::namespaced(client.clone(), &ns);
    let existing = stateful_sets.get_opt(&name).await?;
    let sts_replicas = existing
        .as_ref()
        .and_then(|s| s.spec.as_ref())
        .and_then(|s| s.replicas);
    let recorded = cluster.status.as_ref().and_then(|s| s.operation.as_ref());
    let mut operation = scale::start_or_resume(cluster.spec.replicas, sts_replicas, recorded);
    if let Some(op) = &operation
        && recorded != Some(op)
    {
        let verb = if op.kind == OperationKind::ScaleUp {
            "ScaleUpStarted"
        } else {
            "ScaleDownStarted"
        };
        ctx.event(
            &*cluster,
            EventType::Normal,
            verb,
            format!("scaling from {} to {} brokers", op.from, op.to),
        )
        .await;
    }
    // Members from the admin API; unreachable brokers degrade the cluster, they do not fail
    // the reconcile (the pods may simply be starting).
    let overview = admin.overview().await;
    let mut drained = cluster
        .status
        .as_ref()
        .map(|s| s.drained_by_scale_down.clone())
        .unwrap_or_default();
    let mut blocked = None;
    let replicas = match operation.as_mut() {
        None => cluster.spec.replicas,
        Some(op) if op.kind == OperationKind::ScaleDown => {
            let at = ScaleDownAt {
                current: sts_replicas.unwrap_or(op.from),
                pods: existing_pods(existing.as_ref()),
                overview: &overview,
            };
            let (replicas, why) =
                scale_down_step(&ctx, &cluster, admin.as_ref(), op, at, &mut drained).await?;
            blocked = why;
            replicas
        }
        Some(op) => op.to,
    };
    let kept = match &operation {
        Some(op) if op.kind == OperationKind::ScaleDown => op.to,
        _ => cluster.spec.replicas,
    };
    undrain_kept(&ctx, &cluster, admin.as_ref(), &mut drained, kept).await;

    // Rolling restart: the partition lets one more pod take the new template only when the
    // cluster is whole again (rollout.rs).
    let mut sts = resources::stateful_set(&cluster, &owner, replicas, &config_yaml);
    let template_changed = existing
        .as_ref()
        .is_some_and(|old| resources::template_hash_of(old) != resources::template_hash_of(&sts));
    let step = match &existing {
        None => None,
        Some(old) => {
            let health = rollout::cluster_health(&overview, &name, replicas);
            Some(rollout::next_step(
                &name,
                template_changed,
                rollout_progress(old, replicas),
                &health,
            ))
        }
    };
    if let Some(step) = &step {
        resources::set_partition(&mut sts, step.partition);
        if let Some(pod) = &step.released {
            let note = format!(
                "quorum held and all {replicas} members running: {pod} restarts with the new template"
            );
            ctx.event(&*cluster, EventType::Normal, "RestartingBroker", note)
                .await;
        }
    }
    let applied = stateful_sets
        .patch(&name, &apply, &Patch::Apply(&sts))
        .await?;
    if let (Some(old), Some(new)) = (
        existing.as_ref().and_then(config_hash_of),
        config_hash_of(&sts),
    ) && old != new
    {
        let note = format!("broker config changed; pods of {name} roll one at a time");
        ctx.event(&*cluster, EventType::Normal, "ConfigChanged", note)
            .await;
    }
    if existing.is_none() {
        ctx.event(
            &*cluster,
            EventType::Normal,
            "Created",
            format!("created StatefulSet {name} with {replicas} brokers"),
        )
        .await;
    }
    let sts_status = applied.status.unwrap_or_default();
    let rolling_restart = step.and_then(|step| {
        step.waiting_for.map(|waiting_for| RollingRestart {
            partition: step.partition,
            waiting_for,
        })
    });
    let was_rolling = cluster
        .status
        .as_ref()
        .is_some_and(|s| s.rolling_restart.is_some());
    if was_rolling && rolling_restart.is_none() {
        ctx.event(
            &*cluster,
            EventType::Normal,
            "RollingRestartDone",
            format!("all {replicas} brokers run the new pod template"),
        )
        .await;
    }

    if let Some(op) = operation.as_mut() {
        finish_step(
            &ctx,
            &cluster,
            admin.as_ref(),
            op,
            sts_status.ready_replicas.unwrap_or(0),
            overview.as_ref().ok(),
        )
        .await;
        if op.waiting_for.is_none() {
            operation = None;
        }
    }

    let status = build_status(
        &cluster,
        replicas,
        &sts_status,
        &overview,
        operation,
        rolling_restart,
        ScaleDownState { blocked, drained },
    );
    let requeue = if status.operation.is_some() || status.rolling_restart.is_some() {
        OPERATION_POLL
    } else {
        RESYNC
    };
    let patch = serde_json::json!({
        "apiVersion": Cluster::api_version(&()),
        "kind": Cluster::kind(&()),
        "status": status,
    });
    Api::<Cluster>::namespaced(client, &ns)
        .patch_status(&name, &apply, &Patch::Apply(&patch))
        .await?;
    Ok(Action::requeue(requeue))
}

/// Where a scale-down stands: the StatefulSet's size and pods, and the brokers' overview.
#[derive(Clone, Copy)]
struct ScaleDownAt<'a> {
    current: i32,
    pods: i32,
    overview: &'a Result<Overview, crate::admin::AdminError>,
}

/// Why a scale-down is held in a way the user may have to act on: the `ScaleDownBlocked`
/// condition's reason and message.
type Blocked = Option<(&'static str, String)>;

/// One step of a scale-down, one broker at a time (scale.rs says why): once the cluster is
/// settled at the StatefulSet's `current` size, drain its highest pod's broker; once that
/// is marked draining and holds nothing (or the Cluster carries
/// [`FORCE_SCALE_DOWN_ANNOTATION`]` = "true"`), lower the StatefulSet by one, and wait for
/// the cluster to settle again. Returns the StatefulSet size to apply and what blocks it;
/// `op.waiting_for` is `None` once the cluster is settled at the target size. `drained`
/// gets every broker this drains.
async fn scale_down_step(
    ctx: &Context,
    cluster: &Cluster,
    admin: &dyn AdminApi,
    op: &mut Operation,
    at: ScaleDownAt<'_>,
    drained: &mut Vec<String>,
) -> Result<(i32, Blocked), Error> {
    let name = cluster.name_any();
    let forced = force_scale_down(cluster);
    let current = at.current;
    let removing = current > op.to;
    if let Err(why) = scale::settled(&name, current, at.pods, at.overview, forced, removing) {
        op.step = OperationStep::ShrinkingStatefulSet;
        op.waiting_for = Some(format!("{current}/{} brokers left; {why}", op.from));
        let blocked = match why {
            scale::Unsettled::StaleVoters(why) => Some(("StaleVoters", why)),
            scale::Unsettled::Waiting(_) => None,
        };
        return Ok((current, blocked));
    }
    if !removing {
        op.step = OperationStep::ShrinkingStatefulSet;
        op.waiting_for = None;
        return Ok((current, None));
    }
    op.step = OperationStep::Draining;
    let leaving = format!("{name}-{}", current - 1);
    let voters = at
        .overview
        .as_ref()
        .ok()
        .and_then(|o| o.cluster.as_ref())
        .map(|c| i32::try_from(c.voters).unwrap_or(i32::MAX));
    let drain = drain_step(ctx, cluster, admin, op, &leaving, voters, forced, drained).await?;
    if let Some(blocked) = drain {
        return Ok((current, blocked));
    }
    let note = format!(
        "quorum held, the {} brokers that stay running, {leaving} drained: removing it ({} more after it)",
        current - 1,
        current - 1 - op.to
    );
    ctx.event(cluster, EventType::Normal, "RemovingBroker", note)
        .await;
    op.step = OperationStep::ShrinkingStatefulSet;
    op.waiting_for = Some(format!("{leaving} to stop and leave the consensus voters"));
    Ok((current - 1, None))
}

/// Drains `leaving`, the highest pod's broker (the brokers move its primaries and backups
/// to the others), and judges whether its pod may go: `None` once it is marked draining and
/// holds nothing — it then leaves the voters when it stops — or when `forced`; otherwise
/// what it waits for is in `op.waiting_for`, and what blocks it is returned. A broker that
/// is no member (down, or never started) may go only if it is no voter either (`voters` is
/// not above the brokers that stay), or when forced and the brokers that stay are a
/// majority of the voters. Says once, per change of what blocks it, why it waits.
#[allow(clippy::too_many_arguments)]
async fn drain_step(
    ctx: &Context,
    cluster: &Cluster,
    admin: &dyn AdminApi,
    op: &mut Operation,
    leaving: &str,
    voters: Option<i32>,
    forced: bool,
    drained: &mut Vec<String>,
) -> Result<Option<Blocked>, Error> {
    let staying = scale::ordinal(&cluster.name_any(), leaving).unwrap_or(0);
    let Some(member) = admin.member(leaving).await? else {
        let votes = voters.is_some_and(|v| v > staying);
        if !votes {
            ctx.event(
                cluster,
                EventType::Normal,
                "Drained",
                format!(
                    "{leaving} is no member and no voter; shrinking to {}",
                    op.to
                ),
            )
            .await;
            return Ok(None);
        }
        let majority = voters.is_some_and(|v| staying * 2 > v);
        if forced && majority {
            ctx.event(
                cluster,
                EventType::Warning,
                "ForcedScaleDown",
                format!("{FORCE_SCALE_DOWN_ANNOTATION}=true: removing {leaving}, which is no member but still votes"),
            )
            .await;
            return Ok(None);
        }
        let why = format!(
            "{leaving} is no member (its broker is down or not started) but still votes: it can be neither drained nor leave the voters until it runs; check its pod"
        );
        op.waiting_for = Some(why.clone());
        return Ok(Some(Some(("LeavingMemberDown", why))));
    };
    let holds = member.holds();
    if !member.draining || holds > 0 {
        // Asked again on every pass: a drain is idempotent, and the mark is what makes the
        // broker leave the voters when it stops, even one that holds nothing.
        admin.drain(leaving).await?;
        // Listed only if this put the mark: one drained by hand stays drained.
        if !member.draining && !drained.iter().any(|d| d == leaving) {
            drained.push(leaving.to_owned());
        }
    }
    if member.draining && holds == 0 {
        ctx.event(
            cluster,
            EventType::Normal,
            "Drained",
            format!("{leaving} holds no queues; shrinking to {}", op.to),
        )
        .await;
        return Ok(None);
    }
    let owning = format!("{leaving} holds {holds} queues");
    if forced {
        ctx.event(
            cluster,
            EventType::Warning,
            "ForcedScaleDown",
            format!(
                "{FORCE_SCALE_DOWN_ANNOTATION}=true: removing {leaving} without waiting for its drain ({owning}); queues it still holds lose that copy, and it stays a voter if it holds any"
            ),
        )
        .await;
        return Ok(None);
    }
    if holds == 0 {
        // Marked just now: the next pass sees the mark, and whether a role reached it
        // before the mark did.
        op.waiting_for = Some(format!("{leaving} to be marked draining"));
        return Ok(Some(None));
    }
    let waiting_for = format!("leaving members to hand over their queues: {owning}");
    // Once per change of what blocks it, not on every poll.
    if op.waiting_for.as_deref() != Some(waiting_for.as_str()) {
        ctx.event(
            cluster,
            EventType::Warning,
            "ScaleDownBlocked",
            format!(
                "{owning}: its pod stays until it owns no queues; to remove it anyway, annotate the Cluster {FORCE_SCALE_DOWN_ANNOTATION}=true"
            ),
        )
        .await;
    }
    let message = format!(
        "{waiting_for}; to remove it anyway, annotate the Cluster {FORCE_SCALE_DOWN_ANNOTATION}=true"
    );
    op.waiting_for = Some(waiting_for);
    Ok(Some(Some(("MemberOwnsQueues", message))))
}

/// Undrains the brokers a scale-down drained that the Cluster keeps again (ordinal below
/// `kept`: the scale-down was called off or retargeted, or a scale-up brings the pod back),
/// and forgets them; a broker the cluster no longer knows (404: no member, no mark) is
/// forgotten too. Another failure is retried on the next reconcile.
async fn undrain_kept(
    ctx: &Context,
    cluster: &Cluster,
    admin: &dyn AdminApi,
    drained: &mut Vec<String>,
    kept: i32,
) {
    let name = cluster.name_any();
    let mut still = Vec::new();
    for id in std::mem::take(drained) {
        if scale::ordinal(&name, &id).is_none_or(|n| n >= kept) {
            still.push(id);
            continue;
        }
        match admin.undrain(&id).await {
            Ok(()) => {
                let note = format!("{id} was drained by a scale-down and is kept again: undrained");
                ctx.event(cluster, EventType::Normal, "Undrained", note)
                    .await;
            }
            Err(crate::admin::AdminError::Unexpected { status: 404, .. }) => {}
            Err(e) => {
                tracing::warn!(member = %id, error = %e, "cannot undrain a broker the Cluster keeps; retried on the next reconcile");
                still.push(id);
            }
        }
    }
    *drained = still;
}

/// Pods the existing StatefulSet reports (`status.replicas`), 0 before it exists.
fn existing_pods(sts: Option<&StatefulSet>) -> i32 {
    sts.and_then(|s| s.status.as_ref())
        .map_or(0, |s| s.replicas)
}

/// Whether the Cluster carries [`FORCE_SCALE_DOWN_ANNOTATION`]` = "true"`.
fn force_scale_down(cluster: &Cluster) -> bool {
    cluster
        .annotations()
        .get(FORCE_SCALE_DOWN_ANNOTATION)
        .is_some_and(|v| v == "true")
}

/// What the existing StatefulSet says about a rollout (rollout.rs reads it).
fn rollout_progress(sts: &StatefulSet, replicas: i32) -> rollout::Progress {
    let partition = sts
        .spec
        .as_ref()
        .and_then(|s| s.update_strategy.as_ref())
        .and_then(|u| u.rolling_update.as_ref())
        .and_then(|r| r.partition)
        .unwrap_or(0);
    let status = sts.status.clone().unwrap_or_default();
    rollout::Progress {
        replicas,
        partition,
        updated: status.updated_replicas.unwrap_or(0),
        available: status.available_replicas.unwrap_or(0),
        done: status.current_revision == status.update_revision,
    }
}

/// The config hash annotation of a StatefulSet's pod template, if any.
fn config_hash_of(sts: &StatefulSet) -> Option<&str> {
    let annotations = sts
        .spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?;
    annotations
        .get(resources::CONFIG_HASH_ANNOTATION)
        .map(String::as_str)
}

/// Checks whether the operation's last step is done; clears `waiting_for` when it is (a
/// scale-down's step has decided that already, in [`scale_down_step`]).
async fn finish_step(
    ctx: &Context,
    cluster: &Cluster,
    admin: &dyn AdminApi,
    op: &mut Operation,
    ready: i32,
    overview: Option<&Overview>,
) {
    match (op.kind, op.step) {
        (OperationKind::ScaleUp, _) => {
            undrain_returning(ctx, cluster, admin, op, overview).await;
            let joined: Vec<&str> = overview
                .map(|o| o.members.iter().map(|m| m.id.as_str()).collect())
                .unwrap_or_default();
            let missing: Vec<String> = scale::joining_members(&cluster.name_any(), op.from, op.to)
                .into_iter()
                .filter(|id| !joined.contains(&id.as_str()))
                .collect();
            if ready >= op.to && missing.is_empty() {
                op.waiting_for = None;
                ctx.event(
                    cluster,
                    EventType::Normal,
                    "ScaledUp",
                    format!("{} brokers ready and joined", op.to),
                )
                .await;
            } else {
                op.waiting_for = Some(format!(
                    "{ready}/{} brokers ready; not joined yet: {}",
                    op.to,
                    if missing.is_empty() {
                        "none".to_string()
                    } else {
                        missing.join(", ")
                    }
                ));
            }
        }
        (OperationKind::ScaleDown, OperationStep::ShrinkingStatefulSet) => {
            if op.waiting_for.is_none() {
                ctx.event(
                    cluster,
                    EventType::Normal,
                    "ScaledDown",
                    format!("scaled down to {} brokers", op.to),
                )
                .await;
            }
        }
        (OperationKind::ScaleDown, _) => {}
    }
}

/// Undrains the members a scale-up brings back drained: a pod that an earlier scale-down
/// drained and removed keeps its drain mark (the brokers keep it by node id), so it would
/// take no queues, stay unready (`/readyz` 503), and hold the StatefulSet's next pod back.
/// A member the user drained by hand is not among the joining ones and stays drained.
async fn undrain_returning(
    ctx: &Context,
    cluster: &Cluster,
    admin: &dyn AdminApi,
    op: &Operation,
    overview: Option<&Overview>,
) {
    let joining = scale::joining_members(&cluster.name_any(), op.from, op.to);
    let marked = overview
        .into_iter()
        .flat_map(|o| &o.members)
        .filter(|m| m.draining && joining.contains(&m.id));
    for m in marked {
        match admin.undrain(&m.id).await {
            Ok(()) => {
                let note = format!(
                    "{} came back drained from an earlier scale-down: undrained, so it takes queues and serves again",
                    m.id
                );
                ctx.event(cluster, EventType::Normal, "Undrained", note)
                    .await;
            }
            Err(e) => {
                tracing::warn!(member = %m.id, error = %e, "cannot undrain a returning member; retried on the next reconcile")
            }
        }
    }
}

fn build_status(
    cluster: &Cluster,
    replicas: i32,
    sts: &k8s_openapi::api::apps::v1::StatefulSetStatus,
    overview: &Result<Overview, crate::admin::AdminError>,
    operation: Option<Operation>,
    rolling_restart: Option<RollingRestart>,
    scale_down: ScaleDownState,
) -> ClusterStatus {
    let previous = cluster
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    let generation = cluster.metadata.generation;
    let ready = sts.ready_replicas.unwrap_or(0);
    let members: Vec<MemberStatus> = overview
        .as_ref()
        .map(|o| {
            o.members
                .iter()
                .map(|m| MemberStatus {
                    id: m.id.clone(),
                    zone: m.zone.clone(),
                    state: m.state.clone(),
                })
                .collect()
        })
        .unwrap_or_default();
    let ring: Vec<String> = ring_order(
        &members
            .iter()
            .map(|m| Member::new(&m.id, &m.zone))
            .collect::<Vec<_>>(),
    )
    .into_iter()
    .map(|m| m.id)
    .collect();
    let quorum = overview.as_ref().ok().and_then(|o| {
        o.cluster.as_ref().map(|c| QuorumStatus {
            has_quorum: c.quorum,
            voters: i64::try_from(c.voters).unwrap_or(i64::MAX),
            leader: c.leader.clone(),
            reported_by: o.node.clone(),
        })
    });
    let (degraded, degraded_reason, degraded_message) = match overview {
        Err(e) => (true, "AdminApiUnreachable", e.to_string()),
        Ok(o) if quorum.as_ref().is_some_and(|q| !q.has_quorum) => (
            true,
            "NoQuorum",
            format!(
                "{} holds no quorum: the cluster cannot commit changes; bring back a majority of its members",
                o.node
            ),
        ),
        Ok(_) if ready < replicas => (
            true,
            "BrokersNotReady",
            format!("{ready}/{replicas} brokers ready"),
        ),
        Ok(_) => (
            false,
            "AllBrokersReady",
            format!("{ready}/{replicas} brokers ready"),
        ),
    };
    let (reconciled_reason, reconciled_message) = match (&operation, &rolling_restart) {
        (Some(op), _) => (
            format!("{:?}", op.step),
            op.waiting_for
                .clone()
                .unwrap_or_else(|| "operation in progress".to_string()),
        ),
        (None, Some(rolling)) => ("RollingRestart".to_string(), rolling.waiting_for.clone()),
        (None, None) => (
            "Applied".to_string(),
            "all owned objects applied".to_string(),
        ),
    };
    let settled = operation.is_none() && rolling_restart.is_none();
    let is_ready = !degraded && settled;
    let conditions = vec![
        condition(
            previous,
            "Ready",
            is_ready,
            if is_ready {
                "ClusterReady"
            } else {
                degraded_reason
            },
            degraded_message.clone(),
            generation,
        ),
        condition(
            previous,
            "Reconciled",
            settled,
            &reconciled_reason,
            reconciled_message,
            generation,
        ),
        condition(
            previous,
            "Degraded",
            degraded,
            degraded_reason,
            degraded_message,
            generation,
        ),
        scale_down_blocked(previous, scale_down.blocked, generation),
    ];
    ClusterStatus {
        observed_generation: generation,
        replicas: sts.replicas,
        ready_replicas: ready,
        selector: resources::selector_string(cluster),
        members,
        ring,
        conditions,
        operation,
        quorum,
        rolling_restart,
        drained_by_scale_down: scale_down.drained,
    }
}

/// What a reconcile's scale-down step leaves for the status.
struct ScaleDownState {
    /// What holds it that the user may have to act on.
    blocked: Blocked,
    /// `drained_by_scale_down`.
    drained: Vec<String>,
}

/// `ScaleDownBlocked`: true while a scale-down waits on something the user may have to act
/// on — a leaving member that holds queues (`MemberOwnsQueues`), stopped brokers that still
/// vote (`StaleVoters`, also for the second or two a removed broker takes to leave the
/// voters), a leaving member that is down but votes (`LeavingMemberDown`) — with the reason
/// in words.
fn scale_down_blocked(
    previous: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    blocked: Blocked,
    generation: Option<i64>,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    match blocked {
        Some((reason, message)) => condition(
            previous,
            "ScaleDownBlocked",
            true,
            reason,
            message,
            generation,
        ),
        None => condition(
            previous,
            "ScaleDownBlocked",
            false,
            "NotBlocked",
            "no scale-down waits on anything that needs you",
            generation,
        ),
    }
}

/// Gets the Secret `name`, creating it with `data` when missing. Never overwrites: a
/// regenerated password or peer secret would lock clients or brokers out.
async fn ensure_secret(
    ctx: &Context,
    cluster: &Cluster,
    secrets: &Api<Secret>,
    name: &str,
    owner: &k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference,
    data: impl FnOnce(&mut dyn Read) -> Result<BTreeMap<String, String>, Error>,
) -> Result<Secret, Error> {
    if let Some(existing) = secrets.get_opt(name).await? {
        return Ok(existing);
    }
    let mut random = std::fs::File::open("/dev/urandom")?;
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: cluster.namespace(),
            labels: Some(resources::selector_labels(cluster)),
            owner_references: Some(vec![owner.clone()]),
            ..ObjectMeta::default()
        },
        string_data: Some(data(&mut random)?),
        ..Secret::default()
    };
    let created = secrets.create(&PostParams::default(), &secret).await?;
    ctx.event(
        cluster,
        EventType::Normal,
        "SecretCreated",
        format!("created Secret {name}"),
    )
    .await;
    // The API server turns stringData into data; fall back to what we sent if it did not echo it.
    Ok(if created.data.is_some() {
        created
    } else {
        to_data(secret)
    })
}

fn to_data(mut secret: Secret) -> Secret {
    let data = secret.string_data.take().unwrap_or_default();
    secret.data = Some(
        data.into_iter()
            .map(|(k, v)| (k, ByteString(v.into_bytes())))
            .collect(),
    );
    secret
}

/// 32 random bytes as hex: a password or peer secret with 256 bits of entropy.
fn random_token(source: &mut dyn Read) -> Result<String, Error> {
    let mut bytes = [0u8; 32];
    source.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A key of a Secret as UTF-8 (from `data`, or `stringData` if not yet converted).
pub fn secret_value(secret: &Secret, name: &str, key: &str) -> Result<String, Error> {
    let missing = || Error::MissingSecretKey {
        secret: name.to_string(),
        key: key.to_string(),
    };
    if let Some(v) = secret.data.as_ref().and_then(|d| d.get(key)) {
        return String::from_utf8(v.0.clone()).map_err(|_| missing());
    }
    secret
        .string_data
        .as_ref()
        .and_then(|d| d.get(key))
        .cloned()
        .ok_or_else(missing)
}
