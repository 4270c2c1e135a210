//! Wiring changes as data: every exchange and queue declare, delete, bind and unbind, from
//! AMQP or the admin API, becomes one [`WiringOp`]. A single broker applies it at once; a
//! cluster member multicasts it through CPG so that every member applies the same change to
//! its copy of the wiring, in the same order. One place decides what a `queue.declare` does.
//!
//! Applying an op is pure (a [`VHost`] in, a reply or an AMQP error out), so every member
//! reaches the same result for the same sequence: two conflicting declares resolve the same
//! way everywhere — the first committed wins and the second gets the error RabbitMQ gives.

use crate::amqp::FieldTable;
use crate::core::{AmqpError, Effects, ExchangeDeclare, QueueDeclare, VHost};
use serde::{Deserialize, Serialize};

/// The connection an op applied on behalf of no connection acts for: a cluster member
/// applying another member's op. Connection ids start at 1, and shared ops never touch
/// exclusive queues, so no ownership check can match it.
pub const NO_CONNECTION: u64 = 0;

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
    /// Whether a cluster member sends the op to every member: everything but exclusive
    /// queues and what is done to them, which stay with their connection's member.
    pub fn is_shared(&self, v: &VHost) -> bool {
        let exclusive = |name: &str| v.queue(name).is_some_and(|q| q.exclusive_owner.is_some());
        match self {
            WiringOp::DeclareQueue {
                name, exclusive: e, ..
            } => !e && !exclusive(name),
            WiringOp::DeleteQueue { name, .. }
            | WiringOp::BindQueue { queue: name, .. }
            | WiringOp::UnbindQueue { queue: name, .. } => !exclusive(name),
            _ => true,
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
            Some(found) if if_unused && !found.consumers.is_empty() => {
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
                if let Some(home) = home {
                    v.set_queue_home(&name, &home);
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
