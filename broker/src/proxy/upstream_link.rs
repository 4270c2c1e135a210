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

mod reader;
mod writer;

use super::upstream::{ProxiedDelivery, ProxiedEnd, ProxiedGet, Upstreamed, settle_plan};
use crate::amqp::frame::{FRAME_BODY, FRAME_HEADER, FRAME_METHOD, method_ids, split_frame};
use crate::amqp::writer::FrameWriter;
use crate::amqp::{AMQPClass, Properties, ShortString, basic, channel, codes, connection};
use crate::broker::outbox::Outbox;
use crate::core::vhost::Settlement;
use crate::core::{AmqpError, Message};
use crate::server::channel::BodyParts;
use crate::session::KEEP_SESSION;
use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use reader::{Reader, silence_limit};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::{Notify, oneshot};
use writer::{heartbeat_period, write_loop};

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
        super::upstream::unreachable(&self.member, reason)
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
        let reader = tokio::spawn(Reader::new(inner.clone()).run(
            read,
            client.rbuf,
            silence_limit(client.heartbeat_s),
        ));
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
        self.close_with(codes::REPLY_SUCCESS, "client channel closed");
    }

    /// [`UpstreamChannel::close`] for a client whose connection was lost with its session
    /// kept ([`super::upstream::Upstream::detach`]): the member holds for the session what
    /// it requeues (reply code 330, KEEP_SESSION).
    pub fn close_for_kept_session(self) {
        self.close_with(KEEP_SESSION, "client connection lost, its session kept");
    }

    fn close_with(self, reply_code: u16, reply_text: &str) {
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
                reply_code,
                reply_text: ShortString::from(reply_text),
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
