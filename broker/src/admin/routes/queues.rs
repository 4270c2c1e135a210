//! `/api/queues`: listing, declaring, deleting and purging queues on behalf of an operator,
//! with the same rules (and the same 409 on a redeclare with other properties) as the AMQP
//! methods, because both go through the vhost core.

use super::vhosts::vhost;
use super::{arguments, bindings_json, created, flag, ok};
use crate::admin::json::table_to_json;
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply, empty_reply};
use crate::broker::Broker;
use crate::clock::now_ms;
use crate::core::queue::Queue;
use crate::core::{Effects, QueueDeclare, VHost};
use hyper::StatusCode;
use parking_lot::Mutex;
use serde_json::{Value, json};

/// `GET /api/queues`: every vhost's queues.
pub(super) fn list_all(c: &Ctx<'_>) -> Result<Reply> {
    let b = c.broker;
    ok(Value::Array(
        b.vhosts()
            .iter()
            .flat_map(|(n, v)| queues_json(b, n, v))
            .collect(),
    ))
}

/// `GET /api/queues/{vhost}`.
pub(super) fn list(c: &Ctx<'_>) -> Result<Reply> {
    let [vh] = c.args();
    let b = c.broker;
    ok(Value::Array(queues_json(b, vh, &*vhost(b, vh)?)))
}

/// `GET /api/queues/{vhost}/{name}`.
pub(super) fn get(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, name] = c.args();
    let b = c.broker;
    let v = vhost(b, vh)?;
    let v = v.lock();
    let q = v.queue(name).ok_or_else(|| no_queue(vh, name))?;
    ok(queue_json(b, vh, q))
}

/// `PUT /api/queues/{vhost}/{name}`: durable unless the body says otherwise.
pub(super) fn declare(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, name] = c.args();
    let body = c.call.json()?;
    refuse_exclusive(&body)?;
    let args = arguments(&body)?;
    let durable = flag(&body, "durable", true)?;
    let auto_delete = flag(&body, "auto_delete", false)?;
    Ok(created(declare_queue(
        c.broker,
        vh,
        name,
        durable,
        auto_delete,
        args,
    )?))
}

/// `DELETE /api/queues/{vhost}/{name}[?if-unused=true][&if-empty=true]`.
pub(super) fn delete(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, name] = c.args();
    let b = c.broker;
    let v = vhost(b, vh)?;
    let mut v = v.lock();
    let owner = owner(&v, vh, name)?;
    let mut fx = Effects::default();
    v.queue_delete(
        owner,
        name,
        c.call.query("if-unused") == Some("true"),
        c.call.query("if-empty") == Some("true"),
        &mut fx,
    )
    .map_err(ApiError::from_amqp)?;
    b.finish_batch(0, &mut v, &mut fx);
    tracing::info!(vhost = %vh, queue = %name, user = %c.call.user.name, "queue deleted via admin API");
    Ok(empty_reply(StatusCode::NO_CONTENT))
}

/// `DELETE /api/queues/{vhost}/{name}/contents`: drops the ready messages.
pub(super) fn purge(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, name] = c.args();
    let b = c.broker;
    let v = vhost(b, vh)?;
    let mut v = v.lock();
    let owner = owner(&v, vh, name)?;
    let mut fx = Effects::default();
    let n = v
        .queue_purge(owner, name, &mut fx)
        .map_err(ApiError::from_amqp)?;
    b.finish_batch(0, &mut v, &mut fx);
    tracing::info!(vhost = %vh, queue = %name, messages = n, user = %c.call.user.name, "queue purged via admin API");
    Ok(empty_reply(StatusCode::NO_CONTENT))
}

/// `GET /api/queues/{vhost}/{name}/bindings`: the default exchange's implicit binding too.
pub(super) fn bindings(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, name] = c.args();
    let all = bindings_json(vh, &*vhost(c.broker, vh)?);
    ok(Value::Array(
        all.into_iter()
            .filter(|x| x["destination_type"] == "queue" && x["destination"] == name)
            .collect(),
    ))
}

/// The connection the core should act as on queue `name`: its exclusive owner, so the API
/// may delete or purge an exclusive queue, else 0. 404 when there is no such queue.
fn owner(v: &VHost, vh: &str, name: &str) -> Result<u64> {
    Ok(v.queue(name)
        .ok_or_else(|| no_queue(vh, name))?
        .exclusive_owner
        .unwrap_or(0))
}

/// 400 for `"exclusive": true`: an exclusive queue lives and dies with an AMQP connection,
/// which an API call does not have.
pub(in crate::admin) fn refuse_exclusive(body: &Value) -> Result<()> {
    if flag(body, "exclusive", false)? {
        return Err(ApiError::bad_request(
            "exclusive queues belong to an AMQP connection: declare them over AMQP",
        ));
    }
    Ok(())
}

fn queue_json(b: &Broker, vh: &str, q: &Queue) -> Value {
    let ready = q.ready_count();
    let unacked = q.unacked_count();
    json!({
        "name": q.name.as_ref(),
        "vhost": vh,
        "durable": q.durable,
        "auto_delete": q.auto_delete,
        "exclusive": q.exclusive_owner.is_some(),
        "arguments": table_to_json(&q.arguments),
        "messages_ready": ready,
        "messages_unacknowledged": unacked,
        "messages": ready + unacked,
        "consumers": q.consumers.len(),
        "owner": b.config.node_id,
        "node": b.config.node_id,
        "type": "classic",
        "state": "running",
    })
}

fn queues_json(b: &Broker, vh: &str, v: &Mutex<VHost>) -> Vec<Value> {
    let v = v.lock();
    let mut qs: Vec<&Queue> = v.queues().collect();
    qs.sort_by(|a, b| a.name.cmp(&b.name));
    qs.into_iter().map(|q| queue_json(b, vh, q)).collect()
}

/// queue.declare on behalf of the API (and of a definitions import); returns whether the
/// queue is new. 409 when it exists with other properties.
pub(in crate::admin) fn declare_queue(
    b: &Broker,
    vh: &str,
    name: &str,
    durable: bool,
    auto_delete: bool,
    arguments: crate::amqp::FieldTable,
) -> Result<bool> {
    if name.is_empty() {
        return Err(ApiError::bad_request("a queue needs a non-empty name"));
    }
    let v = vhost(b, vh)?;
    let mut v = v.lock();
    let existing = v.queue(name).map(|q| q.exclusive_owner.unwrap_or(0));
    v.queue_declare(
        existing.unwrap_or(0),
        QueueDeclare {
            name: name.to_owned(),
            passive: false,
            durable,
            exclusive: false,
            auto_delete,
            arguments,
        },
        now_ms(),
    )
    .map_err(ApiError::from_amqp)?;
    if existing.is_none() {
        tracing::info!(vhost = %vh, queue = %name, "queue declared via admin API");
    }
    Ok(existing.is_none())
}

/// The 404 for a missing queue, the same on the local and the cluster path.
pub(in crate::admin) fn no_queue(vh: &str, name: &str) -> ApiError {
    ApiError::not_found(format!("no queue '{name}' in vhost '{vh}'"))
}
