//! The `/api/` route table: every endpoint of the management API on one line — method, path
//! pattern, and the handler that answers it, or for a wiring write the planner that turns it
//! into the op [`super::wiring`] applies — so a reader finds an endpoint by the path the docs
//! give it, and adding one is a line here plus a function in its resource's file.
//! [`super::router`] matches calls against this list.
//!
//! Also here: the few reply and body helpers every resource's handlers share, so that a body
//! field is read the same way on every path.

mod bindings;
mod channels;
mod connections;
mod definitions;
mod exchanges;
mod members;
mod overview;
mod permissions;
mod queues;
mod rebalance;
mod ring;
mod sessions;
mod users;
mod vhosts;

pub(super) use bindings::{bind_op, bindings_json};
pub(super) use exchanges::no_exchange;
pub(super) use permissions::set_permission;
pub(super) use queues::{declare_op, no_queue};
pub(super) use users::{parse_tags, put_user};
pub(super) use vhosts::{put_vhost, vhost};

use super::json::table_from_json;
use super::router::{Ctx, Result, Route, Verb};
use super::{ApiError, Reply, empty_reply, json_reply};
use crate::cluster::Cluster;
use crate::core::WiringOp;
use hyper::StatusCode;
use serde_json::Value;
use std::sync::Arc;

/// Every `/api/` endpoint. Patterns are matched in order on the decoded path segments; a
/// path whose first segment appears here with another method answers 405, any other 404.
pub(super) static ROUTES: &[Route] = &[
    Route::get("/api/overview", overview::show),
    Route::get("/api/whoami", overview::whoami),
    Route::get("/api/members", members::list),
    Route::get("/api/members/{id}", members::get),
    Route::post("/api/members/{id}/leave", members::leave),
    Route::post_async("/api/members/{id}/drain", members::drain),
    Route::post_async("/api/members/{id}/undrain", members::undrain),
    Route::get("/api/cluster/ring", ring::show),
    Route::put_async("/api/cluster/ring", ring::set),
    Route::get("/api/cluster/rebalance", rebalance::show),
    Route::post_async("/api/cluster/rebalance", rebalance::start),
    Route::post_async("/api/cluster/rebalance/stop", rebalance::stop),
    Route::get("/api/sessions", sessions::list),
    Route::get("/api/sessions/{id}", sessions::get),
    Route::get("/api/vhosts", vhosts::list),
    Route::get("/api/vhosts/{vhost}", vhosts::get),
    Route::put("/api/vhosts/{vhost}", vhosts::put),
    Route::delete("/api/vhosts/{vhost}", vhosts::delete),
    Route::get_async("/api/queues", queues::list_all),
    Route::get_async("/api/queues/{vhost}", queues::list),
    Route::get_async("/api/queues/{vhost}/{name}", queues::get),
    Route::wiring(Verb::Put, "/api/queues/{vhost}/{name}", queues::declare),
    Route::wiring(Verb::Delete, "/api/queues/{vhost}/{name}", queues::delete),
    Route::delete_async("/api/queues/{vhost}/{name}/contents", queues::purge),
    Route::wiring(
        Verb::Post,
        "/api/queues/{vhost}/{name}/move",
        queues::move_primary,
    ),
    Route::get("/api/queues/{vhost}/{name}/bindings", queues::bindings),
    Route::get("/api/exchanges", exchanges::list_all),
    Route::get("/api/exchanges/{vhost}", exchanges::list),
    Route::get("/api/exchanges/{vhost}/{name}", exchanges::get),
    Route::wiring(
        Verb::Put,
        "/api/exchanges/{vhost}/{name}",
        exchanges::declare,
    ),
    Route::wiring(
        Verb::Delete,
        "/api/exchanges/{vhost}/{name}",
        exchanges::delete,
    ),
    Route::get(
        "/api/exchanges/{vhost}/{name}/bindings/{source|destination}",
        exchanges::bindings,
    ),
    Route::get("/api/bindings", bindings::list_all),
    Route::get("/api/bindings/{vhost}", bindings::list),
    Route::get(
        "/api/bindings/{vhost}/e/{source}/{q|e}/{destination}",
        bindings::between,
    ),
    Route::wiring(
        Verb::Post,
        "/api/bindings/{vhost}/e/{source}/{q|e}/{destination}",
        bindings::create,
    ),
    Route::get(
        "/api/bindings/{vhost}/e/{source}/{q|e}/{destination}/{props}",
        bindings::get,
    ),
    Route::delete(
        "/api/bindings/{vhost}/e/{source}/{q|e}/{destination}/{props}",
        bindings::delete,
    ),
    Route::get("/api/connections", connections::list),
    Route::get("/api/connections/{name}", connections::get),
    Route::delete("/api/connections/{name}", connections::close),
    Route::get("/api/connections/{name}/channels", connections::channels),
    Route::get("/api/channels", channels::list),
    Route::delete("/api/channels/{name}", channels::close),
    Route::get("/api/users", users::list),
    Route::get("/api/users/{name}", users::get),
    Route::put("/api/users/{name}", users::put),
    Route::delete("/api/users/{name}", users::delete),
    Route::get("/api/permissions", permissions::list),
    Route::get("/api/permissions/{vhost}/{user}", permissions::get),
    Route::put("/api/permissions/{vhost}/{user}", permissions::put),
    Route::delete("/api/permissions/{vhost}/{user}", permissions::delete),
    Route::get("/api/definitions", definitions::export),
    Route::post("/api/definitions", definitions::import),
];

/// This member's cluster, or a 400 saying why a single broker cannot do what was asked.
fn clustered(c: &Ctx<'_>, why: &str) -> Result<Arc<Cluster>> {
    (c.broker.cluster().cloned())
        .ok_or_else(|| ApiError::bad_request(format!("this broker is not a cluster member: {why}")))
}

/// Commits a cluster-wide op (the map's, submitted under no vhost) and waits until this
/// member applied it: the op's refusal as the status it maps to, a 503 when the cluster
/// layer stopped.
async fn commit(cluster: &Arc<Cluster>, op: WiringOp) -> Result<()> {
    match cluster.submit("", op).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(ApiError::from_amqp(e)),
        Err(_) => Err(ApiError::cluster_stopped()),
    }
}

/// 200 with `v` as the body: what every read answers.
fn ok(v: Value) -> Result<Reply> {
    Ok(json_reply(StatusCode::OK, &v))
}

/// 201 for a new object, 204 for one that was there with the same properties: a `PUT` is
/// idempotent and the status tells the caller which happened.
pub(super) fn created(was_new: bool) -> Reply {
    empty_reply(if was_new {
        StatusCode::CREATED
    } else {
        StatusCode::NO_CONTENT
    })
}

/// A boolean body field; absent or `null` is `default`, anything but a boolean is 400.
pub(super) fn flag(body: &Value, key: &str, default: bool) -> Result<bool> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(v)) => Ok(*v),
        Some(_) => Err(ApiError::bad_request(format!(
            "{key} must be true or false"
        ))),
    }
}

/// The body's `arguments` object as a field table (absent is empty); 400 names the argument
/// that cannot be converted.
pub(super) fn arguments(body: &Value) -> Result<crate::amqp::FieldTable> {
    table_from_json(body.get("arguments").unwrap_or(&Value::Null)).map_err(ApiError::bad_request)
}
