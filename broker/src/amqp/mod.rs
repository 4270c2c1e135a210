//! The AMQP 0-9-1 wire layer: frame splitting and building, reply codes, and the small
//! pieces of method parsing that `amq-protocol` does not cover.
//!
//! Method and content-header encoding come from `amq-protocol` (see `docs/dependencies.md`);
//! this module owns the framing itself so that the frame size is checked before a payload is
//! buffered and body frames stay zero-copy slices of the read buffer.

pub mod codes;
pub mod frame;
pub mod hot_methods;
pub mod table_depth;
pub mod writer;

#[cfg(test)]
mod fuzz;

pub use amq_protocol::frame::AMQPContentHeader;
pub use amq_protocol::protocol::{
    AMQPClass, basic, channel, confirm, connection, exchange, queue, tx,
};
pub use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};

/// Properties of a message as `amq-protocol` models them.
pub type Properties = basic::AMQPProperties;
