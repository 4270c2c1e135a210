//! A feed: one binding of a local queue to a foreign exchange ([`crate::core::Feed`]),
//! carried out on the other broker. This broker keeps a private queue there, bound to the
//! other broker's exchange with the binding's key and arguments, and consumes it into the
//! local queue.
//!
//! **No loss, possible duplicates.** A message is acked on the other broker only after the
//! local enqueue is as durable as the local queue asks (the journal's fsynced prefix covers
//! it, the rule a publisher confirm follows). A crash between the enqueue and the ack leaves
//! the message unacked there: it is delivered again when the feed resumes, so the local
//! queue may hold it twice. For that the private queue must outlive this broker's link, so
//! it is neither exclusive nor auto-delete (either would drop the requeued messages with the
//! link): it is durable, named uniquely for (this broker or cluster, vhost, queue, binding)
//! by [`remote_queue`], deleted when the binding goes, and expires after
//! [`REMOTE_QUEUE_EXPIRES_MS`] without a consumer in case this broker never comes back.

use super::link::{LinkError, Links, not_found, redacted};
use crate::broker::Broker;
use crate::clock::now_ms;
use crate::core::{Effects, Feed};
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use sha2::{Digest, Sha256};
use std::sync::{Arc, Weak};
use std::time::Duration;
use thiserror::Error;
use tokio::sync::{mpsc, watch};

/// Unacked messages the other broker may hand one feed (its `basic.qos`): a bounded number
/// of messages in flight between the other broker's queue and the local journal.
pub const CREDIT: u16 = 256;

/// How long a private queue lives on the other broker without a consumer (`x-expires`):
/// long enough to ride out an outage of this broker, short enough that a broker that never
/// returns does not leave it forever.
pub const REMOTE_QUEUE_EXPIRES_MS: i32 = 7 * 24 * 3600 * 1000;

/// Longest pause between attempts to resume a failed feed.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// How long a stopping feed waits for its last acks and for the deletion of its private
/// queue.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a feed could not be set up or ran no more.
#[derive(Debug, Clone, Error)]
pub enum FeedError {
    /// The link to the other broker failed.
    #[error(transparent)]
    Link(#[from] LinkError),
    /// The other broker has no exchange of that name (any more): the proxy must go.
    #[error("no exchange '{exchange}' on {broker}")]
    ExchangeGone {
        /// The exchange.
        exchange: String,
        /// The other broker, without its password.
        broker: String,
    },
    /// The other broker refused a method or ended the feed's consumer.
    #[error("{broker}: {reason}")]
    Remote {
        /// The other broker, without its password.
        broker: String,
        /// Its answer.
        reason: String,
    },
}

impl FeedError {
    fn remote(feed: &Feed, e: impl std::fmt::Display) -> Self {
        Self::Remote {
            broker: redacted(&feed.home),
            reason: e.to_string(),
        }
    }
}

/// What the reconciler ([`super::feeds`]) tells a running feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Keep feeding.
    Run,
    /// Stop consuming, leave the private queue (the queue's primary moved to another
    /// member, which resumes the feed from it).
    Detach,
    /// Stop and delete the private queue (the binding is gone).
    Delete,
}

/// The name of the private queue of `feed` on the other broker: unique to the broker or
/// cluster (`identity`, [`Broker::feed_identity`]), the vhost and the binding, and the same
/// every time, so a restarted broker or a new primary resumes the same queue. It starts
/// with the local queue's name for the other broker's operators.
pub fn remote_queue(identity: &str, vhost: &str, feed: &Feed) -> String {
    let mut h = Sha256::new();
    for part in [
        identity,
        vhost,
        &feed.queue,
        &feed.exchange,
        &feed.home,
        &feed.routing_key,
    ] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    h.update(serde_json::to_vec(&feed.arguments).unwrap_or_default());
    let digest: String = h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let queue: String = feed.queue.chars().take(100).collect();
    format!("ringmq.feed.{queue}.{digest}")
}

/// Declares the private queue `remote` of `feed` on the other broker and binds it to the
/// exchange with the binding's key and arguments (both idempotent).
pub async fn bind_remote(
    links: &Links,
    vhost: &str,
    remote: &str,
    feed: &Feed,
) -> Result<(), FeedError> {
    let ch = links.channel(&feed.home, vhost).await?;
    let bound = declare_and_bind(&ch, remote, feed).await;
    let _ = ch.close(200, "bound".into()).await;
    bound
}

/// Removes the binding of the private queue `remote` on the other broker, so that nothing
/// published there from now on reaches the local queue; a queue or exchange already gone
/// there counts as unbound.
pub async fn unbind_remote(
    links: &Links,
    vhost: &str,
    remote: &str,
    feed: &Feed,
) -> Result<(), FeedError> {
    let ch = links.channel(&feed.home, vhost).await?;
    let unbound = ch
        .queue_unbind(
            remote.into(),
            feed.exchange.as_ref().into(),
            feed.routing_key.as_str().into(),
            feed.arguments.clone(),
        )
        .await;
    let _ = ch.close(200, "unbound".into()).await;
    match unbound {
        Ok(()) => Ok(()),
        Err(e) if not_found(&e) => Ok(()),
        Err(e) => Err(FeedError::remote(feed, e)),
    }
}

/// Deletes the private queue `remote` of `feed` on the other broker.
async fn delete_remote(
    links: &Links,
    vhost: &str,
    remote: &str,
    feed: &Feed,
) -> Result<(), FeedError> {
    let ch = links.channel(&feed.home, vhost).await?;
    let deleted = ch
        .queue_delete(remote.into(), QueueDeleteOptions::default())
        .await;
    let _ = ch.close(200, "deleted".into()).await;
    match deleted {
        Ok(_) => Ok(()),
        Err(e) if not_found(&e) => Ok(()),
        Err(e) => Err(FeedError::remote(feed, e)),
    }
}

async fn declare_and_bind(ch: &lapin::Channel, remote: &str, feed: &Feed) -> Result<(), FeedError> {
    let mut args = FieldTable::default();
    args.insert(
        "x-expires".into(),
        AMQPValue::LongInt(REMOTE_QUEUE_EXPIRES_MS),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(remote.into(), durable, args)
        .await
        .map_err(|e| FeedError::remote(feed, e))?;
    ch.queue_bind(
        remote.into(),
        feed.exchange.as_ref().into(),
        feed.routing_key.as_str().into(),
        QueueBindOptions::default(),
        feed.arguments.clone(),
    )
    .await
    .map_err(|e| {
        if not_found(&e) {
            FeedError::ExchangeGone {
                exchange: feed.exchange.to_string(),
                broker: redacted(&feed.home),
            }
        } else {
            FeedError::remote(feed, e)
        }
    })
}

/// Runs `feed` of `vhost` from its private queue `remote` until told to stop, resuming it
/// after failures (with a growing pause); on [`Stop::Delete`] deletes the private queue.
pub async fn run(
    broker: Weak<Broker>,
    vhost: String,
    feed: Feed,
    remote: String,
    mut stop: watch::Receiver<Stop>,
) {
    let mut backoff = Duration::from_millis(500);
    loop {
        match session(&broker, &vhost, &feed, &remote, &mut stop).await {
            Ok(()) => break,
            Err(FeedError::ExchangeGone { .. }) => {
                if let Some(b) = broker.upgrade() {
                    let kind = super::watch::Kind::Exchange;
                    super::watch::remove(&b, &vhost, kind, &feed.exchange, &feed.home).await;
                }
            }
            Err(e) => {
                tracing::warn!(vhost, queue = %feed.queue, exchange = %feed.exchange, error = %e, "foreign exchange feed failed; resuming it");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => break,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
    let delete = *stop.borrow() == Stop::Delete;
    if let (true, Some(b)) = (delete, broker.upgrade()) {
        let links = b.proxies().links.clone();
        drop(b);
        let deleted =
            tokio::time::timeout(STOP_TIMEOUT, delete_remote(&links, &vhost, &remote, &feed)).await;
        if !matches!(deleted, Ok(Ok(()))) {
            tracing::warn!(vhost, queue = %feed.queue, remote, "could not delete a foreign exchange feed's private queue; it expires on its own");
        }
    }
}

/// One connection's worth of a feed: consumes until told to stop (`Ok`) or until the link
/// or the other broker ends it (`Err`).
async fn session(
    broker: &Weak<Broker>,
    vhost: &str,
    feed: &Feed,
    remote: &str,
    stop: &mut watch::Receiver<Stop>,
) -> Result<(), FeedError> {
    let (links, synced) = match broker.upgrade() {
        Some(b) => (b.proxies().links.clone(), b.journal.synced()),
        None => return Ok(()),
    };
    let ch = links.channel(&feed.home, vhost).await?;
    let result = consume(broker, vhost, feed, remote, stop, &ch, synced).await;
    let _ = ch.close(200, "feed stopped".into()).await;
    result
}

async fn consume(
    broker: &Weak<Broker>,
    vhost: &str,
    feed: &Feed,
    remote: &str,
    stop: &mut watch::Receiver<Stop>,
    ch: &lapin::Channel,
    synced: watch::Receiver<u64>,
) -> Result<(), FeedError> {
    declare_and_bind(ch, remote, feed).await?;
    ch.basic_qos(CREDIT, BasicQosOptions::default())
        .await
        .map_err(|e| FeedError::remote(feed, e))?;
    let mut consumer = ch
        .basic_consume(
            remote.into(),
            "ringmq-feed".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| FeedError::remote(feed, e))?;
    tracing::info!(vhost, queue = %feed.queue, exchange = %feed.exchange, broker = %redacted(&feed.home), remote, "foreign exchange feed started");
    let (acks, to_ack) = mpsc::unbounded_channel();
    let acker = tokio::spawn(ack_when_durable(ch.clone(), synced, to_ack));
    let ended = loop {
        tokio::select! {
            _ = stop.changed() => break Ok(()),
            next = consumer.next() => match next {
                None => break Err(FeedError::remote(feed, "the consumer was cancelled")),
                Some(Err(e)) => break Err(FeedError::remote(feed, e)),
                Some(Ok(d)) => {
                    let Some(b) = broker.upgrade() else {
                        break Ok(());
                    };
                    let journal_seq = enqueue(&b, vhost, feed, d.exchange, d.routing_key, d.properties, d.data);
                    let _ = acks.send((d.delivery_tag, journal_seq));
                }
            },
        }
    };
    // What was enqueued is acked before the channel closes (else it comes again).
    drop(acks);
    let _ = tokio::time::timeout(STOP_TIMEOUT, acker).await;
    ended
}

/// Puts one message the other broker delivered on the local queue; returns the journal
/// sequence number that must be durable before it is acked there, if any. A message the
/// local queue refuses (`x-overflow` reject-publish) or no longer takes is dropped, as a
/// publish without confirms would be.
fn enqueue(
    broker: &Broker,
    vhost: &str,
    feed: &Feed,
    exchange: lapin::types::ShortString,
    routing_key: lapin::types::ShortString,
    properties: crate::amqp::Properties,
    body: Vec<u8>,
) -> Option<u64> {
    let message = match super::upstream_foreign::message(exchange, routing_key, properties, body) {
        Ok(m) => Arc::new(m),
        Err(e) => {
            tracing::warn!(vhost, queue = %feed.queue, error = %e.text, "dropped a message from a foreign exchange");
            return None;
        }
    };
    let v = broker.vhost(vhost)?;
    let mut v = v.lock();
    let mut fx = Effects::default();
    v.publish_feed(&feed.queue, message, now_ms(), &mut fx);
    broker.finish_batch(crate::core::NO_CONNECTION, &mut v, &mut fx)
}

/// Acks deliveries on the other broker in order, each once the journal's fsynced prefix
/// covers its enqueue: a run of them as one `multiple` ack.
async fn ack_when_durable(
    ch: lapin::Channel,
    mut synced: watch::Receiver<u64>,
    mut to_ack: mpsc::UnboundedReceiver<(u64, Option<u64>)>,
) {
    while let Some((mut tag, mut journal_seq)) = to_ack.recv().await {
        while let Ok((next, seq)) = to_ack.try_recv() {
            assert!(next > tag, "delivery tags of one channel only grow");
            tag = next;
            journal_seq = journal_seq.max(seq);
        }
        if let Some(seq) = journal_seq
            && synced.wait_for(|s| *s >= seq).await.is_err()
        {
            return;
        }
        let multiple = BasicAckOptions { multiple: true };
        if ch.basic_ack(tag, multiple).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(key: &str) -> Feed {
        Feed {
            exchange: "x".into(),
            home: "amqp://u:p@r/%2f".into(),
            queue: "q".into(),
            routing_key: key.into(),
            arguments: FieldTable::default(),
        }
    }

    #[test]
    fn private_queue_names_are_stable_and_differ_per_binding_and_broker() {
        let a = remote_queue("me", "/", &feed("k"));
        assert_eq!(a, remote_queue("me", "/", &feed("k")));
        assert!(a.starts_with("ringmq.feed.q."), "{a}");
        assert_ne!(a, remote_queue("me", "/", &feed("other")));
        assert_ne!(a, remote_queue("someone else", "/", &feed("k")));
        assert_ne!(a, remote_queue("me", "v", &feed("k")));
    }
}
