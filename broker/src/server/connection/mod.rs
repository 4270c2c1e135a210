//! One client connection. A connection is one task: it reads a buffer full of frames,
//! handles them under one vhost lock, and answers with one write. This file is the task —
//! the socket loop and the batch of frames; the rest is split by job:
//!
//! * [`handshake`]: connection.start … open-ok;
//! * [`frames`]: frame dispatch, channel lifecycle, connection and channel errors;
//! * [`wiring`]: exchange and queue methods, each one [`crate::core::WiringOp`] applied here or
//!   committed through the cluster;
//! * [`basic`]: consume, get, ack and the other basic methods;
//! * [`publish`]: content frames into messages, routed;
//! * [`proxied`]: methods on queues whose primary is another cluster member;
//! * [`tx`]: transactions and publisher confirms;
//! * [`output`]: deliveries, notices and mailbox items onto the write buffer, and the end of
//!   every batch — where output is held behind the [`ConfirmGate`].

mod basic;
mod dead_letters;
mod foreign;
mod fragmented;
mod frames;
mod handshake;
mod not_found;
mod output;
mod proxied;
mod publish;
mod replica;
mod session_status;
mod tx;
mod wiring;

use super::channel::ChannelCtx;
use super::confirm_gate::{ConfirmGate, Progress};
use crate::amqp::codes;
use crate::amqp::frame::{self, PROTOCOL_HEADER};
use crate::amqp::writer::FrameWriter;
use crate::auth::User;
use crate::auth::permissions::Permissions;
use crate::broker::Broker;
use crate::broker::outbox::{Outbox, Pending};
use crate::broker::stats::ConnStats;
use crate::clock::now_ms;
use crate::core::FastHashMap;
use crate::core::{Effects, VHost};
use crate::proxy::forward::ForwardTracker;
use crate::proxy::upstream::{ProxiedDelivery, Upstream};
use crate::session::directory::SessionOp;
use bytes::BytesMut;
use frames::ConnError;
use parking_lot::{Mutex, MutexGuard};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// How often a connection whose forwarded publish failed looks whether a queue's primary
/// moved (the election it waits for before it closes).
const ELECTION_POLL: Duration = Duration::from_millis(20);

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
/// How long the broker waits for close-ok after it sent connection.close, and for the client
/// to close its side after the broker's last word.
const CLOSE_OK_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest wait for what a client's close-ok is held behind (the journal's fsync, a
/// cluster op retiring its exclusive queues) before the socket closes without it.
const CLOSE_HOLD_TIMEOUT: Duration = Duration::from_secs(10);
/// Most bytes read and dropped while waiting for a finished client to close its side.
const MAX_DRAIN_BYTES: usize = 64 * 1024;
/// Most publishes of one connection forwarded to other members and not yet confirmed by
/// them: past it the connection stops reading (a slow link pushes back on its publishers).
const MAX_FORWARDS_IN_FLIGHT: usize = 8192;
/// Longest wait, after a session's connection is lost, for the primaries its last forwarded
/// publishes went to: their confirms are decided before the session keeps the channel
/// (undecided ones count as nacks). A resume waits that long at most (405 until then).
const FORWARD_SETTLE_LIMIT: Duration = Duration::from_secs(5);

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

/// The vhost lock, taken at most once per batch of frames and only when needed — and the
/// batch's clock, read once: a batch of a thousand publishes and acks would otherwise read
/// it for each (5% of the broker's CPU on small messages), and TTLs count in milliseconds.
struct Lazy<'a> {
    vhost: &'a Mutex<VHost>,
    guard: Option<MutexGuard<'a, VHost>>,
    now_ms: Option<u64>,
}

impl<'a> Lazy<'a> {
    fn new(vhost: &'a Mutex<VHost>) -> Self {
        Lazy {
            vhost,
            guard: None,
            now_ms: None,
        }
    }

    fn get(&mut self) -> &mut VHost {
        self.guard.get_or_insert_with(|| self.vhost.lock())
    }

    /// The time of this batch, in milliseconds since the epoch, read at its first use. It
    /// does not take the lock: a command asks for the time before it takes the locks it
    /// needs, and taking the vhost's there would change the order in which it takes them
    /// (a version that did saw a restarting cluster member hang once in CI).
    fn now_ms(&mut self) -> u64 {
        *self.now_ms.get_or_insert_with(now_ms)
    }
}

/// Client capabilities announced in start-ok that change what the broker sends.
#[derive(Debug, Default, Clone, Copy)]
struct ClientCaps {
    consumer_cancel_notify: bool,
    connection_blocked: bool,
    authentication_failure_close: bool,
    /// `ringmq.recognises_redeliveries`: the client recognises, by their identity,
    /// deliveries its application already had (the failover client; `core::queue::holds`).
    recognises_redeliveries: bool,
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
    /// The connection's id; a connection that resumed a session takes the session's owner
    /// id instead (`session.rs`), so that what the vhosts keep by connection follows it.
    id: u64,
    /// The resumable session this connection is attached to, if it asked for one.
    session: Option<crate::session::Attached>,
    /// Whether the session outlives this connection when it ends: yes after an abrupt end,
    /// a client's close with 330 (KEEP_SESSION) or the broker's close with 320; no after any
    /// other close.
    keep_session: bool,
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
    channels: FastHashMap<u16, ChannelCtx>,
    writer: FrameWriter,
    fx: Effects,
    spare: Pending,
    /// Deliveries (count, body bytes) per channel buffered since the last socket write.
    written: FastHashMap<u16, (u32, u64)>,
    confirms: Vec<(u64, bool, bool)>,
    close_reason: String,
    blocked_sent: bool,
    publish_waits_for_unblock: bool,
    /// prefetch-size of the basic.qos being handled (amq-protocol does not decode it).
    qos_prefetch_size: u32,
    /// Output written but held until what it promises is durable (confirms, commit-oks,
    /// replies to durable declarations): see [`ConfirmGate`].
    gate: ConfirmGate,
    /// Metrics counted during a batch, added to the broker's totals once per wake-up.
    stats: ConnStats,
    /// A wiring change sent through the cluster, not yet committed: the connection reads no
    /// further frames until it is, so later methods see its effect (as on one broker).
    cluster_wait: Option<wiring::ClusterWait>,
    /// A session start or resume waiting for the cluster's session directory.
    session_wait: Option<handshake::SessionWait>,
    /// This is another cluster member's link ([`crate::proxy::link`]): what it publishes is
    /// routed only into queues this member owns.
    link: bool,
    /// On whose behalf this connection publishes into fragmented queues
    /// ([`crate::core::VHost::publish_as`]): the member its session started on, or, on a
    /// link, the member the sender named last ([`crate::proxy::catch_up::origin`]); this
    /// member when `None`.
    publish_origin: Option<Arc<str>>,
    /// Publishes forwarded to the primaries of their queues, for the confirm gate.
    forwards: Arc<ForwardTracker>,
    /// The forwards the output held so far already waits for.
    forwards_held: u64,
    /// Some channel has publisher confirms waiting for forwards ([`ChannelCtx::awaiting`]).
    awaiting_confirms: bool,
    /// Upstream channels by (client channel, primary's node id).
    upstreams: HashMap<(u16, Arc<str>), Upstream>,
    /// Consumers on proxied queues by (client channel, consumer tag).
    remote_consumers: HashMap<(u16, Arc<str>), proxied::RemoteConsumer>,
    /// Deliveries from primaries that a channel's channel-wide prefetch holds back, by
    /// client channel, in arrival order ([`Connection::release_held`]).
    held: HashMap<u16, VecDeque<ProxiedDelivery>>,
    /// Serial number of the last proxied consumer.
    next_serial: u64,
    /// A proxied method in flight: no further frames are read until it is answered.
    remote_wait: Option<proxied::RemoteWait>,
    /// This batch confirmed a resent duplicate: its output also waits for the session's
    /// barrier (what the first confirm of that publish waited for).
    resent_confirmed: bool,
    /// Rejected messages of `at-least-once` queues held until their dead-lettered copies are
    /// safe, per batch in batch order (`dead_letters.rs`).
    dead_letters: VecDeque<dead_letters::PendingDeadLetters>,
}

/// How a connection's task ends with its socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Finish {
    /// The broker had the last word (close-ok, or the protocol header it speaks): shut the
    /// socket down and let the client close first ([`close_gracefully`]).
    Gracefully,
    /// The client is gone, or stopped reading, or never finished the handshake: drop it.
    Drop,
}

/// Serves one accepted socket until it closes: a plain TCP stream, or a TLS stream after its
/// handshake (`tls` then says what the handshake learnt). Generic so that the plaintext path
/// is compiled for `TcpStream` alone and pays nothing for TLS.
pub async fn serve<S>(broker: Arc<Broker>, mut stream: S, peer: SocketAddr, tls: Option<TlsPeer>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (id, outbox) = broker.register();
    let mut conn = Connection {
        id,
        session: None,
        keep_session: true,
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
        channels: FastHashMap::default(),
        writer: FrameWriter::default(),
        fx: Effects::default(),
        spare: Pending::default(),
        written: FastHashMap::default(),
        confirms: Vec::new(),
        close_reason: String::new(),
        blocked_sent: false,
        publish_waits_for_unblock: false,
        qos_prefetch_size: 0,
        gate: ConfirmGate::default(),
        stats: ConnStats::default(),
        cluster_wait: None,
        session_wait: None,
        link: false,
        publish_origin: None,
        forwards: Arc::default(),
        forwards_held: 0,
        awaiting_confirms: false,
        upstreams: HashMap::new(),
        remote_consumers: HashMap::new(),
        held: HashMap::new(),
        next_serial: 0,
        remote_wait: None,
        resent_confirmed: false,
        dead_letters: VecDeque::new(),
    };
    let result = conn.run(&mut stream).await;
    // The connection's state goes first — unacked messages requeued, exclusive queues
    // deleted, the connection no longer counted — and only then does the socket wait for
    // the client to close its side.
    conn.release();
    if conn.session_kept() {
        conn.keep_publishing().await;
    }
    broker.unregister(conn.id);
    if let Some(session) = conn.session {
        let barrier =
            conn.gate
                .last_held()
                .map_or_else(Default::default, |c| crate::session::Barrier {
                    journal_seq: c.journal_seq,
                    replicated: c.replicated,
                });
        let kept = conn.keep_session && broker.sessions().contains(session.id);
        broker.sessions().detach(
            session.id,
            conn.keep_session,
            std::time::Instant::now(),
            barrier,
        );
        if let Some(cluster) = broker.cluster() {
            // Only a session that is still this member's: one the directory moved away has
            // had its change committed already.
            let (id, member) = (session.id.to_string(), cluster.node_id().to_owned());
            broker.commit_session(match kept {
                true => SessionOp::Detach { id, member },
                false => SessionOp::End { id, member },
            });
        }
    }
    conn.stats.closed(&broker.stats, conn.id); // metrics
    let user = conn.user.as_ref().map(|u| u.name.as_str()).unwrap_or("-");
    match result {
        Ok(finish) => {
            tracing::info!(conn = id, %peer, user, vhost = %conn.vhost_name, reason = %conn.close_reason, "connection closed");
            if finish == Finish::Gracefully {
                let _ = close_gracefully(&mut stream).await;
            }
        }
        Err(e) => {
            tracing::info!(conn = id, %peer, user, vhost = %conn.vhost_name, error = %e, "connection lost")
        }
    }
}

impl Connection {
    async fn run<S>(&mut self, stream: &mut S) -> std::io::Result<Finish>
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
                return Ok(Finish::Drop);
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
            return Ok(Finish::Gracefully);
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
        let mut replicated = self.broker.replicator().acked();
        let mut lease = self.broker.cluster().map(|c| c.quorum());
        let stall = Duration::from_secs(self.broker.config.write_stall_timeout_s);
        let mut more_input = false;
        // When a forwarded publish failed, and how many primaries had moved then: the close
        // waits for the cluster to elect the failed primary's successor (see
        // `forward_failure_grace`).
        let mut forward_failed: Option<(Instant, u64)> = None;
        let forward_grace = self.forward_failure_grace();
        loop {
            self.stats.flush(&self.broker.stats); // metrics: once per wake-up
            let forwards = self.forwards.status();
            if let Some((failed, reason)) = &forwards.failure
                && self.phase == Phase::Running
            {
                let (at, moved) = *forward_failed
                    .get_or_insert_with(|| (Instant::now(), self.broker.primaries_moved()));
                if at.elapsed() >= forward_grace || self.broker.primaries_moved() != moved {
                    self.abandon_unconfirmed(*failed, reason);
                }
            }
            if self.awaiting_confirms && self.phase == Phase::Running {
                self.decide_forwarded_confirms(forwards.answered_through);
            }
            // Each watch is read into a local first: a borrow held while the lease is asked
            // for would stall the journal or the replicator behind this task if that ask
            // blocked.
            let journal_synced = *synced.borrow();
            let replicas_acked = *replicated.borrow();
            let progress = Progress {
                journal_synced,
                forwards_confirmed: forwards.answered_through,
                replicas_acked,
                lease_held: (self.gate.waits_for_lease() || self.dead_letters_wait())
                    && self.lease_held_now(),
            };
            if self.dead_letters_wait() && self.phase == Phase::Running {
                self.settle_dead_letters(progress);
            }
            let buffered = self.writer.len();
            let writable = self.gate.release(buffered, progress);
            let held = writable < buffered;
            // Held output and held dead letters wait for the same progress.
            let waiting = held || self.dead_letters_wait();
            if writable > 0 {
                self.stats.bytes_out += writable as u64; // metrics
                if !write_with_progress(stream, &self.writer.as_slice()[..writable], stall).await? {
                    tracing::warn!(conn = self.id, peer = %self.peer, timeout_s = stall.as_secs(), "closing connection: the client stopped reading");
                    self.close_reason = format!(
                        "write stalled: the client read nothing for {} s",
                        stall.as_secs()
                    );
                    return Ok(Finish::Drop);
                }
                self.writer.consume(writable);
                self.gate.written(writable);
                self.report_written();
                continue;
            }
            if self.phase == Phase::Done && !held {
                return Ok(Finish::Gracefully);
            }
            if close_deadline.is_none() {
                close_deadline = match self.phase {
                    Phase::Closing => Some(Instant::now() + CLOSE_OK_TIMEOUT),
                    // close-ok is held: the journal, or on a cluster the retirement of the
                    // connection's exclusive queues, has not caught up with it yet.
                    Phase::Done => Some(Instant::now() + CLOSE_HOLD_TIMEOUT),
                    _ => None,
                };
            }
            if self.phase == Phase::Running && !heartbeat_armed && self.heartbeat_s > 0 {
                let period = Duration::from_millis(u64::from(self.heartbeat_s) * 500);
                heartbeat = tokio::time::interval_at((Instant::now() + period).into(), period);
                heartbeat_armed = true;
            }
            let deadline = match (self.phase, close_deadline) {
                (_, Some(d)) => d,
                // Waiting for an election: looked at again every poll.
                (Phase::Running, None) => forward_failed
                    .map_or(Instant::now() + Duration::from_secs(3600), |(at, _)| {
                        (at + forward_grace).min(Instant::now() + ELECTION_POLL)
                    }),
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
            let forwarding = forwards.in_flight > 0;
            let reading = self.phase != Phase::Done
                && !self.publish_waits_for_unblock
                && self.cluster_wait.is_none()
                && self.session_wait.is_none()
                && self.remote_wait.is_none()
                && forward_failed.is_none()
                && forwards.in_flight < MAX_FORWARDS_IN_FLIGHT;
            if rbuf.capacity() - rbuf.len() < read_chunk / 2 {
                rbuf.reserve(read_chunk);
            }
            tokio::select! {
                r = synced.changed(), if waiting => {
                    if r.is_err() {
                        self.close_reason = "the journal stopped".into();
                        return Ok(Finish::Drop);
                    }
                }
                r = stream.read_buf(&mut rbuf), if reading => {
                    let n = r?;
                    if n == 0 {
                        self.close_reason = "client closed the socket".into();
                        return Ok(Finish::Drop);
                    }
                    // A read that filled most of the space asks for a bigger buffer next time.
                    read_chunk = if n >= read_chunk / 2 { READ_CHUNK_BUSY } else { READ_CHUNK_IDLE };
                    last_recv = Instant::now();
                    self.stats.bytes_in += n as u64; // metrics
                    more_input = self.on_bytes(&mut rbuf);
                }
                r = replicated.changed(), if waiting => {
                    if r.is_err() {
                        self.close_reason = "replication stopped".into();
                        return Ok(Finish::Drop);
                    }
                }
                _ = lease_renewed(&mut lease), if waiting => {}
                _ = self.outbox.notified() => self.drain_outbox(),
                _ = self.forwards.changed(), if forwarding || waiting => {}
                answer = proxied::answered(&mut self.remote_wait) => {
                    self.on_remote_answer(answer);
                    more_input = self.on_bytes(&mut rbuf);
                }
                outcome = handshake::session_committed(&mut self.session_wait) => {
                    self.on_session_committed(outcome);
                    more_input = self.on_bytes(&mut rbuf);
                }
                outcome = wiring::committed(&mut self.cluster_wait) => {
                    self.on_committed(outcome);
                    self.on_bytes(&mut rbuf);
                }
                _ = heartbeat.tick(), if heartbeat_armed && self.phase == Phase::Running => {
                    let limit = Duration::from_secs(u64::from(self.heartbeat_s) * 2);
                    if !reading {
                        // Not reading (blocked by an alarm, waiting for a cluster op, a
                        // proxied answer or its forwards): the client's heartbeats wait in
                        // the socket, so its silence says nothing.
                        last_recv = Instant::now();
                    } else if last_recv.elapsed() > limit {
                        tracing::warn!(conn = self.id, peer = %self.peer, timeout_s = self.heartbeat_s, "missed heartbeats from client");
                        self.close_reason = "missed heartbeats".into();
                        return Ok(Finish::Drop);
                    }
                    self.writer.heartbeat();
                }
                _ = tokio::time::sleep_until(deadline.into()) => {
                    self.close_reason = match self.phase {
                        Phase::Closing => "no close-ok after connection.close".into(),
                        Phase::Done => "close-ok held too long".into(),
                        Phase::Running => continue,
                        _ => "handshake timeout".into(),
                    };
                    return Ok(Finish::Drop);
                }
            }
        }
    }

    /// Handles the complete frames in `rbuf`, at most [`FRAMES_PER_BATCH`] of them; returns
    /// whether it stopped at that cap (complete frames may remain).
    fn on_bytes(&mut self, rbuf: &mut BytesMut) -> bool {
        self.refresh_permissions();
        let vhost = self.vhost.clone();
        let mut lazy = vhost.as_deref().map(Lazy::new);
        let mut handled = 0;
        let mut capped = false;
        while matches!(
            self.phase,
            Phase::Start | Phase::Tune | Phase::Open | Phase::Running | Phase::Closing
        ) {
            if self.publish_waits_for_unblock
                || self.cluster_wait.is_some()
                || self.session_wait.is_some()
                || self.remote_wait.is_some()
            {
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
        if let Some(lazy) = lazy {
            self.end_batch(lazy);
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

    /// The connection of a session that is kept is gone: the confirms of publishes forwarded
    /// to other members' primaries are decided as their answers come (for at most
    /// [`FORWARD_SETTLE_LIMIT`]), so that a resent duplicate gets the outcome its publish had;
    /// then each open channel's publishing is kept in the session for the next connection.
    async fn keep_publishing(&mut self) {
        let deadline = Instant::now() + FORWARD_SETTLE_LIMIT;
        while self.awaiting_confirms {
            let status = self.forwards.status();
            if status.failure.is_some() {
                break;
            }
            self.decide_awaiting(status.answered_through);
            if !self.awaiting_confirms
                || tokio::time::timeout_at(deadline.into(), self.forwards.changed())
                    .await
                    .is_err()
            {
                break;
            }
        }
        let Some(session) = self.session else {
            return;
        };
        self.prune_unanswered_forwards();
        let mut kept = Vec::new();
        for (&id, ch) in &self.channels {
            let state = ch.kept_publish_state();
            kept.push((id, state.published));
            self.broker.sessions().keep_channel(session.id, id, state);
        }
        tracing::debug!(conn = self.id, session = %session.id, ?kept, "session kept: channel, publishes processed");
    }

    /// The connection is gone: its channels close in the vhost (unacked messages requeued),
    /// its exclusive queues are deleted — or, for a session that is kept, its channels are
    /// detached (unacked deliveries stay for the next connection) and what it owns stays.
    fn release(&mut self) {
        let Some(vhost) = self.vhost.clone() else {
            return;
        };
        let now = now_ms();
        let kept = self.session_kept();
        let mut v = vhost.lock();
        if self.link {
            v.link_closed(self.id);
        }
        self.abandon_dead_letters(&mut v);
        for ch in self.channels.values() {
            if kept {
                v.channel_detach(ch.key, now, &mut self.fx);
            } else if self.link {
                v.link_channel_lost(ch.key, now, &mut self.fx);
            } else {
                v.channel_close(ch.key, now, &mut self.fx);
            }
        }
        if !kept {
            // A session's channels that this connection never reopened end with it too.
            v.close_channels_of(self.id, now, &mut self.fx);
            v.connection_closed(self.id, &mut self.fx);
        }
        self.fx.deliveries.retain(|d| d.channel.conn != self.id);
        self.fx.cancelled.retain(|c| c.channel.conn != self.id);
        self.fx.remote_settles.clear();
        self.broker.finish_batch(self.id, &mut v, &mut self.fx);
        // Proxied consumers end with their upstream channels: the primaries requeue (and
        // hold for a kept session what went to it).
        if kept {
            self.upstreams.values().for_each(Upstream::detach);
        }
        self.upstreams.clear();
        self.remote_consumers.clear();
        self.held.clear();
    }
}

/// Resolves when the cluster member's lease changes (held output may be waiting for it);
/// never without a cluster, nor once the cluster layer is gone.
async fn lease_renewed(lease: &mut Option<tokio::sync::watch::Receiver<bool>>) {
    if let Some(rx) = lease {
        if rx.changed().await.is_ok() {
            return;
        }
        *lease = None;
    }
    std::future::pending::<()>().await
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

/// Ends a connection without a TCP reset: closing a socket with unread input resets it, and
/// a reset can discard what the client has not read yet (connection.close-ok, or the protocol
/// header the broker answers a wrong one with). So: stop writing (FIN), read and drop what the
/// client still sends until it closes its side, for at most [`CLOSE_OK_TIMEOUT`] and
/// [`MAX_DRAIN_BYTES`], then close.
async fn close_gracefully<S>(stream: &mut S) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream.shutdown().await?;
    let mut sink = [0u8; 4096];
    let drain = async {
        let mut total = 0;
        while let Ok(n @ 1..) = stream.read(&mut sink).await {
            total += n;
            if total > MAX_DRAIN_BYTES {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(CLOSE_OK_TIMEOUT, drain).await;
    Ok(())
}
