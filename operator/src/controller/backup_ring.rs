//! `BackupRing` reconcile: read the ring and the rebalance view from the Cluster's brokers
//! (any member answers with the cluster map's view), bring the brokers' ring layout to the
//! spec's `order` and `backups`, start a rebalance when a person approved the proposal
//! (`Manual`) or the primaries drifted past the threshold or the layout changed since the
//! last one (`Automatic`), and report all of it in the status.
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
use crate::admin::{AdminApi, AdminError, LayoutOrder, Overview, RebalanceView, RingLayout};
use crate::conditions::condition;
use crate::crd::{
    APPROVE_ANNOTATION, BackupRing, BackupRingStatus, LayoutStatus, Proposal, RebalanceMode,
    RebalanceStatus, RingMember, RingOrderPolicy,
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
    let layout = apply_layout(&ring, &ctx, admin.as_ref()).await?;
    let mut view = admin.rebalance().await?;
    let policy = &ring.spec.rebalance;
    let approved = ring
        .annotations()
        .get(APPROVE_ANNOTATION)
        .is_some_and(|v| v == "approve");
    let spread = spread(&view);
    let unfollowed = (layout.as_ref()).is_some_and(|(l, _)| l.changed_at > started_at(&view));
    let wanted = match policy.mode {
        RebalanceMode::Manual => approved,
        RebalanceMode::Automatic => spread > policy.threshold || unfollowed,
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
    let mut status = status(&previous, generation, &overview, &view, policy.mode);
    if let Some((applied, refused)) = layout {
        layout_status(&mut status, &previous, &applied, refused, &view);
    }
    write_status(&ctx, &ns, ring.as_ref(), &status).await?;
    Ok(Action::requeue(if is_running(&view) {
        RUNNING_CHECK
    } else {
        RING_CHECK
    }))
}

/// Brings the brokers' layout to what the spec sets (`order`, `backups`; the parts it does
/// not set stay as the brokers have them). `None` when the spec sets neither; else the
/// layout the brokers hold now and, when they refused the spec's, their reason.
async fn apply_layout(
    ring: &BackupRing,
    ctx: &Context,
    admin: &dyn AdminApi,
) -> Result<Option<(RingLayout, Option<String>)>, Error> {
    let spec = &ring.spec;
    if spec.order.is_none() && spec.backups.is_none() {
        return Ok(None);
    }
    let now = match admin.ring_layout().await {
        Ok(now) => now,
        Err(AdminError::Unexpected { status, body, .. }) if status == 400 || status == 404 => {
            // A single broker (400), or brokers of a version without layouts (404).
            let why = format!("GET /api/cluster/ring answered {status}: {body}");
            ctx.event(ring, EventType::Warning, "LayoutRefused", why.clone())
                .await;
            return Ok(Some((RingLayout::default(), Some(why))));
        }
        Err(e) => return Err(e.into()),
    };
    let order = match &spec.order {
        None => now.order.clone(),
        Some(o) => match o.policy {
            RingOrderPolicy::Placement => LayoutOrder::Named("placement".into()),
            RingOrderPolicy::ZoneAware => LayoutOrder::Named("zone-aware".into()),
            RingOrderPolicy::Explicit => LayoutOrder::Explicit(o.members.clone()),
        },
    };
    let backups = spec.backups.or(now.backups);
    if (&now.order, now.backups) == (&order, backups) {
        return Ok(Some((now, None)));
    }
    match admin.set_ring_layout(&order, backups).await {
        Ok(applied) => {
            let note = format!(
                "ring layout set: order {}, backups {}; the next rebalance puts the backups \
                 on their primaries' new ring successors",
                serde_json::to_string(&applied.order).unwrap_or_default(),
                applied
                    .backups
                    .map_or("per member".into(), |k| k.to_string())
            );
            ctx.event(ring, EventType::Normal, "LayoutApplied", note)
                .await;
            Ok(Some((applied, None)))
        }
        Err(AdminError::Unexpected {
            status: 400 | 409,
            body,
            ..
        }) => {
            ctx.event(ring, EventType::Warning, "LayoutRefused", body.clone())
                .await;
            Ok(Some((now, Some(body))))
        }
        Err(e) => Err(e.into()),
    }
}

/// Agreed index of the newest rebalance's start, if it was one over the whole ring (0: none
/// yet, or the newest was the brokers' handover to a new member, which moves only the
/// queues of it and its neighbours).
fn started_at(view: &RebalanceView) -> u64 {
    (view.current.as_ref())
        .filter(|c| c.joined.is_none())
        .map_or(0, |c| c.started_at)
}

/// The layout's part of the status: what the brokers hold, whether the backups follow it,
/// and the `LayoutApplied` condition.
fn layout_status(
    status: &mut BackupRingStatus,
    previous: &BackupRingStatus,
    applied: &RingLayout,
    refused: Option<String>,
    view: &RebalanceView,
) {
    let (policy, members) = match &applied.order {
        LayoutOrder::Explicit(list) => ("Explicit", list.clone()),
        LayoutOrder::Named(n) if n == "zone-aware" => ("ZoneAware", Vec::new()),
        LayoutOrder::Named(_) => ("Placement", Vec::new()),
    };
    let done = view.current.as_ref().is_some_and(|c| c.status == "done");
    let followed = view.balanced || (applied.changed_at <= started_at(view) && done);
    status.layout = Some(LayoutStatus {
        policy: policy.into(),
        members,
        backups: applied.backups,
        followed,
    });
    let generation = status.observed_generation;
    let (ok, reason, message) = match refused {
        Some(why) => (
            false,
            "Refused",
            format!("the brokers refused the layout: {why}"),
        ),
        None => (true, "Applied", "the brokers hold the spec's layout".into()),
    };
    status.conditions.push(condition(
        &previous.conditions,
        "LayoutApplied",
        ok,
        reason,
        message,
        generation,
    ));
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
        layout: None,
    }
}
