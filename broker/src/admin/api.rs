//! The `/api/` routes: one function per resource, matched on the decoded path segments.

use super::json::{properties_key, table_from_json, table_to_json};
use super::{ApiError, Call, Reply, definitions, empty_reply, json_reply, metrics};
use crate::auth::{PasswordHash, Permission, UserRecord};
use crate::broker::Broker;
use crate::broker::connections::ConnInfo;
use crate::broker::resources::rss_bytes;
use crate::clock::now_ms;
use crate::core::exchange::Destination;
use crate::core::queue::Queue;
use crate::core::{Effects, ExchangeDeclare, QueueDeclare, VHost};
use hyper::header::{self, HeaderValue};
use hyper::{Method, StatusCode};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;

type Result<T> = std::result::Result<T, ApiError>;

/// Dispatches one authenticated call.
pub fn route(b: &Arc<Broker>, c: &Call) -> Result<Reply> {
    let p: Vec<&str> = c.path.iter().map(String::as_str).collect();
    let m = &c.method;
    let get = *m == Method::GET || *m == Method::HEAD;
    let put = *m == Method::PUT;
    let del = *m == Method::DELETE;
    let post = *m == Method::POST;
    let ok = |v: Value| Ok(json_reply(StatusCode::OK, &v));
    match p.as_slice() {
        ["overview"] if get => ok(overview(b)),
        ["whoami"] if get => ok(json!({"name": c.user.name, "tags": c.user.tags})),
        ["members"] if get => ok(members(b)),
        ["members", id] if get => {
            this_member(b, id)?;
            let mut m = member(b);
            m["owned_queues"] = json!(metrics::totals(b).queues);
            ok(m)
        }
        ["members", id, "leave"] if post => {
            this_member(b, id)?;
            b.registry.leaving.store(true, Ordering::Relaxed);
            tracing::warn!(member = %id, "member leaving on request: /readyz now answers 503");
            Ok(json_reply(
                StatusCode::ACCEPTED,
                &json!({"id": id, "state": "leaving"}),
            ))
        }
        ["vhosts"] if get => ok(Value::Array(
            b.vhosts().iter().map(|(n, v)| vhost_json(n, v)).collect(),
        )),
        ["vhosts", name] if get => ok(vhost_json(name, &*vhost(b, name)?)),
        ["vhosts", name] if put => {
            if name.is_empty() {
                return Err(ApiError::bad_request("a vhost needs a non-empty name"));
            }
            Ok(created(put_vhost(b, name, &c.user.name)))
        }
        ["vhosts", name] if del => {
            if !b.remove_vhost(name) {
                return Err(no_vhost(name));
            }
            Ok(empty_reply(StatusCode::NO_CONTENT))
        }
        ["queues"] if get => ok(Value::Array(
            b.vhosts()
                .iter()
                .flat_map(|(n, v)| queues_json(b, n, v))
                .collect(),
        )),
        ["queues", vh] if get => ok(Value::Array(queues_json(b, vh, &*vhost(b, vh)?))),
        ["queues", vh, name] if get => {
            let v = vhost(b, vh)?;
            let v = v.lock();
            let q = v.queue(name).ok_or_else(|| no_queue(vh, name))?;
            ok(queue_json(b, vh, q))
        }
        ["queues", vh, name] if put => {
            let body = c.json()?;
            if flag(&body, "exclusive", false)? {
                return Err(ApiError::bad_request(
                    "exclusive queues belong to an AMQP connection: declare them over AMQP",
                ));
            }
            let args = table_from_json(body.get("arguments").unwrap_or(&Value::Null))
                .map_err(ApiError::bad_request)?;
            let durable = flag(&body, "durable", true)?;
            let auto_delete = flag(&body, "auto_delete", false)?;
            Ok(created(declare_queue(
                b,
                vh,
                name,
                durable,
                auto_delete,
                args,
            )?))
        }
        ["queues", vh, name] if del => {
            let v = vhost(b, vh)?;
            let mut v = v.lock();
            let owner = v
                .queue(name)
                .ok_or_else(|| no_queue(vh, name))?
                .exclusive_owner
                .unwrap_or(0);
            let mut fx = Effects::default();
            v.queue_delete(
                owner,
                name,
                c.query("if-unused") == Some("true"),
                c.query("if-empty") == Some("true"),
                &mut fx,
            )
            .map_err(ApiError::from_amqp)?;
            b.finish_batch(0, &mut v, &mut fx);
            tracing::info!(vhost = %vh, queue = %name, user = %c.user.name, "queue deleted via admin API");
            Ok(empty_reply(StatusCode::NO_CONTENT))
        }
        ["queues", vh, name, "contents"] if del => {
            let v = vhost(b, vh)?;
            let mut v = v.lock();
            let owner = v
                .queue(name)
                .ok_or_else(|| no_queue(vh, name))?
                .exclusive_owner
                .unwrap_or(0);
            let mut fx = Effects::default();
            let n = v
                .queue_purge(owner, name, &mut fx)
                .map_err(ApiError::from_amqp)?;
            b.finish_batch(0, &mut v, &mut fx);
            tracing::info!(vhost = %vh, queue = %name, messages = n, user = %c.user.name, "queue purged via admin API");
            Ok(empty_reply(StatusCode::NO_CONTENT))
        }
        ["queues", vh, name, "bindings"] if get => {
            let all = bindings_json(vh, &*vhost(b, vh)?);
            ok(Value::Array(
                all.into_iter()
                    .filter(|x| x["destination_type"] == "queue" && x["destination"] == *name)
                    .collect(),
            ))
        }
        ["exchanges"] if get => ok(Value::Array(
            b.vhosts()
                .iter()
                .flat_map(|(n, v)| exchanges_json(n, v))
                .collect(),
        )),
        ["exchanges", vh] if get => ok(Value::Array(exchanges_json(vh, &*vhost(b, vh)?))),
        ["exchanges", vh, name] if get => {
            let v = vhost(b, vh)?;
            let v = v.lock();
            let e = v.exchange(name).ok_or_else(|| no_exchange(vh, name))?;
            ok(exchange_json(vh, e))
        }
        ["exchanges", vh, name] if put => {
            let body = c.json()?;
            let kind = body
                .get("type")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "the body needs \"type\": one of direct, fanout, topic, headers",
                    )
                })?
                .to_owned();
            let args = table_from_json(body.get("arguments").unwrap_or(&Value::Null))
                .map_err(ApiError::bad_request)?;
            Ok(created(declare_exchange(
                b,
                vh,
                ExchangeDeclare {
                    name: (*name).to_owned(),
                    kind,
                    passive: false,
                    durable: flag(&body, "durable", true)?,
                    auto_delete: flag(&body, "auto_delete", false)?,
                    internal: flag(&body, "internal", false)?,
                    arguments: args,
                },
            )?))
        }
        ["exchanges", vh, name] if del => {
            let v = vhost(b, vh)?;
            let mut v = v.lock();
            if v.exchange(name).is_none() {
                return Err(no_exchange(vh, name));
            }
            v.exchange_delete(name, c.query("if-unused") == Some("true"))
                .map_err(ApiError::from_amqp)?;
            tracing::info!(vhost = %vh, exchange = %name, user = %c.user.name, "exchange deleted via admin API");
            Ok(empty_reply(StatusCode::NO_CONTENT))
        }
        [
            "exchanges",
            vh,
            name,
            "bindings",
            dir @ ("source" | "destination"),
        ] if get => {
            let all = bindings_json(vh, &*vhost(b, vh)?);
            let key = if *dir == "source" {
                "source"
            } else {
                "destination"
            };
            ok(Value::Array(
                all.into_iter()
                    .filter(|x| {
                        x[key] == *name && (*dir == "source" || x["destination_type"] == "exchange")
                    })
                    .collect(),
            ))
        }
        ["bindings"] if get => ok(Value::Array(
            b.vhosts()
                .iter()
                .flat_map(|(n, v)| bindings_json(n, v))
                .collect(),
        )),
        ["bindings", vh] if get => ok(Value::Array(bindings_json(vh, &*vhost(b, vh)?))),
        ["bindings", vh, "e", src, kind @ ("q" | "e"), dst] if get => {
            ok(Value::Array(between(vh, &*vhost(b, vh)?, src, kind, dst)))
        }
        ["bindings", vh, "e", src, kind @ ("q" | "e"), dst] if post => {
            let body = c.json()?;
            let rk = match body.get("routing_key") {
                None | Some(Value::Null) => "",
                Some(Value::String(s)) => s.as_str(),
                Some(_) => return Err(ApiError::bad_request("routing_key must be a string")),
            };
            let args = table_from_json(body.get("arguments").unwrap_or(&Value::Null))
                .map_err(ApiError::bad_request)?;
            let key = properties_key(rk, &args);
            bind(b, vh, src, *kind == "q", dst, rk, args)?;
            let mut r = empty_reply(StatusCode::CREATED);
            let enc = |s: &str| {
                percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC)
                    .to_string()
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
        ["bindings", vh, "e", src, kind @ ("q" | "e"), dst, props] if get => {
            let found = between(vh, &*vhost(b, vh)?, src, kind, dst)
                .into_iter()
                .find(|x| x["properties_key"] == *props)
                .ok_or_else(|| no_binding(vh, src, dst, props))?;
            ok(found)
        }
        ["bindings", vh, "e", src, kind @ ("q" | "e"), dst, props] if del => {
            let v = vhost(b, vh)?;
            let mut v = v.lock();
            let found = v.exchange(src).and_then(|e| {
                e.bindings()
                    .iter()
                    .find(|bd| {
                        dest_matches(&bd.destination, kind, dst)
                            && properties_key(&bd.routing_key, &bd.arguments) == *props
                    })
                    .map(|bd| (bd.routing_key.clone(), bd.arguments.clone()))
            });
            let (rk, args) = found.ok_or_else(|| no_binding(vh, src, dst, props))?;
            if *kind == "q" {
                let owner = v.queue(dst).and_then(|q| q.exclusive_owner).unwrap_or(0);
                v.queue_unbind(owner, dst, src, &rk, args)
            } else {
                v.exchange_unbind(dst, src, &rk, args)
            }
            .map_err(ApiError::from_amqp)?;
            Ok(empty_reply(StatusCode::NO_CONTENT))
        }
        ["connections"] if get => ok(Value::Array(
            b.registry
                .connections()
                .iter()
                .map(|ci| connection_json(b, ci))
                .collect(),
        )),
        ["connections", name] if get => ok(connection_json(b, &connection(b, name)?)),
        ["connections", name] if del => {
            let ci = connection(b, name)?;
            let reason = c
                .query("reason")
                .map(str::to_owned)
                .unwrap_or_else(|| format!("Closed via management API by '{}'", c.user.name));
            if !b.force_close(ci.id, &reason) {
                return Err(no_connection(name));
            }
            Ok(empty_reply(StatusCode::NO_CONTENT))
        }
        ["connections", name, "channels"] if get => {
            let ci = connection(b, name)?;
            ok(Value::Array(
                channels_json(b)
                    .into_iter()
                    .filter(|x| x["connection_details"]["name"] == ci.name.as_str())
                    .collect(),
            ))
        }
        ["channels"] if get => ok(Value::Array(channels_json(b))),
        ["channels", name] if del => {
            // Channel names are "CONNECTION (NUMBER)", as GET /api/channels lists them.
            let (conn_name, number) = name
                .strip_suffix(')')
                .and_then(|n| n.rsplit_once(" ("))
                .and_then(|(c, n)| Some((c, n.parse::<u16>().ok()?)))
                .ok_or_else(|| ApiError::not_found(format!("no channel '{name}': names look like 'CONNECTION (NUMBER)', see GET /api/channels")))?;
            let ci = connection(b, conn_name)?;
            let open = channels_json(b).iter().any(|x| x["name"] == **name);
            if !open {
                return Err(ApiError::not_found(format!("no channel '{name}'")));
            }
            let reason = format!("Closed via management API by '{}'", c.user.name);
            if !b.force_close_channel(ci.id, number, &reason) {
                return Err(ApiError::not_found(format!("no channel '{name}'")));
            }
            Ok(empty_reply(StatusCode::NO_CONTENT))
        }
        ["users"] if get => ok(Value::Array(
            b.users.users().iter().map(user_json).collect(),
        )),
        ["users", name] if get => ok(user_json(&b.users.user(name).ok_or_else(|| no_user(name))?)),
        ["users", name] if put => {
            let body = c.json()?;
            Ok(created(put_user(b, name, &body)?))
        }
        ["users", name] if del => {
            if !b.users.delete_user(name) {
                return Err(no_user(name));
            }
            tracing::info!(user = %name, by = %c.user.name, "user deleted");
            for ci in b.registry.connections() {
                if ci.user == *name {
                    b.force_close(ci.id, &format!("user '{name}' was deleted"));
                }
            }
            Ok(empty_reply(StatusCode::NO_CONTENT))
        }
        ["permissions"] if get => ok(Value::Array(
            b.users
                .permissions()
                .iter()
                .map(|(u, v, p)| permission_json(u, v, p))
                .collect(),
        )),
        ["permissions", vh, user] if get => {
            let p = b
                .users
                .permissions()
                .into_iter()
                .find(|(u, v, _)| u == user && v == vh)
                .ok_or_else(|| {
                    ApiError::not_found(format!("user '{user}' has no permission on vhost '{vh}'"))
                })?;
            ok(permission_json(&p.0, &p.1, &p.2))
        }
        ["permissions", vh, user] if put => {
            let body = c.json()?;
            let field = |k: &str| -> Result<String> {
                match body.get(k) {
                    Some(Value::String(s)) => Ok(s.clone()),
                    None => Err(ApiError::bad_request(format!(
                        "the body needs \"{k}\": a regex such as \".*\""
                    ))),
                    Some(_) => Err(ApiError::bad_request(format!("{k} must be a string"))),
                }
            };
            let p = Permission {
                configure: field("configure")?,
                write: field("write")?,
                read: field("read")?,
            };
            Ok(created(set_permission(b, vh, user, p)?))
        }
        ["permissions", vh, user] if del => {
            if !b.users.clear_permission(user, vh) {
                return Err(ApiError::not_found(format!(
                    "user '{user}' has no permission on vhost '{vh}'"
                )));
            }
            Ok(empty_reply(StatusCode::NO_CONTENT))
        }
        ["definitions"] if get => {
            // The export holds password hashes: administrators only, as in RabbitMQ.
            if !c.user.tags.iter().any(|t| t == super::TAG_ADMINISTRATOR) {
                return Err(ApiError::forbidden(
                    "exporting definitions (with password hashes) needs the administrator tag",
                ));
            }
            ok(definitions::export(b))
        }
        ["definitions"] if post => {
            let body = c.json()?;
            definitions::import(b, &body, &c.user.name)?;
            Ok(empty_reply(StatusCode::NO_CONTENT))
        }
        _ => {
            let known = matches!(
                p.first().copied(),
                Some(
                    "overview"
                        | "whoami"
                        | "members"
                        | "vhosts"
                        | "queues"
                        | "exchanges"
                        | "bindings"
                        | "connections"
                        | "channels"
                        | "users"
                        | "permissions"
                        | "definitions"
                )
            );
            if known {
                Err(ApiError::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "method_not_allowed",
                    format!(
                        "{m} is not supported on /api/{}: see docs/admin-api.md",
                        c.path.join("/")
                    ),
                ))
            } else {
                Err(ApiError::not_found(format!(
                    "no such API path /api/{}: see docs/admin-api.md",
                    c.path.join("/")
                )))
            }
        }
    }
}

pub(super) fn created(was_new: bool) -> Reply {
    empty_reply(if was_new {
        StatusCode::CREATED
    } else {
        StatusCode::NO_CONTENT
    })
}

pub(super) fn flag(body: &Value, key: &str, default: bool) -> Result<bool> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(v)) => Ok(*v),
        Some(_) => Err(ApiError::bad_request(format!(
            "{key} must be true or false"
        ))),
    }
}

pub(super) fn no_vhost(name: &str) -> ApiError {
    ApiError::not_found(format!(
        "no vhost '{name}': create it with PUT /api/vhosts/{{name}} (URL-encode '/' as %2F)"
    ))
}
pub(super) fn no_queue(vh: &str, name: &str) -> ApiError {
    ApiError::not_found(format!("no queue '{name}' in vhost '{vh}'"))
}
pub(super) fn no_exchange(vh: &str, name: &str) -> ApiError {
    ApiError::not_found(format!("no exchange '{name}' in vhost '{vh}'"))
}
fn no_user(name: &str) -> ApiError {
    ApiError::not_found(format!("no user '{name}'"))
}
fn no_connection(name: &str) -> ApiError {
    ApiError::not_found(format!(
        "no connection '{name}': list them with GET /api/connections"
    ))
}
fn no_binding(vh: &str, src: &str, dst: &str, props: &str) -> ApiError {
    ApiError::not_found(format!(
        "no binding from '{src}' to '{dst}' with properties key '{props}' in vhost '{vh}'"
    ))
}

fn this_member(b: &Broker, id: &str) -> Result<()> {
    if id != b.config.node_id {
        return Err(ApiError::not_found(format!(
            "no member '{id}': this single node is '{}'",
            b.config.node_id
        )));
    }
    Ok(())
}

/// A vhost by name, or 404.
pub(super) fn vhost(b: &Broker, name: &str) -> Result<Arc<Mutex<VHost>>> {
    b.vhost(name).ok_or_else(|| no_vhost(name))
}

fn member(b: &Broker) -> Value {
    let r = &b.registry;
    json!({
        "id": b.config.node_id,
        "amqp": r.amqp_addr.get().map(ToString::to_string),
        "admin": r.admin_addr.get().map(ToString::to_string),
        "zone": b.config.zone,
        "state": if r.leaving.load(Ordering::Relaxed) { "leaving" } else { "running" },
    })
}

/// Every member in ring order when clustered (with `ring_position` and whether it holds the
/// cluster map), else this broker alone.
fn members(b: &Broker) -> Value {
    let Some(cluster) = b.cluster() else {
        return json!([member(b)]);
    };
    Value::Array(
        cluster
            .members()
            .iter()
            .enumerate()
            .filter_map(|(position, m)| {
                let info = m.info.as_ref()?;
                Some(json!({
                    "id": info.node_id,
                    "amqp": info.amqp,
                    "admin": info.admin,
                    "zone": info.zone,
                    "state": if m.synced { "running" } else { "joining" },
                    "ring_position": position,
                }))
            })
            .collect(),
    )
}

fn overview(b: &Broker) -> Value {
    let t = metrics::totals(b);
    let s = &b.stats;
    json!({
        "node": b.config.node_id,
        "cluster_name": b.config.cluster_name,
        "ringmq_version": env!("CARGO_PKG_VERSION"),
        "members": members(b),
        "cluster": b.cluster().map(|c| json!({
            "member": c.node_id(),
            "cluster_port": c.addr(),
            "quorum": c.has_quorum(),
            "voters": c.voters(),
        })),
        "object_totals": {
            "connections": b.registry.connection_count(),
            "channels": t.channels,
            "consumers": t.consumers,
            "exchanges": t.exchanges,
            "queues": t.queues,
            "vhosts": t.vhosts,
        },
        "queue_totals": {
            "messages": t.ready + t.unacked,
            "messages_ready": t.ready,
            "messages_unacknowledged": t.unacked,
        },
        "message_totals": {
            "published": s.published.get(),
            "routed": s.routed.get(),
            "unroutable": s.unroutable.get(),
            "delivered": s.delivered.get(),
            "redelivered": s.redelivered.get(),
            "acked": s.acked.get(),
            "confirmed": s.confirmed.get(),
            "received_bytes": s.bytes_in.get(),
            "sent_bytes": s.bytes_out.get(),
        },
        "memory": {
            "used_bytes": rss_bytes(),
            "high_watermark_bytes": b.config.memory_high_watermark_bytes,
            "alarm": b.publishers_blocked(),
        },
        "disk_free_bytes": crate::broker::resources::disk_free_bytes(&b.config.data_dir),
        "blocked_publishers": s.blocked_publishers.get(),
    })
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

/// Creates a vhost and gives `creator` full permissions on it (as RabbitMQ does); returns
/// whether it was new.
pub(super) fn put_vhost(b: &Broker, name: &str, creator: &str) -> bool {
    let new = b.add_vhost(name);
    if new {
        b.users
            .set_permission(creator, name, Permission::full())
            .expect(".* compiles");
    }
    new
}

fn queue_json(b: &Broker, vh: &str, q: &Queue) -> Value {
    let ready = q.ready_count();
    let unacked = q.unacked_count();
    json!({
        "name": q.name.as_ref(),
        "vhost": vh,
        "durable": q.durable,
        "auto_delete": q.auto_delete,
        "exclusive": q.exclusive_owner.is_some(),
        "arguments": table_to_json(&q.arguments),
        "messages_ready": ready,
        "messages_unacknowledged": unacked,
        "messages": ready + unacked,
        "consumers": q.consumers.len(),
        "owner": b.config.node_id,
        "node": b.config.node_id,
        "type": "classic",
        "state": "running",
    })
}

fn queues_json(b: &Broker, vh: &str, v: &Mutex<VHost>) -> Vec<Value> {
    let v = v.lock();
    let mut qs: Vec<&Queue> = v.queues().collect();
    qs.sort_by(|a, b| a.name.cmp(&b.name));
    qs.into_iter().map(|q| queue_json(b, vh, q)).collect()
}

/// queue.declare on behalf of the API; returns whether the queue is new. 409 when it exists
/// with other properties.
pub(super) fn declare_queue(
    b: &Broker,
    vh: &str,
    name: &str,
    durable: bool,
    auto_delete: bool,
    arguments: crate::amqp::FieldTable,
) -> Result<bool> {
    if name.is_empty() {
        return Err(ApiError::bad_request("a queue needs a non-empty name"));
    }
    let v = vhost(b, vh)?;
    let mut v = v.lock();
    let existing = v.queue(name).map(|q| q.exclusive_owner.unwrap_or(0));
    v.queue_declare(
        existing.unwrap_or(0),
        QueueDeclare {
            name: name.to_owned(),
            passive: false,
            durable,
            exclusive: false,
            auto_delete,
            arguments,
        },
        now_ms(),
    )
    .map_err(ApiError::from_amqp)?;
    if existing.is_none() {
        tracing::info!(vhost = %vh, queue = %name, "queue declared via admin API");
    }
    Ok(existing.is_none())
}

fn exchange_json(vh: &str, e: &crate::core::exchange::Exchange) -> Value {
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

/// exchange.declare on behalf of the API; returns whether the exchange is new.
pub(super) fn declare_exchange(b: &Broker, vh: &str, d: ExchangeDeclare) -> Result<bool> {
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

/// queue.bind or exchange.bind on behalf of the API.
pub(super) fn bind(
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
/// them), then by source, destination and key.
pub(super) fn bindings_json(vh: &str, v: &Mutex<VHost>) -> Vec<Value> {
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

fn between(vh: &str, v: &Mutex<VHost>, src: &str, kind: &str, dst: &str) -> Vec<Value> {
    let t = if kind == "q" { "queue" } else { "exchange" };
    bindings_json(vh, v)
        .into_iter()
        .filter(|x| x["source"] == src && x["destination"] == dst && x["destination_type"] == t)
        .collect()
}

fn connection(b: &Broker, name: &str) -> Result<ConnInfo> {
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

fn channels_json(b: &Broker) -> Vec<Value> {
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

fn user_json(u: &UserRecord) -> Value {
    json!({"name": u.name, "tags": u.tags})
}

/// Parses `tags` as RabbitMQ writes it: a comma-separated string (3.x) or a list (3.10+).
pub(super) fn parse_tags(v: Option<&Value>) -> Result<Vec<String>> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(s
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| ApiError::bad_request("tags must be strings"))
            })
            .collect(),
        Some(_) => Err(ApiError::bad_request(
            "tags must be a list of strings or a comma-separated string",
        )),
    }
}

/// Creates or changes a user from a RabbitMQ-style body (`password`, or `password_hash` with
/// `hashing_algorithm` ringmq_pbkdf2_sha256 or rabbit_password_hashing_sha256, and `tags`);
/// returns whether it is new.
pub(super) fn put_user(b: &Broker, name: &str, body: &Value) -> Result<bool> {
    if name.is_empty() {
        return Err(ApiError::bad_request("a user needs a non-empty name"));
    }
    let tags = parse_tags(body.get("tags"))?;
    let existing = b.users.user(name);
    let password = match (body.get("password"), body.get("password_hash")) {
        (Some(Value::String(p)), _) => b.users.hash_password(p),
        (_, Some(Value::String(h))) => {
            PasswordHash::parse(h, body.get("hashing_algorithm").and_then(Value::as_str))
                .map_err(|e| ApiError::bad_request(e.to_string()))?
        }
        _ => match &existing {
            Some(u) => u.password.clone(),
            None => {
                return Err(ApiError::bad_request(
                    "a new user needs \"password\" or \"password_hash\"",
                ));
            }
        },
    };
    let loopback_only = existing.as_ref().is_some_and(|u| u.loopback_only);
    let new = b.users.put_user(UserRecord {
        name: name.to_owned(),
        password,
        tags,
        loopback_only,
    });
    tracing::info!(user = %name, new, "user saved");
    Ok(new)
}

fn permission_json(user: &str, vhost: &str, p: &Permission) -> Value {
    json!({
        "user": user,
        "vhost": vhost,
        "configure": p.configure,
        "write": p.write,
        "read": p.read,
    })
}

/// Sets a permission after checking the user and vhost exist; returns whether it is new.
pub(super) fn set_permission(b: &Broker, vh: &str, user: &str, p: Permission) -> Result<bool> {
    vhost(b, vh)?;
    if b.users.user(user).is_none() {
        return Err(no_user(user));
    }
    b.users
        .set_permission(user, vh, p)
        .map_err(|e| ApiError::bad_request(e.to_string()))
}
