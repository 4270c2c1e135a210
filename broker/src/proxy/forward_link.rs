//! The forwarding connection to a cluster member, on the broker's own codec.
//!
//! Forwarded publishes are the busiest thing a proxy does: every publish through a member
//! that is not its queue's primary crosses a link once. A general AMQP client (lapin) costs
//! several allocations and copies per message there — the method, the properties encoded
//! again, the body copied, a confirm future each. This connection does only what
//! forwarding needs: one confirm-mode channel, publishes written with the broker's own
//! [`FrameWriter`] — the content header as the publisher's bytes, encoded once when the
//! message arrived, the body as it is — a batch per `write`, and a reader task that
//! settles the batch's tickets as the member's confirms come in (`multiple` acks settle
//! runs at once).
//!
//! It logs in as any link does ([`super::link::open_raw`]): [`super::link::LINK_USER`], the
//! cluster-secret HMAC and the [`super::link::LINK_PROPERTY`] client property, so the member routes what it publishes into
//! the queues it owns only. It speaks to cluster members only; foreign brokers get lapin.

use super::forward::{ForwardOutcome, Job, Ticket, fail};
use super::link::LinkError;
use crate::amqp::frame::{FRAME_METHOD, split_frame};
use crate::amqp::writer::FrameWriter;
use crate::amqp::{AMQPClass, ShortString, basic, channel, confirm, connection};
use crate::client::{ClientError, RawClient};
use bytes::BytesMut;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// The channel forwards travel on.
const CHANNEL: u16 = 1;

/// The largest frame this side asks for: the member's own limit is usually lower.
const FRAME_MAX: u32 = 128 * 1024;

/// Heartbeat asked for (seconds): a member that vanishes without a reset (a cut cable, a
/// frozen VM) fails the forwards waiting on it within two of these.
const HEARTBEAT_S: u16 = 10;

/// Bytes encoded before they are written: a long queue of forwards goes out in writes of
/// about this size rather than all encoded at once.
const WRITE_CHUNK: usize = 512 * 1024;

/// Longest wait to connect and log in, and for the member to take a batch's bytes.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// Forwards written and not yet confirmed, by delivery tag, and whether the connection
/// still works.
#[derive(Default)]
struct Waiting {
    tickets: BTreeMap<u64, Option<Ticket>>,
    /// Why the connection stopped working; no forward is registered after that.
    failed: Option<String>,
    /// The member said `connection.blocked` (and not yet `unblocked`).
    blocked: bool,
}

impl Waiting {
    /// Settles every ticket up to `tag` (`multiple`) or just `tag`.
    fn settle(&mut self, tag: u64, multiple: bool, outcome: &ForwardOutcome) {
        let settled = if multiple {
            let rest = self.tickets.split_off(&(tag + 1));
            std::mem::replace(&mut self.tickets, rest)
        } else {
            self.tickets
                .remove(&tag)
                .map(|t| (tag, t))
                .into_iter()
                .collect()
        };
        for (tracker, id) in settled.into_values().flatten() {
            tracker.settle(id, outcome.clone());
        }
    }

    /// The connection failed: nothing waiting will be confirmed.
    fn fail(&mut self, reason: String) {
        let failed = ForwardOutcome::Failed(reason.clone());
        for (tracker, id) in std::mem::take(&mut self.tickets).into_values().flatten() {
            tracker.settle(id, failed.clone());
        }
        self.failed.get_or_insert(reason);
    }
}

/// A forwarding connection to one member for one vhost.
pub struct ForwardLink {
    member: String,
    write: OwnedWriteHalf,
    out: FrameWriter,
    frame_max: u32,
    next_tag: u64,
    heartbeat_s: u16,
    /// The newest cluster change the member was told about.
    told: u64,
    /// The publish origin the member was told about last ([`super::catch_up::origin`]).
    told_origin: Option<Arc<str>>,
    waiting: Arc<Mutex<Waiting>>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for ForwardLink {
    fn drop(&mut self) {
        self.reader.abort();
        self.waiting.lock().fail(format!(
            "the link to cluster member '{}' closed",
            self.member
        ));
    }
}

impl ForwardLink {
    /// Connects to `member` at `addr`, logs in for `vhost` with the link `password`, and
    /// opens the confirm-mode channel.
    pub async fn open(
        member: &str,
        addr: &str,
        vhost: &str,
        password: &str,
    ) -> Result<Self, LinkError> {
        let failed = |reason: String| LinkError::Failed {
            node: member.to_owned(),
            addr: addr.to_owned(),
            reason,
        };
        let opened = tokio::time::timeout(IO_TIMEOUT, handshake(addr, vhost, password)).await;
        let (stream, rbuf, frame_max, heartbeat_s) = match opened {
            Ok(Ok(opened)) => opened,
            Ok(Err(e)) => return Err(failed(e.to_string())),
            Err(_) => return Err(failed(format!("no answer within {IO_TIMEOUT:?}"))),
        };
        let (read, write) = stream.into_split();
        let waiting = Arc::new(Mutex::new(Waiting::default()));
        let reader = tokio::spawn(read_confirms(
            read,
            rbuf,
            frame_max,
            silence_limit(heartbeat_s),
            member.to_owned(),
            waiting.clone(),
        ));
        tracing::info!(node = member, addr, vhost, "forwarding link opened");
        Ok(Self {
            member: member.to_owned(),
            write,
            out: FrameWriter::default(),
            frame_max,
            next_tag: 0,
            heartbeat_s,
            told: 0,
            told_origin: None,
            waiting,
            reader,
        })
    }

    /// Whether the connection still works.
    pub fn is_open(&self) -> bool {
        self.waiting.lock().failed.is_none()
    }

    /// Writes `jobs` (in writes of about [`WRITE_CHUNK`] bytes); each ticket is settled
    /// when the member answers, or when the connection fails. Errors when the connection
    /// had failed before or fails while writing: the jobs' tickets are failed then too.
    pub async fn send(&mut self, jobs: Vec<Job>) -> Result<(), String> {
        let mut jobs = jobs.into_iter().peekable();
        while jobs.peek().is_some() {
            {
                let shared = self.waiting.clone();
                let mut waiting = shared.lock();
                if let Some(reason) = waiting.failed.clone() {
                    drop(waiting);
                    jobs.for_each(|j| fail(j, &reason));
                    return Err(reason);
                }
                while self.out.len() < WRITE_CHUNK
                    && let Some(job) = jobs.next()
                {
                    self.encode(job, &mut waiting);
                }
            }
            if let Err(reason) = self.flush().await {
                // What was written fails with the link; what was not yet encoded too.
                jobs.for_each(|j| fail(j, &reason));
                return Err(reason);
            }
        }
        Ok(())
    }

    /// Adds one job's frames to the output (after a catch-up if it needs a newer cluster
    /// change than the member was told about) and registers its ticket.
    fn encode(&mut self, job: Job, waiting: &mut Waiting) {
        if job.after_index > self.told {
            self.told = job.after_index;
            self.out
                .method(CHANNEL, super::catch_up::declare(job.after_index));
        }
        if job.origin.is_some() && job.origin != self.told_origin {
            let origin = job.origin.clone().unwrap_or_default();
            self.out
                .method(CHANNEL, super::catch_up::origin_declare(&origin));
            self.told_origin = job.origin.clone();
        }
        self.next_tag += 1;
        waiting.tickets.insert(self.next_tag, job.ticket);
        self.out.method(
            CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: ShortString::from(job.exchange.as_ref()),
                routing_key: ShortString::from(job.routing_key.as_ref()),
                mandatory: false,
                immediate: false,
            })),
        );
        self.out
            .header_payload(CHANNEL, &job.message.header_payload);
        self.out
            .body(CHANNEL, job.message.body.bytes(), self.frame_max);
    }

    /// A heartbeat, so that the member does not take an idle link for a dead one.
    pub async fn heartbeat(&mut self) -> Result<(), String> {
        self.out.heartbeat();
        self.flush().await
    }

    /// Writes the output. A member that takes nothing for [`IO_TIMEOUT`] fails the link —
    /// unless it said it is blocked (`connection.blocked`: a memory or disk alarm), which is
    /// back-pressure to wait out, not a failure; the reader's silence limit still ends the
    /// wait if the member is gone.
    async fn flush(&mut self) -> Result<(), String> {
        let mut write = std::pin::pin!(self.write.write_all(self.out.as_slice()));
        let result = loop {
            match tokio::time::timeout(IO_TIMEOUT, write.as_mut()).await {
                Ok(Ok(())) => break Ok(()),
                Ok(Err(e)) => {
                    break Err(format!(
                        "forwarding to cluster member '{}': {e}",
                        self.member
                    ));
                }
                Err(_) => {
                    let waiting = self.waiting.lock();
                    if let Some(reason) = &waiting.failed {
                        break Err(reason.clone());
                    }
                    if !waiting.blocked {
                        break Err(format!(
                            "cluster member '{}' took nothing for {IO_TIMEOUT:?}",
                            self.member
                        ));
                    }
                }
            }
        };
        self.out.clear();
        if let Err(reason) = &result {
            self.waiting.lock().fail(reason.clone());
        }
        result
    }

    /// How often to send a heartbeat when there is nothing to forward: twice per agreed
    /// heartbeat, so that the member never sees two go by without a frame.
    pub fn heartbeat_period(&self) -> Duration {
        match self.heartbeat_s {
            0 => Duration::from_secs(u64::from(HEARTBEAT_S)),
            s => Duration::from_millis(u64::from(s) * 500),
        }
    }
}

/// Connects, logs in as a link and opens the confirm-mode channel: the stream, what was
/// read past the handshake, the frame-max and the heartbeat agreed.
async fn handshake(
    addr: &str,
    vhost: &str,
    password: &str,
) -> Result<(TcpStream, BytesMut, u32, u16), ClientError> {
    let mut client =
        super::link::open_raw(addr, vhost, password, "ringmq forwarding link", HEARTBEAT_S).await?;
    client
        .call(
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
            |m| matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))),
            "confirm.select-ok",
        )
        .await?;
    let RawClient {
        stream,
        rbuf,
        frame_max,
        heartbeat_s,
        ..
    } = client;
    Ok((stream, rbuf, frame_max.min(FRAME_MAX), heartbeat_s))
}

/// Reads the member's answers until the connection ends: confirms settle their tickets; a
/// close, an error, or silence for two heartbeats fails everything waiting.
async fn read_confirms(
    mut read: OwnedReadHalf,
    mut rbuf: BytesMut,
    frame_max: u32,
    silence: Duration,
    member: String,
    waiting: Arc<Mutex<Waiting>>,
) {
    let reason = loop {
        match split_frame(&mut rbuf, frame_max) {
            Err(e) => break format!("cluster member '{member}' sent a bad frame: {e}"),
            Ok(Some(f)) if f.kind == FRAME_METHOD => {
                match amq_protocol::protocol::parse_class(&f.payload[..]) {
                    Ok((_, method)) => {
                        if let Some(reason) = on_method(method, &member, &waiting) {
                            break reason;
                        }
                    }
                    Err(e) => break format!("cluster member '{member}' sent {e:?}"),
                }
            }
            Ok(Some(_)) => {}
            Ok(None) => match tokio::time::timeout(silence, read.read_buf(&mut rbuf)).await {
                Ok(Ok(0)) => break format!("cluster member '{member}' closed the link"),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => break format!("link to cluster member '{member}': {e}"),
                Err(_) => break format!("cluster member '{member}' silent for {silence:?}"),
            },
        }
    };
    tracing::warn!(node = %member, %reason, "forwarding link failed");
    waiting.lock().fail(reason);
}

/// How long the member may send nothing before the link counts as dead: two heartbeats
/// (the spec's rule), or, when the member wants none, long enough for any confirm.
fn silence_limit(heartbeat_s: u16) -> Duration {
    match heartbeat_s {
        0 => Duration::from_secs(300),
        s => Duration::from_secs(2 * u64::from(s)),
    }
}

/// One method from the member; `Some(reason)` when it ends the link.
fn on_method(method: AMQPClass, member: &str, waiting: &Mutex<Waiting>) -> Option<String> {
    match method {
        AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => {
            waiting
                .lock()
                .settle(a.delivery_tag, a.multiple, &ForwardOutcome::Confirmed);
            None
        }
        AMQPClass::Basic(basic::AMQPMethod::Nack(n)) => {
            // `requeue` on a member's nack: the queue is moving, not refusing (B16).
            let outcome = if n.requeue {
                ForwardOutcome::Moving
            } else {
                ForwardOutcome::Refused
            };
            waiting.lock().settle(n.delivery_tag, n.multiple, &outcome);
            None
        }
        AMQPClass::Connection(connection::AMQPMethod::Close(c)) => Some(format!(
            "cluster member '{member}' closed the link: {} {}",
            c.reply_code, c.reply_text
        )),
        AMQPClass::Channel(channel::AMQPMethod::Close(c)) => Some(format!(
            "cluster member '{member}' closed the forwarding channel: {} {}",
            c.reply_code, c.reply_text
        )),
        AMQPClass::Connection(connection::AMQPMethod::Blocked(_)) => {
            waiting.lock().blocked = true;
            None
        }
        AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)) => {
            waiting.lock().blocked = false;
            None
        }
        // The catch-up's declare-ok: nothing to do (the member answered it before it read
        // what followed).
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::proxy::forward::ForwardTracker;

    fn ticketed(t: &Arc<ForwardTracker>, w: &mut Waiting, tag: u64) -> u64 {
        let id = t.issue();
        w.tickets.insert(tag, Some((t.clone(), id)));
        id
    }

    #[test]
    fn multiple_acks_settle_runs_and_single_ones_only_their_tag() {
        let t = Arc::new(ForwardTracker::default());
        let mut w = Waiting::default();
        for tag in 1..=4 {
            ticketed(&t, &mut w, tag);
        }
        w.settle(3, false, &ForwardOutcome::Refused);
        assert_eq!(t.status().answered_through, 0, "1 and 2 are still out");
        w.settle(2, true, &ForwardOutcome::Confirmed);
        assert_eq!(t.status().answered_through, 3);
        assert!(t.not_taken(3, 3), "the nack refused its forward only");
        assert!(!t.not_taken(1, 2));
        w.fail("gone".into());
        assert_eq!(t.status().answered_through, 4);
        assert_eq!(t.status().failure, Some((4, "gone".to_owned())));
        assert!(w.tickets.is_empty());
    }
}
