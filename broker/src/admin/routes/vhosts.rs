//! `/api/vhosts`: virtual hosts created and removed at run time, and the lookup every other
//! resource uses to turn a vhost path segment into the vhost or a 404 that says how to make
//! one.

use super::{created, ok};
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply, empty_reply};
use crate::auth::Permission;
use crate::broker::Broker;
use crate::core::VHost;
use hyper::StatusCode;
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::sync::Arc;

/// `GET /api/vhosts`.
pub(super) fn list(c: &Ctx<'_>) -> Result<Reply> {
    ok(Value::Array(
        c.broker
            .vhosts()
            .iter()
            .map(|(n, v)| vhost_json(n, v))
            .collect(),
    ))
}

/// `GET /api/vhosts/{vhost}`.
pub(super) fn get(c: &Ctx<'_>) -> Result<Reply> {
    let [name] = c.args();
    ok(vhost_json(name, &*vhost(c.broker, name)?))
}

/// `PUT /api/vhosts/{vhost}`: the caller gets full permissions on a new vhost.
pub(super) fn put(c: &Ctx<'_>) -> Result<Reply> {
    let [name] = c.args();
    if name.is_empty() {
        return Err(ApiError::bad_request("a vhost needs a non-empty name"));
    }
    Ok(created(put_vhost(c.broker, name, &c.call.user.name)))
}

/// `DELETE /api/vhosts/{vhost}`.
pub(super) fn delete(c: &Ctx<'_>) -> Result<Reply> {
    let [name] = c.args();
    if !c.broker.remove_vhost(name) {
        return Err(no_vhost(name));
    }
    Ok(empty_reply(StatusCode::NO_CONTENT))
}

fn vhost_json(name: &str, v: &Mutex<VHost>) -> Value {
    let v = v.lock();
    let (ready, unacked) = v.queues().fold((0, 0), |(r, u), q| {
        (r + q.ready_count(), u + q.unacked_count())
    });
    json!({
        "name": name,
        "messages": ready + unacked,
        "messages_ready": ready,
        "messages_unacknowledged": unacked,
        "queues": v.queues().count(),
    })
}

/// Creates a vhost and gives `creator` full permissions on it (as RabbitMQ does, so that
/// whoever made it can use it at once); returns whether it was new.
pub(in crate::admin) fn put_vhost(b: &Broker, name: &str, creator: &str) -> bool {
    let new = b.add_vhost(name);
    if new {
        b.users
            .set_permission(creator, name, Permission::full())
            .expect(".* compiles");
    }
    new
}

/// A vhost by name, or the 404 every path under a vhost answers when it is missing.
pub(in crate::admin) fn vhost(b: &Broker, name: &str) -> Result<Arc<Mutex<VHost>>> {
    b.vhost(name).ok_or_else(|| no_vhost(name))
}

fn no_vhost(name: &str) -> ApiError {
    ApiError::not_found(format!(
        "no vhost '{name}': create it with PUT /api/vhosts/{{name}} (URL-encode '/' as %2F)"
    ))
}
