//! Building outgoing frames into one buffer, so that many replies and deliveries leave in
//! one `write` call.

use super::frame::{FRAME_BODY, FRAME_END, FRAME_HEADER, FRAME_OVERHEAD};
use super::{AMQPClass, Properties};
use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame};
use bytes::Bytes;

/// Capacity an output buffer keeps between writes.
const RETAINED_CAPACITY: usize = 256 * 1024;

/// An append-only output buffer of encoded frames.
#[derive(Debug, Default)]
pub struct FrameWriter {
    buf: Vec<u8>,
}

impl FrameWriter {
    /// Bytes waiting to be written.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf
    }

    /// Number of bytes waiting to be written.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// True when nothing waits to be written.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Forgets everything written so far, keeping a modest allocation: a burst of
    /// deliveries must not leave an idle connection holding megabytes.
    pub fn clear(&mut self) {
        self.buf.clear();
        if self.buf.capacity() > RETAINED_CAPACITY {
            self.buf.shrink_to(RETAINED_CAPACITY);
        }
    }

    /// Keeps the first `len` bytes and forgets the rest (output that must never be sent).
    pub fn truncate(&mut self, len: usize) {
        self.buf.truncate(len);
    }

    /// Forgets the first `n` bytes (they were written), keeping the rest in order.
    pub fn consume(&mut self, n: usize) {
        if n >= self.buf.len() {
            self.clear();
        } else {
            self.buf.drain(..n);
        }
    }

    /// Raw bytes (the protocol header).
    pub fn raw(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// A method frame.
    pub fn method(&mut self, channel: u16, method: AMQPClass) {
        self.frame(&AMQPFrame::Method(channel, method));
    }

    /// connection.open-ok with `known_hosts` in its reserved shortstr (amq-protocol's
    /// `OpenOk` has no field for it). Truncated to 255 bytes at a comma, the shortstr limit.
    pub fn open_ok(&mut self, known_hosts: &str) {
        let mut hosts = known_hosts;
        while hosts.len() > 255 {
            hosts = hosts.rsplit_once(',').map_or("", |(head, _)| head);
        }
        let payload_len = 4 + 1 + hosts.len();
        self.buf.push(1);
        self.buf.extend_from_slice(&0u16.to_be_bytes());
        self.buf
            .extend_from_slice(&(payload_len as u32).to_be_bytes());
        self.buf.extend_from_slice(&10u16.to_be_bytes());
        self.buf.extend_from_slice(&41u16.to_be_bytes());
        self.buf.push(hosts.len() as u8);
        self.buf.extend_from_slice(hosts.as_bytes());
        self.buf.push(FRAME_END);
    }

    /// A heartbeat frame.
    pub fn heartbeat(&mut self) {
        self.buf
            .extend_from_slice(&[8, 0, 0, 0, 0, 0, 0, FRAME_END]);
    }

    /// Encodes a content header payload (class, weight, body size, properties) once, so that
    /// the same bytes can be sent with every delivery of the message.
    pub fn encode_header_payload(body_size: u64, properties: &Properties) -> Bytes {
        let mut w = FrameWriter::default();
        w.frame(&AMQPFrame::Header(
            0,
            AMQPContentHeader {
                class_id: 60,
                body_size,
                properties: properties.clone(),
            },
        ));
        let len = w.buf.len();
        Bytes::from(w.buf).slice(7..len - 1)
    }

    /// A basic.deliver method frame, encoded by hand: it is written once per delivery, and
    /// the generic encoder allocates per call.
    pub fn deliver(
        &mut self,
        channel: u16,
        consumer_tag: &str,
        delivery_tag: u64,
        redelivered: bool,
        exchange: &str,
        routing_key: &str,
    ) {
        let size = 4 + 1 + consumer_tag.len() + 8 + 1 + 1 + exchange.len() + 1 + routing_key.len();
        self.buf.reserve(size + FRAME_OVERHEAD);
        self.buf.push(super::frame::FRAME_METHOD);
        self.buf.extend_from_slice(&channel.to_be_bytes());
        self.buf.extend_from_slice(&(size as u32).to_be_bytes());
        self.buf.extend_from_slice(&[0, 60, 0, 60]);
        push_short_str(&mut self.buf, consumer_tag);
        self.buf.extend_from_slice(&delivery_tag.to_be_bytes());
        self.buf.push(u8::from(redelivered));
        push_short_str(&mut self.buf, exchange);
        push_short_str(&mut self.buf, routing_key);
        self.buf.push(FRAME_END);
    }

    /// A content header frame from an already encoded payload.
    pub fn header_payload(&mut self, channel: u16, payload: &[u8]) {
        self.frame_raw(FRAME_HEADER, channel, payload);
    }

    /// The body, split into frames of at most `frame_max` bytes each.
    pub fn body(&mut self, channel: u16, body: &[u8], frame_max: u32) {
        let chunk = (frame_max as usize).saturating_sub(FRAME_OVERHEAD).max(1);
        for part in body.chunks(chunk) {
            self.frame_raw(FRAME_BODY, channel, part);
        }
    }

    fn frame_raw(&mut self, kind: u8, channel: u16, payload: &[u8]) {
        self.buf.reserve(payload.len() + FRAME_OVERHEAD);
        self.buf.push(kind);
        self.buf.extend_from_slice(&channel.to_be_bytes());
        self.buf
            .extend_from_slice(&(payload.len() as u32).to_be_bytes());
        self.buf.extend_from_slice(payload);
        self.buf.push(FRAME_END);
    }

    fn frame(&mut self, frame: &AMQPFrame) {
        let buf = std::mem::take(&mut self.buf);
        match gen_frame(frame)(WriteContext::from(buf)) {
            Ok(ctx) => self.buf = ctx.write,
            // Writing into a Vec cannot run out of space; an encoder error here means a value
            // the broker built itself is out of range, which is a bug worth stopping on.
            Err(e) => panic!("encoding an outgoing frame failed: {e:?}"),
        }
    }
}

/// Appends a short string; callers pass strings that came in as short strings (<= 255 bytes).
fn push_short_str(buf: &mut Vec<u8>, s: &str) {
    debug_assert!(s.len() <= 255, "short string over 255 bytes");
    buf.push(s.len() as u8);
    buf.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::parse_frame;
    use amq_protocol::protocol::basic;

    #[test]
    fn hand_encoded_deliver_decodes_as_basic_deliver() {
        let mut w = FrameWriter::default();
        w.deliver(7, "ctag", 42, true, "ex", "rk");
        let (rest, frame) = parse_frame(w.as_slice()).unwrap();
        assert!(rest.is_empty());
        let AMQPFrame::Method(7, AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) = frame else {
            panic!("not a deliver: {frame:?}");
        };
        assert_eq!(
            (d.consumer_tag.as_str(), d.delivery_tag, d.redelivered),
            ("ctag", 42, true)
        );
        assert_eq!((d.exchange.as_str(), d.routing_key.as_str()), ("ex", "rk"));
    }

    #[test]
    fn open_ok_with_known_hosts_decodes_as_open_ok() {
        use amq_protocol::protocol::connection;
        for hosts in ["", "127.0.0.1:5672,127.0.0.1:5673"] {
            let mut w = FrameWriter::default();
            w.open_ok(hosts);
            let bytes = w.as_slice();
            assert_eq!(&bytes[12..12 + hosts.len()], hosts.as_bytes());
            let (rest, frame) = parse_frame(bytes).unwrap();
            assert!(rest.is_empty());
            assert!(matches!(
                frame,
                AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)))
            ));
        }
    }

    #[test]
    fn known_hosts_beyond_a_shortstr_are_cut_at_a_comma() {
        let hosts = vec!["10.0.0.1:5672"; 40].join(",");
        let mut w = FrameWriter::default();
        w.open_ok(&hosts);
        let len = usize::from(w.as_slice()[11]);
        assert!(len <= 255);
        assert!(
            !std::str::from_utf8(&w.as_slice()[12..12 + len])
                .unwrap()
                .ends_with(',')
        );
        assert!(parse_frame(w.as_slice()).is_ok());
    }

    #[test]
    fn bodies_are_split_at_frame_max() {
        let mut w = FrameWriter::default();
        w.body(1, &[7u8; 10_000], 4096);
        let mut rest = w.as_slice();
        let mut sizes = Vec::new();
        while !rest.is_empty() {
            let (r, f) = parse_frame(rest).unwrap();
            let AMQPFrame::Body(1, b) = f else { panic!() };
            sizes.push(b.len());
            rest = r;
        }
        assert_eq!(sizes, vec![4088, 4088, 1824]);
    }
}
