//! The durable part of a vhost's wiring — exchanges, queues and bindings that survive a
//! restart — as plain data, and putting it (and recovered messages) back into a vhost.

use super::args::QueueArgs;
use super::exchange::{Binding, Destination, Exchange, ExchangeKind};
use super::message::Message;
use super::queue::Queue;
use super::vhost::VHost;
use crate::amqp::FieldTable;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// A durable exchange.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DurableExchange {
    /// Name.
    pub name: String,
    /// Type (`direct`, ...).
    pub kind: String,
    /// Auto-delete flag.
    pub auto_delete: bool,
    /// Internal flag.
    pub internal: bool,
    /// Arguments.
    pub arguments: FieldTable,
}

/// A durable queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DurableQueue {
    /// Name.
    pub name: String,
    /// Unique id of this incarnation: journal records name it.
    pub uid: u64,
    /// Auto-delete flag.
    pub auto_delete: bool,
    /// Arguments.
    pub arguments: FieldTable,
}

/// A binding whose both ends are durable.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DurableBinding {
    /// Source exchange.
    pub source: String,
    /// Destination name.
    pub destination: String,
    /// The destination is a queue (else an exchange).
    pub destination_is_queue: bool,
    /// Binding key.
    pub routing_key: String,
    /// Arguments.
    pub arguments: FieldTable,
}

/// Everything of a vhost's wiring that survives a restart.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DurableWiring {
    /// Durable exchanges other than the predeclared ones.
    pub exchanges: Vec<DurableExchange>,
    /// Durable, non-exclusive queues.
    pub queues: Vec<DurableQueue>,
    /// Bindings between durable ends.
    pub bindings: Vec<DurableBinding>,
}

fn predeclared(name: &str) -> bool {
    name.is_empty() || name.starts_with("amq.")
}

impl VHost {
    /// The durable wiring as it is now, in a stable order.
    pub fn durable_wiring(&self) -> DurableWiring {
        let mut w = DurableWiring::default();
        for ex in self.exchanges.values() {
            if ex.durable && !predeclared(&ex.name) {
                w.exchanges.push(DurableExchange {
                    name: ex.name.to_string(),
                    kind: ex.kind.as_str().to_owned(),
                    auto_delete: ex.auto_delete,
                    internal: ex.internal,
                    arguments: ex.arguments.clone(),
                });
            }
        }
        for q in self.queues.values() {
            if q.durable && q.exclusive_owner.is_none() {
                w.queues.push(DurableQueue {
                    name: q.name.to_string(),
                    uid: q.uid,
                    auto_delete: q.auto_delete,
                    arguments: q.arguments.clone(),
                });
            }
        }
        for ex in self.exchanges.values() {
            if !ex.durable {
                continue;
            }
            for b in ex.bindings() {
                let (destination, is_queue, durable) = match &b.destination {
                    Destination::Queue(q) => (
                        q,
                        true,
                        self.queues
                            .get(q)
                            .is_some_and(|q| q.durable && q.exclusive_owner.is_none()),
                    ),
                    Destination::Exchange(e) => {
                        (e, false, self.exchanges.get(e).is_some_and(|e| e.durable))
                    }
                };
                if durable {
                    w.bindings.push(DurableBinding {
                        source: ex.name.to_string(),
                        destination: destination.to_string(),
                        destination_is_queue: is_queue,
                        routing_key: b.routing_key.clone(),
                        arguments: b.arguments.clone(),
                    });
                }
            }
        }
        w.exchanges.sort_by(|a, b| a.name.cmp(&b.name));
        w.queues.sort_by(|a, b| a.name.cmp(&b.name));
        w.bindings.sort_by(|a, b| {
            (&a.source, &a.destination, &a.routing_key).cmp(&(
                &b.source,
                &b.destination,
                &b.routing_key,
            ))
        });
        w
    }

    /// Puts recovered wiring back, before the vhost serves anyone. Entries that cannot be
    /// restored (an unknown exchange type, a binding to something missing) are skipped and
    /// returned as reasons, for the caller to log.
    pub fn restore_wiring(&mut self, w: DurableWiring, now_ms: u64) -> Vec<String> {
        let mut skipped = Vec::new();
        for e in w.exchanges {
            let Some(kind) = ExchangeKind::parse(&e.kind) else {
                skipped.push(format!("exchange '{}': unknown type '{}'", e.name, e.kind));
                continue;
            };
            let name: Arc<str> = e.name.into();
            self.exchanges.insert(
                name.clone(),
                Exchange::new(name, kind, true, e.auto_delete, e.internal, e.arguments),
            );
        }
        for q in w.queues {
            let args = match QueueArgs::parse(&q.arguments, &q.name, &self.name) {
                Ok(a) => a,
                Err(err) => {
                    skipped.push(format!("queue '{}': {}", q.name, err.text));
                    continue;
                }
            };
            let name: Arc<str> = q.name.into();
            let mut queue = Queue::new(
                name.clone(),
                true,
                None,
                q.auto_delete,
                q.arguments,
                args,
                now_ms,
            );
            queue.uid = q.uid;
            self.queues.insert(name, queue);
        }
        self.restore_bindings(w.bindings, &mut skipped);
        // Restoring is not a change: nothing needs saving.
        self.take_wiring_changed();
        skipped
    }

    /// Adds `bindings` whose both ends exist; the others go to `skipped` as reasons. Shared by
    /// restoring from disk and installing a cluster snapshot.
    pub(super) fn restore_bindings(
        &mut self,
        bindings: Vec<DurableBinding>,
        skipped: &mut Vec<String>,
    ) {
        for b in bindings {
            let destination = if b.destination_is_queue {
                self.queues
                    .get(b.destination.as_str())
                    .map(|q| Destination::Queue(q.name.clone()))
            } else {
                self.exchanges
                    .get(b.destination.as_str())
                    .map(|e| Destination::Exchange(e.name.clone()))
            };
            match (destination, self.exchanges.get_mut(b.source.as_str())) {
                (Some(destination), Some(source)) => {
                    source.bind(Binding {
                        destination,
                        routing_key: b.routing_key,
                        arguments: b.arguments,
                    });
                }
                _ => skipped.push(format!(
                    "binding {} -> {}: an end is missing",
                    b.source, b.destination
                )),
            }
        }
    }

    /// Puts recovered messages back into the queue `name`, in id order.
    pub fn restore_messages(
        &mut self,
        name: &str,
        mut messages: Vec<(u64, Arc<Message>, Option<u64>)>,
    ) {
        let budget = self.limits.queue_memory_budget_bytes;
        let Some(q) = self.queues.get_mut(name) else {
            return;
        };
        messages.sort_unstable_by_key(|(id, _, _)| *id);
        for (id, message, expires_at_ms) in messages {
            q.restore(id, message, expires_at_ms, budget);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::vhost::{ExchangeDeclare, QueueDeclare};

    #[test]
    fn durable_wiring_round_trips_and_skips_transient_objects() {
        let mut v = VHost::new("/", 1);
        v.exchange_declare(ExchangeDeclare {
            name: "ex".into(),
            kind: "topic".into(),
            durable: true,
            ..Default::default()
        })
        .unwrap();
        v.exchange_declare(ExchangeDeclare {
            name: "tmp".into(),
            kind: "fanout".into(),
            ..Default::default()
        })
        .unwrap();
        v.queue_declare(
            1,
            QueueDeclare {
                name: "dq".into(),
                durable: true,
                ..Default::default()
            },
            0,
        )
        .unwrap();
        v.queue_declare(
            1,
            QueueDeclare {
                name: "tq".into(),
                ..Default::default()
            },
            0,
        )
        .unwrap();
        v.queue_declare(
            1,
            QueueDeclare {
                name: "xq".into(),
                durable: true,
                exclusive: true,
                ..Default::default()
            },
            0,
        )
        .unwrap();
        assert!(v.take_wiring_changed());
        v.queue_bind(1, "dq", "ex", "a.#", FieldTable::default())
            .unwrap();
        assert!(
            v.take_wiring_changed(),
            "a durable binding is a durable change"
        );
        v.queue_bind(1, "tq", "ex", "b", FieldTable::default())
            .unwrap();
        assert!(
            !v.take_wiring_changed(),
            "a binding to a transient queue is not"
        );
        let w = v.durable_wiring();
        assert_eq!(
            w.exchanges
                .iter()
                .map(|e| e.name.as_str())
                .collect::<Vec<_>>(),
            vec!["ex"]
        );
        assert_eq!(
            w.queues.iter().map(|q| q.name.as_str()).collect::<Vec<_>>(),
            vec!["dq"]
        );
        assert_eq!(w.bindings.len(), 1);
        let mut restored = VHost::new("/", 2);
        assert!(restored.restore_wiring(w.clone(), 0).is_empty());
        assert_eq!(restored.durable_wiring(), w);
    }
}
