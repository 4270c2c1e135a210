//! Wiring writes of the admin API — declaring or deleting a queue or an exchange, adding a
//! binding — take the path AMQP's exchange and queue methods take
//! (`server/connection/wiring.rs`): the call becomes one [`WiringOp`], built by the route's
//! [`Planner`] the same way on a single broker and on a cluster member, and [`run`] applies
//! it here or sends it through the cluster map and answers once it is committed. So one
//! place, [`WiringOp::apply`], decides what a `queue.declare` does, whoever asks and wherever.
//!
//! The op is applied here on a single broker, and on a cluster member when it is not shared
//! ([`WiringOp::is_shared`]: it names an exclusive queue, which lives with its connection on
//! this member). Applied here, it acts as the exclusive queue's connection, so the API may
//! delete or bind such a queue; a shared op goes out as
//! [`crate::core::WiringOp::for_cluster`] makes it, the same form AMQP sends. A definitions
//! import applies its ops here with the same checks ([`apply_here`]).

use super::router::{Ctx, Result};
use super::routes::{created, no_exchange, no_queue, vhost};
use super::{ApiError, Reply, empty_reply};
use crate::broker::Broker;
use crate::clock::now_ms;
use crate::cluster::{Cluster, OpOutcome};
use crate::core::{Effects, NO_CONNECTION, VHost, WiringOp};
use hyper::StatusCode;
use hyper::header::{self, HeaderValue};
use std::sync::Arc;
use tokio::sync::oneshot;

/// Turns a call into the wiring change it asks for. It reads only the call (path, query,
/// body), so a bad request is refused before the vhost is looked up, in the same order on a
/// single broker and on a cluster member; what the change needs of the vhost is checked when
/// it is applied or sent ([`check`]).
pub(super) type Planner = for<'a> fn(&Ctx<'a>) -> Result<Plan<'a>>;

/// A wiring change a call asks for: where, what, and how success is answered.
pub(super) struct Plan<'a> {
    /// The vhost (a path segment of the call).
    pub(super) vhost: &'a str,
    /// The change, as every member of a cluster applies it.
    pub(super) op: WiringOp,
    /// The success reply.
    pub(super) answer: Answer,
}

/// How a route answers once its op is applied.
pub(super) enum Answer {
    /// 201 when the declare created the object, 204 when it was there with the same
    /// properties: a `PUT` is idempotent and the status tells which happened.
    Declared,
    /// 204.
    Deleted,
    /// 202: a change the cluster carries out after the call (a primary's move).
    Accepted,
    /// 201 with the new binding's address (`/api/bindings/.../{properties_key}`) in
    /// `Location`, as RabbitMQ answers.
    Bound {
        /// The binding's path, percent-encoded.
        location: String,
    },
}

impl Answer {
    fn reply(self, was_new: bool) -> Reply {
        match self {
            Answer::Declared => created(was_new),
            Answer::Deleted => empty_reply(StatusCode::NO_CONTENT),
            Answer::Accepted => empty_reply(StatusCode::ACCEPTED),
            Answer::Bound { location } => {
                let mut r = empty_reply(StatusCode::CREATED);
                if let Ok(loc) = HeaderValue::from_str(&location) {
                    r.headers_mut().insert(header::LOCATION, loc);
                }
                r
            }
        }
    }
}

/// Answers a wiring call: `plan` builds the op, which is applied here or, on a cluster
/// member, committed through the cluster map first. The journal wait before the answer is
/// the caller's, as for every write (`persist_all_and_wait` in `handle`).
pub(super) async fn run(c: &Ctx<'_>, plan: Planner) -> Result<Reply> {
    let Plan {
        vhost: vh,
        op,
        answer,
    } = plan(c)?;
    let was_new = match start(c.broker, vh, &op)? {
        Flight::Applied { was_new } => was_new,
        Flight::Submitted {
            outcome,
            new_exchange,
        } => {
            let (reply, _journal_seq) = outcome
                .await
                .map_err(|_| ApiError::cluster_stopped())?
                .map_err(ApiError::from_amqp)?;
            reply.created || new_exchange
        }
    };
    log_change(vh, &op, was_new, &c.call.user.name);
    Ok(answer.reply(was_new))
}

/// Applies `op` to vhost `vh` on this broker alone, with the checks [`run`] makes: for a
/// definitions import, which builds its ops the way the routes do.
pub(super) fn apply_here(b: &Broker, vh: &str, op: &WiringOp, by: &str) -> Result<()> {
    let v = vhost(b, vh)?;
    let mut v = v.lock();
    let checked = check(op, &v, vh)?;
    let was_new = apply(b, &mut v, op, &checked)?;
    log_change(vh, op, was_new, by);
    Ok(())
}

/// Where a wiring change is once [`start`] returns.
enum Flight {
    /// Applied on this broker.
    Applied {
        /// A declare created the object.
        was_new: bool,
    },
    /// Sent through the cluster map; the outcome arrives once it is committed and applied on
    /// this member.
    Submitted {
        /// The outcome of this member's apply.
        outcome: oneshot::Receiver<OpOutcome>,
        /// A declared exchange did not exist when the op left (the op's reply says whether a
        /// declare created the object only for queues).
        new_exchange: bool,
    },
}

/// Checks `op` against the vhost and, under the same lock, applies it here or (on a cluster
/// member, when it is shared) submits it, so what was checked still holds when it leaves.
fn start(b: &Broker, vh: &str, op: &WiringOp) -> Result<Flight> {
    let v = vhost(b, vh)?;
    let mut v = v.lock();
    let checked = check(op, &v, vh)?;
    match b.cluster() {
        Some(cluster) if op.is_shared(&v, checked.conn) => submit(cluster, vh, op, &v, checked),
        _ => Ok(Flight::Applied {
            was_new: apply(b, &mut v, op, &checked)?,
        }),
    }
}

/// Sends a shared op through the cluster map in the form every member applies.
fn submit(
    cluster: &Arc<Cluster>,
    vh: &str,
    op: &WiringOp,
    v: &VHost,
    checked: Checked,
) -> Result<Flight> {
    let shared = op.clone().for_cluster(v).map_err(ApiError::from_amqp)?;
    Ok(Flight::Submitted {
        outcome: cluster.submit(vh, shared),
        new_exchange: checked.new_exchange,
    })
}

/// Applies `op` on this broker and ends the batch (effects to other connections, durable
/// changes to the journal); returns whether a declare created the object.
fn apply(b: &Broker, v: &mut VHost, op: &WiringOp, checked: &Checked) -> Result<bool> {
    let mut fx = Effects::default();
    let applied = op.apply(v, checked.conn, now_ms(), &mut fx);
    b.finish_batch(0, v, &mut fx);
    let reply = applied.map_err(ApiError::from_amqp)?;
    Ok(reply.created || checked.new_exchange)
}

/// What [`check`] found that applying the op, or answering it, needs.
struct Checked {
    /// The connection the op acts as: the exclusive owner of the queue it names, so the API
    /// may use an exclusive queue as its connection would; else [`NO_CONNECTION`].
    conn: u64,
    /// A declared exchange does not exist yet.
    new_exchange: bool,
}

/// What the API checks before an op applies, beyond what applying checks: the objects the
/// path names must exist (404 in the API's words, naming the missing end of a binding,
/// where AMQP's deletes of what is gone succeed), in the order a single broker always
/// checked them.
fn check(op: &WiringOp, v: &VHost, vh: &str) -> Result<Checked> {
    let need_exchange = |name: &str| match v.exchange(name) {
        Some(_) => Ok(()),
        None => Err(no_exchange(vh, name)),
    };
    let owner = |name: &str| {
        v.queue(name)
            .map(|q| q.exclusive_owner.unwrap_or(NO_CONNECTION))
    };
    let need_queue = |name: &str| owner(name).ok_or_else(|| no_queue(vh, name));
    let mut checked = Checked {
        conn: NO_CONNECTION,
        new_exchange: false,
    };
    match op {
        WiringOp::DeclareQueue { name, .. } => {
            checked.conn = owner(name).unwrap_or(NO_CONNECTION);
        }
        WiringOp::DeleteQueue { name, .. } => checked.conn = need_queue(name)?,
        WiringOp::BindQueue {
            queue, exchange, ..
        } => {
            need_exchange(exchange)?;
            checked.conn = need_queue(queue)?;
        }
        WiringOp::DeclareExchange { name, .. } => {
            checked.new_exchange = v.exchange(name).is_none();
        }
        WiringOp::DeleteExchange { name, .. } => need_exchange(name)?,
        WiringOp::BindExchange {
            destination,
            source,
            ..
        } => {
            need_exchange(source)?;
            need_exchange(destination)?;
        }
        // No route plans an unbind: `DELETE /api/bindings/...` finds the binding by its
        // properties key and changes the vhost itself.
        WiringOp::UnbindQueue { .. } | WiringOp::UnbindExchange { .. } => {}
        // The cluster's own ops: no route plans them (a move is submitted as it is).
        WiringOp::BackupInSync { .. }
        | WiringOp::BackupOutOfSync { .. }
        | WiringOp::MovePrimary { .. }
        | WiringOp::DrainMember { .. }
        | WiringOp::Rebalance(_)
        | WiringOp::SetRingLayout(_)
        | WiringOp::Session(_) => {}
    }
    Ok(checked)
}

/// One log line for an object created or deleted through the API (bindings are not logged).
fn log_change(vh: &str, op: &WiringOp, was_new: bool, user: &str) {
    match op {
        WiringOp::DeclareQueue { name, .. } if was_new => {
            tracing::info!(vhost = %vh, queue = %name, %user, "queue declared via admin API");
        }
        WiringOp::DeleteQueue { name, .. } => {
            tracing::info!(vhost = %vh, queue = %name, %user, "queue deleted via admin API");
        }
        WiringOp::DeclareExchange { name, .. } if was_new => {
            tracing::info!(vhost = %vh, exchange = %name, %user, "exchange declared via admin API");
        }
        WiringOp::DeleteExchange { name, .. } => {
            tracing::info!(vhost = %vh, exchange = %name, %user, "exchange deleted via admin API");
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::FieldTable;
    use crate::core::QueueDeclare;

    /// Vhost `/` with the exclusive queue `ex` of connection 7 and the shared queue `q`.
    fn vhost() -> VHost {
        let mut v = VHost::new("/", 1);
        for (name, exclusive) in [("ex", true), ("q", false)] {
            let d = QueueDeclare {
                name: name.into(),
                passive: false,
                durable: false,
                exclusive,
                auto_delete: false,
                arguments: FieldTable::default(),
            };
            v.queue_declare(7, d, 1).unwrap();
        }
        v
    }

    fn bind(queue: &str, exchange: &str) -> WiringOp {
        WiringOp::BindQueue {
            queue: queue.into(),
            exchange: exchange.into(),
            routing_key: String::new(),
            arguments: FieldTable::default(),
        }
    }

    fn delete_queue(name: &str) -> WiringOp {
        WiringOp::DeleteQueue {
            name: name.into(),
            if_unused: false,
            if_empty: false,
        }
    }

    #[test]
    fn an_op_on_an_exclusive_queue_acts_as_its_connection() {
        let mut v = vhost();
        for op in [bind("ex", "amq.direct"), delete_queue("ex")] {
            let checked = check(&op, &v, "/").unwrap();
            assert_eq!(checked.conn, 7, "{op:?}");
            // On a cluster it goes to every member (all of them know the queue).
            assert!(op.is_shared(&v, checked.conn), "{op:?}");
            op.apply(&mut v, checked.conn, 1, &mut Effects::default())
                .unwrap();
        }
        assert!(v.queue("ex").is_none());
        let shared = check(&delete_queue("q"), &v, "/").unwrap();
        assert_eq!(shared.conn, NO_CONNECTION);
    }

    #[test]
    fn a_binding_with_both_ends_missing_names_the_source_exchange_first() {
        let e = check(&bind("nq", "nx"), &vhost(), "/").err().unwrap();
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert_eq!(e.reason, "no exchange 'nx' in vhost '/'");
        let e = check(&bind("nq", "amq.direct"), &vhost(), "/")
            .err()
            .unwrap();
        assert_eq!(e.reason, "no queue 'nq' in vhost '/'");
    }

    #[test]
    fn deleting_what_is_not_there_is_404_where_amqp_succeeds() {
        let v = vhost();
        let gone = WiringOp::DeleteExchange {
            name: "gone".into(),
            if_unused: false,
        };
        assert_eq!(
            check(&gone, &v, "/").err().unwrap().reason,
            "no exchange 'gone' in vhost '/'"
        );
        assert_eq!(
            check(&delete_queue("gone"), &v, "/").err().unwrap().reason,
            "no queue 'gone' in vhost '/'"
        );
    }

    #[test]
    fn only_an_exchange_that_did_not_exist_counts_as_created() {
        let declare = |name: &str| WiringOp::DeclareExchange {
            name: name.into(),
            kind: "direct".into(),
            durable: true,
            auto_delete: false,
            internal: false,
            arguments: FieldTable::default(),
        };
        let v = vhost();
        assert!(check(&declare("fresh"), &v, "/").unwrap().new_exchange);
        assert!(!check(&declare("amq.direct"), &v, "/").unwrap().new_exchange);
    }
}
