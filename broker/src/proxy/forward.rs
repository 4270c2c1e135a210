//! Forwarding publishes to the members that own their queues.
//!
//! The receiving member routes a publish once over the replicated bindings; queues it owns
//! get the message at once, and every other member that owns a matched queue gets it once
//! over its link, on a confirm-mode channel ([`Forwarders`]). That member routes it again over
//! the same bindings into the queues it owns ([`crate::core::VHost::publish_forwarded`]) and
//! confirms it; the publisher's confirm waits, behind the connection's confirm gate, until
//! every forward of its batch is confirmed ([`ForwardTracker`]).

use super::forward_link::ForwardLink;
use super::link::{LinkError, Links, is_foreign};
use crate::core::Message;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{Confirmation, PublisherConfirm};
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, mpsc};

/// The forwards one client connection issued, for its confirm gate: forward `n` of the
/// connection is confirmed when every forward up to `n` is.
#[derive(Debug, Default)]
pub struct ForwardTracker {
    state: Mutex<TrackerState>,
    changed: Notify,
    /// Proxied methods waiting in [`Self::answered_through`] (besides the connection, which
    /// waits in [`Self::changed`]).
    watchers: AtomicUsize,
    /// The connection carries a session: a forward to a moving queue is a failure, not a
    /// refusal ([`ForwardOutcome::Moving`]).
    resend_when_moving: AtomicBool,
}

#[derive(Debug, Default)]
struct TrackerState {
    issued: u64,
    outstanding: BTreeSet<u64>,
    /// Forwards their primary refused (a `basic.nack`: the message is not in the queue, e.g.
    /// `reject-publish` overflow), until their publishes' confirms are decided.
    refused: BTreeSet<u64>,
    failure: Option<(u64, String)>,
    /// The first forward of each batch whose dead letters wait for their forwards
    /// ([`ForwardTracker::watch`]), with how many batches start there.
    watched: std::collections::BTreeMap<u64, usize>,
    /// Refusals at or after the first watched forward, kept for
    /// [`ForwardTracker::all_taken`] whatever [`ForwardTracker::fate`] forgets.
    watched_refused: BTreeSet<u64>,
}

/// What became of a publish's forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardFate {
    /// Every primary confirmed it.
    Taken,
    /// A primary refused it (nacked): not in that primary's queues.
    Refused,
    /// A forward failed before its primary answered: in its queues or not.
    Unknown,
}

/// How a forward ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForwardOutcome {
    /// The primary confirmed it: the message is in its queues.
    Confirmed,
    /// The primary refused it (nacked): the message is in none of its queues, and the
    /// publisher's confirm is a nack, as on one broker.
    Refused,
    /// Nobody knows (the link failed before the answer): the reason.
    Failed(String),
    /// The primary took it into none of its queues because one of them is sealed for a
    /// planned move (a nack with `requeue`): a refusal for a plain client, whose
    /// application publishes again; for a session's connection
    /// ([`ForwardTracker::resend_when_moving`]) a failure, so that the client resends it
    /// after the switch and the application never sees a nack (B16).
    Moving,
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

    /// A session attached to the connection: from now on a forward that reaches a moving
    /// queue fails (its client resends the publish after the switch) instead of being
    /// refused.
    pub fn resend_when_moving(&self) {
        self.resend_when_moving.store(true, Ordering::Release);
    }

    /// Forward `id` ended so.
    pub fn settle(&self, id: u64, outcome: ForwardOutcome) {
        let outcome = match outcome {
            ForwardOutcome::Moving if self.resend_when_moving.load(Ordering::Acquire) => {
                ForwardOutcome::Failed("the queue's primary is moving to another member".into())
            }
            ForwardOutcome::Moving => ForwardOutcome::Refused,
            other => other,
        };
        let mut s = self.state.lock();
        s.outstanding.remove(&id);
        match outcome {
            ForwardOutcome::Confirmed => {}
            ForwardOutcome::Refused | ForwardOutcome::Moving => {
                s.refused.insert(id);
                if s.watched.keys().next().is_some_and(|&first| first <= id) {
                    s.watched_refused.insert(id);
                }
            }
            ForwardOutcome::Failed(reason) => match &s.failure {
                Some((first, _)) if *first < id => {}
                _ => s.failure = Some((id, reason)),
            },
        }
        drop(s);
        if self.watchers.load(Ordering::Acquire) > 0 {
            self.changed.notify_waiters();
        }
        self.changed.notify_one();
    }

    /// Whether any of the forwards `first..=last` (all answered) is not known to be in its
    /// primary's queues: [`Self::fate`] is not [`ForwardFate::Taken`].
    pub fn not_taken(&self, first: u64, last: u64) -> bool {
        self.fate(first, last) != ForwardFate::Taken
    }

    /// What became of the forwards `first..=last` (all answered): taken, refused by a
    /// primary, or of unknown fate — one failed (the link went before the answer; from the
    /// first failure on, every forward counts as failed). Forgets the refusals up to `last`,
    /// whose publishes' confirms are decided now.
    pub fn fate(&self, first: u64, last: u64) -> ForwardFate {
        let mut s = self.state.lock();
        let refused = s.refused.range(first..=last).next().is_some();
        let failed = s.failure.as_ref().is_some_and(|(f, _)| *f <= last);
        s.refused = s.refused.split_off(&(last + 1));
        match (refused, failed) {
            (_, true) => ForwardFate::Unknown,
            (true, false) => ForwardFate::Refused,
            (false, false) => ForwardFate::Taken,
        }
    }

    /// How many forwards were issued.
    pub fn issued(&self) -> u64 {
        self.state.lock().issued
    }

    /// The forwards from `first` on belong to a batch whose held dead letters
    /// (`at-least-once`) are settled by [`Self::all_taken`]: their refusals are kept for it.
    /// Called before the batch's forwards are issued, so no answer comes first.
    pub fn watch(&self, first: u64) {
        *self.state.lock().watched.entry(first).or_default() += 1;
    }

    /// Whether every forward `first..=last` (all answered; watched from `first`) was
    /// taken by its primary: none refused, none failed. Ends that watch (an empty range,
    /// `last < first`, only ends it).
    pub fn all_taken(&self, first: u64, last: u64) -> bool {
        let mut s = self.state.lock();
        let refused = last >= first && s.watched_refused.range(first..=last).next().is_some();
        let failed = s.failure.as_ref().is_some_and(|(f, _)| *f <= last);
        Self::end_watch(&mut s, first);
        !refused && !failed
    }

    /// Ends the watch from `first` without asking about it: the batch it was for forwarded
    /// nothing.
    pub fn unwatch(&self, first: u64) {
        Self::end_watch(&mut self.state.lock(), first);
    }

    /// Ends one watch from `first`, and forgets the refusals no watch covers any more.
    fn end_watch(s: &mut TrackerState, first: u64) {
        if let Some(n) = s.watched.get_mut(&first) {
            *n -= 1;
            if *n == 0 {
                s.watched.remove(&first);
            }
        }
        match s.watched.keys().next().copied() {
            Some(oldest) => s.watched_refused = s.watched_refused.split_off(&oldest),
            None => s.watched_refused.clear(),
        }
    }

    /// Where the forwards stand, read at once (the connection asks once per wake-up).
    pub fn status(&self) -> ForwardStatus {
        let s = self.state.lock();
        ForwardStatus {
            answered_through: s.outstanding.first().map_or(s.issued, |first| first - 1),
            in_flight: s.outstanding.len(),
            failure: s.failure.clone(),
        }
    }

    /// Resolves after the next [`Self::settle`].
    pub async fn changed(&self) {
        self.changed.notified().await
    }

    /// Resolves once every forward up to `upto` was answered (confirmed or failed). A
    /// proxied method (a get, a count, a purge) sent after publishes of the same connection
    /// waits for it, so that it cannot overtake them on the way to the primary: on one broker
    /// a channel's publish is in its queue before the channel's next method runs.
    pub async fn answered_through(&self, upto: u64) {
        self.watchers.fetch_add(1, Ordering::AcqRel);
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let done = self
                .state
                .lock()
                .outstanding
                .first()
                .is_none_or(|first| *first > upto);
            if done {
                break;
            }
            notified.await;
        }
        self.watchers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A connection's forwards as of one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardStatus {
    /// Every forward up to this number is answered: confirmed, refused (its publish's
    /// confirm is a nack) or failed (see `failure`).
    pub answered_through: u64,
    /// Forwards not yet answered: a publisher with many is paused (back-pressure from a slow
    /// link, instead of memory growing without bound).
    pub in_flight: usize,
    /// The first forward that failed (its number and why), if any: neither its publish nor
    /// any later one may be confirmed.
    pub failure: Option<(u64, String)>,
}

/// Who waits for a forward's confirm: a connection's tracker and the forward's number in it.
pub type Ticket = (Arc<ForwardTracker>, u64);

/// The forwarding tasks' queues, by vhost and member.
type Senders = HashMap<String, HashMap<Arc<str>, mpsc::UnboundedSender<Vec<Job>>>>;

/// One message for a member, and who waits for its confirm.
pub struct Job {
    /// The exchange it was routed through.
    pub exchange: Arc<str>,
    /// The routing key it was routed with.
    pub routing_key: Arc<str>,
    /// The message, its body in memory.
    pub message: Arc<Message>,
    /// Who waits for its confirm, if anyone.
    pub ticket: Option<Ticket>,
    /// The newest cluster change this member had applied when it routed the message: the
    /// primary applies it before the message ([`super::catch_up`]).
    pub after_index: u64,
    /// On whose behalf it was published, for a fragmented queue's fragment
    /// ([`crate::core::vhost::Forward::origin`]).
    pub origin: Option<Arc<str>>,
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

    /// Hands each batch of jobs to its member (in order, one queue push per member).
    pub fn send(&self, vhost: &str, batches: Vec<(Arc<str>, Vec<Job>)>) {
        let mut senders = self.senders.lock();
        let by_member = match senders.get_mut(vhost) {
            Some(m) => m,
            None => senders.entry(vhost.to_owned()).or_default(),
        };
        for (primary, mut jobs) in batches {
            if let Some(tx) = by_member.get(&primary) {
                match tx.send(jobs) {
                    Ok(()) => continue,
                    Err(mpsc::error::SendError(j)) => jobs = j,
                }
            }
            let (tx, rx) = mpsc::unbounded_channel();
            if tx.send(jobs).is_err() {
                unreachable!("the receiver is in this scope");
            }
            by_member.insert(primary.clone(), tx);
            tokio::spawn(run(self.links.clone(), primary, vhost.to_owned(), rx));
        }
    }
}

/// A publish handed to the link (its frames queued in order) whose write may still be to
/// come.
type Writing = Pin<Box<dyn Future<Output = Result<PublisherConfirm, lapin::Error>> + Send>>;

/// A publish whose confirm is awaited: still being written, or written already.
enum InFlight {
    Writing(Writing),
    Written(PublisherConfirm),
}

/// The task of one (member, vhost), in order: on the broker's own codec to a cluster
/// member ([`run_member`]), through lapin to a foreign broker ([`run_foreign`]).
async fn run(
    links: Arc<Links>,
    primary: Arc<str>,
    vhost: String,
    batches: mpsc::UnboundedReceiver<Vec<Job>>,
) {
    if is_foreign(&primary) {
        run_foreign(links, primary, vhost, batches).await;
    } else {
        run_member(links, primary, vhost, batches).await;
    }
}

/// Forwards to a cluster member: whatever is queued goes out together on the forwarding
/// link ([`ForwardLink`]), whose reader settles the tickets as the member confirms. A
/// failed link fails the jobs waiting at that moment and is opened again for the next one;
/// an idle one sends heartbeats.
async fn run_member(
    links: Arc<Links>,
    primary: Arc<str>,
    vhost: String,
    mut batches: mpsc::UnboundedReceiver<Vec<Job>>,
) {
    let mut link: Option<ForwardLink> = None;
    loop {
        let idle = link
            .as_ref()
            .map_or(Duration::from_secs(5), ForwardLink::heartbeat_period);
        let mut jobs = match tokio::time::timeout(idle, batches.recv()).await {
            Ok(Some(jobs)) => jobs,
            Ok(None) => return,
            Err(_) => {
                if let Some(l) = link.as_mut().filter(|l| l.is_open()) {
                    // A failure marks the link failed; the next job opens another.
                    let _ = l.heartbeat().await;
                }
                continue;
            }
        };
        while let Ok(more) = batches.try_recv() {
            jobs.extend(more);
        }
        if !link.as_ref().is_some_and(ForwardLink::is_open) {
            link = None;
            match links.forward_link(&primary, &vhost).await {
                Ok(l) => link = Some(l),
                Err(e) => {
                    // The member cannot be reached: what waits now fails at once rather
                    // than trying again message by message.
                    let reason = e.to_string();
                    jobs.into_iter().for_each(|j| fail(j, &reason));
                    continue;
                }
            }
        }
        if let Some(l) = link.as_mut() {
            // A failure settles the jobs' tickets; the next batch opens the link again.
            let _ = l.send(jobs).await;
        }
    }
}

/// Forwards to a foreign broker through lapin: queues each job's frames in order without
/// waiting for the socket (pipelined); a confirm task answers them in order as the broker
/// confirms. A failed link fails the jobs waiting at that moment and is opened again for
/// the next one.
async fn run_foreign(
    links: Arc<Links>,
    primary: Arc<str>,
    vhost: String,
    mut batches: mpsc::UnboundedReceiver<Vec<Job>>,
) {
    let mut channel = None;
    let (confirm_tx, confirm_rx) = mpsc::unbounded_channel();
    tokio::spawn(answer_confirms(confirm_rx));
    while let Some(batch) = batches.recv().await {
        let mut jobs = batch.into_iter();
        while let Some(job) = jobs.next() {
            let sent = forward_one(job, &links, &primary, &vhost, &mut channel, &confirm_tx).await;
            if let Err(reason) = sent {
                // The member cannot be reached: what waits now fails at once rather than
                // trying again message by message.
                jobs.by_ref().for_each(|j| fail(j, &reason));
                while let Ok(batch) = batches.try_recv() {
                    batch.into_iter().for_each(|j| fail(j, &reason));
                }
            }
        }
    }
}

/// Queues one job's frames on the foreign broker's channel (opened again if it failed).
/// No catch-up: a foreign broker is no cluster member and has no cluster changes to apply.
async fn forward_one(
    job: Job,
    links: &Links,
    primary: &Arc<str>,
    vhost: &str,
    link: &mut Option<lapin::Channel>,
    confirm_tx: &mpsc::UnboundedSender<(InFlight, Option<Ticket>)>,
) -> Result<(), String> {
    let ch = match link.as_ref().filter(|c| c.status().connected()) {
        Some(c) => c.clone(),
        None => match open(links, primary, vhost).await {
            Ok(c) => {
                *link = Some(c.clone());
                c
            }
            Err(e) => {
                fail(job, &e.to_string());
                return Err(e.to_string());
            }
        },
    };
    let Job {
        exchange,
        routing_key,
        message,
        ticket,
        after_index: _,
        origin: _,
    } = job;
    let mut publish: Writing = Box::pin(async move {
        ch.basic_publish(
            exchange.as_ref().into(),
            routing_key.as_ref().into(),
            BasicPublishOptions::default(),
            message.body.bytes(),
            (*message.properties).clone(),
        )
        .await
    });
    // The first poll queues the frames (in job order); the write and the confirm are
    // awaited by the confirm task, so publishes are pipelined, not one per round trip.
    let in_flight = match futures::poll!(publish.as_mut()) {
        std::task::Poll::Ready(Err(e)) => {
            *link = None;
            if let Some((tracker, id)) = ticket {
                tracker.settle(
                    id,
                    ForwardOutcome::Failed(format!(
                        "forwarding to '{}': {e}",
                        super::link::redacted(primary)
                    )),
                );
            }
            return Ok(());
        }
        std::task::Poll::Ready(Ok(confirm)) => InFlight::Written(confirm),
        std::task::Poll::Pending => InFlight::Writing(publish),
    };
    let _ = confirm_tx.send((in_flight, ticket));
    Ok(())
}

/// A confirm-mode channel on the link to `primary`.
async fn open(links: &Links, primary: &str, vhost: &str) -> Result<lapin::Channel, LinkError> {
    let ch = links.channel(primary, vhost).await?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| LinkError::Failed {
            node: super::link::redacted(primary),
            addr: String::new(),
            reason: e.to_string(),
        })?;
    Ok(ch)
}

/// Fails `job`'s ticket: its publish is never confirmed.
pub(super) fn fail(job: Job, reason: &str) {
    if let Some((tracker, id)) = job.ticket {
        tracker.settle(id, ForwardOutcome::Failed(reason.to_owned()));
    }
}

async fn answer_confirms(mut confirms: mpsc::UnboundedReceiver<(InFlight, Option<Ticket>)>) {
    while let Some((in_flight, ticket)) = confirms.recv().await {
        let written = match in_flight {
            InFlight::Writing(publish) => publish.await,
            InFlight::Written(confirm) => Ok(confirm),
        };
        let confirmed = match written {
            Ok(confirm) => confirm.await,
            Err(e) => Err(e),
        };
        let result = match confirmed {
            Ok(Confirmation::Ack(_)) | Ok(Confirmation::NotRequested) => ForwardOutcome::Confirmed,
            Ok(Confirmation::Nack(_)) => ForwardOutcome::Refused,
            Err(e) => ForwardOutcome::Failed(format!("the queue's primary did not confirm: {e}")),
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
    fn answered_through_is_the_contiguous_prefix() {
        let t = ForwardTracker::default();
        let (a, b, c, d) = (t.issue(), t.issue(), t.issue(), t.issue());
        assert_eq!(t.status().answered_through, 0);
        t.settle(b, ForwardOutcome::Refused);
        assert_eq!(t.status().answered_through, 0, "the first is still out");
        t.settle(a, ForwardOutcome::Confirmed);
        assert_eq!(t.status().answered_through, 2);
        assert_eq!(t.status().in_flight, 2);
        assert_eq!(
            t.status().failure,
            None,
            "a refusal is an answer, not a failure"
        );
        assert!(!t.not_taken(a, a));
        assert!(t.not_taken(b, b));
        assert!(!t.not_taken(b, b), "forgotten once decided");
        t.settle(d, ForwardOutcome::Confirmed);
        t.settle(c, ForwardOutcome::Failed("gone".into()));
        assert_eq!(t.status().answered_through, 4);
        assert_eq!(t.status().failure, Some((3, "gone".to_owned())));
    }

    #[test]
    fn a_watched_batch_sees_its_refusals_even_after_a_publish_decided_past_them() {
        let t = ForwardTracker::default();
        let publish = t.issue();
        t.watch(publish + 1);
        let (dead, other) = (t.issue(), t.issue());
        t.settle(publish, ForwardOutcome::Confirmed);
        t.settle(dead, ForwardOutcome::Refused);
        t.settle(other, ForwardOutcome::Confirmed);
        assert_eq!(t.fate(publish, other), ForwardFate::Refused);
        assert!(!t.all_taken(dead, other), "the refusal was kept for it");

        let first = t.issue();
        t.watch(first);
        t.settle(first, ForwardOutcome::Confirmed);
        assert!(t.all_taken(first, first));
        t.watch(first + 1);
        assert!(t.all_taken(first + 1, first), "no forward at all: ended");
        assert!(t.state.lock().watched.is_empty());
    }

    #[test]
    fn a_moving_queue_refuses_a_plain_clients_forward_and_fails_a_sessions() {
        let plain = ForwardTracker::default();
        let a = plain.issue();
        plain.settle(a, ForwardOutcome::Moving);
        assert_eq!(plain.status().failure, None);
        assert_eq!(
            plain.fate(a, a),
            ForwardFate::Refused,
            "its publisher gets a nack"
        );

        let session = ForwardTracker::default();
        session.resend_when_moving();
        let b = session.issue();
        session.settle(b, ForwardOutcome::Moving);
        assert_eq!(
            session.fate(b, b),
            ForwardFate::Unknown,
            "no nack: the client resends it after the switch"
        );
        assert!(session.status().failure.is_some());
    }

    #[test]
    fn a_failed_forward_and_every_later_one_decide_as_not_taken() {
        let t = ForwardTracker::default();
        let (a, b, c) = (t.issue(), t.issue(), t.issue());
        t.settle(a, ForwardOutcome::Confirmed);
        t.settle(b, ForwardOutcome::Failed("link closed".into()));
        t.settle(c, ForwardOutcome::Confirmed);
        assert!(!t.not_taken(a, a), "before the failure: confirmed");
        assert!(
            t.not_taken(b, b),
            "the failed one is not known to be stored"
        );
        assert!(
            t.not_taken(c, c),
            "after the first failure nothing is trusted (the connection is abandoning)"
        );
        assert_eq!(t.fate(a, a), ForwardFate::Taken);
        assert_eq!(t.fate(b, b), ForwardFate::Unknown, "not refused: unknown");
        assert_eq!(t.fate(c, c), ForwardFate::Unknown);
    }
}
