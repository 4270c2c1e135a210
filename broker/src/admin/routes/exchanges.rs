//! `/api/exchanges`: listing, declaring and deleting exchanges, and the bindings an exchange
//! is the source or destination of. Declares and deletes go through the vhost core, so the
//! API keeps the AMQP rules (`amq.*` reserved, 409 on a redeclare with other properties).

use super::vhosts::vhost;
use super::{arguments, bindings_json, created, flag, ok};
use crate::admin::json::table_to_json;
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply, empty_reply};
use crate::broker::Broker;
use crate::core::exchange::Exchange;
use crate::core::{ExchangeDeclare, VHost};
use hyper::StatusCode;
use parking_lot::Mutex;
use serde_json::{Value, json};

/// `GET /api/exchanges`: every vhost's exchanges.
pub(super) fn list_all(c: &Ctx<'_>) -> Result<Reply> {
    ok(Value::Array(
        c.broker
            .vhosts()
            .iter()
            .flat_map(|(n, v)| exchanges_json(n, v))
            .collect(),
    ))
}

/// `GET /api/exchanges/{vhost}`.
pub(super) fn list(c: &Ctx<'_>) -> Result<Reply> {
    let [vh] = c.args();
    ok(Value::Array(exchanges_json(vh, &*vhost(c.broker, vh)?)))
}

/// `GET /api/exchanges/{vhost}/{name}`.
pub(super) fn get(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, name] = c.args();
    let v = vhost(c.broker, vh)?;
    let v = v.lock();
    let e = v.exchange(name).ok_or_else(|| no_exchange(vh, name))?;
    ok(exchange_json(vh, e))
}

/// `PUT /api/exchanges/{vhost}/{name}`: `type` is required, durable unless the body says
/// otherwise.
pub(super) fn declare(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, name] = c.args();
    let body = c.call.json()?;
    let kind = type_field(&body)?;
    let args = arguments(&body)?;
    Ok(created(declare_exchange(
        c.broker,
        vh,
        ExchangeDeclare {
            name: name.to_owned(),
            kind,
            passive: false,
            durable: flag(&body, "durable", true)?,
            auto_delete: flag(&body, "auto_delete", false)?,
            internal: flag(&body, "internal", false)?,
            arguments: args,
        },
    )?))
}

/// `DELETE /api/exchanges/{vhost}/{name}[?if-unused=true]`.
pub(super) fn delete(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, name] = c.args();
    let v = vhost(c.broker, vh)?;
    let mut v = v.lock();
    if v.exchange(name).is_none() {
        return Err(no_exchange(vh, name));
    }
    v.exchange_delete(name, c.call.query("if-unused") == Some("true"))
        .map_err(ApiError::from_amqp)?;
    tracing::info!(vhost = %vh, exchange = %name, user = %c.call.user.name, "exchange deleted via admin API");
    Ok(empty_reply(StatusCode::NO_CONTENT))
}

/// `GET /api/exchanges/{vhost}/{name}/bindings/source` (bindings from the exchange) and
/// `.../destination` (exchange-to-exchange bindings into it).
pub(super) fn bindings(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, name, dir] = c.args();
    let all = bindings_json(vh, &*vhost(c.broker, vh)?);
    let key = if dir == "source" {
        "source"
    } else {
        "destination"
    };
    ok(Value::Array(
        all.into_iter()
            .filter(|x| x[key] == name && (dir == "source" || x["destination_type"] == "exchange"))
            .collect(),
    ))
}

/// The body's required `type`, the same check on the local and the cluster path.
pub(in crate::admin) fn type_field(body: &Value) -> Result<String> {
    Ok(body
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            ApiError::bad_request("the body needs \"type\": one of direct, fanout, topic, headers")
        })?
        .to_owned())
}

fn exchange_json(vh: &str, e: &Exchange) -> Value {
    json!({
        "name": e.name.as_ref(),
        "vhost": vh,
        "type": e.kind.as_str(),
        "durable": e.durable,
        "auto_delete": e.auto_delete,
        "internal": e.internal,
        "arguments": table_to_json(&e.arguments),
    })
}

fn exchanges_json(vh: &str, v: &Mutex<VHost>) -> Vec<Value> {
    let v = v.lock();
    let mut es: Vec<_> = v.exchanges().collect();
    es.sort_by(|a, b| a.name.cmp(&b.name));
    es.into_iter().map(|e| exchange_json(vh, e)).collect()
}

/// exchange.declare on behalf of the API (and of a definitions import); returns whether the
/// exchange is new.
pub(in crate::admin) fn declare_exchange(b: &Broker, vh: &str, d: ExchangeDeclare) -> Result<bool> {
    let v = vhost(b, vh)?;
    let mut v = v.lock();
    let new = v.exchange(&d.name).is_none();
    let name = d.name.clone();
    v.exchange_declare(d).map_err(ApiError::from_amqp)?;
    if new {
        tracing::info!(vhost = %vh, exchange = %name, "exchange declared via admin API");
    }
    Ok(new)
}

/// The 404 for a missing exchange, the same on the local and the cluster path.
pub(in crate::admin) fn no_exchange(vh: &str, name: &str) -> ApiError {
    ApiError::not_found(format!("no exchange '{name}' in vhost '{vh}'"))
}
