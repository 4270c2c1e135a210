//! Frames on a socket: splitting what arrives, encoding what leaves (with `amq-protocol`'s
//! codec), and the handshake that opens or resumes a session.

use crate::Error;
use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame};
use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::{AMQPValue, FieldTable};
use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;

const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const FRAME_BODY: u8 = 3;
const FRAME_HEARTBEAT: u8 = 8;
const FRAME_END: u8 = 0xCE;
/// The frame size this client asks for (the broker's default).
pub(crate) const FRAME_MAX: u32 = 131_072;

/// Where to connect and as whom, from an `amqp://user:pass@host:port/vhost` URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub addr: String,
    pub user: String,
    pub password: String,
    pub vhost: String,
}

impl Target {
    pub fn parse(uri: &str) -> Result<Target, Error> {
        let u: amq_protocol::uri::AMQPUri = uri
            .parse()
            .map_err(|e: String| Error::Uri(format!("{uri}: {e}")))?;
        Ok(Target {
            addr: format!("{}:{}", u.authority.host, u.authority.port),
            user: u.authority.userinfo.username,
            password: u.authority.userinfo.password,
            vhost: u.vhost,
        })
    }

    /// The same credentials and vhost at another address (a failover candidate).
    pub fn at(&self, addr: &str) -> Target {
        Target {
            addr: addr.to_owned(),
            ..self.clone()
        }
    }
}

/// One frame as it arrived.
#[derive(Debug)]
pub(crate) enum Incoming {
    Method(u16, AMQPClass),
    Header(u16, u64, AMQPProperties),
    Body(u16, Bytes),
    Heartbeat,
}

/// An open connection's socket and buffers. Writes go through a task of their own once the
/// connection is open ([`Wire::start_writer`]), so that a full socket never stops the reading.
pub(crate) struct Wire {
    read: OwnedReadHalf,
    write: Option<OwnedWriteHalf>,
    writer: Option<mpsc::UnboundedSender<Vec<u8>>>,
    rbuf: BytesMut,
    /// Encoded frames not yet written.
    pub out: Vec<u8>,
    pub frame_max: u32,
    /// Negotiated heartbeat, seconds (0: none).
    pub heartbeat_s: u16,
    /// The highest channel number the broker allows.
    pub channel_max: u16,
}

impl Wire {
    /// Connects to `target` and opens `target.vhost`, presenting `session` (the
    /// `qpid.session.*` client properties). Returns the wire and open-ok's known-hosts.
    pub async fn open(
        target: &Target,
        session: FieldTable,
        heartbeat_s: u16,
    ) -> Result<(Wire, String), Error> {
        let stream = TcpStream::connect(&target.addr).await?;
        stream.set_nodelay(true)?;
        let (read, write) = stream.into_split();
        let mut w = Wire {
            read,
            write: Some(write),
            writer: None,
            rbuf: BytesMut::with_capacity(64 * 1024),
            out: Vec::new(),
            frame_max: FRAME_MAX,
            heartbeat_s: 0,
            channel_max: u16::MAX,
        };
        w.out.extend_from_slice(b"AMQP\x00\x00\x09\x01");
        w.flush().await?;
        w.expect(|m| matches!(m, AMQPClass::Connection(connection::AMQPMethod::Start(_))))
            .await?;
        let mut caps = FieldTable::default();
        for cap in [
            "publisher_confirms",
            "consumer_cancel_notify",
            "connection.blocked",
            "authentication_failure_close",
            // It hides, by their identity, deliveries its application already had
            // (`book.rs`): the broker may send a message held for its session under the
            // flag of the delivery that was lost.
            "ringmq.recognises_redeliveries",
        ] {
            caps.insert(cap.into(), AMQPValue::Boolean(true));
        }
        let mut props = session;
        props.insert(
            "product".into(),
            AMQPValue::LongString("ringmq-client".into()),
        );
        props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
        w.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: props,
                mechanism: "PLAIN".into(),
                response: format!("\0{}\0{}", target.user, target.password).into(),
                locale: "en_US".into(),
            })),
        );
        w.flush().await?;
        let tune = match w
            .expect(|m| matches!(m, AMQPClass::Connection(connection::AMQPMethod::Tune(_))))
            .await?
        {
            AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => t,
            _ => unreachable!("expect returned what it accepts"),
        };
        if tune.frame_max != 0 {
            w.frame_max = tune.frame_max.min(FRAME_MAX);
        }
        if tune.channel_max != 0 {
            w.channel_max = tune.channel_max;
        }
        w.heartbeat_s = match (heartbeat_s, tune.heartbeat) {
            (0, _) => 0,
            (mine, 0) => mine,
            (mine, theirs) => mine.min(theirs),
        };
        w.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: tune.channel_max,
                frame_max: w.frame_max,
                heartbeat: w.heartbeat_s,
            })),
        );
        w.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: target.vhost.as_str().into(),
            })),
        );
        w.flush().await?;
        let known_hosts = w.open_ok().await?;
        w.start_writer();
        Ok((w, known_hosts))
    }

    /// Reads methods until one `accept`s; a `connection.close` is the broker's refusal.
    async fn expect(&mut self, accept: impl Fn(&AMQPClass) -> bool) -> Result<AMQPClass, Error> {
        loop {
            if let Incoming::Method(_, m) = self.read().await? {
                if accept(&m) {
                    return Ok(m);
                }
                if let AMQPClass::Connection(connection::AMQPMethod::Close(c)) = m {
                    return Err(Error::Refused {
                        code: c.reply_code,
                        text: c.reply_text.to_string(),
                    });
                }
                return Err(Error::Protocol(format!(
                    "unexpected {m:?} in the handshake"
                )));
            }
        }
    }

    /// connection.open-ok's reserved shortstr (known-hosts), which the codec drops.
    async fn open_ok(&mut self) -> Result<String, Error> {
        loop {
            let (kind, _, payload) = self.read_raw().await?;
            if kind != FRAME_METHOD {
                continue;
            }
            if payload.get(..4) == Some(&[0, 10, 0, 41]) {
                let len = usize::from(payload.get(4).copied().unwrap_or(0));
                let hosts = payload.get(5..5 + len).unwrap_or_default();
                return Ok(String::from_utf8_lossy(hosts).into_owned());
            }
            return match decode_method(&payload)? {
                AMQPClass::Connection(connection::AMQPMethod::Close(c)) => Err(Error::Refused {
                    code: c.reply_code,
                    text: c.reply_text.to_string(),
                }),
                m => Err(Error::Protocol(format!("expected open-ok, got {m:?}"))),
            };
        }
    }

    /// Queues a method frame.
    pub fn method(&mut self, channel: u16, method: AMQPClass) {
        self.frame(&AMQPFrame::Method(channel, method));
    }

    /// Queues a publish: method, content header, body frames.
    pub fn publish(
        &mut self,
        channel: u16,
        method: AMQPClass,
        properties: &AMQPProperties,
        body: &[u8],
    ) {
        self.method(channel, method);
        self.frame(&AMQPFrame::Header(
            channel,
            AMQPContentHeader {
                class_id: 60,
                body_size: body.len() as u64,
                properties: properties.clone(),
            },
        ));
        let chunk = (self.frame_max as usize).saturating_sub(8).max(1);
        for part in body.chunks(chunk) {
            self.out.push(FRAME_BODY);
            self.out.extend_from_slice(&channel.to_be_bytes());
            self.out
                .extend_from_slice(&(part.len() as u32).to_be_bytes());
            self.out.extend_from_slice(part);
            self.out.push(FRAME_END);
        }
    }

    /// Queues a heartbeat frame.
    pub fn heartbeat(&mut self) {
        self.out
            .extend_from_slice(&[FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END]);
    }

    fn frame(&mut self, frame: &AMQPFrame) {
        let buf = std::mem::take(&mut self.out);
        match gen_frame(frame)(WriteContext::from(buf)) {
            Ok(ctx) => self.out = ctx.write,
            Err(e) => panic!("encoding a frame this client built failed: {e:?}"),
        }
    }

    /// Writes what is queued: at once during the handshake, through the writer task after.
    pub async fn flush(&mut self) -> Result<(), Error> {
        if self.out.is_empty() {
            return Ok(());
        }
        if let Some(writer) = &self.writer {
            return writer
                .send(std::mem::take(&mut self.out))
                .map_err(|_| Error::Io(std::io::ErrorKind::BrokenPipe.into()));
        }
        if let Some(write) = self.write.as_mut() {
            write.write_all(&self.out).await?;
            self.out.clear();
        }
        Ok(())
    }

    /// Hands the write half to a task that writes what [`Wire::flush`] sends it, in order,
    /// until the socket fails or the wire is dropped.
    fn start_writer(&mut self) {
        let Some(mut write) = self.write.take() else {
            return;
        };
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        tokio::spawn(async move {
            while let Some(buf) = rx.recv().await {
                if write.write_all(&buf).await.is_err() {
                    return;
                }
            }
            let _ = write.shutdown().await;
        });
        self.writer = Some(tx);
    }

    /// The next frame, decoded.
    pub async fn read(&mut self) -> Result<Incoming, Error> {
        let (kind, channel, payload) = self.read_raw().await?;
        match kind {
            FRAME_METHOD => Ok(Incoming::Method(channel, decode_method(&payload)?)),
            FRAME_HEADER => {
                let (_, h) = amq_protocol::frame::parsing::parse_content_header(&payload[..])
                    .map_err(|e| Error::Protocol(format!("undecodable content header: {e:?}")))?;
                Ok(Incoming::Header(channel, h.body_size, h.properties))
            }
            FRAME_BODY => Ok(Incoming::Body(channel, payload)),
            FRAME_HEARTBEAT => Ok(Incoming::Heartbeat),
            other => Err(Error::Protocol(format!("unknown frame type {other}"))),
        }
    }

    async fn read_raw(&mut self) -> Result<(u8, u16, Bytes), Error> {
        loop {
            if self.rbuf.len() >= 7 {
                let size =
                    u32::from_be_bytes(self.rbuf[3..7].try_into().expect("4 bytes")) as usize;
                if self.rbuf.len() > 7 + size {
                    let kind = self.rbuf[0];
                    let channel = u16::from_be_bytes([self.rbuf[1], self.rbuf[2]]);
                    if self.rbuf[7 + size] != FRAME_END {
                        return Err(Error::Protocol("a frame without its frame-end".into()));
                    }
                    self.rbuf.advance(7);
                    let payload = self.rbuf.split_to(size).freeze();
                    self.rbuf.advance(1);
                    return Ok((kind, channel, payload));
                }
            }
            if self.read.read_buf(&mut self.rbuf).await? == 0 {
                return Err(Error::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
        }
    }
}

fn decode_method(payload: &[u8]) -> Result<AMQPClass, Error> {
    amq_protocol::protocol::parse_class(payload)
        .map(|(_, m)| m)
        .map_err(|e| Error::Protocol(format!("undecodable method: {e:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uri_names_the_address_the_login_and_the_vhost() {
        let t = Target::parse("amqp://u:p@127.0.0.1:5999/%2fprod").unwrap();
        assert_eq!(t.addr, "127.0.0.1:5999");
        assert_eq!((t.user.as_str(), t.password.as_str()), ("u", "p"));
        assert_eq!(t.vhost, "/prod");
        assert_eq!(t.at("10.0.0.2:5672").addr, "10.0.0.2:5672");
        assert!(Target::parse("http://x").is_err());
    }
}
