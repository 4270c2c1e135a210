//! `/api/channels`: the open channels of every connection, and closing one channel while its
//! connection and other channels carry on (an operator's tool for a stuck consumer).

use super::connections::connection;
use super::ok;
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply, empty_reply};
use crate::broker::Broker;
use hyper::StatusCode;
use serde_json::{Value, json};

/// `GET /api/channels`.
pub(super) fn list(c: &Ctx<'_>) -> Result<Reply> {
    ok(Value::Array(channels_json(c.broker)))
}

/// `DELETE /api/channels/{name}`: the channel gets channel.close 320.
pub(super) fn close(c: &Ctx<'_>) -> Result<Reply> {
    let [name] = c.args();
    let b = c.broker;
    // Channel names are "CONNECTION (NUMBER)", as GET /api/channels lists them.
    let (conn_name, number) = name
        .strip_suffix(')')
        .and_then(|n| n.rsplit_once(" ("))
        .and_then(|(c, n)| Some((c, n.parse::<u16>().ok()?)))
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "no channel '{name}': names look like 'CONNECTION (NUMBER)', see GET /api/channels"
            ))
        })?;
    let ci = connection(b, conn_name)?;
    let open = channels_json(b).iter().any(|x| x["name"] == name);
    if !open {
        return Err(ApiError::not_found(format!("no channel '{name}'")));
    }
    let reason = format!("Closed via management API by '{}'", c.call.user.name);
    if !b.force_close_channel(ci.id, number, &reason) {
        return Err(ApiError::not_found(format!("no channel '{name}'")));
    }
    Ok(empty_reply(StatusCode::NO_CONTENT))
}

/// Every open channel of every connection, ordered by connection and number; a connection's
/// channel listing filters this.
pub(super) fn channels_json(b: &Broker) -> Vec<Value> {
    let conns = b.registry.connections();
    let mut out = Vec::new();
    for (vh, v) in b.vhosts() {
        let v = v.lock();
        let mut chans: Vec<_> = v.channels().collect();
        chans.sort_by_key(|(k, _)| (k.conn, k.channel));
        for (key, st) in chans {
            let Some(ci) = conns.iter().find(|c| c.id == key.conn) else {
                continue;
            };
            out.push(json!({
                "name": format!("{} ({})", ci.name, key.channel),
                "number": key.channel,
                "connection_details": {
                    "name": ci.name,
                    "peer_host": ci.peer.ip().to_string(),
                    "peer_port": ci.peer.port(),
                },
                "user": ci.user,
                "vhost": vh,
                "consumer_count": st.consumers.len(),
                "messages_unacknowledged": st.unacked.len(),
                "prefetch_count": st.consumer_prefetch_count,
                "global_prefetch_count": st.channel_prefetch_count,
                "node": b.config.node_id,
            }));
        }
    }
    out
}
