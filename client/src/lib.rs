//! An AMQP 0-9-1 client with ringmq's transparent failover (`docs/sessions.md`).
//!
//! The client opens a resumable session on the first member it reaches. When the connection
//! breaks — the member dies, the network drops it, the broker closes it with 320 — it
//! connects to another candidate (the URIs it was given and the members `connection.open-ok`
//! names in `known-hosts`), resumes the session there, reopens its channels under their
//! numbers, sets their prefetch again, creates their consumers again under their tags, has
//! the broker send again what the lost connection had not delivered (`basic.recover` with
//! `requeue=false`) and hides what the application had already seen, acknowledges again
//! what the application acknowledged and the broker may not have heard, and sends again
//! every publish it has no confirm for. Every publish carries its number and its channel's
//! name (`x-ringmq-publish-seq`, `x-ringmq-producer`), so that the member drops those it had
//! and confirms them with the outcome they first had — or, when the session's member was
//! lost, each queue drops those it took; a delivery that comes back from its queue after
//! such a loss is recognised by the same two headers and not handed out twice (`tags`). The
//! application sees the commands of a run without failure; [`Client::failovers`] tells it,
//! if it asks, how often that happened. A consumer the broker cancels because its queue's primary was
//! lost (a cluster member proxied it) is created again under its tag once a backup has
//! taken the queue over, without a failover of the connection (`recovery`).
//!
//! What it offers is the part of 0-9-1 the failover has to carry: channels, confirm mode,
//! transactions, prefetch, queue declarations, publishing, consuming and settling. Why a client of its own
//! and not lapin: `docs/dependencies.md`.

mod book;
mod driver;
mod recovery;
mod tags;
mod wire;

use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::types::FieldTable;
use bytes::Bytes;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

pub use amq_protocol::protocol::basic::AMQPProperties as Properties;
pub use amq_protocol::types::{AMQPValue, FieldTable as Table};

/// What the client connects to and how patient it is.
#[derive(Debug, Clone)]
pub struct Config {
    /// `amqp://user:password@host:port/vhost` of one or more members; the first is tried
    /// first, the others (and the members the cluster names) on failover. Every candidate
    /// is reached with the first URI's user, password and vhost.
    pub uris: Vec<String>,
    /// How long the broker keeps the session after a connection is lost (it grants at most
    /// its maximum).
    pub session_timeout_s: u64,
    /// Heartbeat to ask for, in seconds: a member that stops answering is noticed after two.
    pub heartbeat_s: u16,
    /// How long a failover may take before the client gives up and reports the session lost.
    pub failover_timeout: Duration,
}

impl Config {
    /// Defaults for `uris`: a 60 s session, 2 s heartbeats, failover given 30 s.
    pub fn new<S: Into<String>>(uris: impl IntoIterator<Item = S>) -> Config {
        Config {
            uris: uris.into_iter().map(Into::into).collect(),
            session_timeout_s: 60,
            heartbeat_s: 2,
            failover_timeout: Duration::from_secs(30),
        }
    }
}

/// Why an operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A URI the client cannot use.
    #[error("bad URI {0}")]
    Uri(String),
    /// The socket failed.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The broker sent something this client does not understand.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The broker closed the connection (during the handshake: refused it).
    #[error("the broker closed the connection: {code} {text}")]
    Refused {
        /// The reply code.
        code: u16,
        /// The reply text.
        text: String,
    },
    /// The broker closed the channel (a channel error: the operation was wrong).
    #[error("the broker closed channel {channel}: {code} {text}")]
    ChannelClosed {
        /// The channel.
        channel: u16,
        /// The reply code.
        code: u16,
        /// The reply text.
        text: String,
    },
    /// The session ended: the client is closed, or could not take its session back.
    #[error("the session ended: {0}")]
    Ended(String),
}

/// A message a consumer received.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Its delivery tag on the channel, to acknowledge it by.
    pub delivery_tag: u64,
    /// The broker delivered it before (to this or another client).
    pub redelivered: bool,
    /// The exchange it was published to.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// The consumer it went to.
    pub consumer_tag: String,
    /// Its properties.
    pub properties: AMQPProperties,
    /// Its body.
    pub body: Bytes,
}

/// Flags of a queue declaration.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueOptions {
    /// Only check that it exists.
    pub passive: bool,
    /// Survives a broker restart.
    pub durable: bool,
    /// Owned by this session.
    pub exclusive: bool,
    /// Deleted when its last consumer goes.
    pub auto_delete: bool,
}

/// What `queue.declare-ok` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueDeclared {
    /// The queue's name (the broker's choice when asked for none).
    pub name: String,
    /// Messages ready in it.
    pub message_count: u32,
    /// Its consumers.
    pub consumer_count: u32,
}

/// The outcome of a publish: in confirm mode the broker's confirm, else that it was sent.
#[derive(Debug)]
pub struct Confirmation(oneshot::Receiver<bool>, Arc<driver::Shared>);

impl Confirmation {
    /// Waits for the outcome: `true` for an ack (or, outside confirm mode, once sent), `false`
    /// for a nack.
    pub async fn wait(self) -> Result<bool, Error> {
        let Confirmation(rx, shared) = self;
        rx.await.map_err(|_| shared.ended())
    }
}

/// A consumer's deliveries, in order.
#[derive(Debug)]
pub struct Consumer {
    tag: String,
    rx: mpsc::UnboundedReceiver<Delivery>,
}

impl Consumer {
    /// Its consumer tag.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The next delivery; `None` once the consumer or the client ended.
    pub async fn next(&mut self) -> Option<Delivery> {
        self.rx.recv().await
    }

    /// The next delivery if one has arrived: a consumer that acknowledges in batches reads
    /// what is there, then acks once.
    pub fn try_next(&mut self) -> Option<Delivery> {
        self.rx.try_recv().ok()
    }
}

/// A connection to the cluster that survives the loss of its member. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    cmd: mpsc::UnboundedSender<driver::Cmd>,
    shared: Arc<driver::Shared>,
}

impl Client {
    /// Connects to the first URI that answers and opens a session.
    pub async fn connect(config: Config) -> Result<Client, Error> {
        let (cmd, shared) = driver::start(config).await?;
        Ok(Client { cmd, shared })
    }

    /// The session's id.
    pub fn session_id(&self) -> uuid::Uuid {
        self.shared.session
    }

    /// How many times the client moved its session to a new connection.
    pub fn failovers(&self) -> u64 {
        self.shared.failovers.load(Ordering::Acquire)
    }

    /// Opens a channel.
    pub async fn channel(&self) -> Result<Channel, Error> {
        let (reply, rx) = oneshot::channel();
        self.send(driver::Cmd::OpenChannel { reply })?;
        let id = rx.await.map_err(|_| self.shared.ended())??;
        Ok(Channel {
            id,
            cmd: self.cmd.clone(),
            shared: self.shared.clone(),
            next_consumer: Arc::new(AtomicU64::new(1)),
        })
    }

    /// Closes the connection and ends the session (its exclusive queues go).
    pub async fn close(&self) -> Result<(), Error> {
        let (reply, rx) = oneshot::channel();
        self.send(driver::Cmd::Close { reply })?;
        rx.await.map_err(|_| self.shared.ended())?
    }

    fn send(&self, cmd: driver::Cmd) -> Result<(), Error> {
        self.cmd.send(cmd).map_err(|_| self.shared.ended())
    }
}

/// A channel of the session: reopened under its number after a failover.
#[derive(Debug, Clone)]
pub struct Channel {
    id: u16,
    cmd: mpsc::UnboundedSender<driver::Cmd>,
    shared: Arc<driver::Shared>,
    next_consumer: Arc<AtomicU64>,
}

impl Channel {
    /// Its number.
    pub fn id(&self) -> u16 {
        self.id
    }

    /// Turns on publisher confirms.
    pub async fn confirm_select(&self) -> Result<(), Error> {
        use amq_protocol::protocol::{AMQPClass, confirm};
        self.call(
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
            None,
        )
        .await
        .map(drop)
    }

    /// Makes the channel transactional: its publishes and settlements wait for
    /// [`Channel::tx_commit`]. A transaction survives a failover: one whose commit the lost
    /// connection did not answer is sent again only if it did not go through
    /// (`docs/sessions.md` §5).
    pub async fn tx_select(&self) -> Result<(), Error> {
        use amq_protocol::protocol::{AMQPClass, tx};
        self.call(AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})), None)
            .await
            .map(drop)
    }

    /// Applies the channel's open transaction: its publishes, then its settlements.
    pub async fn tx_commit(&self) -> Result<(), Error> {
        use amq_protocol::protocol::{AMQPClass, tx};
        self.call(AMQPClass::Tx(tx::AMQPMethod::Commit(tx::Commit {})), None)
            .await
            .map(drop)
    }

    /// Discards the channel's open transaction: its publishes are dropped, and the
    /// deliveries it settled are the application's again, unsettled.
    pub async fn tx_rollback(&self) -> Result<(), Error> {
        use amq_protocol::protocol::{AMQPClass, tx};
        self.call(
            AMQPClass::Tx(tx::AMQPMethod::Rollback(tx::Rollback {})),
            None,
        )
        .await
        .map(drop)
    }

    /// Sets the prefetch count of the consumers created after it.
    pub async fn qos(&self, prefetch_count: u16) -> Result<(), Error> {
        use amq_protocol::protocol::{AMQPClass, basic};
        self.call(
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count,
                global: false,
            })),
            None,
        )
        .await
        .map(drop)
    }

    /// Declares a queue.
    pub async fn queue_declare(
        &self,
        name: &str,
        options: QueueOptions,
        arguments: FieldTable,
    ) -> Result<QueueDeclared, Error> {
        use amq_protocol::protocol::{AMQPClass, queue};
        let reply = self
            .call(
                AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                    queue: name.into(),
                    passive: options.passive,
                    durable: options.durable,
                    exclusive: options.exclusive,
                    auto_delete: options.auto_delete,
                    nowait: false,
                    arguments,
                })),
                None,
            )
            .await?;
        match reply {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => Ok(QueueDeclared {
                name: ok.queue.to_string(),
                message_count: ok.message_count,
                consumer_count: ok.consumer_count,
            }),
            other => Err(Error::Protocol(format!(
                "expected queue.declare-ok, got {other:?}"
            ))),
        }
    }

    /// Publishes a message; the [`Confirmation`] says how it went.
    pub fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        properties: AMQPProperties,
        body: impl Into<Bytes>,
    ) -> Result<Confirmation, Error> {
        let (outcome, rx) = oneshot::channel();
        self.cmd
            .send(driver::Cmd::Publish {
                channel: self.id,
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
                properties,
                body: body.into(),
                outcome,
            })
            .map_err(|_| self.shared.ended())?;
        Ok(Confirmation(rx, self.shared.clone()))
    }

    /// Starts a consumer on `queue` under `consumer_tag` (one of the client's making when
    /// empty: a consumer is created again under its tag after a failover).
    pub async fn consume(
        &self,
        queue: &str,
        consumer_tag: &str,
        no_ack: bool,
    ) -> Result<Consumer, Error> {
        use amq_protocol::protocol::{AMQPClass, basic};
        let tag = if consumer_tag.is_empty() {
            let n = self.next_consumer.fetch_add(1, Ordering::Relaxed);
            format!("ringmq-client.{}.{n}", self.id)
        } else {
            consumer_tag.to_owned()
        };
        let (deliveries, rx) = mpsc::unbounded_channel();
        let spec = book::ConsumerSpec {
            tag: tag.clone(),
            queue: queue.to_owned(),
            no_ack,
            deliveries,
        };
        self.call(
            AMQPClass::Basic(basic::AMQPMethod::Consume(driver::consume_method(&spec))),
            Some(spec),
        )
        .await?;
        Ok(Consumer { tag, rx })
    }

    /// Acknowledges delivery `delivery_tag` (and, with `multiple`, every one before it).
    pub fn ack(&self, delivery_tag: u64, multiple: bool) -> Result<(), Error> {
        self.settle(book::Settle::Ack {
            tag: delivery_tag,
            multiple,
        })
    }

    /// Rejects delivery `delivery_tag` (with `multiple`, every one before it too), back to
    /// its queue when `requeue`.
    pub fn nack(&self, delivery_tag: u64, multiple: bool, requeue: bool) -> Result<(), Error> {
        self.settle(book::Settle::Nack {
            tag: delivery_tag,
            multiple,
            requeue,
        })
    }

    fn settle(&self, settle: book::Settle) -> Result<(), Error> {
        self.cmd
            .send(driver::Cmd::Settle {
                channel: self.id,
                settle,
            })
            .map_err(|_| self.shared.ended())
    }

    async fn call(
        &self,
        method: amq_protocol::protocol::AMQPClass,
        consumer: Option<book::ConsumerSpec>,
    ) -> Result<amq_protocol::protocol::AMQPClass, Error> {
        let (reply, rx) = oneshot::channel();
        self.cmd
            .send(driver::Cmd::Call {
                channel: self.id,
                method,
                consumer,
                reply,
            })
            .map_err(|_| self.shared.ended())?;
        rx.await.map_err(|_| self.shared.ended())?
    }
}
