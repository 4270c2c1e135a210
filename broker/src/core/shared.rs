//! A vhost's *shared* wiring — every exchange, non-exclusive queue and binding, durable or
//! not — as plain data: what a cluster member hands a member that joins, so that the joiner
//! starts from the same wiring the others have (then follows the same op stream).

use super::args::QueueArgs;
use super::exchange::{Binding, Destination, Exchange, ExchangeKind};
use super::queue::Queue;
use super::vhost::{Effects, VHost};
use super::wiring::DurableBinding;
use crate::amqp::FieldTable;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// An exchange of the shared wiring.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedExchange {
    /// Name.
    pub name: String,
    /// Type (`direct`, ...).
    pub kind: String,
    /// Durable flag.
    pub durable: bool,
    /// Auto-delete flag.
    pub auto_delete: bool,
    /// Internal flag.
    pub internal: bool,
    /// Arguments.
    pub arguments: FieldTable,
}

/// A queue of the shared wiring (its declaration, not its content).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedQueue {
    /// Name.
    pub name: String,
    /// Durable flag.
    pub durable: bool,
    /// Auto-delete flag.
    pub auto_delete: bool,
    /// Arguments.
    pub arguments: FieldTable,
    /// Node id of the member that owns it.
    pub home: Option<String>,
}

/// Every exchange, non-exclusive queue and binding of a vhost, in a stable order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SharedWiring {
    /// Exchanges other than the predeclared ones.
    pub exchanges: Vec<SharedExchange>,
    /// Non-exclusive queues.
    pub queues: Vec<SharedQueue>,
    /// Bindings, except those to exclusive queues.
    pub bindings: Vec<DurableBinding>,
}

fn predeclared(name: &str) -> bool {
    name.is_empty() || name.starts_with("amq.")
}

impl VHost {
    /// The shared wiring as it is now.
    pub fn shared_wiring(&self) -> SharedWiring {
        let mut w = SharedWiring::default();
        for ex in self.exchanges.values() {
            if !predeclared(&ex.name) {
                w.exchanges.push(SharedExchange {
                    name: ex.name.to_string(),
                    kind: ex.kind.as_str().to_owned(),
                    durable: ex.durable,
                    auto_delete: ex.auto_delete,
                    internal: ex.internal,
                    arguments: ex.arguments.clone(),
                });
            }
            for b in ex.bindings() {
                let (destination, is_queue) = match &b.destination {
                    Destination::Queue(q) => (q, true),
                    Destination::Exchange(e) => (e, false),
                };
                if is_queue && !self.is_shared_queue(destination) {
                    continue;
                }
                w.bindings.push(DurableBinding {
                    source: ex.name.to_string(),
                    destination: destination.to_string(),
                    destination_is_queue: is_queue,
                    routing_key: b.routing_key.clone(),
                    arguments: b.arguments.clone(),
                });
            }
        }
        for q in self.queues.values() {
            if q.exclusive_owner.is_none() {
                w.queues.push(SharedQueue {
                    name: q.name.to_string(),
                    durable: q.durable,
                    auto_delete: q.auto_delete,
                    arguments: q.arguments.clone(),
                    home: q.home.as_deref().map(str::to_owned),
                });
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

    fn is_shared_queue(&self, name: &str) -> bool {
        self.queues
            .get(name)
            .is_some_and(|q| q.exclusive_owner.is_none())
    }

    /// Makes this vhost's shared wiring equal to `w`, keeping the content of queues that stay
    /// (a restarted member keeps the messages of the queues it owns). Queues and exchanges the
    /// cluster no longer has are removed (their consumers cancelled through `fx`). Returns
    /// what could not be installed, for the caller to log.
    pub fn install_shared_wiring(
        &mut self,
        w: SharedWiring,
        now_ms: u64,
        fx: &mut Effects,
    ) -> Vec<String> {
        let mut skipped = Vec::new();
        let wanted_queues: Vec<&str> = w.queues.iter().map(|q| q.name.as_str()).collect();
        let gone: Vec<Arc<str>> = self
            .queues
            .values()
            .filter(|q| q.exclusive_owner.is_none() && !wanted_queues.contains(&&*q.name))
            .map(|q| q.name.clone())
            .collect();
        for name in gone {
            self.remove_queue(&name, fx);
        }
        let wanted_exchanges: Vec<&str> = w.exchanges.iter().map(|e| e.name.as_str()).collect();
        let gone: Vec<Arc<str>> = self
            .exchanges
            .keys()
            .filter(|n| !predeclared(n) && !wanted_exchanges.contains(&&***n))
            .cloned()
            .collect();
        for name in gone {
            self.exchanges.remove(&name);
        }
        for e in w.exchanges {
            let Some(kind) = ExchangeKind::parse(&e.kind) else {
                skipped.push(format!("exchange '{}': unknown type '{}'", e.name, e.kind));
                continue;
            };
            let name: Arc<str> = e.name.into();
            self.exchanges.insert(
                name.clone(),
                Exchange::new(
                    name,
                    kind,
                    e.durable,
                    e.auto_delete,
                    e.internal,
                    e.arguments,
                ),
            );
        }
        // Exchanges were rebuilt without bindings; the predeclared ones lose their shared
        // bindings here, keeping only those to exclusive (member-local) queues.
        let exclusive: Vec<Arc<str>> = self
            .queues
            .values()
            .filter(|q| q.exclusive_owner.is_some())
            .map(|q| q.name.clone())
            .collect();
        for ex in self.exchanges.values_mut() {
            let keep: Vec<Binding> = ex
                .bindings()
                .iter()
                .filter(
                    |b| matches!(&b.destination, Destination::Queue(q) if exclusive.contains(q)),
                )
                .cloned()
                .collect();
            let all: Vec<Binding> = ex.bindings().to_vec();
            for b in all.iter().filter(|b| !keep.contains(b)) {
                ex.unbind(b);
            }
        }
        for q in w.queues {
            let same = self.queues.get(q.name.as_str()).is_some_and(|cur| {
                cur.durable == q.durable
                    && cur.auto_delete == q.auto_delete
                    && cur.arguments == q.arguments
            });
            if !same {
                let args = match QueueArgs::parse(&q.arguments, &q.name, &self.name) {
                    Ok(a) => a,
                    Err(err) => {
                        skipped.push(format!("queue '{}': {}", q.name, err.text));
                        continue;
                    }
                };
                self.remove_queue(&q.name, fx);
                let name: Arc<str> = q.name.as_str().into();
                let mut queue = Queue::new(
                    name.clone(),
                    q.durable,
                    None,
                    q.auto_delete,
                    q.arguments,
                    args,
                    now_ms,
                );
                queue.uid = self.fresh_uid();
                self.queues.insert(name, queue);
            }
            if let Some(cur) = self.queues.get_mut(q.name.as_str()) {
                cur.home = q.home.map(Arc::from);
            }
        }
        self.restore_bindings(w.bindings, &mut skipped);
        self.mark_wiring_changed();
        skipped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{ExchangeDeclare, QueueDeclare};

    fn populated(seed: u64) -> VHost {
        let mut v = VHost::new("/", seed);
        v.exchange_declare(ExchangeDeclare {
            name: "x".into(),
            kind: "topic".into(),
            durable: false,
            ..Default::default()
        })
        .unwrap();
        for (name, durable) in [("a", true), ("b", false)] {
            v.queue_declare(
                0,
                QueueDeclare {
                    name: name.into(),
                    durable,
                    ..Default::default()
                },
                0,
            )
            .unwrap();
            v.queue_bind(0, name, "x", "k.#", FieldTable::default())
                .unwrap();
        }
        v.set_queue_home("a", "node-1");
        v
    }

    #[test]
    fn installing_a_snapshot_reproduces_the_wiring() {
        let source = populated(1);
        let mut joiner = VHost::new("/", 2);
        joiner
            .queue_declare(
                7,
                QueueDeclare {
                    name: "mine".into(),
                    exclusive: true,
                    ..Default::default()
                },
                0,
            )
            .unwrap();
        joiner
            .queue_bind(7, "mine", "amq.fanout", "", FieldTable::default())
            .unwrap();
        joiner
            .queue_declare(
                0,
                QueueDeclare {
                    name: "stale".into(),
                    ..Default::default()
                },
                0,
            )
            .unwrap();
        let skipped =
            joiner.install_shared_wiring(source.shared_wiring(), 0, &mut Effects::default());
        assert!(skipped.is_empty(), "{skipped:?}");
        assert_eq!(joiner.shared_wiring(), source.shared_wiring());
        assert!(joiner.queue("stale").is_none());
        assert!(joiner.queue("mine").is_some(), "exclusive queues stay");
        assert_eq!(
            joiner.exchange("amq.fanout").unwrap().bindings().len(),
            1,
            "bindings of exclusive queues stay"
        );
        assert_eq!(joiner.queue("a").unwrap().home.as_deref(), Some("node-1"));
        assert!(joiner.take_wiring_changed(), "the new wiring must be saved");
    }
}
