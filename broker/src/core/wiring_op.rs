//! Wiring changes as data: every exchange and queue declare, delete, bind and unbind, from
//! AMQP or the admin API, becomes one [`WiringOp`]. A single broker applies it at once; a
//! cluster member multicasts it through CPG so that every member applies the same change to
//! its copy of the wiring, in the same order. One place decides what a `queue.declare` does.
//!
//! Applying an op is pure (a [`VHost`] in, a reply or an AMQP error out), so every member
//! reaches the same result for the same sequence: two conflicting declares resolve the same
//! way everywhere — the first committed wins and the second gets the error RabbitMQ gives.

use crate::amqp::FieldTable;
use crate::core::vhost::OwnerToken;
use crate::core::{AmqpError, Effects, ExchangeDeclare, QueueDeclare, VHost};
use serde::{Deserialize, Serialize};

/// The connection an op applied on behalf of no connection acts for: a cluster member
/// applying a committed op. Connection ids start at 1. Ownership checks let it through: the
/// member that sent the op checked its own connection (see [`WiringOp::is_shared`]).
pub const NO_CONNECTION: u64 = 0;

/// The argument a cluster op declaring an exclusive queue carries, naming its owner on the
/// queue's member ([`VHost::exclusive_owner_token`]); taken out before the queue is made.
pub const OWNER_ARGUMENT: &str = "x-ringmq-exclusive-owner";

/// A change to a vhost's wiring. Passive declares (questions, not changes), purges and
/// everything about messages are not ops.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum WiringOp {
    /// exchange.declare (not passive).
    DeclareExchange {
        /// Name.
        name: String,
        /// Type as sent.
        kind: String,
        /// Durable flag.
        durable: bool,
        /// Auto-delete flag.
        auto_delete: bool,
        /// Internal flag.
        internal: bool,
        /// Arguments.
        arguments: FieldTable,
    },
    /// exchange.delete.
    DeleteExchange {
        /// Name.
        name: String,
        /// Refuse if the exchange has bindings.
        if_unused: bool,
    },
    /// exchange.bind.
    BindExchange {
        /// Exchange receiving what `source` routes.
        destination: String,
        /// Exchange routing.
        source: String,
        /// Binding key.
        routing_key: String,
        /// Arguments.
        arguments: FieldTable,
    },
    /// exchange.unbind.
    UnbindExchange {
        /// Exchange that received what `source` routes.
        destination: String,
        /// Exchange routing.
        source: String,
        /// Binding key.
        routing_key: String,
        /// Arguments.
        arguments: FieldTable,
    },
    /// queue.declare (not passive). The name is never empty: the broker that took the
    /// request made one up, so that every member of a cluster creates the same queue.
    DeclareQueue {
        /// Name.
        name: String,
        /// Durable flag.
        durable: bool,
        /// Exclusive to the declaring connection (never multicast: it lives where its
        /// connection is).
        #[serde(default)]
        exclusive: bool,
        /// Auto-delete flag.
        auto_delete: bool,
        /// Arguments.
        arguments: FieldTable,
        /// Node id of the cluster member where it was declared (its home); none on a
        /// single broker. Named `owner` on the wire, as members before this field had it.
        #[serde(rename = "owner")]
        home: Option<String>,
        /// The broker made the `amq.gen-` name up (the client sent an empty one).
        server_named: bool,
    },
    /// queue.delete. On a cluster, `if-unused` and `if-empty` are checked by the member that
    /// took the request (only a queue's owner knows its consumers and content) and the op
    /// it multicasts has both off: deleting what is already gone succeeds.
    DeleteQueue {
        /// Name.
        name: String,
        /// Refuse if the queue has consumers.
        #[serde(default)]
        if_unused: bool,
        /// Refuse if the queue holds messages.
        #[serde(default)]
        if_empty: bool,
    },
    /// queue.bind.
    BindQueue {
        /// Queue.
        queue: String,
        /// Source exchange.
        exchange: String,
        /// Binding key.
        routing_key: String,
        /// Arguments.
        arguments: FieldTable,
    },
    /// queue.unbind.
    UnbindQueue {
        /// Queue.
        queue: String,
        /// Source exchange.
        exchange: String,
        /// Binding key.
        routing_key: String,
        /// Arguments.
        arguments: FieldTable,
    },
    /// A clustered queue's primary caught backup `node` up (a snapshot, then the op stream):
    /// from this point of the agreed order on it counts as in sync — the primary's confirms
    /// wait for its ack, and it may be elected. Applied only if `node` is still a backup of
    /// that incarnation and the sender is its primary (else a no-op). The cluster map's
    /// roles change; a vhost's wiring does not.
    BackupInSync {
        /// Queue.
        queue: String,
        /// Its incarnation ([`crate::core::wiring::WiringRoles::incarnation`]).
        incarnation: u64,
        /// Node id of the backup.
        node: String,
    },
    /// Backup `node` of a clustered queue is no longer in sync: committed by the primary
    /// before it sends any confirm without that backup's ack, so a backup that may lack a
    /// confirmed op is never elected. Applied if `node` is in sync in that incarnation (else
    /// a no-op), whoever sends it.
    BackupOutOfSync {
        /// Queue.
        queue: String,
        /// Its incarnation.
        incarnation: u64,
        /// Node id of the backup.
        node: String,
    },
    /// A planned move of a clustered queue's primary (`cluster move-queue`, a drain; see
    /// `docs/cluster.md`, "Moving a primary"): asked by anyone, switched by the primary
    /// once the target caught up and acknowledged every op, or called off. The cluster
    /// map's roles change; a vhost's wiring does not.
    MovePrimary {
        /// Queue.
        queue: String,
        /// Its incarnation.
        incarnation: u64,
        /// Node id of the member the primary moves to.
        to: String,
        /// Which step of the move.
        step: MoveStep,
    },
    /// A member is drained (`cluster drain`: it takes no new roles and hands over the ones
    /// it holds) or undrained. The cluster map's membership changes; a vhost's wiring does
    /// not (submitted under any vhost).
    DrainMember {
        /// Node id of the member.
        node: String,
        /// Drained (`true`) or undrained.
        draining: bool,
    },
    /// A change to the cluster's session directory (`crate::session::directory`): where
    /// each resumable session lives and whether a connection holds it. The cluster map's,
    /// not the vhost's wiring (the vhost named is the connection's, or empty before open).
    Session(crate::session::directory::SessionOp),
    /// A rebalance of the primaries over the active members (`cluster rebalance --apply`)
    /// starts or stops. Every member plans it from the same map at the same point of the
    /// agreed order, so the plan and its progress are the map's, not one member's
    /// (submitted under any vhost).
    Rebalance(RebalanceStep),
    /// The ring's layout is set (`PUT /api/cluster/ring`, a `BackupRing`): the order of the
    /// members and the `k` of queues declared without their own. The cluster map's
    /// membership and roles change; a vhost's wiring does not (submitted under any vhost).
    SetRingLayout(crate::cluster::layout::RingLayout),
}

/// What a [`WiringOp::Rebalance`] asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RebalanceStep {
    /// Plan the moves that even out the primaries and carry them out, at most
    /// `concurrency` at once. Refused while another rebalance has moves left.
    Start {
        /// Most moves under way at once.
        concurrency: u32,
    },
    /// Start none of the plan's remaining moves (those under way finish).
    Stop,
    /// Member `node`, new to the ring, holds the map: it and its ring neighbours hand it
    /// its share of the primaries and the backups (a rebalance over the three). Sent by
    /// the new member itself once; one that finds a rebalance under way waits for
    /// `cluster rebalance --apply`.
    Join {
        /// Node id of the new member.
        node: String,
    },
}

/// The steps of a planned primary move ([`WiringOp::MovePrimary`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MoveStep {
    /// Start it: the target becomes a backup if it is not one, and catches up.
    Request,
    /// The primary's switch, once the target is in sync and acknowledged everything the
    /// primary did before it stopped the queue: the target is the primary from here on.
    /// Applied only when the primary sends it.
    Switch,
    /// Call it off (the primary could not finish it); the queue is served as before.
    Cancel,
}

/// What applying an op answers, for the broker whose client asked.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OpReply {
    /// Ready messages (queue.declare-ok, queue.delete-ok) as this member holds them.
    pub message_count: u32,
    /// Consumers on this member (queue.declare-ok).
    pub consumer_count: u32,
    /// The declare created the queue (the admin API answers 201 rather than 204, and the
    /// broker logs it).
    pub created: bool,
}

impl WiringOp {
    /// Whether a cluster member sends the op, asked for by its connection `conn`, to every
    /// member. Everything is shared — exclusive queues too, so that every member routes to
    /// them and refuses them to other connections — except what only this member can answer:
    /// a declare naming an exclusive queue that exists (its owner's redeclare, or 405), and
    /// what another connection tries on an exclusive queue (405, answered here).
    pub fn is_shared(&self, v: &VHost, conn: u64) -> bool {
        let owner = |name: &str| v.queue(name).and_then(|q| q.exclusive_owner);
        match self {
            WiringOp::DeclareQueue {
                name, exclusive, ..
            } => match v.queue(name) {
                None => true,
                Some(q) => q.exclusive_owner.is_none() && !exclusive,
            },
            WiringOp::DeleteQueue { name, .. }
            | WiringOp::BindQueue { queue: name, .. }
            | WiringOp::UnbindQueue { queue: name, .. } => match owner(name) {
                Some(owner) => owner == conn || conn == NO_CONNECTION,
                None => true,
            },
            _ => true,
        }
    }

    /// An exclusive queue's declare, marked for the cluster with its owner's token
    /// ([`VHost::exclusive_owner_token`]) so that its member gives it to that connection;
    /// any other op unchanged.
    pub fn with_exclusive_owner(self, token: String) -> WiringOp {
        match self {
            WiringOp::DeclareQueue {
                name,
                durable,
                exclusive: true,
                auto_delete,
                mut arguments,
                home,
                server_named,
            } => {
                arguments.insert(
                    OWNER_ARGUMENT.into(),
                    crate::amqp::AMQPValue::LongString(token.into()),
                );
                WiringOp::DeclareQueue {
                    name,
                    durable,
                    exclusive: true,
                    auto_delete,
                    arguments,
                    home,
                    server_named,
                }
            }
            other => other,
        }
    }

    /// The session that owns the exclusive queue this op declares, if a session's
    /// connection declared it ([`WiringOp::with_exclusive_owner`]): such a queue is the
    /// cluster's to replicate, like a shared one (`docs/sessions.md` §4).
    pub fn declaring_session(&self) -> Option<String> {
        let WiringOp::DeclareQueue {
            exclusive: true,
            arguments,
            ..
        } = self
        else {
            return None;
        };
        match arguments.inner().get(OWNER_ARGUMENT)? {
            crate::amqp::AMQPValue::LongString(s) => {
                let token = String::from_utf8_lossy(s.as_bytes());
                OwnerToken::parse(&token)?.session.map(str::to_owned)
            }
            _ => None,
        }
    }

    /// The op as a cluster member multicasts it. A queue's consumers and content are known
    /// only where they are, so the member that took the request checks queue.delete's
    /// `if-unused` and `if-empty` against its own copy before the op leaves, and the op every
    /// member applies is unconditional.
    pub fn for_cluster(self, v: &VHost) -> Result<WiringOp, AmqpError> {
        let WiringOp::DeleteQueue {
            name,
            if_unused,
            if_empty,
        } = self
        else {
            return Ok(self);
        };
        match v.queue(&name) {
            Some(found) if if_unused && found.consumer_count() > 0 => {
                return Err(AmqpError::precondition(format!(
                    "queue '{name}' in vhost '{}' in use",
                    v.name()
                )));
            }
            Some(found) if if_empty && found.ready_count() > 0 => {
                return Err(AmqpError::precondition(format!(
                    "queue '{name}' in vhost '{}' is not empty",
                    v.name()
                )));
            }
            _ => {}
        }
        Ok(WiringOp::DeleteQueue {
            name,
            if_unused: false,
            if_empty: false,
        })
    }

    /// Applies the op to this broker's vhost on behalf of connection `conn` (which exclusive
    /// queues it may use; [`NO_CONNECTION`] for another member's op). Deterministic: the same
    /// vhost state and op give the same result on every member.
    pub fn apply(
        &self,
        v: &mut VHost,
        conn: u64,
        now_ms: u64,
        fx: &mut Effects,
    ) -> Result<OpReply, AmqpError> {
        match self.clone() {
            WiringOp::DeclareExchange {
                name,
                kind,
                durable,
                auto_delete,
                internal,
                arguments,
            } => v
                .exchange_declare(ExchangeDeclare {
                    name,
                    kind,
                    passive: false,
                    durable,
                    auto_delete,
                    internal,
                    arguments,
                })
                .map(|()| OpReply::default()),
            WiringOp::DeleteExchange { name, if_unused } => v
                .exchange_delete(&name, if_unused)
                .map(|()| OpReply::default()),
            WiringOp::BindExchange {
                destination,
                source,
                routing_key,
                arguments,
            } => v
                .exchange_bind(&destination, &source, &routing_key, arguments)
                .map(|()| OpReply::default()),
            WiringOp::UnbindExchange {
                destination,
                source,
                routing_key,
                arguments,
            } => v
                .exchange_unbind(&destination, &source, &routing_key, arguments)
                .map(|()| OpReply::default()),
            WiringOp::DeclareQueue {
                name,
                durable,
                exclusive,
                auto_delete,
                arguments,
                home,
                server_named,
            } => {
                let mut table = arguments.inner().clone();
                let token = table.remove(OWNER_ARGUMENT).and_then(|t| match t {
                    crate::amqp::AMQPValue::LongString(s) => {
                        Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                    }
                    _ => None,
                });
                let arguments = FieldTable::from(table);
                let here = home.as_deref().is_some_and(|h| v.is_here(h));
                let session = token
                    .as_deref()
                    .and_then(OwnerToken::parse)
                    .and_then(|t| t.session)
                    .filter(|_| exclusive);
                let conn = match &token {
                    Some(t) if exclusive && here => v.token_owner(t),
                    _ => conn,
                };
                if exclusive && conn == NO_CONNECTION && v.queue(&name).is_some() {
                    // Two members' clients declared the same exclusive queue: the first
                    // committed owns it, everywhere.
                    return Err(AmqpError::resource_locked(format!(
                        "cannot obtain exclusive access to locked queue '{name}' in vhost '{}'",
                        v.name()
                    )));
                }
                let d = QueueDeclare {
                    name: name.clone(),
                    passive: false,
                    durable,
                    exclusive,
                    auto_delete,
                    arguments,
                };
                let created = v.queue(&name).is_none();
                let declared = if server_named {
                    v.queue_declare_server_named(conn, d, now_ms)?
                } else {
                    v.queue_declare(conn, d, now_ms)?
                };
                // A redeclare through another member does not move the queue: its primary is
                // where it was made, or where the cluster map's election put it.
                if let Some(home) = home
                    && (created || v.queue(&name).is_some_and(|q| q.home.is_none()))
                {
                    v.set_queue_home(&name, &home);
                }
                if let Some(session) = session.filter(|_| created) {
                    v.set_queue_session(&name, session);
                } else if exclusive && here && conn == NO_CONNECTION {
                    // Declared for a connection of an earlier run of this member (a replay):
                    // nobody owns it, it goes. (A session's lives while its session does.)
                    v.retire_exclusive(&name, fx);
                }
                Ok(OpReply {
                    message_count: declared.message_count,
                    consumer_count: declared.consumer_count,
                    created,
                })
            }
            WiringOp::DeleteQueue {
                name,
                if_unused,
                if_empty,
            } => {
                let message_count = v.queue_delete(conn, &name, if_unused, if_empty, fx)?;
                Ok(OpReply {
                    message_count,
                    ..OpReply::default()
                })
            }
            WiringOp::BindQueue {
                queue,
                exchange,
                routing_key,
                arguments,
            } => v
                .queue_bind(conn, &queue, &exchange, &routing_key, arguments)
                .map(|()| OpReply::default()),
            WiringOp::UnbindQueue {
                queue,
                exchange,
                routing_key,
                arguments,
            } => v
                .queue_unbind(conn, &queue, &exchange, &routing_key, arguments)
                .map(|()| OpReply::default()),
            // The cluster map's roles, not the vhost's wiring (a single broker has none).
            WiringOp::BackupInSync { .. }
            | WiringOp::BackupOutOfSync { .. }
            | WiringOp::MovePrimary { .. }
            | WiringOp::DrainMember { .. }
            | WiringOp::Rebalance(_)
            | WiringOp::SetRingLayout(_)
            | WiringOp::Session(_) => Ok(OpReply::default()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::codes;

    fn queue(name: &str, durable: bool) -> WiringOp {
        WiringOp::DeclareQueue {
            name: name.into(),
            durable,
            auto_delete: false,
            exclusive: false,
            arguments: FieldTable::default(),
            home: Some("a".into()),
            server_named: false,
        }
    }

    #[test]
    fn the_same_ops_give_the_same_results_and_wiring_on_every_member() {
        let ops = [
            queue("q", true),
            queue("q", false),
            WiringOp::DeclareExchange {
                name: "x".into(),
                kind: "topic".into(),
                durable: true,
                auto_delete: false,
                internal: false,
                arguments: FieldTable::default(),
            },
            WiringOp::BindQueue {
                queue: "q".into(),
                exchange: "x".into(),
                routing_key: "a.#".into(),
                arguments: FieldTable::default(),
            },
            WiringOp::BindQueue {
                queue: "nope".into(),
                exchange: "x".into(),
                routing_key: "k".into(),
                arguments: FieldTable::default(),
            },
            WiringOp::DeleteExchange {
                name: "x".into(),
                if_unused: true,
            },
        ];
        let run = |seed| {
            let mut v = VHost::new("/", seed);
            let mut fx = Effects::default();
            let results: Vec<_> = ops
                .iter()
                .map(|op| {
                    op.apply(&mut v, NO_CONNECTION, 1, &mut fx)
                        .map_err(|e| e.code)
                })
                .collect();
            (results, v.shared_wiring())
        };
        let (a, wa) = run(1);
        let (b, wb) = run(2);
        assert_eq!(a, b);
        assert_eq!(wa, wb);
        assert!(a[0].is_ok());
        assert_eq!(
            a[1],
            Err(codes::PRECONDITION_FAILED),
            "second declare conflicts"
        );
        assert_eq!(a[4], Err(codes::NOT_FOUND));
        assert_eq!(a[5], Err(codes::PRECONDITION_FAILED), "x is in use");
    }

    #[test]
    fn ops_read_and_written_in_the_form_members_before_the_one_wiring_path_use() {
        // What a member multicast before ops carried the whole method.
        let declare: WiringOp = serde_json::from_str(
            r#"{"DeclareQueue":{"name":"q","durable":true,"auto_delete":false,
                "arguments":{},"owner":"a","server_named":false}}"#,
        )
        .expect("an older member's declare decodes");
        assert_eq!(declare, queue("q", true));
        let delete: WiringOp = serde_json::from_str(r#"{"DeleteQueue":{"name":"q"}}"#)
            .expect("an older member's delete decodes");
        assert_eq!(
            delete,
            WiringOp::DeleteQueue {
                name: "q".into(),
                if_unused: false,
                if_empty: false,
            }
        );
        // And an older member finds the home where it looks for the owner.
        let sent = serde_json::to_value(queue("q", true)).unwrap();
        assert_eq!(sent["DeclareQueue"]["owner"], "a");
    }

    #[test]
    fn a_declared_queue_records_its_owner() {
        let mut v = VHost::new("/", 1);
        queue("q", true)
            .apply(&mut v, NO_CONNECTION, 1, &mut Effects::default())
            .unwrap();
        assert_eq!(v.queue("q").unwrap().home.as_deref(), Some("a"));
    }
}
