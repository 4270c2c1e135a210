//! The error a vhost command ends in: an AMQP reply code and a text for the client.

use crate::amqp::codes;
use thiserror::Error;

/// A refused command. The code decides whether the server closes the channel (soft error) or
/// the whole connection (hard error); the text is sent to the client as the reply text.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{code} {text}")]
pub struct AmqpError {
    /// AMQP reply code (see [`crate::amqp::codes`]).
    pub code: u16,
    /// Human-readable reason, written the way RabbitMQ writes it so people can search for it.
    pub text: String,
}

impl AmqpError {
    /// An error with the given code and text.
    pub fn new(code: u16, text: impl Into<String>) -> Self {
        Self {
            code,
            text: text.into(),
        }
    }

    /// 404 NOT_FOUND, as a channel error.
    pub fn not_found(text: impl Into<String>) -> Self {
        Self::new(codes::NOT_FOUND, text)
    }

    /// 406 PRECONDITION_FAILED, as a channel error.
    pub fn precondition(text: impl Into<String>) -> Self {
        Self::new(codes::PRECONDITION_FAILED, text)
    }

    /// 403 ACCESS_REFUSED, as a channel error.
    pub fn access_refused(text: impl Into<String>) -> Self {
        Self::new(codes::ACCESS_REFUSED, text)
    }

    /// 405 RESOURCE_LOCKED, as a channel error.
    pub fn resource_locked(text: impl Into<String>) -> Self {
        Self::new(codes::RESOURCE_LOCKED, text)
    }

    /// True for codes the spec names connection exceptions: the server must close the whole
    /// connection, not just the channel.
    pub fn is_connection_error(&self) -> bool {
        matches!(self.code, 320 | 402 | 501..=506 | 530 | 540 | 541)
    }
}

/// Result of a vhost command.
pub type CoreResult<T> = Result<T, AmqpError>;
