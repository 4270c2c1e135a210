//! `/api/connections`: the open AMQP connections, their channels, and force-closing one. A
//! connection is named by `PEER -> LOCAL` or by its numeric id, whichever the caller has.

use super::channels::channels_json;
use super::ok;
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply, empty_reply};
use crate::broker::Broker;
use crate::broker::connections::ConnInfo;
use hyper::StatusCode;
use serde_json::{Value, json};

/// `GET /api/connections`.
pub(super) fn list(c: &Ctx<'_>) -> Result<Reply> {
    let b = c.broker;
    ok(Value::Array(
        b.registry
            .connections()
            .iter()
            .map(|ci| connection_json(b, ci))
            .collect(),
    ))
}

/// `GET /api/connections/{name}`.
pub(super) fn get(c: &Ctx<'_>) -> Result<Reply> {
    let [name] = c.args();
    ok(connection_json(c.broker, &connection(c.broker, name)?))
}

/// `DELETE /api/connections/{name}[?reason=text]`: the connection closes itself with 320.
pub(super) fn close(c: &Ctx<'_>) -> Result<Reply> {
    let [name] = c.args();
    let b = c.broker;
    let ci = connection(b, name)?;
    let reason = c
        .call
        .query("reason")
        .map(str::to_owned)
        .unwrap_or_else(|| format!("Closed via management API by '{}'", c.call.user.name));
    if !b.force_close(ci.id, &reason) {
        return Err(no_connection(name));
    }
    Ok(empty_reply(StatusCode::NO_CONTENT))
}

/// `GET /api/connections/{name}/channels`.
pub(super) fn channels(c: &Ctx<'_>) -> Result<Reply> {
    let [name] = c.args();
    let ci = connection(c.broker, name)?;
    ok(Value::Array(
        channels_json(c.broker)
            .into_iter()
            .filter(|x| x["connection_details"]["name"] == ci.name.as_str())
            .collect(),
    ))
}

/// An open connection by name or id, or a 404 that says where to find the names.
pub(super) fn connection(b: &Broker, name: &str) -> Result<ConnInfo> {
    b.registry
        .connections()
        .into_iter()
        .find(|c| c.name == name || c.id.to_string() == name)
        .ok_or_else(|| no_connection(name))
}

fn connection_json(b: &Broker, ci: &ConnInfo) -> Value {
    let channels = b.vhost(&ci.vhost).map_or(0, |v| {
        v.lock().channels().filter(|(k, _)| k.conn == ci.id).count()
    });
    json!({
        "name": ci.name,
        "id": ci.id,
        "peer_host": ci.peer.ip().to_string(),
        "peer_port": ci.peer.port(),
        "user": ci.user,
        "vhost": ci.vhost,
        "channels": channels,
        "connected_at": ci.connected_at_ms,
        "node": b.config.node_id,
        "state": "running",
        "protocol": "AMQP 0-9-1",
    })
}

fn no_connection(name: &str) -> ApiError {
    ApiError::not_found(format!(
        "no connection '{name}': list them with GET /api/connections"
    ))
}
