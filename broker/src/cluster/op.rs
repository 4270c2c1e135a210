//! Wiring changes as data: what a member multicasts through CPG so that every member applies
//! the same change to its copy of the wiring, in the same order.
//!
//! Applying an op is pure (a [`VHost`] in, a reply or an AMQP error out), so every member
//! reaches the same result for the same sequence: two conflicting declares resolve the same
//! way everywhere — the first committed wins and the second gets the error RabbitMQ gives.

use crate::amqp::FieldTable;
use crate::core::{AmqpError, Effects, ExchangeDeclare, QueueDeclare, VHost};
use serde::{Deserialize, Serialize};

/// A change to a vhost's shared wiring. Exclusive queues, passive declares, purges and
/// everything about messages stay local to the member the client is connected to.
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
    /// queue.declare of a shared (non-exclusive, not passive) queue. The name is never
    /// empty: the member that took the request made one up, so every member uses the same.
    DeclareQueue {
        /// Name.
        name: String,
        /// Durable flag.
        durable: bool,
        /// Auto-delete flag.
        auto_delete: bool,
        /// Arguments.
        arguments: FieldTable,
        /// Node id of the member where it was declared: the queue's owner.
        owner: String,
        /// The member made the `amq.gen-` name up (the client sent an empty one).
        server_named: bool,
    },
    /// queue.delete. `if-unused` and `if-empty` were checked by the member that took the
    /// request (only a queue's owner knows its consumers and content), so this is
    /// unconditional: deleting what is already gone succeeds.
    DeleteQueue {
        /// Name.
        name: String,
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

/// What applying an op answers, for the member whose client asked.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OpReply {
    /// Ready messages (queue.declare-ok, queue.delete-ok) as this member holds them.
    pub message_count: u32,
    /// Consumers on this member (queue.declare-ok).
    pub consumer_count: u32,
}

impl WiringOp {
    /// Applies the op to this member's copy of the vhost. Deterministic: the same vhost state
    /// and op give the same result on every member.
    pub fn apply(
        &self,
        v: &mut VHost,
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
                auto_delete,
                arguments,
                owner,
                server_named,
            } => {
                let d = QueueDeclare {
                    name: name.clone(),
                    passive: false,
                    durable,
                    exclusive: false,
                    auto_delete,
                    arguments,
                };
                let declared = if server_named {
                    v.queue_declare_server_named(d, now_ms)?
                } else {
                    v.queue_declare(SHARED, d, now_ms)?
                };
                v.set_queue_home(&name, &owner);
                Ok(OpReply {
                    message_count: declared.message_count,
                    consumer_count: declared.consumer_count,
                })
            }
            WiringOp::DeleteQueue { name } => {
                let message_count = v.queue_delete(SHARED, &name, false, false, fx)?;
                Ok(OpReply {
                    message_count,
                    consumer_count: 0,
                })
            }
            WiringOp::BindQueue {
                queue,
                exchange,
                routing_key,
                arguments,
            } => v
                .queue_bind(SHARED, &queue, &exchange, &routing_key, arguments)
                .map(|()| OpReply::default()),
            WiringOp::UnbindQueue {
                queue,
                exchange,
                routing_key,
                arguments,
            } => v
                .queue_unbind(SHARED, &queue, &exchange, &routing_key, arguments)
                .map(|()| OpReply::default()),
        }
    }
}

/// The "connection" shared ops act for: none. Connection ids start at 1, and shared ops never
/// touch exclusive queues, so no ownership check can match it.
const SHARED: u64 = 0;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::codes;

    fn queue(name: &str, durable: bool) -> WiringOp {
        WiringOp::DeclareQueue {
            name: name.into(),
            durable,
            auto_delete: false,
            arguments: FieldTable::default(),
            owner: "a".into(),
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
                .map(|op| op.apply(&mut v, 1, &mut fx).map_err(|e| e.code))
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
    fn a_declared_queue_records_its_owner() {
        let mut v = VHost::new("/", 1);
        queue("q", true)
            .apply(&mut v, 1, &mut Effects::default())
            .unwrap();
        assert_eq!(v.queue("q").unwrap().home.as_deref(), Some("a"));
    }
}
