//! `/api/exchanges`: listing, declaring and deleting exchanges, and the bindings an exchange
//! is the source or destination of. Declares and deletes are wiring ops
//! ([`crate::admin::wiring`]), the ones the AMQP methods make, so the API keeps the AMQP
//! rules (`amq.*` reserved, 409 on a redeclare with other properties).

use super::vhosts::vhost;
use super::{arguments, bindings_json, flag, ok};
use crate::admin::json::table_to_json;
use crate::admin::router::{Ctx, Result};
use crate::admin::wiring::{Answer, Plan};
use crate::admin::{ApiError, Reply};
use crate::core::exchange::Exchange;
use crate::core::{VHost, WiringOp};
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
pub(super) fn declare<'a>(c: &Ctx<'a>) -> Result<Plan<'a>> {
    let [vh, name] = c.args();
    let body = c.call.json()?;
    let kind = type_field(&body)?;
    let args = arguments(&body)?;
    Ok(Plan {
        vhost: vh,
        op: WiringOp::DeclareExchange {
            name: name.to_owned(),
            kind,
            durable: flag(&body, "durable", true)?,
            auto_delete: flag(&body, "auto_delete", false)?,
            internal: flag(&body, "internal", false)?,
            arguments: args,
        },
        answer: Answer::Declared,
    })
}

/// `DELETE /api/exchanges/{vhost}/{name}[?if-unused=true]`.
pub(super) fn delete<'a>(c: &Ctx<'a>) -> Result<Plan<'a>> {
    let [vh, name] = c.args();
    Ok(Plan {
        vhost: vh,
        op: WiringOp::DeleteExchange {
            name: name.to_owned(),
            if_unused: c.call.query("if-unused") == Some("true"),
        },
        answer: Answer::Deleted,
    })
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

/// The body's required `type`.
fn type_field(body: &Value) -> Result<String> {
    Ok(body
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            ApiError::bad_request("the body needs \"type\": one of direct, fanout, topic, headers")
        })?
        .to_owned())
}

/// An exchange as the API shows it; a foreign proxy's URI without its password, and
/// `"state": "foreign"`.
fn exchange_json(vh: &str, e: &Exchange) -> Value {
    let mut shown = json!({
        "name": e.name.as_ref(),
        "vhost": vh,
        "type": e.kind.as_str(),
        "durable": e.durable,
        "auto_delete": e.auto_delete,
        "internal": e.internal,
        "arguments": table_to_json(&e.arguments),
    });
    if let Some(home) = &e.home {
        shown["arguments"][crate::broker::PROXY_ARGUMENT] =
            crate::proxy::link::redacted(home).into();
        shown["state"] = "foreign".into();
    }
    shown
}

fn exchanges_json(vh: &str, v: &Mutex<VHost>) -> Vec<Value> {
    let v = v.lock();
    let mut es: Vec<_> = v.exchanges().collect();
    es.sort_by(|a, b| a.name.cmp(&b.name));
    es.into_iter().map(|e| exchange_json(vh, e)).collect()
}

/// The 404 for a missing exchange, the same wherever the API names one.
pub(in crate::admin) fn no_exchange(vh: &str, name: &str) -> ApiError {
    ApiError::not_found(format!("no exchange '{name}' in vhost '{vh}'"))
}
