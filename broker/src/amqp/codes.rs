//! Reply codes of AMQP 0-9-1 (spec §1.9 "Constants") that the broker sends.

/// Normal close.
pub const REPLY_SUCCESS: u16 = 200;
/// A mandatory message could not be routed (basic.return).
pub const NO_ROUTE: u16 = 312;
/// Channel error: the client is not allowed to do this (exclusive queue of another connection).
pub const ACCESS_REFUSED: u16 = 403;
/// Channel error: the entity does not exist.
pub const NOT_FOUND: u16 = 404;
/// Channel error: the entity is locked by another connection (exclusive consumer/queue).
pub const RESOURCE_LOCKED: u16 = 405;
/// Channel error: arguments or flags do not match the existing entity or a precondition failed.
pub const PRECONDITION_FAILED: u16 = 406;
/// Connection error: the administrator closed the connection or the broker is shutting down.
pub const CONNECTION_FORCED: u16 = 320;
/// Connection error: the virtual host does not exist or may not be used.
pub const INVALID_PATH: u16 = 402;
/// Connection error: the client tried something the server forbids (reused consumer tag).
pub const NOT_ALLOWED: u16 = 530;
/// Connection error: a malformed frame (size over frame-max, bad frame-end, bad type).
pub const FRAME_ERROR: u16 = 501;
/// Connection error: a method's fields could not be decoded or hold illegal values.
pub const SYNTAX_ERROR: u16 = 502;
/// Connection error: a method or frame arrived where it is not allowed.
pub const COMMAND_INVALID: u16 = 503;
/// Connection error: a method on a channel that is not open, or a channel number out of range.
pub const CHANNEL_ERROR: u16 = 504;
/// Connection error: content frame received where none was expected.
pub const UNEXPECTED_FRAME: u16 = 505;
/// Connection error: the broker is out of a resource (channels, memory).
pub const RESOURCE_ERROR: u16 = 506;
/// Connection error: a method the broker does not implement.
pub const NOT_IMPLEMENTED: u16 = 540;
/// Connection error: an internal failure.
pub const INTERNAL_ERROR: u16 = 541;
