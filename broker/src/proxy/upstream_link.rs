//! The upstream link to a cluster member, on the broker's own codec: one connection per
//! (member, vhost) carrying the upstream channels ([`super::upstream`]) of every client of
//! this member that uses the member's queues, channels multiplexed.
//!
//! After forwarded publishes, deliveries to proxied consumers are the busiest traffic
//! between members: every message a client consumes through a member that is not its
//! queue's primary crosses a link. A general AMQP client (lapin) costs per delivery a
//! hand-over from its IO thread to the consumer's stream, a `Vec` per body, a channel
//! handle cloned and dropped, and a pump task woken per batch. Here one **reader task**
//! splits the member's frames with the broker's own splitter (a body that came in one frame
//! stays a `Bytes` slice of the read buffer, the content header stays the member's bytes and
//! goes on to the client as it is), assembles each message and hands it straight to its
//! consumer's client connection: a consumer's deliveries that arrived together go in one
//! mailbox push ([`PUMP_BATCH`] at most). A **writer task** writes whatever the channels
//! queued meanwhile in one go: acks, nacks and rejects are queued without waiting (runs of
//! acks as one `multiple` ack, [`super::upstream::settle_plan`]); synchronous methods
//! (qos, consume, cancel, get, purge, delete, passive declares, catch-ups) queue a waiter in
//! their channel's FIFO, which the member's replies answer in order.
//!
//! A channel the member closes (its error: 404 for a deleted queue, 403 for an exclusive
//! consumer, …) fails its waiters with that error and ends its consumers; a consumer the
//! member cancels (its queue went) ends alone. The link failing — a socket error, a close,
//! silence for two heartbeats, a member that takes nothing for [`IO_TIMEOUT`] — does the
//! same to every channel, and the next channel opens a new link ([`super::link::Links`]).
//!
//! It logs in as any link does ([`super::link::open_raw`]). It speaks to cluster members
//! only; upstream channels to foreign brokers keep lapin (`upstream_foreign.rs`).

use super::upstream::{ProxiedDelivery, ProxiedEnd, ProxiedGet, Upstreamed, settle_plan};
use crate::amqp::frame::{FRAME_BODY, FRAME_HEADER, FRAME_METHOD, method_ids, split_frame};
use crate::amqp::writer::FrameWriter;
use crate::amqp::{AMQPClass, Properties, ShortString, basic, channel, codes, connection};
use crate::broker::outbox::Outbox;
use crate::core::vhost::Settlement;
use crate::core::{AmqpError, Message};
use crate::server::channel::BodyParts;
use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, oneshot};

/// The largest frame this side asks for: the member's own limit is usually lower.
const FRAME_MAX: u32 = 128 * 1024;

/// Heartbeat asked for (seconds): a member that vanishes without a reset fails the link's
/// channels within two of these.
const HEARTBEAT_S: u16 = 10;

/// Longest wait to connect and log in, and for the member to take queued frames.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// Most deliveries the reader hands to one consumer's connection in one mailbox push.
pub const PUMP_BATCH: usize = 256;

/// Most upstream channels on one link (client channels of this member that use the
/// member's queues at once); the member's own `channel_max` when lower.
const MAX_CHANNELS: u16 = 2047;

/// The largest message body the link takes from a member (RabbitMQ's limit is 512 MiB; a
/// member only delivers what it accepted under its own `max_message_size`): a larger size in
/// a content header is a broken link, not an allocation.
const MAX_BODY_BYTES: u64 = 1 << 31;

/// Free space the read buffer keeps before a read, so that reads stay large.
const READ_RESERVE: usize = 64 * 1024;

/// A synchronous method's reply, as the waiter gets it.
#[derive(Debug)]
pub enum Replied {
    /// The reply method.
    Method(AMQPClass),
    /// basic.get-ok with its message.
    Got(ProxiedGet),
}

/// Who waits for a synchronous method's reply.
type Waiter = oneshot::Sender<Result<Replied, AmqpError>>;

/// The client consumer a proxied consumer delivers to.
#[derive(Debug, Clone)]
pub struct ClientConsumer {
    /// The client connection's mailbox.
    pub outbox: Arc<Outbox>,
    /// Client channel number.
    pub channel: u16,
    /// Consumer tag (the same upstream and to the client).
    pub tag: Arc<str>,
    /// The consumer's serial number on its connection.
    pub serial: u64,
    /// The queue.
    pub queue: Arc<str>,
    /// The member it consumes from.
    pub primary: Arc<str>,
    /// The client consumes with no-ack.
    pub no_ack: bool,
}

/// A consumer on an upstream channel and the deliveries the reader has not yet handed on.
struct Sink {
    to: ClientConsumer,
    /// consume-ok came: the consumer exists on the member (and ends with a notice to the
    /// client connection). One whose consume failed ends silently: the client hears the
    /// error.
    started: bool,
    batch: Vec<ProxiedDelivery>,
}

impl Sink {
    /// Hands what is batched, then the end, to the client connection.
    fn end(mut self) {
        if !self.started {
            return;
        }
        let to = self.to;
        let end = ProxiedEnd {
            channel: to.channel,
            consumer_tag: to.tag,
            serial: to.serial,
        };
        to.outbox.push(|p| {
            p.proxied.append(&mut self.batch);
            p.proxied_ended.push(end);
        });
    }
}

/// One upstream channel, shared by its task (which writes on it) and the reader.
struct Chan {
    id: u16,
    state: Mutex<ChanState>,
}

#[derive(Default)]
struct ChanState {
    /// Why nothing more may be written on it: the member closed it (its error) or the link
    /// failed.
    closed: Option<AmqpError>,
    /// This side sent channel.close: what still arrives for it is dropped, and its close-ok
    /// frees the number.
    closing: bool,
    /// Synchronous methods sent, answered in order.
    waiters: VecDeque<Waiter>,
    /// Consumers by tag.
    consumers: HashMap<Arc<str>, Sink>,
    /// Upstream delivery tags not yet settled: an ack may be sent as `multiple` only when no
    /// unsettled tag below it remains.
    unsettled: BTreeSet<u64>,
}

/// What the link's tasks share.
struct Shared {
    /// Frames queued for the writer.
    out: FrameWriter,
    /// Why the link stopped working; nothing is queued after that.
    failed: Option<AmqpError>,
    /// The member said `connection.blocked`: a write that takes long is waited out.
    blocked: bool,
    /// Open (or closing) channels by number.
    channels: HashMap<u16, Arc<Chan>>,
    /// The number given out last: the next search starts after it, so that a number just
    /// freed is not taken again at once.
    last_id: u16,
}

struct Inner {
    member: String,
    frame_max: u32,
    channel_max: u16,
    shared: Mutex<Shared>,
    /// The writer: frames are queued (or the link failed).
    wake: Notify,
    /// The reader: the writer found the link broken.
    stop: Notify,
}

impl Inner {
    /// Queues frames on channel `chan` (with a waiter for the reply when `waiter` is some),
    /// unless the channel or the link is closed: that error then.
    fn queue(
        &self,
        chan: &Chan,
        waiter: Option<Waiter>,
        encode: impl FnOnce(&mut FrameWriter, &mut ChanState),
    ) -> Result<(), AmqpError> {
        let mut st = chan.state.lock();
        if let Some(e) = &st.closed {
            return Err(e.clone());
        }
        let mut shared = self.shared.lock();
        if let Some(e) = &shared.failed {
            return Err(e.clone());
        }
        let was_empty = shared.out.is_empty();
        encode(&mut shared.out, &mut st);
        st.waiters.extend(waiter);
        drop(shared);
        drop(st);
        if was_empty {
            self.wake.notify_one();
        }
        Ok(())
    }

    /// Queues a connection-level or channel-control frame (close-ok, cancel-ok), if the link
    /// still works.
    fn queue_control(&self, channel: u16, method: AMQPClass) {
        let mut shared = self.shared.lock();
        if shared.failed.is_some() {
            return;
        }
        let was_empty = shared.out.is_empty();
        shared.out.method(channel, method);
        drop(shared);
        if was_empty {
            self.wake.notify_one();
        }
    }

    /// Marks the link failed (the first reason wins) and stops both tasks; the reader then
    /// fails every channel ([`Reader::fail_all`]).
    fn mark_failed(&self, e: AmqpError) {
        self.shared.lock().failed.get_or_insert(e);
        self.stop.notify_one();
        self.wake.notify_one();
    }

    fn channel(&self, id: u16) -> Option<Arc<Chan>> {
        self.shared.lock().channels.get(&id).cloned()
    }

    /// The error a channel's commands get when the member cannot be reached.
    fn unreachable(&self, reason: impl std::fmt::Display) -> AmqpError {
        AmqpError::new(
            codes::NOT_FOUND,
            format!(
                "the queue's primary, '{}', cannot be reached: {reason}",
                self.member
            ),
        )
    }
}

/// An upstream link to one member for one vhost.
pub struct UpstreamLink {
    inner: Arc<Inner>,
    reader: tokio::task::JoinHandle<()>,
    writer: tokio::task::JoinHandle<()>,
}

impl Drop for UpstreamLink {
    fn drop(&mut self) {
        // Only once no channel uses it any more: nothing is left to fail.
        self.reader.abort();
        self.writer.abort();
    }
}

impl UpstreamLink {
    /// Connects to `member` at `addr` and logs in for `vhost` with the link `password`.
    pub async fn open(
        member: &str,
        addr: &str,
        vhost: &str,
        password: &str,
    ) -> Result<Self, super::link::LinkError> {
        let failed = |reason: String| super::link::LinkError::Failed {
            node: member.to_owned(),
            addr: addr.to_owned(),
            reason,
        };
        let opened = tokio::time::timeout(
            IO_TIMEOUT,
            super::link::open_raw(addr, vhost, password, "ringmq upstream link", HEARTBEAT_S),
        )
        .await;
        let client = match opened {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(failed(e.to_string())),
            Err(_) => return Err(failed(format!("no answer within {IO_TIMEOUT:?}"))),
        };
        let (read, write) = client.stream.into_split();
        let inner = Arc::new(Inner {
            member: member.to_owned(),
            frame_max: client.frame_max.min(FRAME_MAX),
            channel_max: client.channel_max.min(MAX_CHANNELS),
            shared: Mutex::new(Shared {
                out: FrameWriter::default(),
                failed: None,
                blocked: false,
                // Channel 1, which the handshake opened, stays idle.
                channels: HashMap::new(),
                last_id: 1,
            }),
            wake: Notify::new(),
            stop: Notify::new(),
        });
        let reader = Reader {
            inner: inner.clone(),
            chans: HashMap::new(),
            partial: HashMap::new(),
            dirty: Vec::new(),
        };
        let reader = tokio::spawn(reader.run(read, client.rbuf, silence_limit(client.heartbeat_s)));
        let writer = tokio::spawn(write_loop(
            inner.clone(),
            write,
            heartbeat_period(client.heartbeat_s),
        ));
        tracing::info!(node = member, addr, vhost, "upstream link opened");
        Ok(Self {
            inner,
            reader,
            writer,
        })
    }

    /// Whether the link still works.
    pub fn is_open(&self) -> bool {
        self.inner.shared.lock().failed.is_none()
    }

    /// Opens a new channel on the link.
    pub async fn open_channel(self: &Arc<Self>) -> Result<UpstreamChannel, AmqpError> {
        let inner = &self.inner;
        let chan = {
            let mut shared = inner.shared.lock();
            if let Some(e) = &shared.failed {
                return Err(e.clone());
            }
            let max = inner.channel_max.max(2);
            let mut id = shared.last_id;
            let found = (2..=max).find_map(|_| {
                id = if id >= max { 2 } else { id + 1 };
                (!shared.channels.contains_key(&id)).then_some(id)
            });
            let Some(id) = found else {
                return Err(AmqpError::new(
                    codes::NOT_FOUND,
                    format!(
                        "the link to cluster member '{}' has all its {} channels in use",
                        inner.member,
                        max - 1
                    ),
                ));
            };
            shared.last_id = id;
            let chan = Arc::new(Chan {
                id,
                state: Mutex::default(),
            });
            shared.channels.insert(id, chan.clone());
            chan
        };
        let ch = UpstreamChannel {
            link: self.clone(),
            chan,
        };
        let opened = ch
            .call(AMQPClass::Channel(channel::AMQPMethod::Open(
                channel::Open {},
            )))
            .await;
        match opened {
            Ok(Replied::Method(AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))) => Ok(ch),
            Ok(other) => Err(ch.unexpected("channel.open-ok", &other)),
            Err(e) => {
                // Closed by the member, or the link failed: the number is free again.
                ch.close();
                Err(e)
            }
        }
    }
}

/// One channel on an upstream link, used by one upstream channel's task; dropping it
/// without [`UpstreamChannel::close`] leaves the number taken until the link goes.
pub struct UpstreamChannel {
    link: Arc<UpstreamLink>,
    chan: Arc<Chan>,
}

impl UpstreamChannel {
    fn inner(&self) -> &Inner {
        &self.link.inner
    }

    /// Sends a synchronous method and waits for its reply (the member's error if it closed
    /// the channel instead).
    pub async fn call(&self, method: AMQPClass) -> Result<Replied, AmqpError> {
        let (tx, rx) = oneshot::channel();
        let id = self.chan.id;
        self.inner()
            .queue(&self.chan, Some(tx), |w, _| w.method(id, method))?;
        self.answer(rx).await
    }

    async fn answer(
        &self,
        rx: oneshot::Receiver<Result<Replied, AmqpError>>,
    ) -> Result<Replied, AmqpError> {
        rx.await
            .unwrap_or_else(|_| Err(self.inner().unreachable("the link closed")))
    }

    /// Starts a consumer: its deliveries go to `to`, from the moment the member has it.
    pub async fn consume(
        &self,
        consume: basic::Consume,
        to: ClientConsumer,
    ) -> Result<(), AmqpError> {
        let (tx, rx) = oneshot::channel();
        let id = self.chan.id;
        let tag = to.tag.clone();
        self.inner().queue(&self.chan, Some(tx), |w, st| {
            st.consumers.insert(
                to.tag.clone(),
                Sink {
                    to,
                    started: false,
                    batch: Vec::new(),
                },
            );
            w.method(id, AMQPClass::Basic(basic::AMQPMethod::Consume(consume)));
        })?;
        match self.answer(rx).await {
            Ok(Replied::Method(AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_)))) => Ok(()),
            other => {
                self.chan.state.lock().consumers.remove(&tag);
                match other {
                    Err(e) => Err(e),
                    Ok(r) => Err(self.unexpected("basic.consume-ok", &r)),
                }
            }
        }
    }

    /// Queues settlements without waiting (see [`settle_plan`]); on a closed channel they
    /// are moot (the member requeued what the channel had).
    pub fn settle(&self, batch: Vec<(u64, Settlement)>) {
        let id = self.chan.id;
        let _ = self.inner().queue(&self.chan, None, |w, st| {
            for frame in settle_plan(&mut st.unsettled, batch) {
                w.method(id, frame.method());
            }
        });
    }

    /// Records a delivery tag basic.get took with acks on: it waits for the client's.
    pub fn track(&self, tag: u64) {
        self.chan.state.lock().unsettled.insert(tag);
    }

    /// Closes the channel: the member requeues what it had not had acked, in its original
    /// order. Does not wait: the reader frees the number when close-ok comes.
    pub fn close(self) {
        let inner = self.inner();
        let id = self.chan.id;
        let mut st = self.chan.state.lock();
        st.consumers.clear();
        if st.closed.is_some() {
            // Closed by the member (and close-ok sent) or the link failed.
            drop(st);
            inner.shared.lock().channels.remove(&id);
            return;
        }
        st.closing = true;
        st.closed = Some(inner.unreachable("the channel was closed"));
        drop(st);
        inner.queue_control(
            id,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: codes::REPLY_SUCCESS,
                reply_text: ShortString::from("client channel closed"),
                class_id: 0,
                method_id: 0,
            })),
        );
    }

    /// The error for a reply that is not the one expected: the link is out of step.
    pub fn unexpected(&self, expected: &str, got: &Replied) -> AmqpError {
        let e = self
            .inner()
            .unreachable(format!("expected {expected}, got {got:?}"));
        self.inner().mark_failed(e.clone());
        e
    }
}

impl Upstreamed {
    /// The method that carries it.
    fn method(self) -> AMQPClass {
        match self {
            Upstreamed::Ack { tag, multiple } => {
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: tag,
                    multiple,
                }))
            }
            Upstreamed::Nack { tag, requeue } => {
                AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                    delivery_tag: tag,
                    multiple: false,
                    requeue,
                }))
            }
        }
    }
}

/// How often the writer sends a heartbeat when it has nothing to write: twice per agreed
/// heartbeat.
fn heartbeat_period(heartbeat_s: u16) -> Duration {
    match heartbeat_s {
        0 => Duration::from_secs(u64::from(HEARTBEAT_S)),
        s => Duration::from_millis(u64::from(s) * 500),
    }
}

/// How long the member may send nothing before the link counts as dead: two heartbeats, or
/// when it wants none, long enough for any reply.
fn silence_limit(heartbeat_s: u16) -> Duration {
    match heartbeat_s {
        0 => Duration::from_secs(300),
        s => Duration::from_secs(2 * u64::from(s)),
    }
}

/// Writes what the channels queued, all of it per `write`, and heartbeats when idle.
async fn write_loop(inner: Arc<Inner>, mut write: OwnedWriteHalf, heartbeat_every: Duration) {
    let mut out = FrameWriter::default();
    loop {
        let idle = tokio::time::timeout(heartbeat_every, inner.wake.notified())
            .await
            .is_err();
        {
            let mut shared = inner.shared.lock();
            if shared.failed.is_some() {
                return;
            }
            std::mem::swap(&mut shared.out, &mut out);
        }
        if out.is_empty() {
            if !idle {
                continue;
            }
            out.heartbeat();
        }
        if let Err(e) = flush(&inner, &mut write, &out).await {
            inner.mark_failed(e);
            return;
        }
        out.clear();
    }
}

/// Writes `out`. A member that takes nothing for [`IO_TIMEOUT`] fails the link — unless it
/// said it is blocked (a memory or disk alarm), which is waited out; the reader's silence
/// limit still ends the wait if the member is gone.
async fn flush(
    inner: &Inner,
    write: &mut OwnedWriteHalf,
    out: &FrameWriter,
) -> Result<(), AmqpError> {
    let mut writing = std::pin::pin!(write.write_all(out.as_slice()));
    loop {
        match tokio::time::timeout(IO_TIMEOUT, writing.as_mut()).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => return Err(inner.unreachable(e)),
            Err(_) => {
                let shared = inner.shared.lock();
                if let Some(e) = &shared.failed {
                    return Err(e.clone());
                }
                if !shared.blocked {
                    return Err(inner.unreachable(format!("it took nothing for {IO_TIMEOUT:?}")));
                }
            }
        }
    }
}

/// A message whose method frame came and whose content is still arriving.
struct Partial {
    what: Content,
    /// Properties, the header payload as it came, and the body size it announced.
    header: Option<(Properties, Bytes, u64)>,
    body: BodyParts,
}

enum Content {
    Deliver(Deliver),
    Got { ok: basic::GetOk },
}

/// A basic.deliver, read by hand: it comes once per message.
#[derive(Debug, PartialEq, Eq)]
struct Deliver {
    consumer_tag: Bytes,
    delivery_tag: u64,
    redelivered: bool,
    exchange: ShortString,
    routing_key: ShortString,
}

/// Reads a basic.deliver payload (class and method ids included); `None` if malformed.
fn parse_deliver(p: &Bytes) -> Option<Deliver> {
    fn short(p: &[u8], at: &mut usize) -> Option<ShortString> {
        let len = usize::from(*p.get(*at)?);
        let s = std::str::from_utf8(p.get(*at + 1..*at + 1 + len)?).ok()?;
        *at += 1 + len;
        Some(ShortString::from(s))
    }
    if p.get(..4)? != [0, 60, 0, 60] {
        return None;
    }
    let tag_len = usize::from(*p.get(4)?);
    p.get(5..5 + tag_len)?;
    let consumer_tag = p.slice(5..5 + tag_len);
    let mut at = 5 + tag_len;
    let delivery_tag = u64::from_be_bytes(p.get(at..at + 8)?.try_into().ok()?);
    at += 8;
    let redelivered = p.get(at)? & 1 == 1;
    at += 1;
    let exchange = short(p, &mut at)?;
    let routing_key = short(p, &mut at)?;
    Some(Deliver {
        consumer_tag,
        delivery_tag,
        redelivered,
        exchange,
        routing_key,
    })
}

/// The reader task's state.
struct Reader {
    inner: Arc<Inner>,
    /// Channels by number, as the reader last saw them (a number is freed only after the
    /// reader saw its close or close-ok, so the cache cannot go stale).
    chans: HashMap<u16, Arc<Chan>>,
    /// Messages being assembled, by channel.
    partial: HashMap<u16, Partial>,
    /// Consumers with deliveries batched, to hand on before the next read.
    dirty: Vec<(Arc<Chan>, Arc<str>)>,
}

impl Reader {
    async fn run(mut self, mut read: OwnedReadHalf, mut rbuf: BytesMut, silence: Duration) {
        let frame_max = self.inner.frame_max;
        let error = loop {
            match split_frame(&mut rbuf, frame_max) {
                Err(e) => break self.inner.unreachable(format!("it sent a bad frame: {e}")),
                Ok(Some(f)) => {
                    let handled = match f.kind {
                        FRAME_METHOD if f.channel == 0 => self.on_connection_method(&f.payload),
                        FRAME_METHOD => self.on_method(f.channel, f.payload),
                        FRAME_HEADER => self.on_header(f.channel, f.payload),
                        FRAME_BODY => self.on_body(f.channel, f.payload),
                        _ => Ok(()),
                    };
                    if let Err(e) = handled {
                        break e;
                    }
                }
                Ok(None) => {
                    self.hand_on();
                    if rbuf.capacity() - rbuf.len() < READ_RESERVE {
                        rbuf.reserve(4 * READ_RESERVE);
                    }
                    tokio::select! {
                        r = tokio::time::timeout(silence, read.read_buf(&mut rbuf)) => match r {
                            Ok(Ok(0)) => break self.inner.unreachable("it closed the link"),
                            Ok(Ok(_)) => {}
                            Ok(Err(e)) => break self.inner.unreachable(e),
                            Err(_) => break self.inner.unreachable(format!("silent for {silence:?}")),
                        },
                        () = self.inner.stop.notified() => {
                            break self.inner.shared.lock().failed.clone()
                                .unwrap_or_else(|| self.inner.unreachable("the link stopped"));
                        }
                    }
                }
            }
        };
        tracing::warn!(node = %self.inner.member, reason = %error.text, "upstream link failed");
        self.hand_on();
        self.fail_all(error);
    }

    /// Fails every channel: waiters get `error`, consumers end.
    fn fail_all(&mut self, error: AmqpError) {
        let chans: Vec<Arc<Chan>> = {
            let mut shared = self.inner.shared.lock();
            shared.failed.get_or_insert(error.clone());
            shared.channels.drain().map(|(_, c)| c).collect()
        };
        self.inner.wake.notify_one();
        for chan in chans {
            close_chan(&chan, &error);
        }
    }

    fn chan(&mut self, id: u16) -> Option<Arc<Chan>> {
        if let Some(c) = self.chans.get(&id) {
            return Some(c.clone());
        }
        let c = self.inner.channel(id)?;
        self.chans.insert(id, c.clone());
        Some(c)
    }

    fn on_connection_method(&mut self, payload: &[u8]) -> Result<(), AmqpError> {
        let method = match amq_protocol::protocol::parse_class(payload) {
            Ok((_, m)) => m,
            Err(e) => return Err(self.inner.unreachable(format!("it sent {e:?}"))),
        };
        match method {
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
                self.inner.queue_control(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                Err(AmqpError::new(c.reply_code, c.reply_text.to_string()))
            }
            AMQPClass::Connection(connection::AMQPMethod::Blocked(_)) => {
                self.inner.shared.lock().blocked = true;
                Ok(())
            }
            AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)) => {
                self.inner.shared.lock().blocked = false;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn on_method(&mut self, id: u16, payload: Bytes) -> Result<(), AmqpError> {
        if method_ids(&payload) == Some((60, 60)) {
            let Some(d) = parse_deliver(&payload) else {
                return Err(self.inner.unreachable("it sent a malformed basic.deliver"));
            };
            return self.start_content(id, Content::Deliver(d));
        }
        let method = match amq_protocol::protocol::parse_class(&payload[..]) {
            Ok((_, m)) => m,
            Err(e) => return Err(self.inner.unreachable(format!("it sent {e:?}"))),
        };
        match method {
            AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) => {
                self.start_content(id, Content::Got { ok })
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(c)) => {
                self.closed_by_member(id, AmqpError::new(c.reply_code, c.reply_text.to_string()));
                Ok(())
            }
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                self.forget(id);
                if let Some(chan) = self.inner.shared.lock().channels.remove(&id) {
                    let e = self.inner.unreachable("the channel was closed");
                    close_chan(&chan, &e);
                }
                Ok(())
            }
            AMQPClass::Basic(basic::AMQPMethod::Cancel(c)) => {
                // The member cancelled the consumer (its queue went).
                if let Some(chan) = self.chan(id) {
                    let sink = chan.state.lock().consumers.remove(c.consumer_tag.as_str());
                    if let Some(sink) = sink {
                        sink.end();
                    }
                }
                if !c.nowait {
                    self.inner.queue_control(
                        id,
                        AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                            consumer_tag: c.consumer_tag,
                        })),
                    );
                }
                Ok(())
            }
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(ok)) => {
                if let Some(chan) = self.chan(id)
                    && let Some(sink) = chan
                        .state
                        .lock()
                        .consumers
                        .get_mut(ok.consumer_tag.as_str())
                {
                    sink.started = true;
                }
                self.answer(
                    id,
                    Ok(Replied::Method(AMQPClass::Basic(
                        basic::AMQPMethod::ConsumeOk(ok),
                    ))),
                )
            }
            AMQPClass::Basic(basic::AMQPMethod::CancelOk(ok)) => {
                if let Some(chan) = self.chan(id) {
                    let sink = chan.state.lock().consumers.remove(ok.consumer_tag.as_str());
                    if let Some(sink) = sink {
                        sink.end();
                    }
                }
                self.answer(
                    id,
                    Ok(Replied::Method(AMQPClass::Basic(
                        basic::AMQPMethod::CancelOk(ok),
                    ))),
                )
            }
            AMQPClass::Channel(channel::AMQPMethod::Flow(f)) => {
                // Nothing is published on this link: nothing to pause.
                self.inner.queue_control(
                    id,
                    AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                        active: f.active,
                    })),
                );
                Ok(())
            }
            // Nothing is published on this link: no confirms or returns come.
            AMQPClass::Basic(
                basic::AMQPMethod::Ack(_)
                | basic::AMQPMethod::Nack(_)
                | basic::AMQPMethod::Return(_),
            ) => Ok(()),
            m => self.answer(id, Ok(Replied::Method(m))),
        }
    }

    /// Gives a reply to the channel's oldest waiter.
    fn answer(&mut self, id: u16, reply: Result<Replied, AmqpError>) -> Result<(), AmqpError> {
        let Some(chan) = self.chan(id) else {
            return Err(self
                .inner
                .unreachable(format!("it answered on channel {id}, which is not open")));
        };
        let mut st = chan.state.lock();
        if st.closing {
            // Answers to what was sent before this side closed the channel.
            return Ok(());
        }
        match st.waiters.pop_front() {
            Some(w) => {
                let _ = w.send(reply);
                Ok(())
            }
            None => {
                drop(st);
                Err(self.inner.unreachable(format!(
                    "it answered nothing asked on channel {id}: {reply:?}"
                )))
            }
        }
    }

    /// The member closed channel `id` with `error`: its waiters fail with it, its
    /// consumers end, and close-ok goes back.
    fn closed_by_member(&mut self, id: u16, error: AmqpError) {
        self.forget(id);
        if let Some(chan) = self.inner.channel(id) {
            let closing = close_chan(&chan, &error);
            if closing {
                // Both sides closed at once: nobody else frees the number.
                self.inner.shared.lock().channels.remove(&id);
            }
        }
        self.inner.queue_control(
            id,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
        );
    }

    /// Forgets what the reader held of channel `id` (it closed).
    fn forget(&mut self, id: u16) {
        self.chans.remove(&id);
        self.partial.remove(&id);
    }

    fn start_content(&mut self, id: u16, what: Content) -> Result<(), AmqpError> {
        if self.partial.contains_key(&id) {
            return Err(self.inner.unreachable(format!(
                "it sent a method on channel {id} before the content it announced"
            )));
        }
        self.partial.insert(
            id,
            Partial {
                what,
                header: None,
                body: BodyParts::default(),
            },
        );
        Ok(())
    }

    fn on_header(&mut self, id: u16, payload: Bytes) -> Result<(), AmqpError> {
        let Some(p) = self.partial.get_mut(&id) else {
            return Err(self.inner.unreachable(format!(
                "it sent a content header on channel {id} without a method"
            )));
        };
        if p.header.is_some() {
            return Err(self
                .inner
                .unreachable("it sent a second content header for one message"));
        }
        let header = match amq_protocol::frame::parsing::parse_content_header(&payload[..]) {
            Ok(([], h)) if h.class_id == 60 && h.body_size <= MAX_BODY_BYTES => h,
            _ => {
                return Err(self
                    .inner
                    .unreachable("it sent a content header this link cannot take"));
            }
        };
        let size = header.body_size;
        p.header = Some((header.properties, payload, size));
        if size == 0 {
            self.complete(id);
        }
        Ok(())
    }

    fn on_body(&mut self, id: u16, payload: Bytes) -> Result<(), AmqpError> {
        let Some(p) = self.partial.get_mut(&id) else {
            return Err(self.inner.unreachable(format!(
                "it sent a content body on channel {id} without a method"
            )));
        };
        let Some((_, _, size)) = &p.header else {
            return Err(self
                .inner
                .unreachable("it sent a content body before its header"));
        };
        let size = *size as usize;
        if p.body.len() + payload.len() > size {
            return Err(self
                .inner
                .unreachable("it sent a content body longer than announced"));
        }
        p.body.push(payload, size);
        if p.body.len() == size {
            self.complete(id);
        }
        Ok(())
    }

    /// A message is complete: a delivery goes to its consumer's batch, a get-ok to its
    /// waiter.
    fn complete(&mut self, id: u16) {
        let Some(p) = self.partial.remove(&id) else {
            return;
        };
        let Some((properties, header, _)) = p.header else {
            return;
        };
        let Some(chan) = self.chan(id) else {
            return;
        };
        let body = p.body.finish();
        match p.what {
            Content::Got { ok } => {
                let got = Message::new(ok.exchange, ok.routing_key, properties, header, body)
                    .map_err(|e| AmqpError::precondition(e.0))
                    .map(|m| {
                        Replied::Got(ProxiedGet {
                            upstream_tag: ok.delivery_tag,
                            redelivered: ok.redelivered,
                            message_count: ok.message_count,
                            message: Arc::new(m),
                        })
                    });
                let mut st = chan.state.lock();
                if !st.closing
                    && let Some(w) = st.waiters.pop_front()
                {
                    let _ = w.send(got);
                }
            }
            Content::Deliver(d) => self.deliver(&chan, d, properties, header, body),
        }
    }

    fn deliver(
        &mut self,
        chan: &Arc<Chan>,
        d: Deliver,
        properties: Properties,
        header: Bytes,
        body: Bytes,
    ) {
        let message = Message::new(d.exchange, d.routing_key, properties, header, body);
        let mut guard = chan.state.lock();
        let st = &mut *guard;
        if st.closing {
            return;
        }
        let tag = std::str::from_utf8(&d.consumer_tag).unwrap_or_default();
        let Some(sink) = st.consumers.get_mut(tag) else {
            // No such consumer (any more): back to its queue.
            drop(guard);
            self.refuse(
                chan,
                Upstreamed::Nack {
                    tag: d.delivery_tag,
                    requeue: true,
                },
            );
            return;
        };
        let message = match message {
            Ok(m) => m,
            Err(e) => {
                drop(guard);
                tracing::warn!(node = %self.inner.member, expiration = %e.0, "dropping a proxied delivery whose expiration the broker cannot take");
                self.refuse(
                    chan,
                    Upstreamed::Ack {
                        tag: d.delivery_tag,
                        multiple: false,
                    },
                );
                return;
            }
        };
        let to = &sink.to;
        sink.batch.push(ProxiedDelivery {
            channel: to.channel,
            consumer_tag: to.tag.clone(),
            serial: to.serial,
            queue: to.queue.clone(),
            primary: to.primary.clone(),
            upstream_tag: d.delivery_tag,
            redelivered: d.redelivered,
            message: Arc::new(message),
            no_ack: to.no_ack,
        });
        st.unsettled.insert(d.delivery_tag);
        if sink.batch.len() == 1 {
            self.dirty.push((chan.clone(), sink.to.tag.clone()));
        } else if sink.batch.len() >= PUMP_BATCH {
            let outbox = sink.to.outbox.clone();
            let mut batch = std::mem::take(&mut sink.batch);
            drop(guard);
            outbox.push(|p| p.proxied.append(&mut batch));
        }
    }

    /// Settles at once a delivery no client will see.
    fn refuse(&self, chan: &Chan, frame: Upstreamed) {
        let id = chan.id;
        let _ = self
            .inner
            .queue(chan, None, |w, _| w.method(id, frame.method()));
    }

    /// Hands every consumer's batched deliveries to its client connection.
    fn hand_on(&mut self) {
        for (chan, tag) in self.dirty.drain(..) {
            let taken = chan.state.lock().consumers.get_mut(&tag).and_then(|sink| {
                (!sink.batch.is_empty())
                    .then(|| (sink.to.outbox.clone(), std::mem::take(&mut sink.batch)))
            });
            if let Some((outbox, mut batch)) = taken {
                outbox.push(|p| p.proxied.append(&mut batch));
            }
        }
    }
}

/// Closes `chan` for good with `error`: nothing more is written on it, its waiters fail,
/// its consumers end. Whether this side had closed it already.
fn close_chan(chan: &Chan, error: &AmqpError) -> bool {
    let (closing, waiters, sinks) = {
        let mut st = chan.state.lock();
        st.closed.get_or_insert_with(|| error.clone());
        (
            st.closing,
            std::mem::take(&mut st.waiters),
            std::mem::take(&mut st.consumers),
        )
    };
    for w in waiters {
        let _ = w.send(Err(error.clone()));
    }
    sinks.into_values().for_each(Sink::end);
    closing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hand_read_deliver_matches_the_encoder() {
        let mut w = FrameWriter::default();
        w.deliver(3, "ctag", 77, true, "ex", "rk");
        let frame = split_frame(&mut BytesMut::from(w.as_slice()), FRAME_MAX)
            .unwrap()
            .unwrap();
        assert_eq!(
            parse_deliver(&frame.payload),
            Some(Deliver {
                consumer_tag: Bytes::from_static(b"ctag"),
                delivery_tag: 77,
                redelivered: true,
                exchange: ShortString::from("ex"),
                routing_key: ShortString::from("rk"),
            })
        );
        let truncated = frame.payload.slice(..frame.payload.len() - 1);
        assert_eq!(parse_deliver(&truncated), None);
    }
}
