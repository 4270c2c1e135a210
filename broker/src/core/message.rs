//! A published message as the vhost holds it: shared by every queue it was routed to.

use crate::amqp::writer::FrameWriter;
use crate::amqp::{Properties, ShortString};
use bytes::Bytes;

/// One published message. Immutable once built: queues share it through an `Arc`, and a
/// changed copy (dead-lettering adds `x-death`) is a new `Message`.
#[derive(Debug, Clone)]
pub struct Message {
    /// Exchange the message was published to.
    pub exchange: ShortString,
    /// Routing key it was published with.
    pub routing_key: ShortString,
    /// Decoded properties, for the fields the broker acts on (expiration, priority, headers).
    /// Boxed: they are 300 bytes, and a message moves several times between its content
    /// header and its `Arc` (copying them was 7% of the broker's CPU on small messages).
    pub properties: Box<Properties>,
    /// The encoded content-header payload, re-sent unchanged with every delivery.
    pub header_payload: Bytes,
    /// The body: in memory (a slice of the read buffer when it arrived in one frame), or
    /// only on disk once its queue went over its memory budget (flow-to-disk).
    pub body: Body,
    /// `delivery-mode` = 2.
    pub persistent: bool,
    /// `priority` property (0 when absent).
    pub priority: u8,
    /// Per-message TTL from the `expiration` property, in milliseconds.
    pub expiration_ms: Option<u64>,
}

/// Where a message's body is. The core never reads a body from disk: a delivery or a dead
/// letter whose body is [`Body::Disk`] is resolved by the server layer before it is written
/// or re-enqueued.
#[derive(Debug, Clone)]
pub enum Body {
    /// The bytes, in memory.
    Memory(Bytes),
    /// Only in the journal, found by the key of the record that holds it.
    Disk(DiskBody),
}

/// The journal key of a body that was dropped from memory: the queue incarnation and the
/// message id of the record holding it. The store maps the key to the record's current
/// location (segment, offset, length); keeping the key rather than the location here lets
/// the compactor move records without touching queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DiskBody {
    /// Queue incarnation ([`crate::core::QueueOp::uid`]) of the record.
    pub uid: u64,
    /// Message id of the record in that queue.
    pub id: u64,
    /// Body length in bytes.
    pub len: usize,
}

impl From<Bytes> for Body {
    fn from(bytes: Bytes) -> Self {
        Body::Memory(bytes)
    }
}

impl Body {
    /// Body size in bytes, wherever it is.
    pub fn len(&self) -> usize {
        match self {
            Body::Memory(b) => b.len(),
            Body::Disk(d) => d.len,
        }
    }

    /// Whether the body has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes when they are in memory.
    pub fn in_memory(&self) -> Option<&Bytes> {
        match self {
            Body::Memory(b) => Some(b),
            Body::Disk(_) => None,
        }
    }

    /// Where the body is on disk, when it is only there.
    pub fn on_disk(&self) -> Option<DiskBody> {
        match self {
            Body::Memory(_) => None,
            Body::Disk(d) => Some(*d),
        }
    }

    /// The in-memory bytes; a body still on disk here is a bug in the server layer, which
    /// resolves every on-disk body before it writes a delivery or a journal record.
    pub fn bytes(&self) -> &Bytes {
        match self {
            Body::Memory(b) => b,
            Body::Disk(d) => panic!(
                "body of message {} of queue {:x} used while only on disk",
                d.id, d.uid
            ),
        }
    }
}

/// Why an `expiration` property was refused (RabbitMQ answers 406 for these).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidExpiration(pub String);

impl Message {
    /// Builds a message from its decoded parts. `header_payload` must be the encoding of
    /// `properties` for this body (the bytes that came off the wire, or
    /// [`FrameWriter::encode_header_payload`]).
    pub fn new(
        exchange: ShortString,
        routing_key: ShortString,
        properties: impl Into<Box<Properties>>,
        header_payload: Bytes,
        body: Bytes,
    ) -> Result<Self, InvalidExpiration> {
        let properties = properties.into();
        let expiration_ms = match properties.expiration() {
            None => None,
            Some(s) => Some(
                s.as_str()
                    .parse::<u64>()
                    .map_err(|_| InvalidExpiration(s.as_str().to_owned()))?,
            ),
        };
        Ok(Self {
            persistent: *properties.delivery_mode() == Some(2),
            priority: properties.priority().unwrap_or(0),
            expiration_ms,
            exchange,
            routing_key,
            properties,
            header_payload,
            body: Body::Memory(body),
        })
    }

    /// Builds a message the broker itself authors (dead letters, cluster notices), encoding
    /// its header.
    pub fn authored(
        exchange: ShortString,
        routing_key: ShortString,
        properties: Properties,
        body: impl Into<Body>,
    ) -> Self {
        let body = body.into();
        let header_payload = FrameWriter::encode_header_payload(body.len() as u64, &properties);
        let mut message = Self::new(
            exchange,
            routing_key,
            properties,
            header_payload,
            Bytes::new(),
        )
        .expect("broker-authored messages carry no expiration");
        message.body = body;
        message
    }

    /// Body size in bytes: what `x-max-length-bytes` and `prefetch-size` count.
    pub fn body_len(&self) -> usize {
        self.body.len()
    }

    /// This message with its body dropped from memory, to be read back by `key` (`key.len`
    /// must be the body length). The header payload is copied: as a slice it would keep the
    /// whole read buffer it came in (and so the body) alive.
    pub fn paged(&self, key: DiskBody) -> Message {
        assert_eq!(key.len, self.body.len(), "paged body length");
        Message {
            exchange: self.exchange.clone(),
            routing_key: self.routing_key.clone(),
            properties: self.properties.clone(),
            header_payload: Bytes::copy_from_slice(&self.header_payload),
            body: Body::Disk(key),
            persistent: self.persistent,
            priority: self.priority,
            expiration_ms: self.expiration_ms,
        }
    }

    /// This message with its body and header in allocations of their own: a message decoded
    /// from a large buffer (a journal segment read whole at recovery) would otherwise keep
    /// all of that buffer alive.
    pub fn detached(&self) -> Message {
        Message {
            header_payload: Bytes::copy_from_slice(&self.header_payload),
            body: match &self.body {
                Body::Memory(b) => Body::Memory(Bytes::copy_from_slice(b)),
                Body::Disk(d) => Body::Disk(*d),
            },
            ..self.clone()
        }
    }

    /// This message with its body back in memory (read from disk for a delivery or a dead
    /// letter).
    pub fn with_body(&self, body: Bytes) -> Message {
        assert_eq!(body.len(), self.body.len(), "resolved body length");
        Message {
            body: Body::Memory(body),
            ..self.clone()
        }
    }
}
