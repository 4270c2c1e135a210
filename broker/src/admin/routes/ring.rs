//! `/api/cluster/ring`: the ring's layout (`ringmqctl cluster layout`, a `BackupRing`'s
//! `order` and `backups`) — the order of the members and the `k` of queues declared without
//! their own. The layout is the cluster map's, so any member answers the same
//! ([`crate::cluster::layout`]).

use super::{commit, ok};
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply, json_reply};
use crate::cluster::Cluster;
use crate::cluster::layout::{RingLayout, RingOrder};
use crate::cluster::roles::MAX_BACKUPS;
use crate::core::WiringOp;
use futures::future::BoxFuture;
use hyper::StatusCode;
use serde_json::{Value, json};
use std::sync::Arc;

/// `GET /api/cluster/ring`: the layout (`order`: `"placement"`, `"zone-aware"` or the
/// explicit list; `backups`: `k` or `null`), the agreed index of the op that set it
/// (`changed_at`, 0 if never: a rebalance started before it has not followed it), and the
/// members in ring order now (`ring`).
pub(super) fn show(c: &Ctx<'_>) -> Result<Reply> {
    ok(layout_json(&*clustered(c)?))
}

/// `PUT /api/cluster/ring` with `{"order": ..., "backups": ...}` (each optional: a missing
/// one is the default, `"placement"` and `null`): every member orders the ring by it at the
/// same point of the agreed order and places members that join later by it; queues whose
/// `k` is not their own take on `backups`. No queue's copies move: `POST
/// /api/cluster/rebalance` puts the backups on the new ring successors (catch-up first).
/// 202 with the layout as committed; 400 for a layout no ring can follow; 409 while a
/// member of a version without layouts is in the cluster (it could not read the change).
pub(super) fn set<'a>(c: &'a Ctx<'a>) -> BoxFuture<'a, Result<Reply>> {
    Box::pin(async move {
        let cluster = clustered(c)?;
        let layout = parse(&c.call.json()?)?;
        if let Some(old) = cluster.predating_layouts() {
            return Err(ApiError::conflict(format!(
                "member '{old}' runs a version without ring layouts, which would leave the \
                 cluster on this change: upgrade it first"
            )));
        }
        commit(&cluster, WiringOp::SetRingLayout(layout.clone())).await?;
        tracing::warn!(?layout, user = %c.call.user.name, "ring layout set via admin API");
        Ok(json_reply(StatusCode::ACCEPTED, &layout_json(&cluster)))
    })
}

fn clustered(c: &Ctx<'_>) -> Result<Arc<Cluster>> {
    super::clustered(c, "it has no ring to lay out")
}

/// The layout a body asks for, or a 400 that says what to fix.
fn parse(body: &Value) -> Result<RingLayout> {
    let order = match body.get("order") {
        None | Some(Value::Null) => RingOrder::Placement,
        Some(Value::String(s)) if s == "placement" => RingOrder::Placement,
        Some(Value::String(s)) if s == "zone-aware" => RingOrder::ZoneAware,
        Some(Value::Array(items)) => RingOrder::Explicit(
            (items.iter())
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    ApiError::bad_request("an explicit ring order is a list of node ids (strings)")
                })?,
        ),
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "order must be \"placement\", \"zone-aware\" or a list of node ids, not {other}"
            )));
        }
    };
    let backups = match body.get("backups") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|k| *k <= u64::from(MAX_BACKUPS))
                .and_then(|k| u8::try_from(k).ok())
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "backups must be a whole number from 0 to {MAX_BACKUPS}, or null, not {v}"
                    ))
                })?,
        ),
    };
    let layout = RingLayout { order, backups };
    layout
        .validate()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(layout)
}

fn layout_json(cluster: &Cluster) -> Value {
    let (layout, changed_at) = cluster.layout();
    let order = match &layout.order {
        RingOrder::Placement => json!("placement"),
        RingOrder::ZoneAware => json!("zone-aware"),
        RingOrder::Explicit(list) => json!(list),
    };
    json!({
        "order": order,
        "backups": layout.backups,
        "changed_at": changed_at,
        "ring": cluster.ring(),
    })
}
