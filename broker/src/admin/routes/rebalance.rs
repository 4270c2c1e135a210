//! `/api/cluster/rebalance`: evening out the queues' primaries over the active members
//! (`ringmqctl cluster rebalance`). The plan and its progress are the cluster map's, so any
//! member answers with the same view ([`crate::cluster::rebalance`]).

use super::{commit, ok};
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply, json_reply};
use crate::cluster::rebalance::{DEFAULT_CONCURRENCY, MAX_CONCURRENCY};
use crate::cluster::{Cluster, MoveState, PlannedMove, Rebalance};
use crate::core::{RebalanceStep, WiringOp};
use futures::future::BoxFuture;
use hyper::StatusCode;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;

/// `GET /api/cluster/rebalance`: the primary moves a rebalance started now would make
/// (`plan`), the backup moves it would make if the primaries stayed (`backup_plan`; it plans
/// them once its primary moves are done), the primaries and backups each active member
/// holds, whether there is nothing to move (`balanced`), and the newest rebalance under way
/// or finished (`current`, `null` before the first).
pub(super) fn show(c: &Ctx<'_>) -> Result<Reply> {
    let cluster = clustered(c)?;
    let plan = cluster.rebalance_plan();
    let backup_plan = cluster.rebalance_backup_plan();
    let active: Vec<String> = (cluster.ring().into_iter())
        .filter(|n| !cluster.is_draining(n))
        .collect();
    let held = cluster.held();
    let count = |f: fn(&crate::cluster::Held) -> u64| -> BTreeMap<&str, u64> {
        (active.iter())
            .map(|n| (n.as_str(), held.get(n).map_or(0, f)))
            .collect()
    };
    ok(json!({
        "balanced": plan.is_empty() && backup_plan.is_empty(),
        "primaries": count(|h| h.primaries),
        "backups": count(|h| h.backups),
        "plan": plan.iter().map(move_json).collect::<Vec<_>>(),
        "backup_plan": backup_plan.iter().map(move_json).collect::<Vec<_>>(),
        "current": cluster.rebalance().as_ref().map(rebalance_json),
    }))
}

/// `POST /api/cluster/rebalance` with an optional `{"concurrency": N}` (moves under way at
/// once, 1..=64, default 2): every member plans the moves from the map at the same point
/// and carries them out, each a planned primary move (catch-up, then switch). 202 with the
/// rebalance as committed; 409 while another one has moves left.
pub(super) fn start<'a>(c: &'a Ctx<'a>) -> BoxFuture<'a, Result<Reply>> {
    Box::pin(async move {
        let cluster = clustered(c)?;
        let body = c.call.json()?;
        let concurrency = match body.get("concurrency") {
            None | Some(Value::Null) => DEFAULT_CONCURRENCY,
            Some(v) => v
                .as_u64()
                .filter(|n| (1..=u64::from(MAX_CONCURRENCY)).contains(n))
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "concurrency must be a whole number from 1 to {MAX_CONCURRENCY}, not {v}"
                    ))
                })?,
        };
        commit(
            &cluster,
            WiringOp::Rebalance(RebalanceStep::Start { concurrency }),
        )
        .await?;
        tracing::warn!(concurrency, user = %c.call.user.name, "rebalance started via admin API");
        accepted(&cluster)
    })
}

/// `POST /api/cluster/rebalance/stop`: the moves not started yet are skipped; those under
/// way finish. 202 with the rebalance as it is then (stopping a finished one changes
/// nothing).
pub(super) fn stop<'a>(c: &'a Ctx<'a>) -> BoxFuture<'a, Result<Reply>> {
    Box::pin(async move {
        let cluster = clustered(c)?;
        commit(&cluster, WiringOp::Rebalance(RebalanceStep::Stop)).await?;
        tracing::warn!(user = %c.call.user.name, "rebalance stopped via admin API");
        accepted(&cluster)
    })
}

fn clustered(c: &Ctx<'_>) -> Result<Arc<Cluster>> {
    super::clustered(c, "there is nothing to rebalance")
}

fn accepted(cluster: &Cluster) -> Result<Reply> {
    let current = cluster.rebalance().as_ref().map(rebalance_json);
    Ok(json_reply(StatusCode::ACCEPTED, &json!(current)))
}

/// A rebalance as the API shows it: its status, counts by state, and every move.
fn rebalance_json(r: &Rebalance) -> Value {
    let count = |f: fn(&MoveState) -> bool| r.moves.iter().filter(|m| f(&m.state)).count();
    json!({
        "status": r.status(),
        "started_at": r.started_at,
        "concurrency": r.concurrency,
        "stopped": r.stopped,
        "joined": r.joined,
        "scope": r.scope,
        "total": r.moves.len(),
        "pending": count(|s| *s == MoveState::Pending),
        "running": count(|s| *s == MoveState::Running),
        "done": count(|s| *s == MoveState::Done),
        "failed": count(|s| matches!(s, MoveState::Failed(_))),
        "skipped": count(|s| *s == MoveState::Skipped),
        "moves": r.moves.iter().map(move_json).collect::<Vec<_>>(),
    })
}

fn move_json(m: &PlannedMove) -> Value {
    let (state, reason) = match &m.state {
        MoveState::Pending => ("pending", None),
        MoveState::Running => ("running", None),
        MoveState::Done => ("done", None),
        MoveState::Failed(why) => ("failed", Some(why.as_str())),
        MoveState::Skipped => ("skipped", None),
    };
    json!({
        "vhost": m.vhost,
        "queue": m.queue,
        "kind": if m.backup { "backup" } else { "primary" },
        "from": m.from,
        "to": m.to,
        "state": state,
        "reason": reason,
    })
}
