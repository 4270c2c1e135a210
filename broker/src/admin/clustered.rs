//! Wiring writes of the admin API on a cluster member: declaring or deleting a queue or an
//! exchange, and adding a binding, go through the cluster map like the same AMQP methods,
//! so every member applies them in the same order; the reply comes after the commit.

use super::api::{created, flag, no_exchange, no_queue, vhost};
use super::json::table_from_json;
use super::{ApiError, Call, Reply, empty_reply};
use crate::broker::Broker;
use crate::cluster::Cluster;
use crate::core::WiringOp;
use hyper::{Method, StatusCode};
use serde_json::Value;
use std::sync::Arc;

type Result<T> = std::result::Result<T, ApiError>;

/// Handles `c` if it changes shared wiring; `None` leaves it to the ordinary routes.
pub async fn route(b: &Arc<Broker>, cluster: &Arc<Cluster>, c: &Call) -> Option<Result<Reply>> {
    let p: Vec<&str> = c.path.iter().map(String::as_str).collect();
    let (put, del, post) = (
        c.method == Method::PUT,
        c.method == Method::DELETE,
        c.method == Method::POST,
    );
    let planned = match p.as_slice() {
        ["queues", _, name] if put => declare_queue(cluster, c, name),
        ["queues", vh, name] if del => delete_queue(b, c, vh, name),
        ["exchanges", _, name] if put => declare_exchange(c, name),
        ["exchanges", vh, name] if del => delete_exchange(b, c, vh, name),
        ["bindings", _, "e", src, kind @ ("q" | "e"), dst] if post => bind(c, src, kind, dst),
        _ => return None,
    };
    let vh = p[1];
    Some(match planned {
        Ok((op, planned)) => commit(b, cluster, vh, op, planned).await,
        Err(e) => Err(e),
    })
}

/// Submits the change and waits for its commit. Existence before the change decides 201 or
/// 204, as on a single broker.
async fn commit(
    b: &Arc<Broker>,
    cluster: &Arc<Cluster>,
    vh: &str,
    op: WiringOp,
    reply: Planned,
) -> Result<Reply> {
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

fn arguments(body: &Value) -> Result<crate::amqp::FieldTable> {
    table_from_json(body.get("arguments").unwrap_or(&Value::Null)).map_err(ApiError::bad_request)
}

fn declare_queue(cluster: &Cluster, c: &Call, name: &str) -> Result<(WiringOp, Planned)> {
    let body = c.json()?;
    if flag(&body, "exclusive", false)? {
        return Err(ApiError::bad_request(
            "exclusive queues belong to an AMQP connection: declare them over AMQP",
        ));
    }
    if name.is_empty() {
        return Err(ApiError::bad_request("a queue needs a non-empty name"));
    }
    Ok((
        WiringOp::DeclareQueue {
            name: name.to_owned(),
            durable: flag(&body, "durable", true)?,
            exclusive: false,
            auto_delete: flag(&body, "auto_delete", false)?,
            arguments: arguments(&body)?,
            home: Some(cluster.node_id().to_owned()),
            server_named: false,
        },
        Planned::Created,
    ))
}

fn delete_queue(b: &Broker, c: &Call, vh: &str, name: &str) -> Result<(WiringOp, Planned)> {
    let v = vhost(b, vh)?;
    let v = v.lock();
    let q = v.queue(name).ok_or_else(|| no_queue(vh, name))?;
    if c.query("if-unused") == Some("true") && !q.consumers.is_empty() {
        return Err(ApiError::from_amqp(crate::core::AmqpError::precondition(
            format!("queue '{name}' in vhost '{vh}' in use"),
        )));
    }
    if c.query("if-empty") == Some("true") && q.ready_count() > 0 {
        return Err(ApiError::from_amqp(crate::core::AmqpError::precondition(
            format!("queue '{name}' in vhost '{vh}' is not empty"),
        )));
    }
    Ok((
        WiringOp::DeleteQueue {
            name: name.to_owned(),
            if_unused: false,
            if_empty: false,
        },
        Planned::NoContent,
    ))
}

fn declare_exchange(c: &Call, name: &str) -> Result<(WiringOp, Planned)> {
    let body = c.json()?;
    let kind = body
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            ApiError::bad_request("the body needs \"type\": one of direct, fanout, topic, headers")
        })?
        .to_owned();
    Ok((
        WiringOp::DeclareExchange {
            name: name.to_owned(),
            kind,
            durable: flag(&body, "durable", true)?,
            auto_delete: flag(&body, "auto_delete", false)?,
            internal: flag(&body, "internal", false)?,
            arguments: arguments(&body)?,
        },
        Planned::Created,
    ))
}

fn delete_exchange(b: &Broker, c: &Call, vh: &str, name: &str) -> Result<(WiringOp, Planned)> {
    if vhost(b, vh)?.lock().exchange(name).is_none() {
        return Err(no_exchange(vh, name));
    }
    Ok((
        WiringOp::DeleteExchange {
            name: name.to_owned(),
            if_unused: c.query("if-unused") == Some("true"),
        },
        Planned::NoContent,
    ))
}

fn bind(c: &Call, src: &str, kind: &str, dst: &str) -> Result<(WiringOp, Planned)> {
    let body = c.json()?;
    let routing_key = match body.get("routing_key") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::bad_request("routing_key must be a string")),
    };
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
    Ok((op, Planned::BindingCreated))
}
