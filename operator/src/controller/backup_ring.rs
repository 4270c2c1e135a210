//! `BackupRing` reconcile: read the ring and the rebalance view from the Cluster's brokers
//! (any member answers with the cluster map's view), start a rebalance when a person
//! approved the proposal (`Manual`) or the primaries drifted past the threshold
//! (`Automatic`), and report all of it in the status.
//!
//! The rebalance itself is the brokers': its plan and progress live in the cluster map, so
//! the operator only starts it and reads it; an operator restart mid-way changes nothing.

use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::{Context, Error, admin_for_cluster, write_status};
use crate::admin::{AdminError, Overview, RebalanceView};
use crate::conditions::condition;
use crate::crd::{
    APPROVE_ANNOTATION, BackupRing, BackupRingStatus, Proposal, RebalanceMode, RebalanceStatus,
    RingMember,
};

/// How often an idle ring is read again (the status follows the cluster).
pub const RING_CHECK: Duration = Duration::from_secs(30);
/// How often a ring with a rebalance under way is read again (its progress).
pub const RUNNING_CHECK: Duration = Duration::from_secs(5);
/// Retry period while the Cluster does not exist yet.
pub const CLUSTER_WAIT: Duration = Duration::from_secs(30);
/// Primary moves the proposal lists by name (the rest are counted).
pub const PROPOSAL_SAMPLE: usize = 10;

/// Reconciles one `BackupRing`.
pub async fn reconcile(ring: Arc<BackupRing>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile("BackupRing");
    let ns = ring
        .namespace()
        .ok_or(Error::MissingObjectKey("namespace"))?;
    let previous = ring.status.clone().unwrap_or_default();
    let generation = ring.metadata.generation;
    let cluster = &ring.spec.cluster_ref.name;
    let Some(admin) = admin_for_cluster(&ctx, &ns, cluster).await? else {
        let status = BackupRingStatus {
            observed_generation: generation,
            conditions: vec![condition(
                &previous.conditions,
                "Ready",
                false,
                "ClusterNotFound",
                format!(
                    "Cluster {cluster} not found (or its default-user Secret is missing); create it"
                ),
                generation,
            )],
            ..BackupRingStatus::default()
        };
        write_status(&ctx, &ns, ring.as_ref(), &status).await?;
        return Ok(Action::requeue(CLUSTER_WAIT));
    };
    let overview = admin.overview().await?;
    let mut view = admin.rebalance().await?;
    let policy = &ring.spec.rebalance;
    let approved = ring
        .annotations()
        .get(APPROVE_ANNOTATION)
        .is_some_and(|v| v == "approve");
    let spread = spread(&view);
    let wanted = match policy.mode {
        RebalanceMode::Manual => approved,
        RebalanceMode::Automatic => spread > policy.threshold,
    };
    if wanted && !view.balanced && !is_running(&view) {
        match admin.start_rebalance(policy.concurrency).await {
            Ok(()) => {
                let note = format!(
                    "rebalance started ({}): {} primary moves planned, at most {} at once",
                    if approved { "approved" } else { "automatic" },
                    view.plan.len(),
                    policy.concurrency
                );
                ctx.event(ring.as_ref(), EventType::Normal, "RebalanceStarted", note)
                    .await;
                view = admin.rebalance().await?;
            }
            Err(AdminError::Busy(reason)) => {
                ctx.event(ring.as_ref(), EventType::Normal, "RebalanceBusy", reason)
                    .await;
            }
            Err(e) => return Err(e.into()),
        }
    } else if approved {
        let why = if view.balanced {
            "the ring is balanced: nothing to move"
        } else {
            "a rebalance is under way: approve again once it is over"
        };
        ctx.event(
            ring.as_ref(),
            EventType::Normal,
            "NothingApproved",
            why.into(),
        )
        .await;
    }
    if approved {
        // Consumed: a later proposal needs a new approval.
        let patch = serde_json::json!({"metadata": {"annotations": {APPROVE_ANNOTATION: null}}});
        Api::<BackupRing>::namespaced(ctx.client.clone(), &ns)
            .patch(
                &ring.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
    }
    let status = status(&previous, generation, &overview, &view, policy.mode);
    write_status(&ctx, &ns, ring.as_ref(), &status).await?;
    Ok(Action::requeue(if is_running(&view) {
        RUNNING_CHECK
    } else {
        RING_CHECK
    }))
}

fn is_running(view: &RebalanceView) -> bool {
    view.current.as_ref().is_some_and(|c| c.status == "running")
}

/// Most primaries on one active member minus fewest.
fn spread(view: &RebalanceView) -> u64 {
    let most = view.primaries.values().max().copied().unwrap_or(0);
    let fewest = view.primaries.values().min().copied().unwrap_or(0);
    most - fewest
}

/// The status for what the brokers answered.
fn status(
    previous: &BackupRingStatus,
    generation: Option<i64>,
    overview: &Overview,
    view: &RebalanceView,
    mode: RebalanceMode,
) -> BackupRingStatus {
    let ring: Vec<RingMember> = (overview.members.iter())
        .map(|m| RingMember {
            member: m.id.clone(),
            zone: m.zone.clone(),
            state: m.state.clone(),
            primaries: m.primaries,
            backups: m.backups,
            in_sync_backups: m.in_sync_backups,
        })
        .collect();
    let out_of_sync_backups = (ring.iter())
        .map(|m| m.backups.saturating_sub(m.in_sync_backups))
        .sum();
    let proposal = (!view.balanced).then(|| Proposal {
        moves: (view.plan.len() + view.backup_plan.len()) as u64,
        primary_moves: view.plan.len() as u64,
        backup_moves: view.backup_plan.len() as u64,
        sample: (view.plan.iter().take(PROPOSAL_SAMPLE))
            .map(|m| format!("{}/{}: {} -> {}", m.vhost, m.queue, m.from, m.to))
            .collect(),
    });
    let rebalance = view.current.as_ref().map(|c| RebalanceStatus {
        status: c.status.clone(),
        total: c.total,
        done: c.done,
        failed: c.failed,
        left: c.pending + c.running,
        joined: c.joined.clone(),
    });
    let (reason, message) = match (view.balanced, is_running(view), mode) {
        (true, _, _) => ("Balanced", "primaries and backups are even".to_string()),
        (false, true, _) => ("Rebalancing", "a rebalance is under way".to_string()),
        (false, false, RebalanceMode::Manual) => (
            "Proposed",
            format!(
                "the status holds a proposal; annotate with {APPROVE_ANNOTATION}=approve to carry it out"
            ),
        ),
        (false, false, RebalanceMode::Automatic) => (
            "WithinThreshold",
            "uneven, but within the threshold".to_string(),
        ),
    };
    BackupRingStatus {
        observed_generation: generation,
        conditions: vec![
            condition(
                &previous.conditions,
                "Ready",
                true,
                "RingRead",
                format!("{} members on the ring", ring.len()),
                generation,
            ),
            condition(
                &previous.conditions,
                "Balanced",
                view.balanced,
                reason,
                message,
                generation,
            ),
        ],
        ring,
        balanced: view.balanced,
        out_of_sync_backups,
        proposal,
        rebalance,
    }
}
