//! `/api/members`: the brokers of the cluster (or this one alone), and asking this member to
//! leave so that a load balancer drains it before it stops.

use super::ok;
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply, json_reply, metrics};
use crate::broker::Broker;
use crate::core::WiringOp;
use futures::future::BoxFuture;
use hyper::StatusCode;
use serde_json::{Value, json};
use std::sync::atomic::Ordering;

/// `GET /api/members`.
pub(super) fn list(c: &Ctx<'_>) -> Result<Reply> {
    ok(members(c.broker))
}

/// `GET /api/members/{id}`: the member, with the number of queues whose primary it is
/// (`owned_queues`) and, on a cluster, the backups it holds. A cluster member answers for
/// any member, from the cluster map, so every member gives the same answer (what a drain or
/// a scale-down check needs: it may not be able to reach the member it asks about).
pub(super) fn get(c: &Ctx<'_>) -> Result<Reply> {
    let [id] = c.args();
    let b = c.broker;
    if b.cluster().is_none() {
        this_member(b, id)?;
        let mut m = member(b);
        m["owned_queues"] = json!(metrics::totals(b).queues);
        return ok(m);
    }
    let all = members(b);
    let listed = all.as_array().into_iter().flatten();
    let Some(found) = listed.clone().find(|m| m["id"] == id) else {
        let ids: Vec<&str> = listed.filter_map(|m| m["id"].as_str()).collect();
        return Err(ApiError::not_found(format!(
            "no member '{id}' in the cluster (members: {})",
            ids.join(", ")
        )));
    };
    let mut m = found.clone();
    m["owned_queues"] = m["primaries"].clone();
    ok(m)
}

/// `POST /api/members/{id}/drain`, answered by any member: the cluster map marks the member
/// draining — it takes no new roles, its primaries move to other members (catch-up, then
/// switch), its backups are replaced, its clients are closed with 320 and sent elsewhere.
/// 202 once the mark is committed; the drain is done when `GET /api/members/{id}` shows
/// it holding nothing (`ringmqctl cluster drain NODE --wait`).
pub(super) fn drain<'a>(c: &'a Ctx<'a>) -> BoxFuture<'a, Result<Reply>> {
    Box::pin(set_draining(c, true))
}

/// `POST /api/members/{id}/undrain`: the member takes roles again (a primary move the
/// drain started and has not switched yet is called off); what moved off stays where it
/// is (`cluster rebalance` evens it out).
pub(super) fn undrain<'a>(c: &'a Ctx<'a>) -> BoxFuture<'a, Result<Reply>> {
    Box::pin(set_draining(c, false))
}

async fn set_draining(c: &Ctx<'_>, draining: bool) -> Result<Reply> {
    let [id] = c.args();
    let cluster = super::clustered(c, "there is no other member to drain to")?;
    let known = cluster
        .members()
        .iter()
        .any(|m| m.info.as_ref().is_some_and(|i| i.node_id == id));
    // Undraining a member that left is allowed: its mark outlives it.
    let undrain_gone = !draining && cluster.is_draining(id);
    if !known && !undrain_gone {
        return Err(ApiError::not_found(format!(
            "no member '{id}' in the cluster (see GET /api/members)"
        )));
    }
    let op = WiringOp::DrainMember {
        node: id.to_owned(),
        draining,
    };
    super::commit(&cluster, op).await?;
    let state = if draining { "draining" } else { "running" };
    tracing::warn!(member = %id, state, user = %c.call.user.name, "member drain changed via admin API");
    Ok(json_reply(
        StatusCode::ACCEPTED,
        &json!({"id": id, "state": state}),
    ))
}

/// `POST /api/members/{id}/leave`: from now on `/readyz` answers 503.
pub(super) fn leave(c: &Ctx<'_>) -> Result<Reply> {
    let [id] = c.args();
    let b = c.broker;
    this_member(b, id)?;
    b.registry.leaving.store(true, Ordering::Relaxed);
    tracing::warn!(member = %id, "member leaving on request: /readyz now answers 503");
    Ok(json_reply(
        StatusCode::ACCEPTED,
        &json!({"id": id, "state": "leaving"}),
    ))
}

fn this_member(b: &Broker, id: &str) -> Result<()> {
    if id != b.config.node_id {
        return Err(ApiError::not_found(format!(
            "no member '{id}': this single node is '{}'",
            b.config.node_id
        )));
    }
    Ok(())
}

fn member(b: &Broker) -> Value {
    let r = &b.registry;
    json!({
        "id": b.config.node_id,
        "amqp": r.amqp_addr.get().map(ToString::to_string),
        "admin": r.admin_addr.get().map(ToString::to_string),
        "zone": b.config.zone,
        "state": if r.leaving.load(Ordering::Relaxed) { "leaving" } else { "running" },
    })
}

/// Every member in ring order when clustered (with `ring_position`, whether it holds the
/// cluster map, and the primaries and backups it holds by the cluster map's roles), else
/// this broker alone; the overview lists the same.
pub(super) fn members(b: &Broker) -> Value {
    let Some(cluster) = b.cluster() else {
        return json!([member(b)]);
    };
    let held = cluster.held();
    let members = cluster.members();
    Value::Array(
        cluster
            .ring()
            .iter()
            .enumerate()
            .filter_map(|(position, node)| {
                let m = (members.iter())
                    .find(|m| m.info.as_ref().is_some_and(|i| i.node_id == *node))?;
                let info = m.info.as_ref()?;
                let h = held.get(&info.node_id).copied().unwrap_or_default();
                let draining = cluster.is_draining(&info.node_id);
                let state = match (m.synced, draining) {
                    (false, _) => "joining",
                    (true, true) => "draining",
                    (true, false) => "running",
                };
                Some(json!({
                    "id": info.node_id,
                    "amqp": info.amqp,
                    "admin": info.admin,
                    "zone": info.zone,
                    "state": state,
                    "draining": draining,
                    "ring_position": position,
                    "ring_order": info.ring_order,
                    "primaries": h.primaries,
                    "backups": h.backups,
                    "in_sync_backups": h.in_sync_backups,
                }))
            })
            .collect(),
    )
}
