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
//! is sent an image of the queue and then the ops ([`super::catch_up`]): the image is taken
//! under the vhost lock as refcounted handles, then sent in bounded chunks by the link's
//! watcher task, windowed by the backup's acknowledgements, with paged-out bodies read back
//! from the journal outside the lock; the queue's ops produced meanwhile are held back
//! (bounded) and sent right after the last chunk. Once the backup confirmed the last of
//! those frames, the primary commits an in-sync mark through the cluster. A catch-up that
//! takes longer than its limit, or whose held ops outgrow theirs, is abandoned and retried
//! from a new image. A failed in-sync backup is first committed out of sync — until that
//! commit, confirms that need it wait — so that no confirm goes out without every backup
//! the map counts on.

use super::REPLICATION_EXCHANGE;
use super::catch_up::{CatchUp, CatchUpLimits, ChunkWork, Phase};
use super::codec::{Frame, op_len};
use super::ledger::Ledger;
use crate::core::VHost;
use crate::core::message::{DiskBody, Message};
use crate::core::ops::QueueOp;
use crate::core::queue::ImageChunk;
use crate::proxy::forward::{ForwardTracker, Forwarders, Job};
use crate::proxy::link::Links;
use bytes::Bytes;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tokio::sync::{Notify, watch};

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
    /// Reads paged-out bodies back from the journal, in `keys` order; `None` for a body
    /// whose record is gone (its message left the queue since). Blocking I/O: call it off
    /// the async workers and outside the vhost lock.
    fn read_paged(&self, keys: &[DiskBody]) -> Result<Vec<Option<Bytes>>, String>;
}

/// A frame on its way to one backup, for the watcher of that backup's link.
#[derive(Debug)]
struct Sent {
    /// The tracker's number for it.
    id: u64,
    /// The batch it belongs to.
    stamp: u64,
    /// The last frame of a catch-up (queue, attempt): once confirmed, the backup is in sync
    /// for this queue — if that attempt is still the current one.
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
    /// Catch-ups of this backup, by queue.
    catch_ups: HashMap<Arc<str>, CatchUp>,
    /// Wakes the watcher: a catch-up started or was abandoned.
    kick: Arc<Notify>,
}

#[derive(Default)]
struct State {
    ledger: Ledger,
    /// Roles of the replicated queues this member is primary of, by (vhost, queue).
    roles: HashMap<(String, Arc<str>), ReplicaSet>,
    /// By (backup node id, vhost).
    links: HashMap<(String, String), Link>,
    /// The newest catch-up attempt's number.
    attempts: u64,
    /// Backups whose catch-up's last frames are out, counted by the gate from then on, by
    /// (vhost, queue, backup), until their in-sync mark is applied here or given up: so that
    /// no op confirmed between the catch-up and the mark's commit goes out without a backup
    /// the map is about to count on (found by `cluster::map::sim_tests`).
    pending: HashSet<(String, Arc<str>, String)>,
}

/// Replication of this member's primaries to their backups.
pub struct Replicator {
    forwarders: Forwarders,
    state: Mutex<State>,
    acked: watch::Sender<u64>,
    counters: Counters,
    limits: CatchUpLimits,
}

/// Most chunks one pass of a link's watcher builds before it looks at the answers again.
const CHUNKS_PER_PASS: usize = 16;

/// Running totals for `/metrics`.
#[derive(Debug, Default)]
struct Counters {
    frames: AtomicU64,
    bytes: AtomicU64,
    catch_ups_started: AtomicU64,
    catch_ups_completed: AtomicU64,
    catch_ups_abandoned: AtomicU64,
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
    /// Catch-ups given up (not done within the time limit, too many ops held back, a link
    /// failure, a body that could not be read) and retried from a new image.
    pub catch_ups_abandoned: u64,
    /// Catch-ups under way now.
    pub catch_ups_running: u64,
    /// Messages in the images of the catch-ups under way.
    pub catch_up_messages_total: u64,
    /// Of those, sent so far.
    pub catch_up_messages_sent: u64,
    /// Image chunk bytes the catch-ups under way sent so far.
    pub catch_up_bytes_sent: u64,
    /// Encoded ops held back by catch-ups under way until their last chunk is out.
    pub catch_up_held_bytes: u64,
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
    /// A replicator whose links are opened over `links`, catching backups up within
    /// `limits`.
    pub fn new(links: Arc<Links>, limits: CatchUpLimits) -> Self {
        Self {
            forwarders: Forwarders::new(links),
            state: Mutex::default(),
            acked: watch::Sender::new(0),
            counters: Counters::default(),
            limits,
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
        let running = || {
            state
                .links
                .values()
                .flat_map(|l| l.catch_ups.values())
                .filter(|c| !matches!(c.phase, Phase::Abandoned(_)))
        };
        ReplicationStats {
            frames_sent: c.frames.load(Ordering::Relaxed),
            bytes_sent: c.bytes.load(Ordering::Relaxed),
            frames_unacked: state.links.values().map(|l| l.sent.len() as u64).sum(),
            batches_waiting: state.ledger.waiting(),
            catch_ups_started: c.catch_ups_started.load(Ordering::Relaxed),
            catch_ups_completed: c.catch_ups_completed.load(Ordering::Relaxed),
            catch_ups_abandoned: c.catch_ups_abandoned.load(Ordering::Relaxed),
            catch_ups_running: running().count() as u64,
            catch_up_messages_total: running().map(|c| c.messages_total).sum(),
            catch_up_messages_sent: running().map(|c| c.messages_sent).sum(),
            catch_up_bytes_sent: running().map(|c| c.bytes_sent).sum(),
            catch_up_held_bytes: running().map(|c| c.held_bytes() as u64).sum(),
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
            // Each frame within the chunk size (a frame is one message on the link, which
            // the backup takes up to its `max_message_size`).
            let mut rest = run;
            while !rest.is_empty() {
                let n = self
                    .limits
                    .chunk
                    .take_ops(&run[0].queue, rest.iter().map(op_len));
                frames.push((
                    roles.clone(),
                    Frame::Ops {
                        incarnation: roles.incarnation,
                        queue: run[0].queue.clone(),
                        ops: rest[..n].to_vec(),
                    },
                ));
                rest = &rest[n..];
            }
        }
        if frames.is_empty() {
            return None;
        }
        let mut gating: Vec<String> = Vec::new();
        for (r, frame) in &frames {
            let Frame::Ops { queue, .. } = frame else {
                continue;
            };
            for b in &r.backups {
                let pending = state
                    .pending
                    .contains(&(vhost.to_owned(), queue.clone(), b.clone()));
                if r.in_sync.contains(b) || pending {
                    gating.push(owed_key(b, vhost));
                }
            }
        }
        let stamp = state.ledger.issue(gating.iter().map(String::as_str));
        let mut batches: HashMap<String, Vec<Job>> = HashMap::new();
        let after_index = host.applied_index();
        let now = Instant::now();
        for (roles, frame) in frames {
            let Frame::Ops { queue, .. } = &frame else {
                unreachable!("replicate builds ops frames only");
            };
            let queue = queue.clone();
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
                if self.divert(&mut state, vhost, backup, &queue, &message, now) {
                    continue;
                }
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

    /// Whether the ops frame `message` of `queue` must not go to `backup` now: a catch-up of
    /// it is sending its image (the frame is held until the last chunk is out) or was
    /// abandoned (the frame is dropped: the next attempt starts from a new image).
    fn divert(
        &self,
        state: &mut State,
        vhost: &str,
        backup: &str,
        queue: &Arc<str>,
        message: &Arc<Message>,
        now: Instant,
    ) -> bool {
        let Some(link) = state.links.get_mut(&(backup.to_owned(), vhost.to_owned())) else {
            return false;
        };
        let Some(c) = link.catch_ups.get_mut(queue).filter(|c| c.diverts_ops()) else {
            return false;
        };
        let sending = c.phase == Phase::Sending;
        if !c.hold(message, &self.limits, now) && sending {
            self.counters
                .catch_ups_abandoned
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(backup, vhost, %queue, limit_bytes = self.limits.held_bytes, "catch-up abandoned: the queue's ops held back during its image outgrew their limit; retrying from a new image");
            link.kick.notify_one();
        }
        true
    }

    /// The map changed the roles of `queue` (this member is its primary with these roles;
    /// `None`: not, or no longer). Call it under `vhost`'s lock (`v`): a backup new to the
    /// queue starts a catch-up from an image taken now, so the stream continues right after
    /// the image.
    pub fn set_roles(
        self: &Arc<Self>,
        host: &Arc<dyn ReplicationHost>,
        v: &VHost,
        queue: &str,
        roles: Option<ReplicaSet>,
    ) {
        let vhost = v.name().to_owned();
        let name: Arc<str> = Arc::from(queue);
        let key = (vhost.clone(), name.clone());
        let mut state = self.state.lock();
        let before = match roles.clone() {
            Some(r) => state.roles.insert(key.clone(), r),
            None => state.roles.remove(&key),
        };
        let old_backups = before.map(|r| r.backups).unwrap_or_default();
        let backups = roles
            .as_ref()
            .map(|r| r.backups.clone())
            .unwrap_or_default();
        // Catch-ups of backups the queue no longer has (or of a queue no longer primary
        // here) end; so does the counting of those whose mark the map now holds.
        for ((b, vh), link) in state.links.iter_mut() {
            if *vh == vhost && !backups.contains(b) {
                link.catch_ups.remove(&name);
            }
        }
        let in_sync = roles
            .as_ref()
            .map(|r| r.in_sync.clone())
            .unwrap_or_default();
        state.pending.retain(|(vh, q, b)| {
            !(*vh == vhost && *q == name && (!backups.contains(b) || in_sync.contains(b)))
        });
        let mut started = Vec::new();
        if let Some(roles) = &roles {
            let now = Instant::now();
            for backup in roles.backups.iter().filter(|b| !old_backups.contains(b)) {
                if roles.in_sync.contains(backup) {
                    continue;
                }
                if self.start_catch_up(&mut state, v, backup, queue, roles.incarnation, now) {
                    started.push(backup.clone());
                }
            }
        }
        self.settle_forgiven(&mut state, &vhost);
        drop(state);
        for backup in started {
            self.watch_link(host, &backup, &vhost);
        }
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
                .any(|((v, _), r)| v == vhost && r.in_sync.contains(&backup))
                || state
                    .pending
                    .iter()
                    .any(|(v, _, b)| v == vhost && *b == backup);
            if !counted {
                state.ledger.forgive(&owed_key(&backup, vhost));
            }
        }
        self.acked.send_replace(state.ledger.acked_through());
    }

    /// Starts (or starts over) a catch-up of `backup` for `queue` from an image taken now —
    /// refcounted handles, no body copied. Call it under `v`'s lock, so that the image is
    /// the queue at a batch boundary and the ops after it reach [`Self::replicate`] after
    /// this. Returns whether it started (the link's watcher must be running).
    fn start_catch_up(
        &self,
        state: &mut State,
        v: &VHost,
        backup: &str,
        queue: &str,
        incarnation: u64,
        now: Instant,
    ) -> bool {
        let Some(image) = v.queue_image(queue) else {
            return false;
        };
        state.attempts += 1;
        let attempt = state.attempts;
        let link = state
            .links
            .entry((backup.to_owned(), v.name().to_owned()))
            .or_default();
        if link.broken {
            // Its watcher starts every catch-up of this backup again on a new link.
            return false;
        }
        tracing::info!(
            backup,
            vhost = v.name(),
            queue,
            attempt,
            messages = image.entries.len(),
            last_seq = image.last_seq,
            "catch-up started: sending the queue's image in chunks"
        );
        let c = CatchUp::new(incarnation, attempt, image, now, &self.limits);
        link.catch_ups.insert(queue.into(), c);
        link.kick.notify_one();
        self.counters
            .catch_ups_started
            .fetch_add(1, Ordering::Relaxed);
        true
    }

    /// A job carrying `frame` (encoded by [`encode`]) to `backup`, registered with its link
    /// (`None` when the link is broken: its catch-up will send an image instead). `image`
    /// marks the last frame of a catch-up (queue, attempt).
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
        for backup in batches.keys() {
            self.watch_link(host, backup, vhost);
        }
        self.forwarders.send(
            vhost,
            batches
                .into_iter()
                .map(|(backup, jobs)| (Arc::from(backup), jobs))
                .collect(),
        );
    }

    /// Starts the watcher of `backup`'s link for `vhost` unless one runs.
    fn watch_link(self: &Arc<Self>, host: &Arc<dyn ReplicationHost>, backup: &str, vhost: &str) {
        let mut state = self.state.lock();
        if let Some(link) = state.links.get_mut(&(backup.to_owned(), vhost.to_owned()))
            && !link.watched
        {
            link.watched = true;
            tokio::spawn(
                self.clone()
                    .watch(host.clone(), backup.to_owned(), vhost.to_owned()),
            );
        }
    }

    /// Follows one backup's link: acknowledgements advance the ledger and open the
    /// catch-ups' windows, confirmed catch-ups commit the backup in sync, a failure commits
    /// it out of sync and catches it up again, and the catch-ups' chunks are built and sent
    /// here, outside the vhost lock.
    async fn watch(self: Arc<Self>, host: Arc<dyn ReplicationHost>, backup: String, vhost: String) {
        let key = (backup.clone(), vhost.clone());
        loop {
            let (tracker, kick) = match self.state.lock().links.get(&key) {
                Some(link) => (link.tracker.clone(), link.kick.clone()),
                None => return,
            };
            let changed = tracker.changed();
            let kicked = kick.notified();
            let (in_sync, broken) = self.take_answers(&key, &tracker);
            for (queue, incarnation) in in_sync {
                let committed = host.commit_sync(&vhost, &queue, incarnation, &backup, true);
                let outcome = committed.await;
                {
                    let mut state = self.state.lock();
                    state
                        .pending
                        .remove(&(vhost.clone(), queue.clone(), backup.clone()));
                    self.settle_forgiven(&mut state, &vhost);
                }
                match outcome {
                    Ok(()) => {
                        self.counters
                            .catch_ups_completed
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::info!(%backup, %vhost, %queue, "catch-up done: the backup is in sync");
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
            self.pump(&host, &key).await;
            let wake = self.next_wake(&key);
            let far = Instant::now() + std::time::Duration::from_secs(3600);
            let sleep = tokio::time::sleep_until(wake.unwrap_or(far).into());
            tokio::select! {
                () = changed => {}
                () = kicked => {}
                () = sleep => {}
            }
        }
    }

    /// When the watcher of link `key` must look at its catch-ups again at the latest.
    fn next_wake(&self, key: &(String, String)) -> Option<Instant> {
        let state = self.state.lock();
        let link = state.links.get(key)?;
        link.catch_ups.values().map(CatchUp::next_wake).min()
    }

    /// Moves the catch-ups of link `key` on: those past their deadline are abandoned, those
    /// abandoned a while ago start over from a new image, and chunks are sent while their
    /// windows have room.
    async fn pump(self: &Arc<Self>, host: &Arc<dyn ReplicationHost>, key: &(String, String)) {
        let (backup, vhost) = (key.0.as_str(), key.1.as_str());
        let now = Instant::now();
        let due: Vec<(Arc<str>, u64, u64)> = {
            let mut state = self.state.lock();
            let Some(link) = state.links.get_mut(key).filter(|l| !l.broken) else {
                return;
            };
            let mut due = Vec::new();
            for (queue, c) in link.catch_ups.iter_mut() {
                if c.expired(now) {
                    c.abandon("not done in time", now, &self.limits);
                    self.counters
                        .catch_ups_abandoned
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(backup, vhost, %queue, attempt = c.attempt, timeout_ms = self.limits.timeout.as_millis() as u64, messages_sent = c.messages_sent, messages = c.messages_total, "catch-up abandoned: not done within replication_catch_up_timeout_ms; retrying from a new image");
                }
                if c.due_for_retry(now) {
                    // Looked at again after another delay, should this retry not happen
                    // (the vhost is gone).
                    c.retry_at = Some(now + self.limits.retry_delay);
                    due.push((queue.clone(), c.incarnation, c.attempt));
                }
            }
            due
        };
        if !due.is_empty() {
            let me = self.clone();
            host.with_vhost(vhost, &mut |v: &mut VHost| {
                let mut state = me.state.lock();
                let now = Instant::now();
                for (queue, incarnation, attempt) in &due {
                    let wanted = state
                        .roles
                        .get(&(vhost.to_owned(), queue.clone()))
                        .is_some_and(|r| {
                            r.incarnation == *incarnation
                                && r.backups.iter().any(|b| b == backup)
                                && !r.in_sync.iter().any(|b| b == backup)
                        });
                    let Some(link) = state.links.get_mut(key) else {
                        return;
                    };
                    let still_abandoned = link.catch_ups.get(queue).is_some_and(|c| {
                        c.attempt == *attempt && matches!(c.phase, Phase::Abandoned(_))
                    });
                    if !still_abandoned {
                        continue;
                    }
                    link.catch_ups.remove(queue);
                    if wanted {
                        me.start_catch_up(&mut state, v, backup, queue, *incarnation, now);
                    }
                }
            });
        }
        for _ in 0..CHUNKS_PER_PASS {
            let work = {
                let mut state = self.state.lock();
                let Some(link) = state.links.get_mut(key).filter(|l| !l.broken) else {
                    return;
                };
                link.catch_ups.iter_mut().find_map(|(queue, c)| {
                    let w = c.next_chunk(queue, &self.limits)?;
                    Some((queue.clone(), c.incarnation, w))
                })
            };
            let Some((queue, incarnation, work)) = work else {
                return;
            };
            self.send_chunk(host, key, queue, incarnation, work).await;
        }
        // More may be due: look again after the answers.
        if let Some(link) = self.state.lock().links.get(key) {
            link.kick.notify_one();
        }
    }

    /// Builds one chunk of a catch-up — paged-out bodies read back from the journal, the
    /// frame encoded, all outside every lock — and sends it under the vhost lock (so that it
    /// is ordered with the batches' frames on the link). After the last chunk, the ops held
    /// back go out behind it, and the last frame carries the catch-up's mark.
    async fn send_chunk(
        self: &Arc<Self>,
        host: &Arc<dyn ReplicationHost>,
        key: &(String, String),
        queue: Arc<str>,
        incarnation: u64,
        work: ChunkWork,
    ) {
        let (backup, vhost) = (key.0.as_str(), key.1.as_str());
        let ChunkWork {
            attempt,
            mut entries,
            first,
            last,
            last_seq,
            next_id,
        } = work;
        let built = async {
            let mut stand_ins = 0;
            let paged: Vec<(usize, DiskBody)> = entries
                .iter()
                .enumerate()
                .filter_map(|(i, e)| e.message.body.on_disk().map(|k| (i, k)))
                .collect();
            if !paged.is_empty() {
                let keys: Vec<DiskBody> = paged.iter().map(|(_, k)| *k).collect();
                let reader = host.clone();
                let bodies = tokio::task::spawn_blocking(move || reader.read_paged(&keys))
                    .await
                    .map_err(|e| e.to_string())??;
                for ((i, _), body) in paged.into_iter().zip(bodies) {
                    let m = &entries[i].message;
                    // Gone: the message left the queue after the image, so an op held
                    // back behind the last chunk removes it before the backup counts as
                    // in sync; the backup never serves this stand-in.
                    let resolved = match body {
                        Some(body) => m.with_body(body),
                        None => {
                            stand_ins += 1;
                            stand_in(m)
                        }
                    };
                    entries[i].message = Arc::new(resolved);
                }
            }
            let messages = entries.len();
            let frame = Frame::Image {
                incarnation,
                queue: queue.clone(),
                chunk: ImageChunk {
                    first,
                    last,
                    last_seq,
                    next_id,
                    entries,
                },
            };
            encode(&frame)
                .map(|m| (m, (messages, stand_ins)))
                .map_err(|e| e.to_string())
        };
        let (frame, messages) = match built.await {
            Ok(built) => built,
            Err(e) => {
                let mut state = self.state.lock();
                if let Some(c) = state
                    .links
                    .get_mut(key)
                    .and_then(|l| l.catch_ups.get_mut(&queue))
                    .filter(|c| c.attempt == attempt)
                {
                    c.chunk_failed(Instant::now(), &self.limits);
                    self.counters
                        .catch_ups_abandoned
                        .fetch_add(1, Ordering::Relaxed);
                }
                tracing::error!(backup, vhost, %queue, error = %e, "catch-up abandoned: a chunk of the image could not be built; retrying");
                return;
            }
        };
        let bytes = frame.body_len();
        let me = self.clone();
        let host2 = host.clone();
        host.with_vhost(vhost, &mut |_v: &mut VHost| {
            let mut state = me.state.lock();
            let current = |state: &mut State| {
                state
                    .links
                    .get_mut(key)
                    .filter(|l| !l.broken)
                    .and_then(|l| l.catch_ups.get_mut(&queue))
                    .filter(|c| c.attempt == attempt && c.phase == Phase::Sending)
                    .map(|c| c.held_bytes() == 0)
            };
            // Abandoned or replaced meanwhile: this chunk is not wanted any more.
            let Some(nothing_held) = current(&mut state) else {
                return;
            };
            let after_index = host2.applied_index();
            let mark = |last_frame: bool| (last && last_frame).then(|| (queue.clone(), attempt));
            let stamp = state.ledger.issue([]);
            let Some(job) = me.frame_job(
                &mut state,
                vhost,
                backup,
                &frame,
                stamp,
                mark(nothing_held),
                after_index,
            ) else {
                return;
            };
            let id = job.ticket.as_ref().map_or(0, |(_, id)| *id);
            let mut jobs = vec![job];
            let held = match state
                .links
                .get_mut(key)
                .and_then(|l| l.catch_ups.get_mut(&queue))
            {
                Some(c) => c.chunk_sent(id, messages, bytes, last),
                None => Vec::new(),
            };
            if last {
                state
                    .pending
                    .insert((vhost.to_owned(), queue.clone(), backup.to_owned()));
            }
            let n = held.len();
            for (i, ops) in held.into_iter().enumerate() {
                let stamp = state.ledger.issue([]);
                if let Some(job) = me.frame_job(
                    &mut state,
                    vhost,
                    backup,
                    &ops,
                    stamp,
                    mark(i + 1 == n),
                    after_index,
                ) {
                    jobs.push(job);
                }
            }
            drop(state);
            me.forwarders.send(vhost, vec![(Arc::from(backup), jobs)]);
        });
    }

    /// Reads what the link's tracker answered: the ledger advances and the catch-ups'
    /// windows open; returns the catch-ups the backup confirmed (queue, incarnation) and
    /// whether the link broke.
    fn take_answers(
        &self,
        key: &(String, String),
        tracker: &ForwardTracker,
    ) -> (Vec<(Arc<str>, u64)>, bool) {
        let status = tracker.status();
        let mut state = self.state.lock();
        let State {
            ledger,
            links,
            pending,
            roles,
            ..
        } = &mut *state;
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
            // A backup counted only until its mark commits is no longer awaited; one the map
            // counts stays awaited until `recover` commits it out of sync.
            pending.retain(|(v, _, b)| !(*v == key.1 && *b == key.0));
            let counted = roles
                .iter()
                .any(|((v, _), r)| *v == key.1 && r.in_sync.contains(&key.0));
            if !counted {
                ledger.forgive(&owed_key(&key.0, &key.1));
                self.acked.send_replace(ledger.acked_through());
            }
            self.counters.links_failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(backup = %key.0, vhost = %key.1, refused, failure = ?status.failure, "replication link to a backup failed: catching it up again");
            return (Vec::new(), true);
        }
        for c in link.catch_ups.values_mut() {
            c.answered(answered);
        }
        // A catch-up's last frame confirmed: done, if that attempt is still the current one
        // (a later attempt's first chunk resets the replica again).
        let mut in_sync = Vec::new();
        for (queue, attempt) in images {
            let done = link
                .catch_ups
                .get(&queue)
                .is_some_and(|c| c.attempt == attempt && c.phase == Phase::Confirming);
            if done && let Some(c) = link.catch_ups.remove(&queue) {
                tracing::info!(backup = %key.0, vhost = %key.1, %queue, attempt, messages = c.messages_total, bytes = c.bytes_sent, stand_ins = c.stand_ins, elapsed_ms = c.started.elapsed().as_millis() as u64, "catch-up confirmed by the backup");
                in_sync.push((queue, c.incarnation));
            }
        }
        if let Some(last) = last {
            let through = link.sent.front().map_or(last, |next| next.stamp - 1);
            ledger.acked(&owed_key(&key.0, &key.1), through);
            self.acked.send_replace(ledger.acked_through());
        }
        (in_sync, false)
    }

    /// The link to `backup` broke: commit it out of sync wherever it was in sync (confirms
    /// that count on it wait until then), then start over on a new link, every queue from a
    /// new image.
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
        let backup = backup.to_owned();
        let vhost_name = vhost.to_owned();
        host.with_vhost(vhost, &mut |v: &mut VHost| {
            let mut state = me.state.lock();
            let key = (backup.clone(), vhost_name.clone());
            let old = state.links.insert(
                key,
                Link {
                    watched: true,
                    ..Link::default()
                },
            );
            let dropped = old.map_or(0, |l| {
                l.catch_ups
                    .values()
                    .filter(|c| !matches!(c.phase, Phase::Abandoned(_)))
                    .count()
            });
            me.counters
                .catch_ups_abandoned
                .fetch_add(dropped as u64, Ordering::Relaxed);
            let queues: Vec<(Arc<str>, u64)> = state
                .roles
                .iter()
                .filter(|((vn, _), r)| *vn == vhost_name && r.backups.contains(&backup))
                .map(|((_, q), r)| (q.clone(), r.incarnation))
                .collect();
            let now = Instant::now();
            for (queue, incarnation) in queues {
                me.start_catch_up(&mut state, v, &backup, &queue, incarnation, now);
            }
        });
    }
}

/// What a catch-up sends for an image entry whose paged-out body is gone from the journal
/// (its message left the queue after the image was taken): an empty, transient message of
/// the same priority, which the op that removed the original removes from the backup too.
fn stand_in(m: &Message) -> Message {
    Message::authored(
        "".into(),
        "".into(),
        crate::amqp::Properties::default().with_priority(m.priority),
        Bytes::new(),
    )
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
