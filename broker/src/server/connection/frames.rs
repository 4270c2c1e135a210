//! Frames in: what arrives on channel 0 (the connection class), the lifecycle of channels,
//! dispatch of channel methods to their class's handler, and the two ways a method fails —
//! a channel error closes the channel, a connection error the connection.

use super::{Connection, Lazy, Phase};
use crate::amqp::frame::{self, FRAME_BODY, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD, RawFrame};
use crate::amqp::table_depth::method_within_depth;
use crate::amqp::{AMQPClass, ShortString, basic, channel, codes, confirm, connection};
use crate::auth::permissions::{Access, Permissions, Resource};
use crate::core::{AmqpError, ChannelKey};
use crate::server::channel::ChannelCtx;
use crate::session::KEEP_SESSION;
use std::sync::Arc;

/// A connection-level failure: the broker sends connection.close with these and ends.
#[derive(Debug, Clone)]
pub(super) struct ConnError {
    pub(super) code: u16,
    pub(super) text: String,
    pub(super) class_id: u16,
    pub(super) method_id: u16,
}

impl ConnError {
    pub(super) fn new(code: u16, text: impl Into<String>) -> Self {
        Self {
            code,
            text: text.into(),
            class_id: 0,
            method_id: 0,
        }
    }
}

impl Connection {
    pub(super) fn on_frame_while_closing(&mut self, frame: &RawFrame) {
        if frame.kind != FRAME_METHOD
            || frame.channel != 0
            || !method_within_depth(&frame.payload, self.broker.config.max_table_depth)
        {
            return;
        }
        match amq_protocol::protocol::parse_class(&frame.payload[..]) {
            Ok((_, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))) => {
                self.phase = Phase::Done
            }
            Ok((_, AMQPClass::Connection(connection::AMQPMethod::Close(_)))) => {
                self.writer.method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.phase = Phase::Done;
            }
            _ => {}
        }
    }

    pub(super) fn connection_error(&mut self, e: ConnError) {
        tracing::warn!(conn = self.id, peer = %self.peer, code = e.code, text = %e.text, "closing connection on error");
        self.close_reason = format!("{} {}", e.code, e.text);
        // 320 (drain, lost majority, shutdown, an operator) asks the client to go elsewhere
        // and resume; any other error the client caused ends its session with it.
        self.keep_session = e.code == codes::CONNECTION_FORCED;
        self.writer.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: e.code,
                reply_text: short(&reply_text(e.code, &e.text)),
                class_id: e.class_id,
                method_id: e.method_id,
            })),
        );
        self.phase = Phase::Closing;
    }

    pub(super) fn parse_method(
        frame: &RawFrame,
        max_table_depth: usize,
    ) -> Result<AMQPClass, ConnError> {
        let (class_id, method_id) = frame::method_ids(&frame.payload).ok_or_else(|| {
            ConnError::new(
                codes::FRAME_ERROR,
                "method frame shorter than its class and method ids",
            )
        })?;
        if let Some(method) = crate::amqp::hot_methods::parse(&frame.payload) {
            return Ok(method);
        }
        if !method_within_depth(&frame.payload, max_table_depth) {
            return Err(ConnError {
                code: codes::SYNTAX_ERROR,
                text: format!("field table nested deeper than {max_table_depth} levels"),
                class_id,
                method_id,
            });
        }
        match amq_protocol::protocol::parse_class(&frame.payload[..]) {
            Ok(([], m)) => Ok(m),
            _ => {
                let known = known_method(class_id, method_id);
                let code = if known {
                    codes::SYNTAX_ERROR
                } else {
                    codes::NOT_IMPLEMENTED
                };
                let what = if known { "could not decode" } else { "unknown" };
                Err(ConnError {
                    code,
                    text: format!("{what} method {class_id}.{method_id}"),
                    class_id,
                    method_id,
                })
            }
        }
    }

    pub(super) fn on_frame(&mut self, frame: RawFrame, v: &mut Lazy) -> Result<(), ConnError> {
        match frame.kind {
            FRAME_HEARTBEAT => {
                if frame.channel != 0 {
                    return Err(ConnError::new(
                        codes::FRAME_ERROR,
                        "heartbeat frame on a channel other than 0",
                    ));
                }
                Ok(())
            }
            FRAME_METHOD => {
                let method = Self::parse_method(&frame, self.broker.config.max_table_depth)?;
                if let AMQPClass::Basic(basic::AMQPMethod::Qos(_)) = method {
                    // amq-protocol drops prefetch-size: read it from the payload (after the ids).
                    let p = &frame.payload;
                    self.qos_prefetch_size = u32::from_be_bytes([p[4], p[5], p[6], p[7]]);
                }
                if frame.channel == 0 {
                    return self.on_connection_method(method, v);
                }
                self.on_channel_method(frame.channel, method, v)
            }
            FRAME_HEADER | FRAME_BODY => self.on_content(frame, v),
            _ => unreachable!("split_frame only yields known frame types"),
        }
    }

    pub(super) fn on_connection_method(
        &mut self,
        method: AMQPClass,
        v: &mut Lazy,
    ) -> Result<(), ConnError> {
        match method {
            AMQPClass::Connection(connection::AMQPMethod::Close(close)) => {
                self.close_reason =
                    format!("client closed: {} {}", close.reply_code, close.reply_text);
                self.keep_session = close.reply_code == crate::session::KEEP_SESSION;
                if self.session_kept() {
                    self.detach_all_channels(v);
                } else {
                    self.close_all_channels(v);
                    // Exclusive queues go before close-ok, so a client that saw close-ok
                    // finds them gone (RabbitMQ's order; a test relies on it); a session's
                    // channels this connection never reopened end with it.
                    let now = v.now_ms();
                    v.get().close_channels_of(self.id, now, &mut self.fx);
                    v.get().connection_closed(self.id, &mut self.fx);
                }
                self.writer.method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.phase = Phase::Done;
                Ok(())
            }
            // Sent by a client that closed a connection the broker had already closed.
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => {
                self.phase = Phase::Done;
                Ok(())
            }
            AMQPClass::Connection(
                connection::AMQPMethod::Blocked(_) | connection::AMQPMethod::Unblocked(_),
            ) => Ok(()),
            AMQPClass::Connection(connection::AMQPMethod::UpdateSecret(_)) => {
                self.writer.method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(
                        connection::UpdateSecretOk {},
                    )),
                );
                Ok(())
            }
            m => Err(ConnError {
                code: if matches!(m, AMQPClass::Connection(_)) {
                    codes::COMMAND_INVALID
                } else {
                    codes::CHANNEL_ERROR
                },
                text: "method not allowed on channel 0".into(),
                class_id: m.get_amqp_class_id(),
                method_id: m.get_amqp_method_id(),
            }),
        }
    }

    /// Whether this connection's end keeps its session (and so its channels' unacked
    /// deliveries and its exclusive queues).
    pub(super) fn session_kept(&self) -> bool {
        self.keep_session
            && self
                .session
                .is_some_and(|s| self.broker.sessions().contains(s.id))
    }

    /// [`Connection::close_all_channels`] for a session that is kept: the channels are
    /// detached in the vhost, their unacked deliveries kept for the next connection.
    pub(super) fn detach_all_channels(&mut self, v: &mut Lazy) {
        let now = v.now_ms();
        let ids: Vec<u16> = self.channels.keys().copied().collect();
        for id in ids {
            if let Some(ch) = self.channels.remove(&id) {
                v.get().channel_detach(ch.key, now, &mut self.fx);
                self.detach_upstreams(id);
                if let Some(session) = self.session {
                    self.broker
                        .sessions()
                        .keep_channel(session.id, id, ch.publish_state());
                }
            }
        }
        self.fx.deliveries.clear();
    }

    pub(super) fn close_all_channels(&mut self, v: &mut Lazy) {
        let now = v.now_ms();
        let ids: Vec<u16> = self.channels.keys().copied().collect();
        for id in ids {
            if let Some(ch) = self.channels.remove(&id) {
                v.get().channel_close(ch.key, now, &mut self.fx);
                self.drop_upstreams(id);
            }
        }
        self.fx.deliveries.clear();
    }

    pub(super) fn on_channel_method(
        &mut self,
        id: u16,
        method: AMQPClass,
        v: &mut Lazy,
    ) -> Result<(), ConnError> {
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
        if id > self.channel_max {
            return Err(ConnError {
                code: codes::CHANNEL_ERROR,
                text: format!("channel {id} is above channel_max {}", self.channel_max),
                class_id,
                method_id,
            });
        }
        match (&method, self.channels.get(&id)) {
            (AMQPClass::Channel(channel::AMQPMethod::Open(_)), None) => {
                self.open_channel(id, v);
                return Ok(());
            }
            (AMQPClass::Channel(channel::AMQPMethod::Open(_)), Some(ch))
                if ch.crossing_close_answered =>
            {
                // The client's close crossed the broker's and was answered; a client that
                // opens the channel again without sending close-ok for the broker's close is
                // done with the old one.
                self.channels.remove(&id);
                self.open_channel(id, v);
                return Ok(());
            }
            (AMQPClass::Channel(channel::AMQPMethod::Open(_)), Some(_)) => {
                return Err(ConnError {
                    code: codes::CHANNEL_ERROR,
                    text: format!("second 'channel.open' seen on channel {id}"),
                    class_id,
                    method_id,
                });
            }
            (_, None) => {
                return Err(ConnError {
                    code: codes::CHANNEL_ERROR,
                    text: format!("expected 'channel.open' on channel {id}"),
                    class_id,
                    method_id,
                });
            }
            (AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)), Some(ch)) if ch.closing => {
                self.channels.remove(&id);
                return Ok(());
            }
            (AMQPClass::Channel(channel::AMQPMethod::Close(_)), Some(ch)) if ch.closing => {
                // Both sides closed at once (the spec's crossing close): answer the client's
                // close, and keep discarding the channel's traffic until the close-ok for the
                // broker's own close arrives. The other channels never notice.
                self.writer.method(
                    id,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
                if let Some(ch) = self.channels.get_mut(&id) {
                    ch.crossing_close_answered = true;
                    // Nothing more goes out on a channel after its close-ok.
                    ch.confirms.clear();
                    ch.moving.clear();
                    ch.awaiting.clear();
                }
                return Ok(());
            }
            (_, Some(ch)) if ch.closing => return Ok(()),
            (_, Some(ch)) if ch.pending.is_some() => {
                return Err(ConnError {
                    code: codes::UNEXPECTED_FRAME,
                    text: format!("expected content on channel {id}, got a method"),
                    class_id,
                    method_id,
                });
            }
            _ => {}
        }
        let retry = self.retry_if_not_found(&method);
        let result = self.handle(id, method, v);
        if let (Err(error), Some(method)) = (&result, retry)
            && error.code == codes::NOT_FOUND
        {
            self.catch_up_then_retry(id, method);
            return Ok(());
        }
        match result {
            Ok(()) => Ok(()),
            Err(error) => {
                if error.is_connection_error() {
                    return Err(ConnError {
                        code: error.code,
                        text: error.text,
                        class_id,
                        method_id,
                    });
                }
                self.channel_error(id, error, class_id, method_id, v);
                Ok(())
            }
        }
    }

    pub(super) fn channel_error(
        &mut self,
        id: u16,
        error: AmqpError,
        class_id: u16,
        method_id: u16,
        v: &mut Lazy,
    ) {
        tracing::info!(conn = self.id, channel = id, code = error.code, text = %error.text, class_id, method_id, "closing channel on error");
        let Some(ch) = self.channels.get_mut(&id) else {
            return;
        };
        ch.closing = true;
        ch.pending = None;
        let key = ch.key;
        self.forget_channel(key, v);
        self.writer.method(
            id,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: error.code,
                reply_text: short(&reply_text(error.code, &error.text)),
                class_id,
                method_id,
            })),
        );
    }

    /// Removes a channel from the vhost and drops anything still addressed to it.
    pub(super) fn forget_channel(&mut self, key: ChannelKey, v: &mut Lazy) {
        let now = v.now_ms();
        v.get().channel_close(key, now, &mut self.fx);
        self.drop_upstreams(key.channel);
        self.outbox.purge_channel(key.channel);
        self.fx.deliveries.retain(|d| d.channel != key);
        self.fx.cancelled.retain(|c| c.channel != key);
        self.written.remove(&key.channel);
    }

    /// Hands a method on an open channel to its class's handler. The handler's error closes
    /// the channel, or the connection when its code is a connection error.
    pub(super) fn handle(
        &mut self,
        id: u16,
        method: AMQPClass,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
        match method {
            AMQPClass::Channel(m) => self.on_channel_class(id, m, v),
            AMQPClass::Exchange(_) | AMQPClass::Queue(_) => self.on_wiring_method(id, method, v),
            AMQPClass::Basic(m) => self.on_basic(id, m, v),
            AMQPClass::Confirm(confirm::AMQPMethod::Select(s)) => self.on_confirm_select(id, s),
            AMQPClass::Tx(m) => self.on_tx(id, m, v),
            _ => Err(AmqpError::new(
                codes::NOT_IMPLEMENTED,
                format!("method {class_id}.{method_id} is not supported"),
            )),
        }
    }

    /// channel.close, channel.flow and channel.flow-ok on an open channel.
    pub(super) fn on_channel_class(
        &mut self,
        id: u16,
        m: channel::AMQPMethod,
        v: &mut Lazy,
    ) -> Result<(), AmqpError> {
        match m {
            channel::AMQPMethod::Close(close) => {
                if let Some(ch) = self.channels.remove(&id) {
                    if self.link && close.reply_code == KEEP_SESSION {
                        // The member's client lost its connection and kept its session:
                        // what went to it is held for it (`core::queue::holds`).
                        let now = v.now_ms();
                        v.get().link_channel_lost(ch.key, now, &mut self.fx);
                    }
                    self.forget_channel(ch.key, v);
                }
                self.writer.method(
                    id,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
                Ok(())
            }
            // Stopping the broker's deliveries is what prefetch and cancel are for; RabbitMQ
            // answers active=false with 540, and client code in the wild expects that.
            channel::AMQPMethod::Flow(f) if !f.active => {
                Err(AmqpError::new(codes::NOT_IMPLEMENTED, "active=false"))
            }
            channel::AMQPMethod::Flow(f) => {
                self.writer.method(
                    id,
                    AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                        active: f.active,
                    })),
                );
                Ok(())
            }
            channel::AMQPMethod::FlowOk(_) => Ok(()),
            _ => Err(AmqpError::new(
                codes::COMMAND_INVALID,
                "unexpected channel method",
            )),
        }
    }

    /// Opens channel `id` and answers open-ok.
    pub(super) fn open_channel(&mut self, id: u16, v: &mut Lazy) {
        let key = ChannelKey {
            conn: self.id,
            channel: id,
        };
        v.get().channel_open(key);
        let ch = match self.session {
            Some(session) => {
                ChannelCtx::resumed(key, self.broker.sessions().take_channel(session.id, id))
            }
            None => ChannelCtx::new(key),
        };
        self.channels.insert(id, ch);
        self.writer.method(
            id,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        );
    }
}

/// Checks the user's permission for one access to one resource (RabbitMQ's rules and texts).
pub(super) fn permit(
    perms: &Option<Arc<Permissions>>,
    access: Access,
    resource: Resource,
) -> Result<(), AmqpError> {
    match perms {
        Some(p) => p
            .check(access, resource)
            .map_err(|e| AmqpError::access_refused(e.to_string())),
        None => Err(AmqpError::access_refused(
            "the user's permission on this vhost was removed",
        )),
    }
}

/// Whether class.method is one the protocol defines (so a decode failure is a syntax error,
/// not an unknown method).
fn known_method(class_id: u16, method_id: u16) -> bool {
    let methods: &[u16] = match class_id {
        10 => &[10, 11, 20, 21, 30, 31, 40, 41, 50, 51, 60, 61, 70, 71],
        20 => &[10, 11, 20, 21, 40, 41],
        40 => &[10, 11, 20, 21, 30, 31, 40, 51],
        50 => &[10, 11, 20, 21, 30, 31, 40, 41, 50, 51],
        60 => &[
            10, 11, 20, 21, 30, 31, 40, 50, 60, 70, 71, 72, 80, 90, 100, 110, 111, 120,
        ],
        85 => &[10, 11],
        90 => &[10, 11, 20, 21, 30, 31],
        _ => &[],
    };
    methods.contains(&method_id)
}

/// The reply text as RabbitMQ writes it: `NAME - text`, cut to fit a short string.
pub(super) fn reply_text(code: u16, text: &str) -> String {
    let name = match code {
        codes::NOT_FOUND => "NOT_FOUND",
        codes::ACCESS_REFUSED => "ACCESS_REFUSED",
        codes::RESOURCE_LOCKED => "RESOURCE_LOCKED",
        codes::PRECONDITION_FAILED => "PRECONDITION_FAILED",
        codes::CONNECTION_FORCED => "CONNECTION_FORCED",
        codes::FRAME_ERROR => "FRAME_ERROR",
        codes::SYNTAX_ERROR => "SYNTAX_ERROR",
        codes::COMMAND_INVALID => "COMMAND_INVALID",
        codes::CHANNEL_ERROR => "CHANNEL_ERROR",
        codes::UNEXPECTED_FRAME => "UNEXPECTED_FRAME",
        codes::RESOURCE_ERROR => "RESOURCE_ERROR",
        codes::NOT_ALLOWED => "NOT_ALLOWED",
        codes::NOT_IMPLEMENTED => "NOT_IMPLEMENTED",
        codes::INTERNAL_ERROR => "INTERNAL_ERROR",
        _ => "",
    };
    if name.is_empty() || text.starts_with(name) {
        text.to_owned()
    } else {
        format!("{name} - {text}")
    }
}

/// A short string from `s`, cut at 255 bytes on a character boundary.
pub(super) fn short(s: &str) -> ShortString {
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    ShortString::from(&s[..end])
}
