//! The task that owns the connection: it carries out what the handles ask, hands incoming
//! deliveries and confirms to them, and when the connection breaks moves the session to a
//! new one (the failover the crate documentation describes).

mod failover;

use crate::Error;
use crate::book::{Arrival, ChannelBook, ConsumerSpec, Identity, Logged, Settle};
use crate::recovery::{Recoveries, Refused};
use crate::wire::{Incoming, Target, Wire};
use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::protocol::{AMQPClass, basic, channel, connection, queue, tx};
use amq_protocol::types::{AMQPValue, FieldTable};
use bytes::{Bytes, BytesMut};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use uuid::Uuid;

/// The ringmq header naming a publish's number on its channel.
const PUBLISH_SEQ_HEADER: &str = "x-ringmq-publish-seq";
/// The broker's `core::producers::PRODUCER_HEADER`.
const PRODUCER_HEADER: &str = "x-ringmq-producer";
/// Reply code of a broker's close that keeps the session (drain, lost quorum, shutdown).
const CONNECTION_FORCED: u16 = 320;
/// Reply code of a broker that could not say whether it committed a change (its cluster's
/// leader went with the answer).
const RESOURCE_ERROR: u16 = 506;

/// What the handles and the driver share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub session: Uuid,
    pub failovers: AtomicU64,
    /// Why the session ended, once it did.
    ended: Mutex<Option<String>>,
}

impl Shared {
    /// The error an operation gets once the session ended.
    pub fn ended(&self) -> Error {
        let why = self
            .ended
            .lock()
            .expect("never poisoned: no panics while held")
            .clone()
            .unwrap_or_else(|| "the client was dropped".into());
        Error::Ended(why)
    }
}

/// What a handle asks of the driver.
#[derive(Debug)]
pub(crate) enum Cmd {
    OpenChannel {
        reply: oneshot::Sender<Result<u16, Error>>,
    },
    Call {
        channel: u16,
        method: AMQPClass,
        consumer: Option<ConsumerSpec>,
        reply: oneshot::Sender<Result<AMQPClass, Error>>,
    },
    Publish {
        channel: u16,
        exchange: String,
        routing_key: String,
        properties: AMQPProperties,
        body: Bytes,
        outcome: oneshot::Sender<bool>,
    },
    Settle {
        channel: u16,
        settle: Settle,
    },
    Close {
        reply: oneshot::Sender<Result<(), Error>>,
    },
}

/// A synchronous method sent and not yet answered.
#[derive(Debug)]
struct Pending {
    method: AMQPClass,
    consumer: Option<ConsumerSpec>,
    reply: Option<oneshot::Sender<Result<AMQPClass, Error>>>,
    /// `channel.open` of a channel the application opens (answered with its number).
    open: Option<oneshot::Sender<Result<u16, Error>>>,
    /// The channel's publish count when it was sent: after a failover it is sent again
    /// after the publishes that came before it and before those that came after (a
    /// `tx.commit` after its transaction's publishes).
    published_before: u64,
}

/// A message whose content frames are still arriving.
#[derive(Debug)]
struct Assembling {
    channel: u16,
    deliver: Option<basic::Deliver>,
    size: u64,
    properties: AMQPProperties,
    body: BytesMut,
}

/// `connection.close` reply code that keeps the session (`docs/sessions.md` §1).
const KEEP_SESSION: u16 = 330;

/// Longest wait for the close that leaves a member to be written.
const LEAVE_TIMEOUT: Duration = Duration::from_millis(200);

/// How serving a connection ended.
enum Ended {
    /// The application closed the client.
    Closed,
    /// The connection broke: fail over.
    Broken(String),
    /// The member cannot serve a command the application waits for: leave it, keeping the
    /// session, and fail over.
    Unserved(String),
    /// The session cannot go on.
    Fatal(String),
}

struct Driver {
    config: crate::Config,
    first: Target,
    /// Failover candidates by address: the configured URIs, then the members named in
    /// known-hosts.
    candidates: Vec<Target>,
    shared: Arc<Shared>,
    cmds: mpsc::UnboundedReceiver<Cmd>,
    wire: Wire,
    channel_max: u16,
    books: BTreeMap<u16, ChannelBook>,
    pending: HashMap<u16, VecDeque<Pending>>,
    assembling: Option<Assembling>,
    next_channel: u16,
    /// Consumers the broker cancelled, being created again (`crate::recovery`).
    recoveries: Recoveries,
}

/// Connects, opens the session and starts the driver.
pub(crate) async fn start(
    config: crate::Config,
) -> Result<(mpsc::UnboundedSender<Cmd>, Arc<Shared>), Error> {
    let targets = config
        .uris
        .iter()
        .map(|u| Target::parse(u))
        .collect::<Result<Vec<_>, _>>()?;
    let Some(first) = targets.first().cloned() else {
        return Err(Error::Uri("no URI given".into()));
    };
    let (wire, known_hosts, session) = first_connection(&targets, &config).await?;
    let shared = Arc::new(Shared {
        session,
        failovers: AtomicU64::new(0),
        ended: Mutex::new(None),
    });
    let (tx, cmds) = mpsc::unbounded_channel();
    let mut driver = Driver {
        config,
        first: first.clone(),
        candidates: targets,
        shared: shared.clone(),
        cmds,
        channel_max: wire.channel_max,
        wire,
        books: BTreeMap::new(),
        pending: HashMap::new(),
        assembling: None,
        next_channel: 1,
        recoveries: Recoveries::default(),
    };
    driver.learn(&known_hosts);
    tokio::spawn(driver.run());
    Ok((tx, shared))
}

/// Opens the client's first connection, starting a new session: each target in turn, round
/// after round, pausing longer each time, until one takes it or the failover limit is up. A
/// member that is not ready or being drained (320), one that cannot say whether it
/// committed the session (506, its cluster leader changing), and one that does not answer
/// are passed over as a failover passes them — a cluster in the middle of an election is
/// no reason for an application not to start; any other refusal (a wrong password, an
/// unknown vhost) is the answer. Each attempt starts a session of its own id: one whose
/// start a member may have committed is never asked for twice.
async fn first_connection(
    targets: &[Target],
    config: &crate::Config,
) -> Result<(Wire, String, uuid::Uuid), Error> {
    let deadline = tokio::time::Instant::now() + config.failover_timeout;
    let mut pause = Duration::from_millis(50);
    loop {
        let mut last = None;
        for t in targets {
            let session = uuid::Builder::from_random_bytes(rand08::random()).into_uuid();
            let mut props = FieldTable::default();
            props.insert(
                "qpid.session.start".into(),
                AMQPValue::LongString(session.to_string().as_str().into()),
            );
            props.insert(
                "qpid.session.timeout".into(),
                AMQPValue::LongLongInt(i64::try_from(config.session_timeout_s).unwrap_or(i64::MAX)),
            );
            let attempt = tokio::time::timeout(
                failover::CONNECT_TIMEOUT,
                Wire::open(t, props, config.heartbeat_s),
            )
            .await
            .unwrap_or_else(|_| {
                Err(Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no answer to the handshake",
                )))
            });
            match attempt {
                Ok((wire, known_hosts)) => return Ok((wire, known_hosts, session)),
                Err(e) if passed_over(&e) => {
                    tracing::debug!(at = %t.addr, error = %e, "first connection attempt failed: trying the next");
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        let last = last.unwrap_or_else(|| Error::Uri("no URI given".into()));
        if tokio::time::Instant::now() + pause > deadline {
            return Err(last);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// Whether a failed first connection attempt is one a failover would pass over.
fn passed_over(e: &Error) -> bool {
    match e {
        Error::Io(_) => true,
        Error::Refused { code, .. } => [CONNECTION_FORCED, RESOURCE_ERROR].contains(code),
        _ => false,
    }
}

/// The `basic.consume` that creates `spec` (again).
pub(crate) fn consume_method(spec: &ConsumerSpec) -> basic::Consume {
    basic::Consume {
        queue: spec.queue.as_str().into(),
        consumer_tag: spec.tag.as_str().into(),
        no_local: false,
        no_ack: spec.no_ack,
        exclusive: false,
        nowait: false,
        arguments: FieldTable::default(),
    }
}

impl Driver {
    async fn run(mut self) {
        loop {
            let ended = self.serve().await;
            match ended {
                Ended::Closed => return,
                Ended::Fatal(why) => return self.end(why),
                Ended::Broken(why) => {
                    if let Err(why) = self.failover(&why).await {
                        return self.end(why);
                    }
                }
                Ended::Unserved(why) => {
                    self.leave_keeping_session().await;
                    if let Err(why) = self.failover(&why).await {
                        return self.end(why);
                    }
                }
            }
        }
    }

    /// Closes the connection with 330 (KEEP_SESSION), without waiting for the answer: the
    /// member lets go of the session at once, and the resume elsewhere is not refused as
    /// attached to this connection.
    async fn leave_keeping_session(&mut self) {
        self.wire.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: KEEP_SESSION,
                reply_text: "failing over".into(),
                class_id: 0,
                method_id: 0,
            })),
        );
        let _ = tokio::time::timeout(LEAVE_TIMEOUT, self.wire.flush()).await;
    }

    /// The session is over: every waiter learns why.
    fn end(mut self, why: String) {
        tracing::warn!(session = %self.shared.session, reason = %why, "session ended");
        *self
            .shared
            .ended
            .lock()
            .expect("never poisoned: no panics while held") = Some(why);
        self.books.clear();
        self.pending.clear();
        self.cmds.close();
    }

    /// Adds the members of `known_hosts` (comma-separated host:port) to the candidates.
    fn learn(&mut self, known_hosts: &str) {
        for addr in known_hosts
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
        {
            if !self.candidates.iter().any(|t| t.addr == addr) {
                self.candidates.push(self.first.at(addr));
            }
        }
    }

    /// Serves the current connection until it ends.
    async fn serve(&mut self) -> Ended {
        let period = match self.wire.heartbeat_s {
            0 => Duration::from_secs(3600),
            s => Duration::from_millis(u64::from(s) * 500),
        };
        let silence = Duration::from_secs(u64::from(self.wire.heartbeat_s.max(1)) * 2);
        let mut tick = tokio::time::interval(period);
        let mut last_heard = Instant::now();
        loop {
            tokio::select! {
                frame = self.wire.read() => match frame {
                    Ok(frame) => {
                        last_heard = Instant::now();
                        if let Some(ended) = self.on_frame(frame) {
                            let _ = self.wire.flush().await;
                            return ended;
                        }
                    }
                    Err(e) => return Ended::Broken(e.to_string()),
                },
                cmd = self.cmds.recv() => match cmd {
                    Some(cmd) => {
                        if let Some(ended) = self.on_cmd(cmd) {
                            let _ = self.wire.flush().await;
                            return ended;
                        }
                    }
                    None => {
                        // Every handle is gone: end the session as a close would.
                        self.close_connection();
                        let _ = self.wire.flush().await;
                        return Ended::Closed;
                    }
                },
                _ = at(self.recoveries.due()) => self.ask_for_cancelled_queue(),
                _ = tick.tick() => {
                    if self.wire.heartbeat_s > 0 {
                        if last_heard.elapsed() > silence {
                            return Ended::Broken(format!("no frame from the broker for {silence:?}"));
                        }
                        self.wire.heartbeat();
                    }
                }
            }
            if let Err(e) = self.wire.flush().await {
                return Ended::Broken(e.to_string());
            }
        }
    }

    fn on_cmd(&mut self, cmd: Cmd) -> Option<Ended> {
        match cmd {
            Cmd::OpenChannel { reply } => {
                let scratch = self.recoveries.scratch();
                let Some(id) = (self.next_channel..=self.channel_max)
                    .find(|id| !self.books.contains_key(id) && Some(*id) != scratch)
                else {
                    let _ = reply.send(Err(Error::Protocol("no channel number left".into())));
                    return None;
                };
                self.next_channel = id + 1;
                self.books.insert(
                    id,
                    ChannelBook {
                        producer: format!("{}:{id}", self.shared.session),
                        ..ChannelBook::default()
                    },
                );
                let method = AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}));
                self.wire.method(id, method.clone());
                self.pending.entry(id).or_default().push_back(Pending {
                    method,
                    consumer: None,
                    reply: None,
                    open: Some(reply),
                    published_before: 0,
                });
            }
            Cmd::Call {
                channel,
                method,
                consumer,
                reply,
            } => {
                let Some(book) = self.books.get_mut(&channel) else {
                    let _ = reply.send(Err(Error::ChannelClosed {
                        channel,
                        code: 0,
                        text: "the channel is closed".into(),
                    }));
                    return None;
                };
                match &method {
                    AMQPClass::Confirm(_) => book.select_confirms(),
                    AMQPClass::Tx(tx::AMQPMethod::Select(_)) => book.select_tx(),
                    AMQPClass::Tx(tx::AMQPMethod::Commit(_) | tx::AMQPMethod::Rollback(_)) => {
                        book.tx_ending();
                    }
                    _ => {}
                }
                let published_before = book.published;
                self.wire.method(channel, method.clone());
                self.pending.entry(channel).or_default().push_back(Pending {
                    method,
                    consumer,
                    reply: Some(reply),
                    open: None,
                    published_before,
                });
            }
            Cmd::Publish {
                channel,
                exchange,
                routing_key,
                properties,
                body,
                outcome,
            } => {
                // On a channel the broker closed: dropped, and its confirmation fails.
                let book = self.books.get_mut(&channel)?;
                let confirm = book.confirm_base.is_some();
                let properties = numbered(properties, book.published + 1, &book.producer);
                let logged = Logged {
                    seq: 0,
                    exchange,
                    routing_key,
                    properties,
                    body,
                    outcome: None,
                };
                self.wire.publish(
                    channel,
                    publish_method(&logged),
                    &logged.properties,
                    &logged.body,
                );
                if confirm {
                    book.record_publish(Logged {
                        outcome: Some(outcome),
                        ..logged
                    });
                } else {
                    book.record_publish(logged);
                    let _ = outcome.send(true);
                }
            }
            Cmd::Settle { channel, settle } => {
                if let Some(book) = self.books.get_mut(&channel) {
                    for settle in book.settle(settle) {
                        self.wire
                            .method(channel, AMQPClass::Basic(settle_method(settle)));
                    }
                }
            }
            Cmd::Close { reply } => {
                self.close_connection();
                let _ = reply.send(Ok(()));
                return Some(Ended::Closed);
            }
        }
        None
    }

    fn close_connection(&mut self) {
        self.wire.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: 200,
                reply_text: "bye".into(),
                class_id: 0,
                method_id: 0,
            })),
        );
    }

    fn on_frame(&mut self, frame: Incoming) -> Option<Ended> {
        match frame {
            Incoming::Heartbeat => {}
            Incoming::Header(ch, size, properties) => {
                if let Some(a) = self.assembling.as_mut().filter(|a| a.channel == ch) {
                    a.size = size;
                    a.properties = properties;
                    if size == 0 {
                        self.delivered();
                    }
                }
            }
            Incoming::Body(ch, part) => {
                if let Some(a) = self.assembling.as_mut().filter(|a| a.channel == ch) {
                    a.body.extend_from_slice(&part);
                    if a.body.len() as u64 >= a.size {
                        self.delivered();
                    }
                }
            }
            Incoming::Method(ch, m) => return self.on_method(ch, m),
        }
        None
    }

    fn on_method(&mut self, ch: u16, m: AMQPClass) -> Option<Ended> {
        if Some(ch) == self.recoveries.scratch() {
            self.on_scratch_answer(ch, m);
            return None;
        }
        match m {
            AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) => {
                self.assembling = Some(Assembling {
                    channel: ch,
                    deliver: Some(d),
                    size: 0,
                    properties: AMQPProperties::default(),
                    body: BytesMut::new(),
                });
            }
            AMQPClass::Basic(basic::AMQPMethod::Return(_)) => {
                // Returned messages are not offered: their content is read and dropped.
                self.assembling = Some(Assembling {
                    channel: ch,
                    deliver: None,
                    size: 0,
                    properties: AMQPProperties::default(),
                    body: BytesMut::new(),
                });
            }
            AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => {
                tracing::trace!(
                    channel = ch,
                    tag = a.delivery_tag,
                    multiple = a.multiple,
                    "ack"
                );
                if let Some(book) = self.books.get_mut(&ch) {
                    book.confirmed(a.delivery_tag, a.multiple, true);
                }
            }
            AMQPClass::Basic(basic::AMQPMethod::Nack(n)) => {
                if let Some(book) = self.books.get_mut(&ch) {
                    book.confirmed(n.delivery_tag, n.multiple, false);
                }
            }
            AMQPClass::Basic(basic::AMQPMethod::Cancel(c)) => {
                // The broker ended a consumer the application did not cancel (its queue's
                // primary was lost, or the queue deleted): created again if the queue
                // answers, else the application's consumer ends.
                if let Some(book) = self.books.get_mut(&ch)
                    && let Some(i) = book
                        .consumers
                        .iter()
                        .position(|s| s.tag == c.consumer_tag.as_str())
                {
                    let spec = book.consumers.remove(i);
                    book.consumer_lost();
                    tracing::info!(channel = ch, tag = %spec.tag, queue = %spec.queue, "consumer cancelled by the broker: creating it again once its queue answers");
                    let now = Instant::now();
                    self.recoveries
                        .cancelled(ch, spec, now, now + self.config.failover_timeout);
                }
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(c))
                if crate::recovery::is_unreachable(c.reply_code, c.reply_text.as_str()) =>
            {
                // A queue's primary was lost while the channel waited for it (a commit's
                // acks, a get): the member cannot say what became of the command, and the
                // application must not see the loss. Failing over resumes the session; the
                // channel, closed here, starts over there, and what the application waits
                // for is sent again (docs/sessions.md §5).
                return Some(Ended::Unserved(format!(
                    "channel {ch} closed by the broker: {} {}",
                    c.reply_code, c.reply_text
                )));
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(c)) => {
                self.wire.method(
                    ch,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
                self.books.remove(&ch);
                for p in self.pending.remove(&ch).unwrap_or_default() {
                    let err = || Error::ChannelClosed {
                        channel: ch,
                        code: c.reply_code,
                        text: c.reply_text.to_string(),
                    };
                    if let Some(r) = p.reply {
                        let _ = r.send(Err(err()));
                    }
                    if let Some(r) = p.open {
                        let _ = r.send(Err(err()));
                    }
                }
            }
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
                self.wire.method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                let why = format!(
                    "the broker closed the connection: {} {}",
                    c.reply_code, c.reply_text
                );
                return Some(if c.reply_code == CONNECTION_FORCED {
                    Ended::Broken(why)
                } else {
                    Ended::Fatal(why)
                });
            }
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => {
                return Some(Ended::Closed);
            }
            AMQPClass::Connection(_) => {}
            reply => self.answered(ch, reply),
        }
        None
    }

    /// Asks, on a scratch channel, for the queue of the next cancelled consumer that is due
    /// (`crate::recovery`).
    fn ask_for_cancelled_queue(&mut self) {
        let Some(scratch) = (1..=self.channel_max)
            .rev()
            .find(|id| !self.books.contains_key(id))
        else {
            // Every channel number is the application's: nothing to ask on.
            for (_, spec) in self.recoveries.take_all() {
                tracing::warn!(tag = %spec.tag, queue = %spec.queue, "no channel number left to ask for a cancelled consumer's queue: the consumer ends");
            }
            return;
        };
        let mut gone = Vec::new();
        let queue = self.recoveries.start(Instant::now(), scratch, &mut gone);
        for spec in gone {
            tracing::warn!(tag = %spec.tag, queue = %spec.queue, "a cancelled consumer's queue did not answer within the failover limit: the consumer ends");
        }
        let Some(queue) = queue else {
            return;
        };
        self.wire.method(
            scratch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        );
        self.wire.method(
            scratch,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: queue.as_str().into(),
                passive: true,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        );
    }

    /// What the broker answered on the scratch channel of a cancelled consumer's ask.
    fn on_scratch_answer(&mut self, scratch: u16, m: AMQPClass) {
        match m {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_)) => {
                self.wire.method(
                    scratch,
                    AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                        reply_code: 200,
                        reply_text: "queue found".into(),
                        class_id: 0,
                        method_id: 0,
                    })),
                );
                let Some((ch, spec)) = self.recoveries.found() else {
                    return;
                };
                if !self.books.contains_key(&ch) {
                    return;
                }
                tracing::info!(channel = ch, tag = %spec.tag, queue = %spec.queue, "consumer created again");
                let method = AMQPClass::Basic(basic::AMQPMethod::Consume(consume_method(&spec)));
                self.wire.method(ch, method.clone());
                let published_before = self.books.get(&ch).map_or(0, |b| b.published);
                self.pending.entry(ch).or_default().push_back(Pending {
                    method,
                    consumer: Some(spec),
                    reply: None,
                    open: None,
                    published_before,
                });
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(c)) => {
                self.wire.method(
                    scratch,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
                let refused =
                    self.recoveries
                        .refused(c.reply_code, c.reply_text.as_str(), Instant::now());
                if let Some(Refused::GivenUp(spec, why)) = refused {
                    tracing::warn!(tag = %spec.tag, queue = %spec.queue, %why, "a cancelled consumer's queue is gone: the consumer ends");
                }
            }
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => self.recoveries.closed(),
            _ => {}
        }
    }

    /// The reply to the oldest synchronous method sent on `ch`.
    fn answered(&mut self, ch: u16, reply: AMQPClass) {
        let Some(p) = self.pending.get_mut(&ch).and_then(VecDeque::pop_front) else {
            tracing::debug!(channel = ch, ?reply, "a reply nobody waits for");
            return;
        };
        if let Some(book) = self.books.get_mut(&ch) {
            if let Some(spec) = p.consumer {
                book.consumers.push(spec);
            }
            match &p.method {
                AMQPClass::Basic(basic::AMQPMethod::Qos(q)) => {
                    book.prefetch = Some((q.prefetch_count, q.global));
                }
                AMQPClass::Tx(tx::AMQPMethod::Commit(_)) => book.tx_ended(true),
                AMQPClass::Tx(tx::AMQPMethod::Rollback(_)) => book.tx_ended(false),
                _ => {}
            }
        }
        if let Some(r) = p.open {
            let _ = r.send(Ok(ch));
        }
        if let Some(r) = p.reply {
            let _ = r.send(Ok(reply));
        }
    }

    /// A delivery's content is complete: to its consumer, unless the application had it.
    fn delivered(&mut self) {
        let Some(a) = self.assembling.take() else {
            return;
        };
        let Some(d) = a.deliver else {
            return;
        };
        let Some(book) = self.books.get_mut(&a.channel) else {
            return;
        };
        let identity = identity_of(&a.properties);
        let tag = match book.arrival(d.delivery_tag, identity.as_ref()) {
            Arrival::New(tag) => tag,
            Arrival::Seen => return,
            Arrival::SettleAgain(settle) => {
                self.wire
                    .method(a.channel, AMQPClass::Basic(settle_method(settle)));
                return;
            }
        };
        let Some(i) = book
            .consumers
            .iter()
            .position(|s| s.tag == d.consumer_tag.as_str())
        else {
            return;
        };
        let redelivered = book.redelivered(identity.as_ref(), d.redelivered);
        if !book.consumers[i].no_ack {
            book.held(tag, identity);
        }
        let _ = book.consumers[i].deliveries.send(crate::Delivery {
            delivery_tag: tag,
            redelivered,
            exchange: d.exchange.to_string(),
            routing_key: d.routing_key.to_string(),
            consumer_tag: d.consumer_tag.to_string(),
            properties: a.properties,
            body: a.body.freeze(),
        });
    }
}

/// Waits until `t`; for ever when there is nothing to wait for.
async fn at(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

fn publish_method(p: &Logged) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
        exchange: p.exchange.as_str().into(),
        routing_key: p.routing_key.as_str().into(),
        mandatory: false,
        immediate: false,
    }))
}

/// A publish's properties with its number on the channel in `x-ringmq-publish-seq` and the
/// channel's name in `x-ringmq-producer` (`<session>:<channel>`), by which the member the
/// session is on — or, after that member's loss, each queue the publish reached — drops a
/// resent duplicate (`docs/sessions.md` §3).
fn numbered(properties: AMQPProperties, seq: u64, producer: &str) -> AMQPProperties {
    let mut headers = properties.headers().clone().unwrap_or_default();
    headers.insert(
        PUBLISH_SEQ_HEADER.into(),
        AMQPValue::LongLongInt(i64::try_from(seq).unwrap_or(i64::MAX)),
    );
    headers.insert(
        PRODUCER_HEADER.into(),
        AMQPValue::LongString(producer.into()),
    );
    properties.with_headers(headers)
}

/// A delivered message's identity: the producer and number its publish carried, when it
/// was published by a session's channel (this client numbers every publish).
fn identity_of(properties: &AMQPProperties) -> Option<Identity> {
    let headers = properties.headers().as_ref()?.inner();
    let producer = match headers.get(PRODUCER_HEADER)? {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.to_string(),
        _ => return None,
    };
    let seq = match *headers.get(PUBLISH_SEQ_HEADER)? {
        AMQPValue::LongLongInt(n) => u64::try_from(n).ok()?,
        AMQPValue::LongUInt(n) => n.into(),
        AMQPValue::LongInt(n) => u64::try_from(n).ok()?,
        AMQPValue::Timestamp(n) => n,
        _ => return None,
    };
    Some((producer, seq))
}

fn settle_method(settle: Settle) -> basic::AMQPMethod {
    match settle {
        Settle::Ack { tag, multiple } => basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: tag,
            multiple,
        }),
        Settle::Nack {
            tag,
            multiple,
            requeue,
        } => basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: tag,
            multiple,
            requeue,
        }),
    }
}
