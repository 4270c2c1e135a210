//! Property-based fuzzing of everything that reads bytes from a peer: the frame splitter, the
//! method decoder and the content-header decoder must answer any input with a value or an
//! error — never a panic, never an allocation beyond the frame size they were allowed.
//! (cargo-fuzz needs a nightly toolchain, which these machines do not have; proptest runs the
//! same idea on stable, in CI, for a bounded number of cases.)

use super::frame::{FRAME_END, FRAME_METHOD, split_frame};
use super::{AMQPClass, basic};
use bytes::BytesMut;
use proptest::prelude::*;

/// Byte strings that look like frames often enough to get past the first checks.
fn framed_noise() -> impl Strategy<Value = Vec<u8>> {
    (
        0u8..10,
        any::<u16>(),
        prop::collection::vec(any::<u8>(), 0..300),
        any::<bool>(),
    )
        .prop_map(|(kind, channel, payload, good_end)| {
            let mut v = vec![kind];
            v.extend_from_slice(&channel.to_be_bytes());
            v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            v.extend_from_slice(&payload);
            v.push(if good_end { FRAME_END } else { 0 });
            v
        })
}

/// Method payloads with a real class and method id and random arguments.
fn method_noise() -> impl Strategy<Value = Vec<u8>> {
    let ids = prop_oneof![
        Just((10u16, 11u16)),
        Just((10, 31)),
        Just((10, 40)),
        Just((20, 10)),
        Just((40, 10)),
        Just((50, 10)),
        Just((50, 20)),
        Just((60, 10)),
        Just((60, 20)),
        Just((60, 40)),
        Just((60, 80)),
        Just((85, 10)),
        Just((90, 10)),
    ];
    (ids, prop::collection::vec(any::<u8>(), 0..200)).prop_map(|((c, m), args)| {
        let mut v = c.to_be_bytes().to_vec();
        v.extend_from_slice(&m.to_be_bytes());
        v.extend(args);
        v
    })
}

/// `basic.publish` and `basic.ack` payloads that are well-formed, or nearly: names of any
/// bytes (UTF-8 or not), any flag octet, a length octet that may lie, a byte more or fewer.
fn publish_or_ack_noise() -> impl Strategy<Value = Vec<u8>> {
    let name = (
        prop::collection::vec(any::<u8>(), 0..12),
        any::<bool>(),
        any::<u8>(),
    );
    let publish = (any::<u16>(), name.clone(), name, any::<u8>()).prop_map(
        |(ticket, exchange, routing_key, bits)| {
            let mut v = vec![0, 60, 0, 40];
            v.extend_from_slice(&ticket.to_be_bytes());
            for (bytes, honest, lie) in [exchange, routing_key] {
                v.push(if honest { bytes.len() as u8 } else { lie });
                v.extend(bytes);
            }
            v.push(bits);
            v
        },
    );
    let ack = (any::<u64>(), any::<u8>()).prop_map(|(tag, bits)| {
        let mut v = vec![0, 60, 0, 80];
        v.extend_from_slice(&tag.to_be_bytes());
        v.push(bits);
        v
    });
    (prop_oneof![publish, ack], 0usize..4).prop_map(|(mut v, change)| {
        match change {
            1 => v.push(0),
            2 => {
                v.pop();
            }
            _ => {}
        }
        v
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn the_frame_splitter_never_panics_and_respects_frame_max(chunks in prop::collection::vec(prop_oneof![framed_noise(), prop::collection::vec(any::<u8>(), 0..64)], 0..20)) {
        let mut buf = BytesMut::new();
        for c in chunks {
            buf.extend_from_slice(&c);
            loop {
                match split_frame(&mut buf, 4096) {
                    Ok(Some(f)) => prop_assert!(f.payload.len() + 8 <= 4096),
                    Ok(None) => break,
                    Err(_) => { buf.clear(); break }
                }
            }
        }
    }

    #[test]
    fn the_method_decoder_never_panics(payload in method_noise()) {
        let _ = amq_protocol::protocol::parse_class(&payload[..]);
        let mut framed = vec![FRAME_METHOD, 0, 1];
        framed.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        framed.extend_from_slice(&payload);
        framed.push(FRAME_END);
        let mut buf = BytesMut::from(&framed[..]);
        let f = split_frame(&mut buf, 131_072).unwrap().unwrap();
        prop_assert_eq!(&f.payload[..], &payload[..]);
    }

    #[test]
    fn the_hand_decoder_agrees_with_amq_protocol(payload in prop_oneof![method_noise(), publish_or_ack_noise()]) {
        // Whatever it decodes, amq-protocol decodes to the same method with nothing left
        // over; a publish or an ack amq-protocol takes whole, it takes too.
        let ours = super::hot_methods::parse(&payload);
        let theirs = match amq_protocol::protocol::parse_class(&payload[..]) {
            Ok(([], m)) => Some(m),
            _ => None,
        };
        match (&ours, &theirs) {
            (Some(_), _) => prop_assert_eq!(&ours, &theirs),
            (None, Some(AMQPClass::Basic(basic::AMQPMethod::Publish(_) | basic::AMQPMethod::Ack(_)))) => {
                prop_assert!(false, "amq-protocol decoded {:?}, the hand decoder nothing", theirs)
            }
            (None, _) => {}
        }
    }

    #[test]
    fn the_content_header_decoder_never_panics(payload in prop::collection::vec(any::<u8>(), 0..120)) {
        let mut p = vec![0, 60, 0, 0];
        p.extend(payload);
        let _ = amq_protocol::frame::parsing::parse_content_header(&p[..]);
    }
}
