//! `/api/queues`: listing, declaring, deleting and purging queues on behalf of an operator.
//! Declares and deletes are wiring ops ([`crate::admin::wiring`]), the ones the AMQP
//! methods make, so the API keeps the same rules (and the same 409 on a redeclare with
//! other properties); purge is content, not wiring, and is done here.

use super::vhosts::vhost;
use super::{arguments, bindings_json, flag, ok};
use crate::admin::json::table_to_json;
use crate::admin::router::{Ctx, Result};
use crate::admin::wiring::{Answer, Plan};
use crate::admin::{ApiError, Reply, empty_reply};
use crate::broker::Broker;
use crate::core::queue::Queue;
use crate::core::{Effects, MoveStep, VHost, WiringOp, is_foreign};
use crate::proxy::stats::queue_stats;
use futures::future::BoxFuture;
use hyper::StatusCode;
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::collections::HashMap;

/// `GET /api/queues`: every vhost's queues, each once, with its primary's numbers.
pub(super) fn list_all<'a>(c: &'a Ctx<'a>) -> BoxFuture<'a, Result<Reply>> {
    Box::pin(async move {
        let b = c.broker;
        let mut all: Vec<Value> = b
            .vhosts()
            .iter()
            .flat_map(|(n, v)| queues_json(b, n, v))
            .collect();
        primary_numbers(b, &mut all).await;
        fragment_numbers(b, &mut all).await;
        ok(Value::Array(all))
    })
}

/// `GET /api/queues/{vhost}`.
pub(super) fn list<'a>(c: &'a Ctx<'a>) -> BoxFuture<'a, Result<Reply>> {
    Box::pin(async move {
        let [vh] = c.args();
        let b = c.broker;
        let mut all = queues_json(b, vh, &*vhost(b, vh)?);
        primary_numbers(b, &mut all).await;
        fragment_numbers(b, &mut all).await;
        ok(Value::Array(all))
    })
}

/// `GET /api/queues/{vhost}/{name}`.
pub(super) fn get<'a>(c: &'a Ctx<'a>) -> BoxFuture<'a, Result<Reply>> {
    Box::pin(async move {
        let [vh, name] = c.args();
        let b = c.broker;
        let v = vhost(b, vh)?;
        let read = || v.lock().queue(name).map(|q| queue_json(b, vh, q));
        let one = match b.cluster() {
            Some(c) => stamped(c, read),
            None => read(),
        };
        let mut one = vec![one.ok_or_else(|| no_queue(vh, name))?];
        primary_numbers(b, &mut one).await;
        fragment_numbers(b, &mut one).await;
        ok(one.pop().expect("one queue"))
    })
}

/// `read`'s answer with `cluster`: the configuration its roles belong to
/// ([`crate::cluster::Membership::configuration`]) and whether this member held the
/// majority's lease and the current cluster map, both as of the instant it was read — or
/// `null` when cluster events kept changing it under the read. Two members that name
/// themselves a queue's `node` under one configuration while holding the lease would be two
/// primaries at once: the fault suite checks that it never happens (docs/reliability.md).
/// A member without the current map (restarting, or rejoining after an eviction) holds no
/// roles, whatever its vhosts remember: `quorum` is false for it.
fn stamped(c: &crate::cluster::Cluster, read: impl Fn() -> Option<Value>) -> Option<Value> {
    let consistent = c.read_consistent(|| (read(), c.has_quorum() && c.holds_current_map()));
    let Some(((one, quorum), configuration)) = consistent else {
        return read().map(|mut q| {
            q["cluster"] = Value::Null;
            q
        });
    };
    one.map(|mut q| {
        q["cluster"] = json!({"configuration": configuration, "quorum": quorum});
        q
    })
}

/// Replaces the numbers of queues whose primary is another member (this member holds
/// none of their messages) with the primary's, asked over the links; a queue whose
/// primary cannot be asked keeps `null` numbers and `"state": "unreachable"`.
async fn primary_numbers(b: &Broker, queues: &mut [Value]) {
    let proxies = b.proxies();
    let me = b.config.node_id.as_str();
    let mut asks: HashMap<(String, String), Vec<String>> = HashMap::new();
    for q in queues.iter() {
        let node = q["node"].as_str().unwrap_or(me);
        if is_foreign(node) {
            // Another broker's queue: its numbers are that broker's to tell.
            asks.entry((node.to_owned(), String::new())).or_default();
        } else if node != me && (q["exclusive"] != true || !q["session"].is_null()) {
            asks.entry((
                node.to_owned(),
                q["vhost"].as_str().unwrap_or("").to_owned(),
            ))
            .or_default()
            .push(q["name"].as_str().unwrap_or("").to_owned());
        }
    }
    for ((node, vh), names) in asks {
        if is_foreign(&node) {
            for q in queues.iter_mut().filter(|q| q["node"] == node.as_str()) {
                for k in [
                    "messages_ready",
                    "messages_unacknowledged",
                    "messages",
                    "consumers",
                ] {
                    q[k] = Value::Null;
                }
                let shown: Value = crate::proxy::link::redacted(&node).into();
                if let Some(args) = q["arguments"].as_object_mut() {
                    args.insert(crate::broker::PROXY_ARGUMENT.into(), shown.clone());
                }
                q["node"] = shown.clone();
                q["owner"] = shown;
                q["state"] = "foreign".into();
            }
            continue;
        }
        let stats = queue_stats(&proxies.links, &node, &vh, &names).await;
        for q in queues.iter_mut() {
            if q["node"] != node.as_str() || q["vhost"] != vh.as_str() {
                continue;
            }
            let Some(name) = q["name"].as_str().map(str::to_owned) else {
                continue;
            };
            if !names.contains(&name) {
                continue;
            }
            match stats.get(&name) {
                Some(s) => {
                    q["messages_ready"] = s.ready.into();
                    q["messages_unacknowledged"] = s.unacked.into();
                    q["messages"] = (u64::from(s.ready) + u64::from(s.unacked)).into();
                    q["consumers"] = s.consumers.into();
                }
                None => {
                    for k in [
                        "messages_ready",
                        "messages_unacknowledged",
                        "messages",
                        "consumers",
                    ] {
                        q[k] = Value::Null;
                    }
                    q["state"] = "unreachable".into();
                }
            }
        }
    }
}

/// `PUT /api/queues/{vhost}/{name}`: durable unless the body says otherwise. On a cluster
/// the queue's primary is this member, or the one its `qpid.cluster.primary` argument names.
pub(super) fn declare<'a>(c: &Ctx<'a>) -> Result<Plan<'a>> {
    let [vh, name] = c.args();
    let body = c.call.json()?;
    refuse_exclusive(&body)?;
    let args = arguments(&body)?;
    let durable = flag(&body, "durable", true)?;
    let auto_delete = flag(&body, "auto_delete", false)?;
    let v = vhost(c.broker, vh)?;
    let v = v.lock();
    let primaries = v.queues().filter_map(|q| q.home.as_deref());
    let home = c
        .broker
        .queue_home(&args, primaries)
        .map_err(|e| match e.code {
            crate::amqp::codes::NOT_FOUND => ApiError::not_found(e.text),
            _ => ApiError::bad_request(e.text),
        })?;
    drop(v);
    Ok(Plan {
        vhost: vh,
        op: declare_op(name, durable, auto_delete, args, home)?,
        answer: Answer::Declared,
    })
}

/// `DELETE /api/queues/{vhost}/{name}[?if-unused=true][&if-empty=true]`.
pub(super) fn delete<'a>(c: &Ctx<'a>) -> Result<Plan<'a>> {
    let [vh, name] = c.args();
    Ok(Plan {
        vhost: vh,
        op: WiringOp::DeleteQueue {
            name: name.to_owned(),
            if_unused: c.call.query("if-unused") == Some("true"),
            if_empty: c.call.query("if-empty") == Some("true"),
        },
        answer: Answer::Deleted,
    })
}

/// `POST /api/queues/{vhost}/{name}/move` with `{"to": "<node id>"}`: the queue's primary
/// moves to that member — it becomes a backup if it is not one and catches up, then the
/// primary stops the queue's ops until it has them all and switches (`docs/cluster.md`,
/// "Moving a primary"). 202 once the move is agreed; it is done when `node` names the
/// member. 409 when the move cannot be made now (the queue is unavailable, already moving
/// elsewhere, or the member is not one); 400 on a single broker.
pub(super) fn move_primary<'a>(c: &Ctx<'a>) -> Result<Plan<'a>> {
    let [vh, name] = c.args();
    let body = c.call.json()?;
    let to = body.get("to").and_then(Value::as_str).ok_or_else(|| {
        ApiError::bad_request(r#"the body must name the member to move to: {"to": "<node id>"}"#)
    })?;
    let cluster = c.broker.cluster().ok_or_else(|| {
        ApiError::bad_request("this broker is not a cluster member: a primary has nowhere to move")
    })?;
    vhost(c.broker, vh)?;
    let roles = cluster.queue_roles(vh, name).ok_or_else(|| {
        ApiError::not_found(format!(
            "no clustered queue '{name}' in vhost '{vh}' (exclusive queues stay with their connection)"
        ))
    })?;
    Ok(Plan {
        vhost: vh,
        op: WiringOp::MovePrimary {
            queue: name.to_owned(),
            incarnation: roles.incarnation,
            to: to.to_owned(),
            step: MoveStep::Request,
        },
        answer: Answer::Accepted,
    })
}

/// `DELETE /api/queues/{vhost}/{name}/contents`: drops the ready messages (of a fragmented
/// queue: of every fragment, on its primary).
pub(super) fn purge<'a>(c: &'a Ctx<'a>) -> BoxFuture<'a, Result<Reply>> {
    Box::pin(async move {
        let [vh, name] = c.args();
        let b = c.broker;
        let fragmented = b.cluster().is_some() && vhost(b, vh)?.lock().is_fragmented(name);
        let n = if fragmented {
            // The whole queue: every fragment, on its primary.
            crate::broker::fragments::purge(b, vh, name)
                .await
                .map_err(ApiError::from_amqp)?
        } else {
            let v = vhost(b, vh)?;
            let mut v = v.lock();
            let owner = owner(&v, vh, name)?;
            let mut fx = Effects::default();
            let n = v
                .queue_purge(owner, name, &mut fx)
                .map_err(ApiError::from_amqp)?;
            b.finish_batch(0, &mut v, &mut fx);
            n
        };
        tracing::info!(vhost = %vh, queue = %name, messages = n, user = %c.call.user.name, "queue purged via admin API");
        Ok(empty_reply(StatusCode::NO_CONTENT))
    })
}

/// `GET /api/queues/{vhost}/{name}/bindings`: the default exchange's implicit binding too.
pub(super) fn bindings(c: &Ctx<'_>) -> Result<Reply> {
    let [vh, name] = c.args();
    let all = bindings_json(vh, &*vhost(c.broker, vh)?);
    ok(Value::Array(
        all.into_iter()
            .filter(|x| x["destination_type"] == "queue" && x["destination"] == name)
            .collect(),
    ))
}

/// The connection the core should act as on queue `name`: its exclusive owner, so the API
/// may purge an exclusive queue, else 0. 404 when there is no such queue.
fn owner(v: &VHost, vh: &str, name: &str) -> Result<u64> {
    Ok(v.queue(name)
        .ok_or_else(|| no_queue(vh, name))?
        .exclusive_owner
        .unwrap_or(0))
}

/// 400 for `"exclusive": true`: an exclusive queue lives and dies with an AMQP connection,
/// which an API call does not have.
fn refuse_exclusive(body: &Value) -> Result<()> {
    if flag(body, "exclusive", false)? {
        return Err(ApiError::bad_request(
            "exclusive queues belong to an AMQP connection: declare them over AMQP",
        ));
    }
    Ok(())
}

fn queue_json(b: &Broker, vh: &str, q: &Queue) -> Value {
    // The primary: where the queue's messages live.
    let node = q.home.as_deref().unwrap_or(&b.config.node_id);
    let ready = q.ready_count();
    let unacked = q.unacked_count();
    // Its backups (node ids, in ring order) and which of them may take over: the cluster
    // map's, so every member answers the same.
    let roles = b.cluster().and_then(|c| c.queue_roles(vh, &q.name));
    let (backups, in_sync, unavailable, moving_to, replacing) = match roles {
        Some(r) => (
            r.backups,
            r.in_sync,
            r.unavailable,
            r.moving_to,
            r.replacing,
        ),
        None => (Vec::new(), Vec::new(), false, None, None),
    };
    let replacing = replacing.map(|r| json!({"from": r.old, "to": r.new}));
    let local_copy = local_copy_json(b, node, &backups, q);
    json!({
        "name": q.name.as_ref(),
        "vhost": vh,
        "durable": q.durable,
        "auto_delete": q.auto_delete,
        "exclusive": q.exclusive_owner.is_some(),
        "session": q.session.as_deref(),
        "arguments": table_to_json(&q.arguments),
        "messages_ready": ready,
        "messages_unacknowledged": unacked,
        "messages": ready + unacked,
        "consumers": q.consumer_count(),
        "owner": node,
        "node": node,
        "backup_nodes": backups,
        "in_sync_backup_nodes": in_sync,
        "unavailable": unavailable,
        "moving_to": moving_to,
        "replacing_backup": replacing,
        "local_copy": local_copy,
        "type": "classic",
        "state": "running",
        "fragmented": q.args.fragmented,
        "fragment_of": q.args.fragment.as_ref().map(|f| json!({"queue": &*f.queue, "member": &*f.member})),
    })
}

/// The numbers of each fragmented queue among `queues`: the sums over the queues that hold
/// its messages (its fragments, wherever their primaries are, and its own record), and
/// `fragments`, the names of its fragments with their members and primaries.
async fn fragment_numbers(b: &Broker, queues: &mut [Value]) {
    for q in queues.iter_mut().filter(|q| q["fragmented"] == true) {
        let (vh, name) = (
            q["vhost"].as_str().unwrap_or("").to_owned(),
            q["name"].as_str().unwrap_or("").to_owned(),
        );
        let Ok(totals) = crate::broker::fragments::totals(b, &vh, &name).await else {
            continue;
        };
        q["messages_ready"] = totals.ready.into();
        q["messages_unacknowledged"] = totals.unacked.into();
        q["messages"] = (totals.ready + totals.unacked).into();
        q["consumers"] = totals.consumers.into();
        let parts: Vec<Value> = match b.vhost(&vh) {
            Some(v) => {
                let v = v.lock();
                (v.fragments(&name).into_iter())
                    .filter_map(|(member, part)| {
                        let primary = v.queue(&part)?.home.clone();
                        Some(json!({
                            "name": &*part,
                            "member": member.as_deref()?,
                            "node": primary.as_deref().unwrap_or(&b.config.node_id),
                        }))
                    })
                    .collect()
            }
            None => Vec::new(),
        };
        q["fragments"] = Value::Array(parts);
    }
}

/// What this member itself holds of queue `q`, whose primary is `node`: the counts above
/// are the primary's wherever the API is asked, so a backup's own memory use — bounded by
/// `queue_memory_budget_bytes` like its primary's — would show nowhere else. `role` is
/// `primary`, `backup`, or `none` (a member that only proxies the queue holds nothing).
fn local_copy_json(b: &Broker, node: &str, backups: &[String], q: &Queue) -> Value {
    let me = b.config.node_id.as_str();
    let role = if node == me {
        "primary"
    } else if backups.iter().any(|n| n == me) {
        "backup"
    } else {
        "none"
    };
    json!({
        "role": role,
        "messages": q.ready_count() + q.unacked_count(),
        "message_bytes_ram": q.resident_bytes(),
    })
}

fn queues_json(b: &Broker, vh: &str, v: &Mutex<VHost>) -> Vec<Value> {
    let v = v.lock();
    let mut qs: Vec<&Queue> = v.queues().collect();
    qs.sort_by(|a, b| a.name.cmp(&b.name));
    qs.into_iter().map(|q| queue_json(b, vh, q)).collect()
}

/// queue.declare as the API makes it, for a route or a definitions import: never exclusive
/// (an API call has no connection to own the queue) and never server-named, so an empty
/// name is 400.
pub(in crate::admin) fn declare_op(
    name: &str,
    durable: bool,
    auto_delete: bool,
    arguments: crate::amqp::FieldTable,
    home: Option<String>,
) -> Result<WiringOp> {
    if name.is_empty() {
        return Err(ApiError::bad_request("a queue needs a non-empty name"));
    }
    crate::core::fragments::refuse_reserved(&arguments, name)
        .map_err(|e| ApiError::bad_request(e.text))?;
    Ok(WiringOp::DeclareQueue {
        name: name.to_owned(),
        durable,
        exclusive: false,
        auto_delete,
        arguments,
        home,
        server_named: false,
    })
}

/// The 404 for a missing queue, the same wherever the API names one.
pub(in crate::admin) fn no_queue(vh: &str, name: &str) -> ApiError {
    ApiError::not_found(format!("no queue '{name}' in vhost '{vh}'"))
}
