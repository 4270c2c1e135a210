//! `/api/bindings`: listing, creating, reading and deleting bindings. A binding has no name of
//! its own, so one is addressed by its ends and RabbitMQ's `properties_key`
//! ([`crate::admin::json::properties_key`]), which the listing gives for each binding.
//! Creating one is a wiring op ([`crate::admin::wiring`]), the one queue.bind or
//! exchange.bind makes.

use super::vhosts::vhost;
use super::{arguments, ok};
use crate::admin::json::{properties_key, table_to_json};
use crate::admin::router::{Ctx, Result};
use crate::admin::wiring::{Answer, Plan};
use crate::admin::{ApiError, Reply, empty_reply};
use crate::core::exchange::Destination;
use crate::core::{VHost, WiringOp};
use hyper::StatusCode;
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
pub(super) fn create<'a>(c: &Ctx<'a>) -> Result<Plan<'a>> {
    let [vh, src, kind, dst] = c.args();
    let body = c.call.json()?;
    let rk = routing_key(&body)?;
    let args = arguments(&body)?;
    let enc = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    let location = format!(
        "/api/bindings/{}/e/{}/{kind}/{}/{}",
        enc(vh),
        enc(src),
        enc(dst),
        enc(&properties_key(rk, &args))
    );
    Ok(Plan {
        vhost: vh,
        op: bind_op(src, kind == "q", dst, rk.to_owned(), args),
        answer: Answer::Bound { location },
    })
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

/// The body's `routing_key`: absent or `null` is the empty key.
fn routing_key(body: &Value) -> Result<&str> {
    match body.get("routing_key") {
        None | Some(Value::Null) => Ok(""),
        Some(Value::String(s)) => Ok(s.as_str()),
        Some(_) => Err(ApiError::bad_request("routing_key must be a string")),
    }
}

/// queue.bind (`to_queue`) or exchange.bind from exchange `source` to `destination`, for a
/// route or a definitions import.
pub(in crate::admin) fn bind_op(
    source: &str,
    to_queue: bool,
    destination: &str,
    routing_key: String,
    arguments: crate::amqp::FieldTable,
) -> WiringOp {
    if to_queue {
        WiringOp::BindQueue {
            queue: destination.to_owned(),
            exchange: source.to_owned(),
            routing_key,
            arguments,
        }
    } else {
        WiringOp::BindExchange {
            destination: destination.to_owned(),
            source: source.to_owned(),
            routing_key,
            arguments,
        }
    }
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
