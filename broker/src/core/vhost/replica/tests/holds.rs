//! Deliveries to a session's consumer that come back with a lost member are held for that
//! session (`core::queue::holds`): a competing consumer of another session does not get
//! them, the session's consumer does, and the hold ends with the session or after
//! [`HOLD_MS`].

use super::*;
use crate::core::queue::HOLD_MS;

/// Opens channel 1 of connection `conn` on `v` and consumes `q` there, with prefetch
/// `prefetch`, for session `session`.
fn consume_for(v: &mut VHost, conn: u64, session: &str, prefetch: u16, fx: &mut Effects) {
    let key = ChannelKey { conn, channel: 1 };
    v.channel_open(key);
    v.basic_qos(key, 0, prefetch, false, 0, fx);
    v.basic_consume(
        key,
        Consume {
            queue: "q".into(),
            tag: format!("c{conn}"),
            session: Some(session.into()),
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
