//! `/api/bindings`: listing, creating, reading and deleting bindings. A binding has no name of
//! its own, so one is addressed by its ends and RabbitMQ's `properties_key`
//! ([`crate::admin::json::properties_key`]), which the listing gives for each binding.

use super::exchanges::no_exchange;
use super::queues::no_queue;
use super::vhosts::vhost;
use super::{arguments, ok};
use crate::admin::json::{properties_key, table_to_json};
use crate::admin::router::{Ctx, Result};
use crate::admin::{ApiError, Reply, empty_reply};
use crate::broker::Broker;
use crate::core::VHost;
use crate::core::exchange::Destination;
use hyper::StatusCode;
use hyper::header::{self, HeaderValue};
use parking_lot::Mutex;
use serde_json::{Value, json};

/// `GET /api/bindings`: every vhost's bindings.
pub(super) fn list_all(c: &Ctx<'_>) -> Result<Reply> {
    ok(Value::Array(
        c.broker
            .vhosts()
            .iter()
            .flat_map(|(n, v)| bindings_json(n, v))
            .collect(),
    ))
}

/// `GET /api/bindings/{vhost}`.
pub(super) fn list(c: &Ctx<'_>) -> Result<Reply> {
    let [vh] = c.args();
    ok(Value::Array(bindings_json(vh, &*vhost(c.broker, vh)?)))
}

/// `GET /api/bindings/{vhost}/e/{source}/{q|e}/{destination}`: every binding between the two.
pub(super) fn between(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, src, kind, dst] = c.args();
    ok(Value::Array(bindings_between(
        vh,
        &*vhost(c.broker, vh)?,
        src,
        kind,
        dst,
    )))
}

/// `POST /api/bindings/{vhost}/e/{source}/{q|e}/{destination}`: 201 with the new binding's
/// address in `Location`, as RabbitMQ answers.
pub(super) fn create(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, src, kind, dst] = c.args();
    let body = c.call.json()?;
    let rk = routing_key(&body)?;
    let args = arguments(&body)?;
    let key = properties_key(rk, &args);
    bind(c.broker, vh, src, kind == "q", dst, rk, args)?;
    let mut r = empty_reply(StatusCode::CREATED);
    let enc = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    let location = format!(
        "/api/bindings/{}/e/{}/{kind}/{}/{}",
        enc(vh),
        enc(src),
        enc(dst),
        enc(&key)
    );
    if let Ok(loc) = HeaderValue::from_str(&location) {
        r.headers_mut().insert(header::LOCATION, loc);
    }
    Ok(r)
}

/// `GET /api/bindings/{vhost}/e/{source}/{q|e}/{destination}/{props}`.
pub(super) fn get(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, src, kind, dst, props] = c.args();
    let found = bindings_between(vh, &*vhost(c.broker, vh)?, src, kind, dst)
        .into_iter()
        .find(|x| x["properties_key"] == props)
        .ok_or_else(|| no_binding(vh, src, dst, props))?;
    ok(found)
}

/// `DELETE /api/bindings/{vhost}/e/{source}/{q|e}/{destination}/{props}`.
pub(super) fn delete(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, src, kind, dst, props] = c.args();
    let v = vhost(c.broker, vh)?;
    let mut v = v.lock();
    let found = v.exchange(src).and_then(|e| {
        e.bindings()
            .iter()
            .find(|bd| {
                dest_matches(&bd.destination, kind, dst)
                    && properties_key(&bd.routing_key, &bd.arguments) == props
            })
            .map(|bd| (bd.routing_key.clone(), bd.arguments.clone()))
    });
    let (rk, args) = found.ok_or_else(|| no_binding(vh, src, dst, props))?;
    if kind == "q" {
        let owner = v.queue(dst).and_then(|q| q.exclusive_owner).unwrap_or(0);
        v.queue_unbind(owner, dst, src, &rk, args)
    } else {
        v.exchange_unbind(dst, src, &rk, args)
    }
    .map_err(ApiError::from_amqp)?;
    Ok(empty_reply(StatusCode::NO_CONTENT))
}

/// The body's `routing_key` (absent or `null` is the empty key), the same check on the local
/// and the cluster path.
pub(in crate::admin) fn routing_key(body: &Value) -> Result<&str> {
    match body.get("routing_key") {
        None | Some(Value::Null) => Ok(""),
        Some(Value::String(s)) => Ok(s.as_str()),
        Some(_) => Err(ApiError::bad_request("routing_key must be a string")),
    }
}

/// queue.bind or exchange.bind on behalf of the API (and of a definitions import), with a
/// 404 naming whichever end is missing.
pub(in crate::admin) fn bind(
    b: &Broker,
    vh: &str,
    src: &str,
    to_queue: bool,
    dst: &str,
    routing_key: &str,
    args: crate::amqp::FieldTable,
) -> Result<()> {
    let v = vhost(b, vh)?;
    let mut v = v.lock();
    if v.exchange(src).is_none() {
        return Err(no_exchange(vh, src));
    }
    if to_queue {
        let owner = v
            .queue(dst)
            .ok_or_else(|| no_queue(vh, dst))?
            .exclusive_owner
            .unwrap_or(0);
        v.queue_bind(owner, dst, src, routing_key, args)
    } else {
        if v.exchange(dst).is_none() {
            return Err(no_exchange(vh, dst));
        }
        v.exchange_bind(dst, src, routing_key, args)
    }
    .map_err(ApiError::from_amqp)
}

fn dest_matches(d: &Destination, kind: &str, name: &str) -> bool {
    match d {
        Destination::Queue(q) => kind == "q" && q.as_ref() == name,
        Destination::Exchange(e) => kind == "e" && e.as_ref() == name,
    }
}

fn binding_json(
    vh: &str,
    src: &str,
    dest: &Destination,
    rk: &str,
    args: &crate::amqp::FieldTable,
) -> Value {
    let (dst, kind) = match dest {
        Destination::Queue(q) => (q.as_ref(), "queue"),
        Destination::Exchange(e) => (e.as_ref(), "exchange"),
    };
    json!({
        "source": src,
        "vhost": vh,
        "destination": dst,
        "destination_type": kind,
        "routing_key": rk,
        "arguments": table_to_json(args),
        "properties_key": properties_key(rk, args),
    })
}

/// Every binding of a vhost, the default exchange's implicit ones first (as RabbitMQ lists
/// them), then by source, destination and key: the one listing every binding path filters,
/// and the definitions export reuses.
pub(in crate::admin) fn bindings_json(vh: &str, v: &Mutex<VHost>) -> Vec<Value> {
    let v = v.lock();
    let mut queues: Vec<_> = v.queues().map(|q| q.name.clone()).collect();
    queues.sort();
    let empty = crate::amqp::FieldTable::default();
    let mut out: Vec<Value> = queues
        .into_iter()
        .map(|q| {
            let rk = q.to_string();
            binding_json(vh, "", &Destination::Queue(q), &rk, &empty)
        })
        .collect();
    let mut es: Vec<_> = v.exchanges().collect();
    es.sort_by(|a, b| a.name.cmp(&b.name));
    for e in es {
        let mut bs: Vec<_> = e.bindings().iter().collect();
        bs.sort_by(|a, b| (&a.destination, &a.routing_key).cmp(&(&b.destination, &b.routing_key)));
        for bd in bs {
            out.push(binding_json(
                vh,
                &e.name,
                &bd.destination,
                &bd.routing_key,
                &bd.arguments,
            ));
        }
    }
    out
}

fn bindings_between(vh: &str, v: &Mutex<VHost>, src: &str, kind: &str, dst: &str) -> Vec<Value> {
    let t = if kind == "q" { "queue" } else { "exchange" };
    bindings_json(vh, v)
        .into_iter()
        .filter(|x| x["source"] == src && x["destination"] == dst && x["destination_type"] == t)
        .collect()
}

fn no_binding(vh: &str, src: &str, dst: &str, props: &str) -> ApiError {
    ApiError::not_found(format!(
        "no binding from '{src}' to '{dst}' with properties key '{props}' in vhost '{vh}'"
    ))
}
