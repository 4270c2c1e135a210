//! Deliveries to a session's consumer that come back with a lost member are held for that
//! session (`core::queue::holds`): a competing consumer of another session does not get
//! them, the session's consumer does, and the hold ends with the session or after
//! [`HOLD_MS`].

use super::*;
use crate::amqp::{AMQPValue, FieldTable};
use crate::core::producers::{PRODUCER_HEADER, PUBLISH_SEQ_HEADER};
use crate::core::queue::HOLD_MS;

/// Opens channel 1 of connection `conn` on `v` and consumes `q` there, with prefetch
/// `prefetch`, for session `session` (whose client does not recognise redeliveries).
fn consume_for(v: &mut VHost, conn: u64, session: &str, prefetch: u16, fx: &mut Effects) {
    consume_as(v, conn, session, false, prefetch, fx);
}

/// [`consume_for`], the client recognising redeliveries if `recognises`.
fn consume_as(
    v: &mut VHost,
    conn: u64,
    session: &str,
    recognises: bool,
    prefetch: u16,
    fx: &mut Effects,
) {
    let key = ChannelKey { conn, channel: 1 };
    v.channel_open(key);
    v.basic_qos(key, 0, prefetch, false, 0, fx);
    v.basic_consume(
        key,
        Consume {
            queue: "q".into(),
            tag: format!("c{conn}"),
            session: Some(session.into()),
            recognises_redeliveries: recognises,
            ..Default::default()
        },
        0,
        fx,
    )
    .unwrap();
}

/// What connection `conn` was delivered in `fx`: body and redelivered flag.
fn bodies_of(fx: &Effects, conn: u64) -> Vec<(String, bool)> {
    fx.deliveries
        .iter()
        .filter(|d| d.channel.conn == conn)
        .map(|d| {
            let body = d.message.body.in_memory().expect("in memory");
            (String::from_utf8(body.to_vec()).unwrap(), d.redelivered)
        })
        .collect()
}

fn expect(list: &[(&str, bool)]) -> Vec<(String, bool)> {
    list.iter().map(|(b, r)| ((*b).to_owned(), *r)).collect()
}

/// Primary `a` hands m1 and m2 of m1..m5 to session `s1`'s consumer, its backup `b` follows,
/// and `a` is lost: `b` is promoted. Returns `b` and the promotion's effects.
fn promoted_after_s1_had_two() -> (VHost, Effects) {
    let mut a = member("a");
    let mut b = member("b");
    let mut fx = Effects::default();
    for body in ["m1", "m2", "m3", "m4", "m5"] {
        publish(&mut a, body, &mut fx);
    }
    consume_for(&mut a, 2, "s1", 2, &mut fx);
    assert_eq!(bodies_of(&fx, 2), expect(&[("m1", false), ("m2", false)]));
    b.apply_replicated("q", &fx.ops, &mut Effects::default())
        .unwrap();
    b.set_queue_home("q", "b");
    let mut pfx = Effects::default();
    assert_eq!(b.promote_replica("q", 1_000, &mut pfx).unwrap(), 2);
    (b, pfx)
}

#[test]
fn what_a_lost_primary_had_given_a_session_waits_for_that_session_on_the_promoted_backup() {
    let (mut b, mut fx) = promoted_after_s1_had_two();
    consume_for(&mut b, 3, "s2", 10, &mut fx);
    assert_eq!(
        bodies_of(&fx, 3),
        expect(&[("m3", false), ("m4", false), ("m5", false)]),
        "a competing session's consumer passes over what is held for s1"
    );
    let got = b
        .basic_get(CH, "q", true, 1_000, &mut Effects::default())
        .unwrap();
    assert!(got.is_none(), "a get skips what is held for a session");

    // s1 resumed elsewhere and consumes here again.
    let mut fx = Effects::default();
    consume_for(&mut b, 4, "s1", 10, &mut fx);
    assert_eq!(bodies_of(&fx, 4), expect(&[("m1", true), ("m2", true)]));
}

#[test]
fn a_hold_ends_with_its_session() {
    let (mut b, mut fx) = promoted_after_s1_had_two();
    consume_for(&mut b, 3, "s2", 10, &mut fx);
    let mut fx = Effects::default();
    b.session_ended("another", 1_000, &mut fx);
    assert!(fx.deliveries.is_empty());
    b.session_ended("s1", 1_000, &mut fx);
    assert_eq!(bodies_of(&fx, 3), expect(&[("m1", true), ("m2", true)]));
}

#[test]
fn a_hold_ends_after_its_time_when_the_session_does_not_come_back_for_it() {
    let (mut b, mut fx) = promoted_after_s1_had_two();
    consume_for(&mut b, 3, "s2", 10, &mut fx);
    let mut fx = Effects::default();
    b.tick(1_000 + HOLD_MS - 1, &mut fx);
    assert!(fx.deliveries.is_empty());
    b.tick(1_000 + HOLD_MS, &mut fx);
    assert_eq!(bodies_of(&fx, 3), expect(&[("m1", true), ("m2", true)]));
}

#[test]
fn what_went_over_a_lost_link_to_a_session_waits_for_it_and_a_closed_channels_does_not() {
    let mut a = member("a");
    let mut fx = Effects::default();
    for body in ["m1", "m2", "m3", "m4"] {
        publish(&mut a, body, &mut fx);
    }
    // Another member's link consumes for session s1 (connection 2), a local client of no
    // session takes m3 (connection 5).
    consume_for(&mut a, 2, "s1", 2, &mut fx);
    let plain = ChannelKey {
        conn: 5,
        channel: 1,
    };
    a.channel_open(plain);
    let got = a.basic_get(plain, "q", false, 0, &mut fx).unwrap().unwrap();
    assert_eq!(got.message.body.in_memory().unwrap(), "m3".as_bytes());

    // The link is lost: m1 and m2 are held for s1. The plain channel closes: m3 is anyone's.
    let mut fx = Effects::default();
    a.link_channel_lost(
        ChannelKey {
            conn: 2,
            channel: 1,
        },
        0,
        &mut fx,
    );
    a.channel_close(plain, 0, &mut fx);
    consume_for(&mut a, 3, "s2", 10, &mut fx);
    assert_eq!(bodies_of(&fx, 3), expect(&[("m3", true), ("m4", false)]));

    // A link's channel closed in order (its client closed it): nothing held.
    let mut fx = Effects::default();
    consume_for(&mut a, 4, "s1", 1, &mut fx);
    assert_eq!(bodies_of(&fx, 4), expect(&[("m1", true)]));
    a.channel_close(
        ChannelKey {
            conn: 4,
            channel: 1,
        },
        0,
        &mut fx,
    );
    assert_eq!(
        bodies_of(&fx, 3),
        expect(&[("m1", true)]),
        "s2 gets m1, put back by an orderly close, and not m2, still held for s1"
    );
}

/// `b` follows what primary `a` did in `fx`, and `a` is lost: `b` is promoted at 1 s.
fn take_over(b: &mut VHost, fx: &Effects) {
    b.apply_replicated("q", &fx.ops, &mut Effects::default())
        .unwrap();
    b.set_queue_home("q", "b");
    b.promote_replica("q", 1_000, &mut Effects::default())
        .unwrap();
}

/// Publishes `body` numbered `seq` by producer `p`, as the failover client does.
fn publish_numbered(v: &mut VHost, body: &'static str, seq: i64, fx: &mut Effects) {
    let mut headers = FieldTable::default();
    headers.insert(PRODUCER_HEADER.into(), AMQPValue::LongString("p:1".into()));
    headers.insert(PUBLISH_SEQ_HEADER.into(), AMQPValue::LongLongInt(seq));
    let m = Arc::new(Message::authored(
        "".into(),
        "q".into(),
        Properties::default()
            .with_delivery_mode(2)
            .with_headers(headers),
        Bytes::from_static(body.as_bytes()),
    ));
    v.publish("", "q", m, 0, fx).unwrap();
}

#[test]
fn a_held_message_goes_back_under_its_lost_deliverys_flag_to_a_client_that_recognises_it() {
    let mut a = member("a");
    let mut b = member("b");
    let mut fx = Effects::default();
    // n1 was delivered before (to s0, which gave it back), n2 not; m3 has no identity.
    publish_numbered(&mut a, "n1", 1, &mut fx);
    consume_for(&mut a, 9, "s0", 1, &mut fx);
    a.channel_close(
        ChannelKey {
            conn: 9,
            channel: 1,
        },
        0,
        &mut fx,
    );
    publish_numbered(&mut a, "n2", 2, &mut fx);
    publish(&mut a, "m3", &mut fx);
    consume_as(&mut a, 2, "s1", true, 3, &mut fx);
    assert_eq!(
        bodies_of(&fx, 2),
        expect(&[("n1", true), ("n2", false), ("m3", false)])
    );
    take_over(&mut b, &fx);

    // s1 resumes: what it never got looks as it would have without the failure, where an
    // identity lets its client hide what its application had; m3 has none.
    let mut fx = Effects::default();
    consume_as(&mut b, 3, "s1", true, 10, &mut fx);
    assert_eq!(
        bodies_of(&fx, 3),
        expect(&[("n1", true), ("n2", false), ("m3", true)])
    );
}

#[test]
fn a_held_message_goes_back_marked_redelivered_to_a_client_that_does_not_recognise_it() {
    let mut a = member("a");
    let mut b = member("b");
    let mut fx = Effects::default();
    publish_numbered(&mut a, "n1", 1, &mut fx);
    consume_for(&mut a, 2, "s1", 1, &mut fx);
    take_over(&mut b, &fx);
    let mut fx = Effects::default();
    consume_for(&mut b, 3, "s1", 10, &mut fx);
    assert_eq!(bodies_of(&fx, 3), expect(&[("n1", true)]));
}

/// Channel 1 of connection `conn`.
fn channel_of(conn: u64) -> ChannelKey {
    ChannelKey { conn, channel: 1 }
}

#[test]
fn a_held_message_that_later_ones_overtook_on_another_consumer_of_its_session_comes_back_marked() {
    // s1 consumes through a member's link (connection 2) and gets n1, n2; that member is cut
    // off, s1 resumes elsewhere (connection 3) and gets n3, n4 before the primary learns of
    // the loss. n1 and n2 come back behind n3 and n4, which the application may have had:
    // they must be marked, whatever their lost delivery's flag.
    let mut a = member("a");
    let mut fx = Effects::default();
    for (seq, body) in ["n1", "n2", "n3", "n4"].into_iter().enumerate() {
        publish_numbered(&mut a, body, seq as i64 + 1, &mut fx);
    }
    consume_as(&mut a, 2, "s1", true, 2, &mut fx);
    consume_as(&mut a, 3, "s1", true, 2, &mut fx);
    assert_eq!(bodies_of(&fx, 2), expect(&[("n1", false), ("n2", false)]));
    assert_eq!(bodies_of(&fx, 3), expect(&[("n3", false), ("n4", false)]));
    let mut fx = Effects::default();
    a.link_channel_lost(channel_of(2), 0, &mut fx);
    a.basic_ack(channel_of(3), 2, true, 0, &mut fx).unwrap();
    assert_eq!(bodies_of(&fx, 3), expect(&[("n1", true), ("n2", true)]));
}

#[test]
fn a_held_message_nothing_overtook_comes_back_unmarked_and_the_log_follows_a_promotion() {
    // s1's consumer on the primary gets n1; s1 moves and its new consumer gets n2 while the
    // first is not known to be lost; the primary dies. On the promoted backup, n1 was
    // overtaken by n2 on another consumer (marked); nothing went to s1 after n2 (unmarked:
    // its client hides it if the application had it).
    let mut a = member("a");
    let mut b = member("b");
    let mut fx = Effects::default();
    publish_numbered(&mut a, "n1", 1, &mut fx);
    consume_as(&mut a, 2, "s1", true, 1, &mut fx);
    publish_numbered(&mut a, "n2", 2, &mut fx);
    consume_as(&mut a, 3, "s1", true, 1, &mut fx);
    assert_eq!(bodies_of(&fx, 3), expect(&[("n2", false)]));
    take_over(&mut b, &fx);
    let mut fx = Effects::default();
    consume_as(&mut b, 4, "s1", true, 10, &mut fx);
    assert_eq!(bodies_of(&fx, 4), expect(&[("n1", true), ("n2", false)]));
}

#[test]
fn a_message_lost_on_the_consumer_a_session_resumed_with_comes_back_unmarked_again() {
    // Lost once and given back unmarked, n1 is lost again on the second consumer: it comes
    // back under the flag it last went out with (the op carries it), not the queue's.
    let mut a = member("a");
    let mut fx = Effects::default();
    publish_numbered(&mut a, "n1", 1, &mut fx);
    consume_as(&mut a, 2, "s1", true, 1, &mut fx);
    a.link_channel_lost(channel_of(2), 0, &mut fx);
    let mut fx = Effects::default();
    consume_as(&mut a, 3, "s1", true, 1, &mut fx);
    assert_eq!(bodies_of(&fx, 3), expect(&[("n1", false)]));
    a.link_channel_lost(channel_of(3), 0, &mut fx);
    let mut fx = Effects::default();
    consume_as(&mut a, 4, "s1", true, 1, &mut fx);
    assert_eq!(bodies_of(&fx, 4), expect(&[("n1", false)]));
}
