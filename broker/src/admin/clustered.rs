//! Wiring writes of the admin API on a cluster member: declaring or deleting a queue or an
//! exchange, and adding a binding, go through the cluster map like the same AMQP methods,
//! so every member applies them in the same order; the reply comes after the commit.
//!
//! The route table names the planner of each such route next to its local handler
//! ([`super::router::Route::through_cluster`]); a planner only checks the call and builds the
//! operation, [`run`] submits it.

use super::router::{Ctx, Result};
use super::routes::{
    arguments, created, flag, no_exchange, no_queue, refuse_exclusive, routing_key, type_field,
    vhost,
};
use super::{ApiError, Reply, empty_reply};
use crate::broker::Broker;
use crate::cluster::Cluster;
use crate::core::WiringOp;
use hyper::StatusCode;
use std::sync::Arc;

/// Turns a call into the cluster operation that makes its change, checking what can be
/// checked on this member first so that a bad request never reaches the cluster map.
pub(super) type Planner = for<'a> fn(&Ctx<'a>, &Cluster) -> Result<Plan<'a>>;

/// A wiring change ready to submit: the vhost it applies to, the operation, and which
/// success reply it gets once committed.
pub(super) struct Plan<'a> {
    vhost: &'a str,
    op: WiringOp,
    reply: Planned,
}

/// Plans the call with `plan`, submits the operation and answers once it is committed.
pub(super) async fn run(c: &Ctx<'_>, cluster: &Arc<Cluster>, plan: Planner) -> Result<Reply> {
    let planned = plan(c, cluster)?;
    commit(c.broker, cluster, planned).await
}

/// Submits the change and waits for its commit. Existence before the change decides 201 or
/// 204, as on a single broker.
async fn commit(b: &Arc<Broker>, cluster: &Arc<Cluster>, plan: Plan<'_>) -> Result<Reply> {
    let Plan {
        vhost: vh,
        op,
        reply,
    } = plan;
    let was_new = match (&op, reply) {
        (WiringOp::DeclareQueue { name, .. }, Planned::Created) => {
            vhost(b, vh)?.lock().queue(name).is_none()
        }
        (WiringOp::DeclareExchange { name, .. }, Planned::Created) => {
            vhost(b, vh)?.lock().exchange(name).is_none()
        }
        _ => false,
    };
    vhost(b, vh)?;
    let outcome = cluster.submit(vh, op).await.map_err(|_| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the cluster layer stopped",
        )
    })?;
    outcome.map_err(ApiError::from_amqp)?;
    Ok(match reply {
        Planned::Created => created(was_new),
        Planned::NoContent => empty_reply(StatusCode::NO_CONTENT),
        Planned::BindingCreated => empty_reply(StatusCode::CREATED),
    })
}

/// Which success reply a change gets.
#[derive(Debug, Clone, Copy)]
enum Planned {
    /// 201 if the object is new, else 204.
    Created,
    /// 204.
    NoContent,
    /// 201.
    BindingCreated,
}

/// `PUT /api/queues/{vhost}/{name}`: the queue is owned by this member.
pub(super) fn declare_queue<'a>(c: &Ctx<'a>, cluster: &Cluster) -> Result<Plan<'a>> {
    let [vh, name] = c.args();
    let body = c.call.json()?;
    refuse_exclusive(&body)?;
    if name.is_empty() {
        return Err(ApiError::bad_request("a queue needs a non-empty name"));
    }
    Ok(Plan {
        vhost: vh,
        op: WiringOp::DeclareQueue {
            name: name.to_owned(),
            durable: flag(&body, "durable", true)?,
            exclusive: false,
            auto_delete: flag(&body, "auto_delete", false)?,
            arguments: arguments(&body)?,
            home: Some(cluster.node_id().to_owned()),
            server_named: false,
        },
        reply: Planned::Created,
    })
}

/// `DELETE /api/queues/{vhost}/{name}`: `if-unused` and `if-empty` are checked here, against
/// this member's view of the queue.
pub(super) fn delete_queue<'a>(c: &Ctx<'a>, _: &Cluster) -> Result<Plan<'a>> {
    let [vh, name] = c.args();
    let v = vhost(c.broker, vh)?;
    let v = v.lock();
    let q = v.queue(name).ok_or_else(|| no_queue(vh, name))?;
    if c.call.query("if-unused") == Some("true") && !q.consumers.is_empty() {
        return Err(ApiError::from_amqp(crate::core::AmqpError::precondition(
            format!("queue '{name}' in vhost '{vh}' in use"),
        )));
    }
    if c.call.query("if-empty") == Some("true") && q.ready_count() > 0 {
        return Err(ApiError::from_amqp(crate::core::AmqpError::precondition(
            format!("queue '{name}' in vhost '{vh}' is not empty"),
        )));
    }
    Ok(Plan {
        vhost: vh,
        op: WiringOp::DeleteQueue {
            name: name.to_owned(),
            if_unused: false,
            if_empty: false,
        },
        reply: Planned::NoContent,
    })
}

/// `PUT /api/exchanges/{vhost}/{name}`.
pub(super) fn declare_exchange<'a>(c: &Ctx<'a>, _: &Cluster) -> Result<Plan<'a>> {
    let [vh, name] = c.args();
    let body = c.call.json()?;
    let kind = type_field(&body)?;
    Ok(Plan {
        vhost: vh,
        op: WiringOp::DeclareExchange {
            name: name.to_owned(),
            kind,
            durable: flag(&body, "durable", true)?,
            auto_delete: flag(&body, "auto_delete", false)?,
            internal: flag(&body, "internal", false)?,
            arguments: arguments(&body)?,
        },
        reply: Planned::Created,
    })
}

/// `DELETE /api/exchanges/{vhost}/{name}`: `if-unused` is checked when the operation applies.
pub(super) fn delete_exchange<'a>(c: &Ctx<'a>, _: &Cluster) -> Result<Plan<'a>> {
    let [vh, name] = c.args();
    if vhost(c.broker, vh)?.lock().exchange(name).is_none() {
        return Err(no_exchange(vh, name));
    }
    Ok(Plan {
        vhost: vh,
        op: WiringOp::DeleteExchange {
            name: name.to_owned(),
            if_unused: c.call.query("if-unused") == Some("true"),
        },
        reply: Planned::NoContent,
    })
}

/// `POST /api/bindings/{vhost}/e/{source}/{q|e}/{destination}`.
pub(super) fn bind<'a>(c: &Ctx<'a>, _: &Cluster) -> Result<Plan<'a>> {
    let [vh, src, kind, dst] = c.args();
    let body = c.call.json()?;
    let routing_key = routing_key(&body)?.to_owned();
    let arguments = arguments(&body)?;
    let op = if kind == "q" {
        WiringOp::BindQueue {
            queue: dst.to_owned(),
            exchange: src.to_owned(),
            routing_key,
            arguments,
        }
    } else {
        WiringOp::BindExchange {
            destination: dst.to_owned(),
            source: src.to_owned(),
            routing_key,
            arguments,
        }
    };
    Ok(Plan {
        vhost: vh,
        op,
        reply: Planned::BindingCreated,
    })
}
