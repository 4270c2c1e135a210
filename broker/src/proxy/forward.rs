//! Forwarding publishes to the members that own their queues.
//!
//! The receiving member routes a publish once over the replicated bindings; queues it owns
//! get the message at once, and every other member that owns a matched queue gets it once
//! over its link, on a confirm-mode channel ([`Forwarders`]). That member routes it again over
//! the same bindings into the queues it owns ([`crate::core::VHost::publish_forwarded`]) and
//! confirms it; the publisher's confirm waits, behind the connection's confirm gate, until
//! every forward of its batch is confirmed ([`ForwardTracker`]).

use super::link::{LinkError, Links};
use crate::core::Message;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{Confirmation, PublisherConfirm};
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use tokio::sync::{Notify, mpsc};

/// The forwards one client connection issued, for its confirm gate: forward `n` of the
/// connection is confirmed when every forward up to `n` is.
#[derive(Debug, Default)]
pub struct ForwardTracker {
    state: Mutex<TrackerState>,
    changed: Notify,
}

#[derive(Debug, Default)]
struct TrackerState {
    issued: u64,
    outstanding: BTreeSet<u64>,
    failure: Option<(u64, String)>,
}

impl ForwardTracker {
    /// Numbers a new forward (1, 2, …).
    pub fn issue(&self) -> u64 {
        let mut s = self.state.lock();
        s.issued += 1;
        let id = s.issued;
        s.outstanding.insert(id);
        id
    }

    /// Forward `id` was confirmed (`Ok`) or not (`Err` with the reason).
    pub fn settle(&self, id: u64, result: Result<(), String>) {
        let mut s = self.state.lock();
        s.outstanding.remove(&id);
        if let Err(reason) = result {
            match &s.failure {
                Some((first, _)) if *first < id => {}
                _ => s.failure = Some((id, reason)),
            }
        }
        drop(s);
        self.changed.notify_one();
    }

    /// How many forwards were issued.
    pub fn issued(&self) -> u64 {
        self.state.lock().issued
    }

    /// Every forward up to this number is confirmed (or failed: see [`Self::failure`]).
    pub fn confirmed_through(&self) -> u64 {
        let s = self.state.lock();
        s.outstanding.first().map_or(s.issued, |first| first - 1)
    }

    /// Forwards not yet answered: a publisher with many is paused (back-pressure from a slow
    /// link, instead of memory growing without bound).
    pub fn in_flight(&self) -> usize {
        self.state.lock().outstanding.len()
    }

    /// The first forward that failed (its number and why), if any: neither its publish nor
    /// any later one may be confirmed.
    pub fn failure(&self) -> Option<(u64, String)> {
        self.state.lock().failure.clone()
    }

    /// Resolves after the next [`Self::settle`].
    pub async fn changed(&self) {
        self.changed.notified().await
    }
}

/// Who waits for a forward's confirm: a connection's tracker and the forward's number in it.
type Ticket = (Arc<ForwardTracker>, u64);

/// A forwarding task's queue, by (member, vhost).
type Senders = HashMap<(Arc<str>, String), mpsc::UnboundedSender<Job>>;

/// One message for a member, and who waits for its confirm.
struct Job {
    exchange: Arc<str>,
    routing_key: Arc<str>,
    message: Arc<Message>,
    ticket: Option<Ticket>,
}

/// The forwarding channels of this member: one task per (member, vhost), publishing in
/// order on one confirm-mode channel of the link.
pub struct Forwarders {
    links: Arc<Links>,
    senders: Mutex<Senders>,
}

impl std::fmt::Debug for Forwarders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarders").finish_non_exhaustive()
    }
}

impl Forwarders {
    /// Forwarders over `links`.
    pub fn new(links: Arc<Links>) -> Self {
        Self {
            links,
            senders: Mutex::new(HashMap::new()),
        }
    }

    /// Hands `message` (routed through `exchange` with `routing_key`) to `primary`; with a
    /// tracker, its confirm settles the tracker's forward `id`. The body must be in memory.
    pub fn send(
        &self,
        primary: &Arc<str>,
        vhost: &str,
        exchange: Arc<str>,
        routing_key: Arc<str>,
        message: Arc<Message>,
        ticket: Option<Ticket>,
    ) {
        let mut job = Job {
            exchange,
            routing_key,
            message,
            ticket,
        };
        let mut senders = self.senders.lock();
        let key = (primary.clone(), vhost.to_owned());
        if let Some(tx) = senders.get(&key) {
            match tx.send(job) {
                Ok(()) => return,
                Err(mpsc::error::SendError(j)) => job = j,
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        if tx.send(job).is_err() {
            unreachable!("the receiver is in this scope");
        }
        senders.insert(key, tx);
        tokio::spawn(run(
            self.links.clone(),
            primary.clone(),
            vhost.to_owned(),
            rx,
        ));
    }
}

/// The task of one (member, vhost): publishes each job in order; a confirm task answers
/// them in order as the member confirms. A failed link fails the jobs waiting at that
/// moment and is opened again for the next one.
async fn run(
    links: Arc<Links>,
    primary: Arc<str>,
    vhost: String,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) {
    let mut channel: Option<lapin::Channel> = None;
    let (confirm_tx, confirm_rx) = mpsc::unbounded_channel();
    tokio::spawn(answer_confirms(confirm_rx));
    while let Some(job) = jobs.recv().await {
        let ch = match channel.as_ref().filter(|c| c.status().connected()) {
            Some(c) => c.clone(),
            None => match open(&links, &primary, &vhost).await {
                Ok(c) => {
                    channel = Some(c.clone());
                    c
                }
                Err(e) => {
                    fail(job, &e.to_string());
                    while let Ok(job) = jobs.try_recv() {
                        fail(job, &e.to_string());
                    }
                    continue;
                }
            },
        };
        let m = &job.message;
        let published = ch
            .basic_publish(
                job.exchange.as_ref().into(),
                job.routing_key.as_ref().into(),
                BasicPublishOptions::default(),
                m.body.bytes(),
                m.properties.clone(),
            )
            .await;
        match published {
            Ok(confirm) => {
                let _ = confirm_tx.send((confirm, job.ticket));
            }
            Err(e) => {
                channel = None;
                fail(
                    job,
                    &format!("forwarding to cluster member '{primary}': {e}"),
                );
            }
        }
    }
}

/// A confirm-mode channel on the link to `primary`.
async fn open(links: &Links, primary: &str, vhost: &str) -> Result<lapin::Channel, LinkError> {
    let ch = links.channel(primary, vhost).await?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| LinkError::Failed {
            node: primary.into(),
            addr: String::new(),
            reason: e.to_string(),
        })?;
    Ok(ch)
}

fn fail(job: Job, reason: &str) {
    if let Some((tracker, id)) = job.ticket {
        tracker.settle(id, Err(reason.to_owned()));
    }
}

async fn answer_confirms(
    mut confirms: mpsc::UnboundedReceiver<(PublisherConfirm, Option<Ticket>)>,
) {
    while let Some((confirm, ticket)) = confirms.recv().await {
        let result = match confirm.await {
            Ok(Confirmation::Ack(_)) | Ok(Confirmation::NotRequested) => Ok(()),
            Ok(Confirmation::Nack(_)) => Err("the queue's primary refused the message".to_owned()),
            Err(e) => Err(format!("the queue's primary did not confirm: {e}")),
        };
        if let Some((tracker, id)) = ticket {
            tracker.settle(id, result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confirmed_through_is_the_contiguous_prefix() {
        let t = ForwardTracker::default();
        let (a, b, c) = (t.issue(), t.issue(), t.issue());
        assert_eq!(t.confirmed_through(), 0);
        t.settle(b, Ok(()));
        assert_eq!(t.confirmed_through(), 0, "the first is still out");
        t.settle(a, Ok(()));
        assert_eq!(t.confirmed_through(), 2);
        assert_eq!(t.in_flight(), 1);
        t.settle(c, Err("gone".into()));
        assert_eq!(t.confirmed_through(), 3);
        assert_eq!(t.failure(), Some((3, "gone".to_owned())));
    }
}
