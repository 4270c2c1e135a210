//! The vhost core driven without I/O: commands in, effects out.

use super::args::QueueArgs;
use super::queue::Queue;
use super::*;
use crate::amqp::{FieldTable, Properties};
use bytes::Bytes;
use proptest::prelude::*;
use std::sync::Arc;

const CH: ChannelKey = ChannelKey {
    conn: 1,
    channel: 1,
};

fn msg(body: &'static str) -> Arc<Message> {
    Arc::new(Message::authored(
        "".into(),
        "q".into(),
        Properties::default(),
        Bytes::from_static(body.as_bytes()),
    ))
}

fn vhost_with_queue() -> VHost {
    let mut v = VHost::new("/", 7);
    v.set_record_ops(true);
    v.channel_open(CH);
    v.queue_declare(
        1,
        QueueDeclare {
            name: "q".into(),
            durable: true,
            ..Default::default()
        },
        0,
    )
    .unwrap();
    v
}

fn consume(v: &mut VHost, fx: &mut Effects, tag: &str, prefetch: u16) {
    v.basic_qos(CH, 0, prefetch, false, 0, fx);
    v.basic_consume(
        CH,
        Consume {
            queue: "q".into(),
            tag: tag.into(),
            ..Default::default()
        },
        0,
        fx,
    )
    .unwrap();
}

#[test]
fn a_publish_to_a_queue_with_a_ready_consumer_becomes_a_delivery_effect() {
    let mut v = vhost_with_queue();
    let mut fx = Effects::default();
    consume(&mut v, &mut fx, "c", 0);
    assert_eq!(
        v.publish("", "q", msg("hi"), 0, &mut fx).unwrap(),
        PublishOutcome::Routed
    );
    assert_eq!(fx.deliveries.len(), 1);
    let d = &fx.deliveries[0];
    assert_eq!(
        (d.channel, &*d.consumer_tag, d.delivery_tag, d.redelivered),
        (CH, "c", 1, false)
    );
    assert_eq!(v.queue("q").unwrap().unacked_count(), 1);
}

#[test]
fn prefetch_holds_messages_back_until_acks_free_room() {
    let mut v = vhost_with_queue();
    let mut fx = Effects::default();
    consume(&mut v, &mut fx, "c", 2);
    for b in ["1", "2", "3"] {
        v.publish("", "q", msg(b), 0, &mut fx).unwrap();
    }
    assert_eq!(fx.deliveries.len(), 2);
    assert_eq!(v.queue("q").unwrap().ready_count(), 1);
    fx.deliveries.clear();
    v.basic_ack(CH, 1, false, 0, &mut fx).unwrap();
    assert_eq!(fx.deliveries.len(), 1);
    assert_eq!(&fx.deliveries[0].message.body.bytes()[..], b"3");
}

#[test]
fn an_unknown_delivery_tag_is_a_precondition_failure() {
    let mut v = vhost_with_queue();
    let mut fx = Effects::default();
    assert_eq!(v.basic_ack(CH, 5, false, 0, &mut fx).unwrap_err().code, 406);
}

#[test]
fn time_is_an_input_ttl_expires_only_when_told() {
    let mut v = VHost::new("/", 1);
    v.channel_open(CH);
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), crate::amqp::AMQPValue::LongInt(100));
    v.queue_declare(
        1,
        QueueDeclare {
            name: "q".into(),
            arguments: args,
            ..Default::default()
        },
        1_000,
    )
    .unwrap();
    let mut fx = Effects::default();
    v.publish("", "q", msg("m"), 1_000, &mut fx).unwrap();
    v.tick(1_099, &mut fx);
    assert_eq!(v.queue("q").unwrap().ready_count(), 1);
    v.tick(1_100, &mut fx);
    assert_eq!(v.queue("q").unwrap().ready_count(), 0);
}

#[test]
fn messages_expiring_together_are_dead_lettered_in_order_whether_paged_out_or_not() {
    let mut v = VHost::new("/", 1);
    v.channel_open(CH);
    v.set_limits(vhost::Limits {
        queue_memory_budget_bytes: Some(4),
        ..Default::default()
    });
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), crate::amqp::AMQPValue::LongInt(100));
    args.insert(
        "x-dead-letter-exchange".into(),
        crate::amqp::AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        crate::amqp::AMQPValue::LongString("dead".into()),
    );
    for (name, arguments) in [("q", args), ("dead", FieldTable::default())] {
        let declare = QueueDeclare {
            name: name.into(),
            durable: true,
            arguments,
            ..Default::default()
        };
        v.queue_declare(1, declare, 0).unwrap();
    }
    let mut fx = Effects::default();
    for b in ["aa", "bb", "cc"] {
        v.publish("", "q", msg(b), 0, &mut fx).unwrap();
    }
    // "cc" went over the budget and is paged out; taking the first two makes room, so "dd"
    // stays resident behind it.
    for _ in 0..2 {
        v.basic_get(CH, "q", true, 0, &mut fx).unwrap().unwrap();
    }
    v.publish("", "q", msg("dd"), 50, &mut fx).unwrap();
    let resident: Vec<bool> = v
        .queue("q")
        .unwrap()
        .ready()
        .map(|e| e.message.body.in_memory().is_some())
        .collect();
    assert_eq!(resident, [false, true]);
    let mut fx = Effects::default();
    v.tick(150, &mut fx);
    assert_eq!(v.queue("dead").unwrap().ready_count(), 0, "dd overtook cc");
    let mut dead = std::mem::take(&mut fx.paged_dead_letters);
    assert_eq!(dead.len(), 2);
    dead[0].message = Arc::new(dead[0].message.with_body(Bytes::from_static(b"cc")));
    v.dead_letter_resolved(dead, 150, &mut fx);
    let bodies: Vec<Bytes> = v
        .queue("dead")
        .unwrap()
        .ready()
        .map(|e| e.message.body.in_memory().cloned().unwrap_or_default())
        .collect();
    assert_eq!(bodies, [&b"cc"[..], &b"dd"[..]]);
}

fn numbered(body: &'static str, producer: &str, seq: i64) -> Arc<Message> {
    Arc::new(super::producers::numbered(body, producer, seq))
}

#[test]
fn a_queue_drops_a_numbered_publish_it_took_already_even_once_consumed_but_not_its_dead_letter() {
    let mut v = vhost_with_queue();
    let mut dlx = FieldTable::default();
    dlx.insert(
        "x-dead-letter-exchange".into(),
        crate::amqp::AMQPValue::LongString("".into()),
    );
    dlx.insert(
        "x-dead-letter-routing-key".into(),
        crate::amqp::AMQPValue::LongString("q".into()),
    );
    v.queue_declare(
        1,
        QueueDeclare {
            name: "ttl".into(),
            durable: true,
            arguments: dlx,
            ..Default::default()
        },
        0,
    )
    .unwrap();
    let mut fx = Effects::default();
    for seq in 1..=3 {
        v.publish("", "q", numbered("m", "s:1", seq), 0, &mut fx)
            .unwrap();
    }
    assert!(!fx.resent_held);
    v.basic_get(CH, "q", true, 0, &mut fx).unwrap().unwrap();
    for seq in [1, 3] {
        let outcome = v
            .publish("", "q", numbered("m", "s:1", seq), 0, &mut fx)
            .unwrap();
        assert_eq!(outcome, PublishOutcome::Routed, "a resend is confirmed");
    }
    assert!(fx.resent_held, "its confirm waits for the first one's");
    assert_eq!(
        v.queue("q").unwrap().ready_count(),
        2,
        "neither taken again"
    );
    v.publish("", "q", numbered("m", "s:2", 1), 0, &mut fx)
        .unwrap();
    assert_eq!(v.queue("q").unwrap().ready_count(), 3, "another channel");
    // The producer's publish 2 went to "ttl", its 3 to "q"; 2 is rejected and dead-lettered
    // to "q" after 3. The copy is no longer the producer's publish: taken, not dropped.
    let mut fx = Effects::default();
    v.publish("", "ttl", numbered("late", "s:9", 2), 0, &mut fx)
        .unwrap();
    v.publish("", "q", numbered("m", "s:9", 3), 0, &mut fx)
        .unwrap();
    let got = v.basic_get(CH, "ttl", false, 0, &mut fx).unwrap().unwrap();
    v.basic_nack(CH, got.delivery_tag, false, false, 0, &mut fx)
        .unwrap();
    assert_eq!(
        v.queue("q").unwrap().ready_count(),
        5,
        "3 and the dead letter"
    );
    assert!(!fx.resent_held);
}

/// A vhost with "q" rejecting into "dead" through the default exchange, with the given
/// `x-dead-letter-strategy`.
fn vhost_dead_lettering(strategy: &str) -> VHost {
    let mut v = VHost::new("/", 7);
    v.set_record_ops(true);
    v.channel_open(CH);
    let mut args = FieldTable::default();
    for (k, value) in [
        ("x-dead-letter-exchange", ""),
        ("x-dead-letter-routing-key", "dead"),
        ("x-dead-letter-strategy", strategy),
    ] {
        args.insert(k.into(), crate::amqp::AMQPValue::LongString(value.into()));
    }
    for (name, arguments) in [("q", args), ("dead", FieldTable::default())] {
        let d = QueueDeclare {
            name: name.into(),
            durable: true,
            arguments,
            ..Default::default()
        };
        v.queue_declare(1, d, 0).unwrap();
    }
    v
}

#[test]
fn an_at_least_once_rejected_message_stays_until_its_dead_letter_is_settled() {
    let mut v = vhost_dead_lettering("at-least-once");
    let mut fx = Effects::default();
    for body in ["a", "b"] {
        v.publish("", "q", msg(body), 0, &mut fx).unwrap();
    }
    let mut fx = Effects::default();
    for _ in 0..2 {
        let got = v.basic_get(CH, "q", false, 0, &mut fx).unwrap().unwrap();
        v.basic_nack(CH, got.delivery_tag, false, false, 0, &mut fx)
            .unwrap();
    }
    assert_eq!(v.queue("dead").unwrap().ready_count(), 2, "the copies");
    let q = v.queue("q").unwrap();
    assert_eq!(
        (q.ready_count(), q.unacked_count()),
        (0, 2),
        "the originals stay, held for their copies"
    );
    assert!(
        !fx.ops
            .iter()
            .any(|op| op.queue.as_ref() == "q" && matches!(op.kind, OpKind::Settle { .. })),
        "no removal of an original yet"
    );
    let held = std::mem::take(&mut fx.dead_letters_held);
    assert_eq!(held.len(), 2);
    assert_eq!(v.ackable(CH, 0, true), 0, "the channel holds none of them");

    // The first copy's batch was refused somewhere: the original goes back for another try.
    let mut fx = Effects::default();
    v.dead_letters_settled(&held[..1], false, 0, &mut fx);
    let q = v.queue("q").unwrap();
    assert_eq!((q.ready_count(), q.unacked_count()), (1, 1));
    let again = v.basic_get(CH, "q", true, 0, &mut fx).unwrap().unwrap();
    assert!(again.redelivered);
    assert_eq!(&again.message.body.bytes()[..], b"a");

    // The second one's copy is safe: the original is removed.
    let mut fx = Effects::default();
    v.dead_letters_settled(&held[1..], true, 0, &mut fx);
    assert_eq!(v.queue("q").unwrap().unacked_count(), 0);
    assert!(
        fx.ops
            .iter()
            .any(|op| matches!(op.kind, OpKind::Settle { id } if id == held[1].id))
    );
    v.dead_letters_settled(&held[1..], false, 0, &mut fx);
    assert_eq!(
        v.queue("q").unwrap().ready_count(),
        0,
        "settled once: a late second answer changes nothing"
    );
}

#[test]
fn an_at_most_once_rejected_message_leaves_with_its_dead_letter() {
    let mut v = vhost_dead_lettering("at-most-once");
    let mut fx = Effects::default();
    v.publish("", "q", msg("a"), 0, &mut fx).unwrap();
    let got = v.basic_get(CH, "q", false, 0, &mut fx).unwrap().unwrap();
    v.basic_nack(CH, got.delivery_tag, false, false, 0, &mut fx)
        .unwrap();
    assert_eq!(v.queue("q").unwrap().unacked_count(), 0);
    assert_eq!(v.queue("dead").unwrap().ready_count(), 1);
    assert!(fx.dead_letters_held.is_empty());
}

#[derive(Debug, Clone)]
enum Cmd {
    Publish,
    Consume(u16),
    Cancel,
    Ack(u8, bool),
    Nack(u8, bool, bool),
    Get(bool),
    Recover,
    Purge,
    Written,
}

fn cmd() -> impl Strategy<Value = Cmd> {
    prop_oneof![
        5 => Just(Cmd::Publish),
        1 => (0u16..4).prop_map(Cmd::Consume),
        1 => Just(Cmd::Cancel),
        3 => (any::<u8>(), any::<bool>()).prop_map(|(t, m)| Cmd::Ack(t, m)),
        2 => (any::<u8>(), any::<bool>(), any::<bool>()).prop_map(|(t, m, r)| Cmd::Nack(t, m, r)),
        1 => any::<bool>().prop_map(Cmd::Get),
        1 => Just(Cmd::Recover),
        1 => Just(Cmd::Purge),
        2 => Just(Cmd::Written),
    ]
}

proptest! {
    /// Whatever clients do, no message is lost or duplicated: every published message is
    /// ready, unacked, or was settled exactly once; and a replica fed the recorded op stream
    /// holds the same content as the queue itself.
    #[test]
    fn messages_are_conserved_and_the_op_stream_rebuilds_the_queue(cmds in prop::collection::vec(cmd(), 1..120)) {
        let mut v = vhost_with_queue();
        let mut fx = Effects::default();
        let mut published = 0u64;
        let mut purged = 0u64;
        let mut outstanding: Vec<u64> = Vec::new();
        let mut settled = 0u64;
        let mut consumer: Option<String> = None;
        let mut next = 0u32;
        let mut gone_with_no_ack = 0u64;
        let mut unwritten = 0u32;
        for c in cmds {
            match c {
                Cmd::Publish => {
                    v.publish("", "q", msg("m"), 0, &mut fx).unwrap();
                    published += 1;
                }
                Cmd::Consume(p) => if consumer.is_none() {
                    next += 1;
                    let tag = format!("c{next}");
                    consume(&mut v, &mut fx, &tag, p);
                    consumer = Some(tag);
                },
                Cmd::Cancel => if let Some(tag) = consumer.take() {
                    v.basic_cancel(CH, &tag, 0, &mut fx);
                },
                Cmd::Ack(i, multiple) => if !outstanding.is_empty() {
                    let tag = outstanding[usize::from(i) % outstanding.len()];
                    v.basic_ack(CH, tag, multiple, 0, &mut fx).unwrap();
                    let before = outstanding.len();
                    outstanding.retain(|t| if multiple { *t > tag } else { *t != tag });
                    settled += (before - outstanding.len()) as u64;
                },
                Cmd::Nack(i, multiple, requeue) => if !outstanding.is_empty() {
                    let tag = outstanding[usize::from(i) % outstanding.len()];
                    v.basic_nack(CH, tag, multiple, requeue, 0, &mut fx).unwrap();
                    let before = outstanding.len();
                    outstanding.retain(|t| if multiple { *t > tag } else { *t != tag });
                    if !requeue {
                        settled += (before - outstanding.len()) as u64;
                    }
                },
                Cmd::Get(no_ack) => if let Some(got) = v.basic_get(CH, "q", no_ack, 0, &mut fx).unwrap() {
                    if no_ack { gone_with_no_ack += 1 } else { outstanding.push(got.delivery_tag) }
                },
                Cmd::Recover => {
                    v.basic_recover(CH, 0, &mut fx);
                    outstanding.clear();
                }
                Cmd::Purge => purged += u64::from(v.queue_purge(1, "q", &mut fx).unwrap()),
                Cmd::Written => v.delivered_written(CH, std::mem::take(&mut unwritten), u64::MAX, 0, &mut fx),
            }
            for d in fx.deliveries.drain(..) {
                outstanding.push(d.delivery_tag);
                unwritten += 1;
            }
            outstanding.sort_unstable();
            let q = v.queue("q").unwrap();
            prop_assert_eq!(q.unacked_count(), outstanding.len());
            prop_assert_eq!(
                published,
                q.ready_count() as u64 + q.unacked_count() as u64 + settled + purged + gone_with_no_ack
            );
        }
        let q = v.queue("q").unwrap();
        let mut replica = Queue::new("q".into(), false, None, false, FieldTable::default(), QueueArgs::default(), 0);
        for op in &fx.ops {
            replica.apply(op);
        }
        let ready = |q: &Queue| q.ready().map(|e| (e.id, e.redelivered)).collect::<Vec<_>>();
        prop_assert_eq!(ready(q), ready(&replica));
        let mut a: Vec<u64> = q.unacked_ids().collect();
        let mut b: Vec<u64> = replica.unacked_ids().collect();
        a.sort_unstable();
        b.sort_unstable();
        prop_assert_eq!(a, b);
    }
}

#[test]
fn a_queue_over_its_memory_budget_pages_new_bodies_out_and_releases_their_pages() {
    let mut v = vhost_with_queue();
    v.set_limits(vhost::Limits {
        queue_memory_budget_bytes: Some(4),
        ..Default::default()
    });
    let mut fx = Effects::default();
    // Transient messages on a durable queue: each one over the budget needs a page record.
    for b in ["aa", "bb", "cc", "dd"] {
        v.publish("", "q", msg(b), 0, &mut fx).unwrap();
    }
    let q = v.queue("q").unwrap();
    assert_eq!(q.resident_bytes(), 4);
    let paged: Vec<u64> = fx.page_out.iter().map(|p| p.id).collect();
    assert_eq!(paged, vec![3, 4]);
    assert_eq!(&fx.page_out[0].message.body.bytes()[..], b"cc");
    let on_disk: Vec<Option<DiskBody>> = q.ready().map(|e| e.message.body.on_disk()).collect();
    assert_eq!(on_disk[..2], [None, None]);
    assert_eq!(
        on_disk[2],
        Some(DiskBody {
            uid: q.uid,
            id: 3,
            len: 2
        })
    );
    // A persistent message pages out to its Enqueued record: no page record of its own.
    let persistent = Arc::new(Message::authored(
        "".into(),
        "q".into(),
        Properties::default().with_delivery_mode(2),
        Bytes::from_static(b"ee"),
    ));
    fx.page_out.clear();
    v.publish("", "q", persistent, 0, &mut fx).unwrap();
    assert!(fx.page_out.is_empty());
    assert!(
        v.queue("q")
            .unwrap()
            .ready()
            .last()
            .unwrap()
            .message
            .body
            .on_disk()
            .is_some()
    );
    assert_eq!(v.queue("q").unwrap().owned_pages(), 2);
    // Delivering hands the on-disk body to the server to read; the ack releases the page.
    consume(&mut v, &mut fx, "c", 0);
    let ids: Vec<bool> = fx
        .deliveries
        .iter()
        .map(|d| d.message.body.on_disk().is_some())
        .collect();
    assert_eq!(ids, vec![false, false, true, true, true]);
    assert!(fx.page_released.is_empty());
    v.basic_ack(CH, 5, true, 0, &mut fx).unwrap();
    let uid = v.queue("q").unwrap().uid;
    fx.page_released.sort_unstable();
    assert_eq!(fx.page_released, vec![(uid, 3), (uid, 4)]);
    let q = v.queue("q").unwrap();
    assert_eq!((q.resident_bytes(), q.owned_pages()), (0, 0));
}

#[test]
fn deleting_a_queue_holding_page_records_releases_them_all() {
    let mut v = vhost_with_queue();
    v.set_limits(vhost::Limits {
        queue_memory_budget_bytes: Some(1),
        ..Default::default()
    });
    let mut fx = Effects::default();
    for b in ["aa", "bb"] {
        v.publish("", "q", msg(b), 0, &mut fx).unwrap();
    }
    let uid = v.queue("q").unwrap().uid;
    v.queue_delete(1, "q", false, false, &mut fx).unwrap();
    assert_eq!(fx.queues_released, vec![uid]);
}

fn proxy_arguments(uri: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        PROXY_ARGUMENT.into(),
        crate::amqp::AMQPValue::LongString(uri.into()),
    );
    args
}

/// A vhost with queue `q` bound to `fx`, a foreign direct exchange on `amqp://r/%2f`.
fn vhost_with_foreign_exchange() -> VHost {
    let mut v = vhost_with_queue();
    v.exchange_declare(ExchangeDeclare {
        name: "fx".into(),
        kind: "direct".into(),
        arguments: proxy_arguments("amqp://u:p@r/%2f"),
        ..Default::default()
    })
    .unwrap();
    v.queue_bind(1, "q", "fx", "k", FieldTable::default())
        .unwrap();
    v
}

#[test]
fn a_publish_to_a_foreign_exchange_is_forwarded_and_never_routed_here() {
    let mut v = vhost_with_foreign_exchange();
    let mut fx = Effects::default();
    assert_eq!(
        v.publish("fx", "k", msg("hi"), 0, &mut fx).unwrap(),
        PublishOutcome::Routed
    );
    assert_eq!(fx.forwards.len(), 1);
    let f = &fx.forwards[0];
    assert_eq!(
        (&*f.primary, &*f.exchange, &*f.routing_key),
        ("amqp://u:p@r/%2f", "fx", "k")
    );
    assert_eq!(
        v.queue("q").unwrap().ready_count(),
        0,
        "the local binding is fed by the other broker, not by this routing"
    );
}

#[test]
fn a_queue_bound_to_a_foreign_exchange_is_a_feed_and_takes_what_the_feed_brings() {
    let mut v = vhost_with_foreign_exchange();
    let feeds = v.feeds();
    assert_eq!(feeds.here.len(), 1);
    assert_eq!(
        (
            &*feeds.here[0].queue,
            &*feeds.here[0].exchange,
            &*feeds.here[0].home
        ),
        ("q", "fx", "amqp://u:p@r/%2f")
    );
    let mut fx = Effects::default();
    assert_eq!(
        v.publish_feed("q", msg("fed"), 0, &mut fx),
        PublishOutcome::Routed
    );
    assert_eq!(v.queue("q").unwrap().ready_count(), 1);
    assert_eq!(
        v.publish_feed("gone", msg("fed"), 0, &mut fx),
        PublishOutcome::Unroutable
    );
    v.queue_unbind(1, "q", "fx", "k", FieldTable::default())
        .unwrap();
    assert_eq!(v.feeds(), Feeds::default());
}

#[test]
fn foreign_exchanges_refuse_exchange_bindings_and_foreign_queues() {
    let mut v = vhost_with_foreign_exchange();
    let e = v
        .exchange_bind("fx", "amq.direct", "k", FieldTable::default())
        .unwrap_err();
    assert_eq!(e.code, crate::amqp::codes::NOT_IMPLEMENTED);
    v.queue_declare(
        1,
        QueueDeclare {
            name: "fq".into(),
            ..Default::default()
        },
        0,
    )
    .unwrap();
    v.set_queue_home("fq", "amqp://u:p@r/%2f");
    let e = v
        .queue_bind(1, "fq", "fx", "k", FieldTable::default())
        .unwrap_err();
    assert_eq!(e.code, crate::amqp::codes::NOT_IMPLEMENTED);
}

#[test]
fn a_detached_channel_keeps_its_unacked_deliveries_for_the_sessions_next_connection() {
    let mut v = vhost_with_queue();
    let mut fx = Effects::default();
    for body in ["a", "b", "c"] {
        v.publish("", "q", msg(body), 0, &mut fx).unwrap();
    }
    consume(&mut v, &mut fx, "c1", 0);
    assert_eq!(fx.deliveries.len(), 3);
    v.channel_detach(CH, 0, &mut fx);
    let q = v.queue("q").unwrap();
    assert_eq!(
        (q.ready_count(), q.unacked_count()),
        (0, 3),
        "kept, not requeued"
    );
    assert!(
        q.consumers.is_empty(),
        "the consumer went with the connection"
    );
    v.channel_open(CH);
    assert_eq!(v.channel_summaries(CH.conn), vec![(1, 4, vec![1, 2, 3])]);
    v.basic_ack(CH, 2, false, 0, &mut fx).unwrap();
    v.close_channels_of(CH.conn, 0, &mut fx);
    let q = v.queue("q").unwrap();
    assert_eq!(
        (q.ready_count(), q.unacked_count()),
        (2, 0),
        "the session's end requeues what was never acked"
    );
}

#[test]
fn a_consumer_created_again_after_a_resume_takes_its_predecessors_unacked_and_gets_them_resent() {
    let mut v = vhost_with_queue();
    let mut fx = Effects::default();
    for body in ["a", "b", "c"] {
        v.publish("", "q", msg(body), 0, &mut fx).unwrap();
    }
    consume(&mut v, &mut fx, "c1", 2);
    assert_eq!(fx.deliveries.len(), 2, "prefetch 2");
    v.channel_detach(CH, 0, &mut fx);
    v.channel_open(CH);
    fx.deliveries.clear();
    consume(&mut v, &mut fx, "c1", 2);
    assert!(
        fx.deliveries.is_empty(),
        "tags 1 and 2 are still the consumer's: its prefetch is full"
    );
    v.basic_resend(CH, true, &mut fx);
    let sent = |fx: &Effects| -> Vec<(u64, bool, String)> {
        fx.deliveries
            .iter()
            .map(|d| {
                (
                    d.delivery_tag,
                    d.redelivered,
                    String::from_utf8(d.message.body.bytes().to_vec()).unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(
        sent(&fx),
        [(1, false, "a".into()), (2, false, "b".into())],
        "the same deliveries under their tags, as they first went"
    );
    fx.deliveries.clear();
    v.basic_ack(CH, 1, false, 0, &mut fx).unwrap();
    assert_eq!(fx.deliveries.len(), 1, "the ack opens the window: c");
    assert_eq!(fx.deliveries[0].delivery_tag, 3);
    v.basic_ack(CH, 3, true, 0, &mut fx).unwrap();
    assert_eq!(v.queue("q").unwrap().unacked_count(), 0);
    fx.deliveries.clear();
    v.basic_resend(CH, false, &mut fx);
    assert!(fx.deliveries.is_empty(), "nothing left to send again");
}

#[test]
fn a_resumed_sessions_consumer_gets_its_unacked_again_before_anything_new() {
    let mut v = vhost_with_queue();
    let mut fx = Effects::default();
    for body in ["a", "b", "c", "d"] {
        v.publish("", "q", msg(body), 0, &mut fx).unwrap();
    }
    consume(&mut v, &mut fx, "c1", 2);
    v.channel_detach(CH, 0, &mut fx);
    v.channel_open(CH);
    fx.deliveries.clear();
    v.basic_qos(CH, 0, 4, false, 0, &mut fx);
    v.basic_consume(
        CH,
        Consume {
            queue: "q".into(),
            tag: "c1".into(),
            resend_unacked: true,
            ..Default::default()
        },
        0,
        &mut fx,
    )
    .unwrap();
    let tags: Vec<u64> = fx.deliveries.iter().map(|d| d.delivery_tag).collect();
    assert_eq!(
        tags,
        [1, 2, 3, 4],
        "the lost connection's deliveries first, under their tags, then c and d"
    );
}

/// Consumer priorities (`x-priority`): the highest-priority consumers with room get the
/// messages, round-robin among them; a lower one only while every higher one is full.
#[test]
fn higher_priority_consumers_get_the_messages_while_they_have_room() {
    let mut v = vhost_with_queue();
    let mut fx = Effects::default();
    let low = ChannelKey {
        conn: 1,
        channel: 2,
    };
    v.channel_open(low);
    for (key, tag, priority) in [(CH, "high-a", 5), (CH, "high-b", 5), (low, "low", 0)] {
        v.basic_qos(key, 0, 2, false, 0, &mut fx);
        let c = Consume {
            queue: "q".into(),
            tag: tag.into(),
            priority,
            ..Default::default()
        };
        v.basic_consume(key, c, 0, &mut fx).unwrap();
    }
    for b in ["1", "2", "3", "4", "5", "6"] {
        v.publish("", "q", msg(b), 0, &mut fx).unwrap();
    }
    let to: Vec<&str> = fx.deliveries.iter().map(|d| &*d.consumer_tag).collect();
    assert_eq!(
        to,
        ["high-a", "high-b", "high-a", "high-b", "low", "low"],
        "round-robin over the two of priority 5 until both are full, then the low one"
    );
    fx.deliveries.clear();
    // An ack makes room on the high-priority channel: the next message goes there.
    v.basic_ack(CH, 1, false, 0, &mut fx).unwrap();
    v.publish("", "q", msg("7"), 0, &mut fx).unwrap();
    assert_eq!(fx.deliveries.len(), 1);
    assert_eq!(&*fx.deliveries[0].consumer_tag, "high-a");
}

/// A fragmented queue's pulls (`Consume::pull`): a message a pull brought in
/// (`VHost::publish_pulled`) waits for the member's own consumers and is never handed to
/// another pull while there are any — no message moves twice and lands behind later ones
/// of its producer — and a pull is no consumer in the counts.
#[test]
fn a_pulled_in_message_waits_for_the_members_own_consumers() {
    let mut v = vhost_with_queue();
    let mut fx = Effects::default();
    let pulls = ChannelKey {
        conn: 1,
        channel: 2,
    };
    v.channel_open(pulls);
    v.basic_qos(pulls, 0, 10, false, 0, &mut fx);
    let pull = Consume {
        queue: "q".into(),
        tag: "pull".into(),
        priority: crate::core::fragments::PULL_PRIORITY,
        pull: true,
        ..Default::default()
    };
    v.basic_consume(pulls, pull, 0, &mut fx).unwrap();
    consume(&mut v, &mut fx, "own", 1);
    assert_eq!(
        v.queue("q").unwrap().consumer_count(),
        1,
        "a pull is no consumer"
    );
    v.publish("", "q", msg("first"), 0, &mut fx).unwrap();
    v.publish_pulled("q", msg("pulled"), true, 0, &mut fx);
    v.publish("", "q", msg("own"), 0, &mut fx).unwrap();
    let to: Vec<&str> = fx.deliveries.iter().map(|d| &*d.consumer_tag).collect();
    assert_eq!(
        to,
        ["own"],
        "the pulled-in message waits for the full consumer"
    );
    fx.deliveries.clear();
    v.basic_ack(CH, 1, false, 0, &mut fx).unwrap();
    let to: Vec<(&str, &[u8])> = (fx.deliveries.iter())
        .map(|d| (&*d.consumer_tag, &d.message.body.in_memory().unwrap()[..]))
        .collect();
    assert_eq!(to, [("own", &b"pulled"[..]), ("pull", &b"own"[..])]);
    assert!(
        fx.deliveries[0].redelivered,
        "the source had delivered it before: redelivered here too"
    );
    fx.deliveries.clear();
    // With no consumer of the member's own left, a pull takes anything: nothing is stuck.
    v.basic_cancel(CH, "own", 0, &mut fx);
    v.publish_pulled("q", msg("pulled again"), false, 0, &mut fx);
    let to: Vec<&str> = fx.deliveries.iter().map(|d| &*d.consumer_tag).collect();
    assert_eq!(to, ["pull"]);
}
