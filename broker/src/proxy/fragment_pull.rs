//! A pull: moves messages from one queue holding a fragmented queue's messages (another
//! member's fragment, or the queue's own record) into this member's fragment, with credit
//! (`broker/fragments.rs` decides when; [`crate::core::fragments`] says what fragments are).
//!
//! A consumer on the source, over a link to its primary, with [`CREDIT`] unacked at most
//! and the lowest consumer priority ([`PULL_PRIORITY`], marked [`PULL_ARGUMENT`]): the
//! source's primary hands a pull
//! only what its own consumers have no room for, so a fragment whose member reads it keeps
//! its messages, and one nobody reads empties into the members that want more.
//!
//! **No loss, possible duplicates**, as a foreign exchange's feed ([`super::feed`]): a
//! message is acked on the source only once this member's enqueue is as safe as a publisher
//! confirm would make it — the journal's fsynced prefix covers it and every in-sync backup
//! of the fragment acknowledged it. A crash between the two leaves it unacked there: the
//! source delivers it again, and the fragment may hold it twice.

use crate::broker::Broker;
use crate::clock::now_ms;
use crate::core::fragments::{PULL_ARGUMENT, PULL_PRIORITY};
use crate::core::{Effects, PublishOutcome};
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// Unacked messages a pull takes from its source at once: enough to keep a member's
/// consumers busy for a round trip, few enough that a member which stops wanting more
/// holds little that another could have served.
pub const CREDIT: u16 = 64;

/// The consumer tag of a pull on its source.
const TAG: &str = "ringmq-fragment-pull";

/// How long a stopping pull waits for the acks of what it moved.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest pause between attempts to resume a failed pull.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How long opening the pull's channel, its qos, consume and cancel may take: a source's
/// primary that stopped answering (paused, cut off) fails the pull, which the reconciler
/// then replaces with one to the source's new primary.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// `call`, failed after [`CALL_TIMEOUT`].
async fn within<T, E: std::fmt::Display>(
    what: &str,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(result) => result.map_err(|e| format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {CALL_TIMEOUT:?}")),
    }
}

/// What one pull moves: from `source` (on member `primary`) into `into` (here), in `vhost`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Pull {
    /// The vhost.
    pub vhost: String,
    /// The queue taken from.
    pub source: String,
    /// Node id of the source's primary (possibly this member).
    pub primary: String,
    /// This member's fragment, put into.
    pub into: String,
}

/// What becomes of one delivery of the source, in delivery order.
enum Settle {
    /// Enqueued here: ack once the journal (`journal_seq`) and the backups (`stamp`) have it.
    Ack {
        tag: u64,
        journal_seq: Option<u64>,
        stamp: Option<u64>,
    },
    /// Not taken here (the fragment moved or is full): back to the source.
    Requeue { tag: u64 },
}

/// Runs `pull` until told to stop, resuming it after failures.
pub async fn run(broker: Weak<Broker>, pull: Pull, mut stop: watch::Receiver<bool>) {
    let mut backoff = Duration::from_millis(200);
    loop {
        match session(&broker, &pull, &mut stop).await {
            Ok(()) => return,
            Err(e) => {
                tracing::info!(vhost = %pull.vhost, source = %pull.source, into = %pull.into, error = %e, "fragment pull failed; resuming it");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One link's worth of a pull: `Ok` when told to stop, `Err` when the link or the source
/// ended it or this member's fragment took no more.
async fn session(
    broker: &Weak<Broker>,
    pull: &Pull,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), String> {
    let (links, synced, acked) = match broker.upgrade() {
        Some(b) => (
            b.proxies().links.clone(),
            b.journal.synced(),
            b.replicator().acked(),
        ),
        None => return Ok(()),
    };
    let uri = links
        .member_uri(&pull.primary, &pull.vhost)
        .map_err(|e| e.to_string())?;
    let ch = within("opening a channel", links.channel(&uri, &pull.vhost)).await?;
    let result = consume(broker, pull, stop, &ch, synced, acked).await;
    let _ = ch.close(200, "pull stopped".into()).await;
    result
}

async fn consume(
    broker: &Weak<Broker>,
    pull: &Pull,
    stop: &mut watch::Receiver<bool>,
    ch: &lapin::Channel,
    synced: watch::Receiver<u64>,
    acked: watch::Receiver<u64>,
) -> Result<(), String> {
    within(
        "basic.qos",
        ch.basic_qos(CREDIT, BasicQosOptions::default()),
    )
    .await?;
    let mut arguments = FieldTable::default();
    arguments.insert("x-priority".into(), AMQPValue::LongInt(PULL_PRIORITY));
    arguments.insert(PULL_ARGUMENT.into(), AMQPValue::Boolean(true));
    let consume = ch.basic_consume(
        pull.source.as_str().into(),
        TAG.into(),
        BasicConsumeOptions::default(),
        arguments,
    );
    let mut consumer = within("basic.consume", consume).await?;
    tracing::debug!(vhost = %pull.vhost, source = %pull.source, primary = %pull.primary, into = %pull.into, "fragment pull started");
    let (settles, to_settle) = mpsc::unbounded_channel();
    let settler = tokio::spawn(settle_when_safe(ch.clone(), synced, acked, to_settle));
    let mut cancelled = false;
    let ended = loop {
        let next = tokio::select! {
            _ = stop.changed(), if !cancelled => {
                // What the source sent before its cancel-ok is still taken here: handed
                // back, it would go in front of what its own consumers already got, out of
                // its producers' order.
                cancelled = true;
                let cancel = ch.basic_cancel(TAG.into(), Default::default());
                if let Err(e) = within("basic.cancel", cancel).await {
                    break Err(e);
                }
                continue;
            }
            next = consumer.next() => next,
        };
        match next {
            None if cancelled => break Ok(()),
            None => break Err("the source ended the pull's consumer".to_owned()),
            Some(Err(e)) => break Err(e.to_string()),
            Some(Ok(d)) => {
                let Some(b) = broker.upgrade() else {
                    break Ok(());
                };
                let (tag, redelivered) = (d.delivery_tag, d.redelivered);
                let message = (d.exchange, d.routing_key, d.properties, d.data);
                match enqueue(&b, pull, message, redelivered) {
                    Some((journal_seq, stamp)) => {
                        let _ = settles.send(Settle::Ack {
                            tag,
                            journal_seq,
                            stamp,
                        });
                    }
                    None => {
                        // Full, moving, or no longer served here: back off, and the
                        // reconciler decides again meanwhile.
                        let _ = settles.send(Settle::Requeue { tag });
                        break Err(format!("'{}' took no more", pull.into));
                    }
                }
            }
        }
    };
    // What was enqueued is acked before the channel closes (else it comes again).
    drop(settles);
    let _ = tokio::time::timeout(STOP_TIMEOUT, settler).await;
    ended
}

/// Puts one message of the source on this member's fragment (marked redelivered if the
/// source delivered it so): the journal sequence number and replication stamp its ack
/// waits for, or `None` when the fragment did not take it.
fn enqueue(
    broker: &Broker,
    pull: &Pull,
    (exchange, routing_key, properties, body): (
        lapin::types::ShortString,
        lapin::types::ShortString,
        crate::amqp::Properties,
        Vec<u8>,
    ),
    redelivered: bool,
) -> Option<(Option<u64>, Option<u64>)> {
    // Moved out of its producer's order: no longer counted as its producer's publish.
    let properties = crate::core::producers::without_producer(properties);
    let message = match super::upstream_foreign::message(exchange, routing_key, properties, body) {
        Ok(m) => Arc::new(m),
        Err(e) => {
            tracing::warn!(vhost = %pull.vhost, source = %pull.source, error = %e.text, "a fragment's message could not be read; left on its source");
            return None;
        }
    };
    let v = broker.vhost(&pull.vhost)?;
    let mut v = v.lock();
    let mut fx = Effects::default();
    let outcome = v.publish_pulled(&pull.into, message, redelivered, now_ms(), &mut fx);
    let journal_seq = broker.finish_batch(crate::core::NO_CONNECTION, &mut v, &mut fx);
    let stamp = fx.replica_stamp.take();
    (outcome == PublishOutcome::Routed).then_some((journal_seq, stamp))
}

/// Settles the source's deliveries in order: runs of enqueued ones as one `multiple` ack
/// once the journal and the backups hold them, one that was not taken with a requeue.
async fn settle_when_safe(
    ch: lapin::Channel,
    mut synced: watch::Receiver<u64>,
    mut acked: watch::Receiver<u64>,
    mut to_settle: mpsc::UnboundedReceiver<Settle>,
) {
    let mut next = to_settle.recv().await;
    while let Some(first) = next.take() {
        let (mut tag, mut journal_seq, mut stamp) = match first {
            Settle::Requeue { tag } => {
                let requeue = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                let _ = ch.basic_nack(tag, requeue).await;
                next = to_settle.recv().await;
                continue;
            }
            Settle::Ack {
                tag,
                journal_seq,
                stamp,
            } => (tag, journal_seq, stamp),
        };
        // The acks that are in already join this one.
        loop {
            match to_settle.try_recv() {
                Ok(Settle::Ack {
                    tag: t,
                    journal_seq: j,
                    stamp: s,
                }) => {
                    tag = t;
                    journal_seq = journal_seq.max(j);
                    stamp = stamp.max(s);
                }
                Ok(requeue) => {
                    next = Some(requeue);
                    break;
                }
                Err(_) => break,
            }
        }
        if let Some(seq) = journal_seq
            && synced.wait_for(|s| *s >= seq).await.is_err()
        {
            return;
        }
        if let Some(stamp) = stamp
            && acked.wait_for(|s| *s >= stamp).await.is_err()
        {
            return;
        }
        if ch
            .basic_ack(tag, BasicAckOptions { multiple: true })
            .await
            .is_err()
        {
            return;
        }
        if next.is_none() {
            next = to_settle.recv().await;
        }
    }
}
