//! `basic.publish` and `basic.ack` decoded by hand. They arrive once per message (a publish
//! from every producer, an ack per consumer batch), and amq-protocol's generated decoder
//! builds a `String` per flag name and collects each short string byte by byte: about a
//! tenth of the broker's CPU in a 16 B publish-to-consume run (`docs/performance.md`, "The
//! hot path"). Every other method, and any payload these two functions do not accept, goes
//! to amq-protocol, which also words the error for a malformed one.

use super::{AMQPClass, ShortString, basic};

/// The method in a method frame's `payload` when it is a well-formed `basic.publish` or
/// `basic.ack` — the value amq-protocol would decode, with no byte left over — else `None`.
pub fn parse(payload: &[u8]) -> Option<AMQPClass> {
    let (ids, args) = payload.split_first_chunk::<4>()?;
    match ids {
        [0, 60, 0, 40] => publish(args),
        [0, 60, 0, 80] => ack(args),
        _ => None,
    }
}

fn publish(args: &[u8]) -> Option<AMQPClass> {
    // reserved-1 (the old access ticket), then the two names and the bits.
    let (_ticket, rest) = args.split_first_chunk::<2>()?;
    let (exchange, rest) = short_string(rest)?;
    let (routing_key, rest) = short_string(rest)?;
    let [bits] = rest else { return None };
    Some(AMQPClass::Basic(basic::AMQPMethod::Publish(
        basic::Publish {
            exchange,
            routing_key,
            mandatory: bits & 1 != 0,
            immediate: bits & 2 != 0,
        },
    )))
}

fn ack(args: &[u8]) -> Option<AMQPClass> {
    let (tag, rest) = args.split_first_chunk::<8>()?;
    let [bits] = rest else { return None };
    Some(AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
        delivery_tag: u64::from_be_bytes(*tag),
        multiple: bits & 1 != 0,
    })))
}

/// A short string (a length octet, then that many bytes of UTF-8) and what follows it.
fn short_string(input: &[u8]) -> Option<(ShortString, &[u8])> {
    let (&len, rest) = input.split_first()?;
    let (text, rest) = rest.split_at_checked(usize::from(len))?;
    Some((ShortString::from(std::str::from_utf8(text).ok()?), rest))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::writer::FrameWriter;

    /// The method payload amq-protocol encodes for `method`.
    fn encoded(method: AMQPClass) -> Vec<u8> {
        let mut w = FrameWriter::default();
        w.method(1, method);
        let frame = w.as_slice();
        frame[7..frame.len() - 1].to_vec()
    }

    #[test]
    fn publishes_and_acks_decode_as_amq_protocol_decodes_them() {
        let methods = [
            basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: "a-queue".into(),
                mandatory: false,
                immediate: false,
            }),
            basic::AMQPMethod::Publish(basic::Publish {
                exchange: "amq.tøpic".into(),
                routing_key: "k".repeat(255).as_str().into(),
                mandatory: true,
                immediate: true,
            }),
            basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: u64::MAX,
                multiple: true,
            }),
            basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 7,
                multiple: false,
            }),
        ];
        for m in methods {
            let payload = encoded(AMQPClass::Basic(m.clone()));
            assert_eq!(parse(&payload), Some(AMQPClass::Basic(m)));
        }
    }

    #[test]
    fn anything_else_is_left_to_amq_protocol() {
        let other = encoded(AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: 1,
            multiple: false,
            requeue: true,
        })));
        assert_eq!(parse(&other), None);
        let publish = encoded(AMQPClass::Basic(basic::AMQPMethod::Publish(
            basic::Publish {
                exchange: "".into(),
                routing_key: "q".into(),
                mandatory: false,
                immediate: false,
            },
        )));
        // Short by a byte, a byte too long, and a name that is not UTF-8.
        assert_eq!(parse(&publish[..publish.len() - 1]), None);
        assert_eq!(parse(&[&publish[..], &[0]].concat()), None);
        let mut not_utf8 = publish.clone();
        let at = not_utf8.len() - 2;
        not_utf8[at] = 0xff;
        assert_eq!(parse(&not_utf8), None);
    }
}
