//! The primary's side of replication: every batch's ops of the queues this member is primary
//! of go to those queues' backups, and the batch's confirms wait for the in-sync ones.
//!
//! **Order.** [`Replicator::replicate`] runs under the vhost lock, at the end of each batch,
//! beside the journal hand-off: ops reach each backup in the order the queue applied them,
//! whichever connection caused them. Each (backup, vhost) has one forwarding link of its own
//! ([`crate::proxy::forward_link`], separate from client forwards), so frames arrive in that
//! order and the backup confirms them in that order.
//!
//! **The gate.** A batch that changed a queue with in-sync backups gets a stamp from the
//! [`Ledger`]; the connection holds that batch's confirms until [`Replicator::acked`] reaches
//! the stamp. Backups that are catching up get the frames but hold nothing back.
//!
//! **Catch-up.** A backup that is new to a queue, or whose link failed or refused a frame,
//! is sent an image of the queue (taken under the vhost lock, so the stream continues right
//! after it) and then the ops; once the backup confirmed the image, the primary commits
//! an in-sync mark through the cluster. A failed in-sync backup is first committed
//! out of sync  — until that commit, confirms that need it
//! wait — so that no confirm goes out without every backup the map counts on.

use super::REPLICATION_EXCHANGE;
use super::codec::Frame;
use super::ledger::Ledger;
use crate::core::VHost;
use crate::core::message::Message;
use crate::core::ops::QueueOp;
use crate::proxy::forward::{ForwardTracker, Forwarders, Job};
use crate::proxy::link::Links;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::watch;

/// A replicated queue's roles as the cluster map says, on its primary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSet {
    /// The queue's cluster-wide identity.
    pub incarnation: u64,
    /// Node ids of its backups, in ring order.
    pub backups: Vec<String>,
    /// The backups that are in sync.
    pub in_sync: Vec<String>,
}

/// What the replicator needs of the broker: the vhosts, to take images at a batch boundary,
/// and the cluster, to commit in-sync changes.
pub trait ReplicationHost: Send + Sync + std::fmt::Debug + 'static {
    /// Runs `f` on vhost `vhost` while holding its lock: no batch runs meanwhile.
    fn with_vhost(&self, vhost: &str, f: &mut dyn FnMut(&mut VHost));
    /// Commits through the cluster that `backup` is (or is no longer) in sync for `queue` of
    /// `vhost` (incarnation `incarnation`); resolves once this member applied it.
    fn commit_sync(
        &self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
        backup: &str,
        in_sync: bool,
    ) -> BoxFuture<'static, Result<(), String>>;
    /// The newest cluster change applied here: a backup applies it before the frames after
    /// it (so it knows the queue they name).
    fn applied_index(&self) -> u64;
}

/// A frame on its way to one backup, for the watcher of that backup's link.
#[derive(Debug)]
struct Sent {
    /// The tracker's number for it.
    id: u64,
    /// The batch it belongs to.
    stamp: u64,
    /// An image: once confirmed, the backup is in sync for this queue (name, incarnation).
    image: Option<(Arc<str>, u64)>,
}

/// One backup's link for one vhost.
#[derive(Debug, Default)]
struct Link {
    tracker: Arc<ForwardTracker>,
    sent: VecDeque<Sent>,
    /// The link failed or refused a frame: nothing more goes out on this tracker; the
    /// watcher commits the backup out of sync and starts a catch-up on a new one.
    broken: bool,
    /// A watcher task runs for this link.
    watched: bool,
}

#[derive(Default)]
struct State {
    ledger: Ledger,
    /// Roles of the replicated queues this member is primary of, by (vhost, queue).
    roles: HashMap<(String, Arc<str>), ReplicaSet>,
    /// By (backup node id, vhost).
    links: HashMap<(String, String), Link>,
}

/// Replication of this member's primaries to their backups.
pub struct Replicator {
    forwarders: Forwarders,
    state: Mutex<State>,
    acked: watch::Sender<u64>,
    counters: Counters,
}

/// Running totals for `/metrics`.
#[derive(Debug, Default)]
struct Counters {
    frames: AtomicU64,
    bytes: AtomicU64,
    catch_ups_started: AtomicU64,
    catch_ups_completed: AtomicU64,
    links_failed: AtomicU64,
}

/// What the replicator has done and where it stands, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicationStats {
    /// Frames handed to backup links (one per queue per batch per backup, and images).
    pub frames_sent: u64,
    /// Their bytes.
    pub bytes_sent: u64,
    /// Frames sent and not yet acknowledged, over every backup: the replication lag.
    pub frames_unacked: u64,
    /// Batches whose confirms still wait for an in-sync backup.
    pub batches_waiting: u64,
    /// Catch-ups begun (an image sent to a backup new to a queue, or after a failure).
    pub catch_ups_started: u64,
    /// Catch-ups that ended with the backup committed in sync.
    pub catch_ups_completed: u64,
    /// Backup links that failed or refused a frame.
    pub links_failed: u64,
    /// Replicated queues this member is primary of.
    pub queues: u64,
    /// Of their backups (counted per queue), how many are in sync.
    pub in_sync_backups: u64,
    /// And how many are not (catching up).
    pub catching_up_backups: u64,
}

impl std::fmt::Debug for Replicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replicator").finish_non_exhaustive()
    }
}

/// The ledger key of a link: a backup owes per vhost, since each vhost has its own link.
fn owed_key(backup: &str, vhost: &str) -> String {
    format!("{backup}\u{0}{vhost}")
}

impl Replicator {
    /// A replicator whose links are opened over `links`.
    pub fn new(links: Arc<Links>) -> Self {
        Self {
            forwarders: Forwarders::new(links),
            state: Mutex::default(),
            acked: watch::Sender::new(0),
            counters: Counters::default(),
        }
    }

    /// Totals and the current lag.
    pub fn stats(&self) -> ReplicationStats {
        let state = self.state.lock();
        let c = &self.counters;
        let (mut in_sync, mut catching_up) = (0, 0);
        for r in state.roles.values() {
            in_sync += r.in_sync.len() as u64;
            catching_up += (r.backups.len() - r.in_sync.len()) as u64;
        }
        ReplicationStats {
            frames_sent: c.frames.load(Ordering::Relaxed),
            bytes_sent: c.bytes.load(Ordering::Relaxed),
            frames_unacked: state.links.values().map(|l| l.sent.len() as u64).sum(),
            batches_waiting: state.ledger.waiting(),
            catch_ups_started: c.catch_ups_started.load(Ordering::Relaxed),
            catch_ups_completed: c.catch_ups_completed.load(Ordering::Relaxed),
            links_failed: c.links_failed.load(Ordering::Relaxed),
            queues: state.roles.len() as u64,
            in_sync_backups: in_sync,
            catching_up_backups: catching_up,
        }
    }

    /// The stamp up to which every in-sync backup acknowledged: a connection's confirms of
    /// a batch stamped `s` go out once this reaches `s`.
    pub fn acked(&self) -> watch::Receiver<u64> {
        self.acked.subscribe()
    }

    /// Hands a batch's ops to the backups of their queues. Call it under `vhost`'s lock, in
    /// batch order. Returns the stamp the batch's confirms wait for, when an in-sync backup
    /// must acknowledge it.
    pub fn replicate(
        self: &Arc<Self>,
        host: &Arc<dyn ReplicationHost>,
        vhost: &str,
        ops: &[QueueOp],
    ) -> Option<u64> {
        let mut state = self.state.lock();
        if state.roles.is_empty() || ops.is_empty() {
            return None;
        }
        let mut frames: Vec<(ReplicaSet, Frame)> = Vec::new();
        for run in ops.chunk_by(|a, b| a.queue == b.queue) {
            let key = (vhost.to_owned(), run[0].queue.clone());
            let Some(roles) = state.roles.get(&key) else {
                continue;
            };
            frames.push((
                roles.clone(),
                Frame::Ops {
                    incarnation: roles.incarnation,
                    queue: run[0].queue.clone(),
                    ops: run.to_vec(),
                },
            ));
        }
        if frames.is_empty() {
            return None;
        }
        let gating: Vec<String> = frames
            .iter()
            .flat_map(|(r, _)| r.in_sync.iter().map(|b| owed_key(b, vhost)))
            .collect();
        let stamp = state.ledger.issue(gating.iter().map(String::as_str));
        let mut batches: HashMap<String, Vec<Job>> = HashMap::new();
        let after_index = host.applied_index();
        for (roles, frame) in frames {
            // An enqueue carries the message as published, in memory; should one not, the
            // backups miss these ops, refuse the next ones, and are caught up again.
            let message = match encode(&frame) {
                Ok(m) => m,
                Err(e) => {
                    tracing::error!(vhost, error = %e, "replication frame not sent");
                    continue;
                }
            };
            for backup in &roles.backups {
                if let Some(job) = self.frame_job(
                    &mut state,
                    vhost,
                    backup,
                    &message,
                    stamp,
                    None,
                    after_index,
                ) {
                    batches.entry(backup.clone()).or_default().push(job);
                }
            }
        }
        drop(state);
        self.send(host, vhost, batches);
        Some(stamp).filter(|_| !gating.is_empty())
    }

    /// The map changed the roles of `queue` (this member is its primary with these roles;
    /// `None`: not, or no longer). Call it under `vhost`'s lock (`v`): a backup new to the
    /// queue is sent an image of it now, so the stream continues right after the image.
    pub fn set_roles(
        self: &Arc<Self>,
        host: &Arc<dyn ReplicationHost>,
        v: &VHost,
        queue: &str,
        roles: Option<ReplicaSet>,
    ) {
        let vhost = v.name().to_owned();
        let key = (vhost.clone(), Arc::<str>::from(queue));
        let mut state = self.state.lock();
        let before = match roles.clone() {
            Some(r) => state.roles.insert(key.clone(), r),
            None => state.roles.remove(&key),
        };
        let old_backups = before.map(|r| r.backups).unwrap_or_default();
        let mut batches: HashMap<String, Vec<Job>> = HashMap::new();
        if let Some(roles) = &roles {
            for backup in roles.backups.iter().filter(|b| !old_backups.contains(b)) {
                if roles.in_sync.contains(backup) {
                    continue;
                }
                if let Some(job) = self.image_job(
                    &mut state,
                    v,
                    backup,
                    queue,
                    roles.incarnation,
                    host.applied_index(),
                ) {
                    batches.entry(backup.clone()).or_default().push(job);
                }
            }
        }
        self.settle_forgiven(&mut state, &vhost);
        drop(state);
        self.send(host, &vhost, batches);
    }

    /// Backups no longer in sync for any queue of `vhost` owe nothing there any more.
    fn settle_forgiven(&self, state: &mut State, vhost: &str) {
        let links: Vec<String> = state
            .links
            .keys()
            .filter(|(_, v)| v == vhost)
            .map(|(b, _)| b.clone())
            .collect();
        for backup in links {
            let counted = state
                .roles
                .iter()
                .any(|((v, _), r)| v == vhost && r.in_sync.contains(&backup));
            if !counted {
                state.ledger.forgive(&owed_key(&backup, vhost));
            }
        }
        self.acked.send_replace(state.ledger.acked_through());
    }

    /// A job carrying an image of `queue` to `backup` (a catch-up's start).
    fn image_job(
        &self,
        state: &mut State,
        v: &VHost,
        backup: &str,
        queue: &str,
        incarnation: u64,
        after_index: u64,
    ) -> Option<Job> {
        let image = v.queue_image(queue)?;
        let frame = Frame::Image {
            incarnation,
            queue: queue.into(),
            image,
        };
        let message = match encode(&frame) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(backup, queue, error = %e, "cannot catch this backup up: it stays out of sync");
                return None;
            }
        };
        let stamp = state.ledger.issue([]);
        let name: Arc<str> = queue.into();
        self.frame_job(
            state,
            v.name(),
            backup,
            &message,
            stamp,
            Some((name, incarnation)),
            after_index,
        )
    }

    /// A job carrying `frame` (encoded by [`encode`]) to `backup`, registered with its link
    /// (`None` when the link is broken: its catch-up will send an image instead).
    #[allow(clippy::too_many_arguments)]
    fn frame_job(
        &self,
        state: &mut State,
        vhost: &str,
        backup: &str,
        frame: &Arc<Message>,
        stamp: u64,
        image: Option<(Arc<str>, u64)>,
        after_index: u64,
    ) -> Option<Job> {
        let link = state
            .links
            .entry((backup.to_owned(), vhost.to_owned()))
            .or_default();
        if link.broken {
            return None;
        }
        let id = link.tracker.issue();
        self.counters.frames.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes
            .fetch_add(frame.body_len() as u64, Ordering::Relaxed);
        if image.is_some() {
            self.counters
                .catch_ups_started
                .fetch_add(1, Ordering::Relaxed);
        }
        link.sent.push_back(Sent { id, stamp, image });
        Some(Job {
            exchange: REPLICATION_EXCHANGE.into(),
            routing_key: "".into(),
            message: frame.clone(),
            ticket: Some((link.tracker.clone(), id)),
            after_index,
        })
    }

    /// Hands the jobs to the links, and watches each link that has none watching it.
    fn send(
        self: &Arc<Self>,
        host: &Arc<dyn ReplicationHost>,
        vhost: &str,
        batches: HashMap<String, Vec<Job>>,
    ) {
        if batches.is_empty() {
            return;
        }
        let mut state = self.state.lock();
        for backup in batches.keys() {
            if let Some(link) = state.links.get_mut(&(backup.clone(), vhost.to_owned()))
                && !link.watched
            {
                link.watched = true;
                tokio::spawn(
                    self.clone()
                        .watch(host.clone(), backup.clone(), vhost.to_owned()),
                );
            }
        }
        drop(state);
        self.forwarders.send(
            vhost,
            batches
                .into_iter()
                .map(|(backup, jobs)| (Arc::from(backup), jobs))
                .collect(),
        );
    }

    /// Follows one backup's link: acknowledgements advance the ledger, confirmed images
    /// commit the backup in sync, and a failure commits it out of sync and catches it up.
    async fn watch(self: Arc<Self>, host: Arc<dyn ReplicationHost>, backup: String, vhost: String) {
        let key = (backup.clone(), vhost.clone());
        loop {
            let tracker = match self.state.lock().links.get(&key) {
                Some(link) => link.tracker.clone(),
                None => return,
            };
            let changed = tracker.changed();
            let (in_sync, broken) = self.take_answers(&key, &tracker);
            for (queue, incarnation) in in_sync {
                let committed = host.commit_sync(&vhost, &queue, incarnation, &backup, true);
                match committed.await {
                    Ok(()) => {
                        self.counters
                            .catch_ups_completed
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        tracing::warn!(%backup, %queue, error = %e, "backup caught up, but its in-sync mark was not committed");
                    }
                }
            }
            if broken {
                self.recover(&host, &backup, &vhost).await;
                continue;
            }
            changed.await;
        }
    }

    /// Reads what the link's tracker answered: the ledger advances; returns the images the
    /// backup confirmed and whether the link broke.
    fn take_answers(
        &self,
        key: &(String, String),
        tracker: &ForwardTracker,
    ) -> (Vec<(Arc<str>, u64)>, bool) {
        let status = tracker.status();
        let mut state = self.state.lock();
        let State { ledger, links, .. } = &mut *state;
        let Some(link) = links.get_mut(key) else {
            return (Vec::new(), false);
        };
        let mut images = Vec::new();
        let mut last = None;
        while let Some(s) = link
            .sent
            .front()
            .filter(|s| s.id <= status.answered_through)
        {
            last = Some(s.stamp);
            let s = link.sent.pop_front().expect("front exists");
            images.extend(s.image);
        }
        let answered = status.answered_through;
        let refused = answered > 0 && tracker.refused(1, answered);
        if refused || status.failure.is_some() {
            link.broken = true;
            self.counters.links_failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(backup = %key.0, vhost = %key.1, refused, failure = ?status.failure, "replication link to a backup failed: catching it up again");
            return (Vec::new(), true);
        }
        if let Some(last) = last {
            let through = link.sent.front().map_or(last, |next| next.stamp - 1);
            ledger.acked(&owed_key(&key.0, &key.1), through);
            self.acked.send_replace(ledger.acked_through());
        }
        (images, false)
    }

    /// The link to `backup` broke: commit it out of sync wherever it was in sync (confirms
    /// that count on it wait until then), then start over on a new link with images.
    async fn recover(self: &Arc<Self>, host: &Arc<dyn ReplicationHost>, backup: &str, vhost: &str) {
        let counted: Vec<(Arc<str>, u64)> = {
            let state = self.state.lock();
            state
                .roles
                .iter()
                .filter(|((v, _), r)| v == vhost && r.in_sync.iter().any(|b| b == backup))
                .map(|((_, q), r)| (q.clone(), r.incarnation))
                .collect()
        };
        for (queue, incarnation) in counted {
            // Until this commits, the confirms that need this backup stay held: retry.
            while let Err(e) = host
                .commit_sync(vhost, &queue, incarnation, backup, false)
                .await
            {
                tracing::warn!(backup, %queue, error = %e, "cannot commit the backup out of sync yet; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let me = self.clone();
        let host2 = host.clone();
        let backup = backup.to_owned();
        let vhost_name = vhost.to_owned();
        host.with_vhost(vhost, &mut |v: &mut VHost| {
            let mut batches: HashMap<String, Vec<Job>> = HashMap::new();
            let mut state = me.state.lock();
            let key = (backup.clone(), vhost_name.clone());
            state.links.insert(
                key,
                Link {
                    watched: true,
                    ..Link::default()
                },
            );
            let queues: Vec<(Arc<str>, u64)> = state
                .roles
                .iter()
                .filter(|((vn, _), r)| *vn == vhost_name && r.backups.contains(&backup))
                .map(|((_, q), r)| (q.clone(), r.incarnation))
                .collect();
            for (queue, incarnation) in queues {
                if let Some(job) = me.image_job(
                    &mut state,
                    v,
                    &backup,
                    &queue,
                    incarnation,
                    host2.applied_index(),
                ) {
                    batches.entry(backup.clone()).or_default().push(job);
                }
            }
            drop(state);
            // Still under the vhost lock: no batch's ops can overtake the images.
            me.send(&host2, &vhost_name, batches);
        });
    }
}

/// A frame as the message that carries it (encoded once, whatever number of backups it goes
/// to).
fn encode(frame: &Frame) -> Result<Arc<Message>, super::codec::EncodeError> {
    let mut body = Vec::new();
    frame.encode(&mut body)?;
    Ok(Arc::new(Message::authored(
        REPLICATION_EXCHANGE.into(),
        "".into(),
        Default::default(),
        bytes::Bytes::from(body),
    )))
}
