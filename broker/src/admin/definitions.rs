//! Definitions: the broker's topology and users as one JSON document, in RabbitMQ's
//! definitions format, so that a ringmq broker can be rebuilt from an export and a RabbitMQ
//! export can be loaded into ringmq.
//!
//! Exported: users (with `password_hash`, never a password), vhosts, permissions, durable and
//! transient non-exclusive queues (not a fragmented queue's fragments: members make them), exchanges other than the predeclared ones, and bindings
//! other than the default exchange's implicit ones. Every list is sorted so two exports of
//! equal brokers are equal. Parameters and policies are exported empty and ignored on import.

use super::ApiError;
use super::json::{table_from_json, table_to_json};
use super::routes::{
    bind_op, bindings_json, declare_op, parse_tags, put_user, put_vhost, set_permission,
};
use super::wiring::apply_here;
use crate::auth::Permission;
use crate::broker::Broker;
use crate::core::WiringOp;
use serde::Deserialize;
use serde_json::{Value, json};

/// The RabbitMQ version whose format this follows (tools check that the field exists).
const RABBIT_VERSION: &str = "3.13.0";

/// Exports the definitions.
pub fn export(b: &Broker) -> Value {
    let users: Vec<Value> = b
        .users
        .users()
        .iter()
        .map(|u| {
            json!({
                "name": u.name,
                "password_hash": u.password.encoded(),
                "hashing_algorithm": u.password.algorithm(),
                "tags": u.tags,
                "limits": {},
            })
        })
        .collect();
    let permissions: Vec<Value> = b
        .users
        .permissions()
        .iter()
        .map(|(u, v, p)| {
            json!({"user": u, "vhost": v, "configure": p.configure, "write": p.write, "read": p.read})
        })
        .collect();
    let mut vhosts = Vec::new();
    let mut queues = Vec::new();
    let mut exchanges = Vec::new();
    let mut bindings = Vec::new();
    for (name, v) in b.vhosts() {
        vhosts.push(json!({"name": name, "limits": [], "metadata": {}}));
        {
            let v = v.lock();
            let mut qs: Vec<_> = v
                .queues()
                .filter(|q| q.exclusive_owner.is_none() && q.args.fragment.is_none())
                .collect();
            qs.sort_by(|a, b| a.name.cmp(&b.name));
            for q in qs {
                queues.push(json!({
                    "name": q.name.as_ref(),
                    "vhost": name,
                    "durable": q.durable,
                    "auto_delete": q.auto_delete,
                    "arguments": table_to_json(&q.arguments),
                }));
            }
            let mut es: Vec<_> = v
                .exchanges()
                .filter(|e| !e.name.is_empty() && !e.name.starts_with("amq."))
                .collect();
            es.sort_by(|a, b| a.name.cmp(&b.name));
            for e in es {
                exchanges.push(json!({
                    "name": e.name.as_ref(),
                    "vhost": name,
                    "type": e.kind.as_str(),
                    "durable": e.durable,
                    "auto_delete": e.auto_delete,
                    "internal": e.internal,
                    "arguments": table_to_json(&e.arguments),
                }));
            }
        }
        for bd in bindings_json(&name, &v) {
            if bd["source"] == "" {
                continue;
            }
            let vv = v.lock();
            let skip = bd["destination_type"] == "queue"
                && bd["destination"]
                    .as_str()
                    .and_then(|q| vv.queue(q))
                    .is_some_and(|q| q.exclusive_owner.is_some());
            drop(vv);
            if skip {
                continue;
            }
            let mut bd = bd;
            if let Some(o) = bd.as_object_mut() {
                o.remove("properties_key");
            }
            bindings.push(bd);
        }
    }
    json!({
        "rabbit_version": RABBIT_VERSION,
        "rabbitmq_version": RABBIT_VERSION,
        "product_name": "ringmq",
        "product_version": env!("CARGO_PKG_VERSION"),
        "users": users,
        "vhosts": vhosts,
        "permissions": permissions,
        "topic_permissions": [],
        "parameters": [],
        "global_parameters": [],
        "policies": [],
        "queues": queues,
        "exchanges": exchanges,
        "bindings": bindings,
    })
}

fn yes() -> bool {
    true
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Definitions {
    users: Vec<Value>,
    vhosts: Vec<DefVhost>,
    permissions: Vec<DefPermission>,
    queues: Vec<DefQueue>,
    exchanges: Vec<DefExchange>,
    bindings: Vec<DefBinding>,
}

#[derive(Debug, Deserialize)]
struct DefVhost {
    name: String,
}

#[derive(Debug, Deserialize)]
struct DefPermission {
    user: String,
    vhost: String,
    configure: String,
    write: String,
    read: String,
}

#[derive(Debug, Deserialize)]
struct DefQueue {
    name: String,
    vhost: String,
    #[serde(default = "yes")]
    durable: bool,
    #[serde(default)]
    auto_delete: bool,
    #[serde(default)]
    arguments: Value,
}

#[derive(Debug, Deserialize)]
struct DefExchange {
    name: String,
    vhost: String,
    #[serde(rename = "type")]
    kind: String,
    #[serde(default = "yes")]
    durable: bool,
    #[serde(default)]
    auto_delete: bool,
    #[serde(default)]
    internal: bool,
    #[serde(default)]
    arguments: Value,
}

#[derive(Debug, Deserialize)]
struct DefBinding {
    source: String,
    vhost: String,
    destination: String,
    destination_type: String,
    #[serde(default)]
    routing_key: String,
    #[serde(default)]
    arguments: Value,
}

/// Imports definitions: vhosts, users, permissions, exchanges, queues, then bindings. Objects
/// that exist with the same properties are left alone; one that exists with other properties
/// stops the import with 409 (what came before it stays applied).
/// Exchanges, queues and bindings are the wiring ops the API's routes make, applied on this
/// broker alone ([`super::wiring::apply_here`]) — on a cluster member too: an import does
/// not go through the cluster map.
pub fn import(b: &Broker, body: &Value, caller: &str) -> Result<(), ApiError> {
    let defs: Definitions = serde_json::from_value(body.clone()).map_err(|e| {
        ApiError::bad_request(format!(
            "not a definitions document (users, vhosts, permissions, queues, exchanges, bindings): {e}"
        ))
    })?;
    // Check what can be checked before changing anything.
    for u in &defs.users {
        if u.get("name").and_then(Value::as_str).is_none() {
            return Err(ApiError::bad_request("every user needs a \"name\""));
        }
        parse_tags(u.get("tags"))?;
    }
    for e in &defs.exchanges {
        if crate::core::exchange::ExchangeKind::parse(&e.kind).is_none() {
            return Err(ApiError::bad_request(format!(
                "exchange '{}' has type '{}': ringmq supports direct, fanout, topic, headers",
                e.name, e.kind
            )));
        }
    }
    for bd in &defs.bindings {
        if bd.destination_type != "queue" && bd.destination_type != "exchange" {
            return Err(ApiError::bad_request(format!(
                "binding destination_type '{}' must be queue or exchange",
                bd.destination_type
            )));
        }
    }
    for v in &defs.vhosts {
        put_vhost(b, &v.name, caller);
    }
    for u in &defs.users {
        let name = u.get("name").and_then(Value::as_str).unwrap_or_default();
        put_user(b, name, u)?;
    }
    for p in defs.permissions {
        set_permission(
            b,
            &p.vhost,
            &p.user,
            Permission {
                configure: p.configure,
                write: p.write,
                read: p.read,
            },
        )?;
    }
    // Exchanges first without their alternate exchanges' existence mattering (the core keeps
    // the name only), then queues, then bindings.
    for e in defs.exchanges {
        if e.name.is_empty() || e.name.starts_with("amq.") {
            continue;
        }
        let arguments = table_from_json(&e.arguments).map_err(ApiError::bad_request)?;
        let op = WiringOp::DeclareExchange {
            name: e.name,
            kind: e.kind,
            durable: e.durable,
            auto_delete: e.auto_delete,
            internal: e.internal,
            arguments,
        };
        apply_here(b, &e.vhost, &op, caller)?;
    }
    for q in defs.queues {
        let arguments = table_from_json(&q.arguments).map_err(ApiError::bad_request)?;
        let op = declare_op(&q.name, q.durable, q.auto_delete, arguments, None)?;
        apply_here(b, &q.vhost, &op, caller)?;
    }
    for bd in defs.bindings {
        if bd.source.is_empty() {
            continue;
        }
        let arguments = table_from_json(&bd.arguments).map_err(ApiError::bad_request)?;
        let to_queue = bd.destination_type == "queue";
        let op = bind_op(
            &bd.source,
            to_queue,
            &bd.destination,
            bd.routing_key,
            arguments,
        );
        apply_here(b, &bd.vhost, &op, caller)?;
    }
    tracing::info!(by = caller, "definitions imported");
    Ok(())
}
