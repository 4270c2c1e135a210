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
    pub properties: Properties,
    /// The encoded content-header payload, re-sent unchanged with every delivery.
    pub header_payload: Bytes,
    /// The body, a slice of the read buffer when it arrived in one frame.
    pub body: Bytes,
    /// `delivery-mode` = 2.
    pub persistent: bool,
    /// `priority` property (0 when absent).
    pub priority: u8,
    /// Per-message TTL from the `expiration` property, in milliseconds.
    pub expiration_ms: Option<u64>,
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
        properties: Properties,
        header_payload: Bytes,
        body: Bytes,
    ) -> Result<Self, InvalidExpiration> {
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
            body,
        })
    }

    /// Builds a message the broker itself authors (dead letters, cluster notices), encoding
    /// its header.
    pub fn authored(
        exchange: ShortString,
        routing_key: ShortString,
        properties: Properties,
        body: Bytes,
    ) -> Self {
        let header_payload = FrameWriter::encode_header_payload(body.len() as u64, &properties);
        Self::new(exchange, routing_key, properties, header_payload, body)
            .expect("broker-authored messages carry no expiration")
    }

    /// Body size in bytes: what `x-max-length-bytes` and `prefetch-size` count.
    pub fn body_len(&self) -> usize {
        self.body.len()
    }
}
