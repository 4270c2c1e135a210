//! Where a fragmented queue's messages go and where its consumers read
//! ([`crate::core::fragments`]): the same answer on every member from the same wiring, so the
//! member a publish arrived at and the primary it is forwarded to pick the same fragment.

use super::VHost;
use crate::core::fragments::{fragment_name, fragment_name_by_prefix};
use crate::core::queue::Queue;
use std::sync::Arc;

/// The origin a forward names when the sender put the message in a fragmented queue's own
/// record: no member's fragment has this name, so the primary takes the record too.
pub const RECORD_ORIGIN: &str = "";

impl VHost {
    /// The queue a message routed to fragmented queue `queue` goes to when published on
    /// behalf of `origin` (a member's node id; this member's when `None`): that member's
    /// fragment, or the queue's own record while the member has none (on a single broker
    /// always: there are no members).
    pub(super) fn fragment_for(&self, queue: &Queue, origin: Option<&str>) -> Arc<str> {
        let name = match (origin, &self.fragment_prefix) {
            (Some(origin), _) => fragment_name(origin, &queue.name),
            (None, Some(prefix)) => fragment_name_by_prefix(prefix, &queue.name),
            (None, None) => return queue.name.clone(),
        };
        // The queue's own name, not the map's key: the key is kept apart from the Arc
        // counts that routing writes (`core::own_key`).
        match self.queues.get(name.as_str()) {
            Some(fragment) => fragment.name.clone(),
            None => queue.name.clone(),
        }
    }

    /// Replaces the fragmented queues among `targets` with their fragments for `origin`
    /// (see [`VHost::fragment_for`]), each target still once. Returns whether one of them
    /// fell back to the queue's own record (no fragment for `origin` here): a forward then
    /// names no origin member but the record ([`RECORD_ORIGIN`]), so that a primary that
    /// already has the fragment does not pick it instead — it may be another member's to
    /// serve, and the message would be in neither.
    pub(super) fn route_to_fragments(
        &self,
        targets: &mut Vec<Arc<str>>,
        origin: Option<&str>,
    ) -> bool {
        if !self.has_fragmented {
            return false;
        }
        let (mut replaced, mut to_record) = (false, false);
        for name in targets.iter_mut() {
            if let Some(q) = self.queues.get(name).filter(|q| q.args.fragmented) {
                *name = self.fragment_for(q, origin);
                to_record |= *name == q.name;
                replaced = true;
            }
        }
        if replaced && targets.len() > 1 {
            let mut seen: Vec<Arc<str>> = Vec::with_capacity(targets.len());
            targets.retain(|t| {
                let first = !seen.contains(t);
                if first {
                    seen.push(t.clone());
                }
                first
            });
        }
        to_record
    }

    /// The queue a consumer (or a basic.get) on this member reads when it names `queue`:
    /// for a fragmented queue this member's fragment (the queue's own record while there is
    /// none); `queue` itself otherwise.
    pub fn read_target(&self, queue: &str) -> String {
        match self.queues.get(queue) {
            Some(q) if q.args.fragmented => self.fragment_for(q, None).to_string(),
            _ => queue.to_owned(),
        }
    }

    /// Whether `queue` is fragmented.
    pub fn is_fragmented(&self, queue: &str) -> bool {
        self.queues.get(queue).is_some_and(|q| q.args.fragmented)
    }

    /// The names of the vhost's fragmented queues.
    pub fn fragmented_queues(&self) -> Vec<Arc<str>> {
        if !self.has_fragmented {
            return Vec::new();
        }
        let mut names: Vec<Arc<str>> = self
            .queues
            .values()
            .filter(|q| q.args.fragmented)
            .map(|q| q.name.clone())
            .collect();
        names.sort();
        names
    }

    /// Fragments whose fragmented queue is gone (its delete went first, and the member
    /// deleting the fragments stopped before it was done): they are deleted next.
    pub fn orphan_fragments(&self) -> Vec<Arc<str>> {
        if !self.has_fragmented {
            return Vec::new();
        }
        (self.queues.values())
            .filter(|q| {
                q.args
                    .fragment
                    .as_ref()
                    .is_some_and(|of| !self.queues.contains_key(&of.queue))
            })
            .map(|q| q.name.clone())
            .collect()
    }

    /// The queues that hold fragmented queue `queue`'s messages: its fragments as
    /// (member, name) in member order, then the queue's own record (member `None`).
    pub fn fragments(&self, queue: &str) -> Vec<(Option<Arc<str>>, Arc<str>)> {
        let Some(q) = self.queues.get(queue).filter(|q| q.args.fragmented) else {
            return Vec::new();
        };
        let mut parts: Vec<(Option<Arc<str>>, Arc<str>)> = self
            .queues
            .values()
            .filter_map(|f| {
                let of = f.args.fragment.as_ref()?;
                (*of.queue == *queue).then(|| (Some(of.member.clone()), f.name.clone()))
            })
            .collect();
        parts.sort();
        parts.push((None, q.name.clone()));
        parts
    }
}

/// A transient message, for the tests of this module.
#[cfg(test)]
fn tests_message() -> Arc<crate::core::Message> {
    Arc::new(crate::core::Message {
        exchange: "".into(),
        routing_key: "orders".into(),
        properties: Default::default(),
        header_payload: Default::default(),
        body: bytes::Bytes::from_static(b"m").into(),
        persistent: false,
        priority: 0,
        expiration_ms: None,
    })
}

#[cfg(test)]
mod tests {
    use crate::amqp::{AMQPValue, FieldTable};
    use crate::core::fragments::{FRAGMENTED_ARGUMENT, fragment_arguments, fragment_name};
    use crate::core::{Effects, QueueDeclare, VHost};

    fn declare(v: &mut VHost, name: &str, arguments: FieldTable) {
        v.queue_declare(
            crate::core::NO_CONNECTION,
            QueueDeclare {
                name: name.into(),
                durable: true,
                arguments,
                ..Default::default()
            },
            0,
        )
        .unwrap();
    }

    fn fragmented() -> FieldTable {
        let mut t = FieldTable::default();
        t.insert(FRAGMENTED_ARGUMENT.into(), AMQPValue::Boolean(true));
        t
    }

    fn ready(v: &VHost, q: &str) -> usize {
        v.queue(q).unwrap().ready_count()
    }

    #[test]
    fn a_publish_goes_to_the_fragment_of_its_origin_or_to_the_queue_while_there_is_none() {
        let mut v = VHost::new("/", 1);
        v.set_node("a");
        v.set_live_nodes(&["a".into(), "b".into()]);
        declare(&mut v, "q", fragmented());
        let mut fx = Effects::default();
        // No fragment yet: the queue's own record takes it.
        v.publish("", "q", super::tests_message(), 0, &mut fx)
            .unwrap();
        assert_eq!(ready(&v, "q"), 1);
        for m in ["a", "b"] {
            let args = fragment_arguments(&fragmented(), "q", m);
            declare(&mut v, &fragment_name(m, "q"), args);
        }
        let (fa, fb) = (fragment_name("a", "q"), fragment_name("b", "q"));
        v.publish("", "q", super::tests_message(), 0, &mut fx)
            .unwrap();
        assert_eq!((ready(&v, &fa), ready(&v, &fb)), (1, 0));
        v.publish_as(Some("b"), "", "q", super::tests_message(), 0, &mut fx)
            .unwrap();
        assert_eq!(
            ready(&v, &fb),
            1,
            "a session that started on b keeps b's fragment"
        );
        assert_eq!(v.read_target("q"), fa);
        assert_eq!(
            v.fragments("q"),
            vec![
                (Some("a".into()), fa.as_str().into()),
                (Some("b".into()), fb.as_str().into()),
                (None, "q".into())
            ]
        );
        assert!(
            !v.queue(&fa).unwrap().args.fragmented,
            "a fragment is a plain queue"
        );
        // A forward whose sender put the message in the record (it had no fragment for the
        // origin yet) goes to the record here too, though this member has that fragment.
        let before = ready(&v, "q");
        v.publish_forwarded_as(
            Some(super::RECORD_ORIGIN),
            "",
            "q",
            super::tests_message(),
            0,
            &mut fx,
        );
        assert_eq!(ready(&v, "q"), before + 1);
        assert_eq!(ready(&v, &fa), 1);
    }

    #[test]
    fn a_pull_neither_blocks_nor_is_blocked_by_an_exclusive_consumer() {
        let mut v = VHost::new("/", 1);
        declare(&mut v, "q", FieldTable::default());
        let mut fx = Effects::default();
        for (channel, tag, exclusive, pull) in [(1, "pull", false, true), (2, "own", true, false)] {
            let key = crate::core::ChannelKey { conn: 1, channel };
            v.channel_open(key);
            let c = crate::core::Consume {
                queue: "q".into(),
                tag: tag.into(),
                exclusive,
                pull,
                ..Default::default()
            };
            v.basic_consume(key, c, 0, &mut fx)
                .unwrap_or_else(|e| panic!("{tag}: {e:?}"));
        }
    }
}

#[cfg(test)]
mod cluster_apply_tests {
    use crate::amqp::{AMQPValue, FieldTable};
    use crate::core::fragments::{FRAGMENTED_ARGUMENT, fragment_arguments, fragment_name};
    use crate::core::{Effects, NO_CONNECTION, VHost, WiringOp};

    #[test]
    fn declared_through_cluster_ops_a_publish_goes_to_the_local_fragment() {
        let mut v = VHost::new("/", 1);
        v.set_node("b");
        v.set_live_nodes(&["a".into(), "b".into(), "c".into()]);
        let mut args = FieldTable::default();
        args.insert(FRAGMENTED_ARGUMENT.into(), AMQPValue::Boolean(true));
        let mut fx = Effects::default();
        let declare = |name: String, arguments: FieldTable, home: &str| WiringOp::DeclareQueue {
            name,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments,
            home: Some(home.into()),
            server_named: false,
        };
        declare("orders".into(), args.clone(), "b")
            .apply(&mut v, NO_CONNECTION, 0, &mut fx)
            .unwrap();
        for m in ["a", "b", "c"] {
            declare(
                fragment_name(m, "orders"),
                fragment_arguments(&args, "orders", m),
                m,
            )
            .apply(&mut v, NO_CONNECTION, 0, &mut fx)
            .unwrap();
        }
        v.publish("", "orders", super::tests_message(), 0, &mut fx)
            .unwrap();
        assert_eq!(
            v.queue(&fragment_name("b", "orders"))
                .unwrap()
                .ready_count(),
            1
        );
        assert_eq!(v.queue("orders").unwrap().ready_count(), 0);
    }
}
