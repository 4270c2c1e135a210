//! One client connection: handshake, frame dispatch, channels, and writing what the vhost
//! hands back. A connection is one task; it reads a buffer full of frames, processes them
//! under one vhost lock, and answers with one write.

use super::channel::{BodyParts, ChannelCtx, HeldAck, HeldPublish, PendingPublish, Transaction};
use crate::broker::outbox::{Outbox, Pending};
use super::wiring::{self as shared_wiring, Awaited, Waiting, string_arg};
use crate::broker::stats::ConnStats;
use crate::broker::Broker;
use crate::clock::now_ms;
use crate::amqp::frame::{
    self, FRAME_BODY, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD, PROTOCOL_HEADER, RawFrame,
};
use crate::amqp::table_depth::{header_within_depth, method_within_depth};
use crate::amqp::writer::FrameWriter;
use crate::amqp::{
    AMQPClass, AMQPValue, FieldTable, ShortString, basic, channel, codes, confirm, connection,
    exchange, queue, tx,
};
use crate::auth::permissions::{Access, Permissions, Resource};
use crate::auth::{MECHANISM_EXTERNAL, MECHANISMS, User};
use crate::cluster::OpOutcome;
use crate::core::vhost::{Cancelled, Delivery};
use crate::core::{
    AmqpError, ChannelKey, Consume, Effects, ExchangeDeclare, Message, PublishOutcome,
    QueueDeclare, VHost,
};
use bytes::BytesMut;
use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Read buffer space for a busy connection: many frames per syscall.
const READ_CHUNK_BUSY: usize = 64 * 1024;
/// Read buffer space for a quiet one: idle connections must stay cheap.
const READ_CHUNK_IDLE: usize = 2 * 1024;
/// How long a publisher whose queue is backlogged waits before the broker reads from it again.
const FLOW_PAUSE: Duration = Duration::from_millis(1);
/// Most frames handled under one vhost lock before the task lets others run: a client
/// flooding tiny frames (64 KiB of heartbeats is 8,000 frames) must not hold the lock and
/// its worker thread for a whole read buffer while other connections wait.
const FRAMES_PER_BATCH: usize = 1024;
/// How long the broker waits for close-ok after it sent connection.close.
const CLOSE_OK_TIMEOUT: Duration = Duration::from_secs(1);

/// A connection-level failure: the broker sends connection.close with these and ends.
#[derive(Debug, Clone)]
struct ConnError {
    code: u16,
    text: String,
    class_id: u16,
    method_id: u16,
}

impl ConnError {
    fn new(code: u16, text: impl Into<String>) -> Self {
        Self {
            code,
            text: text.into(),
            class_id: 0,
            method_id: 0,
        }
    }
}

/// An error while handling one method: closes the channel or the connection, by its code.
#[derive(Debug)]
struct MethodError {
    error: AmqpError,
    class_id: u16,
    method_id: u16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Sent connection.start; waiting for start-ok.
    Start,
    /// Sent connection.tune; waiting for tune-ok.
    Tune,
    /// Waiting for connection.open.
    Open,
    /// Serving.
    Running,
    /// Sent connection.close; waiting for close-ok.
    Closing,
    /// Finished: flush and drop the socket.
    Done,
}

/// The vhost lock, taken at most once per batch of frames and only when needed.
struct Lazy<'a> {
    vhost: &'a Mutex<VHost>,
    guard: Option<MutexGuard<'a, VHost>>,
}

impl Lazy<'_> {
    fn get(&mut self) -> &mut VHost {
        self.guard.get_or_insert_with(|| self.vhost.lock())
    }
}

/// Client capabilities announced in start-ok that change what the broker sends.
#[derive(Debug, Default, Clone, Copy)]
struct ClientCaps {
    consumer_cancel_notify: bool,
    connection_blocked: bool,
    authentication_failure_close: bool,
}

/// What a TLS connection learnt in its handshake.
#[derive(Debug, Clone, Default)]
pub struct TlsPeer {
    /// The subject common name of the client certificate the broker verified: the user SASL
    /// EXTERNAL logs in as. None when the client presented no certificate (or it has no CN),
    /// and then EXTERNAL is not offered.
    pub external: Option<String>,
}

struct Connection {
    id: u64,
    /// Set for connections that came through the TLS listener.
    tls: Option<TlsPeer>,
    broker: Arc<Broker>,
    peer: SocketAddr,
    outbox: Arc<Outbox>,
    phase: Phase,
    frame_max: u32,
    channel_max: u16,
    heartbeat_s: u16,
    caps: ClientCaps,
    user: Option<User>,
    /// The user's permission on the open vhost, as of `perms_generation` of the user store.
    perms: Option<Arc<Permissions>>,
    perms_generation: u64,
    vhost: Option<Arc<Mutex<VHost>>>,
    vhost_name: String,
    channels: HashMap<u16, ChannelCtx>,
    writer: FrameWriter,
    fx: Effects,
    spare: Pending,
    /// Deliveries (count, body bytes) per channel buffered since the last socket write.
    written: HashMap<u16, (u32, u64)>,
    confirms: Vec<(u64, bool, bool)>,
    close_reason: String,
    blocked_sent: bool,
    publish_waits_for_unblock: bool,
    /// prefetch-size of the basic.qos being handled (amq-protocol does not decode it).
    qos_prefetch_size: u32,
    /// Held output: (length of the write buffer, journal sequence number) — the first
    /// `length` bytes may only be written once the journal is durable up to that number.
    /// Confirms of persistent messages and replies to durable declarations wait this way;
    /// output before them goes out at once.
    gates: std::collections::VecDeque<(usize, u64)>,
    /// Metrics counted during a batch, added to the broker's totals once per wake-up.
    stats: ConnStats,
    /// A wiring change sent through the cluster, not yet committed: the connection reads no
    /// further frames until it is, so later methods see its effect (as on one broker).
    cluster_wait: Option<ClusterWait>,
}

/// A method whose shared-wiring op is in flight through the cluster.
struct ClusterWait {
    channel: u16,
    class_id: u16,
    method_id: u16,
    waiting: Waiting,
    outcome: tokio::sync::oneshot::Receiver<OpOutcome>,
}

/// Serves one accepted socket until it closes: a plain TCP stream, or a TLS stream after its
/// handshake (`tls` then says what the handshake learnt). Generic so that the plaintext path
/// is compiled for `TcpStream` alone and pays nothing for TLS.
pub async fn serve<S>(broker: Arc<Broker>, stream: S, peer: SocketAddr, tls: Option<TlsPeer>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (id, outbox) = broker.register();
    let mut conn = Connection {
        id,
        tls,
        frame_max: broker.config.frame_max,
        channel_max: broker.config.channel_max,
        heartbeat_s: 0,
        broker: broker.clone(),
        peer,
        outbox,
        phase: Phase::Start,
        caps: ClientCaps::default(),
        user: None,
        perms: None,
        perms_generation: 0,
        vhost: None,
        vhost_name: String::new(),
        channels: HashMap::new(),
        writer: FrameWriter::default(),
        fx: Effects::default(),
        spare: Pending::default(),
        written: HashMap::new(),
        confirms: Vec::new(),
        close_reason: String::new(),
        blocked_sent: false,
        publish_waits_for_unblock: false,
        qos_prefetch_size: 0,
        gates: std::collections::VecDeque::new(),
        stats: ConnStats::default(),
        cluster_wait: None,
    };
    let result = conn.run(stream).await;
    conn.release();
    broker.unregister(id);
    conn.stats.closed(&broker.stats, id); // metrics
    let user = conn.user.as_ref().map(|u| u.name.as_str()).unwrap_or("-");
    match result {
        Ok(()) => {
            tracing::info!(conn = id, %peer, user, vhost = %conn.vhost_name, reason = %conn.close_reason, "connection closed")
        }
        Err(e) => {
            tracing::info!(conn = id, %peer, user, vhost = %conn.vhost_name, error = %e, "connection lost")
        }
    }
}

impl Connection {
    async fn run<S>(&mut self, mut stream: S) -> std::io::Result<()>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let handshake_deadline =
            Instant::now() + Duration::from_secs(self.broker.config.handshake_timeout_s);
        let mut header = [0u8; 8];
        match tokio::time::timeout_at(handshake_deadline.into(), stream.read_exact(&mut header))
            .await
        {
            Err(_) => {
                self.close_reason = "no protocol header before the handshake timeout".into();
                return Ok(());
            }
            Ok(r) => {
                r?;
            }
        }
        if &header != PROTOCOL_HEADER {
            // Spec §4.2.2: answer with the header we speak, then close.
            stream.write_all(PROTOCOL_HEADER).await?;
            stream.flush().await?;
            self.close_reason = format!("bad protocol header {header:?}");
            // Close gracefully: closing with unread input would reset the connection and
            // could discard the header before the client reads it.
            stream.shutdown().await?;
            let mut sink = [0u8; 4096];
            let drain = async {
                let mut total = 0;
                while let Ok(n @ 1..) = stream.read(&mut sink).await {
                    total += n;
                    if total > 64 * 1024 {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(CLOSE_OK_TIMEOUT, drain).await;
            return Ok(());
        }
        self.send_start();
        let mut rbuf = BytesMut::new();
        let mut read_chunk = READ_CHUNK_IDLE;
        let mut last_recv = Instant::now();
        let mut close_deadline: Option<Instant> = None;
        let mut heartbeat = tokio::time::interval(Duration::from_secs(3600));
        heartbeat.reset();
        let mut heartbeat_armed = false;
        let mut synced = self.broker.journal.synced();
        let stall = Duration::from_secs(self.broker.config.write_stall_timeout_s);
        let mut more_input = false;
        loop {
            self.stats.flush(&self.broker.stats); // metrics: once per wake-up
            let writable = self.writable(*synced.borrow());
            let held = writable < self.writer.len();
            if writable > 0 {
                self.stats.bytes_out += writable as u64; // metrics
                if !write_with_progress(&mut stream, &self.writer.as_slice()[..writable], stall)
                    .await?
                {
                    tracing::warn!(conn = self.id, peer = %self.peer, timeout_s = stall.as_secs(), "closing connection: the client stopped reading");
                    self.close_reason = format!(
                        "write stalled: the client read nothing for {} s",
                        stall.as_secs()
                    );
                    return Ok(());
                }
                self.writer.consume(writable);
                for (len, _) in self.gates.iter_mut() {
                    *len -= writable;
                }
                self.report_written();
                continue;
            }
            if self.phase == Phase::Done {
                return Ok(());
            }
            if self.phase == Phase::Closing && close_deadline.is_none() {
                close_deadline = Some(Instant::now() + CLOSE_OK_TIMEOUT);
            }
            if self.phase == Phase::Running && !heartbeat_armed && self.heartbeat_s > 0 {
                let period = Duration::from_millis(u64::from(self.heartbeat_s) * 500);
                heartbeat = tokio::time::interval_at((Instant::now() + period).into(), period);
                heartbeat_armed = true;
            }
            let deadline = match (self.phase, close_deadline) {
                (_, Some(d)) => d,
                (Phase::Running, None) => Instant::now() + Duration::from_secs(3600),
                _ => handshake_deadline,
            };
            if more_input {
                // The last batch stopped at its cap: let other tasks run, then go on with
                // the frames already read.
                tokio::task::yield_now().await;
                more_input = self.on_bytes(&mut rbuf);
                continue;
            }
            let paced = std::mem::take(&mut self.fx.backlogged);
            if paced {
                // Flow control: the queue this connection publishes to is backlogged.
                tokio::time::sleep(FLOW_PAUSE).await;
                continue;
            }
            let reading = !self.publish_waits_for_unblock && self.cluster_wait.is_none();
            if rbuf.capacity() - rbuf.len() < read_chunk / 2 {
                rbuf.reserve(read_chunk);
            }
            tokio::select! {
                r = synced.changed(), if held => {
                    if r.is_err() {
                        self.close_reason = "the journal stopped".into();
                        return Ok(());
                    }
                }
                r = stream.read_buf(&mut rbuf), if reading => {
                    let n = r?;
                    if n == 0 {
                        self.close_reason = "client closed the socket".into();
                        return Ok(());
                    }
                    // A read that filled most of the space asks for a bigger buffer next time.
                    read_chunk = if n >= read_chunk / 2 { READ_CHUNK_BUSY } else { READ_CHUNK_IDLE };
                    last_recv = Instant::now();
                    self.stats.bytes_in += n as u64; // metrics
                    more_input = self.on_bytes(&mut rbuf);
                }
                _ = self.outbox.notified() => self.drain_outbox(),
                outcome = committed(&mut self.cluster_wait) => {
                    self.on_committed(outcome);
                    self.on_bytes(&mut rbuf);
                }
                _ = heartbeat.tick(), if heartbeat_armed => {
                    let limit = Duration::from_secs(u64::from(self.heartbeat_s) * 2);
                    if last_recv.elapsed() > limit {
                        tracing::warn!(conn = self.id, peer = %self.peer, timeout_s = self.heartbeat_s, "missed heartbeats from client");
                        self.close_reason = "missed heartbeats".into();
                        return Ok(());
                    }
                    self.writer.heartbeat();
                }
                _ = tokio::time::sleep_until(deadline.into()) => {
                    self.close_reason = match self.phase {
                        Phase::Closing => "no close-ok after connection.close".into(),
                        Phase::Running => continue,
                        _ => "handshake timeout".into(),
                    };
                    return Ok(());
                }
            }
        }
    }

    // ---- frames ----------------------------------------------------------------------------

    /// Handles the complete frames in `rbuf`, at most [`FRAMES_PER_BATCH`] of them; returns
    /// whether it stopped at that cap (complete frames may remain).
    fn on_bytes(&mut self, rbuf: &mut BytesMut) -> bool {
        self.refresh_permissions();
        let vhost = self.vhost.clone();
        let mut lazy = vhost.as_deref().map(|vhost| Lazy { vhost, guard: None });
        let mut handled = 0;
        let mut capped = false;
        while matches!(
            self.phase,
            Phase::Start | Phase::Tune | Phase::Open | Phase::Running | Phase::Closing
        ) {
            if self.publish_waits_for_unblock || self.cluster_wait.is_some() {
                break;
            }
            if handled == FRAMES_PER_BATCH {
                capped = true;
                break;
            }
            handled += 1;
            let frame = match frame::split_frame(rbuf, self.frame_max) {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    rbuf.clear();
                    self.connection_error(ConnError::new(codes::FRAME_ERROR, e.to_string()));
                    break;
                }
            };
            if self.phase == Phase::Closing {
                self.on_frame_while_closing(&frame);
                continue;
            }
            let result = match (&mut lazy, self.phase) {
                (Some(lazy), Phase::Running) => self.on_frame(frame, lazy),
                _ => self.on_handshake_frame(frame),
            };
            if let Err(e) = result {
                self.connection_error(e);
            }
            // A handshake that just opened a vhost: take its lock from the next frame on.
            if lazy.is_none() && self.phase == Phase::Running {
                break;
            }
        }
        if let Some(mut lazy) = lazy
            && lazy.guard.is_some()
        {
            self.flush_confirms();
            let guard = lazy.guard.as_mut().expect("checked above");
            let gate = self.broker.finish_batch(self.id, guard, &mut self.fx);
            drop(lazy.guard.take());
            self.hold_output(gate);
            self.write_own_effects();
        }
        // Frames left behind by the handshake break above are processed now, with the lock.
        if self.phase == Phase::Running
            && !rbuf.is_empty()
            && self.vhost.is_some()
            && vhost.is_none()
        {
            return self.on_bytes(rbuf);
        }
        capped
    }

    /// Re-reads the user's permission when the store changed it (the admin API), so a
    /// change applies to the next command without a reconnect. One atomic load per batch.
    fn refresh_permissions(&mut self) {
        let generation = self.broker.users.permissions_generation();
        if generation == self.perms_generation {
            return;
        }
        self.perms_generation = generation;
        if let Some(user) = &self.user
            && self.vhost.is_some()
        {
            self.perms = self
                .broker
                .users
                .permissions_for(&user.name, &self.vhost_name);
        }
    }

    fn on_frame_while_closing(&mut self, frame: &RawFrame) {
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

    fn connection_error(&mut self, e: ConnError) {
        tracing::warn!(conn = self.id, peer = %self.peer, code = e.code, text = %e.text, "closing connection on error");
        self.close_reason = format!("{} {}", e.code, e.text);
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

    fn parse_method(frame: &RawFrame, max_table_depth: usize) -> Result<AMQPClass, ConnError> {
        let (class_id, method_id) = frame::method_ids(&frame.payload).ok_or_else(|| {
            ConnError::new(
                codes::FRAME_ERROR,
                "method frame shorter than its class and method ids",
            )
        })?;
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

    // ---- handshake -------------------------------------------------------------------------

    fn send_start(&mut self) {
        let mut caps = FieldTable::default();
        for cap in [
            "publisher_confirms",
            "exchange_exchange_bindings",
            "basic.nack",
            "consumer_cancel_notify",
            "connection.blocked",
            "authentication_failure_close",
            "per_consumer_qos",
        ] {
            caps.insert(cap.into(), AMQPValue::Boolean(true));
        }
        let mut props = FieldTable::default();
        let s = |v: &str| AMQPValue::LongString(v.into());
        props.insert("product".into(), s("ringmq"));
        props.insert("version".into(), s(env!("CARGO_PKG_VERSION")));
        props.insert("platform".into(), s("Rust"));
        props.insert("information".into(), s("A clustered AMQP 0-9-1 broker"));
        props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
        self.writer.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: props,
                mechanisms: self.mechanisms().into(),
                locales: "en_US".into(),
            })),
        );
    }

    /// PLAIN and AMQPLAIN always; EXTERNAL only on a TLS connection whose client presented a
    /// certificate the broker verified (as RabbitMQ's `rabbitmq_auth_mechanism_ssl`).
    fn mechanisms(&self) -> String {
        match self.tls.as_ref().and_then(|t| t.external.as_ref()) {
            Some(_) => format!("{MECHANISMS} {MECHANISM_EXTERNAL}"),
            None => MECHANISMS.to_owned(),
        }
    }

    fn on_handshake_frame(&mut self, frame: RawFrame) -> Result<(), ConnError> {
        if frame.kind == FRAME_HEARTBEAT {
            return Ok(());
        }
        if frame.kind != FRAME_METHOD || frame.channel != 0 {
            return Err(ConnError::new(
                codes::COMMAND_INVALID,
                "only connection methods are allowed before connection.open-ok",
            ));
        }
        let method = Self::parse_method(&frame, self.broker.config.max_table_depth)?;
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
        let at = |mut e: ConnError| {
            e.class_id = class_id;
            e.method_id = method_id;
            e
        };
        match (self.phase, method) {
            (Phase::Start, AMQPClass::Connection(connection::AMQPMethod::StartOk(ok))) => {
                self.on_start_ok(ok).map_err(at)
            }
            (Phase::Tune, AMQPClass::Connection(connection::AMQPMethod::TuneOk(ok))) => {
                self.on_tune_ok(ok).map_err(at)
            }
            (Phase::Open, AMQPClass::Connection(connection::AMQPMethod::Open(open))) => {
                self.on_open(open).map_err(at)
            }
            (_, AMQPClass::Connection(connection::AMQPMethod::Close(_))) => {
                self.writer.method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.close_reason = "client closed during the handshake".into();
                self.phase = Phase::Done;
                Ok(())
            }
            _ => Err(at(ConnError::new(
                codes::COMMAND_INVALID,
                "unexpected method during the handshake",
            ))),
        }
    }

    fn on_start_ok(&mut self, ok: connection::StartOk) -> Result<(), ConnError> {
        if let Some(AMQPValue::FieldTable(caps)) = ok.client_properties.inner().get("capabilities")
        {
            let on = |k: &str| matches!(caps.inner().get(k), Some(AMQPValue::Boolean(true)));
            self.caps = ClientCaps {
                consumer_cancel_notify: on("consumer_cancel_notify"),
                connection_blocked: on("connection.blocked"),
                authentication_failure_close: on("authentication_failure_close"),
            };
        }
        let mechanism = ok.mechanism.as_str();
        if !self.mechanisms().split(' ').any(|m| m == mechanism) {
            return Err(ConnError::new(
                codes::COMMAND_INVALID,
                format!("unknown authentication mechanism '{mechanism}'"),
            ));
        }
        let external = self.tls.as_ref().and_then(|t| t.external.as_deref());
        let result = match (mechanism, external) {
            (MECHANISM_EXTERNAL, Some(cn)) => {
                self.broker.users.authenticate_external(cn, self.peer.ip())
            }
            _ => self
                .broker
                .users
                .authenticate(mechanism, ok.response.as_bytes(), self.peer.ip()),
        };
        match result {
            Ok(user) => self.user = Some(user),
            Err(e) => {
                tracing::warn!(conn = self.id, peer = %self.peer, error = ?e, "login refused");
                let text = e.reply_text(mechanism);
                if self.caps.authentication_failure_close {
                    return Err(ConnError::new(codes::ACCESS_REFUSED, text));
                }
                // Without the capability, RabbitMQ just closes the socket.
                self.close_reason = text;
                self.phase = Phase::Done;
                return Ok(());
            }
        }
        let c = &self.broker.config;
        self.writer.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
                channel_max: c.channel_max,
                frame_max: c.frame_max,
                heartbeat: c.heartbeat_s,
            })),
        );
        self.phase = Phase::Tune;
        Ok(())
    }

    fn on_tune_ok(&mut self, ok: connection::TuneOk) -> Result<(), ConnError> {
        let c = &self.broker.config;
        if ok.frame_max != 0 && (ok.frame_max < frame::FRAME_MIN_SIZE || ok.frame_max > c.frame_max)
        {
            return Err(ConnError::new(
                codes::SYNTAX_ERROR,
                format!(
                    "frame_max={} outside the allowed range {}..={}",
                    ok.frame_max,
                    frame::FRAME_MIN_SIZE,
                    c.frame_max
                ),
            ));
        }
        if ok.channel_max > c.channel_max {
            return Err(ConnError::new(
                codes::NOT_ALLOWED,
                format!(
                    "channel_max={} is above the server's {}",
                    ok.channel_max, c.channel_max
                ),
            ));
        }
        self.frame_max = if ok.frame_max == 0 {
            c.frame_max
        } else {
            ok.frame_max
        };
        self.channel_max = if ok.channel_max == 0 {
            c.channel_max
        } else {
            ok.channel_max
        };
        self.heartbeat_s = ok.heartbeat;
        self.phase = Phase::Open;
        Ok(())
    }

    fn on_open(&mut self, open: connection::Open) -> Result<(), ConnError> {
        let name = open.virtual_host.as_str();
        let user = self.user.as_ref().expect("authenticated before open");
        let vhost = self.broker.vhost(name).filter(|_| user.may_open(name));
        let Some(vhost) = vhost else {
            return Err(ConnError::new(
                codes::NOT_ALLOWED,
                format!("vhost {name} not found"),
            ));
        };
        self.broker
            .connection_opened(self.id, self.peer, &user.name, name)
            .map_err(|limit| ConnError::new(codes::NOT_ALLOWED, limit))?;
        self.perms_generation = self.broker.users.permissions_generation();
        self.perms = self.broker.users.permissions_for(&user.name, name);
        self.vhost = Some(vhost);
        self.vhost_name = name.to_owned();
        // open-ok's reserved shortstr is 0-8's known-hosts: a cluster fills it with the
        // members' AMQP addresses, the failover candidates.
        let known_hosts = self
            .broker
            .cluster()
            .map(|c| c.known_hosts().join(","))
            .unwrap_or_default();
        self.writer.open_ok(&known_hosts);
        self.phase = Phase::Running;
        tracing::info!(conn = self.id, peer = %self.peer, user = %user.name, vhost = name, "connection opened");
        if self.broker.publishers_blocked() {
            self.send_blocked(true);
        }
        Ok(())
    }

    // ---- running ---------------------------------------------------------------------------

    fn on_frame(&mut self, frame: RawFrame, v: &mut Lazy) -> Result<(), ConnError> {
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

    fn on_connection_method(&mut self, method: AMQPClass, v: &mut Lazy) -> Result<(), ConnError> {
        match method {
            AMQPClass::Connection(connection::AMQPMethod::Close(close)) => {
                self.close_reason =
                    format!("client closed: {} {}", close.reply_code, close.reply_text);
                self.close_all_channels(v);
                // Exclusive queues go before close-ok, so a client that saw close-ok finds
                // them gone (RabbitMQ's order; a test relies on it).
                v.get().connection_closed(self.id, &mut self.fx);
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

    fn close_all_channels(&mut self, v: &mut Lazy) {
        let now = now_ms();
        let ids: Vec<u16> = self.channels.keys().copied().collect();
        for id in ids {
            if let Some(ch) = self.channels.remove(&id) {
                v.get().channel_close(ch.key, now, &mut self.fx);
            }
        }
        self.fx.deliveries.clear();
    }

    fn on_channel_method(
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
                let key = ChannelKey {
                    conn: self.id,
                    channel: id,
                };
                v.get().channel_open(key);
                self.channels.insert(id, ChannelCtx::new(key));
                self.writer.method(
                    id,
                    AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
                );
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
                // Both sides closed at once: answer and forget the channel.
                self.writer.method(
                    id,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
                self.channels.remove(&id);
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
        match self.handle(id, method, v) {
            Ok(()) => Ok(()),
            Err(MethodError {
                error,
                class_id,
                method_id,
            }) => {
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

    fn channel_error(
        &mut self,
        id: u16,
        error: AmqpError,
        class_id: u16,
        method_id: u16,
        v: &mut Lazy,
    ) {
        tracing::info!(conn = self.id, channel = id, code = error.code, text = %error.text, "closing channel on error");
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
    fn forget_channel(&mut self, key: ChannelKey, v: &mut Lazy) {
        v.get().channel_close(key, now_ms(), &mut self.fx);
        self.outbox.purge_channel(key.channel);
        self.fx.deliveries.retain(|d| d.channel != key);
        self.fx.cancelled.retain(|c| c.channel != key);
        self.written.remove(&key.channel);
    }

    fn handle(&mut self, id: u16, method: AMQPClass, v: &mut Lazy) -> Result<(), MethodError> {
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
        let err = |error: AmqpError| MethodError {
            error,
            class_id,
            method_id,
        };
        if let Some(cluster) = self.broker.cluster().cloned() {
            let ch = self.channels.get(&id).expect("checked by the caller");
            if let Some((op, waiting)) =
                shared_wiring::to_op(&method, ch, v.get(), cluster.node_id()).map_err(err)?
            {
                for (access, resource) in shared_wiring::required_access(&op) {
                    match &self.perms {
                        Some(p) => p
                            .check(access, resource)
                            .map_err(|e| err(AmqpError::access_refused(e.to_string())))?,
                        None => {
                            return Err(err(AmqpError::access_refused(
                                "the user's permission on this vhost was removed",
                            )));
                        }
                    }
                }
                let outcome = cluster.submit(&self.vhost_name, op);
                self.cluster_wait = Some(ClusterWait {
                    channel: id,
                    class_id,
                    method_id,
                    waiting,
                    outcome,
                });
                return Ok(());
            }
        }
        let now = now_ms();
        let ch = self.channels.get_mut(&id).expect("checked by the caller");
        let key = ch.key;
        let conn = self.id;
        let fx = &mut self.fx;
        let w = &mut self.writer;
        let reply = |w: &mut FrameWriter, m: AMQPClass| w.method(id, m);
        let need_queue = |ch: &ChannelCtx, name: &str| {
            ch.queue_name(name)
                .ok_or_else(|| err(AmqpError::not_found("no previously declared queue")))
        };
        let perms = &self.perms;
        let permit = |access: Access, resource: Resource| match perms {
            Some(p) => p
                .check(access, resource)
                .map_err(|e| err(AmqpError::access_refused(e.to_string()))),
            None => Err(err(AmqpError::access_refused(
                "the user's permission on this vhost was removed",
            ))),
        };
        match method {
            AMQPClass::Channel(m) => match m {
                channel::AMQPMethod::Close(_) => {
                    self.channels.remove(&id);
                    self.forget_channel(key, v);
                    reply(
                        &mut self.writer,
                        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                    );
                }
                channel::AMQPMethod::Flow(f) => {
                    v.get().channel_flow(key, f.active, now, fx);
                    reply(
                        w,
                        AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                            active: f.active,
                        })),
                    );
                }
                channel::AMQPMethod::FlowOk(_) => {}
                _ => {
                    return Err(err(AmqpError::new(
                        codes::COMMAND_INVALID,
                        "unexpected channel method",
                    )));
                }
            },
            AMQPClass::Exchange(m) => match m {
                exchange::AMQPMethod::Declare(d) => {
                    let nowait = d.nowait;
                    if !d.passive {
                        let name = d.exchange.as_str();
                        permit(Access::Configure, Resource::Exchange(name))?;
                        if let Some(ae) = string_arg(&d.arguments, "alternate-exchange") {
                            permit(Access::Read, Resource::Exchange(name))?;
                            permit(Access::Write, Resource::Exchange(ae))?;
                        }
                    }
                    v.get()
                        .exchange_declare(ExchangeDeclare {
                            name: d.exchange.to_string(),
                            kind: d.kind.to_string(),
                            passive: d.passive,
                            durable: d.durable,
                            auto_delete: d.auto_delete,
                            internal: d.internal,
                            arguments: d.arguments,
                        })
                        .map_err(err)?;
                    if !nowait {
                        reply(
                            w,
                            AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(
                                exchange::DeclareOk {},
                            )),
                        );
                    }
                }
                exchange::AMQPMethod::Delete(d) => {
                    permit(Access::Configure, Resource::Exchange(d.exchange.as_str()))?;
                    v.get()
                        .exchange_delete(d.exchange.as_str(), d.if_unused)
                        .map_err(err)?;
                    if !d.nowait {
                        reply(
                            w,
                            AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(
                                exchange::DeleteOk {},
                            )),
                        );
                    }
                }
                exchange::AMQPMethod::Bind(b) => {
                    permit(Access::Write, Resource::Exchange(b.destination.as_str()))?;
                    permit(Access::Read, Resource::Exchange(b.source.as_str()))?;
                    v.get()
                        .exchange_bind(
                            b.destination.as_str(),
                            b.source.as_str(),
                            b.routing_key.as_str(),
                            b.arguments,
                        )
                        .map_err(err)?;
                    if !b.nowait {
                        reply(
                            w,
                            AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {})),
                        );
                    }
                }
                exchange::AMQPMethod::Unbind(b) => {
                    permit(Access::Write, Resource::Exchange(b.destination.as_str()))?;
                    permit(Access::Read, Resource::Exchange(b.source.as_str()))?;
                    v.get()
                        .exchange_unbind(
                            b.destination.as_str(),
                            b.source.as_str(),
                            b.routing_key.as_str(),
                            b.arguments,
                        )
                        .map_err(err)?;
                    if !b.nowait {
                        reply(
                            w,
                            AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(
                                exchange::UnbindOk {},
                            )),
                        );
                    }
                }
                _ => {
                    return Err(err(AmqpError::new(
                        codes::COMMAND_INVALID,
                        "unexpected exchange method",
                    )));
                }
            },
            AMQPClass::Queue(m) => match m {
                queue::AMQPMethod::Declare(d) => {
                    let nowait = d.nowait;
                    if !d.passive {
                        let name = match d.queue.as_str() {
                            "" => v.get().next_server_queue_name(),
                            n => n.to_owned(),
                        };
                        permit(Access::Configure, Resource::Queue(&name))?;
                        if let Some(dlx) = string_arg(&d.arguments, "x-dead-letter-exchange") {
                            permit(Access::Read, Resource::Queue(&name))?;
                            permit(Access::Write, Resource::Exchange(dlx))?;
                        }
                    }
                    let created = !d.passive && v.get().queue(d.queue.as_str()).is_none(); // log
                    let declared = v
                        .get()
                        .queue_declare(
                            conn,
                            QueueDeclare {
                                name: d.queue.to_string(),
                                passive: d.passive,
                                durable: d.durable,
                                exclusive: d.exclusive,
                                auto_delete: d.auto_delete,
                                arguments: d.arguments,
                            },
                            now,
                        )
                        .map_err(err)?;
                    ch.last_queue = Some(declared.name.to_string());
                    if created {
                        tracing::info!(conn, channel = id, vhost = %v.get().name(), queue = %declared.name, "queue declared");
                    }
                    if !nowait {
                        reply(
                            w,
                            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                                queue: short(&declared.name),
                                message_count: declared.message_count,
                                consumer_count: declared.consumer_count,
                            })),
                        );
                    }
                }
                queue::AMQPMethod::Bind(b) => {
                    let q = need_queue(ch, b.queue.as_str())?;
                    let rk = if b.routing_key.as_str().is_empty() && b.queue.as_str().is_empty() {
                        q.clone()
                    } else {
                        b.routing_key.to_string()
                    };
                    permit(Access::Write, Resource::Queue(&q))?;
                    permit(Access::Read, Resource::Exchange(b.exchange.as_str()))?;
                    v.get()
                        .queue_bind(conn, &q, b.exchange.as_str(), &rk, b.arguments)
                        .map_err(err)?;
                    if !b.nowait {
                        reply(
                            w,
                            AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
                        );
                    }
                }
                queue::AMQPMethod::Unbind(b) => {
                    let q = need_queue(ch, b.queue.as_str())?;
                    permit(Access::Write, Resource::Queue(&q))?;
                    permit(Access::Read, Resource::Exchange(b.exchange.as_str()))?;
                    v.get()
                        .queue_unbind(
                            conn,
                            &q,
                            b.exchange.as_str(),
                            b.routing_key.as_str(),
                            b.arguments,
                        )
                        .map_err(err)?;
                    reply(
                        w,
                        AMQPClass::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {})),
                    );
                }
                queue::AMQPMethod::Purge(p) => {
                    let q = need_queue(ch, p.queue.as_str())?;
                    permit(Access::Read, Resource::Queue(&q))?;
                    let message_count = v.get().queue_purge(conn, &q, fx).map_err(err)?;
                    if !p.nowait {
                        reply(
                            w,
                            AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk {
                                message_count,
                            })),
                        );
                    }
                }
                queue::AMQPMethod::Delete(d) => {
                    let q = need_queue(ch, d.queue.as_str())?;
                    permit(Access::Configure, Resource::Queue(&q))?;
                    let message_count = v
                        .get()
                        .queue_delete(conn, &q, d.if_unused, d.if_empty, fx)
                        .map_err(err)?;
                    tracing::info!(conn, channel = id, vhost = %v.get().name(), queue = %q, "queue deleted");
                    if !d.nowait {
                        reply(
                            w,
                            AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                                message_count,
                            })),
                        );
                    }
                }
                _ => {
                    return Err(err(AmqpError::new(
                        codes::COMMAND_INVALID,
                        "unexpected queue method",
                    )));
                }
            },
            AMQPClass::Basic(m) => match m {
                basic::AMQPMethod::Publish(p) => {
                    if p.immediate {
                        return Err(err(AmqpError::new(
                            codes::NOT_IMPLEMENTED,
                            "immediate=true",
                        )));
                    }
                    permit(Access::Write, Resource::Exchange(p.exchange.as_str()))?;
                    ch.pending = Some(PendingPublish {
                        exchange: p.exchange.to_string(),
                        routing_key: p.routing_key.to_string(),
                        mandatory: p.mandatory,
                        header: None,
                        body: BodyParts::Empty,
                    });
                }
                basic::AMQPMethod::Qos(q) => {
                    v.get().basic_qos(
                        key,
                        self.qos_prefetch_size,
                        q.prefetch_count,
                        q.global,
                        now,
                        fx,
                    );
                    reply(
                        w,
                        AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
                    );
                }
                basic::AMQPMethod::Consume(c) => {
                    let q = need_queue(ch, c.queue.as_str())?;
                    permit(Access::Read, Resource::Queue(&q))?;
                    let nowait = c.nowait;
                    let tag = v
                        .get()
                        .basic_consume(
                            key,
                            Consume {
                                queue: q,
                                tag: c.consumer_tag.to_string(),
                                no_ack: c.no_ack,
                                exclusive: c.exclusive,
                            },
                            now,
                            fx,
                        )
                        .map_err(err)?;
                    if !nowait {
                        // consume-ok must precede the first delivery: put it before them.
                        reply(
                            w,
                            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                                consumer_tag: short(&tag),
                            })),
                        );
                    }
                }
                basic::AMQPMethod::Cancel(c) => {
                    v.get().basic_cancel(key, c.consumer_tag.as_str(), now, fx);
                    if !c.nowait {
                        reply(
                            w,
                            AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                                consumer_tag: c.consumer_tag,
                            })),
                        );
                    }
                }
                basic::AMQPMethod::Get(g) => {
                    let q = need_queue(ch, g.queue.as_str())?;
                    permit(Access::Read, Resource::Queue(&q))?;
                    match v.get().basic_get(key, &q, g.no_ack, now, fx).map_err(err)? {
                        None => reply(
                            w,
                            AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
                        ),
                        Some(mut got) => {
                            got.message = self.broker.resolve_message(got.message);
                            self.stats.delivered += 1; // metrics
                            self.stats.redelivered += u64::from(got.redelivered); // metrics
                            reply(
                                w,
                                AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
                                    delivery_tag: got.delivery_tag,
                                    redelivered: got.redelivered,
                                    exchange: got.message.exchange.clone(),
                                    routing_key: got.message.routing_key.clone(),
                                    message_count: got.message_count,
                                })),
                            );
                            w.header_payload(id, &got.message.header_payload);
                            w.body(id, got.message.body.bytes(), self.frame_max);
                        }
                    }
                }
                basic::AMQPMethod::Ack(a) => match &mut ch.tx {
                    Some(tx) => tx.acks.push(HeldAck::Ack {
                        tag: a.delivery_tag,
                        multiple: a.multiple,
                    }),
                    None => {
                        let acked = v.get().ackable(key, a.delivery_tag, a.multiple); // metrics
                        v.get()
                            .basic_ack(key, a.delivery_tag, a.multiple, now, fx)
                            .map_err(err)?;
                        self.stats.acked += acked as u64; // metrics
                    }
                },
                basic::AMQPMethod::Nack(n) => match &mut ch.tx {
                    Some(tx) => tx.acks.push(HeldAck::Nack {
                        tag: n.delivery_tag,
                        multiple: n.multiple,
                        requeue: n.requeue,
                    }),
                    None => v
                        .get()
                        .basic_nack(key, n.delivery_tag, n.multiple, n.requeue, now, fx)
                        .map_err(err)?,
                },
                basic::AMQPMethod::Reject(r) => match &mut ch.tx {
                    Some(tx) => tx.acks.push(HeldAck::Nack {
                        tag: r.delivery_tag,
                        multiple: false,
                        requeue: r.requeue,
                    }),
                    None => v
                        .get()
                        .basic_nack(key, r.delivery_tag, false, r.requeue, now, fx)
                        .map_err(err)?,
                },
                basic::AMQPMethod::Recover(r) => {
                    if !r.requeue {
                        return Err(err(AmqpError::new(codes::NOT_IMPLEMENTED, "requeue=false")));
                    }
                    v.get().basic_recover(key, now, fx);
                    reply(
                        w,
                        AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
                    );
                }
                basic::AMQPMethod::RecoverAsync(r) => {
                    if !r.requeue {
                        return Err(err(AmqpError::new(codes::NOT_IMPLEMENTED, "requeue=false")));
                    }
                    v.get().basic_recover(key, now, fx);
                }
                _ => {
                    return Err(err(AmqpError::new(
                        codes::COMMAND_INVALID,
                        "unexpected basic method",
                    )));
                }
            },
            AMQPClass::Confirm(confirm::AMQPMethod::Select(s)) => {
                if ch.tx.is_some() {
                    return Err(err(AmqpError::precondition(
                        "cannot switch from tx to confirm mode",
                    )));
                }
                ch.confirm = true;
                if !s.nowait {
                    reply(
                        w,
                        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
                    );
                }
            }
            AMQPClass::Tx(m) => match m {
                tx::AMQPMethod::Select(_) => {
                    if ch.confirm {
                        return Err(err(AmqpError::precondition(
                            "cannot switch from confirm to tx mode",
                        )));
                    }
                    ch.tx.get_or_insert_with(Transaction::default);
                    reply(w, AMQPClass::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})));
                }
                tx::AMQPMethod::Commit(_) => {
                    let Some(held) = ch.tx.replace(Transaction::default()) else {
                        return Err(err(AmqpError::precondition("channel is not transactional")));
                    };
                    self.commit(id, held, v).map_err(err)?;
                    reply(
                        &mut self.writer,
                        AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})),
                    );
                }
                tx::AMQPMethod::Rollback(_) => {
                    if ch.tx.replace(Transaction::default()).is_none() {
                        return Err(err(AmqpError::precondition("channel is not transactional")));
                    }
                    reply(
                        w,
                        AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})),
                    );
                }
                _ => {
                    return Err(err(AmqpError::new(
                        codes::COMMAND_INVALID,
                        "unexpected tx method",
                    )));
                }
            },
            _ => {
                return Err(err(AmqpError::new(
                    codes::NOT_IMPLEMENTED,
                    format!("method {class_id}.{method_id} is not supported"),
                )));
            }
        }
        Ok(())
    }

    fn commit(&mut self, id: u16, held: Transaction, v: &mut Lazy) -> Result<(), AmqpError> {
        let now = now_ms();
        let key = ChannelKey {
            conn: self.id,
            channel: id,
        };
        for p in held.publishes {
            let outcome = v.get().publish(
                &p.exchange,
                &p.routing_key,
                p.message.clone(),
                now,
                &mut self.fx,
            )?;
            match outcome {
                PublishOutcome::Routed => self.stats.routed += 1, // metrics
                PublishOutcome::Unroutable => self.stats.unroutable += 1, // metrics
                PublishOutcome::Rejected => {}
            }
            if p.mandatory && outcome == PublishOutcome::Unroutable {
                self.send_return(id, &p.message);
            }
        }
        for a in held.acks {
            match a {
                HeldAck::Ack { tag, multiple } => {
                    v.get().basic_ack(key, tag, multiple, now, &mut self.fx)?
                }
                HeldAck::Nack {
                    tag,
                    multiple,
                    requeue,
                } => v
                    .get()
                    .basic_nack(key, tag, multiple, requeue, now, &mut self.fx)?,
            }
        }
        Ok(())
    }

    // ---- content ---------------------------------------------------------------------------

    fn on_content(&mut self, frame: RawFrame, v: &mut Lazy) -> Result<(), ConnError> {
        let id = frame.channel;
        let class_id = 60;
        let method_id = 40;
        let unexpected = |what: &str| ConnError {
            code: codes::UNEXPECTED_FRAME,
            text: format!("{what} on channel {id} without a preceding basic.publish"),
            class_id,
            method_id,
        };
        let Some(ch) = self.channels.get_mut(&id) else {
            return Err(ConnError::new(
                codes::CHANNEL_ERROR,
                format!("content on channel {id}, which is not open"),
            ));
        };
        if ch.closing {
            return Ok(());
        }
        let Some(pending) = ch.pending.as_mut() else {
            return Err(unexpected(if frame.kind == FRAME_HEADER {
                "content header"
            } else {
                "content body"
            }));
        };
        if frame.kind == FRAME_HEADER {
            if pending.header.is_some() {
                return Err(ConnError {
                    code: codes::UNEXPECTED_FRAME,
                    text: "second content header for one message".into(),
                    class_id,
                    method_id,
                });
            }
            let max_depth = self.broker.config.max_table_depth;
            if !header_within_depth(&frame.payload, max_depth) {
                return Err(ConnError {
                    code: codes::SYNTAX_ERROR,
                    text: format!("message headers nested deeper than {max_depth} levels"),
                    class_id,
                    method_id,
                });
            }
            let header =
                match amq_protocol::frame::parsing::parse_content_header(&frame.payload[..]) {
                    Ok(([], h)) => h,
                    _ => {
                        return Err(ConnError {
                            code: codes::FRAME_ERROR,
                            text: "could not decode the content header".into(),
                            class_id,
                            method_id,
                        });
                    }
                };
            if header.class_id != 60 {
                return Err(ConnError {
                    code: codes::FRAME_ERROR,
                    text: format!("content header of class {}", header.class_id),
                    class_id,
                    method_id,
                });
            }
            if header.body_size > self.broker.config.max_message_size {
                let max = self.broker.config.max_message_size;
                let text = format!(
                    "message size {} is larger than configured max size {max}",
                    header.body_size
                );
                self.channel_error(id, AmqpError::precondition(text), class_id, method_id, v);
                return Ok(());
            }
            pending.header = Some((header.properties, frame.payload, header.body_size));
        } else {
            let Some((_, _, size)) = &pending.header else {
                return Err(ConnError {
                    code: codes::UNEXPECTED_FRAME,
                    text: "content body before its header".into(),
                    class_id,
                    method_id,
                });
            };
            let size = *size as usize;
            if pending.body.len() + frame.payload.len() > size {
                return Err(ConnError {
                    code: codes::FRAME_ERROR,
                    text: format!("content body longer than the {size} bytes its header announced"),
                    class_id,
                    method_id,
                });
            }
            pending.body.push(frame.payload, size);
        }
        let complete =
            matches!(&pending.header, Some((_, _, size)) if pending.body.len() as u64 == *size);
        if complete {
            let p = ch.pending.take().expect("checked above");
            self.on_publish(id, p, v);
        }
        Ok(())
    }

    fn on_publish(&mut self, id: u16, p: PendingPublish, v: &mut Lazy) {
        let (class_id, method_id) = (60, 40);
        let (properties, header_payload, _) = p.header.expect("complete publish has a header");
        let message = match Message::new(
            short(&p.exchange),
            short(&p.routing_key),
            properties,
            header_payload,
            p.body.finish(),
        ) {
            Ok(m) => Arc::new(m),
            Err(e) => {
                self.channel_error(
                    id,
                    AmqpError::precondition(format!("invalid expiration '{}'", e.0)),
                    class_id,
                    method_id,
                    v,
                );
                return;
            }
        };
        self.stats.published += 1; // metrics
        if self.broker.publishers_blocked() && self.caps.connection_blocked {
            // Stop reading this publisher's socket until the watermark clears.
            self.publish_waits_for_unblock = true;
            self.stats.set_blocked(&self.broker.stats, self.id, true); // metrics
        }
        let ch = self
            .channels
            .get_mut(&id)
            .expect("publishing channel is open");
        if let Some(tx) = &mut ch.tx {
            if v.get().exchange(&p.exchange).is_none() {
                let text = format!(
                    "no exchange '{}' in vhost '{}'",
                    p.exchange, self.vhost_name
                );
                self.channel_error(id, AmqpError::not_found(text), class_id, method_id, v);
                return;
            }
            tx.publishes.push(HeldPublish {
                exchange: p.exchange,
                routing_key: p.routing_key,
                mandatory: p.mandatory,
                message,
            });
            return;
        }
        let outcome = v.get().publish(
            &p.exchange,
            &p.routing_key,
            message.clone(),
            now_ms(),
            &mut self.fx,
        );
        match outcome {
            Err(e) => self.channel_error(id, e, class_id, method_id, v),
            Ok(outcome) => {
                match outcome {
                    PublishOutcome::Routed => self.stats.routed += 1, // metrics
                    PublishOutcome::Unroutable => self.stats.unroutable += 1, // metrics
                    PublishOutcome::Rejected => {}
                }
                if p.mandatory && outcome == PublishOutcome::Unroutable {
                    self.send_return(id, &message);
                }
                let ch = self
                    .channels
                    .get_mut(&id)
                    .expect("publishing channel is open");
                if ch.confirm {
                    ch.publish_seq += 1;
                    ch.confirms
                        .push((ch.publish_seq, outcome != PublishOutcome::Rejected));
                }
            }
        }
    }

    fn send_return(&mut self, id: u16, message: &Message) {
        self.writer.method(
            id,
            AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                reply_code: codes::NO_ROUTE,
                reply_text: "NO_ROUTE".into(),
                exchange: message.exchange.clone(),
                routing_key: message.routing_key.clone(),
            })),
        );
        self.writer.header_payload(id, &message.header_payload);
        self.writer.body(id, message.body.bytes(), self.frame_max);
    }

    fn flush_confirms(&mut self) {
        for (id, ch) in &mut self.channels {
            if ch.confirms.is_empty() {
                continue;
            }
            self.confirms.clear();
            self.stats.confirmed += ch.confirms.len() as u64; // metrics
            ch.take_confirms(&mut self.confirms);
            for &(tag, multiple, ack) in &self.confirms {
                let m = if ack {
                    basic::AMQPMethod::Ack(basic::Ack {
                        delivery_tag: tag,
                        multiple,
                    })
                } else {
                    basic::AMQPMethod::Nack(basic::Nack {
                        delivery_tag: tag,
                        multiple,
                        requeue: false,
                    })
                };
                self.writer.method(*id, AMQPClass::Basic(m));
            }
        }
    }

    // ---- output ----------------------------------------------------------------------------

    fn write_delivery(&mut self, d: &Delivery) {
        let id = d.channel.channel;
        match self.channels.get(&id) {
            Some(ch) if !ch.closing && ch.key == d.channel => {}
            _ => return,
        }
        let m = &d.message;
        self.writer.deliver(
            id,
            &d.consumer_tag,
            d.delivery_tag,
            d.redelivered,
            m.exchange.as_str(),
            m.routing_key.as_str(),
        );
        self.writer.header_payload(id, &m.header_payload);
        self.writer.body(id, m.body.bytes(), self.frame_max);
        let written = self.written.entry(id).or_insert((0, 0));
        written.0 += 1;
        written.1 += m.body.bytes().len() as u64;
        self.stats.delivered += 1; // metrics
        self.stats.redelivered += u64::from(d.redelivered); // metrics
    }

    fn write_cancel(&mut self, c: &Cancelled) {
        if self.caps.consumer_cancel_notify
            && self
                .channels
                .get(&c.channel.channel)
                .is_some_and(|ch| !ch.closing)
        {
            self.writer.method(
                c.channel.channel,
                AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                    consumer_tag: short(&c.tag),
                    nowait: true,
                })),
            );
        }
    }

    /// Writes the deliveries and notices the last batch produced for this connection itself.
    fn write_own_effects(&mut self) {
        let deliveries = std::mem::take(&mut self.fx.deliveries);
        for d in &deliveries {
            self.write_delivery(d);
        }
        self.fx.deliveries = deliveries;
        self.fx.deliveries.clear();
        let cancelled = std::mem::take(&mut self.fx.cancelled);
        for c in &cancelled {
            self.write_cancel(c);
        }
        self.fx.cancelled = cancelled;
        self.fx.cancelled.clear();
        self.fx.ops.clear();
    }

    fn drain_outbox(&mut self) {
        self.outbox.take(&mut self.spare);
        let mut pending = std::mem::take(&mut self.spare);
        for d in pending.deliveries.drain(..) {
            self.write_delivery(&d);
        }
        for c in pending.cancelled.drain(..) {
            self.write_cancel(&c);
        }
        if let Some(blocked) = pending.blocked.take() {
            self.send_blocked(blocked);
        }
        if !pending.close_channels.is_empty() {
            let closing: Vec<(u16, String)> = pending.close_channels.drain(..).collect();
            self.force_close_channels(closing);
        }
        if let Some((code, text)) = pending.close.take()
            && self.phase == Phase::Running
        {
            self.connection_error(ConnError::new(code, text));
        }
        self.spare = pending;
    }

    /// Answers a method whose shared-wiring op the cluster committed (or could not).
    fn on_committed(&mut self, outcome: Option<OpOutcome>) {
        let Some(wait) = self.cluster_wait.take() else {
            return;
        };
        let Some(vhost) = self.vhost.clone() else {
            return;
        };
        let mut v = Lazy {
            vhost: &vhost,
            guard: None,
        };
        let outcome = outcome.unwrap_or_else(|| {
            Err(AmqpError::new(
                codes::INTERNAL_ERROR,
                "the cluster layer stopped before the change was committed",
            ))
        });
        let open = self
            .channels
            .get(&wait.channel)
            .is_some_and(|ch| !ch.closing);
        match outcome {
            Ok((reply, gate)) if open => {
                if let Awaited::QueueDeclared(name) = &wait.waiting.awaited
                    && let Some(ch) = self.channels.get_mut(&wait.channel)
                {
                    ch.last_queue = Some(name.clone());
                }
                if !wait.waiting.nowait {
                    self.writer.method(
                        wait.channel,
                        shared_wiring::reply_method(&wait.waiting.awaited, &reply),
                    );
                }
                self.hold_output(gate);
            }
            Ok(_) => {}
            Err(e) if e.is_connection_error() => self.connection_error(ConnError {
                code: e.code,
                text: e.text,
                class_id: wait.class_id,
                method_id: wait.method_id,
            }),
            Err(e) => self.channel_error(wait.channel, e, wait.class_id, wait.method_id, &mut v),
        }
        if let Some(guard) = v.guard.as_mut() {
            let gate = self.broker.finish_batch(self.id, guard, &mut self.fx);
            drop(v.guard.take());
            self.hold_output(gate);
            self.write_own_effects();
        }
    }

    /// Closes channels an operator asked to close (admin API), as a channel error 320.
    fn force_close_channels(&mut self, channels: Vec<(u16, String)>) {
        let Some(vhost) = self.vhost.clone() else {
            return;
        };
        let mut v = Lazy {
            vhost: &vhost,
            guard: None,
        };
        for (id, reason) in channels {
            if self.channels.get(&id).is_some_and(|ch| !ch.closing) {
                self.channel_error(
                    id,
                    AmqpError::new(codes::CONNECTION_FORCED, reason),
                    0,
                    0,
                    &mut v,
                );
            }
        }
        if let Some(guard) = v.guard.as_mut() {
            let gate = self.broker.finish_batch(self.id, guard, &mut self.fx);
            drop(v.guard.take());
            self.hold_output(gate);
            self.write_own_effects();
        }
    }

    fn send_blocked(&mut self, blocked: bool) {
        if !blocked {
            self.publish_waits_for_unblock = false;
            self.stats.set_blocked(&self.broker.stats, self.id, false); // metrics
        }
        if !self.caps.connection_blocked
            || self.blocked_sent == blocked
            || self.phase != Phase::Running
        {
            return;
        }
        self.blocked_sent = blocked;
        let m = if blocked {
            connection::AMQPMethod::Blocked(connection::Blocked {
                reason: self.broker.blocked_reason().into(),
            })
        } else {
            connection::AMQPMethod::Unblocked(connection::Unblocked {})
        };
        self.writer.method(0, AMQPClass::Connection(m));
    }

    /// After a socket write: tells the vhost which deliveries left, so that consumers held
    /// back by the write window get more.
    fn report_written(&mut self) {
        if self.written.is_empty() {
            return;
        }
        let Some(vhost) = self.vhost.clone() else {
            return;
        };
        let now = now_ms();
        {
            let mut v = vhost.lock();
            for (channel, (count, bytes)) in self.written.drain() {
                v.delivered_written(
                    ChannelKey {
                        conn: self.id,
                        channel,
                    },
                    count,
                    bytes,
                    now,
                    &mut self.fx,
                );
            }
            let gate = self.broker.finish_batch(self.id, &mut v, &mut self.fx);
            drop(v);
            self.hold_output(gate);
        }
        self.write_own_effects();
    }

    /// Holds everything written so far until the journal is durable up to `gate`.
    fn hold_output(&mut self, gate: Option<u64>) {
        if let Some(seq) = gate {
            self.gates.push_back((self.writer.len(), seq));
        }
    }

    /// How many bytes of the write buffer may go out with the journal durable up to `synced`:
    /// all of it when no gate is unmet, else what came before the first unmet gate's batch.
    fn writable(&mut self, synced: u64) -> usize {
        let mut released = 0;
        while let Some(&(len, seq)) = self.gates.front() {
            if seq > synced {
                return released;
            }
            released = len;
            self.gates.pop_front();
        }
        self.writer.len()
    }

    /// The connection is gone: its channels close in the vhost (unacked messages requeued),
    /// its exclusive queues are deleted.
    fn release(&mut self) {
        let Some(vhost) = self.vhost.clone() else {
            return;
        };
        let now = now_ms();
        let mut v = vhost.lock();
        for ch in self.channels.values() {
            v.channel_close(ch.key, now, &mut self.fx);
        }
        v.connection_closed(self.id, &mut self.fx);
        self.fx.deliveries.retain(|d| d.channel.conn != self.id);
        self.fx.cancelled.retain(|c| c.channel.conn != self.id);
        self.broker.finish_batch(self.id, &mut v, &mut self.fx);
    }
}

/// The outcome of the in-flight cluster op, if there is one (pending forever otherwise, so
/// `select!` can always poll it). `None` means the cluster layer dropped the request.
async fn committed(wait: &mut Option<ClusterWait>) -> Option<OpOutcome> {
    match wait {
        Some(w) => (&mut w.outcome).await.ok(),
        None => std::future::pending().await,
    }
}

/// Writes `buf` and flushes (a no-op on TCP; it pushes the records rustls still holds).
/// Returns false when the socket took no byte for `stall`: a client that stopped reading
/// would otherwise hold this task, and what it was sent, forever.
async fn write_with_progress<S>(
    stream: &mut S,
    buf: &[u8],
    stall: Duration,
) -> std::io::Result<bool>
where
    S: AsyncWrite + Unpin,
{
    let mut at = 0;
    while at < buf.len() {
        match tokio::time::timeout(stall, stream.write(&buf[at..])).await {
            Err(_) => return Ok(false),
            Ok(Ok(0)) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(Ok(n)) => at += n,
            Ok(Err(e)) => return Err(e),
        }
    }
    match tokio::time::timeout(stall, stream.flush()).await {
        Err(_) => Ok(false),
        Ok(r) => r.map(|()| true),
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
fn reply_text(code: u16, text: &str) -> String {
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
fn short(s: &str) -> ShortString {
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    ShortString::from(&s[..end])
}
