//! A minimal AMQP 0-9-1 client that speaks raw frames. Two users need it: the bench tool,
//! where a general client library would be the bottleneck long before the broker, and tests
//! that must send malformed input after a valid handshake. It is not a general client: one
//! channel, no reconnect. It runs over any byte stream (`S`): a TCP socket by default, or a
//! TLS stream the caller set up (the TLS tests do).

use crate::amqp::frame::{
    self, FRAME_BODY, FRAME_END, FRAME_HEADER, FRAME_METHOD, PROTOCOL_HEADER, RawFrame,
};
use crate::amqp::writer::FrameWriter;
use crate::amqp::{AMQPClass, AMQPValue, FieldTable, basic, channel, connection};
use amq_protocol::uri::AMQPUri;
use bytes::BytesMut;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// Why a raw-client operation failed.
#[derive(Debug, Error)]
pub enum ClientError {
    /// Socket error.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The URI could not be parsed.
    #[error("invalid AMQP URI '{0}': {1}")]
    Uri(String, String),
    /// The server closed the connection or channel with a reply code.
    #[error("server closed the {scope}: {code} {text}")]
    Closed {
        /// `connection` or `channel`.
        scope: &'static str,
        /// Reply code.
        code: u16,
        /// Reply text.
        text: String,
    },
    /// The server sent something this client does not expect.
    #[error("protocol: {0}")]
    Protocol(String),
}

/// A connection with channel 1 open.
pub struct RawClient<S = TcpStream> {
    /// The socket.
    pub stream: S,
    /// Bytes read and not yet split into frames.
    pub rbuf: BytesMut,
    /// Negotiated frame-max.
    pub frame_max: u32,
    /// `known-hosts` from connection.open-ok: a cluster's member addresses, comma-separated.
    pub known_hosts: String,
    /// Negotiated heartbeat in seconds (0: none).
    pub heartbeat_s: u16,
    /// Highest channel number the server allows (its `connection.tune`; 0 there is none).
    pub channel_max: u16,
}

/// How the client presents itself in the handshake beyond its login.
#[derive(Debug, Clone, Default)]
pub struct Presentation {
    /// Client properties besides `product` and `capabilities` (a cluster link marks itself).
    pub properties: FieldTable,
    /// Heartbeat to ask for, in seconds; 0 asks for none. The server's is taken if lower.
    pub heartbeat_s: u16,
    /// Capabilities announced besides `connection.blocked` and
    /// `authentication_failure_close` (a cluster link wants `consumer_cancel_notify`).
    pub capabilities: &'static [&'static str],
}

/// The parts of an AMQP URI the client uses.
#[derive(Debug, Clone)]
pub struct Target {
    /// host:port.
    pub addr: String,
    /// User name.
    pub user: String,
    /// Password.
    pub password: String,
    /// Vhost.
    pub vhost: String,
}

impl Target {
    /// Parses `amqp://user:pass@host:port/vhost`.
    pub fn parse(uri: &str) -> Result<Self, ClientError> {
        let u: AMQPUri = uri
            .parse()
            .map_err(|e: String| ClientError::Uri(uri.to_owned(), e))?;
        Ok(Self {
            addr: format!("{}:{}", u.authority.host, u.authority.port),
            user: u.authority.userinfo.username,
            password: u.authority.userinfo.password,
            vhost: u.vhost,
        })
    }
}

impl RawClient<TcpStream> {
    /// Connects, logs in with PLAIN, opens the vhost and channel 1.
    pub async fn connect(target: &Target) -> Result<Self, ClientError> {
        let stream = TcpStream::connect(&target.addr).await?;
        stream.set_nodelay(true)?;
        let response = format!("\0{}\0{}", target.user, target.password);
        Self::open(stream, target, "PLAIN", response.as_bytes()).await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> RawClient<S> {
    /// Runs the handshake on a connected stream, logging in with `mechanism` and its
    /// `response` (PLAIN: `\0user\0password`; EXTERNAL: empty), then opens the vhost and
    /// channel 1. `target.addr` is not used: the stream is already connected.
    pub async fn open(
        stream: S,
        target: &Target,
        mechanism: &str,
        response: &[u8],
    ) -> Result<Self, ClientError> {
        Self::open_presenting(
            stream,
            target,
            mechanism,
            response,
            &Presentation::default(),
        )
        .await
    }

    /// A client on `stream` that has sent nothing yet: for tests that drive the handshake
    /// themselves.
    pub fn unopened(stream: S) -> Self {
        RawClient {
            stream,
            rbuf: BytesMut::with_capacity(256 * 1024),
            frame_max: 131_072,
            known_hosts: String::new(),
            heartbeat_s: 0,
            channel_max: u16::MAX,
        }
    }

    /// [`RawClient::open`], presenting itself as `presentation` says.
    pub async fn open_presenting(
        stream: S,
        target: &Target,
        mechanism: &str,
        response: &[u8],
        presentation: &Presentation,
    ) -> Result<Self, ClientError> {
        let mut c = RawClient::unopened(stream);
        c.stream.write_all(PROTOCOL_HEADER).await?;
        c.stream.flush().await?;
        match c.read_method().await? {
            AMQPClass::Connection(connection::AMQPMethod::Start(_)) => {}
            m => {
                return Err(ClientError::Protocol(format!(
                    "expected connection.start, got {m:?}"
                )));
            }
        }
        let mut caps = FieldTable::default();
        caps.insert("connection.blocked".into(), AMQPValue::Boolean(true));
        caps.insert(
            "authentication_failure_close".into(),
            AMQPValue::Boolean(true),
        );
        for &cap in presentation.capabilities {
            caps.insert(cap.into(), AMQPValue::Boolean(true));
        }
        let mut props = presentation.properties.clone();
        props.insert(
            "product".into(),
            AMQPValue::LongString("ringmq raw client".into()),
        );
        props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
        c.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: props,
                mechanism: mechanism.into(),
                response: response.into(),
                locale: "en_US".into(),
            })),
        )
        .await?;
        let tune = match c.read_method().await? {
            AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => t,
            m => {
                return Err(ClientError::Protocol(format!(
                    "expected connection.tune, got {m:?}"
                )));
            }
        };
        c.frame_max = if tune.frame_max == 0 {
            131_072
        } else {
            tune.frame_max.min(131_072)
        };
        c.heartbeat_s = match (presentation.heartbeat_s, tune.heartbeat) {
            (0, _) => 0,
            (mine, 0) => mine,
            (mine, theirs) => mine.min(theirs),
        };
        if tune.channel_max != 0 {
            c.channel_max = tune.channel_max;
        }
        c.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: tune.channel_max,
                frame_max: c.frame_max,
                heartbeat: c.heartbeat_s,
            })),
        )
        .await?;
        c.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: target.vhost.as_str().into(),
            })),
        )
        .await?;
        c.known_hosts = c.read_open_ok().await?;
        c.send(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await?;
        c.expect(
            |m| matches!(m, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))),
            "channel.open-ok",
        )
        .await?;
        Ok(c)
    }

    /// Sends one method frame.
    pub async fn send(&mut self, channel: u16, method: AMQPClass) -> Result<(), ClientError> {
        let mut w = FrameWriter::default();
        w.method(channel, method);
        self.stream.write_all(w.as_slice()).await?;
        self.stream.flush().await?;
        Ok(())
    }

    /// Sends a method and waits for the reply `what` (skipping heartbeats and blocked notices).
    pub async fn call(
        &mut self,
        method: AMQPClass,
        accept: impl Fn(&AMQPClass) -> bool,
        what: &str,
    ) -> Result<AMQPClass, ClientError> {
        self.send(1, method).await?;
        self.expect(accept, what).await
    }

    async fn expect(
        &mut self,
        accept: impl Fn(&AMQPClass) -> bool,
        what: &str,
    ) -> Result<AMQPClass, ClientError> {
        loop {
            let m = self.read_method().await?;
            if accept(&m) {
                return Ok(m);
            }
            match m {
                AMQPClass::Connection(
                    connection::AMQPMethod::Blocked(_) | connection::AMQPMethod::Unblocked(_),
                )
                | AMQPClass::Basic(basic::AMQPMethod::Ack(_)) => continue,
                m => return Err(ClientError::Protocol(format!("expected {what}, got {m:?}"))),
            }
        }
    }

    /// Waits for connection.open-ok and returns its reserved shortstr (known-hosts), which
    /// the method decoder drops.
    async fn read_open_ok(&mut self) -> Result<String, ClientError> {
        loop {
            let f = self.read_frame().await?;
            if f.kind != FRAME_METHOD {
                continue;
            }
            if frame::method_ids(&f.payload) == Some((10, 41)) {
                let len = f.payload.get(4).copied().unwrap_or(0) as usize;
                let hosts = f.payload.get(5..5 + len).unwrap_or_default();
                return Ok(String::from_utf8_lossy(hosts).into_owned());
            }
            let (_, m) = amq_protocol::protocol::parse_class(&f.payload[..])
                .map_err(|e| ClientError::Protocol(format!("undecodable method: {e:?}")))?;
            return Err(match m {
                AMQPClass::Connection(connection::AMQPMethod::Close(c)) => ClientError::Closed {
                    scope: "connection",
                    code: c.reply_code,
                    text: c.reply_text.to_string(),
                },
                m => ClientError::Protocol(format!("expected connection.open-ok, got {m:?}")),
            });
        }
    }

    /// Reads the next frame.
    pub async fn read_frame(&mut self) -> Result<RawFrame, ClientError> {
        loop {
            match frame::split_frame(&mut self.rbuf, u32::MAX) {
                Ok(Some(f)) => return Ok(f),
                Ok(None) => {}
                Err(e) => return Err(ClientError::Protocol(e.to_string())),
            }
            if self.stream.read_buf(&mut self.rbuf).await? == 0 {
                return Err(ClientError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
        }
    }

    /// Reads the next method frame, skipping heartbeats; a close from the server is an error.
    pub async fn read_method(&mut self) -> Result<AMQPClass, ClientError> {
        loop {
            let f = self.read_frame().await?;
            if f.kind != FRAME_METHOD {
                continue;
            }
            let (_, m) = amq_protocol::protocol::parse_class(&f.payload[..])
                .map_err(|e| ClientError::Protocol(format!("undecodable method: {e:?}")))?;
            return match m {
                AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
                    Err(ClientError::Closed {
                        scope: "connection",
                        code: c.reply_code,
                        text: c.reply_text.to_string(),
                    })
                }
                AMQPClass::Channel(channel::AMQPMethod::Close(c)) => Err(ClientError::Closed {
                    scope: "channel",
                    code: c.reply_code,
                    text: c.reply_text.to_string(),
                }),
                m => Ok(m),
            };
        }
    }
}

/// Encodes basic.publish plus content into `out` without any allocation: the bench's inner loop.
pub fn encode_publish(
    out: &mut Vec<u8>,
    channel: u16,
    exchange: &str,
    routing_key: &str,
    persistent: bool,
    body: &[u8],
    frame_max: u32,
) {
    encode_publish_numbered(
        out,
        channel,
        exchange,
        routing_key,
        persistent,
        None,
        body,
        frame_max,
    );
}

/// [`encode_publish`] with the publish's number on its channel in the
/// [`crate::session::PUBLISH_SEQ_HEADER`] header (a session's resent publish, which the
/// broker drops if it processed it already) when `seq` is given.
#[allow(clippy::too_many_arguments)]
pub fn encode_publish_numbered(
    out: &mut Vec<u8>,
    channel: u16,
    exchange: &str,
    routing_key: &str,
    persistent: bool,
    seq: Option<u64>,
    body: &[u8],
    frame_max: u32,
) {
    let method_size = 4 + 2 + 1 + exchange.len() + 1 + routing_key.len() + 1;
    put_frame_header(out, FRAME_METHOD, channel, method_size);
    out.extend_from_slice(&[0, 60, 0, 40, 0, 0]);
    out.push(exchange.len() as u8);
    out.extend_from_slice(exchange.as_bytes());
    out.push(routing_key.len() as u8);
    out.extend_from_slice(routing_key.as_bytes());
    out.push(0);
    out.push(FRAME_END);
    let name = crate::session::PUBLISH_SEQ_HEADER.as_bytes();
    // The headers table: one entry, the name and a signed 64-bit integer ('l').
    let table = 1 + name.len() + 1 + 8;
    let headers_size = if seq.is_some() { 4 + table } else { 0 };
    let header_size = 2 + 2 + 8 + 2 + headers_size + usize::from(persistent);
    put_frame_header(out, FRAME_HEADER, channel, header_size);
    out.extend_from_slice(&[0, 60, 0, 0]);
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    // Property flags: headers is bit 13, delivery-mode bit 12; values in that order.
    let flags = (u16::from(seq.is_some()) << 13) | (u16::from(persistent) << 12);
    out.extend_from_slice(&flags.to_be_bytes());
    if let Some(seq) = seq {
        out.extend_from_slice(&(table as u32).to_be_bytes());
        out.push(name.len() as u8);
        out.extend_from_slice(name);
        out.push(b'l');
        out.extend_from_slice(&seq.to_be_bytes());
    }
    if persistent {
        out.push(2);
    }
    out.push(FRAME_END);
    let chunk = frame_max as usize - frame::FRAME_OVERHEAD;
    for part in body.chunks(chunk) {
        put_frame_header(out, FRAME_BODY, channel, part.len());
        out.extend_from_slice(part);
        out.push(FRAME_END);
    }
}

fn put_frame_header(out: &mut Vec<u8>, kind: u8, channel: u16, size: usize) {
    out.push(kind);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&(size as u32).to_be_bytes());
}

/// Encodes basic.ack.
pub fn encode_ack(out: &mut Vec<u8>, channel: u16, delivery_tag: u64, multiple: bool) {
    put_frame_header(out, FRAME_METHOD, channel, 13);
    out.extend_from_slice(&[0, 60, 0, 80]);
    out.extend_from_slice(&delivery_tag.to_be_bytes());
    out.push(u8::from(multiple));
    out.push(FRAME_END);
}

/// Reads the delivery tag of a basic.deliver payload; `None` for any other method.
pub fn deliver_tag(payload: &[u8]) -> Option<u64> {
    if payload.get(..4)? != [0, 60, 0, 60] {
        return None;
    }
    let tag_len = usize::from(*payload.get(4)?);
    let at = 5 + tag_len;
    Some(u64::from_be_bytes(
        payload.get(at..at + 8)?.try_into().ok()?,
    ))
}

/// Reads (delivery-tag, multiple, ack?) of a basic.ack or basic.nack payload.
pub fn confirm_of(payload: &[u8]) -> Option<(u64, bool, bool)> {
    let ack = match payload.get(..4)? {
        [0, 60, 0, 80] => true,
        [0, 60, 0, 120] => false,
        _ => return None,
    };
    let tag = u64::from_be_bytes(payload.get(4..12)?.try_into().ok()?);
    Some((tag, payload.get(12)? & 1 == 1, ack))
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::{AMQPFrame, parse_frame};

    #[test]
    fn encoded_publish_decodes_as_publish_header_and_body() {
        let mut out = Vec::new();
        encode_publish(&mut out, 1, "ex", "rk", true, &[9u8; 10], 4096);
        let (rest, m) = parse_frame(out.as_slice()).unwrap();
        let AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Publish(p))) = m else {
            panic!("{m:?}")
        };
        assert_eq!((p.exchange.as_str(), p.routing_key.as_str()), ("ex", "rk"));
        let (rest, h) = parse_frame(rest).unwrap();
        let AMQPFrame::Header(1, h) = h else { panic!() };
        assert_eq!((h.body_size, *h.properties.delivery_mode()), (10, Some(2)));
        let (rest, b) = parse_frame(rest).unwrap();
        assert!(matches!(b, AMQPFrame::Body(1, ref v) if v.len() == 10));
        assert!(rest.is_empty());
    }

    #[test]
    fn a_numbered_publish_carries_its_number_in_the_header_amq_protocol_decodes() {
        for persistent in [false, true] {
            let mut out = Vec::new();
            encode_publish_numbered(&mut out, 2, "", "q", persistent, Some(41), b"x", 4096);
            let (rest, _) = parse_frame(out.as_slice()).unwrap();
            let (_, h) = parse_frame(rest).unwrap();
            let AMQPFrame::Header(2, h) = h else { panic!() };
            let headers = h.properties.headers().clone().expect("headers");
            assert_eq!(
                headers.inner().get(crate::session::PUBLISH_SEQ_HEADER),
                Some(&crate::amqp::AMQPValue::LongLongInt(41))
            );
            assert_eq!(
                *h.properties.delivery_mode(),
                persistent.then_some(2),
                "delivery mode after headers"
            );
        }
    }

    #[test]
    fn ack_round_trips_through_confirm_of() {
        let mut out = Vec::new();
        encode_ack(&mut out, 1, 77, true);
        assert_eq!(confirm_of(&out[7..out.len() - 1]), Some((77, true, true)));
    }
}
