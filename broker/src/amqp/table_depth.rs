//! A guard in front of the field-table decoder: `amq-protocol` decodes nested tables and
//! arrays recursively, so a table nested ten thousand levels deep — a few dozen kilobytes —
//! would overflow the decoding thread's stack and take the broker down. This walks the
//! tables a client can send (method arguments, client properties, message headers)
//! iteratively and refuses nesting beyond a limit before anything recursive sees them.

/// Where the first field table sits in a method payload from a client, for the methods that
/// carry one: `(class, method) → fields before it`. Each entry lists the fields to skip:
/// `S` a short string, `2` two bytes, `1` one byte (a bit field).
fn table_offset(class_id: u16, method_id: u16, payload: &[u8]) -> Option<usize> {
    let layout: &[u8] = match (class_id, method_id) {
        (10, 11) => b"",                 // connection.start-ok: client-properties first
        (40, 10) => b"2SS1",             // exchange.declare
        (40, 30) | (40, 40) => b"2SSS1", // exchange.bind / unbind
        (50, 10) => b"2S1",              // queue.declare
        (50, 20) => b"2SSS1",            // queue.bind
        (50, 50) => b"2SSS",             // queue.unbind
        (60, 20) => b"2SS1",             // basic.consume
        _ => return None,
    };
    let mut at = 4;
    for f in layout {
        at += match f {
            b'S' => 1 + usize::from(*payload.get(at)?),
            b'2' => 2,
            _ => 1,
        };
    }
    Some(at)
}

/// Whether a method payload's field table (if it has one) nests no deeper than `max_depth`.
/// Malformed tables pass: the decoder refuses them with its own error.
pub fn method_within_depth(payload: &[u8], max_depth: usize) -> bool {
    let Some((class_id, method_id)) = super::frame::method_ids(payload) else {
        return true;
    };
    match table_offset(class_id, method_id, payload) {
        Some(at) if at < payload.len() => value_within_depth(payload, at, b'F', max_depth),
        _ => true,
    }
}

/// Whether a content header's `headers` property nests no deeper than `max_depth`.
pub fn header_within_depth(payload: &[u8], max_depth: usize) -> bool {
    // class (2), weight (2), body size (8), then property flags (one 16-bit word here: a
    // continuation bit would be malformed for basic and the decoder refuses it).
    let Some(flags) = payload
        .get(12..14)
        .map(|b| u16::from_be_bytes([b[0], b[1]]))
    else {
        return true;
    };
    if flags & (1 << 13) == 0 {
        return true;
    }
    let mut at = 14;
    for bit in [15, 14] {
        if flags & (1 << bit) != 0 {
            let Some(len) = payload.get(at) else {
                return true;
            };
            at += 1 + usize::from(*len);
        }
    }
    value_within_depth(payload, at, b'F', max_depth)
}

/// Walks the value of type `kind` at `at` with an explicit stack; false when tables and
/// arrays nest deeper than `max_depth`.
fn value_within_depth(buf: &[u8], at: usize, kind: u8, max_depth: usize) -> bool {
    // Each open container: (its kind, where its contents end, where we are in it).
    let mut stack: Vec<(u8, usize, usize)> = Vec::new();
    let Some(end) = container_end(buf, at) else {
        return true;
    };
    stack.push((kind, end, at + 4));
    while let Some(&(kind, end, pos)) = stack.last() {
        if stack.len() > max_depth {
            return false;
        }
        if pos >= end {
            stack.pop();
            continue;
        }
        let mut p = pos;
        if kind == b'F' {
            let Some(key_len) = buf.get(p) else {
                return true;
            };
            p += 1 + usize::from(*key_len);
        }
        let Some(&t) = buf.get(p) else { return true };
        p += 1;
        let size = match t {
            b't' | b'b' | b'B' => 1,
            b's' | b'u' => 2,
            b'I' | b'i' | b'f' => 4,
            b'l' | b'L' | b'd' | b'T' => 8,
            b'D' => 5,
            b'V' => 0,
            b'S' | b'x' => match buf.get(p..p + 4) {
                Some(l) => 4 + u32::from_be_bytes([l[0], l[1], l[2], l[3]]) as usize,
                None => return true,
            },
            b'F' | b'A' => {
                let Some(inner_end) = container_end(buf, p) else {
                    return true;
                };
                stack.last_mut().expect("non-empty").2 = inner_end;
                stack.push((t, inner_end, p + 4));
                continue;
            }
            // Unknown type: the decoder will refuse the frame.
            _ => return true,
        };
        stack.last_mut().expect("non-empty").2 = p + size;
    }
    true
}

/// End offset of a table or array (u32 length prefix) starting at `at`.
fn container_end(buf: &[u8], at: usize) -> Option<usize> {
    let l = buf.get(at..at + 4)?;
    Some(at + 4 + u32::from_be_bytes([l[0], l[1], l[2], l[3]]) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::writer::FrameWriter;
    use crate::amqp::{AMQPClass, AMQPValue, FieldArray, FieldTable, Properties, queue};

    fn nested(depth: usize) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert("leaf".into(), AMQPValue::LongString("x".into()));
        for i in 0..depth.saturating_sub(1) {
            let mut outer = FieldTable::default();
            if i % 2 == 0 {
                outer.insert("t".into(), AMQPValue::FieldTable(t));
            } else {
                let mut a = FieldArray::default();
                a.push(AMQPValue::LongInt(1));
                a.push(AMQPValue::FieldTable(t));
                outer.insert("a".into(), AMQPValue::FieldArray(a));
            }
            t = outer;
        }
        t
    }

    fn declare_payload(arguments: FieldTable) -> Vec<u8> {
        let mut w = FrameWriter::default();
        w.method(
            1,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: "q".into(),
                arguments,
                ..Default::default()
            })),
        );
        let s = w.as_slice();
        s[7..s.len() - 1].to_vec()
    }

    #[test]
    fn method_tables_are_measured_where_they_sit() {
        assert!(method_within_depth(&declare_payload(nested(5)), 8));
        // Arrays count as a level, so depth 5 tables with arrays between them exceed 6.
        assert!(!method_within_depth(&declare_payload(nested(9)), 6));
        assert!(method_within_depth(
            &declare_payload(FieldTable::default()),
            1
        ));
    }

    #[test]
    fn message_headers_are_measured_after_the_two_strings_before_them() {
        let props = Properties::default()
            .with_content_type("text/plain".into())
            .with_content_encoding("utf-8".into())
            .with_headers(nested(6));
        let payload = FrameWriter::encode_header_payload(3, &props);
        assert!(header_within_depth(&payload, 16));
        assert!(!header_within_depth(&payload, 4));
        let plain = FrameWriter::encode_header_payload(3, &Properties::default());
        assert!(header_within_depth(&plain, 1));
    }
}
