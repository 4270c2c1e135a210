//! A vhost's wiring — exchanges, queues and bindings — as plain data, and putting it back.
//!
//! One type, [`Wiring`], serves two readers that want nearly the same thing:
//!
//! * **disk** ([`VHost::durable_wiring`], [`VHost::restore_wiring`]): what survives a restart —
//!   durable exchanges, durable non-exclusive queues with the uid their journal records name,
//!   bindings whose both ends are durable. The store saves it as JSON (`wiring.json`) and the
//!   queues' messages are restored after it.
//! * **a joining cluster member** ([`VHost::shared_wiring`], [`VHost::install_shared_wiring`]):
//!   what the cluster shares — every exchange and non-exclusive queue, durable or not, with the
//!   member each queue lives on, and the bindings between them.
//!
//! The two were separate types that differed only in a `durable` flag, a queue's `uid` and its
//! `home`; keeping them apart meant every new exchange or queue attribute had to be added, saved
//! and restored twice. The fields one view does not use are defaulted, so that a wiring file
//! written before the types were merged (no `durable`, no `home`) still reads.

use super::NO_CONNECTION;
use super::WiringOp;
use super::args::QueueArgs;
use super::exchange::{Binding, Destination, Exchange, ExchangeKind};
use super::message::Message;
use super::queue::Queue;
use super::vhost::{Effects, VHost};
use crate::amqp::FieldTable;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::Arc;

/// An exchange's declaration: enough to declare it again, identically, elsewhere or later.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WiringExchange {
    /// Name.
    pub name: String,
    /// Type (`direct`, ...).
    pub kind: String,
    /// Durable flag. Absent from wiring files, which hold durable exchanges only.
    #[serde(default = "durable_when_absent")]
    pub durable: bool,
    /// Auto-delete flag.
    pub auto_delete: bool,
    /// Internal flag.
    pub internal: bool,
    /// Arguments.
    pub arguments: FieldTable,
}

/// A queue's declaration, not its content (messages travel as queue ops, not as wiring).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WiringQueue {
    /// Name.
    pub name: String,
    /// Unique id of this incarnation: journal records name it. Only the durable view carries
    /// it (0 in the shared view): uids are local to a member's journal, a joiner makes its own.
    #[serde(default)]
    pub uid: u64,
    /// Durable flag. Absent from wiring files, which hold durable queues only.
    #[serde(default = "durable_when_absent")]
    pub durable: bool,
    /// Auto-delete flag.
    pub auto_delete: bool,
    /// Arguments.
    pub arguments: FieldTable,
    /// Node id of the cluster member that owns it. Only the shared view carries it: after a
    /// restart the cluster, not the disk, says where a queue lives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub home: Option<String>,
    /// Exclusive to a connection on its home member. Only the shared view holds such queues
    /// (a joiner routes to them and refuses them to its own connections); no disk does.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exclusive: bool,
    /// The resumable session that owns an exclusive queue, when a session's connection
    /// declared it: it lives with the session, not with a member (`docs/sessions.md` §4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Its backups and their sync state, beside `home` (the primary): only a cluster map's
    /// snapshot carries them (`cluster::roles`, which decides them); a vhost exports them
    /// empty, and no disk holds them. Flat in JSON, absent when empty.
    #[serde(flatten)]
    pub roles: WiringRoles,
}

/// A clustered queue's roles besides its primary, as a snapshot of the cluster map carries
/// them. Every field defaults, so snapshots of members that predate roles still read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WiringRoles {
    /// Cluster-wide identity of the queue's incarnation: the agreed index of the declare that
    /// created it, the same on every member (unlike `uid`, local to one journal). 0: none
    /// (not a clustered queue, or declared before roles existed).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub incarnation: u64,
    /// Node ids of the backups, in ring order after the primary.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backups: Vec<String>,
    /// The backups that are in sync (may be promoted), in backups order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_sync: Vec<String>,
    /// How many backups the queue keeps when enough members are up (`k`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub wanted_backups: u8,
    /// The primary is lost with no in-sync backup: `home` and `in_sync` name who holds the
    /// newest state, and the queue waits for one of them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unavailable: bool,
    /// The member a planned move of the primary goes to, while it is under way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moving_to: Option<String>,
    /// A backup being replaced (old, new), while the new one catches up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replacing: Option<(String, String)>,
    /// Its `k` is the ring layout's, not its own (declared without `qpid.cluster.backups`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub default_k: bool,
}

fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
}

/// A binding between two ends that the same view holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WiringBinding {
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

/// A vhost's wiring in a stable order (sorted by name; bindings by source, destination, key),
/// so that two vhosts with the same wiring export equal values. Which objects it holds depends
/// on the view that made it: see the module documentation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Wiring {
    /// Exchanges other than the predeclared ones.
    pub exchanges: Vec<WiringExchange>,
    /// Non-exclusive queues.
    pub queues: Vec<WiringQueue>,
    /// Bindings, except those to exclusive queues.
    pub bindings: Vec<WiringBinding>,
    /// On a cluster member, the agreed index of the newest cluster change this vhost has
    /// applied (disk view only): a restart replays the cluster's log after it, and never an
    /// op at or before it a second time (a purge applied twice would empty a queue of
    /// messages published after it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_through: Option<u64>,
}

/// Objects in wiring files written before the views shared one type were all durable.
fn durable_when_absent() -> bool {
    true
}

fn predeclared(name: &str) -> bool {
    name.is_empty() || name.starts_with("amq.")
}

/// Which part of a vhost's wiring an export holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum View {
    /// What survives a restart: durable objects, and bindings whose both ends are durable.
    Durable,
    /// What the cluster shares: every object, durable or not.
    Shared,
    /// What the cluster shares and no disk holds: the shared view less the durable one.
    Transient,
}

impl View {
    /// Whether an object with this durability belongs to the view.
    fn holds(self, durable: bool) -> bool {
        match self {
            View::Durable => durable,
            View::Shared => true,
            View::Transient => !durable,
        }
    }

    /// Whether queue `q` belongs to the view: exclusive queues live and die with one
    /// connection, so no disk holds them, but every cluster member knows them (those of a
    /// single broker, which has no home for them, stay out of every view).
    fn holds_queue(self, q: &Queue) -> bool {
        match q.exclusive_owner {
            Some(_) => self != View::Durable && q.home.is_some(),
            None => self.holds(q.durable),
        }
    }

    /// Whether a binding belongs to the view, from whether each end is in the durable view
    /// and whether its destination is shared at all: a binding is durable when both ends are.
    fn holds_binding(self, source_durable: bool, destination: Ends) -> bool {
        let durable = source_durable && destination.durable;
        match self {
            View::Durable => durable,
            View::Shared => destination.shared,
            View::Transient => destination.shared && !durable,
        }
    }
}

/// Which views a binding's destination belongs to.
#[derive(Clone, Copy)]
struct Ends {
    durable: bool,
    shared: bool,
}

impl VHost {
    /// The durable wiring as it is now: what the store saves so that a restart finds it again.
    pub fn durable_wiring(&self) -> Wiring {
        self.wiring(View::Durable)
    }

    /// The shared wiring as it is now: what a cluster member hands a member that joins, so
    /// that the joiner starts from the wiring the others have (then follows the same op stream).
    pub fn shared_wiring(&self) -> Wiring {
        self.wiring(View::Shared)
    }

    /// The shared wiring no disk holds (non-durable and exclusive queues, non-durable
    /// exchanges, bindings with such an end): a cluster member keeps it in its map
    /// checkpoint, so that a restart in place gets it back with the durable part
    /// ([`VHost::restore_transient_wiring`]).
    pub fn transient_wiring(&self) -> Wiring {
        self.wiring(View::Transient)
    }

    fn wiring(&self, view: View) -> Wiring {
        let mut w = Wiring::default();
        for ex in self.exchanges.values() {
            if view == View::Durable && !ex.durable {
                continue;
            }
            if view.holds(ex.durable) && !predeclared(&ex.name) {
                w.exchanges.push(WiringExchange {
                    name: ex.name.to_string(),
                    kind: ex.kind.as_str().to_owned(),
                    durable: ex.durable,
                    auto_delete: ex.auto_delete,
                    internal: ex.internal,
                    arguments: ex.arguments.clone(),
                });
            }
            for b in ex.bindings() {
                let (destination, is_queue, ends) = match &b.destination {
                    Destination::Queue(name) => {
                        let q = self.queues.get(name);
                        (
                            name,
                            true,
                            Ends {
                                durable: q.is_some_and(|q| View::Durable.holds_queue(q)),
                                shared: q.is_some_and(|q| View::Shared.holds_queue(q)),
                            },
                        )
                    }
                    Destination::Exchange(e) => (
                        e,
                        false,
                        Ends {
                            durable: self.exchanges.get(e).is_some_and(|e| e.durable),
                            shared: true,
                        },
                    ),
                };
                if view.holds_binding(ex.durable, ends) {
                    w.bindings.push(WiringBinding {
                        source: ex.name.to_string(),
                        destination: destination.to_string(),
                        destination_is_queue: is_queue,
                        routing_key: b.routing_key.clone(),
                        arguments: b.arguments.clone(),
                    });
                }
            }
        }
        for q in self.queues.values() {
            if view.holds_queue(q) {
                w.queues.push(WiringQueue {
                    name: q.name.to_string(),
                    uid: if view == View::Durable { q.uid } else { 0 },
                    durable: q.durable,
                    auto_delete: q.auto_delete,
                    arguments: q.arguments.clone(),
                    home: match view {
                        View::Durable => None,
                        View::Shared | View::Transient => q.home.as_deref().map(str::to_owned),
                    },
                    exclusive: q.exclusive_owner.is_some(),
                    session: q.session.as_deref().map(str::to_owned),
                    // The cluster map owns the roles and adds them to its snapshots.
                    roles: WiringRoles::default(),
                });
            }
        }
        if view == View::Durable {
            w.cluster_through = self.cluster_through;
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
    pub fn restore_wiring(&mut self, w: Wiring, now_ms: u64) -> Vec<String> {
        let mut skipped = Vec::new();
        for e in w.exchanges {
            self.install_exchange(e, &mut skipped);
        }
        for q in w.queues {
            let uid = q.uid;
            match self.new_queue(q, now_ms) {
                Ok(mut queue) => {
                    queue.uid = uid;
                    self.has_fragmented |= queue.args.fragmented;
                    self.queues.insert(crate::core::own_key(&queue.name), queue);
                }
                Err(why) => skipped.push(why),
            }
        }
        self.restore_bindings(w.bindings, &mut skipped);
        self.cluster_through = w.cluster_through;
        // Restoring is not a change: nothing needs saving.
        self.take_wiring_changed();
        skipped
    }

    /// Makes this vhost's shared wiring equal to `w`, keeping the content of queues that stay
    /// (a restarted member keeps the messages of the queues it owns). Queues and exchanges the
    /// cluster no longer has are removed (their consumers cancelled through `fx`). Returns
    /// what could not be installed, for the caller to log.
    pub fn install_shared_wiring(
        &mut self,
        w: Wiring,
        now_ms: u64,
        fx: &mut Effects,
    ) -> Vec<String> {
        self.cluster_through = w.cluster_through;
        let mut skipped = Vec::new();
        let wanted_queues: Vec<&str> = w.queues.iter().map(|q| q.name.as_str()).collect();
        let gone: Vec<Arc<str>> = self
            .queues
            .values()
            .filter(|q| !wanted_queues.contains(&&*q.name))
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
            self.install_exchange(e, &mut skipped);
        }
        // Exchanges were rebuilt without bindings; the predeclared ones lose theirs here (the
        // snapshot holds every binding of the cluster).
        for ex in self.exchanges.values_mut() {
            let all: Vec<Binding> = ex.bindings().to_vec();
            for b in &all {
                ex.unbind(b);
            }
        }
        for q in w.queues {
            let home: Option<Arc<str>> = q.home.as_deref().map(Arc::from);
            let exclusive = q.exclusive;
            let session: Option<Arc<str>> =
                q.session.as_deref().filter(|_| exclusive).map(Arc::from);
            let same = |cur: &&mut Queue| {
                cur.durable == q.durable
                    && cur.auto_delete == q.auto_delete
                    && cur.arguments == q.arguments
            };
            if let Some(cur) = self.queues.get_mut(q.name.as_str()).filter(same) {
                cur.home = home;
                continue;
            }
            let mut queue = match self.new_queue(q, now_ms) {
                Ok(queue) => queue,
                Err(why) => {
                    skipped.push(why);
                    continue;
                }
            };
            self.remove_queue(&queue.name, fx);
            queue.uid = self.fresh_uid();
            queue.home = home;
            // Another member's connection owns it (or, homed here, a connection of this
            // member's earlier run: retired below).
            queue.exclusive_owner = exclusive.then_some(NO_CONNECTION);
            queue.session = session;
            self.has_fragmented |= queue.args.fragmented;
            self.queues.insert(crate::core::own_key(&queue.name), queue);
        }
        self.restore_bindings(w.bindings, &mut skipped);
        let orphans: Vec<Arc<str>> = self
            .queues
            .values()
            .filter(|q| {
                q.exclusive_owner == Some(NO_CONNECTION)
                    && q.session.is_none()
                    && q.home.as_deref().is_some_and(|h| self.is_here(h))
            })
            .map(|q| q.name.clone())
            .collect();
        for name in orphans {
            self.retire_exclusive(&name, fx);
        }
        self.mark_wiring_changed();
        skipped
    }

    /// Whether `op`, which this vhost's saved state already reflects (a restart's replay
    /// skips it), also changed the transient wiring, which no disk holds, so that the replay
    /// must apply it again: a declare of a non-durable or exclusive object, a delete of one
    /// that is here, a bind or unbind with an end that is not durable. Its durable part, if
    /// any, is already here and applies as a no-op or fails harmlessly.
    pub fn has_transient_part(&self, op: &WiringOp) -> bool {
        let saved_queue = |name: &str| {
            self.queues
                .get(name)
                .is_some_and(|q| View::Durable.holds_queue(q))
        };
        let saved_exchange = |name: &str| self.exchanges.get(name).is_some_and(|e| e.durable);
        match op {
            WiringOp::DeclareExchange { durable, .. } => !durable,
            WiringOp::DeclareQueue {
                durable, exclusive, ..
            } => !durable || *exclusive,
            WiringOp::DeleteExchange { name, .. } => {
                self.exchanges.contains_key(name.as_str()) && !saved_exchange(name)
            }
            WiringOp::DeleteQueue { name, .. } => {
                self.queues.contains_key(name.as_str()) && !saved_queue(name)
            }
            WiringOp::BindQueue {
                queue, exchange, ..
            }
            | WiringOp::UnbindQueue {
                queue, exchange, ..
            } => !(saved_exchange(exchange) && saved_queue(queue)),
            WiringOp::BindExchange {
                destination,
                source,
                ..
            }
            | WiringOp::UnbindExchange {
                destination,
                source,
                ..
            } => !(saved_exchange(source) && saved_exchange(destination)),
            _ => false,
        }
    }

    /// Puts back, after a restart in place, the transient wiring `w` this member's map
    /// checkpoint kept ([`VHost::transient_wiring`]), beside the durable wiring the store
    /// restored. The store may be newer than the checkpoint: an object its durable wiring
    /// names wins, and the transient one (with its bindings) is left out — the replay of the
    /// cluster's log after the checkpoint is what removed it. Returns what could not be put
    /// back (not those), for the caller to log.
    pub fn restore_transient_wiring(
        &mut self,
        w: Wiring,
        now_ms: u64,
        fx: &mut Effects,
    ) -> Vec<String> {
        let mut merged = self.shared_wiring();
        merged.cluster_through = self.cluster_through;
        // Names the durable wiring has that `w` has too: those of `w` are left out.
        let exchanges: HashSet<String> = merged.exchanges.iter().map(|e| e.name.clone()).collect();
        let queues: HashSet<String> = merged.queues.iter().map(|q| q.name.clone()).collect();
        let (kept, shadowed): (Vec<_>, Vec<_>) = w
            .exchanges
            .into_iter()
            .partition(|e| !exchanges.contains(&e.name));
        let shadowed_exchanges: HashSet<String> = shadowed.into_iter().map(|e| e.name).collect();
        merged.exchanges.extend(kept);
        let (kept, shadowed): (Vec<_>, Vec<_>) = w
            .queues
            .into_iter()
            .partition(|q| !queues.contains(&q.name));
        let shadowed_queues: HashSet<String> = shadowed.into_iter().map(|q| q.name).collect();
        merged.queues.extend(kept);
        merged.bindings.extend(w.bindings.into_iter().filter(|b| {
            let destination_shadowed = if b.destination_is_queue {
                shadowed_queues.contains(&b.destination)
            } else {
                shadowed_exchanges.contains(&b.destination)
            };
            !shadowed_exchanges.contains(&b.source) && !destination_shadowed
        }));
        self.install_shared_wiring(merged, now_ms, fx)
    }

    /// Adds exchange `e`, replacing one of the same name (bindings and all); an unknown type
    /// goes to `skipped` as a reason. Shared by restoring from disk and installing a snapshot.
    fn install_exchange(&mut self, e: WiringExchange, skipped: &mut Vec<String>) {
        let Some(kind) = ExchangeKind::parse(&e.kind) else {
            skipped.push(format!("exchange '{}': unknown type '{}'", e.name, e.kind));
            return;
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

    /// The empty queue `q` declares (not yet in the vhost, uid unset), or why it cannot be
    /// made: its arguments do not parse. Shared by restoring from disk and installing a
    /// snapshot.
    fn new_queue(&self, q: WiringQueue, now_ms: u64) -> Result<Queue, String> {
        let args = QueueArgs::parse(&q.arguments, &q.name, &self.name)
            .map_err(|err| format!("queue '{}': {}", q.name, err.text))?;
        Ok(Queue::new(
            q.name.into(),
            q.durable,
            None,
            q.auto_delete,
            q.arguments,
            args,
            now_ms,
        ))
    }

    /// Adds `bindings` whose both ends exist; the others go to `skipped` as reasons. Shared by
    /// restoring from disk and installing a cluster snapshot.
    fn restore_bindings(&mut self, bindings: Vec<WiringBinding>, skipped: &mut Vec<String>) {
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

    /// Gives the queue `name` back the producer table its journal kept (the producers of
    /// messages consumed before the restart as well as of those restored): a session's
    /// publish resent after the restart is dropped as the resend it is.
    pub fn restore_producers(&mut self, name: &str, highest: &[(Arc<str>, u64)]) {
        if let Some(q) = self.queues.get_mut(name) {
            q.note_producers(highest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{ExchangeDeclare, QueueDeclare};

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
        let mut source = populated(1);
        source
            .queue_declare(
                9,
                QueueDeclare {
                    name: "theirs".into(),
                    exclusive: true,
                    ..Default::default()
                },
                0,
            )
            .unwrap();
        source.set_queue_home("theirs", "node-1");
        source
            .queue_bind(9, "theirs", "amq.fanout", "", FieldTable::default())
            .unwrap();
        let mut joiner = VHost::new("/", 2);
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
        assert_eq!(
            joiner.queue("theirs").unwrap().exclusive_owner,
            Some(NO_CONNECTION),
            "another member's exclusive queue: known, owned by none of the joiner's connections"
        );
        assert_eq!(
            joiner.exchange("amq.fanout").unwrap().bindings().len(),
            1,
            "bindings of exclusive queues are shared too"
        );
        assert!(
            !joiner
                .durable_wiring()
                .queues
                .iter()
                .any(|q| q.name == "theirs"),
            "no disk holds exclusive queues"
        );
        assert_eq!(joiner.queue("a").unwrap().home.as_deref(), Some("node-1"));
        assert!(joiner.take_wiring_changed(), "the new wiring must be saved");
    }

    #[test]
    fn a_snapshot_from_a_member_of_the_previous_version_installs() {
        // The shape SharedWiring had on the cluster wire before the views shared one type:
        // every object has `durable`, queues have `home` and no `uid`.
        let json = r#"{"exchanges":[{"name":"x","kind":"topic","durable":false,
            "auto_delete":false,"internal":false,"arguments":{}}],
            "queues":[{"name":"a","durable":true,"auto_delete":false,"arguments":{},
            "home":"node-1"},{"name":"b","durable":false,"auto_delete":false,"arguments":{},
            "home":null}],
            "bindings":[{"source":"x","destination":"a","destination_is_queue":true,
            "routing_key":"k.#","arguments":{}},{"source":"x","destination":"b",
            "destination_is_queue":true,"routing_key":"k.#","arguments":{}}]}"#;
        let w: Wiring = serde_json::from_str(json).unwrap();
        let source = populated(1);
        assert_eq!(w, source.shared_wiring());
        let mut joiner = VHost::new("/", 2);
        assert!(
            joiner
                .install_shared_wiring(w, 0, &mut Effects::default())
                .is_empty()
        );
        assert_eq!(joiner.shared_wiring(), source.shared_wiring());
    }

    #[test]
    fn a_queue_with_roles_and_every_kind_of_argument_round_trips_through_json() {
        // The roles are flattened into the queue's object: the arguments go through serde's
        // buffered path then, and must come back the same.
        use crate::amqp::{AMQPValue, FieldArray};
        let mut nested = FieldTable::default();
        nested.insert("n".into(), AMQPValue::LongLongInt(-3));
        let mut list = FieldArray::default();
        list.push(AMQPValue::LongString("h:1".into()));
        list.push(AMQPValue::Boolean(true));
        let mut arguments = FieldTable::default();
        for (k, v) in [
            ("x-max-length", AMQPValue::LongInt(10)),
            ("qpid.cluster.backups", AMQPValue::ShortShortUInt(2)),
            ("s", AMQPValue::ShortString("short".into())),
            ("l", AMQPValue::LongString("long".into())),
            ("f", AMQPValue::Double(1.5)),
            ("t", AMQPValue::Timestamp(7)),
            ("u", AMQPValue::LongUInt(u32::MAX)),
            ("table", AMQPValue::FieldTable(nested)),
            ("array", AMQPValue::FieldArray(list)),
            ("void", AMQPValue::Void),
        ] {
            arguments.insert(k.into(), v);
        }
        let q = WiringQueue {
            name: "q".into(),
            uid: 0,
            durable: true,
            auto_delete: false,
            arguments,
            home: Some("n1".into()),
            exclusive: false,
            session: None,
            roles: WiringRoles {
                incarnation: 12,
                backups: vec!["n2".into(), "n3".into()],
                in_sync: vec!["n3".into()],
                wanted_backups: 2,
                unavailable: true,
                moving_to: Some("n3".into()),
                replacing: Some(("n2".into(), "n4".into())),
                default_k: true,
            },
        };
        let json = serde_json::to_string(&q).unwrap();
        assert!(json.contains(r#""backups":["n2","n3"]"#), "flat: {json}");
        assert_eq!(serde_json::from_str::<WiringQueue>(&json).unwrap(), q);
        let plain = WiringQueue {
            roles: WiringRoles::default(),
            ..q
        };
        let json = serde_json::to_string(&plain).unwrap();
        assert!(!json.contains("incarnation"), "no roles, no keys: {json}");
        assert_eq!(serde_json::from_str::<WiringQueue>(&json).unwrap(), plain);
    }
}
